"""lab/resume.py: --resume's checks, before anything is written: the run's own settings, its last.pt and lock; a
finished, damaged, incompatible or moved run is refused in one line (status 2), a finished one in one line (status 0).
last.pt holds weights, optimiser, schedule and every RNG, so a stopped run continues exactly (lab/steps.Training
restores them). Check: tests/test_faults.py, tests/test_robustness.py (exact resume, locks, damaged checkpoints).
"""
import argparse
import contextlib
import json
from pathlib import Path

import torch

from lab.runs import append_line, cannot_write, fail, hold_lock, rank, read_config, release_lock
from tools import checked


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


# settings a resumed run may take from the new command line (the data paths: if the data is the same)
RESUME_MAY_CHANGE = {"resume", "device", "workers", "data_dir", "cache_dir"}
PATH_FLAGS = {"data_dir", "cache_dir", "out", "init_from"}   # lab/run.absolute_paths makes them absolute


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
        ck = checked.read_checkpoint(folder / "last.pt")
    except ValueError as e:
        usable = []
        for name in ("best.pt", "spt.pt"):
            with contextlib.suppress(ValueError, FileNotFoundError):
                other = checked.read_checkpoint(folder / name)
                usable.append(f"{name} ({other['phase']} epoch {other['epoch']})")
        hint = f"still readable: {', '.join(usable)}" if usable else "no other readable checkpoint there"
        fail(f"--resume: {e}; {hint}; start again"
             f"{seed_it.replace(', e.g.', ' (an spt.pt can seed a new run:')}"
             f"{')' if seed_it else ''}")
    missing = [k for k in ("optimizer", "scheduler", "rng", "args", "phase", "epoch", "step", "best") if k not in ck]
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
    if [ck["model_name"], ck["task"], plain(ck)[2]] != [config.get(k) for k in ("model_name", "task", "config")]:
        fail(f"--resume {folder}: its last.pt ({ck['model_name']} on {ck['task']}) is not of the "
             f"run config.json describes ({config.get('model_name')} on {config.get('task')}, "
             f"its sizes): the folder mixes two runs; start a new run")
    name, best = "spt.pt" if ck["phase"] == "spt" else "best.pt", None
    with contextlib.suppress(ValueError):
        best = checked.read_checkpoint(folder / name)
    if ck["best"]["epoch"] and (not best or plain(best) != [ck["phase"], ck["best"]["epoch"], plain(ck)[2]]):
        what = f"of {best.get('phase')} epoch {best.get('epoch')}" if best else \
            "damaged" if (folder / name).exists() else "missing"
        fail(f"--resume {folder}: {name} ({ck['phase']} epoch {ck['best']['epoch']}'s best, which "
             f"{'fine-tuning starts from' if name == 'spt.pt' else 'the test reads'}) is {what}: "
             f"the run could not finish; start a new run{seed_it}")
