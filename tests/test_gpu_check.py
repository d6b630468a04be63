"""Facts about tools/gpu_check.py (python tools/bench.py --gpu-check) at --check-scale tiny on a CPU: every part (a)-(g)
measures, within 90 s, without git, writing only the three files of --out-dir (summary.md, results.json,
check.tar.gz); --minutes counts from the process's start and the check ends before it, keeping what was done; a failing
part keeps its error and log lines; SIGTERM leaves the finished parts; the TF32 part fails on a setter that mixes
torch's APIs; the paper-scale main command passes train.py's checks with the preset's batches."""
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

from tools import bench
import models
from lab import hardware, presets
import ssm
import train
from tools import gpu_check

REPO = Path(__file__).resolve().parents[1]
PARTS = list(gpu_check.PARTS)
FILES = {"summary.md", "results.json", "check.tar.gz", ".outputs"}   # .outputs: the files it wrote (tools/checked.py)


def numbers(x):
    """Every int and float inside x (nested dicts and lists)."""
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, list):
        return [n for item in x for n in numbers(item)]
    return [x] if isinstance(x, (int, float)) and not isinstance(x, bool) else []


def archive(out):
    with tarfile.open(out / "check.tar.gz") as tar:
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


def test_the_tiny_check_measures_every_part_in_90_s_without_git_and_writes_only_its_three_files(tmp_path):
    out, cwd = tmp_path / "out", tmp_path / "elsewhere"
    cwd.mkdir()
    status = lambda: subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,  # noqa: E731
                                    capture_output=True, text=True).stdout
    before, t0 = status(), time.time()
    done = subprocess.run([sys.executable, str(REPO / "tools/bench.py"), "--gpu-check", "--check-scale", "tiny", "--out-dir",
                           str(out)], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PATH": str(tmp_path / "no-git-here")})
    wall = time.time() - t0
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert wall < 90, f"the tiny check took {wall:.0f} s"
    assert {p.name for p in out.iterdir()} == FILES, sorted(out.iterdir())
    assert status() == before, "the check wrote into the repo"
    res = json.loads((out / "results.json").read_text())
    assert res["machine"]["commit"] == "unknown", res["machine"]
    for name in PARTS:
        part = res["parts"][name]
        assert part["status"] == "ok", f"{name}: {part.get('reason') or part.get('error')}"
        assert all(math.isfinite(n) for n in numbers(part)), f"{name} holds a non-finite number"
    files = archive(out)
    assert {f"{n}.json" for n in PARTS} | {f"{n}.log" for n in PARTS} <= set(files), sorted(files)
    parts = res["parts"]
    assert all(r["ok"] for r in parts["tf32"]["rows"]) and len(parts["tf32"]["rows"]) == 4
    kernels = {(r["kernel"], r["L"], r["guarded"]) for r in parts["kernels"]["rows"]}
    assert kernels == {(k, L, g) for k in ("s4-nplr", "s4-diag", "dlr") for L in (64, 256) for g in (False, True)}
    assert all(r["forward_error"] < 1e-3 and r["grad_error"] < 1e-2 for r in parts["kernels"]["rows"] if r["guarded"])
    assert parts["main"]["spt_steps"] == 2 and parts["main"]["finetune_steps"] == 2, parts["main"]
    assert all(": " in w for w in parts["main"]["other_warnings"]), parts["main"]  # "Category: message" -> count
    assert [(r["model"], r["task"], r["phase"]) for r in parts["largest"]["rows"]] == gpu_check.largest_presets()
    assert all(r["est_gib"] > 0 and r["peak_gib"] > 0 for r in parts["largest"]["rows"])
    assert parts["compile"]["fell_back"] is False and len(parts["compile"]["records"]) == 2, parts["compile"]
    assert parts["spt_batch"]["pretrain_batch_size"] == 8 == parts["spt_batch"]["preset"]
    text = (out / "summary.md").read_text()
    assert all(f"- {name}: measured" in text for name in PARTS), text
    assert "deadline:" in text and "kept" in text and "commit unknown" in text, text


# tools/bench.py's command line, its last part made endless: on any machine the deadline has to cut the check short
ENDLESS_LAST = ("import sys, time; from tools import bench, gpu_check; "
                "gpu_check.PARTS['spt_batch'] = lambda check: time.sleep(3600) or {}; "
                "sys.exit(1 if bench.main(sys.argv[1:]).get('failed') else 0)")


def test_the_check_ends_before_its_minutes_counted_from_the_process_start_and_keeps_what_was_done(tmp_path):
    minutes = 0.75                                 # 45 s, less the margin
    t0 = time.time()
    done = subprocess.run([sys.executable, "-c", ENDLESS_LAST, "--gpu-check", "--check-scale", "tiny", "--minutes",
                           str(minutes), "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.time() - t0
    assert wall < 60 * minutes, f"took {wall:.0f} s of a {60 * minutes:.0f} s budget"
    parts = json.loads((tmp_path / "results.json").read_text())["parts"]
    assert any(p["status"] == "ok" for p in parts.values()), f"no part finished: {parts}; {done.stderr[-2000:]}"
    assert set(parts) == set(PARTS), f"every part says what happened to it: {sorted(parts)}"
    assert parts["spt_batch"]["status"] != "ok", f"the endless part was not cut: {parts['spt_batch']}"
    assert {p.name for p in tmp_path.iterdir()} == FILES


def test_a_part_that_fails_keeps_its_error_and_log_lines_and_the_summary_says_failed(tmp_path, monkeypatch):
    def broken(check):
        print("loading the data ... 42 images")
        raise RuntimeError("out of luck")
    monkeypatch.setattr(gpu_check, "PARTS", {"tf32": broken, "spt_batch": gpu_check.spt_batch_part})
    res = bench.main(["--gpu-check", "--check-scale", "tiny", "--out-dir", str(tmp_path)])
    part = json.loads((tmp_path / "results.json").read_text())["parts"]["tf32"]
    assert part["status"] == "error" and "out of luck" in part["error"], part
    assert any("42 images" in line for line in part["log"]), part["log"]
    assert "42 images" in archive(tmp_path)["tf32.log"]
    assert res["failed"] == ["tf32", "spt_batch"], "spt_batch needs part main: an error saying so"
    text = (tmp_path / "summary.md").read_text()
    assert "- tf32: failed: RuntimeError: out of luck" in text and "- spt_batch: failed" in text, text


def test_the_tf32_part_fails_on_a_setter_that_mixes_torchs_tf32_apis(tmp_path, monkeypatch):
    # the setter before this work (the new API's fp32_precision) leaves cuBLAS's query raising on torch >= 2.9
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        return                                     # a torch without the new API cannot mix them
    old = ssm.matmul_precision()
    monkeypatch.setattr(hardware, "set_tf32", lambda on: setattr(
        torch.backends.cuda.matmul, "fp32_precision", "tf32" if on else "ieee"))
    check = gpu_check.Check.__new__(gpu_check.Check)
    check.args = bench.parse_args(["--gpu-check", "--out-dir", str(tmp_path)])
    try:
        gpu_check.tf32_part(check)
        raise AssertionError("the TF32 part passed a setter that leaves torch's getters raising")
    except RuntimeError as e:
        assert "TF32 state wrong or unreadable" in str(e), e
    finally:
        ssm.set_matmul_precision(old)


def test_sigterm_mid_check_leaves_the_finished_parts(tmp_path):
    check = subprocess.Popen([sys.executable, "tools/bench.py", "--gpu-check", "--check-scale", "tiny", "--out-dir",
                              str(tmp_path)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    started, deadline = time.time(), time.time() + 300          # a loaded CI machine can take a minute to import torch
    while not (tmp_path / "check.tar.gz").exists() and time.time() < deadline and check.poll() is None:
        time.sleep(0.05)
    ended_before = check.poll()                                     # the signal must find the check running
    check.send_signal(signal.SIGTERM)
    err = check.communicate(timeout=60)[1]
    seen = dict(rc=check.returncode, ended_before_the_signal=ended_before, waited_s=round(time.time() - started, 1))
    assert check.returncode == 143 and "stopped by SIGTERM" in err, (seen, err[-2000:])
    parts = json.loads((tmp_path / "results.json").read_text())["parts"]
    assert parts["tf32"]["status"] == "ok" and "stopped" in parts, parts


def test_the_paper_scale_main_command_passes_train_py_checks_with_the_presets_batches(tmp_path):
    args = bench.parse_args(["--gpu-check", "--check-scale", "paper", "--out-dir", str(tmp_path)])
    check = gpu_check.Check.__new__(gpu_check.Check)                   # no machine needed to plan the flags
    check.args, check.scale, check.work = args, gpu_check.SCALES["paper"], tmp_path
    (tmp_path / "pathx").mkdir()
    flags, n = gpu_check.main_flags(check, check.scale["main_steps"])
    run = train.parse_flags(flags)[0]
    presets.check(run, presets.apply(run, train.MODELS["dlr"])[0], train.MODELS["dlr"])   # raises on a bad flag
    preset = presets.values_for("paper", "dlr", "pathx", True)
    assert (run.batch_size, run.pretrain_batch_size) == (preset["batch_size"], preset["pretrain_batch_size"]), vars(run)
    assert run.max_steps == 20 and run.spt and run.preset == "paper" and n >= run.max_train / 0.8, vars(run)
    assert gpu_check.SCALES["paper"]["lengths"] == [1024, 16384, 65536]
