"""Facts about transformer.py: shapes, causality, padding invariance, rotary relativity, block-local attention."""
import pytest
import torch
import torch.nn.functional as F

from transformer import (SSM_PARAMS, Transformer, TransformerConfig, attention, block_local_attention, key_mask,
                         rotary_angles, rotate, sinusoidal_embedding)

ALWAYS_LOCAL, NEVER_LOCAL = 1, 10**9  # values of local_min_len that force block-local / full attention


def small(**overrides):
    """A tiny config (D 16, 2 heads of 8, 2 layers, no dropout) so every test runs in well under a second."""
    return TransformerConfig(**{**dict(d_model=16, n_layers=2, n_heads=2, d_ff=32, dropout=0.0), **overrides})


def test_tokens_and_floats_map_to_B_L_D_features():
    torch.manual_seed(0)
    tokens = Transformer(small(vocab_size=10))(torch.randint(0, 10, (2, 7)))
    floats = Transformer(small(d_input=3))(torch.randn(2, 7, 3))
    assert tokens.shape == (2, 7, 16) and floats.shape == (2, 7, 16), "backbone must return (B, L, D)"
    assert SSM_PARAMS == set(), "the Transformer has no SSM parameter group"


@pytest.mark.parametrize("local_min_len", [NEVER_LOCAL, ALWAYS_LOCAL])
def test_causal_model_does_not_see_the_future(local_min_len):
    torch.manual_seed(0)
    model = Transformer(small(d_input=3, causal=True, block_size=4, local_min_len=local_min_len)).double().eval()
    x = torch.randn(2, 15, 3, dtype=torch.float64)                 # (B, L, d_input), L not a multiple of 4
    x_new = x.clone()
    x_new[:, 9:] = torch.randn(2, 6, 3, dtype=torch.float64)       # change the inputs after t0 = 8
    y, y_new = model(x), model(x_new)
    torch.testing.assert_close(y[:, :9], y_new[:, :9], msg="outputs at t <= t0 changed when inputs after t0 did")
    assert not torch.allclose(y[:, 9:], y_new[:, 9:]), "outputs after t0 ignore their own inputs"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("local_min_len", [NEVER_LOCAL, ALWAYS_LOCAL])
def test_padding_does_not_change_real_outputs(causal, local_min_len):
    torch.manual_seed(0)
    model = Transformer(small(vocab_size=10, causal=causal, block_size=4, local_min_len=local_min_len)).eval()
    lengths = torch.tensor([16, 5, 11])
    x = torch.randint(1, 10, (3, 16))                              # (B, L); pads hold real-looking tokens on purpose
    batch = model(x, lengths)                                      # (B, L, D)
    for b, n in enumerate(lengths.tolist()):
        alone = model(x[b : b + 1, :n])                            # (1, n, D)
        torch.testing.assert_close(batch[b : b + 1, :n], alone, atol=1e-5, rtol=1e-5,
                                   msg=f"padding changed the features of sequence {b} (length {n})")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("local_min_len", [NEVER_LOCAL, ALWAYS_LOCAL])
def test_all_padding_row_gives_finite_outputs_and_gradients(causal, local_min_len):
    torch.manual_seed(0)
    model = Transformer(small(d_input=2, causal=causal, block_size=4, local_min_len=local_min_len))
    x = torch.randn(2, 10, 2, requires_grad=True)                  # (B, L, d_input)
    y = model(x, torch.tensor([0, 7]))                             # row 0 is all padding: every key masked
    y.sum().backward()
    assert torch.isfinite(y).all(), "an all-padding row produced NaN/inf features"
    assert torch.isfinite(x.grad).all(), "an all-padding row produced NaN/inf input gradients"
    for name, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), f"NaN/inf gradient in {name}"


def test_no_query_row_is_left_without_keys():
    # CPU SDPA happens to return 0 for a row with every key masked, GPU kernels need not (NaN): so never make one.
    lengths = torch.tensor([0, 3, 14])
    full = key_mask(torch.arange(14), lengths, 14)                 # (B, L)
    windows = key_mask((torch.arange(4)[:, None] - 1) * 4 + torch.arange(12), lengths, 14)  # (B, nb, 3W), W = 4
    assert full.any(-1).all() and windows.any(-1).all(), "some query row would see no key at all"
    assert full[1].tolist() == [True] * 3 + [False] * 11, "real queries must see exactly the real keys"


def test_rotary_scores_depend_only_on_relative_offset():
    torch.manual_seed(0)
    hs = 8
    q, k = torch.randn(2, hs, dtype=torch.float64)                 # one head's query and key, (hs,) each
    angles = rotary_angles(200, hs)                                # (200, hs/2)

    def score(m, n):  # q at position m, k at position n, both rotated
        return (rotate(q[None], angles[m : m + 1]) * rotate(k[None], angles[n : n + 1])).sum()

    for m, n, s in [(0, 5, 1), (3, 10, 70), (40, 2, 150)]:
        torch.testing.assert_close(score(m, n), score(m + s, n + s), msg=f"score at ({m}, {n}) != at (+{s}, +{s})")
    assert not torch.isclose(score(0, 1), score(0, 5)), "scores should depend on the offset n - m"
    torch.testing.assert_close(rotate(q[None], angles[7:8]).norm(), q.norm(), msg="rotary must be a rotation")


def block_band_mask(L, W, lengths, causal):
    """Reference (B, 1, L, L) mask: query m sees key n iff |m//W − n//W| ≤ 1, n is real, and (causal) n ≤ m."""
    i = torch.arange(L)
    allowed = (i[:, None] // W - i[None, :] // W).abs() <= 1       # (L, L)
    if causal:
        allowed &= i[None, :] <= i[:, None]
    return (allowed & (i < lengths[:, None, None]))[:, None]      # (B, 1, L, L)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[14, 14], [14, 3]])
def test_block_local_equals_full_attention_with_block_band_mask(causal, lengths):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 14, 4, dtype=torch.float64)    # (B, nh, L, hs) each; L = 14 is 3.5 blocks of 4
    lengths = torch.tensor(lengths)
    local = block_local_attention(q, k, v, 4, lengths, causal)     # (B, nh, L, hs)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=block_band_mask(14, 4, lengths, causal))
    full = attention(q, k, v, lengths, causal)
    for b, n in enumerate(lengths.tolist()):                       # pad queries may differ; real ones may not
        torch.testing.assert_close(local[b, :, :n], ref[b, :, :n], msg="block-local != band-masked full attention")
    assert not torch.allclose(local[0], full[0]), "the band should hide far blocks (else this test proves nothing)"


def test_sinusoidal_option_encodes_absolute_position():
    torch.manual_seed(0)
    pe = sinusoidal_embedding(50, 16)                              # (L, D)
    m = torch.arange(50, dtype=torch.float64)
    torch.testing.assert_close(pe[:, 0], m.sin(), msg="PE[m, 0] must be sin(m)")
    torch.testing.assert_close(pe[:, 5], (m / 10000 ** (4 / 16)).cos(), msg="PE[m, 2i+1] = cos(m / 10000^(2i/D))")
    model = Transformer(small(vocab_size=10, rotary=False)).eval()
    y = model(torch.full((2, 9), 4))                               # the same token everywhere
    assert y.shape == (2, 9, 16)
    assert not torch.allclose(y[:, 0], y[:, 5]), "identical tokens at different positions must differ"
