"""lab/hardware.py: where a run computes, settled once before anything runs: --device (checked against what PyTorch
sees), --deterministic, --precision, --workers, torchrun's process group (DDP), and --compile (bounded graphs,
counted, no silent fallback to eager). What a step does on the device (DDP rows, the guard) is lab/steps.py's.
Check: tests/test_robustness.py (devices, DDP start-up, compile bounds), tools/gpu_check.py.
"""
import contextlib
import datetime
import os
import shutil
import signal
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

import lra_data
from lab.runs import fail
from ssm import set_tf32


# ---- --device, --deterministic, --workers, DDP -------------------------------------------------

def unwritable(folder):
    """Why nothing can be written where `folder` is or would be made (its nearest existing parent; a temporary file
    is tried there: permissions, read-only mounts), or None."""
    probe = Path(folder).resolve()
    while not probe.exists():
        probe = probe.parent
    try:
        tempfile.TemporaryFile(dir=probe).close()                # a file there: NotADirectoryError
    except OSError as e:
        return e.strerror or str(e)


def setup_device(args):
    """-> (device, world size): checks --device and that --out can be written (making --out itself); settles
    --deterministic (before any CUDA call), --precision (printed, in config.json) and --workers. The DDP
    environment is checked first (check_ddp_environment, at the run's opening)."""
    if args.deterministic:      # before any CUDA call: cuBLAS reads its workspace setting when CUDA starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)    # an op without a deterministic kernel: torch's error names it
        torch.backends.cudnn.benchmark = False      # cuDNN's autotuner off
    try:
        device = check_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except ValueError as e:
        fail(f"--device {args.device}: {e}")
    world = ddp_world(os.environ)                   # checked at the run's opening
    if args.compile and COMPILE_BACKEND == "inductor" and not c_compiler():
        fail("--compile needs a C/C++ compiler (torch.compile's inductor builds its kernels with one) and none is "
             "on PATH (CXX, c++, g++, clang++): install one (apt-get install g++) or run without --compile")
    args.device = str(device)                       # resolved once, printed, in config.json
    args.precision = precision(args, device)[0]     # resolved once, printed, in config.json
    if args.workers is None:                        # CUDA: loader processes keep the GPU fed
        args.workers = min(8, (os.cpu_count() or 1) // world) if device.type == "cuda" else 0
    # known now, not after the data was prepared: try writing where the run folder will be made
    if not args.resume and int(os.environ.get("RANK", 0)) == 0 and (why := unwritable(args.out)):
        fail(f"--out {args.out}: cannot write there ({why}); pass a writable folder")
    return device, world


def ddp_world(env):
    """The world size a launch's environment (torchrun's, or a manual srun's that sets them all) asks for -> int;
    ValueError (one line) for one that cannot start, said before the data is prepared: WORLD_SIZE not a positive
    integer, WORLD_SIZE > 1 without MASTER_ADDR or MASTER_PORT, a port outside 1-65535, RANK or LOCAL_RANK
    outside the world (a rendezvous that would wait for a process that never comes)."""
    def integer(name, default):
        try:
            return int(env.get(name, default))
        except ValueError:
            raise ValueError(f"{name}={env[name]!r} is not an integer") from None
    world, _, _ = integer("WORLD_SIZE", 1), integer("RANK", 0), integer("LOCAL_RANK", 0)
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world} must be at least 1")
    if world == 1:
        return 1
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise ValueError(f"WORLD_SIZE={world} without {' and '.join(missing)}: launch with torchrun, or unset "
                         f"WORLD_SIZE (left in the shell?) for one process")
    if not 1 <= integer("MASTER_PORT", 0) <= 65535:
        raise ValueError(f"MASTER_PORT={env['MASTER_PORT']} is not a port (1-65535)")
    for name in ("RANK", "LOCAL_RANK"):
        if name in env and not 0 <= integer(name, 0) < world:
            raise ValueError(f"{name}={env[name]} is outside the world of WORLD_SIZE={world} processes (0-{world - 1})")
    return world


def check_ddp_environment():
    """train.py's first check: ddp_world of this process's environment, or one line on stderr from every process
    (the rank may be the fault) and exit status 2."""
    try:
        ddp_world(os.environ)
    except ValueError as e:
        print(f"train.py: error: the DDP environment: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def check_device(text):
    """A --device value (cpu, cuda, cuda:1, ...) -> torch.device, checked against the devices
    PyTorch sees (train.py and tools/bench.py). Raises ValueError with what to pass instead."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError("not a device; use cpu, cuda, cuda:1, ...") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError("only cpu and cuda are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA device is visible to PyTorch; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


RENDEZVOUS_S = 600      # how long the processes of a DDP run wait for each other at start-up


def join_process_group(device, world):
    """Under torchrun: one process per GPU (NCCL) or CPU process (gloo); only rank 0 prints. Returns
    the device. The rendezvous waits RENDEZVOUS_S for every process, then each stops in one line (status 2); a
    SIGTERM while it waits ends the process at once (its default action: no run folder exists yet, and
    the wait in C++ would not hear Python's handler)."""
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    cuda = device.type == "cuda"
    handler = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                                timeout=datetime.timedelta(seconds=RENDEZVOUS_S))
    except (RuntimeError, dist.DistError) as e:     # a process that never came, a port taken, ...
        print(f"train.py: error: the DDP rendezvous at {os.environ.get('MASTER_ADDR')}:"
              f"{os.environ.get('MASTER_PORT')} failed after up to {RENDEZVOUS_S} s "
              f"({str(e).splitlines()[0][:160]}): every one of the WORLD_SIZE={world} processes must start "
              f"(torchrun starts them all); check that the port is free", file=sys.stderr)  # every process says it
        raise SystemExit(2) from None
    finally:
        signal.signal(signal.SIGTERM, handler)
    if dist.get_rank() > 0:                         # only rank 0 prints, logs and saves
        sys.stdout = open(os.devnull, "w")
    return device


def precision(args, device):
    """The one place that decides numeric precision -> (name, autocast context factory, GradScaler or None). Default:
    bf16 autocast on CUDA with compute capability ≥ 8, fp16 autocast with a gradient scaler on older GPUs (V100, T4),
    fp32 on CPU. TF32 is set explicitly for every choice: on for "tf32" only. Under bf16 / fp16 autocast the only
    float32 matmuls left are the SSM kernels', which must not use TF32 (ssm.Matmul guards them anyway), so TF32 there
    would buy nothing. The SSM kernels and FFT convolutions run in fp32 inside autocast (ssm.py). --amp is the old
    name of --precision bf16."""
    name = args.precision or ("bf16" if args.amp else None)
    if name is None:
        name = "fp32" if device.type != "cuda" else (
            "bf16" if torch.cuda.get_device_capability(device)[0] >= 8 else "fp16")
    # by the setter that leaves torch's TF32 state readable from any state a user's code left
    # (ssm.set_tf32, docs/gpu.md); also on a CPU, where only oneDNN on CPUs with TF32 units reads it
    set_tf32(name == "tf32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)
    amp = partial(torch.autocast, device.type, dtype) if dtype else contextlib.nullcontext
    return name, amp, torch.amp.GradScaler(device.type) if name == "fp16" else None


# ---- --compile: bounded graphs, counted, no silent fallback to eager ----------------------------

COMPILE_BACKEND = "inductor"        # tests use "aot_eager" (traces and runs autograd, no codegen)


def padded_lengths(task, max_len=None):
    """The lengths a batch of `task` can have after lra_data.collate: its buckets up to the longest
    input (token tasks; --max-len cuts documents), or the one image length (pixel tasks)."""
    spec = lra_data.TASKS[task]
    if spec.kind == "pixels":
        return [spec.max_len]
    longest = min(spec.max_len, max_len + 1 if max_len else spec.max_len)  # + EOS
    return sorted({lra_data.bucket_length(n) for n in range(1, longest + 1)})


def c_compiler():
    """The C++ compiler inductor would build with (CXX, else c++, g++ or clang++ on PATH), or None."""
    return next((found for name in (os.environ.get("CXX"), "c++", "g++", "clang++") if name
                 for found in [shutil.which(name)] if found), None)


def compiled(forward, args):
    """torch.compile(forward) for a run of args.task: static shapes (dynamic=False), so each function compiles one
    graph per padded length and mode (train with autograd, eval under no_grad): automatic dynamic shapes would not
    save that here, since the FFT size (ssm.fft_length) branches on L and guards each length anyway. torch's recompile
    limit is raised to that bound for two phases (SPT's model and the classifier run the same functions) and hitting
    it is an error (fail_on_recompile_limit_hit), not a silent fallback to eager. The graph breaks that remain: one
    per SSM layer at SSMLayer.kernel_of (the kernel is complex-valued and its loops depend on L:
    torch.compiler.disable keeps it eager, the fork recipe's kernel contract), and the classifier's frame at the SSM
    backbone, whose own frame runs its layer loop eagerly (ssm.SSMBackbone.forward); compile_summary counts them."""
    import torch._dynamo
    bound = 2 * 2 * len(padded_lengths(args.task, args.max_len))  # modes × phases × lengths
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, bound)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 8 * bound)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(forward, backend=COMPILE_BACKEND, dynamic=False)


def compile_summary(phase):
    """-> (line for log.txt, record for log.jsonl) after `phase`: torch._dynamo's counters for this process so far:
    graphs compiled, frames dynamo ran eagerly, graph breaks by reason (the first line of each)."""
    from torch._dynamo.utils import counters
    graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]
    breaks = {}
    for reason, n in counters["graph_break"].items():
        short = reason.splitlines()[0][:80]
        breaks[short] = breaks.get(short, 0) + n
    eager = frames["total"] - frames["ok"]
    line = (f"compile after {phase}: {graphs} graphs compiled in {frames['ok']} frames; fallback to eager: "
            f"{f'{eager} frames' if eager else 'none'}; graph breaks: "
            + ("; ".join(f"{n} × {r}" for r, n in breaks.items()) or "none"))
    return line, {"phase": "compile", "after": phase, "graphs": graphs, "frames_compiled": frames["ok"], "frames_eager": eager,
                  "graph_breaks": breaks}
