"""Shared test fixtures: where the real data lives, one thread for tiny tensors, a tiny train.py run, float64."""
import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(os.environ.get("LRA_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))

# A train.py run small enough for a test: width 16, one layer, 16 training examples = one batch, so each epoch revisits
# the same examples (far too few for validation numbers to mean anything: these runs check the machinery).
TINY = ["--preset", "tiny", "--d-model", "16", "--n-layers", "1", "--d-state", "16", "--batch-size", "16",
        "--max-train", "16", "--max-eval", "8", "--lr", "5e-3", "--pretrain-lr", "5e-3", "--warmup", "1",
        "--no-curves"]    # matplotlib's import and a figure: ~2 CPU-s a run (tests/test_curves.py draws them)


@pytest.fixture
def shared_data():
    """Path to the real data folder (read-only: tests pass a cache_dir under tmp_path); skips, saying why,
    without it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} not found (set LRA_SHARED_DATA to point at shared/data)")
    return SHARED_DATA


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tensors this small gain nothing from threads, and on a shared 2-core machine a second thread waiting for a busy
    core made the training tests several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(data_dir, out, *flags):
    """train.main with the TINY settings on data_dir, runs under out -> (results dict, run folder)."""
    import train
    results = train.main(["--data-dir", str(data_dir), "--out", str(out), *TINY, *flags])
    return results, Path(results["run_dir"])


def records(run_dir):
    """The log.jsonl records of a run folder, in order."""
    return [json.loads(line) for line in (Path(run_dir) / "log.jsonl").read_text().splitlines()]


def shared_file(shared_data, rel):
    """A file of the real data folder, or skip the test saying which is missing."""
    path = shared_data / rel
    if not path.exists():
        pytest.skip(f"shared file {path} not found")
    return path


@contextlib.contextmanager
def default_dtype(dtype):
    """Build modules with float64 parameters from the start (init is computed in float64, then cast)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def interrupt_at_step(monkeypatch, n):
    """A Ctrl-C at the n-th optimiser step: lab/steps.guard_step patched to raise KeyboardInterrupt there (after
    n - 1 real steps). Returns the real guard_step, to put back for a resume."""
    from lab import steps
    calls, step = [], steps.guard_step

    def stop(*a):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return step(*a)
    monkeypatch.setattr(steps, "guard_step", stop)
    return step


def settled(argv):
    """train.py's flags of argv with the presets applied and every check made, as a run opens them (lab/presets.settle)
    -> (args, the backbone config)."""
    import train
    from lab import presets
    args, given, _ = train.parse_flags(argv)
    return args, presets.settle(args, given)[0]
