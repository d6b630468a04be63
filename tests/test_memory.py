"""Facts about memory.py: the counter counts each storage once and forgets it when freed, the estimate from one and two
layers equals the whole model's, it matches real CPU training steps, and the plan of every --preset paper run fits a
simulated 80 GB and 141 GB card in micro-batches of the paper's batch."""
import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lra_data
import models
from lab import steps
from lab import memory
import train
from conftest import settled
from lab import presets


def test_live_bytes_counts_each_storage_once_and_forgets_it_when_freed():
    with FakeTensorMode():
        counter = memory.LiveBytes()
        with counter:
            a = torch.empty(1000)                                          # 4000 bytes
            view = a.view(10, 100)                                         # the same storage: no new bytes
            b = a * 2                                                      # 4000 more
            del a, view
            after_free = counter.now
    assert (counter.peak, after_free) == (8000, 4000), f"peak {counter.peak}, after free {after_free}"
    del b


def test_peak_estimated_from_one_and_two_layers_equals_the_whole_models():
    for model_name, task, phase in (("s4", "listops", "finetune"), ("transformer", "text", "spt")):
        values = presets.values_for("paper", model_name, task, phase == "spt")   # S4 ListOps: 8 post-norm layers
        cased = memory.training_case(memory.Phase(model_name, task, values, phase, 256, "bf16"), 2)
        whole = memory.simulated_peak(*cased, "bf16")
        est = memory.training_memory(memory.Phase(model_name, task, values, phase, 256, "bf16"), 2)
        assert (est["n_params"], est["step"]) == (whole[0], whole[2]), f"{model_name}: {est} vs the whole {whole}"


def test_memory_estimate_matches_measured_peak_within_25_percent():
    rows = memory.memory_check()
    bad = [r for r in rows if not 0.75 <= r["est_mib"] / r["measured_mib"] <= 1.25]
    assert not bad, f"estimate and real CPU step disagree by more than 25 %: {bad}"


PAPER = [(m, t) for m, entry in train.MODELS.items() if presets.paper_of(m, entry) for t in lra_data.TASKS]
CARDS = {"80 GB": 80 * 2**30, "141 GB (H200)": 141 * 10**9}


def planned(monkeypatch, card_bytes, *flags):
    """memory.plan_memory of `train.py --preset paper *flags` on a simulated CUDA card of card_bytes (all free) ->
    (args, record)."""
    monkeypatch.setattr(memory, "card_memory", lambda device: (card_bytes, card_bytes))
    args, cfg = settled(["--preset", "paper", *flags])
    args.precision = args.precision or "bf16"
    _, record = memory.plan_memory(args, dict(config=dataclasses.asdict(cfg)), torch.device("cuda"), 1)
    return args, record


@pytest.mark.parametrize("model_name,task", PAPER)
def test_the_plan_of_every_paper_preset_fits_each_card_with_headroom_in_micro_batches_of_the_papers_batch(
        model_name, task, monkeypatch):
    for card, total in CARDS.items():
        for spt in (False, True):
            flags = ["--model", model_name, "--task", task] + ["--spt"] * spt
            args, record = planned(monkeypatch, total, *flags)
            values = presets.values_for("paper", model_name, task, spt)
            for phase, plan in record.items():
                batch = values["pretrain_batch_size" if phase == "spt" else "batch_size"]
                where = f"{model_name} {task} {phase}{' after SPT' * (spt and phase == 'finetune')} on {card}"
                assert plan["accum_steps"] * plan["micro_batch"] == batch, f"{where}: {plan} is not the batch {batch}"
                assert plan["est_gib"] * 2**30 <= memory.HEADROOM * total, f"{where}: {plan} over the card"
                assert plan["L"] >= lra_data.TASKS[task].max_len, f"{where}: estimated below the length it runs at"


def test_a_141_gb_card_runs_whole_batches_that_an_80_gb_card_splits(monkeypatch):
    flags = ["--model", "dlr", "--task", "retrieval", "--spt"]        # fine-tuning batch 256 of two 4,096-byte documents
    small, big = (planned(monkeypatch, total, *flags)[1]["finetune"] for total in CARDS.values())
    assert small["accum_steps"] > 1 and big["accum_steps"] == 1, (small, big)
    assert small["L"] == 4096, f"Retrieval pads 4,001 tokens to 4,096, the estimate must use that: {small}"


def test_the_fp32_transformer_on_pathx256_is_split_to_fit_an_80_gb_card(monkeypatch):
    args, record = planned(monkeypatch, CARDS["80 GB"], "--model", "transformer", "--task", "pathx256", "--spt",
                           "--precision", "fp32")
    assert all(p["fits"] for p in record.values()), record
    assert args.pretrain_accum_steps == record["spt"]["accum_steps"] and args.accum_steps == record["finetune"][
        "accum_steps"], "the plan reaches the run's settings"


def test_an_explicit_accum_steps_is_kept_and_estimated(monkeypatch):
    args, record = planned(monkeypatch, CARDS["80 GB"], "--model", "dlr", "--task", "retrieval", "--accum-steps", "8")
    assert args.accum_steps == 8 and record["finetune"]["micro_batch"] == -(-args.batch_size // 8), record
    assert record["finetune"]["est_gib"] > 0, record


@pytest.mark.parametrize("objective,phase", [("masked", "spt"), ("rtd", "spt"), (None, "finetune")])
def test_the_memory_plan_and_the_training_step_take_their_batch_functions_from_one_place(objective, phase,
                                                                                         monkeypatch):
    """One batch path: the memory estimate runs the run's own objective (rtd: its generator too) through the very
    functions the step calls (models.batch_functions), never a copy of a corruption."""
    import models as objectives
    seen, real = [], models.batch_functions

    def spy(*a):
        fns = real(*a)
        seen.append(fns[:2])
        return fns
    monkeypatch.setattr(objectives, "batch_functions", spy)
    flags = {k: f.default for k, f in models.OBJECTIVES[objective].flags.items()} if objective else None
    values = {**presets.values_for("tiny", "dlr", "listops", phase == "spt"), "d_model": 8, "n_layers": 1,
              "d_state": 8}
    case = memory.Phase("dlr", "listops", values, phase, 32, "fp32", objective, flags)
    build, forward = memory.training_case(case, 2)
    model = build()
    if objective == "rtd":
        assert any("generator" in name for name, _ in model.named_modules()), "rtd's generator is in the estimate"
    calls = []
    prepare, loss = seen[-1]
    monkeypatch.setattr(objectives, "batch_functions", lambda *a: (
        lambda *b, **k: calls.append("prepare") or prepare(*b, **k),
        lambda *b, **k: calls.append("loss") or loss(*b, **k), real(*a)[2]))
    forward(model).backward()
    assert calls == [], "the estimate called its functions before the patch: they were taken once, up front"
    steps_fns = real(phase, "listops", objective or "masked", flags)[:2]
    func = lambda f: getattr(f, "func", f)                                          # noqa: E731 (a partial's own)
    assert func(prepare) is func(steps_fns[0]) and loss is steps_fns[1], (prepare, loss, steps_fns)
    if phase == "spt":           # an unset flag filled in as train.py fills it: the task's mask ratio
        assert prepare.keywords["mask_ratio"] == lra_data.TASKS["listops"].mask_ratio, prepare.keywords
