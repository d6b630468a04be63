"""summarize.py: rebuild results/summary.md and the plots from the run folders that train.py wrote.
Each run folder holds config.json (settings, command, commit), log.jsonl (one record per evaluation), log.txt and
results.json (test accuracy of the best-validation checkpoint); S4/DLR folders may hold kernels.json (kernels.py).
Each --runs folder is a study: its runs are grouped into cells (task x setting x training examples x model x TFS/SPT
variant), and runs of different studies never share a cell. A cell's seeds give mean ± std (sample std, ddof 1).
"Optimisation speed" (the paper, Fig. 5) is the first fine-tuning step at which validation accuracy exceeds chance
(1 / classes) + 5 points ("never" if it does not within the budget), read at the run's evaluations (every
--eval-every epochs), so its resolution is the spacing of those.
A study gets the at-a-glance and every-cell tables and plots of val accuracy over fine-tuning steps, of test accuracy
against the number of training examples and of the kernels (the paper, Fig. 4, from kernels.json). A study whose runs
compare SPT objectives (train.py --objective) or split one step budget between SPT and fine-tuning (as in the paper,
Table 8) gets those tables and plots instead of the glance table and the curves (results/objectives.sh).
    python results/summarize.py                     # results/study + results/objectives -> results/summary.md, *.png
    python results/summarize.py --runs results/explore --out results/explore --title "Exploratory runs"
The output depends only on the run folders (sorted, no dates), so running it twice gives identical files; summary.md
is the same whether or not matplotlib (optional, for the plots) is installed.
"""
import argparse
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from tools import checked  # noqa: E402  (checked reads; outputs over our own files only)
import plots  # noqa: E402  (results/plots.py: the figures, matplotlib optional)
import stats  # noqa: E402  (results/stats.py: t intervals, exact McNemar)
import why_spt_tables  # noqa: E402  (results/why_spt_tables.py: that study's tables)

SKIP = "this run folder is skipped (rerun or resume the run, or delete the folder)"
MARGIN = 0.05                                     # "left chance": val accuracy > chance + 5 points
STUDIES = ("control", "study", "objectives", "why_spt")  # default --runs: results/<name>, skipped while missing
CAVEATS = {   # how far the earlier studies' tables carry (README, "The result"); the numbers are in the tables
    "study": "Caveat: 3 seeds and 500 test reviews (one test accuracy's standard error is about 2 points), and about "
             "half the Text runs (22 of 42, ties counted) were at their best at their last evaluation: of the "
             "SPT − TFS gains below, only those whose interval excludes 0 are outside noise (DLR's on Text).",
    "objectives": "Caveat: 3 seeds and 500 test reviews: the objectives differ within noise, except that DLR gains "
                  "more from masked than from rtd SPT in every seed (their SPT − TFS rows, seed by seed).",
}
ARMS = ("TFS", "TFS-long", "SPT")                 # the control study's arms (results/control.py)
MODELS = ("transformer", "s4", "dlr")             # row and panel order
OBJECTIVES = ("masked", "span", "causal", "rtd")  # train.py --objective, in column order


def read_records(log):
    """A log.jsonl's records, in order (tools/checked.py: a line a cut write left is skipped)."""
    return checked.read_records(log, SKIP)


def read_or_note(folder, read=None):
    """read_run (or `read`), or None with a note when a file of the folder is damaged: one never stops the rest."""
    try:
        return (read or read_run)(*([folder, SKIP] if read else [folder]))
    except checked.Damaged as e:
        print(f"note: {e}", flush=True)


def read_run(folder):
    """-> dict with the fields the summary needs, or None if the run has not finished (no results.json)."""
    if not (folder / "results.json").is_file():
        return None
    config, results, records = checked.read_run_folder(folder, SKIP)
    a, c = config["args"], config["config"]
    chance = 1 / config["head"]["n_classes"]
    curve = [(r["step"], r["val_acc"]) for r in records if r.get("phase") == "finetune"]  # [(step, val acc)]
    spt_records = [r for r in records if r.get("phase") == "spt"]
    kind = "SPT" if a["spt"] and spt_records else "init" if a.get("init_from") else "TFS"
    recipe = f"{objective_label(a)}, lr {a['pretrain_lr']:g}" if kind == "SPT" else ""  # SPT label minus steps
    spt = dict(SPT=f"SPT ({spt_records[-1]['step'] if spt_records else 0} steps, {recipe})", TFS="TFS",
               init=f"from {Path(a['init_from'] or '').name}")[kind]
    # the setting leaves out the training-set size (its own column) and the epochs (the step budget says it all)
    steps = f"{curve[-1][0]} steps" if curve else None
    setting = [f"{a['difficulty']}" if a["task"].startswith("path") else None,
               f"L ≤ {a['max_len']}" if a.get("max_len") else None, f"D{c['d_model']}x{c['n_layers']}",
               "causal" if a.get("causal") else None, f"lr {a['lr']:g}", f"batch {a['batch_size']}", steps,
               f"val/test {a['max_eval'] or 'all'}"]
    kernels = checked.read_json(folder / "kernels.json", SKIP) if (folder / "kernels.json").is_file() else None
    predictions = folder / "test_predictions.json"
    predictions = checked.read_json(predictions, SKIP) if predictions.is_file() else None
    # model-specific knobs go with the model's name, so the models of one setting share its plots
    model = config["model_name"] + (f" (N{c['d_state']}, ssm lr {c['ssm_lr']:g})" if "d_state" in c else "")
    return dict(name=folder.name, model=model, task=config["task"], seed=a["seed"],
                spt=spt, kind=kind, objective=a.get("objective", "masked") if kind == "SPT" else kind, recipe=recipe,
                setting=" · ".join(s for s in setting if s), base=" · ".join(s for s in setting if s and s != steps),
                spt_steps=spt_records[-1]["step"] if spt_records else 0, ft_steps=curve[-1][0] if curve else 0,
                n_train=results.get("n_train") or n_train_from_log(folder), chance=chance, curve=curve,
                test=results["test_acc"], best_val=results["best_val_acc"], params=results["params"],
                # the phases' sum: before commit 2ceea81 a resumed run's "total" counted its last session only
                seconds=sum(v for k, v in results["wall_time_s"].items() if k != "total"),
                spt_seconds=results["wall_time_s"].get("spt", 0),
                git=config.get("git", "?"), torch=config.get("torch", "?"), device=config.get("device", "?"),
                command="python " + " ".join(config.get("command", [])), kernels=kernels,
                spt_loss=(spt_records[0]["val_loss"], spt_records[-1]["val_loss"]) if spt_records else None,
                spt_best=min(r["val_loss"] for r in spt_records) if spt_records else None,
                # runs before --pretrain-patience lack the key: their SPT records count the epochs run
                spt_epochs_run=results.get("spt_epochs") or (max(r["epoch"] for r in spt_records) if spt_records
                                                             else None),
                speed=next((step for step, acc in curve if acc > chance + MARGIN), None), predictions=predictions,
                best_epoch=results.get("best_epoch"), last_epoch=max((r["epoch"] for r in records
                                                                     if r.get("phase") == "finetune"), default=0))


def objective_label(a):
    """An SPT objective and its knobs as config.json's args give them (the study's masked runs: 'mask 0.15')."""
    objective, ratio = a.get("objective", "masked"), f"mask {a['mask_ratio']:g}"
    if objective == "span":
        return f"span, {ratio}, mean {a['span_mean']:g}"
    if objective == "rtd":
        return (f"rtd, {ratio}, generator D{a['gen_width']}x{a['gen_layers']}, λ {a['rtd_weight']:g}"
                + (", GDES" if a["gdes"] else ""))
    return ratio if objective == "masked" else objective


def n_train_from_log(folder):
    """Training examples of a run whose results.json predates its "n_train" entry: log.txt's "data: ..." line."""
    log = checked.read_text(folder / "log.txt", SKIP) if (folder / "log.txt").is_file() else ""
    found = re.search(r"\| train ([\d,]+) /", log)
    if not found:
        raise checked.Damaged(f"{folder}: no n_train in results.json and no 'data: ... | train N /' line in "
                              f"log.txt: {SKIP}")
    return int(found.group(1).replace(",", ""))


def mean_std(values, scale=100, digits=1):
    """'m ± s' (sample std) of values x scale; a single value has no std."""
    values = [v * scale for v in values]
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def model_order(model):
    """Sort key: the Transformer, S4, DLR (MODELS), then any other model, by name."""
    name = model.split()[0]
    return (MODELS.index(name) if name in MODELS else len(MODELS), model)


def cells_of(runs):
    """{(task, setting, n_train, model, spt): [runs sorted by seed]} of one study, keys sorted (largest training set
    first, TFS before SPT)."""
    cells = defaultdict(list)
    for r in runs:
        cells[(r["task"], r["setting"], r["n_train"], r["model"], r["spt"])].append(r)
    order = sorted(cells, key=lambda k: (k[0], k[1], -k[2], k[3], k[4] != "TFS", k[4]))
    return {k: sorted(cells[k], key=lambda r: (r["seed"], r["name"])) for k in order}


GLANCE_COLUMNS = [(m, k) for m in MODELS for k in ("TFS", "SPT")]
# The paper's test accuracies (%, README's table of them; Transformer TFS is the LRA paper's) for the tasks of the
# study, Transformer and S4 TFS / SPT. The paper gives DLR only as an average over tasks (≈77 TFS / 83.4 SPT): "–".
PAPER = {task: dict(zip(GLANCE_COLUMNS, accs)) for task, accs in {
    "listops": (36.37, 61.49, 59.60, 61.25), "text": (64.27, 91.02, 86.82, 90.34),
    "pathfinder": (71.40, 94.16, 94.20, 94.92)}.items()}


def glance(cells):
    """The compact table: a row per (task, setting, training examples) with test accuracy mean ± std (seeds) per model
    and TFS/SPT, each task followed by the paper's row. Where a group has several SPT variants (length, mask ratio),
    the one most models ran is in the main row and each other variant gets a row of its own. -> lines of markdown."""
    groups = defaultdict(lambda: defaultdict(dict))       # (task, setting, n) -> SPT label -> (model, TFS/SPT) -> text
    for (task, setting, n_train, model, spt), rs in cells.items():
        kind = "TFS" if spt == "TFS" else "SPT"
        groups[(task, setting, n_train)][spt if kind == "SPT" else ""][(model.split()[0], kind)] = \
            f"{mean_std([r['test'] for r in rs])} (n={len(rs)})"
    header = "| task · setting · training examples | " + " | ".join(f"{m} {k}" for m, k in GLANCE_COLUMNS) + " |"
    rows = [header, "|---" * (len(GLANCE_COLUMNS) + 1) + "|"]
    row = lambda label, found: f"| {label} | " + " | ".join(found.get(c, "–") for c in GLANCE_COLUMNS) + " |"
    for task in sorted({key[0] for key in groups}):
        for key in sorted((k for k in groups if k[0] == task), key=lambda k: (k[1], -k[2])):
            variants = sorted((v for v in groups[key] if v), key=lambda v: (-len(groups[key][v]), v))
            label = f"{task} · {key[1]} · {key[2]:,}"
            rows.append(row(label, {**groups[key].get("", {}), **(groups[key][variants[0]] if variants else {})}))
            rows += [row(f"{label} · variant {v}", groups[key][v]) for v in variants[1:]]
        if task in PAPER:
            rows.append(row(f"{task}: paper (full LRA, GPU)", {c: f"{v:.2f}" for c, v in PAPER[task].items()}))
    return rows


def paired_gains(rs, tfs):
    """SPT − TFS per seed in points, 'a / b / c → mean [95 % t interval]', for the runs rs whose seed has a TFS run
    ({seed: test acc}); the interval needs two seeds."""
    pairs = {r["seed"]: (r["test"], tfs[r["seed"]]) for r in rs if r["seed"] in tfs}
    if not pairs:
        return ""
    d = stats.paired(pairs)
    return " / ".join(f"{x:+.1f}" for x in d["diffs"]) + (f" → {stats.interval_text(d)}" if d["n"] > 1 else "")


def table(cells):
    """Every cell: one row per (task, setting, training examples, model, TFS/SPT variant). SPT rows also give
    SPT − TFS per seed: both runs of a seed share the initialisation and the batch order (train.py --seed)."""
    rows = ["| model | task | setting | train examples | SPT | seeds | test acc % | SPT − TFS per seed (points) | "
            "best val acc % | first step > chance + 5 (per seed) | SPT val loss first → last | params | "
            "wall time / run | git | hardware + torch |", "|---" * 15 + "|"]
    for (task, setting, n_train, model, spt), rs in cells.items():
        tfs = {r["seed"]: r["test"] for r in cells.get((task, setting, n_train, model, "TFS"), [])}
        gain = paired_gains(rs, tfs) if spt != "TFS" else ""
        speed = " / ".join(str(r["speed"]) if r["speed"] is not None else "never" for r in rs)
        spt_loss = " / ".join(f"{r['spt_loss'][0]:.3f} → {r['spt_loss'][1]:.3f}" for r in rs) \
            if rs[0]["spt_loss"] else "—"
        wall = statistics.mean(r["seconds"] for r in rs)
        gits = ", ".join(sorted({r["git"] for r in rs}))
        hw = ", ".join(sorted({f"{r['device']} + torch {r['torch']}" for r in rs}))
        rows.append(f"| {model} | {task} | {setting} | {n_train:,} | {spt} | {', '.join(str(r['seed']) for r in rs)} "
                    f"| {mean_std([r['test'] for r in rs])} | {gain or '—'} | {mean_std([r['best_val'] for r in rs])} "
                    f"| {speed} | {spt_loss} | {rs[0]['params']:,} | {wall / 60:.1f} min | {gits} | {hw} |")
    return rows


def objective_groups(runs):
    """The comparisons of one study, per (task, setting without its step count, training examples, T = the TFS runs'
    fine-tuning steps): main[model][column] -> runs, the TFS runs and the SPT runs with T fine-tuning steps on top
    of their SPT steps, a column per SPT recipe; tied[(model, column)][(SPT steps, fine-tuning steps)] -> runs, the
    SPT runs with T steps in all, and the TFS runs as the (0, T) point. A column is (objective, recipe), the recipe
    "" unless a model ran that objective in several ways (TFS: ("TFS", "")). Only groups with two SPT objectives or
    a compute-tied run. -> {key: (main, tied)}, keys sorted."""
    groups = {}
    for key in sorted({(r["task"], r["base"], r["n_train"], r["ft_steps"]) for r in runs if r["kind"] == "TFS"},
                      key=lambda k: (k[0], k[1], -k[2], k[3])):
        T, main, tied = key[3], defaultdict(lambda: defaultdict(list)), defaultdict(lambda: defaultdict(list))
        members = [r for r in sorted(runs, key=lambda r: (r["seed"], r["name"]))
                   if (r["task"], r["base"], r["n_train"]) == key[:3] and r["kind"] != "init"]
        recipes = defaultdict(set)                                   # a model's ways of running one objective
        for r in members:
            recipes[(r["model"], r["objective"])].add(r["recipe"])
        for r in members:
            column = (r["objective"], r["recipe"] if len(recipes[(r["model"], r["objective"])]) > 1 else "")
            if r["ft_steps"] == T:
                main[r["model"]][column].append(r)
            elif r["kind"] == "SPT" and r["spt_steps"] + r["ft_steps"] == T:
                tied[(r["model"], column)][(r["spt_steps"], r["ft_steps"])].append(r)
        for (model, _), points in tied.items():
            points[(0, T)] = main.get(model, {}).get(("TFS", ""), [])
        if len({o for by in main.values() for o, _ in by} - {"TFS"}) > 1 or tied:
            groups[key] = (main, tied)
    return groups


def columns_of(main):
    """Column order (TFS, then train.py's objectives) and headings: the objective's name, with its recipe where one
    objective ran in several ways in the group."""
    order = ("TFS",) + OBJECTIVES
    columns = sorted({col for by in main.values() for col in by},
                     key=lambda c: (order.index(c[0]) if c[0] in order else len(order), c))
    names = [c[0] for c in columns]
    return columns, [("TFS" if o == "TFS" else f"SPT {o}") + (f" ({recipe})" if recipe and names.count(o) > 1
                                                               else "") for o, recipe in columns]


def objective_tables(main):
    """Test accuracy per model (rows) and column (TFS, SPT objectives), with SPT − TFS paired by seed under it; then
    the cost: the SPT validation loss each objective reached and the wall time per run. -> lines of markdown."""
    columns, names = columns_of(main)
    header, rule = "| model | " + " | ".join(names) + " |", "|---" * (len(columns) + 1) + "|"
    acc, cost = [header, rule], [header, rule]
    for model in sorted(main, key=model_order):
        by = main[model]
        tfs = {r["seed"]: r["test"] for r in by.get(("TFS", ""), [])}
        tested = [f"{mean_std([r['test'] for r in by[c]])} (n={len(by[c])})" if c in by else "–" for c in columns]
        gains = [paired_gains(by[c], tfs) or "—" if c in by and c[0] != "TFS" else "—" for c in columns]
        acc += [f"| {model} | {' | '.join(tested)} |", f"| {model}: SPT − TFS per seed | {' | '.join(gains)} |"]
        spent = []
        for c in columns:
            rs = by.get(c, [])
            loss = mean_std([r["spt_best"] for r in rs], 1, 3) if rs and rs[0]["spt_best"] is not None else "—"
            wall = f"{statistics.mean(r['seconds'] for r in rs) / 60:.1f} min" if rs else "–"
            spt = f" (SPT {statistics.mean(r['spt_seconds'] for r in rs) / 60:.1f})" if rs and c[0] != "TFS" else ""
            spent.append(f"{loss} · {wall}{spt}" if rs else "–")
        cost.append(f"| {model} | {' | '.join(spent)} |")
    return acc, cost


def tied_table(tied, T):
    """Rows (model, objective), columns the SPT share of the T steps (0 %: the TFS runs): test accuracy mean ± std."""
    points = sorted({p for by in tied.values() for p in by})
    rows = ["| model · objective | " + " | ".join(f"{100 * s / T:.0f} % SPT ({s:,} + {f:,} steps)" + (
        " = TFS" if s == 0 else "") for s, f in points) + " |", "|---" * (len(points) + 1) + "|"]
    for (model, column), by in sorted(tied.items(), key=lambda kv: (model_order(kv[0][0]), kv[0][1])):
        found = [f"{mean_std([r['test'] for r in by[p]])} (n={len(by[p])})" if by.get(p) else "–" for p in points]
        rows.append(f"| {model} · {column[0]} | {' | '.join(found)} |")
    return rows


def arm_of(r, tfs_steps):
    """The control study's arm of a run: SPT, TFS (the shortest from-scratch run) or TFS-long (the others)."""
    return "SPT" if r["kind"] == "SPT" else ("TFS" if r["ft_steps"] == tfs_steps else "TFS-long")


def control_cells(runs):
    """{model: {arm: {seed: run}}} of the control study (results/control.py)."""
    cells = defaultdict(lambda: defaultdict(dict))
    spt = [r["ft_steps"] for r in runs if r["kind"] == "SPT"]   # TFS fine-tunes as long as SPT does
    tfs_steps = spt[0] if spt else min(r["ft_steps"] for r in runs)
    for r in sorted(runs, key=lambda r: r["name"]):
        cells[r["model"]][arm_of(r, tfs_steps)][r["seed"]] = r
    return {m: cells[m] for m in sorted(cells, key=model_order)}


CONTROL_PAIRS = [("SPT", "TFS"), ("SPT", "TFS-long"), ("TFS-long", "TFS")]


def control_section(runs, out, plt, study):
    """The control study: test accuracy per model and arm with 95 % t intervals over seeds; every pair of arms
    paired by seed (differences, their mean and interval, an exact McNemar test per seed on the test predictions);
    how many runs had their best validation checkpoint at their last evaluation. -> (lines, figures)."""
    cells = control_cells(runs)
    some = runs[0]
    spt = next((r for r in runs if r["kind"] == "SPT"), some)
    setting = (f"{some['task']} · {some['base']} · {some['n_train']:,} training examples · fine-tuning "
               f"{spt['ft_steps']:,} steps (TFS-long: {spt['spt_steps'] + spt['ft_steps']:,}) · {spt['spt']}")
    lines = [f"## SPT vs training from scratch, and from scratch for as long (`{study}/`)", "", setting, "",
             "Test accuracy %, mean [95 % t interval over seeds] (n = seeds). TFS-long trains from scratch for as "
             "many steps as the SPT run's pre-training and fine-tuning together, with the same schedule and the "
             "same evaluation after every epoch: the control for \"SPT only trained longer\".", ""]
    lines += ["| model | " + " | ".join(ARMS) + " |", "|---" * (len(ARMS) + 1) + "|"]
    for model, arms in cells.items():
        lines.append(f"| {model} | " + " | ".join(stats.accuracy_text(list(arms[a].values())) if arms.get(a) else "–"
                                                  for a in ARMS) + " |")
    lines += ["", "Paired by seed (both runs of a seed share its initialisation and batch order): the difference "
              "per seed in points, its mean [95 % t interval], and an exact McNemar test per seed on the two runs' "
              "predictions of the same test reviews.", "",
              "| model | comparison | per seed (points) | mean [95 % interval] | detectable at 80 % power | "
              "McNemar p per seed |", "|---|---|---|---|---|---|"]
    for model, arms in cells.items():
        for a, b in CONTROL_PAIRS:
            pairs = {s: (arms[a][s]["test"], arms[b][s]["test"]) for s in arms.get(a, {}) if s in arms.get(b, {})}
            if len(pairs) < 1:
                continue
            d = stats.paired(pairs)
            shown = stats.interval_text(d) if d["n"] > 1 else f"{d['mean']:+.1f}"
            sd = statistics.stdev(d["diffs"]) if d["n"] > 1 else 0   # the difference a paired t test finds
            detect = f"{stats.detectable_difference(sd, d['n']):.1f}" if sd else "–"   # 4 times in 5 at sd
            lines.append(f"| {model} | {a} − {b} | {' / '.join(f'{x:+.1f}' for x in d['diffs'])} | {shown} | "
                         f"{detect} | {stats.mcnemar_text(arms[a], arms[b])} |")
    spt = [r["spt_loss"][1] == r["spt_best"] for arms in cells.values() for r in arms.get("SPT", {}).values()]
    at_last = [(a, r["best_epoch"] == r["last_epoch"]) for arms in cells.values() for a in ARMS
               for r in arms.get(a, {}).values()]
    lines += ["", "Runs whose best validation checkpoint is their last evaluation (still improving when they "
              "stopped): " + ", ".join(f"{a} {sum(x for b, x in at_last if b == a)} of "
                                        f"{sum(1 for b, _ in at_last if b == a)}" for a in ARMS) +
              f"; in all {sum(x for _, x in at_last)} of {len(at_last)}. SPT phases whose lowest SPT validation "
              f"loss is at their last SPT epoch (still improving when cut): {sum(spt)} of {len(spt)}.", ""]
    figures = [(f"{study}_test_acc.png", "test accuracy per arm (dot: one seed; line: seed mean)")]
    if plt:
        plots.plot_control(cells, ARMS, out / figures[0][0], plt)
    lines += [f"![{figures[0][1]}]({figures[0][0]})", ""]
    return lines + [f"### Every cell of `{study}/`", ""] + table(cells_of(runs)) + [""], figures


def cells_section(runs, out, plt, study, first):
    """One study's glance and every-cell tables and plots; a study after the first is named in the headings and
    file names. -> (lines of markdown, [(file name, caption)])."""
    cells, of, prefix = cells_of(runs), "" if first else f" (`{study}/`)", "" if first else f"{study}_"
    figures = plots.plot_curves(cells, out, plt, MARGIN, prefix) + plots.plot_sizes(cells, out, plt, prefix)
    figures += plots.plot_kernels(runs, out, plt, prefix)
    lines = [f"## At a glance{of}: test accuracy %, mean ± std over seeds (n = seeds)", ""] + glance(cells) + [""]
    lines += [f"## Every cell{of}", ""] + table(cells) + [""]
    return lines + [line for name, caption in figures for line in (f"![{caption}]({name})", "")], figures


OBJECTIVES_NOTE = (
    "SPT on the task's own training inputs (masked: the paper's denoising; span: SpanBERT's masked spans; rtd: "
    "ELECTRA's replaced-token detection, GDES as in DeBERTaV3; each run's recipe: the SPT column of the every-cell "
    "table), then the TFS run's fine-tuning. SPT − TFS pairs the runs of a seed, which share initialisation and batch "
    "order (train.py --seed). SPT val loss: of the checkpoint fine-tuning starts from, each objective's own (masked, "
    "span: cross-entropy over the masked positions; rtd: generator cross-entropy + λ × discriminator cross-entropy), "
    "so it compares models within a column, never objectives. Wall time: mean over the cell's runs.")


def objectives_section(runs, groups, out, plt, study):
    """One study's objective comparisons (objective_groups), their plots, and its every-cell table."""
    lines, figures, count = [f"## SPT objectives (`{study}/`)", "", OBJECTIVES_NOTE, ""], [], defaultdict(int)
    for (task, base, n_train, T), (main, tied) in groups.items():
        tag, count[task] = task + (f"_{count[task]}" if count[task] else ""), count[task] + 1
        acc, cost = objective_tables(main)
        lines += [f"### {task} · {base} · {n_train:,} training examples · {T:,} fine-tuning steps", "",
                  "Test accuracy %, mean ± std over seeds (n = seeds); SPT − TFS per seed (points):", ""] + acc
        lines += ["", "SPT validation loss reached (own objective's) · wall time / run (SPT phase), min:", ""] + cost
        figures.append((f"objectives_{tag}.png", f"{task}: test accuracy per SPT objective, {base}"))
        if plt:
            plots.plot_objectives(main, *columns_of(main), sorted(main, key=model_order), out / figures[-1][0], plt)
        if tied:
            lines += ["", f"Compute-tied, as in the paper, Table 8: {T:,} steps in all, split between SPT and "
                      "fine-tuning; test accuracy %, mean ± std over seeds (n = seeds):", ""] + tied_table(tied, T)
            figures.append((f"objectives_budget_{tag}.png", f"{task}: {T:,} steps split between SPT and fine-tuning"))
            if plt:
                plots.plot_budget(tied, T, sorted({m for m, _ in tied}, key=model_order), out / figures[-1][0], plt)
        lines += [""]
    lines += [line for name, caption in figures for line in (f"![{caption}]({name})", "")]
    return lines + [f"### Every cell of `{study}/`", ""] + table(cells_of(runs)) + [""], figures


def unfinished_lines(folder, names, first):
    """A study's runs without results.json: the last evaluation each logged, and its command."""
    if not names:
        return []
    where = "" if first else f" of `{folder.name}/`"
    lines = [f"Unfinished runs{where} (no results.json: stopped before the end), not counted in the table:", ""]
    for u in names:
        try:
            config, _, records = checked.read_run_folder(folder / u, SKIP)
        except checked.Damaged as e:                                       # a damaged one: a note, the rest go on
            print(f"note: {e}", flush=True)
            continue
        last = next((r for r in reversed(records) if "val_acc" in r), None)
        seen = (f"last eval: {last['phase']} epoch {last['epoch']}, step {last['step']}, val acc "
                f"{last['val_acc'] * 100:.1f}%") if last else "no evaluation logged"
        command = "python " + " ".join(config.get("command", []))
        lines += [f"- `{u}`: {seen}  ", f"  `{command}`"]
    return lines + [""]


def main(argv=None):
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description="Rebuild summary.md and plots from train.py run folders.")
    p.add_argument("--runs", nargs="+", default=None, help="study folders, each holding run folders (default: "
                   f"{', '.join(f'results/{s}' for s in STUDIES)}, those that exist)")
    p.add_argument("--out", default=str(here), help="where summary.md and the .png plots go")
    p.add_argument("--title", default="Results: self pre-training (SPT) vs training from scratch (TFS)",
                   help="heading of summary.md")
    p.error = lambda message: (print(f"summarize.py: error: {message}", file=sys.stderr), sys.exit(2))
    args = p.parse_args(argv)
    folders = [Path(f) for f in args.runs] if args.runs else [here / s for s in STUDIES if (here / s).is_dir()]
    for folder in folders or [here / STUDIES[0]]:
        if not folder.is_dir():
            p.error(f"--runs {folder}: no such folder (it should hold train.py run folders)")
        if args.runs and not any((f / "config.json").is_file() for f in folder.iterdir()):
            p.error(f"--runs {folder}: no run folders in it (each has a config.json): pass a study folder")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out {out} is a file, not a folder: pass the folder for summary.md and the plots")
    if not checked.owned(out / "summary.md"):
        p.error(f"--out {out}: {out / 'summary.md'} exists and summarize.py did not write it (it is not in "
                f"{out / checked.MANIFEST}); it is left untouched: move it away or pass another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {out}: cannot make it ({e.strerror or e}): {checked.write_advice(e)}")
    try:     # a figure or summary.md over a file that is not ours, a full disk: one line, nothing else lost
        write_summary(args, folders, out)
    except checked.NotOwned as e:
        p.error(str(e))
    except OSError as e:
        p.error(f"cannot write into --out {out} ({e.strerror or e}): {checked.write_advice(e)}")


def write_summary(args, folders, out):
    """summary.md and the plots of the studies `folders` into `out`; then the plots of ours it no longer draws go."""
    plt, started = plots.pyplot(), time.time()
    studies = []                                                            # [(folder, runs, unfinished names)]
    for folder in folders:
        runs = sorted((f for f in folder.iterdir() if (f / "config.json").is_file()), key=lambda f: f.name)
        studies.append((folder, [r for r in map(read_or_note, runs) if r],
                        [f.name for f in runs if not (f / "results.json").is_file()]))
    n_runs = sum(len(runs) for _, runs, _ in studies)
    where = " and ".join(f"`{f.name}/`" + (f" ({len(runs)})" if len(studies) > 1 else "") for f, runs, _ in studies)
    lines = [f"# {args.title}", "",
             f"Generated by `python results/summarize.py --runs {' '.join(f.name for f in folders)} ...` from {n_runs} "
             f"finished run folders in {where} (each: config.json with the command and commit, log.jsonl, log.txt, "
             "results.json). Test accuracy is that of the best-validation checkpoint. mean ± std over seeds (sample "
             "std). 'first step > chance + 5': the first fine-tuning step (val is measured at each evaluation) at "
             f"which val accuracy exceeded chance + {MARGIN * 100:.0f} points, per seed. Wall time: whole run (SPT + "
             "fine-tuning + test).", ""]
    n_figures = 0
    for i, (folder, runs, unfinished) in enumerate(studies):
        groups = objective_groups(runs) if folder.name not in ("control", "why_spt") else None
        if not runs:
            section, figures = [f"## `{folder.name}/`", "", "No finished runs yet.", ""], []
        elif folder.name == "control":
            section, figures = control_section(runs, out, plt, folder.name)
        elif folder.name == "why_spt":
            section, figures = why_spt_tables.section(folder, runs, stats), []
            if plt and why_spt_tables.length_rows(cells := why_spt_tables.study_cells(folder, runs)):
                why_spt_tables.plot_length(cells, folder / "spt_length.png", plt)    # the study's figure, beside it
        elif groups:
            section, figures = objectives_section(runs, groups, out, plt, folder.name)
        else:
            section, figures = cells_section(runs, out, plt, folder.name, i == 0)
        if folder.name in CAVEATS:                                         # after the section's heading
            section[2:2] = [CAVEATS[folder.name], ""]
        lines += section + unfinished_lines(folder, unfinished, i == 0)
        n_figures += len(figures)
    lines += ["## Runs and exact commands", ""]
    for folder, runs, _ in studies:
        study = f"{folder.name}/" if len(studies) > 1 else ""
        for r in sorted(runs, key=lambda r: r["name"]):
            lines += [f"- `{study}{r['name']}`: test {r['test'] * 100:.1f}%, best val {r['best_val'] * 100:.1f}%, "
                      f"{r['seconds'] / 60:.1f} min, git {r['git']}  ", f"  `{r['command']}`"]
    checked.write_owned(out / "summary.md", "\n".join(lines) + "\n", "summarize.py")
    for name, tool in checked.manifest(out).items():                       # earlier plots of ours only
        if tool == "summarize.py" and name.endswith(".png") and (out / name).stat().st_mtime < started:
            checked.remove_owned(out / name)
    print(f"wrote {out / 'summary.md'} ({n_runs} runs in {len(studies)} studies) and {n_figures if plt else 0} plots")


if __name__ == "__main__":
    main()
