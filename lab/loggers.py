"""lab/loggers.py: a run's records mirrored to TensorBoard or Weights & Biases (train.py --log-to), optional.
what:   every record of the run folder's log.jsonl (each evaluation, the test, the wall times) and config.json,
        nothing else: log.jsonl stays the run's one record, the loggers are views of it
how:    after each record runs.log writes, the records not sent yet are read back from log.jsonl and sent; the count
        sent is kept in the logger's folder, so a resumed run (or a stop between a checkpoint and its log line,
        runs.catch_up_log) continues the same curves, each phase over its own step axis; rank 0 only under DDP
packages: imported only when asked; neither is a requirement (`pip install tensorboard` / `pip install wandb`)
Check: tests/test_loggers.py (the TensorBoard events read back hold log.jsonl's values; wandb offline writes its run).
"""
import argparse
import contextlib
import hashlib
import importlib.util
import json
import netrc
import os
from pathlib import Path

from lab import runs
from tools import checked

PACKAGES = ("tensorboard", "wandb")                            # --log-to values, each the package it needs
PROJECT = "never-train-from-scratch"                           # wandb's project, unless WANDB_PROJECT says


def log_to(text):
    """The argparse type of --log-to: 'tensorboard' or 'wandb', refused in one line naming the pip command when its
    package is not installed (checked without importing it, so a run without --log-to never imports either)."""
    if text not in PACKAGES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(PACKAGES)}")
    if importlib.util.find_spec(text) is None:
        raise argparse.ArgumentTypeError(f"{text} needs the {text} package, which is not installed: pip install {text}")
    return text


log_to.rule = "tensorboard or wandb"                          # --help (presets.FlagHelp)


def probe(kind):
    """None, or one line why --log-to `kind` cannot run on this machine, said at start-up before any run folder
    exists: its package fails to import (installed but broken), or wandb is online with no login (no WANDB_API_KEY,
    no api.wandb.ai entry in ~/.netrc) and WANDB_MODE is not offline or disabled."""
    if kind is None:
        return None
    try:
        importlib.import_module("torch.utils.tensorboard" if kind == "tensorboard" else "wandb")
    except Exception as e:                                    # a broken install: ImportError, AttributeError, ...
        return (f"--log-to {kind}: the {kind} package does not import ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:120] if str(e) else ''}); pip install --force-reinstall {kind}")
    if kind == "wandb" and os.environ.get("WANDB_MODE", "online") not in ("offline", "disabled", "dryrun"):
        try:
            login = os.environ.get("WANDB_API_KEY") or netrc.netrc().authenticators("api.wandb.ai")
        except (OSError, netrc.NetrcParseError):
            login = None
        if not login:
            return ("--log-to wandb: not logged in to Weights & Biases: run `wandb login`, or run offline with "
                    "WANDB_MODE=offline (upload later with `wandb sync`)")
    return None


def scalars(record):
    """A log.jsonl record -> {name: number}: its numbers, nested ones (wall_time_s) joined by '/'; no bools."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in scalars(value).items()})
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            out[key] = value
    return out


class TensorBoard:
    """Scalars `<phase>/<key>` at the phase's optimiser step (the test and the wall times at the last step seen),
    the config as text; written to <run folder>/tensorboard (`tensorboard --logdir runs`)."""

    def __init__(self, folder, config, fresh):
        from torch.utils.tensorboard import SummaryWriter     # needs the tensorboard package
        self.folder = Path(folder) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.folder))
        if fresh:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def send(self, record, step):
        for key, value in scalars(record).items():
            self.writer.add_scalar(f"{record.get('phase', 'run')}/{key}", value, step)

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandB:
    """One wandb run per run folder (its id derived from the folder, so a resume continues it; resume="allow"),
    `<phase>/<key>` over the phase's own step axis `<phase>/step`, the test in the summary, config.json as its
    config; files under <run folder>/wandb. WANDB_MODE=offline needs no account (`wandb sync` uploads later)."""

    def __init__(self, folder, config, fresh):
        import wandb                                          # needs the wandb package
        self.wandb = wandb
        run_id = hashlib.sha1(str(Path(folder).resolve()).encode()).hexdigest()[:16]
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), dir=str(folder), id=run_id,
                                  name=Path(folder).name, resume="allow", config=config,
                                  settings=wandb.Settings(console="off"))
        except Exception as e:                                # no login, no network: say what to do
            runs.fail(f"--log-to wandb: wandb.init failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                      f"log in with `wandb login`, or run offline with WANDB_MODE=offline (upload later with "
                      f"`wandb sync {folder}/wandb`)")
        for phase in ("spt", "finetune"):
            self.run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")

    def send(self, record, step):
        phase = record.get("phase", "run")
        values = {f"{phase}/{k}": v for k, v in scalars(record).items()}
        if phase in ("spt", "finetune"):
            self.run.log({**values, f"{phase}/step": step})
        else:                                                 # the test, the wall times: one value each
            self.run.summary.update(values)

    def flush(self):
        pass

    def close(self):
        self.run.finish()


KINDS = {"tensorboard": TensorBoard, "wandb": WandB}


class Mirror:
    """Sends the records of <folder>/log.jsonl that the logger has not had yet; the count sent so far lives in
    <logger folder>/records_sent.txt, so a resumed run sends only what is new (and what a stop left unsent)."""

    def __init__(self, kind, folder, config):
        self.folder = Path(folder)
        self.mark = self.folder / kind / "records_sent.txt"
        self.sent = int(self.mark.read_text()) if self.mark.is_file() else 0
        self.logger = KINDS[kind](folder, config, fresh=self.sent == 0)
        self.step = 0                                         # the last optimiser step seen (for the test)

    def sync(self):
        path = self.folder / "log.jsonl"
        records = checked.read_records(path, "check the run folder") if path.is_file() else []   # cut lines: skipped
        for i, record in enumerate(records):                  # those sent before only set the step axis
            self.step = record.get("step", self.step)
            if i >= self.sent:
                self.logger.send(record, self.step)
        if len(records) > self.sent:
            self.logger.flush()
            self.sent = len(records)
            self.mark.parent.mkdir(parents=True, exist_ok=True)
            runs.write_whole(self.mark, lambda tmp: tmp.write_text(f"{self.sent}\n"))


@contextlib.contextmanager
def mirror(kind, folder, config):
    """For the block: rank 0 mirrors the run folder's log.jsonl to `kind` ('tensorboard', 'wandb'; None: nothing)
    after every record runs.log writes, once at the start (what an earlier, stopped part left unsent) and once at
    the end. config: config.json's dict."""
    if kind is None or runs.rank() > 0:
        yield
        return
    m = Mirror(kind, folder, config)
    m.sync()
    runs.RECORD_HOOKS.append(m.sync)
    try:
        yield
    finally:
        runs.RECORD_HOOKS.remove(m.sync)
        try:
            m.sync()
        finally:
            m.logger.close()
