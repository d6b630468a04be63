"""Facts about lab/curves.py: the figure a run draws at its end holds exactly log.jsonl's evaluations (the lines are
read back from the figure), SPT and fine-tuning side by side; several runs overlay in one figure; without matplotlib
a run says so in one line and still finishes."""
import builtins
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, records
from lra.listops import generate_listops
from lab import curves

NEEDS = "the curves need it: pip install matplotlib"
DRAW = [f for f in TINY if f != "--no-curves"]
FLAGS = ["--model", "dlr", "--task", "listops", "--spt", "--pretrain-epochs", "2", "--epochs", "3"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    generate_listops(root, 30, 6, 6, min_length=30, max_length=120)
    return root


def tiny_run(data_dir, out, *flags):
    import train
    results = train.main(["--data-dir", str(data_dir), "--out", str(out), *DRAW, *flags])
    return Path(results["run_dir"])


def test_a_runs_curves_png_holds_exactly_its_logged_evaluations(data_dir, tmp_path):
    pytest.importorskip("matplotlib", reason=NEEDS)
    run_dir = tiny_run(data_dir, tmp_path, *FLAGS)
    png = run_dir / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"curves: {png}" in (run_dir / "log.txt").read_text()
    held = curves.draw([run_dir], tmp_path / "again.png", curves.pyplot())     # the same figure, its lines read back
    lines = {(title, label): (x, y) for title, label, x, y in held}
    recs = records(run_dir)
    for phase, title in (("spt", "SPT (denoising)"), ("finetune", "fine-tuning")):
        rows = [r for r in recs if r["phase"] == phase]
        assert len(rows) == {"spt": 2, "finetune": 3}[phase]
        for split in ("train", "val"):
            for kind, panel in (("loss", "loss"), ("acc", "accuracy / R²")):
                x, y = lines[f"{title}: {panel}", split]
                assert x == [r["step"] for r in rows], f"{phase} {split} {kind}: steps {x}"
                assert y == [r[f"{split}_{kind}"] for r in rows], f"{phase} {split} {kind}: values {y}"
    assert len(held) == 8, [h[:2] for h in held]


def test_two_runs_overlay_in_one_figure_from_the_command_line(data_dir, tmp_path):
    pytest.importorskip("matplotlib", reason=NEEDS)
    a = tiny_run(data_dir, tmp_path / "a", "--model", "dlr", "--task", "listops", "--epochs", "2", "--no-curves")
    b = tiny_run(data_dir, tmp_path / "b", "--model", "s4", "--task", "listops", "--epochs", "2", "--no-curves")
    held = curves.draw([a, b], tmp_path / "both.png", curves.pyplot())
    labels = {label for _, label, _, _ in held}
    assert labels == {f"{d.name} {s}" for d in (a, b) for s in ("train", "val")}, labels
    assert [t for t, _, _, _ in held if "SPT" in t] == [], "a run without SPT drew an SPT panel"
    done = subprocess.run([sys.executable, "lab/curves.py", str(a), str(b), "--out", str(tmp_path / "cli.png")],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and (tmp_path / "cli.png").stat().st_size > 0, done.stderr
    missing = subprocess.run([sys.executable, "lab/curves.py", str(tmp_path)], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert missing.returncode == 2 and "log.jsonl: no such file" in missing.stderr, missing.stderr


def test_without_matplotlib_a_run_says_so_in_one_line_and_finishes(data_dir, tmp_path, monkeypatch):
    real = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    run_dir = tiny_run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--epochs", "1")
    log = (run_dir / "log.txt").read_text()
    assert (run_dir / "results.json").is_file() and not (run_dir / "curves.png").exists()
    assert sum("matplotlib is not installed (pip install matplotlib" in line for line in log.splitlines()) == 1, log


def test_curves_never_replace_a_file_of_the_users_and_redraw_their_own(tmp_path):
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "log.jsonl").write_text('{"phase": "finetune", "epoch": 1, "step": 5, "train_loss": 0.7, "train_acc": '
                                       '0.5, "val_loss": 0.69, "val_acc": 0.52}\n')
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"the user's own figure")
    cli = [sys.executable, "lab/curves.py", str(run_dir)]
    here = Path(__file__).resolve().parents[1]
    done = subprocess.run([*cli, "--out", str(mine)], cwd=here, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "mine.png exists and was not written by curves.py" in done.stderr, done.stderr
    assert mine.read_bytes() == b"the user's own figure", "a file of the user's was replaced"
    for _ in range(2):                                                  # a resumed run redraws its own figure
        done = subprocess.run(cli, cwd=here, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and (run_dir / "curves.png").stat().st_size > 1000, done.stderr
    (run_dir / "curves.png").unlink()
    (run_dir / "curves.png").write_bytes(b"a figure of the user's, in the run folder")
    checked_manifest = run_dir / ".outputs"
    checked_manifest.unlink()                                           # no longer ours
    done = subprocess.run(cli, cwd=here, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and (run_dir / "curves.png").read_bytes().startswith(b"a figure of the user"), done
