"""models.py: what train.py trains: a backbone (one MODELS entry each) with a head on top, and, for SPT, the
objective's model around it (one OBJECTIVES entry each). Flags, checks, presets and tests read both dicts, so a new
model is its file and one entry, a new objective its corruption and one entry (docs/fork.md).
entry:      Model(Config, build, ssm_params, paper): the config dataclass (each field a flag), Config -> backbone
            (forward(x, lengths) -> (B, L, D)), the parameters with their own lr, a fork's own --preset paper values
objective:  Objective(prepare, flags, doc, model, loss, metrics, backbone, refuse): its corruption (denoise.py), its
            own flags (passed by name to the functions that name them), the SPT model around the backbone (default:
            a denoising head; rtd: ELECTRA's pair), loss, metrics, the backbone hand-over, the runs it refuses
classifier: logits = W·pool(backbone(x)) over real positions (mean / max / last); Retrieval: [a, b, a−b, a·b] (LRA);
            pixels are read as [normalised value, mask indicator] (Amos et al. 2024, App. C)
Check: tests/test_fork.py, tests/test_train.py (pooling ignores pads, checkpoints reload), test_paper_presets.py.
"""
import argparse
import dataclasses
import inspect
import math
import re
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn as nn

import denoise
import dlr
import lra_data
import s4
import transformer
from tools import checked
from tools.checked import at_least, in_range


class Model(NamedTuple):
    Config: type                # the model file's config dataclass: presets and flags set it
    build: Callable             # Config -> backbone, forward(x, lengths) -> (B, L, D) features
    ssm_params: set             # leaf names of parameters with their own lr, no weight decay
    paper: Callable | None = None   # a fork's (task, spt) -> (values, sources) of --preset paper
                                    # (the paper's own models: lab/presets.PAPER)


MODELS = {
    "transformer": Model(transformer.TransformerConfig, transformer.Transformer, transformer.SSM_PARAMS),
    "s4": Model(s4.S4Config, s4.S4, s4.SSM_PARAMS),
    "dlr": Model(dlr.DLRConfig, dlr.DLR, dlr.SSM_PARAMS),
}
BUILT_IN = dict(MODELS)         # a fork adds names; one that reassigns these is refused (check_entries)


def check_entries(run_flags):
    """ValueError (one line) where a fork shadows a name: a MODELS entry of a built-in name that is not the built-in
    one (MODELS["dlr"] = ... silently replaces DLR), an OBJECTIVES entry likewise, or a model knob (a config field)
    whose flag is a run flag of train.py (run_flags: their names, e.g. "warmup"). MODELS stays a plain dict."""
    for table, built_in, kind in ((MODELS, BUILT_IN, "MODELS"), (OBJECTIVES, BUILT_IN_OBJECTIVES,
                                                                  "OBJECTIVES")):
        for name, entry in built_in.items():
            if table.get(name) is not entry:
                raise ValueError(f"{kind}[{name!r}] was replaced ({table.get(name)!r:.60}): the built-in {name} "
                                 f"keeps its name; give the new entry a name of its own, e.g. {kind}[{name + '2'!r}]")
    for name, (_, _, users) in knobs().items():
        if name in run_flags:
            raise ValueError(f"the {', '.join(users)} config field {name!r} has the name of train.py's run flag "
                             f"--{name.replace('_', '-')}: rename the field")


# ---- SPT objectives: what the backbone is pre-trained to do -------------------------------------------

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


class Backbone(NamedTuple):
    """What an objective may ask of the backbone it wraps (lab/presets.settle makes it from the flags)."""
    task: str                   # an lra_data.TASKS name
    causal: bool                # --causal: the backbone sees only the past
    config: Callable            # (**changes) -> the backbone config with those fields changed;
                                # ValueError (one line) when the model cannot be built so
    build: Callable             # backbone config -> backbone (the MODELS entry's build)


def denoiser(backbone, run):
    """The default SPT model: the backbone + a per-position denoising head (Denoiser)."""
    return Denoiser(backbone, run.config().d_model, n_outputs(run.task))


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
    refuse: Callable | None = None  # (run, **flags) -> why this run cannot use it, or None (None: every run can)

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
BUILT_IN_OBJECTIVES = dict(OBJECTIVES)   # likewise (check_entries)


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
    ratio, the generator's width) gets that value in args; then, with --spt, the objective's check:
    ValueError (one line) when it cannot serve this run (its entry's refuse)."""
    for entry in OBJECTIVES.values():
        for name, flag in entry.flags.items():
            if flag.derive is not None and getattr(args, name) is None:
                setattr(args, name, flag.derive(run))
    objective = OBJECTIVES[args.objective]
    if args.spt and objective.refuse and (why := objective.bound("refuse", {
            k: getattr(args, k) for k in objective.flags})(run)):
        raise ValueError(why)


def backbone_state(ck):
    """The backbone.* weights a checkpoint dict hands to fine-tuning: an SPT checkpoint's through
    its objective's `backbone` (rtd: the discriminator, its GDES table folded), any other's as
    saved."""
    head = ck["head"]
    return (OBJECTIVES[head["objective"]].backbone(ck["model"]) if head["kind"] == "spt"
            else ck["model"])


def spt_model(backbone, head, run):
    """The SPT model of checkpoint head `head` ({"kind": "spt", "objective", "flags"}) around `backbone`."""
    return OBJECTIVES[head["objective"]].bound("model", head["flags"])(backbone, run)


def unused_flag_notes(args, given):
    """One line per kind of flag typed but not used by this run: SPT flags without --spt, an
    objective's flags with another objective, a model knob the chosen model's config lacks."""
    def named(keys):
        return ", ".join("--" + k.replace("_", "-") for k in sorted(keys))
    notes, objective = [], OBJECTIVES[args.objective]
    spt_only = given & {"objective", "pretrain_epochs", "pretrain_lr", "pretrain_batch_size",
                        "pretrain_accum_steps", "pretrain_patience",
                        *(n for o in OBJECTIVES.values() for n in o.flags)}
    other_objective = given & {n for o in OBJECTIVES.values() for n in o.flags} - set(objective.flags)
    if spt_only and not args.spt:
        notes.append(f"note: {named(spt_only)} only act{'s' * (len(spt_only) == 1)} with --spt: "
                     f"ignored")
    elif other_objective:
        owners = sorted({k for k, o in OBJECTIVES.items() if other_objective & set(o.flags)})
        notes.append(f"note: {named(other_objective)} belong{'s' * (len(other_objective) == 1)} "
                     f"to --objective {' / '.join(owners)}, not {args.objective}: ignored")
    fields = knobs()
    unused = {k for k in given & set(fields) if args.model not in fields[k][2]}
    if unused:
        owners = sorted({m for k in unused for m in fields[k][2]})
        notes.append(f"note: {named(unused)}: no such field in the {args.model} config (only "
                     f"{', '.join(owners)}): ignored")
    return notes


# ---- the model knobs: every config field is a flag of train.py, declared once, in its dataclass ----

# set from --task (the input kind, its longest input: also --max-len's) and --causal, not knobs
TASK_FIELDS = {"vocab_size", "d_input", "causal", "bidirectional", "max_len"}


def field_help(Config):
    """{field: its comment in the source of Config or a base}: the one description of a knob,
    read where it is declared. A comment after the field, its continuation lines indented below
    it, and a comment line just above the field (at the field's indentation) all count."""
    found = {}
    for cls in reversed([c for c in Config.__mro__ if dataclasses.is_dataclass(c)]):
        name, above = None, []
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):            # no readable source (a class made at run time): no help, same flags
            continue
        for line in source.splitlines():
            indent = len(line) - len(line.lstrip())
            if m := re.match(r"\s+(\w+)\s*:[^=#]*=([^#]*)(?:#\s*(.*))?$", line):
                name, found[m[1]], above = m[1], " ".join([*above, (m[3] or "").strip()]).strip(), []
            elif m := re.match(r"\s+#\s*(.*)$", line):
                if name and indent > 4:                     # a continuation of the field above
                    found[name] += " " + m[1].strip()
                else:                                       # a comment on the next field
                    name, above = None, [*above, m[1].strip()]
            else:
                name, above = None, []
    return found


def knob_type(kind):
    """The argparse settings of a config field of type `kind`: a number that must be finite (the
    config's __post_init__ checks its range), a string, or --x / --no-x for a bool."""
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if kind in (int, float):
        return {"type": checked.number(kind, math.isfinite, "must be a finite number")}
    return {"type": kind}


def knobs(models=None):
    """Every model knob train.py offers: {field: (argparse settings, help, the models that have
    it)}, from the config dataclasses of MODELS (a fork's entry brings its own at once)."""
    out = {}
    for name, entry in (models or MODELS).items():
        helps = field_help(entry.Config)
        for f in dataclasses.fields(entry.Config):
            if f.name in TASK_FIELDS or f.type not in (int, float, str, bool):
                continue
            settings, text, users = out.get(f.name, (knob_type(f.type), helps.get(f.name, ""), []))
            out[f.name] = (settings, text, [*users, name])
    return out


# ---- heads: what the backbone's features are trained to predict ------------------------------

def pool(h, lengths, how):
    """Pool features over real positions only (pads never count). h: (B, L, D), lengths: (B,) or
    None (nothing padded) -> (B, D), float32 at least. A row with no real position (lengths 0) pools
    to zeros, whatever `how` is."""
    # bf16 sums over 16k positions lose digits
    h = h.to(torch.promote_types(h.dtype, torch.float32))
    if lengths is None:
        return {"mean": h.mean(1), "max": h.amax(1), "last": h[:, -1]}[how]   # (B, D)
    real = torch.arange(h.size(1), device=h.device)[None, :] < lengths[:, None]   # (B, L)
    if how == "mean":
        return (h * real[..., None]).sum(1) / lengths[:, None].clamp(min=1)       # (B, D)
    if how == "max":
        z = h.masked_fill(~real[..., None], torch.finfo(h.dtype).min).amax(1)    # (B, D)
    else:                                                              # "last", for causal models
        z = h[torch.arange(h.size(0), device=h.device), (lengths - 1).clamp(min=0)]   # (B, D)
    return z.masked_fill((lengths == 0)[:, None], 0.0)                 # (B, D)


class Classifier(nn.Module):
    """backbone -> pool over real positions -> Linear to C classes. Retrieval (pair=True): both
    documents go through the same backbone (two towers); the head reads [a, b, a−b, a·b] as in LRA.
    forward: x (B, L) or (B, L, 2) or, for pairs, (B, 2, L); lengths (B,) or (B, 2) -> logits
    (B, C)."""

    def __init__(self, backbone, d_model, n_classes, pool, pair):
        super().__init__()
        self.backbone, self.pool, self.pair = backbone, pool, pair
        if pair:
            self.head = nn.Sequential(nn.Linear(4 * d_model, d_model), nn.GELU(),
                                      nn.Linear(d_model, n_classes))
        else:
            self.head = nn.Linear(d_model, n_classes)

    def forward(self, x, lengths):
        if self.pair:
            B = x.size(0)
            x = x.flatten(0, 1)                                      # (2B, L): each document alone
            lengths = None if lengths is None else lengths.flatten()     # (2B,)
        # torch.compile: an SSM backbone runs its frame eagerly (ssm.SSMBackbone.forward), which
        # splits this frame here: one graph before, one after (lab/hardware.py: compiled)
        z = pool(self.backbone(x, lengths), lengths, self.pool)          # (B or 2B, D)
        if self.pair:
            a, b = z.view(B, 2, -1).unbind(1)                            # (B, D) each
            z = torch.cat([a, b, a - b, a * b], -1)                      # (B, 4D)
        return self.head(z)                                              # (B, C)


def model_input(x, task):
    """What a classifier reads for a raw batch x (B, L): token ids, or pixels as (B, L, 2) [value, 0
    indicator]."""
    value = lra_data.clean_input(x, task)[0]                                      # (B, L)
    return denoise.mask_input(value, torch.zeros(value.shape, dtype=torch.bool, device=x.device),
                              lra_data.MASK)


# ---- a checkpoint's model, and the backbone a pre-trained checkpoint hands over -----------------

def build_model(ck):
    """The model a checkpoint dict (or a run's meta: model_name, task, config, head) describes:
    backbone = entry.build(entry.Config(**ck["config"])) of its MODELS entry, inside a Classifier
    (head kind "classifier") or the SPT model of the objective that trained it (kind "spt": the
    objective's entry builds it, e.g. ELECTRA's generator + discriminator)."""
    entry, head = MODELS[ck["model_name"]], ck["head"]
    config = entry.Config(**ck["config"])
    backbone = entry.build(config)
    if head["kind"] == "spt":
        run = Backbone(ck["task"], not getattr(config, "bidirectional", True),
                       lambda **changes: dataclasses.replace(config, **changes) if changes else config, entry.build)
        return spt_model(backbone, head, run)
    return Classifier(backbone, config.d_model, head["n_classes"], head["pool"],
                            head["pair"])


def load_model(path, device="cpu"):
    """Load a checkpoint written by train.py: returns (model in eval mode, the checkpoint dict)."""
    ck = checked.read_checkpoint(path, device)
    model = build_model(ck).to(device)
    model.load_state_dict(ck["model"])
    return model.eval(), ck


def load_backbone(model, state):
    """Copy a checkpoint's backbone into a Classifier, strictly: the only keys allowed to differ are
    the checkpoint's own head (expected unexpected: denoise_head.* from SPT, or head.*) and our new
    head (expected missing: head.*). Anything else, or a shape mismatch, raises RuntimeError: a
    pre-trained backbone is never silently skipped."""
    old_head = sorted(k for k in state if not k.startswith("backbone."))
    new_head = sorted(k for k in model.state_dict() if not k.startswith("backbone."))
    result = model.load_state_dict({k: v for k, v in state.items() if k not in old_head},
                                   strict=False)
    if sorted(result.missing_keys) != new_head or result.unexpected_keys:
        raise RuntimeError(f"backbone keys do not match: missing "
                           f"{sorted(set(result.missing_keys) - set(new_head))}, "
                           f"unexpected {result.unexpected_keys}")
    return old_head, new_head
