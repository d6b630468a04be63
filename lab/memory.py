"""memory.py: peak training memory of a --preset paper run, estimated without allocating it, and checked against a
real step. The estimate runs train.py's model on fake tensors (shapes and dtypes, no data) under a dispatch mode that
counts the bytes of every live storage, as an allocator would:
    peak = 4 × parameter bytes (weights, gradients, AdamW's two moments) + the most bytes live at once in one step's
           forward and backward (activations autograd saves, temporaries)
Check: the estimate equals a real CPU step's growth of the resident set within a few % (tests/test_memory.py; the
table and the check: `python tools/bench.py --memory`, results/memory.md); what it leaves out on a GPU:
results/bench_notes.md. plan_phase splits a phase's batch into micro-batches that fit the card in hand (plan_memory).
"""
import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import denoise
import lra_data
import models

from lab import hardware
from lab import presets

PRECISIONS, PHASES = ["fp32", "bf16"], ["finetune", "spt"]
GPU_GIB, HEADROOM = 80, 0.9   # fits = estimate ≤ 90 % of an 80 GB card (80 GiB); the 10 % are for what the estimate
                              # leaves out: CUDA context, cuFFT / cuBLAS workspaces, allocator rounding
# estimate vs a real CPU step, small sizes: (model, task, phase, precision, B, lengths); S4 keeps N = 64
CHECKS = [("dlr", "pathfinder", "finetune", "fp32", 8, [1024, 2048]),
          ("s4", "listops", "finetune", "fp32", 8, [1024, 2048]), ("s4", "pathfinder", "spt", "bf16", 8, [1024, 2048]),
          ("transformer", "text", "finetune", "bf16", 16, [512, 1024])]
CHECK_SIZE = dict(d_model=64, n_layers=2, n_heads=4, d_ff=128, dropout=0.0)


# ---- measured memory: CUDA's allocator, or the resident set ---------------------------------------------------------

def device_type(device):
    """"cuda" for "cuda", "cuda:1", torch.device("cuda", 0), ...; "cpu" for "cpu": compare types, never strings."""
    return torch.device(device).type


def memory_mib(device, what, reset=False):
    """MiB of memory on `device` (a string or torch.device). what: "now" (CUDA: allocated; CPU: the resident set),
    "peak" (since the last reset: CUDA's allocator counter of allocated bytes, or VmHWM, reset by writing 5 to
    /proc/self/clear_refs, Linux), "reserved_peak" (CUDA's caching allocator, which also holds cuFFT workspaces and
    fragmentation; None on a CPU), "free" and "total" (torch.cuda.mem_get_info, or MemAvailable / MemTotal)."""
    if device_type(device) == "cuda":
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        info = dict(now=torch.cuda.memory_allocated, peak=torch.cuda.max_memory_allocated,
                    reserved_peak=torch.cuda.max_memory_reserved,
                    free=lambda d: torch.cuda.mem_get_info(d)[0], total=lambda d: torch.cuda.mem_get_info(d)[1])
        return info[what](device) / 2**20
    if reset:                                # first hand memory that malloc keeps for reuse back to the system
        ctypes.CDLL(None).malloc_trim(0)     # (glibc), so that what the row needs shows in the resident set
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    if what == "reserved_peak":
        return None
    key, path = dict(now=("VmRSS", "self/status"), peak=("VmHWM", "self/status"), free=("MemAvailable", "meminfo"),
                     total=("MemTotal", "meminfo"))[what]
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


@dataclasses.dataclass
class Phase:
    """A phase whose memory is planned: the model (a MODELS name), the task, its preset values (presets.preset_values),
    "spt" or "finetune", the padded length L (tokens; pixels: side²), train.py's --precision (fp16 counts as bf16,
    tf32 as fp32), and the run's --objective with its flags (None: the default objective, its defaults). One training
    step of it at a batch of B rows is what training_case builds and training_memory / step_estimate estimate."""
    model_name: str
    task: str
    values: dict
    name: str
    L: int
    precision: str = "fp32"
    objective: str | None = None
    flags: dict | None = None


def training_case(phase, B):
    """(build, forward) of one training step of train.py's model on a random clean batch of full length L, through
    the step's own functions (models.batch_functions: the objective's corruption and loss for spt, the labelled
    batch and the one loss for finetune), so the estimate holds the run's own objective (rtd: its generator
    too). phase: a Phase (precision unread). Token tasks take the padded path (lengths given, all real: the larger
    case), pixel tasks are never padded (padded None). Retrieval: two documents per example, so 2·B sequences."""
    model_name, task, L, flags = phase.model_name, phase.task, phase.L, phase.flags
    spec, cfg = lra_data.TASKS[task], presets.config_for(model_name, task, phase.values)
    objective = phase.objective or next(iter(models.OBJECTIVES))                  # --objective's default, the paper's
    run = models.Backbone(task, False, lambda **changes: dataclasses.replace(cfg, **changes),
                         models.MODELS[model_name].build)
    flags = {k: v if v is not None or f.derive is None else f.derive(run)      # unset: as train.py fills it in
             for k, f in models.OBJECTIVES[objective].flags.items() for v in [(flags or {}).get(k, f.default)]}
    head = (dict(kind="spt", objective=objective, flags=dict(flags)) if phase.name == "spt" else
            dict(kind="classifier", n_classes=spec.n_classes, pool=spec.pool, pair=spec.pair))
    meta = dict(model_name=model_name, task=task, config=dataclasses.asdict(cfg), head=head)
    prepare, loss, _ = models.batch_functions(phase.name, task, objective, flags)

    def forward(model):
        device, rows = next(model.parameters()).device, 2 * B if spec.pair else B
        if spec.kind == "tokens":                                                   # (rows, L) ids, the last an EOS
            value = torch.randint(lra_data.N_SPECIAL, spec.vocab_size, (rows, L), device=device)
            target, lengths = value, torch.full((rows,), L, device=device)
            clean = denoise.Clean(value, target, lengths, lengths - 1, lengths, lra_data.MASK)
        else:                                                                        # (rows, L) grey levels
            pixels = torch.randint(0, 256, (rows, L), dtype=torch.uint8, device=device)
            value, target = lra_data.clean_input(pixels, task)
            lengths = torch.full((rows,), L, device=device)
            clean = denoise.Clean(value, target, lengths, lengths, None, lra_data.MASK)
        clean = clean._replace(labels=torch.randint(0, spec.n_classes, (B,), device=device))
        gen = torch.Generator(device).manual_seed(0)
        return loss(model, prepare(clean, gen, 0.0))[0]                             # the training loss itself
    return (lambda: models.build_model(meta)), forward


def training_memory(phase, B):
    """Estimated peak bytes of one training step (see the file header), with its parts. The layers are identical and
    each adds the same bytes at the moment of the peak (its saved activations), so the count is affine in n_layers:
    runs with 1 and 2 layers give it for any number (tests/test_memory.py checks this against the whole model)."""
    one, two = (simulated_peak(*training_case(dataclasses.replace(phase, values={**phase.values, "n_layers": n}), B),
                               phase.precision) for n in (1, 2))
    n_params, param_bytes, step = (a + (phase.values["n_layers"] - 1) * (b - a) for a, b in zip(one, two))
    return dict(n_params=n_params, step=step, peak=4 * param_bytes + step)


# ---- the paper presets: estimate, fit, table ------------------------------------------------------------------------

def paper_memory(model_name, task, phase, precision, accum_steps=None):
    """The estimate of one --preset paper step of `phase` at the task's full length and micro-batch
    ⌈batch / accum_steps⌉ (accum_steps: the preset's unless given), and whether it fits. Fine-tuning runs from
    scratch (TFS) or after SPT, whose batch sizes may differ: the run with the larger micro-batch counts."""
    runs = []
    for spt in [True] if phase == "spt" else [False, True]:
        v = presets.values_for("paper", model_name, task, spt)
        batch, accum = ((v["pretrain_batch_size"], v["pretrain_accum_steps"]) if phase == "spt" else
                        (v["batch_size"], v["accum_steps"]))
        runs.append((-(-batch // (accum_steps or accum)), batch, accum_steps or accum, v))
    micro, batch, accum, values = max(runs, key=lambda r: r[0])
    est = training_memory(Phase(model_name, task, values, phase, lra_data.TASKS[task].max_len, precision), micro)
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
    paper = [m for m, entry in models.MODELS.items() if presets.paper_of(m, entry)]   # without paper values: no row
    for model_name, task, phase in [(m, t, p) for m in paper for t in lra_data.TASKS for p in PHASES]:
        est = {precision: paper_memory(model_name, task, phase, precision) for precision in PRECISIONS}
        keep = ("n_params", "L", "batch", "accum_steps", "micro_batch")
        rows.append(dict(model=model_name, task=task, phase=phase, **{k: est["bf16"][k] for k in keep},
                         **{f"{p}_{k}": est[p][k] for p in PRECISIONS for k in ("gib", "fits")},
                         accum_to_fit=est["bf16"]["accum_steps"] if est["bf16"]["fits"] else
                         accum_to_fit(model_name, task, phase)))
        print(f"  {model_name:11s} {task:10s} {phase:8s} micro-batch {rows[-1]['micro_batch']:3d}: fp32 "
              f"{est['fp32']['gib']:6.1f} GiB, bf16 {est['bf16']['gib']:6.1f} GiB", flush=True)
    return rows


# ---- the plan: micro-batches from the card in hand -------------------------------------------------------------------

_PEAKS = {}                    # memoised estimates: (model, task, phase, B, L, precision, values) -> estimate


def card_memory(device):
    """(free, total) bytes of the CUDA card `device` (torch.cuda.mem_get_info: what the driver reports, other
    processes' use included). Tests replace this function to simulate a card."""
    return torch.cuda.mem_get_info(device)


def card_budget(device):
    """(bytes a run may plan to use on `device`: HEADROOM of the card's total, never more than is free now; total)."""
    free, total = card_memory(device)
    return min(free, HEADROOM * total), total


def step_estimate(phase, B):
    """training_memory(phase, B), memoised (a plan asks for the same step more than once)."""
    key = (B, json.dumps(dataclasses.asdict(phase), sort_keys=True, default=str))
    if key not in _PEAKS:
        _PEAKS[key] = training_memory(phase, B)
    return _PEAKS[key]


def plan_phase(phase, batch, budget, accum_steps=None):
    """The micro-batches of one Phase: the smallest accum_steps that divides `batch` (this process's rows of a step)
    and whose micro-batch batch / accum_steps has an estimated peak (training_memory at the padded length phase.L)
    within `budget` bytes; accum_steps given: kept, only estimated. Fewer accumulation steps first: the same update,
    but BatchNorm normalises each micro-batch with its own statistics (docs/gpu.md).
    -> dict(phase, batch, L, accum_steps, micro_batch, est_gib, budget_gib, fits)."""
    estimated = dataclasses.replace(phase, precision="bf16" if phase.precision in ("bf16", "fp16") else "fp32")
    peak = lambda m: step_estimate(estimated, m)["peak"]  # noqa: E731
    if accum_steps is None:
        whole = step_estimate(estimated, batch)
        accum_steps = 1
        if whole["peak"] > budget:
            # weights, gradients, AdamW's moments stay; the step's activations shrink with the micro-batch: a
            # guess that skips micro-batches that cannot fit, each candidate then estimated
            fixed, per_example = whole["peak"] - whole["step"], whole["step"] / batch
            for a in (a for a in range(2, batch + 1) if batch % a == 0):
                accum_steps = a
                if fixed + per_example * (batch // a) <= budget and peak(batch // a) <= budget:
                    break
    micro = -(-batch // accum_steps)
    est = peak(micro)
    return dict(phase=phase.name, batch=batch, L=phase.L, accum_steps=accum_steps, micro_batch=micro,
                est_gib=est / 2**30, budget_gib=budget / 2**30, fits=bool(est <= budget))


def plan_memory(args, meta, device, world):
    """Each phase's micro-batches on the CUDA card `device` -> (start-up lines, config.json record): plan_phase at
    the length batches pad to, within card_budget; an accum_steps left None (--preset paper without --accum-steps)
    is planned, a given one kept and estimated (on a CPU: lab/run.no_card_plan). Every line says micro-batch,
    accumulation steps and estimated peak; an estimate over the card is a note, not an error (it is an estimate)."""
    phases = [("spt", "pretrain_batch_size", "pretrain_accum_steps")] if args.spt else []
    phases += [("finetune", "batch_size", "accum_steps")]
    record, lines = {}, []
    budget, total = card_budget(device)
    L = max(hardware.padded_lengths(args.task, args.max_len))
    for phase, batch, accum in phases:
        rows = -(-getattr(args, batch) // world)            # this process's rows of a step
        flags = {k: getattr(args, k) for k in models.OBJECTIVES[args.objective].flags}  # the run's own objective
        plan = plan_phase(Phase(args.model, args.task, meta["config"], phase, L, args.precision, args.objective, flags),
                          rows, budget, getattr(args, accum))
        setattr(args, accum, plan["accum_steps"])
        record[phase] = dict(plan, card_gib=total / 2**30)
        lines.append(f"memory plan {phase}: micro-batch {plan['micro_batch']} × {plan['accum_steps']}"
                     f" accumulation steps, estimated peak {plan['est_gib']:.1f} GiB at L {L} of "
                     f"{plan['budget_gib']:.1f} GiB planned ({HEADROOM:.0%} of the card's "
                     f"{total / 2**30:.1f} GiB, at most what is free)")
        if not plan["fits"]:
            lines.append(f"note: {phase}: even micro-batch {plan['micro_batch']} is estimated over "
                         f"the plan; pass a smaller --{batch.replace('_', '-')}")
    return lines, record


# ---- the check: the estimate against a real CPU step ----------------------------------------------------------------

def check_values(model_name, task, phase):
    """The tiny preset's settings at CHECK_SIZE (DLR N = 256; S4 keeps its N = 64) for a check's small model."""
    return {**presets.values_for("tiny", model_name, task, phase == "spt"), **CHECK_SIZE,
            **({} if model_name == "s4" else dict(d_state=256))}


def memory_growth(cases):
    """The real side of a check, in this process: for each (model, task, phase, precision, B, lengths) of `cases` and
    each length, the growth of the resident set over one training step (forward, backward, AdamW), MiB. A first step
    at L = 32 loads the libraries and makes AdamW's state: what grows later is what the estimate's `step` counts."""
    grown = []
    for model_name, task, phase, precision, B, lengths in cases:
        torch.manual_seed(0)
        values = check_values(model_name, task, phase)
        model = training_case(Phase(model_name, task, values, phase, 32), B)[0]()
        opt = torch.optim.AdamW(model.parameters())
        for L in [32, *lengths]:
            forward = training_case(Phase(model_name, task, values, phase, L), B)[1]
            before = memory_mib("cpu", "now", True)
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
    code = "from lab import memory; import json, sys; print(json.dumps(memory.memory_growth(json.load(sys.stdin))))"
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    if out.returncode:
        raise RuntimeError(f"memory measurement failed: {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_check(cases=CHECKS):
    """Estimate vs measurement for each case and length: rows with est_mib and measured_mib."""
    measured = iter(measure_memory(cases))
    return [dict(model=m, task=t, phase=p, precision=pr, B=B, L=L, measured_mib=next(measured),
                 est_mib=training_memory(Phase(m, t, check_values(m, t, p), p, L, pr), B)["step"] / 2**20)
            for m, t, p, pr, B, lengths in cases for L in lengths]


# ---- the report ------------------------------------------------------------------------------------------------------

def table(header, rows):
    """Markdown table lines (readable in a terminal too)."""
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header), *(f"| {' | '.join(map(str, r))} |" for r in rows)]


def memory_lines(res):
    """The markdown of `python tools/bench.py --memory`: res["memory"] (memory_table), res["check"] (memory_check)."""
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
