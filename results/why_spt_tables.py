"""results/why_spt_tables.py: the why-SPT study's tables in summary.md (results/summarize.py calls section): the
runs per arm and CPU model, the primary contrasts (Holm over four) and the secondary ones, each per-seed difference
from one CPU model's runs, the contrasts per CPU model, the machine effect, the attention by offset. The study's
arms and runs: results/why_spt.py; its plan: results/why_spt/README.md.
"""
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import plots  # noqa: E402  (results/plots.py: figures written whole, over the tool's own files only)
from why_spt import arm_of, cpu_of  # noqa: E402  (the study's arms and run keys)


# ---- the tables (results/summarize.py calls section) -----------------------------------------------------------------
# a contrast: per seed Σ weight × test accuracy (points) over (model, arm) terms; a seed counts where every term ran.
# The four primary ones are fixed in why_spt/README.md before any run; Holm's adjustment is over these four.
PRIMARY = [
    ("C1 sinusoidal: SPT − TFS", {("transformer", "spt-sin"): 1, ("transformer", "tfs-sin"): -1}),
    ("C2 position × SPT: (SPT − TFS) sinusoidal − (SPT − TFS) rotary",
     {("transformer", "spt-sin"): 1, ("transformer", "tfs-sin"): -1, ("transformer", "spt-rot"): -1,
      ("transformer", "tfs-rot"): 1}),
    ("C3 rotary: SPT to the 15-epoch cap − TFS", {("transformer", "conv-rot"): 1, ("transformer", "tfs-rot"): -1}),
    ("C4 S4 and DLR: SPT − tuned TFS (mean of the two)",
     {("s4", "spt-tuned"): 0.5, ("s4", "tfs-tuned"): -0.5, ("dlr", "spt-tuned"): 0.5, ("dlr", "tfs-tuned"): -0.5}),
]
SECONDARY = [
    ("rotary: SPT − TFS (the control's arms)", {("transformer", "spt-rot"): 1, ("transformer", "tfs-rot"): -1}),
    ("sinusoidal: SPT to the 15-epoch cap − TFS", {("transformer", "conv-sin"): 1, ("transformer", "tfs-sin"): -1}),
    ("rotary: SPT to the 15-epoch cap − SPT (P = 3)", {("transformer", "conv-rot"): 1, ("transformer", "spt-rot"): -1}),
    ("sinusoidal: SPT to the 15-epoch cap − SPT (P = 3)", {("transformer", "conv-sin"): 1, ("transformer", "spt-sin"): -1}),
    ("S4: SPT − tuned TFS", {("s4", "spt-tuned"): 1, ("s4", "tfs-tuned"): -1}),
    ("DLR: SPT − tuned TFS", {("dlr", "spt-tuned"): 1, ("dlr", "tfs-tuned"): -1}),
    ("rotary: SPT to the 15-epoch cap − tuned TFS", {("transformer", "conv-rot"): 1, ("transformer", "tfs-tuned"): -1}),
    ("rotary: SPT capped at 40 − at 15 epochs", {("transformer", "conv40-rot"): 1, ("transformer", "conv-rot"): -1}),
    ("rotary: SPT capped at 40 epochs − TFS", {("transformer", "conv40-rot"): 1, ("transformer", "tfs-rot"): -1}),
]


def study_cells(folder, runs):
    """{(model, arm): {seed: {CPU model: run}}} of the finished runs (summarize.read_run's dicts) of the study folder,
    each run with its CPU model and, where there, attention.json. A Transformer whose pilot chose the control's
    setting has its tfs-rot runs as its tfs-tuned ones (the same flags)."""
    finetune = json.loads((HERE / "control" / "pilot" / "choice.json").read_text())["finetune_epochs"]
    choice_file = folder / "pilot" / "choice.json"
    choice = ({m: (c["dropout"], c["schedule"]) for m, c in json.loads(choice_file.read_text())["choice"].items()}
              if choice_file.is_file() else None)
    cells = {}
    for r in runs:
        config = json.loads((folder / r["name"] / "config.json").read_text())
        key = arm_of(config, finetune, choice)
        if key:
            attention = folder / r["name"] / "attention.json"
            cells.setdefault(key, {}).setdefault(r["seed"], {})[cpu_of(config)] = {
                **r, "cpu": cpu_of(config), "reused": (folder / r["name"] / "reused.json").is_file(),
                "attention": json.loads(attention.read_text()) if attention.is_file() else None}
    if (choice or {}).get("transformer") == ("0", "constant") and ("transformer", "tfs-rot") in cells:
        cells[("transformer", "tfs-tuned")] = cells[("transformer", "tfs-rot")]
    return cells


def pairing_cpu(cells, terms, seed, cpu=None):
    """The CPU model whose runs make a seed's difference: one that holds every term (cpu: only that one); where
    several do, the one that holds most of the seed's runs of the contrast's models (where its runs began), then
    the first by name. None where no CPU model holds every term."""
    held = set.intersection(*(set(cells.get(t, {}).get(seed, {})) for t in terms)) & ({cpu} if cpu else set(
        c for t in terms for by_cpu in cells.get(t, {}).values() for c in by_cpu))
    models = {m for m, _ in terms}
    count = lambda c: sum(c in by_seed.get(seed, {}) for (m, _), by_seed in cells.items() if m in models)  # noqa
    return min(held, key=lambda c: (-count(c), c)) if held else None


def contrast(cells, terms, cpu=None):
    """Per seed Σ weight × test accuracy (points), every term from one CPU model (pairing_cpu; cpu: only that one),
    where every term ran -> {seed: (difference, CPU model)}."""
    found = {}
    for s in sorted(set.intersection(*(set(cells.get(t, {})) for t in terms))):
        c = pairing_cpu(cells, terms, s, cpu)
        if c:
            found[s] = (sum(w * 100 * cells[t][s][c]["test"] for t, w in terms.items()), c)
    return found


def short_cpu(cpu):
    return {"AMD EPYC": "AMD", "Intel(R) Xeon(R) Processor": "Intel"}.get(cpu, cpu.split("(")[0].split()[0])


def cpus_text(pairs):
    """'AMD × 3, Intel × 3' of a contrast's {seed: (difference, CPU model)}."""
    cpus = [c for _, c in pairs.values()]
    return ", ".join(f"{short_cpu(c)} × {cpus.count(c)}" for c in sorted(set(cpus))) or "–"


def contrast_rows(cells, contrasts, stats, adjust):
    """Rows of the contrasts table: n, per seed, mean [95 % t interval], t, p (Holm-adjusted where adjust), the
    difference detectable at 80 % power from the observed spread, McNemar per seed (two-arm contrasts)."""
    found = [(name, terms, contrast(cells, terms)) for name, terms in contrasts]
    tests = [stats.paired_test([v for v, _ in d.values()]) if len(d) > 1 and len({v for v, _ in d.values()}) > 1
             else (None, None) for _, _, d in found]
    ps = [p for _, p in tests]
    held = [i for i, p in enumerate(ps) if p is not None]
    holm = dict(zip(held, stats.holm([ps[i] for i in held]))) if adjust else {}
    rows = []
    for i, (name, terms, d) in enumerate(found):
        values, (t, p) = [v for v, _ in d.values()], tests[i]
        if len(values) > 1:
            mean, low, high = stats.interval(values)
            shown = f"{mean:+.1f} [{low:+.1f}, {high:+.1f}]"
            detect = f"{stats.detectable_difference(statistics.stdev(values), len(values)):.1f}"
        else:
            shown, detect = (f"{values[0]:+.1f}" if values else "–"), "–"
        pairs = [t_ for t_, w in terms.items()]
        mcnemar = "–"
        if len(pairs) == 2 and pairs[0][0] == pairs[1][0] and d:
            mcnemar = control_mcnemar(cells[pairs[0]], cells[pairs[1]], d, stats)
        p_text = "–" if p is None else f"{p:.3g}" + (f" (Holm {holm[i]:.3g})" if i in holm else "")
        rows.append(f"| {name} | {len(values)} | {' / '.join(f'{v:+.1f}' for v in values) or '–'} | {shown} | "
                    f"{'–' if t is None else f'{t:.2f}'} | {p_text} | {detect} | {mcnemar} | {cpus_text(d)} |")
    return rows


def per_cpu_rows(cells, contrasts, stats):
    """Rows of each contrast restricted to one CPU model, for the contrasts that two or more CPU models can pair
    (each holds every term of some seed): n, per seed, mean [95 % t interval] (descriptive)."""
    rows = []
    for name, terms in contrasts:
        cpus = sorted({c for t in terms for by_cpu in cells.get(t, {}).values() for c in by_cpu})
        found = {cpu: [v for v, _ in contrast(cells, terms, cpu).values()] for cpu in cpus}
        if sum(bool(values) for values in found.values()) < 2:
            continue
        for cpu, values in ((cpu, values) for cpu, values in found.items() if values):
            shown = (f"{values[0]:+.1f}" if len(values) == 1 else
                     "{:+.1f} [{:+.1f}, {:+.1f}]".format(*stats.interval(values)))
            rows.append(f"| {name} | {cpu} | {len(values)} | {' / '.join(f'{v:+.1f}' for v in values)} | {shown} |")
    return rows


def machine_rows(cells, stats):
    """The machine effect: for each arm, the seeds that ran on two CPU models, test accuracy (points) of the second
    by name − the first; mean [95 % t interval] where two or more."""
    rows = []
    for (model, arm), by_seed in sorted(cells.items()):
        pairs = {}
        for seed, by_cpu in sorted(by_seed.items()):
            if len(by_cpu) >= 2:
                a, b = sorted(by_cpu)[:2]
                pairs[seed] = (a, b, 100 * (by_cpu[b]["test"] - by_cpu[a]["test"]))
        if not pairs:
            continue
        values = [d for _, _, d in pairs.values()]
        shown = (f"{values[0]:+.1f}" if len(values) == 1 else
                 "{:+.1f} [{:+.1f}, {:+.1f}]".format(*stats.interval(values)))
        a, b = next(iter(pairs.values()))[:2]
        rows.append(f"| {model} {arm} | {short_cpu(b)} − {short_cpu(a)} | {len(values)} | "
                    f"{', '.join(str(s) for s in pairs)} | {' / '.join(f'{v:+.1f}' for v in values)} | {shown} |")
    return rows


def control_mcnemar(a, b, pairs, stats):
    """Exact McNemar p per seed of two arms' test predictions (each seed's runs of the CPU model in pairs),
    'p1 / p2 / ...'."""
    ps = []
    for seed, (_, cpu) in sorted(pairs.items()):
        pa, pb = a[seed][cpu]["predictions"], b[seed][cpu]["predictions"]
        ok = pa and pb and pa["labels"] == pb["labels"] and pa["index_sha1"] == pb["index_sha1"]
        ps.append(f"{stats.mcnemar(pa['predictions'], pb['predictions'], pa['labels'])[2]:.2g}" if ok else "–")
    return " / ".join(ps)


def attention_rows(cells):
    """Mean attention distance per layer (mean over heads, then seeds) of each Transformer arm, after SPT (spt.pt)
    and after fine-tuning (best.pt), against uniform attention's."""
    rows = []
    for (model, arm), by_seed in sorted(cells.items()):
        found = [r["attention"] for by_cpu in by_seed.values() for r in by_cpu.values() if r["attention"]]
        for ck in ("spt.pt", "best.pt"):
            layers = [a["checkpoints"][ck]["layers"] for a in found if ck in a["checkpoints"]]
            if not layers:
                continue
            per_layer = []
            for i in range(len(layers[0])):
                mean = statistics.fmean(statistics.fmean(seed[i]["mean_distance"]) for seed in layers)
                uniform = statistics.fmean(seed[i]["uniform_distance"] for seed in layers)
                per_layer.append(f"{mean:.1f} (uniform {uniform:.1f})")
            rows.append(f"| {model} {arm} | {ck} | {len(layers)} | {' | '.join(per_layer)} |")
    return rows


def plateau_rows(folder):
    """Cell p: each plateau run's SPT validation loss per epoch (nats) against the context-free loss of unigram.json,
    and whether it left the plateau (a loss below PLATEAU_EXIT at any epoch), sorted by (SPT lr, warm-up)."""
    import why_spt
    rows, unigram = [], json.loads((folder / "unigram.json").read_text())["cross_entropy_val_nats"]
    for run in sorted((folder / "plateau").glob("*/results.json")):
        config = json.loads((run.parent / "config.json").read_text())
        losses = [json.loads(line)["val_loss"] for line in (run.parent / "log.jsonl").read_text().splitlines()
                  if line.strip() and json.loads(line).get("phase") == "spt"]
        a = config["args"]
        rows.append(((a["pretrain_lr"], a["warmup"]), f"| {a['pretrain_lr']:g} | {a['warmup']} | "
                     f"{' / '.join(f'{v:.4f}' for v in losses)} | {unigram:.4f} | "
                     f"{'yes' if min(losses) < why_spt.PLATEAU_EXIT else 'no'} | {run.parent.name} |"))
    return [row for _, row in sorted(rows)]


def length_rows(cells):
    """SPT length, per seed that ran conv40-rot: test accuracy % after 0 (tfs-rot), 3 (spt-rot), 15 (conv-rot) SPT
    epochs and at conv40-rot's stop, each on the seed's CPU model (pairing_cpu), with the epochs SPT ran."""
    rows, arms = [], ["tfs-rot", "spt-rot", "conv-rot", "conv40-rot"]
    for seed in sorted(cells.get(("transformer", "conv40-rot"), {})):
        terms = {("transformer", a): 1 for a in arms if seed in cells.get(("transformer", a), {})}
        cpu = pairing_cpu(cells, {("transformer", "conv40-rot"): 1}, seed)
        got = {a: cells[("transformer", a)][seed].get(cpu) for a in arms if ("transformer", a) in terms}
        shown = [f"{100 * got[a]['test']:.1f} ({got[a]['spt_epochs_run'] or 0})" if got.get(a) else "–" for a in arms]
        rows.append(f"| {seed} | {cpu} | {' | '.join(shown)} |")
    return rows


def escape_rows(cells, folder):
    """Sinusoidal SPT to the 15-epoch cap, per seed (its seed's tfs-sin on the same CPU model): the SPT validation
    loss (nats) at epochs 3 and 15, the first epoch below PLATEAU_EXIT (it leaves the plateau), each layer's mean
    attention distance after SPT (mean over heads) and the test accuracy % of conv-sin and tfs-sin."""
    import why_spt
    rows, terms = [], {("transformer", "conv-sin"): 1, ("transformer", "tfs-sin"): -1}
    for seed in sorted(cells.get(("transformer", "conv-sin"), {})):
        cpu = pairing_cpu(cells, terms, seed)
        if cpu is None:
            continue
        run, tfs = (cells[t][seed][cpu] for t in terms)
        losses = [json.loads(line)["val_loss"] for line in (folder / run["name"] / "log.jsonl").read_text().splitlines()
                  if line.strip() and json.loads(line).get("phase") == "spt"]
        left = next((str(e) for e, v in enumerate(losses, 1) if v < why_spt.PLATEAU_EXIT), "–")
        layers = run["attention"]["checkpoints"]["spt.pt"]["layers"] if run["attention"] else []
        distance = " / ".join(f"{statistics.fmean(layer['mean_distance']):.1f}" for layer in layers) or "–"
        rows.append(f"| {seed} | {cpu} | {losses[2]:.4f} / {losses[-1]:.4f} | {left} | {distance} | "
                    f"{100 * run['test']:.1f} | {100 * tfs['test']:.1f} |")
    return rows


def plot_length(cells, path, plt):
    """spt_length.png: test accuracy against the SPT epochs run, a line per seed (tfs-rot at 0, spt-rot, conv-rot,
    conv40-rot at its stop)."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for seed in sorted(cells.get(("transformer", "conv40-rot"), {})):
        cpu = pairing_cpu(cells, {("transformer", "conv40-rot"): 1}, seed)
        points = sorted((r["spt_epochs_run"] or 0, 100 * r["test"]) for a in ("tfs-rot", "spt-rot", "conv-rot",
                        "conv40-rot") if (r := cells.get(("transformer", a), {}).get(seed, {}).get(cpu)))
        ax.plot(*zip(*points), marker="o", label=f"seed {seed}")
    ax.set_xlabel("SPT epochs run (0: from scratch)"), ax.set_ylabel("test accuracy %"), ax.legend()
    plots.save(plt, fig, path, "Rotary Transformer, Text: SPT length", 60, 10)   # whole, over its own file only


def section(folder, runs, stats):
    """The study's part of summary.md: n per cell, the primary contrasts (Holm), the secondary ones, attention."""
    cells = study_cells(folder, runs)
    lines = [f"## Why SPT: position code, SPT length, a tuned baseline (`{folder.name}/`)", "",
             "The plan and its four primary contrasts: `why_spt/README.md` (fixed before any run). Test accuracy %, "
             "mean [95 % t interval over seeds]; n = seeds. Each contrast pairs the runs of a seed, all its terms "
             "from one CPU model (where two hold them all, the one where most of the seed's runs ran).", "",
             "| model · arm | n | seeds | test acc % | best val acc % | SPT epochs (per seed) | CPU | reused |",
             "|---|---|---|---|---|---|---|---|"]
    rows = [((model, arm), cpu, [by_seed[s][cpu] for s in sorted(by_seed) if cpu in by_seed[s]])
            for (model, arm), by_seed in sorted(cells.items())
            for cpu in sorted({c for by_cpu in by_seed.values() for c in by_cpu})]     # a row per arm and CPU model
    for (model, arm), cpu, rs in rows:
        accs = [100 * r["test"] for r in rs]
        acc = (f"{stats.interval(accs)[0]:.1f} [{stats.interval(accs)[1]:.1f}, {stats.interval(accs)[2]:.1f}]"
               if len(accs) > 1 else f"{accs[0]:.1f}")
        epochs = " / ".join(str(r["spt_epochs_run"]) for r in rs) if rs[0]["spt_epochs_run"] else "–"
        lines.append(f"| {model} {arm} | {len(rs)} | {', '.join(str(r['seed']) for r in rs)} | {acc} | "
                     f"{statistics.fmean(100 * r['best_val'] for r in rs):.1f} | {epochs} | {cpu} | "
                     f"{sum(r['reused'] for r in rs)} |")
    header = ["| contrast | n | per seed (points) | mean [95 % interval] | t | p | detectable at 80 % power | "
              "McNemar p per seed | CPU of the pairs |", "|---|---|---|---|---|---|---|---|---|"]
    lines += ["", "Primary contrasts (paired t, two-sided; Holm over the four, or over those with runs while some "
              "lack them):", ""] + header
    lines += contrast_rows(cells, PRIMARY, stats, adjust=True)
    lines += ["", "Secondary contrasts (descriptive, unadjusted):", ""] + header
    lines += contrast_rows(cells, SECONDARY, stats, adjust=False)
    per_cpu = per_cpu_rows(cells, PRIMARY + SECONDARY, stats)
    if per_cpu:
        lines += ["", "Per CPU model (descriptive): the contrasts some of whose arms ran on two CPU models, each "
                  "from one CPU model's runs only:", "", "| contrast | CPU | n | per seed (points) | mean [95 % "
                  "interval] |", "|---|---|---|---|---|"] + per_cpu
    machine = machine_rows(cells, stats)
    if machine:
        lines += ["", "The machine effect (secondary, descriptive): an arm's seeds that ran on two CPU models, the "
                  "same train.py flags; test accuracy of one CPU model − the other's, points:", "",
                  "| arm | CPU models | n | seeds | per seed (points) | mean [95 % interval] |",
                  "|---|---|---|---|---|---|"] + machine
    plateau = plateau_rows(folder) if (folder / "plateau").is_dir() and (folder / "unigram.json").is_file() else []
    if plateau:
        lines += ["", "The sinusoidal plateau (cell p, seed 100, `plateau/`): SPT validation loss per epoch, nats, against "
                  "the context-free loss (`unigram.json`); it leaves the plateau below 3.0 nats at any epoch:", "",
                  "| SPT lr | warm-up steps | SPT val loss per epoch | context-free | left | run |",
                  "|---|---|---|---|---|---|"] + plateau
    length = length_rows(cells)
    if length:
        lines += ["", "SPT length (rotary, per seed): test accuracy % (SPT epochs run) from scratch, after 3 and 15 SPT "
                  "epochs, and capped at 40 (K = 3):", "", "| seed | CPU | tfs-rot | spt-rot | conv-rot | conv40-rot |",
                  "|---|---|---|---|---|---|"] + length
    escape = escape_rows(cells, folder)
    if escape:
        lines += ["", "Sinusoidal SPT to the 15-epoch cap, per seed: SPT validation loss (nats) at epochs 3 and 15, "
                  "the first epoch below 3.0 (it leaves the plateau), mean attention distance per layer after SPT, and "
                  "test accuracy % against the seed's TFS:", "", "| seed | CPU | SPT val loss, epoch 3 / 15 | left at "
                  "epoch | distance after SPT, layer 1 / 2 | conv-sin | tfs-sin |", "|---|---|---|---|---|---|---|"]
        lines += escape
    attention = attention_rows(cells)
    if attention:
        n_layers = attention[0].count("uniform")
        lines += ["", "Mean attention distance Σ_j a_ij |i − j| on the validation inputs (tools/attention_offsets.py), "
                  "mean over heads, then seeds:", "",
                  "| arm | checkpoint | n | " + " | ".join(f"layer {i + 1}" for i in range(n_layers)) + " |",
                  "|---" * (3 + n_layers) + "|"] + attention
    return lines + [""]
