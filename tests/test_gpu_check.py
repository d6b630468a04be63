"""Facts about tools/gpu_check.py (python bench.py --gpu-check): at reduced size on a CPU every part runs and writes
its JSON; --minutes counts from the process's start and the check ends before it, keeping what was done; a failing
part keeps its error and log lines; SIGTERM leaves the finished parts' files; the claim's steps fit the minutes."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import bench
import presets
import train
from tools import gpu_check

REPO = Path(__file__).resolve().parents[1]
PARTS = list(gpu_check.PARTS)


def numbers(x):
    """Every int and float inside x (nested dicts and lists)."""
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, list):
        return [n for item in x for n in numbers(item)]
    return [x] if isinstance(x, (int, float)) and not isinstance(x, bool) else []


def positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_gpu_check_at_reduced_size_runs_every_part_and_writes_its_json(tmp_path):
    res = bench.main(["--gpu-check", "--check-scale", "tiny", "--out-dir", str(tmp_path)])
    errors = {name: part.get("error") for name, part in res["parts"].items()}
    assert not res["failed"], f"parts failed at reduced size: {res['failed']}; {errors}"
    parts = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in PARTS}
    for name, part in parts.items():
        assert part["status"] == "ok", f"{name}: {part.get('reason') or part.get('error')}"
        assert all(math.isfinite(n) for n in numbers(part)), f"{name}.json holds a non-finite number"
        assert {"cpu", "torch", "commit", "command"} <= set(part["machine"]), f"{name}.json: no machine: {part}"
        assert (tmp_path / f"{name}.log").is_file(), f"{name} kept no log"
    rows = parts["kernels"]["rows"]
    assert {(r["kernel"], r["guarded"]) for r in rows} == {(k, g) for k in ("s4-nplr", "s4-diag", "dlr")
                                                          for g in (False, True)}
    assert all(r["max_error"] < 1e-3 for r in rows if r["guarded"]), rows
    assert set(parts["layers"]) >= {"fp32", "bf16"}, "layers in fp32 and in the training precision"
    runs = parts["runs"]["runs"]
    planned = {(m, t, False) for m in train.MODELS for t in ("pathfinder", "pathx")} | {("dlr", "pathx", True)}
    assert {(r["model"], r["task"], r["spt"]) for r in runs} == planned, "each model on both tasks + main command"
    skipped = [(r["model"], r["task"]) for r in runs if r["status"] == "skipped"]
    assert skipped == [("transformer", "pathx")], f"tiny skips only the Transformer on PathX (slow): {skipped}"
    for r in (r for r in runs if r["status"] != "skipped"):
        assert r["status"] == "ok" and all(positive(r[k]) for k in ("ms_per_step", "tokens_per_s", "peak_mib")), r
        assert r["warmup"] < r["steps"], f"a warm-up longer than the run keeps it at chance: {r}"
    main_command = next(r for r in runs if r["spt"])
    assert any(rec["phase"] == "spt" for rec in main_command["records"]), "the main command did not pre-train"
    assert not list((tmp_path / "runs").rglob("*.pt")), "checkpoints were brought back"
    claim = parts["claim"]
    tfs, spt = ([step for step, _ in claim[kind]["curve"]] for kind in ("tfs", "spt"))
    assert tfs == spt and tfs[-1] == claim["steps"], f"TFS and SPT fine-tuned for different steps: {tfs} vs {spt}"
    text = (tmp_path / "summary.md").read_text()
    assert "torch" in text and "commit" in text and "--gpu-check" in text and "after SPT" in text, text


# bench.py's command line, its last part made endless: on any machine the deadline has to cut the check short
ENDLESS_CLAIM = ("import sys, time; import bench; from tools import gpu_check; "
                 "gpu_check.PARTS['claim'] = lambda check: time.sleep(3600) or {}; "
                 "sys.exit(1 if bench.main(sys.argv[1:]).get('failed') else 0)")


def test_gpu_check_ends_before_its_minutes_counted_from_the_process_start_and_keeps_what_was_done(tmp_path):
    minutes = 0.75                                 # 45 s, less the margin
    t0 = time.time()
    done = subprocess.run([sys.executable, "-c", ENDLESS_CLAIM, "--gpu-check", "--check-scale", "tiny", "--minutes",
                           str(minutes), "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.time() - t0
    assert wall < 60 * minutes, f"took {wall:.0f} s of a {60 * minutes:.0f} s budget"
    parts = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert any(p["status"] == "ok" for p in parts.values()), f"no part finished: {parts}; {done.stderr[-2000:]}"
    assert set(parts) == set(PARTS), f"every part says what happened to it: {sorted(parts)}"
    cut = [name for name, p in parts.items() if p["status"] != "ok"]
    assert cut and parts["claim"]["status"] != "ok", f"the endless part was not cut: {parts['claim']}"
    assert (tmp_path / "summary.md").is_file()


def test_a_part_that_fails_keeps_its_json_with_the_error_and_its_log_lines(tmp_path, monkeypatch):
    def broken(check):
        print("loading the data ... 42 images")
        raise RuntimeError("out of luck")
    monkeypatch.setattr(gpu_check, "PARTS", {"kernels": broken, "claim": gpu_check.claim_part})
    res = bench.main(["--gpu-check", "--check-scale", "tiny", "--out-dir", str(tmp_path)])
    part = json.loads((tmp_path / "kernels.json").read_text())
    assert part["status"] == "error" and "out of luck" in part["error"], part
    assert any("42 images" in line for line in part["log"]), part["log"]
    assert "42 images" in (tmp_path / "kernels.log").read_text()
    assert res["failed"] == ["kernels", "claim"], "claim needs the runs part: an error saying so"
    assert "kernels: error" in (tmp_path / "summary.md").read_text()


def test_sigterm_mid_check_leaves_the_finished_parts_files(tmp_path):
    check = subprocess.Popen([sys.executable, "bench.py", "--gpu-check", "--check-scale", "tiny", "--out-dir",
                              str(tmp_path)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 90
    while not (tmp_path / "kernels.json").exists() and time.time() < deadline and check.poll() is None:
        time.sleep(0.2)
    check.send_signal(signal.SIGTERM)
    err = check.communicate(timeout=60)[1]
    assert check.returncode == 143 and "stopped by SIGTERM" in err, (check.returncode, err[-2000:])
    assert json.loads((tmp_path / "kernels.json").read_text())["status"] == "ok"
    assert "kernels" in (tmp_path / "summary.md").read_text() and (tmp_path / "stopped.json").is_file()


def test_the_claim_gets_the_steps_its_minutes_allow_in_whole_epochs():
    run, scale = dict(ms_per_step=100.0, batch=32, fixed_s=5.0), gpu_check.SCALES["paper"]
    E, per_step = scale["claim_epochs"], 3 * 0.100 + 32 / (0.8 * scale["claim_epochs"] * 4000)  # 3 × s/step + images
    F = gpu_check.claim_steps(300, run, 4000, scale)
    used = 2 * run["fixed_s"] + F * per_step
    assert F % E == 0 and used <= 0.8 * 300 < used + E * per_step, f"F = {F} does not fill 80 % of 300 s"
    assert gpu_check.claim_steps(5, run, 4000, scale) == 0, "no time: no steps"
    assert gpu_check.claim_steps(1e6, run, 4000, scale) == scale["max_claim_steps"], "at most max_claim_steps"


def test_the_paper_scale_runs_pass_train_py_checks_and_take_the_steps_they_plan(tmp_path):
    args = bench.parse_args(["--gpu-check", "--check-scale", "paper", "--out-dir", str(tmp_path)])
    check = gpu_check.Check.__new__(gpu_check.Check)                   # no machine needed to plan the flags
    check.args, check.scale, check.work, check.out = args, gpu_check.SCALES["paper"], tmp_path, tmp_path
    plans = [(m, t, False, *check.scale["runs"][t]) for m in train.MODELS for t in check.scale["runs"]]
    plans += [("dlr", "pathx", True, *check.scale["runs"]["pathx"])]
    plans += [("transformer", "pathfinder", spt, 600, check.scale["claim_epochs"]) for spt in (False, True)]
    for task in check.scale["runs"]:
        (tmp_path / task).mkdir(exist_ok=True)                        # where the check generates its images
    for model, task, spt, steps, epochs in plans:
        flags, _, n = gpu_check.run_flags(check, model, task, steps, epochs, check.scale["max_eval"], spt)
        run = train.parse_flags(flags)[0]
        presets.check(run, presets.apply(run, train.MODELS[model])[0], train.MODELS[model])   # raises on a bad flag
        assert run.epochs * math.ceil(run.max_train / run.batch_size) == steps, f"{model} {task}: {vars(run)}"
        assert n >= run.max_train / 0.8 and run.preset == "paper" and run.warmup <= steps // 10, vars(run)
        if spt:
            assert run.pretrain_epochs * math.ceil(run.max_train / run.pretrain_batch_size) == steps, vars(run)
