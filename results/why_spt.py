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
otherwise they run here. The arms of one model's seed run on one machine: a (model, seed) some of whose runs ran
on another CPU model is left for that machine (named, never mixed). Resumable: a finished run is skipped, a stopped
one resumed, one stopped before its first evaluation started again, one a train.py holds locked left alone. The
Transformer runs keep best.pt and spt.pt (with their attention by offset, attention.json: tools/attention_offsets.py;
a plot per cell, attention_a.png and attention_b.png); other checkpoints are deleted once a run has finished. Each
run: nice 19, one thread, --jobs at a time.
    python results/why_spt.py --dry-run          # the plan: what would run, resume, be reused or left
    python results/why_spt.py --cells a b c      # the study, about 14 h on 2 cores; run again after a stop
    python results/summarize.py                  # its tables in results/summary.md
"""
import argparse
import json
import os
import shlex
import shutil
import statistics
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
    """This machine's CPU model, as train.py records it (tools/provenance.machine)."""
    sys.path.insert(0, str(REPO))
    import torch
    from tools import provenance
    return provenance.machine(torch.device("cpu"))["cpu"]


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


def model_seed(ident):
    """(model, seed) of a run: the unit that stays on one CPU model (every contrast pairs the runs of one model)."""
    return flag(ident, "--model"), flag(ident, "--seed")


def plan(jobs, out, cpu, reuse_from, dry=False, log=print):
    """Decide each (name, cmd) of jobs: skip (finished), resume, start, reuse a control run (copy it), or leave it
    (another CPU model holds its model's seed). dry: say so, change nothing on disk. -> [(name, cmd, folder to
    resume or None)] to run."""
    found, reusable = folders(out), folders(reuse_from) if reuse_from else {}
    seed_cpus = {}                # (model, seed) -> the CPU models its runs here ran on (contrasts pair within a model)
    for ident, (_, config) in found.items():
        seed_cpus.setdefault(model_seed(ident), set()).add(cpu_of(config))
    todo = []
    for name, cmd in jobs:
        ident = identity(cmd)
        key, seed = model_seed(ident), flag(ident, "--seed")
        folder, config = found.get(ident, (None, None))
        if folder and (folder / "results.json").is_file():
            continue
        elsewhere = seed_cpus.get(key, set()) - {cpu}
        if elsewhere and seed != str(PILOT_SEED):
            log(f"{name}: left: {key[0]} seed {seed}'s runs ran on {', '.join(sorted(elsewhere))}, this machine is "
                f"{cpu} (the arms of a model's seed run on one machine)")
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
            seed_cpus.setdefault(key, set()).add(cpu)
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
        seed_cpus.setdefault(key, set()).add(cpu)
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


# ---- the tables (results/summarize.py calls section) -----------------------------------------------------------------
# a contrast: per seed Σ weight × test accuracy (points) over (model, arm) terms; a seed counts where every term ran.
# The four primary ones are fixed in why_spt/README.md before any run; Holm's adjustment is over these four.
PRIMARY = [
    ("C1 sinusoidal: SPT − TFS", {("transformer", "spt-sin"): 1, ("transformer", "tfs-sin"): -1}),
    ("C2 position × SPT: (SPT − TFS) sinusoidal − (SPT − TFS) rotary",
     {("transformer", "spt-sin"): 1, ("transformer", "tfs-sin"): -1, ("transformer", "spt-rot"): -1,
      ("transformer", "tfs-rot"): 1}),
    ("C3 rotary: converged SPT − TFS", {("transformer", "conv-rot"): 1, ("transformer", "tfs-rot"): -1}),
    ("C4 S4 and DLR: SPT − tuned TFS (mean of the two)",
     {("s4", "spt-tuned"): 0.5, ("s4", "tfs-tuned"): -0.5, ("dlr", "spt-tuned"): 0.5, ("dlr", "tfs-tuned"): -0.5}),
]
SECONDARY = [
    ("rotary: SPT − TFS (the control's arms)", {("transformer", "spt-rot"): 1, ("transformer", "tfs-rot"): -1}),
    ("sinusoidal: converged SPT − TFS", {("transformer", "conv-sin"): 1, ("transformer", "tfs-sin"): -1}),
    ("rotary: converged SPT − SPT (P = 3)", {("transformer", "conv-rot"): 1, ("transformer", "spt-rot"): -1}),
    ("sinusoidal: converged SPT − SPT (P = 3)", {("transformer", "conv-sin"): 1, ("transformer", "spt-sin"): -1}),
    ("S4: SPT − tuned TFS", {("s4", "spt-tuned"): 1, ("s4", "tfs-tuned"): -1}),
    ("DLR: SPT − tuned TFS", {("dlr", "spt-tuned"): 1, ("dlr", "tfs-tuned"): -1}),
]


def arm_of(config, finetune, choice):
    """(model, arm) of a run folder's config.json, or None for a run that is no arm of this study."""
    ident = identity(config["command"])
    model, flags = flag(ident, "--model"), list(ident[ident.index("--seed") + 2:])
    for cell in arms(finetune, choice).values():
        for arm, arm_flags in cell.get(model, {}).items():
            if arm_flags == flags:
                return model, arm
    return None


def study_cells(folder, runs):
    """{(model, arm): {seed: run}} of the finished runs (summarize.read_run's dicts) of the study folder, each run with
    its CPU model and, where there, attention.json."""
    finetune = json.loads((HERE / "control" / "pilot" / "choice.json").read_text())["finetune_epochs"]
    choice_file = folder / "pilot" / "choice.json"
    choice = ({m: (c["dropout"], c["schedule"]) for m, c in json.loads(choice_file.read_text())["choice"].items()}
              if choice_file.is_file() else None)
    cells = {}
    for r in runs:
        config = json.loads((folder / r["name"] / "config.json").read_text())
        key = arm_of(config, finetune, choice)
        if key:
            attention = folder / r["name"] / "attention.json"
            cells.setdefault(key, {})[r["seed"]] = {
                **r, "cpu": cpu_of(config), "reused": (folder / r["name"] / "reused.json").is_file(),
                "attention": json.loads(attention.read_text()) if attention.is_file() else None}
    return cells


def contrast(cells, terms):
    """Per seed Σ weight × test accuracy (points) where every term ran -> {seed: difference}."""
    seeds = set.intersection(*(set(cells.get(t, {})) for t in terms))
    return {s: sum(w * 100 * cells[t][s]["test"] for t, w in terms.items()) for s in sorted(seeds)}


def contrast_rows(cells, contrasts, stats, adjust):
    """Rows of the contrasts table: n, per seed, mean [95 % t interval], t, p (Holm-adjusted where adjust), the
    difference detectable at 80 % power from the observed spread, McNemar per seed (two-arm contrasts)."""
    found = [(name, terms, contrast(cells, terms)) for name, terms in contrasts]
    tests = [stats.paired_test(list(d.values())) if len(d) > 1 and len(set(d.values())) > 1 else (None, None)
             for _, _, d in found]
    ps = [p for _, p in tests]
    held = [i for i, p in enumerate(ps) if p is not None]
    holm = dict(zip(held, stats.holm([ps[i] for i in held]))) if adjust else {}
    rows = []
    for i, (name, terms, d) in enumerate(found):
        values, (t, p) = list(d.values()), tests[i]
        if len(values) > 1:
            mean, low, high = stats.interval(values)
            shown = f"{mean:+.1f} [{low:+.1f}, {high:+.1f}]"
            detect = f"{stats.detectable_difference(statistics.stdev(values), len(values)):.1f}"
        else:
            shown, detect = (f"{values[0]:+.1f}" if values else "–"), "–"
        pairs = [t_ for t_, w in terms.items()]
        mcnemar = "–"
        if len(pairs) == 2 and pairs[0][0] == pairs[1][0] and d:
            mcnemar = control_mcnemar(cells[pairs[0]], cells[pairs[1]], stats)
        p_text = "–" if p is None else f"{p:.3g}" + (f" (Holm {holm[i]:.3g})" if i in holm else "")
        rows.append(f"| {name} | {len(values)} | {' / '.join(f'{v:+.1f}' for v in values) or '–'} | {shown} | "
                    f"{'–' if t is None else f'{t:.2f}'} | {p_text} | {detect} | {mcnemar} |")
    return rows


def control_mcnemar(a, b, stats):
    """Exact McNemar p per seed of two arms' test predictions, 'p1 / p2 / ...'."""
    ps = []
    for seed in sorted(set(a) & set(b)):
        pa, pb = a[seed]["predictions"], b[seed]["predictions"]
        ok = pa and pb and pa["labels"] == pb["labels"] and pa["index_sha1"] == pb["index_sha1"]
        ps.append(f"{stats.mcnemar(pa['predictions'], pb['predictions'], pa['labels'])[2]:.2g}" if ok else "–")
    return " / ".join(ps)


def attention_rows(cells):
    """Mean attention distance per layer (mean over heads, then seeds) of each Transformer arm, after SPT (spt.pt)
    and after fine-tuning (best.pt), against uniform attention's."""
    rows = []
    for (model, arm), by_seed in sorted(cells.items()):
        found = [r["attention"] for r in by_seed.values() if r["attention"]]
        for ck in ("spt.pt", "best.pt"):
            layers = [a["checkpoints"][ck]["layers"] for a in found if ck in a["checkpoints"]]
            if not layers:
                continue
            per_layer = []
            for i in range(len(layers[0])):
                mean = statistics.fmean(statistics.fmean(seed[i]["mean_distance"]) for seed in layers)
                uniform = statistics.fmean(seed[i]["uniform_distance"] for seed in layers)
                per_layer.append(f"{mean:.1f} (uniform {uniform:.1f})")
            rows.append(f"| {model} {arm} | {ck} | {len(layers)} | {' | '.join(per_layer)} |")
    return rows


def section(folder, runs, stats):
    """The study's part of summary.md: n per cell, the primary contrasts (Holm), the secondary ones, attention."""
    cells = study_cells(folder, runs)
    lines = [f"## Why SPT gives our Transformer nothing (`{folder.name}/`, issue 31)", "",
             "The plan and its four primary contrasts: `why_spt/README.md` (fixed before any run). Test accuracy %, "
             "mean [95 % t interval over seeds]; n = seeds. Each contrast pairs the runs of a seed.", "",
             "| model · arm | n | seeds | test acc % | best val acc % | SPT epochs (per seed) | CPU | reused |",
             "|---|---|---|---|---|---|---|---|"]
    for (model, arm), by_seed in sorted(cells.items()):
        rs = [by_seed[s] for s in sorted(by_seed)]
        accs = [100 * r["test"] for r in rs]
        acc = (f"{stats.interval(accs)[0]:.1f} [{stats.interval(accs)[1]:.1f}, {stats.interval(accs)[2]:.1f}]"
               if len(accs) > 1 else f"{accs[0]:.1f}")
        epochs = " / ".join(str(r["spt_epochs_run"]) for r in rs) if rs[0]["spt_epochs_run"] else "–"
        lines.append(f"| {model} {arm} | {len(rs)} | {', '.join(str(s) for s in sorted(by_seed))} | {acc} | "
                     f"{statistics.fmean(100 * r['best_val'] for r in rs):.1f} | {epochs} | "
                     f"{', '.join(sorted({r['cpu'] for r in rs}))} | {sum(r['reused'] for r in rs)} |")
    header = ["| contrast | n | per seed (points) | mean [95 % interval] | t | p | detectable at 80 % power | "
              "McNemar p per seed |", "|---|---|---|---|---|---|---|---|"]
    lines += ["", "Primary contrasts (paired t, two-sided; Holm over the four, or over those with runs while some "
              "lack them):", ""] + header
    lines += contrast_rows(cells, PRIMARY, stats, adjust=True)
    lines += ["", "Secondary contrasts (descriptive, unadjusted):", ""] + header
    lines += contrast_rows(cells, SECONDARY, stats, adjust=False)
    attention = attention_rows(cells)
    if attention:
        n_layers = attention[0].count("uniform")
        lines += ["", "Mean attention distance Σ_j a_ij |i − j| on the validation inputs (tools/attention_offsets.py), "
                  "mean over heads, then seeds:", "",
                  "| arm | checkpoint | n | " + " | ".join(f"layer {i + 1}" for i in range(n_layers)) + " |",
                  "|---" * (3 + n_layers) + "|"] + attention
    return lines + [""]


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
        plot_cells(args.out, args.finetune_epochs)
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
