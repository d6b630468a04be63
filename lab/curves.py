"""lab/curves.py: the curves of train.py runs from their log.jsonl: train and val loss and accuracy (R² on Image)
over optimiser steps, SPT and fine-tuning side by side, several runs overlaid.
    python lab/curves.py runs/<run folder>                 # -> runs/<run folder>/curves.png
    python lab/curves.py runs/A runs/B --out cmp.png       # A and B overlaid in one figure
train.py draws curves.png at the end of every run when matplotlib is installed (--no-curves: not), and says in one
line when it is not. matplotlib is optional (pip install matplotlib). Check: tests/test_curves.py (the figure's
lines hold log.jsonl's values).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the repo: python lab/curves.py from anywhere
from tools import checked  # noqa: E402  (log.jsonl's records; outputs over our own files only)

PHASES = ("spt", "finetune")


def read_records(run_dir):
    """The evaluation records of <run_dir>/log.jsonl, in order (a line a kill cut short is skipped).
    Raises FileNotFoundError naming the file when the folder has none."""
    path = Path(run_dir) / "log.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (is {run_dir} a train.py run folder?)")
    return [r for r in checked.read_records(path, "check the run folder") if r.get("phase") in PHASES and "step" in r]


def pyplot():
    """matplotlib.pyplot on the file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def draw(run_dirs, out, plt):
    """One figure: a column per phase that any run has (SPT, fine-tuning), a row for the loss and one for the
    accuracy (R² where the records have it); per run one colour, val solid with dots, train dashed. Written to out
    (no date metadata). Returns what its lines hold, read back from the figure:
    [(panel title, line label, steps, values)]."""
    runs = [(Path(d).name, read_records(d)) for d in run_dirs]
    phases = [p for p in PHASES if any(r["phase"] == p for _, recs in runs for r in recs)] or ["finetune"]
    fig, axes = plt.subplots(2, len(phases), figsize=(5.2 * len(phases), 6.4), squeeze=False)
    for j, phase in enumerate(phases):
        for i, kind in enumerate(("loss", "acc")):
            ax = axes[i][j]
            for k, (name, recs) in enumerate(runs):
                rows = [r for r in recs if r["phase"] == phase]
                metric = "r2" if rows and "val_r2" in rows[0] else "acc"
                key = kind if kind == "loss" else metric
                for split, style in (("val", "-o"), ("train", "--")):
                    points = [(r["step"], r[f"{split}_{key}"]) for r in rows if f"{split}_{key}" in r]
                    if points:
                        ax.plot(*zip(*points), style, color=f"C{k % 10}", ms=3, lw=1.2,
                                label=f"{name} {split}" if len(runs) > 1 else split)
            what = {"spt": "SPT (denoising)", "finetune": "fine-tuning"}[phase]
            ax.set_title(f"{what}: {'loss' if kind == 'loss' else 'accuracy / R²'}", fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=6 if len(runs) > 1 else 7)
    fig.tight_layout()
    # over a file of our own only (a user's file of that name stays), whole or not at all
    checked.write_owned(out, lambda tmp: fig.savefig(tmp, format="png", dpi=100, metadata={"Software": None}),
                        "curves.py")
    held = [(ax.get_title(), line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
            for ax in fig.axes for line in ax.lines]
    plt.close(fig)
    return held


def after_run(folder, log):
    """train.py, at the end of a run (rank 0): draw <folder>/curves.png, or say in one line why not. log(line)
    prints and keeps the line (runs.log)."""
    plt = pyplot()
    if plt is None:
        log("note: no curves.png: matplotlib is not installed (pip install matplotlib; then python "
            f"lab/curves.py {folder})")
        return
    try:
        draw([folder], Path(folder) / "curves.png", plt)
    except (KeyboardInterrupt, Exception) as e:        # the run is saved already: a figure is no reason
        log(f"note: no curves.png ({type(e).__name__}: {e}); python lab/curves.py {folder} draws it")
        return
    log(f"curves: {Path(folder) / 'curves.png'}")


def main(argv=None):
    p = argparse.ArgumentParser(description="Draw the train/val curves of train.py run folders.")
    p.add_argument("run_dirs", nargs="+", help="run folders (each holds a log.jsonl)")
    p.add_argument("--out", default=None, help="one figure of all runs overlaid (default: each folder's "
                                               "curves.png)")
    args = p.parse_args(argv)
    plt = pyplot()
    if plt is None:
        print("curves.py: error: matplotlib is not installed: pip install matplotlib", file=sys.stderr)
        return 2
    try:
        figures = [(args.run_dirs, args.out)] if args.out else [([d], Path(d) / "curves.png") for d in args.run_dirs]
        for run_dirs, out in figures:
            draw(run_dirs, out, plt)
            print(out)
    except (FileNotFoundError, checked.Damaged, checked.NotOwned) as e:
        print(f"curves.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
