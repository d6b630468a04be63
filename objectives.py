"""objectives.py: the self pre-training objectives train.py can use, one entry each.
entry:   Objective(prepare, flags, doc, head, refuse): the corruption (a function of denoise.py),
         the objective's own flags with their defaults and range checks, its one-line description,
         the SPT model it trains ("denoise": backbone + per-position head; "rtd": ELECTRA's
         generator and discriminator) and the check that refuses a run it cannot serve
derived: --objective's choices and each objective's flags (train.parse_flags), the note on flags
         that act only with --spt, the start-up line, results.json's spt_objective and the tests'
         lists all read OBJECTIVES, so a new objective is its function and one entry here
         (docs/fork.md)
Check: tests/test_fork.py (an objective and a knob added as one entry each), tests/test_denoise.py.
"""
import argparse
import dataclasses
import math
from typing import Callable, NamedTuple

import denoise
import heads
from presets import at_least, in_range


class Flag(NamedTuple):
    default: object
    type: Callable | None       # argparse type: parses, checks the range (one line if it is not)
    help: str
    action: object = None       # e.g. argparse.BooleanOptionalAction (type is then None)


class Objective(NamedTuple):
    prepare: Callable           # (denoise.Clean, args, gen, progress 0..1) -> denoise.Batch
    flags: dict                 # its own flags, name -> Flag; results.json records their values
    doc: str                    # one line, for --help and the start-up lines
    head: str = "denoise"       # "denoise": per-position head; "rtd": ELECTRA's two models
    refuse: Callable = lambda args: None     # args -> why this run cannot use it, or None


def needs_causal(args):
    """--objective causal needs a causal model."""
    return None if args.causal else ("--objective causal trains next-token prediction, which a "
                                     "bidirectional model solves by looking ahead: add --causal")


def not_on_image(args):
    """--objective rtd samples replacements: none for Image's L1 targets."""
    return None if args.task != "image" else ("--objective rtd samples replacements from a "
                                              "distribution, and Image's L1 targets have none: "
                                              "use masked or span")


MASK_RATIO = Flag(None, in_range(0, 1, open_low=True, open_high=True),
                  "share of positions masked (default: the task's; text 0.15, pixels 0.5)")
OBJECTIVES = {
    "masked": Objective(denoise.masked, {"mask_ratio": MASK_RATIO},
                        "masked denoising, the paper's"),
    "span": Objective(denoise.span, {"mask_ratio": MASK_RATIO, "span_mean": Flag(
        3.0, in_range(1, 10), "mean span length (geometric, at most 10)")},
        "span masking (SpanBERT)"),
    "causal": Objective(denoise.causal, {}, "next token (causal LM), with --causal",
                        refuse=needs_causal),
    "rtd": Objective(denoise.rtd, {
        "mask_ratio": MASK_RATIO,
        "gen_width": Flag(None, at_least(1), "the generator's width (default: d_model / 4)"),
        "gen_layers": Flag(1, at_least(1), "the generator's layers"),
        "rtd_weight": Flag(denoise.RTD_WEIGHT, in_range(0, math.inf, open_low=True),
                           "λ in L_gen + λ·L_disc"),
        "gdes": Flag(True, None, "discriminator reads sg(E) + its own part (DeBERTaV3); "
                     "--no-gdes: E (ELECTRA)", argparse.BooleanOptionalAction)},
        "replaced-token detection (ELECTRA)", head="rtd", refuse=not_on_image),
}


def spt_batch(batch, gen, progress, args, device):
    """A collated batch -> the objective's denoise.Batch: the task's clean tensors on `device`, then
    the corruption, drawn from `gen`; progress (0..1, the phase's step / steps) lets it schedule."""
    clean = heads.clean_batch(batch, args.task, device)
    return OBJECTIVES[args.objective].prepare(clean, args, gen, progress)


def spt_head(args, cfg):
    """The checkpoint's description of the SPT model: a denoising head, or ELECTRA's generator (the
    same family at --gen-width × --gen-layers) and discriminator. cfg: the backbone's config."""
    if OBJECTIVES[args.objective].head != "rtd":
        return dict(kind="denoise", n_out=heads.n_outputs(args.task))
    gen_cfg = dataclasses.replace(cfg, d_model=args.gen_width, n_layers=args.gen_layers)
    return dict(kind="rtd", n_out=heads.n_outputs(args.task),
                gen_config=dataclasses.asdict(gen_cfg), gdes=args.gdes)


SPT_FLAGS = ("objective", "pretrain_epochs", "pretrain_lr", "pretrain_batch_size", "pretrain_accum_steps",
             "pretrain_patience")


def ignored_flags(args, given):
    """Notes naming the flags typed on the command line (`given`) that this run does not use: the
    SPT-only flags (SPT_FLAGS and every objective's own) without --spt, and with --spt the flags of
    objectives other than --objective. -> a list of at most one line."""
    dash = lambda k: "--" + k.replace("_", "-")  # noqa: E731
    own = {n for o in OBJECTIVES.values() for n in o.flags}
    if not args.spt:
        unused = sorted(given & {*SPT_FLAGS, *own})
        return [f"note: {', '.join(map(dash, unused))} only act{'s' * (len(unused) == 1)} with "
                f"--spt: ignored"] if unused else []
    unused = sorted(given & own - set(OBJECTIVES[args.objective].flags))
    users = lambda k: "/".join(n for n, o in OBJECTIVES.items() if k in o.flags)  # noqa: E731
    return [f"note: {', '.join(f'{dash(k)} (of --objective {users(k)})' for k in unused)} "
            f"not used by --objective {args.objective}: ignored"] if unused else []
