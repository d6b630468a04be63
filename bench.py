"""bench.py: speed and memory of one layer of every model, its kernel alone, and one whole training step.
growth with length: time per step (fixed B) ∝ L^p, p ≈ 1 (L log L) for S4, DLR (FFT convolution) and block-local
attention, p ≈ 2 for full attention. The DLR kernel K = Re(W·V), V_nl = λ_n^l, is one matmul (real, on re/im pairs), so it is
compared with the machine's own dense float32 matmul GFLOP/s, measured in the same run.
usage: python bench.py [--quick] [--device cuda] [--out runs/bench.json]     smoke test: tests/test_bench.py
"""
import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

# Before torch starts OpenMP: on a shared CPU, spinning threads wait a whole time slice for a descheduled partner in
# every parallel region (batched torch.linalg.solve of 256 64×64 matrices: 4.1 s spinning, 31 ms passive), so the
# numbers would measure the neighbours. Set OMP_WAIT_POLICY=ACTIVE yourself on a dedicated machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from dlr import DLR, DLRConfig, DLRKernel
from s4 import S4, S4Config, S4Kernel
from transformer import Transformer, TransformerConfig

LAYERS = ["transformer-full", "transformer-local", "s4-nplr", "s4-diag", "dlr"]
# --quick is the same measurement with fewer lengths and shorter timing; flags given explicitly win over both.
FULL = dict(lengths=[1024, 4096, 16384, 65536], min_time=1.0, max_reps=5, presets=["tiny", "paper"], fit_from=4096)
QUICK = dict(lengths=[4096, 8192], min_time=0.2, max_reps=2, presets=["tiny"], fit_from=4096)
W_BLOCK = TransformerConfig.block_size                                     # block-local attention block (4096)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help=f"about a minute on 2 CPU cores: {QUICK}")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help=f"sequence lengths L (default {FULL['lengths']})")
    p.add_argument("--batch", type=int, default=4, help="B of one layer's forward+backward")
    p.add_argument("--max-tokens", type=int, default=4096, help="B is lowered to max(1, this // L): B=1 at L ≥ 4096, so the exponent fit sees one B")
    p.add_argument("--d-model", type=int, default=128, help="H, channels of each layer")
    p.add_argument("--d-state", type=int, default=64, help="N of S4 (nplr and diag)")
    p.add_argument("--dlr-state", type=int, default=1024, help="N of DLR")
    p.add_argument("--n-heads", type=int, default=4, help="attention heads of the Transformer layer")
    p.add_argument("--models", nargs="+", choices=LAYERS, default=LAYERS, help="layers to measure")
    p.add_argument("--task", default="pathfinder", help="task of the whole-training-step measurement")
    p.add_argument("--presets", nargs="*", default=None, help=f"train.py presets for the training step (default {FULL['presets']}; none: skip)")
    p.add_argument("--train-batch", type=int, default=None, help="B of the training step (default: the preset's, capped by --max-tokens)")
    p.add_argument("--min-time", type=float, default=None, help=f"seconds of timed repeats per measurement (default {FULL['min_time']})")
    p.add_argument("--max-reps", type=int, default=None, help=f"most timed repeats per measurement (default {FULL['max_reps']})")
    p.add_argument("--max-step-seconds", type=float, default=60.0, help="skip a layer whose forward+backward is predicted to take longer")
    p.add_argument("--fit-from", type=int, default=None, help=f"fit the exponent of time vs L over L ≥ this (default {FULL['fit_from']})")
    p.add_argument("--in-process", action="store_true", help="CPU: no subprocess per layer (fast; peak memory is then a running maximum)")
    p.add_argument("--out", default="runs/bench.json", help="JSON results; the markdown table goes next to it (.md)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)      # internal: measure one layer, print one JSON line
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def timed(fn, args, slow=30.0):
    """Best seconds per call of fn. Best, not mean: on a shared machine other jobs only ever add time. The first call
    also pays one-time costs (allocator, FFT plans, thread pool), so min() drops it, unless it took over `slow`
    seconds: then it is the measurement (its one-time costs are a few %). Otherwise repeats until args.min_time
    seconds after the first call, at least once, at most args.max_reps times."""
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
    """The machine's own limit: a dense float32 (n×n)·(n×n) matmul, 2n³ flops; n just big enough for the BLAS peak."""
    n = 8192 if args.device == "cuda" else 2048
    a, b = torch.randn(n, n, device=args.device), torch.randn(n, n, device=args.device)
    return 2 * n**3 / timed(lambda: a @ b, args)[0] / 1e9


def memory_mib(args):
    """Peak memory so far, MiB: CUDA max allocated; on CPU the process's peak resident set (Linux reports KiB)."""
    if args.device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


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


def measure_layer(name, L, B, args):
    """Forward+backward of one layer on (B, L, 1) floats: seconds, tokens/s, peak memory; then its kernel alone."""
    torch.manual_seed(0)
    model = build_layer(name, args).to(args.device)
    x = torch.randn(B, L, 1, device=args.device)                           # (B, L, d_input)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()                                # (B, L, H) -> scalar

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = memory_mib(args)                                                 # interpreter, torch, weights, input
    seconds, reps = timed(step, args)
    row = dict(model=name, L=L, B=B, seconds=seconds, reps=reps, tokens_per_s=B * L / seconds,
               peak_mib=memory_mib(args), base_mib=base)
    kernel = next((m for m in model.modules() if isinstance(m, (S4Kernel, DLRKernel))), None)
    if kernel is not None:
        with torch.no_grad():
            row["kernel_seconds"], _ = timed(lambda: kernel(L), args)
        if name == "dlr":
            # honest count of the work done: per direction S, K = Re(W·λ^l) is one real matmul over (re, im) pairs,
            # 2·H·(2N)·L = 4·H·N·L flops (s4.vandermonde); the split-power tables and the W·λ^{a·c} scaling add
            # 6·H·N·L/c with c ≈ √(H·L), under 1%, left out
            S, N = (2 if model.cfg.bidirectional else 1), args.dlr_state
            row["kernel_gflops"] = S * 4 * args.d_model * N * L / row["kernel_seconds"] / 1e9
            row["matmul_gflops"] = matmul_gflops(args)                      # same process, same moment: a fair share
    return row


def run_child(spec):
    """Subprocess side of measure_isolated: cap the address space, so a wrong prediction fails with an error here
    instead of waking the OOM killer on a shared machine; measure; print one JSON line."""
    args = argparse.Namespace(**spec["args"])
    vm = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmSize"))) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + spec["mem_limit"], resource.RLIM_INFINITY))
    try:
        row = measure_layer(spec["name"], spec["L"], spec["B"], args)
    except (RuntimeError, MemoryError) as e:
        row = dict(model=spec["name"], L=spec["L"], B=spec["B"], skipped=f"did not fit: {str(e).splitlines()[0][:60]}")
    print(json.dumps(row))


def measure_isolated(name, L, B, args, mem_limit):
    """CPU peak memory is per process (ru_maxrss never goes down), so each configuration gets a fresh interpreter."""
    spec = dict(name=name, L=L, B=B, args=vars(args), mem_limit=mem_limit)
    here = Path(__file__).resolve()
    out = subprocess.run([sys.executable, str(here), "--child", json.dumps(spec)], capture_output=True, text=True, cwd=here.parent)
    if out.returncode != 0:
        return dict(model=name, L=L, B=B, skipped=f"failed: {(out.stderr.strip().splitlines() or ['?'])[-1][:60]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def predict(name, L, B, prev, args, gflops):
    """Seconds and MiB of one step before running it. Time: the longer of the flop count at matmul speed and the
    previous length's measurement scaled by B/B_prev·(L/L_prev)^p (p = 2 full attention, 1 otherwise): that catches
    slow elementwise work that no flop count sees. Memory above the base: the previous measurement scaled by L/L_prev
    (and by B if B grew), plus its base; SDPA's fused kernels never store an (L, L) score matrix.
    Returns (seconds, MiB above the base, predicted peak MiB or None)."""
    H = args.d_model
    if name.startswith("transformer"):
        pairs = L * L if name == "transformer-full" else -(-L // W_BLOCK) * W_BLOCK * 3 * W_BLOCK  # query·key pairs
        flops = 24 * L * H * H + 4 * pairs * H                              # projections + MLP (d_ff=4H), QKᵀ and AV
    else:
        N = args.dlr_state if name == "dlr" else args.d_state
        flops = 4 * L * H * H + 2 * 4 * H * N * L                           # GLU, kernel of both directions
    seconds, extra, peak = 3 * B * flops / (gflops * 1e9), 0.0, None        # backward ≈ 2 forwards
    if prev is not None and "seconds" in prev:
        grow = L / prev["L"]
        seconds = max(seconds, prev["seconds"] * B / prev["B"] * grow ** (2 if name == "transformer-full" else 1))
        extra = (prev["peak_mib"] - prev["base_mib"]) * grow * max(1, B / prev["B"])
        peak = prev["base_mib"] + extra
    return seconds, extra, peak


def free_mib(args):
    if args.device == "cuda":
        return torch.cuda.mem_get_info()[0] / 2**20
    return int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemAvailable"))) / 2**10


def layer_table(args, gflops):
    """Every (layer, L) in order of L; skipped, with the reason, when predicted not to fit or to take too long.
    Memory limit: half the free memory (other people's jobs share this machine)."""
    rows, limit = [], 0.5 * free_mib(args)
    for name in args.models:
        prev = None
        for L in args.lengths:
            B = max(1, min(args.batch, args.max_tokens // L))
            seconds, extra, peak = predict(name, L, B, prev, args, gflops)
            if name == "transformer-local" and L < W_BLOCK:  # one block padded to 3 blocks of keys: the model never does this
                row = dict(model=name, L=L, B=B, skipped=f"n/a: L < block {W_BLOCK}, the model uses full attention")
            elif extra > limit:
                row = dict(model=name, L=L, B=B, predicted_mib=peak, skipped=f"would not fit: ~{extra / 1024:.0f} GiB > {limit / 1024:.0f} GiB")
            elif seconds > args.max_step_seconds:
                row = dict(model=name, L=L, B=B, predicted_mib=peak, skipped=f"~{seconds:.0f} s/step > --max-step-seconds")
            elif args.device == "cpu" and not args.in_process:
                row = measure_isolated(name, L, B, args, int(limit * 2**20))
            else:
                try:
                    row = measure_layer(name, L, B, args)
                except torch.cuda.OutOfMemoryError as e:
                    row = dict(model=name, L=L, B=B, skipped=f"did not fit: {str(e).splitlines()[0][:60]}")
            rows.append(row)
            prev = row if "seconds" in row else prev
            print(f"  {name:18s} L {L:6d} B {B}  " + row.get("skipped", f"{row.get('tokens_per_s', 0):9.0f} tokens/s"), flush=True)
    return rows


def fit_exponent(rows, name, fit_from):
    """Least-squares slope of log(seconds per step) against log L over L ≥ fit_from, at the B of the longest L only:
    an SSM computes its kernel once per batch, so a step's time is not linear in B."""
    rows = [r for r in rows if r["model"] == name and "seconds" in r and r["L"] >= fit_from]
    rows = [r for r in rows if r["B"] == rows[-1]["B"]]
    pts = [(math.log(r["L"]), math.log(r["seconds"])) for r in rows]
    if len(pts) < 2:
        return dict(p=None, lengths=[r["L"] for r in rows])
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    p = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return dict(p=p, lengths=[r["L"] for r in rows])


def train_step(model_name, preset, args):
    """One whole training step (forward, pooled cross-entropy, backward, AdamW) of a train.py preset on random inputs
    of the task's shape, with the model config train.py's main() builds for that preset."""
    import lra_data
    import train
    task, ssm_names = lra_data.TASKS[args.task], train.MODELS[model_name][2]
    values = train.preset_values(preset, model_name, args.task, spt=False)
    cfg = train.model_config(model_name, args.task, values)
    head = dict(kind="classifier", n_classes=task.n_classes, pool=task.pool, pair=task.pair)
    torch.manual_seed(0)
    model = train.build_model(dict(model_name=model_name, config=dataclasses.asdict(cfg), head=head)).to(args.device)
    with contextlib.redirect_stdout(io.StringIO()):                        # param_groups prints the group sizes
        groups = train.param_groups(model, values["lr"], values["weight_decay"], getattr(cfg, "ssm_lr", values["lr"]), ssm_names)
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.999))
    L = task.max_len
    B = args.train_batch or max(1, min(values["batch_size"], args.max_tokens // L))
    shape = (B, 2, L) if task.pair else (B, L)
    x = torch.randint(0, 256, shape, dtype=torch.uint8) if task.kind == "pixels" else torch.randint(4, task.vocab_size, shape)
    batch = (x, torch.full(shape[:-1], L), torch.randint(0, task.n_classes, (B,)))   # every position real

    def step():
        loss, _ = train.finetune_batch(model, batch, None, args.task)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    seconds, reps = timed(step, args)
    row = dict(model=model_name, preset=preset, B=B, L=L, seconds=seconds, reps=reps, tokens_per_s=x.numel() / seconds)
    print(f"  train step {model_name:11s} {preset:5s} B {B} L {L}  {row['tokens_per_s']:9.0f} tokens/s", flush=True)
    return row


def targets(res, args):
    """The issue's targets: (what, measured, goal, met); met is None when this run did not measure it."""
    row = {(r["model"], r["L"]): r for r in res["layers"]}
    out = []
    for name, fit in res["exponents"].items():
        full, e = name == "transformer-full", fit["p"]
        out.append((f"{name}: time ∝ L^p, fit over L = {', '.join(map(str, fit['lengths'])) or '–'}", "–" if e is None else f"p = {e:.2f}",
                    "near 2 (1.7–2.3)" if full else "≤ 1.15", None if e is None else (1.7 <= e <= 2.3 if full else e <= 1.15)))
    nplr, diag = row.get(("s4-nplr", 4096), {}), row.get(("s4-diag", 4096), {})
    if "tokens_per_s" in nplr and "tokens_per_s" in diag:
        ratio = nplr["tokens_per_s"] / diag["tokens_per_s"]
        out.append((f"S4 nplr / S4 diag tokens/s, H={args.d_model}, N={args.d_state}, L=4096", f"{ratio:.2f}", "≥ 0.5", ratio >= 0.5))
    d = row.get(("dlr", 16384), {})
    if "kernel_gflops" in d:
        share = d["kernel_gflops"] / d["matmul_gflops"]
        out.append((f"DLR kernel / matmul GFLOP/s, N={args.dlr_state}, L=16384", f"{share:.0%}", "≥ 40%", share >= 0.4))
    for name in ("s4-nplr", "s4-diag", "dlr"):
        r = row.get((name, 65536), {})
        if r.get("B") == 1 and "peak_mib" in r:
            out.append((f"{name}: peak memory, L=65536, B=1, H={args.d_model}", f"{r['peak_mib']:.0f} MiB", "< 2048 MiB", r["peak_mib"] < 2048))
        elif r.get("B") == 1 and r.get("predicted_mib"):   # not run: its prediction from L=16384 is the finding
            out.append((f"{name}: peak memory, L=65536, B=1, H={args.d_model}", f"not run; predicted ~{r['predicted_mib']:.0f} MiB",
                        "< 2048 MiB", False if r["predicted_mib"] >= 2048 else None))
    return out


def report(res, args):
    """Markdown tables (readable in a terminal too)."""
    m = res["machine"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores ({m['threads']} torch threads, OMP_WAIT_POLICY={m['omp_wait_policy']}), torch {m['torch']}, load average "
             f"(1 min) at start {m['load_1min']:.2f}; commit {m['commit']}; `{m['command']}`",
             f"dense float32 matmul: {res['matmul_gflops']:.0f} GFLOP/s; run time {res['seconds']:.0f} s",
             f"B = min(--batch {args.batch}, --max-tokens {args.max_tokens} // L); time = best of n calls (a first call over "
             "30 s is the only one); peak = " + ("CUDA max allocated" if args.device == "cuda" else
             "peak RSS of a fresh process per row, base = before the first step (interpreter, torch, weights)") + "; "
             "a row predicted too slow or too big says so instead of running", "",
             "| layer | L | B | ms / step (fwd+bwd) | tokens/s | peak MiB (base) | kernel ms | kernel GFLOP/s (of matmul) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["layers"]:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['L']} | {r['B']} | {r['skipped']} | | | | |")
            continue
        kms = f"{1e3 * r['kernel_seconds']:.1f}" if "kernel_seconds" in r else ""
        gf = f"{r['kernel_gflops']:.1f} ({r['kernel_gflops'] / r['matmul_gflops']:.0%} of {r['matmul_gflops']:.0f})" if "kernel_gflops" in r else ""
        lines.append(f"| {r['model']} | {r['L']} | {r['B']} | {1e3 * r['seconds']:.1f} (n={r['reps']}) | "
                     f"{r['tokens_per_s']:.0f} | {r['peak_mib']:.0f} ({r['base_mib']:.0f}) | {kms} | {gf} |")
    if res["train"]:
        lines += ["", f"whole training step (forward, loss, backward, AdamW) on {args.task}:", "",
                  "| model | preset | B | L | ms / step | tokens/s |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['preset']} | {r['B']} | {r['L']} | {1e3 * r['seconds']:.0f} (n={r['reps']}) | {r['tokens_per_s']:.0f} |" for r in res["train"]]
    lines += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
    lines += [f"| {what} | {value} | {goal} | {'–' if met is None else 'met' if met else 'MISSED'} |" for what, value, goal, met in res["targets"]]
    return "\n".join(lines)


def machine_info(argv, args):
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    git = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=Path(__file__).resolve().parent)
    return dict(cpu=torch.cuda.get_device_name() if args.device == "cuda" else cpu, cores=os.cpu_count(),
                threads=torch.get_num_threads(), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                torch=torch.__version__, load_1min=os.getloadavg()[0],
                commit=git.stdout.strip() or "?", command=" ".join(["python bench.py", *argv]))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:
        return run_child(json.loads(args.child))
    t0 = time.perf_counter()
    res = dict(args=vars(args), machine=machine_info(argv, args))
    print(f"bench: {res['machine']}\n  {vars(args)}", flush=True)
    res["matmul_gflops"] = matmul_gflops(args)
    res["layers"] = layer_table(args, res["matmul_gflops"])
    res["exponents"] = {name: fit_exponent(res["layers"], name, args.fit_from) for name in args.models}
    res["train"] = [train_step(name, preset, args) for preset in args.presets for name in ("transformer", "s4", "dlr")]
    res["targets"] = targets(res, args)
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
