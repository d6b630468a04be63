"""train.py: self pre-training (SPT), then fine-tuning, on the Long Range Arena (Amos, Berant & Gupta, ICLR 2024).
phase 1 (--spt):  backbone + denoising head learn to restore masked (or next) inputs of the task's own train split
phase 2:          the same backbone + a fresh pooled classifier head learn the labels; without --spt it starts from
                  random init ("trained from scratch", TFS). Test accuracy: the best-validation checkpoint's.
    python train.py --model dlr --task pathfinder --spt --preset tiny     # the quick start (a minute or two on a CPU)
    python train.py --model dlr --task pathx --spt                        # paper preset on a GPU, tiny on a CPU
    python train.py --resume runs/<run folder>                            # continue a stopped run exactly
    torchrun --nproc_per_node=4 train.py --model s4 --task pathx --spt     # DDP: 4 GPUs, --batch-size stays global
Reading order: main() at the bottom runs the steps by name (run_both_phases above it: pre-train, fine-tune,
test); each step is a function above it.
Check: tests/test_train.py (every model with and without --spt, checkpoints, one-batch overfit) and
tests/test_robustness.py (DDP equals 1 process, exact resume, NaN guard, every bad input, --compile, memory).
"""
import argparse
import contextlib
import dataclasses
import gc
import hashlib
import json
import math
import os
import sys
import tempfile
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
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from tqdm import tqdm  # noqa: E402

import denoise  # noqa: E402
import lra_data  # noqa: E402
from heads import (add, batch_loss, build_model, finetune_inputs, load_backbone, metrics, n_outputs,  # noqa: E402
                   read_checkpoint_for_init, spt_inputs)
from heads import load_model  # noqa: E402,F401  (public: train.load_model(path) rebuilds any checkpoint)
from presets import MODELS, apply_presets, check_flags  # noqa: E402
from presets import model_config, preset_values  # noqa: E402,F401  (public: train.model_config, train.preset_values)
from runs import (all_sum, fail, file_lock, git_commit, join_process_group, loader, log, precision,  # noqa: E402
                  rank_and_world, read_checkpoint, restore_training_state, resume_settings, run_folder,
                  save_checkpoint, setup_device, shard, startup_lines, stopped_by_ctrl_c, training_state,
                  write_results)


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
    """Multiplier of every group's lr: linear warm-up over `warmup` steps, then constant (the paper's) or cosine."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return 1.0


@torch.no_grad()
def evaluate(model, prepare, loader, seed, amp):
    """Metrics over a whole split, summed on the device and read once; SPT masks come from a generator re-seeded
    every time, so epochs compare alike. DDP: each process scores its rows of every batch; the sums are added up."""
    model.eval()
    device = next(model.parameters()).device
    gen, total = torch.Generator(device).manual_seed(seed), {}
    for batch in loader:
        b = prepare(batch, gen=gen)
        rows, keep = shard(len(b.weight))
        with amp():
            total = add(total, batch_loss(model, b, rows)[1], keep)
    model.train()
    return metrics(all_sum(total))


# ---- one training phase --------------------------------------------------------------------------------------------

PROGRESS_STEPS = 25      # the progress bar (and the non-finite guard) read device values once every this many steps


class Phase(NamedTuple):
    name: str               # "spt" or "finetune"
    epochs: int
    lr: float
    batch_size: int
    accum_steps: int        # micro-batches per step: the same update in 1/accum_steps of the activation memory
    best_file: str          # spt.pt or best.pt: the checkpoint kept for the next phase / the test
    select: str             # the validation metric that picks it: "loss" (SPT) or "acc" (fine-tuning)


def guard_step(model, bad_loss, opt, scaler, record, step):
    """The optimiser step behind a device-side guard: one fused reduction (torch._foreach_norm) over all gradients
    decides, on the device, whether this update is finite; a non-finite update is skipped inside the fused AdamW
    kernel (found_inf), so it never reaches the weights, and `record` keeps the first such [step, parameter index].
    fp16: overflowing gradients are the scaler's business (it skips and lowers its scale); only a non-finite loss is
    an error. bad_loss: a device bool, any micro-batch's loss was not finite. Nothing here reads a device value:
    check_finite does, once per progress interval."""
    if scaler is not None:
        scaler.unscale_(opt)
    grads = [p.grad if p.grad is not None else p.new_zeros(()) for p in model.parameters() if p.requires_grad]
    finite = torch.isfinite(torch.stack(torch._foreach_norm(grads)))    # (P,) bool
    error = bad_loss if scaler is not None else bad_loss | ~finite.all()
    first_bad = torch.where(finite.all(), -1, (~finite).int().argmax())   # index into the trained parameters
    update = torch.stack([step.float(), first_bad.float()])
    record.copy_(torch.where((record[0] < 0) & error, update, record))
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.found_inf = error.float()                                    # read by the fused kernel, on the device
        opt.step()


def check_finite(record, model, phase):
    """Stop at a recorded non-finite update (read once per progress interval), naming its step and the first
    parameter whose gradient was not finite. The guard skipped it: weights and checkpoints so far are intact."""
    if dist.is_initialized():         # the earliest bad step of any process stops all, with that process's parameter
        step = torch.where(record[0] < 0, torch.inf, record[0])          # a process without one: never the earliest
        first = step.clone()
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        index = torch.where(step == first, record[1], -2.0)              # -2: not the process of that step
        dist.all_reduce(index, op=dist.ReduceOp.MAX)
        record = torch.stack([torch.where(first.isinf(), -1.0, first), index])
    step, index = record.tolist()
    if step < 0:
        return
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    bad = f"gradient of {names[int(index)]}" if index >= 0 else "the loss itself"
    raise SystemExit(f"train.py: {phase} step {int(step)}: non-finite loss or gradient, first non-finite: {bad}; the "
                     f"update was skipped, checkpoints so far are intact (try a lower --lr / --pretrain-lr)")


def make_optimizer(phase, model, args, ssm_lr, n_train):
    """Fused AdamW (its kernel can skip a step on the device) with the SSM groups, the warm-up schedule, and the
    step budget of the phase -> (opt, sched, total steps)."""
    opt = torch.optim.AdamW(param_groups(model, phase.lr, args.weight_decay, ssm_lr, MODELS[args.model][2]), fused=True)
    total = min(phase.epochs * math.ceil(n_train / phase.batch_size), args.max_steps or float("inf"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, partial(lr_factor, warmup=args.warmup, total=total,
                                                           schedule=args.schedule))
    return opt, sched, total


def run_phase(phase, model, prepare, splits, args, run_dir, meta, resume=None):
    """Train for phase.epochs epochs; after every args.eval_every-th epoch and the last, evaluate on val and write
    two checkpoints: the best so far (phase.best_file) and last.pt, the state to continue from. `resume`: a last.pt
    of this phase; training then continues after its epoch exactly as if never stopped.
    Returns {"metric", "best", "epoch", "val", "steps", "seconds"}."""
    start, device, (rank, world) = time.time(), next(model.parameters()).device, rank_and_world()
    forward = DDP(model, device_ids=[device] if device.type == "cuda" else None) if world > 1 else model
    forward = torch.compile(forward) if args.compile else forward      # save `model`: no `module.`, `_orig_mod.`
    opt, sched, total = make_optimizer(phase, model, args, meta["config"].get("ssm_lr", phase.lr), len(splits["train"]))
    gens = {"order": torch.Generator().manual_seed(args.seed + 1),      # batch order, the same in TFS and SPT runs
            "mask": torch.Generator(device).manual_seed(args.seed + 2)}  # SPT masks, drawn on the device
    _, amp, scaler = precision(args, device)
    best, step, done, before = {"name": f"val_{phase.select}", "value": None, "epoch": 0, "val": {}}, 0, 0, 0.0
    if resume is not None:
        restore_training_state(resume, model, opt, sched, gens, device, scaler)
        best, step, done, before = resume["best"], resume["step"], resume["epoch"], resume["seconds"]
    batches = loader(splits["train"], phase.batch_size, args, device, order=gens["order"])
    val_batches = loader(splits["val"], phase.batch_size, args, device)
    since_eval = {}                                                      # training statistics since the last evaluation
    model.train()
    for epoch in range(done + 1, phase.epochs + 1):
        if step >= total:
            break
        if rank > 0:                        # own dropout masks per process; rank 0's RNG is the one checkpointed
            torch.manual_seed(args.seed + 1000 * rank + epoch)
        step, train = train_epoch(f"{phase.name} {epoch}/{phase.epochs}", forward, model, prepare, batches,
                                  (opt, sched, scaler), gens["mask"], (step, total, phase.accum_steps), amp)
        since_eval = add(since_eval, train)
        if epoch % args.eval_every and epoch < phase.epochs and step < total:   # evaluate every k-th epoch and last
            continue
        try:
            val = evaluate(forward, prepare, val_batches, args.seed + 3, amp)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(f"{phase.name} epoch {epoch}/{phase.epochs}, evaluation") from None
        score = (lambda r: -r["loss"]) if phase.select == "loss" else (lambda r: r["acc"])
        improved = best["epoch"] == 0 or score(val) > score(best["val"])
        if improved:
            best = {"name": f"val_{phase.select}", "value": val[phase.select], "epoch": epoch, "val": val}
        seconds = before + time.time() - start
        state = {**meta, **training_state(model, opt, sched, gens, device, scaler), "phase": phase.name,
                 "epoch": epoch, "step": step, "best": best, "seconds": seconds}
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


def train_epoch(desc, forward, model, prepare, batches, optimizer, mask_gen, steps, amp):
    """One pass over `batches`, each step as in nanoGPT: the global batch to the device, forward and backward over
    accum_steps micro-batches of this process's rows (DDP syncs gradients on the last one only), the guarded
    optimiser step, the schedule. optimizer: (opt, sched, scaler); steps: (step, total, accum_steps). Device values
    are read once per PROGRESS_STEPS steps. Returns (step, training statistics of this process). A Ctrl-C is re-raised
    naming the phase, epoch and step where it hit."""
    (opt, sched, scaler), (step, total, accum), (rank, world) = optimizer, steps, rank_and_world()
    device = next(model.parameters()).device
    record, step_t = torch.full((2,), -1.0, device=device), torch.tensor(step, device=device)   # guard, step
    train, shown = {}, {}
    bar = tqdm(batches, desc=desc, leave=False, dynamic_ncols=True, disable=rank > 0)
    try:
        for batch in bar:
            b = prepare(batch, gen=mask_gen)
            rows, keep = shard(len(b.weight))                            # this process's examples of the batch
            parts, bad_loss = micro_batches(rows, accum), torch.zeros((), dtype=torch.bool, device=device)
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                with forward.no_sync() if world > 1 and not last else contextlib.nullcontext(), amp():
                    loss, stats = batch_loss(forward, b, part, world)   # DDP averages over processes
                (scaler.scale(loss * keep) if scaler else loss * keep).backward()
                train, bad_loss = add(train, stats, keep), bad_loss | ~torch.isfinite(loss.detach())
            guard_step(model, bad_loss, opt, scaler, record, step_t)
            opt.zero_grad(set_to_none=True)
            sched.step()
            step, step_t = step + 1, step_t + 1
            if step % PROGRESS_STEPS == 0 or step >= total:
                check_finite(record, model, desc.split()[0])
                shown = metrics(train)
                bar.set_postfix({k: f"{v:.4f}" for k, v in shown.items()})
            if step >= total:
                break
        check_finite(record, model, desc.split()[0])
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"{desc.replace(' ', ' epoch ', 1)}, step {step}") from None
    finally:
        bar.close()
    return step, train


def micro_batches(rows, k):
    """rows (a slice) in k contiguous, near-equal parts (fewer when there are fewer rows)."""
    n = rows.stop - rows.start
    bounds = [rows.start + (n * i) // k for i in range(k + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a] or [rows]


def log_evaluation(run_dir, phase, epoch, step, train, val, improved, opt, seconds):
    """The line (log.txt) and record (log.jsonl) of one evaluation: training metrics since the last one, val metrics."""
    metric, lr = "r2" if "r2" in val else "acc", opt.param_groups[0]["lr"]
    log(run_dir, f"eval {phase.name:8s} epoch {epoch:3d}/{phase.epochs} step {step:6d} | train_loss "
        f"{train['loss']:.4f} {metric} {train[metric]:.4f} | val_loss {val['loss']:.4f} val_{metric} "
        f"{val[metric]:.4f}{' *' if improved else '  '} | lr {lr:.1e} | {seconds:.0f} s",
        {"phase": phase.name, "epoch": epoch, "step": step, **{f"train_{k}": v for k, v in train.items()},
         **{f"val_{k}": v for k, v in val.items()}, "lr": lr, "elapsed_s": seconds})


# ---- the steps of main() -------------------------------------------------------------------------------------------

def parse_flags(argv):
    """The command line -> (args, names of the flags given explicitly, every flag's default)."""
    p = argparse.ArgumentParser(description="Self pre-training (SPT) and fine-tuning on the Long Range Arena.")
    flag = p.add_argument
    flag("--model", choices=MODELS, default="dlr", help="backbone: transformer, s4 or dlr")
    flag("--task", choices=lra_data.TASKS, default="pathfinder", help=", ".join(lra_data.TASKS))
    flag("--spt", action="store_true", help="self pre-train by denoising on the train split, then fine-tune")
    flag("--objective", choices=["masked", "span", "causal", "rtd"], default="masked", help="SPT objective: masked "
         "denoising, span masking (SpanBERT), next token (causal, needs --causal), replaced-token detection (ELECTRA)")
    flag("--causal", action="store_true", help="causal Transformer / unidirectional S4 and DLR (LayerNorm)")
    flag("--mask-ratio", type=float, default=None, help="masked, span, rtd: share of positions masked (default: the "
         "task's)")
    flag("--span-mean", type=float, default=3.0, help="span: mean span length (geometric, clipped at 10)")
    flag("--gen-width", type=int, default=None, help="rtd: the generator's width (default: d_model / 4)")
    flag("--gen-layers", type=int, default=1, help="rtd: the generator's layers")
    flag("--rtd-weight", type=float, default=50.0, help="rtd: λ in L_gen + λ·L_disc (ELECTRA's 50)")
    flag("--gdes", action=argparse.BooleanOptionalAction, default=True, help="rtd, token tasks: the discriminator "
         "reads sg(E) + its own residual (DeBERTaV3); --no-gdes: E itself (ELECTRA)")
    flag("--preset", choices=["tiny", "small", "paper"], default=None, help="sizes and budget (default: paper with "
         "CUDA, else tiny)")
    flag("--epochs", type=int, default=None, help="fine-tuning epochs (default: preset)")
    flag("--pretrain-epochs", type=int, default=None, help="SPT epochs (default: preset)")
    flag("--eval-every", type=int, default=1, help="evaluate and checkpoint every this many epochs and after the last")
    flag("--max-steps", type=int, default=0, help="stop each phase after this many steps (0: no limit)")
    flag("--batch-size", type=int, default=None, help="fine-tuning examples per step, all processes (default: preset)")
    flag("--pretrain-batch-size", type=int, default=None, help="SPT examples per step (default: the preset's; CPU "
         "presets: --batch-size)")
    flag("--accum-steps", type=int, default=None, help="fine-tuning micro-batches per step: the same update in less "
         "memory (default: preset)")
    flag("--pretrain-accum-steps", type=int, default=None, help="SPT micro-batches per step (default: preset)")
    flag("--lr", type=float, default=None, help="fine-tuning learning rate (default: preset)")
    flag("--pretrain-lr", type=float, default=None, help="SPT learning rate (default: preset)")
    flag("--ssm-lr", type=float, default=None, help="lr of the SSM parameters, no weight decay (default: config's)")
    flag("--weight-decay", type=float, default=None, help="AdamW weight decay (default: preset)")
    flag("--warmup", type=int, default=None, help="linear warm-up steps (default: preset)")
    flag("--schedule", choices=["constant", "cosine"], default="constant", help="lr after warm-up")
    flag("--d-model", type=int, default=None, help="model width D (default: preset)")
    flag("--n-layers", type=int, default=None, help="number of layers (default: preset)")
    flag("--d-state", type=int, default=None, help="SSM state size N (default: preset)")
    flag("--dropout", type=float, default=None, help="dropout (default: preset)")
    flag("--pool", choices=["mean", "max", "last"], default=None, help="pooling over real positions (default: task's)")
    flag("--data-dir", default="data", help="the LRA release, IMDB or CIFAR files; synthetic tasks generated here")
    flag("--cache-dir", default=None, help="prepared arrays (default: <data-dir>/cache if writable, else ./data/cache)")
    flag("--difficulty", choices=["easy", "intermediate", "hard"], default="hard", help="Pathfinder/PathX contour "
         "length 6, 9 or 14")
    flag("--generate", type=int, default=None, help="examples to generate when ListOps/Pathfinder/PathX files are "
         "absent, 0: never (default: preset)")
    flag("--data-fraction", type=float, default=1.0, help="use this fraction of the train split (nested prefixes)")
    flag("--max-len", type=int, default=None, help="text, retrieval: cut each document to this many tokens, EOS "
         "included (default: LRA's 4096 / 4001 = 4000 bytes + EOS)")
    flag("--max-train", type=int, default=None, help="at most this many training examples, 0: all (default: preset)")
    flag("--max-eval", type=int, default=None, help="at most this many val and test examples, 0: all (default: preset)")
    flag("--workers", type=int, default=None, help="DataLoader worker processes (default: 0 on CPU; on CUDA 8, or "
         "the CPU cores per process if fewer)")
    flag("--seed", type=int, default=0, help="seed of the model init; batch order and masks use seed+1, seed+2")
    flag("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    flag("--precision", choices=["fp32", "tf32", "bf16", "fp16"], default=None, help="autocast dtype, the SSM FFTs "
         "stay fp32 (default: bf16 on CUDA compute capability >= 8, fp16 + scaler below, fp32 on CPU)")
    flag("--amp", action="store_true", help="old name of --precision bf16")
    flag("--compile", action="store_true", help="torch.compile the model (checkpoints keep plain keys)")
    flag("--out", default="runs", help="parent folder of the run folder")
    flag("--init-from", default=None, help="fine-tune from the backbone of this checkpoint (e.g. a run's spt.pt)")
    flag("--resume", default=None, help="continue the stopped run in this folder from its last.pt, own settings")
    p.error = lambda message: fail(f"{message} (python train.py --help lists the flags)")   # not the 30-line usage
    args = p.parse_args(argv)
    return args, {k for k, v in vars(args).items() if v != p.get_default(k)}, vars(p.parse_args([]))


def load_data(args):
    """The three splits, each capped at --max-train / --max-eval by a fixed random subset -> (splits, source, notes,
    seconds). Generating and caching run under a file lock before any collective, so DDP processes wait on the lock,
    never on a collective's timeout."""
    start, data_dir = time.time(), Path(args.data_dir).resolve()
    lock = Path(tempfile.gettempdir()) / f"lra-prepare-{hashlib.sha1(str(data_dir).encode()).hexdigest()[:12]}.lock"
    try:
        with file_lock(lock):                                            # the other processes wait here
            splits = {split: lra_data.load(args.task, split, args.data_dir, generate=args.generate or None,
                                           difficulty=args.difficulty, cache_dir=args.cache_dir,
                                           workers=os.cpu_count() or 1, max_len=args.max_len)
                      for split in ("train", "val", "test")}
    except lra_data.DataError as e:
        fail(str(e))
    except KeyboardInterrupt:                   # a half-built cache is removed by lra_data; no run folder exists yet
        print("train.py: stopped by Ctrl-C while preparing the data; no run folder was made; a half-built cache is "
              "removed, but data being generated is left half made: delete that folder (it holds "
              "generated_by_lra_data.txt) before running again", file=sys.stderr)
        raise SystemExit(130) from None
    notes = list(dict.fromkeys(n for s in splits.values() for n in getattr(s, "notes", [])))   # each note once
    source = getattr(splits["train"], "source", "unknown")
    n_train = max(1, round(args.data_fraction * len(splits["train"])))
    caps = {"train": min(args.max_train or n_train, n_train), "val": args.max_eval, "test": args.max_eval}
    for split, cap in caps.items():   # a prefix of one fixed permutation: smaller fractions and caps nest in larger
        if cap and len(splits[split]) > cap:   # (lra_data's data_fraction draws the same permutation, seed 0)
            keep = torch.randperm(len(splits[split]), generator=torch.Generator().manual_seed(0))[:cap].sort().values
            splits[split] = torch.utils.data.Subset(splits[split], keep.tolist())
        if len(splits[split]) == 0:
            fail(f"the {split} split of {args.task} in {args.data_dir} is empty")
    return splits, source, notes, time.time() - start


def pretrain(args, cfg, meta, splits, run_dir, device, resume):
    """Phase 1: a fresh backbone + denoising head (rtd: + a small generator) on the training inputs; the best one by
    the objective's own validation loss is saved as spt.pt."""
    torch.manual_seed(args.seed)
    head = spt_head(args, cfg)
    model = build_model(dict(meta, head=head)).to(device)
    phase = Phase("spt", args.pretrain_epochs, args.pretrain_lr, args.pretrain_batch_size, args.pretrain_accum_steps,
                  "spt.pt", "loss")
    prepare = partial(spt_inputs, task=args.task, device=device, objective=args.objective, ratio=args.mask_ratio,
                      span_mean=args.span_mean, rtd_weight=args.rtd_weight)
    return run_phase(phase, model, prepare, splits, args, run_dir, dict(meta, head=head), resume)


def spt_head(args, cfg):
    """The checkpoint's description of the SPT model: a denoising head, or ELECTRA's generator and discriminator
    (the generator: the same family at --gen-width, --gen-layers)."""
    if args.objective != "rtd":
        return dict(kind="denoise", n_out=n_outputs(args.task))
    gen_cfg = dataclasses.replace(cfg, d_model=args.gen_width, n_layers=args.gen_layers)
    return dict(kind="rtd", n_out=n_outputs(args.task), gen_config=dataclasses.asdict(gen_cfg), gdes=args.gdes)


def load_pretrained(classifier, args, run_dir, device, init_ck=None):
    """Copy the backbone of spt.pt (after --spt) or of --init-from (init_ck) into the classifier, strictly; say so."""
    path = run_dir / "spt.pt" if args.spt else Path(args.init_from)
    ck = init_ck or read_checkpoint(path, device)
    state = ck["model"] if ck["head"]["kind"] != "rtd" else denoise.discriminator_backbone(ck["model"])
    try:
        _, new = load_backbone(classifier, state)
        dropped = sorted(k for k in ck["model"] if not k.startswith("backbone."))   # rtd: generator, both heads
    except RuntimeError as e:
        fail(f"loading the backbone of {path}: {str(e).splitlines()[0]}")
    log(run_dir, f"loaded backbone from {path} ({ck['phase']} epoch {ck['epoch']}, {ck['best']['name']} "
        f"{ck['best']['value']:.4f}); new: {', '.join(new)}; dropped: {', '.join(dropped)}")


def test_best(classifier, args, splits, run_dir, device):
    """Test accuracy of the checkpoint with the best validation accuracy (best.pt)."""
    classifier.load_state_dict(read_checkpoint(run_dir / "best.pt", device)["model"])
    prepare = partial(finetune_inputs, task=args.task, device=device)
    test_batches = loader(splits["test"], args.batch_size, args, device)
    return evaluate(classifier, prepare, test_batches, args.seed + 3, precision(args, device)[1])


def run_both_phases(args, cfg, meta, classifier, splits, run_dir, device, resume, init_ck):
    """Pre-train (with --spt), fine-tune, test: the method. -> results (test_acc, best_val_acc, spt_val_metric, ...)."""
    seconds, spt = {}, None
    resuming_ft = resume is not None and resume["phase"] == "finetune"
    if args.spt:
        spt = resume["spt"] if resuming_ft else pretrain(args, cfg, meta, splits, run_dir, device, resume)
        seconds["spt"] = spt["seconds"]
    if (args.spt or args.init_from) and not resuming_ft:                # else last.pt holds the whole state
        load_pretrained(classifier, args, run_dir, device, init_ck)
    phase = Phase("finetune", args.epochs, args.lr, args.batch_size, args.accum_steps, "best.pt", "acc")
    ft = run_phase(phase, classifier, partial(finetune_inputs, task=args.task, device=device), splits, args, run_dir,
                   dict(meta, spt=spt), resume if resuming_ft else None)
    seconds["finetune"] = ft["seconds"]
    t_test = time.time()
    try:
        test = test_best(classifier, args, splits, run_dir, device)
    except KeyboardInterrupt:
        raise KeyboardInterrupt("the test") from None
    seconds["test"] = time.time() - t_test
    spt_text = " | SPT " + " ".join(f"val_{k} {v:.4f}" for k, v in spt["val"].items()) if spt else ""
    log(run_dir, f"test | acc {test['acc']:.4f} | loss {test['loss']:.4f} | best val_acc {ft['best']:.4f} "
        f"(epoch {ft['epoch']}){spt_text}", {"phase": "test", "test_acc": test["acc"], "test_loss": test["loss"]})
    settings = {"span": ["span_mean"], "rtd": ["gen_width", "gen_layers", "rtd_weight", "gdes"]}.get(args.objective, [])
    objective = {k: getattr(args, k) for k in ["objective", "mask_ratio", *settings]} if args.spt else None
    spt_val = spt and {"name": spt["metric"], "value": spt["best"], "epoch": spt["epoch"], **spt["val"]}
    return {"test_acc": test["acc"], "test_loss": test["loss"], "best_val_acc": ft["best"], "best_epoch": ft["epoch"],
            "spt_val_metric": spt_val, "spt_objective": objective, "wall_time_s": seconds}


def main(argv=None):
    args, given, defaults = parse_flags(argv)
    resume = lock = None
    if args.resume:                                                      # the run's own settings, its last.pt, and
        args, resume, lock = resume_settings(args, given, defaults)      # its lock, held until the run ends
    config_kw, notes = apply_presets(args)                               # preset first, then explicit flags win
    spt_only = sorted(given & {"objective", "mask_ratio", "span_mean", "gen_width", "gen_layers", "rtd_weight", "gdes",
                               "pretrain_epochs", "pretrain_lr", "pretrain_batch_size", "pretrain_accum_steps"})
    if spt_only and not args.spt:
        notes.append(f"note: {', '.join('--' + k.replace('_', '-') for k in spt_only)} only act with --spt: ignored")
    try:
        cfg = check_flags(args, config_kw)                               # every flag, before anything is written
    except ValueError as e:
        fail(str(e))
    if resume:                                                           # the weights' own config, whatever the
        cfg = type(cfg)(**resume["config"])                              # presets say today
    device, world = setup_device(args)                                   # also settles --precision and --workers
    splits, source, data_notes, t_data = load_data(args)                 # before any collective (DDP start-up)
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
                          splits, source, data_notes, classifier, meta, t_data)
    if resume:
        lines.insert(0, f"resuming after {resume['phase']} epoch {resume['epoch']} (step {resume['step']})")
    run_meta = dict(meta, preset=args.preset, device=str(device), torch=torch.__version__, git=git_commit(),
                    data_source=source, data_notes=data_notes, threads=threads,
                    command=sys.argv if argv is None else ["train.py", *argv])
    with run_folder(args, run_meta, lines, lock) as run_dir:
        log(run_dir, f"run folder: {run_dir}")
        try:
            results = run_both_phases(args, cfg, meta, classifier, splits, run_dir, device, resume, init_ck)
        except KeyboardInterrupt as e:
            stopped_by_ctrl_c(run_dir, e.args[0] if e.args else "start-up")     # prints one line, exits 130
        results.update(params=sum(p.numel() for p in classifier.parameters()), n_train=len(splits["train"]),
                       data_source=source, data_notes=data_notes, preset=args.preset, device=str(device),
                       processes=world, threads=threads, run_dir=str(run_dir))
        seconds = {"data": t_data, **results["wall_time_s"]}
        results["wall_time_s"] = {**seconds, "total": sum(seconds.values())}   # resumed: the phases' time before too
        write_results(run_dir, results)
    if world > 1:  # free the DDP wrappers (reference cycles) first: else gloo threads can outlive the group and
        gc.collect()   # abort the exit (SIGABRT, "terminate called without an active exception")
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
