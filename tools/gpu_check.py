"""tools/gpu_check.py: the GPU check that ships with the repo, `python tools/bench.py --device cuda --gpu-check
--out-dir D`, made to bring its numbers back from one lent window. --minutes (default 8: a 15-minute lease less the
machine's start) counts from the start of the process, imports included, and the check ends MARGIN_S before it. Each
part, when it ends, refreshes the three files of --out-dir (default: a new temporary folder, never the repo):
summary.md (tools/gpu_summary.py), results.json (every part's numbers) and check.tar.gz (the parts' JSON and logs and
the run folders' logs): three files, no folders, as a lent machine returns them. SIGTERM writes what is done and
exits. Runs without git (commit "unknown").
parts, in order (PARTS; each part's docstring and docs/gpu.md say more):
  tf32      (a) torch's TF32 state after each --precision choice and inside the kernel guard (ssm.set_tf32)
  kernels   (b) the PathX paper layer's S4 NPLR, S4D, DLR kernels against float64, TF32 allowed and guarded
  main      (c) 20 steps of the main command, its process under torch.cuda.set_sync_debug_mode("warn"): step time,
                peak memory, host-device syncs (the whole run's, evaluations and checkpoints included) and where
  largest   (d) one training step of the three largest paper presets: peak against the plan's estimate
  attention (e) the paper Transformer's attention at PathX's length under SDPA limited to flash / memory-efficient
  compile   (f) --compile: graphs compiled, frames that fell back to eager, graph breaks
  spt_batch (g) the SPT batch the preset really uses in (c), against the preset's
Check: tests/test_gpu_check.py runs it at --check-scale tiny on the CPU (each part, the deadline, a failing part,
SIGTERM, no git, the files).
"""
import argparse
import contextlib
import copy
import json
import multiprocessing
import os
import shutil
import tarfile
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import lra_data
import ssm
from lab import hardware, memory, presets, steps
from lab.memory import device_type, memory_mib
from lra import pathfinder
from tools import checked, speed
from tools.gpu_summary import last_lines, logged, summary_lines

OUTPUTS = ("summary.md", "results.json", "check.tar.gz")   # all --out-dir gets (a lent machine returns 8 files)
MARGIN_S = 15                  # the check ends this long before --minutes (writing summary.md takes well under 1 s)
REPO = Path(__file__).resolve().parents[1]
TOOL = "tools/bench.py --gpu-check"                       # the writer recorded in --out-dir's manifest


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


# Sizes per --check-scale (tiny: the same path on a CPU in seconds).
SCALES = {
    "paper": dict(lengths=[1024, 16384, 65536], kernel_size={}, main_steps=20, main_extra=[], size={}, max_eval=64,
                  largest_size={}, largest_L=None, attention_L=16384, attention_batch=2, compile_backend="inductor",
                  guess_s=dict(tf32=1, kernels=30, main=120, largest=90, attention=20, compile=90, spt_batch=0)),
    "tiny": dict(lengths=[64, 256], kernel_size=dict(d_model=4), main_steps=2, main_extra=["--batch-size", "4"],
                 size=dict(d_model=16, n_layers=1, d_state=8), max_eval=2, largest_L=256, attention_L=256,
                 largest_size=dict(d_model=16, n_layers=1, d_state=8, n_heads=2, d_ff=32), attention_batch=2,
                 compile_backend="aot_eager", guess_s=dict(tf32=0, kernels=0, main=0, largest=0, attention=0,
                                                           compile=0, spt_batch=0)),
}
MAIN = ["--model", "dlr", "--task", "pathx", "--spt"]       # the README's main command


class Check:
    """The check's state: settings, where it writes, its deadline, the parts' results so far."""

    def __init__(self, args, argv, started):
        self.args, self.scale = args, SCALES[args.check_scale]
        self.machine = dict(speed.machine_info(argv, args), cuda=torch.version.cuda,
                            gpu_memory_mib=memory_mib(args.device, "total"))
        self.out = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="gpu-check-out-"))
        self.out.mkdir(parents=True, exist_ok=True)        # its OUTPUTS checked ours before (bench.check_args)
        self.started, self.deadline = started, started + 60 * args.minutes - MARGIN_S
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))       # images, run folders, part files
        self.parts, self.data, self.names, self.margin_s = {}, {}, list(PARTS), MARGIN_S

    def left(self):
        return self.deadline - time.time()

    def cuda(self):
        return device_type(self.args.device) == "cuda"

    def save(self, name, part):
        """The part's JSON and log into the work folder, then the three files of --out-dir rewritten: whatever
        happens next, this part is on disk."""
        self.parts[name] = part
        body = dict(machine=self.machine, scale=self.args.check_scale, **part)
        checked.write_owned(self.work / f"{name}.json", json.dumps(body, indent=1, default=str), TOOL)
        results = dict(machine=self.machine, scale=self.args.check_scale, parts=self.parts)
        checked.write_owned(self.out / "results.json", json.dumps(results, indent=1, default=str), TOOL)
        checked.write_owned(self.out / "summary.md", "\n".join(summary_lines(self)) + "\n", TOOL)

        def archive(tmp):
            with tarfile.open(tmp, "w:gz") as tar:
                for f in sorted(self.work.glob("*.json")) + sorted(self.work.glob("*.log")):
                    tar.add(f, arcname=f.name)
                for f in sorted((self.work / "runs").rglob("*")) if (self.work / "runs").is_dir() else []:
                    if f.is_file() and f.suffix in (".txt", ".jsonl", ".json"):
                        tar.add(f, arcname=str(f.relative_to(self.work)))
        checked.write_owned(self.out / "check.tar.gz", archive, TOOL)


def attempt(check, name, fn, need_s):
    """Run part `name` (fn(check) -> dict) with what is left of the deadline, its output also in <name>.log; save it
    as "ok", "skipped" (the guessed need_s is not left) or "error" (its traceback's end and log lines: a failure or
    the deadline). Stopped (SIGTERM) is saved, then raised on."""
    log = check.work / f"{name}.log"
    if need_s > check.left():
        return check.save(name, dict(status="skipped", reason=f"needs ~{need_s:.0f} s, {max(check.left(), 0):.0f} s "
                                     "of --minutes left"))
    t0 = time.time()
    try:
        with logged(log), time_limit(check.left()):
            part = fn(check)
            part = dict(part, status=part.get("status", "ok"))
    except Stopped as e:
        check.save(name, dict(status="error", error=f"Stopped: {e}", log=last_lines(log), seconds=time.time() - t0))
        raise
    except (Exception, SystemExit, OutOfTime, KeyboardInterrupt):   # SystemExit: train.py's one-line error
        part = dict(status="error", error=traceback.format_exc(limit=-3)[-1500:], log=last_lines(log))
    check.save(name, dict(part, seconds=time.time() - t0))


# ---- the parts ------------------------------------------------------------------------------------------------------

def tf32_state():
    """torch's TF32 getters, each as it answers or the first line of what it raised."""
    out = {}
    for name, get in [("cublas_allow_tf32", torch._C._get_cublas_allow_tf32),
                      ("matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
                      ("float32_matmul_precision", torch.get_float32_matmul_precision),
                      ("cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32)]:
        try:
            out[name] = get()
        except Exception as e:
            out[name] = f"raised: {str(e).splitlines()[0][:120]}"
    return out


def tf32_part(check):
    """(a) For each --precision choice: steps.precision on the device, the getters after it and inside the kernel
    guard; ok when none raised and cuBLAS's TF32 is the flag asked (inside the guard: off)."""
    rows, device = [], torch.device(check.args.device)
    before = ssm.matmul_precision()
    try:
        for name in ("fp32", "tf32", "bf16", "fp16"):
            steps.precision(argparse.Namespace(precision=name, amp=False), device)
            after = tf32_state()
            with ssm.full_fp32_matmuls():
                inside = tf32_state()
            if device.type == "cuda":                                  # a float32 matmul asks cuBLAS for real
                a = torch.randn(64, 64, device=device)
                (a @ a).sum().item()
            rows.append(dict(precision=name, after=after, inside_guard=inside, back=tf32_state(),
                             ok=after["cublas_allow_tf32"] is (name == "tf32")
                             and inside["cublas_allow_tf32"] is False
                             and not any(str(v).startswith("raised") for s in (after, inside) for v in s.values())))
    finally:
        ssm.set_matmul_precision(before)
    bad = [r["precision"] for r in rows if not r["ok"]]
    if bad:
        raise RuntimeError(f"TF32 state wrong or unreadable after --precision {', '.join(bad)}: {rows}")
    return dict(rows=rows, torch=torch.__version__)


def kernel_errors(kernel, L, grads_of):
    """Per-channel relative L2 error of kernel(L) and of the gradient of Σ K·w against the float64 kernel."""
    exact = copy.deepcopy(kernel).double()
    torch.manual_seed(1)
    w = torch.randn(kernel(L).shape, device=next(kernel.parameters()).device, dtype=torch.float64)
    out = {}
    for k, dtype in ((kernel, torch.float32), (exact, torch.float64)):
        K = k(L)
        g = torch.autograd.grad((K * w.to(dtype)).sum(), grads_of(k))
        out[dtype] = (K.detach().double().reshape(-1, L), torch.cat([x.double().flatten() for x in g]))
    (K, g), (K64, g64) = out[torch.float32], out[torch.float64]
    return (float(((K - K64).norm(dim=-1) / K64.norm(dim=-1)).max()), float((g - g64).norm() / g64.norm()))


def kernels_part(check):
    """(b) The PathX paper layer's kernels (S4 NPLR, S4D, DLR) at each length, forward and gradient, TF32 allowed and
    guarded (speed.tf32_allowed), against float64."""
    rows = []
    for name in speed.KERNELS:
        kernel = speed.paper_kernel(name, "pathx", check.args.device, **check.scale["kernel_size"])
        params = lambda k: [p for p in k.parameters() if p.requires_grad]      # noqa: E731
        for L in check.scale["lengths"]:
            for guarded in (False, True):
                with speed.tf32_allowed(guarded):
                    fwd, grad = kernel_errors(kernel, L, params)
                rows.append(dict(kernel=name, L=L, guarded=guarded, forward_error=fwd, grad_error=grad))
                print(f"  {name:8s} L {L:6d} {'guarded' if guarded else 'TF32   '} forward {fwd:.1e} grad {grad:.1e}",
                      flush=True)
    return dict(rows=rows)


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


def main_flags(check, steps_, extra=()):
    """train.py's flags of the main command for `steps_` SPT and as many fine-tuning steps, one epoch each, the
    preset's own batches (part g reads the SPT batch back; tiny: fine-tuning batch 4) -> (flags, images needed)."""
    extra = [*check.scale["main_extra"], *extra]
    values = {**presets.values_for("paper", "dlr", "pathx", True), **check.scale["size"]}
    if "--batch-size" in extra:
        values["batch_size"] = int(extra[extra.index("--batch-size") + 1])
    n_train = steps_ * max(values["batch_size"], values["pretrain_batch_size"])
    max_eval = check.scale["max_eval"]
    flags = [*MAIN, "--preset", "paper", "--device", check.args.device, "--data-dir", check.work / "pathx",
             "--max-train", n_train, "--max-eval", max_eval, "--epochs", 1, "--pretrain-epochs", 1,
             "--max-steps", steps_, "--warmup", max(1, steps_ // 10), "--out", check.work / "runs", "--generate", 0,
             *[x for k, v in check.scale["size"].items() for x in (f"--{k.replace('_', '-')}", v)], *extra]
    return [str(f) for f in flags], max(-(-n_train * 10 // 8), 10 * max_eval, 20)


RUN_MAIN = """import collections, json, os, sys, torch, warnings
import train
from lab import hardware
from lab.memory import memory_mib
hardware.COMPILE_BACKEND = sys.argv[2]              # the check's backend for --compile
memory_mib(sys.argv[1], "now", reset=True)
if torch.cuda.is_available() and sys.argv[1].startswith("cuda"):
    torch.cuda.set_sync_debug_mode("warn")          # here, in the run's own process: every host-device sync warns
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    res = train.main(sys.argv[3:])
sync = [w for w in seen if "synchroniz" in str(w.message)]
syncs = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in sync)
others = collections.Counter(f"{w.category.__name__}: {str(w.message)[:160]}" for w in seen  # shown, not lost
                             if "synchroniz" not in str(w.message))
peak = {k: memory_mib(sys.argv[1], k) for k in ("peak", "reserved_peak")}
print("RESULT " + json.dumps(dict(results=res, peak=peak, syncs=dict(syncs.most_common(8)), n_syncs=len(sync),
                                  warnings=dict(others.most_common(8))), default=str), flush=True)
"""


def run_main(check, flags, n, backend=None):
    """train.main(flags) on generated PathX images in a process of its own (nothing imports train.py), --compile with
    `backend` (default hardware.COMPILE_BACKEND) -> (results, config.json, log.jsonl records, peak MiB); its checkpoints
    deleted. Its one-line error is raised here (SystemExit); a stop (OutOfTime, Ctrl-C) ends the process first."""
    make_images(check, "pathx", n)
    child = subprocess.Popen([sys.executable, "-c", RUN_MAIN, check.args.device, backend or hardware.COMPILE_BACKEND,
                              *flags], cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = child.communicate()
    except BaseException:
        child.kill(), child.wait()
        raise
    found = [line[len("RESULT "):] for line in out.splitlines() if line.startswith("RESULT ")]
    if child.returncode or not found:
        raise SystemExit((err.strip().splitlines() or [f"train.py exited {child.returncode}"])[-1])
    done = json.loads(found[-1])
    res, peak = done["results"], dict(done["peak"], **{k: done[k] for k in ("syncs", "n_syncs", "warnings")})
    run_dir = Path(res["run_dir"])
    for name in ("spt.pt", "best.pt", "last.pt"):                   # the run's own checkpoints: this run made them
        (run_dir / name).unlink(missing_ok=True)
    config, _, records = checked.read_run_folder(run_dir, "the run just made is damaged: run the check again")
    return res, config, records, peak


def main_part(check):
    """(c) The main command, main_steps SPT and fine-tuning steps, its process under set_sync_debug_mode("warn"):
    every host-device sync of the run (steps, evaluations, checkpoints, the test) counted by its line of code, to set
    against the loop's one read per PROGRESS_STEPS, and every other warning the run raised (its first 8 kinds); no
    verdict ((f)'s --compile run: counted, not reported)."""
    flags, n = main_flags(check, check.scale["main_steps"])
    res, config, records, peak = run_main(check, flags, n)
    spt = [r for r in records if r.get("phase") == "spt"]
    ft = [r for r in records if r.get("phase") == "finetune"]
    return dict(sync_debug_mode="warn, counted" if check.cuda() else "not CUDA: no sync debug mode",
                syncs=peak["n_syncs"] if check.cuda() else None, sync_sites=peak["syncs"],
                other_warnings=peak["warnings"],
                precision=config["args"]["precision"], spt_steps=spt[-1]["step"], finetune_steps=ft[-1]["step"],
                spt_s_per_step=spt[-1]["elapsed_s"] / max(1, spt[-1]["step"]),
                finetune_s_per_step=ft[-1]["elapsed_s"] / max(1, ft[-1]["step"]),
                peak_mib=peak["peak"], reserved_mib=peak["reserved_peak"], memory_plan=config.get("memory_plan"),
                pretrain_batch_size=config["args"]["pretrain_batch_size"], batch_size=config["args"]["batch_size"],
                test_acc=res["test_acc"], images=check.data["pathx"])


def largest_presets(n=3):
    """The n (model, task, phase) of the largest paper-preset steps in results/memory.json (tools/bench.py --memory)."""
    rows = json.loads((REPO / "results" / "memory.json").read_text())["memory"]
    return [(r["model"], r["task"], r["phase"]) for r in sorted(rows, key=lambda r: -r["bf16_gib"])[:n]]


def largest_part(check):
    """(d) One training step of each of the three largest paper presets, at the micro-batch the plan gives this card
    (CPU: the machine's memory) and the padded length: peak allocated and reserved against the plan's estimate."""
    rows, device = [], check.args.device
    precision = training_precision(check)
    budget = memory.card_budget(device)[0] if check.cuda() else memory.HEADROOM * memory_mib("cpu", "free") * 2**20
    for model_name, task, phase in largest_presets():
        values = {**presets.values_for("paper", model_name, task, phase == "spt"), **check.scale["largest_size"]}
        batch = values["pretrain_batch_size" if phase == "spt" else "batch_size"]
        L = check.scale["largest_L"] or max(hardware.padded_lengths(task))
        case = memory.Phase(model_name, task, values, phase, L, precision)
        plan = memory.plan_phase(case, batch, budget)
        build, forward = memory.training_case(case, plan["micro_batch"])
        torch.manual_seed(0)
        model = build().to(device)
        opt = torch.optim.AdamW(model.parameters())
        if check.cuda():
            torch.cuda.empty_cache()
        memory_mib(device, "now", reset=True)
        t0 = time.time()
        with memory.autocast("fp32" if precision == "fp32" else "bf16", device_type(device)):
            loss = forward(model)
        loss.backward()
        opt.step()
        speed.synchronizer(device)()
        rows.append(dict(model=model_name, task=task, phase=phase, L=L, micro_batch=plan["micro_batch"],
                         accum_steps=plan["accum_steps"], est_gib=plan["est_gib"], seconds=time.time() - t0,
                         peak_gib=memory_mib(device, "peak") / 1024,
                         reserved_gib=(memory_mib(device, "reserved_peak") or 0) / 1024))
        print(f"  {model_name} {task} {phase}: micro-batch {plan['micro_batch']}, est. {plan['est_gib']:.2f} GiB, "
              f"peak {rows[-1]['peak_gib']:.2f} GiB", flush=True)
        del model, opt, loss
    return dict(rows=rows, precision=precision)


def attention_part(check):
    """(e) The paper Transformer (PathX: 4 × 128, block-local attention) forward + backward at PathX's length in the
    training precision with SDPA limited to the flash and memory-efficient kernels: if the fused path is not taken,
    torch raises (no math fallback)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    values = presets.values_for("paper", "transformer", "pathx", False)
    L, B = check.scale["attention_L"], check.scale["attention_batch"]
    extra = {} if L >= 16384 else dict(local_min_len=L // 2, block_size=L // 4)
    build, forward = memory.training_case(memory.Phase("transformer", "pathx", {**values, **extra}, "finetune", L), B)
    torch.manual_seed(0)
    model = build().to(check.args.device)
    precision = training_precision(check)
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    t0 = time.time()
    with sdpa_kernel(backends), memory.autocast("fp32" if precision == "fp32" else "bf16",
                                               device_type(check.args.device)):
        loss = forward(model)
    loss.backward()
    speed.synchronizer(check.args.device)()
    return dict(L=L, batch=B, precision=precision, backends=[b.name for b in backends], seconds=time.time() - t0,
                loss=float(loss))


def compile_part(check):
    """(f) The main command for main_steps steps with --compile (tiny: the aot_eager backend, paper: inductor): the
    compile records train.py logs (graphs, frames run eagerly, graph breaks) and the fallback verdict."""
    flags, n = main_flags(check, check.scale["main_steps"], ["--compile"])
    records = run_main(check, flags, n, check.scale["compile_backend"])[2]
    compiled = [r for r in records if r.get("phase") == "compile"]
    fell_back = any(r["frames_eager"] for r in compiled)
    return dict(backend=check.scale["compile_backend"], records=compiled, fell_back=fell_back,
                status="error" if fell_back else "ok", error="frames fell back to eager" if fell_back else None)


def spt_batch_part(check):
    """(g) The SPT batch the main command really ran (part c's config.json) against the preset's."""
    main = check.parts.get("main", {})
    if main.get("status") != "ok":
        raise RuntimeError("needs part main (c)")
    preset = presets.values_for("paper", "dlr", "pathx", True)["pretrain_batch_size"]
    if main["pretrain_batch_size"] != preset:
        raise RuntimeError(f"the main command pre-trained with batch {main['pretrain_batch_size']}, preset {preset}")
    return dict(pretrain_batch_size=main["pretrain_batch_size"], preset=preset, spt_s_per_step=main["spt_s_per_step"])


def training_precision(check):
    """What train.py picks on this device by default: bf16 (compute capability ≥ 8), fp16 below; fp32 on a CPU."""
    if not check.cuda():
        return "fp32"
    return "bf16" if torch.cuda.get_device_capability(check.args.device)[0] >= 8 else "fp16"


PARTS = {"tf32": tf32_part, "kernels": kernels_part, "main": main_part, "largest": largest_part,
         "attention": attention_part, "compile": compile_part, "spt_batch": spt_batch_part}


def gpu_check(args, argv, started):
    """--gpu-check: the parts in order (PARTS), each skipped (saying so) when the minutes left do not allow it, each
    recording its error and log and the check going on if it fails, until the deadline (started + --minutes,
    less MARGIN_S). SIGTERM: what is done is on disk; exit status 143. -> dict(out_dir, parts, failed)."""
    check = Check(args, argv, started)
    print(f"gpu check: writing to {check.out}", flush=True)

    def stop(signum, frame):
        raise Stopped("SIGTERM: the check stopped here, the parts before are saved")
    old, stopped = signal.signal(signal.SIGTERM, stop), False
    try:
        for name, fn in PARTS.items():
            attempt(check, name, fn, check.scale["guess_s"][name])
    except Stopped:
        check.save("stopped", dict(status="error", error="stopped by SIGTERM", seconds=time.time() - started))
        print(f"gpu check: stopped by SIGTERM; what was done is in {check.out}", file=sys.stderr, flush=True)
        stopped = True
    finally:
        signal.signal(signal.SIGTERM, old)
        shutil.rmtree(check.work, ignore_errors=True)
    if stopped:
        # What was done is on disk. Exit now, not through the interpreter's shutdown: that joins every worker pool
        # a part left, and one that SIGTERM interrupted mid-task (a data generator's) can keep it waiting past a
        # scheduler's grace period (seen once in CI: the message above, then no exit for 60 s).
        for child in multiprocessing.active_children():
            child.terminate()
        sys.stdout.flush()
        os._exit(143)
    failed = [name for name, part in check.parts.items() if part["status"] == "error"]
    print("\n".join(summary_lines(check)) + (f"\nFAILED: {', '.join(failed)}" if failed else ""))
    return dict(out_dir=str(check.out), parts=check.parts, failed=failed)
