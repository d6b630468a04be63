"""train.py: self pre-training (SPT), then fine-tuning, on the Long Range Arena (Amos et al., 2024).
phase 1 (--spt): backbone + denoising head learn to restore masked (or next) inputs of the task's
                 own training split
phase 2:         the same backbone + a fresh pooled classifier learn the labels; without --spt it
                 starts from random init ("trained from scratch", TFS). Test: the best-val model.
    python train.py --model dlr --task pathfinder --spt --preset tiny    # the quick start (CPU)
    python train.py --model dlr --task pathx --spt                       # paper preset on a GPU
    python train.py --resume runs/<run folder>                           # continue a stopped run
    torchrun --nproc_per_node=4 train.py --model s4 --task pathx --spt   # DDP, global --batch-size
Reading order, top to bottom: the flags (each once, with its range; MODELS and OBJECTIVES are
models.py's), one phase with its training step (train_phase), the method (main: flags -> data ->
model -> SPT -> fine-tuning -> test). The machinery that makes a run safe and observable (the run
folder, resume, stops, devices, DDP, precision, the guard, logs) is reached through one object,
lab/run.py's Run, and the phase's lab/steps.Training.
Check: tests/test_train.py, test_robustness.py, test_faults.py, test_fork.py (docs/fork.md).
"""
import argparse
import math
import os
import time
from pathlib import Path
from typing import Callable, NamedTuple

# Before torch starts OpenMP: spinning threads wait a whole time slice for a descheduled partner in
# every parallel region, which makes small runs on a shared CPU several times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

import denoise  # noqa: E402
import lra_data  # noqa: E402
import models  # noqa: E402
from lab import loggers, presets, steps  # noqa: E402
from lab.run import Run  # noqa: E402
from lab.runs import fail  # noqa: E402
from models import MODELS, OBJECTIVES, build_model, load_model  # noqa: E402, F401  (load_model: public)
from tools import checked  # noqa: E402
from tools.checked import at_least, in_range  # noqa: E402


# ---- every flag, once ------------------------------------------------------------------------

def parse_flags(argv):
    """The command line -> (args, the flags typed on it, even at their default value, every flag's
    default). A value out of range stops here in one line (its type checks it); a None default is
    the preset's."""
    p = argparse.ArgumentParser(description="Self pre-training (SPT) and fine-tuning on the LRA.",
                                formatter_class=presets.FlagHelp, epilog=presets.EPILOG)
    flag, count, rate = p.add_argument, at_least(0), in_range(0, math.inf, open_low=True)
    flag("--model", choices=MODELS, default="dlr", help=", ".join(MODELS))
    flag("--task", choices=lra_data.TASKS, default="pathfinder", help=", ".join(lra_data.TASKS))
    flag("--spt", action="store_true", help="self pre-train on the train split, then fine-tune")
    flag("--objective", choices=OBJECTIVES, default=next(iter(OBJECTIVES)),
         help="; ".join(f"{k}: {o.doc}" for k, o in OBJECTIVES.items()))
    for name, f in {n: f for o in OBJECTIVES.values() for n, f in o.flags.items()}.items():
        users = ", ".join(k for k, o in OBJECTIVES.items() if name in o.flags)
        flag("--" + name.replace("_", "-"), default=f.default, help=f"{users}: {f.help}",
             **({"action": f.action} if f.action else {"type": f.type}))
    flag("--causal", action="store_true", help="causal Transformer, unidirectional S4 / DLR")
    flag("--preset", choices=["tiny", "small", "paper"], default=None, help="default: paper on "
         "CUDA, else tiny")
    flag("--epochs", type=at_least(1), default=None, help="fine-tuning epochs")
    flag("--pretrain-epochs", type=at_least(1), default=None, help="SPT epochs (with "
         "--pretrain-patience: the most)")
    flag("--pretrain-patience", type=count, default=0, help="stop SPT after this many evaluations "
         "without a lower val loss (0: never)")
    flag("--eval-every", type=at_least(1), default=1, help="evaluate every k epochs, and last")
    flag("--max-steps", type=count, default=0, help="at most this many steps a phase (0: all)")
    flag("--batch-size", type=at_least(1), default=None, help="fine-tuning batch (all processes)")
    flag("--pretrain-batch-size", type=at_least(1), default=None, help="SPT batch")
    flag("--accum-steps", type=at_least(1), default=None, help="fine-tuning micro-batches")
    flag("--pretrain-accum-steps", type=at_least(1), default=None, help="SPT micro-batches")
    flag("--lr", type=rate, default=None, help="fine-tuning learning rate")
    flag("--pretrain-lr", type=rate, default=None, help="SPT learning rate")
    flag("--weight-decay", type=in_range(0, math.inf), default=None, help="AdamW weight decay")
    flag("--warmup", type=count, default=None, help="linear warm-up steps")
    flag("--schedule", choices=steps.SCHEDULES, default="constant", help="after warm-up: "
         + ", ".join(steps.SCHEDULES))
    flag("--pool", choices=["mean", "max", "last"], default=None, help="default: the task's")
    flag("--data-dir", default="data", help="downloaded files; synthetic tasks generated here")
    flag("--cache-dir", default=None, help="arrays (default: <data-dir>/cache or data/cache)")
    flag("--difficulty", choices=["easy", "intermediate", "hard"], default="hard",
         help="Pathfinder contour length 6, 9, 14")
    flag("--generate", type=checked.number(int, lambda v: v == 0 or v >= 10, "must be 0 (never) or at least 10"),
         default=None, help="examples to make if absent (0: never)")
    flag("--data-fraction", type=in_range(0, 1, open_low=True), default=1.0, help="of train")
    flag("--lra-val", action="store_true", help="text, image: validate on test, as LRA did")
    flag("--max-len", type=at_least(2), default=None, help="text, retrieval: cut documents (default: no cut)")
    flag("--max-train", type=count, default=None, help="at most this many train examples")
    flag("--max-eval", type=count, default=None, help="at most this many val / test examples")
    flag("--workers", type=count, default=None, help="DataLoader workers (default: CPU 0, CUDA 8)")
    flag("--seed", type=checked.seed(), default=0, help="model init; batch order seed+1, masks seed+2")
    flag("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if there)")
    flag("--precision", choices=["fp32", "tf32", "bf16", "fp16"], default=None,
         help="default: bf16 or fp16 on CUDA, fp32 on CPU (docs/gpu.md)")
    flag("--amp", action="store_true", help="old name of --precision bf16")
    flag("--compile", action="store_true", help="torch.compile (checkpoints keep plain keys)")
    flag("--deterministic", action="store_true", help="deterministic algorithms (slower; docs/gpu.md)")
    flag("--out", default="runs", help="parent folder of the run folder")
    flag("--init-from", default=None, help="fine-tune this checkpoint's backbone (an spt.pt)")
    flag("--resume", default=None, help="continue the stopped run in this folder")
    flag("--no-curves", action="store_true", help="no curves.png at the end (lab/curves.py)")
    flag("--log-to", type=loggers.log_to, default=None, help="also log to tensorboard or wandb (optional)")
    try:                                       # a fork's model or objective may not shadow a name (one line)
        models.check_entries({a.dest for a in p._actions})
    except ValueError as e:
        fail(str(e))
    for name, (settings, text, users) in models.knobs().items():   # each model's config fields
        flag("--" + name.replace("_", "-"), default=None, **settings,
             help=f"{', '.join(users)}: {text} (default: the preset's, else the config's)")
    p.error = lambda message: fail(f"{checked.flag_message(message)} (python train.py --help lists "
                                   f"the flags)")
    args, defaults, unset = p.parse_args(argv), vars(p.parse_args([])), object()
    typed = p.parse_args(argv, argparse.Namespace(**dict.fromkeys(defaults, unset)))  # no defaults
    return args, {k for k, v in vars(typed).items() if v is not unset}, defaults


# ---- one training phase ----------------------------------------------------------------------

class Phase(NamedTuple):
    name: str                   # "spt" or "finetune"
    epochs: int
    lr: float
    batch_size: int
    accum_steps: int            # micro-batches per step: the same update in less memory
    best_file: str              # spt.pt or best.pt: kept for the next phase / the test
    select: str                 # the validation metric that picks it: "loss" or "acc"
    prepare: Callable           # (clean, gen, progress) -> denoise.Batch: the objective's
                                # corruption (SPT) or the labels (denoise.labelled)
    loss: Callable              # (model, batch, rows, scale) -> (loss, statistics)
    metrics: Callable           # summed statistics -> {"loss": ..., "acc": ...}
    patience: int = 0           # stop after this many evaluations without improvement (0: never)


def train_phase(phase, model, run, splits, meta):
    """Train phase.epochs epochs; after every --eval-every-th epoch and the last, evaluate on val;
    run.record keeps the best checkpoint so far (phase.best_file), last.pt (the state to continue
    from) and the log. With phase.patience K > 0 the phase ends once K evaluations in a row have
    not beaten the best (early stopping). A resumed phase continues exactly as if never stopped.
    meta: the model's description, saved with each checkpoint. Returns ({"metric", "best", "epoch",
    "val", "steps", "seconds", "last_epoch", "stopped_early"}, the phase's state: its .test scores
    the best checkpoint)."""
    t = run.phase(phase, model, splits, meta)   # optimiser, schedule, seeds, precision, DDP, loaders
    since_eval, last, stale = {}, t.epochs_done, 0   # training statistics since the last evaluation
    for epoch in range(t.epochs_done + 1, phase.epochs + 1):
        # early stopping: the evaluations (every --eval-every-th epoch) since the best one
        stale = sum(1 for e in range(t.best["epoch"] + 1, epoch) if e % run.args.eval_every == 0)
        if t.step >= t.total or 0 < phase.patience <= stale:      # or the step budget is spent
            break
        last = epoch
        train = {}                          # this epoch's training statistics (device sums)
        with run.stage(lambda: f"{phase.name} epoch {epoch}/{phase.epochs}, step {t.step}"):
            for clean in t.batches(epoch):  # the clean batch (lra_data.clean_batch), on the device
                # ---- the training step: batch -> corruption -> forward -> loss -> backward -> step
                b = phase.prepare(clean, t.mask_gen, t.step / t.total)   # denoise.Batch
                losses = []
                for rows, keep, sync in t.parts(len(b.weight)):   # this process's rows (DDP), in
                    with sync, t.amp():                           # --accum-steps micro-batches
                        loss, stats = phase.loss(t.forward, b, rows, t.world)
                    t.scaler.scale(loss * keep).backward()        # fp16: scaled
                    train = denoise.add(train, stats, keep)
                    losses.append(loss.detach())
                t.optimizer_step(losses, train)     # skipped if not finite; then the schedule
                if t.step >= t.total:
                    break
        since_eval = denoise.add(since_eval, train)
        if epoch % run.args.eval_every and epoch < phase.epochs and t.step < t.total:
            continue                        # evaluate every k-th epoch and the last
        with run.stage(f"{phase.name} epoch {epoch}/{phase.epochs}, evaluation"):
            run.record(*t.evaluation(epoch, since_eval))   # val; best so far; checkpoints, log
        since_eval = {}
    return t.summary(last, stale), t


# ---- the method: pre-train, fine-tune, test ----------------------------------------------------

def load_pretrained(classifier, run):
    """Copy the backbone of spt.pt (after --spt) or --init-from into the classifier, strictly:
    only the old and the new heads may differ (the objective's entry says which weights are the
    backbone)."""
    path = run.folder / "spt.pt" if run.args.spt else Path(run.args.init_from)
    ck = checked.read_checkpoint(path, run.device)
    try:
        _, new = models.load_backbone(classifier, models.backbone_state(ck))
    except RuntimeError as e:
        fail(f"loading the backbone of {path}: {str(e).splitlines()[0]}")
    dropped = sorted(k for k in ck["model"] if not k.startswith("backbone."))   # heads, generator
    run.record(f"loaded backbone from {path} ({ck['phase']} epoch {ck['epoch']}, "
               f"{ck['best']['name']} {ck['best']['value']:.4f}); new: {', '.join(new)}; "
               f"dropped: {', '.join(dropped)}")


def main(argv=None):
    args, given, defaults = parse_flags(argv)
    run = Run(argv, args, given, defaults)    # presets, checks, --resume, device: no writes yet
    args, resume = run.args, run.resume
    with run.stage("preparing the data"):           # generated and cached on first use, under a lock
        splits = lra_data.load_splits(args)
    torch.manual_seed(args.seed)                    # model init (on the CPU: begin moves it)
    classifier = build_model(run.meta)
    knobs = ", ".join(f"{k} {getattr(args, k)}" for k in OBJECTIVES[args.objective].flags)
    plan = (f"SPT {args.objective}{f' ({knobs})' if knobs else ''}, then fine-tune" if args.spt
            else f"fine-tune from {args.init_from}" if args.init_from else "from scratch (TFS)")
    with run.begin(splits, classifier, plan):       # DDP, the device, the run folder: config, log, lock
        seconds, spt = {}, None
        resuming_ft = resume is not None and resume["phase"] == "finetune"
        if args.spt and resuming_ft:                # SPT is done: last.pt carries its summary
            spt = resume["spt"]
        elif args.spt:  # phase 1, SPT: a fresh backbone inside the objective's SPT model (a denoising
            #             head, or ELECTRA's pair), its best by the objective's own val loss -> spt.pt
            flags = {k: getattr(args, k) for k in OBJECTIVES[args.objective].flags}   # its own flags
            torch.manual_seed(args.seed)
            meta = {**run.meta, "head": dict(kind="spt", objective=args.objective, flags=flags)}
            phase = Phase("spt", args.pretrain_epochs, args.pretrain_lr, args.pretrain_batch_size,
                          args.pretrain_accum_steps, "spt.pt", "loss",
                          *models.batch_functions("spt", args.task, args.objective, flags),
                          args.pretrain_patience)
            spt, _ = train_phase(phase, build_model(meta).to(run.device), run, splits, meta)
        if args.spt:
            seconds["spt"] = spt["seconds"]
        if (args.spt or args.init_from) and not resuming_ft:    # else last.pt holds the whole state
            load_pretrained(classifier, run)
        phase = Phase("finetune", args.epochs, args.lr, args.batch_size, args.accum_steps,
                      "best.pt", "acc", *models.batch_functions("finetune", args.task))
        ft, t = train_phase(phase, classifier, run, splits, {**run.meta, "spt": spt})  # phase 2
        seconds["finetune"], t_test = ft["seconds"], time.time()
        with run.stage("the test"):     # best.pt on the test split; its predictions saved
            result = t.test(splits["test"], run.folder)
        seconds["test"] = time.time() - t_test
        spt_text = spt and " | SPT " + " ".join(f"val_{k} {v:.4f}" for k, v in spt["val"].items())
        run.record(f"test | acc {result['acc']:.4f} | loss {result['loss']:.4f} | best val_acc "
                   f"{ft['best']:.4f} (epoch {ft['epoch']}){spt_text or ''}",
                   {"phase": "test", "test_acc": result["acc"], "test_loss": result["loss"]})
        knobs = ["objective", *OBJECTIVES[args.objective].flags]
        spt_val = spt and {"name": spt["metric"], "value": spt["best"], "epoch": spt["epoch"],
                           **spt["val"]}
        return run.finish({
            "test_acc": result["acc"], "test_loss": result["loss"], "best_val_acc": ft["best"],
            "best_epoch": ft["epoch"], "spt_val_metric": spt_val, "wall_time_s": seconds,
            "spt_objective": {k: getattr(args, k) for k in knobs} if args.spt else None,
            "spt_epochs": spt and spt["last_epoch"], "spt_stopped_early": spt and spt["stopped_early"]})


if __name__ == "__main__":
    main()
