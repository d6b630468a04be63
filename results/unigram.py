"""results/unigram.py: the masked-denoising loss a model gets from the token frequencies alone, with no context.
denoise.masked_batch masks each content position (every token before EOS) with one probability, so the masked targets
are a uniform sample of the content tokens, and the best context-free prediction is their frequencies p_v (training
split): on training inputs its loss is their entropy, on validation inputs the cross-entropy
    H(train) = −Σ_v p_v ln p_v,   H(val ‖ train) = −Σ_v q_v ln p'_v   (nats; q_v: the validation split's frequencies,
    p'_v = (count_v + 1) / (Σ count + V): add-one smoothing over the V ids, as a few validation bytes never occur in
    the training reviews and a model gives them small, not zero, probability).
A run's SPT loss at these values has learned the frequencies and nothing about context (results/why_spt/README.md).
    python results/unigram.py RUN_DIR      # prints and writes results/why_spt/unigram.json (the run's data settings)
Check: tests/test_results.py (a two-token split gives ln 2; the committed numbers are the ones the README cites).
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lra_data  # noqa: E402
from tools import checked  # noqa: E402  (checked flags, outputs over our own files only)
from lra.files import EOS, PAD  # noqa: E402

OUT = Path(__file__).resolve().parent / "why_spt" / "unigram.json"


def content_counts(ds, task):
    """Counts of what SPT may mask in a split of `task`: a token task's ids but PAD and EOS (its padding and end
    marker), a pixel task's every grey level (pixels have no PAD or EOS: 0 and 2 are grey levels there): (V,) int64,
    V = the largest value + 1."""
    ids = np.concatenate([ds[i][0].reshape(-1).numpy() for i in range(len(ds))])          # (tokens,) the split's ids
    if lra_data.TASKS[task].kind != "tokens":
        return np.bincount(ids)
    return np.bincount(ids[(ids != PAD) & (ids != EOS)])


def unigram_loss(train, other=None, smoothing=0.0):
    """Cross-entropy in nats of the `other` counts under the training frequencies p = (train + smoothing) /
    Σ (train + smoothing) (the entropy of p when other is None). train, other: (V,) counts of the same ids (zero-padded
    to one length). Raises ValueError where `other` has a token that p gives no probability (an infinite loss)."""
    p = (train + smoothing) / (train + smoothing).sum()
    q = p if other is None else other / other.sum()
    if np.any((q > 0) & (p == 0)):
        raise ValueError("the other split has tokens the training split never saw: infinite cross-entropy")
    seen = q > 0
    return float(-(q[seen] * np.log(p[seen])).sum())


def main(argv=None):
    p = argparse.ArgumentParser(description="The context-free masked-denoising loss of a run's data (nats).")
    p.add_argument("run", help="a run folder: its config.json's data settings are read")
    p.add_argument("--out", default=None, help=f"also write the numbers there (json; e.g. {OUT.relative_to(OUT.parents[2])}"
                   "), over a file of this tool's only (default: print them)")
    p.error = lambda m: (print(f"unigram.py: error: {checked.flag_message(m)}", file=sys.stderr), sys.exit(2))
    args = p.parse_args(argv)
    if args.out and not checked.owned(args.out):                # a file of the user's: never replaced
        p.error(f"--out {args.out} exists and unigram.py did not write it: it is left untouched; pass another name")
    config = json.loads((Path(args.run) / "config.json").read_text())
    splits = lra_data.load_splits(argparse.Namespace(**config["args"]))
    train, val = content_counts(splits["train"], config["task"]), content_counts(splits["val"], config["task"])
    n = max(len(train), len(val))
    train, val = np.pad(train, (0, n - len(train))), np.pad(val, (0, n - len(val)))
    res = dict(run=Path(args.run).name, task=config["task"], train_examples=len(splits["train"]),
               val_examples=len(splits["val"]), train_tokens=int(train.sum()), val_tokens=int(val.sum()),
               entropy_train_nats=unigram_loss(train), cross_entropy_val_nats=unigram_loss(train, val, smoothing=1.0),
               val_tokens_unseen_in_train=int(val[train == 0].sum()))
    if args.out:
        checked.write_owned(args.out, json.dumps(res, indent=1) + "\n", "unigram.py")      # whole or not at all
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
