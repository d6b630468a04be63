"""denoise.py: the self pre-training (SPT) objectives of Amos, Berant & Gupta, "Never Train from Scratch" (ICLR 2024), §2, App. C.
masked:  M_bt ~ Bernoulli(p) on content positions (>= 1 per row);  x_in = x with M replaced;  loss = mean over M of ℓ(head(h_bt), x_bt)
causal:  x_in = x;  loss = mean over t < length-1 of ℓ(head(h_bt), x_b,t+1)      (next token; needs a causal model)
ℓ = cross-entropy over the vocabulary (token ids) or over the 256 grey levels (Pathfinder/PathX), L1 on the normalised value (Image).
Check: tests/test_denoise.py (masking rate, pads never masked, causal targets shifted exactly once).
The objectives see tensors only: token ids (B, L) long, or pixel values (B, L) float, already normalised; targets are
class ids (long: cross-entropy) or values (float: L1). Which task is which is train.py's business; so are the heads.
"""
import torch
import torch.nn.functional as F


def sample_mask(lengths, L, ratio, gen):
    """Positions to mask: each content position t < lengths[b] i.i.d. with probability `ratio`, never a pad (nor
    the EOS token, which the caller leaves out of `lengths`), at least one per sequence with lengths > 0 (else that
    row adds nothing to learn from). lengths: (B,) long -> (B, L) bool, on lengths' device.
    Random numbers come from the CPU generator `gen`, so masks do not depend on the device."""
    B = lengths.numel()
    lengths_cpu = lengths.cpu()
    real = torch.arange(L)[None, :] < lengths_cpu[:, None]                        # (B, L)
    mask = (torch.rand(B, L, generator=gen) < ratio) & real                       # (B, L)
    pick = (torch.rand(B, generator=gen) * lengths_cpu).long()                    # (B,) one uniform content position
    empty = ~mask.any(1) & (lengths_cpu > 0)                                      # (B,)
    mask[empty, pick[empty]] = True
    return mask.to(lengths.device)


def mask_input(x, mask, mask_id=None):
    """What the backbone reads (BERT-style masking, no 80/10/10 replacement; paper App. C).
    x: (B, L) long token ids -> (B, L) long with the masked ids replaced by `mask_id`;
    x: (B, L) float pixel values -> (B, L, 2) float = [value, 0 where masked; mask indicator]. Pixel models always
    read the indicator channel (all zeros when mask is all False, i.e. when fine-tuning), so the encoder of the
    pre-trained and of the fine-tuned model has one shape. mask: (B, L) bool."""
    if not x.is_floating_point():
        return x.masked_fill(mask, mask_id)                                       # (B, L)
    return torch.stack([x.masked_fill(mask, 0.0), mask.to(x.dtype)], -1)         # (B, L, 2)


def next_token(target, lengths):
    """Causal denoising: the target at t is target[t+1] (shifted exactly once here; the model must not shift again).
    The last real position has no next token and is ignored, as are pads. target: (B, L), lengths: (B,)
    -> (shifted target (B, L), mask (B, L) bool): the loss is taken where mask is True."""
    L = target.size(1)
    shifted = target.roll(-1, dims=1)                     # (B, L); shifted[:, t] = target[:, t+1], last column wraps
    mask = torch.arange(L, device=target.device)[None, :] < (lengths.to(target.device) - 1)[:, None]   # wrap unused
    return shifted, mask


def loss(pred, target):
    """Mean denoising loss over the selected positions. pred: (M, V) logits or (M, 1) values; target: (M,).
    Integer targets are classes (cross-entropy); float targets are normalised pixels (L1)."""
    if target.is_floating_point():
        return (pred.float().squeeze(-1) - target).abs().mean()
    return F.cross_entropy(pred.float(), target)
