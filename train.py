"""train.py: self pre-training (SPT), then fine-tuning, on the Long Range Arena (Amos, Berant & Gupta, ICLR 2024).
phase 1 (--spt):  backbone + denoising head learn to restore masked (or next) inputs of the task's own train split
phase 2:          the same backbone + a fresh pooled classifier learn the labels; without --spt it starts from
                  random init ("trained from scratch", TFS). Test accuracy: the best-validation checkpoint's.
    python train.py --model dlr --task pathfinder --spt --preset tiny     # the quick start (a minute or two on a CPU)
    python train.py --model dlr --task pathx --spt                        # paper preset on a GPU, tiny on a CPU
    python train.py --resume runs/<run folder>                            # continue a stopped run exactly
    torchrun --nproc_per_node=4 train.py --model s4 --task pathx --spt    # DDP: --batch-size stays the global batch
Reading order: the knobs first (MODELS, OBJECTIVES, parse_flags: every flag once, with its default and range), then
the loop, then main() at the bottom, the run as named steps.
Check: tests/test_train.py, tests/test_robustness.py (DDP, resume, NaN guard, bad input), tests/test_fork.py.
"""
import argparse
import dataclasses
import gc
import math
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

# Before torch starts OpenMP: spinning threads wait a whole time slice for a descheduled partner in every parallel
# region, which makes small runs on a shared CPU several times slower. Export OMP_WAIT_POLICY to change it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import denoise  # noqa: E402
import dlr  # noqa: E402
import heads  # noqa: E402
import lra_data  # noqa: E402
import presets  # noqa: E402
import runs  # noqa: E402
import s4  # noqa: E402
import steps  # noqa: E402
import transformer  # noqa: E402
from runs import at_least, fail, in_range, log  # noqa: E402


# ---- the models: one entry each ------------------------------------------------------------------------------------

class Model(NamedTuple):
    Config: type                    # the model file's config dataclass; its fields are what presets and flags set
    build: Callable                 # Config -> backbone: forward(x, lengths) -> (B, L, D) features
    ssm_params: set                 # leaf names of parameters with their own lr (ssm_lr) and no weight decay
    paper: Callable | None          # (task, spt) -> (values, sources) of --preset paper; None: the paper has none


MODELS = {
    "transformer": Model(transformer.TransformerConfig, transformer.Transformer, transformer.SSM_PARAMS,
                         presets.transformer_paper),
    "s4": Model(s4.S4Config, s4.S4, s4.SSM_PARAMS, presets.s4_paper),
    "dlr": Model(dlr.DLRConfig, dlr.DLR, dlr.SSM_PARAMS, presets.dlr_paper),
}


# ---- the self pre-training objectives: one entry each --------------------------------------------------------------

class Flag(NamedTuple):
    default: object
    type: Callable | None           # argparse type: parses and range-checks, one line at parse time if out of range
    help: str
    action: object = None           # e.g. argparse.BooleanOptionalAction (then type is None)


class Objective(NamedTuple):
    prepare: Callable               # (denoise.Clean, args, gen, progress 0..1) -> denoise.Batch
    flags: dict                     # its own flags, name -> Flag; results.json records their values
    doc: str                        # one line: --help and the start-up lines
    head: str = "denoise"           # "denoise": a per-position head; "rtd": ELECTRA's generator + discriminator
    refuse: Callable = lambda args: None     # args -> why this run cannot use it (one line), or None


MASK_RATIO = Flag(None, in_range(0, 1, open_low=True, open_high=True), "share of positions masked (default: the "
                  "task's, ListOps 0.10, Text and Retrieval 0.15, pixels 0.50)")
OBJECTIVES = {
    "masked": Objective(denoise.masked, {"mask_ratio": MASK_RATIO}, "masked denoising, the paper's"),
    "span": Objective(denoise.span, {"mask_ratio": MASK_RATIO, "span_mean": Flag(
        3.0, in_range(1, 10), "mean span length (geometric, clipped at 10)")}, "span masking (SpanBERT)"),
    "causal": Objective(denoise.causal, {}, "next token (causal LM), with --causal", refuse=lambda args: None
                        if args.causal else "--objective causal trains next-token prediction, which a "
                        "bidirectional model solves by looking ahead: add --causal, or use another --objective"),
    "rtd": Objective(denoise.rtd, {
        "mask_ratio": MASK_RATIO,
        "gen_width": Flag(None, at_least(1), "the generator's width (default: d_model / 4)"),
        "gen_layers": Flag(1, at_least(1), "the generator's layers"),
        "rtd_weight": Flag(denoise.RTD_WEIGHT, in_range(0, math.inf, open_low=True), "λ in L_gen + λ·L_disc"),
        "gdes": Flag(True, None, "the discriminator reads sg(E) + its own residual (DeBERTaV3); --no-gdes: E itself "
                     "(ELECTRA)", argparse.BooleanOptionalAction)},
        "replaced-token detection (ELECTRA)", head="rtd", refuse=lambda args: None if args.task != "image" else
        "--objective rtd samples replacements from a distribution, and Image's L1 targets (normalised values) have "
        "none: use --objective masked or span on image"),
}


# ---- every flag, once ---------------------------------------------------------------------------------------------

def parse_flags(argv):
    """The command line -> (args, names of the flags given explicitly, every flag's default). A flag out of range
    stops here with one line (its type checks it); None defaults are filled by the preset (presets.apply)."""
    p = argparse.ArgumentParser(description="Self pre-training (SPT) and fine-tuning on the Long Range Arena.")
    flag, count, rate = p.add_argument, at_least(0), in_range(0, math.inf, open_low=True)
    flag("--model", choices=MODELS, default="dlr", help=", ".join(MODELS))
    flag("--task", choices=lra_data.TASKS, default="pathfinder", help=", ".join(lra_data.TASKS))
    flag("--spt", action="store_true", help="self pre-train by denoising on the train split, then fine-tune")
    flag("--objective", choices=OBJECTIVES, default="masked", help="; ".join(f"{k}: {o.doc}"
                                                                          for k, o in OBJECTIVES.items()))
    for name, f in {n: f for o in OBJECTIVES.values() for n, f in o.flags.items()}.items():
        users = ", ".join(k for k, o in OBJECTIVES.items() if name in o.flags)
        flag("--" + name.replace("_", "-"), default=f.default, help=f"{users}: {f.help}",
             **({"action": f.action} if f.action else {"type": f.type}))
    flag("--causal", action="store_true", help="causal Transformer / unidirectional S4 and DLR (LayerNorm)")
    flag("--preset", choices=["tiny", "small", "paper"], default=None, help="sizes and budget (default: paper "
         "with CUDA, else tiny)")
    flag("--epochs", type=at_least(1), default=None, help="fine-tuning epochs (default: preset)")
    flag("--pretrain-epochs", type=at_least(1), default=None, help="SPT epochs (default: preset)")
    flag("--eval-every", type=at_least(1), default=1, help="evaluate and checkpoint every this many epochs and "
         "after the last")
    flag("--max-steps", type=count, default=0, help="stop each phase after this many steps (0: no limit)")
    flag("--batch-size", type=at_least(1), default=None, help="fine-tuning examples per step, all processes "
         "(default: preset)")
    flag("--pretrain-batch-size", type=at_least(1), default=None, help="SPT examples per step (default: the "
         "preset's; CPU presets: --batch-size)")
    flag("--accum-steps", type=at_least(1), default=None, help="fine-tuning micro-batches per step: the same "
         "update in less memory (default: preset)")
    flag("--pretrain-accum-steps", type=at_least(1), default=None, help="SPT micro-batches per step (default: "
         "preset)")
    flag("--lr", type=rate, default=None, help="fine-tuning learning rate (default: preset)")
    flag("--pretrain-lr", type=rate, default=None, help="SPT learning rate (default: preset)")
    flag("--ssm-lr", type=rate, default=None, help="lr of the SSM parameters, no weight decay (default: config's)")
    flag("--weight-decay", type=in_range(0, math.inf), default=None, help="AdamW weight decay (default: preset)")
    flag("--warmup", type=count, default=None, help="linear warm-up steps (default: preset)")
    flag("--schedule", choices=["constant", "cosine"], default="constant", help="lr after warm-up")
    flag("--d-model", type=at_least(1), default=None, help="model width D (default: preset)")
    flag("--n-layers", type=at_least(1), default=None, help="number of layers (default: preset)")
    flag("--d-state", type=at_least(1), default=None, help="SSM state size N (default: preset)")
    flag("--dropout", type=in_range(0, 1, open_high=True), default=None, help="dropout (default: preset)")
    flag("--pool", choices=["mean", "max", "last"], default=None, help="pooling over real positions (default: "
         "the task's)")
    flag("--data-dir", default="data", help="the LRA release, IMDB or CIFAR files; synthetic tasks generated here")
    flag("--cache-dir", default=None, help="prepared arrays (default: <data-dir>/cache if writable, else "
         "./data/cache)")
    flag("--difficulty", choices=["easy", "intermediate", "hard"], default="hard", help="Pathfinder/PathX contour "
         "length 6, 9 or 14")
    flag("--generate", type=at_least(0), default=None, help="examples to generate when ListOps/Pathfinder/PathX "
         "files are absent, 0: never (default: preset)")
    flag("--data-fraction", type=in_range(0, 1, open_low=True), default=1.0, help="use this fraction of the train "
         "split (nested prefixes of one permutation)")
    flag("--lra-val", action="store_true", help="text, image: validate on the test set and train on all of train, "
         "as LRA did (default: a validation split carved from train)")
    flag("--max-len", type=at_least(2), default=None, help="text, retrieval: cut each document to this many "
         "tokens, EOS included (default: LRA's 4096 / 4001 = 4000 bytes + EOS)")
    flag("--max-train", type=count, default=None, help="at most this many training examples, 0: all (default: "
         "preset)")
    flag("--max-eval", type=count, default=None, help="at most this many val and test examples, 0: all (default: "
         "preset)")
    flag("--workers", type=count, default=None, help="DataLoader worker processes (default: 0 on CPU; on CUDA 8, "
         "or the CPU cores per process if fewer)")
    flag("--seed", type=int, default=0, help="seed of the model init; batch order and masks use seed+1, seed+2")
    flag("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    flag("--precision", choices=["fp32", "tf32", "bf16", "fp16"], default=None, help="autocast dtype; the SSM "
         "kernels stay fp32 (default: bf16 on CUDA compute capability >= 8, fp16 + scaler below, fp32 on CPU)")
    flag("--amp", action="store_true", help="old name of --precision bf16")
    flag("--compile", action="store_true", help="torch.compile the model (checkpoints keep plain keys)")
    flag("--out", default="runs", help="parent folder of the run folder")
    flag("--init-from", default=None, help="fine-tune from the backbone of this checkpoint (e.g. a run's spt.pt)")
    flag("--resume", default=None, help="continue the stopped run in this folder from its last.pt, own settings")
    p.error = lambda message: fail(f"{runs.flag_message(message)} (python train.py --help lists the flags)")
    args = p.parse_args(argv)
    return args, {k for k, v in vars(args).items() if v != p.get_default(k)}, vars(p.parse_args([]))


# ---- presets, model configs, the models of checkpoints ------------------------------------------------------------

def preset_values(preset, model, task, spt):
    """Every setting `preset` decides for (model, task), with or without SPT (presets.preset_values)."""
    return presets.preset_values(preset, model, MODELS[model], task, spt)


def model_config(model, task, values, causal=False):
    """The backbone config of `model` for `task` from preset values and flags (presets.model_config)."""
    return presets.model_config(MODELS[model].Config, task, values, causal)


def build_model(ck):
    """The model a checkpoint dict (or a run's meta) describes: heads.build_model with its MODELS entry."""
    return heads.build_model(ck, MODELS[ck["model_name"]])


def load_model(path, device="cpu"):
    """Load a checkpoint written by train.py: returns (model in eval mode, the checkpoint dict)."""
    ck = runs.read_checkpoint(path, device)
    model = build_model(ck).to(device)
    model.load_state_dict(ck["model"])
    return model.eval(), ck


# ---- one training phase ------------------------------------------------------------------------------------------

def param_groups(model, lr, wd, ssm_lr, ssm_names):
    """AdamW groups: SSM parameters (leaf name in ssm_names) get ssm_lr and no weight decay (with the global lr and
    decay S4 loses much accuracy: S4 §4); norms, biases and embeddings get no weight decay; the rest gets wd.
    Every parameter lands in exactly one group (tests/test_train.py). Prints the group sizes."""
    decay, no_decay, ssm, seen = [], [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if name in ssm_names:
                ssm.append(p)
            elif name == "bias" or isinstance(module, nn.Embedding) or "Norm" in type(module).__name__:
                no_decay.append(p)  # LayerNorm, BatchNorm*, RMSNorm, GroupNorm, ... by class name
            else:
                decay.append(p)
    size = lambda ps: sum(p.numel() for p in ps)  # noqa: E731
    print(f"param groups: decay {size(decay):,} (lr {lr:.1e}, wd {wd}) | no-decay {size(no_decay):,} (norms, "
          f"biases, embeddings) | ssm {size(ssm):,} (lr {ssm_lr:.1e}, wd 0)")
    groups = [dict(params=decay, lr=lr, weight_decay=wd), dict(params=no_decay, lr=lr, weight_decay=0.0),
              dict(params=ssm, lr=ssm_lr, weight_decay=0.0)]
    return [g for g in groups if g["params"]]


def lr_factor(step, warmup, total, schedule):
    """Multiplier of every group's lr: linear warm-up over `warmup` steps, then constant (the paper's) or cosine."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return 1.0


class Phase(NamedTuple):
    name: str                   # "spt" or "finetune"
    epochs: int
    lr: float
    batch_size: int
    accum_steps: int            # micro-batches per step: the same update in 1/accum_steps of the activation memory
    best_file: str              # spt.pt or best.pt: the checkpoint kept for the next phase / the test
    select: str                 # the validation metric that picks it: "loss" (SPT) or "acc" (fine-tuning)
    prepare: Callable           # (collated batch, gen, progress) -> denoise.Batch


def run_phase(phase, model, run, splits, resume=None):
    """Train for phase.epochs epochs; after every --eval-every-th epoch and the last, evaluate on val and write two
    checkpoints: the best so far (phase.best_file) and last.pt, the state to continue from. run: runs.Run (args,
    device, folder, meta); resume: a last.pt of this phase, continued after its epoch exactly as if never stopped.
    Returns {"metric", "best", "epoch", "val", "steps", "seconds"}."""
    args, start, (rank, world) = run.args, time.time(), steps.rank_and_world()
    state = steps.Training(model, phase, args, run.device, len(splits["train"]))
    state.forward = DDP(model, device_ids=[run.device] if run.device.type == "cuda" else None) if world > 1 else model
    state.forward = torch.compile(state.forward) if args.compile else state.forward   # save `model`: plain keys
    state.optimizer(param_groups(model, phase.lr, args.weight_decay, run.meta["config"].get("ssm_lr", phase.lr),
                                 MODELS[args.model].ssm_params), partial(lr_factor, warmup=args.warmup,
                                                                          schedule=args.schedule))
    best = {"name": f"val_{phase.select}", "value": None, "epoch": 0, "val": {}}
    done, before = 0, 0.0
    if resume is not None:
        state.restore(resume)
        best, done, before = resume["best"], resume["epoch"], resume["seconds"]
    batches = steps.loader(splits["train"], phase.batch_size, args, run.device, order=state.gens["order"])
    val_batches = steps.loader(splits["val"], phase.batch_size, args, run.device)
    since_eval = {}                                                      # training statistics since the last evaluation
    for epoch in range(done + 1, phase.epochs + 1):
        if state.step >= state.total:
            break
        if rank > 0:                        # own dropout masks per process; rank 0's RNG is the one checkpointed
            torch.manual_seed(args.seed + 1000 * rank + epoch)
        since_eval = heads.add(since_eval, train_epoch(state, batches, f"{phase.name} {epoch}/{phase.epochs}"))
        if epoch % args.eval_every and epoch < phase.epochs and state.step < state.total:
            continue                                                     # evaluate every k-th epoch and the last
        with runs.stopping_at(f"{phase.name} epoch {epoch}/{phase.epochs}, evaluation"):
            val = evaluate(state.forward, phase.prepare, val_batches, args.seed + 3, state.amp)
        score = (lambda r: -r["loss"]) if phase.select == "loss" else (lambda r: r["acc"])  # noqa: E731
        improved = best["epoch"] == 0 or score(val) > score(best["val"])
        if improved:
            best = {"name": f"val_{phase.select}", "value": val[phase.select], "epoch": epoch, "val": val}
        seconds = before + time.time() - start
        saved = {**run.meta, **state.saved(), "phase": phase.name, "epoch": epoch, "best": best, "seconds": seconds}
        runs.save_phase_checkpoints(run.folder, phase.best_file if improved else None, saved)
        train = heads.metrics(steps.all_sum(since_eval))
        runs.log_evaluation(run.folder, phase, epoch, state.step, state.opt.param_groups[0]["lr"],
                            dict(train=train, val=val, improved=improved, seconds=seconds))
        since_eval = {}
    if world > 1:
        dist.barrier()                                                   # the others read spt.pt / best.pt next
    return {"metric": best["name"], "best": best["value"], "epoch": best["epoch"], "val": best["val"],
            "steps": state.step, "seconds": before + time.time() - start}


def train_epoch(state, batches, desc):
    """One pass over `batches`, each step as in nanoGPT: the global batch to the device, forward and backward over
    accum_steps micro-batches of this process's rows (DDP syncs gradients on the last one only), the guarded
    optimiser step (steps.guard_step), the schedule. Device values are read once per steps.PROGRESS_STEPS steps.
    Returns the training statistics of this process. A stop (Ctrl-C, SIGTERM) is re-raised naming where it hit."""
    (rank, world), phase = steps.rank_and_world(), state.phase
    bar = steps.progress_bar(batches, desc, disable=rank > 0)
    train = {}
    with runs.stopping_at(lambda: f"{desc.replace(' ', ' epoch ', 1)}, step {state.step}"), bar:
        for batch in bar:
            b = phase.prepare(batch, state.gens["mask"], state.step / state.total)
            rows, keep = steps.shard(len(b.weight))                      # this process's examples of the batch
            parts = steps.micro_batches(rows, phase.accum_steps)
            bad_loss = torch.zeros((), dtype=torch.bool, device=state.device)
            for i, part in enumerate(parts):
                with state.no_sync(last=i == len(parts) - 1), state.amp():
                    loss, stats = heads.batch_loss(state.forward, b, part, world)   # DDP averages over processes
                (state.scaler.scale(loss * keep) if state.scaler else loss * keep).backward()
                train, bad_loss = heads.add(train, stats, keep), bad_loss | ~torch.isfinite(loss.detach())
            steps.guard_step(state, bad_loss)
            if state.step % steps.PROGRESS_STEPS == 0 or state.step >= state.total:
                steps.check_finite(state, phase.name)
                bar.set_postfix({k: f"{v:.4f}" for k, v in heads.metrics(train).items()})
            if state.step >= state.total:
                break
        steps.check_finite(state, phase.name)
    return train


@torch.no_grad()
def evaluate(model, prepare, loader, seed, amp, predictions=None):
    """Metrics over a whole split, summed on the device and read once; SPT masks come from a generator re-seeded
    every time, so epochs compare alike. DDP: each process scores its rows of every batch; the sums are added up.
    predictions: a list that gets this process's predicted classes, batch by batch (heads.batch_loss)."""
    model.eval()
    device = next(model.parameters()).device
    gen, total = torch.Generator(device).manual_seed(seed), {}
    for batch in loader:
        b = prepare(batch, gen, 1.0)
        rows, keep = steps.shard(len(b.weight))
        with amp():
            kept = predictions if keep else None                         # a DDP dummy row predicts nothing
            total = heads.add(total, heads.batch_loss(model, b, rows, predictions=kept)[1], keep)
    model.train()
    return heads.metrics(steps.all_sum(total))


# ---- the method: pre-train, fine-tune, test ------------------------------------------------------------------------

def spt_batch(batch, gen, progress, args, device):
    """A collated batch -> the objective's Batch: the task's clean tensors (heads.clean_batch), then its corruption."""
    return OBJECTIVES[args.objective].prepare(heads.clean_batch(batch, args.task, device), args, gen, progress)


def spt_head(args, cfg):
    """The checkpoint's description of the SPT model: a denoising head, or ELECTRA's generator and discriminator
    (the generator: the same family at --gen-width, --gen-layers)."""
    if OBJECTIVES[args.objective].head != "rtd":
        return dict(kind="denoise", n_out=heads.n_outputs(args.task))
    gen_cfg = dataclasses.replace(cfg, d_model=args.gen_width, n_layers=args.gen_layers)
    return dict(kind="rtd", n_out=heads.n_outputs(args.task), gen_config=dataclasses.asdict(gen_cfg), gdes=args.gdes)


def pretrain(run, cfg, splits, resume):
    """Phase 1: a fresh backbone + denoising head (rtd: + a small generator) on the training inputs; the best one by
    the objective's own validation loss is saved as spt.pt."""
    args = run.args
    torch.manual_seed(args.seed)
    spt = run.with_meta(head=spt_head(args, cfg))
    model = build_model(spt.meta).to(run.device)
    phase = Phase("spt", args.pretrain_epochs, args.pretrain_lr, args.pretrain_batch_size, args.pretrain_accum_steps,
                  "spt.pt", "loss", partial(spt_batch, args=args, device=run.device))
    return run_phase(phase, model, spt, splits, resume)


def load_pretrained(classifier, run, init_ck=None):
    """Copy the backbone of spt.pt (after --spt) or of --init-from (init_ck) into the classifier, strictly; say so."""
    path = run.folder / "spt.pt" if run.args.spt else Path(run.args.init_from)
    ck = init_ck or runs.read_checkpoint(path, run.device)
    state = ck["model"] if ck["head"]["kind"] != "rtd" else denoise.discriminator_backbone(ck["model"])
    try:
        _, new = heads.load_backbone(classifier, state)
    except RuntimeError as e:
        fail(f"loading the backbone of {path}: {str(e).splitlines()[0]}")
    dropped = sorted(k for k in ck["model"] if not k.startswith("backbone."))   # rtd: generator, both heads
    log(run.folder, f"loaded backbone from {path} ({ck['phase']} epoch {ck['epoch']}, {ck['best']['name']} "
        f"{ck['best']['value']:.4f}); new: {', '.join(new)}; dropped: {', '.join(dropped)}")


def run_both_phases(run, cfg, classifier, splits, resume, init_ck):
    """Pre-train (with --spt), fine-tune, test: the method. -> results (test_acc, best_val_acc, spt_val_metric, ...)."""
    args, seconds, spt = run.args, {}, None
    resuming_ft = resume is not None and resume["phase"] == "finetune"
    if args.spt:
        spt = resume["spt"] if resuming_ft else pretrain(run, cfg, splits, resume)
        seconds["spt"] = spt["seconds"]
    if (args.spt or args.init_from) and not resuming_ft:                # else last.pt holds the whole state
        load_pretrained(classifier, run, init_ck)
    prepare = partial(heads.finetune_inputs, task=args.task, device=run.device)
    phase = Phase("finetune", args.epochs, args.lr, args.batch_size, args.accum_steps, "best.pt", "acc", prepare)
    ft = run_phase(phase, classifier, run.with_meta(spt=spt), splits, resume if resuming_ft else None)
    seconds["finetune"], t_test = ft["seconds"], time.time()
    with runs.stopping_at("the test"):
        classifier.load_state_dict(runs.read_checkpoint(run.folder / "best.pt", run.device)["model"])
        test_batches = steps.loader(splits["test"], args.batch_size, args, run.device)
        predicted = []
        test = evaluate(classifier, prepare, test_batches, args.seed + 3, steps.precision(args, run.device)[1],
                        predicted)
        runs.write_predictions(run.folder, splits["test"], predicted)
    seconds["test"] = time.time() - t_test
    spt_text = " | SPT " + " ".join(f"val_{k} {v:.4f}" for k, v in spt["val"].items()) if spt else ""
    log(run.folder, f"test | acc {test['acc']:.4f} | loss {test['loss']:.4f} | best val_acc {ft['best']:.4f} "
        f"(epoch {ft['epoch']}){spt_text}", {"phase": "test", "test_acc": test["acc"], "test_loss": test["loss"]})
    objective = {k: getattr(args, k) for k in ["objective", *OBJECTIVES[args.objective].flags]} if args.spt else None
    spt_val = spt and {"name": spt["metric"], "value": spt["best"], "epoch": spt["epoch"], **spt["val"]}
    return {"test_acc": test["acc"], "test_loss": test["loss"], "best_val_acc": ft["best"], "best_epoch": ft["epoch"],
            "spt_val_metric": spt_val, "spt_objective": objective, "wall_time_s": seconds}


def main(argv=None):
    args, given, defaults = parse_flags(argv)
    runs.stop_on_sigterm()                                               # a scheduler's SIGTERM is a Ctrl-C
    resume = lock = None
    if args.resume:                                                      # the run's own settings, its last.pt, and
        args, resume, lock = runs.resume_settings(args, given, defaults)  # its lock, held until the run ends
    try:
        config_kw, notes = presets.apply(args, MODELS[args.model])       # preset first, then explicit flags win
        cfg = presets.check(args, config_kw, MODELS[args.model], OBJECTIVES[args.objective])   # before any write
    except ValueError as e:
        fail(str(e))
    spt_only = sorted(given & {"objective", "pretrain_epochs", "pretrain_lr", "pretrain_batch_size",
                               "pretrain_accum_steps", *(n for o in OBJECTIVES.values() for n in o.flags)})
    if spt_only and not args.spt:
        notes.append(f"note: {', '.join('--' + k.replace('_', '-') for k in spt_only)} only act with --spt: ignored")
    if resume:                                                           # the weights' own config, whatever the
        cfg = type(cfg)(**resume["config"])                              # presets say today
    runs.absolute_paths(args)                                            # a resume elsewhere finds the same files
    device, world = steps.setup_device(args)                              # also settles --precision and --workers
    start = time.time()
    with runs.stopped_in(), runs.stopping_at("preparing the data"):      # before any collective (DDP start-up)
        try:
            splits = lra_data.load_splits(args)
        except lra_data.DataError as e:
            fail(str(e))
    data_notes = list(dict.fromkeys(n for s in splits.values() for n in s.notes))    # each note once
    data = runs.Data(splits, splits["train"].source, data_notes, time.time() - start)
    device = steps.join_process_group(device, world)
    spec = lra_data.TASKS[args.task]
    head = dict(kind="classifier", n_classes=spec.n_classes, pool=args.pool, pair=spec.pair)
    meta = dict(model_name=args.model, task=args.task, config=dataclasses.asdict(cfg), head=head, args=vars(args))
    torch.manual_seed(args.seed)                                         # model init
    classifier = build_model(meta).to(device)
    init_ck = None
    if args.init_from and not resume:                                    # a bad checkpoint stops before the run folder
        try:
            init_ck = runs.read_checkpoint(args.init_from, device)
            heads.check_init_checkpoint(init_ck, args.model, args.task, meta["config"])
        except ValueError as e:
            fail(f"--init-from {args.init_from}: {e}")
    knobs = ", ".join(f"{k} {getattr(args, k)}" for k in OBJECTIVES[args.objective].flags)
    plan = (f"SPT {args.objective}{f' ({knobs})' if knobs else ''}, then fine-tune" if args.spt else f"fine-tune from {args.init_from}" if args.init_from else
            "from scratch (TFS)")
    lines = runs.startup_lines(args, "given" if "preset" in given or resume else "default", plan, notes, data,
                               classifier, meta)
    if resume:
        lines.insert(0, f"resuming after {resume['phase']} epoch {resume['epoch']} (step {resume['step']})")
    with runs.run_folder(args, runs.run_meta(meta, args, argv, data, device), lines, lock) as run:
        run = runs.Run(args, device, run, meta)
        log(run.folder, f"run folder: {run.folder}")
        with runs.stopped_in(run.folder):                                # a stop: one line, the --resume command
            results = run_both_phases(run, cfg, classifier, data.splits, resume, init_ck)
        results.update(params=sum(p.numel() for p in classifier.parameters()), n_train=len(data.splits["train"]),
                       data_source=data.source, data_notes=data.notes, preset=args.preset, device=str(device),
                       processes=world, machine=runs.machine(device), run_dir=str(run.folder))
        seconds = {"data": data.seconds, **results["wall_time_s"]}
        results["wall_time_s"] = {**seconds, "total": sum(seconds.values())}   # resumed: the phases' time before too
        runs.write_results(run.folder, results)
    if world > 1:  # free the DDP wrappers (reference cycles) first: else gloo threads can outlive the group and
        gc.collect()   # abort the exit (SIGABRT, "terminate called without an active exception")
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
