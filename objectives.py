"""objectives.py: the self pre-training objectives train.py can use, one entry each.
entry:   Objective(prepare, flags, doc, model, loss, metrics, backbone, refuse): everything an
         objective is, in one place: its corruption (a function of denoise.py), its own flags
         (defaults, range checks, help), its one-line description, the SPT model it trains around
         the backbone (default: a per-position denoising head; rtd: ELECTRA's generator and
         discriminator), its loss and metrics, how its pre-trained weights become the fine-tuning
         backbone, and the check that refuses a run it cannot serve
flags:   an entry's flags reach its functions as keyword arguments: each function names the ones
         it reads (Objective.bound), never the run's whole settings
derived: --objective's choices and each objective's flags (train.parse_flags), the notes on flags
         that act only with --spt or with another objective, the start-up line, results.json's
         spt_objective and the tests' lists all read OBJECTIVES, so a new objective is its function
         and one entry here (docs/fork.md)
Check: tests/test_fork.py (an objective with a model of its own added as one entry),
tests/test_denoise.py.
"""
import argparse
import inspect
import math
from functools import partial
from typing import Callable, NamedTuple

import torch

import torch.nn as nn

import denoise
import lra_data
from tools.checked import at_least, in_range


class Denoiser(nn.Module):
    """backbone -> per-position denoising head D -> V (ids), 256 (grey levels) or 1 (Image values),
    at every position (the loss weights pick the masked ones: gathering them first would read the
    mask's size back from the device). forward(x_in, lengths) -> predictions (B, L, V)."""

    def __init__(self, backbone, d_model, n_out):
        super().__init__()
        self.backbone = backbone
        self.denoise_head = nn.Linear(d_model, n_out)

    def forward(self, x, lengths=None):
        return self.denoise_head(self.backbone(x, lengths))             # (B, L, D) -> (B, L, V)


def n_outputs(task):
    """Width of the denoising head: V token ids, 256 grey levels (Pathfinder/PathX), or 1 normalised
    value (Image)."""
    spec = lra_data.TASKS[task]
    return spec.vocab_size if spec.kind == "tokens" else (1 if task == "image" else 256)


class Flag(NamedTuple):
    default: object
    type: Callable | None       # argparse type: parses, checks the range (one line if it is not)
    help: str
    action: object = None       # e.g. argparse.BooleanOptionalAction (type is then None)
    derive: Callable | None = None   # run -> the value when the flag is left unset (default None)


class Run(NamedTuple):
    """What an objective may ask of the run it serves (train.settle makes it)."""
    task: str                   # an lra_data.TASKS name
    causal: bool                # --causal: the backbone sees only the past
    config: Callable            # (**changes) -> the backbone config with those fields changed;
                                # ValueError (one line) when the model cannot be built so
    build: Callable             # backbone config -> backbone (the MODELS entry's build)


def denoiser(backbone, run):
    """The default SPT model: the backbone + a per-position denoising head (Denoiser)."""
    return Denoiser(backbone, run.config().d_model, n_outputs(run.task))


def no_reason(run):
    """Every run can use this objective."""
    return None


def as_saved(state):
    """The SPT model's state_dict already holds the backbone under backbone.*: nothing to fold."""
    return state


class Objective(NamedTuple):
    prepare: Callable           # (denoise.Clean, gen, progress 0..1, **flags) -> denoise.Batch
    flags: dict                 # its own flags, name -> Flag; results.json records their values
    doc: str                    # one line, for --help and the start-up lines
    model: Callable = denoiser  # (backbone, run, **flags) -> the SPT model around the backbone
    loss: Callable = denoise.batch_loss  # (model, batch, rows, scale) -> (loss, statistics)
    metrics: Callable = denoise.metrics  # summed statistics -> {"loss": ..., ...}
    backbone: Callable = as_saved   # the SPT model's state_dict -> backbone.* keys to fine-tune
    refuse: Callable = no_reason    # (run, **flags) -> why this run cannot use it, or None

    def bound(self, name, flags):
        """The entry's function `name` ("prepare", "model", ...) with the flags it names as
        parameters bound as keyword arguments (functools.partial)."""
        fn = getattr(self, name)
        params = inspect.signature(fn).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):      # **flags: every one
            return partial(fn, **flags)
        return partial(fn, **{k: v for k, v in flags.items() if k in params})


# ---- replaced-token detection: ELECTRA's two models around the backbone --------------------------

def rtd_model(backbone, run, gen_width, gen_layers, gdes):
    """ELECTRA's generator (the backbone's family at gen_width × gen_layers) and discriminator
    (the backbone, fine-tuned later), denoise.ReplacedTokenDetection. Pixels: the generator
    samples grey levels, which the discriminator reads at their normalised value."""
    generator = run.build(run.config(d_model=gen_width, n_layers=gen_layers))
    tokens = lra_data.TASKS[run.task].kind == "tokens"
    grey = torch.arange(256, dtype=torch.uint8)[None]                     # (1, 256) raw levels
    levels = None if tokens else lra_data.clean_input(grey, run.task)[0][0]  # (256,) as read
    exclude = (lra_data.PAD, lra_data.MASK) if tokens else ()
    return denoise.ReplacedTokenDetection(backbone, generator, run.config().d_model, gen_width,
                                          gdes, levels, exclude_ids=exclude)


def rtd_refuse(run, gen_width, gen_layers):
    """No replacements to sample for Image's L1 targets; a generator the model cannot build."""
    if run.task == "image":
        return ("--objective rtd samples replacements from a distribution, and Image's L1 targets "
                "have none: use masked or span")
    try:
        run.config(d_model=gen_width, n_layers=gen_layers)
    except ValueError as e:
        return (f"the rtd generator: {e} (set by --gen-width {gen_width}, --gen-layers "
                f"{gen_layers}, or the preset)")
    return None


def gen_width(run):
    """ELECTRA's generator width: the widest the model accepts at most 1/4 of the backbone's
    (Transformer: a multiple of 2·n_heads), else the narrowest above; None while the backbone's
    own config is impossible (its check says why)."""
    try:
        d_model = run.config().d_model
    except ValueError:
        return None
    widths = [*range(max(1, d_model // 4), 0, -1), *range(d_model // 4 + 1, d_model + 1)]
    for width in widths:
        try:
            run.config(d_model=width)
            return width
        except ValueError:
            continue
    return max(1, d_model // 4)


def needs_causal(run):
    """--objective causal needs a causal model."""
    return None if run.causal else ("--objective causal trains next-token prediction, which a "
                                    "bidirectional model solves by looking ahead: add --causal")


# ---- the entries ----------------------------------------------------------------------------------

MASK_RATIO = Flag(None, in_range(0, 1, open_low=True, open_high=True),
                  "share of positions masked (default: the task's; text 0.15, pixels 0.5)",
                  derive=lambda run: lra_data.TASKS[run.task].mask_ratio)
OBJECTIVES = {                  # the first entry is --objective's default
    "masked": Objective(denoise.masked_batch, {"mask_ratio": MASK_RATIO},
                        "masked denoising, the paper's"),
    "span": Objective(denoise.span_batch, {"mask_ratio": MASK_RATIO, "span_mean": Flag(
        3.0, in_range(1, 10), "mean span length (geometric, at most 10)")},
        "span masking (SpanBERT)"),
    "causal": Objective(denoise.causal_batch, {}, "next token (causal LM), with --causal",
                        refuse=needs_causal),
    "rtd": Objective(denoise.rtd_batch, {
        "mask_ratio": MASK_RATIO,
        "gen_width": Flag(None, at_least(1), "the generator's width (default: d_model / 4)",
                          derive=gen_width),
        "gen_layers": Flag(1, at_least(1), "the generator's layers"),
        "rtd_weight": Flag(denoise.RTD_WEIGHT, in_range(0, math.inf, open_low=True),
                           "λ in L_gen + λ·L_disc"),
        "gdes": Flag(True, None, "discriminator reads sg(E) + its own part (DeBERTaV3); "
                     "--no-gdes: E (ELECTRA)", argparse.BooleanOptionalAction)},
        "replaced-token detection (ELECTRA)", model=rtd_model, loss=denoise.rtd_batch_loss,
        metrics=denoise.rtd_metrics, backbone=denoise.discriminator_backbone, refuse=rtd_refuse),
}
BUILT_IN = dict(OBJECTIVES)     # a fork adds names; one that reassigns these is refused (models.check_entries)


def batch_functions(phase, task, objective=None, flags=None):
    """(prepare, loss, metrics) of a phase's batches, the one batch path: "spt": objective's corruption (bound to its
    flags, a dict), its loss and metrics; "finetune": the clean input with the labels (denoise.labelled), the one
    loss and its metrics. train.py's step and the memory plan (lab/memory.py) both take them from here."""
    if phase == "spt":
        entry = OBJECTIVES[objective]
        return entry.bound("prepare", flags), entry.loss, entry.metrics
    return partial(denoise.labelled, pair=lra_data.TASKS[task].pair), denoise.batch_loss, denoise.metrics


def fill_defaults(args, run):
    """Every objective flag left unset (None) that its Flag derives from the run (the task's mask
    ratio, the generator's width) gets that value in args."""
    for entry in OBJECTIVES.values():
        for name, flag in entry.flags.items():
            if flag.derive is not None and getattr(args, name) is None:
                setattr(args, name, flag.derive(run))


def spt_head(name, flags):
    """The checkpoint's description of an SPT model: which objective, with which flag values
    (models.build_model rebuilds it from that)."""
    return dict(kind="spt", objective=name, flags=dict(flags))


def backbone_state(ck):
    """The backbone.* weights a checkpoint dict hands to fine-tuning: an SPT checkpoint's through
    its objective's `backbone` (rtd: the discriminator, its GDES table folded), any other's as
    saved."""
    head = ck["head"]
    return (OBJECTIVES[head["objective"]].backbone(ck["model"]) if head["kind"] == "spt"
            else ck["model"])


def spt_model(backbone, head, run):
    """The SPT model of checkpoint head `head` (spt_head) around `backbone`."""
    return OBJECTIVES[head["objective"]].bound("model", head["flags"])(backbone, run)
