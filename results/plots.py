"""plots.py: the figures of results/summary.md (summarize.py calls these): val accuracy over fine-tuning steps, test
accuracy per arm, objective, training-set size and step budget, and the kernels. matplotlib is optional: summarize.py
passes plt = pyplot() (None without it, and no figure is drawn). Each figure is written without software or date
metadata, so its bytes depend on the run folders only.
"""
import statistics
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import checked  # noqa: E402  (outputs written whole, over our own files only)

COLORS = {"TFS": "tab:blue", "masked": "tab:red", "span": "tab:orange", "causal": "tab:purple", "rtd": "tab:green"}


def save(plt, fig, path, title, width, fontsize):
    """Title, layout, write (no software/date metadata, so the bytes depend on the data only) and close a figure."""
    fig.suptitle(textwrap.fill(title, width), fontsize=fontsize)
    fig.tight_layout()
    try:        # written whole, and only over a figure summarize.py wrote (tools/checked.py's manifest)
        checked.write_owned(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, metadata={"Software": None}),
                            "summarize.py")
    finally:
        plt.close(fig)


def seed_dots(ax, x, rs, color, half=0.25):
    """One dot per seed around x (spread a little, in seed order) and the seed mean as a bold line x ± half."""
    accs = [r["test"] for r in rs]
    ax.scatter([x + 0.3 * half * (j - (len(rs) - 1) / 2) for j in range(len(rs))], accs, color=color, s=14, zorder=3)
    ax.hlines(statistics.mean(accs), x - half, x + half, color=color, lw=2)


def plot_objectives(main, columns, names, models, path, plt):
    """Test accuracy per column (TFS, SPT objectives; names: their labels), a panel per model (in the order of
    models): a dot per seed, the seed mean a line."""
    fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models), 3.4), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models):
        for x, column in enumerate(columns):
            if column in main[model]:
                seed_dots(ax, x, main[model][column], COLORS.get(column[0], "grey"))
        ax.set_xticks(range(len(columns)), [n.replace("SPT ", "") for n in names], fontsize=8)
        ax.set_title(model, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    save(plt, fig, path, "test accuracy per SPT objective (dot: one seed; line: seed mean)", 100, 8)


def plot_budget(tied, T, models, path, plt):
    """The compute-tied slice: test accuracy against the SPT share of the T steps, a panel per model (in the order
    of models), a line per objective from the TFS runs (0 %) through its seed means, a dot per seed (objectives
    side by side)."""
    fig, axes = plt.subplots(1, len(models), figsize=(3.8 * len(models), 3.4), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models):
        lines = sorted(((column, by) for (m, column), by in tied.items() if m == model), key=lambda kv: kv[0])
        for k, (column, by) in enumerate(lines):
            color, shift = COLORS.get(column[0], "grey"), 2.5 * (k - (len(lines) - 1) / 2)
            points = [(0, T)] * bool(by[(0, T)]) + sorted(p for p in by if p[0] and by[p])
            x = [100 * s / T + shift * (s > 0) for s, _ in points]
            for xk, p in zip(x, points):
                seed_dots(ax, xk, by[p], COLORS["TFS"] if p[0] == 0 else color, half=1)
            ax.plot(x, [statistics.mean(r["test"] for r in by[p]) for p in points], color=color, lw=1,
                    label=" ".join(column).strip())
        ax.set_xlabel(f"SPT share of the {T:,} steps (%; 0: TFS)")
        ax.set_title(model, fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    save(plt, fig, path, "one step budget split between SPT and fine-tuning (dot: one seed; line: seed means)", 100, 8)


def plot_curves(cells, out, plt, margin, prefix=""):
    """One figure per (task, setting, training-set size): a panel per model, val accuracy over fine-tuning steps, TFS
    vs SPT, one thin line per seed and the seed mean bold (where the seeds share their evaluation steps).
    Draws only if plt (matplotlib.pyplot) is given; returns [(file name, caption)] either way."""
    groups = defaultdict(dict)
    for (task, setting, n_train, model, spt), rs in cells.items():
        groups[(task, setting, n_train)].setdefault(model, {})[spt] = rs
    files, count = [], defaultdict(int)                                    # plots so far per task: file names
    for (task, setting, n_train), models in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2])):
        name, count[task] = f"{prefix}val_acc_{task}_{count[task]}.png", count[task] + 1
        files.append((name, f"{task}, {n_train:,} training examples: {setting}"))
        if plt is None:
            continue
        fig, axes = plt.subplots(1, len(models), figsize=(max(5.5, 4.2 * len(models)), 3.8), squeeze=False,
                                 sharey=True)
        for ax, model in zip(axes[0], sorted(models)):
            variants = sorted(models[model].items(), key=lambda kv: (kv[0] != "TFS", -len(kv[1]), kv[0]))
            colors = ["tab:blue", "tab:red", "tab:orange", "tab:purple", "tab:green"][variants[0][0] != "TFS":]
            for k, (spt, rs) in enumerate(variants):        # TFS blue; SPT red, further SPT variants other colours
                style = dict(ls="-", marker="s", ms=5) if spt == "TFS" else dict(ls="--", marker="o", ms=3)
                for r in rs:
                    ax.plot(*zip(*r["curve"]), color=colors[min(k, len(colors) - 1)], alpha=0.3, lw=0.8)
                steps = [s for s, _ in rs[0]["curve"]]
                if all([s for s, _ in r["curve"]] == steps for r in rs):
                    mean = [statistics.mean(r["curve"][j][1] for r in rs) for j in range(len(steps))]
                    label = spt if len(variants) > 2 else spt.split(" (")[0]
                    ax.plot(steps, mean, color=colors[min(k, len(colors) - 1)], lw=2, **style,
                            label=f"{label} (n={len(rs)})")
            ax.axhline(rs[0]["chance"], color="grey", ls=":", lw=1)
            ax.axhline(rs[0]["chance"] + margin, color="grey", ls="--", lw=0.8)
            ax.set_title(f"{model} on {task}", fontsize=10)
            ax.set_xlabel("fine-tuning step")
            ax.legend(fontsize=8, loc="upper left")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("val accuracy")
        save(plt, fig, out / name, f"{n_train:,} training examples · {setting}  (bold: seed mean; thin: single seeds; "
                                   "dotted: chance; dashed: chance + 5)", 100, 8)
    return files


def plot_sizes(cells, out, plt, prefix=""):
    """Test accuracy against the number of training examples, TFS vs SPT, one panel per model, for each (task,
    setting) run at more than one training-set size (the paper's data-fraction study). -> [(file name, caption)]."""
    points = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # (task, setting) -> model -> spt -> (n, acc)
    for (task, setting, n_train, model, spt), rs in cells.items():
        points[(task, setting)][model][spt.split(" (")[0]] += [(n_train, r["test"]) for r in rs]
    files, count = [], defaultdict(int)
    for (task, setting), models in sorted(points.items()):
        models = {m: by for m, by in models.items() if len({n for pts in by.values() for n, _ in pts}) > 1}
        if not models:
            continue
        name, count[task] = f"{prefix}train_size_{task}_{count[task]}.png", count[task] + 1
        files.append((name, f"{task}: test accuracy against training examples, {setting}"))
        if plt is None:
            continue
        fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.4), squeeze=False, sharey=True)
        for ax, model in zip(axes[0], sorted(models)):
            for spt, pts in sorted(models[model].items()):
                sizes = sorted({n for n, _ in pts})
                accs = [[a for n, a in pts if n == x] for x in sizes]
                ax.errorbar(sizes, [statistics.mean(a) for a in accs],
                            [statistics.stdev(a) if len(a) > 1 else 0 for a in accs],
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


def plot_kernels(runs, out, plt, prefix=""):
    """The paper's Figure 4 per (task, setting): max over channels of |K[l]| against l, per S4/DLR layer (mean over
    seeds, log scale), at init, after SPT, after fine-tuning from SPT and after training from scratch; runs with
    kernels.json, the largest training set of each. -> [(file name, caption)]."""
    largest = defaultdict(int)
    for r in runs:
        if r["kernels"]:
            largest[(r["task"], r["setting"])] = max(largest[(r["task"], r["setting"])], r["n_train"])
    groups = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))  # (task, setting) -> model -> stage -> seed
    for r in runs:
        if not r["kernels"] or r["n_train"] != largest[(r["task"], r["setting"])]:
            continue
        stages, spt, stage = r["kernels"]["stages"], r["kernels"]["spt"], groups[(r["task"], r["setting"])][r["model"]]
        stage["init"][r["seed"]] = stages["init"]                     # TFS and SPT runs of a seed share their init
        if spt:
            stage["after SPT"][r["seed"]] = stages["spt"]
        stage["fine-tuned from SPT" if spt else "trained from scratch"][r["seed"]] = stages["finetune"]
    colors = {"init": "grey", "after SPT": "tab:orange", "fine-tuned from SPT": "tab:red",
              "trained from scratch": "tab:blue"}
    files, count = [], defaultdict(int)
    for (task, setting), models in sorted(groups.items()):
        name, count[task] = f"{prefix}kernels_{task}_{count[task]}.png", count[task] + 1
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


def plot_control(cells, arms, path, plt):
    """Test accuracy per arm (in the order of arms), a panel per model: a dot per seed, the seed mean a line."""
    fig, axes = plt.subplots(1, len(cells), figsize=(3.4 * len(cells), 3.4), squeeze=False, sharey=True)
    colors = {"TFS": "tab:blue", "TFS-long": "tab:purple", "SPT": "tab:red"}
    for ax, (model, cell) in zip(axes[0], cells.items()):
        for x, arm in enumerate(arms):
            if cell.get(arm):
                seed_dots(ax, x, list(cell[arm].values()), colors[arm])
        ax.set_xticks(range(len(arms)), arms, fontsize=8)
        ax.set_title(model, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    save(plt, fig, path, "test accuracy: TFS, TFS-long (as many steps as SPT + fine-tuning), SPT", 100, 8)


def pyplot():
    """matplotlib.pyplot on the file-only backend, or None: matplotlib is optional, summary.md does not need it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: summary.md written, plots skipped (pip install matplotlib)")
        return None
    return plt
