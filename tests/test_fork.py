"""Facts about forking the repo the way docs/fork.md says: a new model is its file and one MODELS entry, a new
objective its function and one OBJECTIVES entry, a new knob one Flag in an entry (here a schedule, which sees the
training progress); each one trains through the real train.main, and --preset paper says where its values come from.
The code below is the recipes' code (docs/fork.md shows it)."""
import argparse
import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn as nn

import denoise
import models
import objectives
import presets
import train
from conftest import records, run
from lra.listops import generate_listops
from ssm import SSMBackbone, vandermonde


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    generate_listops(root, 60, 9, 9, min_length=30, max_length=200)
    return root


# ---- recipe 1: add a model (an LRU-style diagonal RNN, Orvieto et al. 2023) --------------------------------------

@dataclass
class LRUConfig:
    d_model: int = 64                # H
    n_layers: int = 4
    d_state: int = 64                # N complex modes per direction, shared by the channels (as DLR)
    dropout: float = 0.1
    bidirectional: bool = True
    prenorm: bool = True
    norm: str = "layer"
    vocab_size: Optional[int] = None
    d_input: int = 1
    ssm_lr: float = 1e-3             # lr of LRU_PARAMS
    r_min: float = 0.9               # init: |λ| uniform on the ring r_min ≤ |λ| ≤ r_max
    r_max: float = 0.999


LRU_PARAMS = {"nu_log", "theta"}


class LRUKernel(nn.Module):
    """λ_n = exp(−exp(ν_n) + iθ_n), K_{h,l} = Re Σ_n W_{h,n} γ_n λ_n^l with γ_n = √(1 − |λ_n|²) (LRU's
    normalisation): DLR's Vandermonde product (ssm.vandermonde) under another parameterisation."""

    def __init__(self, cfg):
        super().__init__()
        S, N = 2 if cfg.bidirectional else 1, cfg.d_state
        u = torch.rand(S, N)                                                  # (S, N)
        self.nu_log = nn.Parameter(torch.log(-0.5 * torch.log(u * (cfg.r_max**2 - cfg.r_min**2) + cfg.r_min**2)))
        self.theta = nn.Parameter(2 * math.pi * torch.rand(S, N))            # (S, N)
        W = torch.randn(S, cfg.d_model, N, dtype=torch.cfloat) / math.sqrt(N)   # (S, H, N)
        self.W = nn.Parameter(torch.view_as_real(W))                          # (S, H, N, 2)

    def forward(self, L):
        nu = torch.exp(self.nu_log)                                           # (S, N)
        gamma = torch.sqrt(-torch.expm1(-2 * nu))                             # (S, N), √(1 − |λ|²)
        K = vandermonde(torch.view_as_complex(self.W) * gamma[:, None], torch.complex(-nu, self.theta), L)
        return K[0] if K.size(0) == 1 else K                                  # (H, L) or (2, H, L)


def LRU(cfg):
    return SSMBackbone(cfg, LRUKernel)


@pytest.fixture
def lru(monkeypatch):
    monkeypatch.setitem(models.MODELS, "lru", models.Model(LRUConfig, LRU, LRU_PARAMS, paper=None))   # models.py


def test_a_model_added_as_one_entry_pre_trains_and_fine_tunes(lru, data_dir, tmp_path, capsys):
    results, folder = run(data_dir, tmp_path, "--model", "lru", "--task", "listops", "--spt", "--pretrain-epochs",
                          "3", "--epochs", "1")
    losses = [r["train_loss"] for r in records(folder) if r["phase"] == "spt"]
    assert losses[-1] < losses[0] and 0 <= results["test_acc"] <= 1, losses
    assert "ssm 64 (lr 1.0e-03" in capsys.readouterr().out, "the entry's SSM parameters did not get their own lr group"


def test_a_model_without_paper_values_stops_preset_paper_in_one_line(lru, data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--model", "lru", "--task", "listops", "--preset", "paper", "--data-dir", str(data_dir),
                    "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "the paper has no values for lru" in err[0], err


def test_a_model_that_borrows_paper_values_says_so_and_names_the_source(monkeypatch):
    monkeypatch.setitem(models.MODELS, "lru", models.Model(LRUConfig, LRU, LRU_PARAMS,
                                                         presets.borrow(presets.dlr_paper, "dlr")))
    args, _, _ = train.parse_flags(["--model", "lru", "--task", "text", "--preset", "paper"])
    _, notes = presets.apply(args, models.MODELS["lru"])
    assert any("borrowed" in n for n in notes) and args.lr == presets.dlr_paper("text", False)[0]["lr"], notes
    table = "\n".join(presets.paper_table(models.MODELS))
    assert "| lru | text | TFS |" in table and "borrowed from dlr: paper Table 5" in table


# ---- recipe 2: add an objective (BERT's 80 / 10 / 10) ---------------------------------------------------------------

def bert(clean, args, gen, progress):
    """BERT's corruption: of the masked positions, 80 % read <mask>, 10 % a token drawn from the batch's real
    positions, 10 % stay as they are; the loss is taken at all of them (tokens only)."""
    mask = denoise.sample_mask(clean.content, clean.value.size(1), args.mask_ratio, gen)   # (B, L) bool
    u = torch.rand(mask.shape, generator=gen, device=mask.device)                          # (B, L)
    real = torch.arange(clean.value.size(1), device=mask.device) < clean.content[:, None]  # (B, L)
    pool = clean.value[real]                                                               # (n,) ids
    random = pool[torch.randint(len(pool), mask.shape, generator=gen, device=mask.device)]  # (B, L)
    x = torch.where(mask & (u < args.bert_mask), clean.mask_id, clean.value)
    x = torch.where(mask & (u >= args.bert_mask) & (u < args.bert_mask + args.bert_random), random, x)
    return denoise.Batch(x, clean.padded, clean.target, mask.float())


Flag, in_range = objectives.Flag, objectives.in_range
BERT = objectives.Objective(bert, {"mask_ratio": objectives.MASK_RATIO,
                                   "bert_mask": Flag(0.8, in_range(0, 1), "share of masked that read <mask>"),
                                   "bert_random": Flag(0.1, in_range(0, 1), "share read a random token")},
                            "BERT's 80/10/10 masking", refuse=lambda args: "bert: tokens only"
                            if args.task in ("image", "pathfinder", "pathx", "pathx256") else None)


def test_an_objective_added_as_one_entry_pre_trains_records_its_flags_and_corrupts_as_declared(data_dir, tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setitem(objectives.OBJECTIVES, "bert", BERT)
    seen, prepare = [], bert
    def spy(clean, args, gen, progress):
        b = prepare(clean, args, gen, progress)
        seen.append(((b.x == clean.mask_id) & b.weight.bool()).sum() / b.weight.sum())
        return b
    monkeypatch.setitem(objectives.OBJECTIVES, "bert", BERT._replace(prepare=spy))
    results, folder = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--spt", "--objective", "bert",
                          "--bert-random", "0.2", "--pretrain-epochs", "3", "--epochs", "1")
    assert results["spt_objective"] == dict(objective="bert", mask_ratio=0.1, bert_mask=0.8, bert_random=0.2)
    share = torch.stack(seen).mean()
    assert 0.6 < share < 0.95, f"share of masked positions reading <mask>: {share:.2f}, want about 0.8"
    assert "SPT bert (mask_ratio 0.1, bert_mask 0.8, bert_random 0.2)" in (folder / "log.txt").read_text()


def test_an_added_objectives_own_flags_are_checked_and_ignored_without_spt(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(objectives.OBJECTIVES, "bert", BERT)
    with pytest.raises(SystemExit) as e:
        train.main(["--objective", "bert", "--spt", "--bert-mask", "1.5", "--data-dir", str(data_dir)])
    assert e.value.code == 2 and "--bert-mask 1.5 must be in [0, 1]" in capsys.readouterr().err


# ---- recipe 3: add a knob (a mask-ratio schedule: the preparation sees the training progress) ---------------------

def ramped(clean, args, gen, progress):
    """Masked denoising whose ratio rises linearly from 0 to --mask-ratio over the first --mask-ramp of SPT."""
    ratio = args.mask_ratio * min(1.0, progress / args.mask_ramp) if args.mask_ramp else args.mask_ratio
    return denoise.masked(clean, argparse.Namespace(mask_ratio=max(ratio, 1e-3)), gen, progress)


def test_a_knob_added_to_an_objective_reaches_its_tensor_and_follows_the_training_progress(data_dir, tmp_path,
                                                                                          monkeypatch):
    flags = {**objectives.OBJECTIVES["masked"].flags, "mask_ramp": Flag(0.0, in_range(0, 1), "ramp share")}
    monkeypatch.setitem(objectives.OBJECTIVES, "masked", objectives.OBJECTIVES["masked"]._replace(prepare=ramped, flags=flags))
    ratios, sample = [], denoise.sample_mask
    monkeypatch.setattr(denoise, "sample_mask", lambda lengths, L, ratio, gen: ratios.append(ratio) or
                        sample(lengths, L, ratio, gen))
    results, _ = run(data_dir, tmp_path, "--model", "dlr", "--task", "listops", "--spt", "--mask-ramp", "0.5",
                     "--pretrain-epochs", "8", "--epochs", "1", "--max-train", "16")
    train_ratios = ratios[: 8 * 2 : 2]           # per epoch: one training step, then the evaluation's batch
    assert train_ratios[0] < train_ratios[2] < train_ratios[4] == train_ratios[-1] == pytest.approx(0.1), ratios
    assert results["spt_objective"]["mask_ramp"] == 0.5
