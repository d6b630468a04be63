"""Facts about the faults long runs meet (lab/runs.py, lra/cache.py, the generators, every command-line tool): a full disk
at the cache, a checkpoint or generated data ends in one line and leaves no temporary; SIGTERM and SIGKILL stop
generator workers and training cleanly, and the --resume command printed works; leftovers of a killed process are
removed; runs of an older commit or from another folder resume; images are read exactly or refused."""
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import lra_data
from lab import run as run_module, runs
from lab import steps
import train
import models
from conftest import TINY, interrupt_at_step, records, run
from lra import files as lra_files
from lra.files import DataError
from lra.listops import generate_listops
from lra.pathfinder import generate_pathfinder

REPO = Path(__file__).resolve().parents[1]
NO_SPACE = OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """ListOps in the release format: 60 / 9 / 9 trees of 30..200 tokens."""
    root = tmp_path_factory.mktemp("data")
    generate_listops(root, 60, 9, 9, min_length=30, max_length=200)
    return root


def one_line(capsys, code, says, exit_info):
    """The run ended with status `code` and exactly one 'train.py: error' / 'stopped' line naming `says`."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train.py:")]
    assert exit_info.value.code == code and len(lines) == 1 and says in lines[0] and "Traceback" not in err, \
        f"exit {exit_info.value.code}, stderr: {err[-2000:]!r}"
    return lines[0]


# ---- a full disk --------------------------------------------------------------------------------------------------

def test_out_of_space_building_a_pixel_cache_is_one_line_naming_the_space_and_leaves_no_temporary(tmp_path,
                                                                                                monkeypatch, capsys):
    generate_pathfinder(tmp_path, res=32, n=40, contour_length=14)
    def full(fd, offset, length):
        raise NO_SPACE
    monkeypatch.setattr(os, "posix_fallocate", full)                 # the reservation finds the disk full
    with pytest.raises(SystemExit) as e:
        run(tmp_path, tmp_path / "runs", "--task", "pathfinder", "--generate", "0", "--cache-dir", str(tmp_path / "c"))
    line = one_line(capsys, 2, "cannot write the cache", e)
    assert "needs about" in line and "GB free" in line, line
    assert not list((tmp_path / "c").glob("*.building-*")), "a half-built cache folder was left behind"
    assert not (tmp_path / "runs").exists(), "a run folder was made before the data was ready"


def test_out_of_space_writing_a_checkpoint_is_one_line_and_the_earlier_checkpoints_load(data_dir, tmp_path,
                                                                                       monkeypatch, capsys):
    calls, save = [], torch.save
    def save_until_full(obj, f, *a, **k):                            # the third checkpoint finds the disk full:
        calls.append(f)                                              # torch's own writer meets a real ENOSPC
        if len(calls) == 3:
            f.write(b"half a checkpoint")
            with open("/dev/full", "wb") as full:
                return save(obj, full, *a, **k)
        return save(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", save_until_full)
    with pytest.raises(SystemExit) as e:
        run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--spt", "--pretrain-epochs", "2",
            "--epochs", "1")
    line = one_line(capsys, 2, "cannot write", e)
    folder = next(tmp_path.iterdir())
    assert str(folder) in line and "GB free" in line, line
    assert not list(folder.glob("*.tmp")), "the half-written checkpoint was left behind"
    monkeypatch.setattr(torch, "save", save)
    for name in ("spt.pt", "last.pt"):                               # written before the disk filled: intact
        assert runs.read_checkpoint(folder / name)["epoch"] == 1
    assert train.main(["--resume", str(folder)])["test_acc"] >= 0, "the run did not continue from its last.pt"


@pytest.mark.parametrize("error, advice, not_advice", [
    (NO_SPACE, "free some space", "make it writable"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "free some space", "make it writable"),
    (PermissionError(errno.EACCES, "Permission denied"), "make it writable", "free some space"),
    (OSError(errno.EROFS, "Read-only file system"), "make it writable", "free some space")])
def test_a_failed_write_advises_space_for_a_full_disk_and_permission_for_a_denied_one(error, advice, not_advice,
                                                                                    tmp_path, capsys):
    def write(tmp):
        tmp.write_bytes(b"half")
        raise error
    (tmp_path / "last.pt").write_bytes(b"the old checkpoint")
    with pytest.raises(SystemExit) as e:
        runs.write_whole(tmp_path / "last.pt", write)
    line = one_line(capsys, 2, "cannot write", e)
    assert advice in line and not_advice not in line and error.strerror in line, line
    assert (tmp_path / "last.pt").read_bytes() == b"the old checkpoint" and not list(tmp_path.glob("*.tmp"))


def test_out_of_space_while_generating_is_one_line_and_removes_the_folder_it_made(tmp_path, monkeypatch, capsys):
    saved, save = [], Image.Image.save
    def save_until_full(self, fp, *a, **k):
        saved.append(1)
        if len(saved) == 5:
            raise NO_SPACE
        return save(self, fp, *a, **k)
    monkeypatch.setattr(Image.Image, "save", save_until_full)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)                  # in this process, where the patch is
    with pytest.raises(SystemExit) as e:
        run(tmp_path, tmp_path / "runs", "--task", "pathfinder", "--generate", "40")
    one_line(capsys, 2, "cannot write the generated data", e)
    assert not (tmp_path / "pathfinder32").exists(), "half the generated images were left on the full disk"


def test_ctrl_c_during_a_checkpoint_write_names_the_write_and_leaves_no_temporary(data_dir, tmp_path, monkeypatch,
                                                                                capsys):
    def interrupted(obj, f, *a, **k):                                # torch.save gets the open temporary file
        f.write(b"half")
        raise KeyboardInterrupt
    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(SystemExit) as e:
        run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--epochs", "1")
    line = one_line(capsys, 130, "writing checkpoints", e)
    assert "start-up" not in line and not list(next(tmp_path.iterdir()).glob("*.tmp")), line


# ---- SIGTERM, SIGKILL, leftovers ---------------------------------------------------------------------------------

def count_files(folder):
    return sum(1 for p in Path(folder).rglob("*") if p.is_file())


def start_generating(tmp_path):
    return subprocess.Popen([sys.executable, "lra_data.py", "--task", "pathx", "--generate", "4000", "--workers", "2",
                             "--data-dir", str(tmp_path), "--cache-dir", str(tmp_path / "c")], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_images(tmp_path, n=10, seconds=60):
    deadline = time.time() + seconds
    while count_files(tmp_path) < n and time.time() < deadline:
        time.sleep(0.1)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_generator_workers_stop_when_their_parent_is_terminated_or_killed(how, tmp_path):
    gen = start_generating(tmp_path)
    wait_for_images(tmp_path)
    gen.send_signal(how)
    err = gen.communicate(timeout=60)[1]
    before, deadline = -1, time.time() + 15        # a worker may finish the image it is on: wait until 1 s is quiet
    while count_files(tmp_path) != before and time.time() < deadline:
        before = count_files(tmp_path)
        time.sleep(1.0)
    time.sleep(2.0)                                # an orphaned worker goes on at several images a second
    assert count_files(tmp_path) == before, f"files still appear after the generator's parent got {how.name}"
    if how == signal.SIGTERM:
        assert gen.returncode == 143 and "stopped by SIGTERM" in err and "completes it" in err, err[-1000:]


def stop_when_saved(job, folder_glob, epochs_after=0, seconds=90):
    """SIGTERM `job` once a last.pt exists (and log.jsonl has epochs_after more SPT records); -> its stderr."""
    deadline, parent = time.time() + seconds, folder_glob.parent
    def spt_epochs():
        return [r["epoch"] for f in parent.glob(folder_glob.name) if (f / "log.jsonl").is_file()
                for r in records(f) if r.get("phase") == "spt"]
    start = len(spt_epochs())
    while (not list(parent.glob(f"{folder_glob.name}/last.pt")) or len(spt_epochs()) < start + epochs_after) \
            and time.time() < deadline and job.poll() is None:
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    return job.communicate(timeout=60)[1]


def test_sigterm_during_spt_prints_the_resume_command_and_it_works(data_dir, tmp_path):
    flags = ["--data-dir", str(data_dir), "--out", str(tmp_path), *TINY, "--model", "dlr", "--task", "listops",
             "--spt", "--pretrain-epochs", "2000", "--epochs", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([sys.executable, "train.py", *flags], cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, env=env)
    err = stop_when_saved(job, tmp_path / "*")
    (folder,) = tmp_path.iterdir()
    line = next((line for line in err.splitlines() if line.startswith("train.py:")), err[-1500:])
    assert job.returncode == 143 and "stopped by SIGTERM at spt epoch" in line, line
    assert line.endswith(f"python train.py --resume {folder}") and not list(folder.glob("*.tmp")), line
    command = line.rsplit("continue with: ", 1)[1].split()                # the command it printed, as it is
    again = subprocess.Popen([sys.executable, *command[1:]], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=env)
    err = stop_when_saved(again, tmp_path / folder.name, epochs_after=2, seconds=240)
    epochs = [r["epoch"] for r in records(folder) if r.get("phase") == "spt"]
    assert len(epochs) >= 3 and epochs == list(range(1, len(epochs) + 1)), \
        f"the resumed run's epochs: {epochs}; its exit code {again.returncode}, its stderr's end: {err[-1500:]}"


def test_a_sigterm_between_the_best_checkpoint_and_last_pt_waits_for_last_pt_and_the_run_resumes(data_dir, tmp_path,
                                                                                                  monkeypatch, capsys):
    # the race CI met: SIGTERM after spt.pt of epoch e, before last.pt of epoch e, left a folder resume must refuse
    save, sent = runs.save_checkpoint, []
    def save_then_sigterm(path, state):
        save(path, state)
        if path.name == "spt.pt" and not sent:                          # epoch 1: always a new best
            sent.append(state["epoch"])
            os.kill(os.getpid(), signal.SIGTERM)                      # lands between spt.pt and last.pt
    before = signal.getsignal(signal.SIGTERM)
    run_module.stop_on_sigterm()                                            # train.main installs it; the kill needs it now
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    monkeypatch.setattr(runs, "save_checkpoint", save_then_sigterm)
    try:
        with pytest.raises(SystemExit) as e:
            run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--spt", "--pretrain-epochs", "3",
                "--epochs", "1")
    finally:
        signal.signal(signal.SIGTERM, before)
        run_module.STOP["cause"] = "Ctrl-C"
    assert sent == [1], sent
    line = one_line(capsys, 143, f"stopped by SIGTERM at spt epoch {sent[0]}, writing checkpoints", e)
    (folder,) = tmp_path.iterdir()
    assert torch.load(folder / "last.pt", weights_only=True)["epoch"] == sent[0], f"last.pt was not written: {line}"
    monkeypatch.setattr(runs, "save_checkpoint", save)
    train.main(["--resume", str(folder)])
    epochs = [r["epoch"] for r in records(folder) if r.get("phase") == "spt"]
    assert epochs == [1, 2, 3] and (folder / "results.json").is_file(), f"the resumed run's SPT records: {epochs}"


def test_a_stop_held_in_a_block_that_fails_is_not_left_for_a_later_block(monkeypatch):
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setitem(run_module.STOP, "cause", "Ctrl-C")
    run_module.stop_on_sigterm()
    try:
        with pytest.raises(OSError):
            with run_module.held_stops():
                os.kill(os.getpid(), signal.SIGTERM)                  # held...
                time.sleep(0.01)
                raise OSError("disk full")                            # ...and the write then fails
        assert run_module.STOP["held"] == 0 and not run_module.STOP["pending"], run_module.STOP
        with run_module.held_stops():                                       # a later run's writes: nothing fires
            pass
        with pytest.raises(KeyboardInterrupt):                        # a held stop does fire at the block's end
            with run_module.held_stops():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_run_folder_another_run_made_in_the_same_second_gives_this_run_the_next_name(tmp_path, monkeypatch):
    monkeypatch.setattr(runs.time, "strftime", lambda fmt, *a: "20261204-120000")
    args = train.parse_flags(["--model", "dlr", "--task", "listops", "--out", str(tmp_path),
                              "--data-dir", str(tmp_path)])[0]
    stem = "listops-dlr-tfs-s0-20261204-120000"
    (tmp_path / stem).mkdir()                                         # the other run's, made a moment ago...
    monkeypatch.setattr(Path, "exists", lambda self: False)           # ...after any look this run took (the race)
    with runs.run_folder(args, {"command": []}, []) as first, runs.run_folder(args, {"command": []}, []) as second:
        names = first.name, second.name
    monkeypatch.undo()
    assert names == (f"{stem}+1", f"{stem}+2") and (tmp_path / f"{stem}+1" / "config.json").is_file(), names


def stopped_at_spt_epoch_2_then_resumed(data_dir, tmp_path, monkeypatch, before_stop):
    """A tiny SPT run whose log() call for SPT epoch 2 (last.pt is written by then) runs before_stop(folder, line)
    and raises Ctrl-C; then `--resume` of it. -> (the folder, its 'eval spt' lines of log.txt)."""
    log = runs.log
    def stop(folder, line, record=None):
        if record and record.get("phase") == "spt" and record["epoch"] == 2:
            before_stop(folder, line)
            raise KeyboardInterrupt
        log(folder, line, record)
    monkeypatch.setattr(runs, "log", stop)
    with pytest.raises(SystemExit):
        run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--spt", "--pretrain-epochs", "3",
            "--epochs", "1")
    monkeypatch.setattr(runs, "log", log)
    (folder,) = tmp_path.iterdir()
    assert torch.load(folder / "last.pt", weights_only=True)["epoch"] == 2
    train.main(["--resume", str(folder)])
    return folder, [line for line in (folder / "log.txt").read_text().splitlines() if line.startswith("eval spt")]


def test_a_stop_between_last_pt_and_its_log_record_loses_no_record(data_dir, tmp_path, monkeypatch):
    folder, evals = stopped_at_spt_epoch_2_then_resumed(data_dir, tmp_path, monkeypatch, lambda folder, line: None)
    epochs = [r["epoch"] for r in records(folder) if r.get("phase") == "spt"]
    assert epochs == [1, 2, 3] and len(evals) == 3, f"SPT records {epochs}, log.txt: {evals}"


def test_a_resume_after_a_cut_log_write_keeps_each_evaluation_once_and_every_record_whole(data_dir, tmp_path,
                                                                                           monkeypatch):
    def cut(folder, line):                                            # log.txt written, half a record
        with open(folder / "log.txt", "a") as f:
            f.write(line + "\n")
        with open(folder / "log.jsonl", "a") as f:
            f.write('{"phase": "spt", "ep')
    folder, evals = stopped_at_spt_epoch_2_then_resumed(data_dir, tmp_path, monkeypatch, cut)
    lines = (folder / "log.jsonl").read_text().splitlines()
    whole = [json.loads(line) for line in lines if not line.startswith('{"phase": "spt", "ep') or line.endswith("}")]
    assert [r["epoch"] for r in whole if r.get("phase") == "spt"] == [1, 2, 3] and len(evals) == 3, (lines, evals)
    assert len(lines) == len(whole) + 1, "the cut record stays a line of its own"


def test_a_stale_build_folder_of_a_dead_process_is_removed_and_a_live_ones_kept(tmp_path):
    generate_pathfinder(tmp_path, res=32, n=20, contour_length=14)
    ds = lra_data.load("pathfinder", "train", lra_data.Files(tmp_path, cache_dir=tmp_path / "c"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = ds.store.with_name(f"{ds.store.name}.building-{int(dead.stdout)}")
    live = ds.store.with_name(f"{ds.store.name}.building-{os.getppid()}")
    for folder in (stale, live):
        folder.mkdir()
        (folder / "all.x.npy").write_bytes(b"half a cache")
    lra_data.load("pathfinder", "train", lra_data.Files(tmp_path, cache_dir=tmp_path / "c"))
    assert not stale.exists() and live.exists(), "leftovers: the dead process's removed, the live one's kept"


# ---- runs of an older commit, from another folder ------------------------------------------------------------------

FLAGS = ["--model", "dlr", "--task", "listops", "--spt", "--pretrain-epochs", "2", "--epochs", "2"]


@pytest.fixture
def stopped_run(data_dir, tmp_path, monkeypatch):
    """(the folder of a run stopped by Ctrl-C in fine-tuning epoch 2, with last.pt of epoch 1; the results of the same
    run uninterrupted)."""
    from lab import steps
    full, _ = run(data_dir, tmp_path / "full", *FLAGS)
    step = interrupt_at_step(monkeypatch, 4)                        # the 4th optimiser step: fine-tuning epoch 2
    with pytest.raises(SystemExit):
        run(data_dir, tmp_path / "cut", *FLAGS)
    monkeypatch.setattr(steps, "guard_step", step)
    return next((tmp_path / "cut").iterdir()), full


def test_resume_of_a_run_saved_before_the_fused_optimiser_continues_it(stopped_run):
    folder, full = stopped_run
    ck = torch.load(folder / "last.pt", weights_only=True)
    assert ck["phase"] == "finetune" and ck["epoch"] == 1
    for group in ck["optimizer"]["param_groups"]:
        group["fused"] = None                                        # as commits before the device-side guard saved
    ck.pop("scaler")
    torch.save(ck, folder / "last.pt")
    results = train.main(["--resume", str(folder)])
    for key in ("test_acc", "test_loss"):
        assert abs(results[key] - full[key]) < 1e-6, f"{key}: resumed {results[key]}, uninterrupted {full[key]}"


def test_resume_of_a_checkpoint_this_code_cannot_read_names_its_commit(stopped_run, capsys):
    folder, _ = stopped_run
    ck = torch.load(folder / "last.pt", weights_only=True)
    del ck["rng"]
    torch.save(ck, folder / "last.pt")
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", str(folder)])
    commit = json.loads((folder / "config.json").read_text())["git"]
    one_line(capsys, 2, f"commit {commit}", e)


def test_resume_with_a_damaged_config_json_is_one_line(stopped_run, capsys):
    folder, _ = stopped_run
    (folder / "config.json").write_text('{"model_name": "dlr", "args": {')
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", str(folder)])
    one_line(capsys, 2, "config.json is damaged", e)


def test_resume_from_another_working_directory_reads_the_runs_own_data(tmp_path, monkeypatch):
    generate_listops(tmp_path / "a" / "data", 60, 9, 9, min_length=30, max_length=200)
    monkeypatch.chdir(tmp_path / "a")
    _, folder = run("data", "runs", "--model", "dlr", "--task", "listops", "--epochs", "2")   # relative paths
    full = json.loads((folder / "results.json").read_text())
    (folder / "results.json").unlink()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    results = train.main(["--resume", str(folder.resolve())])
    assert not (tmp_path / "b" / "data").exists(), "the resume made (or generated) a second data folder"
    assert results["test_acc"] == full["test_acc"] and Path(results["run_dir"]).is_absolute()


# ---- images read as they are ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, exact", [("I;16", False), ("RGB", True), ("P", False)])
def test_a_pathfinder_png_is_read_exactly_or_refused_never_clipped(mode, exact, tmp_path):
    folder = generate_pathfinder(tmp_path, res=32, n=20, contour_length=14)
    png = folder / "imgs" / "0" / "sample_3.png"
    grey = np.asarray(Image.open(png))                                # (32, 32) uint8
    if mode == "I;16":
        Image.fromarray(grey.astype(np.uint16) * 257).save(png)       # 16-bit grey: 54 levels would clip to 0 / 255
    else:
        Image.fromarray(grey).convert(mode).save(png)
    if exact:
        ds = lra_data.load("pathfinder", "train", lra_data.Files(tmp_path, cache_dir=tmp_path / "c"))
        assert np.array_equal(lra_files.read_pngs(([str(png)], 32))[0], grey.reshape(-1)) and len(ds)
    else:
        with pytest.raises(DataError, match=f"{png}: a {mode} image"):
            lra_data.load("pathfinder", "train", lra_data.Files(tmp_path, cache_dir=tmp_path / "c"))


# ---- every command-line tool checks its flags and paths first ------------------------------------------------------

def tool_main(script):
    """The main() of one of the repo's command-line tools, run in this process."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(Path(script).stem, REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("script, argv, says", [
    ("lra_data.py", ["--data-dir", "README.md"], "--data-dir README.md is a file"),
    ("lra_data.py", ["--task", "text", "--speed"], "--speed measures the Pathfinder generator"),
    ("lra_data.py", ["--workers", "0"], "--workers 0"),
    ("lra_data.py", ["--generate", "5"], "--generate 5"),
    ("lra_data.py", ["--task", "nope"], "--task"),
    ("lab/presets.py", ["--out", "results"], "--out results is a folder"),
    ("lab/presets.py", ["--nope"], "unrecognized arguments"),
    ("results/summarize.py", ["--runs", "no/such/folder"], "no/such/folder"),
    ("results/summarize.py", ["--runs", "docs"], "--runs docs: no run folders in it"),
    ("results/summarize.py", ["--out", "README.md"], "--out README.md is a file"),
    ("results/kernels.py", ["no/such/folder"], "no/such/folder"),
    ("results/kernels.py", ["results/study", "--length", "0"], "--length 0"),
    ("tools/bench.py", ["--device", "tpu"], "--device tpu"),
    ("tools/bench.py", ["--out", "results"], "--out results is a folder"),
])
def test_every_command_line_tool_refuses_a_bad_flag_in_one_line_with_status_2(script, argv, says, capsys,
                                                                             monkeypatch):
    monkeypatch.chdir(REPO)
    main = tool_main(script)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        code = main(argv)
        raise SystemExit(code)                         # lra_data.main returns its status
    err = capsys.readouterr().err.strip().splitlines()
    name = Path(script).name
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"{name}: error:") and says in err[0], \
        f"{script} {argv}: exit {e.value.code}, stderr {err!r}"


# ---- every numeric flag of every tool: finite, in range, at parse time -------------------------

TOOLS = ["train.py", "tools/bench.py", "lra_data.py", "lab/presets.py", "results/control.py", "results/kernels.py",
         "results/summarize.py", "lab/curves.py", "results/unigram.py", "results/why_spt.py", "tools/attention_offsets.py"]


class Caught(Exception):
    pass


def parser_of(script, monkeypatch):
    """The argparse parser a tool builds, caught at its parse_args (nothing else of the tool runs)."""
    import argparse
    caught = []
    def catch(self, *a, **k):
        caught.append(self)
        raise Caught
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", catch)
        with pytest.raises(Caught):
            tool_main(script)([])
    return caught[0]


def numeric_flags(parser):
    """The option strings of the flags whose type parses numbers."""
    found = []
    for action in parser._actions:
        if action.type is None or not action.option_strings:
            continue
        for text in ("1", "0.5", "10", "1.5"):
            try:
                if isinstance(action.type(text), (int, float)):
                    found.append(action.option_strings[-1])
                    break
            except Exception:
                continue
    return found


def commands():
    """Every command of the repo: each file (tests aside) with a `__main__` block whose command line is argparse's."""
    found = []
    for path in sorted(p for where in ("", "lab/", "lra/", "tools/", "results/") for p in REPO.glob(f"{where}*.py")):
        rel = path.relative_to(REPO).as_posix()                     # the repo's own code: not a venv inside it
        text = path.read_text(encoding="utf-8")
        if 'if __name__ == "__main__":' in text and "ArgumentParser" in text:
            found.append(rel)
    return found


def test_the_tools_list_holds_every_command_of_the_repo():
    assert set(commands()) == set(TOOLS), f"a command the flag checks do not walk: {set(commands()) ^ set(TOOLS)}"


def refused_at_start_up(knob, value, tmp_path, capsys):
    """train.py with model knob `knob` (a config field) at `value` for a model that has it: stopped in one line
    naming the flag, before any data or folder (the config's __post_init__ holds the knob's range)."""
    import models
    model = models.knobs()[knob][2][0]
    flag = "--" + knob.replace("_", "-")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(["--model", model, flag, value, "--data-dir", str(tmp_path / "nothing"), "--out",
                    str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    return e.value.code == 2 and len(err) == 1 and flag in err[0] and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script", commands())
def test_every_numeric_flag_of_every_command_has_a_range_checked_before_it_acts(script, monkeypatch, tmp_path,
                                                                              capsys):
    """A numeric flag refuses a value out of its range: at least one of -1e18 and 1e18 (a count, a rate, a size, a
    seed all have one), besides nan and the infinities (the test below): its type at parse time, or, for a model
    knob of train.py (a config field, whose range its config's __post_init__ declares), the run's opening, in one
    line, before any data or folder."""
    monkeypatch.chdir(REPO)
    parser = parser_of(script, monkeypatch)
    unranged = []
    for action in parser._actions:
        if action.option_strings and action.option_strings[-1] in numeric_flags(parser):
            refused = 0
            for value in ("-1e18", "1e18", "-1000000000000000000", "1000000000000000000"):
                try:
                    action.type(value)
                except Exception:
                    refused += 1
            knob = action.dest
            if not refused and not (script == "train.py" and knob in __import__("models").knobs() and any(
                    refused_at_start_up(knob, v, tmp_path, capsys) for v in ("-1e18", "1e18"))):
                unranged.append(action.option_strings[-1])
    assert not unranged, f"{script}: numeric flags without a range: {unranged}"


@pytest.mark.parametrize("script", TOOLS)
def test_every_numeric_flag_of_every_tool_refuses_nan_and_infinities_in_one_line(script, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    parser = parser_of(script, monkeypatch)
    flags = numeric_flags(parser)
    assert all(a.type not in (int, float) for a in parser._actions if a.option_strings and a.type), \
        f"{script}: a numeric flag with a bare int/float type has no range check"
    for flag in flags:
        for value in ("nan", "inf", "-inf", "1e999"):
            capsys.readouterr()
            with pytest.raises(SystemExit) as e:
                code = tool_main(script)([flag, value])
                raise SystemExit(code)
            err = capsys.readouterr().err.strip().splitlines()
            assert e.value.code == 2 and len(err) == 1 and flag in err[0] and "Traceback" not in err[0], \
                f"{script} {flag} {value}: exit {e.value.code}, stderr {err!r}"


def test_train_py_numeric_flags_include_the_objectives_and_the_seed(monkeypatch):
    flags = numeric_flags(parser_of("train.py", monkeypatch))
    assert {"--lr", "--weight-decay", "--rtd-weight", "--span-mean", "--mask-ratio", "--seed", "--data-fraction"} \
        <= set(flags), flags


@pytest.mark.parametrize("seed, ok", [("-1", False), (str(2**62), True), (str(2**62 + 1), False), (str(2**64), False)])
def test_the_seed_has_a_range_that_leaves_room_for_the_seeds_derived_from_it(seed, ok, capsys):
    from tools import checked
    if ok:
        assert train.parse_flags(["--seed", seed])[0].seed == int(seed)
        for derived in (int(seed) + 4, int(seed) + 1000 * 4096 + 10**6):   # seed + 4; seed + 1000·rank + epoch
            torch.Generator().manual_seed(derived)
            torch.manual_seed(derived)
        assert checked.SEED_MAX + 1000 * 10**6 < 2**64
        return
    with pytest.raises(SystemExit) as e:
        train.parse_flags(["--seed", seed])
    one_line(capsys, 2, "--seed", e)


def test_bench_refuses_repeated_lengths_before_measuring_and_a_fit_never_divides_by_zero(capsys):
    from tools import bench
    from tools import speed
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--lengths", "256", "256", "256", "--fit-from", "256"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--lengths 256 256 256" in err[0], err
    rows = [dict(model="m", L=256, B=1, seconds=1e-3)] * 3 + [dict(model="m", L=512, B=1, seconds=2e-3)]
    fit = speed.fit_exponent(rows, "m", 256)
    assert fit["p"] is None and "needs" in fit["why"], "two distinct lengths fit no exponent (and never divide by 0)"


def test_the_control_driver_refuses_zero_jobs_or_epochs_before_deleting_anything(tmp_path, capsys):
    control = tool_main("results/control.py")
    out = tmp_path / "control"
    folder = out / "text-dlr-spt-s0-a"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"args": {"model": "dlr", "seed": 0, "spt": True, "epochs": 9,
                                                             "pretrain_epochs": 3}}))
    for argv in (["--jobs", "0"], ["--finetune-epochs", "0"], ["--pretrain-epochs", "0"]):
        with pytest.raises(SystemExit) as e:
            control(["--finetune-epochs", "9", "--out", str(out), "--console", str(tmp_path / "c"), *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and argv[0] in err[0], (argv, err)
        assert (folder / "config.json").is_file(), f"{argv}: the stopped run's folder was deleted before the check"


def test_a_non_finite_validation_loss_stops_the_run_and_best_pt_stays_the_last_finite_one(data_dir, tmp_path,
                                                                                         monkeypatch, capsys):
    calls, evaluate = [], steps.evaluate
    def nan_from_the_second(*a, **k):
        calls.append(1)
        val = evaluate(*a, **k)
        return dict(val, loss=float("nan")) if len(calls) >= 2 else val
    monkeypatch.setattr(steps, "evaluate", nan_from_the_second)
    with pytest.raises(SystemExit) as e:
        run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--epochs", "3")
    line = one_line(capsys, 2, "finetune epoch 2: validation loss nan is not finite", e)
    folder = next(tmp_path.iterdir())
    assert "best.pt holds epoch 1" in line, line
    for name in ("best.pt", "last.pt"):
        assert runs.read_checkpoint(folder / name)["epoch"] == 1, f"{name} holds the non-finite model"


# ---- flags a run does not use are named (point 5) -----------------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["--spt", "--objective", "masked", "--span-mean", "4"], "--span-mean belongs to --objective span, not masked: "
                                                              "ignored"),
    (["--spt", "--objective", "span", "--rtd-weight", "2", "--no-gdes"], "--gdes, --rtd-weight belong to "
                                                                         "--objective rtd, not span: ignored"),
    (["--span-mean", "4"], "--span-mean only acts with --spt: ignored"),
])
def test_a_flag_the_chosen_objective_does_not_use_is_named_as_ignored(argv, says):
    args, given, _ = train.parse_flags(argv)
    notes = models.unused_flag_notes(args, given)
    assert len(notes) == 1 and says in notes[0], notes
    args, given, _ = train.parse_flags(["--spt", "--objective", "span", "--span-mean", "4", "--mask-ratio", "0.2"])
    assert models.unused_flag_notes(args, given) == [], "the objective's own flags are used"


# ---- a tool overwrites or deletes only its own files (point 1) ----------------------------------------------------

@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    """A study folder of two finished tiny ListOps runs (seeds 0, 1)."""
    root = tmp_path_factory.mktemp("study")
    generate_listops(root / "data", 16, 8, 8, min_length=10, max_length=60)
    for seed in ("0", "1"):
        train.main(["--model", "dlr", "--task", "listops", "--preset", "tiny", "--d-model", "8", "--n-layers", "1",
                    "--d-state", "8", "--batch-size", "16", "--epochs", "1", "--seed", seed, "--data-dir",
                    str(root / "data"), "--out", str(root / "study")])
    return root / "study"


def test_summarize_deletes_and_overwrites_only_its_own_files_in_out(tiny_study, tmp_path, capsys):
    summarize = tool_main("results/summarize.py")
    out = tmp_path / "out"
    out.mkdir()
    (out / "my_val_acc_plot.png").write_bytes(b"the user's own figure")
    summarize(["--runs", str(tiny_study), "--out", str(out)])
    from tools import checked
    ours = checked.manifest(out)
    assert (out / "my_val_acc_plot.png").read_bytes() == b"the user's own figure", "a user's figure was deleted"
    assert "summary.md" in ours and any(n.endswith(".png") for n in ours), ours
    (out / "study_val_acc_gone_0.png").write_bytes(b"an old plot of ours")          # a plot it no longer draws
    checked.record(out, "study_val_acc_gone_0.png", "summarize.py")
    os.utime(out / "study_val_acc_gone_0.png", (0, 0))
    summarize(["--runs", str(tiny_study), "--out", str(out)])
    assert not (out / "study_val_acc_gone_0.png").exists(), "its own stale plot was kept"
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "summary.md").write_text("the user's notes")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        summarize(["--runs", str(tiny_study), "--out", str(tmp_path / "theirs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "summary.md exists and summarize.py did not write it" in err[0]
    assert (tmp_path / "theirs" / "summary.md").read_text() == "the user's notes"
    assert os.listdir(tmp_path / "theirs") == ["summary.md"], "a plot was written before the refusal"


@pytest.mark.parametrize("script, argv, says", [
    ("tools/bench.py", ["--out", "{tmp}/b.md"], "pass a .json name"),
    ("tools/bench.py", ["--out", "{tmp}/mine.json"], "mine.json exists and tools/bench.py did not write it"),
    ("tools/bench.py", ["--out", "{tmp}/mine"], "mine.md exists and tools/bench.py did not write it"),
    ("tools/bench.py", ["--out", "/proc/bench/b.json"], "--out /proc/bench/b.json: cannot write there"),
    ("lab/presets.py", ["--out", "{tmp}/mine.json"], "exists and lab/presets.py did not write it"),
])
def test_a_tool_refuses_to_overwrite_a_file_it_did_not_write_and_formats_never_share_a_path(script, argv, says,
                                                                                          tmp_path, capsys):
    for name in ("mine.json", "mine.md"):
        (tmp_path / name).write_text("the user's")
    argv = [a.format(tmp=tmp_path) for a in argv]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        tool_main(script)(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err
    assert all((tmp_path / n).read_text() == "the user's" for n in ("mine.json", "mine.md"))
    assert not (tmp_path / "b.md").exists()


def test_the_control_driver_sets_a_stopped_run_aside_with_every_file_in_it(tmp_path):
    control = tool_main("results/control.py").__globals__
    for _ in range(2):                                      # the second time beside the first, not over it
        folder = tmp_path / "text-dlr-spt-s0-a"
        folder.mkdir()
        for name in ("config.json", "log.txt", ".lock", "last.pt.tmp", "notes.txt"):
            (folder / name).write_text("x")
        aside = control["set_aside"](folder)
        assert not folder.exists() and sorted(os.listdir(aside)) == [".lock", "config.json", "last.pt.tmp",
                                                                    "log.txt", "notes.txt"]
    assert sorted(os.listdir(tmp_path / "stopped")) == ["text-dlr-spt-s0-a", "text-dlr-spt-s0-a+"]


# ---- every file read is checked where it is read (point 2) --------------------------------------------------------

def cifar_folder(root):
    """A cifar-10-batches-py folder of 5 + 1 batches of 4 images each."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 3]}
        (folder / name).write_bytes(__import__("pickle").dumps(batch))
    return folder


def damaged_listops(root):
    folder = root / "listops-1000"
    generate_listops(root, 20, 5, 5, min_length=10, max_length=60)
    return folder


@pytest.mark.parametrize("damage, task, says", [
    ("cifar cut", "image", "data_batch_3: a damaged CIFAR-10 batch"),
    ("metadata cut", "pathfinder", "0.npy: a damaged metadata array"),
    ("listops not utf-8", "listops", "basic_val.tsv:3: not UTF-8 text"),
    ("review dangling", "text", "cannot read"),
    ("listops unreadable", "listops", "cannot read"),
])
def test_a_damaged_or_unreadable_source_file_is_one_line_naming_it(damage, task, says, tmp_path, monkeypatch):
    if damage == "cifar cut":
        path = cifar_folder(tmp_path) / "data_batch_3"
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "metadata cut":
        folder = generate_pathfinder(tmp_path, res=32, n=20, contour_length=14)
        meta = folder / "metadata" / "0.npy"
        rows = np.array([line.split() for line in meta.read_text().splitlines()])
        with open(meta, "wb") as f:
            np.save(f, rows)                                          # the original generator's binary format
        meta.write_bytes(meta.read_bytes()[:-40])
    elif damage.startswith("listops"):
        path = damaged_listops(tmp_path) / "basic_val.tsv"
        if damage == "listops not utf-8":
            lines = path.read_bytes().split(b"\n")
            lines[2] = lines[2][:5] + b"\xff" + lines[2][5:]
            path.write_bytes(b"\n".join(lines))
        else:
            real = open
            def denied(file, *a, **k):
                if str(file) == str(path):
                    raise PermissionError(errno.EACCES, "Permission denied", str(file))
                return real(file, *a, **k)
            monkeypatch.setattr("builtins.open", denied)
    else:
        for split in ("train", "test"):
            for label in ("pos", "neg"):
                d = tmp_path / "aclImdb" / split / label
                d.mkdir(parents=True)
                (d / "0_1.txt").write_text("a fine review")
        (tmp_path / "aclImdb" / "train" / "pos" / "1_1.txt").symlink_to(tmp_path / "nowhere.txt")
    with pytest.raises(DataError) as e:
        lra_data.load(task, "train", lra_data.Files(tmp_path, cache_dir=tmp_path / "c"))
    message = str(e.value)
    assert says in message and "\n" not in message and "free some space" not in message, message
    assert not list((tmp_path / "c").glob("*/*")) if (tmp_path / "c").exists() else True


@pytest.mark.parametrize("damage", ["meta.json cut", "labels deleted", "tokens cut"])
def test_a_cache_that_fails_its_check_is_rebuilt_not_trusted(damage, tmp_path, capsys):
    damaged_listops(tmp_path)
    files = lra_data.Files(tmp_path, cache_dir=tmp_path / "c")
    first = lra_data.load("listops", "train", files)
    store = first.store
    if damage == "meta.json cut":
        (store / "meta.json").write_text((store / "meta.json").read_text()[:30])
    elif damage == "labels deleted":
        (store / "val.y.npy").unlink()
    else:
        (store / "train.tok").write_bytes((store / "train.tok").read_bytes()[:50])
    capsys.readouterr()
    again = lra_data.load("listops", "train", files)
    assert "rebuilding it" in capsys.readouterr().out
    assert [again[i][0].tolist() for i in range(len(again))] == [first[i][0].tolist() for i in range(len(first))]
    assert len(lra_data.load("listops", "val", files)) == 5


@pytest.mark.parametrize("damage", ["config.json cut", "results.json cut", "log.jsonl missing", "log.txt cut in a char"])
def test_summarize_skips_a_damaged_run_folder_with_a_note_and_goes_on(damage, tiny_study, tmp_path, capsys):
    import shutil
    study = tmp_path / "study"
    shutil.copytree(tiny_study, study)
    folders = sorted(study.iterdir())
    bad = folders[1]
    if damage == "log.jsonl missing":
        (bad / "log.jsonl").unlink()
    elif damage == "log.txt cut in a char":
        (bad / "log.txt").write_bytes((bad / "log.txt").read_bytes() + "é".encode()[:1])
        (bad / "results.json").write_text(json.dumps({k: v for k, v in json.loads(
            (bad / "results.json").read_text()).items() if k != "n_train"}))        # read from log.txt, then
    else:
        name = damage.split()[0]
        (bad / name).write_text((bad / name).read_text()[:40])
    capsys.readouterr()
    tool_main("results/summarize.py")(["--runs", str(study), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert folders[0].name in summary, "the sound run is missing from the summary"
    if damage == "log.txt cut in a char":
        assert bad.name in summary, "a log.txt cut inside a character must still be read"
    else:
        assert f"note: {bad / damage.split()[0]}" in out and bad.name not in summary.split("## Runs")[1], out


# ---- a resume is checked up front against the run's own files (point 3) -------------------------------------------

def test_resume_of_a_folder_whose_last_pt_is_another_models_stops_before_training(stopped_run, tmp_path, capsys):
    folder, _ = stopped_run
    ck = torch.load(folder / "last.pt", weights_only=True)
    ck["model_name"], ck["config"] = "s4", {**ck["config"], "d_model": 32}
    torch.save(ck, folder / "last.pt")
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", str(folder)])
    one_line(capsys, 2, "the folder mixes two runs", e)


@pytest.mark.parametrize("damage", ["deleted", "cut", "another epoch's"])
def test_resume_with_the_best_checkpoint_missing_or_not_the_runs_stops_before_any_training(damage, stopped_run,
                                                                                           monkeypatch, capsys):
    from lab import steps
    folder, _ = stopped_run
    if damage == "deleted":
        (folder / "best.pt").unlink()
    elif damage == "cut":
        (folder / "best.pt").write_bytes((folder / "best.pt").read_bytes()[:100])
    else:
        ck = torch.load(folder / "best.pt", weights_only=True)
        ck["epoch"] = 7
        torch.save(ck, folder / "best.pt")
    monkeypatch.setattr(steps, "guard_step", lambda *a: pytest.fail("trained before the check"))
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", str(folder)])
    line = one_line(capsys, 2, "best.pt (finetune epoch 1's best, which the test reads) is", e)
    assert {"deleted": "missing", "cut": "damaged", "another epoch's": "of finetune epoch 7"}[damage] in line, line


def test_a_resume_reads_moved_data_from_the_data_dir_given_once_it_is_checked_the_same(stopped_run, data_dir,
                                                                                       tmp_path, capsys):
    import shutil
    folder, full = stopped_run
    moved = tmp_path / "moved"
    shutil.copytree(data_dir, moved, ignore=shutil.ignore_patterns("cache"))
    gone = tmp_path / "gone"
    config = json.loads((folder / "config.json").read_text())
    for path in (folder / "config.json",):                           # the run's data folder is not there any more
        path.write_text(json.dumps({**config, "args": {**config["args"], "data_dir": str(gone)}}))
    ck = torch.load(folder / "last.pt", weights_only=True)
    ck["args"]["data_dir"] = str(gone)
    torch.save(ck, folder / "last.pt")
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", str(folder)])
    one_line(capsys, 2, f"its data folder {gone} is gone; if it moved, add --data-dir", e)
    other = tmp_path / "other"
    generate_listops(other, 60, 9, 9, seed=1, min_length=30, max_length=200)   # other trees
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", str(folder), "--data-dir", str(other)])
    one_line(capsys, 2, "cannot be shown to be the data this run trained on", e)
    results = train.main(["--resume", str(folder), "--data-dir", str(moved)])
    assert "data: the run's own data (sizes, labels, examples compared), now at" in capsys.readouterr().out
    assert abs(results["test_acc"] - full["test_acc"]) < 1e-6, "the moved data gave another run"


def test_a_full_disk_at_the_run_folders_first_file_leaves_no_stub(data_dir, tmp_path, monkeypatch, capsys):
    real = runs.write_whole
    def full(path, write):
        if path.name == "config.json":
            return real(path, lambda tmp: (tmp.write_text("{"), (_ for _ in ()).throw(NO_SPACE)))
        return real(path, write)
    monkeypatch.setattr(runs, "write_whole", full)
    with pytest.raises(SystemExit) as e:
        run(data_dir, tmp_path / "runs", "--model", "dlr", "--task", "listops", "--epochs", "1")
    one_line(capsys, 2, "cannot write", e)
    assert list((tmp_path / "runs").iterdir()) == [], "a run folder stub was left on the full disk"


# ---- another user's lock, read-only places (point 6) ----------------------------------------------------------------

def test_another_users_lock_file_is_opened_read_only_and_one_that_cannot_be_opened_is_one_line(data_dir, tmp_path,
                                                                                              monkeypatch, capsys):
    real, refused = open, {"a"}
    def foreign(file, mode="r", *a, **k):                            # root passes chmod: refuse as the OS would
        if str(file).endswith(".lock") and mode in refused and os.path.exists(file):   # an existing one
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real(file, mode, *a, **k)
    monkeypatch.setattr("builtins.open", foreign)
    results, _ = run(data_dir, tmp_path / "a", "--model", "dlr", "--task", "listops", "--epochs", "1")
    assert results["test_acc"] >= 0, "a lock file of another user's (mode 644) stopped the run"
    refused.add("r")
    with pytest.raises(SystemExit) as e:
        run(data_dir, tmp_path / "b", "--model", "dlr", "--task", "listops", "--epochs", "1")
    line = one_line(capsys, 2, "cannot open the lock file", e)
    assert "make it writable" in line and "free some space" not in line, line


def test_a_read_only_working_folder_with_the_default_data_dir_says_make_it_writable(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    real = os.mkdir
    def read_only(path, *a, **k):
        if str(Path(path).resolve()).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *a, **k)
    monkeypatch.setattr(os, "mkdir", read_only)
    with pytest.raises(SystemExit) as e:
        train.main(["--model", "dlr", "--task", "listops", "--generate", "100", *TINY, "--out", str(tmp_path / "r")])
    line = one_line(capsys, 2, "cannot write the generated data", e)
    assert "make it writable" in line and "free some space" not in line, line


def test_a_resume_after_a_log_txt_cut_inside_a_character_continues_and_ends_the_line(stopped_run):
    folder, full = stopped_run
    with open(folder / "log.txt", "ab") as f:
        f.write("eval finetune epoch 2 … é".encode()[:-1])               # a kill inside a 2-byte character
    results = train.main(["--resume", str(folder)])
    assert abs(results["test_acc"] - full["test_acc"]) < 1e-6
    text = (folder / "log.txt").read_bytes().decode("utf-8", errors="replace")
    assert "\ufffd\n" in text and text.rstrip().splitlines()[-1].startswith("done in"), text[-300:]


def test_a_full_disk_at_the_first_checkpoint_is_one_line_and_leaves_no_run_folder(data_dir, tmp_path, monkeypatch,
                                                                                  capsys):
    save = torch.save
    def full(obj, f, *a, **k):                                       # torch's writer meets a real ENOSPC
        with open("/dev/full", "wb") as dev:
            return save(obj, dev, *a, **k)
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SystemExit) as e:
        run(data_dir, tmp_path / "runs", "--model", "dlr", "--task", "listops", "--epochs", "1")
    line = one_line(capsys, 2, "cannot write", e)
    assert "best.pt" in line and "free some space" in line, line
    assert list((tmp_path / "runs").iterdir()) == [], "a run folder without a checkpoint was left"


def test_a_path_that_is_not_utf_8_is_used_as_the_bytes_the_os_gave(tmp_path):
    odd = tmp_path / os.fsdecode(b"caf\xe9")                       # Latin-1 bytes: not valid UTF-8
    generate_listops(odd / "data", 60, 9, 9, min_length=30, max_length=200)
    done = subprocess.run([sys.executable, "train.py", "--data-dir", str(odd / "data"), "--out", str(odd / "runs"),
                           *TINY, "--model", "dlr", "--task", "listops", "--epochs", "1"], cwd=REPO,
                          capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"})
    assert done.returncode == 0, done.stderr[-2000:]
    (folder,) = (odd / "runs").iterdir()
    assert b"caf\xe9/runs" in done.stdout and b"caf\xe9/runs" in (folder / "log.txt").read_bytes(), \
        "the console and log.txt must show the path's own bytes"
    assert runs.read_checkpoint(folder / "best.pt")["epoch"] == 1


def test_a_cache_folder_holding_files_no_cache_holds_is_never_replaced(tmp_path):
    damaged_listops(tmp_path)
    files = lra_data.Files(tmp_path, cache_dir=tmp_path / "c")
    store = lra_data.load("listops", "train", files).store
    (store / "meta.json").unlink()
    (store / "my_notes.txt").write_text("the user's")
    with pytest.raises(DataError, match="holds my_notes.txt, which no cache of this repo holds"):
        lra_data.load("listops", "train", files)
    assert (store / "my_notes.txt").read_text() == "the user's"


@pytest.mark.parametrize("model", ["s4", "dlr"])
def test_a_negative_ssm_learning_rate_is_refused_in_one_line_before_any_folder(model, tmp_path, capsys):
    # a negative --ssm-lr would train the SSM parameters by gradient ascent, exit 0
    with pytest.raises(SystemExit) as e:
        train.main(["--model", model, "--task", "listops", "--ssm-lr", "-1", "--data-dir", str(tmp_path),
                    "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "ssm_lr=-1" in err[0] and "must be > 0" in err[0], err
    assert not (tmp_path / "runs").exists(), "a run folder was made for a refused run"


@pytest.mark.parametrize("env, says", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 without MASTER_ADDR and MASTER_PORT"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000", "RANK": "0"}, "MASTER_PORT=70000"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "3"}, "RANK=3 is outside"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer")])
def test_a_ddp_environment_that_cannot_start_is_one_line_before_the_data_is_prepared(env, says, tmp_path,
                                                                                  monkeypatch, capsys):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:          # before the data: no data folder is even looked at
        train.main(["--model", "dlr", "--task", "listops", "--data-dir", str(tmp_path), "--out",
                    str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err
    assert [p.name for p in tmp_path.iterdir() if p.name != "runs"] == [], "data was prepared first"
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_compile_without_a_c_compiler_is_one_line_at_start_up_not_a_failure_in_the_first_step(tmp_path,
                                                                                            monkeypatch, capsys):
    from lab import hardware
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(SystemExit) as e:
        train.main(["--model", "dlr", "--task", "listops", "--compile", "--data-dir", str(tmp_path), "--out",
                    str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--compile needs a C/C++ compiler" in err[0], err
    assert [p.name for p in tmp_path.iterdir() if p.name != "runs"] == [], "data was prepared first"


def rendezvous_alone(timeout_s):
    """A process of a 2-process DDP run whose peer never comes, at the rendezvous (lab/hardware.join_process_group),
    with train.py's SIGTERM handler installed and the rendezvous timeout set to timeout_s."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = ("import torch; from lab import hardware, run; run.stop_on_sigterm(); "
            f"hardware.RENDEZVOUS_S = {timeout_s}; hardware.join_process_group(torch.device('cpu'), 2)")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)


def test_a_ddp_rendezvous_whose_peer_never_comes_stops_in_one_line_after_its_timeout():
    proc = rendezvous_alone(3)
    err = proc.communicate(timeout=120)[1].strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "the DDP rendezvous at 127.0.0.1" in err[0] \
        and "WORLD_SIZE=2" in err[0], (proc.returncode, err)


def test_a_sigterm_during_the_ddp_rendezvous_ends_the_process_at_once():
    proc = rendezvous_alone(300)
    time.sleep(8)                                                      # imports done, waiting for its peer
    assert proc.poll() is None, proc.communicate()
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM and time.time() - t0 < 10, (proc.returncode, time.time() - t0)


# Where a command writes a file without checked.write_owned / write_whole (a temporary file renamed over its own),
# and why that is safe. A new raw write elsewhere fails the test below: route it through tools/checked.py.
RAW_WRITES = {
    "lab/hardware.py": "ranks above 0 print to os.devnull",
    "lab/memory.py": "/proc/self/clear_refs, the kernel's counter reset",
    "lab/runs.py": "a checkpoint into its temporary file (the line above opens it), then renamed over last.pt",
    "lra/cache.py": "the arrays of a build, inside its private folder that then replaces the store whole",
    "results/control.py": "each run's console, appended in --console (not committed)",
    "results/why_spt.py": "each run's console, appended in --console (not committed)",
    "tools/checked.py": "the lock file, opened for a lock, never written",
    "tools/gpu_summary.py": "a part's log, appended in the check's private work folder",
}


def test_every_command_writes_its_files_whole_and_over_its_own_only_or_says_why_not():
    import re
    raw = re.compile(r'write_text\(|write_bytes\(|open\([^)]*"(?:w|wb|a)"|savefig\(|torch\.save\(|np\.save\(')
    found = {}
    for path in sorted(p for where in ("", "lab/", "lra/", "tools/", "results/") for p in REPO.glob(f"{where}*.py")):
        rel = path.relative_to(REPO).as_posix()                     # the repo's own code: not a venv inside it
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if raw.search(line) and "tmp" not in line:            # inside write_whole's writer: the temporary file
                found.setdefault(rel, []).append(f"{number}: {line.strip()}")
    assert set(found) <= set(RAW_WRITES), {k: v for k, v in found.items() if k not in RAW_WRITES}
    assert set(RAW_WRITES) <= set(found), f"no raw write left in {set(RAW_WRITES) - set(found)}: drop it from RAW_WRITES"
