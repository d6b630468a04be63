"""train.py: self pre-training (SPT), then fine-tuning, on the Long Range Arena (Amos, Berant & Gupta, ICLR 2024).
phase 1 (--spt):  backbone + denoising head learn to restore masked (or next) inputs of the task's own train split
phase 2:          the same backbone + a fresh pooled classifier head learn the labels; without --spt it starts from
                  random init ("trained from scratch", TFS). Test accuracy is reported for the best-validation checkpoint.
    python train.py --model dlr --task pathfinder --spt --preset tiny     # the quick start (under a minute on a CPU)
    python train.py --model dlr --task pathx --spt                        # paper preset on a GPU, tiny on a CPU
    python train.py --resume runs/<run folder>                            # continue a stopped run exactly
    torchrun --nproc_per_node=4 train.py --model s4 --task pathx --spt     # DDP: 4 GPUs, --batch-size stays global
Check: tests/test_train.py (smoke runs of every model with and without --spt, checkpoints, one-batch overfit) and
tests/test_robustness.py (DDP equals 1 process, exact resume, NaN guard, bad input, --compile, memory).
"""
import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

# Before torch starts OpenMP: spinning threads wait a whole time slice for a descheduled partner in every parallel
# region, so on a shared CPU the tiny preset ran 2.6x slower (48 s vs 19 s for 30 steps). Export it to change it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from tqdm import tqdm  # noqa: E402

import denoise
import lra_data
from dlr import DLR, DLRConfig, SSM_PARAMS as DLR_SSM_PARAMS
from s4 import S4, S4Config, SSM_PARAMS as S4_SSM_PARAMS
from transformer import Transformer, TransformerConfig, SSM_PARAMS as TRANSFORMER_SSM_PARAMS

MODELS = {  # name -> (config class, backbone class, leaf names of parameters that get their own lr and no weight decay)
    "transformer": (TransformerConfig, Transformer, TRANSFORMER_SSM_PARAMS),
    "s4": (S4Config, S4, S4_SSM_PARAMS),
    "dlr": (DLRConfig, DLR, DLR_SSM_PARAMS),
}

# ---- presets: every setting a preset decides -----------------------------------------------------------------------

# --preset paper: model sizes and learning rates from spec §4 (the paper); batch size, epochs per phase and warm-up
# steps (≈ 1 epoch) from the authors' configs. pathx256 has no row in the paper's tables: it reuses PathX's settings.
PAPER_TASK = {
    "listops": dict(batch_size=50, epochs=40, warmup=2000),
    "text": dict(batch_size=16, epochs=32, warmup=5000),
    "retrieval": dict(batch_size=64, epochs=20, warmup=2500),
    "image": dict(batch_size=50, epochs=200, warmup=1000),
    "pathfinder": dict(batch_size=64, epochs=200, warmup=2500),
    "pathx": dict(batch_size=32, epochs=50, warmup=5000),
    "pathx256": dict(batch_size=32, epochs=50, warmup=5000),
}
PAPER_GENERATE = {"listops": 100_000, "pathfinder": 200_000, "pathx": 200_000, "pathx256": 200_000}  # LRA sizes, if absent
TRANSFORMER_PAPER = {  # rotary, pre-norm; lr = fine-tuning, pretrain_lr = SPT (spec §4); no weight decay
    "listops": dict(n_layers=6, d_model=512, n_heads=8, d_ff=2048, lr=1e-4, pretrain_lr=1e-3),
    "text": dict(n_layers=6, d_model=512, n_heads=8, d_ff=2048, lr=5e-4, pretrain_lr=5e-4),
    "retrieval": dict(n_layers=4, d_model=128, n_heads=4, d_ff=512, lr=5e-4, pretrain_lr=5e-3),
    "image": dict(n_layers=3, d_model=64, n_heads=4, d_ff=128, lr=1e-3, pretrain_lr=1e-3),  # FFN ×2, as the authors' config
    "pathfinder": dict(n_layers=4, d_model=128, n_heads=8, d_ff=128, lr=5e-4, pretrain_lr=1e-3),
    "pathx": dict(n_layers=4, d_model=128, n_heads=4, d_ff=128, block_size=4096, lr=5e-4, pretrain_lr=1e-3),
    "pathx256": dict(n_layers=4, d_model=128, n_heads=4, d_ff=128, block_size=4096, lr=5e-4, pretrain_lr=1e-3),
}
S4_PAPER = {  # bidirectional, d_state 64, HiPPO-LegS, GLU; lr 0.01 from scratch (PathX 5e-4), 1e-3 with SPT
    "listops": dict(n_layers=8, d_model=128, norm="batch", prenorm=False),
    "text": dict(n_layers=6, d_model=256, norm="batch", prenorm=True),
    "retrieval": dict(n_layers=6, d_model=256, norm="batch", prenorm=True),
    "image": dict(n_layers=6, d_model=512, norm="layer", prenorm=False, dropout=0.1),
    "pathfinder": dict(n_layers=6, d_model=256, norm="batch", prenorm=True),
    "pathx": dict(n_layers=6, d_model=256, norm="batch", prenorm=True, dt_min=1e-4),
    "pathx256": dict(n_layers=6, d_model=256, norm="batch", prenorm=True, dt_min=1e-4),
}

# --preset tiny / small: CPU-sized runs of the real tasks. `generate` = examples made (80/10/10; ListOps 96/2/2) when a
# synthetic task's files are absent; max_train / max_eval cap the examples used, so the run time does not depend on
# what is on disk. `epochs` is per phase (SPT and fine-tuning get the same).
CPU_MODEL = {
    "tiny": dict(d_model=32, n_layers=2, d_state=64, n_heads=4, d_ff=64, dropout=0.0, weight_decay=0.01, lr=2e-3, pretrain_lr=2e-3, warmup=20),
    "small": dict(d_model=64, n_layers=4, d_state=64, n_heads=4, d_ff=128, dropout=0.0, weight_decay=0.01, lr=2e-3, pretrain_lr=2e-3, warmup=100),
}
CPU_TASK = {
    "tiny": {
        "listops": dict(epochs=3, batch_size=32, generate=12000, max_train=1000, max_eval=240),
        "text": dict(epochs=2, batch_size=16, generate=None, max_train=500, max_eval=200),
        "retrieval": dict(epochs=2, batch_size=16, generate=None, max_train=400, max_eval=100),
        "image": dict(epochs=3, batch_size=32, generate=None, max_train=2000, max_eval=500),
        "pathfinder": dict(epochs=2, batch_size=32, generate=2500, max_train=2000, max_eval=250),
        "pathx": dict(epochs=1, batch_size=16, generate=800, max_train=640, max_eval=80),
        "pathx256": dict(epochs=1, batch_size=8, generate=100, max_train=80, max_eval=10),
    },
    "small": {
        "listops": dict(epochs=10, batch_size=32, generate=50000, max_train=10000, max_eval=1000),
        "text": dict(epochs=4, batch_size=16, generate=None, max_train=2500, max_eval=500),
        "retrieval": dict(epochs=4, batch_size=16, generate=None, max_train=2000, max_eval=500),
        "image": dict(epochs=10, batch_size=32, generate=None, max_train=10000, max_eval=1000),
        "pathfinder": dict(epochs=10, batch_size=32, generate=12000, max_train=9600, max_eval=1200),
        "pathx": dict(epochs=3, batch_size=16, generate=2500, max_train=2000, max_eval=250),
        "pathx256": dict(epochs=2, batch_size=8, generate=500, max_train=400, max_eval=50),
    },
}
# Where a model is much slower on a CPU than DLR, the CPU presets give it 1/share of the examples (and smaller batches,
# so it takes as many steps). Measured at tiny sizes: at L = 16384 a step of S4 (NPLR kernel) costs about 4x DLR's and
# one of the Transformer (block-local attention) about 40x; on ListOps (L up to 2,000) the Transformer costs about 16x.
CPU_SHARE = {("s4", "pathx"): 4, ("s4", "pathx256"): 4, ("transformer", "pathx"): 20, ("transformer", "pathx256"): 20,
             ("transformer", "listops"): 4, ("transformer", "text"): 4, ("transformer", "retrieval"): 4}


def preset_values(preset, model, task, spt):
    """Every setting the preset decides for (model, task): training flags and model-config fields. Flags given
    explicitly on the command line override these (main does that)."""
    if preset != "paper":
        values = {**CPU_MODEL[preset], **CPU_TASK[preset][task]}
        values["pretrain_epochs"] = values["epochs"]
        share = CPU_SHARE.get((model, task), 1)
        values.update(max_train=values["max_train"] // share, max_eval=max(16, values["max_eval"] // share),
                      batch_size=max(4, values["batch_size"] // share))
        return values
    values = dict(PAPER_TASK[task], generate=PAPER_GENERATE.get(task), max_train=0, max_eval=0, dropout=0.0)
    if model == "transformer":
        values.update(weight_decay=0.0, **TRANSFORMER_PAPER[task])
    else:
        lr = 5e-4 if task.startswith("pathx") else (1e-3 if spt else 1e-2)  # spec §4: S4+SPT uses 5e-4..1e-3
        values.update(weight_decay=0.05, d_state=64 if model == "s4" else 1024, lr=lr, pretrain_lr=min(lr, 1e-3))
        values.update(S4_PAPER[task])
        if model == "dlr":  # "as S4 with LayerNorm" (spec §4)
            values.update(norm="layer", prenorm=True)
    values["pretrain_epochs"] = values["epochs"]
    return values


def model_config(model, task, values, causal=False):
    """The backbone config of `model` for `task`: the fields of `values` (a preset's, plus explicit flags) that the
    config class has, the input kind of the task (tokens: vocab_size; pixels: d_input = 2, value + mask indicator),
    and causal (Transformer) / bidirectional (S4, DLR). Used by main(), bench.py and tests/test_paper_presets.py."""
    Config, spec = MODELS[model][0], lra_data.TASKS[task]
    kw = {**values, "vocab_size": spec.vocab_size if spec.kind == "tokens" else None,
          "d_input": 1 if spec.kind == "tokens" else 2, "causal": causal, "bidirectional": not causal}
    fields = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in kw.items() if k in fields})


# ---- optimiser and schedule ----------------------------------------------------------------------------------------

def param_groups(model, lr, wd, ssm_lr, ssm_names):
    """AdamW groups: SSM parameters (leaf name in ssm_names) get ssm_lr and no weight decay (spec §3: with the global
    lr and decay, S4 loses a lot of accuracy); norms, biases and embeddings get no weight decay; the rest gets wd.
    Every parameter lands in exactly one group (tests/test_train.py). Prints the group sizes."""
    decay, no_decay, ssm, seen = [], [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if name in ssm_names:
                ssm.append(p)
            elif name == "bias" or isinstance(module, nn.Embedding) or "Norm" in type(module).__name__:
                no_decay.append(p)  # LayerNorm, BatchNorm*, RMSNorm, GroupNorm, ... by class name
            else:
                decay.append(p)
    size = lambda ps: sum(p.numel() for p in ps)
    print(f"param groups: decay {size(decay):,} (lr {lr:.1e}, wd {wd}) | no-decay {size(no_decay):,} (norms, biases, "
          f"embeddings) | ssm {size(ssm):,} (lr {ssm_lr:.1e}, wd 0)")
    groups = [dict(params=decay, lr=lr, weight_decay=wd), dict(params=no_decay, lr=lr, weight_decay=0.0),
              dict(params=ssm, lr=ssm_lr, weight_decay=0.0)]
    return [g for g in groups if g["params"]]


def lr_factor(step, warmup, total, schedule):
    """Multiplier of every group's lr: linear warm-up over `warmup` steps, then constant (the paper's) or cosine to 0."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return 1.0


# ---- heads, building and loading models, checkpoints ---------------------------------------------------------------

def pool(h, lengths, how):
    """Pool features over real positions only (pads never count). h: (B, L, D), lengths: (B,) -> (B, D) float32."""
    h = h.float()                                                      # bf16 sums over 16k positions lose digits
    real = torch.arange(h.size(1), device=h.device)[None, :] < lengths[:, None]   # (B, L)
    if how == "mean":
        return (h * real[..., None]).sum(1) / lengths[:, None].clamp(min=1)       # (B, D)
    if how == "max":
        return h.masked_fill(~real[..., None], torch.finfo(h.dtype).min).amax(1)  # (B, D)
    return h[torch.arange(h.size(0), device=h.device), (lengths - 1).clamp(min=0)]  # (B, D) "last", for causal models


class Classifier(nn.Module):
    """backbone -> pool over real positions -> Linear to C classes. Retrieval (pair=True): both documents go through
    the same backbone (two towers); the head reads [a, b, a−b, a·b] as in LRA. forward: x (B, L) or (B, L, 2) or,
    for pairs, (B, 2, L); lengths (B,) or (B, 2) -> logits (B, C)."""

    def __init__(self, backbone, d_model, n_classes, pool, pair):
        super().__init__()
        self.backbone, self.pool, self.pair = backbone, pool, pair
        if pair:
            self.head = nn.Sequential(nn.Linear(4 * d_model, d_model), nn.GELU(), nn.Linear(d_model, n_classes))
        else:
            self.head = nn.Linear(d_model, n_classes)

    def forward(self, x, lengths):
        if self.pair:
            B = x.size(0)
            x, lengths = x.flatten(0, 1), lengths.flatten()              # (2B, L), (2B,): each document alone
        z = pool(self.backbone(x, lengths), lengths, self.pool)          # (B or 2B, D)
        if self.pair:
            a, b = z.view(B, 2, -1).unbind(1)                            # (B, D) each
            z = torch.cat([a, b, a - b, a * b], -1)                      # (B, 4D)
        return self.head(z)                                              # (B, C)


class Denoiser(nn.Module):
    """backbone -> per-position denoising head D -> V (ids), 256 (grey levels) or 1 (Image values). The head is applied
    only where the loss is taken: forward(x_in, lengths, mask (B, L) bool) -> predictions (M, V), M = mask.sum()."""

    def __init__(self, backbone, d_model, n_out):
        super().__init__()
        self.backbone = backbone
        self.denoise_head = nn.Linear(d_model, n_out)

    def forward(self, x, lengths, mask):
        return self.denoise_head(self.backbone(x, lengths)[mask])       # (B, L, D) -> (M, D) -> (M, V)


def build_model(ck):
    """Rebuild the model of a checkpoint dict without the CLI: Classifier or Denoiser around MODELS[...] backbone."""
    Config, Model, _ = MODELS[ck["model_name"]]
    backbone, head = Model(Config(**ck["config"])), ck["head"]
    if head["kind"] == "denoise":
        return Denoiser(backbone, ck["config"]["d_model"], head["n_out"])
    return Classifier(backbone, ck["config"]["d_model"], head["n_classes"], head["pool"], head["pair"])


def load_model(path, device="cpu"):
    """Load a checkpoint written by train.py: returns (model in eval mode, the checkpoint dict)."""
    ck = torch.load(path, map_location=device, weights_only=True)
    model = build_model(ck).to(device)
    model.load_state_dict(ck["model"])
    return model.eval(), ck


def load_backbone(model, state):
    """Copy a checkpoint's backbone into a Classifier, strictly: the only keys allowed to differ are the checkpoint's
    own head (expected unexpected: denoise_head.* from SPT, or head.*) and our new head (expected missing: head.*).
    Anything else, or a shape mismatch, raises: a pre-trained backbone must never be silently skipped."""
    old_head = sorted(k for k in state if not k.startswith("backbone."))
    new_head = sorted(k for k in model.state_dict() if not k.startswith("backbone."))
    result = model.load_state_dict({k: v for k, v in state.items() if k not in old_head}, strict=False)
    if sorted(result.missing_keys) != new_head or result.unexpected_keys:
        raise RuntimeError(f"backbone keys do not match: missing {sorted(set(result.missing_keys) - set(new_head))}, "
                           f"unexpected {result.unexpected_keys}")
    return old_head, new_head


def read_checkpoint_for_init(path, model_name, task, config, device):
    """Read a checkpoint whose backbone is to be fine-tuned; ValueError (one line) if it cannot serve this run."""
    try:
        ck = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:                                               # not written by torch.save, or not plain data
        raise ValueError(f"--init-from {path}: cannot read it as a train.py checkpoint ({type(e).__name__})") from None
    if not isinstance(ck, dict) or not {"model", "config", "model_name", "task"} <= set(ck):
        raise ValueError(f"--init-from {path}: not a train.py checkpoint (no model/config/model_name/task entries)")
    if (ck["model_name"], ck["task"]) != (model_name, task):
        raise ValueError(f"--init-from {path}: a {ck['model_name']} checkpoint for {ck['task']}, but this run is "
                         f"{model_name} on {task}; pass the --model and --task it was made with")
    init_only = {"dropout", "ssm_lr", "dt_min", "dt_max", "diag_init"}          # may differ: not in the weights
    differ = [k for k in config if k not in init_only and ck["config"].get(k) != config[k]]
    if differ:
        theirs, ours = (", ".join(f"{k}={c.get(k)}" for k in differ) for c in (ck["config"], config))
        raise ValueError(f"--init-from {path}: its {theirs} differ from this run's {ours}; pass the model flags it was made with")
    return ck


def save_checkpoint(path, state):
    """Write a plain dict atomically (temporary file, then os.replace): a kill mid-write leaves the old file intact."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


# ---- DDP: which rows of a batch are this process's, and sums over processes ----------------------------------------

def shard(n):
    """(rows, keep): this process's contiguous share of a global batch of n examples (DDP; one process: all of it).
    Every process reads the whole global batch, so batches and SPT masks are those of a 1-process run. A process left
    without rows (a last batch smaller than the world) computes row 0 with keep=False, to join the gradient all-reduce."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    start = rank * (n // world) + min(rank, n % world)
    stop = start + n // world + (rank < n % world)
    return (slice(start, stop), True) if stop > start else (slice(0, 1), False)


def all_sum(sums):
    """Add up the `sums` dicts (denoise.sums) of all DDP processes: metrics of the whole batch or split, as 1 process."""
    if not dist.is_initialized():
        return sums
    total = torch.tensor([float(v) for v in sums.values()], dtype=torch.float64,   # same keys, same order everywhere
                         device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(total)
    return dict(zip(sums, total.tolist()))


# ---- one batch, one evaluation, one phase --------------------------------------------------------------------------

def spt_batch(model, batch, gen, task, objective, ratio, rows):
    """One denoising batch, the examples `rows` of it: corrupt (or shift) the inputs, predict at the selected positions
    -> (loss, sums). Masks are drawn for the whole batch, then cut, so each DDP process masks as one process would."""
    x, lengths, _ = batch                                                # labels are not used in pre-training
    device = next(model.parameters()).device
    x, lengths = x.to(device), lengths.to(device)
    if lra_data.TASKS[task].pair:                                        # (2B, L), (2B,): each document on its own
        x, lengths, rows = x.flatten(0, 1), lengths.flatten(), slice(2 * rows.start, 2 * rows.stop)
    if objective == "masked":
        x_in, target, mask = denoise.corrupt(x, lengths, ratio, gen, task)
    else:
        x_in, target, mask = denoise.next_token(x, lengths, task)
    x_in, target, mask, lengths = x_in[rows], target[rows], mask[rows], lengths[rows]   # (b, L, ...)
    pred = model(x_in, lengths, mask)                                    # (M, V) or (M, 1)
    target = target[mask]                                                # (M,)
    loss = denoise.loss(pred, target)
    return loss, denoise.sums(pred.detach(), target, loss.detach())


def finetune_batch(model, batch, gen, task, rows=slice(None)):
    """One classification batch, the examples `rows` of it -> (cross-entropy, sums). `gen` is unused."""
    x, lengths, y = (t[rows] for t in batch)
    device = next(model.parameters()).device
    x, lengths, y = denoise.model_input(x.to(device), task), lengths.to(device), y.to(device)  # pixels -> (B, L, 2)
    logits = model(x, lengths)                                           # (B, C)
    loss = denoise.loss(logits, y)                                       # cross-entropy
    return loss, denoise.sums(logits.detach(), y, loss.detach())


@torch.no_grad()
def evaluate(model, batch_fn, loader, seed, amp):
    """Metrics over a whole split; SPT masks come from a generator re-seeded every time, so epochs compare alike.
    DDP: each process scores its rows of every batch and the sums are added up."""
    model.eval()
    gen, total = torch.Generator().manual_seed(seed), {}
    for batch in loader:
        rows, keep = shard(len(batch[2]))
        with amp():
            sums = batch_fn(model, batch, gen, rows=rows)[1]
        denoise.add(total, sums if keep else dict.fromkeys(sums, 0))
    model.train()
    return denoise.metrics(all_sum(total))


def check_finite(loss, model, phase, step):
    """Stop at the first non-finite loss or gradient (called after backward, before the optimiser step), naming the
    step and the first parameter whose gradient (or value) is not finite. Checkpoints written so far stay valid."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if torch.isfinite(loss) and (not grads or torch.isfinite(torch.stack([g.float().norm() for g in grads]).sum())):
        return
    bad = next((f"gradient of {n}" for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()),
               next((f"value of {n}" for n, p in model.named_parameters() if not p.isfinite().all()), "no parameter"))
    raise SystemExit(f"train.py: {phase} step {step}: loss {loss.item():.4g}, first non-finite: {bad}; stopped before "
                     f"the optimiser step, checkpoints so far are intact (try a lower --lr / --pretrain-lr)")


def run_phase(phase, model, batch_fn, train_set, val_loader, epochs, lr, args, ssm_names, run_dir, meta, log, resume=None):
    """Train for `epochs` epochs (AdamW, warm-up schedule); after every args.eval_every-th epoch and the last, evaluate
    on val and write two checkpoints: the best so far (spt.pt or best.pt) and last.pt, the state to continue from.
    `resume`: a last.pt of this phase; training then continues after its epoch exactly as if never stopped (model,
    optimiser, schedule, RNG states).
    Returns {"metric": name, "best": value, "epoch": best epoch, "steps": steps, "seconds": wall time}."""
    start, device = time.time(), next(model.parameters()).device
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    forward = DDP(model, device_ids=[device] if device.type == "cuda" else None) if world > 1 else model
    forward = torch.compile(forward) if args.compile else forward       # save `model`: no `module.`, `_orig_mod.`
    ssm_lr = meta["config"].get("ssm_lr", lr)
    opt = torch.optim.AdamW(param_groups(model, lr, args.weight_decay, ssm_lr, ssm_names), betas=(0.9, 0.999))
    steps_per_epoch = math.ceil(len(train_set) / args.batch_size)
    total = min(epochs * steps_per_epoch, args.max_steps or float("inf"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, partial(lr_factor, warmup=args.warmup, total=total, schedule=args.schedule))
    order_gen = torch.Generator().manual_seed(args.seed + 1)             # batch order, the same in TFS and SPT runs
    mask_gen = torch.Generator().manual_seed(args.seed + 2)              # SPT masks
    on_cuda = device.type == "cuda"
    amp = partial(torch.autocast, "cuda", torch.bfloat16) if args.amp and on_cuda else contextlib.nullcontext
    name = "r2" if denoise.n_outputs(args.task) == 1 and phase == "spt" else "acc"
    # Selection: fine-tuning by val accuracy; SPT by val denoising loss, because masked accuracy on Pathfinder sits at
    # the share of black pixels (≈ 0.66) for epochs while the loss keeps falling.
    select = "loss" if phase == "spt" else "acc"
    score = lambda metrics: -metrics["loss"] if select == "loss" else metrics["acc"]
    best, step, first_epoch, before = {"name": f"val_{select}", "value": None, "epoch": 0, "val": {}}, 0, 1, 0.0
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        sched.load_state_dict(resume["scheduler"])
        torch.set_rng_state(resume["rng"]["torch"])
        if on_cuda and resume["rng"]["cuda"] is not None:                # this GPU's only: the GPU count may change
            torch.cuda.set_rng_state(resume["rng"]["cuda"], device)
        order_gen.set_state(resume["rng"]["order"])
        mask_gen.set_state(resume["rng"]["mask"])
        best, step, first_epoch, before = resume["best"], resume["step"], resume["epoch"] + 1, resume["seconds"]
    model.train()
    train = {}                                                           # training-metric sums since the last evaluation
    for epoch in range(first_epoch, epochs + 1):
        if step >= total:
            break
        if rank > 0:                        # own dropout masks per process; rank 0's RNG is the one checkpointed
            torch.manual_seed(args.seed + 1000 * rank + epoch)
        order = torch.randperm(len(train_set), generator=order_gen).tolist()      # global batches, on every process
        loader = torch.utils.data.DataLoader(torch.utils.data.Subset(train_set, order), args.batch_size,
                                             collate_fn=lra_data.collate, num_workers=args.workers)
        bar = tqdm(loader, desc=f"{phase} {epoch}/{epochs}", leave=False, dynamic_ncols=True, mininterval=1.0, disable=rank > 0)
        for batch in bar:
            rows, keep = shard(len(batch[2]))                            # this process's examples of the batch
            with amp():
                loss, sums = batch_fn(forward, batch, mask_gen, rows=rows)
            sums = sums if keep else dict.fromkeys(sums, 0)
            if world > 1:  # DDP averages the processes' gradients: weigh each one's mean loss by its share of the
                loss = loss * sums["n"] * world / all_sum({"n": sums["n"]})["n"]   # global count (masks vary)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            check_finite(loss, model, phase, step)
            opt.step()
            sched.step()
            step += 1
            m = denoise.metrics(denoise.add(train, sums))                # this process's share, for the bar
            bar.set_postfix({"loss": f"{m['loss']:.4f}", name: f"{m[name]:.3f}"}, refresh=False)  # drawn at mininterval
            if step >= total:
                break
        bar.close()
        if epoch % args.eval_every and epoch < epochs and step < total:  # evaluate (and checkpoint) every k-th epoch
            continue                                                     # and after the last
        m = denoise.metrics(all_sum(train))                              # training metrics since the last evaluation
        train = {}
        val = evaluate(forward, batch_fn, val_loader, args.seed + 3, amp)
        improved = best["epoch"] == 0 or score(val) > score(best["val"])
        if improved:
            best = {"name": f"val_{select}", "value": val[select], "epoch": epoch, "val": val}
        seconds = before + time.time() - start
        state = {**meta, "model": model.state_dict(), "phase": phase, "epoch": epoch, "step": step, "best": best,
                 "seconds": seconds, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if on_cuda else None,
                         "order": order_gen.get_state(), "mask": mask_gen.get_state()}}
        if rank == 0:                                                    # DDP: one writer, the states are equal
            if improved:
                save_checkpoint(run_dir / ("spt.pt" if phase == "spt" else "best.pt"), state)
            save_checkpoint(run_dir / "last.pt", state)                  # written last: resume never misses a best
        lr_now = opt.param_groups[0]["lr"]
        log(f"eval {phase:8s} epoch {epoch:3d}/{epochs} step {step:6d} | train_loss {m['loss']:.4f} {name} "
            f"{m[name]:.4f} | val_loss {val['loss']:.4f} val_{name} {val[name]:.4f}{' *' if improved else '  '} | "
            f"lr {lr_now:.1e} | {seconds:.0f} s",
            {"phase": phase, "epoch": epoch, "step": step, "train_loss": m["loss"], f"train_{name}": m[name],
             "val_loss": val["loss"], f"val_{name}": val[name], "lr": lr_now, "elapsed_s": seconds})
    if world > 1:
        dist.barrier()                                                   # the others read spt.pt / best.pt next
    return {"metric": best["name"], "best": best["value"], "epoch": best["epoch"], "val": best["val"], "steps": step,
            "seconds": before + time.time() - start}


# ---- the script: flags, data, model, SPT, fine-tuning, test --------------------------------------------------------

def git_commit():
    """Short commit of the repo this file is in (plus -dirty), or 'unknown' outside git."""
    here = Path(__file__).resolve().parent
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=here, capture_output=True, text=True, timeout=5).stdout.strip()
        return (run("rev-parse", "--short", "HEAD") or "unknown") + ("-dirty" if run("status", "--porcelain") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def fail(message):
    """Bad input: one line on stderr (from rank 0 only, under torchrun) and exit status 2, never a traceback."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"train.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv=None):
    p = argparse.ArgumentParser(description="Self pre-training (SPT) and fine-tuning on the Long Range Arena.")
    p.add_argument("--model", choices=MODELS, default="dlr", help="backbone: transformer, s4 or dlr")
    p.add_argument("--task", choices=lra_data.TASKS, default="pathfinder", help="listops, text, retrieval, image, pathfinder, pathx, pathx256")
    p.add_argument("--spt", action="store_true", help="self pre-train by denoising on the train split, then fine-tune")
    p.add_argument("--objective", choices=["masked", "causal"], default="masked", help="SPT objective; causal (next token) needs --causal")
    p.add_argument("--causal", action="store_true", help="causal Transformer / unidirectional S4 and DLR")
    p.add_argument("--mask-ratio", type=float, default=None, help="masked SPT: share of positions masked (default: the task's, spec §1)")
    p.add_argument("--preset", choices=["tiny", "small", "paper"], default=None, help="sizes and budget (default: paper with CUDA, else tiny)")
    p.add_argument("--epochs", type=int, default=None, help="fine-tuning epochs (default: preset)")
    p.add_argument("--pretrain-epochs", type=int, default=None, help="SPT epochs (default: preset)")
    p.add_argument("--eval-every", type=int, default=1, help="evaluate on val and checkpoint every this many epochs "
                   "and after the last (--resume continues from the last evaluation); >1 keeps tiny training sets from "
                   "spending their time on val")
    p.add_argument("--max-steps", type=int, default=0, help="stop each phase after this many steps (0: no limit)")
    p.add_argument("--batch-size", type=int, default=None, help="examples per step, all processes together (default: preset)")
    p.add_argument("--lr", type=float, default=None, help="fine-tuning learning rate (default: preset)")
    p.add_argument("--pretrain-lr", type=float, default=None, help="SPT learning rate (default: preset)")
    p.add_argument("--ssm-lr", type=float, default=None, help="lr of the SSM parameters, no weight decay (default: the model config's)")
    p.add_argument("--weight-decay", type=float, default=None, help="AdamW weight decay (default: preset)")
    p.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default: preset)")
    p.add_argument("--schedule", choices=["constant", "cosine"], default="constant", help="lr after warm-up")
    p.add_argument("--d-model", type=int, default=None, help="model width D (default: preset)")
    p.add_argument("--n-layers", type=int, default=None, help="number of layers (default: preset)")
    p.add_argument("--d-state", type=int, default=None, help="SSM state size N (default: preset)")
    p.add_argument("--dropout", type=float, default=None, help="dropout (default: preset)")
    p.add_argument("--pool", choices=["mean", "max", "last"], default=None, help="pooling over real positions (default: the task's)")
    p.add_argument("--data-dir", default="data", help="folder with the LRA release, IMDB or CIFAR files; synthetic tasks are generated here")
    p.add_argument("--difficulty", choices=["easy", "intermediate", "hard"], default="hard", help="Pathfinder/PathX contour length 6, 9 or 14")
    p.add_argument("--generate", type=int, default=None, help="examples to generate when ListOps/Pathfinder/PathX files are absent, 0: never (default: preset)")
    p.add_argument("--data-fraction", type=float, default=1.0, help="use this fraction of the train split (nested prefixes)")
    p.add_argument("--max-len", type=int, default=None, help="text, retrieval: cut each document to this many tokens, "
                   "EOS included (default: LRA's 4096 / 4000)")
    p.add_argument("--max-train", type=int, default=None, help="use at most this many training examples, 0: all (default: preset)")
    p.add_argument("--max-eval", type=int, default=None, help="use at most this many val and test examples, 0: all (default: preset)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--seed", type=int, default=0, help="seed of the model init; batch order and masks use seed+1, seed+2")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--amp", action="store_true", help="bf16 autocast on CUDA (the FFT convolutions stay float32)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (checkpoints keep plain keys)")
    p.add_argument("--out", default="runs", help="parent folder of the run folder")
    p.add_argument("--init-from", default=None, help="fine-tune from the backbone of this checkpoint (e.g. an earlier run's spt.pt)")
    p.add_argument("--resume", default=None, help="continue the stopped run in this folder from its last.pt, with its own settings")
    p.error = lambda message: fail(f"{message} (python train.py --help lists the flags)")   # not the 30-line usage
    args = p.parse_args(argv)
    t_start = time.time()
    resume = None
    if args.resume:                                                      # only --device may differ from the saved run
        if not (Path(args.resume) / "last.pt").is_file():
            fail(f"--resume {args.resume}: no last.pt in that folder (a run writes it at its first evaluation)")
        resume = torch.load(Path(args.resume) / "last.pt", map_location="cpu", weights_only=True)
        defaults = vars(p.parse_args([]))                                # flags newer than the checkpoint: defaults
        args = argparse.Namespace(**{**defaults, **resume["args"], "resume": args.resume, "device": args.device})

    # ---- settings: preset first, then explicit flags win ------------------------------------------------------------
    how = "given" if args.preset else ("default: CUDA found" if torch.cuda.is_available() else "default: no CUDA, the CPU preset")
    preset = args.preset = args.preset or ("paper" if torch.cuda.is_available() else "tiny")
    task = lra_data.TASKS[args.task]
    _, Model, ssm_names = MODELS[args.model]
    config_kw = {}                                     # model-only knobs (n_heads, norm, dt_min, ...); model_config
                                                       # keeps those that this model's config has
    for key, value in preset_values(preset, args.model, args.task, args.spt).items():
        if hasattr(args, key):
            setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
        else:
            config_kw[key] = value
    args.pool = args.pool or task.pool
    args.mask_ratio = task.mask_ratio if args.mask_ratio is None else args.mask_ratio
    if not 0 < args.mask_ratio < 1:
        fail(f"--mask-ratio {args.mask_ratio} must be in (0, 1)")
    if not 0 < args.data_fraction <= 1:
        fail(f"--data-fraction {args.data_fraction} must be in (0, 1]")
    if args.spt and args.objective == "causal" and not args.causal:
        fail("--objective causal trains next-token prediction, which a bidirectional model solves by looking ahead: "
             "add --causal (causal Transformer / unidirectional SSM), or use --objective masked")
    if args.spt and args.init_from:
        fail("--init-from already supplies a pre-trained backbone: drop --spt (or --init-from)")
    if args.init_from and not Path(args.init_from).is_file():
        fail(f"--init-from {args.init_from}: no such checkpoint file")
    if min(args.epochs, args.pretrain_epochs if args.spt else 1) < 1:
        fail("--epochs and --pretrain-epochs must be at least 1")
    if args.eval_every < 1:
        fail(f"--eval-every {args.eval_every} must be at least 1 (epochs between evaluations)")
    if args.max_len is not None and (args.task not in ("text", "retrieval") or not 2 <= args.max_len <= task.max_len):
        fail(f"--max-len {args.max_len}: only text and retrieval documents can be cut, to 2..{task.max_len} tokens "
             f"(ListOps answers need the whole expression; pixel tasks have a fixed length)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {args.device}: no CUDA device is visible to PyTorch; use --device cpu")

    # ---- DDP: torchrun starts WORLD_SIZE copies of this script and sets RANK and LOCAL_RANK in each ------------------
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.batch_size % world:
        fail(f"--batch-size {args.batch_size} is the global batch: it must split evenly over the {world} processes")
    if world > 1:
        cuda = device.type == "cuda"
        if cuda:                                                         # one GPU per process
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        if rank > 0:                                                     # only rank 0 prints, logs and saves
            sys.stdout = open(os.devnull, "w")
    lines, run_dir = [], None
    def log(line, record=None):      # console, log.txt (+ log.jsonl); rank 0 writes, once the run folder exists
        print(line, flush=True)
        lines.append(line)
        if run_dir is None or rank > 0:
            return
        with open(run_dir / "log.txt", "a") as f:
            f.write("".join(f"{line}\n" for line in lines))
        lines.clear()
        if record is not None:
            with open(run_dir / "log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
    log(f"preset {preset} ({how}); explicit flags override it")
    if args.spt:
        plan = f"SPT {args.objective}{f' (mask ratio {args.mask_ratio})' if args.objective == 'masked' else ''}, then fine-tune"
    else:
        plan = f"fine-tune from {args.init_from}" if args.init_from else "from scratch (TFS)"
    log(f"run: {args.model} on {args.task} | {plan} | seed {args.seed}")
    log(f"device {device}{f' × {world} processes (DDP)' if world > 1 else ''}"
        f"{' + bf16 autocast' if args.amp and device.type == 'cuda' else ''}{' + torch.compile' if args.compile else ''}"
        f" | torch {torch.__version__} | git {git_commit()}")
    if args.amp and device.type != "cuda":
        log("note: --amp is ignored on CPU (bf16 autocast is for CUDA)")
    log("settings: " + " ".join(f"{k}={v}" for k, v in vars(args).items()))

    # ---- data -----------------------------------------------------------------------------------------------------
    t_data = time.time()
    if args.data_dir != "data" and not Path(args.data_dir).is_dir():  # a typo must not silently generate data there
        fail(f"--data-dir {args.data_dir}: no such folder (synthetic tasks are generated only into an existing "
             f"folder or the default ./data)")
    if rank > 0:
        dist.barrier()                     # rank 0 generates and caches the data first; the others then only read it
    try:
        splits = {split: lra_data.load(args.task, split, args.data_dir, data_fraction=args.data_fraction if split == "train" else 1.0,
                                       difficulty=args.difficulty, generate=args.generate or None, workers=os.cpu_count() or 1,
                                       max_len=args.max_len)
                  for split in ("train", "val", "test")}
    except lra_data.DataError as e:
        fail(str(e))
    if rank == 0 and world > 1:
        dist.barrier()
    source = getattr(splits["train"], "source", "unknown")
    caps = {"train": args.max_train, "val": args.max_eval, "test": args.max_eval}
    for split, cap in caps.items():
        if cap and len(splits[split]) > cap:  # a fixed random subset (nested across sizes), not the first files on disk
            keep = torch.randperm(len(splits[split]), generator=torch.Generator().manual_seed(0))[:cap].sort().values
            splits[split] = torch.utils.data.Subset(splits[split], keep.tolist())
        if len(splits[split]) == 0:
            fail(f"the {split} split of {args.task} in {args.data_dir} is empty")
    seconds = {"data": time.time() - t_data}
    log(f"data: {source} | train {len(splits['train']):,} / val {len(splits['val']):,} / test {len(splits['test']):,}"
        f" | {time.time() - t_data:.1f} s")
    eval_loader = lambda split: torch.utils.data.DataLoader(splits[split], args.batch_size, collate_fn=lra_data.collate, num_workers=args.workers)

    # ---- model --------------------------------------------------------------------------------------------------
    flag_kw = dict(d_model=args.d_model, n_layers=args.n_layers, d_state=args.d_state, dropout=args.dropout, ssm_lr=args.ssm_lr)
    config_kw.update({k: v for k, v in flag_kw.items() if v is not None})
    cfg = model_config(args.model, args.task, config_kw, args.causal)
    config = dataclasses.asdict(cfg)
    head = dict(kind="classifier", n_classes=task.n_classes, pool=args.pool, pair=task.pair)
    meta = dict(model_name=args.model, task=args.task, config=config, head=head, args=vars(args))
    torch.manual_seed(args.seed)                                         # model init
    classifier = build_model(meta).to(device)
    n_backbone = sum(p.numel() for p in classifier.backbone.parameters())
    n_head = sum(p.numel() for p in classifier.head.parameters())
    log(f"model {Model.__name__}({', '.join(f'{k}={v}' for k, v in config.items())})")
    log(f"params: backbone {n_backbone:,} + classifier head {n_head:,} = {n_backbone + n_head:,}")

    init_ck, init_path = None, args.init_from
    if args.init_from and not args.resume:
        try:
            init_ck = read_checkpoint_for_init(args.init_from, args.model, args.task, config, device)
        except ValueError as e:
            fail(str(e))

    # ---- run folder (DDP: rank 0 names and writes it; all processes read the checkpoints in it) -------------------
    kind = "spt" if args.spt else ("init" if args.init_from else "tfs")
    folder = Path(args.out) / f"{args.task}-{args.model}-{kind}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    suffix = 1
    while folder.exists() and not resume:                               # two runs started in the same second
        folder, suffix = folder.with_name(folder.name.rsplit("+", 1)[0] + f"+{suffix}"), suffix + 1
    if world > 1:                                                       # the processes' clocks may be a second apart
        shared = [folder]
        dist.broadcast_object_list(shared, src=0)
        folder = shared[0]
    if not resume and rank == 0:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(dict(meta, preset=preset, device=str(device), torch=torch.__version__,
                                                            git=git_commit(), data_source=source, command=sys.argv), indent=2))
    run_dir = Path(args.resume) if resume else folder                   # log() writes there from now on
    if resume:
        log(f"resuming {run_dir} after {resume['phase']} epoch {resume['epoch']} (step {resume['step']})")
    log(f"run folder: {run_dir}")

    # ---- phase 1: self pre-training (spec §1) --------------------------------------------------------------------
    spt, resuming_ft = None, resume is not None and resume["phase"] == "finetune"
    if args.spt and resuming_ft:                                         # pre-training had finished before the stop
        spt = resume["spt"]
    elif args.spt:
        torch.manual_seed(args.seed)
        denoiser = Denoiser(Model(cfg), cfg.d_model, denoise.n_outputs(args.task)).to(device)
        spt_fn = partial(spt_batch, task=args.task, objective=args.objective, ratio=args.mask_ratio)
        spt_meta = dict(meta, head=dict(kind="denoise", n_out=denoise.n_outputs(args.task)))
        spt = run_phase("spt", denoiser, spt_fn, splits["train"], eval_loader("val"), args.pretrain_epochs,
                        args.pretrain_lr, args, ssm_names, run_dir, spt_meta, log, resume)
        init_path = run_dir / "spt.pt"                                   # the best SPT checkpoint, not the last state
        init_ck = torch.load(init_path, map_location=device, weights_only=True)
    if spt:
        seconds["spt"] = spt["seconds"]
    if init_ck is not None and not resuming_ft:                          # else last.pt holds the whole state
        try:
            dropped, new = load_backbone(classifier, init_ck["model"])
        except RuntimeError as e:
            fail(f"loading the backbone: {str(e).splitlines()[0]}")
        log(f"loaded backbone from {init_path} ({init_ck['phase']} epoch {init_ck['epoch']}, {init_ck['best']['name']} "
            f"{init_ck['best']['value']:.4f}); new: {', '.join(new)}; dropped: {', '.join(dropped)}")

    # ---- phase 2: fine-tuning, then test on the best-val checkpoint -------------------------------------------------
    ft_fn = partial(finetune_batch, task=args.task)
    ft = run_phase("finetune", classifier, ft_fn, splits["train"], eval_loader("val"), args.epochs, args.lr,
                   args, ssm_names, run_dir, dict(meta, spt=spt), log, resume if resuming_ft else None)
    seconds["finetune"] = ft["seconds"]
    t_test = time.time()
    classifier.load_state_dict(torch.load(run_dir / "best.pt", map_location=device, weights_only=True)["model"])
    amp = partial(torch.autocast, "cuda", torch.bfloat16) if args.amp and device.type == "cuda" else contextlib.nullcontext
    test = evaluate(classifier, ft_fn, eval_loader("test"), args.seed + 3, amp)
    seconds["test"] = time.time() - t_test
    seconds["total"] = time.time() - t_start
    results = {"test_acc": test["acc"], "test_loss": test["loss"], "best_val_acc": ft["best"], "best_epoch": ft["epoch"],
               "spt_val_metric": spt and {"name": spt["metric"], "value": spt["best"], "epoch": spt["epoch"], **spt["val"]},
               "params": n_backbone + n_head, "n_train": len(splits["train"]), "wall_time_s": seconds, "data_source": source, "preset": preset,
               "device": str(device), "processes": world, "run_dir": str(run_dir)}
    if rank == 0:
        (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    spt_text = " | SPT " + " ".join(f"val_{k} {v:.4f}" for k, v in spt["val"].items()) if spt else ""
    log(f"test | acc {test['acc']:.4f} | loss {test['loss']:.4f} | best val_acc {ft['best']:.4f} (epoch {ft['epoch']}){spt_text}",
        {"phase": "test", "test_acc": test["acc"], "test_loss": test["loss"]})
    log(f"done in {seconds['total'] / 60:.1f} min ({', '.join(f'{k} {v:.0f} s' for k, v in seconds.items() if k != 'total')}): "
        f"{run_dir}", {"phase": "done", "wall_time_s": seconds})
    if world > 1:  # free the DDP wrappers (reference cycles) first: else gloo threads can outlive the group and
        gc.collect()   # abort the exit (SIGABRT, "terminate called without an active exception"; 1 run in 6 here)
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
