"""results/control.py: the CPU-scale study with its control, on Text (real IMDB): is self pre-training better than
training from scratch, and better than training from scratch for as long?
arms, per model and seed:  TFS       fine-tune F epochs from random init
                           TFS-long  from random init for P + F epochs: as many steps as the SPT run takes in all,
                                     with the same schedule (warm-up, then constant) and evaluations
                           SPT       masked denoising for P epochs, then fine-tune F epochs (the paper's method)
setting: width 64 × 2 layers (N = 64), batch 16, AdamW lr 2e-3, 20 warm-up steps then constant, 4,000 training
reviews cut to 511 bytes + EOS (250 steps an epoch), validation on the whole carved split (2,500 reviews) after
every epoch, test on all 25,000 test reviews; F from the pilot (results/control/pilot/README.md), P = 3.
The driver is resumable: a finished run is skipped, an unfinished one continued (--resume), one stopped before its
first evaluation (no last.pt) started again, one that a train.py is running (its folder locked) left alone; run it
again after a stop. Checkpoints are deleted once a run has finished, so the folders are small enough to commit.
    python results/control.py --seeds 100 --arms tfs spt --finetune-epochs 10 --out results/control/pilot  # pilot
    python results/control.py --seeds 0 1 2 3 4 5 --jobs 2        # about 4-5 h on 2 cores
    python results/summarize.py                                   # summary.md, with this study's intervals
"""
import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    import fcntl  # POSIX file locks, as train.py takes them (runs.hold_lock); absent on Windows
except ImportError:
    fcntl = None

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
from tools import checked  # noqa: E402  (finite flags, checked reads, no torch)

CHECKPOINTS = ("spt.pt", "best.pt", "last.pt")   # what train.py writes into a run folder and this driver may delete
MODELS = ["transformer", "s4", "dlr"]
SETTING = ["--preset", "tiny", "--task", "text", "--max-len", "512", "--max-train", "4000", "--max-eval", "0",
           "--d-model", "64", "--n-layers", "2", "--batch-size", "16", "--device", "cpu"]


def arms(finetune, pretrain):
    """{arm: the flags that make it}: TFS, TFS-long (as many steps as SPT + fine-tuning), SPT (masked)."""
    return {"tfs": ["--epochs", str(finetune)], "tfs-long": ["--epochs", str(finetune + pretrain)],
            "spt": ["--spt", "--pretrain-epochs", str(pretrain), "--epochs", str(finetune)]}


def identity(args):
    """What makes a run one cell of the study: (model, seed, spt, epochs, pretrain epochs if SPT)."""
    return (args["model"], args["seed"], bool(args["spt"]), args["epochs"], args["pretrain_epochs"] if args["spt"]
            else None)


def existing(out):
    """{identity: run folder} of the run folders under out (finished or not)."""
    found = {}
    for folder in sorted(out.glob("text-*")):
        config = folder / "config.json"
        if config.is_file():
            try:
                args = checked.read_json(config, "skipped by this driver: delete the folder to run it "
                                         "again", needs=["args"])["args"]
                found[identity(args)] = folder
            except (checked.Damaged, KeyError, TypeError) as e:
                print(f"note: {e if isinstance(e, checked.Damaged) else f'{config}: no run settings'}",
                      flush=True)
    return found


def set_aside(folder):
    """Move a run folder that stopped before its first evaluation (nothing to resume) to <out>/stopped/, so that the
    run can start again and nothing in the folder (a user's notes included) is deleted. -> the new place."""
    aside = folder.parent / "stopped" / folder.name
    while aside.exists():                                     # set aside before: keep both
        aside = aside.with_name(aside.name + "+")
    aside.parent.mkdir(exist_ok=True)
    folder.rename(aside)
    print(f"note: {folder.name}: set aside in {aside} (stopped before its first evaluation)", flush=True)
    return aside


def try_lock(f):
    """Take the lock of the open lock file f (checked.open_lock) until f is closed, as train.py does (runs.hold_lock):
    False where another process holds it. True without fcntl (Windows: no locks)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def in_use(folder):
    """Whether a train.py holds the run folder's lock (runs.hold_lock): a run that another driver on the same --out
    has started and is running, which this one must neither delete nor resume. False without fcntl (Windows)."""
    if not (folder / ".lock").is_file():
        return False
    with checked.open_lock(folder / ".lock") as f:
        return not try_lock(f)                              # free: closing the file releases it at once


def command(model, seed, flags, args):
    return [sys.executable, "train.py", *SETTING, "--model", model, "--seed", str(seed), *flags,
            "--data-dir", str(args.data_dir), "--cache-dir", str(args.cache_dir), "--out", str(args.out)]


def run_one(cmd, folder, log):
    """Run (or resume) one train.py run, one thread; its console output goes to log; checkpoints deleted after."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}          # one core per process: two processes on two cores
    cmd = [sys.executable, "train.py", "--resume", str(folder)] if folder else cmd
    with open(log, "a") as f:
        done = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    return done.returncode


def main(argv=None):
    p = argparse.ArgumentParser(description="Run (or continue) the TFS / TFS-long / SPT study on Text.")
    p.add_argument("--seeds", type=checked.seed(), nargs="+", default=[0, 1, 2, 3, 4, 5], help="seeds to run")
    p.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    p.add_argument("--arms", nargs="+", choices=["tfs", "tfs-long", "spt"], default=["tfs", "tfs-long", "spt"])
    p.add_argument("--finetune-epochs", type=checked.at_least(1), default=None,
                   help="F (default: the pilot's, in pilot/README.md)")
    p.add_argument("--pretrain-epochs", type=checked.at_least(1), default=3, help="P: SPT epochs (750 steps)")
    p.add_argument("--jobs", type=checked.at_least(1), default=2, help="training processes at a time, one thread each")
    p.add_argument("--out", default=str(HERE / "control"), help="the study folder (one folder per run inside)")
    shared = Path(os.environ.get("LRA_SHARED_DATA", REPO.parent / "shared" / "data"))   # as the tests find it
    p.add_argument("--data-dir", default=str(shared / "text"), help="the IMDB folder (default: $LRA_SHARED_DATA/text, "
                   "else ../shared/data/text)")
    p.add_argument("--cache-dir", default="/tmp/lra_cache", help="prepared arrays (not committed)")
    p.add_argument("--console", default="/tmp/control_console", help="each run's console output (not committed: "
                   "its log.txt holds the lines that matter)")
    p.error = lambda m: (print(f"control.py: error: {checked.flag_message(m)}", file=sys.stderr), sys.exit(2))
    args = p.parse_args(argv)
    args.out = Path(args.out)
    if args.finetune_epochs is None:
        pilot = args.out / "pilot" / "choice.json"
        if not pilot.is_file():
            p.error(f"no --finetune-epochs and no pilot choice in {pilot}: run the pilot first (see README.md)")
        try:
            args.finetune_epochs = checked.read_json(pilot, "run the pilot again, or pass --finetune-epochs",
                                                     needs=["finetune_epochs"])["finetune_epochs"]
            checked.at_least(1)(str(args.finetune_epochs))
        except (checked.Damaged, argparse.ArgumentTypeError) as e:
            p.error(str(e) if isinstance(e, checked.Damaged) else f"{pilot}: finetune_epochs {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    found = existing(args.out)
    todo = []
    for seed in args.seeds:                                # seed by seed: a stopped study has whole seeds first
        for model in args.models:
            for arm, flags in arms(args.finetune_epochs, args.pretrain_epochs).items():
                if arm not in args.arms:
                    continue
                key = (model, seed, arm == "spt", int(flags[flags.index("--epochs") + 1]),
                       args.pretrain_epochs if arm == "spt" else None)
                folder = found.get(key)
                if folder and (folder / "results.json").is_file():
                    continue
                if folder and in_use(folder):
                    print(f"{folder.name}: being run by another train.py (a second driver on {args.out}?); "
                          f"left to it")
                    continue
                if folder and not (folder / "last.pt").is_file():   # stopped before its first evaluation:
                    print(f"{folder.name}: stopped before its first evaluation; starting it again")
                    set_aside(folder)                                # nothing in it to resume
                    folder = None
                todo.append((f"{arm}-{model}-s{seed}", command(model, seed, flags, args), folder))
    print(f"{len(todo)} runs to do ({sum(1 for t in todo if t[2])} to resume), {args.jobs} at a time", flush=True)
    logs = Path(args.console)
    logs.mkdir(parents=True, exist_ok=True)

    def work(item):
        name, cmd, folder = item
        t0 = time.time()
        code = run_one(cmd, folder, logs / f"{name}.txt")
        print(f"{name}: exit {code} after {(time.time() - t0) / 60:.1f} min", flush=True)
        return code
    with ThreadPoolExecutor(args.jobs) as pool:
        codes = list(pool.map(work, todo))
    for folder in args.out.glob("text-*"):                 # finished runs keep their logs, not their checkpoints
        if (folder / "results.json").is_file():
            for name in CHECKPOINTS:                       # train.py's own: a user's *.pt stays
                (folder / name).unlink(missing_ok=True)
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
