"""lab/runs.py: the plumbing under a run (lab/run.Run) and the tools: one-line failures, files written whole or
not at all (temp file + rename; a failed write (full disk, quota, read-only) stops the run: one line, exit 2), the
log's lines, folder locks, checkpoints, the run folder (the stops are lab/run.py's).
Check: tests/test_robustness.py, test_faults.py (exact resume, locks, damaged checkpoints, full disks).
"""
import contextlib
import json
import os
import sys
import time
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from tools import checked
from tools.checked import read_checkpoint  # noqa: F401  (runs.read_checkpoint: its old name)

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
             f"{checked.write_advice(error)} or pass another --out / --cache-dir; the files written before are intact")
    raise WriteFailed(2)


def write_whole(path, write):
    """write(tmp) fills a temporary file next to `path`, then it replaces path: a kill or a full disk mid-write leaves
    the old file intact and no temporary behind. OSError (no space, quota, read-only) -> cannot_write."""
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


# ---- checkpoints and resume ----------------------------------------------------------------------

def save_checkpoint(path, state):
    """A plain dict via write_whole: a kill or full disk mid-write leaves the old file intact."""
    def save(tmp):                  # through a Python file: a path of any bytes (torch's own takes UTF-8 only)
        with open(tmp, "wb") as f:
            torch.save(state, f)
    write_whole(path, save)


def read_config(folder):
    """A run folder's config.json (resume_settings has checked it is there); one line if damaged."""
    try:        # missing, unreadable, cut or no settings: Damaged
        return checked.read_json(Path(folder) / "config.json", "the run cannot be checked against "
                                 "its settings: start a new run", needs=["args"])
    except checked.Damaged as e:
        fail(f"--resume {folder}: {e}")


@contextlib.contextmanager
def run_folder(args, meta, lines, lock=None):
    """Hold the run folder for the block: a new runs/<task>-<model>-<spt|init|tfs>-s<seed>-<time>/
    with config.json (DDP: rank 0 names and makes it, all use it), or the --resume folder, whose
    `lock` resume_settings took. Rank 0 holds its lock for the whole block, so a second train.py on
    one folder stops in one line before any write; then log.txt gets `lines`. Yields it."""
    if args.resume:
        folder = Path(args.resume)
        saved = read_config(folder)
        was, moved = saved.get("data_fingerprint"), saved["args"]["data_dir"] != args.data_dir
        if was != meta["data_fingerprint"] and (was or moved):     # moved, or changed in place
            why = "its sizes, labels or examples differ" if was else "config.json has no record"
            release_lock(lock)
            fail(f"--resume {folder}: the data at {args.data_dir} cannot be shown to be the data "
                 f"this run trained on ({why}); pass the --data-dir that holds that data")
        lines = [f"data: the run's own data (sizes, labels, examples compared), now at {args.data_dir}"] * moved + lines
    else:
        kind = "spt" if args.spt else ("init" if args.init_from else "tfs")
        stem = Path(args.out) / f"{args.task}-{args.model}-{kind}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
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
        if dist.is_initialized():                   # the processes' clocks may be a second apart
            shared = [folder]
            dist.broadcast_object_list(shared, src=0)
            folder = shared[0]
        lock = hold_lock(folder)                    # rank 0's (None on the others)
    try:
        if rank() == 0 and not args.resume:
            write_whole(folder / "config.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=2)))
        for line in [*lines, f"run folder: {folder}"]:
            log(folder, line)
        yield folder
    except WriteFailed:     # a full disk before the first checkpoint: no stub of a run folder is left
        if rank() == 0 and not args.resume and not list(folder.glob("*.pt")):
            release_lock(lock)
            shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        release_lock(lock)                          # a run's own lock goes with the run
