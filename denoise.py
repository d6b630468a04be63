"""denoise.py: the self pre-training (SPT) objectives of Amos, Berant & Gupta, "Never Train from
Scratch" (ICLR 2024), §2, App. C, and two more from the pre-training literature.
masked: M_bt ~ Bernoulli(p) on content positions (>= 1 per row); x_in = x with M replaced;
        loss = mean over M of ℓ(head(h_bt), x_bt)
span:   M = contiguous spans, |span| ~ Geometric clipped at max_span, until |M_b| = round(p·n_b)
        (SpanBERT; T5)
causal: x_in = x;  loss = mean over t < length-1 of ℓ(head(h_bt), x_b,t+1)
        (next token; needs a causal model)
RTD:    x̃ = x with M replaced by samples of a small masked-denoising generator; a discriminator
        tells x̃_t ≠ x_t at every real t;  loss = L_gen + λ·L_disc, λ = 50
        (ELECTRA, Clark et al. 2020; GDES: DeBERTaV3, He et al. 2023)
fine-tune: labelled, no corruption: the clean input, the class labels as targets
loss:   batch_loss, Σ weight·ℓ / the global batch's Σ weight: every objective's but RTD's, and
        fine-tuning's (a step: train.py's train_phase, which calls the corruption and the loss here)
ℓ = cross-entropy over the vocabulary (token ids) or over the 256 grey levels (Pathfinder/PathX)
or the classes, L1 on the normalised value (Image).
Check: tests/test_denoise.py (masking rate, span lengths, pads never masked, causal targets shifted
exactly once, RTD labels and gradient paths, the folded discriminator backbone).
The objectives see tensors only: token ids (B, L) long, or pixel values (B, L) float, already
normalised; targets are class ids (long: cross-entropy) or values (float: L1). Which task is which
is models.py's business; so are the heads.
"""
import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

RTD_WEIGHT = 50.0        # λ, the discriminator's weight in L_gen + λ·L_disc (ELECTRA §3)


class Batch(NamedTuple):
    """One global batch on the device, as every DDP process sees it (each then computes its own
    rows): what a model reads, what it is scored against and where. Made by an objective (below) or
    by labelled (fine-tuning)."""
    x: torch.Tensor                  # model input: (B, L) ids | (B, L, 2) pixels [value, indicator]
                                     # | (B, 2, L) pairs
    lengths: torch.Tensor | None     # (B,) or (B, 2) real lengths; None: nothing padded
                                     # (fast attention, plain norms)
    target: torch.Tensor             # (B,) labels, or (B, L) denoising targets
                                     # (ids / grey levels long, values float)
    weight: torch.Tensor             # (B,) or (B, L) float: 1 where the loss is taken, else 0
    noise: torch.Tensor | None = None    # RTD: (B, L) uniform [0, 1), the generator's samples
    disc_weight: float = RTD_WEIGHT      # RTD: λ in L_gen + λ·L_disc


class Clean(NamedTuple):
    """One batch of a task's clean inputs: what an objective corrupts. lra_data.clean_batch makes it on
    the host (the loader's collate) and steps.to_device moves it."""
    value: torch.Tensor              # (B, L) long token ids, or float pixel values (normalised)
    target: torch.Tensor             # (B, L) what to restore: ids / grey levels (long)
                                     # or values (float, Image)
    lengths: torch.Tensor            # (B,) long, real lengths
    content: torch.Tensor            # (B,) long, the positions that may be masked: lengths,
                                     # less a token task's EOS
    padded: torch.Tensor | None      # lengths, or None when nothing is padded
                                     # (the models' fast path)
    mask_id: int                     # the <mask> token id
                                     # (pixels: masked values become 0 and an indicator says so)
    labels: torch.Tensor | None = None   # (B,) class labels, for fine-tuning (SPT ignores them);
                                         # Retrieval: one per pair of rows


# ---- the corruptions: (clean batch, generator, progress in [0, 1], the objective's flags) -> Batch
# models.py's OBJECTIVES declares each one with its flags, which arrive as keyword arguments.
# `gen` draws every random number on the device, for the whole global batch, so DDP processes mask
# as one process would. `progress` (step / steps of the phase) lets an objective follow a schedule;
# these four keep theirs constant.

def masked_batch(clean, gen, progress, mask_ratio):
    """Masked denoising, the paper's objective (§2): each content position masked i.i.d. with
    p = mask_ratio, at least one per row, never a pad or the EOS; the loss counts the masked
    positions only."""
    mask = sample_mask(clean.content, clean.value.size(1), mask_ratio, gen)      # (B, L) bool
    return Batch(mask_input(clean.value, mask, clean.mask_id), clean.padded, clean.target,
                 mask.float())


def masked(clean, args, gen, progress):
    """masked_batch with the ratio read from args.mask_ratio (any object that has it): the call of
    earlier versions, kept for code outside the repo."""
    return masked_batch(clean, gen, progress, mask_ratio=args.mask_ratio)


def span_batch(clean, gen, progress, mask_ratio, span_mean):
    """Span masking (SpanBERT): contiguous spans of mean length span_mean up to the share
    mask_ratio."""
    mask = span_mask(clean.content, clean.value.size(1), mask_ratio, gen, span_mean)  # (B, L) bool
    return Batch(mask_input(clean.value, mask, clean.mask_id), clean.padded, clean.target,
                 mask.float())


def causal_batch(clean, gen, progress):
    """Next-token prediction: the input unchanged, the target shifted by one (a causal model is
    required)."""
    target, mask = next_token(clean.target, clean.lengths)                   # (B, L) each
    # pixels: (B, L, 2), indicator 0
    x = mask_input(clean.value, torch.zeros_like(mask), clean.mask_id)
    return Batch(x, clean.padded, target, mask.float())


def rtd_batch(clean, gen, progress, mask_ratio, rtd_weight):
    """Replaced-token detection (ELECTRA): masked as masked_batch, plus the uniform noise the
    generator samples with and λ = rtd_weight; the model is ReplacedTokenDetection."""
    mask = sample_mask(clean.content, clean.value.size(1), mask_ratio, gen)      # (B, L) bool
    noise = torch.rand(mask.shape, generator=gen, device=mask.device)            # (B, L)
    x = mask_input(clean.value, mask, clean.mask_id)
    return Batch(x, clean.padded, clean.target, mask.float(), noise, rtd_weight)


def sample_mask(lengths, L, ratio, gen):
    """Positions to mask: each content position t < lengths[b] i.i.d. with probability `ratio`,
    never a pad (nor the EOS token, which the caller leaves out of `lengths`), at least one per
    sequence with lengths > 0 (else that row adds nothing to learn from). lengths: (B,) long
    -> (B, L) bool. The random numbers are drawn on lengths' device from `gen` (a generator of that
    device), with no value read back to the host."""
    B, device = lengths.numel(), lengths.device
    pos = torch.arange(L, device=device)[None, :]                                 # (1, L)
    # (B, L)
    mask = (torch.rand(B, L, generator=gen, device=device) < ratio) & (pos < lengths[:, None])
    # (B,) one uniform content position
    pick = (torch.rand(B, generator=gen, device=device) * lengths).long()
    empty = ~mask.any(1) & (lengths > 0)                                          # (B,)
    return mask | (empty[:, None] & (pos == pick[:, None]))                       # (B, L)


def span_length_q(mean_span, max_span):
    """q of the span-length law P(ℓ > k) = q^k for k < max_span (a geometric clipped at max_span, as
    in SpanBERT), chosen so that E ℓ = Σ_{k<max_span} q^k = mean_span exactly (bisection; E ℓ grows
    with q from 1 to max_span)."""
    assert 1 <= mean_span <= max_span, (
        f"mean_span={mean_span} must lie in [1, max_span={max_span}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        lo, hi = (q, hi) if sum(q ** k for k in range(max_span)) < mean_span else (lo, q)
    return (lo + hi) / 2


def span_mask(lengths, L, ratio, gen, mean_span=3.0, max_span=10):
    """Span masking (SpanBERT, Joshi et al. 2020; placement as T5's random_spans_noise_mask, Raffel
    et al. 2020): row b masks exactly n_b = clamp(round(ratio·lengths[b]), 1, lengths[b]) content
    positions t < lengths[b] (never a pad, nor the EOS the caller leaves out of lengths; >= 1 when
    lengths[b] > 0), as contiguous spans of lengths ℓ_k ~ P(ℓ > k) = q^k, ℓ <= max_span,
    E ℓ = mean_span (span_length_q), drawn until Σ ℓ_k reaches n_b (the last one cut to fit). The
    K_b spans keep their order; the lengths[b] − n_b unmasked positions are spread around them as
    K_b + 1 gaps, the inner ones >= 1 (so no two spans touch and every masked run is one span),
    chosen uniformly by stars and bars (K_b bars among free_b + K_b slots). Only when a row has
    fewer unmasked positions than inner gaps (ratio near 1) may spans touch. Pixels: the same along
    the raster order. lengths: (B,) long -> (B, L) bool. Random numbers come from `gen` on lengths'
    device; no value is read back to the host (fine inside a GPU step)."""
    B, device = lengths.numel(), lengths.device
    S = max(1, min(L, math.ceil(ratio * L) + 1))                   # spans drawn per row: >= any n_b
    # (B,) masked budget
    n = torch.minimum(torch.round(ratio * lengths).long().clamp(min=1), lengths)
    # (max_span − 1,)
    thresholds = span_length_q(mean_span, max_span) ** torch.arange(1, max_span, device=device)
    u = torch.rand(B, S, generator=gen, device=device)             # (B, S)
    ell = 1 + (u[..., None] < thresholds).sum(-1)                  # (B, S) ℓ = 1 + #{k: U < q^k}
    before = ell.cumsum(1) - ell                                   # (B, S) masked before span k
    ell = torch.minimum(ell, (n[:, None] - before).clamp(min=0))   # (B, S) the prefix that fits n_b
    K = (ell > 0).sum(1)                                           # (B,) spans used
    inner = (K - 1).clamp(min=0)                                   # (B,) gaps between two spans
    gap = (lengths - n >= inner).long()                            # (B,) 1: spans never touch
    free = lengths - n - gap * inner                               # (B,) unmasked cells to spread
    slot = torch.arange(L, device=device)                          # (L,)
    keys = (torch.rand(B, L, generator=gen, device=device)         # (B, L)
            .masked_fill(slot >= (free + K)[:, None], 2.0))
    k = torch.arange(S, device=device)                             # (S,)
    # (B, S) first K
    bars = keys.argsort(dim=1, stable=True)[:, :S].masked_fill(k >= K[:, None], L).sort(1).values
    # (B, S) free cells before bar k + spans + inner gaps
    start = bars - k + before + gap[:, None] * k
    ends = torch.cat([start, start + ell], 1).clamp(0, L)          # (B, 2S); unused spans: ℓ = 0
    # (B, 2S) +1 at a start, −1 at an end
    step = torch.cat([torch.ones_like(start), -torch.ones_like(start)], 1)
    # (B, L + 1)
    edges = torch.zeros(B, L + 1, dtype=torch.long, device=device).scatter_add_(1, ends, step)
    return edges.cumsum(1)[:, :L] > 0                              # (B, L)


def mask_input(x, mask, mask_id=None):
    """What the backbone reads (BERT-style masking, no 80/10/10 replacement; paper App. C).
    x: (B, L) long token ids -> (B, L) long with the masked ids replaced by `mask_id`;
    x: (B, L) float pixel values -> (B, L, 2) float = [value, 0 where masked; mask indicator].
    Pixel models always read the indicator channel (all zeros when mask is all False, i.e. when
    fine-tuning), so the encoder of the pre-trained and of the fine-tuned model has one shape.
    mask: (B, L) bool."""
    if not x.is_floating_point():
        return x.masked_fill(mask, mask_id)                                       # (B, L)
    return torch.stack([x.masked_fill(mask, 0.0), mask.to(x.dtype)], -1)         # (B, L, 2)


def next_token(target, lengths):
    """Causal denoising: the target at t is target[t+1] (shifted exactly once here; the model must
    not shift again). The last real position has no next token and is ignored, as are pads.
    target: (B, L), lengths: (B,) -> (shifted target (B, L), mask (B, L) bool): the loss is taken
    where mask is True."""
    L = target.size(1)
    # (B, L); shifted[:, t] = target[:, t+1], last column wraps
    shifted = target.roll(-1, dims=1)
    # wrap unused
    mask = torch.arange(L, device=target.device)[None, :] < (lengths.to(target.device) - 1)[:, None]
    return shifted, mask


def losses(pred, target):
    """Denoising (or classification) loss at each position, unreduced: cross-entropy for integer
    targets (classes, ids, grey levels), L1 for float targets (normalised pixels).
    pred: (..., V) logits or (..., 1) values; target: (...) -> (...) float32. The caller weights and
    sums (batch_loss: Σ weight·ℓ / the global count)."""
    if target.is_floating_point():
        return (pred.float().squeeze(-1) - target).abs()
    return F.cross_entropy(pred.float().flatten(0, -2), target.flatten(),
                           reduction="none").view(target.shape)


# ---- fine-tuning's batch, and the one loss of a Batch ------------------------------------------

def labelled(clean, gen, progress, pair=False):
    """Fine-tuning's "corruption": none. The clean input as the classifier reads it (pixels with a
    zero mask indicator), the labels as targets, every example counted once (gen and progress are
    not needed). pair (Retrieval): rows 2i, 2i+1 are example i's two documents -> x (B, 2, L),
    lengths (B, 2)."""
    x = mask_input(clean.value, torch.zeros(clean.value.shape, dtype=torch.bool,
                                            device=clean.value.device), clean.mask_id)
    lengths = clean.padded
    if pair:
        x = x.unflatten(0, (-1, 2))                                      # (B, 2, L)
        lengths = None if lengths is None else lengths.unflatten(0, (-1, 2))     # (B, 2)
    y = clean.labels
    return Batch(x, lengths, y, torch.ones(y.shape, device=y.device))


def batch_loss(model, b, rows=slice(None), scale=1.0, predictions=None):
    """Loss of the examples `rows` of the global batch b, summed and divided by the global batch's
    count (times `scale`: the number of DDP processes, whose gradients DDP averages), so that rows,
    micro-batches and processes add up to the global batch mean; and the rows' additive statistics
    (a dict of device tensors). Classifier: logits (b, C); Denoiser: predictions at every position
    (b, L, V), no boolean indexing (it would read the mask's size back from the device). (An
    objective with a model of its own has its own loss: rtd_batch_loss.) The one loss of training,
    evaluation and the memory estimate (lab/memory.py). predictions: a list that gets the rows'
    predicted classes (b,) long (the test keeps them, for paired tests of two runs)."""
    lengths = None if b.lengths is None else b.lengths[rows]
    pred = model(b.x[rows], lengths)                                     # (b, C) or (b, L, V)
    target, weight = b.target[rows], b.weight[rows]                      # (b,) or (b, L)
    per = losses(pred, target)                                           # (b,) or (b, L) float32
    if predictions is not None:
        predictions.append(pred.detach().argmax(-1))                     # (b,)
    return ((per * weight).sum() / b.weight.sum() * scale,
            statistics(pred.detach(), target, per.detach(), weight))


def statistics(pred, target, per, weight):
    """Additive statistics of one batch as float64 device tensors, so many batches add up exactly
    and are read once: n, Σloss and correct (classes) or Σ(pred − t)², Σt, Σt² (values, for
    R²)."""
    out = {"n": weight.sum().double(), "loss": (per * weight).sum().double()}
    if target.is_floating_point():
        residual = pred.float().squeeze(-1) - target
        out.update(sse=(residual ** 2 * weight).sum().double(),
                   sum=(target * weight).sum().double(),
                   sumsq=(target ** 2 * weight).sum().double())
    else:
        out["correct"] = ((pred.argmax(-1) == target) * weight).sum().double()
    return out


def add(total, stats, keep=True):
    """total + stats, key by key (keep=False: a DDP process's dummy row, counted as nothing)."""
    return {k: total.get(k, 0) + v * keep for k, v in stats.items()}


def metrics(total):
    """loss and accuracy (classes) or R² = 1 − SSE/SST (values), from summed statistics; one read
    of the device values. (An objective with other statistics has its own: rtd_metrics.)"""
    t = totals(total)
    n = max(t["n"], 1e-12)
    if "sse" in t:
        return {"loss": t["loss"] / n,
                "r2": 1.0 - t["sse"] / max(t["sumsq"] - t["sum"] ** 2 / n, 1e-12)}
    return {"loss": t["loss"] / n, "acc": t["correct"] / n}


# ---- replaced-token detection (ELECTRA, Clark et al. 2020; GDES, DeBERTaV3, He et al. 2023) ------

class ProjectedEmbedding(nn.Module):
    """The generator's encoder under embedding sharing: one table E (V, D) at the discriminator's
    width, read by the narrower generator through Linear(D -> D_gen) (ELECTRA §3.2; no bias, so the
    padding row stays 0). x: (B, L) long -> (B, L, D_gen)."""

    def __init__(self, table, d_gen):
        super().__init__()
        self.table, self.project = table, nn.Linear(table.embedding_dim, d_gen, bias=False)

    def forward(self, x):
        return self.project(self.table(x))           # (B, L) -> (B, L, D) -> (B, L, D_gen)


class GDESEmbedding(nn.Module):
    """The discriminator's encoder under gradient-disentangled embedding sharing (DeBERTaV3 §3):
    E_D = sg(E) + E_Δ with E_Δ (V, D) zero at init, so only the generator's loss moves E and E_Δ
    carries the discriminator's part; fine-tuning reads the folded table E + E_Δ
    (discriminator_backbone). x: (B, L) long -> (B, L, D)."""

    def __init__(self, table):
        super().__init__()
        self.table = table
        self.delta = nn.Embedding(table.num_embeddings, table.embedding_dim, padding_idx=0)
        nn.init.zeros_(self.delta.weight)

    def forward(self, x):
        return self.table(x).detach() + self.delta(x)            # (B, L, D)


def sample_replacements(logits, original, mask, u):
    """The generator's samples at the masked positions, temperature 1, by inverse CDF of one given
    uniform u per position (so the whole global batch is sampled as one process would, and
    deterministically): x̃_t = the first id whose cumulative probability exceeds u_t where mask,
    else x_t. No gradient flows through the sample.
    logits: (B, L, V); original: (B, L) long; mask: (B, L) bool; u: (B, L) float in [0, 1)
    -> (replaced (B, L) long, labels (B, L) float: 1 where replaced ≠ original, so a sampled
    original counts as original)."""
    cdf = logits.detach().float().softmax(-1).cumsum(-1)      # (B, L, V)
    cdf = cdf / cdf[..., -1:]                                 # last exactly 1 > u: an id exists
    sample = (cdf <= u[..., None].to(cdf.dtype)).sum(-1)      # (B, L) long; never a p = 0 id
    replaced = torch.where(mask, sample, original)            # (B, L)
    return replaced, (replaced != original).float()


class ReplacedTokenDetection(nn.Module):
    """ELECTRA pre-training of `backbone` (the discriminator, width D = d_model, the one fine-tuned
    later) with a small `generator` of the same family (width D_gen = d_gen ≈ D/4..D/2, 1-2 layers;
    its own `encoder` is replaced). Both map (x, lengths) -> (B, L, width). G reads the masked input
    and is trained by masked denoising; its samples replace the masked positions; the discriminator
    reads the result and tells, at every real position, replaced (1) from original (0):
    L_gen = mean_{t ∈ M} CE(G(x_masked)_t, x_t),
    L_disc = mean_{t real} BCE(D(x̃)_t, 1[x̃_t ≠ x_t]).
    levels None, tokens: ids, n_out = V; one table E (V, D) = the backbone's encoder, shared:
    gdes=False (ELECTRA) the discriminator reads E itself; gdes=True (DeBERTaV3) it reads
    sg(E) + E_Δ. exclude_ids: ids never sampled (e.g. PAD and MASK, so x̃ holds no mask id).
    levels (n_out,) float, pixels: the normalised value of each grey level (n_out = 256), exactly
    as the fine-tuned model reads it; no sharing (each keeps its Linear(2, width)); the
    discriminator reads [levels[x̃], 0] (B, L, 2), the fine-tuning input shape.
    forward(x_masked, lengths, original, mask, u)
    -> (gen_logits (B, L, n_out), disc_logits (B, L), labels (B, L) float)
    with x_masked = mask_input(x, mask, mask_id) ((B, L) long or (B, L, 2) float), lengths (B,)
    long or None (no pads), original (B, L) long (ids or levels 0..255), mask (B, L) bool,
    u (B, L) float uniform [0, 1). Losses: rtd_losses."""

    def __init__(self, backbone, generator, d_model, d_gen, gdes=True, levels=None, exclude_ids=()):
        super().__init__()
        tokens = levels is None
        if tokens:
            table = backbone.encoder                 # E: (V, D), the discriminator's own init
            assert isinstance(table, nn.Embedding) and table.weight.shape[1] == d_model, (
                "need Embedding(V, D)")
            n_out = table.num_embeddings             # V
            generator.encoder = ProjectedEmbedding(table, d_gen)
            if gdes:
                backbone.encoder = GDESEmbedding(table)
        else:
            assert levels.dim() == 1 and levels.is_floating_point(), "levels: (n_out,) float, one per grey level"
            n_out = len(levels)                      # 256 grey levels
        assert n_out > 1, (
            "RTD samples from a distribution over n_out > 1 classes (Image's L1 values have none)")
        self.backbone, self.generator, self.tokens = backbone, generator, tokens
        self.gen_head = nn.Linear(d_gen, n_out)
        self.disc_head = nn.Linear(d_model, 1)
        self.register_buffer("levels", None if tokens else levels, persistent=False)
        # (n_out,)
        never = torch.zeros(n_out).index_fill_(0, torch.tensor(exclude_ids, dtype=torch.long),
                                               -math.inf)
        self.register_buffer("sample_bias", never, persistent=False)

    def corrupted_input(self, replaced):
        """What the discriminator reads: ids as they are, or pixels as [levels[x̃], 0] (B, L, 2)."""
        if self.tokens:
            return replaced                                                       # (B, L)
        # (B, L, 2)
        return mask_input(self.levels[replaced], torch.zeros_like(replaced, dtype=torch.bool))

    def forward(self, x_masked, lengths, original, mask, u):
        # (B, L, D_gen) -> (B, L, n_out)
        gen_logits = self.gen_head(self.generator(x_masked, lengths))
        # (B, L) each
        replaced, labels = sample_replacements(gen_logits + self.sample_bias, original, mask, u)
        # (B, L, 1)
        disc_logits = self.disc_head(self.backbone(self.corrupted_input(replaced), lengths))
        # (B, L, n_out), (B, L), (B, L)
        return gen_logits, disc_logits.squeeze(-1), labels


def rtd_losses(gen_logits, disc_logits, labels, original, mask, real):
    """Unreduced RTD losses, so micro-batches and DDP processes can divide by the global counts:
    gen (B, L) float32 = CE(gen_logits_t, original_t) where mask, else 0;
    disc (B, L) float32 = BCE(disc_logits_t, labels_t) where real, else 0. real: (B, L) bool,
    t < lengths[b] (EOS included, pads not; all True without pads).
    L = gen.sum() / mask.sum() + λ · disc.sum() / real.sum(), with the counts of the whole global
    batch (batch_loss)."""
    gen = torch.where(mask, losses(gen_logits, original), 0.0)                   # (B, L)
    # (B, L)
    bce = F.binary_cross_entropy_with_logits(disc_logits.float(), labels.float(), reduction="none")
    return gen, torch.where(real, bce, 0.0)


def discriminator_backbone(state):
    """A ReplacedTokenDetection state_dict -> the plain keys of the discriminator's backbone
    ("backbone.<...>", as a Classifier's backbone has them), for a strict load before fine-tuning;
    the generator and both heads are dropped. GDES folds backbone.encoder.weight = E + E_Δ;
    ELECTRA's is E itself; pixels keep their Linear encoder as it is."""
    out = {k: v for k, v in state.items()
           if k.startswith("backbone.") and not k.startswith("backbone.encoder.")}
    if "backbone.encoder.delta.weight" in state:                 # GDES: E_D = E + E_Δ
        out["backbone.encoder.weight"] = (state["backbone.encoder.table.weight"]
                                          + state["backbone.encoder.delta.weight"])
    else:                                                        # ELECTRA's E, or Linear(2, D)
        out.update({k: v for k, v in state.items() if k.startswith("backbone.encoder.")})
    return out


def rtd_batch_loss(model, b, rows=slice(None), scale=1.0, predictions=None):
    """batch_loss of ReplacedTokenDetection (the rtd objective's loss): L_gen + λ·L_disc of
    the rows `rows` of the global batch b, each part over the global batch's masked / real
    positions (times `scale`, the DDP processes); statistics: the generator's and discriminator's
    sums (and λ times the latter) and the discriminator's accuracy over real positions."""
    lengths = None if b.lengths is None else b.lengths[rows]
    mask, L = b.weight.bool(), b.weight.size(1)
    real = (torch.ones_like(mask) if b.lengths is None
            else torch.arange(L, device=mask.device) < b.lengths[:, None])
    mask, real = mask[rows], real[rows]
    gen_logits, disc_logits, labels = model(b.x[rows], lengths, b.target[rows], mask, b.noise[rows])
    # (b, L) each
    gen, disc = rtd_losses(gen_logits, disc_logits, labels, b.target[rows], mask, real)
    loss = (gen.sum() / b.weight.sum() + b.disc_weight * disc.sum() / real_count(b)) * scale
    correct = ((disc_logits.detach() > 0) == labels.bool()) & real
    disc = disc.detach().sum().double()
    return loss, {"n": real.sum().double(), "loss_disc": disc,
                  "weighted_disc": b.disc_weight * disc,
                  "correct": correct.sum().double(), "n_gen": mask.sum().double(),
                  "loss_gen": gen.detach().sum().double()}


def real_count(b):
    """Real positions of the global batch (all of them when nothing is padded)."""
    return b.weight.numel() if b.lengths is None else b.lengths.sum()


def totals(total):
    """A dict of summed statistics (device tensors or numbers) as floats: one read of the
    device."""
    return dict(zip(total, torch.stack([torch.as_tensor(v, dtype=torch.float64)
                                        for v in total.values()]).tolist()))


def rtd_metrics(total):
    """L_gen + λ·L_disc, the discriminator's accuracy and both parts, from rtd_batch_loss's summed
    statistics (one read of the device values)."""
    t = totals(total)
    n, gen = max(t["n"], 1e-12), t["loss_gen"] / max(t["n_gen"], 1e-12)
    return {"loss": gen + t["weighted_disc"] / n, "acc": t["correct"] / n, "gen_loss": gen,
            "disc_loss": t["loss_disc"] / n}


if __name__ == "__main__":      # python denoise.py: one masked-denoising batch, as SPT sees it
    PAD, MASK, EOS = 0, 1, 2                                   # lra/files.py's special ids (a test checks them)
    text = [b"never train from scratch", b"self pre-training"]
    L = max(len(t) for t in text) + 1
    ids = torch.full((len(text), L), PAD)                     # (B, L): bytes + 4, then EOS, then pads
    for i, t in enumerate(text):
        ids[i, :len(t)] = torch.tensor(list(t)) + 4
        ids[i, len(t)] = EOS
    lengths = torch.tensor([len(t) + 1 for t in text])        # (B,) with the EOS
    clean = Clean(ids, ids, lengths, lengths - 1, lengths, MASK)
    ratio = 0.15                                              # p, the Text tasks' mask ratio
    b = masked_batch(clean, torch.Generator().manual_seed(0), 0.0, mask_ratio=ratio)
    show = lambda row: "".join("_" if v == MASK else "·" if v in (PAD, EOS) else chr(v - 4) for v in row.tolist())
    for i in range(len(text)):
        print(f"input  {show(b.x[i])!r}")
        print(f"target {show(b.target[i])!r}")
        print(f"loss reads positions {b.weight[i].nonzero().flatten().tolist()} (weight 1; every other 0)")
    print(f"masked {int(b.weight.sum())} of {int(clean.content.sum())} content positions (mask ratio {ratio}, "
          f"at least one a row; never a pad or the EOS)")
