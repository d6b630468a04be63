"""summarize.py: rebuild results/summary.md and the plots from the run folders that train.py wrote.
Each run folder holds config.json (settings, command, commit), log.jsonl (one record per evaluation), log.txt and
results.json (test accuracy of the best-validation checkpoint); S4/DLR folders may hold kernels.json (results/kernels.py).
Runs are grouped into cells: task x setting x training examples x model x TFS/SPT; a cell's seeds give mean ± std
(sample std, ddof 1). "Optimisation speed" (paper Fig. 5) is the first fine-tuning step at which validation accuracy
exceeds chance (1 / classes) + 5 points ("never" if it does not within the budget), read at the run's evaluations
(every --eval-every epochs), so its resolution is the spacing of those.
Plots: val accuracy over fine-tuning steps (per task, setting and training-set size), test accuracy against the number
of training examples (where a cell was run at several sizes), and the kernel picture (paper Fig. 4) from kernels.json.
    python results/summarize.py                                   # results/study -> results/summary.md + results/*.png
    python results/summarize.py --runs results/explore --out results/explore --title "Exploratory runs"
The output depends only on the run folders (sorted, no dates), so running it twice gives identical files; summary.md
is the same whether or not matplotlib (optional, for the plots) is installed.
"""
import argparse
import json
import re
import statistics
import textwrap
from collections import defaultdict
from pathlib import Path

MARGIN = 0.05  # "left chance": val accuracy > chance + 5 points


def read_run(folder):
    """-> dict with the fields the summary needs, or None if the run has not finished (no results.json)."""
    if not (folder / "results.json").is_file():
        return None
    config = json.loads((folder / "config.json").read_text())
    results = json.loads((folder / "results.json").read_text())
    records = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines() if line.strip()]
    a, c = config["args"], config["config"]
    chance = 1 / config["head"]["n_classes"]
    curve = [(r["step"], r["val_acc"]) for r in records if r.get("phase") == "finetune"]  # [(step, val acc)]
    spt_records = [r for r in records if r.get("phase") == "spt"]
    n_train = results.get("n_train") or n_train_from_log(folder)
    # the setting leaves out the training-set size (its own column) and the epochs (the step budget says it all)
    setting = [f"{a['difficulty']}" if a["task"].startswith("path") else None,
               f"L ≤ {a['max_len']}" if a.get("max_len") else None,
               f"D{c['d_model']}x{c['n_layers']}", "causal" if a.get("causal") else None, f"lr {a['lr']:g}", f"batch {a['batch_size']}",
               f"{curve[-1][0]} steps" if curve else None, f"val/test {a['max_eval'] or 'all'}"]
    objective = f"mask {a['mask_ratio']:g}" if a.get("objective", "masked") == "masked" else a["objective"]
    spt = (f"SPT ({spt_records[-1]['step']} steps, {objective}, lr {a['pretrain_lr']:g})" if a["spt"] and spt_records
           else f"from {Path(a['init_from']).name}" if a.get("init_from") else "TFS")
    kernels = json.loads((folder / "kernels.json").read_text()) if (folder / "kernels.json").is_file() else None
    # model-specific knobs go with the model's name, so the models of one setting share its plots
    model = config["model_name"] + (f" (N{c['d_state']}, ssm lr {c['ssm_lr']:g})" if "d_state" in c else "")
    return dict(name=folder.name, model=model, task=config["task"], seed=a["seed"], spt=spt,
                setting=" · ".join(s for s in setting if s), n_train=n_train, chance=chance, curve=curve,
                test=results["test_acc"], best_val=results["best_val_acc"], params=results["params"],
                seconds=results["wall_time_s"]["total"], git=config.get("git", "?"), torch=config.get("torch", "?"),
                device=config.get("device", "?"), command="python " + " ".join(config.get("command", [])),
                spt_loss=(spt_records[0]["val_loss"], spt_records[-1]["val_loss"]) if spt_records else None,
                speed=next((step for step, acc in curve if acc > chance + MARGIN), None), kernels=kernels)


def n_train_from_log(folder):
    """Training examples of a run whose results.json predates its "n_train" entry: log.txt's "data: ..." line."""
    found = re.search(r"\| train ([\d,]+) /", (folder / "log.txt").read_text()) if (folder / "log.txt").is_file() else None
    if not found:
        raise SystemExit(f"summarize.py: {folder}: no n_train in results.json and no 'data: ... | train N /' line in log.txt")
    return int(found.group(1).replace(",", ""))


def mean_std(values, scale=100, digits=1):
    """'m ± s' (sample std) of values x scale; a single value has no std."""
    values = [v * scale for v in values]
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def cells_of(runs):
    """{(task, setting, n_train, model, spt): [runs sorted by seed]}, keys sorted (largest training set first, TFS
    before SPT)."""
    cells = defaultdict(list)
    for r in runs:
        cells[(r["task"], r["setting"], r["n_train"], r["model"], r["spt"])].append(r)
    order = sorted(cells, key=lambda k: (k[0], k[1], -k[2], k[3], k[4] != "TFS", k[4]))
    return {k: sorted(cells[k], key=lambda r: (r["seed"], r["name"])) for k in order}


# The paper's test accuracies (%, spec §4; Transformer TFS is the LRA paper's) for the tasks of the study. The paper
# gives DLR only as an average over tasks (≈77 TFS / 83.4 SPT), so its cells are "–".
PAPER = {"listops": {("transformer", "TFS"): 36.37, ("transformer", "SPT"): 61.49, ("s4", "TFS"): 59.60, ("s4", "SPT"): 61.25},
         "text": {("transformer", "TFS"): 64.27, ("transformer", "SPT"): 91.02, ("s4", "TFS"): 86.82, ("s4", "SPT"): 90.34},
         "pathfinder": {("transformer", "TFS"): 71.40, ("transformer", "SPT"): 94.16, ("s4", "TFS"): 94.20, ("s4", "SPT"): 94.92}}
GLANCE_COLUMNS = [(m, k) for m in ("transformer", "s4", "dlr") for k in ("TFS", "SPT")]


def glance(cells):
    """The compact table: a row per (task, setting, training examples) with test accuracy mean ± std (seeds) per model
    and TFS/SPT, each task followed by the paper's row. Where a group has several SPT variants (length, mask ratio),
    the one most models ran is in the main row and each other variant gets a row of its own. -> lines of markdown."""
    groups = defaultdict(lambda: defaultdict(dict))       # (task, setting, n) -> SPT label -> (model, "TFS"/"SPT") -> text
    for (task, setting, n_train, model, spt), rs in cells.items():
        kind = "TFS" if spt == "TFS" else "SPT"
        groups[(task, setting, n_train)][spt if kind == "SPT" else ""][(model.split()[0], kind)] = \
            f"{mean_std([r['test'] for r in rs])} (n={len(rs)})"
    header = "| task · setting · training examples | " + " | ".join(f"{m} {k}" for m, k in GLANCE_COLUMNS) + " |"
    rows = [header, "|---" * (len(GLANCE_COLUMNS) + 1) + "|"]
    row = lambda label, found: f"| {label} | " + " | ".join(found.get(c, "–") for c in GLANCE_COLUMNS) + " |"
    for task in sorted({key[0] for key in groups}):
        for key in sorted((k for k in groups if k[0] == task), key=lambda k: (k[1], -k[2])):
            variants = sorted((v for v in groups[key] if v), key=lambda v: (-len(groups[key][v]), v))
            label = f"{task} · {key[1]} · {key[2]:,}"
            rows.append(row(label, {**groups[key].get("", {}), **(groups[key][variants[0]] if variants else {})}))
            rows += [row(f"{label} · variant {v}", groups[key][v]) for v in variants[1:]]
        if task in PAPER:
            rows.append(row(f"{task}: paper (full LRA, GPU)", {c: f"{v:.2f}" for c, v in PAPER[task].items()}))
    return rows


def table(cells):
    """Every cell: one row per (task, setting, training examples, model, TFS/SPT variant). SPT rows also give
    SPT − TFS per seed: both runs of a seed share the initialisation and the batch order (train.py --seed)."""
    rows = ["| model | task | setting | train examples | SPT | seeds | test acc % | SPT − TFS per seed (points) | "
            "best val acc % | first step > chance + 5 (per seed) | SPT val loss first → last | params | wall time / run "
            "| git | hardware + torch |", "|---" * 15 + "|"]
    for (task, setting, n_train, model, spt), rs in cells.items():
        tfs = {r["seed"]: r["test"] for r in cells.get((task, setting, n_train, model, "TFS"), [])}
        gain = " / ".join(f"{(r['test'] - tfs[r['seed']]) * 100:+.1f}" for r in rs if r["seed"] in tfs) \
            if spt != "TFS" else ""
        speed = " / ".join(str(r["speed"]) if r["speed"] is not None else "never" for r in rs)
        spt_loss = " / ".join(f"{r['spt_loss'][0]:.3f} → {r['spt_loss'][1]:.3f}" for r in rs) if rs[0]["spt_loss"] else "—"
        wall = statistics.mean(r["seconds"] for r in rs)
        gits = ", ".join(sorted({r["git"] for r in rs}))
        hw = ", ".join(sorted({f"{r['device']} + torch {r['torch']}" for r in rs}))
        rows.append(f"| {model} | {task} | {setting} | {n_train:,} | {spt} | {', '.join(str(r['seed']) for r in rs)} | "
                    f"{mean_std([r['test'] for r in rs])} | {gain or '—'} | {mean_std([r['best_val'] for r in rs])} | {speed} | "
                    f"{spt_loss} | {rs[0]['params']:,} | {wall / 60:.1f} min | {gits} | {hw} |")
    return rows


def save(plt, fig, path, title, width, fontsize):
    """Title, layout, write (no software/date metadata, so the bytes depend on the data only) and close a figure."""
    fig.suptitle(textwrap.fill(title, width), fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def plot_curves(cells, out, plt):
    """One figure per (task, setting, training-set size): a panel per model, val accuracy over fine-tuning steps, TFS
    vs SPT, one thin line per seed and the seed mean bold (where the seeds share their evaluation steps).
    Draws only if plt (matplotlib.pyplot) is given; returns [(file name, caption)] either way."""
    groups = defaultdict(dict)
    for (task, setting, n_train, model, spt), rs in cells.items():
        groups[(task, setting, n_train)].setdefault(model, {})[spt] = rs
    files = []
    count = defaultdict(int)                                                # plots so far per task: file names
    for (task, setting, n_train), models in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2])):
        name, count[task] = f"val_acc_{task}_{count[task]}.png", count[task] + 1
        files.append((name, f"{task}, {n_train:,} training examples: {setting}"))
        if plt is None:
            continue
        fig, axes = plt.subplots(1, len(models), figsize=(max(5.5, 4.2 * len(models)), 3.8), squeeze=False, sharey=True)
        for ax, model in zip(axes[0], sorted(models)):
            variants = sorted(models[model].items(), key=lambda kv: (kv[0] != "TFS", -len(kv[1]), kv[0]))
            for k, (spt, rs) in enumerate(variants):        # TFS blue; SPT red, further SPT variants other colours
                color = ["tab:blue", "tab:red", "tab:orange", "tab:purple", "tab:green"][min(k, 4) if variants[0][0] == "TFS" else min(k + 1, 4)]
                style = dict(ls="-", marker="s", ms=5) if spt == "TFS" else dict(ls="--", marker="o", ms=3)
                for r in rs:
                    ax.plot(*zip(*r["curve"]), color=color, alpha=0.3, lw=0.8)
                steps = [s for s, _ in rs[0]["curve"]]
                if all([s for s, _ in r["curve"]] == steps for r in rs):
                    mean = [statistics.mean(r["curve"][j][1] for r in rs) for j in range(len(steps))]
                    ax.plot(steps, mean, color=color, lw=2, **style, label=f"{spt} (n={len(rs)})" if len(variants) > 2
                            else f"{spt.split(' (')[0]} (n={len(rs)})")
            ax.axhline(rs[0]["chance"], color="grey", ls=":", lw=1)
            ax.axhline(rs[0]["chance"] + MARGIN, color="grey", ls="--", lw=0.8)
            ax.set_title(f"{model} on {task}", fontsize=10)
            ax.set_xlabel("fine-tuning step")
            ax.legend(fontsize=8, loc="upper left")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("val accuracy")
        save(plt, fig, out / name, f"{n_train:,} training examples · {setting}  (bold: seed mean; thin: single seeds; "
                                 "dotted: chance; dashed: chance + 5)", 100, 8)
    return files


def plot_sizes(cells, out, plt):
    """Test accuracy against the number of training examples, TFS vs SPT, one panel per model, for each (task,
    setting) run at more than one training-set size (the paper's data-fraction study). -> [(file name, caption)]."""
    points = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # (task, setting) -> model -> spt -> [(n, acc)]
    for (task, setting, n_train, model, spt), rs in cells.items():
        points[(task, setting)][model][spt.split(" (")[0]] += [(n_train, r["test"]) for r in rs]
    files, count = [], defaultdict(int)
    for (task, setting), models in sorted(points.items()):
        models = {m: by for m, by in models.items() if len({n for pts in by.values() for n, _ in pts}) > 1}
        if not models:
            continue
        name, count[task] = f"train_size_{task}_{count[task]}.png", count[task] + 1
        files.append((name, f"{task}: test accuracy against training examples, {setting}"))
        if plt is None:
            continue
        fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.4), squeeze=False, sharey=True)
        for ax, model in zip(axes[0], sorted(models)):
            for spt, pts in sorted(models[model].items()):
                sizes = sorted({n for n, _ in pts})
                accs = [[a for n, a in pts if n == x] for x in sizes]
                ax.errorbar(sizes, [statistics.mean(a) for a in accs], [statistics.stdev(a) if len(a) > 1 else 0 for a in accs],
                            marker="o", capsize=3, label=spt, color="tab:blue" if spt == "TFS" else "tab:red")
            ax.set_xscale("log")
            ticks = sorted({n for pts in models[model].values() for n, _ in pts})
            ax.set_xticks(ticks, [f"{x:,}" for x in ticks])      # the sizes run, not log-scale tick clutter
            ax.minorticks_off()
            ax.set_xlabel("training examples")
            ax.set_title(f"{model} on {task}", fontsize=10)
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("test accuracy (mean ± std over seeds)")
        save(plt, fig, out / name, setting, 90, 7)
    return files


def plot_kernels(runs, out, plt):
    """The paper's Figure 4 per (task, setting): max over channels of |K[l]| against l, per S4/DLR layer (mean over
    seeds, log scale), at init, after SPT, after fine-tuning from SPT and after training from scratch; runs with
    kernels.json, the largest training set of each. -> [(file name, caption)]."""
    largest = defaultdict(int)
    for r in runs:
        if r["kernels"]:
            largest[(r["task"], r["setting"])] = max(largest[(r["task"], r["setting"])], r["n_train"])
    groups = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))   # (task, setting) -> model -> stage -> {seed: profile}
    for r in runs:
        if not r["kernels"] or r["n_train"] != largest[(r["task"], r["setting"])]:
            continue
        stages, spt, stage = r["kernels"]["stages"], r["kernels"]["spt"], groups[(r["task"], r["setting"])][r["model"]]
        stage["init"][r["seed"]] = stages["init"]                     # TFS and SPT runs of a seed share their init
        if spt:
            stage["after SPT"][r["seed"]] = stages["spt"]
        stage["fine-tuned from SPT" if spt else "trained from scratch"][r["seed"]] = stages["finetune"]
    files, colors = [], {"init": "grey", "after SPT": "tab:orange", "fine-tuned from SPT": "tab:red", "trained from scratch": "tab:blue"}
    count = defaultdict(int)
    for (task, setting), models in sorted(groups.items()):
        name, count[task] = f"kernels_{task}_{count[task]}.png", count[task] + 1
        files.append((name, f"{task}: max over channels of |K[l]| per layer (paper Fig. 4), {setting}"))
        if plt is None:
            continue
        n_layers = max(len(p) for stages in models.values() for by_seed in stages.values() for p in by_seed.values())
        fig, axes = plt.subplots(len(models), n_layers, figsize=(4 * n_layers, 2.9 * len(models)), squeeze=False)
        for row, model in zip(axes, sorted(models)):
            for j, ax in enumerate(row):
                for stage, color in colors.items():
                    profiles = [p[j] for _, p in sorted(models[model].get(stage, {}).items()) if j < len(p)]
                    if profiles:
                        curve = [statistics.mean(p[l] for p in profiles) for l in range(len(profiles[0]))]
                        ax.plot(curve, color=color, lw=1, label=f"{stage} (n={len(profiles)})")
                ax.set_yscale("log")
                ax.set_title(f"{model} on {task}, layer {j + 1}", fontsize=9)
                ax.set_xlabel("lag l")
                ax.grid(alpha=0.3)
            row[0].set_ylabel("max over channels |K[l]|")
        axes[0][-1].legend(fontsize=7)
        save(plt, fig, out / name, setting, 100, 7)
    return files


def main(argv=None):
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description="Rebuild summary.md and plots from train.py run folders.")
    p.add_argument("--runs", default=str(here / "study"), help="folder whose subfolders are run folders")
    p.add_argument("--out", default=str(here), help="where summary.md and the .png plots go")
    p.add_argument("--title", default="Results: self pre-training (SPT) vs training from scratch (TFS)", help="heading of summary.md")
    args = p.parse_args(argv)
    runs_dir, out = Path(args.runs), Path(args.out)
    if not runs_dir.is_dir():
        raise SystemExit(f"summarize.py: --runs {runs_dir}: no such folder (it should hold train.py run folders)")
    out.mkdir(parents=True, exist_ok=True)
    folders = sorted(f for f in runs_dir.iterdir() if (f / "config.json").is_file())
    runs = [r for r in map(read_run, folders) if r]
    unfinished = [f.name for f in folders if not (f / "results.json").is_file()]
    cells = cells_of(runs)
    for old in [*out.glob("val_acc_*.png"), *out.glob("data_fraction_*.png"), *out.glob("train_size_*.png"),
                *out.glob("kernels_*.png")]:                              # plots of an earlier set of runs
        old.unlink()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
        print("matplotlib is not installed: summary.md written, plots skipped (pip install matplotlib)")
    figures = plot_curves(cells, out, plt) + plot_sizes(cells, out, plt) + plot_kernels(runs, out, plt)
    lines = [f"# {args.title}", "",
             f"Generated by `python results/summarize.py --runs {runs_dir.name} ...` from {len(runs)} finished run folders "
             f"in `{runs_dir.name}/` (each: config.json with the command and commit, log.jsonl, log.txt, results.json). "
             "Test accuracy is that of the best-validation checkpoint. mean ± std over seeds (sample std). "
             f"'first step > chance + 5': the first fine-tuning step (val is measured at each evaluation) at which val accuracy "
             f"exceeded chance + {MARGIN * 100:.0f} points, per seed. Wall time: whole run (SPT + fine-tuning + test).", ""]
    lines += ["## At a glance: test accuracy %, mean ± std over seeds (n = seeds)", ""] + glance(cells) + [""]
    lines += ["## Every cell", ""] + table(cells) + [""]
    for name, caption in figures:
        lines += [f"![{caption}]({name})", ""]
    if unfinished:
        lines += ["Unfinished runs (no results.json: stopped before the end), not counted in the table:", ""]
        for u in unfinished:
            records = [json.loads(x) for x in (runs_dir / u / "log.jsonl").read_text().splitlines() if x.strip()] \
                if (runs_dir / u / "log.jsonl").is_file() else []
            last = next((r for r in reversed(records) if "val_acc" in r), None)
            seen = f"last eval: {last['phase']} epoch {last['epoch']}, step {last['step']}, val acc {last['val_acc'] * 100:.1f}%" \
                if last else "no evaluation logged"
            command = "python " + " ".join(json.loads((runs_dir / u / "config.json").read_text()).get("command", []))
            lines += [f"- `{u}`: {seen}  ", f"  `{command}`"]
        lines += [""]
    lines += ["## Runs and exact commands", ""]
    for r in sorted(runs, key=lambda r: r["name"]):
        lines += [f"- `{r['name']}`: test {r['test'] * 100:.1f}%, best val {r['best_val'] * 100:.1f}%, "
                  f"{r['seconds'] / 60:.1f} min, git {r['git']}  ", f"  `{r['command']}`"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'summary.md'} ({len(runs)} runs, {len(cells)} cells) and {len(figures) if plt else 0} plots")


if __name__ == "__main__":
    main()
