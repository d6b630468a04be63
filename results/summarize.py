"""summarize.py: rebuild results/summary.md and the plots from the run folders that train.py wrote.
Each run folder holds config.json (settings, command, commit), log.jsonl (one record per evaluation) and results.json
(test accuracy of the best-validation checkpoint). Runs are grouped into cells: model x task x setting x TFS/SPT; a
cell's seeds give mean ± std (sample std, ddof 1). "Optimisation speed" (paper Fig. 5) is the first fine-tuning step
at which validation accuracy exceeds chance + 5 points ("never" if it does not within the budget); val is measured
once per epoch, so it is a step at an epoch end.
    python results/summarize.py                                   # results/study -> results/summary.md + results/*.png
    python results/summarize.py --runs results/explore --out results/explore --title "Exploratory runs"
The output depends only on the run folders (sorted, no dates), so running it twice gives identical files.
"""
import argparse
import json
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
    setting = [f"{a['difficulty']}" if a["task"].startswith("path") else None,
               f"D{c['d_model']}x{c['n_layers']}", f"lr {a['lr']:g}", f"ssm lr {c['ssm_lr']:g}", f"batch {a['batch_size']}",
               f"train {a['max_train'] or 'all'}", f"frac {a['data_fraction']:g}" if a["data_fraction"] != 1 else None,
               f"{a['epochs']} ep", f"eval {a['max_eval'] or 'all'}"]
    spt = f"SPT ({a['pretrain_epochs']} ep, mask {a['mask_ratio']:g}, lr {a['pretrain_lr']:g})" if a["spt"] else "TFS"
    spt_records = [r for r in records if r.get("phase") == "spt"]
    return dict(name=folder.name, model=config["model_name"], task=config["task"], seed=a["seed"], spt=spt,
                setting=" · ".join(s for s in setting if s), fraction=a["data_fraction"], chance=chance, curve=curve,
                test=results["test_acc"], best_val=results["best_val_acc"], params=results["params"],
                seconds=results["wall_time_s"]["total"], git=config.get("git", "?"), torch=config.get("torch", "?"),
                device=config.get("device", "?"), command="python " + " ".join(config.get("command", [])),
                spt_loss=(spt_records[0]["val_loss"], spt_records[-1]["val_loss"]) if spt_records else None,
                speed=next((step for step, acc in curve if acc > chance + MARGIN), None))


def mean_std(values, scale=100, digits=1):
    """'m ± s' (sample std) of values x scale; a single value has no std."""
    values = [v * scale for v in values]
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def cells_of(runs):
    """{(task, setting, model, spt): [runs sorted by seed]}, keys sorted (TFS first)."""
    cells = defaultdict(list)
    for r in runs:
        cells[(r["task"], r["setting"], r["model"], r["spt"])].append(r)
    order = sorted(cells, key=lambda k: (k[0], k[1], k[2], k[3] != "TFS", k[3]))    # TFS row before its SPT rows
    return {k: sorted(cells[k], key=lambda r: (r["seed"], r["name"])) for k in order}


def table(cells):
    rows = ["| model | task | setting | SPT | seeds | test acc % | best val acc % | first step > chance + 5 (per seed) "
            "| SPT val loss first → last | params | wall time / run | git | hardware + torch |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (task, setting, model, spt), rs in cells.items():
        speed = " / ".join(str(r["speed"]) if r["speed"] is not None else "never" for r in rs)
        spt_loss = " / ".join(f"{r['spt_loss'][0]:.3f} → {r['spt_loss'][1]:.3f}" for r in rs) if rs[0]["spt_loss"] else "—"
        wall = statistics.mean(r["seconds"] for r in rs)
        gits = ", ".join(sorted({r["git"] for r in rs}))
        hw = ", ".join(sorted({f"{r['device']} + torch {r['torch']}" for r in rs}))
        rows.append(f"| {model} | {task} | {setting} | {spt} | {', '.join(str(r['seed']) for r in rs)} | "
                    f"{mean_std([r['test'] for r in rs])} | {mean_std([r['best_val'] for r in rs])} | {speed} | "
                    f"{spt_loss} | {rs[0]['params']:,} | {wall / 60:.1f} min | {gits} | {hw} |")
    return rows


def plot_curves(cells, out, plt):
    """One figure per (task, setting): a panel per model, val accuracy over fine-tuning steps, TFS vs SPT, one thin
    line per seed and the seed mean bold (where the seeds share their evaluation steps). -> list of file names."""
    groups = defaultdict(dict)
    for (task, setting, model, spt), rs in cells.items():
        groups[(task, setting)].setdefault(model, {})[spt] = rs
    files = []
    for i, ((task, setting), models) in enumerate(sorted(groups.items())):
        fig, axes = plt.subplots(1, len(models), figsize=(max(5.5, 4.2 * len(models)), 3.8), squeeze=False, sharey=True)
        for ax, model in zip(axes[0], sorted(models)):
            for spt, rs in sorted(models[model].items(), key=lambda kv: kv[0] != "TFS"):
                color, style = ("tab:blue", dict(ls="-", marker="s", ms=5)) if spt == "TFS" else ("tab:red", dict(ls="--", marker="o", ms=3))
                for r in rs:
                    ax.plot(*zip(*r["curve"]), color=color, alpha=0.3, lw=0.8)
                steps = [s for s, _ in rs[0]["curve"]]
                if all([s for s, _ in r["curve"]] == steps for r in rs):
                    mean = [statistics.mean(r["curve"][j][1] for r in rs) for j in range(len(steps))]
                    ax.plot(steps, mean, color=color, lw=2, **style, label=f"{spt.split(' (')[0]} (n={len(rs)})")
            ax.axhline(rs[0]["chance"], color="grey", ls=":", lw=1)
            ax.axhline(rs[0]["chance"] + MARGIN, color="grey", ls="--", lw=0.8)
            ax.set_title(f"{model} on {task}", fontsize=10)
            ax.set_ylim(min(0.4, ax.get_ylim()[0]), max(0.75, ax.get_ylim()[1]))
            ax.set_xlabel("fine-tuning step")
            ax.legend(fontsize=8, loc="upper left")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("val accuracy")
        fig.suptitle(textwrap.fill(setting + "  (dotted: chance; dashed: chance + 5)", 90), fontsize=8)
        fig.tight_layout()
        name = f"val_acc_{task}_{i}.png"
        fig.savefig(out / name, dpi=110, metadata={"Software": None})
        plt.close(fig)
        files.append((name, task, setting))
    return files


def plot_fractions(cells, out, plt):
    """Test accuracy vs data fraction, TFS vs SPT, per (task, model), if runs at more than one fraction exist."""
    points = defaultdict(lambda: defaultdict(list))     # (task, model, setting without frac) -> spt -> [(frac, acc)]
    for (task, setting, model, spt), rs in cells.items():
        base = " · ".join(s for s in setting.split(" · ") if not s.startswith("frac "))
        for r in rs:
            points[(task, model, base)][spt.split(" (")[0]].append((r["fraction"], r["test"]))
    files = []
    for i, ((task, model, base), by_spt) in enumerate(sorted(points.items())):
        if len({f for pts in by_spt.values() for f, _ in pts}) < 2:
            continue
        fig, ax = plt.subplots(figsize=(4.5, 3.4))
        for spt, pts in sorted(by_spt.items()):
            fracs = sorted({f for f, _ in pts})
            ax.errorbar(fracs, [statistics.mean(a for f, a in pts if f == x) for x in fracs],
                        [statistics.stdev(a) if len(a := [a for f, a in pts if f == x]) > 1 else 0 for x in fracs],
                        marker="o", capsize=3, label=spt, color="tab:blue" if spt == "TFS" else "tab:red")
        ax.set_xscale("log")
        ax.set_xlabel("fraction of the train split")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"{model} on {task}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.suptitle(textwrap.fill(base, 70), fontsize=7)
        fig.tight_layout()
        name = f"data_fraction_{task}_{model}_{i}.png"
        fig.savefig(out / name, dpi=110, metadata={"Software": None})
        plt.close(fig)
        files.append((name, task, base))
    return files


def main(argv=None):
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description="Rebuild summary.md and plots from train.py run folders.")
    p.add_argument("--runs", default=str(here / "study"), help="folder whose subfolders are run folders")
    p.add_argument("--out", default=str(here), help="where summary.md and the .png plots go")
    p.add_argument("--title", default="Results: self pre-training (SPT) vs training from scratch (TFS)", help="heading of summary.md")
    args = p.parse_args(argv)
    runs_dir, out = Path(args.runs), Path(args.out)
    folders = sorted(f for f in runs_dir.iterdir() if (f / "config.json").is_file())
    runs = [r for r in map(read_run, folders) if r]
    unfinished = [f.name for f in folders if not (f / "results.json").is_file()]
    cells = cells_of(runs)
    for old in [*out.glob("val_acc_*.png"), *out.glob("data_fraction_*.png")]:   # plots of an earlier set of runs
        old.unlink()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        figures = plot_curves(cells, out, plt) + plot_fractions(cells, out, plt)
    except ImportError:
        figures = None
    lines = [f"# {args.title}", "",
             f"Generated by `python results/summarize.py --runs {runs_dir.name} ...` from {len(runs)} finished run folders "
             f"in `{runs_dir.name}/` (each: config.json with the command and commit, log.jsonl, log.txt, results.json). "
             "Test accuracy is that of the best-validation checkpoint. mean ± std over seeds (sample std). "
             f"'first step > chance + 5': the first fine-tuning step (val is measured at epoch ends) at which val accuracy "
             f"exceeded chance + {MARGIN * 100:.0f} points, per seed. Wall time: whole run (SPT + fine-tuning + test).", ""]
    lines += table(cells) + [""]
    if figures is None:
        lines += ["(plots skipped: matplotlib is not installed)", ""]
    for name, task, setting in figures or []:
        lines += [f"![{task}: {setting}]({name})", ""]
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
    print(f"wrote {out / 'summary.md'} ({len(runs)} runs, {len(cells)} cells) and {len(figures or [])} plots")


if __name__ == "__main__":
    main()
