"""results/why_spt.py: why SPT gives our Transformer nothing at CPU scale, and whether S4's and DLR's gains hold
against a tuned baseline (the plan and its primary contrasts: results/why_spt/README.md, written before any run;
its dated section, the later arms). The control study's setting (results/control.py: Text, 4,000 reviews, width 64 × 2, all 2,500 validation
and 25,000 test reviews, F = 9 fine-tuning epochs), paired by seed. Cells, in order of priority:
  a  Transformer, --pos sinusoidal: TFS and SPT (P = 3), beside the control's rotary TFS and SPT (P = 3)
  b  Transformer, rotary and sinusoidal: SPT to convergence (--pretrain-patience 3, at most 15 epochs), then F = 9
     and its SPT-length arm: rotary, at most 40 SPT epochs (conv40-rot)
  c  TFS tuned on validation (a pilot on seed 100, not a study seed: dropout {0, 0.1} × schedule {constant,
     cosine}, the best validation accuracy wins), then with the chosen settings S4's and DLR's TFS and SPT (P = 3),
     the Transformer's TFS
  p  the sinusoidal plateau: seed 100, SPT lr {5e-4, 1e-3, 2e-3} × warm-up {20, 250} (in plateau/)
A run is keyed by its train.py flags and its CPU model: a run finished on another CPU model is no run of this
machine's, and each per-seed difference of the tables takes all its terms from one CPU model (study_cells). The
rotary arms of cell a are the control's runs, copied (folder and reused.json) where a control run has the very same
train.py flags and ran on this CPU model; otherwise they run here. Resumable: a finished run is skipped, a stopped
one resumed, one stopped before its first evaluation started again, one a train.py holds locked left alone. The
Transformer runs of study seeds keep best.pt and spt.pt (with their attention by offset, attention.json:
tools/attention_offsets.py; a plot per cell, attention_a.png and attention_b.png); other checkpoints are deleted
once a run has finished. Each run: nice 19, one thread, --jobs at a time.
    python results/why_spt.py --dry-run          # the plan: what would run, resume, be reused or left
    python results/why_spt.py --cells a b c      # the study, about 14 h on 2 cores; run again after a stop
    python results/why_spt.py --cells b --seeds 3 4 5 --arms conv-rot     # some arms and seeds only
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
from tools import checked  # noqa: E402  (control puts the repo on the path: ranged flag types)

PATIENCE, CAP, PRETRAIN = 3, 15, 3          # cell b's K and epoch cap; cells a and c pre-train P epochs (control's)
LONG_CAP = 40                               # the SPT-length arm's cap (conv40-rot), same K
PLATEAU_LRS, PLATEAU_WARMUPS = ("5e-4", "1e-3", "2e-3"), ("20", "250")   # cell p's grid (sinusoidal, seed 100)
PLATEAU_EXIT = 3.0                          # "leaves the plateau": an SPT validation loss below this (nats), any epoch
GRID = [(dropout, schedule) for dropout in ("0", "0.1") for schedule in ("constant", "cosine")]
PILOT_SEED = 100
PATHS = ("--data-dir", "--cache-dir", "--out")      # where a run reads and writes: not what it is


def arms(finetune, choice=None):
    """{cell: {model: {arm: train.py flags}}}; choice: cell c's {model: (dropout, schedule)} from the pilot (the
    Transformer's cell c is its tuned TFS only)."""
    ft, spt = ["--epochs", str(finetune)], ["--spt", "--pretrain-epochs", str(PRETRAIN)]
    converged = lambda cap: ["--spt", "--pretrain-epochs", str(cap), "--pretrain-patience", str(PATIENCE)]  # noqa
    sin = ["--pos", "sinusoidal"]
    cells = {"a": {"transformer": {"tfs-sin": sin + ft, "spt-sin": sin + spt + ft, "tfs-rot": ft,
                                   "spt-rot": spt + ft}},
             "b": {"transformer": {"conv-rot": converged(CAP) + ft, "conv-sin": sin + converged(CAP) + ft,
                                   "conv40-rot": converged(LONG_CAP) + ft}}, "c": {}}
    for model, (dropout, schedule) in (choice or {}).items():
        tuned = grid_flags(dropout, schedule)
        cells["c"][model] = {"tfs-tuned": tuned + ft} if model == "transformer" else {
            "tfs-tuned": tuned + ft, "spt-tuned": tuned + spt + ft}
    return cells


def plateau_flags(lr, warmup):
    """Cell p: a sinusoidal SPT run of 3 epochs and one fine-tuning epoch at SPT learning rate lr and warm-up steps
    warmup (both phases)."""
    return ["--pos", "sinusoidal", "--spt", "--pretrain-epochs", str(PRETRAIN), "--epochs", "1", "--pretrain-lr", lr,
            "--warmup", warmup]


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
    """{(identity, CPU model): (run folder, config.json)} of the run folders under out: one run of a flag set per
    CPU model (a finished one before an unfinished one, else the later folder)."""
    found = {}
    for folder in sorted(Path(out).glob("*")):
        if (folder / "config.json").is_file():
            try:            # damaged, or a folder of the user's with a config.json of its own: one line, up front
                config = checked.read_json(folder / "config.json", "it is not a run of this study: move the folder "
                                           "out of the study folder (nothing in it was touched)", needs=["command"])
                if Path(str(config["command"][0])).name != "train.py":
                    raise ValueError("its command is not train.py's")
                key = (identity(config["command"]), cpu_of(config))
            except (checked.Damaged, ValueError, TypeError, IndexError, KeyError) as e:
                why = str(e) if isinstance(e, checked.Damaged) else (
                    f"{folder / 'config.json'} is not a train.py run's ({e or type(e).__name__}): move the folder "
                    f"out of the study folder (nothing in it was touched)")
                print(f"why_spt.py: error: {why}", file=sys.stderr)
                raise SystemExit(2) from None
            if key not in found or (folder / "results.json").is_file() or not (found[key][0] / "results.json").is_file():
                found[key] = (folder, config)
    return found


def cpu_of(config):
    return config.get("machine", {}).get("cpu", "unknown")


def this_cpu():
    """This machine's CPU model, as train.py records it (lab/provenance.machine)."""
    sys.path.insert(0, str(REPO))
    import torch
    from lab.run import machine
    return machine(torch.device("cpu"))["cpu"]


def pilot_choice(pilot, models):
    """Cell c's choice from the finished pilot runs: per model the (dropout, schedule) of the best validation accuracy
    (ties: the earlier in GRID, the control's settings first) -> ({model: (dropout, schedule)}, [missing] of models),
    and pilot/choice.json, with every model whose grid has finished, once the grids of models have."""
    found, choice, missing, table = folders(pilot), {}, [], {}
    for model in ("transformer", "s4", "dlr"):
        accs = {}
        for dropout, schedule in GRID:
            key = (model, PILOT_SEED, dropout, schedule)
            hit = next((f for (ident, _), (f, _) in found.items() if run_key(ident, model, PILOT_SEED)
                        and (flag(ident, "--dropout") or "0") == dropout
                        and (flag(ident, "--schedule") or "constant") == schedule), None)
            if hit is None or not (hit / "results.json").is_file():
                missing += [key] if model in models else []
                continue
            accs[(dropout, schedule)] = json.loads((hit / "results.json").read_text())["best_val_acc"]
        if len(accs) == len(GRID):
            choice[model] = max(GRID, key=lambda g: (accs[g], -GRID.index(g)))
            table[model] = {f"dropout {d}, {s}": a for (d, s), a in accs.items()}
    if not missing and models and choice:
        checked.write_whole(pilot / "choice.json", json.dumps(dict(      # whole or not at all
            choice={m: dict(dropout=d, schedule=s) for m, (d, s) in choice.items()}, best_val_acc=table,
            rule="per model, the grid point of the highest best validation accuracy (ties: the earlier point)"),
            indent=1) + "\n")
    return choice, missing


def flag(ident, name):
    return ident[ident.index(name) + 1] if name in ident else None


def run_key(ident, model, seed):
    return flag(ident, "--model") == model and flag(ident, "--seed") == str(seed)


def plan(jobs, out, cpu, reuse_from, dry=False, log=print, any_cpu=False):
    """Decide each (name, cmd) of jobs on this machine's CPU model cpu: skip (finished on cpu), resume, start, or
    reuse a control run of cpu (copy it); a run of the same flags on another CPU model counts for nothing here
    (any_cpu: it counts, for the runs no contrast pairs: the pilot's choice, the plateau grid). dry: say so,
    change nothing on disk. -> [(name, cmd, folder to resume or None)] to run."""
    found, reusable = folders(out), folders(reuse_from) if reuse_from else {}
    todo = []
    for name, cmd in jobs:
        ident = identity(cmd)
        if any_cpu and any(i == ident and (f / "results.json").is_file() for (i, _), (f, _) in found.items()):
            continue
        folder, config = found.get((ident, cpu), (None, None))
        if folder and (folder / "results.json").is_file():
            continue
        if folder and control.in_use(folder):
            log(f"{folder.name}: being run by another train.py; left to it")
            continue
        if folder and not (folder / "last.pt").is_file():
            log(f"{folder.name}: stopped before its first evaluation; starting it again")
            if not dry:              # moved to <out>/stopped/, nothing deleted
                control.set_aside(folder)
            folder = None
        source = reusable.get((ident, cpu))
        if folder is None and source and (source[0] / "results.json").is_file():
            log(f"{name}: {'would reuse' if dry else 'reused'} {source[0].name} (same flags, {cpu})")
            if dry:
                continue
            copy = Path(out) / source[0].name
            shutil.copytree(source[0], copy, ignore=shutil.ignore_patterns("*.pt", ".lock"))
            checked.write_owned(copy / "reused.json", json.dumps(dict(
                reused_from=str(source[0].relative_to(REPO)) if source[0].is_relative_to(REPO) else str(source[0]),
                why="the same train.py flags, the same CPU model")) + "\n", "why_spt.py")
            continue
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


def finish(out, nice, keep=True):
    """Finished runs: a Transformer's best.pt and spt.pt stay (keep: study seeds; not the pilots'), with their
    attention.json; every other checkpoint goes. A folder another process holds locked (another driver's finish on
    the same --out, a train.py) is left to it: one attention pass per run, no checkpoint deleted under a reader."""
    for folder in sorted(Path(out).glob("*")):
        if not (folder / "results.json").is_file():
            continue
        with checked.open_lock(folder / ".lock") as lock:
            if not control.try_lock(lock):                  # held until the with block closes the file
                continue
            transformer = keep and json.loads((folder / "config.json").read_text())["model_name"] == "transformer"
            for ck in folder.glob("*.pt"):
                if not (transformer and ck.name in ("best.pt", "spt.pt")):
                    ck.unlink()
            if transformer and (folder / "best.pt").is_file() and not (folder / "attention.json").is_file():
                subprocess.run([sys.executable, "tools/attention_offsets.py", str(folder)], cwd=REPO, check=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=lambda: os.nice(nice),
                               stdout=subprocess.DEVNULL)


def arm_of(config, finetune, choice):
    """(model, arm) of a run folder's config.json, or None for a run that is no arm of this study."""
    ident = identity(config["command"])
    model, flags = flag(ident, "--model"), list(ident[ident.index("--seed") + 2:])
    for cell in arms(finetune, choice).values():
        for arm, arm_flags in cell.get(model, {}).items():
            if arm_flags == flags:
                return model, arm
    return None


def plot_cells(out, finetune):
    """attention_<cell>.png for cells a and b: the attention by offset of the Transformer runs of the cell that have
    attention.json (tools/attention_offsets.plot: one line per arm and checkpoint, the mean over its seeds)."""
    sys.path.insert(0, str(REPO))
    from tools import attention_offsets
    by_cell = {}
    for folder in sorted(Path(out).glob("*")):
        if (folder / "attention.json").is_file():
            key = arm_of(json.loads((folder / "config.json").read_text()), finetune, None)
            cell = next((c for c, by_model in arms(finetune).items() if key and key[1] in by_model.get(key[0], {})),
                        None)
            if cell:
                by_cell.setdefault(cell, []).append((key[1], json.loads((folder / "attention.json").read_text())))
    for cell, found in sorted(by_cell.items()):                # one line per arm and checkpoint, over its seeds
        attention_offsets.plot([r for _, r in found], Path(out) / f"attention_{cell}.png", [a for a, _ in found])


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
    p = argparse.ArgumentParser(description="Run (or continue) the why-SPT study on Text.")
    p.add_argument("--cells", nargs="+", choices=["a", "b", "c", "p"], default=["a", "b", "c", "p"],
                   help="in this order (p: the plateau grid, in OUT/plateau)")
    p.add_argument("--seeds", type=checked.seed(), nargs="+", default=[0, 1, 2, 3, 4, 5], help="study seeds")
    p.add_argument("--arms", nargs="+", default=None, help="only these arms of cells a-c, run in this order "
                   "(default: all); cell c's pilot and cell p run whole")
    p.add_argument("--tuned-models", "--ssm-models", nargs="+", choices=["s4", "dlr", "transformer"],
                   default=["s4", "dlr", "transformer"], help="cell c's models")
    p.add_argument("--finetune-epochs", type=checked.at_least(1), default=None, help="F (default: the control's pilot choice)")
    p.add_argument("--jobs", type=checked.at_least(1), default=2, help="training processes at a time, one thread each")
    nice = checked.number(int, lambda v: 0 <= v <= 19, "must be in [0, 19] (0: as the shell, 19: the lowest priority)")
    p.add_argument("--nice", type=nice, default=19, help="niceness of each run (19: the lowest priority)")
    p.add_argument("--out", default=str(HERE / "why_spt"), help="the study folder (run folders inside, pilot/, "
                   "plateau/)")
    p.add_argument("--reuse-from", default=str(HERE / "control"), help="finished runs to reuse ('' : none)")
    p.add_argument("--setting", default=None, help="the flags every run shares, one string (default: the "
                   "control's; tests pass a miniature)")
    shared = Path(os.environ.get("LRA_SHARED_DATA", REPO.parent / "shared" / "data"))   # as the tests find it
    p.add_argument("--data-dir", default=str(shared / "text"), help="the IMDB folder (default: $LRA_SHARED_DATA/text, "
                   "else ../shared/data/text)")
    p.add_argument("--cache-dir", default="/tmp/lra_cache", help="prepared arrays (not committed)")
    p.add_argument("--console", default="/tmp/why_spt_console", help="each run's console output")
    p.add_argument("--dry-run", action="store_true", help="print the plan; run nothing, copy nothing")
    p.error = lambda m: (print(f"why_spt.py: error: {m}", file=sys.stderr), sys.exit(2))
    args = p.parse_args(argv)
    args.out, args.setting = Path(args.out), shlex.split(args.setting) if args.setting else control.SETTING
    if args.finetune_epochs is None:
        args.finetune_epochs = json.loads((HERE / "control" / "pilot" / "choice.json").read_text())["finetune_epochs"]
    known = {arm for cell in arms(args.finetune_epochs, {m: GRID[0] for m in ("transformer", "s4")}).values()
             for by_arm in cell.values() for arm in by_arm}
    if args.arms and set(args.arms) - known:
        p.error(f"--arms {' '.join(sorted(set(args.arms) - known))}: no such arm (the arms: {', '.join(sorted(known))})")
    if not args.dry_run:
        args.out.mkdir(parents=True, exist_ok=True)
    cpu, pilot, plateau = this_cpu(), args.out / "pilot", args.out / "plateau"
    reuse = Path(args.reuse_from) if args.reuse_from else None
    print(f"why_spt: {cpu}; cells {' '.join(args.cells)}; seeds {args.seeds}; F = {args.finetune_epochs}")

    def cell_jobs(cell, choice=None):          # [(name, cmd)] of a cell's arms and seeds, in --arms order, then seed
        found = [(arm, seed, model, flags) for model, by_arm in arms(args.finetune_epochs, choice)[cell].items()
                 for arm, flags in by_arm.items() if not args.arms or arm in args.arms for seed in args.seeds]
        order = lambda job: ((args.arms.index(job[0]) if args.arms else 0), job[1])          # noqa: E731
        return [(f"{arm}-{model}-s{seed}", command(model, seed, flags, args))
                for arm, seed, model, flags in sorted(found, key=order)]
    todo = plan([job for cell in args.cells if cell in "ab" for job in cell_jobs(cell)], args.out, cpu, reuse,
                args.dry_run)
    if "p" in args.cells:                                  # the plateau grid, seed 100, in its own folder
        grid = [(f"plateau-lr{lr}-w{w}", command("transformer", PILOT_SEED, plateau_flags(lr, w), argparse.Namespace(
            **{**vars(args), "out": plateau}))) for lr in PLATEAU_LRS for w in PLATEAU_WARMUPS]
        todo += plan(grid, plateau, cpu, None, args.dry_run, any_cpu=True)
    if "c" in args.cells:                                  # the pilot runs after cells a and b, in one pool
        pilot_args = argparse.Namespace(**{**vars(args), "out": pilot})
        grid = [(f"pilot-{model}-d{d}-{s}", command(model, PILOT_SEED, grid_flags(d, s) + [
            "--epochs", str(args.finetune_epochs)], pilot_args)) for model in args.tuned_models for d, s in GRID]
        todo += plan(grid, pilot, cpu, None, args.dry_run, any_cpu=True)
    print(f"{len(todo)} runs to do ({sum(1 for t in todo if t[2])} to resume), {args.jobs} at a time", flush=True)
    codes = run_all(todo, args)
    if "c" in args.cells:
        choice, missing = pilot_choice(pilot, args.tuned_models)
        if missing and not args.dry_run:
            print(f"cell c: the pilot lacks {len(missing)} finished runs; its seeds wait for them")
        choice = {m: c for m, c in choice.items() if m in args.tuned_models}
        if choice.get("transformer") == ("0", "constant"):
            print("cell c: the Transformer's pilot chose the control's setting: its tfs-tuned is tfs-rot")
            choice.pop("transformer")
        codes += run_all(plan(cell_jobs("c", choice), args.out, cpu, reuse, args.dry_run), args)
    if not args.dry_run:
        finish(args.out, args.nice)
        finish(pilot, args.nice, keep=False)
        finish(plateau, args.nice, keep=False)
        plot_cells(args.out, args.finetune_epochs)
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
