"""Facts about the study scripts in results/: the committed summary is exactly what summarize.py makes of the committed
run folders, and kernels.py's "init" profile is the model train.py really started from."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import lra_data
import train

RESULTS = Path(__file__).resolve().parent.parent / "results"


def script(name):
    spec = importlib.util.spec_from_file_location(name, RESULTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summarize_rebuilds_the_committed_summary_exactly(tmp_path):
    script("summarize").main(["--out", str(tmp_path)])
    assert (tmp_path / "summary.md").read_text() == (RESULTS / "summary.md").read_text(), \
        "results/summary.md is stale: rerun python results/summarize.py and commit it"


def test_summarize_draws_the_same_plots_twice(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (optional) draws the plots; summary.md does not need it")
    summarize = script("summarize")
    for out in ("a", "b"):
        (tmp_path / out).mkdir()
        summarize.main(["--out", str(tmp_path / out)])
    pngs = sorted(p.name for p in (tmp_path / "a").glob("*.png"))
    assert pngs and pngs == sorted(p.name for p in (tmp_path / "b").glob("*.png"))
    assert all((tmp_path / "a" / p).read_bytes() == (tmp_path / "b" / p).read_bytes() for p in pngs)
    listed = [line.split("](")[1].rstrip(")") for line in (tmp_path / "a" / "summary.md").read_text().splitlines()
              if line.startswith("![")]
    assert sorted(listed) == pngs, "summary.md links exactly the plots it drew"


@pytest.mark.parametrize("model", ["s4", "dlr"])
def test_kernel_profile_at_init_is_the_model_train_py_started_from(model, tmp_path, monkeypatch):
    """With the optimiser step disabled the weights never move, so the profiles after SPT and after fine-tuning (read
    from the checkpoints) must equal the init profile that kernels.py rebuilds from the seed alone."""
    lra_data.generate_listops(tmp_path / "data", 16, 8, 8, min_length=10, max_length=60)
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, closure=None: None)
    train.main(["--model", model, "--task", "listops", "--spt", "--preset", "tiny", "--seed", "3", "--d-model", "8",
                "--n-layers", "2", "--d-state", "8", "--batch-size", "16", "--max-eval", "8", "--epochs", "1",
                "--pretrain-epochs", "1", "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "runs")])
    script("kernels").main([str(tmp_path / "runs"), "--clean"])
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert not list(run_dir.glob("*.pt")), "--clean leaves no checkpoints"
    k = json.loads((run_dir / "kernels.json").read_text())
    L = lra_data.TASKS["listops"].max_len
    assert k["L"] == L and sorted(k["stages"]) == ["finetune", "init", "spt"]
    assert [len(p) for p in k["stages"]["init"]] == [L, L] and min(k["stages"]["init"][0]) > 0
    assert k["stages"]["spt"] == k["stages"]["init"] == k["stages"]["finetune"]


def test_readme_shows_the_at_a_glance_table_of_the_summary():
    summary = (RESULTS / "summary.md").read_text().split("## At a glance")[1].split("\n## ")[0]
    rows = [line for line in summary.splitlines() if line.startswith("| ")]
    readme = (RESULTS.parent / "README.md").read_text()
    assert len(rows) > 2 and all(row in readme for row in rows), "README's study table differs from results/summary.md"
