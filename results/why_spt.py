"""results/why_spt.py: why SPT gives our Transformer nothing at CPU scale, and whether S4's and DLR's gains hold
against a tuned baseline (issue 31; the plan and its primary contrasts: results/why_spt/README.md, written before
any run). The control study's setting (results/control.py: Text, 4,000 reviews, width 64 × 2, all 2,500 validation
and 25,000 test reviews, F = 9 fine-tuning epochs), paired by seed. Cells, in order of priority:
  a  Transformer, --pos sinusoidal: TFS and SPT (P = 3), beside the control's rotary TFS and SPT (P = 3)
  b  Transformer, rotary and sinusoidal: SPT to convergence (--pretrain-patience 3, at most 15 epochs), then F = 9
  c  S4 and DLR: TFS tuned on validation (a pilot on seed 100, not a study seed: dropout {0, 0.1} × schedule
     {constant, cosine}, the best validation accuracy wins), then TFS and SPT (P = 3) with the chosen settings
The rotary arms of cell a are the control's runs, copied (folder and reused.json) where a control run has the very
same train.py flags and ran on this CPU model (the default reproduces its epoch 1 to the last digit there: README);
otherwise they run here. The arms of one seed run on one machine: a seed some of whose runs ran on another CPU model
is left for that machine (named, never mixed). Resumable: a finished run is skipped, a stopped one resumed, one
stopped before its first evaluation started again, one a train.py holds locked left alone. The Transformer runs keep
best.pt and spt.pt (with their attention by offset, attention.json: tools/attention_offsets.py); other checkpoints
are deleted once a run has finished. Each run: nice 19, one thread, --jobs at a time.
    python results/why_spt.py --dry-run          # the plan: what would run, resume, be reused or left
    python results/why_spt.py --cells a b c      # the study, about 14 h on 2 cores; run again after a stop
    python results/summarize.py                  # its tables in results/summary.md
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import control  # noqa: E402  (the control study's setting, its run folders, locks)

PATIENCE, CAP, PRETRAIN = 3, 15, 3          # cell b's K and epoch cap; cells a and c pre-train P epochs (control's)
GRID = [(dropout, schedule) for dropout in ("0", "0.1") for schedule in ("constant", "cosine")]
PILOT_SEED = 100
PATHS = ("--data-dir", "--cache-dir", "--out")      # where a run reads and writes: not what it is


def arms(finetune, choice=None):
    """{cell: {model: {arm: train.py flags}}}; choice: cell c's {model: (dropout, schedule)} from the pilot."""
    ft, spt = ["--epochs", str(finetune)], ["--spt", "--pretrain-epochs", str(PRETRAIN)]
    converged = ["--spt", "--pretrain-epochs", str(CAP), "--pretrain-patience", str(PATIENCE)]
    sin = ["--pos", "sinusoidal"]
    cells = {"a": {"transformer": {"tfs-sin": sin + ft, "spt-sin": sin + spt + ft, "tfs-rot": ft,
                                   "spt-rot": spt + ft}},
             "b": {"transformer": {"conv-rot": converged + ft, "conv-sin": sin + converged + ft}}, "c": {}}
    for model, (dropout, schedule) in (choice or {}).items():
        tuned = grid_flags(dropout, schedule)
        cells["c"][model] = {"tfs-tuned": tuned + ft, "spt-tuned": tuned + spt + ft}
    return cells


def grid_flags(dropout, schedule):
    """A grid point's flags, each only where it differs from the control's setting (dropout 0, constant), so that a
    run with the control's settings has the control's flags."""
    return (["--dropout", dropout] if dropout != "0" else []) + (["--schedule", schedule] if schedule != "constant"
                                                                  else [])


def identity(cmd):
    """What makes a run a run: its train.py flags without the paths (a tuple)."""
    flags, i = [], 1                                       # cmd[0] is train.py
    while i < len(cmd):
        if cmd[i] in PATHS:
            i += 2
            continue
        flags.append(cmd[i])
        i += 1
    return tuple(flags)


def command(model, seed, flags, args):
    return ["train.py", *args.setting, "--model", model, "--seed", str(seed), *flags,
            "--data-dir", str(args.data_dir), "--cache-dir", str(args.cache_dir), "--out", str(args.out)]


def folders(out):
    """{identity: (run folder, config.json)} of the run folders under out."""
    found = {}
    for folder in sorted(Path(out).glob("*")):
        if (folder / "config.json").is_file():
            config = json.loads((folder / "config.json").read_text())
            found[identity(config["command"])] = (folder, config)
    return found


def cpu_of(config):
    return config.get("machine", {}).get("cpu", "unknown")


def this_cpu():
    """This machine's CPU model, as train.py records it (runs.machine)."""
    sys.path.insert(0, str(REPO))
    import runs
    import torch
    return runs.machine(torch.device("cpu"))["cpu"]


def pilot_choice(pilot, models):
    """Cell c's choice from the finished pilot runs: per model the (dropout, schedule) of the best validation accuracy
    (ties: the earlier in GRID, the control's settings first) -> ({model: (dropout, schedule)}, [missing]), and
    pilot/choice.json once every grid run has finished."""
    found, choice, missing, table = folders(pilot), {}, [], {}
    for model in models:
        accs = {}
        for dropout, schedule in GRID:
            key = (model, PILOT_SEED, dropout, schedule)
            hit = next((f for ident, (f, _) in found.items() if run_key(ident, model, PILOT_SEED)
                        and (flag(ident, "--dropout") or "0") == dropout
                        and (flag(ident, "--schedule") or "constant") == schedule), None)
            if hit is None or not (hit / "results.json").is_file():
                missing.append(key)
                continue
            accs[(dropout, schedule)] = json.loads((hit / "results.json").read_text())["best_val_acc"]
        if len(accs) == len(GRID):
            choice[model] = max(GRID, key=lambda g: (accs[g], -GRID.index(g)))
            table[model] = {f"dropout {d}, {s}": a for (d, s), a in accs.items()}
    if not missing and models:
        (pilot / "choice.json").write_text(json.dumps(dict(
            choice={m: dict(dropout=d, schedule=s) for m, (d, s) in choice.items()}, best_val_acc=table,
            rule="per model, the grid point of the highest best validation accuracy (ties: the earlier point)"),
            indent=1) + "\n")
    return choice, missing


def flag(ident, name):
    return ident[ident.index(name) + 1] if name in ident else None


def run_key(ident, model, seed):
    return flag(ident, "--model") == model and flag(ident, "--seed") == str(seed)


def plan(jobs, out, cpu, reuse_from, dry=False, log=print):
    """Decide each (name, cmd) of jobs: skip (finished), resume, start, reuse a control run (copy it), or leave it
    (another CPU model holds its seed). dry: say so, change nothing on disk. -> [(name, cmd, folder to resume or
    None)] to run."""
    found, reusable = folders(out), folders(reuse_from) if reuse_from else {}
    seed_cpus = {}                                        # seed -> the CPU models its runs here ran on
    for ident, (_, config) in found.items():
        seed_cpus.setdefault(flag(ident, "--seed"), set()).add(cpu_of(config))
    todo = []
    for name, cmd in jobs:
        ident, seed = identity(cmd), flag(identity(cmd), "--seed")
        folder, config = found.get(ident, (None, None))
        if folder and (folder / "results.json").is_file():
            continue
        elsewhere = seed_cpus.get(seed, set()) - {cpu}
        if elsewhere and seed != str(PILOT_SEED):
            log(f"{name}: left: seed {seed}'s runs ran on {', '.join(sorted(elsewhere))}, this machine is {cpu} "
                f"(the arms of a seed run on one machine)")
            continue
        if folder and control.in_use(folder):
            log(f"{folder.name}: being run by another train.py; left to it")
            continue
        if folder and not (folder / "last.pt").is_file():
            log(f"{folder.name}: stopped before its first evaluation; starting it again")
            if not dry:
                shutil.rmtree(folder)
            folder = None
        source = reusable.get(ident)
        if folder is None and source and (source[0] / "results.json").is_file() and cpu_of(source[1]) == cpu:
            seed_cpus.setdefault(seed, set()).add(cpu)
            log(f"{name}: {'would reuse' if dry else 'reused'} {source[0].name} (same flags, {cpu})")
            if dry:
                continue
            copy = Path(out) / source[0].name
            shutil.copytree(source[0], copy, ignore=shutil.ignore_patterns("*.pt", ".lock"))
            (copy / "reused.json").write_text(json.dumps(dict(reused_from=str(source[0].relative_to(REPO))
                                                               if source[0].is_relative_to(REPO) else str(source[0]),
                                                               why="the same train.py flags, the same CPU model"))
                                              + "\n")
            continue
        seed_cpus.setdefault(seed, set()).add(cpu)
        todo.append((name, cmd, folder))
    return todo


def run_one(cmd, folder, log, nice):
    """Run (or resume) one train.py at low priority, one thread; its console output to log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "train.py", "--resume", str(folder)] if folder else [sys.executable, *cmd]
    with open(log, "a") as f:
        done = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env,
                              preexec_fn=lambda: os.nice(nice))
    return done.returncode


def finish(out, nice):
    """Finished runs: a Transformer's best.pt and spt.pt stay, with their attention.json; every other checkpoint
    goes."""
    for folder in sorted(Path(out).glob("*")):
        if not (folder / "results.json").is_file():
            continue
        transformer = json.loads((folder / "config.json").read_text())["model_name"] == "transformer"
        for ck in folder.glob("*.pt"):
            if not (transformer and ck.name in ("best.pt", "spt.pt")):
                ck.unlink()
        if transformer and (folder / "best.pt").is_file() and not (folder / "attention.json").is_file():
            subprocess.run([sys.executable, "tools/attention_offsets.py", str(folder)], cwd=REPO, check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=lambda: os.nice(nice),
                           stdout=subprocess.DEVNULL)


def run_all(todo, args):
    """Run the planned jobs, --jobs at a time; -> the exit codes."""
    if args.dry_run:
        for name, cmd, folder in todo:
            print(f"{name}: {'resume ' + folder.name if folder else 'python ' + ' '.join(cmd)}")
        return []
    logs = Path(args.console)
    logs.mkdir(parents=True, exist_ok=True)

    def work(item):
        name, cmd, folder = item
        t0 = time.time()
        code = run_one(cmd, folder, logs / f"{name}.txt", args.nice)
        print(f"{name}: exit {code} after {(time.time() - t0) / 60:.1f} min", flush=True)
        return code
    with ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(work, todo))


def main(argv=None):
    p = argparse.ArgumentParser(description="Run (or continue) the why-SPT study (issue 31) on Text.")
    p.add_argument("--cells", nargs="+", choices=["a", "b", "c"], default=["a", "b", "c"], help="in this order")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5], help="study seeds")
    p.add_argument("--ssm-models", nargs="+", choices=["s4", "dlr"], default=["s4", "dlr"], help="cell c's models")
    p.add_argument("--finetune-epochs", type=int, default=None, help="F (default: the control's pilot choice)")
    p.add_argument("--jobs", type=int, default=2, help="training processes at a time, one thread each")
    p.add_argument("--nice", type=int, default=19, help="niceness of each run (19: the lowest priority)")
    p.add_argument("--out", default=str(HERE / "why_spt"), help="the study folder (run folders inside, pilot/)")
    p.add_argument("--reuse-from", default=str(HERE / "control"), help="finished runs to reuse ('' : none)")
    p.add_argument("--setting", default=None, help="the flags every run shares, one string (default: the "
                   "control's; tests pass a miniature)")
    p.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "text"), help="IMDB")
    p.add_argument("--cache-dir", default="/tmp/lra_cache", help="prepared arrays (not committed)")
    p.add_argument("--console", default="/tmp/why_spt_console", help="each run's console output")
    p.add_argument("--dry-run", action="store_true", help="print the plan; run nothing, copy nothing")
    p.error = lambda m: (print(f"why_spt.py: error: {m}", file=sys.stderr), sys.exit(2))
    args = p.parse_args(argv)
    args.out, args.setting = Path(args.out), shlex.split(args.setting) if args.setting else control.SETTING
    if args.finetune_epochs is None:
        args.finetune_epochs = json.loads((HERE / "control" / "pilot" / "choice.json").read_text())["finetune_epochs"]
    if not args.dry_run:
        args.out.mkdir(parents=True, exist_ok=True)
    cpu, pilot = this_cpu(), args.out / "pilot"
    reuse = Path(args.reuse_from) if args.reuse_from else None
    print(f"why_spt: {cpu}; cells {' '.join(args.cells)}; seeds {args.seeds}; F = {args.finetune_epochs}")
    jobs = [(f"{arm}-{model}-s{seed}", command(model, seed, flags, args)) for cell in args.cells if cell != "c"
            for seed in args.seeds for model, by_arm in arms(args.finetune_epochs)[cell].items()
            for arm, flags in by_arm.items()]
    todo = plan(jobs, args.out, cpu, reuse, args.dry_run)
    if "c" in args.cells:                                  # the pilot runs after cells a and b, in one pool
        pilot_args = argparse.Namespace(**{**vars(args), "out": pilot})
        grid = [(f"pilot-{model}-d{d}-{s}", command(model, PILOT_SEED, grid_flags(d, s) + [
            "--epochs", str(args.finetune_epochs)], pilot_args)) for model in args.ssm_models for d, s in GRID]
        todo += plan(grid, pilot, cpu, None, args.dry_run)
    print(f"{len(todo)} runs to do ({sum(1 for t in todo if t[2])} to resume), {args.jobs} at a time", flush=True)
    codes = run_all(todo, args)
    if "c" in args.cells:
        choice, missing = pilot_choice(pilot, args.ssm_models)
        if missing and not args.dry_run:
            print(f"cell c: the pilot lacks {len(missing)} finished runs; its seeds wait for them")
        jobs = [(f"{arm}-{model}-s{seed}", command(model, seed, flags, args)) for seed in args.seeds
                for model, by_arm in arms(args.finetune_epochs, choice)["c"].items() for arm, flags in by_arm.items()]
        codes += run_all(plan(jobs, args.out, cpu, reuse, args.dry_run), args)
    if not args.dry_run:
        finish(args.out, args.nice)
        finish(pilot, args.nice)
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
