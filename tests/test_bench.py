"""Smoke tests of bench.py: a tiny run writes every field with finite numbers; the fit and the guards are right."""
import json
import math

import bench

TINY = ["--quick", "--lengths", "64", "128", "--batch", "2", "--d-model", "16", "--d-state", "8", "--dlr-state", "32",
        "--n-heads", "2", "--train-batch", "1", "--min-time", "0", "--max-reps", "1", "--fit-from", "64"]
# the training step of S4's tiny preset alone takes seconds (the NPLR kernel's dense N×N solve), so the smoke run skips
# the training steps (--presets with no names) and one test times DLR's tiny step on its own


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_tiny_run_writes_json_and_table_with_finite_numbers(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(TINY + ["--presets", "--in-process", "--out", str(out)])
    res = json.loads(out.read_text())
    assert finite(res["matmul_gflops"]) and finite(res["seconds"]), "matmul GFLOP/s and run time must be positive"
    assert {"cpu", "cores", "torch", "load_1min", "commit"} <= set(res["machine"]), f"machine info incomplete: {res['machine']}"
    assert {(r["model"], r["L"]) for r in res["layers"]} == {(m, L) for m in bench.LAYERS for L in (64, 128)}, "one row per (layer, L)"
    for r in res["layers"]:
        if r["model"] == "transformer-local":
            assert "n/a" in r["skipped"], "block-local below one block must say n/a, not be timed"
            continue
        assert "skipped" not in r, f"tiny configuration skipped: {r}"
        assert all(finite(r[k]) for k in ("seconds", "tokens_per_s", "peak_mib", "base_mib")), f"non-finite numbers: {r}"
        if r["model"] != "transformer-full":
            assert finite(r["kernel_seconds"]), f"SSM kernel time missing: {r}"
    dlr = [r for r in res["layers"] if r["model"] == "dlr"]
    assert all(finite(r["kernel_gflops"]) and finite(r["matmul_gflops"]) for r in dlr), "DLR kernel GFLOP/s missing"
    for name in ("transformer-full", "s4-nplr", "s4-diag", "dlr"):
        assert math.isfinite(res["exponents"][name]["p"]), f"no exponent for {name}"
    assert len(res["targets"]) >= 5, "each measured target must be listed"
    assert "| layer | L | B |" in out.with_suffix(".md").read_text(), "markdown table not written"


def test_training_step_of_a_train_py_preset_reports_tokens_per_second():
    row = bench.train_step("dlr", "tiny", bench.parse_args(TINY))
    assert (row["B"], row["L"]) == (1, 1024) and finite(row["tokens_per_s"]), f"bad training-step row: {row}"


def test_each_cpu_configuration_runs_in_its_own_process_and_reports_its_peak():
    args = bench.parse_args(TINY)
    row = bench.measure_isolated("dlr", 64, 1, args, mem_limit=2**31)
    assert "skipped" not in row, f"subprocess measurement failed: {row}"
    assert finite(row["peak_mib"]) and row["peak_mib"] >= row["base_mib"] > 0, f"peak RSS not reported: {row}"


def test_fitted_exponent_recovers_a_known_power_at_one_batch_size():
    rows = [dict(model="m", L=L, B=B, seconds=(0.3 if B == 4 else 1e-9 * L**1.5)) for L, B in ((1024, 4), (4096, 4),
                                                                                              (16384, 1), (65536, 1))]
    fit = bench.fit_exponent(rows, "m", 1024)
    assert abs(fit["p"] - 1.5) < 1e-9 and fit["lengths"] == [16384, 65536], "time ∝ L^1.5 at B=1 must fit p = 1.5 (B=4 left out)"
    assert bench.fit_exponent(rows, "m", 65536)["p"] is None, "one point gives no exponent"


def test_prediction_skips_full_attention_at_65536_and_scales_memory_with_length():
    args = bench.parse_args([])
    prev = dict(L=16384, B=1, seconds=7.0, peak_mib=500, base_mib=400)
    seconds, _, _ = bench.predict("transformer-full", 65536, 1, prev, args, gflops=200)
    assert seconds == 7.0 * 16 > args.max_step_seconds, "full attention: 4x the length must predict 16x the time"
    prev = dict(L=16384, B=1, seconds=2.0, peak_mib=1400, base_mib=400)
    seconds, extra, peak = bench.predict("s4-diag", 65536, 1, prev, args, gflops=200)
    assert extra == 4000 and peak == 4400, "memory above the base grows with L from the previous measurement"
    assert seconds >= 2.0 * 4, "time is extrapolated from the previous length at least linearly in L"
