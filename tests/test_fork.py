"""Facts about forking the repo the way docs/fork.md says, tested with the document's own code blocks (read from the
document here, never copied): a new model is its file and one MODELS entry (its config fields are flags at once,
its kernel keeps ssm.py's contract), a new objective (with a model of its own, or not) its functions and one
OBJECTIVES entry, a new schedule one SCHEDULES entry; each trains through the real train.main, and following every
recipe by hand in a copy of the repo leaves the layout tests and the recipe's own test green. Also: how many files a
knob crosses from its flag to its tensor, measured by tracing the calls of a real run."""
import argparse
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import models

from lab import presets, steps
import train
from conftest import TINY, records, run
from lra.listops import generate_listops

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "fork.md"


def recipe_blocks():
    """The python blocks of docs/fork.md as (how, path, code): how is "new file" or "add to", from the block's first
    line ("# new file: lru.py", "# add to: models.py")."""
    blocks = []
    for code in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
        head = re.match(r"# (new file|add to): (\S+)\n", code)
        assert head, f"docs/fork.md: a code block does not say where it goes: {code.splitlines()[0]!r}"
        blocks.append((head[1], head[2], code))
    return blocks


def blocks_for(path):
    return [code for how, where, code in recipe_blocks() if where == path]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    generate_listops(root, 60, 9, 9, min_length=30, max_length=200)
    return root


@pytest.fixture
def forked(tmp_path, monkeypatch):
    """Every recipe applied in this process: the new files written and imported, each "add to" block run in its
    module (as if pasted at its end); the dicts and modules are restored afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for how, path, code in recipe_blocks():
        if how == "new file" and not path.startswith("tests/"):
            (tmp_path / path).write_text(code)
    for name, table in ((models, "MODELS"), (models, "OBJECTIVES"), (steps, "SCHEDULES")):
        monkeypatch.setattr(name, table, dict(getattr(name, table)))
    monkeypatch.setattr(train, "MODELS", models.MODELS)
    monkeypatch.setattr(train, "OBJECTIVES", models.OBJECTIVES)
    for module in (models, steps):
        before = dict(vars(module))
        for code in blocks_for(module.__name__.replace(".", "/") + ".py"):
            exec(compile(code, str(DOC), "exec"), vars(module))
        for key in set(vars(module)) - set(before):
            monkeypatch.delattr(module, key)             # the recipe's names leave with the test
    yield
    sys.modules.pop("lru", None)


# ---- recipe 1: a model (an LRU-style diagonal RNN) ---------------------------------------------------------------

def test_a_model_added_as_one_entry_pre_trains_and_fine_tunes_with_its_own_config_knob(forked, data_dir, tmp_path,
                                                                                      capsys):
    results, folder = run(data_dir, tmp_path, "--model", "lru", "--task", "listops", "--spt", "--pretrain-epochs",
                          "3", "--epochs", "1", "--r-min", "0.5")
    losses = [r["train_loss"] for r in records(folder) if r["phase"] == "spt"]
    assert losses[-1] < losses[0] and 0 <= results["test_acc"] <= 1, losses
    assert "ssm 64 (lr 1.0e-03" in capsys.readouterr().out, "the entry's SSM parameters did not get their own lr group"
    config = json.loads((folder / "config.json").read_text())["config"]
    assert config["r_min"] == 0.5 and config["d_state"] == 16, f"--r-min / --d-state did not reach LRUConfig: {config}"


def test_a_forked_models_knob_is_a_flag_without_editing_train_py(forked):
    args, given, _ = train.parse_flags(["--model", "lru", "--r-min", "0.25", "--r-max", "0.5"])
    assert (args.r_min, args.r_max) == (0.25, 0.5) and {"r_min", "r_max"} <= given
    assert "--r-min" in train_help() and "lru:" in train_help()


def train_help():
    with pytest.raises(SystemExit), __import__("contextlib").redirect_stdout(__import__("io").StringIO()) as out:
        train.parse_flags(["--help"])
    return out.getvalue()


def test_the_recipes_kernel_meets_the_kernel_contract_and_its_own_recurrence_test_passes(forked):
    import lru
    import dlr
    import s4
    for Kernel in (lru.LRUKernel, dlr.DLRKernel, s4.S4Kernel):
        assert getattr(Kernel.forward, "_torchdynamo_disable", False), f"{Kernel.__name__}.forward is compiled"
        assert callable(getattr(Kernel, "initial_state", None)) and callable(getattr(Kernel, "step", None)), Kernel
    (code,) = blocks_for("tests/test_lru.py")
    namespace = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_")]
    assert tests, "the model recipe has no test of its own"
    for test in tests:
        test()


def test_a_model_without_paper_values_stops_preset_paper_in_one_line(forked, data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--model", "lru", "--task", "listops", "--preset", "paper", "--data-dir", str(data_dir),
                    "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "the paper has no values for lru" in err[0], err


def test_a_model_that_borrows_paper_values_says_so_and_names_the_source(forked, monkeypatch):
    from lab import presets
    monkeypatch.setitem(models.MODELS, "lru", models.MODELS["lru"]._replace(paper=presets.borrow(presets.dlr_paper,
                                                                                                 "dlr")))
    args, _, _ = train.parse_flags(["--model", "lru", "--task", "text", "--preset", "paper"])
    _, notes = presets.apply(args, models.MODELS["lru"])
    assert any("borrowed" in n for n in notes) and args.lr == presets.dlr_paper("text", False)[0]["lr"], notes
    table = "\n".join(presets.paper_table(models.MODELS))
    assert "| lru | text | TFS |" in table and "borrowed from dlr: paper Table 5" in table


def test_a_model_knob_the_chosen_model_lacks_is_named_as_ignored(data_dir, tmp_path):
    results, folder = run(data_dir, tmp_path, "--model", "transformer", "--task", "listops", "--epochs", "1",
                          "--max-steps", "1", "--d-state", "32", "--mode", "diag")
    log = (folder / "log.txt").read_text()
    owners = ", ".join(sorted({m for k in ("d_state", "mode") for m in models.knobs()[k][2]}))   # a fork's too
    assert f"note: --d-state, --mode: no such field in the transformer config (only {owners}): ignored" in log, log


# ---- recipe 2: objectives (BERT's 80 / 10 / 10; a deeper head, a model of its own) -------------------------------

def test_an_objective_added_as_one_entry_pre_trains_records_its_flags_and_corrupts_as_declared(forked, data_dir,
                                                                                            tmp_path, monkeypatch):
    seen, bert = [], models.OBJECTIVES["bert"]

    def spy(clean, gen, progress, **flags):
        b = bert.prepare(clean, gen, progress, **flags)
        seen.append(((b.x == clean.mask_id) & b.weight.bool()).sum() / b.weight.sum())
        return b
    monkeypatch.setitem(models.OBJECTIVES, "bert", bert._replace(prepare=spy))
    results, folder = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--spt", "--objective", "bert",
                          "--bert-random", "0.2", "--pretrain-epochs", "3", "--epochs", "1")
    assert results["spt_objective"] == dict(objective="bert", mask_ratio=0.1, bert_mask=0.8, bert_random=0.2)
    share = torch.stack(seen).mean()
    assert 0.6 < share < 0.95, f"share of masked positions reading <mask>: {share:.2f}, want about 0.8"
    assert "SPT bert (mask_ratio 0.1, bert_mask 0.8, bert_random 0.2)" in (folder / "log.txt").read_text()


def test_an_added_objectives_own_flags_are_checked_and_named_when_unused(forked, data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--objective", "bert", "--spt", "--bert-mask", "1.5", "--data-dir", str(data_dir)])
    assert e.value.code == 2 and "--bert-mask 1.5 must be in [0, 1]" in capsys.readouterr().err
    args, given, _ = train.parse_flags(["--spt", "--objective", "span", "--bert-mask", "0.5"])
    assert models.unused_flag_notes(args, given) == ["note: --bert-mask belongs to --objective bert, not span: "
                                                    "ignored"]
    args, given, _ = train.parse_flags(["--bert-mask", "0.5"])
    assert models.unused_flag_notes(args, given) == ["note: --bert-mask only acts with --spt: ignored"]


def test_an_objective_with_a_model_of_its_own_trains_as_one_entry_and_hands_over_its_backbone(forked, data_dir,
                                                                                           tmp_path):
    results, folder = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--spt", "--objective", "deep",
                          "--pretrain-epochs", "3", "--epochs", "1")
    spt = torch.load(folder / "spt.pt", weights_only=True)
    assert {"deep_head.0.weight", "deep_head.2.weight"} <= set(spt["model"]), sorted(spt["model"])
    losses = [r["train_loss"] for r in records(folder) if r["phase"] == "spt"]
    assert losses[-1] < losses[0], losses
    line = next(line for line in (folder / "log.txt").read_text().splitlines() if "loaded backbone" in line)
    assert "dropped: deep_head.0.bias, deep_head.0.weight, deep_head.2.bias, deep_head.2.weight" in line, line
    reloaded, _ = train.load_model(folder / "spt.pt")
    assert type(reloaded).__name__ == "DeepDenoiser", "the checkpoint does not rebuild the objective's own model"


# ---- recipe 3: knobs (a learning-rate schedule; a mask-ratio ramp that follows the training progress) ----------

def test_a_schedule_added_as_one_entry_is_a_flag_choice_and_decays_every_groups_lr_to_zero(forked, data_dir,
                                                                                          tmp_path):
    results, folder = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--epochs", "4",
                          "--schedule", "linear")
    lrs = [r["lr"] for r in records(folder) if r["phase"] == "finetune"]
    assert lrs[0] > lrs[1] > lrs[2] > lrs[-1] == 0.0, f"lr after each epoch: {lrs}"
    assert json.loads((folder / "config.json").read_text())["args"]["schedule"] == "linear"
    with pytest.raises(SystemExit):
        train.parse_flags(["--schedule", "nope"])


def test_a_knob_added_to_an_objective_reaches_its_tensor_and_follows_the_training_progress(forked, data_dir,
                                                                                          tmp_path, monkeypatch):
    import denoise
    ratios, sample = [], denoise.sample_mask
    monkeypatch.setattr(denoise, "sample_mask", lambda lengths, L, ratio, gen: ratios.append(ratio) or
                        sample(lengths, L, ratio, gen))
    results, _ = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--spt", "--objective", "ramped",
                     "--mask-ramp", "0.5", "--pretrain-epochs", "8", "--epochs", "1", "--max-train", "16")
    train_ratios = ratios[: 8 * 2 : 2]           # per epoch: one training step, then the evaluation's batch
    assert train_ratios[0] < train_ratios[2] < train_ratios[4] == train_ratios[-1] == pytest.approx(0.1), ratios
    assert results["spt_objective"]["mask_ramp"] == 0.5


# ---- by hand: every recipe applied to a copy of the repo --------------------------------------------------------

def test_following_every_recipe_by_hand_leaves_the_layout_tests_and_the_recipes_own_test_green(tmp_path):
    copy = tmp_path / "repo"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.split()
    for rel in listed:
        if (REPO / rel).is_file() and (not rel.startswith("results/runs/") or rel.endswith("log.txt")):  # README's
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, copy / rel)
    for how, path, code in recipe_blocks():
        target = copy / path
        if how == "new file":
            target.write_text(code)
            continue
        text = target.read_text()
        if code.strip() in text:                                       # a copy the recipes were applied to already
            continue
        main = re.search(r"^if __name__ == \"__main__\":", text, flags=re.M)    # paste above it
        at = main.start() if main else len(text)
        target.write_text(text[:at].rstrip() + "\n\n\n" + code + ("\n\n" + text[at:] if main else ""))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                           "tests/test_layout.py", "tests/test_lru.py"], cwd=copy, capture_output=True, text=True)
    assert done.returncode == 0, f"after the recipes the copy's tests fail:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
    helped = subprocess.run([sys.executable, "train.py", "--help"], cwd=copy, capture_output=True, text=True)
    assert all(s in helped.stdout for s in ("--r-min", "--bert-mask", "linear", "--mask-ramp")), helped.stdout[-2000:]


# ---- how far a knob travels: a trace of the calls of a real run --------------------------------------------------

class KnobTrace:
    """The files a knob's value passes through in a run, in order (docs/fork.md, "How far a knob travels"): a visit
    is a call of a repo function with the value itself as an argument, a read of it from the run's settings
    (args.<name>, cfg.<name>) by repo code, or a call of one of the functions of `entry` (an OBJECTIVES entry);
    tracing stops at the first call of the function named `stop` (the one that makes the tensor)."""

    def __init__(self, value, name, stop, entry=None, config=None):
        self.value, self.name, self.stop, self.visits, self.done = value, name, stop, [], False
        self.codes = {f.__code__ for f in (entry or ()) if hasattr(f, "__code__")}
        self.classes = [argparse.Namespace, *([config] if config else [])]

    def visit(self, frame):
        path = frame.f_code.co_filename
        if self.done or not path.startswith(str(REPO)) or "/tests/" in path:
            return
        self.visits.append((str(Path(path).relative_to(REPO)), frame.f_code.co_qualname))
        self.done = frame.f_code.co_name == self.stop or frame.f_code.co_qualname == self.stop

    def profile(self, frame, event, arg):
        if event != "call" or self.done:
            return
        code = frame.f_code
        if not code.co_filename.startswith(str(REPO)):
            return
        n = code.co_argcount + code.co_kwonlyargcount
        names = code.co_varnames[: n + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)]   # *args, **kwargs
        values = [frame.f_locals.get(v) for v in names]
        values += [x for v in values[n:] for x in (v.values() if isinstance(v, dict) else v or ())]
        stop = self.stop in (code.co_name, code.co_qualname)
        if stop or code in self.codes or (self.value is not None and any(v is self.value for v in values)):
            self.visit(frame)

    def __enter__(self):
        trace = self
        self.saved = [(cls, cls.__dict__.get("__getattribute__")) for cls in self.classes]
        for cls in self.classes:
            base = cls.__getattribute__

            def read(obj, attr, base=base):
                if attr == trace.name and not trace.done and trace.value is not None:
                    trace.visit(sys._getframe(1))
                return base(obj, attr)
            cls.__getattribute__ = read
        sys.setprofile(self.profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        for cls, old in self.saved:
            if old is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = old

    def path(self):
        """The visited files in order, a file once per visit (consecutive visits of one file are one)."""
        files = [f for f, _ in self.visits]
        return [f for i, f in enumerate(files) if i == 0 or f != files[i - 1]]


def traced(data_dir, tmp_path, trace, monkeypatch, *flags):
    """Run train.main under `trace`; the value is the object parse_flags makes of the flag (the trace starts at the
    parse, in train.py). -> the path, printed with its counts."""
    parse = train.parse_flags

    def parse_and_catch(argv):
        parsed = parse(argv)
        if trace.value is None:
            trace.value = getattr(parsed[0], trace.name)
        return parsed
    monkeypatch.setattr(train, "parse_flags", parse_and_catch)
    trace.visits.append(("train.py", "parse_flags"))
    with trace:
        run(data_dir, tmp_path, "--task", "listops", "--epochs", "1", "--max-steps", "1", *flags)
    monkeypatch.setattr(train, "parse_flags", parse)
    path = trace.path()
    print(f"{trace.name}: {len(set(path))} files, {len(path) - 1} jumps: {' -> '.join(path)}")
    return path


def test_a_knob_reaches_its_tensor_through_at_most_three_files(data_dir, tmp_path, monkeypatch, capsys):
    import dlr
    mask = KnobTrace(None, "mask_ratio", "sample_mask")
    path = traced(data_dir, tmp_path / "mask", mask, monkeypatch, "--model", "dlr", "--spt", "--pretrain-epochs",
                  "1", "--mask-ratio", "0.37")
    assert mask.done and mask.value == 0.37, mask.visits
    assert len(set(path)) <= 3, f"--mask-ratio crosses {len(set(path))} files: {path}"
    state = KnobTrace(None, "d_state", "DLRKernel.__init__", config=dlr.DLRConfig)
    path = traced(data_dir, tmp_path / "state", state, monkeypatch, "--model", "dlr", "--d-state", "300")
    assert state.done and state.value == 300, state.visits
    assert len(set(path)) <= 3, f"--d-state crosses {len(set(path))} files: {path}"
    name = "".join(["r", "td"])                  # not the interned literal "rtd" of the code: the object argv gives
    rtd = KnobTrace(name, "objective", "rtd_batch_loss", entry=models.OBJECTIVES["rtd"])
    path = traced(data_dir, tmp_path / "rtd", rtd, monkeypatch, "--model", "dlr", "--spt", "--pretrain-epochs", "1",
                  "--objective", name)
    assert rtd.done, rtd.visits
    assert len(set(path)) <= 3, f"--objective rtd crosses {len(set(path))} files: {path}"
    with capsys.disabled():
        print()
        for trace in (mask, state, rtd):
            print(f"  {trace.name}: {' -> '.join(trace.path())}")


# ---- one training step reads in train.py and two files: a trace of the first step of each phase ---------------

class StepTrace:
    """The repo files whose code runs in the first training step of each phase, which train.py's train_phase writes
    out: from the moment the loader hands over a collated batch (steps.to_device, called by Training.batches) until
    the optimiser step returns (steps.guard_step). Code that runs below a torch frame is the model's forward (nn.Module.__call__), the
    optimiser's or autograd's: those files go to `model`, the rest to `step` (docs/fork.md, "One training step")."""

    def __init__(self):
        self.step, self.model, self.active, self.phases = set(), set(), False, 0

    def profile(self, frame, event, arg):
        code = frame.f_code
        here = Path(code.co_filename)
        ours = code.co_filename.startswith(str(REPO)) and "/tests/" not in code.co_filename
        if event == "call" and ours and code.co_name == "to_device" and frame.f_back.f_code.co_name == "batches":
            self.active = True
        if not self.active:
            return
        if event == "return" and ours and code.co_name == "guard_step":
            self.active, self.phases = False, self.phases + 1
            return
        if event != "call" or not ours:
            return
        below, f = False, frame.f_back
        while f is not None and f.f_code.co_name != "train_phase":
            below = below or "/torch/" in f.f_code.co_filename
            f = f.f_back
        (self.model if below else self.step).add(str(here.relative_to(REPO)))


def step_files(data_dir, tmp_path, *flags):
    trace = StepTrace()
    sys.setprofile(trace.profile)
    try:
        run(data_dir, tmp_path, "--task", "listops", "--epochs", "1", "--max-steps", "1", *flags)
    finally:
        sys.setprofile(None)
    return trace


@pytest.mark.parametrize("flags", [("--model", "dlr"), ("--model", "dlr", "--spt", "--pretrain-epochs", "1"),
                                   ("--model", "transformer", "--spt", "--pretrain-epochs", "1", "--objective", "rtd")],
                         ids=["finetune", "masked-spt", "rtd-spt"])
def test_one_training_step_reads_train_py_and_two_files_steps_and_denoise_besides_the_models_forward(data_dir, tmp_path, flags,
                                                                                          capsys):
    trace = step_files(data_dir, tmp_path, *flags)
    assert trace.phases == 1 + ("--spt" in flags), f"the trace saw {trace.phases} first steps"
    assert trace.step == {"lab/steps.py", "denoise.py"}, f"one step of {flags} reads {sorted(trace.step)}"
    assert {"models.py"} <= trace.model, trace.model           # the model's forward: the heads and the backbone's files
    with capsys.disabled():
        print(f"\n  one step ({' '.join(flags)}): {' + '.join(sorted(trace.step))}; "
              f"the model's forward and the optimiser: {' + '.join(sorted(trace.model))}")


# ---- a fork cannot shadow a name -----------------------------------------------------------------------------------

def test_a_fork_that_reassigns_a_built_in_model_or_objective_or_names_a_field_like_a_run_flag_stops_in_one_line(
        monkeypatch, capsys):
    import dataclasses
    cases = [("MODELS['dlr'] replaced", lambda: monkeypatch.setitem(models.MODELS, "dlr", models.MODELS["s4"]),
              "MODELS['dlr'] was replaced"),
             ("OBJECTIVES['masked'] replaced", lambda: monkeypatch.setitem(
                 models.OBJECTIVES, "masked", models.OBJECTIVES["span"]), "OBJECTIVES['masked'] was replaced")]
    Warm = dataclasses.make_dataclass("WarmConfig", [("warmup", int, dataclasses.field(default=3))],
                                      bases=(models.MODELS["dlr"].Config,))     # made at run time: no source either
    cases.append(("a field named warmup", lambda: monkeypatch.setitem(
        models.MODELS, "warm", models.Model(Warm, models.MODELS["dlr"].build, set())),
        "config field 'warmup' has the name of train.py's run flag --warmup"))
    for what, patch, says in cases:
        with monkeypatch.context() as m:
            monkeypatch = m
            patch()
            capsys.readouterr()
            with pytest.raises(SystemExit) as e:
                train.parse_flags(["--help"])
            err = capsys.readouterr().err.strip().splitlines()
            assert e.value.code == 2 and len(err) == 1 and says in err[0], (what, err)
    # a config class whose source cannot be read still gives its flags (with empty help)
    Plain = dataclasses.make_dataclass("PlainConfig", [("r_min", float, dataclasses.field(default=0.5))],
                                       bases=(models.MODELS["dlr"].Config,))
    with monkeypatch.context() as m:
        m.setitem(models.MODELS, "plain", models.Model(Plain, models.MODELS["dlr"].build, set()))
        args, _, _ = train.parse_flags(["--model", "plain", "--r-min", "0.25"])
        assert args.r_min == 0.25
