"""gpu_check.py: the GPU check that ships with the repo, `python bench.py --device cuda --gpu-check` (≤ --minutes).
1. the layer benchmark (bench.py's quick speed path);  2. short --preset paper runs of each model on Pathfinder and
PathX from scratch, on images generated on the machine: tokens/s, ms per step, peak memory next to memory.py's
estimate, the loss curve, precision;  3. with the minutes left, the paper's first claim in miniature: the --preset
paper Transformer on Pathfinder from scratch and after masked SPT, for the same fine-tuning steps, both val curves.
Writes results/gpu/<device name>/{layers,paper_runs,spt_claim}.json + summary.md (or --out-dir). --check-scale tiny
runs the whole check on a CPU in seconds: tests/test_bench.py.
"""
import contextlib
import json
import math
import os
import re
import signal
import tempfile
import time
import traceback
from pathlib import Path

import torch

import lra_data
import memory
import pathfinder
import train
from bench import machine_info, parse_args, speed, speed_lines
from memory import memory_mib, table

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
                                             "block-local attention at L = 16,384 take seconds a step on a CPU core"}),
}
RUN_TASKS, CHANCE_PLUS = ["pathfinder", "pathx"], 0.6   # part 3: the first step with val_acc ≥ 0.6 (chance: 0.5)


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
