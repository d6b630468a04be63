"""tools/checked.py: the guards every command-line tool of the repo shares (train.py, lra_data.py, tools/bench.py,
results/*.py, tools/*.py), so that bad input is one line and no user's file is lost.
numbers:  argparse types that parse, range-check and refuse NaN and ±inf (a value that passes "> 0" as inf does
          would start a run that can only fail): number, at_least, in_range, seed
reads:    read_json / read_text: a file that is missing, unreadable, cut or not what it claims raises Damaged, one
          line naming the file, what is wrong and what to do
outputs:  a manifest (.outputs, JSON) beside a tool's outputs names each file the tool wrote; a tool overwrites or
          deletes only files it lists (write_owned, remove_owned), so a user's file of the same name or pattern in
          --out is never touched
No torch here: results/control.py and summarize.py use it without importing the models.
Check: tests/test_faults.py.
"""
import argparse
import contextlib
import errno
import io
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

SEED_MAX = 2**62    # seeds derived from --seed (seed + 4, seed + 1000·rank + epoch) stay far below torch's 2**64


# ---- numbers -------------------------------------------------------------------------------------

def number(kind, ok, rule):
    """An argparse type: text -> kind (int or float), finite, checked by ok(value), else one line "<value> <rule>"."""
    def check(text):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{value:g} {rule}")
        return value
    check.rule = rule                       # --help prints it (presets.FlagHelp)
    return check


def at_least(low):
    """An argparse type: an integer ≥ low."""
    return number(int, lambda v: v >= low, f"must be at least {low}")


def in_range(low, high=math.inf, open_low=False, open_high=False):
    """An argparse type: a finite number in [low, high], ( or ) where open."""
    ok = lambda v: ((low < v if open_low else low <= v)  # noqa: E731
                    and (v < high if open_high else v <= high))
    return number(float, ok, f"must be in {'(' if open_low else '['}{low:g}, {high:g}"
                  f"{')' if open_high else ']'}" if high != math.inf
                  else f"must be {'>' if open_low else '>='} {low:g}")


def seed():
    """An argparse type: a seed, an integer in [0, SEED_MAX], leaving room for the seeds derived from it."""
    return number(int, lambda v: 0 <= v <= SEED_MAX,
                  "must be in [0, 2**62] (the seeds derived from it must stay below torch's 2**64)")


def flag_message(message):
    """argparse's "argument --lr: 0.0 must be > 0" as "--lr 0.0 must be > 0"."""
    return re.sub(r"^argument ([-\w/]+): ", r"\1 ", message)


# ---- reads ---------------------------------------------------------------------------------------

class Damaged(ValueError):
    """A file that is missing, unreadable, cut or not what it claims; the message is one line: the file, what is
    wrong, what to do."""


def read_bytes(path, fix):
    """The bytes of `path`; Damaged naming it and `fix` (what to do) if it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        what = "missing" if e.errno == errno.ENOENT else f"unreadable ({e.strerror or e})"
        raise Damaged(f"{path} is {what}: {fix}") from None


def read_text(path, fix):
    """The text of `path` (UTF-8; a character cut by a killed write or a byte that is not UTF-8 is replaced by
    U+FFFD, never a traceback); Damaged if it cannot be read."""
    return read_bytes(path, fix).decode("utf-8", errors="replace")


def read_json(path, fix, kind=dict, needs=()):
    """The JSON value of `path`, of type `kind`, with the keys `needs`; Damaged (one line) if it is missing,
    unreadable, cut, not JSON or lacks them."""
    data = read_bytes(path, fix)
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Damaged(f"{path} is damaged (cut or not JSON: {str(e)[:60]}): {fix}") from None
    if not isinstance(value, kind) or (needs and not set(needs) <= set(value)):
        lacking = ", ".join(k for k in needs if not isinstance(value, dict) or k not in value)
        raise Damaged(f"{path} is not what it should be ({f'no {lacking}' if lacking else type(value).__name__}): "
                      f"{fix}")
    return value


def read_records(log, fix):
    """The records of a log.jsonl, in order. A line that a cut write left (a kill or a full disk mid-record; a resumed
    run ends it, runs.append_line) is no record and is skipped: the evaluation it began is logged whole after it."""
    records = []
    for line in read_text(log, fix).splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def read_checkpoint(path, device="cpu"):
    """torch.load of a train.py checkpoint (weights only: plain data, no code) -> its dict; ValueError (one line)
    if empty, truncated or not one. torch is imported here, so that the tools without torch can import this file."""
    import torch
    try:
        with open(path, "rb") as f:                 # a Python file: a path of any bytes, as the OS gave it
            ck = torch.load(f, map_location=device, weights_only=True)
    except Exception as e:                          # truncated, empty, garbage, not plain data
        raise ValueError(f"{path} is damaged or not a train.py checkpoint ({type(e).__name__})") from None
    if not isinstance(ck, dict) or not {"model", "config", "model_name", "task"} <= set(ck):
        raise ValueError(f"{path} is not a train.py checkpoint (no model/config/model_name/task entries)")
    return ck


CONFIG_KEYS = ("args", "config", "head", "model_name", "task")          # what every train.py config.json holds
RESULTS_KEYS = ("test_acc", "best_val_acc", "params", "wall_time_s")    # and every results.json


def read_run_folder(folder, fix):
    """(config.json, results.json or None before the run has finished, log.jsonl's records) of a train.py run
    folder, each checked; Damaged (one line naming the file, what is wrong and `fix`) if one is missing or cut."""
    folder = Path(folder)
    config = read_json(folder / "config.json", fix, needs=CONFIG_KEYS)
    done = (folder / "results.json").is_file()
    results = read_json(folder / "results.json", fix, needs=RESULTS_KEYS) if done else None
    return config, results, read_records(folder / "log.jsonl", fix) if done or (folder / "log.jsonl").exists() else []


# ---- outputs a tool owns -------------------------------------------------------------------------

MANIFEST = ".outputs"     # JSON; no .json suffix, so a glob of a tool's *.json outputs never finds it


class NotOwned(Exception):
    """A path a tool would overwrite but did not write (it is not in the manifest beside it)."""


def manifest(folder):
    """{file name: tool} of the files that tools of this repo wrote into `folder` (its .outputs); a damaged
    manifest counts as empty (nothing is then deleted or overwritten)."""
    try:
        files = json.loads((Path(folder) / MANIFEST).read_text()).get("files", {})
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def record(folder, name, tool):
    """Add (tool, None: remove) `name` to the manifest of `folder`, written whole (temporary file + rename)."""
    files = manifest(folder)
    if tool is None:
        files.pop(name, None)
    else:
        files[name] = tool
    text = json.dumps({"note": "files written by this repo's tools (tools/checked.py); a tool overwrites or deletes "
                               "only the files listed here", "files": dict(sorted(files.items()))}, indent=1)
    write_whole(Path(folder) / MANIFEST, text + "\n")


def owned(path):
    """Whether a tool may write `path`: it does not exist, or the manifest beside it lists it."""
    path = Path(path)
    return not path.exists() and not path.is_symlink() or path.name in manifest(path.parent)


def write_owned(path, write, tool):
    """write_whole(path, write), then `path` is recorded as `tool`'s; NotOwned (one line) if `path` exists and no tool
    of the repo wrote it."""
    path = Path(path)
    if not owned(path):
        raise NotOwned(f"{path} exists and was not written by {tool} (it is not in {path.parent / MANIFEST}): it is "
                       f"left untouched; move it away or pass another output place")
    write_whole(path, write)
    record(path.parent, path.name, tool)
    return path


def write_whole(path, write):
    """write(tmp) fills a temporary file, which then replaces `path` (`write` may also be the bytes or text): a kill
    or an OSError (a full disk, a read-only folder) leaves the old file and no temporary."""
    path = Path(path)
    if not callable(write):
        data = write
        write = (lambda tmp: tmp.write_bytes(data)) if isinstance(data, bytes) else (lambda tmp: tmp.write_text(data))
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_owned(path):
    """Delete `path` if the manifest beside it lists it (then drop it from the list); a file no tool wrote stays.
    Returns whether it was deleted."""
    path = Path(path)
    if path.name not in manifest(path.parent):
        return False
    path.unlink(missing_ok=True)
    record(path.parent, path.name, None)
    return True


def console_as_os_bytes():
    """Let stdout and stderr print a path that is not valid UTF-8 as the bytes the OS gave (Python holds them as
    surrogate escapes), instead of stopping on UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
            stream.reconfigure(errors="surrogateescape")


def free_space(path):
    """'12.3 GB free' on the file system that holds path (or its nearest existing parent)."""
    probe = Path(path).resolve()
    while not probe.exists():
        probe = probe.parent
    return f"{shutil.disk_usage(probe).free / 1e9:.1f} GB free"


def write_advice(error):
    """What to do about a failed write: 'make it writable' for a denied or read-only place, else 'free some space'
    (a full disk, a quota)."""
    denied = isinstance(error, PermissionError) or getattr(error, "errno", None) in (errno.EACCES, errno.EPERM,
                                                                                    errno.EROFS)
    return "make it writable" if denied else "free some space"


def open_lock(path):
    """The file to flock for lock file `path`: opened to append (made if absent), or read-only where it is
    another user's (mode 644: flock needs no write access). OSError if neither works."""
    try:
        return open(path, "a")
    except PermissionError:
        return open(path, "r")
