"""lab/provenance.py: what a run's record says about where its numbers came from besides the flags: the
commit of the code (with -dirty when a tracked file differs) and the machine (CPU model, threads, GPU name).
runs.run_meta writes both into a run's config.json and runs.startup_lines into its log's device line;
results/why_spt.py reads the CPU model to keep the runs of a model's seed on one machine."""
import contextlib
import os
import subprocess
from functools import cache
from pathlib import Path

import torch


@cache  # asked for by the log's device line and by config.json: one git call per run
def git_commit():
    """Short commit of this file's repo, plus -dirty when a tracked file differs from it (new files,
    such as the run folders a study writes in the repo, do not count), or 'unknown' outside git."""
    here = Path(__file__).resolve().parents[1]      # the repo
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=here, capture_output=True,  # noqa: E731
                                        text=True, timeout=5).stdout.strip()
        dirty = run("status", "--porcelain", "--untracked-files=no")
        return (run("rev-parse", "--short", "HEAD") or "unknown") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine(device):
    """What a run's numbers depend on besides the code: CPU model, threads, GPU name on CUDA."""
    cpu = "unknown"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    out = dict(cpu=cpu, torch_threads=torch.get_num_threads(),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS"))
    if torch.device(device).type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out
