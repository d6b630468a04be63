"""Facts about the faults long runs meet (runs.py, lra/cache.py, the generators, every command-line tool): a full disk
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
import runs
import train
from conftest import TINY, records, run
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
    def save_until_full(obj, path, *a, **k):                         # the third checkpoint finds the disk full
        calls.append(path)
        if len(calls) == 3:
            Path(path).write_bytes(b"half a checkpoint")
            raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file")
        return save(obj, path, *a, **k)
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
    def interrupted(obj, path, *a, **k):
        Path(path).write_bytes(b"half")
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
    stop_when_saved(again, tmp_path / folder.name, epochs_after=2)
    epochs = [r["epoch"] for r in records(folder) if r.get("phase") == "spt"]
    assert len(epochs) >= 3 and epochs == list(range(1, len(epochs) + 1)), f"the resumed run's epochs: {epochs}"


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
    import steps
    full, _ = run(data_dir, tmp_path / "full", *FLAGS)
    calls, step = [], steps.guard_step
    def stop(*a):                                                    # the 4th optimiser step: fine-tuning epoch 2
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return step(*a)
    monkeypatch.setattr(steps, "guard_step", stop)
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
    ("models.py", ["--out", "results"], "--out results is a folder"),
    ("models.py", ["--nope"], "unrecognized arguments"),
    ("results/summarize.py", ["--runs", "no/such/folder"], "no/such/folder"),
    ("results/summarize.py", ["--runs", "docs"], "--runs docs: no run folders in it"),
    ("results/summarize.py", ["--out", "README.md"], "--out README.md is a file"),
    ("results/kernels.py", ["no/such/folder"], "no/such/folder"),
    ("results/kernels.py", ["results/study", "--length", "0"], "--length 0"),
    ("bench.py", ["--device", "tpu"], "--device tpu"),
    ("bench.py", ["--out", "results"], "--out results is a folder"),
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
