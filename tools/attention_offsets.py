"""tools/attention_offsets.py: how far a trained Transformer's attention reaches, by offset |i − j|, on validation
inputs: does self pre-training teach proximity (Coser et al., arXiv 2605.21070: SPT turns absolute position codes into
attention biased toward nearby positions, which label supervision alone fails to learn)?
per layer l and head h, over the real (non-pad) queries i of the validation inputs (B_q of them in all):
  mass by offset:   M_h(d) = (1/B_q) Σ_i Σ_{j: |i−j| = d} a_ij           (Σ_d M_h(d) = 1)
  mean distance:    δ_h = (1/B_q) Σ_i Σ_j a_ij |i − j| = Σ_d d · M_h(d)
  uniform:          the same with a_ij = 1 / (keys i may see): real keys (bidirectional) or j ≤ i (causal); one
                    sequence of n real tokens gives (n² − 1) / (3n) bidirectional, (n − 1) / 4 causal
absolute codes (sinusoidal, learned), first layer, from the position code P alone (no token):
  s(d) = mean over i, j with |i − j| = d of q_i·k_j / √hs, q, k = the layer's projections of LayerNorm(P)
a_ij are the weights attend() uses (TransformerLayer.attention_probs: key-padding and causal masks, no dropout), on the
clean validation inputs, for the fine-tuned model (best.pt) and, after SPT, the pre-trained one (spt.pt).
    python tools/attention_offsets.py RUN_DIR [RUN_DIR ...]             # RUN_DIR/attention.json for each
    python tools/attention_offsets.py RUN_DIR ... --plot cell.png       # and one figure of them all
Check: tests/test_attention_offsets.py (local attention gives δ = 0 or 1, uniform attention the closed form).
"""
import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import denoise  # noqa: E402
import lra_data  # noqa: E402
import models  # noqa: E402
from lab import steps  # noqa: E402
from tools import checked  # noqa: E402  (checked flags)

CHECKPOINTS = ("spt.pt", "best.pt")   # after pre-training (SPT runs only), after fine-tuning


def uniform_attention(lengths, L, causal=False):
    """a_ij = 1 / (number of keys query i may see): the real keys j < lengths[b] (bidirectional) or j ≤ i (causal,
    where pads come last). lengths: (B,) long. Returns (B, 1, L, L) float64; pad query rows are uniform over the real
    keys (they are never counted)."""
    i = torch.arange(L)
    allowed = (i[None, None, :] < lengths[:, None, None]).expand(-1, L, -1)      # (B, L, L)
    if causal:
        allowed = allowed & (i[None, :, None] >= i[None, None, :])
    allowed = allowed | ~allowed.any(-1, keepdim=True)                          # no empty row
    a = allowed.double()
    return (a / a.sum(-1, keepdim=True))[:, None]                               # (B, 1, L, L)


def uniform_distance(n, causal=False):
    """The mean of |i − j| over the queries of one sequence of n real tokens under uniform attention, in closed form:
    bidirectional (1/n²) Σ_i Σ_j |i − j| = (n² − 1) / (3n); causal (1/n) Σ_i (1/(i+1)) Σ_{j ≤ i} (i − j)
    = (n − 1) / 4."""
    return (n - 1) / 4 if causal else (n * n - 1) / (3 * n)


def offset_sums(a, lengths):
    """Σ over the real queries of a batch of each head's attention mass at each offset d = |i − j|.
    a: (B, nh, L, L) attention weights (rows sum to 1); lengths: (B,) long (None: no padding).
    Returns (mass (nh, L) float64, the number of real queries): divide by the second for M_h(d)."""
    B, nh, L, _ = a.shape
    real = torch.ones(B, L, dtype=torch.bool) if lengths is None else torch.arange(L) < lengths.cpu()[:, None]
    offset = (torch.arange(L)[:, None] - torch.arange(L)).abs()                  # (L, L)
    per_pair = (a.double().cpu() * real[:, None, :, None]).sum(0)               # (nh, L, L): real queries only
    mass = torch.zeros(nh, L, dtype=torch.float64).index_add_(1, offset.flatten(), per_pair.flatten(1))  # (nh, L)
    return mass, int(real.sum())


def position_scores(backbone, L):
    """For absolute codes: the first layer's scores from the position code alone, averaged by offset:
    s_h(d) = mean_{|i−j| = d} q_i·k_j / √hs with q, k from LayerNorm(P) (P: (L, D) the code). -> (nh, L) float64, or
    None for rotary / none (no code added to the input)."""
    _, code = backbone.positions(L)
    if code is None:
        return None
    layer = backbone.layers[0]
    q, k, _ = layer.project(layer.norm1(code.to(torch.float32)[None]), None)   # (1, nh, L, hs) each
    scores = (q @ k.transpose(-1, -2) / q.size(-1) ** 0.5)[0].double()         # (nh, L, L)
    offset = (torch.arange(L)[:, None] - torch.arange(L)).abs().flatten()        # (L·L,)
    total = torch.zeros(scores.size(0), L, dtype=torch.float64).index_add_(1, offset, scores.flatten(1))
    return total / torch.bincount(offset, minlength=L).double()                 # (nh, L)


@torch.no_grad()
def analyse(backbone, batches):
    """Attention by offset of every layer of a Transformer backbone (eval mode) over batches of (x, lengths): the
    model's input and real lengths ((B,) long or None). -> {"layers": [{"mass_by_offset" (nh × L), "mean_distance"
    (nh,), "uniform_mass_by_offset" (L,), "uniform_distance"}], "position_scores_by_offset", "queries"}."""
    cfg, sums, uniform, queries, L_max = backbone.cfg, None, None, 0, 0
    for x, lengths in batches:
        h, angles = backbone.embed(x)                                           # (B, L, D)
        B, L, _ = h.shape
        if L >= cfg.local_min_len:
            raise ValueError(f"inputs of length {L} use block-local attention (local_min_len={cfg.local_min_len}): "
                             "this tool reads full attention only")
        n = torch.full((B,), L) if lengths is None else lengths.cpu()
        u, _ = offset_sums(uniform_attention(n, L, cfg.causal), n)              # (1, L)
        layer_sums = []
        for layer in backbone.layers:
            layer_sums.append(offset_sums(layer.attention_probs(h, lengths, angles), lengths)[0])   # (nh, L)
            h = layer(h, lengths, angles)                                       # (B, L, D)
        pad = lambda t: torch.nn.functional.pad(t, (0, max(L, L_max) - t.size(-1)))  # noqa: E731
        sums = [pad(s) for s in layer_sums] if sums is None else [pad(a) + pad(b) for a, b in zip(sums, layer_sums)]
        uniform = pad(u) if uniform is None else pad(uniform) + pad(u)
        queries, L_max = queries + int(n.sum()), max(L, L_max)
    if not queries:
        raise ValueError("no validation inputs to analyse")
    d = torch.arange(L_max, dtype=torch.float64)
    layers = [dict(mass_by_offset=(s / queries).tolist(), mean_distance=((s / queries) @ d).tolist(),
                   uniform_mass_by_offset=(uniform[0] / queries).tolist(),
                   uniform_distance=float((uniform[0] / queries) @ d)) for s in sums]
    scores = position_scores(backbone, L_max)
    return dict(layers=layers, queries=queries, length=L_max,
                position_scores_by_offset=None if scores is None else scores.tolist())


def validation_batches(ck, batch_size=16, max_examples=0, device="cpu"):
    """The run's validation split (its own data settings, config.json's args), clean (no SPT masking), as
    (x, lengths) batches of the classifier's input; pairs (Retrieval) as 2B single documents."""
    args = argparse.Namespace(**{**ck["args"], "generate": 0})    # the run's own data, never a generated substitute
    val = lra_data.load_splits(args)["val"]
    if max_examples:
        val = torch.utils.data.Subset(val, range(min(max_examples, len(val))))
    collate = partial(steps.collate, task=ck["task"])                           # pairs: 2B rows
    for batch in torch.utils.data.DataLoader(val, batch_size, collate_fn=collate):
        b = denoise.labelled(steps.to_device(batch, torch.device(device)), None, 1.0)
        yield b.x, b.lengths


def analyse_run(folder, max_examples=0, batch_size=16):
    """attention.json of one run folder: analyse() of spt.pt (if there) and best.pt, on the validation inputs."""
    folder, found, pos = Path(folder), {}, None
    for name in CHECKPOINTS:
        if not (folder / name).is_file():
            continue
        model, ck = models.load_model(folder / name)
        pos = getattr(model.backbone.cfg, "pos", None)
        if ck["model_name"] != "transformer":
            raise SystemExit(f"attention_offsets.py: {folder / name} is a {ck['model_name']} checkpoint; "
                             "attention needs a Transformer")
        found[name] = dict(phase=ck["phase"], epoch=ck["epoch"],
                           **analyse(model.backbone, validation_batches(ck, batch_size, max_examples)))
    if "best.pt" not in found:
        raise SystemExit(f"attention_offsets.py: {folder} has no best.pt (keep the run's checkpoints: "
                         "results/why_spt.py does)")
    result = dict(run=folder.name, pos=pos, spt=bool(ck["args"]["spt"]), seed=ck["args"]["seed"], checkpoints=found)
    checked.write_owned(folder / "attention.json", json.dumps(result, indent=1) + "\n",   # whole, over its own only
                        "tools/attention_offsets.py")
    return result


def summary_lines(result):
    """One line per checkpoint and layer: mean attention distance per head against uniform attention's."""
    lines = []
    for name, c in result["checkpoints"].items():
        for i, layer in enumerate(c["layers"]):
            heads_text = " ".join(f"{x:6.1f}" for x in layer["mean_distance"])
            lines.append(f"{result['run']} {name:7s} layer {i + 1}: mean distance per head {heads_text} | uniform "
                         f"{layer['uniform_distance']:.1f}")
    return lines


def plot(results, path, labels=None):
    """One panel per layer: attention mass by offset (mean over heads, then over the runs of a group) of each group
    and checkpoint, log-log, with uniform attention's dotted; a last panel of the first layer's position-only scores
    (absolute codes). labels: a group name per result (default: its position code and SPT or TFS)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = labels or [f"{r['pos']} {'SPT' if r['spt'] else 'TFS'}" for r in results]
    groups = {}                                               # (group, checkpoint) -> its runs' checkpoint results
    for label, r in zip(labels, results):
        for name, c in r["checkpoints"].items():
            groups.setdefault((label, name), []).append(c)
    n_layers = max(len(c["layers"]) for cs in groups.values() for c in cs)
    fig, axes = plt.subplots(1, n_layers + 1, figsize=(4.2 * (n_layers + 1), 4.4))
    colors = {label: f"C{i}" for i, label in enumerate(dict.fromkeys(labels))}
    for (label, name), cs in sorted(groups.items()):
        style = dict(ls="--" if name == "spt.pt" else "-", color=colors[label], lw=1.2,
                     label=f"{label} {name.removesuffix('.pt')} (n={len(cs)})")
        for i, ax in enumerate(axes[:n_layers]):
            mass = torch.stack([torch.tensor(c["layers"][i]["mass_by_offset"]).mean(0) for c in cs]).mean(0)  # (L,)
            ax.loglog(range(1, len(mass)), mass[1:], **style)
        scores = [torch.tensor(c["position_scores_by_offset"]).mean(0) for c in cs
                  if c["position_scores_by_offset"] is not None]
        if scores:
            axes[-1].plot(torch.stack(scores).mean(0), **style)                    # (L,) mean over heads, runs
    first = next(iter(groups.values()))[0]
    for ax, layer, i in zip(axes, first["layers"], range(n_layers)):
        uniform = layer["uniform_mass_by_offset"]
        ax.loglog(range(1, len(uniform)), uniform[1:], ":", color="k", label="uniform" if i == 0 else None)
        ax.set(title=f"layer {i + 1}: attention mass by offset", xlabel="offset |i − j|",
               ylabel="mass (mean of heads, runs)")
    axes[-1].set(title="layer 1, position code alone", xlabel="offset |i − j|", ylabel="mean score q·k/√hs")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    try:                                                      # whole, over a figure of its own only
        checked.write_owned(path, lambda tmp: fig.savefig(tmp, format=Path(path).suffix[1:] or "png", dpi=110),
                            "tools/attention_offsets.py")
    finally:
        plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description="Attention mass and mean distance by offset |i − j| of Transformer runs.")
    p.add_argument("runs", nargs="+", help="run folders holding best.pt (and spt.pt after SPT)")
    p.add_argument("--max-examples", type=checked.at_least(0), default=0, help="validation examples to read (0: all)")
    p.add_argument("--batch-size", type=checked.at_least(1), default=16, help="validation examples a batch")
    p.add_argument("--plot", default=None, help="a figure of all the runs' profiles (.png, .pdf, .svg: its suffix)")
    p.error = lambda m: (print(f"attention_offsets.py: error: {checked.flag_message(m)}", file=sys.stderr),
                         sys.exit(2))
    args = p.parse_args(argv)
    for f in [Path(f) / "attention.json" for f in args.runs] + ([Path(args.plot)] if args.plot else []):
        if not checked.owned(f):                                          # before an hour of analysis, not after
            p.error(f"{f} exists and is not in {f.parent / checked.MANIFEST} (not this tool's, or an older version's): "
                    f"it is left untouched; {'pass another --plot' if f.suffix == '.png' else 'move it away'}")
    try:
        results = [analyse_run(folder, args.max_examples, args.batch_size) for folder in args.runs]
    except lra_data.DataError as e:                 # the run's data moved or gone: refused, never substituted
        p.error(f"the run's data: {e}")
    for r in results:
        print("\n".join(summary_lines(r)))
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return results


if __name__ == "__main__":
    main()
