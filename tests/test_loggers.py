"""Facts about lab/loggers.py (--log-to): TensorBoard's event files, read back with TensorBoard's own reader, hold
log.jsonl's values at their steps, and a stopped and resumed run continues the same curves without a repeated point;
wandb in offline mode (no account, no network) writes its run folder with the same values; a missing package stops in
one line naming the pip command; under DDP only rank 0 logs."""
import importlib.util
import json
import math
import time

import pytest

from lab import steps
import train
from conftest import interrupt_at_step, records, run
from lra.listops import generate_listops
from lab import loggers

FLAGS = ["--model", "dlr", "--task", "listops", "--spt", "--pretrain-epochs", "2", "--epochs", "2"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    generate_listops(root, 40, 8, 8, min_length=30, max_length=150)
    return root


def tensorboard_scalars(run_dir):
    """{tag: [(step, value)]} from every event file of <run_dir>/tensorboard, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def expected_points(run_dir):
    """The points log.jsonl implies: {'<phase>/<key>': [(step, value)]}, the test at the last fine-tuning step."""
    points, step = {}, 0
    for r in records(run_dir):
        step = r.get("step", step)
        for key, value in loggers.scalars(r).items():
            points.setdefault(f"{r['phase']}/{key}", []).append((step, value))
    return points


def assert_same_points(run_dir):
    got, want = tensorboard_scalars(run_dir), expected_points(run_dir)
    assert set(got) == set(want), f"tags: only in TensorBoard {set(got) - set(want)}, only in log.jsonl " \
                                  f"{set(want) - set(got)}"
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], f"{tag}: steps {got[tag]} vs {points}"
        for (_, a), (_, b) in zip(got[tag], points):
            assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6), f"{tag}: TensorBoard {a}, log.jsonl {b}"


def test_tensorboard_events_hold_every_record_of_log_jsonl_at_its_step(data_dir, tmp_path):
    pytest.importorskip("tensorboard", reason="--log-to tensorboard needs it: pip install tensorboard")
    _, run_dir = run(data_dir, tmp_path, *FLAGS, "--log-to", "tensorboard")
    assert_same_points(run_dir)
    tags = tensorboard_scalars(run_dir)
    assert len(tags["spt/val_loss"]) == 2 and len(tags["finetune/val_acc"]) == 2 and "test/test_acc" in tags
    assert (run_dir / "tensorboard" / "records_sent.txt").read_text().strip() == str(len(records(run_dir)))


def test_a_stopped_and_resumed_run_continues_the_same_tensorboard_curves(data_dir, tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboard", reason="--log-to tensorboard needs it: pip install tensorboard")
    step = interrupt_at_step(monkeypatch, 4)  # a Ctrl-C in fine-tuning epoch 2, after SPT's two evaluations
    with pytest.raises(SystemExit):
        run(data_dir, tmp_path, *FLAGS, "--log-to", "tensorboard", "--batch-size", "16", "--max-train", "16")
    monkeypatch.setattr(steps, "guard_step", step)
    (run_dir,) = tmp_path.iterdir()
    assert len(tensorboard_scalars(run_dir)["spt/val_loss"]) == 2 and "finetune/val_acc" in tensorboard_scalars(
        run_dir), "the stopped part was not logged"
    train.main(["--resume", str(run_dir)])   # --log-to tensorboard is the run's own setting
    assert_same_points(run_dir)              # each point once, over both processes' event files
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_wandb_offline_writes_its_run_folder_with_the_logged_values(data_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="--log-to wandb needs it: pip install wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    results, run_dir = run(data_dir, tmp_path, *FLAGS, "--log-to", "wandb")
    import wandb
    wandb.teardown()                         # wandb's service process writes the file; wait until it is done
    (data,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")     # wandb's own record of the run
    for _ in range(60):
        if b"test/test_acc" in (raw := data.read_bytes()):
            break
        time.sleep(0.5)
    last = [r for r in records(run_dir) if r["phase"] == "finetune"][-1]
    for text in ("spt/val_loss", "finetune/val_acc", "finetune/step", "test/test_acc", json.dumps(last["val_loss"])):
        assert text.encode() in raw, f"{text} is not in {data}"


def test_a_missing_logger_package_stops_in_one_line_naming_the_pip_command(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SystemExit) as stop:
        train.parse_flags(["--log-to", "wandb"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "pip install wandb" in err[0], err


def test_only_rank_0_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with loggers.mirror("tensorboard", tmp_path, {}):
        pass
    assert not (tmp_path / "tensorboard").exists()


def test_a_logger_that_cannot_run_stops_in_one_line_before_any_run_folder_and_a_resume_goes_on_without_it(
        data_dir, tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboard", reason="--log-to tensorboard needs it: pip install tensorboard")
    real = loggers.importlib.import_module

    def broken(name, *a):                    # installed, but its import fails (a half-upgraded package)
        if name == "torch.utils.tensorboard":
            raise ImportError("cannot import name 'x' from partially initialized module")
        return real(name, *a)
    with monkeypatch.context() as m:
        m.setattr(loggers.importlib, "import_module", broken)
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            run(data_dir, tmp_path / "runs", *FLAGS, "--log-to", "tensorboard")
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "--log-to tensorboard: the tensorboard package does not " \
            "import" in err[0], err
        assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "a stub run folder"
    step = interrupt_at_step(monkeypatch, 4)
    with pytest.raises(SystemExit):
        run(data_dir, tmp_path / "stopped", *FLAGS, "--log-to", "tensorboard", "--batch-size", "16",
            "--max-train", "16")
    monkeypatch.setattr(steps, "guard_step", step)
    (run_dir,) = (tmp_path / "stopped").iterdir()
    monkeypatch.setattr(loggers.importlib, "import_module", broken)
    capsys.readouterr()
    results = train.main(["--resume", str(run_dir)])           # the package broke meanwhile: go on without it
    assert results["test_acc"] >= 0 and "the resumed run continues without --log-to" in capsys.readouterr().out


def test_wandb_online_without_a_login_stops_in_one_line_before_any_run_folder(monkeypatch, tmp_path, capsys):
    pytest.importorskip("wandb", reason="--log-to wandb needs it: pip install wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))                  # no ~/.netrc
    assert "not logged in to Weights & Biases" in loggers.probe("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert loggers.probe("wandb") is None
