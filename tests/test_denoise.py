"""Facts about the SPT objectives in denoise.py: masking rate, pads, determinism, targets shifted exactly once."""
import torch

import denoise
import lra_data


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


def test_masked_tokens_become_the_mask_id_and_targets_keep_the_originals():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(4, 19, (16, 30), generator=gen)      # (B, L) listops-sized ids
    lengths = random_lengths(16, 30, 5, gen)
    x[torch.arange(30)[None, :] >= lengths[:, None]] = lra_data.PAD
    x_in, target, mask = denoise.corrupt(x, lengths, 0.3, gen, "listops")
    assert (x_in[mask] == lra_data.MASK).all(), "a masked token was not replaced by MASK"
    assert torch.equal(x_in[~mask], x[~mask]), "an unmasked token changed"
    assert torch.equal(target, x), "targets must be the original ids"


def test_pixel_input_is_value_channel_plus_mask_indicator():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 1024), generator=gen, dtype=torch.uint8)   # (B, L) 8-bit pixels
    lengths = torch.full((4,), 1024)
    x_in, target, mask = denoise.corrupt(x, lengths, 0.5, gen, "pathfinder")
    assert x_in.shape == (4, 1024, 2), f"pixel models take (B, L, 2), got {tuple(x_in.shape)}"
    assert torch.equal(x_in[..., 1], mask.float()), "channel 1 must be the mask indicator"
    assert (x_in[..., 0][mask] == 0).all(), "masked pixels must read 0"
    torch.testing.assert_close(x_in[..., 0][~mask], lra_data.normalize(x, "pathfinder").float()[~mask])
    clean = denoise.model_input(x, "pathfinder")
    assert clean.shape == (4, 1024, 2) and (clean[..., 1] == 0).all(), "fine-tuning input needs an all-zero indicator"
    assert target.dtype == torch.long and torch.equal(target, x.long()), "Pathfinder targets are grey levels 0..255"
    assert denoise.n_outputs("pathfinder") == 256 and denoise.n_outputs("image") == 1


def test_image_targets_are_normalised_values_scored_by_l1_and_r2():
    x = torch.randint(0, 256, (2, 1024), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    target = denoise.target_of(x, "image")[0]               # (L,) float
    perfect = denoise.metrics(denoise.sums(target[:, None].clone(), target))
    mean = denoise.metrics(denoise.sums(torch.full((1024, 1), target.mean().item()), target))
    assert perfect["loss"] < 1e-6 and abs(perfect["r2"] - 1) < 1e-6, f"perfect prediction scored {perfect}"
    assert abs(mean["r2"]) < 1e-4, f"predicting the mean must give R² ≈ 0, got {mean['r2']:.4f}"


def test_causal_targets_are_shifted_exactly_once():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(4, 260, (6, 40), generator=gen)      # (B, L) byte ids
    lengths = torch.tensor([40, 39, 20, 2, 7, 33])
    x[torch.arange(40)[None, :] >= lengths[:, None]] = lra_data.PAD
    x_in, target, mask = denoise.next_token(x, lengths, "text")
    assert torch.equal(x_in, x), "causal denoising must not change the input"
    assert torch.equal(mask.sum(1), lengths - 1), "every real position but the last has a target"
    one_hot = lambda ids: 50.0 * torch.nn.functional.one_hot(ids, 260).float()   # (..., V) confident logits
    next_tok = torch.cat([x[:, 1:], x[:, :1]], 1)                                # what position t should predict
    perfect = denoise.loss(one_hot(next_tok)[mask], target[mask]).item()
    copy = denoise.loss(one_hot(x)[mask], target[mask]).item()
    assert perfect < 1e-4, f"a perfect next-token predictor scores {perfect:.4f}, want ≈ 0 (targets shifted twice or never?)"
    assert copy > 10, f"a copy-the-input predictor scores {copy:.4f}, want large (targets not shifted?)"


def test_metrics_over_batches_equal_metrics_over_everything():
    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(100, 10, generator=gen), torch.randint(0, 10, (100,), generator=gen)
    whole = denoise.metrics(denoise.sums(logits, target))
    parts = denoise.metrics(denoise.add(denoise.sums(logits[:37], target[:37]), denoise.sums(logits[37:], target[37:])))
    assert abs(whole["loss"] - parts["loss"]) < 1e-5 and whole["acc"] == parts["acc"], f"{whole} != {parts}"
