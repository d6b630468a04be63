"""Facts about the SPT objectives in denoise.py: masking rate, pads, determinism, targets shifted exactly once;
span lengths; replaced-token detection (labels, which positions count, gradient paths, the folded backbone)."""
import pytest
import torch
import torch.nn.functional as F

import denoise
from dlr import DLR, DLRConfig

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
    assert denoise.losses(target[:, None].clone(), target).mean().item() < 1e-6, "a perfect value prediction: 0"
    mean = denoise.losses(torch.full((1024, 1), target.mean().item()), target).mean().item()
    torch.testing.assert_close(mean, (target - target.mean()).abs().mean().item(), msg="float targets use L1")
    ids = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(1))   # (M,) long: classes
    logits = torch.randn(64, 10, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(denoise.losses(logits, ids).mean(), torch.nn.functional.cross_entropy(logits, ids))


def test_causal_targets_are_shifted_exactly_once():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(4, 260, (6, 40), generator=gen)      # (B, L) byte ids
    lengths = torch.tensor([40, 39, 20, 2, 7, 33])
    x[torch.arange(40)[None, :] >= lengths[:, None]] = 0   # pads
    target, mask = denoise.next_token(x, lengths)
    assert torch.equal(mask.sum(1), lengths - 1), "every real position but the last has a target"
    one_hot = lambda ids: 50.0 * torch.nn.functional.one_hot(ids, 260).float()   # (..., V) confident logits
    next_tok = torch.cat([x[:, 1:], x[:, :1]], 1)                                # what position t should predict
    perfect = denoise.losses(one_hot(next_tok)[mask], target[mask]).mean().item()
    copy = denoise.losses(one_hot(x)[mask], target[mask]).mean().item()
    assert perfect < 1e-4, \
        f"a perfect next-token predictor scores {perfect:.4f}, want ≈ 0 (targets shifted twice or never?)"
    assert copy > 10, f"a copy-the-input predictor scores {copy:.4f}, want large (targets not shifted?)"


# ---- span masking -------------------------------------------------------------------------------------------------

def runs(mask):
    """Lengths of the maximal runs of True in each row of mask (B, L) -> (R,) long."""
    flat = torch.cat([mask, torch.zeros(mask.size(0), 1, dtype=torch.bool)], 1).flatten().int()   # rows kept apart
    edges = flat.diff(prepend=torch.zeros(1, dtype=torch.int))
    return (edges == -1).nonzero().flatten() - (edges == 1).nonzero().flatten()


def test_span_mask_rate_is_the_requested_ratio_within_one_point():
    lengths = random_lengths(64, 2000, 1000, torch.Generator().manual_seed(0))
    for ratio in (0.15, 0.5):
        mask = denoise.span_mask(lengths, 2000, ratio, torch.Generator().manual_seed(1))
        rate = mask.sum().item() / lengths.sum().item()
        assert abs(rate - ratio) < 0.01, f"span masking covered {rate:.4f} of real positions, asked for {ratio}"
        budget = torch.round(ratio * lengths).long()
        assert torch.equal(mask.sum(1), budget), "each row must mask exactly round(ratio · length) positions"


def test_spans_have_the_requested_mean_length_and_never_exceed_max_span():
    lengths = torch.full((64,), 2000)
    for ratio, mean_span, max_span in ((0.15, 3.0, 10), (0.5, 3.0, 10), (0.15, 5.0, 8)):
        mask = denoise.span_mask(lengths, 2000, ratio, torch.Generator().manual_seed(2), mean_span, max_span)
        lengths_of_runs = runs(mask).double()
        mean = lengths_of_runs.mean().item()
        assert abs(mean / mean_span - 1) < 0.1, f"ratio {ratio}: mean masked run {mean:.2f}, asked for {mean_span}"
        assert lengths_of_runs.max() <= max_span, \
            f"a masked run of {lengths_of_runs.max():.0f} > {max_span}: spans touch"


def test_span_length_law_has_mean_exactly_mean_span():
    for mean_span, max_span in ((3.0, 10), (1.0, 10), (5.5, 6), (10.0, 10)):
        q = denoise.span_length_q(mean_span, max_span)
        mean = sum(q ** k for k in range(max_span))                 # E ℓ = Σ_k P(ℓ > k)
        assert abs(mean - mean_span) < 1e-9, f"E ℓ = {mean} for mean_span {mean_span}, max_span {max_span}"


def test_spans_are_spread_over_the_whole_sequence():
    mask = denoise.span_mask(torch.full((2000,), 200), 200, 0.15, torch.Generator().manual_seed(3))
    per_quarter = mask.double().mean(0).view(4, 50).mean(1)         # (4,) rate in each quarter of the sequence
    assert (per_quarter - 0.15).abs().max() < 0.01, f"masking rate by quarter {per_quarter.tolist()}: placement biased"


def test_span_mask_never_covers_pads():
    gen = torch.Generator().manual_seed(0)
    lengths = random_lengths(300, 50, 0, gen)
    for ratio in (0.15, 0.5, 0.95):
        mask = denoise.span_mask(lengths, 50, ratio, gen)
        pads = torch.arange(50)[None, :] >= lengths[:, None]       # (B, L)
        assert not (mask & pads).any(), f"ratio {ratio}: a padded position was masked"


def test_span_mask_masks_at_least_one_position_even_in_very_short_rows():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.cat([torch.ones(50, dtype=torch.long), random_lengths(450, 6, 1, gen)])   # many length-1 rows
    mask = denoise.span_mask(lengths, 40, 1e-4, gen)
    assert mask.any(1).all(), f"{(~mask.any(1)).sum()} sequences have nothing masked (their loss would be NaN)"
    assert not denoise.span_mask(torch.zeros(3, dtype=torch.long), 5, 0.5, gen).any(), "an empty row got a mask"


def test_span_mask_is_deterministic_for_a_fixed_generator():
    lengths = torch.full((8,), 64)
    a = denoise.span_mask(lengths, 64, 0.5, torch.Generator().manual_seed(3))
    b = denoise.span_mask(lengths, 64, 0.5, torch.Generator().manual_seed(3))
    c = denoise.span_mask(lengths, 64, 0.5, torch.Generator().manual_seed(4))
    assert torch.equal(a, b), "same generator seed gave different span masks"
    assert not torch.equal(a, c), "different seeds gave the same span mask"


# ---- replaced-token detection -------------------------------------------------------------------------------------

V, D, D_GEN, B, L = 19, 8, 4, 6, 24


def tiny(width, **kw):
    """A 1-layer float64 DLR backbone without dropout: ids (vocab_size V) or pixels (d_input 2)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return DLR(DLRConfig(d_model=width, n_layers=1, d_state=4, dropout=0.0, **kw))
    finally:
        torch.set_default_dtype(old)


def token_rtd(gdes, seed=0):
    torch.manual_seed(seed)
    return denoise.ReplacedTokenDetection(tiny(D, vocab_size=V), tiny(D_GEN, vocab_size=V), D, D_GEN,
                                          gdes=gdes, exclude_ids=(0, MASK_ID)).double()


def pixel_rtd(seed=0):
    torch.manual_seed(seed)
    levels = torch.arange(256, dtype=torch.float64) / 255 * 2 - 1   # (256,) grey level -> normalised value
    return denoise.ReplacedTokenDetection(tiny(D, d_input=2), tiny(D_GEN, d_input=2), D, D_GEN,
                                          levels=levels).double()


def token_batch(seed=0, ratio=0.3):
    """(x_masked, lengths, original, mask, u, real) of a padded batch of ids; EOS left out of the masked span."""
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(B, L, 3, gen)                              # (B,)
    real = torch.arange(L)[None, :] < lengths[:, None]                 # (B, L)
    original = torch.randint(4, V, (B, L), generator=gen).masked_fill(~real, 0)   # (B, L) pads are id 0
    mask = denoise.span_mask(lengths - 1, L, ratio, gen)               # (B, L)
    u = torch.rand(B, L, generator=gen, dtype=torch.float64)
    return denoise.mask_input(original, mask, MASK_ID), lengths, original, mask, u, real


def pixel_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    original = torch.randint(0, 256, (B, L), generator=gen)             # (B, L) grey levels
    mask = denoise.sample_mask(torch.full((B,), L), L, 0.3, gen)
    value = original.double() / 255 * 2 - 1                             # (B, L)
    u = torch.rand(B, L, generator=gen, dtype=torch.float64)
    return denoise.mask_input(value, mask), None, original, mask, u, torch.ones(B, L, dtype=torch.bool)


def test_rtd_labels_are_exactly_the_positions_that_differ_from_the_original():
    gen = torch.Generator().manual_seed(0)
    original = torch.randint(0, V, (64, L), generator=gen)
    mask = torch.rand(64, L, generator=gen) < 0.5
    logits = 3 * F.one_hot(original, V).double() + torch.randn(64, L, V, generator=gen, dtype=torch.float64)
    replaced, labels = denoise.sample_replacements(logits, original, mask, torch.rand(64, L, generator=gen))
    assert torch.equal(labels, (replaced != original).double()), "labels must be 1 exactly where x̃ ≠ x"
    assert torch.equal(replaced[~mask], original[~mask]), "an unmasked position was replaced"
    kept = (mask & (labels == 0)).sum().item()
    assert 0 < kept < mask.sum().item(), f"{kept} masked positions sampled the original: need some, not all"
    for rtd, batch in ((token_rtd(True), token_batch()), (pixel_rtd(), pixel_batch())):
        x_masked, lengths, original, mask, u, _ = batch
        gen_logits, _, labels = rtd(x_masked, lengths, original, mask, u)
        replaced, _ = denoise.sample_replacements(gen_logits + rtd.sample_bias, original, mask, u)
        assert torch.equal(labels, (replaced != original).double()), "module labels != x̃ ≠ x"
        assert (labels[~mask] == 0).all() and labels.sum() > 0, "only masked positions can be replaced"


def test_rtd_sampling_by_inverse_cdf_is_deterministic_and_follows_the_noise():
    logits = torch.randn(B, L, V, generator=torch.Generator().manual_seed(0))
    original, mask = torch.zeros(B, L, dtype=torch.long), torch.ones(B, L, dtype=torch.bool)
    u = torch.rand(B, L, generator=torch.Generator().manual_seed(1))
    a, b = (denoise.sample_replacements(logits, original, mask, u)[0] for _ in range(2))
    c = denoise.sample_replacements(logits, original, mask, torch.rand(B, L))[0]
    assert torch.equal(a, b) and not torch.equal(a, c), "same u must give the same samples, another u others"
    cdf = logits.softmax(-1).cumsum(-1)                                 # (B, L, V)
    first = torch.tensor([[next(i for i in range(V) if cdf[b, t, i] > u[b, t]) for t in range(L)] for b in range(B)])
    assert torch.equal(a, first), "the sample is not the first id whose cumulative probability exceeds u"


def test_rtd_never_samples_excluded_ids():
    rtd, (_, _, original, mask, u, _) = token_rtd(True), token_batch()
    logits = torch.zeros(B, L, V, dtype=torch.float64)
    logits[..., 0], logits[..., MASK_ID] = 30.0, 30.0                   # the pad and mask ids are all but certain
    replaced, _ = denoise.sample_replacements(logits + rtd.sample_bias, original, mask, u)
    assert not ((replaced == 0) | (replaced == MASK_ID))[mask].any(), "a pad or mask id was sampled"


def test_rtd_discriminator_loss_covers_every_real_position_and_no_pad():
    rtd, (x_masked, lengths, original, mask, u, real) = token_rtd(True), token_batch()
    gen_logits, disc_logits, labels = rtd(x_masked, lengths, original, mask, u)
    gen, disc = denoise.rtd_losses(gen_logits, disc_logits, labels, original, mask, real)
    assert gen.dtype == disc.dtype == torch.float32 and gen.shape == disc.shape == (B, L), "(B, L) float32 each"
    assert (disc > 0).sum() == real.sum() == lengths.sum(), "L_disc must count every real position (EOS too) once"
    assert torch.equal(gen > 0, mask), "L_gen must count exactly the masked positions"
    noisy = disc_logits.masked_fill(~real, 1e4)                         # anything at the pads
    _, disc_noisy = denoise.rtd_losses(gen_logits, noisy, labels, original, mask, real)
    assert torch.equal(disc, disc_noisy), "the discriminator's loss changed with its logits at pads"


def test_rtd_training_loss_is_the_generator_mean_plus_lambda_times_the_discriminator_mean():
    # the loss training takes (the rtd entry's loss, over rows and micro-batches), against the two means by hand
    rtd, (x_masked, lengths, original, mask, u, real) = token_rtd(True), token_batch()
    b = denoise.Batch(x_masked, lengths, original, mask.float(), u, denoise.RTD_WEIGHT)
    loss = denoise.rtd_batch_loss(rtd, b)[0]
    gen_logits, disc_logits, labels = rtd(x_masked, lengths, original, mask, u)
    l_gen = F.cross_entropy(gen_logits[mask].float(), original[mask])
    l_disc = F.binary_cross_entropy_with_logits(disc_logits[real].float(), labels[real].float())
    torch.testing.assert_close(loss, l_gen + denoise.RTD_WEIGHT * l_disc, msg="loss != L_gen + λ L_disc")
    halves = sum(denoise.rtd_batch_loss(rtd, b, rows)[0] for rows in (slice(0, B // 2), slice(B // 2, B)))
    torch.testing.assert_close(halves, loss, msg="two halves of the rows do not add up to the batch loss")


def test_an_oracle_discriminator_scores_zero_loss():
    rtd, (x_masked, lengths, original, mask, u, real) = token_rtd(True), token_batch()
    _, _, labels = rtd(x_masked, lengths, original, mask, u)
    oracle = 40.0 * (2 * labels - 1)                                    # (B, L) ±large from the true labels
    _, disc = denoise.rtd_losses(torch.zeros(B, L, V), oracle, labels, original, mask, real)
    assert disc.sum() < 1e-12, f"an oracle discriminator scores {disc.sum():.3g}, want ≈ 0"


def test_a_perfect_generator_replaces_nothing():
    gen = torch.Generator().manual_seed(0)
    original = torch.randint(0, 256, (B, L), generator=gen)
    logits = 100.0 * F.one_hot(original, 256).double()                 # (B, L, 256) certain of the original
    replaced, labels = denoise.sample_replacements(logits, original, torch.ones(B, L, dtype=torch.bool),
                                                   torch.rand(B, L, generator=gen))
    assert torch.equal(replaced, original) and not labels.any(), "a perfect generator's samples were counted replaced"


@pytest.mark.parametrize("kind", ["gdes", "electra", "pixels"])
def test_no_gradient_reaches_the_generator_through_the_sampled_inputs(kind):
    rtd, batch = (pixel_rtd(), pixel_batch()) if kind == "pixels" else (token_rtd(kind == "gdes"), token_batch())
    x_masked, lengths, original, mask, u, real = batch
    gen_logits, disc_logits, labels = rtd(x_masked, lengths, original, mask, u)
    denoise.rtd_losses(gen_logits, disc_logits, labels, original, mask, real)[1].sum().backward()
    shared = rtd.backbone.encoder.weight if kind == "electra" else None  # ELECTRA: E is meant to be trained by both
    for name, p in [*rtd.generator.named_parameters(), *rtd.gen_head.named_parameters()]:
        if p is not shared:
            assert p.grad is None or not p.grad.any(), f"L_disc reached generator parameter {name}"


def test_gdes_keeps_the_discriminator_loss_off_the_shared_embedding_and_electra_does_not():
    for gdes in (True, False):
        rtd, (x_masked, lengths, original, mask, u, real) = token_rtd(gdes), token_batch()
        E = rtd.generator.encoder.table.weight                          # (V, D) the one shared table
        gen_logits, disc_logits, labels = rtd(x_masked, lengths, original, mask, u)
        l_gen, l_disc = (part.sum() for part in denoise.rtd_losses(gen_logits, disc_logits, labels, original, mask,
                                                                    real))
        from_disc = torch.autograd.grad(l_disc, E, retain_graph=True, allow_unused=True)[0]
        from_gen = torch.autograd.grad(l_gen, E)[0]
        assert from_gen.any(), "the generator's loss must train E"
        if gdes:
            assert from_disc is None or not from_disc.any(), "GDES: the discriminator's loss moved E"
            assert torch.autograd.grad(rtd(x_masked, lengths, original, mask, u)[1].sum(),
                                       rtd.backbone.encoder.delta.weight)[0].any(), "GDES: E_Δ must learn"
        else:
            assert from_disc is not None and from_disc.any(), "ELECTRA: the discriminator's loss must train E too"


def test_embedding_padding_rows_stay_zero():
    for gdes in (True, False):
        rtd = token_rtd(gdes)
        pad = torch.zeros(1, 1, dtype=torch.long)
        assert not rtd.generator.encoder(pad).any() and not rtd.backbone.encoder(pad).any(), "pad must embed to 0"


@pytest.mark.parametrize("kind", ["gdes", "electra", "pixels"])
def test_folded_discriminator_backbone_loads_strictly_and_gives_the_same_features(kind):
    rtd, batch = (pixel_rtd(), pixel_batch()) if kind == "pixels" else (token_rtd(kind == "gdes"), token_batch())
    if kind == "gdes":
        with torch.no_grad():
            rtd.backbone.encoder.delta.weight[1:].normal_()            # as if trained: E_Δ ≠ 0 (pad row stays 0)
    state = denoise.discriminator_backbone(rtd.state_dict())
    fresh = tiny(D, d_input=2) if kind == "pixels" else tiny(D, vocab_size=V)
    assert sorted(state) == sorted(f"backbone.{k}" for k in fresh.state_dict()), "keys != a classifier's backbone"
    fresh.load_state_dict({k.removeprefix("backbone."): v for k, v in state.items()}, strict=True)
    x_clean = rtd.corrupted_input(batch[2])                             # the fine-tuning input of the originals
    assert torch.equal(fresh(x_clean, batch[1]), rtd.backbone(x_clean, batch[1])), "folded backbone's features differ"


def test_pixel_discriminator_reads_normalised_levels_with_a_zero_indicator():
    rtd, (_, _, original, _, _, _) = pixel_rtd(), pixel_batch()
    value = original.double() / 255 * 2 - 1                             # what the classifier reads
    expected = denoise.mask_input(value, torch.zeros(B, L, dtype=torch.bool))
    assert torch.equal(rtd.corrupted_input(original), expected), "discriminator input != fine-tuning input"


def test_rtd_refuses_a_single_output():
    with pytest.raises(AssertionError):
        denoise.ReplacedTokenDetection(tiny(D, d_input=2), tiny(D_GEN, d_input=2), D, D_GEN,
                                       levels=torch.zeros(1))
