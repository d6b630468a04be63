"""train.py: self pre-training (SPT), then fine-tuning, on the Long Range Arena (Amos et al., 2024).
phase 1 (--spt): backbone + denoising head learn to restore masked (or next) inputs of the task's
                 own training split
phase 2:         the same backbone + a fresh pooled classifier learn the labels; without --spt it
                 starts from random init ("trained from scratch", TFS). Test: the best-val model.
    python train.py --model dlr --task pathfinder --spt --preset tiny    # the quick start (CPU)
    python train.py --model dlr --task pathx --spt                       # paper preset on a GPU
    python train.py --resume runs/<run folder>                           # continue a stopped run
    torchrun --nproc_per_node=4 train.py --model s4 --task pathx --spt   # DDP, global --batch-size
Reading order: the flags (parse_flags: each flag once, with its range; MODELS is in models.py,
OBJECTIVES in objectives.py), one phase (run_phase; its steps: steps.train_epoch, top to bottom),
the method (run_both_phases), main() by steps.
Check: tests/test_train.py, test_robustness.py, test_faults.py, test_fork.py (docs/fork.md).
"""
import argparse
import dataclasses
import gc
import math
import os
import time
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

# Before torch starts OpenMP: spinning threads wait a whole time slice for a descheduled partner in
# every parallel region, which makes small runs on a shared CPU several times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import denoise  # noqa: E402
import lra_data  # noqa: E402
import models  # noqa: E402
import objectives  # noqa: E402
from lab import curves, hardware, loggers, memory, presets, provenance, runs, steps  # noqa: E402
from lab.runs import fail, log  # noqa: E402
from models import MODELS, build_model, load_model  # noqa: E402, F401  (load_model: public)
from objectives import OBJECTIVES  # noqa: E402
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
    flag("--generate", type=presets.number(int, lambda v: v == 0 or v >= 10, "must be 0 (never) or at least 10"),
         default=None, help="examples to make if absent (0: never)")
    flag("--data-fraction", type=in_range(0, 1, open_low=True), default=1.0, help="of train")
    flag("--lra-val", action="store_true", help="text, image: validate on test, as LRA did")
    flag("--max-len", type=at_least(2), default=None, help="text, retrieval: cut documents (default: no cut)")
    flag("--max-train", type=count, default=None, help="at most this many train examples")
    flag("--max-eval", type=count, default=None, help="at most this many val / test examples")
    flag("--workers", type=count, default=None, help="DataLoader workers (default: CPU 0, CUDA 8)")
    flag("--seed", type=presets.seed(), default=0, help="model init; batch order seed+1, masks seed+2")
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
    p.error = lambda message: fail(f"{presets.flag_message(message)} (python train.py --help lists "
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


def run_phase(phase, model, run, splits, resume=None):
    """Train phase.epochs epochs; after every --eval-every-th epoch and the last, evaluate on val
    and write the best checkpoint so far (phase.best_file) and last.pt, the state to continue
    from. run: runs.Run; resume: a last.pt of this phase, continued exactly as if never stopped.
    With phase.patience K > 0 the phase ends early once K evaluations in a row have not beaten the
    best (early stopping; the count is read from the best's epoch, so a resumed run keeps it).
    Returns {"metric", "best", "epoch", "val", "steps", "seconds", "last_epoch", "stopped_early"}."""
    args, start, (rank, world) = run.args, time.time(), steps.rank_and_world()
    state = steps.Training(model, phase, args, run.device, len(splits["train"]))
    if world > 1:
        state.forward = DDP(model, device_ids=[run.device] if run.device.type == "cuda" else None)
    if args.compile:
        state.forward = hardware.compiled(state.forward, args)  # `model` is saved: plain keys
    ssm_lr = run.meta["config"].get("ssm_lr", phase.lr)
    ssm_names = MODELS[args.model].ssm_params
    groups = steps.param_groups(model, phase.lr, args.weight_decay, ssm_lr, ssm_names)
    state.optimizer(groups, partial(steps.lr_factor, warmup=args.warmup, schedule=args.schedule))
    best = {"name": f"val_{phase.select}", "value": None, "epoch": 0, "val": {}}
    done, before = 0, 0.0
    if resume is not None:
        try:
            state.restore(resume)
        except ValueError as e:                            # e.g. an optimiser of other groups
            fail(f"--resume {run.folder}: its last.pt (commit {resume['commit']}) cannot be "
                 f"restored by this code ({e}); start a new run")
        runs.catch_up_log(run.folder, resume)              # a kill came between last.pt and log
        best, done, before = resume["best"], resume["epoch"], resume["seconds"]
    batches = steps.loader(splits["train"], phase.batch_size, args, run.device,
                           order=state.gens["order"])
    val_batches = steps.loader(splits["val"], phase.batch_size, args, run.device)
    score = (lambda r: -r["loss"]) if phase.select == "loss" else (lambda r: r["acc"])  # noqa: E731
    since_eval, last, stale = {}, done, 0                   # training statistics since the last eval
    for epoch in range(done + 1, phase.epochs + 1):
        # evaluations after the best one: every --eval-every-th epoch (the last is never before this)
        stale = sum(1 for e in range(best["epoch"] + 1, epoch) if e % args.eval_every == 0)
        if state.step >= state.total or 0 < phase.patience <= stale:
            break
        last = epoch
        if rank > 0:            # own dropout masks per process; rank 0's RNG is the one saved
            torch.manual_seed(args.seed + 1000 * rank + epoch)
        train = steps.train_epoch(state, batches, f"{phase.name} {epoch}/{phase.epochs}")
        since_eval = denoise.add(since_eval, train)
        if epoch % args.eval_every and epoch < phase.epochs and state.step < state.total:
            continue                                        # evaluate every k-th epoch and the last
        with runs.stopping_at(f"{phase.name} epoch {epoch}/{phase.epochs}, evaluation"):
            val = steps.evaluate(state.forward, phase, val_batches, args.seed + 3, state.amp)
            steps.check_finite_eval(phase, epoch, val, best)    # never a non-finite best or last
            improved = best["epoch"] == 0 or score(val) > score(best["val"])
            if improved:
                best = {"name": f"val_{phase.select}", "value": val[phase.select], "epoch": epoch,
                        "val": val}
            seconds = before + time.time() - start
            metrics = dict(train=phase.metrics(steps.all_sum(since_eval)), val=val,
                           improved=improved, seconds=seconds)
            entry = steps.evaluation_log(phase, epoch, state.step, state.opt.param_groups[0]["lr"],
                                        metrics)                    # (line, record)
            saved = {**run.meta, **state.saved(), "phase": phase.name, "epoch": epoch,
                     "best": best, "seconds": seconds, "log": entry}
            runs.save_evaluation(run.folder, phase.best_file if improved else None, saved)
        since_eval = {}
    if args.compile:                                        # graphs so far, fallbacks, breaks
        log(run.folder, *hardware.compile_summary(phase.name))
    stopped = 0 < phase.patience <= stale
    if stopped:
        log(run.folder, f"{phase.name}: stopped after epoch {last}/{phase.epochs}: "
            f"{best['name']} not better than epoch {best['epoch']}'s for {stale} evaluations")
    if world > 1:
        dist.barrier()                                      # the others read spt.pt / best.pt next
    return {"metric": best["name"], "best": best["value"], "epoch": best["epoch"],
            "val": best["val"], "steps": state.step, "seconds": before + time.time() - start,
            "last_epoch": last, "stopped_early": stopped}


# ---- the method: pre-train, fine-tune, test ----------------------------------------------------

def pretrain(run, splits, resume):
    """Phase 1: a fresh backbone inside the objective's SPT model (its OBJECTIVES entry builds it:
    a denoising head, or ELECTRA's generator + discriminator) on the training inputs; the best one
    by the objective's own validation loss is saved as spt.pt."""
    args, objective = run.args, OBJECTIVES[run.args.objective]
    flags = {k: getattr(args, k) for k in objective.flags}       # its own flags, by name
    torch.manual_seed(args.seed)
    spt = run.with_meta(head=objectives.spt_head(args.objective, flags))
    phase = Phase("spt", args.pretrain_epochs, args.pretrain_lr, args.pretrain_batch_size,
                  args.pretrain_accum_steps, "spt.pt", "loss",
                  *objectives.batch_functions("spt", args.task, args.objective, flags),
                  args.pretrain_patience)
    return run_phase(phase, build_model(spt.meta).to(run.device), spt, splits, resume)


def load_pretrained(classifier, run, init_ck=None):
    """Copy the backbone of spt.pt (after --spt) or --init-from (init_ck) into the classifier,
    strictly: only the old and the new heads may differ (the objective's entry says which weights
    are the backbone)."""
    path = run.folder / "spt.pt" if run.args.spt else Path(run.args.init_from)
    ck = init_ck or runs.read_checkpoint(path, run.device)
    try:
        _, new = models.load_backbone(classifier, objectives.backbone_state(ck))
    except RuntimeError as e:
        fail(f"loading the backbone of {path}: {str(e).splitlines()[0]}")
    dropped = sorted(k for k in ck["model"] if not k.startswith("backbone."))   # heads, generator
    log(run.folder, f"loaded backbone from {path} ({ck['phase']} epoch {ck['epoch']}, "
        f"{ck['best']['name']} {ck['best']['value']:.4f}); new: {', '.join(new)}; dropped: "
        f"{', '.join(dropped)}")


def test(classifier, run, splits, phase):
    """Test accuracy of the best-validation checkpoint (best.pt); its predictions are saved."""
    args = run.args
    with runs.stopping_at("the test"):
        best = runs.read_checkpoint(run.folder / "best.pt", run.device)
        classifier.load_state_dict(best["model"])
        batches, predicted = steps.loader(splits["test"], args.batch_size, args, run.device), []
        amp = steps.precision(args, run.device)[1]
        result = steps.evaluate(classifier, phase, batches, args.seed + 3, amp, predicted)
        steps.write_predictions(run.folder, splits["test"], predicted)
    return result


def run_both_phases(run, classifier, splits, resume, init_ck):
    """Pre-train (with --spt), fine-tune, test: the method. -> results (test_acc, ...)."""
    args, seconds, spt = run.args, {}, None
    resuming_ft = resume is not None and resume["phase"] == "finetune"
    if args.spt:
        spt = resume["spt"] if resuming_ft else pretrain(run, splits, resume)
        seconds["spt"] = spt["seconds"]
    if (args.spt or args.init_from) and not resuming_ft:    # else last.pt holds the whole state
        load_pretrained(classifier, run, init_ck)
    phase = Phase("finetune", args.epochs, args.lr, args.batch_size, args.accum_steps, "best.pt",
                  "acc", *objectives.batch_functions("finetune", args.task))
    ft = run_phase(phase, classifier, run.with_meta(spt=spt), splits,
                   resume if resuming_ft else None)
    seconds["finetune"], t_test = ft["seconds"], time.time()
    result = test(classifier, run, splits, phase)
    seconds["test"] = time.time() - t_test
    spt_text = spt and " | SPT " + " ".join(f"val_{k} {v:.4f}" for k, v in spt["val"].items())
    log(run.folder, f"test | acc {result['acc']:.4f} | loss {result['loss']:.4f} | best val_acc "
        f"{ft['best']:.4f} (epoch {ft['epoch']}){spt_text or ''}",
        {"phase": "test", "test_acc": result["acc"], "test_loss": result["loss"]})
    knobs = ["objective", *OBJECTIVES[args.objective].flags]
    spt_val = spt and {"name": spt["metric"], "value": spt["best"], "epoch": spt["epoch"],
                       **spt["val"]}
    return {"test_acc": result["acc"], "test_loss": result["loss"], "best_val_acc": ft["best"],
            "best_epoch": ft["epoch"], "spt_val_metric": spt_val, "wall_time_s": seconds,
            "spt_objective": {k: getattr(args, k) for k in knobs} if args.spt else None,
            "spt_epochs": spt and spt["last_epoch"], "spt_stopped_early": spt and spt["stopped_early"]}


# ---- the steps of main() -----------------------------------------------------------------------

def settle(argv):
    """Flags, a --resume's own settings and lock, presets, every check, before anything is written
    -> (args, backbone config, notes to print, resume: its last.pt or None, lock)."""
    args, given, defaults = parse_flags(argv)
    how, resume, lock = "given" if args.preset else "default", None, None
    if args.resume:                                 # the run's own settings, last.pt and lock
        args, resume, lock = runs.resume_settings(args, given, defaults)
    entry, objective = MODELS[args.model], OBJECTIVES[args.objective]
    try:
        config_kw, notes = presets.apply(args, entry)        # the preset, then the flags
        run = objectives.Run(args.task, args.causal, lambda **changes: presets.model_config(
            entry.Config, args.task, {**config_kw, **changes}, args.causal), entry.build)
        objectives.fill_defaults(args, run)                 # e.g. the task's mask ratio
        cfg = presets.check(args, config_kw, entry)
        flags = {k: getattr(args, k) for k in objective.flags}
        if args.spt and (why := objective.bound("refuse", flags)(run)):
            raise ValueError(why)
    except ValueError as e:
        fail(str(e))
    notes += unused_flag_notes(args, given)
    if resume:                                      # the weights' own config, whatever the presets
        cfg = type(cfg)(**resume["config"])
    runs.absolute_paths(args)                       # a resume from elsewhere finds the same files
    notes.insert(0, f"preset {args.preset} ({how}); explicit flags override it")
    return args, cfg, notes, resume, lock


def unused_flag_notes(args, given):
    """One line per kind of flag typed but not used by this run: SPT flags without --spt, an
    objective's flags with another objective, a model knob the chosen model's config lacks."""
    def named(keys):
        return ", ".join("--" + k.replace("_", "-") for k in sorted(keys))
    notes, objective = [], OBJECTIVES[args.objective]
    spt_only = given & {"objective", "pretrain_epochs", "pretrain_lr", "pretrain_batch_size",
                        "pretrain_accum_steps", "pretrain_patience",
                        *(n for o in OBJECTIVES.values() for n in o.flags)}
    other_objective = given & {n for o in OBJECTIVES.values() for n in o.flags} - set(objective.flags)
    if spt_only and not args.spt:
        notes.append(f"note: {named(spt_only)} only act{'s' * (len(spt_only) == 1)} with --spt: "
                     f"ignored")
    elif other_objective:
        owners = sorted({k for k, o in OBJECTIVES.items() if other_objective & set(o.flags)})
        notes.append(f"note: {named(other_objective)} belong{'s' * (len(other_objective) == 1)} "
                     f"to --objective {' / '.join(owners)}, not {args.objective}: ignored")
    knobs = models.knobs()
    unused = {k for k in given & set(knobs) if args.model not in knobs[k][2]}
    if unused:
        owners = sorted({m for k in unused for m in knobs[k][2]})
        notes.append(f"note: {named(unused)}: no such field in the {args.model} config (only "
                     f"{', '.join(owners)}): ignored")
    return notes


def prepare_data(args):
    """The three splits (generated and cached on first use, under a lock) -> runs.Data."""
    start = time.time()
    with runs.stopped_in(), runs.stopping_at("preparing the data"):
        try:
            splits = lra_data.load_splits(args)
        except lra_data.DataError as e:
            fail(str(e))
    notes = list(dict.fromkeys(n for s in splits.values() for n in s.notes))   # each note once
    return runs.Data(splits, splits["train"].source, notes, time.time() - start,
                     lra_data.fingerprint(splits))


def build(args, cfg, device, resume):
    """The classifier (seeded init), its description, and the --init-from checkpoint, checked
    before any run folder exists -> (meta, classifier, init checkpoint or None)."""
    spec = lra_data.TASKS[args.task]
    head = dict(kind="classifier", n_classes=spec.n_classes, pool=args.pool, pair=spec.pair)
    meta = dict(model_name=args.model, task=args.task, config=dataclasses.asdict(cfg), head=head,
                args=vars(args))
    torch.manual_seed(args.seed)                    # model init
    classifier, init_ck = build_model(meta).to(device), None
    if args.init_from and not resume:
        try:
            init_ck = runs.read_checkpoint(args.init_from, device)
            models.check_init_checkpoint(init_ck, args.model, args.task, meta["config"])
        except ValueError as e:
            fail(f"--init-from {args.init_from}: {e}")
    return meta, classifier, init_ck


def main(argv=None):
    runs.stop_on_sigterm()                          # a scheduler's SIGTERM is a Ctrl-C
    checked.console_as_os_bytes()                   # a path of any bytes prints as the OS gave it
    hardware.check_ddp_environment()                # WORLD_SIZE, RANK, MASTER_*: one line, before anything
    args, cfg, notes, resume, lock = settle(argv)
    if why := loggers.probe(args.log_to):          # an optional part fails here, before any run folder
        if not resume:
            fail(why)
        log(None, f"note: {why}; the resumed run continues without --log-to")
        args.log_to = None
    device, world = hardware.setup_device(args)        # also --precision and --workers
    data = prepare_data(args)                       # before any collective (DDP start-up)
    device = hardware.join_process_group(device, world)
    meta, classifier, init_ck = build(args, cfg, device, resume)
    knobs = ", ".join(f"{k} {getattr(args, k)}" for k in OBJECTIVES[args.objective].flags)
    plan = (f"SPT {args.objective}{f' ({knobs})' if knobs else ''}, then fine-tune" if args.spt
            else f"fine-tune from {args.init_from}" if args.init_from else "from scratch (TFS)")
    memory_lines, memory_plan = memory.plan_memory(args, meta, device, world)   # micro-batches
    lines = runs.startup_lines(args, plan, notes, data, classifier, meta) + memory_lines
    if resume:
        lines.insert(0, f"resuming after {resume['phase']} epoch {resume['epoch']} (step "
                        f"{resume['step']})")
    config = runs.run_meta(meta, args, argv, data, device)       # config.json
    config["memory_plan"] = memory_plan
    with runs.run_folder(args, config, lines, lock) as folder, \
            loggers.mirror(args.log_to, folder, config):    # --log-to: log.jsonl's records
        run = runs.Run(args, device, folder, meta)
        log(folder, f"run folder: {folder}")
        with runs.stopped_in(folder):               # a stop: one line, the --resume command
            results = run_both_phases(run, classifier, data.splits, resume, init_ck)
        results.update(params=sum(p.numel() for p in classifier.parameters()),
                       n_train=len(data.splits["train"]), data_source=data.source,
                       data_notes=data.notes, preset=args.preset, device=str(device),
                       processes=world, machine=provenance.machine(device), run_dir=str(folder))
        seconds = {"data": data.seconds, **results["wall_time_s"]}
        results["wall_time_s"] = {**seconds, "total": sum(seconds.values())}   # all the phases
        steps.write_results(folder, results)
        if not args.no_curves and runs.rank() == 0:
            curves.after_run(folder, partial(log, folder))            # curves.png
    if world > 1:   # free the DDP wrappers (reference cycles) first: else gloo threads can outlive
        gc.collect()    # the group and abort the exit (SIGABRT)
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
