"""runs.py: a training run on disk and across processes, the plumbing under train.py.
run folder:  runs/<task>-<model>-<spt|init|tfs>-s<seed>-<time>/ with config.json, log.txt, log.jsonl, spt.pt, best.pt,
             last.pt and results.json; checkpoints are plain dicts written atomically (temporary file, then rename)
resume:      last.pt holds weights, optimiser, schedule and every RNG, so a stopped run continues exactly; a lock
             keeps one writer per folder; a finished or damaged run is refused in one line
DDP:         every process reads the whole global batch and keeps its rows; sums of metrics are added over processes
device:      --device checked, --precision decided once (bf16 / fp16 + scaler / tf32 / fp32), loaders that feed a GPU
errors:      bad input ends in one line `train.py: error: ...` and exit status 2, never a traceback
Check: tests/test_robustness.py (DDP equals one process, exact resume, locks, damaged checkpoints, bad flags).
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import cache, partial
from pathlib import Path

import torch
import torch.distributed as dist

import lra_data
from ssm import tf32_flag

try:
    import fcntl                                                         # POSIX file locks; absent on Windows
except ImportError:
    fcntl = None


# ---- messages, locks ----------------------------------------------------------------------------------------------

def fail(message):
    """Bad input: one line on stderr (from rank 0 only, under torchrun) and exit status 2, never a traceback."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"train.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def log(run_dir, line, record=None):
    """Print one line; rank 0 also appends it to run_dir/log.txt (and `record` to log.jsonl) once run_dir is set."""
    print(line, flush=True)
    if run_dir is None or rank_and_world()[0] > 0:
        return
    with open(run_dir / "log.txt", "a") as f:
        f.write(line + "\n")
    if record is not None:
        with open(run_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


@contextlib.contextmanager
def file_lock(path):
    """Wait for an exclusive lock on `path` (created if absent) and hold it for the block; the OS drops it when the
    process dies, so a killed run never leaves a stale lock. Without fcntl (Windows) there is no lock."""
    if fcntl is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def hold_lock(folder):
    """Lock run folder `folder` for this process (rank 0): an open file with an exclusive flock, released when it is
    closed or the process dies (never stale); or exit in one line if another train.py holds it. None without fcntl
    (Windows: no lock) or on ranks > 0."""
    if fcntl is None or rank_and_world()[0] > 0 or int(os.environ.get("RANK", 0)) > 0:
        return None
    f = open(Path(folder) / ".lock", "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        fail(f"{folder} is in use by another train.py (the run itself or a --resume of it); wait until it stops")
    return f


def release_lock(lock):
    """Give a run folder's lock (from hold_lock) back; None: nothing to give back. The empty .lock file stays: deleting
    it would let a process that opened it just before lock the deleted file while a third locks a new one."""
    if lock is not None:
        lock.close()


@cache                        # asked for by the log's device line and by config.json: one git call per run
def git_commit():
    """Short commit of the repo this file is in, plus -dirty when a tracked file differs from it (new files, such as
    the run folders a study writes inside the repo, do not count), or 'unknown' outside git."""
    here = Path(__file__).resolve().parent
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=here, capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = run("status", "--porcelain", "--untracked-files=no")
        return (run("rev-parse", "--short", "HEAD") or "unknown") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---- DDP: which rows of a batch are this process's, and sums over processes ----------------------------------------

def rank_and_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def shard(n):
    """(rows, keep): this process's contiguous share of a global batch of n examples (DDP; one process: all of it).
    Every process reads the whole global batch, so batches and SPT masks are those of a 1-process run. A process left
    without rows (a last batch smaller than the world) computes row 0 with keep=False, to join the all-reduce."""
    rank, world = rank_and_world()
    start = rank * (n // world) + min(rank, n % world)
    stop = start + n // world + (rank < n % world)
    return (slice(start, stop), True) if stop > start else (slice(0, 1), False)


def all_sum(total):
    """Add up a dict of additive statistics (device tensors) over all DDP processes, on their device (gloo: CPU,
    NCCL: CUDA), as one process would have them."""
    if not dist.is_initialized():
        return total
    values = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in total.values()])
    dist.all_reduce(values)
    return dict(zip(total, values.unbind()))


def setup_device(args):
    """-> (device, world size): checks --device and that --out can be written (making --out itself); settles
    --precision (printed, in config.json) and --workers. A global batch need not split evenly over the processes:
    shard() gives some one row more, and batch_loss divides by the global count, so the gradient stays the mean."""
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        fail(f"--device {args.device}: not a device; use cpu, cuda, cuda:1, ...")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {args.device}: no CUDA device is visible to PyTorch; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        fail(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    if device.type not in ("cpu", "cuda"):
        fail(f"--device {args.device}: train.py runs on cpu or cuda")
    world = int(os.environ.get("WORLD_SIZE", 1))
    args.precision = precision(args, device)[0]                          # resolved once, printed, in config.json
    if args.workers is None:                                             # CUDA: loader processes keep the GPU fed
        args.workers = min(8, (os.cpu_count() or 1) // world) if device.type == "cuda" else 0
    if not args.resume and int(os.environ.get("RANK", 0)) == 0:   # known now, not after the data was prepared:
        probe = Path(args.out).resolve()                         # try writing where the run folder will be made
        while not probe.exists():
            probe = probe.parent
        try:
            tempfile.TemporaryFile(dir=probe).close()
        except OSError as e:
            fail(f"--out {args.out}: cannot write there ({e.strerror}); pass a writable folder")
    return device, world


def join_process_group(device, world):
    """Under torchrun: one process per GPU (NCCL) or CPU process (gloo); only rank 0 prints. Returns the device."""
    if world == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    if dist.get_rank() > 0:                                              # only rank 0 prints, logs and saves
        sys.stdout = open(os.devnull, "w")
    return device


def precision(args, device):
    """The one place that decides numeric precision -> (name, autocast context factory, GradScaler or None).
    Default: bf16 autocast on CUDA with compute capability ≥ 8, fp16 autocast with a gradient scaler on older GPUs
    (V100, T4), fp32 on CPU. TF32 is set explicitly for every choice: on for "tf32" only. Under bf16 / fp16 autocast
    the only float32 matmuls left are the SSM kernels', which must not use TF32 (ssm.Matmul guards them anyway), so
    TF32 there would buy nothing. The SSM kernels and FFT convolutions run in fp32 inside autocast (ssm.py).
    --amp is the old name of --precision bf16."""
    name = args.precision or ("bf16" if args.amp else None)
    if name is None:
        name = "fp32" if device.type != "cuda" else ("bf16" if torch.cuda.get_device_capability(device)[0] >= 8
                                                     else "fp16")
    flag, on, off = tf32_flag()
    setattr(torch.backends.cuda.matmul, flag, on if name == "tf32" else off)    # also on a CPU: no effect there
    torch.backends.cudnn.allow_tf32 = name == "tf32"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)
    amp = partial(torch.autocast, device.type, dtype) if dtype else contextlib.nullcontext
    return name, amp, torch.amp.GradScaler(device.type) if name == "fp16" else None


# ---- batches of a run ------------------------------------------------------------------------------------------

class SeededOrder(torch.utils.data.Sampler):
    """A new permutation of the n examples at every pass, drawn from `gen` (its state is in last.pt), so one
    DataLoader (with persistent workers) serves every epoch and the order is that of a 1-process run everywhere."""

    def __init__(self, n, gen):
        self.n, self.gen = n, gen

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.gen).tolist())

    def __len__(self):
        return self.n


def loader(dataset, batch_size, args, device, order=None):
    """Batches of `dataset` padded by lra_data.collate (token batches to a few bucketed lengths): in a new seeded
    order each epoch (order: a torch.Generator) or in order. CUDA: pinned memory, persistent workers that prefetch."""
    workers, cuda = args.workers, device.type == "cuda"
    seeds = torch.Generator().manual_seed(args.seed + 4)   # its worker seeds: not from the global (dropout) RNG
    return torch.utils.data.DataLoader(dataset, batch_size, sampler=order and SeededOrder(len(dataset), order),
                                       collate_fn=lra_data.collate, num_workers=workers, pin_memory=cuda,
                                       persistent_workers=workers > 0, prefetch_factor=4 if workers > 0 else None,
                                       generator=seeds)


# ---- what a run prints first and last ----------------------------------------------------------------------

def startup_lines(args, how, notes, device, world, threads, splits, source, data_notes, classifier, meta, t_data):
    """What the run prints first (and log.txt keeps): preset, plan, device, every setting, data, model, sizes."""
    knobs = {"masked": f"mask ratio {args.mask_ratio}", "span": f"mask ratio {args.mask_ratio}, span mean "
             f"{args.span_mean}", "rtd": f"mask ratio {args.mask_ratio}, generator {args.gen_width}x{args.gen_layers}, "
             f"λ {args.rtd_weight}, {'GDES' if args.gdes else 'shared embedding'}"}.get(args.objective)
    plan = (f"SPT {args.objective}{f' ({knobs})' if knobs else ''}, then fine-tune" if args.spt
            else f"fine-tune from {args.init_from}" if args.init_from else "from scratch (TFS)")
    extras = f"{f' × {world} processes (DDP)' if world > 1 else ''} | precision {args.precision}" + \
        (" + torch.compile" if args.compile else "")
    n_backbone = sum(p.numel() for p in classifier.backbone.parameters())
    n_head = sum(p.numel() for p in classifier.head.parameters())
    sizes = " / ".join(f"{split} {len(splits[split]):,}" for split in ("train", "val", "test"))
    return [f"preset {args.preset} ({how}); explicit flags override it", *notes,
            f"run: {args.model} on {args.task} | {plan} | seed {args.seed}",
            f"device {device}{extras} | torch {torch.__version__} | threads {threads['torch_threads']} | "
            f"git {git_commit()}",
            "settings: " + " ".join(f"{k}={v}" for k, v in vars(args).items()),
            f"data: {source} | {sizes} | {t_data:.1f} s", *(f"data note: {n}" for n in data_notes),
            f"model {type(classifier.backbone).__name__}({', '.join(f'{k}={v}' for k, v in meta['config'].items())})",
            f"params: backbone {n_backbone:,} + classifier head {n_head:,} = {n_backbone + n_head:,}"]


def stopped_by_ctrl_c(run_dir, where):
    """One line instead of a KeyboardInterrupt traceback: where the run stopped, what is saved, how to go on."""
    last = read_checkpoint(run_dir / "last.pt") if (run_dir / "last.pt").is_file() else None
    saved = f"last.pt holds {last['phase']} epoch {last['epoch']}" if last else "no checkpoint yet"
    then = (f"continue with: python train.py --resume {run_dir}" if last else
            f"start the run again ({run_dir} holds no checkpoint: delete it)")
    line = f"train.py: stopped by Ctrl-C at {where}; {saved}; {then}"
    print(line, file=sys.stderr)
    if rank_and_world()[0] == 0:                                         # the log says how the run ended, too
        with open(run_dir / "log.txt", "a") as f:
            f.write(line + "\n")
    raise SystemExit(130)


def write_results(run_dir, results):
    """results.json (rank 0) and the last log line."""
    if rank_and_world()[0] == 0:
        (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    seconds = results["wall_time_s"]
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items() if k != "total")
    log(run_dir, f"done in {seconds['total'] / 60:.1f} min ({phases}): {run_dir}",
        {"phase": "done", "wall_time_s": seconds})


# ---- checkpoints and resume ---------------------------------------------------------------------------------------

def save_checkpoint(path, state):
    """Write a plain dict atomically (temporary file, then os.replace): a kill mid-write leaves the old file intact."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def read_checkpoint(path, device="cpu"):
    """torch.load of a train.py checkpoint; ValueError (one line) if the file is empty, truncated or not one."""
    try:
        ck = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:                                               # truncated, empty, garbage, not plain data
        raise ValueError(f"{path} is damaged or not a train.py checkpoint ({type(e).__name__})") from None
    if not isinstance(ck, dict) or not {"model", "config", "model_name", "task"} <= set(ck):
        raise ValueError(f"{path} is not a train.py checkpoint (no model/config/model_name/task entries)")
    return ck


def training_state(model, opt, sched, gens, device, scaler=None):
    """What --resume needs beyond the phase's progress: weights, optimiser, schedule, fp16 scaler and every RNG."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "scaler": scaler.state_dict() if scaler else None, "device_type": device.type,
            "rng": {"torch": torch.get_rng_state(), "cuda": cuda, **{k: g.get_state() for k, g in gens.items()}}}


def restore_training_state(ck, model, opt, sched, gens, device, scaler=None):
    """Inverse of training_state: continue exactly where the checkpoint `ck` (a last.pt) stopped."""
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    if scaler is not None and ck.get("scaler"):
        scaler.load_state_dict(ck["scaler"])
    torch.set_rng_state(ck["rng"]["torch"])
    if device.type == "cuda" and ck["rng"]["cuda"] is not None:     # this GPU's only: the GPU count may change
        torch.cuda.set_rng_state(ck["rng"]["cuda"], device)
    for k, g in gens.items():
        g.set_state(ck["rng"][k])


def ck_args(folder):
    """The settings a run folder's config.json records (empty if it has none)."""
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()).get("args", {}) if path.is_file() else {}


RESUME_MAY_CHANGE = {"resume", "device", "workers"}    # settings a resumed run may take from the new command line


def resume_settings(args, given, defaults):
    """--resume DIR: (the run's own settings, its last.pt, the folder's lock, held from here on, so that what is
    checked here stays true), or exits: finished run (status 0, results.json untouched), no or damaged last.pt,
    flags that would change the run, a folder in use (status 2)."""
    folder = Path(args.resume)
    if not folder.is_dir():
        fail(f"--resume {folder}: no such run folder")
    finished = lambda: (folder / "results.json").is_file()
    lock = None if finished() else hold_lock(folder)                    # then nothing can finish it behind our back
    try:
        return resume_checks(args, given, defaults, folder, finished) + (lock,)
    except BaseException:                                                # refused: give the folder back at once
        release_lock(lock)
        raise


def resume_checks(args, given, defaults, folder, finished):
    """The checks of resume_settings, under the folder's lock -> (the run's own settings, its last.pt)."""
    if finished():
        print(f"train.py: {folder} has finished (results.json is there); nothing to resume, nothing changed")
        raise SystemExit(0)
    if not (folder / "last.pt").is_file():
        fail(f"--resume {folder}: no last.pt in that folder (a run writes it at its first evaluation)")
    saved_args = ck_args(folder)
    changed = sorted(k for k in given - RESUME_MAY_CHANGE if saved_args.get(k, defaults.get(k)) != getattr(args, k))
    if changed:
        flags = ", ".join("--" + k.replace("_", "-") for k in changed)
        fail(f"--resume continues a run with its own settings; {flags} "
             f"cannot change (only --device, --workers); start a new run, e.g. with --init-from {folder}/spt.pt")
    try:
        ck = read_checkpoint(folder / "last.pt")
    except ValueError as e:
        usable = []
        for name in ("best.pt", "spt.pt"):
            with contextlib.suppress(ValueError, FileNotFoundError):
                other = read_checkpoint(folder / name)
                usable.append(f"{name} ({other['phase']} epoch {other['epoch']})")
        hint = f"still readable: {', '.join(usable)}" if usable else "no other readable checkpoint there"
        fail(f"--resume: {e}; {hint}; start again (an spt.pt can seed a new run: --init-from {folder}/spt.pt)")
    if ck.get("device_type", "cpu") != (torch.device(args.device).type if args.device else
                                        ("cuda" if torch.cuda.is_available() else "cpu")):
        fail(f"--resume {folder}: it ran on {ck.get('device_type', 'cpu')}; resume it there (its mask generator "
             f"and RNG states belong to that device type; --device may pick another device of that type)")
    saved = {**defaults, **ck["args"]}                          # flags newer than the checkpoint: their defaults
    saved["pretrain_batch_size"] = saved.get("pretrain_batch_size") or saved["batch_size"]
    return argparse.Namespace(**{**saved, **{k: getattr(args, k) for k in RESUME_MAY_CHANGE}}), ck


@contextlib.contextmanager
def run_folder(args, meta, lines, lock=None):
    """Hold the run folder for the block: a new runs/<task>-<model>-<spt|init|tfs>-s<seed>-<time>/ with config.json
    (DDP: rank 0 names and creates it, all use it), or the --resume folder, whose `lock` resume_settings took. Rank 0
    holds its lock for the whole block, so a second train.py on one folder stops in one line before writing anything;
    then log.txt gets `lines`."""
    rank, world = rank_and_world()
    if args.resume:
        folder = Path(args.resume)
    else:
        kind = "spt" if args.spt else ("init" if args.init_from else "tfs")
        folder = Path(args.out) / f"{args.task}-{args.model}-{kind}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        suffix = 1
        while folder.exists():                                           # two runs started in the same second
            folder, suffix = folder.with_name(folder.name.rsplit("+", 1)[0] + f"+{suffix}"), suffix + 1
        if world > 1:                                                    # the processes' clocks may be a second apart
            shared = [folder]
            dist.broadcast_object_list(shared, src=0)
            folder = shared[0]
    if rank == 0 and not args.resume:
        try:
            folder.mkdir(parents=True)
        except OSError as e:                                             # read-only file system, no permission, ...
            fail(f"--out {args.out}: cannot create the run folder there ({e.strerror}); pass a writable folder")
        lock = hold_lock(folder)
        (folder / "config.json").write_text(json.dumps(meta, indent=2))
    try:
        for line in lines:
            log(folder, line)
        yield folder
    finally:
        release_lock(lock)                                       # a run's own lock goes with the run
