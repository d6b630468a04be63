"""tools/bench.py: how fast and how big the three models are, and the GPU check that ships with the repo.
speed:   one layer of each model at growing L, its SSM kernel alone, whole training steps, the kernels with and
         without exact float32 matmuls (tools/speed.py)
memory:  --memory: the estimated peak of every --preset paper step, checked against real CPU steps (lab/memory.py)
eval:    --eval-cache: an evaluation pass at PathX's paper configuration, the SSM kernels computed per batch (before)
         and once per pass (now) (tools/speed.py)
check:   --gpu-check: parts (a)-(g) within --minutes of the process's start (tools/gpu_check.py)
usage:   python tools/bench.py [--quick] [--device cuda] [--precision bf16] [--out runs/bench.json]
         python tools/bench.py --memory [--out ...]
         python tools/bench.py --eval-cache [--eval-batches 4] [--eval-batch 2] [--out ...]
         python tools/bench.py --device cuda --gpu-check --out-dir DIR [--minutes 8]
Check: tests/test_bench.py, tests/test_gpu_check.py.
"""
import os
import time


def process_start():
    """Unix time at which this process started (Linux: /proc, so the interpreter's own start-up counts), else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


STARTED = process_start()          # --gpu-check's --minutes count from here: imports included
# Before torch starts OpenMP: on a shared CPU, spinning threads wait a whole time slice for a descheduled partner in
# every parallel region (results/bench_notes.md). Set OMP_WAIT_POLICY=ACTIVE yourself on a dedicated machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # the repo: python tools/bench.py from anywhere
import lra_data  # noqa: E402
from lab import memory  # noqa: E402
from lab.hardware import check_device, unwritable  # noqa: E402
from lab.memory import device_type  # noqa: E402
from tools import checked, speed  # noqa: E402
from tools.checked import at_least, in_range  # noqa: E402  (train.py's flag types)

PRESETS = ["tiny", "small", "paper"]


def fail(message):
    """One line on stderr and exit status 2, never a traceback."""
    print(f"bench.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flag = p.add_argument
    flag("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    flag("--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="layers: autocast dtype")
    flag("--quick", action="store_true", help=f"fewer lengths, shorter timing: {speed.QUICK}")
    flag("--memory", action="store_true", help="estimate the peak memory of the --preset paper runs instead")
    flag("--eval-cache", action="store_true",
         help="an evaluation pass at PathX, SSM kernels per batch vs once per pass, instead")
    flag("--eval-batches", type=at_least(1), default=4, help="--eval-cache: batches in the pass")
    flag("--eval-batch", type=at_least(1), default=2, help="--eval-cache: examples per batch")
    flag("--gpu-check", action="store_true", help="the GPU check (tools/gpu_check.py)")
    flag("--minutes", type=in_range(0, math.inf, open_low=True), default=8.0,
         help="--gpu-check: all of it, from the process's start")
    flag("--check-scale", choices=["paper", "tiny"], default=None,
         help="--gpu-check sizes (default: paper on cuda, tiny on cpu: width 16, one layer, a few steps)")
    flag("--out-dir", default=None, help="--gpu-check: output folder (default: a new temporary folder, printed)")
    flag("--lengths", type=at_least(1), nargs="+", default=None, help=f"lengths L ({speed.FULL['lengths']})")
    flag("--batch", type=at_least(1), default=speed.DEFAULTS["batch"], help="B of one layer's forward+backward")
    flag("--max-tokens", type=at_least(1), default=None, help=f"B ≤ this // L ({speed.FULL['max_tokens']})")
    flag("--d-model", type=at_least(1), default=speed.DEFAULTS["d_model"], help="H, channels of each layer")
    flag("--d-state", type=at_least(1), default=speed.DEFAULTS["d_state"], help="N of S4 (nplr and diag)")
    flag("--dlr-state", type=at_least(1), default=speed.DEFAULTS["dlr_state"], help="N of DLR")
    flag("--n-heads", type=at_least(1), default=speed.DEFAULTS["n_heads"],
         help="attention heads of the Transformer layer")
    flag("--models", nargs="+", choices=speed.LAYERS, default=speed.LAYERS, help="layers to measure")
    flag("--task", choices=lra_data.TASKS, default="pathfinder", help="task of the training-step measurement")
    flag("--presets", nargs="*", choices=PRESETS, default=None,
         help=f"training-step presets ({speed.FULL['presets']})")
    flag("--train-batch", type=at_least(1), default=None, help="B of the training step (preset's ≤ tokens/L)")
    flag("--kernel-precision", action=argparse.BooleanOptionalAction, default=None,
         help="the kernels at PathX with TF32 allowed and guarded (default: on, off with --quick)")
    flag("--min-time", type=in_range(0, math.inf), default=None, help=f"seconds of repeats ({speed.FULL['min_time']})")
    flag("--max-reps", type=at_least(1), default=None, help=f"most timed repeats ({speed.FULL['max_reps']})")
    flag("--max-step-seconds", type=in_range(0, math.inf), default=60.0, help="skip a row predicted slower than this")
    flag("--fit-from", type=at_least(1), default=None, help=f"fit over L ≥ this ({speed.FULL['fit_from']})")
    flag("--out", default="runs/bench.json", help="JSON results; the markdown tables go next to it (.md)")
    p.error = lambda message: fail(f"{message} (python tools/bench.py --help lists the flags)")
    args = p.parse_args(argv)
    for key, value in (speed.QUICK if args.quick else speed.FULL).items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    if len(set(args.lengths)) < len(args.lengths):
        fail(f"--lengths {' '.join(map(str, args.lengths))}: each length once (a repeated length measures nothing "
             "new, and the fit of time against L needs distinct lengths)")
    check_args(args)
    args.check_scale = args.check_scale or ("paper" if device_type(args.device) == "cuda" else "tiny")
    args.kernel_precision = not args.quick if args.kernel_precision is None else args.kernel_precision
    return args


def check_args(args):
    """The device and the output paths (writable, none of them a file that tools/bench.py did not write), before
    anything is measured: one line, exit 2."""
    try:
        check_device(args.device)
    except ValueError as e:
        fail(f"--device {args.device}: {e}")
    flag, path, is_folder = ("--out-dir", args.out_dir, True) if args.gpu_check else ("--out", args.out, False)
    if path is None:                                # --gpu-check without --out-dir: a new temporary folder
        return
    path = Path(path)
    if path.exists() and path.is_dir() != is_folder:
        fail(f"{flag} {path} is a {'file' if is_folder else 'folder'}: pass a "
             f"{'folder' if is_folder else 'file name, e.g. runs/bench.json'}")
    if why := unwritable(path if is_folder else path.parent):
        fail(f"{flag} {path}: cannot write there ({why}); pass a writable place")
    if is_folder:
        from tools.gpu_check import OUTPUTS
        mine = [path / name for name in OUTPUTS]
    elif path.with_suffix(".md") == path:
        fail(f"--out {path}: the JSON results go there and the markdown tables next to it (.md); pass a .json name, "
             f"e.g. {path.with_suffix('.json')}")
    else:
        mine = [path, path.with_suffix(".md")]      # the JSON and the markdown: two paths, both ours
    for file in mine:
        if not checked.owned(file):
            fail(f"{flag} {path}: {file} exists and tools/bench.py did not write it (it is not in "
                 f"{file.parent / checked.MANIFEST}); it is left untouched: move it away or pass another {flag}")


def report(res, args):
    m = res["machine"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads (OMP_NUM_THREADS="
             f"{m['omp_num_threads']}, OMP_WAIT_POLICY={m['omp_wait_policy']}), load average "
             f"{' / '.join(map(str, m['load']))} (1 / 5 / 15 min) at start; torch {m['torch']}; commit {m['commit']}; "
             f"`{m['command']}`; run time {res['seconds']:.0f} s", ""]
    return "\n".join(lines + (memory.memory_lines(res) if args.memory
                               else speed.eval_pass_lines(res["eval_pass"]) if args.eval_cache
                               else speed.speed_lines(res, args)))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args, t0 = parse_args(argv), time.perf_counter()
    if args.gpu_check:
        from tools import gpu_check
        return gpu_check.gpu_check(args, argv, STARTED)
    res = dict(args=vars(args), machine=speed.machine_info(argv, args))
    print(f"bench: {res['machine']}\n  {vars(args)}", flush=True)
    if args.memory:
        res.update(memory=memory.memory_table(), check=memory.memory_check())
    elif args.eval_cache:
        res.update(eval_pass=speed.eval_pass(args, batches=args.eval_batches, batch=args.eval_batch))
    else:
        res.update(speed.speed(args))
    res["seconds"] = time.perf_counter() - t0
    text = report(res, args)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        checked.write_owned(out, json.dumps(res, indent=1), "tools/bench.py")
        checked.write_owned(out.with_suffix(".md"), text + "\n", "tools/bench.py")
    except checked.NotOwned as e:                   # made by someone while we measured
        fail(str(e))
    except OSError as e:
        fail(f"cannot write {out} ({e.strerror or e}): {checked.write_advice(e)}; the results are printed above")
    return res


if __name__ == "__main__":
    sys.exit(1 if main().get("failed") else 0)
