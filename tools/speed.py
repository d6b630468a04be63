"""tools/speed.py: what tools/bench.py measures for speed: one layer of each model (forward + backward) and its SSM kernel
alone at growing length L, the kernels' cost of exact float32 matmuls (TF32 off), whole training steps of train.py's
presets; time per step at fixed B ∝ L^p, least squares over ≥ 3 lengths: p ≈ 1 for L log L (FFT convolution,
block-local attention), p ≈ 2 for full attention; the DLR kernel's GFLOP/s next to the machine's own matmul.
Clocks start and stop after torch.cuda.synchronize() on a CUDA device (the GPU runs behind the host).
Check: tests/test_bench.py.
"""
import argparse
import contextlib
import copy
import dataclasses
import math
import os
import statistics
import time

import torch

import lra_data
import models
import ssm
from dlr import DLR, DLRConfig, DLRKernel
from s4 import S4, S4Config, S4Kernel
from lab.run import git_commit, machine
from lab.memory import Phase, device_type, memory_mib, simulated_peak, table, training_case
from transformer import Transformer, TransformerConfig
from lab import presets

LAYERS = ["transformer-full", "transformer-local", "s4-nplr", "s4-diag", "dlr"]
# --quick is the same measurement with fewer lengths and shorter timing; flags given explicitly win over both.
FULL = dict(lengths=[1024, 4096, 8192, 16384, 65536], max_tokens=4096, min_time=1.0, max_reps=5,
            presets=["tiny", "paper"], fit_from=4096)
QUICK = dict(lengths=[2048, 4096, 8192], max_tokens=2048, min_time=0.2, max_reps=2, presets=["tiny"], fit_from=2048)
# the other settings of a measurement (tools/bench.py's flags of the same names)
DEFAULTS = dict(device="cpu", precision="fp32", batch=4, d_model=128, d_state=64, dlr_state=1024, n_heads=4,
                models=LAYERS, task="pathfinder", train_batch=None, kernel_precision=False, max_step_seconds=60.0)
FIT_POINTS = 3                # two points fit any power exactly: an exponent needs at least three lengths
W_BLOCK = TransformerConfig.block_size                                    # block-local attention block (4096)


def settings(quick=True, **given):
    """The settings of a measurement without tools/bench.py's command line: DEFAULTS, then QUICK (or FULL), then `given`."""
    return argparse.Namespace(**{**DEFAULTS, **(QUICK if quick else FULL), **given})


# ---- measuring: time, the machine's matmul --------------------------------------------------------------------------

def synchronizer(device):
    """torch.cuda.synchronize for a CUDA device (any index), else nothing: a clock read without it on a GPU measures
    how fast the host queues kernels, not how fast they run."""
    return (lambda: torch.cuda.synchronize(device)) if device_type(device) == "cuda" else (lambda: None)


def timed(fn, args, slow=30.0):
    """Best seconds per call of fn on args.device, each clock read after a synchronisation (before the start too, so
    work queued earlier is not counted). Best, not mean: on a shared machine other jobs only ever add time. The first
    call also pays one-time costs (allocator, FFT plans, thread pool), so min() drops it, unless it took over `slow`
    seconds: then it is the measurement. Otherwise repeats until args.min_time seconds after the first call, at
    least once, at most args.max_reps times. Returns (seconds, calls)."""
    sync = synchronizer(args.device)

    def call():
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    times = [call()]
    while times[0] < slow and (len(times) < 2 or (sum(times[1:]) < args.min_time and len(times) <= args.max_reps)):
        times.append(call())
    return min(times), len(times)


def matmul_gflops(args):
    """The machine's own limit: a dense float32 (n×n)·(n×n) matmul, 2n³ flops, n big enough for the BLAS peak."""
    n = 8192 if device_type(args.device) == "cuda" else 2048
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


def autocast(args):
    """The layers' precision: "fp32", or autocast in "bf16" / "fp16" as train.py runs it (SSM kernels stay fp32)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    return torch.autocast(device_type(args.device), dtype, enabled=dtype is not None)


def measure_layer(name, L, B, args):
    """Forward+backward of one layer under args.precision: seconds, tokens/s, peak memory allocated (and reserved, on
    CUDA) and the base under it (MiB); then its kernel alone, and for DLR the kernel's GFLOP/s with the machine's
    matmul's, measured at the same moment."""
    torch.manual_seed(0)
    build, forward = layer_case(name, L, B, args)
    model = build().to(args.device)

    def step():
        model.zero_grad(set_to_none=True)
        with autocast(args):
            loss = forward(model)
        loss.float().backward()

    base = memory_mib(args.device, "now", reset=True)                     # interpreter, torch, weights
    seconds, reps = timed(step, args)
    row = dict(seconds=seconds, reps=reps, tokens_per_s=B * L / seconds, peak_mib=memory_mib(args.device, "peak"),
               reserved_mib=memory_mib(args.device, "reserved_peak"), base_mib=base)
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
    if len({r["L"] for r in rows}) < FIT_POINTS:             # distinct lengths: a repeated L fits no slope
        return dict(fit, why=f"needs ≥ {FIT_POINTS} lengths ≥ fit_from {fit_from} at one B")
    logs = [(math.log(r["L"]), math.log(r["seconds"])) for r in rows]
    return dict(fit, p=statistics.linear_regression(*zip(*logs)).slope)


def train_step(model_name, preset, args):
    """One whole training step (forward, cross-entropy, backward, AdamW) of a train.py preset's classifier on a random
    full-length batch of args.task: the step whose memory the estimate counts."""
    values, L = presets.values_for(preset, model_name, args.task, spt=False), lra_data.TASKS[args.task].max_len
    B = args.train_batch or max(1, min(values["batch_size"], args.max_tokens // L))
    build, forward = training_case(Phase(model_name, args.task, values, "finetune", L), B)
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


def eval_pass(args, task="pathx", batches=4, batch=2, size=None):
    """What computing each SSM kernel once per evaluation pass saves (ssm.SSMLayer.kernel_of): one pass of `batches`
    random full-length batches of `batch` examples through the --preset paper classifier of S4 and DLR on `task`, in
    eval mode under no_grad, with the kernels cached (now) and computed in every forward (before), the same weights
    and inputs; size: preset values to override (tests: a small model). -> rows with both seconds, their ratio and
    the largest output difference."""
    rows, L = [], lra_data.TASKS[task].max_len
    for model_name in ("s4", "dlr"):
        values = {**presets.values_for("paper", model_name, task, spt=False), **(size or {})}
        torch.manual_seed(0)
        model = training_case(Phase(model_name, task, values, "finetune", L), batch)[0]().to(args.device).eval()
        xs = [torch.randn(batch, L, model.backbone.cfg.d_input, device=args.device) for _ in range(batches)]
        out = {}
        for cached in (False, True):
            if not cached:                                   # the code before: the kernel in every forward
                for layer in model.backbone.layers:
                    layer.kernel_of = lambda L, kernel=layer.kernel: kernel(L)     # shadows the method
            logits = []                                      # (batches·batch, classes)
            with torch.no_grad():
                model.eval()                                 # a new pass, timed once (slow=0)
                seconds = timed(lambda: logits.append(torch.cat([model(x, None) for x in xs])), args, slow=0)[0]
            out[cached] = (seconds, logits[0])
            for layer in model.backbone.layers:
                layer.__dict__.pop("kernel_of", None)
        (before, a), (now, b) = out[False], out[True]
        rows.append(dict(model=model_name, task=task, L=L, batches=batches, batch=batch,
                         layers=values["n_layers"], d_model=values["d_model"], before_s=before, cached_s=now,
                         ratio=before / now, max_abs_diff=float((a - b).abs().max())))
        print(f"  eval pass {model_name:4s} {task} {batches} batches of {batch}: kernel every batch {before:.1f} s, "
              f"once per pass {now:.1f} s ({before / now:.2f}x), max |diff| {rows[-1]['max_abs_diff']:.1e}",
              flush=True)
    return rows


def eval_pass_lines(rows):
    """The markdown of `python tools/bench.py --eval-cache`."""
    return ["Evaluation pass (eval mode, no_grad) of the --preset paper classifier on random full-length inputs: SSM "
            "kernels computed in every forward (before) vs once per pass (ssm.SSMLayer.kernel_of, now). The saving "
            "grows with the batches in a pass (PathX: 20,000 validation examples of the 200,000 generated, at batch 64: 313 batches).", "",
            *table(["model", "task", "L", "layers × H", "batches × B", "before s", "now s", "before / now",
                    "max |logit diff|"],
                   [[r["model"], r["task"], r["L"], f"{r['layers']} × {r['d_model']}", f"{r['batches']} × {r['batch']}",
                     f"{r['before_s']:.1f}", f"{r['cached_s']:.1f}", f"{r['ratio']:.2f}", f"{r['max_abs_diff']:.1e}"]
                    for r in rows])]


# ---- the report: machine, tables ------------------------------------------------------------------------------------

def machine_info(argv, args):
    """What the numbers depend on: the machine (lab.run.machine), its load (1, 5, 15 min), torch, the commit."""
    m = machine(args.device)
    return dict(cpu=m.get("gpu", m["cpu"]), cores=os.cpu_count(), torch_threads=m["torch_threads"],
                omp_num_threads=m["OMP_NUM_THREADS"], omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                load=[round(x, 2) for x in os.getloadavg()], torch=torch.__version__, commit=git_commit(),
                command=" ".join(["python tools/bench.py", *argv]))


def speed_lines(res, args):
    """The markdown of `python tools/bench.py` (speed): the layers, the exponents, the kernels, the training steps."""
    peak = ("CUDA's max allocated (reserved: the caching allocator's max, cuFFT workspaces and fragmentation too)"
            if device_type(args.device) == "cuda" else "the resident set's peak (VmHWM) in the row, after "
            "malloc_trim: also malloc's fragmentation and library buffers (results/bench_notes.md)")
    lines = [f"precision {args.precision}. dense float32 matmul: {res['matmul_gflops']:.0f} GFLOP/s. B = min(--batch {args.batch}, --max-tokens "
             f"{args.max_tokens} // L); time = best of n calls; peak = {peak}; base = in use before the row; est. = "
             "tensor bytes above the base, counted on fake tensors; load = 1-min load average at the row", ""]
    reserved = lambda r: "" if r.get("reserved_mib") is None else f", reserved {r['reserved_mib']:.0f}"  # noqa
    cells = lambda r: ([r["skipped"], "", ""] if "skipped" in r else   # noqa: E731
                       [f"{1e3 * r['seconds']:.1f} (n={r['reps']})", f"{r['tokens_per_s']:.0f}",
                        f"{r['peak_mib']:.0f} ({r['base_mib']:.0f}){reserved(r)}"])
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
    if res.get("kernels"):
        lines += ["", "kernel precision: the process allows TF32; the kernels' matmuls follow it (before the guard) "
                  "or are exact float32 (ssm.Matmul); on a CPU both are float32", ""]
        lines += table(["kernel", "task", "L", "matmuls", "fwd+bwd ms", "max rel. error vs float64", "channels > 1e-3",
                        "> 1e-2"], [[r["kernel"], r["task"], r["L"], "exact fp32 (guard)" if r["guarded"] else
                                     "TF32 allowed", f"{1e3 * r['fwd_bwd_seconds']:.1f}", f"{r['max_error']:.1e}",
                                     f"{r['over_1e_3']}/{r['channels']}", r["over_1e_2"]] for r in res["kernels"]])
    if res["train"]:
        lines += ["", f"whole training step (forward, loss, backward, AdamW) on {args.task}:", ""]
        lines += table(["model", "preset", "B", "L", "ms / step", "tokens/s", "load"],
                       [[r["model"], r["preset"], r["B"], r["L"], f"{1e3 * r['seconds']:.0f} (n={r['reps']})",
                         f"{r['tokens_per_s']:.0f}", f"{r['load']:.2f}"] for r in res["train"]])
    return lines


KERNELS = {"s4-nplr": ("s4", dict(mode="nplr")), "s4-diag": ("s4", dict(mode="diag")), "dlr": ("dlr", {})}


def paper_kernel(name, task, device, **size):
    """One layer's SSM kernel of --preset paper on `task` (S4D: S4's with mode="diag"), float32, on device; size:
    config fields to override (the GPU check's tiny scale)."""
    model, fields = KERNELS[name]
    cfg = presets.config_for(model, task, presets.values_for("paper", model, task, False))
    torch.manual_seed(0)
    Kernel = S4Kernel if model == "s4" else DLRKernel
    return Kernel(dataclasses.replace(cfg, **fields, **size)).to(device)


@contextlib.contextmanager
def tf32_allowed(guarded):
    """The process allows TF32 (as --precision tf32) inside the block; the kernels' matmuls follow it
    (ssm.TF32_IN_KERNELS, the code before the guard) unless `guarded` (ssm.Matmul: TF32 off inside). Both restored."""
    old, before = ssm.set_matmul_precision("high"), ssm.TF32_IN_KERNELS
    ssm.TF32_IN_KERNELS = not guarded
    try:
        yield
    finally:
        ssm.TF32_IN_KERNELS = before
        ssm.set_matmul_precision(old)


def kernel_precision(args, task="pathx"):
    """What exact float32 matmuls cost and what TF32 would do, per kernel at the paper's `task` configuration
    (PathX: H = 256, N = 64 / DLR 1,024, L = 16,384): the kernel's forward+backward time and its per-channel relative
    L2 error against float64, TF32 allowed and guarded (tf32_allowed). On a CPU there is no TF32: both are float32."""
    L, rows = lra_data.TASKS[task].max_len, []
    for name in KERNELS:
        kernel = paper_kernel(name, task, args.device)
        with torch.no_grad():
            exact = copy.deepcopy(kernel).double()(L).reshape(-1, L)              # (channels, L) float64
        for guarded in (False, True):
            with tf32_allowed(guarded):
                with torch.no_grad():
                    K = kernel(L).reshape(-1, L).double()
                err = ((K - exact).norm(dim=-1) / exact.norm(dim=-1)).cpu()             # (channels,)
                seconds = timed(lambda: kernel(L).square().sum().backward(), args)[0]
            rows.append(dict(kernel=name, task=task, L=L, channels=len(err), tf32_allowed=True, guarded=guarded,
                             fwd_bwd_seconds=seconds, max_error=float(err.max()),
                             over_1e_3=int((err > 1e-3).sum()), over_1e_2=int((err > 1e-2).sum())))
            print(f"  kernel {name:8s} {'guarded' if guarded else 'TF32   '}  max error {err.max():.1e}, "
                  f"{rows[-1]['over_1e_3']}/{len(err)} channels > 1e-3, fwd+bwd {1e3 * seconds:.1f} ms", flush=True)
    return rows


def speed(args):
    """The speed measurements: the machine's matmul, each layer at each length, the exponents, training steps."""
    res = dict(matmul_gflops=matmul_gflops(args), layers=layer_table(args))
    res["kernels"] = kernel_precision(args) if args.kernel_precision else []
    res["exponents"] = {name: fit_exponent(res["layers"], name, args.fit_from) for name in args.models}
    res["train"] = [train_step(name, preset, args) for preset in args.presets for name in models.MODELS]
    return res


