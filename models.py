"""models.py: the backbones train.py can train, one entry each, and the models of checkpoints.
entry:   Model(Config, build, ssm_params, paper): the config dataclass, Config -> backbone (forward(x,
         lengths) -> (B, L, D) features), the parameters with their own lr, the --preset paper values
derived: --model's choices, the presets, the memory and parameter tables and the tests' model lists
         all read MODELS, so a new model is its file and one entry here (docs/fork.md)
Check: tests/test_fork.py (a model added as one entry), tests/test_paper_presets.py.
"""
import argparse
import dataclasses
import inspect
import math
import re
from typing import Callable, NamedTuple

import dlr
import heads
import objectives
import presets
import runs
import s4
import transformer


class Model(NamedTuple):
    Config: type                # the model file's config dataclass: presets and flags set it
    build: Callable             # Config -> backbone, forward(x, lengths) -> (B, L, D) features
    ssm_params: set             # leaf names of parameters with their own lr, no weight decay
    paper: Callable | None      # (task, spt) -> (values, sources) of --preset paper, or None


MODELS = {
    "transformer": Model(transformer.TransformerConfig, transformer.Transformer,
                         transformer.SSM_PARAMS, presets.transformer_paper),
    "s4": Model(s4.S4Config, s4.S4, s4.SSM_PARAMS, presets.s4_paper),
    "dlr": Model(dlr.DLRConfig, dlr.DLR, dlr.SSM_PARAMS, presets.dlr_paper),
}


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
        for line in inspect.getsource(cls).splitlines():
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
        return {"type": presets.number(kind, math.isfinite, "must be a finite number")}
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


def preset_values(preset, model, task, spt):
    """Every setting `preset` decides for (model, task), with or without SPT."""
    return presets.preset_values(preset, model, MODELS[model], task, spt)


def model_config(model, task, values, causal=False):
    """The backbone config of `model` for `task` from preset values and flags."""
    return presets.model_config(MODELS[model].Config, task, values, causal)


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
    return heads.Classifier(backbone, config.d_model, head["n_classes"], head["pool"],
                            head["pair"])


def load_model(path, device="cpu"):
    """Load a checkpoint written by train.py: returns (model in eval mode, the checkpoint dict)."""
    ck = runs.read_checkpoint(path, device)
    model = build_model(ck).to(device)
    model.load_state_dict(ck["model"])
    return model.eval(), ck


def main(argv=None):
    """python models.py [--out FILE]: every --preset paper value of every MODELS entry with its
    source, as markdown (results/paper_presets.md); one line on a bad flag."""
    import argparse
    import sys
    from pathlib import Path

    from tools import checked

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
