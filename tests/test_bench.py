"""Facts about tools/bench.py: a tiny run writes every field with finite numbers and the machine's load; an exponent needs
three lengths. The memory estimate's facts: tests/test_memory.py; the GPU check's: tests/test_gpu_check.py."""
import json
import math

import pytest

from tools import bench
from tools import speed

TINY = ["--lengths", "64", "128", "256", "--max-tokens", "512", "--batch", "2", "--d-model", "16", "--d-state", "8",
        "--dlr-state", "32", "--n-heads", "2", "--train-batch", "1", "--min-time", "0", "--max-reps", "1",
        "--fit-from", "64", "--no-kernel-precision"]
# the training step of S4's tiny preset alone takes seconds (the NPLR kernel's N×N powers), so the smoke run skips
# the training steps (--presets with no names) and one test times DLR's tiny step on its own


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_tiny_run_writes_json_and_table_with_finite_numbers_and_the_machine_load(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(TINY + ["--presets", "--out", str(out)])
    res = json.loads(out.read_text())
    assert finite(res["matmul_gflops"]) and finite(res["seconds"]), "matmul GFLOP/s and run time must be positive"
    machine = res["machine"]
    assert {"cpu", "cores", "torch_threads", "omp_num_threads", "load", "torch", "commit"} <= set(machine), machine
    assert len(machine["load"]) == 3 and machine["torch_threads"] >= 1, f"load (1, 5, 15 min) and threads: {machine}"
    assert {(r["model"], r["L"]) for r in res["layers"]} == {(m, L) for m in speed.LAYERS for L in (64, 128, 256)}
    for r in res["layers"]:
        assert math.isfinite(r["load"]) and finite(r["est_mib"]), f"every row stores the load and the estimate: {r}"
        if r["model"] == "transformer-local":
            assert "n/a" in r["skipped"], "block-local below one block must say n/a, not be timed"
            continue
        assert "skipped" not in r, f"tiny configuration skipped: {r}"
        assert all(finite(r[k]) for k in ("seconds", "tokens_per_s", "peak_mib", "base_mib")), f"non-finite: {r}"
        if r["model"] != "transformer-full":
            assert finite(r["kernel_seconds"]), f"SSM kernel time missing: {r}"
    dlr = [r for r in res["layers"] if r["model"] == "dlr"]
    assert all(finite(r["kernel_gflops"]) and finite(r["matmul_gflops"]) for r in dlr), "DLR kernel GFLOP/s missing"
    for name, fit in res["exponents"].items():
        assert (fit["p"] is None) == (name == "transformer-local"), f"3 lengths at B = 2 must give p: {name} {fit}"
    text = out.with_suffix(".md").read_text()
    assert "| layer | L | B |" in text and "load average" in text, "markdown tables (with the load) not written"
    assert "target" not in text.lower(), "the tool measures; judging the numbers belongs in the README"


def test_training_step_of_a_train_py_preset_reports_tokens_per_second():
    row = speed.train_step("dlr", "tiny", bench.parse_args(TINY))
    assert (row["B"], row["L"]) == (1, 1024) and finite(row["tokens_per_s"]), f"bad training-step row: {row}"


def test_fitted_exponent_recovers_a_known_power_at_one_batch_size():
    rows = [dict(model="m", L=L, B=B, seconds=0.3 if B == 4 else 1e-9 * L**1.5)
            for L, B in ((1024, 4), (4096, 1), (16384, 1), (65536, 1))]
    fit = speed.fit_exponent(rows, "m", 1024)
    assert abs(fit["p"] - 1.5) < 1e-9 and fit["lengths"] == [4096, 16384, 65536], "L^1.5 at B=1 must fit p = 1.5"


def test_an_exponent_needs_at_least_three_lengths():
    rows = [dict(model="m", L=L, B=1, seconds=1e-9 * L) for L in (4096, 8192, 16384)]
    assert speed.fit_exponent(rows, "m", 8192)["p"] is None, "two lengths fit any power: no exponent"
    assert "needs ≥ 3 lengths" in speed.fit_exponent(rows, "m", 8192)["why"], "a missing exponent must say why"
    assert abs(speed.fit_exponent(rows, "m", 4096)["p"] - 1) < 1e-9, "three lengths of time ∝ L must fit p = 1"


def test_quick_mode_fits_exponents_over_three_lengths_at_one_batch_size():
    args = bench.parse_args(["--quick"])
    fitted = [L for L in args.lengths if L >= args.fit_from]
    batches = {max(1, min(args.batch, args.max_tokens // L)) for L in fitted}
    assert len(fitted) >= speed.FIT_POINTS and len(batches) == 1, f"--quick cannot fit exponents: {vars(args)}"


def test_a_row_predicted_too_slow_is_skipped_not_run():
    rows = speed.layer_table(bench.parse_args(TINY + ["--models", "dlr", "--max-step-seconds", "0"]))
    assert "seconds" in rows[0] and all("--max-step-seconds" in r["skipped"] for r in rows[1:]), rows


def test_devices_are_told_apart_by_type_not_by_string():
    from lab.memory import device_type
    assert [device_type(d) for d in ("cuda:0", "cuda", "cpu", "cuda:3")] == ["cuda", "cuda", "cpu", "cuda"]


def test_the_clock_reads_after_a_synchronisation_before_and_after_the_call_on_cuda(monkeypatch):
    events = []
    monkeypatch.setattr(speed.torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))
    args = speed.settings(device="cuda:0", min_time=0, max_reps=1)
    speed.timed(lambda: events.append("call"), args)
    assert events[:3] == [("sync", "cuda:0"), "call", ("sync", "cuda:0")], events
    events.clear()
    speed.timed(lambda: events.append("call"), speed.settings(device="cpu", min_time=0, max_reps=1))
    assert "call" in events and not [e for e in events if e != "call"], "a CPU has nothing to synchronise"


@pytest.mark.parametrize("flags, says", [
    (["--device", "gpu"], "--device gpu"), (["--device", "cuda:7"], "--device cuda:7"),
    (["--lengths", "0"], "--lengths"), (["--task", "nope"], "--task"), (["--presets", "huge"], "--presets"),
    (["--batch", "-1"], "--batch"), (["--minutes", "0"], "--minutes"),
])
def test_bad_flags_exit_with_status_2_and_one_line(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("bench.py: error:") and says in err[0], err


def test_an_out_that_is_a_folder_is_refused_before_anything_is_measured(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(speed, "speed", lambda args: pytest.fail("measured before checking --out"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "is a folder" in capsys.readouterr().err


def test_eval_pass_with_kernels_once_per_pass_gives_the_same_logits_and_measures_both():
    from tools import speed
    rows = speed.eval_pass(speed.settings(), task="pathfinder", batches=3, batch=2,
                           size=dict(d_model=8, n_layers=2, d_state=8))
    assert [r["model"] for r in rows] == ["s4", "dlr"]
    for r in rows:
        assert r["max_abs_diff"] < 1e-5 and r["before_s"] > 0 and r["cached_s"] > 0, r
