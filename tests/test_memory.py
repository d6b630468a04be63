"""Facts about memory.py: the counter counts each storage once and forgets it when freed, the estimate from one and two
layers equals the whole model's, it matches real CPU training steps, and every --preset paper run fits 80 GB."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lra_data
import models
from tools import memory
import train


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
        values = models.preset_values("paper", model_name, task, phase == "spt")   # S4 ListOps: 8 post-norm layers
        cased = memory.training_case(model_name, task, values, phase, 2, 256)
        whole = memory.simulated_peak(*cased, "bf16")
        est = memory.training_memory(model_name, task, values, phase, 2, 256, "bf16")
        assert (est["n_params"], est["step"]) == (whole[0], whole[2]), f"{model_name}: {est} vs the whole {whole}"


def test_memory_estimate_matches_measured_peak_within_25_percent():
    rows = memory.memory_check()
    bad = [r for r in rows if not 0.75 <= r["est_mib"] / r["measured_mib"] <= 1.25]
    assert not bad, f"estimate and real CPU step disagree by more than 25 %: {bad}"


def test_every_paper_preset_fits_80_gb_in_bf16_as_configured():
    too_big = []
    for model_name in train.MODELS:
        for task in lra_data.TASKS:
            for phase in memory.PHASES:
                est = memory.paper_memory(model_name, task, phase, "bf16")
                if not est["fits"]:
                    too_big.append(f"{model_name}/{task}/{phase}: {est['gib']:.1f} GiB at micro-batch "
                                   f"{est['micro_batch']} (batch {est['batch']}, accum_steps {est['accum_steps']})")
    assert not too_big, (f"over {memory.HEADROOM:.0%} of {memory.GPU_GIB} GiB in bf16 (raise accum_steps in "
                         f"presets.py; `python bench.py --memory` prints the smallest that fits): {too_big}")
