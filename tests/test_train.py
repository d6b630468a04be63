"""Facts about train.py: every model trains with and without --spt on generated data, the pre-trained backbone is
really the one fine-tuned, checkpoints reload exactly, optimiser groups are a partition. Long runs (DDP, resume, NaN
guard, bad input, --compile, memory): tests/test_robustness.py."""
import argparse
import contextlib
import dataclasses
import json
import math
import pickle
from functools import partial

import pytest
import torch

import denoise
import lra_data
import models
from lra.listops import generate_listops
from lab import steps
import train
from conftest import records, run

from lab import presets

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Generated data in the release formats, made once for this file: 200 Pathfinder images (32 px, hard) and 280
    ListOps trees of 30..200 tokens (the LRA generator with a shorter length window, so tests stay fast)."""
    root = tmp_path_factory.mktemp("data")
    generate_listops(root, 200, 40, 40, min_length=30, max_length=200)
    lra_data.load("pathfinder", "train", lra_data.Files(root, generate=200, workers=1))
    return root


@pytest.fixture(scope="module")
def fake_release(tmp_path_factory):
    """Random stand-ins in the official formats for the tasks with no generator: AAN retrieval TSVs (label written
    as 1.0, as in the release) and CIFAR-10 python batches. They exercise the two-tower head and the L1 pixel head."""
    root, gen = tmp_path_factory.mktemp("release"), torch.Generator().manual_seed(0)
    text = lambda: bytes(torch.randint(97, 123, (int(torch.randint(20, 80, (1,), generator=gen)),),
                                       generator=gen).tolist()).decode()
    (root / "tsv_data").mkdir()
    for name, n in (("train", 32), ("eval", 8), ("test", 8)):
        rows = [f"{i % 2}.0\tid{i}a\tid{i}b\t{text()}\t{text()}\n" for i in range(n)]
        (root / "tsv_data" / f"new_aan_pairs.{name}.tsv").write_text("".join(rows))
    (root / "cifar-10-batches-py").mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": torch.randint(0, 256, (8, 3072), generator=gen, dtype=torch.uint8).numpy(),
                 b"labels": list(range(8))}
        (root / "cifar-10-batches-py" / name).write_bytes(pickle.dumps(batch))
    return root


def train_losses(run_dir, phase):
    return [r["train_loss"] for r in records(run_dir) if r["phase"] == phase]


# --preset paper at test size: only the model config keeps the paper's choices (here: S4's BatchNorm on ListOps)
SMALL_PAPER = ["--d-model", "16", "--n-layers", "1", "--d-state", "16", "--batch-size", "16",
               "--pretrain-batch-size", "16", "--epochs", "1", "--pretrain-epochs", "1", "--max-train", "16",
               "--max-eval", "8", "--generate", "0"]


@pytest.mark.parametrize("model", list(train.MODELS))
@pytest.mark.parametrize("task", ["pathfinder", "listops"])
def test_tiny_spt_run_completes_and_denoising_loss_drops(model, task, data_dir, tmp_path):
    results, run_dir = run(data_dir, tmp_path, "--model", model, "--task", task, "--spt", "--pretrain-epochs", "3",
                           "--epochs", "1")
    losses = train_losses(run_dir, "spt")
    assert losses[-1] < losses[0], f"{model}/{task}: SPT training loss did not drop: {losses}"
    assert all(map(math.isfinite, train_losses(run_dir, "finetune"))), "fine-tuning after SPT gave a non-finite loss"
    assert 0 <= results["test_acc"] <= 1 and results["spt_val_metric"]["name"] == "val_loss"
    assert {p.name for p in run_dir.iterdir()} >= {"config.json", "log.jsonl", "spt.pt", "best.pt", "results.json"}


@pytest.mark.parametrize("model", list(train.MODELS))
@pytest.mark.parametrize("task", ["pathfinder", "listops"])
def test_tiny_run_from_scratch_completes(model, task, data_dir, tmp_path):
    results, run_dir = run(data_dir, tmp_path, "--model", model, "--task", task, "--epochs", "3")
    losses = train_losses(run_dir, "finetune")
    assert results["spt_val_metric"] is None and not (run_dir / "spt.pt").exists()
    if task == "listops":
        assert losses[-1] < losses[0], f"{model}/listops: training loss did not drop: {losses}"
    else:
        # Pathfinder from scratch sits at the class prior (≈ ln 2) for many steps: the paper's point; only check sanity
        assert all(abs(loss - math.log(2)) < 0.3 for loss in losses), \
            f"{model}/pathfinder: loss left the ln 2 plateau oddly: {losses}"


@pytest.mark.parametrize("model", list(train.MODELS))
@pytest.mark.parametrize("objective, task", [("span", "listops"), ("rtd", "listops"), ("span", "pathfinder"),
                                             ("rtd", "pathfinder")])
def test_tiny_run_of_each_new_objective_pre_trains_fine_tunes_and_tests(model, objective, task, data_dir, tmp_path):
    results, run_dir = run(data_dir, tmp_path, "--model", model, "--task", task, "--spt", "--objective", objective,
                           "--pretrain-epochs", "3", "--epochs", "1")
    losses = train_losses(run_dir, "spt")
    assert losses[-1] < losses[0], f"{model}/{objective}/{task}: SPT training loss did not drop: {losses}"
    assert results["spt_objective"]["objective"] == objective and 0 <= results["test_acc"] <= 1
    assert "loaded backbone from" in (run_dir / "log.txt").read_text()
    if objective == "rtd":   # the generator is dropped: fine-tuning checkpoints hold the classifier only
        keys = torch.load(run_dir / "best.pt", weights_only=True)["model"]
        assert not any(k.startswith(("generator", "gen_head", "disc_head")) for k in keys)
        assert {"gen_width", "gen_layers", "rtd_weight", "gdes"} <= set(results["spt_objective"])


@pytest.mark.parametrize("task", ["retrieval", "image"])
def test_tiny_spt_run_on_retrieval_pairs_and_image_values(task, fake_release, tmp_path):
    results, run_dir = run(fake_release, tmp_path, "--model", "dlr", "--task", task, "--spt",
                           "--pretrain-epochs", "3", "--epochs", "1")
    losses = train_losses(run_dir, "spt")
    assert losses[-1] < losses[0], f"{task}: SPT training loss did not drop: {losses}"
    metric = "r2" if task == "image" else "acc"                          # Image is regressed (L1), with R²
    assert metric in results["spt_val_metric"], f"{task}: SPT metrics {results['spt_val_metric']} lack {metric}"


@pytest.mark.parametrize("model", list(train.MODELS))
def test_tiny_causal_spt_run_with_a_causal_model(model, data_dir, tmp_path):
    results, run_dir = run(data_dir, tmp_path, "--model", model, "--task", "listops", "--spt", "--objective", "causal",
                           "--causal", "--pool", "last", "--pretrain-epochs", "3", "--epochs", "1")
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert config.get("causal", not config.get("bidirectional")), f"{model} was not built causal: {config}"
    losses = train_losses(run_dir, "spt")
    assert losses[-1] < losses[0], f"{model}: next-token training loss did not drop: {losses}"


def test_fine_tuning_starts_from_the_pre_trained_backbone(data_dir, tmp_path, monkeypatch):
    # the classifier's weights right after loading (before any fine-tuning step) must be exactly spt.pt's backbone
    loaded, load_backbone = {}, models.load_backbone
    def spy(model, state):
        out = load_backbone(model, state)
        loaded.update({k: v.clone() for k, v in model.state_dict().items()})
        return out
    monkeypatch.setattr(models, "load_backbone", spy)
    results, run_dir = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--spt", "--epochs", "1",
                           "--pretrain-epochs", "2")
    spt = torch.load(run_dir / "spt.pt", weights_only=True)["model"]
    best = torch.load(run_dir / "best.pt", weights_only=True)["model"]
    backbone = [k for k in spt if k.startswith("backbone.")]
    assert backbone and backbone == [k for k in loaded if k.startswith("backbone.")], "backbone keys differ"
    for k in backbone:
        assert torch.equal(spt[k], loaded[k]), f"{k} in the fine-tuned model is not the pre-trained tensor"
    assert "denoise_head.weight" in spt and "head.weight" in best and "denoise_head.weight" not in best


def test_saved_checkpoint_reloads_to_identical_logits_and_test_accuracy(data_dir, tmp_path):
    results, run_dir = run(data_dir, tmp_path, "--model", "s4", "--task", "pathfinder", "--epochs", "1")
    model, ck = train.load_model(run_dir / "best.pt")
    assert not any("_orig_mod." in k for k in ck["model"]), "checkpoint keys carry a torch.compile prefix"
    again, _ = train.load_model(run_dir / "best.pt")
    test = lra_data.load("pathfinder", "test", data_dir)
    x, lengths, y = lra_data.collate([test[i] for i in range(8)])
    x = models.model_input(x, "pathfinder")                                     # (B, L, 2)
    with torch.no_grad():
        assert torch.equal(model(x, lengths), again(x, lengths)), "two loads of one checkpoint disagree"
    # as train.py picks them
    keep = torch.randperm(len(test), generator=torch.Generator().manual_seed(0))[: ck["args"]["max_eval"]]
    subset = torch.utils.data.Subset(test, keep.sort().values.tolist())
    loader = torch.utils.data.DataLoader(subset, 16, collate_fn=partial(steps.collate, task="pathfinder"))
    phase = train.Phase("finetune", 1, 0.0, 16, 1, "best.pt", "acc", denoise.labelled, denoise.batch_loss,
                        denoise.metrics)
    acc = steps.evaluate(model, phase, loader, 0, contextlib.nullcontext)["acc"]
    assert acc == results["test_acc"], f"reloaded best.pt scores {acc} on test, the run reported {results['test_acc']}"


@pytest.mark.parametrize("model", list(train.MODELS))
def test_one_batch_overfits(model):
    torch.manual_seed(0)
    Config, ssm_names = train.MODELS[model].Config, train.MODELS[model].ssm_params
    small = dict(d_model=32, n_layers=2, d_state=16, dropout=0.0, vocab_size=19)
    config = Config(**{k: v for k, v in small.items() if k in {f.name for f in dataclasses.fields(Config)}})
    meta = dict(model_name=model, config=dataclasses.asdict(config),
                head=dict(kind="classifier", n_classes=10, pool="mean", pair=False))
    net = train.build_model(meta)
    x, y = torch.randint(4, 19, (8, 32)), torch.arange(8) % 10               # (B, L) ids, (B,) labels
    lengths = torch.tensor([32, 30, 25, 20, 32, 17, 10, 32])
    opt = torch.optim.AdamW(steps.param_groups(net, 3e-3, 0.0, 3e-3, ssm_names))
    losses = []
    for _ in range(50):
        loss = torch.nn.functional.cross_entropy(net(x, lengths), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], f"{model}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in 50 steps on one batch"


@pytest.mark.parametrize("model", list(train.MODELS))
def test_param_groups_put_each_parameter_in_exactly_one_group(model):
    Config, Model, ssm_names = train.MODELS[model][:3]
    cfg = Config(d_model=16, n_layers=2, vocab_size=19)
    net = models.Classifier(Model(cfg), 16, 10, "mean", pair=False)
    groups = steps.param_groups(net, 1e-3, 0.05, 1e-4, ssm_names)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)), "a parameter sits in two groups"
    assert set(ids) == {id(p) for p in net.parameters()}, "a parameter is in no group"
    names = {id(p): n for n, p in net.named_parameters()}
    for g in groups:
        for p in g["params"]:
            leaf = names[id(p)].rsplit(".", 1)[-1]
            if leaf in ssm_names:
                assert g["weight_decay"] == 0 and g["lr"] == 1e-4, \
                    f"SSM parameter {names[id(p)]} has the global lr/decay"
            elif leaf == "bias" or "norm" in names[id(p)] or "encoder" in names[id(p)]:
                assert g["weight_decay"] == 0, f"{names[id(p)]} (bias, norm or embedding) gets weight decay"
    assert any(g["weight_decay"] > 0 for g in groups), "nothing gets weight decay"


def test_pooling_a_row_without_real_positions_gives_zeros_not_a_pad_or_minus_infinity():
    h = torch.randn(2, 5, 3)                                                  # (B, L, D)
    lengths = torch.tensor([0, 5])                                            # row 0: no real position at all
    for how in ("mean", "max", "last"):
        z = models.pool(h, lengths, how)
        assert torch.equal(z[0], torch.zeros(3)), f"{how} pooling of an empty row gave {z[0].tolist()}"
        assert z.isfinite().all()


def test_pooling_reads_real_positions_only():
    h = torch.randn(2, 5, 3)                                                  # (B, L, D)
    lengths = torch.tensor([3, 5])
    spoiled = h.clone()
    spoiled[0, 3:] = 1e6                                                     # pads of row 0
    for how in ("mean", "max", "last"):
        assert torch.equal(models.pool(h, lengths, how), models.pool(spoiled, lengths, how)), f"{how} pooling reads pads"
    torch.testing.assert_close(models.pool(h, lengths, "mean")[0], h[0, :3].mean(0))


def test_load_backbone_refuses_any_unexpected_difference():
    Config, Model = train.MODELS["dlr"][:2]
    cfg = Config(d_model=8, n_layers=1, d_state=4, vocab_size=19)
    source = models.Denoiser(Model(cfg), 8, 19).state_dict()
    target = models.Classifier(Model(cfg), 8, 10, "mean", pair=False)
    dropped, new = models.load_backbone(target, source)
    assert dropped == ["denoise_head.bias", "denoise_head.weight"] and new == ["head.bias", "head.weight"]
    missing_one = {k: v for k, v in source.items() if k != "backbone.encoder.weight"}
    with pytest.raises(RuntimeError, match="encoder"):
        models.load_backbone(target, missing_one)
    with pytest.raises(RuntimeError, match="extra"):
        models.load_backbone(target, {**source, "backbone.extra": torch.zeros(1)})


def test_init_from_fine_tunes_a_saved_backbone(data_dir, tmp_path):
    _, first = run(data_dir, tmp_path / "a", "--model", "dlr", "--task", "listops", "--spt", "--pretrain-epochs", "1",
                   "--epochs", "1")
    results, again = run(data_dir, tmp_path / "b", "--model", "dlr", "--task", "listops", "--epochs", "1",
                         "--init-from", str(first / "spt.pt"))
    assert "loaded backbone from" in (again / "log.txt").read_text() and again.name.startswith("listops-dlr-init")


def test_eval_every_evaluates_every_kth_epoch_and_after_the_last(data_dir, tmp_path):
    results, run_dir = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--epochs", "5",
                           "--eval-every", "2")
    rows = records(run_dir)
    assert [r["epoch"] for r in rows if r["phase"] == "finetune"] == [2, 4, 5]
    assert [r["step"] for r in rows if r["phase"] == "finetune"] == [2, 4, 5], "16 examples = one step an epoch"
    assert (run_dir / "best.pt").is_file() and results["best_epoch"] in (2, 4, 5)


def test_metrics_over_batches_equal_metrics_over_everything():
    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(100, 10, generator=gen), torch.randint(0, 10, (100,), generator=gen)
    stats = lambda a, b: denoise.statistics(a, b, denoise.losses(a, b), torch.ones(b.shape))
    whole = denoise.metrics(stats(logits, target))
    parts = denoise.metrics(denoise.add(stats(logits[:37], target[:37]), stats(logits[37:], target[37:])))
    assert abs(whole["loss"] - parts["loss"]) < 1e-5 and whole["acc"] == parts["acc"], f"{whole} != {parts}"
    torch.testing.assert_close(whole["loss"], torch.nn.functional.cross_entropy(logits, target).item())


def test_image_targets_are_normalised_values_scored_by_l1_and_r2():
    x = torch.randint(0, 256, (2, 1024), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    value, target = lra_data.clean_input(x, "image")
    assert torch.equal(value, target) and target.dtype == torch.float32, "Image targets are the normalised values"
    t, ones = target[0], torch.ones(1024)                                     # (L,) float
    stats = lambda pred: denoise.statistics(pred, t, denoise.losses(pred, t), ones)
    perfect = denoise.metrics(stats(t[:, None].clone()))
    mean = denoise.metrics(stats(torch.full((1024, 1), t.mean().item())))
    assert perfect["loss"] < 1e-6 and abs(perfect["r2"] - 1) < 1e-6, f"perfect prediction scored {perfect}"
    assert abs(mean["r2"]) < 1e-4, f"predicting the mean must give R² ≈ 0, got {mean['r2']:.4f}"
    assert models.n_outputs("pathfinder") == 256 and models.n_outputs("image") == 1


def test_pathfinder_targets_are_grey_levels_and_inputs_are_scaled_to_plus_minus_one():
    x = torch.randint(0, 256, (2, 1024), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    value, target = lra_data.clean_input(x, "pathfinder")
    assert target.dtype == torch.long and torch.equal(target, x.long()), "Pathfinder targets are grey levels 0..255"
    torch.testing.assert_close(value, x.float() / 255 * 2 - 1)


def test_masked_spt_never_masks_the_eos_token(data_dir):
    # EOS is the last real token of every sequence: predicting it is trivial, so it is never a masked position
    data = lra_data.load("listops", "train", data_dir)
    batch = lra_data.collate([data[i] for i in range(16)])
    x, lengths, _ = batch
    eos = torch.arange(x.size(1))[None, :] == (lengths - 1)[:, None]          # (B, L)
    assert (x[eos] == lra_data.EOS).all()
    for seed in range(20):                                 # many draws at a ratio so high that EOS would be hit
        clean = steps.collate([data[i] for i in range(16)], "listops")
        b = denoise.masked(clean, argparse.Namespace(mask_ratio=0.9), torch.Generator().manual_seed(seed), 0.0)
        mask = b.weight.bool()
        assert not (mask & eos).any(), "an EOS position was masked"
        assert mask.any(1).all() and (b.x[mask] == lra_data.MASK).all()


def test_causal_run_of_a_batchnorm_preset_uses_layernorm_and_says_so(data_dir, tmp_path):
    # BatchNorm statistics over the time axis let earlier positions see later ones in training: causal runs switch
    results, run_dir = run(data_dir, tmp_path, "--model", "s4", "--task", "listops", "--spt", "--objective", "causal",
                           "--causal", "--preset", "paper", *SMALL_PAPER, "--device", "cpu")
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert config["norm"] == "layer" and not config["bidirectional"], config
    assert "LayerNorm instead of the preset's BatchNorm" in (run_dir / "log.txt").read_text()


@pytest.mark.parametrize("model", list(train.MODELS))
def test_residual_stream_dtype_is_the_same_on_a_pixel_and_a_token_task_under_autocast(model):
    # the pixel encoder is a Linear (autocast: bf16), the token encoder an Embedding (float32): both must give one dtype
    seen = {}
    for task, x in (("pathfinder", torch.randn(2, 32, 2)), ("listops", torch.randint(4, 19, (2, 32)))):
        cfg = presets.config_for(model, task, dict(d_model=16, n_layers=2, d_state=8, n_heads=2, d_ff=32,
                                                   dropout=0.0))
        net = train.MODELS[model].build(cfg)
        dtypes = []
        for layer in net.layers:
            layer.register_forward_hook(lambda mod, inp, out: dtypes.append((inp[0].dtype, out.dtype)))
        with torch.autocast("cpu", torch.bfloat16):
            net(x)
            assert net.encoder(x).dtype == (torch.bfloat16 if task == "pathfinder" else torch.float32), \
                "autocast did not cast the pixel encoder: the test proves nothing"
        seen[task] = set(dtypes)
    assert seen["pathfinder"] == seen["listops"] == {(torch.float32, torch.float32)}, seen


# ---- SPT to convergence (--pretrain-patience) ----------------------------------------------------------------------

PATIENCE = ["--model", "dlr", "--task", "listops", "--spt", "--pretrain-epochs", "8", "--epochs", "1",
            "--pretrain-lr", "3e-2"]   # 1 step an epoch; at this lr the SPT val loss bottoms out within 8 epochs


def stop_epoch(losses, patience):
    """Early stopping by hand: the epoch after which `patience` evaluations in a row had not beaten the best (one
    evaluation an epoch), or None."""
    best, stale = math.inf, 0
    for epoch, loss in enumerate(losses, 1):
        best, stale = (loss, 0) if loss < best else (best, stale + 1)
        if stale == patience:
            return epoch
    return None


def spt_records(run_dir):
    return [r for r in records(run_dir) if r["phase"] == "spt"]


@pytest.fixture(scope="module")
def unstopped(data_dir, tmp_path_factory):
    """The run without patience: every SPT epoch up to the cap."""
    return run(data_dir, tmp_path_factory.mktemp("unstopped"), *PATIENCE)


def test_pretrain_patience_stops_at_the_epoch_early_stopping_names(unstopped, data_dir, tmp_path):
    losses = [r["val_loss"] for r in spt_records(unstopped[1])]
    expected = stop_epoch(losses, 2)
    assert expected is not None and expected < 8, f"the setting must stop early to test anything: {losses}"
    results, run_dir = run(data_dir, tmp_path, *PATIENCE, "--pretrain-patience", "2")
    got = spt_records(run_dir)
    assert [r["epoch"] for r in got] == list(range(1, expected + 1)), f"stopped after {len(got)}, not {expected}"
    assert [r["val_loss"] for r in got] == losses[:expected], "patience changed the epochs before the stop"
    assert (results["spt_epochs"], results["spt_stopped_early"]) == (expected, True)
    assert results["spt_val_metric"]["value"] == min(losses), "fine-tuning must start from the best SPT epoch"
    assert f"spt: stopped after epoch {expected}/8" in (run_dir / "log.txt").read_text()
    assert (unstopped[0]["spt_epochs"], unstopped[0]["spt_stopped_early"]) == (8, False)


@pytest.mark.parametrize("kill_at", [6, 8])   # the 6th step: SPT epoch 6, before the stop; the 8th: fine-tuning
def test_a_patience_run_resumed_mid_way_logs_what_an_uninterrupted_one_logs(kill_at, data_dir, tmp_path, monkeypatch):
    full, full_dir = run(data_dir, tmp_path / "full", *PATIENCE, "--pretrain-patience", "2")
    assert full["spt_epochs"] == 7, "this test is set up for a stop after SPT epoch 7 (6 and 7 not better than 5)"
    calls, step = [], steps.guard_step

    def killed(*a):                                      # the kill_at-th optimiser step is hit by a Ctrl-C
        calls.append(1)
        if len(calls) == kill_at:
            raise KeyboardInterrupt
        return step(*a)
    monkeypatch.setattr(steps, "guard_step", killed)
    with pytest.raises(SystemExit):
        run(data_dir, tmp_path / "cut", *PATIENCE, "--pretrain-patience", "2")
    monkeypatch.setattr(steps, "guard_step", step)
    cut_dir = next((tmp_path / "cut").iterdir())
    resumed = train.main(["--resume", str(cut_dir)])
    times = ("elapsed_s", "wall_time_s")                  # the clock's, not the run's
    strip = lambda d: [{k: v for k, v in r.items() if k not in times} for r in records(d)]  # noqa: E731
    assert strip(cut_dir) == strip(full_dir), "the resumed run's log.jsonl differs from the uninterrupted one's"
    for key in ("spt_epochs", "spt_stopped_early", "test_acc", "best_val_acc", "spt_val_metric"):
        assert resumed[key] == full[key], f"{key}: resumed {resumed[key]} vs uninterrupted {full[key]}"


def test_help_shows_a_default_on_every_flag_the_range_of_every_ranged_flag_and_runnable_examples(capsys):
    with pytest.raises(SystemExit) as stop:
        train.parse_flags(["--help"])
    text = capsys.readouterr().out
    assert stop.value.code == 0
    body, epilog = text.split("\nexamples:\n")
    blocks = {}                                   # "--flag" -> its help text, as printed
    for line in body.split("\noptions:\n")[1].splitlines():
        if line.startswith("  -"):
            name = line.split()[0].rstrip(",")
            blocks[name] = line
        else:
            blocks[name] += " " + line.strip()
    blocks.pop("-h")
    assert len(blocks) > 40, blocks.keys()
    no_default = [k for k, v in blocks.items() if "default" not in v]
    assert not no_default, f"flags whose --help names no default: {no_default}"
    for name, help_text in (("--lr", "must be > 0"), ("--data-fraction", "must be in (0, 1]"),
                            ("--max-eval", "must be at least 0"), ("--seed", "default: 0")):
        assert help_text in " ".join(blocks[name].split()), blocks[name]
    examples = [line.split("#")[0].split()[2:] for line in epilog.splitlines()
                if line.strip().startswith("python train.py")]
    assert len(examples) == 3, epilog
    for argv in examples:                         # each example parses as printed
        args = train.parse_flags(argv)[0]
        assert args.resume or args.spt, argv
    assert "need a download" in epilog and "lra_data.py --check" in epilog


def test_settings_line_shows_the_ssm_lr_in_use_and_max_eval_beyond_a_split_says_so(tmp_path):
    root = tmp_path / "data"
    generate_listops(root, 30, 2, 2, min_length=30, max_length=120)
    results, run_dir = run(root, tmp_path, "--task", "listops", "--model", "dlr", "--epochs", "1")
    log = (run_dir / "log.txt").read_text()
    settings = next(line for line in log.splitlines() if line.startswith("settings:"))
    assert "ssm_lr=0.0001" in settings and "ssm_lr=None" not in settings, settings
    note = "at most 8 val examples asked for (--max-eval), but the val split has 2 examples: all of them used"
    assert f"data note: {note}" in log and note in results["data_notes"], results["data_notes"]
