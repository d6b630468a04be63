"""Facts about bench.py: a tiny run writes every field with finite numbers and the machine's load; an exponent needs
three lengths; the whole --gpu-check runs at reduced size on the CPU, and skips (saying so) what its budget does not
allow. The memory estimate's facts: tests/test_memory.py."""
import json
import math
import time

import bench
import train

TINY = ["--lengths", "64", "128", "256", "--max-tokens", "512", "--batch", "2", "--d-model", "16", "--d-state", "8",
        "--dlr-state", "32", "--n-heads", "2", "--train-batch", "1", "--min-time", "0", "--max-reps", "1",
        "--fit-from", "64"]
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
    assert {(r["model"], r["L"]) for r in res["layers"]} == {(m, L) for m in bench.LAYERS for L in (64, 128, 256)}
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
    row = bench.train_step("dlr", "tiny", bench.parse_args(TINY))
    assert (row["B"], row["L"]) == (1, 1024) and finite(row["tokens_per_s"]), f"bad training-step row: {row}"


def test_fitted_exponent_recovers_a_known_power_at_one_batch_size():
    rows = [dict(model="m", L=L, B=B, seconds=0.3 if B == 4 else 1e-9 * L**1.5)
            for L, B in ((1024, 4), (4096, 1), (16384, 1), (65536, 1))]
    fit = bench.fit_exponent(rows, "m", 1024)
    assert abs(fit["p"] - 1.5) < 1e-9 and fit["lengths"] == [4096, 16384, 65536], "L^1.5 at B=1 must fit p = 1.5"


def test_an_exponent_needs_at_least_three_lengths():
    rows = [dict(model="m", L=L, B=1, seconds=1e-9 * L) for L in (4096, 8192, 16384)]
    assert bench.fit_exponent(rows, "m", 8192)["p"] is None, "two lengths fit any power: no exponent"
    assert "needs ≥ 3 lengths" in bench.fit_exponent(rows, "m", 8192)["why"], "a missing exponent must say why"
    assert abs(bench.fit_exponent(rows, "m", 4096)["p"] - 1) < 1e-9, "three lengths of time ∝ L must fit p = 1"


def test_quick_mode_fits_exponents_over_three_lengths_at_one_batch_size():
    args = bench.parse_args(["--quick"])
    fitted = [L for L in args.lengths if L >= args.fit_from]
    batches = {max(1, min(args.batch, args.max_tokens // L)) for L in fitted}
    assert len(fitted) >= bench.FIT_POINTS and len(batches) == 1, f"--quick cannot fit exponents: {vars(args)}"


def test_a_row_predicted_too_slow_is_skipped_not_run():
    rows = bench.layer_table(bench.parse_args(TINY + ["--models", "dlr", "--max-step-seconds", "0"]))
    assert "seconds" in rows[0] and all("--max-step-seconds" in r["skipped"] for r in rows[1:]), rows


# ---- --gpu-check ----------------------------------------------------------------------------------------------------

def numbers(x):
    """Every int and float inside x (nested dicts and lists)."""
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, list):
        return [n for item in x for n in numbers(item)]
    return [x] if isinstance(x, (int, float)) and not isinstance(x, bool) else []


def test_gpu_check_runs_at_reduced_size_on_the_cpu_and_writes_its_json(tmp_path):
    res = bench.main(["--gpu-check", "--check-scale", "tiny", "--out-dir", str(tmp_path)])
    errors = {name: part.get("error") for name, part in res["parts"].items()}
    assert not res["failed"], f"parts failed at reduced size: {res['failed']}; {errors}"
    parts = {name: json.loads((tmp_path / f"{name}.json").read_text())
             for name in ("layers", "paper_runs", "spt_claim")}
    for name, part in parts.items():
        assert part["status"] == "ok", f"{name}: {part.get('reason') or part.get('error')}"
        assert all(math.isfinite(n) for n in numbers(part)), f"{name}.json holds a non-finite number"
        assert {"cpu", "torch", "commit", "command"} <= set(part["machine"]), f"{name}.json: no machine: {part}"
    runs = parts["paper_runs"]["runs"]
    assert {(r["model"], r["task"]) for r in runs} == {(m, t) for m in train.MODELS for t in ("pathfinder", "pathx")}
    skipped = {(r["model"], r["task"]): r["reason"] for r in runs if r["status"] == "skipped"}
    assert list(skipped) == [("transformer", "pathx")], f"tiny skips only the Transformer on PathX (slow): {skipped}"
    for r in (r for r in runs if r["status"] != "skipped"):
        assert r["status"] == "ok" and all(finite(r[k]) for k in ("ms_per_step", "tokens_per_s", "peak_mib")), r
        assert (r["precision"], r["batch"], r["accum_steps"]) == ("fp32", 2, 1), f"precision, batch not recorded: {r}"
        assert len(r["curve"]) == 3 and any(rec["phase"] == "test" for rec in r["records"]), f"3 evaluations: {r}"
    claim = parts["spt_claim"]
    tfs, spt = ([step for step, _ in claim[kind]["curve"]] for kind in ("tfs", "spt"))
    assert tfs == spt and tfs[-1] == claim["steps"], f"TFS and SPT fine-tuned for different steps: {tfs} vs {spt}"
    assert any(rec["phase"] == "spt" for rec in claim["spt"]["records"]), "the SPT run did not pre-train"
    assert not any(rec["phase"] == "spt" for rec in claim["tfs"]["records"]), "the TFS run pre-trained"
    text = (tmp_path / "summary.md").read_text()
    assert "torch" in text and "commit" in text and "--gpu-check" in text and "after SPT" in text, text


def test_gpu_check_skips_what_its_minutes_do_not_allow_and_says_so(tmp_path):
    res = bench.main(["--gpu-check", "--check-scale", "tiny", "--minutes", "0", "--out-dir", str(tmp_path)])
    runs = res["parts"]["paper_runs"]
    states = [part["status"] for part in (res["parts"]["layers"], *runs["runs"])]
    assert set(states) == {"skipped"} and not runs["data"] and not res["failed"], f"nothing fits 0 minutes: {states}"
    assert "--minutes left" in res["parts"]["layers"]["reason"], res["parts"]["layers"]
    assert res["parts"]["spt_claim"]["status"] == "skipped", "part 3 needs part 2's time per step"
    assert "skipped" in (tmp_path / "summary.md").read_text(), "summary.md must say what was skipped"


def test_a_part_that_fails_or_overruns_records_its_error_and_the_check_goes_on():
    assert "ZeroDivisionError" in bench.attempt(lambda: 1 / 0, 0, 10)["error"], "a failing part must record its error"
    slow = bench.attempt(lambda: time.sleep(5), 0, 0.2)
    assert slow["status"] == "error" and "OutOfTime" in slow["error"] and slow["seconds"] < 2, slow


def test_the_claim_gets_the_steps_its_minutes_allow_in_whole_epochs():
    run, scale = dict(ms_per_step=10.0, batch=32, fixed_s=5.0), bench.CHECK_SCALES["paper"]
    E, per_step = scale["claim_epochs"], 3 * 0.010 + 32 / (0.8 * scale["claim_epochs"] * 4000)  # 3 × s/step + images
    F = bench.claim_steps(300, run, 4000, scale)
    used = 2 * run["fixed_s"] + F * per_step
    assert F % E == 0 and used <= 0.8 * 300 < used + E * per_step, f"F = {F} does not fill 80 % of 300 s"
    assert bench.claim_steps(5, run, 4000, scale) == 0, "no time: no steps"
    assert bench.claim_steps(1e6, run, 4000, scale) == scale["max_claim_steps"], "at most max_claim_steps"


def test_the_paper_scale_runs_pass_train_py_checks_and_take_the_steps_they_plan(tmp_path):
    scale, args = bench.CHECK_SCALES["paper"], bench.parse_args(["--device", "cuda", "--gpu-check"])
    plans = [(m, t, False, scale["steps"], scale["epochs"]) for m in train.MODELS for t in bench.RUN_TASKS]
    plans += [("transformer", "pathfinder", spt, 600, scale["claim_epochs"]) for spt in (False, True)]  # part 3
    for model, task, spt, steps, epochs in plans:
        where = (tmp_path, tmp_path, bench.n_images(steps // epochs * 64, scale["claim_eval"]))
        flags, _ = bench.run_flags(model, task, args, scale, where, steps, epochs, scale["max_eval"], spt)
        run = train.parse_flags(flags)[0]
        train.check_flags(run, train.apply_presets(run)[0])                     # raises on a bad flag
        assert run.epochs * math.ceil(run.max_train / run.batch_size) == steps, f"{model} {task}: {vars(run)}"
        assert run.generate >= run.max_train / 0.8 and run.preset == "paper", f"too few images: {vars(run)}"
        if spt:
            assert run.pretrain_epochs * math.ceil(run.max_train / run.pretrain_batch_size) == steps, vars(run)
