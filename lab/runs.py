"""lab/runs.py: a training run on disk and across processes, the plumbing under train.py.
run folder:  runs/<task>-<model>-<spt|init|tfs>-s<seed>-<time>/: config.json, log.txt, log.jsonl,
             spt.pt, best.pt, last.pt, results.json, each written whole or not at all (temp file +
             rename); a failed write (full disk, quota, read-only) stops the run: one line, exit 2
resume:      last.pt holds weights, optimiser, schedule and every RNG, so a stopped run continues
             exactly; a lock keeps one writer per folder; a finished, damaged or incompatible run
             is refused in one line
stops:       Ctrl-C and SIGTERM (a scheduler's time limit) end in one line: where, the --resume command;
             one that arrives while an evaluation writes its files waits until they are written
(a step on the hardware, DDP, --device and --precision, the loaders: lab/steps.py) Check: tests/test_robustness.py,
test_faults.py (DDP equals one process, exact resume, locks, damaged checkpoints, full disks, moved data)
"""
import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tools import checked
from tools.checked import read_checkpoint  # noqa: F401  (runs.read_checkpoint: its old name)


from lab import provenance
try:
    import fcntl  # POSIX file locks; absent on Windows
except ImportError:
    fcntl = None
RECORD_HOOKS = []   # called after each record reaches log.jsonl (lab/loggers.py: TensorBoard, wandb)

def rank():
    """This process's rank under torchrun (0 without DDP): only rank 0 writes the run folder."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


# ---- messages, writes that can fail ------------------------------------------------------------

def fail(message):
    """Bad input: one line on stderr (rank 0 only, under torchrun), exit status 2, no traceback."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"train.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class WriteFailed(SystemExit):  # cannot_write's exit: a new run folder with no checkpoint goes too
    pass


def cannot_write(path, error):
    """The one line for a write that failed: the path, why, the space left there, what to do."""
    with contextlib.suppress(SystemExit):
        fail(f"cannot write {path} ({error.strerror or error}; {checked.free_space(path)}): "
             f"{checked.write_advice(error)} or pass another --out / --cache-dir; the files "
             f"written before are intact")
    raise WriteFailed(2)


def write_whole(path, write):
    """write(tmp) fills a temporary file next to `path`, then it replaces path: a kill or a full
    disk mid-write leaves the old file intact and no temporary behind. OSError (no space, quota,
    read-only) -> cannot_write."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:                      # also Ctrl-C halfway through torch.save
        tmp.unlink(missing_ok=True)
        causes = [e, e.__cause__, e.__context__]    # torch's zip writer raises its own error on ours
        if cause := next((c for c in causes if isinstance(c, OSError)), None):
            cannot_write(path, cause)
        if isinstance(e, RuntimeError) and "inline_container" in str(e):
            cannot_write(path, OSError(28, str(e).splitlines()[0]))
        raise


def log(folder, line, record=None):
    """Print one line; rank 0 also appends it to folder/log.txt (`record` to log.jsonl, RECORD_HOOKS)."""
    print(line, flush=True)
    if folder is None or rank() > 0:
        return
    append_line(folder / "log.txt", line)
    if record is not None:
        append_line(folder / "log.jsonl", json.dumps(record))
        for hook in RECORD_HOOKS:
            hook()


def append_line(path, text):
    """Append `text` as one line to `path`, first ending a line that a cut write (a kill, a full
    disk) left unfinished, so one record never runs into the next. OSError -> cannot_write."""
    try:
        with open(path, "a+b") as f:                # appends, wherever it last read
            cut = False
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"
            f.write(b"\n" * cut + text.encode(errors="surrogateescape") + b"\n")  # a path: OS bytes
    except OSError as e:
        cannot_write(path, e)


# ---- stops: Ctrl-C and SIGTERM -------------------------------------------------------------------

STOP = {"cause": "Ctrl-C", "held": 0, "pending": False}


def stop_on_sigterm():
    """SIGTERM (a scheduler's time limit, `kill`) raises KeyboardInterrupt, so it stops a run as
    Ctrl-C does, and both wait while `held_stops` holds them; each signal left alone when the caller
    (the GPU check) has a handler of its own."""
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
        if not STOP["held"]:
            STOP["pending"] = False
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
            print(f"train.py: stopped by {STOP['cause']} at {where}; no run folder was made; "
                  f"a half-built cache was removed, data being generated is kept half made: "
                  f"the same command completes it", file=sys.stderr)
            raise SystemExit(stop_status()) from None
        last = read_checkpoint(folder / "last.pt") if (folder / "last.pt").is_file() else None
        saved = f"last.pt holds {last['phase']} epoch {last['epoch']}" if last else "no checkpoint yet"
        then = (f"continue with: python train.py --resume {folder}" if last else
                f"start the run again ({folder} holds no checkpoint: delete it)")
        line = f"train.py: stopped by {STOP['cause']} at {where}; {saved}; {then}"
        print(line, file=sys.stderr)
        if rank() == 0:                             # the log says how the run ended, too
            with contextlib.suppress(SystemExit):   # a full disk: the console has the line
                append_line(folder / "log.txt", line)
        raise SystemExit(stop_status()) from None


# ---- locks ----------------------------------------------------------------------------------------------

def hold_lock(folder):
    """Lock run folder `folder` for this process (rank 0): an open file with an exclusive flock,
    released when it is closed or the process dies (never stale); or exit in one line if another
    train.py holds it. None without fcntl (Windows: no lock) or on ranks > 0."""
    if fcntl is None or rank() > 0:
        return None
    try:
        f = checked.open_lock(Path(folder) / ".lock")   # another user's: read-only, flock needs no more
    except OSError as e:                            # read-only, another user's, a full disk
        cannot_write(Path(folder) / ".lock", e)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        fail(f"{folder} is in use by another train.py (the run itself or a --resume of it); "
             f"wait until it stops")
    return f


def release_lock(lock):
    """Release a hold_lock lock (None: no-op). The empty .lock stays: deleting it would let a
    process that opened it just before lock the deleted file while a third locks a new one."""
    if lock is not None:
        lock.close()


# ---- the state of a run and of a phase -----------------------------------------------------------

@dataclasses.dataclass
class Data:
    splits: dict                    # "train", "val", "test" -> datasets
    source: str                     # where the examples came from (read or generated)
    notes: list                     # what reading them skipped, cut or found, one line each
    seconds: float
    fingerprint: str = ""           # the examples themselves, not their path (a resume's data check)


@dataclasses.dataclass
class Run:
    args: argparse.Namespace        # every setting, presets applied
    device: torch.device
    folder: Path                    # the run folder
    meta: dict  # the checkpoint's description of the model: model_name, task, config, head, args

    def with_meta(self, **changes):
        """The run with meta entries changed (the SPT model's head; the fine-tuning SPT results)."""
        return dataclasses.replace(self, meta={**self.meta, **changes})


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
    where = provenance.machine(args.device)
    return [*notes, f"run: {args.model} on {args.task} | {plan} | seed {args.seed}",
            f"device {args.device}{extras} | torch {torch.__version__} | {where['cpu']} | "
            f"threads {where['torch_threads']} | git {provenance.git_commit()}",
            "settings: " + " ".join(f"{k}={v}" for k, v in settings.items()),
            f"data: {data.source} | {sizes} | {data.seconds:.1f} s",
            *(f"data note: {n}" for n in data.notes),
            f"model {meta['model_name']}"
            f"({', '.join(f'{k}={v}' for k, v in meta['config'].items())})",
            f"params: backbone {n_backbone:,} + classifier head {n_head:,} = "
            f"{n_backbone + n_head:,}"]


def run_meta(meta, args, argv, data, device):
    """config.json: the model's description, all settings, and what else the numbers depend on."""
    return dict(meta, preset=args.preset, device=str(device), torch=torch.__version__,
                git=provenance.git_commit(), data_source=data.source, data_notes=data.notes,
                data_fingerprint=data.fingerprint,
                machine=provenance.machine(device), command=sys.argv if argv is None else ["train.py", *argv],
                deterministic={"algorithms": torch.are_deterministic_algorithms_enabled(),
                               "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")})


def absolute_paths(args):
    """Every run path made absolute, so config.json and last.pt name the same files from any cwd."""
    for key in ("data_dir", "cache_dir", "out", "init_from"):
        if getattr(args, key):
            setattr(args, key, str(Path(getattr(args, key)).resolve()))


# ---- checkpoints and resume ----------------------------------------------------------------------

def save_checkpoint(path, state):
    """A plain dict via write_whole: a kill or full disk mid-write leaves the old file intact."""
    def save(tmp):                  # through a Python file: a path of any bytes (torch's own takes UTF-8 only)
        with open(tmp, "wb") as f:
            torch.save(state, f)
    write_whole(path, save)


def save_evaluation(folder, best_file, state):
    """After an evaluation (rank 0): the best checkpoint when it improved (best_file, else None),
    then last.pt, so that a resume never misses a best, then the evaluation's log line and record,
    state["log"], which last.pt carries. A Ctrl-C or SIGTERM waits for all three (held_stops); a
    crash between last.pt and the log loses nothing (catch_up_log)."""
    if rank() > 0:
        return
    with stopping_at(f"{state['phase']} epoch {state['epoch']}, writing checkpoints and log"), \
            held_stops():                           # a stop between the two: resume would reject it
        if best_file:
            save_checkpoint(folder / best_file, state)
        save_checkpoint(folder / "last.pt", state)
        log(folder, *state["log"])


def catch_up_log(folder, ck):
    """On resume (rank 0): the evaluation that last.pt `ck` carries, appended to log.txt and
    log.jsonl where a crash (a kill, a full disk) came before it was written."""
    if rank() > 0 or "log" not in ck:
        return
    for name, text in (("log.txt", ck["log"][0]), ("log.jsonl", json.dumps(ck["log"][1]))):
        path = folder / name
        # a line cut inside a character reads as U+FFFD, never a UnicodeDecodeError
        if not path.is_file() or text not in checked.read_text(path, "").splitlines():
            append_line(path, text)


def read_config(folder):
    """A run folder's config.json (resume_settings has checked it is there); one line if damaged."""
    try:        # missing, unreadable, cut or no settings: Damaged
        return checked.read_json(Path(folder) / "config.json", "the run cannot be checked against "
                                 "its settings: start a new run", needs=["args"])
    except checked.Damaged as e:
        fail(f"--resume {folder}: {e}")


# settings a resumed run may take from the new command line (the data paths: if the data is the same)
RESUME_MAY_CHANGE = {"resume", "device", "workers", "data_dir", "cache_dir"}
PATH_FLAGS = {"data_dir", "cache_dir", "out", "init_from"}


def resume_settings(args, given, defaults):
    """--resume DIR: (the run's own settings, its last.pt, the folder's lock, held from here on, so
    that what is checked here stays true), or exits: finished run (status 0, results.json
    untouched), no, damaged or incompatible last.pt, flags that would change the run, a folder in
    use (status 2). Temporary files a killed run left (*.tmp) are removed, under the lock."""
    folder = Path(args.resume)
    if not folder.is_dir():
        fail(f"--resume {folder}: no such run folder")
    if not (folder / "config.json").is_file():     # before a lock or a deletion there
        fail(f"--resume {folder}: not a run folder (no config.json); pass one run's folder")
    finished = lambda: (folder / "results.json").is_file()  # noqa: E731
    lock = None if finished() else hold_lock(folder)  # then nothing can finish it behind our back
    try:
        for tmp in folder.glob("*.tmp"):            # a write a kill cut short
            tmp.unlink()
        return resume_checks(args, given, defaults, folder, finished) + (lock,)
    except BaseException as e:                      # refused: give the folder back at once
        release_lock(lock)
        if isinstance(e, OSError):                  # e.g. a folder made read-only
            cannot_write(Path(e.filename or folder), e)
        raise


def resume_checks(args, given, defaults, folder, finished):
    """resume_settings' checks, under the folder's lock -> (the run's own settings, its last.pt)."""
    config = read_config(folder)
    saved_args = config.get("args", {})
    seed_it = f", e.g. with --init-from {folder}/spt.pt" if (folder / "spt.pt").is_file() else ""
    same = lambda k: (Path(saved_args[k]).resolve() == Path(getattr(args, k)).resolve()  # noqa
                      if k in PATH_FLAGS and saved_args.get(k) and getattr(args, k)
                      else saved_args.get(k, defaults.get(k)) == getattr(args, k))
    changed = sorted(k for k in given - RESUME_MAY_CHANGE if not same(k))
    flags = ", ".join("--" + k.replace("_", "-") for k in changed)
    if changed:                                     # finished or not: e.g. --epochs 20
        fail(f"--resume {folder}{' has finished (results.json is there);' if finished() else ':'} "
             f"a run continues with its own settings; {flags} cannot change (only --device, "
             f"--workers, and --data-dir / --cache-dir for the same data); start a new run{seed_it}")
    if finished():
        print(f"train.py: {folder} has finished (results.json is there); nothing to resume, "
              f"nothing changed")
        raise SystemExit(0)
    if not (folder / "last.pt").is_file():
        fail(f"--resume {folder}: no last.pt in that folder (a run writes it at its first "
             f"evaluation): nothing to continue; start the run again")
    try:
        ck = read_checkpoint(folder / "last.pt")
    except ValueError as e:
        usable = []
        for name in ("best.pt", "spt.pt"):
            with contextlib.suppress(ValueError, FileNotFoundError):
                other = read_checkpoint(folder / name)
                usable.append(f"{name} ({other['phase']} epoch {other['epoch']})")
        hint = (f"still readable: {', '.join(usable)}" if usable
                else "no other readable checkpoint there")
        fail(f"--resume: {e}; {hint}; start again"
             f"{seed_it.replace(', e.g.', ' (an spt.pt can seed a new run:')}"
             f"{')' if seed_it else ''}")
    missing = [k for k in ("optimizer", "scheduler", "rng", "args", "phase", "epoch", "step",
                           "best") if k not in ck]
    if missing:
        fail(f"--resume {folder}: its last.pt (commit {config.get('git', 'unknown')} in "
             f"config.json) lacks {', '.join(missing)}, which this code needs to continue it; "
             f"start a new run{seed_it}")
    if ck.get("device_type", "cpu") != (torch.device(args.device).type if args.device else
                                        ("cuda" if torch.cuda.is_available() else "cpu")):
        fail(f"--resume {folder}: it ran on {ck.get('device_type', 'cpu')}; resume it there "
             f"(its mask generator and RNG states belong to that device type; "
             f"--device may pick another device of that type)")
    check_resumable(folder, config, ck, seed_it)
    ck["commit"] = config.get("git", "unknown")
    saved = {**defaults, **ck["args"]}  # flags newer than the checkpoint: their defaults
    saved["pretrain_batch_size"] = saved.get("pretrain_batch_size") or saved["batch_size"]
    paths = {k for k in ("data_dir", "cache_dir") if k in given}    # moved data: checked in run_folder
    if "data_dir" not in paths and not Path(saved["data_dir"]).is_dir():
        fail(f"--resume {folder}: its data folder {saved['data_dir']} is gone; if it moved, add "
             f"--data-dir <where it is now> (checked to hold the same data)")
    keep = {k: getattr(args, k) for k in RESUME_MAY_CHANGE - {"data_dir", "cache_dir"} | paths}
    return argparse.Namespace(**{**saved, **keep}), ck


def check_resumable(folder, config, ck, seed_it):
    """Before any training: last.pt is of the run config.json describes (model, task, sizes), and
    the checkpoint the rest of the run reads, spt.pt (SPT's best: fine-tuning starts from it) or
    best.pt (fine-tuning's best: the test reads it), is this run's. Else one line, status 2."""
    plain = lambda c: [c.get("phase"), c.get("epoch"), json.loads(json.dumps(c["config"]))]  # noqa
    if [ck["model_name"], ck["task"], plain(ck)[2]] != [config.get(k) for k in ("model_name",
                                                                                "task", "config")]:
        fail(f"--resume {folder}: its last.pt ({ck['model_name']} on {ck['task']}) is not of the "
             f"run config.json describes ({config.get('model_name')} on {config.get('task')}, "
             f"its sizes): the folder mixes two runs; start a new run")
    name, best = "spt.pt" if ck["phase"] == "spt" else "best.pt", None
    with contextlib.suppress(ValueError):
        best = read_checkpoint(folder / name)
    if ck["best"]["epoch"] and (not best or plain(best) != [ck["phase"], ck["best"]["epoch"],
                                                            plain(ck)[2]]):
        what = f"of {best.get('phase')} epoch {best.get('epoch')}" if best else \
            "damaged" if (folder / name).exists() else "missing"
        fail(f"--resume {folder}: {name} ({ck['phase']} epoch {ck['best']['epoch']}'s best, which "
             f"{'fine-tuning starts from' if name == 'spt.pt' else 'the test reads'}) is {what}: "
             f"the run could not finish; start a new run{seed_it}")


@contextlib.contextmanager
def run_folder(args, meta, lines, lock=None):
    """Hold the run folder for the block: a new runs/<task>-<model>-<spt|init|tfs>-s<seed>-<time>/
    with config.json (DDP: rank 0 names and makes it, all use it), or the --resume folder, whose
    `lock` resume_settings took. Rank 0 holds its lock for the whole block, so a second train.py on
    one folder stops in one line before any write; then log.txt gets `lines`. Yields it."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if args.resume:
        folder = Path(args.resume)
        saved = read_config(folder)
        was, moved = saved.get("data_fingerprint"), saved["args"]["data_dir"] != args.data_dir
        if was != meta["data_fingerprint"] and (was or moved):     # moved, or changed in place
            why = "its sizes, labels or examples differ" if was else "config.json has no record"
            release_lock(lock)
            fail(f"--resume {folder}: the data at {args.data_dir} cannot be shown to be the data "
                 f"this run trained on ({why}); pass the --data-dir that holds that data")
        lines = [f"data: the run's own data (sizes, labels, examples compared), now at "
                 f"{args.data_dir}"] * moved + lines
    else:
        kind = "spt" if args.spt else ("init" if args.init_from else "tfs")
        stem = Path(args.out) / (f"{args.task}-{args.model}-{kind}-s{args.seed}-"
                                 f"{time.strftime('%Y%m%d-%H%M%S')}")
        folder, suffix = stem, 1
        while rank() == 0:                          # mkdir claims the name: exists() then mkdir races
            if suffix > 1000:
                fail(f"--out {args.out}: cannot claim a run folder named {stem.name}: check the folder")
            try:
                folder.mkdir(parents=True)
                break
            except FileExistsError:                 # another run started in the same second
                folder, suffix = stem.with_name(f"{stem.name}+{suffix}"), suffix + 1
            except OSError as e:                    # read-only file system, no permission, ...
                fail(f"--out {args.out}: cannot create the run folder there ({e.strerror}); "
                     f"pass a writable folder")
        if world > 1:                               # the processes' clocks may be a second apart
            shared = [folder]
            dist.broadcast_object_list(shared, src=0)
            folder = shared[0]
    if rank() == 0 and not args.resume:
        lock = hold_lock(folder)
    try:
        if rank() == 0 and not args.resume:
            write_whole(folder / "config.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=2)))
        for line in lines:
            log(folder, line)
        yield folder
    except WriteFailed:     # a full disk before the first checkpoint: no stub of a run folder is left
        if rank() == 0 and not args.resume and not list(folder.glob("*.pt")):
            release_lock(lock)
            shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        release_lock(lock)                          # a run's own lock goes with the run
