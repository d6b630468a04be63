"""bench.py: speed of the three models, and a GPU check of the paper presets that ships with the repo.
speed:   one layer of each (forward + backward) and its SSM kernel alone at growing length L, and whole training steps
         of train.py's presets; time per step at fixed B ∝ L^p, least squares over ≥ 3 lengths: p ≈ 1 for L log L (FFT
         convolution, block-local attention), p ≈ 2 for full attention; the DLR kernel's GFLOP/s next to the matmul's
memory:  --memory: memory.py's estimate of every --preset paper step's peak, checked against real CPU steps
check:   --gpu-check, ≤ --minutes: the layers, short --preset paper runs of each model on Pathfinder and PathX, then
         the paper's first claim in miniature (Transformer on Pathfinder, from scratch vs SPT); see gpu_check
usage:   python bench.py [--quick] [--device cuda] [--out runs/bench.json]     python bench.py --memory [--out ...]
         python bench.py --device cuda --gpu-check [--minutes 10] [--out-dir results/gpu/<device>]
Check: tests/test_bench.py (a tiny speed run, exponents, the whole --gpu-check at --check-scale tiny on the CPU).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

# Before torch starts OpenMP: on a shared CPU, spinning threads wait a whole time slice for a descheduled partner in
# every parallel region (results/bench_notes.md). Set OMP_WAIT_POLICY=ACTIVE yourself on a dedicated machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

import lra_data  # noqa: E402
import memory  # noqa: E402
import train  # noqa: E402
from dlr import DLR, DLRConfig, DLRKernel  # noqa: E402
from memory import memory_mib, simulated_peak, table, training_case  # noqa: E402
from s4 import S4, S4Config, S4Kernel  # noqa: E402
from transformer import Transformer, TransformerConfig  # noqa: E402

LAYERS = ["transformer-full", "transformer-local", "s4-nplr", "s4-diag", "dlr"]
# --quick is the same measurement with fewer lengths and shorter timing; flags given explicitly win over both.
FULL = dict(lengths=[1024, 4096, 8192, 16384, 65536], max_tokens=4096, min_time=1.0, max_reps=5,
            presets=["tiny", "paper"], fit_from=4096)
QUICK = dict(lengths=[2048, 4096, 8192], max_tokens=2048, min_time=0.2, max_reps=2, presets=["tiny"], fit_from=2048)
FIT_POINTS = 3                # two points fit any power exactly: an exponent needs at least three lengths
W_BLOCK = TransformerConfig.block_size                                    # block-local attention block (4096)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help=f"fewer lengths, shorter timing: {QUICK}")
    p.add_argument("--memory", action="store_true", help="estimate the peak memory of the --preset paper runs instead")
    p.add_argument("--gpu-check", action="store_true", help="layers, short paper runs, TFS vs SPT (see gpu_check)")
    p.add_argument("--minutes", type=float, default=10.0, help="--gpu-check: time budget; what does not fit is skipped")
    p.add_argument("--check-scale", choices=["paper", "tiny"], default=None,
                   help="--gpu-check sizes (default: paper on cuda, tiny on cpu: width 16, one layer, a few steps)")
    p.add_argument("--out-dir", default=None, help="--gpu-check: output folder (default results/gpu/<device>)")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help=f"lengths L (default {FULL['lengths']})")
    p.add_argument("--batch", type=int, default=4, help="B of one layer's forward+backward")
    p.add_argument("--max-tokens", type=int, default=None, help=f"B ≤ this // L (default {FULL['max_tokens']})")
    p.add_argument("--d-model", type=int, default=128, help="H, channels of each layer")
    p.add_argument("--d-state", type=int, default=64, help="N of S4 (nplr and diag)")
    p.add_argument("--dlr-state", type=int, default=1024, help="N of DLR")
    p.add_argument("--n-heads", type=int, default=4, help="attention heads of the Transformer layer")
    p.add_argument("--models", nargs="+", choices=LAYERS, default=LAYERS, help="layers to measure")
    p.add_argument("--task", default="pathfinder", help="task of the whole-training-step measurement")
    p.add_argument("--presets", nargs="*", default=None, help=f"training-step presets ({FULL['presets']})")
    p.add_argument("--train-batch", type=int, default=None, help="B of the training step (preset's ≤ tokens/L)")
    p.add_argument("--min-time", type=float, default=None, help=f"seconds of repeats ({FULL['min_time']})")
    p.add_argument("--max-reps", type=int, default=None, help=f"most timed repeats (default {FULL['max_reps']})")
    p.add_argument("--max-step-seconds", type=float, default=60.0, help="skip a row whose step is predicted longer")
    p.add_argument("--fit-from", type=int, default=None, help=f"fit over L ≥ this ({FULL['fit_from']})")
    p.add_argument("--out", default="runs/bench.json", help="JSON results; the markdown tables go next to it (.md)")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    args.check_scale = args.check_scale or ("paper" if args.device.startswith("cuda") else "tiny")
    return args


# ---- measuring: time, the machine's matmul --------------------------------------------------------------------------

def timed(fn, args, slow=30.0):
    """Best seconds per call of fn. Best, not mean: on a shared machine other jobs only ever add time. The first call
    also pays one-time costs (allocator, FFT plans, thread pool), so min() drops it, unless it took over `slow`
    seconds: then it is the measurement. Otherwise repeats until args.min_time seconds after the first call, at
    least once, at most args.max_reps times. Returns (seconds, calls)."""
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def call():
        t0 = time.perf_counter()
        fn(), sync()
        return time.perf_counter() - t0

    times = [call()]
    while times[0] < slow and (len(times) < 2 or (sum(times[1:]) < args.min_time and len(times) <= args.max_reps)):
        times.append(call())
    return min(times), len(times)


def matmul_gflops(args):
    """The machine's own limit: a dense float32 (n×n)·(n×n) matmul, 2n³ flops, n big enough for the BLAS peak."""
    n = 8192 if args.device == "cuda" else 2048
    a, b = torch.randn(n, n, device=args.device), torch.randn(n, n, device=args.device)
    return 2 * n**3 / timed(lambda: a @ b, args)[0] / 1e9


# ---- speed: one layer at growing length, whole training steps -------------------------------------------------------

def build_layer(name, args):
    """One block of each model (n_layers=1, float input d_input=1, no dropout): encoder → block → final norm."""
    H = args.d_model
    if name.startswith("transformer"):
        # local_min_len pins the attention kind at every L: 0 = always block-local, 2**62 = always full
        return Transformer(TransformerConfig(d_model=H, n_layers=1, n_heads=args.n_heads, d_ff=4 * H, dropout=0.0,
                                             local_min_len=0 if name == "transformer-local" else 2**62))
    if name.startswith("s4"):
        return S4(S4Config(d_model=H, n_layers=1, d_state=args.d_state, mode=name[3:], dropout=0.0))
    return DLR(DLRConfig(d_model=H, n_layers=1, d_state=args.dlr_state, dropout=0.0))


def layer_case(name, L, B, args):
    """(build, forward) of one layer's step on (B, L, 1) floats; loss = mean square of the features (B, L, H)."""
    def forward(model):
        return model(torch.randn(B, L, 1, device=next(model.parameters()).device)).square().mean()
    return (lambda: build_layer(name, args)), forward


def measure_layer(name, L, B, args):
    """Forward+backward of one layer: seconds, tokens/s, peak memory and the base under it (MiB); then its kernel
    alone, and for DLR the kernel's GFLOP/s with the machine's matmul's, measured at the same moment."""
    torch.manual_seed(0)
    build, forward = layer_case(name, L, B, args)
    model = build().to(args.device)

    def step():
        model.zero_grad(set_to_none=True)
        forward(model).backward()

    base = memory_mib(args.device, "now", reset=True)                     # interpreter, torch, weights
    seconds, reps = timed(step, args)
    row = dict(seconds=seconds, reps=reps, tokens_per_s=B * L / seconds, peak_mib=memory_mib(args.device, "peak"),
               base_mib=base)
    kernel = next((m for m in model.modules() if isinstance(m, (S4Kernel, DLRKernel))), None)
    if kernel is not None:
        with torch.no_grad():
            row["kernel_seconds"] = timed(lambda: kernel(L), args)[0]
    if name == "dlr":   # per direction, K = Re(W·λ^l) is one real matmul on (re, im) pairs: 4·H·N·L flops; the
        S = 2 if model.cfg.bidirectional else 1     # split-power tables add 6·H·N·L/c, c ≈ √(H·L): left out
        row["kernel_gflops"] = S * 4 * args.d_model * args.dlr_state * L / row["kernel_seconds"] / 1e9
        row["matmul_gflops"] = matmul_gflops(args)
    return row


def layer_table(args):
    """Every (layer, L), in order of L. A row says why it is skipped: block-local attention below one block (the model
    uses full attention there), an estimated peak above half the free memory (the machine is shared), or the previous
    length's time scaled by B and L (L² for full attention) above --max-step-seconds."""
    rows, free = [], memory_mib(args.device, "free")
    for name in args.models:
        prev = None
        for L in args.lengths:
            B = max(1, min(args.batch, args.max_tokens // L))
            row = dict(model=name, L=L, B=B, est_mib=simulated_peak(*layer_case(name, L, B, args), "fp32")[2] / 2**20,
                       load=os.getloadavg()[0])
            p = 2 if name == "transformer-full" else 1
            guess = prev and prev["seconds"] * B / prev["B"] * (L / prev["L"]) ** p
            if name == "transformer-local" and L < W_BLOCK:
                row["skipped"] = f"n/a: L < block {W_BLOCK}, the model uses full attention"
            elif row["est_mib"] > free / 2:
                row["skipped"] = f"would not fit: ~{row['est_mib'] / 1024:.1f} GiB > half of {free / 1024:.0f} GiB free"
            elif guess and guess > args.max_step_seconds:
                row["skipped"] = f"~{guess:.0f} s/step > --max-step-seconds"
            else:
                prev = row = dict(row, **measure_layer(name, L, B, args))
            rows.append(row)
            print(f"  {name:18s} L {L:6d} B {B}  " + row.get("skipped", f"{row.get('tokens_per_s', 0):9.0f} tokens/s"),
                  flush=True)
    return rows


def fit_exponent(rows, name, fit_from):
    """Least-squares slope p of log(seconds per step) against log L over the measured L ≥ fit_from, at the B of the
    longest of them only (an SSM computes its kernel once per batch, so time is not linear in B). With fewer than
    FIT_POINTS such lengths there is no exponent: p is None and `why` says so."""
    rows = [r for r in rows if r["model"] == name and "seconds" in r and r["L"] >= fit_from]
    rows = [r for r in rows if r["B"] == rows[-1]["B"]] if rows else []
    fit = dict(p=None, lengths=[r["L"] for r in rows])
    if len(rows) < FIT_POINTS:
        return dict(fit, why=f"needs ≥ {FIT_POINTS} lengths ≥ fit_from {fit_from} at one B")
    pts = [(math.log(r["L"]), math.log(r["seconds"])) for r in rows]
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return dict(fit, p=sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts))


def train_step(model_name, preset, args):
    """One whole training step (forward, cross-entropy, backward, AdamW) of a train.py preset's classifier on a random
    full-length batch of args.task: the step whose memory the estimate counts."""
    values, L = train.preset_values(preset, model_name, args.task, spt=False), lra_data.TASKS[args.task].max_len
    B = args.train_batch or max(1, min(values["batch_size"], args.max_tokens // L))
    build, forward = training_case(model_name, args.task, values, "finetune", B, L)
    torch.manual_seed(0)
    model = build().to(args.device)
    opt = torch.optim.AdamW(model.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        forward(model).backward()
        opt.step()

    row = dict(model=model_name, preset=preset, B=B, L=L, load=os.getloadavg()[0])
    row["seconds"], row["reps"] = timed(step, args)
    row["tokens_per_s"] = B * L * (2 if lra_data.TASKS[args.task].pair else 1) / row["seconds"]
    print(f"  train step {model_name:11s} {preset:5s} B {B} L {L}  {row['tokens_per_s']:9.0f} tokens/s", flush=True)
    return row


# ---- the report: machine, tables ------------------------------------------------------------------------------------

def machine_info(argv, args):
    """What the numbers depend on: the machine, its load (1, 5, 15 min), the threads, torch, the commit."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    git = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent)
    return dict(cpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu, cores=os.cpu_count(),
                torch_threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), load=[round(x, 2) for x in os.getloadavg()],
                torch=torch.__version__, commit=git.stdout.strip() or "?", command=" ".join(["python bench.py", *argv]))


def report(res, args):
    m = res["machine"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads (OMP_NUM_THREADS="
             f"{m['omp_num_threads']}, OMP_WAIT_POLICY={m['omp_wait_policy']}), load average "
             f"{' / '.join(map(str, m['load']))} (1 / 5 / 15 min) at start; torch {m['torch']}; commit {m['commit']}; "
             f"`{m['command']}`; run time {res['seconds']:.0f} s", ""]
    return "\n".join(lines + (memory.memory_lines(res) if args.memory else speed_lines(res, args)))


def speed_lines(res, args):
    peak = ("CUDA max allocated" if args.device == "cuda" else "the resident set's peak (VmHWM) in the row, after "
            "malloc_trim: also malloc's fragmentation and library buffers (results/bench_notes.md)")
    lines = [f"dense float32 matmul: {res['matmul_gflops']:.0f} GFLOP/s. B = min(--batch {args.batch}, --max-tokens "
             f"{args.max_tokens} // L); time = best of n calls; peak = {peak}; base = in use before the row; est. = "
             "tensor bytes above the base, counted on fake tensors; load = 1-min load average at the row", ""]
    cells = lambda r: ([r["skipped"], "", ""] if "skipped" in r else   # noqa: E731
                       [f"{1e3 * r['seconds']:.1f} (n={r['reps']})", f"{r['tokens_per_s']:.0f}",
                        f"{r['peak_mib']:.0f} ({r['base_mib']:.0f})"])
    kernel = lambda r: ([f"{1e3 * r['kernel_seconds']:.1f}" if "kernel_seconds" in r else "",  # noqa: E731
                         f"{r['kernel_gflops']:.1f} ({r['kernel_gflops'] / r['matmul_gflops']:.0%} of "
                         f"{r['matmul_gflops']:.0f})" if "kernel_gflops" in r else ""])
    lines += table(["layer", "L", "B", "ms / step (fwd+bwd)", "tokens/s", "peak MiB (base)", "est. MiB above base",
                    "kernel ms", "kernel GFLOP/s (of matmul)", "load"],
                   [[r["model"], r["L"], r["B"], *cells(r), f"{r['est_mib']:.0f}", *kernel(r), f"{r['load']:.2f}"]
                    for r in res["layers"]])
    lines += ["", f"growth: time per step ∝ L^p, least squares over L ≥ --fit-from {args.fit_from} at one B", ""]
    lines += table(["layer", "lengths fitted", "p"], [[name, ", ".join(map(str, f["lengths"])) or "–", f["why"]
                   if f["p"] is None else f"{f['p']:.2f}"] for name, f in res["exponents"].items()])
    if res["train"]:
        lines += ["", f"whole training step (forward, loss, backward, AdamW) on {args.task}:", ""]
        lines += table(["model", "preset", "B", "L", "ms / step", "tokens/s", "load"],
                       [[r["model"], r["preset"], r["B"], r["L"], f"{1e3 * r['seconds']:.0f} (n={r['reps']})",
                         f"{r['tokens_per_s']:.0f}", f"{r['load']:.2f}"] for r in res["train"]])
    return lines


def speed(args):
    """The speed measurements: the machine's matmul, each layer at each length, the exponents, training steps."""
    res = dict(matmul_gflops=matmul_gflops(args), layers=layer_table(args))
    res["exponents"] = {name: fit_exponent(res["layers"], name, args.fit_from) for name in args.models}
    res["train"] = [train_step(name, preset, args) for preset in args.presets for name in train.MODELS]
    return res


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args, t0 = parse_args(argv), time.perf_counter()
    if args.gpu_check:                                                   # gpu_check.py: its own concept
        import gpu_check
        return gpu_check.gpu_check(args, argv)
    res = dict(args=vars(args), machine=machine_info(argv, args))
    print(f"bench: {res['machine']}\n  {vars(args)}", flush=True)
    res.update(dict(memory=memory.memory_table(), check=memory.memory_check()) if args.memory else speed(args))
    res["seconds"] = time.perf_counter() - t0
    text = report(res, args)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(text + "\n")
    return res


if __name__ == "__main__":
    sys.exit(1 if main().get("failed") else 0)
