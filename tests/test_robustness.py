"""Facts about long runs with train.py: 2 DDP processes (torchrun, gloo) train exactly as 1 process; a killed run
resumes to the same metrics; a non-finite loss stops the run by name; every bad input exits with status 2 and one
line; --compile never leaks `_orig_mod.` into checkpoints; the FFT stays float32 under bf16 autocast; reading a
PathX-sized memmap does not pull it into the process's own memory."""
import argparse
import copy
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

import denoise
import lra_data
from lra.listops import generate_listops
from lra.pathfinder import generate_pathfinder
from lab import steps
import train
from conftest import settled, TINY, records, run
from lab import hardware
from lab import presets
import models


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """ListOps in the release format: 60 / 9 / 9 trees of 30..200 tokens."""
    root = tmp_path_factory.mktemp("data")
    generate_listops(root, 60, 9, 9, min_length=30, max_length=200)
    return root


def exits_with_one_line(argv, capsys, says):
    """train.main(argv) must stop with status 2 and a single 'train.py: error' line on stderr naming `says`."""
    capsys.readouterr()                                  # drop what earlier runs printed
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("train.py: error:")]
    assert e.value.code == 2 and len(errors) == 1 and says in errors[0] and "Traceback" not in err, \
        f"exit {e.value.code}, stderr: {err!r}"
    return errors[0]


# ---- DDP ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("objective", ["masked", "span", "rtd"])
def test_two_ddp_processes_train_exactly_as_one_process(objective, data_dir, tmp_path):
    # 17 training examples in batches of 8: the last batch has one example, so one process runs it with weight 0;
    # 9 val / test examples: the same in evaluation. SPT masks vary per process: the loss weighting must fix that.
    flags = ["--data-dir", str(data_dir), *TINY, "--model", "dlr", "--task", "listops", "--spt", "--batch-size", "8",
             "--max-train", "17", "--max-eval", "9", "--pretrain-epochs", "2", "--epochs", "2", "--device", "cpu",
             "--objective", objective]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "train.py", "--out", str(tmp_path / "two"), *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    one, _ = run(data_dir, tmp_path / "one", *flags)
    (two_dir,) = (tmp_path / "two").iterdir()            # rank 0 alone made (and named) the run folder
    assert done.stdout.count("param groups:") == 2, "a process other than rank 0 printed"
    predictions = [json.loads((Path(d) / "test_predictions.json").read_text()) for d in (one["run_dir"], two_dir)]
    assert predictions[0] == predictions[1], "2 processes (one with no row of the last test batch) lost predictions"
    a, b = records(one["run_dir"])[:-1], records(two_dir)[:-1]   # all but the wall times
    assert [(r["phase"], r.get("epoch")) for r in a] == [(r["phase"], r.get("epoch")) for r in b]
    for ra, rb in zip(a, b):
        for key in ("train_loss", "train_acc", "val_loss", "val_acc", "test_acc", "test_loss"):
            if key in ra:
                assert abs(ra[key] - rb[key]) < 1e-4, f"{ra['phase']} epoch {ra.get('epoch')}: {key} 1 process " \
                                                      f"{ra[key]}, 2 processes {rb[key]}"


def test_two_nodes_of_one_process_each_train_exactly_as_one_process(data_dir, tmp_path):
    # docs/train.md's multi-node command on one machine: two torchrun agents (two "nodes", one process each) meet at
    # a c10d rendezvous on a free local port, as two machines of a cluster would at --rdzv-endpoint; gloo on CPU
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    flags = ["--data-dir", str(data_dir), *TINY, "--model", "dlr", "--task", "listops", "--spt", "--batch-size", "8",
             "--max-train", "17", "--max-eval", "9", "--pretrain-epochs", "1", "--epochs", "2", "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    doc = next(line.split() for line in (REPO / "docs" / "train.md").read_text().splitlines()
               if line.strip().startswith("torchrun --nnodes"))         # the command the docs give
    local = {"--nproc_per_node": "1", "--rdzv_endpoint": f"127.0.0.1:{port}", "--rdzv_id": "two"}   # 1 CPU process
    end = doc.index("train.py")
    launch = [local.get(prev, word) for prev, word in zip(doc[:end - 1], doc[1:end])]   # each value after its flag
    assert launch[:2] == ["--nnodes", "2"] and "c10d" in launch, launch
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch,
                               "train.py", "--out", str(tmp_path / "two"), *flags], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**env, "OMP_NUM_THREADS": "1"})
             for _ in range(2)]
    outputs = [node.communicate(timeout=180) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    printed = sorted(out.count("param groups:") for out, _ in outputs)   # once per phase, by rank 0 only
    assert printed == [0, 2], f"a process other than rank 0 printed: {printed}"
    one, _ = run(data_dir, tmp_path / "one", *flags)
    (two_dir,) = (tmp_path / "two").iterdir()            # one run folder for both nodes
    assert "× 2 processes (DDP)" in (two_dir / "log.txt").read_text()
    a, b = records(one["run_dir"])[:-1], records(two_dir)[:-1]   # all but the wall times
    assert [(r["phase"], r.get("epoch")) for r in a] == [(r["phase"], r.get("epoch")) for r in b]
    for ra, rb in zip(a, b):
        for key in ("train_loss", "val_loss", "val_acc", "test_acc", "test_loss"):
            if key in ra:
                assert abs(ra[key] - rb[key]) < 1e-4, f"{ra['phase']}: {key} 1 process {ra[key]}, 2 nodes {rb[key]}"


GRADIENT_PROBE = textwrap.dedent("""
    import sys, torch, train
    from lab import steps
    seen = []
    guard = steps.guard_step
    def spy(state, *a):                   # the gradient the optimiser is about to use, first step only
        if not seen:
            seen.append(torch.cat([p.grad.flatten() for p in state.model.parameters() if p.grad is not None]))
        return guard(state, *a)
    steps.guard_step = spy
    train.main(sys.argv[2:])
    if steps.rank_and_world()[0] == 0:
        torch.save(seen[0], sys.argv[1])
""")


def test_ddp_gradient_equals_the_one_process_gradient_of_the_global_batch(data_dir, tmp_path):
    # AdamW hides a wrong gradient scale (it normalises by the gradient's size), so compare the gradients themselves:
    # the global-batch mean over 2 processes (each its rows, DDP averaging) must be the 1-process gradient
    flags = ["--data-dir", str(data_dir), *TINY, "--model", "dlr", "--task", "listops", "--spt", "--batch-size", "10",
             "--max-train", "10", "--max-eval", "8", "--pretrain-epochs", "1", "--epochs", "1", "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    (tmp_path / "probe.py").write_text(GRADIENT_PROBE)
    for n in (1, 2):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                               str(tmp_path / "probe.py"), str(tmp_path / f"grad{n}.pt"),
                               "--out", str(tmp_path / str(n)), *flags], cwd=REPO, capture_output=True, text=True,
                              timeout=120, env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = (torch.load(tmp_path / f"grad{n}.pt") for n in (1, 2))
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-7, msg="2-process gradient != 1-process gradient")


FINITE_PROBE = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from lab import steps
    from types import SimpleNamespace
    dist.init_process_group("gloo")
    rank, said = dist.get_rank(), []
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))    # 0.weight 0.bias 1.weight 1.bias
    for records in ([[10.0, 3.0], [4.0, 1.0]], [[-1.0, -1.0], [7.0, 2.0]], [[-1.0, -1.0], [-1.0, -1.0]]):
        try:
            steps.check_finite(SimpleNamespace(record=torch.tensor(records[rank]), model=model), "finetune")
            said.append("finite")
        except SystemExit as e:
            said.append(str(e.code))
    open(f"{sys.argv[1]}/rank{rank}.txt", "w").write("\\n".join(said))
    dist.barrier()
    dist.destroy_process_group()
""")


def test_ddp_non_finite_check_names_the_earliest_bad_step_of_any_process_and_its_parameter(tmp_path):
    (tmp_path / "probe.py").write_text(FINITE_PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(tmp_path / "probe.py"), str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert len(lines) == 3, lines
        assert "finetune step 4:" in lines[0] and "gradient of 0.bias" in lines[0], lines[0]
        assert "finetune step 7:" in lines[1] and "gradient of 1.weight" in lines[1], lines[1]
        assert lines[2].endswith("finite"), lines[2]


def test_three_ddp_processes_with_a_global_batch_of_50_train_as_one_process(data_dir, tmp_path):
    # 50 = 17 + 17 + 16 rows: uneven shards, and the gradient must still be the global-batch mean
    flags = ["--data-dir", str(data_dir), *TINY, "--model", "dlr", "--task", "listops", "--batch-size", "50",
             "--max-train", "60", "--max-eval", "9", "--epochs", "2", "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                           "train.py", "--out", str(tmp_path / "three"), *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=180, env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    one, _ = run(data_dir, tmp_path / "one", *flags)
    (three_dir,) = (tmp_path / "three").iterdir()
    a, b = records(one["run_dir"])[:-1], records(three_dir)[:-1]
    assert len(a) == len(b) == 3, (a, b)
    for ra, rb in zip(a, b):
        for key in ("train_loss", "train_acc", "val_loss", "val_acc", "test_acc", "test_loss"):
            if key in ra:
                assert abs(ra[key] - rb[key]) < 1e-4, f"{key}: 1 process {ra[key]}, 3 processes {rb[key]}"


def test_a_paper_presets_accumulation_is_per_process_and_halves_under_two_processes(monkeypatch):
    from lab import memory
    monkeypatch.setattr(memory, "card_memory", lambda device: (80 * 2**30, 80 * 2**30))     # an 80 GB card
    counts = {}
    for world in (1, 2):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        args, cfg = settled(["--preset", "paper", "--model", "s4", "--task", "retrieval", "--spt"])
        args.precision = "bf16"
        memory.plan_memory(args, dict(config=dataclasses.asdict(cfg)), torch.device("cuda"), world)
        counts[world] = args.accum_steps
    assert counts[1] == 2 * counts[2] and counts[1] > 1, f"S4 Retrieval fine-tuning batch 256 per process: {counts}"


def test_a_pretraining_batch_that_leaves_a_process_one_example_is_named_at_start_up(monkeypatch):
    from lab import presets
    monkeypatch.setenv("WORLD_SIZE", "8")
    args, _, _ = train.parse_flags(["--preset", "paper", "--model", "dlr", "--task", "pathx", "--spt"])
    _, notes = presets.apply(args, train.MODELS[args.model])
    assert any("--pretrain-batch-size 8 over 8 processes" in n for n in notes), notes


# ---- resume, NaN guard --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stop_in, objective", [("spt", "masked"), ("finetune", "masked"), ("spt", "span"),
                                               ("finetune", "span"), ("spt", "rtd"), ("finetune", "rtd")])
def test_resumed_run_ends_with_the_same_metrics_as_an_uninterrupted_one(stop_in, objective, data_dir, tmp_path,
                                                                       monkeypatch, capsys):
    flags = ["--model", "dlr", "--task", "listops", "--spt", "--pretrain-epochs", "3", "--epochs", "3",
             "--max-train", "32", "--batch-size", "8", "--dropout", "0.1",    # 4 steps per epoch; dropout uses the RNG
             "--objective", objective]
    full, full_dir = run(data_dir, tmp_path / "full", *flags)
    kill_at, calls, step = (6 if stop_in == "spt" else 18), [], steps.guard_step   # step 6: SPT epoch 2; 18: FT epoch 2
    def killed(*a):                                      # the kill_at-th optimiser step is hit by a Ctrl-C
        calls.append(1)
        if len(calls) == kill_at:
            raise KeyboardInterrupt
        return step(*a)
    monkeypatch.setattr(steps, "guard_step", killed)
    with pytest.raises(SystemExit) as stop:
        run(data_dir, tmp_path / "cut", *flags)
    monkeypatch.setattr(steps, "guard_step", step)
    cut_dir = next((tmp_path / "cut").iterdir())
    message = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train.py:")]   # not tqdm's
    assert stop.value.code == 130 and len(message) == 1 and f"--resume {cut_dir}" in message[0], message
    assert f"at {stop_in} epoch 2/3, step 5" in message[0], message             # 5 steps done, the 6th hit
    assert message[0] in (cut_dir / "log.txt").read_text(), "log.txt does not say how the run ended"
    assert torch.load(cut_dir / "last.pt", weights_only=True)["phase"] == stop_in
    resumed = train.main(["--resume", str(cut_dir)])
    for key in ("test_acc", "test_loss", "best_val_acc"):
        assert abs(resumed[key] - full[key]) < 1e-6, f"{key}: resumed {resumed[key]} vs uninterrupted {full[key]}"
    val = lambda d: {(r["phase"], r.get("epoch")): r.get("val_loss") for r in records(d)}
    for key, loss in val(full_dir).items():
        if loss is not None:
            assert abs(val(cut_dir)[key] - loss) < 1e-6, f"val loss at {key} differs after resuming"


def test_non_finite_loss_stops_the_run_naming_phase_step_and_parameter(data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:                 # an absurd fine-tuning lr overflows the weights within steps
        run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--spt", "--pretrain-epochs", "1",
            "--epochs", "5", "--lr", "1e30")
    message = str(e.value.code) + capsys.readouterr().err  # the first non-finite thing met: a step or an evaluation
    assert ("finetune step" in message and "non-finite" in message
            and ("gradient of" in message or "value of" in message)) or \
        ("finetune epoch 1: validation loss" in message and "not finite" in message), message
    spt_pt = next(tmp_path.glob("*/spt.pt"))
    assert all(v.isfinite().all() for v in torch.load(spt_pt, weights_only=True)["model"].values()), \
        "spt.pt was spoiled"


# ---- bad input: status 2, one line, no traceback --------------------------------------------------------------------

@pytest.mark.parametrize("flags, says", [
    (["--task", "nope"], "--task"),                                      # unknown task
    (["--model", "rnn"], "--model"),                                     # unknown model
    (["--data-fraction", "0"], "--data-fraction"),
    (["--data-fraction", "1.5"], "--data-fraction"),
    (["--spt", "--mask-ratio", "0"], "--mask-ratio"),
    (["--spt", "--mask-ratio", "1"], "--mask-ratio"),
    (["--model", "dlr", "--spt", "--objective", "causal"], "--causal"),   # causal objective, bidirectional model
    (["--init-from", "no/such/file.pt"], "--init-from"),
    (["--eval-every", "0"], "--eval-every"),
    (["--max-len", "64"], "--max-len"),                                  # ListOps cannot be cut
    (["--batch-size", "0"], "--batch-size 0"),
    (["--batch-size", "-4"], "--batch-size -4"),
    (["--d-model", "0"], "--d-model 0"),
    (["--model", "s4", "--d-state", "0"], "--d-state 0"),
    (["--model", "s4", "--d-state", "7"], "d_state=7"),                  # S4 keeps N/2 conjugate pairs
    (["--n-layers", "0"], "--n-layers 0"),
    (["--dropout", "1"], "--dropout 1"),
    (["--dropout", "-0.1"], "--dropout -0.1"),
    (["--workers", "-1"], "--workers -1"),
    (["--max-steps", "-1"], "--max-steps -1"),
    (["--max-train", "-1"], "--max-train -1"),
    (["--max-eval", "-5"], "--max-eval -5"),
    (["--lr", "0"], "--lr 0"),
    (["--lr=-1e-3"], "--lr -0.001"),
    (["--spt", "--pretrain-lr", "0"], "--pretrain-lr 0"),
    (["--warmup", "-1"], "--warmup -1"),
    (["--generate", "5"], "--generate 5 must be 0 (never) or at least 10"),
    (["--model", "transformer", "--d-model", "30"], "d_model=30"),       # 30 is not divisible into 4 even heads
    (["--model", "transformer", "--pos", "alibi"], "pos='alibi' must be one of rotary, sinusoidal, learned, none"),
    (["--device", "foo"], "--device foo"),
    (["--device", "cuda:7"], "--device cuda:7"),
    (["--accum-steps", "0"], "--accum-steps 0"),
    (["--pretrain-batch-size", "0"], "--pretrain-batch-size 0"),
    (["--cache-dir", "/proc/cache"], "cannot make the cache folder"),        # no folder can be made in /proc
    (["--task", "image", "--spt", "--objective", "rtd"], "--objective rtd"),   # L1 values: nothing to sample from
    (["--spt", "--objective", "span", "--span-mean", "0.5"], "--span-mean 0.5"),
    (["--spt", "--objective", "rtd", "--gen-width", "0"], "--gen-width 0"),
    (["--model", "transformer", "--spt", "--objective", "rtd", "--gen-width", "6"], "d_model=6"),   # 6 / 4 heads
])
def test_bad_flag_exits_with_status_2_and_one_line_before_any_run_folder(flags, says, data_dir, tmp_path, capsys):
    exits_with_one_line(["--task", "listops", "--data-dir", str(data_dir), "--out", str(tmp_path / "runs"), *TINY,
                         *flags], capsys, says)
    assert not (tmp_path / "runs").exists(), "a stub run folder was left behind"


def test_out_pointing_at_a_file_or_an_unwritable_place_exits_with_status_2(data_dir, tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    exits_with_one_line(["--task", "listops", "--data-dir", str(data_dir), "--out", str(tmp_path / "a_file"), *TINY],
                        capsys, "--out")
    # /proc is a file system where no folder can be made, not even by root (a read-only mount behaves alike)
    exits_with_one_line(["--task", "listops", "--data-dir", str(data_dir), "--out", "/proc/runs", *TINY], capsys,
                        "--out /proc/runs")


def test_missing_data_folder_exits_with_status_2_naming_it(tmp_path, capsys):
    exits_with_one_line(["--task", "listops", "--data-dir", str(tmp_path / "none"), "--out", str(tmp_path), *TINY,
                         "--generate", "0"], capsys, "none")


def test_a_data_dir_that_is_a_file_is_named_as_a_file(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    exits_with_one_line(["--task", "listops", "--data-dir", str(tmp_path / "a_file"), "--out", str(tmp_path), *TINY],
                        capsys, "is a file, not a folder")


def test_mistyped_data_dir_of_a_synthetic_task_exits_instead_of_generating_there(tmp_path, capsys):
    exits_with_one_line(["--task", "pathfinder", "--data-dir", str(tmp_path / "pathfinder_rf"), "--out", str(tmp_path),
                         *TINY], capsys, "pathfinder_rf")
    assert not (tmp_path / "pathfinder_rf").exists(), "a typo'd --data-dir was created and filled with generated data"


def test_missing_data_file_exits_with_status_2_naming_it(data_dir, tmp_path, capsys):
    shutil.copytree(data_dir / "listops-1000", tmp_path / "listops-1000")
    (tmp_path / "listops-1000" / "basic_test.tsv").unlink()
    (tmp_path / "listops-1000" / "generated_by_lra_data.txt").unlink()   # not ours: a release copy missing a file
    exits_with_one_line(["--task", "listops", "--data-dir", str(tmp_path), "--out", str(tmp_path), *TINY,
                         "--generate", "0"], capsys, "basic_test.tsv")


def test_corrupt_png_exits_with_status_2_naming_the_image(tmp_path, capsys):
    folder = generate_pathfinder(tmp_path, res=32, n=20, contour_length=14)
    bad = folder / "imgs" / "0" / "sample_7.png"
    bad.write_bytes(bad.read_bytes()[:40])               # a truncated download
    exits_with_one_line(["--task", "pathfinder", "--data-dir", str(tmp_path), "--out", str(tmp_path), *TINY,
                         "--generate", "0"], capsys, "sample_7.png")


def test_malformed_tsv_row_exits_with_status_2_naming_file_and_line(tmp_path, capsys):
    folder = tmp_path / "tsv_data"
    folder.mkdir()
    for name in ("train", "eval", "test"):
        (folder / f"new_aan_pairs.{name}.tsv").write_text("1.0\tid1\tid2\tsome text\tother text\n"
                                                          + "not a row\n" * (name == "train"))
    exits_with_one_line(["--task", "retrieval", "--data-dir", str(tmp_path), "--out", str(tmp_path), *TINY], capsys,
                        "new_aan_pairs.train.tsv:2")


def test_empty_split_exits_with_status_2_naming_it(tmp_path, capsys):
    generate_pathfinder(tmp_path, res=32, n=6, contour_length=14)   # 10% of 6 images: no val, no test
    exits_with_one_line(["--task", "pathfinder", "--data-dir", str(tmp_path), "--out", str(tmp_path), *TINY,
                         "--generate", "0"], capsys, "val split")


@pytest.fixture(scope="module")
def spt_checkpoint(data_dir, tmp_path_factory):
    _, run_dir = run(data_dir, tmp_path_factory.mktemp("spt"), "--model", "dlr", "--task", "listops", "--spt",
                     "--pretrain-epochs", "1", "--epochs", "1")
    return run_dir / "spt.pt"


@pytest.mark.parametrize("flags, says", [
    (["--model", "s4", "--task", "listops"], "dlr checkpoint for listops"),      # another model
    (["--model", "dlr", "--task", "pathfinder"], "dlr checkpoint for listops"),  # another task
    (["--model", "dlr", "--task", "listops", "--d-model", "8"], "d_model=16"),  # another shape
])
def test_init_from_a_checkpoint_of_another_model_task_or_shape_exits_with_status_2(flags, says, spt_checkpoint,
                                                                                   data_dir, tmp_path, capsys):
    exits_with_one_line(["--data-dir", str(data_dir), "--out", str(tmp_path), *TINY, "--init-from", str(spt_checkpoint),
                         "--generate", "200", *flags], capsys, says)


def test_resume_without_a_checkpoint_exits_with_status_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"args": {}}))      # a run stopped before its first evaluation
    line = exits_with_one_line(["--resume", str(tmp_path)], capsys, "no last.pt")
    assert "start the run again" in line, line


@pytest.fixture
def stopped_run(data_dir, tmp_path):
    """A run folder as a crash leaves it: checkpoints of SPT epoch 1, no results.json."""
    _, run_dir = run(data_dir, tmp_path / "runs", "--model", "dlr", "--task", "listops", "--spt", "--pretrain-epochs",
                     "1", "--epochs", "1")
    (run_dir / "results.json").unlink()
    return run_dir


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_resume_from_a_damaged_last_pt_names_it_and_the_checkpoints_still_usable(damage, stopped_run, capsys):
    last = stopped_run / "last.pt"
    last.write_bytes({"truncated": last.read_bytes()[:300], "empty": b"", "garbage": b"not a checkpoint" * 10}[damage])
    line = exits_with_one_line(["--resume", str(stopped_run)], capsys, f"{last} is damaged")
    assert "best.pt (finetune epoch 1)" in line and "spt.pt (spt epoch 1)" in line and "weights_only" not in line, line


def test_resume_of_a_folder_that_is_no_run_touches_nothing_there(tmp_path, capsys):
    (tmp_path / "draft.tmp").write_text("a user's file")                  # e.g. --resume ~/Downloads by mistake
    exits_with_one_line(["--resume", str(tmp_path)], capsys, "not a run folder (no config.json)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft.tmp"], "a refused --resume changed the folder"


def test_resume_refuses_a_flag_typed_at_its_default_when_the_run_used_another_value(stopped_run, capsys):
    # the run is ListOps; --task pathfinder is the parser's default, yet typed it asks for another task
    exits_with_one_line(["--resume", str(stopped_run), "--task", "pathfinder"], capsys, "--task cannot change")


def test_resume_of_a_last_pt_this_code_cannot_restore_stops_in_one_line(stopped_run, capsys):
    last = stopped_run / "last.pt"
    ck = torch.load(last, weights_only=True)
    ck["optimizer"]["param_groups"] = ck["optimizer"]["param_groups"][:1]      # as if saved with other groups
    torch.save(ck, last)
    line = exits_with_one_line(["--resume", str(stopped_run)], capsys, "cannot be restored by this code")
    assert "start a new run" in line, line


def test_resume_refuses_flags_that_would_change_the_run(stopped_run, capsys):
    before = (stopped_run / "log.txt").read_text()
    exits_with_one_line(["--resume", str(stopped_run), "--epochs", "5", "--lr", "1.0"], capsys, "--epochs, --lr")
    assert (stopped_run / "log.txt").read_text() == before, "a refused --resume wrote to the log"
    results = train.main(["--resume", str(stopped_run), "--task", "listops", "--spt"])   # the run's own values: fine
    assert 0 <= results["test_acc"] <= 1


def test_resume_of_a_folder_in_use_refuses_without_writing(stopped_run, capsys):
    before = (stopped_run / "log.txt").read_text()
    fcntl = pytest.importorskip("fcntl", reason="file locks are POSIX (fcntl)")
    with open(stopped_run / ".lock", "a") as held:        # as the first of two --resume runs holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        exits_with_one_line(["--resume", str(stopped_run)], capsys, "in use by another train.py")
    assert (stopped_run / "log.txt").read_text() == before, "the second --resume duplicated log rows"


def test_resume_from_another_folder_uses_the_checkpoints_model_config(stopped_run, monkeypatch, capsys):
    # the presets may change between a run and its resume: the weights' own config is the one rebuilt
    from lab import presets
    values = presets.preset_values
    monkeypatch.setattr(presets, "preset_values", lambda *a: {**values(*a), "dt_max": 0.5})
    results = train.main(["--resume", str(stopped_run)])
    config = torch.load(stopped_run / "best.pt", weights_only=True)["config"]
    assert config["dt_max"] == 0.1 and 0 <= results["test_acc"] <= 1


def test_resume_of_a_finished_run_says_so_and_leaves_results_alone(data_dir, tmp_path, capsys):
    _, run_dir = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--epochs", "1")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", str(run_dir)])
    assert e.value.code == 0 and "has finished" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before, "resuming a finished run changed its folder"


def test_resume_of_a_finished_run_with_new_flags_names_the_flags_it_would_not_apply(data_dir, tmp_path, capsys):
    # --epochs 3 on a finished 1-epoch run trains nothing more: say so (status 2), not a quiet "nothing changed"
    _, run_dir = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--epochs", "1")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    line = exits_with_one_line(["--resume", str(run_dir), "--epochs", "3"], capsys, "has finished")
    assert "--epochs cannot change" in line and "start a new run" in line
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before, "the refused resume changed its folder"


# ---- precision and compilation --------------------------------------------------------------------------------------

def test_compiled_run_saves_checkpoints_without_orig_mod_prefixes(data_dir, tmp_path, monkeypatch):
    # a real OptimizedModule, without the C++ toolchain that the default backend (inductor) needs
    monkeypatch.setattr(hardware, "COMPILE_BACKEND", "eager")
    _, run_dir = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--spt", "--compile",
                     "--pretrain-epochs", "1", "--epochs", "1")
    for name in ("spt.pt", "best.pt", "last.pt"):
        keys = torch.load(run_dir / name, weights_only=True)["model"]
        bad = [k for k in keys if k.startswith(("_orig_mod.", "module."))]
        assert keys and not bad, f"{name} carries wrapper prefixes: {bad[:3]}"
    assert "+ torch.compile" in (run_dir / "log.txt").read_text()
    said = [line for line in (run_dir / "log.txt").read_text().splitlines() if line.startswith("compile after")]
    assert [line.split(":")[0] for line in said] == ["compile after spt", "compile after finetune"], said
    assert all("fallback to eager: none" in line for line in said), said
    counted = [r for r in records(run_dir) if r["phase"] == "compile"]
    assert len(counted) == 2 and all(r["graphs"] > 0 and r["frames_eager"] == 0 for r in counted), counted


def test_compiled_forward_over_12_raw_lengths_keeps_graphs_per_function_within_buckets_times_modes(monkeypatch, request):
    # aot_eager: dynamo's graphs and AOT autograd as inductor gets them, without generating code (seconds, not 30 s)
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters
    import models
    import ssm
    monkeypatch.setattr(hardware, "COMPILE_BACKEND", "aot_eager")
    # restored by setattr, never by monkeypatch: a pytest that undoes a module attribute it did not find in the
    # module's __dict__ deletes it, and a deleted dynamo config entry is hidden (every later compile then fails)
    saved = {key: getattr(torch._dynamo.config, key)
             for key in ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit")}
    request.addfinalizer(lambda: [setattr(torch._dynamo.config, k, v) for k, v in saved.items()])
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    meta = dict(model_name="dlr", config=dataclasses.asdict(presets.config_for("dlr", "listops", {
        **presets.values_for("tiny", "dlr", "listops", False), "d_model": 16, "n_layers": 2, "d_state": 16})),
        head=dict(kind="classifier", n_classes=10, pool="mean", pair=False))
    model = models.build_model(meta)
    eager = copy.deepcopy(model)
    forward = hardware.compiled(model, argparse.Namespace(task="listops", max_len=None))
    raw = [20, 30, 45, 60, 70, 90, 100, 130, 150, 170, 190, 250]             # 12 raw lengths, 7 buckets
    buckets = {lra_data.bucket_length(n) for n in raw}
    for mode in ("train", "eval"):
        model.train(mode == "train"), eager.train(mode == "train")
        for n in raw:
            torch.manual_seed(n)
            x, lengths, _ = lra_data.collate([(torch.randint(4, 16, (m,)), 0) for m in (n, n // 2 + 1, n - 1)])
            with torch.set_grad_enabled(mode == "train"):
                got, want = forward(x, lengths), eager(x, lengths)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{mode}, L {n}: compiled != eager")
                if mode == "train":
                    got.sum().backward()
    for fn in (models.Classifier.forward, ssm.SSMLayer.forward):            # the backbone frame: eager
        entries = len(_debug_get_cache_entry_list(fn.__code__))
        assert 0 < entries <= 2 * len(buckets), f"{fn.__qualname__}: {entries} graphs for {len(buckets)} lengths × 2"
    assert counters["frames"]["total"] == counters["frames"]["ok"], f"frames run eagerly: {dict(counters['frames'])}"


def test_fft_convolution_stays_float32_under_bf16_autocast(monkeypatch):
    # --amp is bf16 autocast on CUDA; CPU autocast takes the same path through s4.SSMLayer (shared with DLR)
    seen, rfft, irfft = [], torch.fft.rfft, torch.fft.irfft
    monkeypatch.setattr(torch.fft, "rfft", lambda x, *a, **k: seen.append(x.dtype) or rfft(x, *a, **k))
    monkeypatch.setattr(torch.fft, "irfft", lambda x, *a, **k: seen.append(x.dtype) or irfft(x, *a, **k))
    for model in ("s4", "dlr"):
        Config, Model = train.MODELS[model][:2]
        net = Model(Config(d_model=16, n_layers=1, d_state=8, vocab_size=19, dropout=0.0))
        with torch.autocast("cpu", torch.bfloat16):
            h = net(torch.randint(4, 19, (2, 64)), torch.tensor([64, 40]))          # (B, L, D)
            assert net.layers[0].out(h).dtype == torch.bfloat16, "autocast was not active: the test proves nothing"
        assert seen and set(seen) <= {torch.float32, torch.complex64}, f"{model}: FFT inputs in {set(seen)}"
        assert h.isfinite().all()
        seen.clear()


# ---- memory ---------------------------------------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, resource, sys
    import numpy as np, torch
    import lra_data

    def anon_kb():                # private memory of this process: what a copy of the data set would grow
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(fields["RssAnon"].split()[0])

    n = 20_000
    data = lra_data.LRADataset("pathx", sys.argv[1], "all", np.arange(n), "generated for a test")
    start, peak, seen = anon_kb(), 0, 0
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for x, lengths, y in torch.utils.data.DataLoader(data, 32, collate_fn=lra_data.collate):
        seen += len(x)
        peak = max(peak, anon_kb())
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - max_rss
    print(json.dumps({"seen": seen, "anon_growth_mb": (peak - start) / 1024, "max_rss_growth_mb": grown / 1024}))
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from Linux's /proc")
def test_iterating_a_pathx_sized_memmap_keeps_it_out_of_process_memory(tmp_path):
    n, L = 20_000, 16384                                 # PathX val/test size x 128², 328 MB
    if shutil.disk_usage(tmp_path).free < 2 * n * L:
        pytest.skip("less than 660 MB free for the 328 MB memmap")
    x = np.lib.format.open_memmap(tmp_path / "all.x.npy", mode="w+", dtype=np.uint8, shape=(n, L))   # the cache format
    block = np.random.default_rng(0).integers(0, 256, (1000, L), dtype=np.uint8)         # real pages, not a sparse file
    for i in range(0, n, 1000):
        x[i: i + 1000] = block
    x.flush()
    del x
    np.save(tmp_path / "all.y.npy", np.zeros(n, np.int64))
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # Rows are read one at a time, so neither private memory (RssAnon) nor all resident memory (ru_maxrss, which
    # would count the touched pages of a memmap) grows with the file.
    assert got["seen"] == n and got["anon_growth_mb"] < 100, f"private memory grew while reading 328 MB: {got}"
    assert got["max_rss_growth_mb"] < 100, f"resident memory grew while reading 328 MB: {got}"


# ---- the GPU path, checked on the CPU: no host reads per step, accumulation, precision -----------------------------

def count_host_reads(monkeypatch):
    """Count calls of Tensor.item, .cpu() and .tolist(): the ways a training step would read a device value."""
    calls = {"n": 0}
    for name in ("item", "cpu", "tolist"):
        method = getattr(torch.Tensor, name)
        def counted(self, *a, _method=method, **k):
            calls["n"] += 1
            return _method(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def test_host_reads_per_training_step_do_not_grow_with_the_number_of_steps(data_dir, tmp_path, monkeypatch):
    # N and 2N steps per phase (one epoch each, fewer steps than a progress interval): the reads are those of the
    # evaluations and the end of each epoch, none per step
    calls = count_host_reads(monkeypatch)
    counts = []
    for n_steps in (3, 6):
        calls["n"] = 0
        run(data_dir, tmp_path / str(n_steps), "--model", "dlr", "--task", "listops", "--spt", "--batch-size", "4",
            "--max-train", str(4 * n_steps), "--epochs", "1", "--pretrain-epochs", "1")
        counts.append(calls["n"])
    assert steps.PROGRESS_STEPS > 6 and counts[0] == counts[1], f"host reads for 3 and 6 steps a phase: {counts}"


@pytest.mark.parametrize("task, objective", [("listops", "masked"), ("listops", None), ("pathfinder", None)])
def test_gradient_accumulation_over_k_micro_batches_equals_one_full_batch(task, objective, data_dir, tmp_path):
    # listops: padded token batches (rows of different lengths, masks of different sizes); pathfinder: pixels
    torch.manual_seed(0)
    if task == "pathfinder":
        generate_pathfinder(tmp_path, res=32, n=40, contour_length=14)
        data_dir = tmp_path
    data = lra_data.load(task, "train", lra_data.Files(data_dir, cache_dir=tmp_path / "cache"))
    batch = steps.collate([data[i] for i in range(12)], task)             # the loader's clean batch
    Config, Model = train.MODELS["s4"][:2]
    spec = lra_data.TASKS[task]
    cfg = Config(d_model=8, n_layers=1, d_state=8, dropout=0.0,
                 vocab_size=spec.vocab_size if task == "listops" else None,
                 d_input=1 if task == "listops" else 2, norm="layer")
    if objective:
        model = models.Denoiser(Model(cfg), 8, models.n_outputs(task)).double()
        b = denoise.masked(batch, argparse.Namespace(mask_ratio=0.3),
                           torch.Generator().manual_seed(1), 0.0)
    else:
        model = models.Classifier(Model(cfg), 8, spec.n_classes, spec.pool, spec.pair).double()
        b = denoise.labelled(batch, None, 0.0, spec.pair)
    b = b._replace(x=b.x.double() if b.x.is_floating_point() else b.x)
    grads = []
    for k in (1, 3, 5):
        model.zero_grad()
        for part in steps.micro_batches(slice(0, 12), k):
            denoise.batch_loss(model, b, part)[0].backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    for k, g in zip((3, 5), grads[1:]):
        torch.testing.assert_close(g, grads[0], atol=1e-5, rtol=1e-5, msg=f"{k} micro-batches != one batch ({task})")


def test_accum_steps_flag_trains_exactly_as_one_batch(data_dir, tmp_path):
    flags = ["--model", "dlr", "--task", "listops", "--spt", "--pretrain-epochs", "2", "--epochs", "2"]
    one, _ = run(data_dir, tmp_path / "one", *flags)
    four, _ = run(data_dir, tmp_path / "four", *flags, "--accum-steps", "4", "--pretrain-accum-steps", "4")
    for key in ("test_acc", "test_loss", "best_val_acc"):
        assert abs(one[key] - four[key]) < 1e-5, f"{key}: 1 batch {one[key]}, 4 micro-batches {four[key]}"


@pytest.mark.parametrize("flags, name", [([], "fp32"), (["--amp"], "bf16"), (["--precision", "bf16"], "bf16"),
                                         (["--precision", "fp16"], "fp16")])
def test_precision_is_printed_and_stored_in_config_json(flags, name, data_dir, tmp_path):
    results, run_dir = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--epochs", "1", *flags)
    assert json.loads((run_dir / "config.json").read_text())["args"]["precision"] == name
    assert f"precision {name}" in (run_dir / "log.txt").read_text() and 0 <= results["test_acc"] <= 1


def test_flags_of_self_pre_training_without_spt_are_named_as_ignored(data_dir, tmp_path):
    _, run_dir = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--epochs", "1", "--objective", "rtd",
                     "--mask-ratio", "0.3")
    note = next(line for line in (run_dir / "log.txt").read_text().splitlines() if "only act with --spt" in line)
    assert "--mask-ratio" in note and "--objective" in note and note.endswith("ignored"), note


def test_precision_sets_tf32_explicitly_so_fp32_after_bf16_or_tf32_has_none():
    import ssm
    flag = torch._C._get_cublas_allow_tf32                                # cuBLAS's own query
    old = ssm.matmul_precision()
    try:
        for first in ("bf16", "tf32"):
            steps.precision(argparse.Namespace(precision=first, amp=False), torch.device("cpu"))
            assert flag() == (first == "tf32"), f"--precision {first}: TF32 is {flag()}"
            steps.precision(argparse.Namespace(precision="fp32", amp=False), torch.device("cpu"))
            assert not flag() and not torch.backends.cudnn.allow_tf32, f"fp32 after {first} left TF32 {flag()}"
    finally:
        ssm.set_matmul_precision(old)


def test_deterministic_sets_torchs_flag_and_the_cublas_workspace_before_the_first_cuda_call(monkeypatch, tmp_path):
    # a CUDA machine simulated: the first call that starts CUDA (get_device_capability, via --precision's default)
    # must find both already set; cuBLAS reads CUBLAS_WORKSPACE_CONFIG when CUDA starts, so later would be too late
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen = []
    def first_cuda_call(*args):
        seen.append((torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
        return (8, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", first_cuda_call)
    monkeypatch.setattr(torch.cuda, "_lazy_init", first_cuda_call)
    args, _, _ = train.parse_flags(["--deterministic", "--device", "cuda", "--out", str(tmp_path)])
    try:
        hardware.setup_device(args)
        assert seen and seen[0] == (True, ":4096:8"), f"at the first CUDA call: (deterministic, workspace) = {seen}"
        assert args.precision == "bf16"
    finally:
        torch.use_deterministic_algorithms(False)
    plain = train.parse_flags(["--device", "cpu", "--out", str(tmp_path)])[0]
    hardware.setup_device(plain)
    assert not torch.are_deterministic_algorithms_enabled(), "without --deterministic torch's default stays"


def test_deterministic_is_recorded_in_config_json(data_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        _, run_dir = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--epochs", "1",
                         "--deterministic")
    finally:
        torch.use_deterministic_algorithms(False)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["args"]["deterministic"] is True, config["args"]
    assert config["deterministic"] == {"algorithms": True, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, config
