"""train.py: self pre-training (SPT), then fine-tuning, on the Long Range Arena (Amos, Berant & Gupta, ICLR 2024).
phase 1 (--spt):  backbone + denoising head learn to restore masked (or next) inputs of the task's own train split
phase 2:          the same backbone + a fresh pooled classifier head learn the labels; without --spt it starts from
                  random init ("trained from scratch", TFS). Test accuracy is reported for the best-validation checkpoint.
    python train.py --model dlr --task pathfinder --spt --preset tiny     # the quick start (under a minute on a CPU)
    python train.py --model dlr --task pathx --spt                        # paper preset on a GPU, tiny on a CPU
    python train.py --resume runs/<run folder>                            # continue a stopped run exactly
    torchrun --nproc_per_node=4 train.py --model s4 --task pathx --spt     # DDP: 4 GPUs, --batch-size stays global
Reading order: main() at the bottom runs the method's steps by name; each step is a function above it.
Check: tests/test_train.py (every model with and without --spt, checkpoints, one-batch overfit) and
tests/test_robustness.py (DDP equals 1 process, exact resume, NaN guard, every bad input, --compile, memory).
"""
import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import NamedTuple

# Before torch starts OpenMP: spinning threads wait a whole time slice for a descheduled partner in every parallel
# region, which makes small runs on a shared CPU several times slower. Export OMP_WAIT_POLICY to change it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import contextlib  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from tqdm import tqdm  # noqa: E402

import denoise  # noqa: E402
import lra_data  # noqa: E402
from presets import MODELS, apply_presets, check_flags, model_config, preset_values  # noqa: E402,F401 (train.MODELS)
from runs import (all_sum, fail, file_lock, git_commit, join_process_group, log, rank_and_world, read_checkpoint,  # noqa: E402
                  restore_training_state, resume_settings, run_folder, save_checkpoint, setup_device, shard,
                  training_state)


# ---- heads: what the backbone's features are trained to predict ---------------------------------------------------

def pool(h, lengths, how):
    """Pool features over real positions only (pads never count). h: (B, L, D), lengths: (B,) -> (B, D) float32.
    A row with no real position (lengths 0) pools to zeros, whatever `how` is."""
    h = h.float()                                                      # bf16 sums over 16k positions lose digits
    real = torch.arange(h.size(1), device=h.device)[None, :] < lengths[:, None]   # (B, L)
    if how == "mean":
        return (h * real[..., None]).sum(1) / lengths[:, None].clamp(min=1)       # (B, D)
    if how == "max":
        z = h.masked_fill(~real[..., None], torch.finfo(h.dtype).min).amax(1)    # (B, D)
    else:                                                              # "last", for causal models
        z = h[torch.arange(h.size(0), device=h.device), (lengths - 1).clamp(min=0)]   # (B, D)
    return z.masked_fill((lengths == 0)[:, None], 0.0)                 # (B, D)


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


def n_outputs(task):
    """Width of the denoising head: V token ids, 256 grey levels (Pathfinder/PathX), or 1 normalised value (Image)."""
    spec = lra_data.TASKS[task]
    return spec.vocab_size if spec.kind == "tokens" else (1 if task == "image" else 256)


def clean_input(x, task):
    """(input, target) of a raw batch: token ids stay ids; pixels become normalised values (paper App. C), and the
    denoising target is the grey level 0..255 as a class (Pathfinder/PathX) or the normalised value (Image, L1).
    x: (B, L) long ids or uint8 pixels -> ((B, L) long or float, (B, L) long or float)."""
    if lra_data.TASKS[task].kind == "tokens":
        return x, x
    value = lra_data.normalize(x, task).float()                          # (B, L)
    return value, (value if task == "image" else x.long())


def model_input(x, task):
    """What a classifier reads for a raw batch x (B, L): token ids, or pixels as (B, L, 2) [value, 0 indicator]."""
    value = clean_input(x, task)[0]                                      # (B, L)
    return denoise.mask_input(value, torch.zeros(value.shape, dtype=torch.bool, device=x.device), lra_data.MASK)


# ---- checkpoints: one plain dict each, rebuilt without the CLI ----------------------------------------------------

def build_model(ck):
    """Rebuild the model of a checkpoint dict without the CLI: Classifier or Denoiser around MODELS[...] backbone."""
    Config, Model, _ = MODELS[ck["model_name"]]
    backbone, head = Model(Config(**ck["config"])), ck["head"]
    if head["kind"] == "denoise":
        return Denoiser(backbone, ck["config"]["d_model"], head["n_out"])
    return Classifier(backbone, ck["config"]["d_model"], head["n_classes"], head["pool"], head["pair"])


def load_model(path, device="cpu"):
    """Load a checkpoint written by train.py: returns (model in eval mode, the checkpoint dict)."""
    ck = read_checkpoint(path, device)
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
    ck = read_checkpoint(path, device)
    if (ck["model_name"], ck["task"]) != (model_name, task):
        raise ValueError(f"{path}: a {ck['model_name']} checkpoint for {ck['task']}, but this run is "
                         f"{model_name} on {task}; pass the --model and --task it was made with")
    init_only = {"dropout", "ssm_lr", "dt_min", "dt_max", "diag_init"}          # may differ: not in the weights
    differ = [k for k in config if k not in init_only and ck["config"].get(k) != config[k]]
    if differ:
        theirs, ours = (", ".join(f"{k}={c.get(k)}" for k in differ) for c in (ck["config"], config))
        raise ValueError(f"{path}: its {theirs} differ from this run's {ours}; pass the model flags it was made with")
    return ck


# ---- optimiser and schedule ----------------------------------------------------------------------------------------

def param_groups(model, lr, wd, ssm_lr, ssm_names):
    """AdamW groups: SSM parameters (leaf name in ssm_names) get ssm_lr and no weight decay (with the global lr and
    decay S4 loses much accuracy: S4 §4); norms, biases and embeddings get no weight decay; the rest gets wd.
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


# ---- one batch, its metrics, one evaluation ------------------------------------------------------------------------

def spt_batch(model, batch, gen, task, objective, ratio, rows):
    """One denoising batch, the examples `rows` of it: corrupt (or shift) the inputs, predict at the selected positions
    -> (loss, sums). Masks are drawn for the whole batch, then cut, so each DDP process masks as one process would.
    Token sequences end with EOS, which is never masked (a trivial target)."""
    x, lengths, _ = batch                                                # labels are not used in pre-training
    device = next(model.parameters()).device
    x, lengths = x.to(device), lengths.to(device)
    if lra_data.TASKS[task].pair:                                        # (2B, L), (2B,): each document on its own
        x, lengths, rows = x.flatten(0, 1), lengths.flatten(), slice(2 * rows.start, 2 * rows.stop)
    value, target = clean_input(x, task)                                 # (B, L) each
    if objective == "masked":
        content = lengths - 1 if lra_data.TASKS[task].kind == "tokens" else lengths   # EOS is the last real token
        mask = denoise.sample_mask(content, x.size(1), ratio, gen)       # (B, L) bool
        x_in = denoise.mask_input(value, mask, lra_data.MASK)            # (B, L) ids or (B, L, 2) floats
    else:
        target, mask = denoise.next_token(target, lengths)               # (B, L) each
        x_in = denoise.mask_input(value, torch.zeros_like(mask), lra_data.MASK)
    x_in, target, mask, lengths = x_in[rows], target[rows], mask[rows], lengths[rows]   # (b, L, ...)
    pred = model(x_in, lengths, mask)                                    # (M, V) or (M, 1)
    target = target[mask]                                                # (M,)
    loss = denoise.loss(pred, target)
    return loss, sums(pred.detach(), target, loss.detach())


def finetune_batch(model, batch, gen, task, rows=slice(None)):
    """One classification batch, the examples `rows` of it -> (cross-entropy, sums). `gen` is unused."""
    x, lengths, y = (t[rows] for t in batch)
    device = next(model.parameters()).device
    logits = model(model_input(x.to(device), task), lengths.to(device))  # (B, C)
    loss = denoise.loss(logits, y.to(device))                            # cross-entropy
    return loss, sums(logits.detach(), y.to(device), loss.detach())


def sums(pred, target, mean_loss):
    """Additive statistics of one batch, so metrics over many batches are exact: n, summed loss, and either
    correct predictions (classes) or the sums that R² needs (values). pred: (M, V) or (M, 1), target: (M,)."""
    n = target.numel()
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


@torch.no_grad()
def evaluate(model, batch_fn, loader, seed, amp):
    """Metrics over a whole split; SPT masks come from a generator re-seeded every time, so epochs compare alike.
    DDP: each process scores its rows of every batch and the sums are added up."""
    model.eval()
    gen, total = torch.Generator().manual_seed(seed), {}
    for batch in loader:
        rows, keep = shard(len(batch[2]))
        with amp():
            batch_sums = batch_fn(model, batch, gen, rows=rows)[1]
        add(total, batch_sums if keep else dict.fromkeys(batch_sums, 0))
    model.train()
    return metrics(all_sum(total))


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


# ---- one training phase --------------------------------------------------------------------------------------------

class Phase(NamedTuple):
    name: str               # "spt" or "finetune"
    epochs: int
    lr: float
    batch_size: int
    best_file: str          # spt.pt or best.pt: the checkpoint kept for the next phase / the test
    select: str             # the validation metric that picks it: "loss" (SPT) or "acc" (fine-tuning)


def autocast(args, device):
    """The one place that builds autocast: bf16 on CUDA with --amp (the SSM FFTs stay float32 inside), else none."""
    if args.amp and device.type == "cuda":
        return partial(torch.autocast, "cuda", torch.bfloat16)
    return contextlib.nullcontext


def run_phase(phase, model, batch_fn, splits, args, run_dir, meta, resume=None):
    """Train for phase.epochs epochs (AdamW, warm-up schedule); after every args.eval_every-th epoch and the last,
    evaluate on val and write two checkpoints: the best so far (phase.best_file) and last.pt, the state to continue
    from. `resume`: a last.pt of this phase; training then continues after its epoch exactly as if never stopped.
    Returns {"metric", "best", "epoch", "val", "steps", "seconds"}."""
    start, device, (rank, world) = time.time(), next(model.parameters()).device, rank_and_world()
    forward = DDP(model, device_ids=[device] if device.type == "cuda" else None) if world > 1 else model
    forward = torch.compile(forward) if args.compile else forward      # save `model`: no `module.`, `_orig_mod.`
    ssm_lr = meta["config"].get("ssm_lr", phase.lr)
    opt = torch.optim.AdamW(param_groups(model, phase.lr, args.weight_decay, ssm_lr, MODELS[args.model][2]))
    total = min(phase.epochs * math.ceil(len(splits["train"]) / phase.batch_size), args.max_steps or float("inf"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, partial(lr_factor, warmup=args.warmup, total=total,
                                                           schedule=args.schedule))
    gens = {"order": torch.Generator().manual_seed(args.seed + 1),      # batch order, the same in TFS and SPT runs
            "mask": torch.Generator().manual_seed(args.seed + 2)}       # SPT masks
    best, step, done, before = {"name": f"val_{phase.select}", "value": None, "epoch": 0, "val": {}}, 0, 0, 0.0
    if resume is not None:
        restore_training_state(resume, model, opt, sched, gens, device)
        best, step, done, before = resume["best"], resume["step"], resume["epoch"], resume["seconds"]
    amp, val_loader = autocast(args, device), loader(splits["val"], phase.batch_size, args)
    since_eval = {}                                                      # training sums since the last evaluation
    model.train()
    for epoch in range(done + 1, phase.epochs + 1):
        if step >= total:
            break
        if rank > 0:                        # own dropout masks per process; rank 0's RNG is the one checkpointed
            torch.manual_seed(args.seed + 1000 * rank + epoch)
        order = torch.randperm(len(splits["train"]), generator=gens["order"]).tolist()   # global batches, everywhere
        batches = loader(torch.utils.data.Subset(splits["train"], order), phase.batch_size, args)
        step, train = train_epoch(f"{phase.name} {epoch}/{phase.epochs}", forward, model, batch_fn, batches,
                                  (opt, sched), gens["mask"], (step, total), amp)
        add(since_eval, train)
        if epoch % args.eval_every and epoch < phase.epochs and step < total:   # evaluate every k-th epoch and last
            continue
        val = evaluate(forward, batch_fn, val_loader, args.seed + 3, amp)
        score = (lambda r: -r["loss"]) if phase.select == "loss" else (lambda r: r["acc"])
        improved = best["epoch"] == 0 or score(val) > score(best["val"])
        if improved:
            best = {"name": f"val_{phase.select}", "value": val[phase.select], "epoch": epoch, "val": val}
        seconds = before + time.time() - start
        state = {**meta, **training_state(model, opt, sched, gens, device), "phase": phase.name, "epoch": epoch,
                 "step": step, "best": best, "seconds": seconds}
        if rank == 0:                                                    # DDP: one writer, the states are equal
            if improved:
                save_checkpoint(run_dir / phase.best_file, state)
            save_checkpoint(run_dir / "last.pt", state)                  # written last: resume never misses a best
        log_evaluation(run_dir, phase, epoch, step, metrics(all_sum(since_eval)), val, improved, opt, seconds)
        since_eval = {}
    if world > 1:
        dist.barrier()                                                   # the others read spt.pt / best.pt next
    return {"metric": best["name"], "best": best["value"], "epoch": best["epoch"], "val": best["val"], "steps": step,
            "seconds": before + time.time() - start}


def train_epoch(desc, forward, model, batch_fn, batches, optimizer, mask_gen, steps, amp):
    """One pass over `batches`: forward, backward, non-finite guard, AdamW and schedule step per batch, until the
    phase's step budget. optimizer: (opt, sched); steps: (step so far, total). Returns (step, training sums of this
    process). A Ctrl-C is re-raised naming the phase, epoch and step where it hit."""
    (opt, sched), (step, total), (rank, world) = optimizer, steps, rank_and_world()
    train, metric = {}, None
    bar = tqdm(batches, desc=desc, leave=False, dynamic_ncols=True, mininterval=1.0, disable=rank > 0)
    try:
        for batch in bar:
            rows, keep = shard(len(batch[2]))                            # this process's examples of the batch
            with amp():
                loss, batch_sums = batch_fn(forward, batch, mask_gen, rows=rows)
            batch_sums = batch_sums if keep else dict.fromkeys(batch_sums, 0)
            if world > 1:  # DDP averages the processes' gradients: weigh each one's mean loss by its share of the
                loss = loss * batch_sums["n"] * world / all_sum({"n": batch_sums["n"]})["n"]   # global count
            opt.zero_grad(set_to_none=True)
            loss.backward()
            check_finite(loss, model, desc.split()[0], step)
            opt.step()
            sched.step()
            step += 1
            m = metrics(add(train, batch_sums))                          # this process's share, for the bar
            metric = metric or ("r2" if "r2" in m else "acc")
            bar.set_postfix({"loss": f"{m['loss']:.4f}", metric: f"{m[metric]:.3f}"}, refresh=False)
            if step >= total:
                break
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"{desc.replace(' ', ' epoch ', 1)}, step {step}") from None
    finally:
        bar.close()
    return step, train


def log_evaluation(run_dir, phase, epoch, step, train, val, improved, opt, seconds):
    """The line (log.txt) and record (log.jsonl) of one evaluation: training metrics since the last one, val metrics."""
    metric, lr = "r2" if "r2" in val else "acc", opt.param_groups[0]["lr"]
    log(run_dir, f"eval {phase.name:8s} epoch {epoch:3d}/{phase.epochs} step {step:6d} | train_loss "
        f"{train['loss']:.4f} {metric} {train[metric]:.4f} | val_loss {val['loss']:.4f} val_{metric} "
        f"{val[metric]:.4f}{' *' if improved else '  '} | lr {lr:.1e} | {seconds:.0f} s",
        {"phase": phase.name, "epoch": epoch, "step": step, "train_loss": train["loss"], f"train_{metric}": train[metric],
         "val_loss": val["loss"], f"val_{metric}": val[metric], "lr": lr, "elapsed_s": seconds})


def loader(dataset, batch_size, args):
    """Batches of `dataset` in its own order (the caller shuffles), padded by lra_data.collate."""
    return torch.utils.data.DataLoader(dataset, batch_size, collate_fn=lra_data.collate, num_workers=args.workers)


# ---- the steps of main() -------------------------------------------------------------------------------------------

def parse_flags(argv):
    """The command line -> (args, names of the flags given explicitly, every flag's default)."""
    p = argparse.ArgumentParser(description="Self pre-training (SPT) and fine-tuning on the Long Range Arena.")
    p.add_argument("--model", choices=MODELS, default="dlr", help="backbone: transformer, s4 or dlr")
    p.add_argument("--task", choices=lra_data.TASKS, default="pathfinder", help="listops, text, retrieval, image, pathfinder, pathx, pathx256")
    p.add_argument("--spt", action="store_true", help="self pre-train by denoising on the train split, then fine-tune")
    p.add_argument("--objective", choices=["masked", "causal"], default="masked", help="SPT objective; causal (next token) needs --causal")
    p.add_argument("--causal", action="store_true", help="causal Transformer / unidirectional S4 and DLR (LayerNorm)")
    p.add_argument("--mask-ratio", type=float, default=None, help="masked SPT: share of positions masked (default: the task's)")
    p.add_argument("--preset", choices=["tiny", "small", "paper"], default=None, help="sizes and budget (default: paper with CUDA, else tiny)")
    p.add_argument("--epochs", type=int, default=None, help="fine-tuning epochs (default: preset)")
    p.add_argument("--pretrain-epochs", type=int, default=None, help="SPT epochs (default: preset)")
    p.add_argument("--eval-every", type=int, default=1, help="evaluate on val and checkpoint every this many epochs "
                   "and after the last (--resume continues from the last evaluation)")
    p.add_argument("--max-steps", type=int, default=0, help="stop each phase after this many steps (0: no limit)")
    p.add_argument("--batch-size", type=int, default=None, help="fine-tuning examples per step, all processes together (default: preset)")
    p.add_argument("--pretrain-batch-size", type=int, default=None, help="SPT examples per step (default: preset)")
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
    p.add_argument("--cache-dir", default=None, help="where prepared arrays go (default: <data-dir>/cache if writable, else ./data/cache)")
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
    return args, {k for k, v in vars(args).items() if v != p.get_default(k)}, vars(p.parse_args([]))


def load_data(args):
    """The three splits, each capped at --max-train / --max-eval by a fixed random subset. Generating and caching run
    under a file lock before any collective, so DDP processes never wait on a collective's timeout for them."""
    cache = lra_data.cache_root(args.data_dir, args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    try:
        with file_lock(cache / "prepare.lock", busy=None):              # other processes wait here, not in a barrier
            splits = {split: lra_data.load(args.task, split, args.data_dir, generate=args.generate or None,
                                           data_fraction=args.data_fraction if split == "train" else 1.0,
                                           difficulty=args.difficulty, cache_dir=args.cache_dir,
                                           workers=os.cpu_count() or 1, max_len=args.max_len)
                      for split in ("train", "val", "test")}
    except lra_data.DataError as e:
        fail(str(e))
    notes = list(dict.fromkeys(n for s in splits.values() for n in getattr(s, "notes", [])))   # each note once
    source = getattr(splits["train"], "source", "unknown")
    for split, cap in {"train": args.max_train, "val": args.max_eval, "test": args.max_eval}.items():
        if cap and len(splits[split]) > cap:  # a fixed random subset (nested across sizes), not the first files on disk
            keep = torch.randperm(len(splits[split]), generator=torch.Generator().manual_seed(0))[:cap].sort().values
            splits[split] = torch.utils.data.Subset(splits[split], keep.tolist())
        if len(splits[split]) == 0:
            fail(f"the {split} split of {args.task} in {args.data_dir} is empty")
    return splits, source, notes


def pretrain(args, cfg, meta, splits, run_dir, device, resume):
    """Phase 1: a fresh backbone + denoising head on the training inputs; the best one (val loss) is saved as spt.pt."""
    torch.manual_seed(args.seed)
    denoiser = Denoiser(MODELS[args.model][1](cfg), cfg.d_model, n_outputs(args.task)).to(device)
    phase = Phase("spt", args.pretrain_epochs, args.pretrain_lr, args.pretrain_batch_size, "spt.pt", "loss")
    batch_fn = partial(spt_batch, task=args.task, objective=args.objective, ratio=args.mask_ratio)
    spt_meta = dict(meta, head=dict(kind="denoise", n_out=n_outputs(args.task)))
    return run_phase(phase, denoiser, batch_fn, splits, args, run_dir, spt_meta, resume)


def load_pretrained(classifier, args, run_dir, device, init_ck=None):
    """Copy the backbone of spt.pt (after --spt) or of --init-from (init_ck) into the classifier, strictly; say so."""
    path = run_dir / "spt.pt" if args.spt else Path(args.init_from)
    ck = init_ck or read_checkpoint(path, device)
    try:
        dropped, new = load_backbone(classifier, ck["model"])
    except RuntimeError as e:
        fail(f"loading the backbone of {path}: {str(e).splitlines()[0]}")
    log(run_dir, f"loaded backbone from {path} ({ck['phase']} epoch {ck['epoch']}, {ck['best']['name']} "
        f"{ck['best']['value']:.4f}); new: {', '.join(new)}; dropped: {', '.join(dropped)}")


def test_best(classifier, args, splits, run_dir, device):
    """Test accuracy of the checkpoint with the best validation accuracy (best.pt)."""
    classifier.load_state_dict(read_checkpoint(run_dir / "best.pt", device)["model"])
    fn = partial(finetune_batch, task=args.task)
    return evaluate(classifier, fn, loader(splits["test"], args.batch_size, args), args.seed + 3, autocast(args, device))


def main(argv=None):
    t_start = time.time()
    args, given, defaults = parse_flags(argv)
    resume = resume_settings(args, given, defaults) if args.resume else None     # the run's own settings
    if resume:
        args, resume = resume
    config_kw, notes = apply_presets(args)                               # preset first, then explicit flags win
    try:
        cfg = check_flags(args, config_kw)                               # every flag, before anything is written
    except ValueError as e:
        fail(str(e))
    device, world = setup_device(args)
    t_data = time.time()
    splits, source, data_notes = load_data(args)                         # before any collective (DDP start-up)
    seconds = {"data": time.time() - t_data}
    device = join_process_group(device, world)
    head = dict(kind="classifier", n_classes=lra_data.TASKS[args.task].n_classes, pool=args.pool,
                pair=lra_data.TASKS[args.task].pair)
    meta = dict(model_name=args.model, task=args.task, config=dataclasses.asdict(cfg), head=head, args=vars(args))
    torch.manual_seed(args.seed)                                         # model init
    classifier = build_model(meta).to(device)
    init_ck = None
    if args.init_from and not resume:                                    # a bad checkpoint stops before the run folder
        try:
            init_ck = read_checkpoint_for_init(args.init_from, args.model, args.task, meta["config"], device)
        except ValueError as e:
            fail(f"--init-from {e}")
    threads = dict(torch_threads=torch.get_num_threads(), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS"))
    lines = startup_lines(args, "given" if "preset" in given or resume else "default", notes, device, world, threads,
                          splits, source, data_notes, classifier, meta, seconds["data"])
    if resume:
        lines.insert(0, f"resuming after {resume['phase']} epoch {resume['epoch']} (step {resume['step']})")
    run_meta = dict(meta, preset=args.preset, device=str(device), torch=torch.__version__, git=git_commit(),
                    data_source=source, data_notes=data_notes, threads=threads, command=sys.argv)
    with run_folder(args, run_meta, lines) as run_dir:
        log(run_dir, f"run folder: {run_dir}")
        try:
            results = run_both_phases(args, cfg, meta, classifier, splits, run_dir, device, resume, init_ck)
        except KeyboardInterrupt as e:
            last = read_checkpoint(run_dir / "last.pt") if (run_dir / "last.pt").is_file() else None
            saved = f"last.pt holds {last['phase']} epoch {last['epoch']}" if last else "no checkpoint yet"
            then = f"continue with: python train.py --resume {run_dir}" if last else "start the run again"
            print(f"train.py: stopped by Ctrl-C at {e.args[0] if e.args else 'start-up'}; {saved}; {then}",
                  file=sys.stderr)
            raise SystemExit(130) from None
        n_params = sum(p.numel() for p in classifier.parameters())
        results.update(params=n_params, n_train=len(splits["train"]), data_source=source, data_notes=data_notes,
                       preset=args.preset, device=str(device), processes=world, threads=threads, run_dir=str(run_dir))
        seconds.update(results["wall_time_s"], total=time.time() - t_start)
        results["wall_time_s"] = seconds
        if rank_and_world()[0] == 0:
            (run_dir / "results.json").write_text(json.dumps(results, indent=2))
        phases = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items() if k != "total")
        log(run_dir, f"done in {seconds['total'] / 60:.1f} min ({phases}): {run_dir}", {"phase": "done", "wall_time_s": seconds})
    if world > 1:  # free the DDP wrappers (reference cycles) first: else gloo threads can outlive the group and
        gc.collect()   # abort the exit (SIGABRT, "terminate called without an active exception")
        dist.destroy_process_group()
    return results


def startup_lines(args, how, notes, device, world, threads, splits, source, data_notes, classifier, meta, t_data):
    """What the run prints first (and log.txt keeps): preset, plan, device, every setting, data, model, sizes."""
    plan = (f"SPT {args.objective}{f' (mask ratio {args.mask_ratio})' if args.objective == 'masked' else ''}, "
            f"then fine-tune" if args.spt else f"fine-tune from {args.init_from}" if args.init_from
            else "from scratch (TFS)")
    extras = (f"{f' × {world} processes (DDP)' if world > 1 else ''}"
              f"{' + bf16 autocast' if args.amp and device.type == 'cuda' else ''}"
              f"{' + torch.compile' if args.compile else ''}")
    n_backbone = sum(p.numel() for p in classifier.backbone.parameters())
    n_head = sum(p.numel() for p in classifier.head.parameters())
    sizes = " / ".join(f"{split} {len(splits[split]):,}" for split in ("train", "val", "test"))
    return [f"preset {args.preset} ({how}); explicit flags override it", *notes,
            f"run: {args.model} on {args.task} | {plan} | seed {args.seed}",
            f"device {device}{extras} | torch {torch.__version__} | {threads['torch_threads']} threads | "
            f"git {git_commit()}",
            *(["note: --amp is ignored on CPU (bf16 autocast is for CUDA)"] if args.amp and device.type != "cuda" else []),
            "settings: " + " ".join(f"{k}={v}" for k, v in vars(args).items()),
            f"data: {source} | {sizes} | {t_data:.1f} s", *(f"data note: {n}" for n in data_notes),
            f"model {type(classifier.backbone).__name__}({', '.join(f'{k}={v}' for k, v in meta['config'].items())})",
            f"params: backbone {n_backbone:,} + classifier head {n_head:,} = {n_backbone + n_head:,}"]


def run_both_phases(args, cfg, meta, classifier, splits, run_dir, device, resume, init_ck):
    """Pre-train (with --spt), fine-tune, test: the method. -> results (test_acc, best_val_acc, spt_val_metric, ...)."""
    seconds, spt = {}, None
    resuming_ft = resume is not None and resume["phase"] == "finetune"
    if args.spt:
        spt = resume["spt"] if resuming_ft else pretrain(args, cfg, meta, splits, run_dir, device, resume)
        seconds["spt"] = spt["seconds"]
    if (args.spt or args.init_from) and not resuming_ft:                # else last.pt holds the whole state
        load_pretrained(classifier, args, run_dir, device, init_ck)
    phase = Phase("finetune", args.epochs, args.lr, args.batch_size, "best.pt", "acc")
    ft = run_phase(phase, classifier, partial(finetune_batch, task=args.task), splits, args, run_dir,
                   dict(meta, spt=spt), resume if resuming_ft else None)
    seconds["finetune"] = ft["seconds"]
    t_test = time.time()
    test = test_best(classifier, args, splits, run_dir, device)
    seconds["test"] = time.time() - t_test
    spt_text = " | SPT " + " ".join(f"val_{k} {v:.4f}" for k, v in spt["val"].items()) if spt else ""
    log(run_dir, f"test | acc {test['acc']:.4f} | loss {test['loss']:.4f} | best val_acc {ft['best']:.4f} "
        f"(epoch {ft['epoch']}){spt_text}", {"phase": "test", "test_acc": test["acc"], "test_loss": test["loss"]})
    return {"test_acc": test["acc"], "test_loss": test["loss"], "best_val_acc": ft["best"], "best_epoch": ft["epoch"],
            "spt_val_metric": spt and {"name": spt["metric"], "value": spt["best"], "epoch": spt["epoch"], **spt["val"]},
            "wall_time_s": seconds}


if __name__ == "__main__":
    main()
