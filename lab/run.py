"""lab/run.py: the run, the one object train.py reaches the machinery through (Run: open or resume, name a
stage, begin the folder, a phase's training state, record, finish). It holds the run's settings, device, folder and
the model's description; it has no loop and no callbacks: train.py's loop calls it.
open:    before anything is written: a stop is one line, the DDP environment, --resume's own settings and lock
         (lab/resume.py), the preset and every check (lab/presets.py), the optional logger (lab/loggers.py), the
         device (lab/hardware.py)
folder:  runs/<task>-<model>-<spt|init|tfs>-s<seed>-<time>/: config.json, log.txt, log.jsonl, spt.pt, best.pt,
         last.pt, results.json, each written whole or not at all (lab/runs.py); a lock keeps one writer per folder
stops:   Ctrl-C and SIGTERM end in one line naming the stage and the --resume command; one that arrives while an
         evaluation writes its files waits until they are written
Check: tests/test_robustness.py, test_faults.py, test_loggers.py (resume, stops, locks, full disks, moved data).
"""
import contextlib
import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import time
from functools import cache, partial
from pathlib import Path

import torch
import torch.distributed as dist

import lra_data
from lab import curves, hardware, loggers, memory, presets, resume, runs, steps
from lab.runs import append_line, fail, rank
from tools import checked


@dataclasses.dataclass
class Data:
    splits: dict                    # "train", "val", "test" -> datasets
    source: str                     # where the examples came from (read or generated)
    notes: list                     # what reading them skipped, cut or found, one line each
    seconds: float
    fingerprint: str = ""           # the examples themselves, not their path (a resume's data check)


class Run:
    """A training run; train.py calls its methods in the order the file's header lists them. Attributes: args
    (every setting, presets applied), device, world (DDP processes), meta (the model's description: model_name, task,
    config, head, args), folder (None before begin), resume (a --resume's last.pt, else None)."""

    def __init__(self, argv, args, given, defaults):
        """Open the run, or reopen a --resume's: settings, checks and device, before anything is written; a bad
        setting is one line (status 2). args, given, defaults: train.parse_flags's."""
        stop_on_sigterm()                               # a scheduler's SIGTERM is a Ctrl-C
        checked.console_as_os_bytes()                   # a path of any bytes prints as the OS gave it
        hardware.check_ddp_environment()                # WORLD_SIZE, RANK, MASTER_*: one line, before anything
        how, self.resume, self.lock = "given" if args.preset else "default", None, None
        if args.resume:                                 # the run's own settings, last.pt and lock
            args, self.resume, self.lock = resume.resume_settings(args, given, defaults)
        cfg, notes = presets.settle(args, given)         # the preset, then the flags; every check
        self.notes = [f"preset {args.preset} ({how}); explicit flags override it", *notes]
        if self.resume:                                 # the weights' own config, whatever the presets
            cfg = type(cfg)(**self.resume["config"])
        absolute_paths(args)                            # a resume from elsewhere finds the same files
        if why := args.log_to and loggers.probe(args.log_to):   # an optional part fails here, before any folder
            if not self.resume:
                fail(why)
            runs.log(None, f"note: {why}; the resumed run continues without --log-to")
            args.log_to = None
        self.device, self.world = hardware.setup_device(args)  # also --precision and --workers
        spec = lra_data.TASKS[args.task]
        head = dict(kind="classifier", n_classes=spec.n_classes, pool=args.pool, pair=spec.pair)
        self.args, self.argv, self.folder, self.started = args, argv, None, time.time()
        self.meta = dict(model_name=args.model, task=args.task, config=dataclasses.asdict(cfg), head=head,
                         args=vars(args))

    @contextlib.contextmanager
    def stage(self, where):
        """The block is a named stage of the run (`where`: a string, or a function giving it): a stop (Ctrl-C,
        SIGTERM) inside it ends the process in one line naming it and what last.pt holds (the --resume command),
        and bad data (lra_data.DataError) is one line too."""
        with stopped_in(self.folder), stopping_at(where):
            try:
                yield
            except lra_data.DataError as e:
                fail(str(e))

    @contextlib.contextmanager
    def begin(self, splits, classifier, plan):
        """Hold the run folder for the block: join the DDP process group (after the data: its preparation takes
        a file lock, never a collective), move the classifier to the device, check --init-from, plan each
        phase's micro-batches (lab/memory.py), then make the folder (or take the --resume one): config.json, the
        start-up lines in log.txt (plan: what the run does, in words), the lock, --log-to's mirror. A stop inside
        ends in one line."""
        args, notes = self.args, list(dict.fromkeys(n for s in splits.values() for n in s.notes))   # each once
        self.data = Data(splits, splits["train"].source, notes, time.time() - self.started,
                         lra_data.fingerprint(splits))
        if self.world > 1:                              # DDP: one process per GPU (NCCL) or CPU process (gloo)
            self.device = hardware.join_process_group(self.device, self.world)
        self.classifier = classifier.to(self.device)
        if args.init_from and not self.resume:         # a backbone that cannot be fine-tuned: one line, now
            try:
                check_init_checkpoint(checked.read_checkpoint(args.init_from, self.device), args.model,
                                             args.task, self.meta["config"])
            except ValueError as e:
                fail(f"--init-from {args.init_from}: {e}")
        memory_lines, memory_plan = (memory.plan_memory(args, self.meta, self.device, self.world)  # micro-batches
                                     if self.device.type == "cuda" else no_card_plan(args, self.world))
        lines = startup_lines(args, plan, self.notes, self.data, classifier, self.meta) + memory_lines
        if self.resume:
            lines.insert(0, f"resuming after {self.resume['phase']} epoch {self.resume['epoch']} (step "
                            f"{self.resume['step']})")
        config = run_meta(self.meta, args, self.argv, self.data, self.device)       # config.json
        config["memory_plan"] = memory_plan
        with runs.run_folder(args, config, lines, self.lock) as folder, (loggers.mirror(args.log_to, folder, config)
                                                                    if args.log_to else contextlib.nullcontext()):
            self.folder = folder
            with stopped_in(folder):                    # a stop: one line, the --resume command
                yield
        if self.world > 1:  # free the DDP wrappers (reference cycles) first: else gloo threads can outlive
            gc.collect()    # the group and abort the exit (SIGABRT)
            dist.destroy_process_group()

    def phase(self, phase, model, splits, meta):
        """A phase's training state (lab/steps.Training: optimiser and schedule, generators, precision, the DDP
        and --compile wrappers, loaders, the best so far), restored from last.pt when --resume stopped in this
        phase. meta: the model's description, which each checkpoint of the phase carries."""
        t = steps.Training(phase, model, self.args, self.device, splits, meta, partial(runs.log, self.folder))
        if self.resume is not None and self.resume["phase"] == phase.name:
            try:
                t.restore(self.resume)
            except ValueError as e:                     # e.g. an optimiser of other groups
                fail(f"--resume {self.folder}: its last.pt (commit {self.resume['commit']}) cannot be "
                     f"restored by this code ({e}); start a new run")
            resume.catch_up_log(self.folder, self.resume)   # a kill came between last.pt and log
        return t

    def record(self, line, entry=None, checkpoint=None, best_file=None):
        """Record a line: printed, in log.txt, and `entry` (a dict) in log.jsonl and --log-to; with an evaluation's
        `checkpoint` (last.pt's dict) and best_file (None: it did not improve), through save_evaluation."""
        if checkpoint is None:
            runs.log(self.folder, line, entry)
        else:
            save_evaluation(self.folder, best_file, {**checkpoint, "log": (line, entry)})

    def finish(self, results):
        """results.json (results: the method's numbers, completed here with the run's sizes, data, device and
        machine; wall_time_s gains the data's and the total), the last log line, curves.png -> results."""
        args, data = self.args, self.data
        results.update(params=sum(p.numel() for p in self.classifier.parameters()),
                       n_train=len(data.splits["train"]), data_source=data.source, data_notes=data.notes,
                       preset=args.preset, device=str(self.device), processes=self.world,
                       machine=machine(self.device), run_dir=str(self.folder))
        seconds = {"data": data.seconds, **results["wall_time_s"]}
        results["wall_time_s"] = {**seconds, "total": sum(seconds.values())}   # all the phases
        if rank() == 0:
            runs.write_whole(self.folder / "results.json", lambda tmp: tmp.write_text(json.dumps(results, indent=2)))
        phases = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
        runs.log(self.folder, f"done in {results['wall_time_s']['total'] / 60:.1f} min ({phases}): {self.folder}",
                 {"phase": "done", "wall_time_s": results["wall_time_s"]})
        if not args.no_curves and rank() == 0:
            curves.after_run(self.folder, partial(runs.log, self.folder))            # curves.png
        return results


# ---- what a run prints first and writes last -----------------------------------------------------

def startup_lines(args, plan, notes, data, classifier, meta):
    """Printed first (and kept in log.txt): the notes (the preset in force first), plan, device, settings, data,
    model, sizes."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    extras = (f"{f' × {world} processes (DDP)' if world > 1 else ''} | precision {args.precision}"
              + (" + torch.compile" if args.compile else ""))
    n_backbone = sum(p.numel() for p in classifier.backbone.parameters())
    n_head = sum(p.numel() for p in classifier.head.parameters())
    sizes = " / ".join(f"{split} {len(data.splits[split]):,}" for split in ("train", "val", "test"))
    settings = {**vars(args), "ssm_lr": meta["config"].get("ssm_lr", args.ssm_lr)}   # the lr in use
    where = machine(args.device)
    return [*notes, f"run: {args.model} on {args.task} | {plan} | seed {args.seed}",
            f"device {args.device}{extras} | torch {torch.__version__} | {where['cpu']} | "
            f"threads {where['torch_threads']} | git {git_commit()}",
            "settings: " + " ".join(f"{k}={v}" for k, v in settings.items()),
            f"data: {data.source} | {sizes} | {data.seconds:.1f} s",
            *(f"data note: {n}" for n in data.notes),
            f"model {meta['model_name']}({', '.join(f'{k}={v}' for k, v in meta['config'].items())})",
            f"params: backbone {n_backbone:,} + classifier head {n_head:,} = {n_backbone + n_head:,}"]


def run_meta(meta, args, argv, data, device):
    """config.json: the model's description, all settings, and what else the numbers depend on."""
    return dict(meta, preset=args.preset, device=str(device), torch=torch.__version__, git=git_commit(),
                data_source=data.source, data_notes=data.notes, data_fingerprint=data.fingerprint,
                machine=machine(device), command=sys.argv if argv is None else ["train.py", *argv],
                deterministic={"algorithms": torch.are_deterministic_algorithms_enabled(),
                               "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")})


def save_evaluation(folder, best_file, state):
    """After an evaluation (rank 0): best_file when it improved (else None), then last.pt, so that a resume never
    misses a best, then the log line and record state["log"], which last.pt carries. A Ctrl-C or SIGTERM waits for all
    three (held_stops); a crash between last.pt and the log loses nothing (catch_up_log)."""
    if rank() > 0:
        return
    with stopping_at(f"{state['phase']} epoch {state['epoch']}, writing checkpoints and log"), \
            held_stops():                           # a stop between the two: resume would reject it
        if best_file:
            runs.save_checkpoint(folder / best_file, state)
        runs.save_checkpoint(folder / "last.pt", state)
        runs.log(folder, *state["log"])


def absolute_paths(args):
    """Every run path made absolute, so config.json and last.pt name the same files from any cwd."""
    for key in resume.PATH_FLAGS:
        if getattr(args, key):
            setattr(args, key, str(Path(getattr(args, key)).resolve()))


def check_init_checkpoint(ck, model_name, task, config):
    """ValueError (one line) unless checkpoint dict ck has a backbone this run (model_name on task, backbone config
    dict `config`) can fine-tune: same model, task and every config field that shapes the weights."""
    if (ck["model_name"], ck["task"]) != (model_name, task):
        raise ValueError(f"a {ck['model_name']} checkpoint for {ck['task']}, but this run is "
                         f"{model_name} on {task}; pass the --model and --task it was made with")
    init_only = {"dropout", "ssm_lr", "dt_min", "dt_max", "diag_init"}    # may differ: not in the weights
    differ = [k for k in config if k not in init_only and ck["config"].get(k) != config[k]]
    if differ:
        theirs, ours = (", ".join(f"{k}={c.get(k)}" for k in differ) for c in (ck["config"], config))
        raise ValueError(f"its {theirs} differ from this run's {ours}; pass the model flags it was made with")


def no_card_plan(args, world):
    """memory.plan_memory's lines and record without a card: each phase's accumulation steps as given, else 1."""
    phases = [("spt", "pretrain_batch_size", "pretrain_accum_steps")] if args.spt else []
    record, lines, L = {}, [], max(hardware.padded_lengths(args.task, args.max_len))
    for phase, batch, accum in phases + [("finetune", "batch_size", "accum_steps")]:
        rows = -(-getattr(args, batch) // world)            # this process's rows of a step
        setattr(args, accum, getattr(args, accum) or 1)
        record[phase] = dict(batch=rows, accum_steps=getattr(args, accum),
                             micro_batch=-(-rows // getattr(args, accum)), L=L, est_gib=None)
        lines.append(f"memory plan {phase}: micro-batch {record[phase]['micro_batch']} × "
                     f"{getattr(args, accum)} accumulation steps (no card: not estimated)")
    return lines, record


# ---- stops: Ctrl-C and SIGTERM -------------------------------------------------------------------

STOP = {"cause": "Ctrl-C", "held": 0, "pending": False}


def stop_on_sigterm():
    """SIGTERM (a scheduler's time limit, `kill`) raises KeyboardInterrupt, so it stops a run as Ctrl-C does, and both
    wait while `held_stops` holds them; a signal the caller (the GPU check) handles itself is left alone."""
    def stop(signum, frame):
        STOP["cause"] = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        if STOP["held"]:                            # inside held_stops: it raises at the block's end
            STOP["pending"] = True
            return
        raise KeyboardInterrupt
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, stop)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, stop)


@contextlib.contextmanager
def held_stops():
    """A stop (Ctrl-C, SIGTERM: stop_on_sigterm's handler) that arrives inside the block waits for
    its end, then raises KeyboardInterrupt there: files written together (a best checkpoint and
    last.pt, which names that best) are never left half a pair."""
    STOP["held"] += 1
    try:
        yield
    finally:                                        # also when the block raises: no stop stays pending
        STOP["held"] -= 1
        fire = not STOP["held"] and STOP["pending"]
        STOP["pending"] &= STOP["held"] > 0         # the outermost block's end clears it
    if fire:
        raise KeyboardInterrupt


def stop_status():
    """The exit status of a stop, as a shell gives it: 128 + the signal (SIGTERM 143, Ctrl-C 130)."""
    return 128 + (signal.SIGTERM if STOP["cause"] == "SIGTERM" else signal.SIGINT)


@contextlib.contextmanager
def stopping_at(where):
    """A stop inside the block is re-raised naming `where` (a string, or a function giving it),
    unless a block inside already named a place (the innermost place wins)."""
    try:
        yield
    except KeyboardInterrupt as e:
        if e.args:
            raise
        raise KeyboardInterrupt(where() if callable(where) else where) from None


@contextlib.contextmanager
def stopped_in(folder=None):
    """A stop inside the block ends the process in one line: where, what last.pt holds, how to
    continue. folder None: before the run folder exists (preparing the data)."""
    try:
        yield
    except KeyboardInterrupt as e:
        where = e.args[0] if e.args else "the run"
        if folder is None:
            print(f"train.py: stopped by {STOP['cause']} at {where}; no run folder was made; a half-built cache was "
                  f"removed, data being generated is kept half made: the same command completes it", file=sys.stderr)
            raise SystemExit(stop_status()) from None
        last = checked.read_checkpoint(folder / "last.pt") if (folder / "last.pt").is_file() else None
        saved = f"last.pt holds {last['phase']} epoch {last['epoch']}" if last else "no checkpoint yet"
        then = (f"continue with: python train.py --resume {folder}" if last else
                f"start the run again ({folder} holds no checkpoint: delete it)")
        line = f"train.py: stopped by {STOP['cause']} at {where}; {saved}; {then}"
        print(line, file=sys.stderr)
        if rank() == 0:                             # the log says how the run ended, too
            with contextlib.suppress(SystemExit):   # a full disk: the console has the line
                append_line(folder / "log.txt", line)
        raise SystemExit(stop_status()) from None


# ---- provenance: where a run's numbers came from besides the flags -------------------------------

@cache  # asked for by the log's device line and by config.json: one git call per run
def git_commit():
    """Short commit of this file's repo, plus -dirty when a tracked file differs from it (new files,
    such as the run folders a study writes in the repo, do not count), or 'unknown' outside git."""
    here = Path(__file__).resolve().parents[1]      # the repo
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=here, capture_output=True,  # noqa: E731
                                        text=True, timeout=5).stdout.strip()
        dirty = run("status", "--porcelain", "--untracked-files=no")
        return (run("rev-parse", "--short", "HEAD") or "unknown") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine(device):
    """What a run's numbers depend on besides the code: CPU model, threads, GPU name on CUDA."""
    cpu = "unknown"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    out = dict(cpu=cpu, torch_threads=torch.get_num_threads(), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS"))
    if torch.device(device).type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out
