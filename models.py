"""models.py: the models train.py trains: a backbone (one MODELS entry each) with a head on top.
entry:      Model(Config, build, ssm_params): the config dataclass, Config -> backbone (forward(x, lengths) -> (B, L, D)
            features), the parameters with their own lr; --model's choices, the model flags (every config field),
            the presets and the tests' model lists all read MODELS, so a new model is its file and one entry here
            (docs/fork.md). `paper`: a fork's own --preset paper values (the paper's are lab/presets.py's)
classifier: logits = W·pool(backbone(x)) over real positions (mean / max / last); Retrieval: [a, b, a−b, a·b] (LRA)
inputs:     token ids stay ids; pixels become [normalised value, mask indicator] (Amos et al. 2024, App. C;
            clean_input, which the loader's collate applies)
checkpoint: build_model / load_model rebuild a train.py checkpoint's model; load_backbone hands SPT's backbone on
The SPT models (a denoising head, ELECTRA's pair) are objectives.py's; the corruptions and losses denoise.py's.
Check: tests/test_fork.py (a model added as one entry), tests/test_train.py (pooling ignores pads, checkpoints
reload exactly), tests/test_paper_presets.py.
"""
import argparse
import dataclasses
import inspect
import math
import re
from typing import Callable, NamedTuple

import torch
import torch.nn as nn

import denoise
import dlr
import lra_data
import objectives
import s4
import transformer
from tools import checked


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
    for table, built_in, kind in ((MODELS, BUILT_IN, "MODELS"), (objectives.OBJECTIVES, objectives.BUILT_IN,
                                                                  "OBJECTIVES")):
        for name, entry in built_in.items():
            if table.get(name) is not entry:
                raise ValueError(f"{kind}[{name!r}] was replaced ({table.get(name)!r:.60}): the built-in {name} "
                                 f"keeps its name; give the new entry a name of its own, e.g. {kind}[{name + '2'!r}]")
    for name, (_, _, users) in knobs().items():
        if name in run_flags:
            raise ValueError(f"the {', '.join(users)} config field {name!r} has the name of train.py's run flag "
                             f"--{name.replace('_', '-')}: rename the field")


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
        run = objectives.Run(ck["task"], not getattr(config, "bidirectional", True),
                             lambda **changes: dataclasses.replace(config, **changes), entry.build)
        return objectives.spt_model(backbone, head, run)
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


def check_init_checkpoint(ck, model_name, task, config):
    """ValueError (one line) unless checkpoint dict ck has a backbone this run (model_name on task,
    backbone config dict `config`) can fine-tune: same model, task and every config field that
    shapes the weights."""
    if (ck["model_name"], ck["task"]) != (model_name, task):
        raise ValueError(f"a {ck['model_name']} checkpoint for {ck['task']}, but this run is "
                         f"{model_name} on {task}; pass the --model and --task it was made with")
    # may differ: not in the weights
    init_only = {"dropout", "ssm_lr", "dt_min", "dt_max", "diag_init"}
    differ = [k for k in config if k not in init_only and ck["config"].get(k) != config[k]]
    if differ:
        theirs, ours = (", ".join(f"{k}={c.get(k)}" for k in differ)
                        for c in (ck["config"], config))
        raise ValueError(f"its {theirs} differ from this run's {ours}; pass the model flags it was "
                         f"made with")


def main(argv=None):
    """python models.py [--out FILE]: every --preset paper value of every MODELS entry with its
    source, as markdown (results/paper_presets.md); one line on a bad flag."""
    import argparse
    import sys
    from pathlib import Path

    from lab import presets                     # the paper's values and sources: the lab's table

    p = argparse.ArgumentParser(description="Print every --preset paper value and its source "
                                            "(markdown).")
    p.add_argument("--out", default=None, help="write the table here instead of printing it")
    p.error = lambda m: (print(f"models.py: error: {checked.flag_message(m)}", file=sys.stderr),
                         sys.exit(2))
    args = p.parse_args(argv)
    if args.out and Path(args.out).is_dir():
        p.error(f"--out {args.out} is a folder: pass a file name, e.g. results/paper_presets.md")
    text = "\n".join(["# `--preset paper`: every value and its source", "",
                      "Written by `python models.py --out results/paper_presets.md` "
                      "(tests/test_paper_presets.py checks that it is current). Sizes: "
                      "docs/presets.md.", "",
                      *presets.paper_table(MODELS)])
    if args.out and not checked.owned(args.out):         # a file of the user's: never overwritten
        p.error(f"--out {args.out} exists and models.py did not write it (it is not in "
                f"{Path(args.out).parent / checked.MANIFEST}): it is left untouched; pass another name")
    if args.out:
        checked.write_owned(args.out, text + "\n", "models.py")
    else:
        print(text)


if __name__ == "__main__":
    main()
