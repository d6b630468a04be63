"""denoise.py: the self pre-training (SPT) objectives of Amos, Berant & Gupta, "Never Train from Scratch" (ICLR 2024), §2, App. C.
masked:  M_bt ~ Bernoulli(p) on real positions (>= 1 per row);  x_in = x with M replaced;  loss = mean over M of ℓ(head(h_bt), x_bt)
causal:  x_in = x;  loss = mean over t < length-1 of ℓ(head(h_bt), x_b,t+1)      (next token; needs a causal model)
ℓ = cross-entropy over the vocabulary (tokens) or over the 256 grey levels (Pathfinder/PathX), L1 on the normalised value (Image).
Check: tests/test_denoise.py (masking rate, pads never masked, causal targets shifted exactly once).
Pure functions only: the denoising head and the training loop live in train.py.
"""
import torch
import torch.nn.functional as F

import lra_data

L1_TASKS = {"image"}  # pixels regressed with L1 on the normalised value; other pixel tasks classify the 8-bit level


def n_outputs(task):
    """Width of the denoising head for `task`: V token ids, 256 grey levels, or 1 normalised value (Image)."""
    t = lra_data.TASKS[task]
    if t.kind == "tokens":
        return t.vocab_size
    return 1 if task in L1_TASKS else 256


def model_input(x, task, mask=None):
    """What the backbone reads. x: ids (B, L) or uint8 pixels (B, L); mask: (B, L) bool or None.
    tokens -> (B, L) long with masked ids replaced by MASK; pixels -> (B, L, 2) float = [normalised value, mask indicator].
    Pixel models always get the indicator channel (all zeros when nothing is masked), so the encoder of the
    pre-trained and the fine-tuned model has the same shape (spec §1)."""
    if lra_data.TASKS[task].kind == "tokens":
        return x if mask is None else x.masked_fill(mask, lra_data.MASK)
    value = lra_data.normalize(x, task).float()          # (B, L)
    if mask is None:
        mask = torch.zeros_like(value, dtype=torch.bool)  # (B, L)
    value = value.masked_fill(mask, 0.0)                 # masked pixel -> 0; the indicator tells it from a real 0
    return torch.stack([value, mask.float()], -1)        # (B, L, 2)


def target_of(x, task):
    """What the denoising head predicts at each position: the id (tokens), the grey level 0..255 as a class
    (Pathfinder/PathX), or the normalised value (Image). x: (B, L) -> (B, L) long or float."""
    if lra_data.TASKS[task].kind == "tokens":
        return x
    return lra_data.normalize(x, task).float() if task in L1_TASKS else x.long()


def sample_mask(lengths, L, ratio, gen):
    """Positions to mask: each real position i.i.d. with probability `ratio`, never a pad, at least one per
    sequence with length > 0 (else its loss is 0/0). lengths: (B,) -> (B, L) bool, on lengths' device.
    Random numbers come from the CPU generator `gen`, so masks do not depend on the device."""
    B = lengths.numel()
    lengths_cpu = lengths.cpu()
    real = torch.arange(L)[None, :] < lengths_cpu[:, None]                        # (B, L)
    mask = (torch.rand(B, L, generator=gen) < ratio) & real                       # (B, L)
    pick = (torch.rand(B, generator=gen) * lengths_cpu).long()                    # (B,) one uniform real position
    empty = ~mask.any(1) & (lengths_cpu > 0)                                      # (B,)
    mask[empty, pick[empty]] = True
    return mask.to(lengths.device)


def corrupt(x, lengths, ratio, gen, task):
    """Masked denoising (BERT-style, no 80/10/10 replacement). x: (B, L) ids or uint8 pixels, lengths: (B,).
    Returns x_in (model_input), target (B, L) and mask (B, L) bool: the loss is taken where mask is True."""
    mask = sample_mask(lengths, x.size(1), ratio, gen).to(x.device)               # (B, L)
    return model_input(x, task, mask), target_of(x, task), mask


def next_token(x, lengths, task):
    """Causal denoising: target at t is x[t+1] (shifted exactly once here; the model must not shift again).
    The last real position has no next token and is ignored, as are pads. Same returns as `corrupt`."""
    L = x.size(1)
    target = target_of(x, task).roll(-1, dims=1)          # (B, L); target[:, t] = x[:, t+1], last column wraps
    mask = torch.arange(L, device=x.device)[None, :] < (lengths.to(x.device) - 1)[:, None]  # (B, L); wrap never used
    return model_input(x, task), target, mask


def loss(pred, target):
    """Mean denoising loss over the selected positions. pred: (M, V) logits or (M, 1) values; target: (M,).
    Integer targets are classes (cross-entropy); float targets are normalised pixels (L1)."""
    if target.is_floating_point():
        return (pred.float().squeeze(-1) - target).abs().mean()
    return F.cross_entropy(pred.float(), target)


def sums(pred, target, mean_loss=None):
    """Additive statistics of one batch, so metrics over many batches are exact: n, summed loss, and either
    correct predictions (classes) or the sums that R² needs (values). pred/target as in `loss`; mean_loss: the
    batch's `loss(pred, target)` if the caller has it already (saves computing it twice)."""
    n = target.numel()
    mean_loss = loss(pred, target) if mean_loss is None else mean_loss
    out = {"n": n, "loss": mean_loss.item() * n}
    if target.is_floating_point():
        residual = pred.float().squeeze(-1) - target
        out.update(sse=residual.pow(2).sum().item(), sum=target.sum().item(), sumsq=target.pow(2).sum().item())
    else:
        out["correct"] = (pred.argmax(-1) == target).sum().item()
    return out


def add(total, batch):
    """Accumulate `sums` dicts key by key."""
    for k, v in batch.items():
        total[k] = total.get(k, 0) + v
    return total


def metrics(total):
    """loss and accuracy (classes) or R² = 1 - SSE/SST (values) from accumulated `sums`; higher metric is better."""
    n = max(total.get("n", 0), 1)
    out = {"loss": total.get("loss", float("nan")) / n}
    if "sse" in total:
        sst = total["sumsq"] - total["sum"] ** 2 / n
        out["r2"] = 1.0 - total["sse"] / max(sst, 1e-12)
    else:
        out["acc"] = total.get("correct", 0) / n
    return out
