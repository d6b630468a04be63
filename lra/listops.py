"""listops.py: the ListOps task (Nangia & Bowman 2018) as the Long Range Arena uses it (Tay et al., ICLR 2021).
value:  [MAX 2 [MIN 4 7 ] 0 ] = max(2, min(4, 7), 0) = 4; operators MIN, MAX, MED (median, truncated), SM (sum mod 10)
tokens: parentheses are decoration, `]` is kept; digit d -> id 4 + d, [MIN [MAX [MED [SM ] -> 14..18 (0-3: lra_files.py)
LRA's generator (lra_benchmarks/data/listops.py): random trees, depth ≤ 10, 2..10 arguments, 500 < length < 2000
check:  evaluate_listops reproduces all 10,000 labels of the original ListOps test set, and generated trees follow
        LRA's rules -> tests/test_listops.py; the release and original TSV formats -> tests/test_lra_data.py
"""
import random
import re
import shutil
import statistics
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lra.files import (EOS, GENERATED_MARK, N_SPECIAL, REGET, DataError, check_output_folder, note_if, open_source,
                       plural, read_mark, write_mark)

LISTOPS_SYMBOLS = [str(d) for d in range(10)] + ["[MIN", "[MAX", "[MED", "[SM", "]"]
LISTOPS_ID = {s: N_SPECIAL + i for i, s in enumerate(LISTOPS_SYMBOLS)}     # "0" -> 4 ... "]" -> 18
LISTOPS_OPS = {"[MIN": min, "[MAX": max, "[MED": lambda a: int(statistics.median(a)), "[SM": lambda a: sum(a) % 10}
MAX_DEPTH, MAX_ARGS = 10, 10          # LRA's trees: at most 10 deep, 2..10 arguments per operator


def listops_tokens(expr):
    """Tokens of a ListOps expression: parentheses are decoration, `]` closes an operator and is kept."""
    return expr.replace("(", " ").replace(")", " ").split()


def evaluate_listops(expr):
    """Value 0..9 of a ListOps expression (str in the LRA or original format, or a token list). Raises DataError."""
    tokens = listops_tokens(expr) if isinstance(expr, str) else expr
    ops, args = [], [[]]                         # open operators and, per nesting level, the values seen so far
    for tok in tokens:
        if tok in LISTOPS_OPS:
            ops.append(tok)
            args.append([])
        elif tok == "]":
            if not ops or not args[-1]:
                raise DataError(f"ListOps: ']' without an operator or arguments in {expr!r:.80}")
            values = args.pop()
            args[-1].append(LISTOPS_OPS[ops.pop()](values))      # MED truncates like int(np.median) in both generators
        elif len(tok) == 1 and tok.isdigit():
            args[-1].append(int(tok))
        else:
            raise DataError(f"ListOps: unknown token {tok!r} in {expr!r:.80}")
    if ops or len(args[0]) != 1:
        raise DataError(f"ListOps: unbalanced expression {expr!r:.80}")
    return args[0][0]


# ----------------------------------------------------------------------------- LRA's generator

def _listops_tree(rng, depth):
    """One LRA ListOps tree -> (string with parentheses, value, length = operators + digits + `]`)."""
    if depth >= MAX_DEPTH or rng.random() > 0.25:            # a digit leaf with prob. 0.75, always at max_depth
        v = rng.randrange(10)
        return str(v), v, 1
    op = rng.choice(tuple(LISTOPS_OPS))
    kids = [_listops_tree(rng, depth + 1) for _ in range(rng.randint(2, MAX_ARGS))]
    # LRA nests ((op, a1), a2) ... then (…, "]"): "( ( ( [MAX 2 ) 9 ) ] )" for [MAX 2 9 ]
    s = "( " * (len(kids) + 1) + op + " " + " ) ".join(k[0] for k in kids) + " ) ] )"
    return s, LISTOPS_OPS[op]([k[1] for k in kids]), 2 + sum(k[2] for k in kids)


def generate_listops(root, n_train=96000, n_val=2000, n_test=2000, seed=0, *,
                     min_length=500, max_length=2000):
    """LRA's ListOps generator: distinct trees with min_length < length < max_length, written as
    root/listops-1000/basic_{train,val,test}.tsv in the release format (header Source\\tTarget); returns that folder.
    Like generate_pathfinder it writes only into an absent, empty or own folder (GENERATED_MARK records every
    parameter) and never overwrites a file (FileExistsError); each file is written whole (a temporary, then
    renamed), and a folder of ours with the same parameters that a stopped run left without all three files is
    completed (the same trees: the generator is deterministic). ValueError for max_length - min_length < 2."""
    if max_length - min_length < 2:
        raise ValueError("need max_length - min_length >= 2")
    folder = Path(root) / "listops-1000"
    check_output_folder(folder)
    params = dict(n_train=n_train, n_val=n_val, n_test=n_test, seed=seed, min_length=min_length,
                  max_length=max_length, max_depth=MAX_DEPTH, max_args=MAX_ARGS)
    files = {p: folder / f"basic_{p}.tsv" for p in ("train", "val", "test")}
    ours = read_mark(folder) == params                    # a run of these parameters started here: complete it
    if (existing := [f for f in files.values() if f.exists()]) and not ours:
        raise FileExistsError(f"{existing[0]} already exists; the generator never overwrites a file: delete {folder} "
                              f"if it made it ({GENERATED_MARK} is there), or generate elsewhere")
    fresh = not folder.exists() or not any(folder.iterdir())
    folder.mkdir(parents=True, exist_ok=True)
    if not ours:
        write_mark(folder, "generate_listops", params)
    for tmp in folder.glob("*.tmp"):                      # a write a stopped run left unfinished
        tmp.unlink()
    rng = random.Random(seed)
    n = n_train + n_val + n_test
    trees = {}                                                   # dict: dedup, keeps generation order
    with tqdm(total=n, desc="generating ListOps") as bar:
        while len(trees) < n:
            s, value, length = _listops_tree(rng, 1)
            if min_length < length < max_length and s not in trees:
                trees[s] = value
                bar.update()
    rows = list(trees.items())
    bounds = {"train": (0, n_train), "val": (n_train, n_train + n_val), "test": (n_train + n_val, n)}
    try:
        for part, (lo, hi) in bounds.items():
            if files[part].exists():
                continue
            tmp = files[part].with_suffix(".tmp")
            with open(tmp, "x") as f:                                    # "x": FileExistsError, never overwrite
                f.write("Source\tTarget\n")
                f.writelines(f"{s}\t{v}\n" for s, v in rows[lo:hi])
            tmp.rename(files[part])
    except OSError:
        if fresh:                                                         # a full disk: give back what was written
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


# ----------------------------------------------------------------------------- reading the TSV files

def _read_listops(path, max_len, notes):
    """Rows (ids uint16 (≤ max_len,), label) of an LRA ListOps TSV (`expr\\tlabel`, header Source\\tTarget) or an
    original one (`label\\texpr`, Nangia & Bowman 2018). Raises DataError naming file and line."""
    blank, cut = 0, 0
    with open_source(path) as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:                        # a byte the ListOps alphabet never has
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start:e.start + 1]!r} at column "
                                f"{e.start + 1}): {REGET}") from None
            if lineno == 1 and line == "Source\tTarget":
                continue
            if not line.strip():
                blank += 1
                continue
            cols = [c.strip() for c in line.split("\t")]
            if len(cols) != 2 or not any(re.fullmatch(r"\d", c) for c in cols):
                raise DataError(f"{path}:{lineno}: expected 'expression<TAB>label' or 'label<TAB>expression' "
                                f"with a label 0-9, got {line[:60]!r}")
            label, expr = (int(cols[0]), cols[1]) if re.fullmatch(r"\d", cols[0]) else (int(cols[1]), cols[0])
            try:
                ids = [LISTOPS_ID[t] for t in listops_tokens(expr)]
            except KeyError as e:
                raise DataError(f"{path}:{lineno}: unknown ListOps token {e.args[0]!r}") from None
            cut += len(ids) >= max_len
            yield np.array(ids[: max_len - 1] + [EOS], np.uint16), label
    note_if(blank, f"skipped {plural(blank, 'empty line')} in {path}", notes)
    note_if(cut, f"{plural(cut, 'ListOps expression')} in {path} cut to {max_len} tokens (incl. EOS)", notes)


def listops_rows(folder, max_len, notes):
    """(part, [ids uint16 (≤ max_len,)], label) of folder/basic_{train,val,test}.tsv, the rows lra_data.py caches."""
    for part in ("train", "val", "test"):
        for ids, label in _read_listops(folder / f"basic_{part}.tsv", max_len, notes):
            yield part, [ids], label
