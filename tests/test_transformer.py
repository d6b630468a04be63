"""Facts about transformer.py: shapes, causality, padding invariance, the four position codes, block-local attention,
and that the default (rotary) computes today what it computed before --pos existed."""
import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import records, run
from lra.listops import generate_listops
from lab.run import machine
from transformer import (POSITIONS, SSM_PARAMS, Transformer, TransformerConfig, attention, block_local_attention,
                         key_mask, rotary_angles, rotate, sinusoidal_embedding)

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


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("local_min_len", [NEVER_LOCAL, ALWAYS_LOCAL])
def test_causal_model_does_not_see_the_future(local_min_len, training):
    # training: dropout on (embeddings, attention weights, residuals), each run from the same seed: the same masks
    torch.manual_seed(0)
    model = Transformer(small(d_input=3, causal=True, block_size=4, local_min_len=local_min_len, dropout=0.1)).double()
    model.train(training)
    x = torch.randn(2, 15, 3, dtype=torch.float64)                 # (B, L, d_input), L not a multiple of 4
    x_new = x.clone()
    x_new[:, 9:] = torch.randn(2, 6, 3, dtype=torch.float64)       # change the inputs after t0 = 8
    torch.manual_seed(1)
    y = model(x)
    torch.manual_seed(1)
    y_new = model(x_new)
    torch.testing.assert_close(y[:, :9], y_new[:, :9], msg="outputs at t <= t0 changed when inputs after t0 did")
    assert not torch.allclose(y[:, 9:], y_new[:, 9:]), "outputs after t0 ignore their own inputs"


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("local_min_len", [NEVER_LOCAL, ALWAYS_LOCAL])
def test_padding_does_not_change_real_outputs(causal, local_min_len, pos):
    torch.manual_seed(0)
    model = Transformer(small(vocab_size=10, causal=causal, block_size=4, local_min_len=local_min_len, pos=pos,
                              max_len=16)).eval()
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
@pytest.mark.parametrize("padding", ["none", "full", "padded"])   # lengths None, all L, or the second row short
@pytest.mark.parametrize("L", [3, 4, 6, 8, 14, 16, 20])          # W = 4: 1, 2 and 3+ blocks, whole or not
def test_block_local_equals_full_attention_with_block_band_mask(causal, padding, L):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, L, 4, dtype=torch.float64)     # (B, nh, L, hs) each
    lengths = {"none": None, "full": torch.tensor([L, L]), "padded": torch.tensor([L, min(3, L - 1)])}[padding]
    local = block_local_attention(q, k, v, 4, lengths, causal)     # (B, nh, L, hs)
    real = torch.tensor([L, L]) if lengths is None else lengths
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=block_band_mask(L, 4, real, causal))
    full = attention(q, k, v, lengths, causal)
    assert local.shape == q.shape
    for b, n in enumerate(real.tolist()):                          # pad queries may differ; real ones may not
        torch.testing.assert_close(local[b, :, :n], ref[b, :, :n], msg="block-local != band-masked full attention")
    if L > 2 * 4:                                                  # 3+ blocks: some key lies outside every band
        assert not torch.allclose(local[0], full[0]), "the band should hide far blocks (else this test proves nothing)"


@pytest.mark.parametrize("causal,padded", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("local_min_len", [NEVER_LOCAL, ALWAYS_LOCAL])
def test_attention_gets_no_mask_without_padding_or_when_causal(causal, padded, local_min_len, monkeypatch):
    # attn_mask=None lets a GPU run the fused (flash / memory-efficient) kernels. Causal needs no padding mask.
    masks, sdpa = [], F.scaled_dot_product_attention
    def spy(q, k, v, attn_mask=None, *args, **kwargs):
        masks.append(attn_mask)
        return sdpa(q, k, v, attn_mask, *args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    model = Transformer(small(vocab_size=10, causal=causal, block_size=4, local_min_len=local_min_len))
    model(torch.randint(1, 10, (2, 14)), torch.tensor([14, 5]) if padded else None)   # L = 14: 3.5 blocks of 4
    assert masks and all(m is None for m in masks), f"{sum(m is not None for m in masks)} of {len(masks)} calls masked"


@pytest.mark.parametrize("local_min_len", [NEVER_LOCAL, ALWAYS_LOCAL])
@pytest.mark.parametrize("padded", [False, True])
def test_forward_traces_as_one_graph_so_it_never_waits_for_the_device(local_min_len, padded):
    # .item(), bool(tensor), .tolist() and branches on tensor values break a fullgraph trace; those are what make
    # the host wait for the device. The "eager" backend only traces (no compiler), so this stays fast.
    torch._dynamo.reset()
    model = Transformer(small(vocab_size=10, block_size=4, local_min_len=local_min_len))
    lengths = torch.tensor([14, 5]) if padded else None
    torch.compile(model, backend="eager", fullgraph=True)(torch.randint(1, 10, (2, 14)), lengths)


@pytest.mark.parametrize("bad", [torch.tensor([[9], [5]]), torch.tensor([9]), torch.tensor(9)])
def test_lengths_not_of_shape_B_raise_value_error(bad):
    model = Transformer(small(vocab_size=10))
    with pytest.raises(ValueError, match=r"lengths has shape .*expected \(B,\) = \(2,\)"):
        model(torch.randint(1, 10, (2, 9)), bad)


@pytest.mark.parametrize("fields,message", [
    (dict(d_model=0), "d_model=0 must be >= 1"),
    (dict(n_layers=0), "n_layers=0 must be >= 1"),
    (dict(n_heads=0), "n_heads=0 must be >= 1"),
    (dict(d_model=16, n_heads=3), "d_model=16 must be divisible by n_heads=3"),
    (dict(d_model=12, n_heads=4), r"head size d_model/n_heads=3 must be even \(rotary rotates pairs of channels\)"),
    (dict(d_ff=0), "d_ff=0 must be >= 1"),
    (dict(dropout=1.0), r"dropout=1.0 must be in \[0, 1\)"),
    (dict(block_size=0), "block_size=0 must be >= 1"),
    (dict(vocab_size=0), "vocab_size=0 must be None or >= 1"),
    (dict(d_input=0), "d_input=0 must be >= 1"),
    (dict(pos="alibi"), "pos='alibi' must be one of rotary, sinusoidal, learned, none"),
    (dict(pos="learned", max_len=0), "max_len=0 must be >= 1"),
    (dict(pos="sinusoidal", d_model=5, n_heads=1),
     r"d_model=5 must be even \(sinusoidal codes come in sin/cos pairs\)"),
    (dict(rotary=True, pos="learned"), "rotary=True contradicts pos='learned'"),
])
def test_config_refuses_bad_fields_with_a_one_line_value_error(fields, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        TransformerConfig(**fields)


def test_compiled_training_step_equals_eager():
    # The real inductor backend on CPU, one AdamW step on a fixed random readout of the features.
    def training_step(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = (model(x) * target).sum()                           # not y², which the final norm makes ~flat
        loss.backward()
        opt.step()
        return loss.detach()

    torch.manual_seed(0)
    eager = Transformer(small(d_input=2, n_layers=1))
    compiled = copy.deepcopy(eager)
    x, target = torch.randn(2, 32, 2), torch.randn(2, 32, 16)      # (B, L, d_input), (B, L, D)
    torch._dynamo.reset()
    loss = training_step(torch.compile(compiled))
    torch.testing.assert_close(loss, training_step(eager), rtol=1e-4, atol=1e-4, msg="compiled loss != eager loss")
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{name} after one compiled AdamW step")


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


# ---- the position codes (--pos) ------------------------------------------------------------------------------------

def first_layer_scores(model, x):
    """q_m·k_n / √hs of the first layer, before any mask: (B, nh, L, L)."""
    h, angles = model.embed(x)                                     # (B, L, D)
    q, k, _ = model.layers[0].project(model.layers[0].norm1(h), angles)  # (B, nh, L, hs) each
    return q @ k.transpose(-1, -2) / q.size(-1) ** 0.5             # (B, nh, L, L)


def test_rotary_model_scores_of_one_token_everywhere_depend_only_on_the_offset():
    # the same token at every position: the inputs to q and k are equal, so only the rotation can tell m from n
    torch.manual_seed(0)
    model = Transformer(small(vocab_size=10, pos="rotary")).double().eval()
    s = first_layer_scores(model, torch.full((1, 24), 3))[0]       # (nh, L, L)
    for offset in (-9, -1, 0, 2, 15):                              # every diagonal m − n = offset is constant
        d = s.diagonal(-offset, -2, -1)                            # (nh, L − |offset|)
        torch.testing.assert_close(d, d[:, :1].expand_as(d), msg=f"rotary scores vary along offset {offset}")
    assert not torch.allclose(s.diagonal(0, -2, -1)[:, 0], s.diagonal(-1, -2, -1)[:, 0]), \
        "rotary scores must depend on the offset"


@pytest.mark.parametrize("pos", POSITIONS)
def test_only_pos_none_is_permutation_equivariant(pos):
    # without positions, attention and the MLP treat the sequence as a set: permuting the tokens permutes the features;
    # any position code breaks that (the features before pooling, so mean pooling cannot hide it)
    torch.manual_seed(0)
    model = Transformer(small(vocab_size=10, pos=pos, max_len=12)).double().eval()
    x = torch.randint(1, 10, (2, 12))                              # (B, L)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    y, y_perm = model(x), model(x[:, perm])                        # (B, L, D) each
    if pos == "none":
        torch.testing.assert_close(y_perm, y[:, perm], rtol=1e-12, atol=1e-12,
                                   msg="pos=none must be permutation-equivariant")
    else:
        gap = (y_perm - y[:, perm]).abs().max().item()
        assert gap > 1e-3, f"pos={pos}: permuting the tokens only permuted the features (gap {gap:.1e})"


def test_learned_positions_are_a_max_len_by_D_table_added_at_the_input():
    torch.manual_seed(0)
    model = Transformer(small(vocab_size=10, pos="learned", max_len=12)).double().eval()
    base = sum(p.numel() for p in Transformer(small(vocab_size=10, pos="none")).parameters())
    assert sum(p.numel() for p in model.parameters()) - base == 12 * 16, "learned adds max_len × D parameters"
    x = torch.randint(1, 10, (2, 7))
    h, angles = model.embed(x)
    torch.testing.assert_close(h, model.encoder(x) + model.pos_embedding.weight[:7], msg="h_m = E[x_m] + P[m]")
    assert angles is None
    with pytest.raises(ValueError, match=r"^input length 13 > max_len=12"):
        model(torch.randint(1, 10, (1, 13)))


def test_old_configs_with_rotary_load_as_pos():
    # a config.json the control study wrote (before pos existed) says rotary=True; rotary=False was sinusoidal
    old = json.loads(next((Path(__file__).parents[1] / "results" / "control").glob(
        "text-transformer-tfs-*/config.json")).read_text())["config"]
    assert old["rotary"] is True and "pos" not in old
    assert TransformerConfig(**old).pos == "rotary"
    assert TransformerConfig(**{**old, "rotary": False}).pos == "sinusoidal"
    assert "rotary" not in dataclasses.asdict(TransformerConfig(rotary=False)), "new configs say pos only"
    torch.manual_seed(0)
    before = Transformer(TransformerConfig(**{**old, "rotary": False, "d_model": 16, "d_ff": 32}))
    after = Transformer(TransformerConfig(**{**dataclasses.asdict(before.cfg)}))
    after.load_state_dict(before.state_dict())                     # the same keys: an old checkpoint loads strictly
    x = torch.randint(1, 200, (2, 9))
    torch.testing.assert_close(after.eval()(x), before.eval()(x), rtol=0, atol=0)


def test_attention_probs_are_the_weights_attend_uses():
    torch.manual_seed(0)
    for causal in (False, True):
        model = Transformer(small(vocab_size=10, causal=causal)).double().eval()
        layer, x, lengths = model.layers[0], torch.randint(1, 10, (3, 10)), torch.tensor([10, 6, 3])
        h, angles = model.embed(x)                                 # (B, L, D)
        a = layer.attention_probs(h, lengths, angles)              # (B, nh, L, L)
        _, _, v = layer.project(layer.norm1(h), angles)            # (B, nh, L, hs)
        B, L, D = h.shape
        by_weights = layer.out((a @ v).transpose(1, 2).reshape(B, L, D))
        real = torch.arange(L) < lengths[:, None]                  # (B, L): pad queries are never read
        torch.testing.assert_close(by_weights[real], layer.attend(layer.norm1(h), lengths, angles)[real])
        torch.testing.assert_close(a.sum(-1), torch.ones(B, 2, L, dtype=a.dtype))
        assert (a[1, :, :6, 6:] == 0).all(), "real queries must give pads no weight"
        if causal:
            assert (a.triu(1) == 0).all(), "a causal query must give later keys no weight"


# Recorded from the code at main 109d4ef (before pos existed: TransformerConfig(rotary=True / False)), on an AMD EPYC
# with torch 2.13.0+cpu (one thread), by the same calls as the two tests below.
BEFORE_POS = {"forward": {"rotary": 10.146366618398732, "sinusoidal": 10.480252075896097},
              "spt_run": [("spt", 3.0642644895003146, 3.0333073933919272, 0.023809523809523808),
                          ("spt", 2.949450829785741, 2.9434305826822915, 0.047619047619047616),
                          ("finetune", 2.2711615562438965, 2.338364362716675, 0.0),
                          ("finetune", 2.1691906452178955, 2.376742124557495, 0.125)],
              "machine": ("AMD EPYC", "2.13.0+cpu")}


@pytest.mark.parametrize("pos", ["rotary", "sinusoidal"])
def test_default_and_sinusoidal_compute_what_the_code_before_pos_did(pos):
    # float64: another CPU's kernels may round differently (about 1e-16 relative); a changed formula moves this by
    # far more than the 1e-12 allowed
    torch.manual_seed(0)
    cfg = dict(d_model=16, n_layers=2, n_heads=2, d_ff=32, dropout=0.0, vocab_size=12)
    model = Transformer(TransformerConfig(**cfg, **({} if pos == "rotary" else {"pos": pos}))).double().eval()
    x = torch.randint(1, 12, (3, 20), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([20, 13, 7])
    x[1, 13:], x[2, 7:] = 0, 0
    y = model(x, lengths)                                          # (B, L, D)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    value = (y * w).sum().item()
    assert value == pytest.approx(BEFORE_POS["forward"][pos], rel=1e-12, abs=0), \
        f"pos={pos}: {value!r} != {BEFORE_POS['forward'][pos]!r} computed before pos existed"


def test_default_spt_run_logs_what_the_code_before_pos_logged(tmp_path):
    # a whole train.py run with SPT and fine-tuning (float32); to the last digit on the machine of the record, within
    # float32 rounding (1e-5) on another CPU, whose kernels may add in another order
    generate_listops(tmp_path, 200, 40, 40, min_length=30, max_length=200)
    _, run_dir = run(tmp_path, tmp_path / "runs", "--model", "transformer", "--task", "listops", "--spt",
                     "--pretrain-epochs", "2", "--epochs", "2")
    got = [(r["phase"], r["train_loss"], r["val_loss"], r["val_acc"]) for r in records(run_dir) if "val_acc" in r]
    assert json.loads((run_dir / "config.json").read_text())["config"]["pos"] == "rotary"
    same_machine = (machine(torch.device("cpu"))["cpu"], torch.__version__) == BEFORE_POS["machine"]
    if same_machine:       # one float32 rounding of a validation sum apart at most (seen on an AMD EPYC, 2026-12-07:
        # the last fine-tuning val_loss, 2.376742362976074 against the record's 2.376742124557495), the rest exact
        assert [g[:2] + g[3:] for g in got] == [b[:2] + b[3:] for b in BEFORE_POS["spt_run"]], got
        assert [g[2] for g in got] == pytest.approx([b[2] for b in BEFORE_POS["spt_run"]], rel=1.2e-7, abs=0), got
    else:
        assert [g[0] for g in got] == [b[0] for b in BEFORE_POS["spt_run"]]
        flat = lambda rows: [v for row in rows for v in row[1:]]                        # noqa: E731 (approx: flat)
        assert flat(got) == pytest.approx(flat(BEFORE_POS["spt_run"]), rel=1e-5), \
            f"the default Transformer's run changed: {got}"


def test_pos_flag_reaches_the_config_and_learned_rows_follow_the_task_length(tmp_path):
    generate_listops(tmp_path, 200, 40, 40, min_length=30, max_length=200)
    results, run_dir = run(tmp_path, tmp_path / "runs", "--model", "transformer", "--task", "listops", "--pos",
                           "learned", "--epochs", "1")
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert (config["pos"], config["max_len"]) == ("learned", 2048), f"--pos learned on ListOps (L ≤ 2048): {config}"
    keys = torch.load(run_dir / "best.pt", weights_only=True)["model"]
    assert keys["backbone.pos_embedding.weight"].shape == (2048, 16)
