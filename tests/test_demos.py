"""Each concept file is also a script that shows its idea in seconds on a CPU: `python s4.py` and `python dlr.py`
check the convolution kernel against the recurrence in float64, `python transformer.py` that rotary attention scores
depend on the offset only, `python denoise.py` prints a masked batch and the positions its loss reads. Each demo is
run here as a user runs it, and what it prints is checked."""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def demo(name):
    """Run `python <name>.py` in the repo as a user does -> (its stdout, seconds)."""
    t0 = time.time()
    done = subprocess.run([sys.executable, f"{name}.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"python {name}.py failed:\n{done.stderr[-2000:]}"
    return done.stdout, time.time() - t0


@pytest.mark.parametrize("name,kernel", [("s4", "S4Kernel"), ("dlr", "DLRKernel")])
def test_the_kernel_demo_finds_the_convolution_equal_to_the_recurrence_in_float64(name, kernel):
    out, seconds = demo(name)
    shape = re.search(rf"{kernel}: kernel K of shape \((\d+), (\d+)\)", out)
    assert shape and shape.groups() == ("4", "64"), out
    error = float(re.search(r"max \|y_conv − y_rec\| = ([\d.e+-]+)", out)[1])
    assert error < 1e-10, f"python {name}.py: the two views differ by {error}"
    assert seconds < 60, f"python {name}.py took {seconds:.0f} s"


def test_the_transformer_demo_shows_rotary_scores_depend_on_the_offset_only_and_sinusoidal_ones_do_not():
    out, _ = demo("transformer")
    rotary = float(re.search(r"largest spread along any diagonal \(same offset, other positions\): ([\d.e+-]+)", out)[1])
    sinusoidal = float(re.search(r"the spread along a diagonal is ([\d.]+)", out)[1])
    assert rotary < 1e-12 and sinusoidal > 0.1, out


def test_the_denoise_demo_masks_content_only_and_its_loss_reads_exactly_the_masked_positions():
    import lra_data
    out, _ = demo("denoise")
    assert (lra_data.PAD, lra_data.MASK, lra_data.EOS) == (0, 1, 2), "the demo's special ids are lra/files.py's"
    lines = out.splitlines()
    inputs = [line.split(" ", 1)[1].strip().strip("'") for line in lines if line.startswith("input ")]
    targets = [line.split(" ", 1)[1].strip().strip("'") for line in lines if line.startswith("target ")]
    read = [eval(re.search(r"positions (\[[\d, ]*\])", line)[1]) for line in lines if "loss reads" in line]
    assert len(inputs) == len(targets) == len(read) == 2, out
    for x, y, positions in zip(inputs, targets, read):
        masked = [i for i, c in enumerate(x) if c == "_"]
        assert masked == positions and positions, (x, positions)            # the loss reads the masked positions
        assert all(y[i] not in "_·" for i in masked), "a pad or the EOS was masked"
        assert all(a == b for i, (a, b) in enumerate(zip(x, y)) if i not in masked), "an unmasked position changed"
    total = int(re.search(r"masked (\d+) of", out)[1])
    assert total == sum(len(p) for p in read)


def test_every_outcome_docs_exercises_quotes_is_its_committed_run_folders():
    import json
    text = (REPO / "docs" / "exercises.md").read_text()
    losses = re.findall(r"`(results/[^`]+)`: SPT val_loss per epoch (\d+\.\d+(?:,\s+\d+\.\d+)*)", text)
    accs = re.findall(r"`(results/[^`]+)`:[^`]*?test_acc ([\d.]+\d)", text)
    assert len(losses) >= 7 and len(accs) >= 3, (losses, accs)
    for folder, quoted in losses:
        records = [json.loads(line) for line in (REPO / folder / "log.jsonl").read_text().splitlines()]
        logged = [f"{r['val_loss']:.4f}" for r in records if r.get("phase") == "spt"]
        assert re.split(r",\s+", quoted) == logged, f"docs/exercises.md quotes {quoted} for {folder}: {logged}"
    for folder, quoted in accs:
        got = json.loads((REPO / folder / "results.json").read_text())["test_acc"]
        assert f"{got:.{len(quoted.split('.')[1])}f}" == quoted, f"{folder}: test_acc {got}, quoted {quoted}"
