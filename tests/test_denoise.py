"""Facts about the SPT objectives in denoise.py: masking rate, pads, determinism, targets shifted exactly once."""
import torch

import denoise

MASK_ID = 1                                                # any id; train.py passes lra_data.MASK


def random_lengths(B, L, low, gen):
    return torch.randint(low, L + 1, (B,), generator=gen)  # (B,)


def test_mask_rate_is_the_requested_ratio_within_one_point():
    gen = torch.Generator().manual_seed(0)
    lengths = random_lengths(400, 128, 64, gen)            # ~38k real positions (σ of the rate ≈ 0.0026 at p = 0.5)
    for ratio in (0.10, 0.15, 0.50):
        mask = denoise.sample_mask(lengths, 128, ratio, torch.Generator().manual_seed(1))
        rate = mask.sum().item() / lengths.sum().item()
        assert abs(rate - ratio) < 0.01, f"masked {rate:.4f} of real positions, asked for {ratio}"


def test_mask_never_covers_pads():
    gen = torch.Generator().manual_seed(0)
    lengths = random_lengths(300, 50, 1, gen)
    mask = denoise.sample_mask(lengths, 50, 0.5, gen)
    pads = torch.arange(50)[None, :] >= lengths[:, None]    # (B, L)
    assert not (mask & pads).any(), "a padded position was masked"


def test_every_sequence_has_at_least_one_masked_position():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.cat([torch.ones(50, dtype=torch.long), random_lengths(450, 40, 1, gen)])  # many length-1 rows
    mask = denoise.sample_mask(lengths, 40, 1e-4, gen)     # so small a ratio that the guarantee must kick in
    assert mask.any(1).all(), f"{(~mask.any(1)).sum()} sequences have nothing masked (their loss would be NaN)"


def test_mask_is_deterministic_for_a_fixed_generator():
    lengths = torch.full((8,), 64)
    a = denoise.sample_mask(lengths, 64, 0.5, torch.Generator().manual_seed(3))
    b = denoise.sample_mask(lengths, 64, 0.5, torch.Generator().manual_seed(3))
    c = denoise.sample_mask(lengths, 64, 0.5, torch.Generator().manual_seed(4))
    assert torch.equal(a, b), "same generator seed gave different masks"
    assert not torch.equal(a, c), "different seeds gave the same mask"


def test_masked_tokens_become_the_mask_id_and_the_rest_is_unchanged():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(4, 19, (16, 30), generator=gen)      # (B, L) listops-sized ids
    lengths = random_lengths(16, 30, 5, gen)
    mask = denoise.sample_mask(lengths, 30, 0.3, gen)
    x_in = denoise.mask_input(x, mask, MASK_ID)
    assert (x_in[mask] == MASK_ID).all(), "a masked token was not replaced by the mask id"
    assert torch.equal(x_in[~mask], x[~mask]), "an unmasked token changed"


def test_pixel_input_is_value_channel_plus_mask_indicator():
    gen = torch.Generator().manual_seed(0)
    value = torch.rand(4, 1024, generator=gen) * 2 - 1      # (B, L) normalised pixels
    mask = denoise.sample_mask(torch.full((4,), 1024), 1024, 0.5, gen)
    x_in = denoise.mask_input(value, mask)
    assert x_in.shape == (4, 1024, 2), f"pixel models take (B, L, 2), got {tuple(x_in.shape)}"
    assert torch.equal(x_in[..., 1], mask.float()), "channel 1 must be the mask indicator"
    assert (x_in[..., 0][mask] == 0).all(), "masked pixels must read 0"
    assert torch.equal(x_in[..., 0][~mask], value[~mask]), "unmasked pixels changed"
    clean = denoise.mask_input(value, torch.zeros_like(mask))
    assert clean.shape == (4, 1024, 2) and (clean[..., 1] == 0).all(), "fine-tuning input needs an all-zero indicator"


def test_value_targets_are_scored_by_l1_and_class_targets_by_cross_entropy():
    target = torch.randn(1024, generator=torch.Generator().manual_seed(0))          # (M,) float: Image values
    assert denoise.loss(target[:, None].clone(), target).item() < 1e-6, "a perfect value prediction must score 0"
    mean = denoise.loss(torch.full((1024, 1), target.mean().item()), target).item()
    torch.testing.assert_close(mean, (target - target.mean()).abs().mean().item(), msg="float targets use L1")
    ids = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(1))   # (M,) long: classes
    logits = torch.randn(64, 10, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(denoise.loss(logits, ids), torch.nn.functional.cross_entropy(logits, ids))


def test_causal_targets_are_shifted_exactly_once():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(4, 260, (6, 40), generator=gen)      # (B, L) byte ids
    lengths = torch.tensor([40, 39, 20, 2, 7, 33])
    x[torch.arange(40)[None, :] >= lengths[:, None]] = 0   # pads
    target, mask = denoise.next_token(x, lengths)
    assert torch.equal(mask.sum(1), lengths - 1), "every real position but the last has a target"
    one_hot = lambda ids: 50.0 * torch.nn.functional.one_hot(ids, 260).float()   # (..., V) confident logits
    next_tok = torch.cat([x[:, 1:], x[:, :1]], 1)                                # what position t should predict
    perfect = denoise.loss(one_hot(next_tok)[mask], target[mask]).item()
    copy = denoise.loss(one_hot(x)[mask], target[mask]).item()
    assert perfect < 1e-4, f"a perfect next-token predictor scores {perfect:.4f}, want ≈ 0 (targets shifted twice or never?)"
    assert copy > 10, f"a copy-the-input predictor scores {copy:.4f}, want large (targets not shifted?)"
