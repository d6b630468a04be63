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
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Before torch starts OpenMP: on a shared CPU, spinning threads wait a whole time slice for a descheduled partner in
# every parallel region (results/bench_notes.md). Set OMP_WAIT_POLICY=ACTIVE yourself on a dedicated machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

import lra_data  # noqa: E402
import memory  # noqa: E402
import pathfinder  # noqa: E402
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
# --gpu-check sizes (gpu_check's docstring says why). layers: bench.py flags of part 1; size: model flags of train.py
# (none: the paper's); batch: None = the preset's; steps / epochs: each part-2 run; claim_*: part 3; *_s: seconds
# guessed before anything is measured, and kept back for part 3
TINY_LAYERS = ["--lengths", "64", "128", "256", "--max-tokens", "512", "--batch", "2", "--d-model", "16", "--d-state",
               "8", "--dlr-state", "32", "--n-heads", "2", "--min-time", "0", "--max-reps", "1", "--fit-from", "64"]
CHECK_SCALES = {
    "paper": dict(layers=["--quick"], size={}, batch=None, steps=200, epochs=5, max_eval=256, claim_epochs=10,
                  claim_eval=1024, min_claim_steps=500, max_claim_steps=20_000, layers_s=60, run_s=30, reserve_s=180),
    "tiny": dict(layers=TINY_LAYERS + ["--presets"], size=dict(d_model=16, n_layers=1, d_state=8), batch=2, steps=3,
                 epochs=3, max_eval=2, claim_epochs=2, claim_eval=2, min_claim_steps=2, max_claim_steps=4, layers_s=0,
                 run_s=0, reserve_s=0, skip={("transformer", "pathx"): "--check-scale tiny: the paper's 4 heads of "
                                             "block-local attention at L = 16,384 take ~12 s a step on a CPU core"}),
}
RUN_TASKS, CHANCE_PLUS = ["pathfinder", "pathx"], 0.6   # part 3: the first step with val_acc ≥ 0.6 (chance: 0.5)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help=f"about a minute on 2 CPU cores: {QUICK}")
    p.add_argument("--memory", action="store_true", help="estimate the peak memory of the --preset paper runs instead")
    p.add_argument("--gpu-check", action="store_true", help="layers, short paper runs, TFS vs SPT (see gpu_check)")
    p.add_argument("--minutes", type=float, default=10.0, help="--gpu-check: time budget; what does not fit is skipped")
    p.add_argument("--check-scale", choices=CHECK_SCALES, default=None, help="--gpu-check sizes (default: paper on "
                   "cuda, tiny on cpu: width 16, one layer, a few steps)")
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


# ---- the GPU check: layers, short --preset paper runs, the paper's first claim in miniature -------------------------

class OutOfTime(BaseException):   # as KeyboardInterrupt: no `except Exception` in train.py turns it into another error
    pass


@contextlib.contextmanager
def time_limit(seconds):
    """Raise OutOfTime inside the block once `seconds` have passed (SIGALRM: Unix, main thread)."""
    def stop(signum, frame):
        raise OutOfTime(f"stopped after {seconds:.0f} s: the --minutes budget is spent")
    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def attempt(fn, need_s, left_s):
    """fn() -> dict, with status "ok" and its seconds; "skipped" (and why) if the predicted need_s exceeds left_s;
    "error" (the traceback's end) if it fails or runs past left_s. A failed part never stops the check."""
    if need_s > left_s:
        return dict(status="skipped", reason=f"needs ~{need_s:.0f} s, {max(left_s, 0):.0f} s of --minutes left")
    t0 = time.time()
    try:
        with time_limit(left_s):
            return dict(fn(), status="ok", seconds=time.time() - t0)
    except (Exception, SystemExit, OutOfTime):       # SystemExit: train.py's one-line error, printed above
        return dict(status="error", error=traceback.format_exc(limit=-3)[-1500:], seconds=time.time() - t0)


def n_images(max_train, max_eval):
    """Images to generate for max_train training and max_eval val / test examples (80/10/10 splits)."""
    return max(math.ceil(max_train / 0.8), 10 * max_eval, 20)


def make_images(task, root, n):
    """n hard Pathfinder / PathX images under root, the release layout, on every core (train.py's --generate makes
    batches of 1,000, one per process: few processes for a few thousand images) -> images per second."""
    t0, cores = time.time(), os.cpu_count() or 1
    pathfinder.generate_pathfinder(root, res=lra_data.TASKS[task].side, n=n, workers=cores, per_batch=-(-n // cores),
                                   contour_length=pathfinder.DIFFICULTIES["hard"].contour_length, seed=0)
    return dict(images=n, images_per_s=n / (time.time() - t0))


def run_flags(model, task, args, scale, where, steps, epochs, max_eval, spt=False):
    """train.py's flags of one check run (where: data folder, run folder, its images): --preset paper on generated
    images, steps/epochs batches an epoch, evaluated after each; --spt: as many SPT epochs first -> (flags, values)."""
    values = {**train.preset_values("paper", model, task, spt), **scale["size"]}
    batch = scale["batch"] or values["batch_size"]
    flags = ["--preset", "paper", "--model", model, "--task", task, "--device", args.device, "--data-dir", where[0],
             "--max-train", steps // epochs * batch, "--max-eval", max_eval, "--epochs", epochs, "--pretrain-epochs",
             epochs, "--eval-every", 1, "--out", where[1], "--generate", where[2]]
    flags += [x for k, v in scale["size"].items() for x in (f"--{k.replace('_', '-')}", v)]
    flags += ["--batch-size", batch, "--pretrain-batch-size", batch] * bool(scale["batch"]) + ["--spt"] * spt
    return [str(f) for f in flags], values


def paper_run(model, task, args, scale, where, steps, epochs, max_eval, spt=False):
    """train.main(run_flags(...)) in this process -> speed (from the first to the last evaluation: the first epoch
    pays one-time costs), peak memory (CUDA's allocator, else the resident set's) and memory.py's estimate, precision,
    batch, accum_steps, the log.jsonl records and val_acc curve, test accuracy."""
    flags, values = run_flags(model, task, args, scale, where, steps, epochs, max_eval, spt)
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    if device == "cuda":
        torch.cuda.empty_cache()
    memory_mib(device, "now", reset=True)
    res = train.main(flags)
    peak, run_dir = memory_mib(device, "peak"), Path(res["run_dir"])
    run = json.loads((run_dir / "config.json").read_text())["args"]
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    ft = [r for r in records if r.get("phase") == "finetune"]
    s = (ft[-1]["elapsed_s"] - ft[0]["elapsed_s"]) / (ft[-1]["step"] - ft[0]["step"])
    micro, spec = -(-run["batch_size"] // run["accum_steps"]), lra_data.TASKS[task]
    est = memory.training_memory(model, task, values, "finetune", micro, spec.max_len, run["precision"])["peak"]
    return dict(precision=run["precision"], batch=run["batch_size"], accum_steps=run["accum_steps"],
                steps=ft[-1]["step"], ms_per_step=1e3 * s, tokens_per_s=run["batch_size"] * spec.max_len / s,
                peak_mib=peak, est_peak_mib=est / 2**20, wall_s=res["wall_time_s"]["total"], test_acc=res["test_acc"],
                fixed_s=res["wall_time_s"]["total"] - (ft[-1]["step"] - ft[0]["step"]) * s, records=records,
                curve=[[r["step"], r["val_acc"]] for r in ft])


def check_runs(args, scale, work, t_end):
    """Part 2: each model fine-tuned from scratch on Pathfinder, then on PathX; the first run of a task makes its
    images. A PathX run's time is predicted from the model's Pathfinder run (time per step × 16: L is 16 × longer), a
    Pathfinder run's is scale["run_s"]."""
    data, runs = {}, []
    for task in RUN_TASKS:
        batch = max(scale["batch"] or train.preset_values("paper", m, task, False)["batch_size"] for m in train.MODELS)
        n = n_images(scale["steps"] // scale["epochs"] * batch, scale["max_eval"])
        for model in train.MODELS:
            if (model, task) in scale.get("skip", {}):
                runs.append(dict(model=model, task=task, status="skipped", reason=scale["skip"][model, task]))
                continue
            pf = next((r for r in runs if r["model"] == model and r["status"] == "ok"), None)
            need = scale["run_s"] if pf is None else pf["fixed_s"] + scale["steps"] * pf["ms_per_step"] / 1e3 * \
                lra_data.TASKS[task].max_len / lra_data.TASKS["pathfinder"].max_len
            where, sizes = (work / task, work / f"runs-{model}-{task}", n), (scale["steps"], scale["epochs"])

            def run():
                data[task] = data.get(task) or make_images(task, work / task, n)
                return paper_run(model, task, args, scale, where, *sizes, scale["max_eval"])
            runs.append(dict(model=model, task=task, **attempt(run, need, t_end - time.time() - scale["reserve_s"])))
    states = {r["status"] for r in runs}
    status = "error" if "error" in states else "ok" if "ok" in states else "skipped"
    return dict(status=status, steps=scale["steps"], epochs=scale["epochs"], data=data, runs=runs)


def claim_steps(left_s, run, images_per_s, scale):
    """Fine-tuning steps F of part 3 in left_s seconds, from part 2's Transformer run on Pathfinder: TFS runs F steps,
    SPT F SPT steps then F (3F in all at that run's time per step), each run pays its fixed costs (start-up, first
    epoch, test), the training images are generated first; 80 % of it, whole epochs, at most max_claim_steps."""
    E = scale["claim_epochs"]
    per_step = 3 * run["ms_per_step"] / 1e3 + run["batch"] / (0.8 * E * images_per_s)
    return max(0, min(scale["max_claim_steps"], int((0.8 * left_s - 2 * run["fixed_s"]) / per_step)) // E * E)


def check_claim(args, scale, work, t_end, part2):
    """Part 3: the --preset paper Transformer on Pathfinder, from scratch and after masked SPT, for the same
    fine-tuning steps; both validation-accuracy curves, and the first step each reaches val_acc ≥ CHANCE_PLUS."""
    run = next((r for r in part2["runs"] if (r["model"], r["task"]) == ("transformer", "pathfinder")), {})
    if run.get("status") != "ok":
        return dict(status="skipped", reason="needs part 2's Transformer run on Pathfinder (its time per step)")
    E = scale["claim_epochs"]
    F = claim_steps(t_end - time.time(), run, part2["data"]["pathfinder"]["images_per_s"], scale)
    if F < scale["min_claim_steps"]:
        return dict(status="skipped", reason=f"{t_end - time.time():.0f} s of --minutes left: {F} steps < "
                    f"{scale['min_claim_steps']}")

    def both():
        n = n_images(F // E * run["batch"], scale["claim_eval"])
        claim = dict(steps=F, epochs=E, data=make_images("pathfinder", work / "claim", n))
        for kind in ("tfs", "spt"):
            where = (work / "claim", work / f"claim-{kind}", n)
            claim[kind] = paper_run("transformer", "pathfinder", args, scale, where, F, E, scale["claim_eval"],
                                    spt=kind == "spt")
            claim[kind]["first_step_over"] = next((s for s, acc in claim[kind]["curve"] if acc >= CHANCE_PLUS), None)
        return claim
    return attempt(both, 0, t_end - time.time())


def gpu_check(args, argv):
    """--gpu-check: three parts in order, each skipped (saying so) when the --minutes left do not allow it, each
    recording its error and the check going on if it fails; one JSON per part + summary.md in --out-dir.
    1. layers: bench.py's --quick speed path (L = 2,048 / 4,096 / 8,192, H = 128; 60 s guessed before it runs).
    2. paper_runs: each model with --preset paper (its width, depth, batch, lr, precision) fine-tuned from scratch on
       Pathfinder, then PathX, 200 steps in 5 epochs (5 evaluations on 256 val examples) on freshly generated images
       (the same examples every epoch: this measures the machine, not the method). Held back: 180 s for part 3.
    3. spt_claim: the paper's first claim in miniature (Amos et al.: the Transformer on Pathfinder reaches 71 % from
       scratch and 94 % with SPT, and leaves chance sooner): the same F fine-tuning steps in 10 epochs, from scratch
       and after F masked-SPT steps, F from the minutes left at part 2's measured time per step (claim_steps), at least
       500. The preset's 2,500 warm-up steps stay: a short run is mostly warm-up.
    --check-scale tiny: the same path at width 16, one layer, batch 2, a few steps and images (a CPU test)."""
    t0, scale, machine = time.time(), CHECK_SCALES[args.check_scale], machine_info(argv, args)
    t_end, layer_args = t0 + 60 * args.minutes, parse_args(scale["layers"] + ["--device", args.device])
    folder = ("" if args.device.startswith("cuda") else "cpu-") + re.sub(r"[^A-Za-z0-9._]+", "-", machine["cpu"])
    out = Path(args.out_dir or Path(__file__).resolve().parent / "results" / "gpu" / folder.strip("-"))
    out.mkdir(parents=True, exist_ok=True)
    parts = {}

    def save(name, part):                            # each JSON as soon as its part ends: a killed check keeps them
        parts[name] = part
        (out / f"{name}.json").write_text(json.dumps(dict(machine=machine, scale=args.check_scale, **part), indent=1))

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        save("layers", attempt(lambda: speed(layer_args), scale["layers_s"], t_end - time.time() - scale["reserve_s"]))
        save("paper_runs", check_runs(args, scale, Path(work), t_end))
        save("spt_claim", check_claim(args, scale, Path(work), t_end, parts["paper_runs"]))
    done = [("layers", parts["layers"]), ("spt_claim", parts["spt_claim"]),
            *((f"{r['model']}/{r['task']}", r) for r in parts["paper_runs"]["runs"])]
    failed = [name for name, part in done if part["status"] == "error"]
    text = "\n".join(summary_lines(machine, args, layer_args, parts, done, time.time() - t0))
    (out / "summary.md").write_text(text + "\n")
    print(text + (f"\nFAILED: {', '.join(failed)}" if failed else ""))
    return dict(out_dir=str(out), parts=parts, failed=failed)


def summary_lines(machine, args, layer_args, parts, done, seconds):
    """summary.md: measured numbers only, the device, torch, commit and command first, then what was not done."""
    lines = [f"# bench.py --gpu-check: {machine['cpu']}", "", f"device {machine['cpu']} ({args.device}, "
             f"{machine['cores']} CPU cores) | torch {machine['torch']} | commit {machine['commit']} | "
             f"`{machine['command']}` | scale {args.check_scale} | {seconds / 60:.1f} of {args.minutes:g} min", ""]
    lines += [f"- {name}: {p['status']}: {p.get('reason') or p['error'].strip().splitlines()[-1]}"
              for name, p in done if p["status"] != "ok"]
    if parts["layers"]["status"] == "ok":
        lines += ["", "## 1. one layer, forward + backward", "", *speed_lines(parts["layers"], layer_args)]
    runs = [r for r in parts["paper_runs"]["runs"] if r["status"] == "ok"]
    data = parts["paper_runs"]["data"]
    images = ", ".join(f"{task} {d['images']} at {d['images_per_s']:.0f}/s" for task, d in data.items()) or "none"
    lines += ["", f"## 2. --preset paper, from scratch, {parts['paper_runs']['steps']} steps on generated images", "",
              f"images generated: {images}. ms / step: from the first to the last evaluation (evaluations included). "
              f"peak: {'torch.cuda.max_memory_allocated' if args.device.startswith('cuda') else 'resident set (VmHWM)'}"
              " over the run; est.: memory.py's estimate of one training step", ""]
    lines += table(["model", "task", "precision", "batch", "accum_steps", "ms / step", "tokens/s", "peak MiB",
                    "est. peak MiB", "last val_acc", "test_acc", "wall s"],
                   [[r["model"], r["task"], r["precision"], r["batch"], r["accum_steps"], f"{r['ms_per_step']:.1f}",
                     f"{r['tokens_per_s']:.0f}", f"{r['peak_mib']:.0f}", f"{r['est_peak_mib']:.0f}",
                     f"{r['curve'][-1][1]:.3f}", f"{r['test_acc']:.3f}", f"{r['wall_s']:.0f}"] for r in runs])
    claim = parts["spt_claim"]
    if claim["status"] == "ok":
        lines += ["", f"## 3. Transformer on Pathfinder: val_acc after the same {claim['steps']} fine-tuning steps", ""]
        lines += table(["fine-tuning step", "from scratch", "after SPT"], [[a[0], f"{a[1]:.3f}", f"{b[1]:.3f}"]
                       for a, b in zip(claim["tfs"]["curve"], claim["spt"]["curve"])])
        lines += ["", *(f"{kind}: first step with val_acc ≥ {CHANCE_PLUS}: {claim[kind]['first_step_over'] or 'none'}"
                        f"; test_acc {claim[kind]['test_acc']:.3f}; {claim[kind]['wall_s']:.0f} s" for kind in claim
                        if kind in ("tfs", "spt"))]
    return lines


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
    if args.gpu_check:
        return gpu_check(args, argv)
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
