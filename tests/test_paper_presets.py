"""Facts about `--preset paper` (the paper's Tables 2, 4, 5 and the authors' configs; lab/presets.py; `python lab/presets.py` prints them): every paper-scale
classifier train.py builds has the parameter count printed in the README ("Paper-preset model sizes"), and runs one
forward and backward pass with a finite loss and finite gradients. The pass is at a reduced length (L = 128, B = 2) on
CPU, so the GPU-sized models are checked in seconds."""
import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

import denoise
import lra_data
import models
from lab import presets
from lab import steps
import train
from conftest import settled

README = Path(__file__).resolve().parents[1] / "docs" / "presets.md"
HEADING = "Paper-preset model sizes"
L = 128                                   # reduced length of the forward/backward check (the paper's: 1,024 … 65,536)
MODEL_NAMES = {m: m.upper() if len(m) <= 3 else m.capitalize()      # the models with paper values, as headed
               for m, entry in train.MODELS.items() if presets.paper_of(m, entry)}

# Parameters of Classifier(backbone + head) that `--preset paper` builds, the README table's numbers. They change
# only when a model file, the head or PAPER_* in train.py change; then update both this table and the README.
EXPECTED_PARAMS = {
    ("transformer", "listops"): 18_930_186, ("transformer", "text"): 19_049_474,
    ("transformer", "retrieval"): 892_546, ("transformer", "image"): 101_386,
    ("transformer", "pathfinder"): 399_234, ("transformer", "pathx"): 399_234, ("transformer", "pathx256"): 399_234,
    ("s4", "listops"): 797_322, ("s4", "text"): 1_651_202, ("s4", "retrieval"): 1_913_602, ("s4", "image"): 4_746_762,
    ("s4", "pathfinder"): 1_585_410, ("s4", "pathx"): 1_585_410, ("s4", "pathx256"): 1_585_410,
    ("dlr", "listops"): 4_498_314, ("dlr", "text"): 7_177_730, ("dlr", "retrieval"): 7_440_130,
    ("dlr", "image"): 15_776_266, ("dlr", "pathfinder"): 7_111_938, ("dlr", "pathx"): 7_111_938,
    ("dlr", "pathx256"): 7_111_938,
}
CASES = sorted(EXPECTED_PARAMS, key=lambda c: (list(train.MODELS).index(c[0]), list(lra_data.TASKS).index(c[1])))


def paper_config(model, task):
    """The model config of `--model model --task task --preset paper` (no size flags, not causal)."""
    return presets.config_for(model, task, presets.values_for("paper", model, task, spt=False))


def paper_classifier(model, task, cfg=None):
    """Classifier(backbone + head) as main() builds it, through train.build_model."""
    spec, cfg = lra_data.TASKS[task], cfg or paper_config(model, task)
    head = dict(kind="classifier", n_classes=spec.n_classes, pool=spec.pool, pair=spec.pair)
    return train.build_model(dict(model_name=model, config=dataclasses.asdict(cfg), head=head))


def short_batch(task, B, gen):
    """A clean batch of B random examples of length ≤ L from the task's raw format (uint8 pixels; ids with padding:
    the second example is 17 shorter; retrieval pairs of two documents), as the loader's collate gives the step."""
    spec = lra_data.TASKS[task]
    if spec.kind == "pixels":
        xs = [torch.randint(0, 256, (L,), generator=gen, dtype=torch.uint8) for _ in range(B)]         # (L,) each
    else:
        ids = lambda n: torch.randint(lra_data.N_SPECIAL, spec.vocab_size, (n,), generator=gen)        # (n,) real ids
        doc = (lambda n: torch.stack([ids(n), ids(n)])) if spec.pair else ids                          # (2, n) or (n,)
        xs = [doc(L - 17 * b) for b in range(B)]
    return steps.collate([(x, b % spec.n_classes) for b, x in enumerate(xs)], task)


@pytest.mark.parametrize("model, task", CASES)
def test_paper_preset_parameter_count_matches_the_table(model, task):
    classifier = paper_classifier(model, task)
    n = sum(p.numel() for p in classifier.parameters())
    assert n == EXPECTED_PARAMS[model, task], (f"{model}/{task} --preset paper has {n:,} parameters, the table says "
                                               f"{EXPECTED_PARAMS[model, task]:,}: "
                                               "update EXPECTED_PARAMS and the README")


@pytest.mark.parametrize("model, task", CASES)
def test_paper_preset_model_trains_one_step_at_reduced_length(model, task):
    """One fine-tuning batch through denoise.labelled and batch_loss (raw batch -> model input -> cross-entropy),
    then backward: the loss and every parameter's gradient are finite. PathX models switch to block-local attention
    at L ≥ 16,384 (blocks of 4,096); here they switch at L = 128 with blocks of 32 (the same ratio), so that path is
    the one run. Block sizes are not parameters: the count is the paper model's."""
    torch.manual_seed(0)
    cfg = paper_config(model, task)
    if model == "transformer" and cfg.local_min_len <= lra_data.TASKS[task].max_len:   # PathX, PathX-256
        cfg = dataclasses.replace(cfg, block_size=L * cfg.block_size // cfg.local_min_len, local_min_len=L)
    classifier = paper_classifier(model, task, cfg).train()
    batch = denoise.labelled(short_batch(task, 2, torch.Generator().manual_seed(0)), None, 0.0,
                             lra_data.TASKS[task].pair)
    loss, _ = denoise.batch_loss(classifier, batch)
    loss.backward()
    assert math.isfinite(loss.item()), f"{model}/{task}: loss {loss.item()} at L = {L}"
    missing = [name for name, p in classifier.named_parameters() if p.grad is None]
    assert not missing, f"{model}/{task}: no gradient reached {missing[:5]}"
    bad = [name for name, p in classifier.named_parameters() if not p.grad.isfinite().all()]
    assert not bad, f"{model}/{task}: non-finite gradients in {bad[:5]}"


def readme_block():
    """The README section this file checks, rendered from EXPECTED_PARAMS and the preset's layers × width."""
    size = lambda m, t: "{n_layers}×{d_model}".format(**presets.values_for("paper", m, t, spt=False))
    rows = [f"| {t} | " + " | ".join(f"{EXPECTED_PARAMS[m, t]:,} ({size(m, t)})" for m in MODEL_NAMES) + " |"
            for t in lra_data.TASKS]
    return "\n".join([f"## {HEADING}", "", "| task | " + " | ".join(MODEL_NAMES.values()) + " |",
                      "|---" * (len(MODEL_NAMES) + 1) + "|", *rows])


def test_readme_prints_the_paper_preset_parameter_counts():
    text = README.read_text(encoding="utf-8")
    section = re.search(rf"^#+ {re.escape(HEADING)}\s*$(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    assert section, \
        f"docs/presets.md has no '{HEADING}' section; add it (from tests/test_paper_presets.py):\n{readme_block()}"
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.group(1).splitlines()
            if line.strip().startswith("|") and not set(line) <= set("|-: ")]
    assert rows, f"docs/presets.md '{HEADING}' section has no table; expected:\n{readme_block()}"
    header, body = rows[0], rows[1:]
    assert [h.lower() for h in header[1:]] == list(MODEL_NAMES), \
        f"README '{HEADING}' columns {header} are not task + {list(MODEL_NAMES.values())}"
    found = {}
    for task, *cells in body:
        for model, cell in zip(MODEL_NAMES, cells):
            cell_parts = re.fullmatch(r"([\d,]+)\s*\((\d+)\s*×\s*(\d+)\)", cell)
            assert cell_parts, f"README '{HEADING}', {task}/{model}: cell {cell!r} is not 'count (layers×width)'"
            n, layers, width = cell_parts.groups()
            found[model, task] = (int(n.replace(",", "")), int(layers), int(width))
    want = {c: (EXPECTED_PARAMS[c], *(presets.values_for("paper", *c, spt=False)[k] for k in ("n_layers", "d_model")))
            for c in EXPECTED_PARAMS}
    diff = {c: (found.get(c), want.get(c)) for c in want.keys() | found.keys() if found.get(c) != want.get(c)}
    assert not diff, (f"README '{HEADING}' disagrees with the code, (README, code) per cell: {diff}\n"
                      f"expected:\n{readme_block()}")


def test_committed_table_of_paper_presets_and_their_sources_is_current():
    from lab import presets
    table = (README.parents[1] / "results" / "paper_presets.md").read_text(encoding="utf-8").splitlines()
    rows = presets.paper_table(train.MODELS)
    assert all(row in table for row in rows), "results/paper_presets.md is stale: python lab/presets.py --out results/paper_presets.md"
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(cells) and "None" not in cells and ":" in cells[-1], f"a value or its source is missing: {row}"


@pytest.mark.parametrize("model, task", CASES)
def test_paper_preset_micro_batch_keeps_the_papers_batch(model, task):
    # accumulation splits a step, never changes it: micro-batches of at most the batch, as many as the batch needs
    for spt in (False, True):
        v = presets.values_for("paper", model, task, spt)
        for batch, accum in (("batch_size", "accum_steps"), ("pretrain_batch_size", "pretrain_accum_steps")):
            assert 1 <= v[accum] <= v[batch], f"{model}/{task}: {accum} {v[accum]} for {batch} {v[batch]}"


def test_an_explicit_batch_size_is_split_to_the_micro_batch_that_fits_not_the_presets_count(monkeypatch):
    import torch
    from lab import steps
    from lab import memory
    monkeypatch.setattr(memory, "card_memory", lambda device: (80 * 2**30, 80 * 2**30))     # an 80 GB card

    def settings(*flags):
        args, cfg = settled(["--model", "s4", "--task", "retrieval", "--preset", "paper", *flags])
        args.precision = "bf16"
        memory.plan_memory(args, dict(config=dataclasses.asdict(cfg)), torch.device("cuda"), 1)
        return args.batch_size, args.accum_steps

    batch, accum = settings()
    assert settings("--batch-size", str(4 * batch))[1] > accum, "a larger batch needs more micro-batches"
    assert settings("--batch-size", "2") == (2, 1), "a batch that fits needs no split"
    assert settings("--batch-size", str(4 * batch), "--accum-steps", "8") == (4 * batch, 8), "an explicit count wins"

