"""heads.py: what a backbone is trained to predict on each LRA task, what it reads, and which of
a checkpoint's weights are the backbone.
classifier:  logits = W·pool(backbone(x)) over real positions (mean / max / last); Retrieval:
             [a, b, a−b, a·b] (LRA)
denoiser:    per-position head D -> V token ids | 256 grey levels (cross-entropy) | 1 normalised
             value (L1, Image)
Inputs: token ids stay ids; pixels become [normalised value, mask indicator] (Amos et al. 2024,
App. C; clean_input, which the loader's collate applies: steps.collate). The objectives (masks,
next-token targets) and the one loss are denoise.py's; a step is steps.train_epoch.
Check: tests/test_train.py (pooling ignores pads, checkpoints reload exactly; denoise.py's metrics
and masks are checked there too).
"""
import torch
import torch.nn as nn

import denoise
import lra_data


# ---- heads: what the backbone's features are trained to predict -------------------------------

def pool(h, lengths, how):
    """Pool features over real positions only (pads never count). h: (B, L, D), lengths: (B,) or
    None (nothing padded) -> (B, D), float32 at least. A row with no real position (lengths 0) pools
    to zeros, whatever `how` is."""
    # bf16 sums over 16k positions lose digits
    h = h.to(torch.promote_types(h.dtype, torch.float32))
    if lengths is None:
        return {"mean": h.mean(1), "max": h.amax(1), "last": h[:, -1]}[how]   # (B, D)
    real = torch.arange(h.size(1), device=h.device)[None, :] < lengths[:, None]   # (B, L)
    if how == "mean":
        return (h * real[..., None]).sum(1) / lengths[:, None].clamp(min=1)       # (B, D)
    if how == "max":
        z = h.masked_fill(~real[..., None], torch.finfo(h.dtype).min).amax(1)    # (B, D)
    else:                                                              # "last", for causal models
        z = h[torch.arange(h.size(0), device=h.device), (lengths - 1).clamp(min=0)]   # (B, D)
    return z.masked_fill((lengths == 0)[:, None], 0.0)                 # (B, D)


class Classifier(nn.Module):
    """backbone -> pool over real positions -> Linear to C classes. Retrieval (pair=True): both
    documents go through the same backbone (two towers); the head reads [a, b, a−b, a·b] as in LRA.
    forward: x (B, L) or (B, L, 2) or, for pairs, (B, 2, L); lengths (B,) or (B, 2) -> logits
    (B, C)."""

    def __init__(self, backbone, d_model, n_classes, pool, pair):
        super().__init__()
        self.backbone, self.pool, self.pair = backbone, pool, pair
        if pair:
            self.head = nn.Sequential(nn.Linear(4 * d_model, d_model), nn.GELU(),
                                      nn.Linear(d_model, n_classes))
        else:
            self.head = nn.Linear(d_model, n_classes)

    def forward(self, x, lengths):
        if self.pair:
            B = x.size(0)
            x = x.flatten(0, 1)                                      # (2B, L): each document alone
            lengths = None if lengths is None else lengths.flatten()     # (2B,)
        # torch.compile: an SSM backbone runs its frame eagerly (ssm.SSMBackbone.forward), which
        # splits this frame here: one graph before, one after (tools/hardware.py: compiled)
        z = pool(self.backbone(x, lengths), lengths, self.pool)          # (B or 2B, D)
        if self.pair:
            a, b = z.view(B, 2, -1).unbind(1)                            # (B, D) each
            z = torch.cat([a, b, a - b, a * b], -1)                      # (B, 4D)
        return self.head(z)                                              # (B, C)


class Denoiser(nn.Module):
    """backbone -> per-position denoising head D -> V (ids), 256 (grey levels) or 1 (Image values),
    at every position (the loss weights pick the masked ones: gathering them first would read the
    mask's size back from the device). forward(x_in, lengths) -> predictions (B, L, V)."""

    def __init__(self, backbone, d_model, n_out):
        super().__init__()
        self.backbone = backbone
        self.denoise_head = nn.Linear(d_model, n_out)

    def forward(self, x, lengths=None):
        return self.denoise_head(self.backbone(x, lengths))             # (B, L, D) -> (B, L, V)


def n_outputs(task):
    """Width of the denoising head: V token ids, 256 grey levels (Pathfinder/PathX), or 1 normalised
    value (Image)."""
    spec = lra_data.TASKS[task]
    return spec.vocab_size if spec.kind == "tokens" else (1 if task == "image" else 256)


def clean_input(x, task):
    """(input, target) of a raw batch: token ids stay ids; pixels become normalised values (paper
    App. C), and the denoising target is the grey level 0..255 as a class (Pathfinder/PathX) or the
    normalised value (Image, L1). x: (B, L) long ids or uint8 pixels -> ((B, L) long or float,
    (B, L) long or float)."""
    if lra_data.TASKS[task].kind == "tokens":
        return x, x
    value = lra_data.normalize(x, task).float()                          # (B, L)
    return value, (value if task == "image" else x.long())


def model_input(x, task):
    """What a classifier reads for a raw batch x (B, L): token ids, or pixels as (B, L, 2) [value, 0
    indicator]."""
    value = clean_input(x, task)[0]                                      # (B, L)
    return denoise.mask_input(value, torch.zeros(value.shape, dtype=torch.bool, device=x.device),
                              lra_data.MASK)


# ---- the backbone a pre-trained checkpoint hands over ----------------------------------------

def load_backbone(model, state):
    """Copy a checkpoint's backbone into a Classifier, strictly: the only keys allowed to differ are
    the checkpoint's own head (expected unexpected: denoise_head.* from SPT, or head.*) and our new
    head (expected missing: head.*). Anything else, or a shape mismatch, raises RuntimeError: a
    pre-trained backbone is never silently skipped."""
    old_head = sorted(k for k in state if not k.startswith("backbone."))
    new_head = sorted(k for k in model.state_dict() if not k.startswith("backbone."))
    result = model.load_state_dict({k: v for k, v in state.items() if k not in old_head},
                                   strict=False)
    if sorted(result.missing_keys) != new_head or result.unexpected_keys:
        raise RuntimeError(f"backbone keys do not match: missing "
                           f"{sorted(set(result.missing_keys) - set(new_head))}, "
                           f"unexpected {result.unexpected_keys}")
    return old_head, new_head


def check_init_checkpoint(ck, model_name, task, config):
    """ValueError (one line) unless checkpoint dict ck has a backbone this run (model_name on task,
    backbone config dict `config`) can fine-tune: same model, task and every config field that
    shapes the weights."""
    if (ck["model_name"], ck["task"]) != (model_name, task):
        raise ValueError(f"a {ck['model_name']} checkpoint for {ck['task']}, but this run is "
                         f"{model_name} on {task}; pass the --model and --task it was made with")
    # may differ: not in the weights
    init_only = {"dropout", "ssm_lr", "dt_min", "dt_max", "diag_init"}
    differ = [k for k in config if k not in init_only and ck["config"].get(k) != config[k]]
    if differ:
        theirs, ours = (", ".join(f"{k}={c.get(k)}" for k in differ)
                        for c in (ck["config"], config))
        raise ValueError(f"its {theirs} differ from this run's {ours}; pass the model flags it was "
                         f"made with")
