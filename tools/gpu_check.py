"""tools/gpu_check.py: the GPU check that ships with the repo, `python bench.py --device cuda --gpu-check`, made to
bring its numbers back from one lent window. --minutes (default 6) counts from the start of the process, imports
included, and the check ends a margin before it; each part writes its JSON and refreshes summary.md as soon as it
ends, and a part that fails or runs out of time keeps its log lines (<part>.log) and its error; SIGTERM writes what
is done and exits. Everything lands in --out-dir (default results/gpu/<device>/); images are generated in a temporary
folder on the machine, run folders keep their logs (checkpoints deleted).
parts:  kernels  S4, S4D, DLR kernels at the PathX paper configuration: TF32 allowed vs guarded, against float64
        layers   one layer of each model, forward + backward, in fp32 and in the training precision (bf16 / fp16)
        runs     --preset paper from scratch on Pathfinder and PathX for each model, then the main command in
                 miniature (DLR, masked SPT then fine-tuning on PathX): ms/step, tokens/s, memory allocated and
                 reserved beside tools/memory.py's estimate, the loss curve
        claim    the paper's first claim in miniature: the Transformer on Pathfinder from scratch and after masked SPT,
                 for the same fine-tuning steps, with the minutes left
Check: tests/test_gpu_check.py runs it at --check-scale tiny on the CPU (deadline, a failing part, SIGTERM).
"""
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import lra_data
import models
import train
from lra import pathfinder
from tools import checked, memory, speed
from tools.memory import device_type, memory_mib, table

# Sizes per --check-scale. runs: task -> (steps, epochs) of each part-3 run; guess_s: seconds a part or run is assumed
# to need before anything is measured (a part is skipped when they are not left); claim_*: the last part.
SCALES = {
    "paper": dict(kernel_task="pathx", layers=dict(), size={}, batch=None, max_eval=128,
                  runs={"pathfinder": (60, 3), "pathx": (24, 2)}, claim_epochs=5, claim_eval=512,
                  min_claim_steps=100, max_claim_steps=5000, skip={},
                  guess_s=dict(kernels=30, layers=60, runs=30, run=30, claim=60)),
    "tiny": dict(kernel_task="pathfinder", size=dict(d_model=16, n_layers=1, d_state=8), batch=2, max_eval=2,
                 layers=dict(lengths=[64, 128, 256], max_tokens=512, batch=2, d_model=16, d_state=8, dlr_state=32,
                             n_heads=2, min_time=0, max_reps=1, fit_from=64, presets=[], models=["s4-nplr", "dlr"]),
                 runs={"pathfinder": (6, 3), "pathx": (4, 2)}, claim_epochs=2, claim_eval=2, min_claim_steps=2,
                 max_claim_steps=4, guess_s=dict(kernels=0, layers=0, runs=0, run=0, claim=0),
                 skip={("transformer", "pathx"): "--check-scale tiny: the paper's block-local attention at "
                                                 "L = 16,384 takes seconds a step on a CPU core"}),
}
MARGIN_S = 15                  # the check ends this long before --minutes (writing summary.md takes well under 1 s)
CHANCE_PLUS = 0.6              # part claim: the first step with val_acc ≥ 0.6 (chance: 0.5)
# images per second per core of the generator (results/generator_speed.txt, measured on a CPU here): how long the
# images of a part take on this machine's cores is predicted from these before it starts
IMAGES_PER_CORE_S = {"pathfinder": 265.0, "pathx": 17.0}


class OutOfTime(BaseException):    # BaseException, as KeyboardInterrupt: train.py's `except Exception` never eats it
    pass


class Stopped(BaseException):      # SIGTERM (a scheduler's time limit, the lender taking the machine back)
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


class Tee:
    """A stream that writes to `stream` and appends every line to `log_path` as it comes (tqdm's bars: the last
    state of each), so a part killed mid-way leaves its log on disk."""

    def __init__(self, stream, log_path):
        self.stream, self.file = stream, open(log_path, "a", buffering=1)

    def write(self, text):
        self.stream.write(text)
        self.file.write(text.replace("\r", "\n"))
        return len(text)

    def flush(self):
        self.stream.flush()
        self.file.flush()

    def isatty(self):
        return False


@contextlib.contextmanager
def logged(log_path):
    """stdout and stderr of the block, also into log_path."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Tee(out, log_path), Tee(err, log_path)
    try:
        yield
    finally:
        sys.stdout.file.close(), sys.stderr.file.close()
        sys.stdout, sys.stderr = out, err


def last_lines(log_path, n=40):
    """The last n non-empty lines of a part's log."""
    if not Path(log_path).is_file():
        return []
    return [line for line in Path(log_path).read_text(errors="replace").splitlines() if line.strip()][-n:]


class Check:
    """The check's state: settings, where it writes, its deadline, the parts' results so far."""

    def __init__(self, args, argv, started):
        self.args, self.scale = args, SCALES[args.check_scale]
        self.machine = dict(speed.machine_info(argv, args), cuda=torch.version.cuda,
                            gpu_memory_mib=memory_mib(args.device, "total"))
        folder = re.sub(r"[^A-Za-z0-9._]+", "-", self.machine["cpu"]).strip("-")
        folder = folder if device_type(args.device) == "cuda" else f"cpu-{folder}"
        default = Path(__file__).resolve().parents[1] / "results" / "gpu" / folder
        self.out = Path(args.out_dir) if args.out_dir else default
        self.out.mkdir(parents=True, exist_ok=True)
        theirs = [n for n in [*(f"{p}{x}" for p in [*PARTS, "stopped"] for x in (".json", ".log")), "summary.md"]
                  if not checked.owned(self.out / n)]                  # before any part: nothing overwritten
        if theirs:
            print(f"bench.py: error: --out-dir {self.out}: {theirs[0]} there was not written by the GPU check (not "
                  f"in {checked.MANIFEST}); it is left untouched: pass another --out-dir", file=sys.stderr)
            raise SystemExit(2)
        self.started, self.deadline = started, started + 60 * args.minutes - MARGIN_S
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))       # images: never brought back
        self.parts, self.data = {}, {}

    def left(self):
        return self.deadline - time.time()

    def save(self, name, part):
        """<name>.json now, and summary.md refreshed: whatever happens next, this part is on disk."""
        self.parts[name] = part
        body = dict(machine=self.machine, scale=self.args.check_scale, **part)
        checked.write_owned(self.out / f"{name}.json", json.dumps(body, indent=1), "bench.py --gpu-check")
        checked.write_owned(self.out / "summary.md", "\n".join(summary_lines(self)) + "\n", "bench.py --gpu-check")


def attempt(check, name, fn, need_s):
    """Run part `name` (fn(check) -> dict) with what is left of the deadline, its output also in <name>.log; save it
    as "ok", "skipped" (the guessed need_s is not left) or "error" (its traceback's end and log lines: a failure or
    the deadline). Stopped (SIGTERM) is saved, then raised on."""
    log = check.out / f"{name}.log"
    if need_s > check.left():
        return check.save(name, dict(status="skipped", reason=f"needs ~{need_s:.0f} s, {max(check.left(), 0):.0f} s "
                                     "of --minutes left"))
    t0 = time.time()
    checked.record(check.out, log.name, "bench.py --gpu-check")      # appended to: ours (Check checked it)
    try:
        with logged(log), time_limit(check.left()):
            part = dict(fn(check), status="ok")
    except Stopped as e:
        check.save(name, dict(status="error", error=f"Stopped: {e}", log=last_lines(log), seconds=time.time() - t0))
        raise
    except (Exception, SystemExit, OutOfTime, KeyboardInterrupt):   # SystemExit: train.py's one-line error
        part = dict(status="error", error=traceback.format_exc(limit=-3)[-1500:], log=last_lines(log))
    check.save(name, dict(part, seconds=time.time() - t0))


# ---- the parts ------------------------------------------------------------------------------------------------------

def kernels_part(check):
    """S4, S4D and DLR kernels at the PathX (tiny: Pathfinder) paper configuration with TF32 allowed and guarded."""
    return dict(rows=speed.kernel_precision(layer_args(check, "fp32"), check.scale["kernel_task"]))


def training_precision(check):
    """What train.py picks on this device by default: bf16 (compute capability ≥ 8), fp16 below, bf16 on a CPU."""
    if device_type(check.args.device) != "cuda":
        return "bf16"
    return "bf16" if torch.cuda.get_device_capability(check.args.device)[0] >= 8 else "fp16"


def layer_args(check, precision):
    return speed.settings(quick=True, device=check.args.device, precision=precision, **check.scale["layers"])


def layers_part(check):
    """tools/speed.py's quick layer table (L = 2,048 / 4,096 / 8,192, H = 128) in fp32, then the training precision."""
    out = {}
    for precision in ("fp32", training_precision(check)):
        args = layer_args(check, precision)
        out[precision] = dict(matmul_gflops=speed.matmul_gflops(args), layers=speed.layer_table(args))
        out[precision]["exponents"] = {n: speed.fit_exponent(out[precision]["layers"], n, args.fit_from)
                                       for n in args.models}
    return out


def make_images(check, task, n):
    """n hard Pathfinder / PathX images in the work folder, on every core (once per task) -> their seconds."""
    if task not in check.data or check.data[task]["images"] < n:
        shutil.rmtree(check.work / task, ignore_errors=True)
        t0, cores, root = time.time(), os.cpu_count() or 1, check.work / task
        pathfinder.generate_pathfinder(root, res=lra_data.TASKS[task].side, n=n, workers=cores,
                                       per_batch=-(-n // cores), seed=0,
                                       contour_length=pathfinder.DIFFICULTIES["hard"].contour_length)
        check.data[task] = dict(images=n, seconds=time.time() - t0, images_per_s=n / (time.time() - t0), cores=cores)
    return check.data[task]


def run_flags(check, model, task, steps, epochs, max_eval, spt=False):
    """train.py's flags of one run: --preset paper on the generated images, steps/epochs steps an epoch, evaluated
    after each, a warm-up of a tenth of the steps (the preset's 2,500-5,000 would keep a short run at chance);
    --spt: as many SPT epochs first. -> (flags, preset values, images needed)."""
    values = {**models.preset_values("paper", model, task, spt), **check.scale["size"]}
    batch = check.scale["batch"] or max(values["batch_size"], values["pretrain_batch_size"] if spt else 0)
    n_train = steps // epochs * batch
    n = max(-(-n_train * 10 // 8), 10 * max_eval, 20)                   # 80 / 10 / 10 split
    flags = ["--preset", "paper", "--model", model, "--task", task, "--device", check.args.device,
             "--data-dir", check.work / task, "--max-train", n_train, "--max-eval", max_eval, "--epochs", epochs,
             "--pretrain-epochs", epochs, "--eval-every", 1, "--warmup", max(1, steps // 10),
             "--out", check.out / "runs", "--generate", 0, "--batch-size", batch, "--pretrain-batch-size", batch]
    flags += [x for k, v in check.scale["size"].items() for x in (f"--{k.replace('_', '-')}", v)]
    return [str(f) for f in flags + ["--spt"] * spt], values, n


def paper_run(check, model, task, steps, epochs, max_eval, spt=False):
    """train.main(run_flags(...)) in this process -> speed (from the first to the last fine-tuning evaluation: the
    first epoch pays one-time costs), peak memory allocated and reserved and tools/memory.py's estimate, precision,
    batch, accum_steps, the log.jsonl records and val_acc curve, test accuracy. Its checkpoints are deleted."""
    flags, values, n = run_flags(check, model, task, steps, epochs, max_eval, spt)
    data = make_images(check, task, n)
    if device_type(check.args.device) == "cuda":
        torch.cuda.empty_cache()
    memory_mib(check.args.device, "now", reset=True)
    res = train.main(flags)
    peak = {k: memory_mib(check.args.device, k) for k in ("peak", "reserved_peak", "total")}
    run_dir = Path(res["run_dir"])
    for name in ("spt.pt", "best.pt", "last.pt"):                   # the run's own checkpoints: this run made them
        (run_dir / name).unlink(missing_ok=True)
    config, _, records = checked.read_run_folder(run_dir, "the run just made is damaged: run the check again")
    run = config["args"]
    ft = [r for r in records if r.get("phase") == "finetune"]
    first = ft[0] if len(ft) > 1 else dict(elapsed_s=0.0, step=0)      # one evaluation: from the start, then
    s = (ft[-1]["elapsed_s"] - first["elapsed_s"]) / max(1, ft[-1]["step"] - first["step"])
    micro, spec = -(-run["batch_size"] // run["accum_steps"]), lra_data.TASKS[task]
    est = memory.training_memory(model, task, values, "finetune", micro, spec.max_len, run["precision"])["peak"]
    return dict(model=model, task=task, spt=spt, precision=run["precision"], batch=run["batch_size"],
                accum_steps=run["accum_steps"], warmup=run["warmup"], steps=ft[-1]["step"], ms_per_step=1e3 * s,
                tokens_per_s=run["batch_size"] * spec.max_len / s, peak_mib=peak["peak"],
                reserved_mib=peak["reserved_peak"], total_mib=peak["total"], est_peak_mib=est / 2**20,
                wall_s=res["wall_time_s"]["total"], test_acc=res["test_acc"], images=data, run_dir=str(run_dir),
                fixed_s=res["wall_time_s"]["total"] - (ft[-1]["step"] - first["step"]) * s, records=records,
                curve=[[r["step"], r["val_acc"]] for r in ft])


def runs_part(check):
    """Each model from scratch on Pathfinder, then PathX; then DLR with masked SPT then fine-tuning on PathX (the
    repo's main command in miniature). Each run is saved into runs.json as it ends; a run whose guessed time is not
    left (tools' guess, or the same model's Pathfinder run scaled by L) is skipped, saying so."""
    plan = [(m, t, False) for t in check.scale["runs"] for m in models.MODELS] + [("dlr", "pathx", True)]
    for task in check.scale["runs"]:                 # one set of images per task, enough for each of its runs
        make_images(check, task, max(run_flags(check, m, t, *check.scale["runs"][t], check.scale["max_eval"], spt)[2]
                                     for m, t, spt in plan if t == task))
    done = []
    for model, task, spt in plan:
        steps, epochs = check.scale["runs"][task]
        row = dict(model=model, task=task, spt=spt)
        if (model, task) in check.scale["skip"]:
            done.append(dict(row, status="skipped", reason=check.scale["skip"][model, task]))
            continue
        pf = next((r for r in done if r["model"] == model and r.get("status") == "ok"), None)
        need = check.scale["guess_s"]["run"] if pf is None else pf["fixed_s"] + (1 + 2 * spt) * steps * \
            pf["ms_per_step"] / 1e3 * lra_data.TASKS[task].max_len / lra_data.TASKS[pf["task"]].max_len
        left = check.left() - check.scale["guess_s"]["claim"]
        if need > left:
            done.append(dict(row, status="skipped", reason=f"needs ~{need:.0f} s, {max(left, 0):.0f} s left"))
        else:
            try:
                done.append(dict(paper_run(check, model, task, steps, epochs, check.scale["max_eval"], spt),
                                 status="ok"))
            except (Exception, SystemExit) as e:   # the next run may still work: say why, go on
                done.append(dict(row, status="error", error=traceback.format_exc(limit=-3)[-1500:]))
                print(f"gpu check: {model} on {task} failed: {e}", file=sys.stderr)
        check.save("runs", dict(status="running", runs=done, data=check.data))
    return dict(runs=done, data=check.data)


def claim_steps(left_s, run, images_per_s, scale):
    """Fine-tuning steps F of the claim in left_s seconds, from the runs part's Transformer run on Pathfinder: TFS
    runs F steps, SPT F SPT steps then F (3F in all at that run's time per step), each run pays its fixed costs
    (start-up, first epoch, test), the training images are generated first; 80 % of it, whole epochs, at most
    max_claim_steps."""
    E = scale["claim_epochs"]
    per_step = 3 * run["ms_per_step"] / 1e3 + run["batch"] / (0.8 * E * images_per_s)
    return max(0, min(scale["max_claim_steps"], int((0.8 * left_s - 2 * run["fixed_s"]) / per_step)) // E * E)


def claim_part(check):
    """The --preset paper Transformer on Pathfinder, from scratch and after masked SPT, for the same F fine-tuning
    steps in claim_epochs epochs, F from the minutes left at the runs part's time per step (claim_steps); both
    validation curves and the first step each reaches val_acc ≥ CHANCE_PLUS. The paper: 71 % from scratch, 94 %
    with SPT; a few minutes check the path, not the claim."""
    run = next((r for r in check.parts.get("runs", {}).get("runs", [])
                if (r["model"], r["task"], r.get("status")) == ("transformer", "pathfinder", "ok")), None)
    if run is None:
        raise RuntimeError("needs the runs part's Transformer run on Pathfinder (its time per step)")
    scale, E = check.scale, check.scale["claim_epochs"]
    F = claim_steps(check.left(), run, run["images"]["images_per_s"], scale)
    if F < scale["min_claim_steps"]:
        raise RuntimeError(f"{check.left():.0f} s of --minutes left: {F} steps < {scale['min_claim_steps']}")
    check.data.pop("pathfinder", None)                                   # its own, larger set of images
    shutil.rmtree(check.work / "pathfinder", ignore_errors=True)
    claim = dict(steps=F, epochs=E)
    for kind in ("tfs", "spt"):
        claim[kind] = paper_run(check, "transformer", "pathfinder", F, E, scale["claim_eval"], spt=kind == "spt")
        claim[kind]["first_step_over"] = next((s for s, acc in claim[kind]["curve"] if acc >= CHANCE_PLUS), None)
    return claim


PARTS = {"kernels": kernels_part, "layers": layers_part, "runs": runs_part, "claim": claim_part}


def gpu_check(args, argv, started):
    """--gpu-check: the parts in order (PARTS), each skipped (saying so) when the minutes left do not allow it, each
    recording its error and log and the check going on if it fails, until the deadline (started + --minutes,
    less MARGIN_S). SIGTERM: what is done is on disk; exit status 143. -> dict(out_dir, parts, failed)."""
    check = Check(args, argv, started)

    def stop(signum, frame):
        raise Stopped("SIGTERM: the check stopped here, the parts before are saved")
    old = signal.signal(signal.SIGTERM, stop)
    try:
        for name, fn in PARTS.items():
            attempt(check, name, fn, check.scale["guess_s"][name])
    except Stopped:
        check.save("stopped", dict(status="error", error="stopped by SIGTERM", seconds=time.time() - started))
        print(f"gpu check: stopped by SIGTERM; what was done is in {check.out}", file=sys.stderr)
        raise SystemExit(143) from None
    finally:
        signal.signal(signal.SIGTERM, old)
        shutil.rmtree(check.work, ignore_errors=True)
    failed = [name for name, part in check.parts.items() if part["status"] == "error"]
    print("\n".join(summary_lines(check)) + (f"\nFAILED: {', '.join(failed)}" if failed else ""))
    return dict(out_dir=str(check.out), parts=check.parts, failed=failed)


# ---- summary.md -----------------------------------------------------------------------------------------------------

def summary_lines(check):
    """summary.md: measured numbers only; the device, torch, commit and command first, then each part as it stands."""
    m, parts = check.machine, check.parts
    lines = [f"# bench.py --gpu-check: {m['cpu']}", "",
             f"device {m['cpu']} ({check.args.device}, {m['gpu_memory_mib']:.0f} MiB, {m['cores']} CPU cores) | "
             f"torch {m['torch']} (CUDA {m['cuda']}) | commit {m['commit']} | `{m['command']}` | scale "
             f"{check.args.check_scale} | {(time.time() - check.started) / 60:.1f} of {check.args.minutes:g} min "
             "from the process's start", ""]
    for name, part in parts.items():
        if part["status"] in ("skipped", "error"):
            why = part.get("reason") or part["error"].strip().splitlines()[-1]
            lines += [f"- {name}: {part['status']}: {why}" + (f" (last lines in {name}.log)" if part.get("log")
                                                            else "")]
    if parts.get("kernels", {}).get("status") == "ok":
        lines += ["", "## kernels: TF32 allowed (matmuls follow it) vs guarded (exact float32), against float64", "",
                  *speed.kernel_lines(parts["kernels"]["rows"])]
    if parts.get("layers", {}).get("status") == "ok":
        for precision, res in parts["layers"].items():
            if isinstance(res, dict) and "layers" in res:
                lines += ["", f"## one layer, forward + backward, {precision}", "",
                          *speed.speed_lines(dict(res, train=[]), layer_args(check, precision))]
    every = parts.get("runs", {}).get("runs", [])
    lines += [f"- run {r['model']} on {r['task']}{' with SPT' * r['spt']}: {r['status']}: "
              f"{r.get('reason') or r['error'].strip().splitlines()[-1]}" for r in every if r["status"] != "ok"]
    runs = [r for r in every if r.get("status") == "ok"]
    if runs:
        lines += ["", "## --preset paper, short runs on generated images", "",
                  "ms / step: from the first to the last evaluation (evaluations included); memory: CUDA's peak "
                  "allocated / reserved over the run (CPU: the resident set's peak), est.: tools/memory.py's estimate "
                  "of one fine-tuning step", ""]
        lines += table(["model", "task", "run", "precision", "batch", "accum", "warm-up", "steps", "ms / step",
                        "tokens/s", "peak MiB", "reserved MiB", "est. MiB", "last val_acc", "test_acc", "wall s"],
                       [[r["model"], r["task"], "SPT + FT" if r["spt"] else "TFS", r["precision"], r["batch"],
                         r["accum_steps"], r["warmup"], r["steps"], f"{r['ms_per_step']:.1f}",
                         f"{r['tokens_per_s']:.0f}", f"{r['peak_mib']:.0f}", "–" if r["reserved_mib"] is None else
                         f"{r['reserved_mib']:.0f}", f"{r['est_peak_mib']:.0f}", f"{r['curve'][-1][1]:.3f}",
                         f"{r['test_acc']:.3f}", f"{r['wall_s']:.0f}"] for r in runs])
        images = {(r["task"], r["images"]["images"]): r["images"] for r in runs}
        lines += ["", "images generated: " + ", ".join(f"{task} {d['images']} in {d['seconds']:.1f} s on {d['cores']} "
                                                       f"cores" for (task, _), d in images.items())]
    claim = parts.get("claim", {})
    if claim.get("status") == "ok":
        lines += ["", f"## claim: Transformer on Pathfinder, val_acc after the same {claim['steps']} fine-tuning "
                  "steps", ""]
        lines += table(["fine-tuning step", "from scratch", "after SPT"], [[a[0], f"{a[1]:.3f}", f"{b[1]:.3f}"]
                       for a, b in zip(claim["tfs"]["curve"], claim["spt"]["curve"])])
        lines += ["", *(f"{kind}: first step with val_acc ≥ {CHANCE_PLUS}: {claim[kind]['first_step_over'] or 'none'}"
                        f"; test_acc {claim[kind]['test_acc']:.3f}; {claim[kind]['wall_s']:.0f} s"
                        for kind in ("tfs", "spt"))]
    return lines
