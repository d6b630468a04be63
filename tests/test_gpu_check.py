"""Facts about gpu_check.py: the whole check runs at reduced size on a CPU and writes its JSON; it skips what its
minutes do not allow; a failing part records its error; the claim's steps fit the minutes left."""
import json
import math
import time

import bench
import gpu_check
import train


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


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
    assert "ZeroDivisionError" in gpu_check.attempt(lambda: 1 / 0, 0, 10)["error"], \
        "a failing part must record its error"
    slow = gpu_check.attempt(lambda: time.sleep(5), 0, 0.2)
    assert slow["status"] == "error" and "OutOfTime" in slow["error"] and slow["seconds"] < 2, slow


def test_the_claim_gets_the_steps_its_minutes_allow_in_whole_epochs():
    run, scale = dict(ms_per_step=10.0, batch=32, fixed_s=5.0), gpu_check.CHECK_SCALES["paper"]
    E, per_step = scale["claim_epochs"], 3 * 0.010 + 32 / (0.8 * scale["claim_epochs"] * 4000)  # 3 × s/step + images
    F = gpu_check.claim_steps(300, run, 4000, scale)
    used = 2 * run["fixed_s"] + F * per_step
    assert F % E == 0 and used <= 0.8 * 300 < used + E * per_step, f"F = {F} does not fill 80 % of 300 s"
    assert gpu_check.claim_steps(5, run, 4000, scale) == 0, "no time: no steps"
    assert gpu_check.claim_steps(1e6, run, 4000, scale) == scale["max_claim_steps"], "at most max_claim_steps"


def test_the_paper_scale_runs_pass_train_py_checks_and_take_the_steps_they_plan(tmp_path):
    scale, args = gpu_check.CHECK_SCALES["paper"], bench.parse_args(["--device", "cuda", "--gpu-check"])
    plans = [(m, t, False, scale["steps"], scale["epochs"]) for m in train.MODELS for t in gpu_check.RUN_TASKS]
    plans += [("transformer", "pathfinder", spt, 600, scale["claim_epochs"]) for spt in (False, True)]  # part 3
    for model, task, spt, steps, epochs in plans:
        where = (tmp_path, tmp_path, gpu_check.n_images(steps // epochs * 64, scale["claim_eval"]))
        flags, _ = gpu_check.run_flags(model, task, args, scale, where, steps, epochs, scale["max_eval"], spt)
        run = train.parse_flags(flags)[0]
        train.check_flags(run, train.apply_presets(run)[0])                     # raises on a bad flag
        assert run.epochs * math.ceil(run.max_train / run.batch_size) == steps, f"{model} {task}: {vars(run)}"
        assert run.generate >= run.max_train / 0.8 and run.preset == "paper", f"too few images: {vars(run)}"
        if spt:
            assert run.pretrain_epochs * math.ceil(run.max_train / run.pretrain_batch_size) == steps, vars(run)
