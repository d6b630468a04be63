"""Facts about the study scripts in results/: the committed summary is exactly what summarize.py makes of the committed
run folders, studies never share a cell, the objectives tables pair SPT and TFS by seed, and kernels.py's "init"
profile is the model train.py really started from."""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import lra_data
from lra.listops import generate_listops
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
    generate_listops(tmp_path / "data", 16, 8, 8, min_length=10, max_length=60)
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


def test_the_control_studys_readme_shows_the_tables_of_the_summary_and_the_readme_its_numbers():
    summary = (RESULTS / "summary.md").read_text()
    control = summary.split("## SPT vs training from scratch")[1].split("### Every cell")[0]
    rows = [line for line in control.splitlines() if line.startswith("| ")]
    readme = (RESULTS / "control" / "README.md").read_text()
    missing = [row for row in rows if row not in readme]
    assert len(rows) > 4 and not missing, f"results/control/README.md's tables differ from results/summary.md: {missing}"
    front = (RESULTS.parent / "README.md").read_text()
    row = next(line for line in front.splitlines() if line.startswith("| [`results/control/`]"))
    for model, cell in (("dlr", "+5.1 [+3.6, +6.7]"), ("s4", "+6.1 [+3.0, +9.2]"), ("transformer", "-0.1 [-0.9, +0.8]")):
        shown = next(line for line in rows if line.startswith(f"| {model}") and "| SPT − TFS-long |" in line)
        assert cell in shown and cell.replace("-", "−") in row, (model, cell, shown, row)


def fake_run(study, name, test, seed=0, objective=None, spt_steps=0, ft_steps=20):
    """A finished run folder with just what summarize.py reads (a text run, 64 training examples)."""
    (study / name).mkdir(parents=True)
    args = dict(task="text", difficulty="hard", max_len=128, causal=False, lr=0.002, batch_size=16, max_eval=32,
                seed=seed, spt=objective is not None, objective=objective or "masked", mask_ratio=0.15, span_mean=3.0,
                gen_width=8, gen_layers=1, rtd_weight=50.0, gdes=True, pretrain_lr=0.002, init_from=None)
    config = dict(model_name="transformer", task="text", args=args, config=dict(d_model=16, n_layers=1),
                  head=dict(n_classes=2), git="abc1234", torch="2.x", device="cpu", command=["train.py", name])
    records = [dict(phase="spt", epoch=1, step=spt_steps, val_loss=2.0 + seed, val_acc=0.3)] if objective else []
    records.append(dict(phase="finetune", epoch=1, step=ft_steps, val_loss=0.69, val_acc=0.6))
    results = dict(test_acc=test, best_val_acc=0.6, params=1000, n_train=64,
                   wall_time_s=dict(spt=60.0 if objective else 0.0, finetune=60.0 if objective else 120.0, total=120.0))
    (study / name / "config.json").write_text(json.dumps(config))
    (study / name / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (study / name / "results.json").write_text(json.dumps(results))


def rows_of(summary, label):
    """The table rows of (part of) summary.md that start with '| label |', split into their cells."""
    return [[cell.strip() for cell in line.strip(" |").split(" | ")][1:] for line in summary.splitlines()
            if line.startswith(f"| {label} |")]


def objectives_part(summary):
    """The objectives tables of summary.md, without the every-cell table that follows them."""
    return summary.split("## SPT objectives")[1].split("### Every cell")[0]


def two_studies(tmp_path):
    """old/: TFS and masked SPT (seeds 0, 1); new/: the same settings again with other accuracies, plus rtd."""
    for seed in (0, 1):
        fake_run(tmp_path / "old", f"tfs-s{seed}", 0.60 + 0.02 * seed, seed)
        fake_run(tmp_path / "old", f"spt-s{seed}", 0.64 + 0.02 * seed, seed, "masked", 12)
        fake_run(tmp_path / "new", f"tfs-s{seed}", 0.70 + 0.02 * seed, seed)
        fake_run(tmp_path / "new", f"masked-s{seed}", 0.74 + 0.02 * seed, seed, "masked", 12)
        fake_run(tmp_path / "new", f"rtd-s{seed}", 0.80 + 0.02 * seed, seed, "rtd", 12)


def test_runs_of_different_studies_never_share_a_cell(tmp_path):
    two_studies(tmp_path)
    script("summarize").main(["--runs", str(tmp_path / "old"), str(tmp_path / "new"), "--out", str(tmp_path / "out")])
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "(n=4)" not in summary and "0, 1, 0, 1" not in summary, "two studies' seeds were pooled into one cell"
    assert rows_of(summary, "text · L ≤ 128 · D16x1 · lr 0.002 · batch 16 · 20 steps · val/test 32 · 64")[0][:2] \
        == ["61.0 ± 1.4 (n=2)", "65.0 ± 1.4 (n=2)"], "old/'s glance row is not old/'s runs alone"
    assert rows_of(objectives_part(summary), "transformer")[0] == ["71.0 ± 1.4 (n=2)", "75.0 ± 1.4 (n=2)",
                                                                   "81.0 ± 1.4 (n=2)"], "new/'s TFS, masked, rtd"
    assert "## SPT objectives (`new/`)" in summary and "- `old/tfs-s0`" in summary and "- `new/tfs-s0`" in summary


def test_a_study_reads_the_same_alone_and_beside_another(tmp_path):
    """Adding a study changes the header and the run list, never a line of the other study's sections."""
    two_studies(tmp_path)
    summarize = script("summarize")
    summarize.main(["--runs", str(tmp_path / "old"), "--out", str(tmp_path / "alone")])
    summarize.main(["--runs", str(tmp_path / "old"), str(tmp_path / "new"), "--out", str(tmp_path / "both")])
    alone = (tmp_path / "alone" / "summary.md").read_text().split("\n## At a glance")[1].split("\n## Runs and")[0]
    both = (tmp_path / "both" / "summary.md").read_text().split("\n## At a glance")[1].split("\n## SPT objectives")[0]
    assert alone == both, "the first study's tables differ once a second study is summarised with it"


def test_objectives_table_pairs_spt_and_tfs_by_seed(tmp_path):
    for seed, tfs, masked in [(0, 0.50, 0.55), (1, 0.60, 0.58), (2, 0.70, 0.75)]:
        fake_run(tmp_path / "runs", f"z-tfs-s{seed}", tfs, seed)
        fake_run(tmp_path / "runs", f"y-masked-s{seed}", masked, seed, "masked", 12)
    fake_run(tmp_path / "runs", "a-rtd-s2", 0.71, 2, "rtd", 12)      # names sort against the seeds; seed 0 missing
    fake_run(tmp_path / "runs", "b-rtd-s1", 0.62, 1, "rtd", 12)
    script("summarize").main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    summary = objectives_part((tmp_path / "out" / "summary.md").read_text())
    assert "| model | TFS | SPT masked | SPT rtd |" in summary
    assert rows_of(summary, "transformer: SPT − TFS per seed") == [["—", "+5.0 / -2.0 / +5.0 → +2.7 [-7.4, +12.7]", "+2.0 / +1.0 → +1.5 [-4.9, +7.9]"]], \
        "SPT − TFS must subtract the TFS run of the same seed, in seed order"
    assert rows_of(summary, "transformer")[1] == ["— · 2.0 min", "3.000 ± 1.000 · 2.0 min (SPT 1.0)",
                                                  "3.500 ± 0.707 · 2.0 min (SPT 1.0)"], "SPT val loss, wall time"


def test_a_resumed_runs_wall_time_is_the_sum_of_its_phases(tmp_path):
    fake_run(tmp_path / "runs", "tfs-s0", 0.60)
    fake_run(tmp_path / "runs", "masked-s0", 0.62, 0, "masked", 12)
    fake_run(tmp_path / "runs", "rtd-s0", 0.61, 0, "rtd", 12)
    results = tmp_path / "runs" / "masked-s0" / "results.json"          # resumed in fine-tuning at an older commit:
    wall = dict(spt=60.0, finetune=90.0, test=30.0, total=6.0)           # "total" was the last session's 6 s only
    results.write_text(json.dumps(dict(json.loads(results.read_text()), wall_time_s=wall)))
    script("summarize").main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    summary = objectives_part((tmp_path / "out" / "summary.md").read_text())
    assert rows_of(summary, "transformer")[1][1] == "2.000 · 3.0 min (SPT 1.0)", \
        "wall time must add up the phases (data, spt, finetune, test), not trust 'total'"


def test_compute_tied_slice_reads_the_tfs_runs_as_its_zero_share(tmp_path):
    for seed in (0, 1):
        fake_run(tmp_path / "runs", f"tfs-s{seed}", 0.60 + 0.02 * seed, seed)
        fake_run(tmp_path / "runs", f"spt-s{seed}", 0.70, seed, "masked", 12)                 # 12 + 20 steps: on top
        fake_run(tmp_path / "runs", f"tied40-s{seed}", 0.64 + 0.02 * seed, seed, "masked", 8, 12)
        fake_run(tmp_path / "runs", f"tied60-s{seed}", 0.66, seed, "masked", 12, 8)
    script("summarize").main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    summary = objectives_part((tmp_path / "out" / "summary.md").read_text())
    assert "| model · objective | 0 % SPT (0 + 20 steps) = TFS | 40 % SPT (8 + 12 steps) | 60 % SPT (12 + 8 steps) |" \
        in summary
    assert rows_of(summary, "transformer · masked") == [["61.0 ± 1.4 (n=2)", "65.0 ± 1.4 (n=2)", "66.0 ± 0.0 (n=2)"]]
    assert rows_of(summary, "transformer")[0] == ["61.0 ± 1.4 (n=2)", "70.0 ± 0.0 (n=2)"], \
        "the main table holds only the runs with the TFS runs' fine-tuning steps"


def test_objectives_summary_is_the_same_without_matplotlib_and_its_plots_the_same_twice(tmp_path, monkeypatch):
    two_studies(tmp_path)
    summarize, runs = script("summarize"), ["--runs", str(tmp_path / "old"), str(tmp_path / "new")]
    if importlib.util.find_spec("matplotlib"):
        for out in ("a", "b"):
            summarize.main(runs + ["--out", str(tmp_path / out)])
        pngs = sorted(p.name for p in (tmp_path / "a").glob("*.png"))
        assert "objectives_text.png" in pngs and all(
            (tmp_path / "a" / p).read_bytes() == (tmp_path / "b" / p).read_bytes() for p in pngs), "plots differ"
        linked = [line.split("](")[1].rstrip(")") for line in (tmp_path / "a" / "summary.md").read_text().splitlines()
                  if line.startswith("![")]
        assert sorted(linked) == pngs, "summary.md links exactly the plots it drew"
    monkeypatch.setitem(sys.modules, "matplotlib", None)                    # import matplotlib now fails
    summarize.main(runs + ["--out", str(tmp_path / "c")])
    assert not list((tmp_path / "c").glob("*.png"))
    if (tmp_path / "a").is_dir():
        assert (tmp_path / "c" / "summary.md").read_text() == (tmp_path / "a" / "summary.md").read_text(), \
            "summary.md depends on whether matplotlib is installed"


def control_folder(out, name, arm_args, *files):
    """A DLR seed-0 run folder of the control study as train.py leaves it: config.json's args, empty `files`."""
    (out / name).mkdir(parents=True)
    args = {"model": "dlr", "seed": 0, "spt": False, "epochs": 9, "pretrain_epochs": 3, **arm_args}
    (out / name / "config.json").write_text(json.dumps({"args": args}))
    for f in files:
        (out / name / f).write_text("")


def test_the_control_driver_skips_finished_runs_resumes_stopped_ones_and_restarts_those_with_no_evaluation(
        tmp_path, monkeypatch):
    control = script("control")
    out = tmp_path / "control"
    control_folder(out, "text-dlr-tfs-s0-a", {}, "last.pt", "results.json")      # TFS: finished
    control_folder(out, "text-dlr-tfs-s0-b", {"epochs": 12}, "last.pt")          # TFS-long: stopped after an evaluation
    control_folder(out, "text-dlr-spt-s0-c", {"spt": True})                      # SPT: stopped before its first one
    calls = []
    monkeypatch.setattr(control, "run_one", lambda cmd, f, log: calls.append((cmd, f)) or 0)
    assert control.main(["--models", "dlr", "--seeds", "0", "--finetune-epochs", "9", "--jobs", "1",
                         "--out", str(out), "--console", str(tmp_path / "console")]) == 0
    assert [f.name if f else "--spt" in cmd for cmd, f in calls] == ["text-dlr-tfs-s0-b", True], calls
    assert not (out / "text-dlr-spt-s0-c").exists() and not (out / "text-dlr-tfs-s0-a" / "last.pt").exists()


def test_the_control_driver_leaves_alone_a_run_another_train_py_is_running(tmp_path, monkeypatch, capsys):
    fcntl = pytest.importorskip("fcntl", reason="file locks are POSIX (fcntl)")
    control = script("control")
    out = tmp_path / "control"
    control_folder(out, "text-dlr-tfs-s0-a", {})                                 # neither has last.pt
    control_folder(out, "text-dlr-spt-s0-b", {"spt": True})
    calls = []
    monkeypatch.setattr(control, "run_one", lambda cmd, f, log: calls.append((cmd, f)) or 0)
    with open(out / "text-dlr-spt-s0-b" / ".lock", "a") as held:         # as a first driver's train.py holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        assert control.main(["--models", "dlr", "--seeds", "0", "--finetune-epochs", "9", "--jobs", "1",
                             "--arms", "tfs", "spt", "--out", str(out), "--console", str(tmp_path / "console")]) == 0
    assert (out / "text-dlr-spt-s0-b" / "config.json").is_file(), "the driver deleted a run another one is running"
    assert not (out / "text-dlr-tfs-s0-a").exists(), "the unlocked run stopped before its first evaluation was kept"
    assert (out / "stopped" / "text-dlr-tfs-s0-a" / "config.json").is_file(), "it was deleted, not set aside"
    assert [("--spt" in cmd, f) for cmd, f in calls] == [(False, None)], calls
    assert "text-dlr-spt-s0-b: being run by another train.py" in capsys.readouterr().out


# ---- the statistics behind the claims (results/stats.py) and the control study's tables ---------------------------

def test_t_quantiles_intervals_and_exact_mcnemar_equal_hand_computations():
    stats = script("stats")
    assert [stats.t975(df) for df in (1, 2, 5, 7, 30)] == [12.7062, 4.3027, 2.5706, 2.3646, 2.0423]  # a t table
    assert abs(stats.t975(60) - 2.000) < 1e-3 and abs(stats.t975(120) - 1.980) < 1e-3
    mean, low, high = stats.interval([2.0, 4.0, 6.0])            # mean 4, s = 2, half = 4.3027 · 2 / √3
    assert mean == 4.0 and abs(high - 4.0 - 4.3027 * 2 / 3 ** 0.5) < 1e-12 and abs(low + high - 8.0) < 1e-12
    truth = "0" * 20
    a, b = "0" * 10 + "1" + "0" * 9, "1" * 9 + "0" * 11     # only a right: 9 reviews; only b right: 1
    assert stats.mcnemar(a, b, truth) == (9, 1, 2 * 11 / 2 ** 10)   # 2 · (C(10,0) + C(10,1)) / 2^10
    assert stats.mcnemar(a, a, truth)[2] == 1.0 and stats.binomial_tail(3, 3) == 1.0
    d = stats.paired({0: (0.62, 0.60), 1: (0.64, 0.60), 2: (0.66, 0.60)})
    assert d["diffs"] == pytest.approx([2.0, 4.0, 6.0]) and d["mean"] == pytest.approx(4.0) and d["n"] == 3


def test_t_p_values_holm_and_power_equal_tables_and_r():
    stats = script("stats")
    for df in (1, 2, 5, 10, 30):                                   # the table's 0.975 quantiles give p = 0.05
        assert stats.t_pvalue(stats.T975[df - 1], df) == pytest.approx(0.05, abs=2e-5)
    assert stats.t_pvalue(0.0, 4) == pytest.approx(1.0) and stats.t_quantile(0.975, 5) == pytest.approx(2.5706, 1e-4)
    assert stats.t_pvalue(1.0, 1) == pytest.approx(0.5, abs=1e-12)     # Cauchy: P(|T| > 1) = 1/2
    t, p = stats.paired_test([2.0, 4.0, 6.0])                      # t = 4 / (2 / √3)
    assert t == pytest.approx(2 * 3 ** 0.5) and 0.05 < p < 0.1
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])   # 3p, 2p -> max, ..., 4p
    # R: power.t.test(n = 20, delta = 1) = 0.8689528 (two-sample: df 38, ncp √10, the upper tail only)
    c = stats.t_quantile(0.975, 38)
    assert stats.noncentral_t_sf(c, 38, 10 ** 0.5) == pytest.approx(0.8689528, abs=1e-7)
    assert stats.power_paired_t(0.0, 1.0, 6) == pytest.approx(0.05, abs=1e-6), "no effect: power = α"
    d = stats.detectable_difference(1.0, 6)                        # 80 % power, n = 6: about 1.43 σ
    assert stats.power_paired_t(d, 1.0, 6) == pytest.approx(0.8, abs=1e-6) and 1.4 < d < 1.45


def control_run(model, seed, kind, ft_steps, test, predictions, spt_steps=0):
    """One run as read_run gives it, enough for control_section."""
    return dict(name=f"{model}-{kind}-{ft_steps}-s{seed}", model=model, task="text", seed=seed, kind=kind,
                spt=("SPT (750 steps, mask 0.15, lr 0.002)" if kind == "SPT" else "TFS"), objective="masked",
                recipe="", setting="s", base="L ≤ 512 · D64x2", spt_steps=spt_steps, ft_steps=ft_steps,
                n_train=4000, chance=0.5, curve=[(ft_steps, 0.6)], test=test, best_val=0.6, params=1,
                seconds=60.0, spt_seconds=0.0, git="abc", torch="2", device="cpu", command="python train.py",
                kernels=None, spt_loss=(2.0, 1.5) if kind == "SPT" else None,   # an SPT run's val loss: first, last
                spt_best=1.5 if kind == "SPT" else None, speed=None, best_epoch=2, last_epoch=2 + (kind == "SPT"),
                predictions=dict(labels="0" * 20, index_sha1="x", predictions=predictions))


def test_the_control_table_gives_each_pair_of_arms_its_interval_and_mcnemar_tests(tmp_path):
    summarize = script("summarize")
    runs = []
    for seed, (tfs, long, spt) in enumerate([(0.60, 0.61, 0.62), (0.60, 0.60, 0.64), (0.60, 0.62, 0.66)]):
        runs += [control_run("dlr", seed, "TFS", 1250, tfs, "1" * 9 + "0" * 11),
                 control_run("dlr", seed, "TFS", 2000, long, "1" * 9 + "0" * 11),
                 control_run("dlr", seed, "SPT", 1250, spt, "0" * 20, spt_steps=750)]
    lines, _ = summarize.control_section(runs, tmp_path, None, "control")
    row = next(line for line in lines if line.startswith("| dlr | SPT − TFS |"))
    assert "+2.0 / +4.0 / +6.0" in row and "+4.0 [-1.0, +9.0]" in row, row      # hand: 4 ± 4.3027 · 2 / √3
    assert "0.0039 / 0.0039 / 0.0039 (3 of 3 < 0.05)" in row, row               # 9 vs 0: 2 / 2^9
    assert any(line.startswith("| dlr | 60.0 [60.0, 60.0] (n=3)") for line in lines), lines
    assert any("TFS 3 of 3" in line and "SPT 0 of 3" in line for line in lines), "runs ending at their last eval"
    assert any("lowest SPT validation loss is at their last SPT epoch (still improving when cut): 3 of 3" in line
               for line in lines), "SPT phases still improving when pre-training stopped"


def test_the_summary_reads_a_log_with_a_line_a_cut_write_left(tmp_path):
    # a kill mid-record leaves '{"phase": "fine'; the resumed run ends that line and logs the evaluation whole
    log = tmp_path / "log.jsonl"
    log.write_text('{"phase": "finetune", "epoch": 1}\n{"phase": "fine\n{"phase": "finetune", "epoch": 2}\n')
    assert script("summarize").read_records(log) == [{"phase": "finetune", "epoch": 1},
                                                     {"phase": "finetune", "epoch": 2}]


def test_a_tiny_run_writes_its_test_predictions_and_the_summary_reads_them_back(tmp_path):
    generate_listops(tmp_path / "data", 16, 8, 8, min_length=10, max_length=60)
    results = train.main(["--model", "dlr", "--task", "listops", "--preset", "tiny", "--d-model", "8", "--n-layers",
                          "1", "--d-state", "8", "--batch-size", "16", "--epochs", "1", "--data-dir",
                          str(tmp_path / "data"), "--out", str(tmp_path / "runs")])
    folder = Path(results["run_dir"])
    run = script("summarize").read_run(folder)
    p = run["predictions"]
    assert p["n"] == len(p["labels"]) == len(p["predictions"]) == 8, p
    correct = sum(x == y for x, y in zip(p["predictions"], p["labels"])) / p["n"]
    assert abs(correct - results["test_acc"]) < 1e-12, "the predictions do not give the run's test accuracy"


# ---- the why-SPT study's driver (results/why_spt.py) ----------------------------------------------------------------

def why_folder(out, name, cmd, cpu, *files, best_val=None):
    """A run folder as train.py leaves it, with just what the driver reads: config.json's command and machine."""
    (out / name).mkdir(parents=True)
    (out / name / "config.json").write_text(json.dumps(dict(command=cmd, machine=dict(cpu=cpu),
                                                            model_name="dlr")))
    for f in files:
        (out / name / f).write_text("")
    if best_val is not None:
        (out / name / "results.json").write_text(json.dumps(dict(best_val_acc=best_val)))


def test_the_why_spt_driver_skips_resumes_restarts_reuses_and_keys_a_run_by_its_flags_and_cpu_model(tmp_path):
    why = script("why_spt")
    args = type("Args", (), dict(setting=["--preset", "tiny"], data_dir="d", cache_dir="c", out=tmp_path / "why"))
    cmd = lambda seed, *flags: why.command("transformer", seed, list(flags), args)   # noqa: E731
    out, control = tmp_path / "why", tmp_path / "control"
    why_folder(out, "done-s0", cmd(0, "--epochs", "9"), "AMD EPYC", "results.json")             # finished
    why_folder(out, "cut-s0", cmd(0, "--spt", "--epochs", "9"), "AMD EPYC", "last.pt")          # resumable
    why_folder(out, "early-s0", cmd(0, "--pos", "none", "--epochs", "9"), "AMD EPYC")           # no evaluation yet
    why_folder(out, "noted-s0", cmd(0, "--pos", "learned", "--epochs", "9"), "AMD EPYC", "notes.txt")   # the user's
    why_folder(out, "intel-s1", cmd(1, "--epochs", "9"), "Intel Xeon", "results.json")          # finished elsewhere
    why_folder(control, "ctl-s2", cmd(2, "--epochs", "9"), "AMD EPYC", "results.json", "best.pt")  # reusable here
    why_folder(control, "ctl-s2-later", cmd(2, "--epochs", "9"), "Intel Xeon", "results.json")  # same flags, Intel
    why_folder(control, "ctl-s3", cmd(3, "--epochs", "9"), "Intel Xeon", "results.json")        # other CPU: rerun
    jobs = [("done", cmd(0, "--epochs", "9")), ("cut", cmd(0, "--spt", "--epochs", "9")),
            ("early", cmd(0, "--pos", "none", "--epochs", "9")), ("noted", cmd(0, "--pos", "learned", "--epochs", "9")),
            ("s1", cmd(1, "--spt", "--epochs", "9")),
            ("s1-intel", cmd(1, "--epochs", "9")), ("s2", cmd(2, "--epochs", "9")), ("s3", cmd(3, "--epochs", "9")),
            ("s4-s1", why.command("s4", 1, ["--epochs", "9"], args))]
    said = []
    dry = why.plan(jobs, out, "AMD EPYC", control, dry=True, log=said.append)
    assert (out / "early-s0").is_dir() and not (out / "ctl-s2").exists(), "a dry run changed the disk"
    todo = why.plan(jobs, out, "AMD EPYC", control, log=said.append)
    # a seed whose other runs ran on an Intel Xeon runs here too, and so does a flag set finished only there
    assert [(n, f.name if f else None) for n, _, f in todo] == [("cut", "cut-s0"), ("early", None), ("noted", None),
                                                             ("s1", None),
                                                             ("s1-intel", None), ("s3", None), ("s4-s1", None)]
    assert [n for n, _, _ in dry] == [n for n, _, _ in todo]
    assert not (out / "early-s0").exists(), "a run stopped before its first evaluation is started again"
    assert "notes.txt" in os.listdir(out / "stopped" / "noted-s0"), "a user's file in a stopped run folder was deleted"
    assert json.loads((out / "ctl-s2" / "reused.json").read_text())["reused_from"].endswith("ctl-s2")
    assert not (out / "ctl-s2" / "best.pt").exists(), "a reused run brings no checkpoint"
    assert not (out / "ctl-s2-later").exists(), "the reused run is this CPU model's, not the later folder"
    # the pilot's and the plateau's runs pair with nothing: a finished one counts on any CPU model
    assert why.plan([("s1-intel", cmd(1, "--epochs", "9"))], out, "AMD EPYC", None, any_cpu=True) == []


def test_the_why_spt_pilot_chooses_the_best_validation_accuracy_per_model(tmp_path):
    why = script("why_spt")
    args = type("Args", (), dict(setting=["--preset", "tiny"], data_dir="d", cache_dir="c", out=tmp_path))
    for model, accs in (("s4", [0.70, 0.72, 0.71, 0.72]), ("dlr", [0.80, 0.79, 0.78, 0.77])):
        for (dropout, schedule), acc in zip(why.GRID, accs):
            cmd = why.command(model, why.PILOT_SEED, why.grid_flags(dropout, schedule) + ["--epochs", "9"], args)
            why_folder(tmp_path, f"{model}-{dropout}-{schedule}-s100-x", cmd, "AMD EPYC", best_val=acc)
    choice, missing = why.pilot_choice(tmp_path, ["s4", "dlr"])
    assert not missing and choice == {"s4": ("0", "cosine"), "dlr": ("0", "constant")}, choice   # s4: a tie, earlier
    assert json.loads((tmp_path / "choice.json").read_text())["choice"]["s4"] == dict(dropout="0", schedule="cosine")
    flags = why.arms(9, choice)["c"]
    assert flags["dlr"]["tfs-tuned"] == ["--epochs", "9"], "the control's settings give the control's flags"
    assert flags["s4"]["spt-tuned"] == ["--schedule", "cosine", "--spt", "--pretrain-epochs", "3", "--epochs", "9"]


def test_the_why_spt_driver_runs_a_miniature_cell_b_keeping_the_transformers_checkpoints(tmp_path):
    why = script("why_spt")
    generate_listops(tmp_path, 200, 40, 40, min_length=30, max_length=200)
    setting = ["--preset", "tiny", "--task", "listops", "--d-model", "16", "--n-layers", "1", "--batch-size", "16",
               "--max-train", "16", "--max-eval", "8", "--lr", "5e-3", "--pretrain-lr", "3e-2", "--device", "cpu"]
    argv = ["--cells", "b", "--arms", "conv-rot", "conv-sin", "--seeds", "0", "--finetune-epochs", "1", "--setting", " ".join(setting), "--data-dir",
            str(tmp_path), "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "why"), "--reuse-from", "",
            "--console", str(tmp_path / "console"), "--nice", "0"]
    assert why.main(argv) == 0
    runs = sorted((tmp_path / "why").glob("listops-*"))
    assert len(runs) == 2, runs
    for folder in runs:
        assert {p.name for p in folder.glob("*.pt")} == {"best.pt", "spt.pt"}, "keep best.pt and spt.pt, no last.pt"
        results = json.loads((folder / "results.json").read_text())
        assert results["spt_stopped_early"] or results["spt_epochs"] == 15, results
        assert set(json.loads((folder / "attention.json").read_text())["checkpoints"]) == {"spt.pt", "best.pt"}
        assert json.loads((folder / "config.json").read_text())["machine"]["cpu"]
    assert (tmp_path / "why" / "attention_b.png").stat().st_size > 1000, "cell b's attention plot"
    assert why.main(argv) == 0 and sorted((tmp_path / "why").glob("listops-*")) == runs, "a second call reruns nothing"


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file locks (fcntl)")
def test_the_why_spt_finish_pass_leaves_a_run_folder_another_process_holds_locked(tmp_path):
    """Two drivers on one --out: the second's finish pass neither deletes the checkpoints nor starts a second
    attention pass of a run the first one (or a train.py) holds locked; a free folder it finishes."""
    import fcntl
    why, study = script("why_spt"), tmp_path / "why_spt"
    for name in ("held", "free"):
        fake_run(study, name, 0.6)
        (study / name / "last.pt").write_bytes(b"a checkpoint")
    with open(study / "held" / ".lock", "a") as f:                     # another open file: flock treats it apart
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        why.finish(study, 19)
        assert (study / "held" / "last.pt").is_file(), "a checkpoint deleted under the process that holds the run"
    assert not (study / "free" / "last.pt").exists(), "a free finished run keeps a checkpoint the study does not"
    why.finish(study, 19)
    assert not (study / "held" / "last.pt").exists(), "released, the run is finished"


def test_the_why_spt_tables_pair_arms_by_seed_and_adjust_the_primary_contrasts(tmp_path):
    why, study = script("why_spt"), tmp_path / "why_spt"
    args = type("Args", (), dict(setting=["--preset", "tiny"], data_dir="d", cache_dir="c", out=study))
    accs = {"tfs-sin": [0.60, 0.61, 0.62], "spt-sin": [0.64, 0.66, 0.65], "tfs-rot": [0.60, 0.60, 0.60],
            "spt-rot": [0.60, 0.61, 0.60]}
    for arm, by_seed in accs.items():
        for seed, acc in enumerate(by_seed):
            name = f"text-transformer-{arm}-s{seed}-x"
            fake_run(study, name, acc, seed, "masked" if arm.startswith("spt") else None, 12)
            config = json.loads((study / name / "config.json").read_text())
            config.update(command=why.command("transformer", seed, why.arms(9)["a"]["transformer"][arm], args),
                          machine=dict(cpu="AMD EPYC"))
            (study / name / "config.json").write_text(json.dumps(config))
    script("summarize").main(["--runs", str(study), "--out", str(tmp_path / "out")])
    summary = (tmp_path / "out" / "summary.md").read_text()
    cell = rows_of(summary, "transformer spt-sin")[0]
    assert cell[:3] == ["3", "0, 1, 2", "65.0 [62.5, 67.5]"] and cell[-2:] == ["AMD EPYC", "0"], cell
    c1, c2, c3 = (rows_of(summary, name)[0] for name in ("C1 sinusoidal: SPT − TFS",
                                                         "C2 position × SPT: (SPT − TFS) sinusoidal − (SPT − TFS) rotary",
                                                         "C3 rotary: SPT to the 15-epoch cap − TFS"))
    assert c1[:3] == ["3", "+4.0 / +5.0 / +3.0", "+4.0 [+1.5, +6.5]"], c1     # 4 ± 4.3027 · 1 / √3
    assert c2[:2] == ["3", "+4.0 / +4.0 / +3.0"] and c3[:2] == ["0", "–"], (c2, c3)
    stats = script("stats")
    p1, p2 = stats.paired_test([4.0, 5.0, 3.0])[1], stats.paired_test([4.0, 4.0, 3.0])[1]
    assert c1[4] == f"{p1:.3g} (Holm {stats.holm([p1, p2])[0]:.3g})", c1  # Holm over the two that ran


def test_every_why_spt_contrast_takes_a_seeds_terms_from_one_cpu_model(tmp_path):
    """tfs-rot ran on two CPU models (seeds 0-2 on both); conv-rot on the AMD for seeds 0 and 1, on the Intel for
    seed 2; spt-rot on the AMD only. Each seed's difference takes its terms from one CPU model: C3 pairs seed 2's
    Intel conv-rot with the Intel tfs-rot, never with the AMD one; where both hold every term, the seed's home (the
    CPU model with most of its runs) wins; the machine effect is tfs-rot's Intel − AMD per seed."""
    why, study = script("why_spt"), tmp_path / "why_spt"
    args = type("Args", (), dict(setting=["--preset", "tiny"], data_dir="d", cache_dir="c", out=study))
    runs = {("tfs-rot", "AMD EPYC"): [0.60, 0.61, 0.62], ("tfs-rot", "Intel Xeon"): [0.50, 0.52, 0.54],
            ("conv-rot", "AMD EPYC"): [0.64, 0.66, None], ("conv-rot", "Intel Xeon"): [None, None, 0.59],
            ("spt-rot", "AMD EPYC"): [0.63, 0.63, 0.63]}
    for (arm, cpu), by_seed in runs.items():
        for seed, acc in enumerate(by_seed):
            if acc is None:
                continue
            name = f"text-transformer-{arm}-{cpu.split()[0]}-s{seed}-x"
            fake_run(study, name, acc, seed, "masked" if arm != "tfs-rot" else None, 12)
            config = json.loads((study / name / "config.json").read_text())
            flags = {**why.arms(9)["a"]["transformer"], **why.arms(9)["b"]["transformer"]}[arm]
            config.update(command=why.command("transformer", seed, flags, args), machine=dict(cpu=cpu))
            (study / name / "config.json").write_text(json.dumps(config))
    tables = script("why_spt_tables")
    cells = tables.study_cells(study, [r for r in map(script("summarize").read_run, sorted(study.iterdir())) if r])
    c3 = dict(tables.PRIMARY)["C3 rotary: SPT to the 15-epoch cap − TFS"]
    assert {s: (round(d, 6), c) for s, (d, c) in tables.contrast(cells, c3).items()} == {
        0: (4.0, "AMD EPYC"), 1: (5.0, "AMD EPYC"), 2: (5.0, "Intel Xeon")}
    rotary = dict(tables.SECONDARY)["rotary: SPT − TFS (the control's arms)"]
    assert {s: c for s, (_, c) in tables.contrast(cells, rotary).items()} == dict.fromkeys((0, 1, 2), "AMD EPYC")
    assert set(tables.contrast(cells, c3, "Intel Xeon")) == {2}, "per CPU model: only that model's pairs"
    script("summarize").main(["--runs", str(study), "--out", str(tmp_path / "out")])
    summary = (tmp_path / "out" / "summary.md").read_text()
    row = rows_of(summary, "C3 rotary: SPT to the 15-epoch cap − TFS")[0]
    assert row[:3] == ["3", "+4.0 / +5.0 / +5.0", "+4.7 [+3.2, +6.1]"] and row[-1] == "AMD × 2, Intel × 1", row
    per_cpu = {r[0]: r[1:] for r in rows_of(summary, "C3 rotary: SPT to the 15-epoch cap − TFS")[1:]}
    assert per_cpu == {"AMD EPYC": ["2", "+4.0 / +5.0", "+4.5 [-1.9, +10.9]"], "Intel Xeon": ["1", "+5.0", "+5.0"]}
    machine = rows_of(summary, "transformer tfs-rot")
    assert ["Intel − AMD", "3", "0, 1, 2", "-10.0 / -9.0 / -8.0", "-9.0 [-11.5, -6.5]"] in machine, machine
    assert [r[5] for r in machine if len(r) == 7] == ["AMD EPYC", "Intel Xeon"], "a row per arm and CPU model"


def test_the_unigram_loss_of_two_equally_frequent_tokens_is_ln_2_and_smoothing_keeps_unseen_ones_finite():
    import numpy as np
    unigram = script("unigram")
    assert unigram.unigram_loss(np.array([0, 0, 5, 5])) == pytest.approx(np.log(2), rel=1e-12)
    # q = (1/2, 1/2) under p = (1/4, 3/4): −(ln 1/4 + ln 3/4) / 2
    assert unigram.unigram_loss(np.array([1, 3]), np.array([2, 2])) == pytest.approx(-(np.log(.25) + np.log(.75)) / 2)
    with pytest.raises(ValueError, match="never saw|no probability"):
        unigram.unigram_loss(np.array([4, 0]), np.array([1, 1]))
    # add-one: p = (4 + 1, 0 + 1) / 6
    assert unigram.unigram_loss(np.array([4, 0]), np.array([1, 1]), smoothing=1.0) == pytest.approx(
        -(np.log(5 / 6) + np.log(1 / 6)) / 2)


def test_the_committed_unigram_losses_are_the_ones_the_study_data_gives_and_the_write_ups_cite(shared_data, tmp_path):
    """results/why_spt/unigram.json is recomputed from the real IMDB data with the study run's own settings (a fresh
    cache under tmp_path), and both write-ups cite its numbers as rounded there."""
    unigram = script("unigram")
    committed = json.loads((RESULTS / "why_spt" / "unigram.json").read_text())
    run = RESULTS / "why_spt" / committed["run"]
    config = json.loads((run / "config.json").read_text())
    config["args"].update(data_dir=str(shared_data / "text"), cache_dir=str(tmp_path / "cache"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    unigram.main([str(tmp_path / "run"), "--out", str(tmp_path / "unigram.json")])
    fresh = json.loads((tmp_path / "unigram.json").read_text())
    assert {k: v for k, v in fresh.items() if k != "run"} == {k: v for k, v in committed.items() if k != "run"}
    cited = {RESULTS / "why_spt" / "README.md": ("entropy_train_nats", "cross_entropy_val_nats"),
             RESULTS.parent / "README.md": ("cross_entropy_val_nats",)}
    for doc, keys in cited.items():
        for key in keys:
            assert f"{committed[key]:.2f} nats" in doc.read_text(), f"{doc} does not cite {key} as {committed[key]:.2f} nats"


def test_the_context_free_loss_of_a_pixel_task_counts_every_grey_level_pixels_have_no_pad_or_eos():
    import numpy as np
    unigram = script("unigram")
    pixels = [(torch.tensor([0, 2, 2, 5], dtype=torch.uint8), 0), (torch.tensor([0, 1, 2, 5], dtype=torch.uint8), 1)]
    counts = unigram.content_counts(pixels, "pathfinder")            # grey levels 0 and 2 are pixels, not PAD / EOS
    assert counts.tolist() == [2, 1, 3, 0, 0, 2], counts
    tokens = [(torch.tensor([7, 9, 2, 0]), 0)]                        # ids, then EOS (2) and PAD (0)
    assert unigram.content_counts(tokens, "text").tolist()[7:] == [1, 0, 1], "a token task drops PAD and EOS"
    assert unigram.unigram_loss(counts) == pytest.approx(-sum(c / 8 * np.log(c / 8) for c in (2, 1, 3, 2)))


def test_unigram_writes_only_where_asked_and_never_over_a_file_of_the_users(tmp_path, capsys):
    unigram = script("unigram")
    mine = tmp_path / "mine.json"
    mine.write_text("the user's notes")
    with pytest.raises(SystemExit) as e:
        unigram.main([str(tmp_path), "--out", str(mine)])
    assert e.value.code == 2 and "mine.json exists and unigram.py did not write it" in capsys.readouterr().err
    assert mine.read_text() == "the user's notes"


@pytest.mark.parametrize("config", ["{", '{"command": ["my_notes.py"]}'], ids=["damaged", "foreign"])
def test_the_why_spt_driver_names_a_damaged_or_foreign_folder_in_its_out_in_one_line_and_touches_nothing(
        config, tmp_path, capsys):
    why = script("why_spt")
    folder = tmp_path / "text-dlr-tfs-s0-mine"
    folder.mkdir()
    (folder / "config.json").write_text(config)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        why.folders(tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("why_spt.py: error: ") and str(folder) in err[0], err
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "notes.txt"]
    assert (folder / "config.json").read_text() == config


def test_the_spt_length_figure_is_written_whole_and_never_over_a_users_file(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot", reason="matplotlib (optional) draws the figure")
    tables = script("why_spt_tables")
    run = lambda test, epochs: {"AMD EPYC": {"test": test, "spt_epochs_run": epochs}}
    cells = {("transformer", "tfs-rot"): {3: run(0.6, None)}, ("transformer", "spt-rot"): {3: run(0.62, 3)},
             ("transformer", "conv-rot"): {3: run(0.64, 15)}, ("transformer", "conv40-rot"): {3: run(0.65, 22)}}
    tables.plot_length(cells, tmp_path / "spt_length.png", plt)
    first = (tmp_path / "spt_length.png").read_bytes()
    tables.plot_length(cells, tmp_path / "spt_length.png", plt)          # its own file: rewritten, the same bytes
    assert (tmp_path / "spt_length.png").read_bytes() == first and first.startswith(b"\x89PNG")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "spt_length.png").write_text("the user's")
    with pytest.raises(Exception, match="left untouched"):
        tables.plot_length(cells, tmp_path / "mine" / "spt_length.png", plt)
    assert (tmp_path / "mine" / "spt_length.png").read_text() == "the user's"
    assert not list(tmp_path.rglob("*.tmp"))


def why_spt_numbers(text):
    """The numbers a write-up prints, as written (− read as -): dates, code spans, parentheses naming a file and
    names with digits (C3, s4, 2e-3, 65da599) are not numbers of the study."""
    import re
    text = re.sub(r"\d{4}-\d{2}-\d{2}|`[^`]*`", " ", text.replace("−", "-"))
    return [m.group() for m in re.finditer(r"(?<![\w.\-])[+\-]?\d+(?:\.\d+)?(?![\w])", text)]


def test_every_number_of_the_why_spt_results_is_in_summary_md_or_a_file_it_cites():
    import re
    readme = (RESULTS / "why_spt" / "README.md").read_text()
    start = readme.index("\n## Results (")
    section = readme[start:readme.index("\n## ", start + 1)]
    summary = (RESULTS / "summary.md").read_text()
    why = summary[summary.index("## Why SPT"):summary.index("\n## ", summary.index("## Why SPT"))]
    earlier = readme[start + len(section):]                     # the interim look and first results, dated, below it
    known = {t.lstrip("+-") for t in why_spt_numbers(why + earlier)}  # not the plan above: its numbers are no results
    number = re.compile(r":\s*(-?\d+\.\d+(?:e-?\d+)?)")
    files = [float(v) for f in ("unigram.json", "pilot/choice.json")               # cited by name: any rounding
             for v in number.findall((RESULTS / "why_spt" / f).read_text())]
    logs = [float(v) for f in [*(RESULTS / "why_spt").glob("*/log.jsonl"), *(RESULTS / "why_spt").glob("*/*/log.jsonl")]
            for v in number.findall(f.read_text())]                              # a loss as the log prints it: 4 places
    missing = []
    for token in why_spt_numbers(section):
        digits = len(token.split(".")[1]) if "." in token else 0
        bare = token.lstrip("+-")
        if bare in known or any(f"{v * scale:.{digits}f}" == bare for v in files for scale in (1, 100)) \
                or digits >= 4 and any(f"{v:.{digits}f}" == bare for v in logs):
            continue
        missing.append(token)
    assert not missing, f"numbers of results/why_spt/README.md's Results found nowhere it cites: {missing}"
