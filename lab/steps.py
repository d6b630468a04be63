"""lab/steps.py: how the training step train.py writes out (train_phase: batch -> corruption -> forward -> loss ->
backward -> guarded optimiser step) runs on the hardware: Training, a phase's state. Besides train.py a step reads
only this file, denoise.py (the corruption and the loss) and the model's forward.
batch:      the loader's collate (lra_data.clean_batch) makes the clean batch on the host (pads, pixels normalised,
            the grey-level targets); Training.batches moves it to the device once (to_device)
precision:  lab/hardware.precision's, decided once: bf16 / fp16 autocast (+ gradient scaler), tf32, fp32
DDP:        every process reads the whole global batch and keeps its rows (uneven shards allowed: the loss divides
            by the global count), sums of metrics are added over processes; micro-batches split a step's rows
guard:      a non-finite update is skipped on the device (fused AdamW's found_inf) and stops the run by name within
            PROGRESS_STEPS steps; nothing per step reads a device value back to the host
loaders:    a seeded order per epoch (its state in last.pt), pinned memory and persistent workers on CUDA
Check: tests/test_robustness.py (2 and 3 processes equal 1, accumulation equals one batch, no host reads per step),
tests/test_fork.py (the files one step reads, traced).
"""
import contextlib
import hashlib
import json
import math
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import denoise
import lra_data
import models
from lab import hardware, runs
from lab.hardware import precision  # noqa: F401  (steps.precision: where tests and tools look)
from lab.runs import fail
from lra_data import clean_batch as collate  # noqa: F401  (steps.collate: its old name)
from tools import checked

# the progress bar and the non-finite guard read device values once every this many steps
PROGRESS_STEPS = 25


@torch.no_grad()
def evaluate(model, phase, loader, seed, amp, predictions=None):
    """phase.metrics over a whole split, summed on the device and read once; SPT masks come from a
    generator re-seeded each time, so epochs compare alike. DDP: each process scores its rows of
    every batch, the sums are added. predictions: a list that gets the predicted classes."""
    model.eval()
    device = next(model.parameters()).device
    gen, total = torch.Generator(device).manual_seed(seed), {}
    for batch in loader:
        b = phase.prepare(to_device(batch, device), gen, 1.0)
        rows, keep = shard(len(b.weight))
        with amp():
            kept = predictions if keep else None            # a DDP dummy row predicts nothing,
            if predictions is not None and not keep:        # but keeps the batches in step
                predictions.append(torch.zeros(0, dtype=torch.long, device=device))
            total = denoise.add(total, phase.loss(model, b, rows, predictions=kept)[1], keep)
    model.train()
    return phase.metrics(all_sum(total))


# ---- the batch: the loader's collate, then the device ------------------------------------------

def to_device(clean, device):
    """A collated denoise.Clean on `device` (non-blocking from pinned memory on CUDA; a no-op on the CPU)."""
    move = lambda t: t.to(device, non_blocking=True)                # noqa: E731
    lengths = move(clean.lengths)
    return clean._replace(value=move(clean.value), target=move(clean.target), lengths=lengths,
                          content=move(clean.content), labels=move(clean.labels),
                          padded=None if clean.padded is None else lengths)


# ---- DDP: which rows of a batch are this process's, and sums over processes ---------------------

def rank_and_world():
    """(this process's DDP rank, the number of processes); (0, 1) without torch.distributed."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def shard(n):
    """(rows, keep): this process's contiguous share of a global batch of n examples (DDP; one process: all of it),
    some processes one row more when n does not split evenly (the loss divides by the global count, so the gradient
    stays the global-batch mean). Every process reads the whole global batch, so batches and SPT masks are a 1-process
    run's. A process left without rows computes row 0 with keep=False, to join the all-reduce."""
    rank, world = rank_and_world()
    start = rank * (n // world) + min(rank, n % world)
    stop = start + n // world + (rank < n % world)
    return (slice(start, stop), True) if stop > start else (slice(0, 1), False)


def all_sum(total):
    """Add up a dict of additive statistics (device tensors) over all DDP processes, on their device
    (gloo: CPU, NCCL: CUDA), as one process would have them."""
    if not dist.is_initialized():
        return total
    values = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in total.values()])
    dist.all_reduce(values)
    return dict(zip(total, values.unbind()))


class SeededOrder(torch.utils.data.Sampler):
    """A new permutation of the n examples at every pass, drawn from `gen` (its state is in last.pt), so one
    DataLoader (with persistent workers) serves every epoch and the order is that of a 1-process run everywhere."""

    def __init__(self, n, gen):
        self.n, self.gen = n, gen

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.gen).tolist())

    def __len__(self):
        return self.n


def loader(dataset, batch_size, args, device, order=None):
    """Clean batches (lra_data.clean_batch) of `dataset`, a task args.task's split: in a new seeded order each epoch
    (order: a SeededOrder of it) or in order. CUDA: pinned memory, persistent workers that prefetch (and collate)."""
    workers, cuda = args.workers, device.type == "cuda"
    seeds = torch.Generator().manual_seed(args.seed + 4)    # its worker seeds: not from the global (dropout) RNG
    return torch.utils.data.DataLoader(dataset, batch_size, sampler=order, generator=seeds, num_workers=workers,
                                       collate_fn=partial(lra_data.clean_batch, task=args.task), pin_memory=cuda,
                                       persistent_workers=workers > 0, prefetch_factor=4 if workers > 0 else None)


class Training:
    """One phase in progress, everything train.py's step needs besides the method: the module saved (model) and
    the one that runs the batches (forward: model or its DDP / compiled wrapper), the optimiser (fused AdamW over
    param_groups) and its schedule, the fp16 scaler (disabled otherwise: scale() is then the identity), the
    generators, autocast (amp), the loaders, the step and step budget, the best evaluation so far. Made by
    lab/run.Run.phase; log: a line (and record) to the run's log."""

    def __init__(self, phase, model, args, device, splits, meta, log):
        self.model, self.phase, self.args, self.device, self.meta, self.log = model, phase, args, device, meta, log
        self.rank, self.world = rank_and_world()
        self.forward, self.step = model, 0
        n = len(splits["train"])
        self.total = min(phase.epochs * -(-n // phase.batch_size), args.max_steps or float("inf"))
        # "order": batch order, as in TFS and SPT; "mask": SPT masks, drawn on the device
        self.gens = {"order": torch.Generator().manual_seed(args.seed + 1),
                     "mask": torch.Generator(device).manual_seed(args.seed + 2)}
        self.mask_gen = self.gens["mask"]
        _, self.amp, fp16 = precision(args, device)
        self.scaler = fp16 or torch.amp.GradScaler(device.type, enabled=False)
        self.record = torch.full((2,), -1.0, device=device)    # the guard's first [bad step, parameter]
        self.step_t = torch.zeros((), device=device)  # the step on the device: no copy per step
        if self.world > 1:
            self.forward = DDP(model, device_ids=[device] if device.type == "cuda" else None)
        if args.compile:
            self.forward = hardware.compiled(self.forward, args)  # `model` is saved: plain keys
        ssm_lr = meta["config"].get("ssm_lr", phase.lr)
        groups = param_groups(model, phase.lr, args.weight_decay, ssm_lr, models.MODELS[args.model].ssm_params)
        self.opt = torch.optim.AdamW(groups, fused=True)  # fused: its kernel can skip a step on the device
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, partial(
            lr_factor, warmup=args.warmup, schedule=args.schedule, total=self.total))
        self.best = {"name": f"val_{phase.select}", "value": None, "epoch": 0, "val": {}}
        self.epochs_done, self.before, self.start = 0, 0.0, time.time()
        self.train_loader = loader(splits["train"], phase.batch_size, args, device,
                                   order=SeededOrder(n, self.gens["order"]))
        self.val_loader = loader(splits["val"], phase.batch_size, args, device)

    def batches(self, epoch):
        """The clean batches (collate) of one epoch, on the device, in this epoch's seeded order, under a progress
        bar; each process draws its own dropout masks (rank 0's RNG is the one saved). An epoch that ends stops
        at a recorded non-finite update (check_finite)."""
        if self.rank > 0:
            torch.manual_seed(self.args.seed + 1000 * self.rank + epoch)
        with tqdm(self.train_loader, desc=f"{self.phase.name} {epoch}/{self.phase.epochs}", leave=False,
                  dynamic_ncols=True, disable=self.rank > 0) as self.bar:     # redrawn at its own interval
            for batch in self.bar:
                yield to_device(batch, self.device)             # denoise.Clean, made by collate
            check_finite(self, self.phase.name)

    def parts(self, n):
        """This process's rows of a global batch of n examples (its share: shard) in phase.accum_steps micro-batches
        -> (rows, keep, sync) each: keep as shard's; sync: DDP's no_sync on every micro-batch but the last."""
        rows, keep = shard(n)
        parts = micro_batches(rows, self.phase.accum_steps)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            yield part, keep, (self.forward.no_sync() if dist.is_initialized() and not last
                               else contextlib.nullcontext())

    def optimizer_step(self, losses, train):
        """The guarded optimiser step and the schedule (guard_step); losses: the step's micro-batch losses (device
        scalars). Every PROGRESS_STEPS steps, and at the last, device values are read once: a recorded non-finite
        update stops the run, and the progress bar shows train's metrics (this epoch's statistics so far)."""
        guard_step(self, ~torch.isfinite(torch.stack(losses)).all())
        if self.step % PROGRESS_STEPS == 0 or self.step >= self.total:
            check_finite(self, self.phase.name)
            self.bar.set_postfix({k: f"{v:.4f}" for k, v in self.phase.metrics(train).items()})

    def test(self, split, folder):
        """The best checkpoint (folder / phase.best_file) scored on split as an evaluation is -> phase.metrics;
        its predictions -> folder / test_predictions.json (write_predictions)."""
        self.model.load_state_dict(checked.read_checkpoint(folder / self.phase.best_file, self.device)["model"])
        predicted = []
        batches = loader(split, self.args.batch_size, self.args, self.device)
        result = evaluate(self.model, self.phase, batches, self.args.seed + 3, self.amp, predicted)
        write_predictions(folder, split, predicted)
        return result

    def evaluation(self, epoch, since_eval):
        """Evaluate on val; the best so far -> run.record's (line, record, checkpoint: last.pt's dict, the best
        file when this evaluation improved, else None). since_eval: the training statistics since the last
        evaluation. A non-finite validation loss stops the run in one line (check_finite_eval)."""
        phase = self.phase
        val = evaluate(self.forward, phase, self.val_loader, self.args.seed + 3, self.amp)
        check_finite_eval(phase, epoch, val, self.best)     # never a non-finite best or last
        score = (lambda r: -r["loss"]) if phase.select == "loss" else (lambda r: r["acc"])  # noqa: E731
        improved = self.best["epoch"] == 0 or score(val) > score(self.best["val"])
        if improved:
            self.best = {"name": f"val_{phase.select}", "value": val[phase.select], "epoch": epoch, "val": val}
        seconds = self.before + time.time() - self.start
        metrics = dict(train=phase.metrics(all_sum(since_eval)), val=val, improved=improved, seconds=seconds)
        line, entry = evaluation_log(phase, epoch, self.step, self.opt.param_groups[0]["lr"], metrics)
        saved = {**self.meta, **self.saved(), "phase": phase.name, "epoch": epoch, "best": self.best,
                 "seconds": seconds}
        return line, entry, saved, phase.best_file if improved else None

    def summary(self, last, stale):
        """The phase's end (last: its last epoch; stale: evaluations since the best): --compile's counts and an
        early stop in the log; DDP: every process waits (the others read spt.pt / best.pt next) -> {"metric",
        "best", "epoch", "val", "steps", "seconds", "last_epoch", "stopped_early"}."""
        if self.args.compile:                               # graphs so far, fallbacks, breaks
            self.log(*hardware.compile_summary(self.phase.name))
        stopped = 0 < self.phase.patience <= stale
        if stopped:
            self.log(f"{self.phase.name}: stopped after epoch {last}/{self.phase.epochs}: {self.best['name']} "
                     f"not better than epoch {self.best['epoch']}'s for {stale} evaluations")
        if self.world > 1:
            dist.barrier()
        return {"metric": self.best["name"], "best": self.best["value"], "epoch": self.best["epoch"],
                "val": self.best["val"], "steps": self.step, "seconds": self.before + time.time() - self.start,
                "last_epoch": last, "stopped_early": stopped}

    def saved(self):
        """What --resume needs beyond the phase's progress: weights, optimiser, schedule, fp16 scaler, every RNG."""
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        rng = {"torch": torch.get_rng_state(), "cuda": cuda, **{k: g.get_state() for k, g in self.gens.items()}}
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step,
                "scheduler": self.sched.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                "device_type": self.device.type, "rng": rng}

    def restore(self, ck):
        """Inverse of saved(), with the phase's progress (epochs done, best, seconds): continue exactly where the
        checkpoint `ck` (a last.pt) stopped. An optimiser state of an older commit is upgraded (fused=True, which
        the device-side guard needs); a state this code cannot read raises ValueError naming what is missing."""
        try:
            optimizer = ck["optimizer"]
            for group in optimizer["param_groups"]:     # before the fused guard: fused=None
                group.update(fused=True, foreach=None)
            self.model.load_state_dict(ck["model"])
            self.opt.load_state_dict(optimizer)
            self.sched.load_state_dict(ck["scheduler"])
            if self.scaler.is_enabled() and ck.get("scaler"):
                self.scaler.load_state_dict(ck["scaler"])
            torch.set_rng_state(ck["rng"]["torch"])
            if self.device.type == "cuda" and ck["rng"]["cuda"] is not None:   # this GPU's only: the count may change
                torch.cuda.set_rng_state(ck["rng"]["cuda"], self.device)
            for k, g in self.gens.items():
                g.set_state(ck["rng"][k])
            self.step = ck["step"]
            self.step_t.fill_(self.step)
            self.best, self.epochs_done, self.before = ck["best"], ck["epoch"], ck["seconds"]
        except (KeyError, TypeError, RuntimeError, ValueError) as e:
            raise ValueError(f"{type(e).__name__}: {str(e).splitlines()[0][:120]}") from None


def micro_batches(rows, k):
    """rows (a slice) in k contiguous, near-equal parts (fewer when there are fewer rows)."""
    n = rows.stop - rows.start
    bounds = [rows.start + (n * i) // k for i in range(k + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a] or [rows]


def guard_step(state, bad_loss):
    """The optimiser step behind a device-side guard: one fused reduction (torch._foreach_norm) over all gradients
    decides, on the device, whether this update is finite; a non-finite update is skipped inside the fused AdamW
    kernel (found_inf), so it never reaches the weights, and state.record keeps the first such [step, parameter
    index]. fp16: overflowing gradients are the scaler's business (it skips and lowers its scale); only a non-finite
    loss is an error. bad_loss: a device bool, any micro-batch's loss was not finite. Nothing here reads a device
    value: check_finite does, once per progress interval. Then zero_grad and the schedule's step."""
    opt, scaler = state.opt, (state.scaler if state.scaler.is_enabled() else None)
    if scaler is not None:
        scaler.unscale_(opt)
    params = [p for p in state.model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else p.new_zeros(()) for p in params]
    finite = torch.isfinite(torch.stack(torch._foreach_norm(grads)))    # (P,) bool
    error = bad_loss if scaler is not None else bad_loss | ~finite.all()
    first_bad = torch.where(finite.all(), -1, (~finite).int().argmax())     # index into the trained parameters
    update = torch.stack([state.step_t, first_bad.float()])
    state.record.copy_(torch.where((state.record[0] < 0) & error, update, state.record))
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.found_inf = error.float()               # read by the fused kernel, on the device
        opt.step()
    opt.zero_grad(set_to_none=True)
    state.sched.step()
    state.step += 1
    state.step_t += 1


def check_finite(state, phase):
    """Stop at a recorded non-finite update (read once per progress interval), naming its step and the first parameter
    whose gradient was not finite. The guard skipped it: weights and checkpoints so far are intact."""
    record = state.record
    if dist.is_initialized():   # the earliest bad step of any process stops all, with that process's parameter
        step = torch.where(record[0] < 0, torch.inf, record[0])      # a process without one: never the earliest
        first = step.clone()
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        index = torch.where(step == first, record[1], -2.0)      # -2: not the process of that step
        dist.all_reduce(index, op=dist.ReduceOp.MAX)
        record = torch.stack([torch.where(first.isinf(), -1.0, first), index])
    step, index = record.tolist()
    if step < 0:
        return
    names = [n for n, p in state.model.named_parameters() if p.requires_grad]
    bad = f"gradient of {names[int(index)]}" if index >= 0 else "the loss itself"
    raise SystemExit(f"train.py: {phase} step {int(step)}: non-finite loss or gradient, first "
                     f"non-finite: {bad}; the update was skipped, checkpoints so far are intact "
                     f"(try a lower --lr / --pretrain-lr)")


def check_finite_eval(phase, epoch, val, best):
    """Stop in one line (status 2) at an evaluation whose validation loss is not finite: such a model
    never becomes the phase's best checkpoint (phase.best_file keeps the last finite one) nor
    last.pt. best: the phase's best so far ({"epoch": 0} before any)."""
    if math.isfinite(val["loss"]):
        return
    kept = (f"{phase.best_file} holds epoch {best['epoch']}, the last finite evaluation" if best["epoch"]
            else f"no {phase.best_file} was written")
    lr = "--pretrain-lr" if phase.name == "spt" else "--lr"
    fail(f"{phase.name} epoch {epoch}: validation loss {val['loss']} is not finite (the first "
         f"non-finite evaluation); {kept}; start again with a lower {lr}")


# ---- what an evaluation logs, the test's predictions ---------------------------------------

def evaluation_log(phase, epoch, step, lr, metrics):
    """One evaluation's (line for log.txt, record for log.jsonl). metrics: {"train": metrics since the last
    evaluation, "val": validation metrics, "improved": bool, "seconds": phase time so far}."""
    train, val = metrics["train"], metrics["val"]
    m = "r2" if "r2" in val else "acc"
    line = (f"eval {phase.name:8s} epoch {epoch:3d}/{phase.epochs} step {step:6d} | "
            f"train_loss {train['loss']:.4f} {m} {train[m]:.4f} | val_loss {val['loss']:.4f} "
            f"val_{m} {val[m]:.4f}{' *' if metrics['improved'] else '  '} | lr {lr:.1e} | "
            f"{metrics['seconds']:.0f} s")
    return line, {"phase": phase.name, "epoch": epoch, "step": step, **{f"train_{k}": v for k, v in train.items()},
                  **{f"val_{k}": v for k, v in val.items()}, "lr": lr, "elapsed_s": metrics["seconds"]}


def write_predictions(folder, split, predicted):
    """test_predictions.json: the test labels and the best checkpoint's predictions, one digit per
    example in split order (a digest of its index into the cached part says which examples), so two
    runs on one split compare example by example (results/stats.py: McNemar). DDP: every process's
    rows, gathered (one writes). ~2 bytes per example (Text, 25,000 reviews: 50 KB)."""
    rows = torch.cat(predicted).cpu() if predicted else torch.zeros(0, dtype=torch.long)
    if dist.is_initialized():                       # each process scored its rows of every batch
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, [p.cpu() for p in predicted])
        rows = torch.cat([torch.cat(batch) for batch in zip(*parts)])    # batch by batch, rank by rank: in order
    labels = [int(y) for y in split.labels]
    if runs.rank() > 0:
        return
    if len(rows) != len(labels) or max(labels + rows.tolist(), default=0) > 9:
        print(f"note: no test_predictions.json: {len(rows)} predictions of {len(labels)} examples, "
              f"or over 10 classes (one digit an example)", flush=True)
        return
    index = hashlib.sha1(",".join(map(str, map(int, split.index))).encode()).hexdigest()
    text = json.dumps({"split": "test", "n": len(labels), "index_sha1": index, "labels": "".join(map(str, labels)),
                       "predictions": "".join(map(str, rows.tolist()))})
    runs.write_whole(folder / "test_predictions.json", lambda tmp: tmp.write_text(text + "\n"))


# ---- the optimiser's groups and schedule --------------------------------------------------

def param_groups(model, lr, wd, ssm_lr, ssm_names):
    """AdamW groups: SSM parameters (leaf name in ssm_names) get ssm_lr and no weight decay (with
    the global lr and decay S4 loses much accuracy: S4 §4); norms, biases and embeddings get no
    weight decay; the rest wd. Each parameter is in exactly one group. Prints the group sizes."""
    decay, no_decay, ssm, seen = [], [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            norm = "Norm" in type(module).__name__              # LayerNorm, BatchNorm*, RMSNorm, ...
            if name in ssm_names:
                ssm.append(p)
            elif name == "bias" or isinstance(module, nn.Embedding) or norm:
                no_decay.append(p)
            else:
                decay.append(p)
    size = lambda ps: sum(p.numel() for p in ps)  # noqa: E731
    print(f"param groups: decay {size(decay):,} (lr {lr:.1e}, wd {wd}) | no-decay {size(no_decay):,} (norms, "
          f"biases, embeddings) | ssm {size(ssm):,} (lr {ssm_lr:.1e}, wd 0)")
    groups = [dict(params=decay, lr=lr, weight_decay=wd),
              dict(params=no_decay, lr=lr, weight_decay=0.0),
              dict(params=ssm, lr=ssm_lr, weight_decay=0.0)]
    return [g for g in groups if g["params"]]


def constant(progress):
    """The paper's schedule: the peak lr all along after warm-up."""
    return 1.0


def cosine(progress):
    """Half a cosine from 1 down to 0 over the steps after warm-up."""
    return 0.5 * (1 + math.cos(math.pi * progress))


# --schedule's choices: name -> the lr multiplier after warm-up, a function of the progress
# through the steps after it (0 -> 1); a new schedule is one entry (docs/fork.md)
SCHEDULES = {"constant": constant, "cosine": cosine}


def lr_factor(step, warmup, total, schedule):
    """Every group's lr multiplier: linear warm-up, then SCHEDULES[schedule]."""
    if step < warmup:
        return (step + 1) / warmup
    return SCHEDULES[schedule](min(1.0, (step - warmup) / max(1, total - warmup)))
