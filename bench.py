"""bench.py: speed and memory of the three models. Speed: one layer of each (forward + backward) and its SSM kernel
alone at growing length L, and whole training steps of train.py's presets. Memory: the peak of one training step of
every `--preset paper` model at its task's full length, estimated on fake tensors (shapes and dtypes, no data).
speed:   time per step at fixed B ∝ L^p, least squares over ≥ 3 lengths: p ≈ 1 for L log L (FFT convolution,
         block-local attention), p ≈ 2 for full attention; the DLR kernel's GFLOP/s next to the machine's matmul's
memory:  peak = 4 × parameter bytes (weights, gradients, AdamW's two moments) + the most bytes live at once in one
         step's forward and backward  -> equals a real step's memory growth on a CPU: tests/test_bench.py
usage:   python bench.py [--quick] [--device cuda] [--out runs/bench.json]     python bench.py --memory [--out ...]
"""
import argparse
import ctypes
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

# Before torch starts OpenMP: on a shared CPU, spinning threads wait a whole time slice for a descheduled partner in
# every parallel region (results/bench_notes.md). Set OMP_WAIT_POLICY=ACTIVE yourself on a dedicated machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import denoise  # noqa: E402
import lra_data  # noqa: E402
import train  # noqa: E402
from dlr import DLR, DLRConfig, DLRKernel  # noqa: E402
from s4 import S4, S4Config, S4Kernel  # noqa: E402
from transformer import Transformer, TransformerConfig  # noqa: E402

LAYERS = ["transformer-full", "transformer-local", "s4-nplr", "s4-diag", "dlr"]
# --quick is the same measurement with fewer lengths and shorter timing; flags given explicitly win over both.
FULL = dict(lengths=[1024, 4096, 8192, 16384, 65536], max_tokens=4096, min_time=1.0, max_reps=5, presets=["tiny", "paper"],
            fit_from=4096)
QUICK = dict(lengths=[2048, 4096, 8192], max_tokens=2048, min_time=0.2, max_reps=2, presets=["tiny"], fit_from=2048)
FIT_POINTS = 3                # two points fit any power exactly: an exponent needs at least three lengths
W_BLOCK = TransformerConfig.block_size                                    # block-local attention block (4096)
PRECISIONS, PHASES = ["fp32", "bf16"], ["finetune", "spt"]
GPU_GIB, HEADROOM = 80, 0.9   # fits = estimate ≤ 90 % of an 80 GB card (80 GiB); the 10 % are for what the estimate
                              # leaves out: CUDA context, cuFFT / cuBLAS workspaces, allocator rounding
# estimate vs a real CPU step, small sizes: (model, task, phase, precision, B, lengths); S4 keeps N = 64
CHECKS = [("dlr", "pathfinder", "finetune", "fp32", 8, [1024, 2048]),
          ("s4", "listops", "finetune", "fp32", 8, [1024, 2048]), ("s4", "pathfinder", "spt", "bf16", 8, [1024, 2048]),
          ("transformer", "text", "finetune", "bf16", 16, [512, 1024])]
CHECK_SIZE = dict(d_model=64, n_layers=2, n_heads=4, d_ff=128, dropout=0.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help=f"about a minute on 2 CPU cores: {QUICK}")
    p.add_argument("--memory", action="store_true", help="estimate the peak memory of the --preset paper runs instead")
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
    return args


# ---- measuring: time, the machine's matmul, memory ------------------------------------------------------------------

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


def memory_mib(device, what, reset=False):
    """MiB of memory: what = "now" (CUDA allocated / resident set), "peak" (since the last reset: CUDA's allocator
    counter, or VmHWM, reset by writing 5 to /proc/self/clear_refs, Linux) or "free"."""
    if device == "cuda":
        if reset:
            torch.cuda.reset_peak_memory_stats()
        info = dict(now=torch.cuda.memory_allocated, peak=torch.cuda.max_memory_allocated,
                    free=lambda: torch.cuda.mem_get_info()[0])
        return info[what]() / 2**20
    if reset:                                # first hand memory that malloc keeps for reuse back to the system
        ctypes.CDLL(None).malloc_trim(0)     # (glibc), so that what the row needs shows in the resident set
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    key, path = dict(now=("VmRSS", "self/status"), peak=("VmHWM", "self/status"), free=("MemAvailable", "meminfo"),
                     )[what]
    with open(f"/proc/{path}") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


# ---- memory without allocating it: a counting dispatch mode on fake tensors -----------------------------------------

class LiveBytes(TorchDispatchMode):
    """A simulated allocator: the bytes of every storage that some tensor made under this mode still uses (views share
    their base's), and their peak. The models read no data to decide shapes, so fake tensors run them unchanged."""

    def __init__(self):
        super().__init__()
        self.users, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def track(self, t):
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if key not in self.users:
            self.users[key], self.now = 0, self.now + nbytes
            self.peak = max(self.peak, self.now)
        self.users[key] += 1
        weakref.finalize(t, self.release, key, nbytes)   # runs when the tensor (also one autograd keeps) is gone

    def release(self, key, nbytes):
        self.users[key] -= 1
        if not self.users[key]:
            del self.users[key]
            self.now -= nbytes


def autocast(precision, device="cpu"):
    """bf16 = autocast as train.py runs it on a GPU by default (matmuls, attention in bf16; the SSM block keeps its
    kernel and FFT convolution in fp32). On fake CPU tensors CPU autocast stands in for CUDA's (for these models both
    cast the same ops), and CPU fused attention for the GPU's flash / memory-efficient kernels (no L×L matrix)."""
    return torch.autocast(device, torch.bfloat16, enabled=precision == "bf16")


def simulated_peak(build, forward, precision):
    """(parameters, their bytes, peak bytes of one step above them) of model = build(), on fake tensors: nothing is
    allocated. The step: loss = forward(model) under autocast, loss.backward(). Autograd keeps the saved
    tensors themselves (not shallow copies), so the counter sees each one live until backward frees it."""
    with FakeTensorMode():
        model = build()
        counter, keep = LiveBytes(), (lambda t: t)
        with counter, torch.autograd.graph.saved_tensors_hooks(keep, keep):
            with autocast(precision):
                loss = forward(model)
            loss.backward()
            del loss
    return sum(p.numel() for p in model.parameters()), sum(p.nbytes for p in model.parameters()), counter.peak


def training_case(model_name, task, values, phase, B, L):
    """(build, forward) of one training step of train.py's model on a random batch of full length L: classifier +
    cross-entropy (finetune), or denoising head at every position + its loss on the masked ones (spt). Token tasks
    take the padded path (lengths given, all real: the larger case), pixel tasks are never padded (lengths None).
    Retrieval: two documents per example, so 2·B sequences."""
    spec, cfg, n_out = lra_data.TASKS[task], train.model_config(model_name, task, values), train.n_outputs(task)
    head = (dict(kind="denoise", n_out=n_out) if phase == "spt" else
            dict(kind="classifier", n_classes=spec.n_classes, pool=spec.pool, pair=spec.pair))
    meta = dict(model_name=model_name, config=dataclasses.asdict(cfg), head=head)

    def forward(model):
        device, rows = next(model.parameters()).device, 2 * B if spec.pair else B
        shape = (B, 2, L) if spec.pair and phase == "finetune" else (rows, L)        # the classifier pairs them
        x = (torch.randint(4, spec.vocab_size, shape, device=device) if cfg.vocab_size else
             torch.randn(*shape, cfg.d_input, device=device))                       # ids, or (..., L, 2) pixels
        lengths = torch.full(shape[:-1], L, device=device) if cfg.vocab_size else None   # (B,), (B, 2), (2B,)
        if phase == "finetune":
            return denoise.loss(model(x, lengths), torch.randint(0, spec.n_classes, (B,), device=device))
        target = (torch.rand(rows, L, device=device) if n_out == 1 else
                  torch.randint(0, n_out, (rows, L), device=device))                # (rows, L)
        weight = (torch.rand(rows, L, device=device) < spec.mask_ratio).float()     # 1 where masked
        return denoise.loss(model(x, lengths), target, weight)                       # predictions (rows, L, n_out)
    return (lambda: train.build_model(meta)), forward


def training_memory(model_name, task, values, phase, B, L, precision):
    """Estimated peak bytes of one training step (see the file header), with its parts. The layers are identical and
    each adds the same bytes at the moment of the peak (its saved activations), so the count is affine in n_layers:
    runs with 1 and 2 layers give it for any number (tests/test_bench.py checks this against the whole model)."""
    one, two = (simulated_peak(*training_case(model_name, task, {**values, "n_layers": n}, phase, B, L), precision)
                for n in (1, 2))
    n_params, param_bytes, step = (a + (values["n_layers"] - 1) * (b - a) for a, b in zip(one, two))
    return dict(n_params=n_params, step=step, peak=4 * param_bytes + step)


def paper_memory(model_name, task, phase, precision, accum_steps=None):
    """The estimate of one --preset paper step of `phase` at the task's full length and micro-batch
    ⌈batch / accum_steps⌉ (accum_steps: the preset's unless given), and whether it fits. Fine-tuning runs from
    scratch (TFS) or after SPT, whose batch sizes may differ: the run with the larger micro-batch counts."""
    runs = []
    for spt in [True] if phase == "spt" else [False, True]:
        v = train.preset_values("paper", model_name, task, spt)
        batch, accum = ((v["pretrain_batch_size"], v["pretrain_accum_steps"]) if phase == "spt" else
                        (v["batch_size"], v["accum_steps"]))
        runs.append((-(-batch // (accum_steps or accum)), batch, accum_steps or accum, v))
    micro, batch, accum, values = max(runs, key=lambda r: r[0])
    est = training_memory(model_name, task, values, phase, micro, lra_data.TASKS[task].max_len, precision)
    return dict(est, L=lra_data.TASKS[task].max_len, batch=batch, accum_steps=accum, micro_batch=micro,
                gib=est["peak"] / 2**30, fits=est["peak"] <= HEADROOM * GPU_GIB * 2**30)


def accum_to_fit(model_name, task, phase, precision="bf16"):
    """The smallest power-of-two accum_steps at which the phase fits; None if one example per step does not."""
    accum = 1
    while not (est := paper_memory(model_name, task, phase, precision, accum))["fits"]:
        if est["micro_batch"] == 1:
            return None
        accum *= 2
    return accum


def memory_table():
    """Every --preset paper model × task × phase in both precisions, with the accum_steps that fit in bf16."""
    rows = []
    for model_name, task, phase in [(m, t, p) for m in train.MODELS for t in lra_data.TASKS for p in PHASES]:
        est = {precision: paper_memory(model_name, task, phase, precision) for precision in PRECISIONS}
        keep = ("n_params", "L", "batch", "accum_steps", "micro_batch")
        rows.append(dict(model=model_name, task=task, phase=phase, **{k: est["bf16"][k] for k in keep},
                         **{f"{p}_{k}": est[p][k] for p in PRECISIONS for k in ("gib", "fits")},
                         accum_to_fit=est["bf16"]["accum_steps"] if est["bf16"]["fits"] else
                         accum_to_fit(model_name, task, phase)))
        print(f"  {model_name:11s} {task:10s} {phase:8s} micro-batch {rows[-1]['micro_batch']:3d}: fp32 "
              f"{est['fp32']['gib']:6.1f} GiB, bf16 {est['bf16']['gib']:6.1f} GiB", flush=True)
    return rows


def check_values(model_name, task, phase):
    """The tiny preset's settings at CHECK_SIZE (DLR N = 256; S4 keeps its N = 64) for a check's small model."""
    return {**train.preset_values("tiny", model_name, task, phase == "spt"), **CHECK_SIZE,
            **({} if model_name == "s4" else dict(d_state=256))}


def memory_growth(cases):
    """The real side of a check, in this process: for each (model, task, phase, precision, B, lengths) of `cases` and
    each length, the growth of the resident set over one training step (forward, backward, AdamW), MiB. A first step
    at L = 32 loads the libraries and makes AdamW's state: what grows later is what the estimate's `step` counts."""
    grown = []
    for model_name, task, phase, precision, B, lengths in cases:
        torch.manual_seed(0)
        values = check_values(model_name, task, phase)
        model = training_case(model_name, task, values, phase, B, 32)[0]()
        opt = torch.optim.AdamW(model.parameters())
        for L in [32, *lengths]:
            forward, before = training_case(model_name, task, values, phase, B, L)[1], memory_mib("cpu", "now", True)
            with autocast(precision):
                loss = forward(model)
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
            grown += [memory_mib("cpu", "peak") - before] if L != 32 else []
    return grown


def measure_memory(cases):
    """memory_growth(cases) in a fresh process with one thread, where large allocations each get their own mmap
    (MALLOC_MMAP_THRESHOLD_): freed memory leaves the resident set at once, so its peak is the peak of live memory."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    code = "import bench, json, sys; print(json.dumps(bench.memory_growth(json.load(sys.stdin))))"
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent)
    if out.returncode:
        raise RuntimeError(f"memory measurement failed: {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_check(cases=CHECKS):
    """Estimate vs measurement for each case and length: rows with est_mib and measured_mib."""
    measured = iter(measure_memory(cases))
    return [dict(model=m, task=t, phase=p, precision=pr, B=B, L=L, measured_mib=next(measured),
                 est_mib=training_memory(m, t, check_values(m, t, p), p, B, L, pr)["step"] / 2**20)
            for m, t, p, pr, B, lengths in cases for L in lengths]


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
    return dict(cpu=torch.cuda.get_device_name() if args.device == "cuda" else cpu, cores=os.cpu_count(),
                torch_threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), load=[round(x, 2) for x in os.getloadavg()],
                torch=torch.__version__, commit=git.stdout.strip() or "?", command=" ".join(["python bench.py", *argv]))


def table(header, rows):
    """Markdown table lines (readable in a terminal too)."""
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header), *(f"| {' | '.join(map(str, r))} |" for r in rows)]


def report(res, args):
    m = res["machine"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads (OMP_NUM_THREADS="
             f"{m['omp_num_threads']}, OMP_WAIT_POLICY={m['omp_wait_policy']}), load average "
             f"{' / '.join(map(str, m['load']))} (1 / 5 / 15 min) at start; torch {m['torch']}; commit {m['commit']}; "
             f"`{m['command']}`; run time {res['seconds']:.0f} s", ""]
    return "\n".join(lines + (memory_lines(res) if args.memory else speed_lines(res, args)))


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


def memory_lines(res):
    yes = lambda ok: "yes" if ok else "NO"  # noqa: E731
    lines = ["Peak memory of one --preset paper training step at the task's full length, estimated: 4 × parameter "
             "bytes (weights, gradients, AdamW) + the most bytes live at once in forward + backward, counted on fake "
             "tensors. bf16 = autocast (matmuls, attention in bf16; SSM kernels and FFT convolutions in fp32). "
             "micro-batch = ⌈batch / accum_steps⌉; fine-tuning: the larger of TFS's and after-SPT's. fits = ≤ "
             f"{HEADROOM:.0%} of {GPU_GIB} GiB. Last column: the smallest power-of-two accum_steps that fits in "
             "bf16.", ""]
    lines += table(["model", "task", "phase", "params", "L", "batch", "accum_steps", "micro-batch", "fp32 GiB",
                    "bf16 GiB", "fits 80 GB fp32 / bf16", "accum_steps to fit (bf16)"],
                   [[r["model"], r["task"], r["phase"], f"{r['n_params']:,}", r["L"], r["batch"], r["accum_steps"],
                     r["micro_batch"], f"{r['fp32_gib']:.1f}", f"{r['bf16_gib']:.1f}",
                     f"{yes(r['fp32_fits'])} / {yes(r['bf16_fits'])}", r["accum_to_fit"] or "not even at 1 example"]
                    for r in res["memory"]])
    lines += ["", f"check: the estimate vs a real training step on this CPU (fresh process, one thread), memory above "
              f"weights + AdamW state; sizes {CHECK_SIZE}, DLR N = 256, S4 N = 64:", ""]
    lines += table(["model", "task", "phase", "precision", "B", "L", "estimated MiB", "measured MiB", "est./measured"],
                   [[r["model"], r["task"], r["phase"], r["precision"], r["B"], r["L"], f"{r['est_mib']:.1f}",
                     f"{r['measured_mib']:.1f}", f"{r['est_mib'] / r['measured_mib']:.3f}"] for r in res["check"]])
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args, t0 = parse_args(argv), time.perf_counter()
    res = dict(args=vars(args), machine=machine_info(argv, args))
    print(f"bench: {res['machine']}\n  {vars(args)}", flush=True)
    if args.memory:
        res["memory"], res["check"] = memory_table(), memory_check()
    else:
        res["matmul_gflops"], res["layers"] = matmul_gflops(args), layer_table(args)
        res["exponents"] = {name: fit_exponent(res["layers"], name, args.fit_from) for name in args.models}
        res["train"] = [train_step(name, preset, args) for preset in args.presets for name in train.MODELS]
    res["seconds"] = time.perf_counter() - t0
    text = report(res, args)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(text + "\n")
    return res


if __name__ == "__main__":
    main()
