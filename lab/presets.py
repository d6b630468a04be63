"""lab/presets.py: every setting a `--preset` decides, and where each number comes from.
paper: model sizes and learning rates of Amos, Berant & Gupta (ICLR 2024): Table 2 (Transformer
       sizes), Table 4 (Transformer fine-tuning / SPT learning rates), Table 5 (per-phase learning
       rates and batch sizes of S4 and DLR with SPT, and of DLR from scratch) and App. C.1.2
       (PathX-256); S4 from scratch and the epochs, batch sizes and model sizes the tables leave out
       come from the authors' released configs and S4's LRA configs (Gu et al., ICLR 2022). Each
       model's function (transformer_paper, s4_paper, dlr_paper: models.MODELS names them) gives the
       source of every value; `python lab/presets.py` prints them all (results/paper_presets.md).
tiny / small: CPU-sized runs of the real tasks (no toy task), our own choice (cpu_values).
Explicit command-line flags always win over a preset (apply, one merge); check
holds the checks that involve several flags; each flag's own range is checked by its argparse type
(at_least, in_range), given where the flag is declared (train.parse_flags, models.OBJECTIVES).
"""
import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # the repo: python lab/presets.py from anywhere
import torch  # noqa: E402

import lra_data  # noqa: E402
import models  # noqa: E402
from lab.runs import fail  # noqa: E402
from tools import checked  # noqa: E402

# ---- paper: model sizes --------------------------------------------------------------------------

# rotary, pre-norm (paper Table 2; heads and FFN widths from the authors' configs)
TRANSFORMER_SIZE = {
    "listops": dict(n_layers=6, d_model=512, n_heads=8, d_ff=2048),
    "text": dict(n_layers=6, d_model=512, n_heads=8, d_ff=2048),
    "retrieval": dict(n_layers=4, d_model=128, n_heads=4, d_ff=512),
    "image": dict(n_layers=3, d_model=64, n_heads=4, d_ff=128),  # FFN 2D in the authors' config
    "pathfinder": dict(n_layers=4, d_model=128, n_heads=8, d_ff=128),
    # block-local attention
    "pathx": dict(n_layers=4, d_model=128, n_heads=4, d_ff=128, block_size=4096),
    "pathx256": dict(n_layers=4, d_model=128, n_heads=4, d_ff=128, block_size=4096),
}
# S4: bidirectional, N = 64, HiPPO-LegS, GLU (paper §4 after S4's configs); DLR: the same with LayerNorm
SSM_SIZE = {
    "listops": dict(n_layers=8, d_model=128, norm="batch", prenorm=False),
    "text": dict(n_layers=6, d_model=256, norm="batch", prenorm=True),
    "retrieval": dict(n_layers=6, d_model=256, norm="batch", prenorm=True),
    "image": dict(n_layers=6, d_model=512, norm="layer", prenorm=False, dropout=0.1),
    "pathfinder": dict(n_layers=6, d_model=256, norm="batch", prenorm=True),
    "pathx": dict(n_layers=6, d_model=256, norm="batch", prenorm=True, dt_min=1e-4),
    "pathx256": dict(n_layers=6, d_model=256, norm="batch", prenorm=True, dt_min=1e-4),
}

# ---- paper: optimisation, per phase --------------------------------------------------------------
# (lr, batch_size, pretrain_lr, pretrain_batch_size); a run the tables leave out: ssm_row, with a source

TABLE4_TRANSFORMER_LR = {  # (FT, SPT)
    "listops": (1e-4, 1e-3), "text": (5e-4, 5e-4), "retrieval": (5e-4, 5e-3),
    "image": (1e-3, 1e-3), "pathfinder": (5e-4, 1e-3), "pathx": (5e-4, 1e-3),
    "pathx256": (5e-4, 1e-3)}                                       # PathX-256: PathX's (no row)
TABLE5 = {
    ("s4", "spt"): {"listops": (1e-3, 16, 1e-3, 128), "text": (5e-4, 16, 5e-4, 8),
                    "retrieval": (5e-4, 256, 5e-4, 8), "image": (1e-3, 512, 1e-3, 32),
                    "pathfinder": (1e-3, 64, 1e-3, 8), "pathx": (1e-3, 64, 1e-3, 8),
                    "pathx256": (1e-3, 64, 1e-3, 8)},               # PathX-256: App. C.1.2
    ("dlr", "spt"): {"listops": (5e-4, 16, 1e-3, 128), "text": (1e-3, 16, 5e-4, 8),
                     "image": (1e-3, 64, 1e-3, 32), "pathx": (5e-4, 64, 5e-4, 8)},
    ("dlr", "tfs"): {"listops": (5e-4, 16), "text": (5e-4, 16), "image": (5e-4, 64),
                     "pathx": (5e-4, 64)},
    ("s4", "tfs"): {"pathx256": (1e-4, 16)},                        # App. C.1.2
}
# S4's LRA configs (Gu et al. 2022): batch size and epochs of each task; S4 from scratch trains at lr 0.01
# (PathX 5e-4), weight decay 0.05 (paper §4). Warm-up: about one epoch, our choice (the papers do not print it).
S4_CONFIG = {
    "listops": dict(batch_size=50, epochs=40, warmup=2000),
    "text": dict(batch_size=16, epochs=32, warmup=5000),
    "retrieval": dict(batch_size=64, epochs=20, warmup=2500),
    "image": dict(batch_size=50, epochs=200, warmup=1000),
    "pathfinder": dict(batch_size=64, epochs=200, warmup=2500),
    "pathx": dict(batch_size=32, epochs=50, warmup=5000),
    "pathx256": dict(batch_size=32, epochs=50, warmup=5000),
}
# The authors' Transformer configs: batch 32 everywhere (Image fine-tuning 50), epochs (fine-tuning, SPT),
# warm-up within their 2,000-5,000 steps. Their learning rates are placeholders: Table 4's are used.
TRANSFORMER_CONFIG = {"listops": (100, 100, 2000), "text": (65, 32, 5000),
                      "retrieval": (32, 32, 2500), "image": (200, 50, 2000),
                      "pathfinder": (200, 50, 2500), "pathx": (200, 200, 5000),
                      "pathx256": (200, 200, 5000)}                 # PathX-256: PathX's (no config)
# the authors' S4 SPT config; elsewhere SPT gets the fine-tuning epochs
SPT_EPOCHS = {("s4", "listops"): 100}
PAPER_GENERATE = {"listops": 100_000, "pathfinder": 200_000, "pathx": 200_000,  # LRA's sizes
                  "pathx256": 200_000}


def ssm_row(model, task, spt, s4_batch):
    """((lr, batch_size, pretrain_lr, pretrain_batch_size), source) of S4 or DLR on `task`, with or without SPT."""
    phase = "spt" if spt else "tfs"
    if task in TABLE5.get((model, phase), {}):
        row, source = TABLE5[model, phase][task], "paper App. C.1.2" if task == "pathx256" else "paper Table 5"
    elif model == "dlr" and task == "pathx256":
        row, source = TABLE5["dlr", phase]["pathx"], "paper Table 5 (DLR's PathX row)"
    elif model == "dlr" and spt:
        row, source = TABLE5["s4", "spt"][task], "paper Table 5 (S4's row: no DLR run)"
    elif model == "dlr":
        row, source = (5e-4, s4_batch), "paper Table 5 (DLR's lr from scratch; S4's batch)"
    else:
        row, source = (5e-4 if task == "pathx" else 1e-2, s4_batch), "paper §4 (S4 from scratch) + S4's config"
    return (row if len(row) == 4 else (*row, *row)), source  # from scratch: SPT settings are unused


def lra_run(task):
    """(values, sources) that every paper run on `task` shares: LRA's data sizes, all of it, no dropout, and
    accum_steps 1 (the paper's batch in one step; on a GPU train.py splits it into micro-batches that fit the card
    in hand: lab/memory.py, plan_memory)."""
    values = dict(generate=PAPER_GENERATE.get(task), max_train=0, max_eval=0, dropout=0.0, accum_steps=1,
                  pretrain_accum_steps=1)
    sources = dict.fromkeys(["generate", "max_train", "max_eval", "dropout"], "LRA's sizes, all data, no dropout")
    sources.update(dict.fromkeys(["accum_steps", "pretrain_accum_steps"], "planned on the card at start-up"))
    return values, sources


def transformer_paper(task, spt):
    """(values, sources) of `--preset paper` for the Transformer on `task` (the same with or without SPT)."""
    values, sources = lra_run(task)
    epochs, pretrain_epochs, warmup = TRANSFORMER_CONFIG[task]
    lr, pretrain_lr = TABLE4_TRANSFORMER_LR[task]
    values.update(TRANSFORMER_SIZE[task], weight_decay=0.0, lr=lr, pretrain_lr=pretrain_lr,
                  batch_size=50 if task == "image" else 32, pretrain_batch_size=32, epochs=epochs,
                  pretrain_epochs=pretrain_epochs, warmup=warmup)
    sources.update(dict.fromkeys(TRANSFORMER_SIZE[task], "paper Table 2 + authors' config"))
    sources.update(dict.fromkeys(["batch_size", "pretrain_batch_size", "epochs", "pretrain_epochs",
                                  "warmup"], "authors' Transformer config"))
    sources.update(lr="paper Table 4", pretrain_lr="paper Table 4", weight_decay="paper §4 (none)")
    return values, sources


def ssm_paper(model, task, spt):
    """(values, sources) of `--preset paper` for S4 or DLR on `task`, with or without SPT."""
    values, sources = lra_run(task)
    values.update(SSM_SIZE[task], d_state=64 if model == "s4" else 1024, weight_decay=0.05, **S4_CONFIG[task])
    if model == "dlr":                                    # "as S4 with LayerNorm" (paper §4)
        values.update(norm="layer", prenorm=True)
    sources.update(dict.fromkeys([*SSM_SIZE[task], "d_state", "weight_decay"], "paper §4 (S4's configs)"))
    sources.update(batch_size="S4's LRA config", epochs="S4's LRA config", warmup="ours (about 1 epoch)")
    per_phase = ["lr", "batch_size", "pretrain_lr", "pretrain_batch_size"]
    row, source = ssm_row(model, task, spt, values["batch_size"])
    values.update(zip(per_phase, row))
    sources.update(dict.fromkeys(per_phase, source))
    values["pretrain_epochs"] = SPT_EPOCHS.get((model, task), values["epochs"])
    sources["pretrain_epochs"] = "authors' S4 SPT config" if (model, task) in SPT_EPOCHS else "= fine-tuning epochs"
    return values, sources


def s4_paper(task, spt):
    """(values, sources) of `--preset paper` for S4."""
    return ssm_paper("s4", task, spt)


def dlr_paper(task, spt):
    """(values, sources) of `--preset paper` for DLR (S4's where the paper gives no DLR number)."""
    return ssm_paper("dlr", task, spt)


# the paper's values of each model it ran, by --model name; a fork's model may bring its own (its MODELS entry's
# `paper`, e.g. borrowed), else --preset paper refuses it
PAPER = {"transformer": transformer_paper, "s4": s4_paper, "dlr": dlr_paper}


def paper_of(name, entry):
    """(task, spt) -> (values, sources) of --preset paper for model `name` (entry: its models.MODELS entry): the
    entry's own `paper` (a fork's, e.g. borrowed), else PAPER's; None for a model the paper never ran."""
    return entry.paper if entry.paper is not None else PAPER.get(name)


def borrow(paper, name):
    """Another model's paper values, for a model the paper never ran (a fork): the same (values,
    sources), each source saying "borrowed from <name>" (train.py prints a note). Use as
    paper=presets.borrow(presets.dlr_paper, "dlr") in its models.MODELS entry."""
    def borrowed(task, spt):
        values, sources = paper(task, spt)
        return values, {k: f"borrowed from {name}: {v}" for k, v in sources.items()}
    return borrowed


# ---- tiny / small: CPU-sized runs ----------------------------------------------------------------
# `generate` = examples made (80/10/10; ListOps 96/2/2) when a synthetic task's files are absent;
# max_train / max_eval cap the examples used, so the run time does not depend on what is on disk.
# Both phases get the same epochs and batch size (--pretrain-batch-size follows --batch-size).
CPU_MODEL = {
    "tiny": dict(d_model=32, n_layers=2, d_state=64, n_heads=4, d_ff=64, dropout=0.0,
                 weight_decay=0.01, lr=2e-3, pretrain_lr=2e-3, warmup=20),
    "small": dict(d_model=64, n_layers=4, d_state=64, n_heads=4, d_ff=128, dropout=0.0,
                  weight_decay=0.01, lr=2e-3, pretrain_lr=2e-3, warmup=100),
}
CPU_TASK = {  # task: (epochs, batch size, examples generated, max_train, max_eval)
    "tiny": {"listops": (3, 32, 12000, 1000, 240), "text": (2, 16, None, 500, 200),
             "retrieval": (2, 16, None, 400, 100), "image": (3, 32, None, 2000, 500),
             "pathfinder": (2, 32, 2500, 2000, 250), "pathx": (1, 16, 800, 640, 80),
             "pathx256": (1, 8, 100, 80, 10)},
    "small": {"listops": (10, 32, 50000, 10000, 1000), "text": (4, 16, None, 2500, 500),
              "retrieval": (4, 16, None, 2000, 500), "image": (10, 32, None, 10000, 1000),
              "pathfinder": (10, 32, 12000, 9600, 1200), "pathx": (3, 16, 2500, 2000, 250),
              "pathx256": (2, 8, 500, 400, 50)},
}
# Where a model is much slower on a CPU than DLR, the CPU presets give it 1/share of the examples (and smaller
# batches, so it takes as many steps): S4's NPLR kernel at L = 16,384, the Transformer's attention on the long tasks.
CPU_SHARE = {("s4", "pathx"): 4, ("s4", "pathx256"): 4, ("transformer", "pathx"): 20,
             ("transformer", "pathx256"): 20, ("transformer", "listops"): 4,
             ("transformer", "text"): 4, ("transformer", "retrieval"): 4}


def cpu_values(preset, model, task):
    """Every setting a CPU preset ("tiny", "small") decides for (model, task): training flags and model-config
    fields. Flags given explicitly on the command line override these (apply)."""
    epochs, batch, generate, max_train, max_eval = CPU_TASK[preset][task]
    share = CPU_SHARE.get((model, task), 1)
    batch = max(4, batch // share)
    return {**CPU_MODEL[preset], "epochs": epochs, "pretrain_epochs": epochs, "batch_size": batch,
            "generate": generate, "max_train": max_train // share, "max_eval": max(16, max_eval // share),
            "accum_steps": 1, "pretrain_accum_steps": 1}   # SPT batch: --batch-size's (apply)


def model_config(Config, task, values, causal=False):
    """The backbone config for `task`: the fields of `values` (a preset's, plus explicit flags) that the config
    class Config has, the input kind of the task (tokens: vocab_size; pixels: d_input = 2, value + mask indicator),
    and causal (Transformer) / bidirectional (S4, DLR). Raises ValueError (from the config) for impossible values.
    max_len (the longest input: a Transformer's learned positions) is --max-len's where given, else the task's."""
    spec = lra_data.TASKS[task]
    kw = {"max_len": spec.max_len, **values, "vocab_size": spec.vocab_size if spec.kind == "tokens" else None,
          "d_input": 1 if spec.kind == "tokens" else 2, "causal": causal, "bidirectional": not causal}
    fields = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in kw.items() if k in fields})


# the flags whose None default a preset fills in (--help says so)
PRESET_DECIDES = {"pretrain_batch_size", *cpu_values("tiny", "dlr", "pathfinder")}
EPILOG = """examples:
  python train.py --model dlr --task pathfinder --spt --preset tiny   # the quick start: ~1-2 min on a CPU
  python train.py --model s4 --task text --data-dir data --max-len 512 --spt   # IMDB reviews cut to 511 bytes
  python train.py --resume runs/RUN_FOLDER                            # continue a stopped run exactly
data: listops, pathfinder, pathx and pathx256 are generated into --data-dir when their files are absent;
  text (IMDB aclImdb_v1.tar.gz), image (CIFAR-10 cifar-10-python.tar.gz) and retrieval (lra_release.gz,
  tsv_data/) need a download: python lra_data.py --check --data-dir DIR says what is there and what is missing
  (docs/data.md); what a healthy run prints and what a failure means: docs/troubleshooting.md"""


class FlagHelp(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help: each flag's help, then its default and, for a flag typed by `number`, its range, read from the
    type itself (so a new flag shows both without writing them twice); the epilog's lines kept as written."""

    def _get_help_string(self, action):
        if action.default is argparse.SUPPRESS or not action.option_strings:
            return action.help
        text, rule = action.help or "", getattr(action.type, "rule", None)
        if "default" in text:                       # the help says it already (e.g. "default: the task's")
            return f"{text} ({rule})" if rule else text
        preset_decides = action.dest in PRESET_DECIDES
        default = ("off" if action.default is False and action.nargs == 0 else "%(default)s"
                   if action.default is not None else "the preset's" if preset_decides else "none")
        return f"{text} (default: {default}{f'; {rule}' if rule else ''})"


# ---- one merge of preset and flags; the checks of several flags at once --------------------------

def preset_values(preset, name, entry, task, spt):
    """Every setting `preset` decides for model `name` (entry: its models.MODELS entry) on `task`,
    with or without SPT: training flags and model-config fields. Raises ValueError for --preset
    paper of a model without paper values."""
    if preset != "paper":
        return cpu_values(preset, name, task)
    if paper_of(name, entry) is None:
        raise ValueError(f"--preset paper: the paper has no values for {name} (its MODELS entry "
                         f"says paper=None); use --preset tiny or small, or borrow another "
                         f"model's: paper=presets.borrow(presets.dlr_paper, \"dlr\")")
    return paper_of(name, entry)(task, spt)[0]


def values_for(preset, model, task, spt):
    """Every setting `preset` decides for `model` (a models.MODELS name) on `task`, with or without SPT."""
    return preset_values(preset, model, models.MODELS[model], task, spt)


def config_for(model, task, values, causal=False):
    """The backbone config of `model` (a models.MODELS name) for `task` from preset values and flags."""
    return model_config(models.MODELS[model].Config, task, values, causal)


def apply(args, entry):
    """Merge the preset's values into args, in one place: an explicit flag (not None) wins; then the
    default that follows from the task (pooling; an objective's own defaults are its entry's:
    models.fill_defaults). entry: the model's models.MODELS entry. Returns the model-config fields (of
    entry.Config) the preset or the flags decide, and the notes to print. A paper batch is split
    into micro-batches of this process's rows (memory per process)."""
    args.preset = args.preset or ("paper" if torch.cuda.is_available() else "tiny")
    fields = {f.name for f in dataclasses.fields(entry.Config)}
    config_kw, notes = {}, []
    paper = paper_of(args.model, entry)
    if args.preset == "paper" and paper and "borrowed from" in str(paper(args.task, args.spt)[1]):
        notes.append(f"note: --preset paper: the paper has no {args.model} run; its values are "
                     f"borrowed (python lab/presets.py names each source)")
    accum_given = {k for k in ("accum_steps", "pretrain_accum_steps") if getattr(args, k) is not None}
    for key, value in preset_values(args.preset, args.model, entry, args.task, args.spt).items():
        if key in fields:                     # a model knob: the config's (a typed flag wins, below)
            config_kw[key] = value
        elif hasattr(args, key):
            setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    config_kw.update({k: v for k, v in vars(args).items() if k in fields and v is not None})
    if args.pretrain_batch_size is None:                  # CPU presets: one batch size
        args.pretrain_batch_size = args.batch_size
    world = int(os.environ.get("WORLD_SIZE", 1))          # DDP: torchrun's processes
    for phase, batch, accum in (("finetune", "batch_size", "accum_steps"),
                                ("spt", "pretrain_batch_size", "pretrain_accum_steps")):
        per_process = -(-getattr(args, batch) // world)   # rows of a global batch per process
        # --preset paper: None = planned from the card in hand (lab/memory.py: plan_memory), per process
        if args.preset == "paper" and accum not in accum_given:
            setattr(args, accum, None)
        if world > 1 and per_process <= 1 and (phase == "finetune" or args.spt):
            notes.append(f"note: --{batch.replace('_', '-')} {getattr(args, batch)} over {world} "
                         f"processes leaves each process at most one example per step (its GPU "
                         f"mostly waits; BatchNorm normalises one example)")
    # BatchNorm over time would leak the future in training
    if args.causal and config_kw.get("norm") == "batch":
        config_kw["norm"] = "layer"
        notes.append("note: causal model: LayerNorm instead of the preset's BatchNorm (whose "
                     "statistics over the time axis would let earlier positions see later ones "
                     "in training)")
    args.pool = args.pool or lra_data.TASKS[args.task].pool
    return config_kw, notes


def check(args, config_kw, entry):
    """The checks that involve several flags (or a flag and the disk), after the presets are applied; returns the
    backbone config (entry: the model's models.MODELS entry; the objective's own checks are its entry's `refuse`).
    Raises ValueError with one line naming the flags (train.py prints it and exits with status 2)."""
    task = lra_data.TASKS[args.task]
    if args.spt and args.init_from:
        raise ValueError("--init-from already supplies a pre-trained backbone: drop --spt (or --init-from)")
    # resume: last.pt has it all
    if args.init_from and not args.resume and not Path(args.init_from).is_file():
        raise ValueError(f"--init-from {args.init_from}: no such checkpoint file")
    if args.cache_dir and Path(args.cache_dir).exists() and not Path(args.cache_dir).is_dir():
        raise ValueError(f"--cache-dir {args.cache_dir} is a file, not a folder: pass a folder for the cache")
    if args.max_len is not None and (args.task not in ("text", "retrieval")
                                     or not 2 <= args.max_len <= task.max_len):
        raise ValueError(f"--max-len {args.max_len}: only text and retrieval documents can be "
                         f"cut, to 2..{task.max_len} tokens (ListOps answers need the whole "
                         f"expression; pixel tasks have a fixed length)")
    # a typo must not silently generate data there
    if Path(args.data_dir).is_file():
        raise ValueError(f"--data-dir {args.data_dir} is a file, not a folder: pass the folder "
                         f"that holds the task's files")
    if args.data_dir != "data" and not Path(args.data_dir).is_dir():
        raise ValueError(f"--data-dir {args.data_dir}: no such folder (synthetic tasks are "
                         f"generated only into an existing folder or the default ./data)")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file, not a folder: pass a folder for the run folders")
    try:
        return model_config(entry.Config, args.task, config_kw, args.causal)
    except ValueError as e:                  # "d_state=0 must be ...": name the flag that set it
        field = re.match(r"(\w+)=", str(e))
        value = field and config_kw.get(field[1])
        shown = f"{value:g}" if isinstance(value, (int, float)) else value   # as it was typed
        flag = (f"--{field[1].replace('_', '-')} {shown}: " if isinstance(value, (int, float, str))
                and not isinstance(value, bool) else "")
        raise ValueError(f"{flag}{args.model} model: {e} (set by its flags or the preset)") from None


def settle(args, given):
    """The run's settings, presets applied, every check made, before anything is written -> (the backbone's
    config, notes to print). args (changed in place): train.parse_flags's (a --resume's own settings); given:
    the flags typed. A setting that cannot run stops in one line (lab/runs.fail)."""
    entry = models.MODELS[args.model]
    try:
        config_kw, notes = apply(args, entry)                   # the preset, then the flags
        backbone = models.Backbone(args.task, args.causal, lambda **changes: model_config(
            entry.Config, args.task, {**config_kw, **changes}, args.causal), entry.build)
        models.fill_defaults(args, backbone)                    # e.g. the task's mask ratio; --objective's check
        cfg = check(args, config_kw, entry)
    except ValueError as e:
        fail(str(e))
    return cfg, notes + models.unused_flag_notes(args, given)


# ---- the table of paper presets and their sources (results/paper_presets.md) ---------------------

def paper_table(models):
    """Markdown rows: every `--preset paper` value that differs by run (model, task, TFS / SPT),
    with its source. models: models.MODELS (the entries without paper values are left out)."""
    keys = ["lr", "pretrain_lr", "batch_size", "pretrain_batch_size", "accum_steps",
            "pretrain_accum_steps", "epochs", "pretrain_epochs", "warmup", "weight_decay"]
    rows = ["| model | task | run | " + " | ".join(keys) + " | sources |",
            "|---" * (len(keys) + 4) + "|"]
    for model, entry in models.items():
        for task in lra_data.TASKS:
            runs = ([(False, "TFS and SPT")] if model == "transformer"
                    else [(False, "TFS"), (True, "SPT")])
            for spt, run in runs if paper_of(model, entry) else []:
                values, sources = paper_of(model, entry)(task, spt)
                by_source = {}                            # source -> the keys it gave
                for k in keys:
                    by_source.setdefault(sources[k], []).append(k)
                cited = "; ".join(f"{source}: {', '.join(ks)}" for source, ks in by_source.items())
                rows.append(f"| {model} | {task} | {run} | "
                            + " | ".join(f"{values[k]:g}" for k in keys) + f" | {cited} |")
    return rows


def main(argv=None):
    """python lab/presets.py [--out FILE]: every --preset paper value of every MODELS entry with its
    source, as markdown (results/paper_presets.md); one line on a bad flag."""
    p = argparse.ArgumentParser(description="Print every --preset paper value and its source (markdown).")
    p.add_argument("--out", default=None, help="write the table here instead of printing it")
    p.error = lambda m: (print(f"presets.py: error: {checked.flag_message(m)}", file=sys.stderr), sys.exit(2))
    args = p.parse_args(argv)
    if args.out and Path(args.out).is_dir():
        p.error(f"--out {args.out} is a folder: pass a file name, e.g. results/paper_presets.md")
    text = "\n".join(["# `--preset paper`: every value and its source", "",
                      "Written by `python lab/presets.py --out results/paper_presets.md` "
                      "(tests/test_paper_presets.py checks that it is current). Sizes: "
                      "docs/presets.md.", "",
                      *paper_table(models.MODELS)])
    if args.out and not checked.owned(args.out):         # a file of the user's: never overwritten
        p.error(f"--out {args.out} exists and lab/presets.py did not write it (it is not in "
                f"{Path(args.out).parent / checked.MANIFEST}): it is left untouched; pass another name")
    if args.out:
        checked.write_owned(args.out, text + "\n", "lab/presets.py")
    else:
        print(text)


if __name__ == "__main__":
    main()
