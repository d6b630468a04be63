"""lra_data.py: the seven Long Range Arena tasks (Tay et al., ICLR 2021) as cached PyTorch datasets.
tokens: ListOps (19 ids), Text and Retrieval (byte b -> id b+4); every sequence ends with EOS
pixels: Image (CIFAR-10 grey = 0.2989 R + 0.5870 G + 0.1140 B), Pathfinder 32² / PathX 128² / PathX-256 256² (8-bit)
check:  evaluate_listops reproduces all 10,000 labels of the original ListOps test set -> tests/test_lra_data.py
prepare once: python lra_data.py --task pathfinder [--data-dir data] [--generate 200000] [--workers 8]

Files are read as downloaded (SPEC.md §2): data_dir/{,lra_release/}listops-1000/basic_{train,val,test}.tsv,
tsv_data/new_aan_pairs.{train,eval,test}.tsv, pathfinder{32,128,256}/<difficulty>/metadata/*.npy;
data_dir/aclImdb/ or aclImdb*.tar.gz; data_dir/cifar-10-batches-py/ or cifar-10-python.tar.gz.
Cache: <cache_dir>/<task>[-<difficulty>]-<hash of source path>/{meta.json, <part>.y.npy, <part>.x.npy (pixels,
uint8 memmap) or <part>.tok (uint16 ids, all documents back to back) + <part>.off.npy (start of each document)}.
"""
import argparse
import math
import contextlib
import hashlib
import json
import multiprocessing
import os
import pickle
import random
import re
import shutil
import stat
import statistics
import sys
import tarfile
import time
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from tqdm import tqdm

PAD, MASK, EOS, UNK = 0, 1, 2, 3              # special ids shared by all token tasks (PAD = 0 = padding_idx)
N_SPECIAL = 4
LISTOPS_SYMBOLS = [str(d) for d in range(10)] + ["[MIN", "[MAX", "[MED", "[SM", "]"]
LISTOPS_ID = {s: N_SPECIAL + i for i, s in enumerate(LISTOPS_SYMBOLS)}     # "0" -> 4 ... "]" -> 18
LISTOPS_OPS = {"[MIN": min, "[MAX": max, "[MED": lambda a: int(statistics.median(a)), "[SM": lambda a: sum(a) % 10}
LISTOPS_OP_NAMES = tuple(LISTOPS_OPS)


@dataclass(frozen=True)
class Task:
    n_classes: int                 # C
    max_len: int                   # L: longest input, EOS included (pixels: side²)
    kind: str                      # "tokens" or "pixels"
    vocab_size: int                # V: token ids incl. the 4 specials, or 256 grey levels
    mask_ratio: float              # SPT masking probability p (paper §2)
    pool: str                      # "mean" or "max" over real positions
    pair: bool = False             # retrieval: two documents per example
    side: int | None = None        # image side in pixels


TASKS = {
    "listops":    Task(10, 2048, "tokens", N_SPECIAL + len(LISTOPS_SYMBOLS), 0.10, "mean"),
    "text":       Task(2, 4096, "tokens", N_SPECIAL + 256, 0.15, "mean"),
    "retrieval":  Task(2, 4001, "tokens", N_SPECIAL + 256, 0.15, "mean", pair=True),     # 4000 bytes + EOS per document
    "image":      Task(10, 1024, "pixels", 256, 0.50, "mean", side=32),
    "pathfinder": Task(2, 1024, "pixels", 256, 0.50, "mean", side=32),
    "pathx":      Task(2, 16384, "pixels", 256, 0.50, "max", side=128),
    "pathx256":   Task(2, 65536, "pixels", 256, 0.50, "max", side=256),
}
PATHFINDER_TASKS = ("pathfinder", "pathx", "pathx256")
DIFFICULTY = {"easy": "curv_baseline", "intermediate": "curv_contour_length_9", "hard": "curv_contour_length_14"}
CONTOUR_LENGTH = {"easy": 6, "intermediate": 9, "hard": 14}
SPLIT_SEED = 42                # every split we carve ourselves; 42 reproduces S4's Pathfinder random_split
KNOWN_EMPTY = {"pathfinder32/curv_baseline/imgs/0/sample_172.png"}     # an empty PNG in lra_release (S4 skips it too)
GENERATED_MARK = "generated_by_lra_data.txt"   # written next to generated data so .source can say so
LRA_DOWNLOAD = "download lra_release.gz from the LRA GitHub repo google-research/long-range-arena and unpack it into"
CACHE_VERSION = 1


class DataError(Exception):
    """Missing or malformed input. The message is one actionable line; train.py exits with status 2."""


# ----------------------------------------------------------------------------- tokenizers and ListOps

def byte_ids(data: bytes, max_len):            # -> uint16 (≤ max_len,): byte b -> b + 4, then EOS
    ids = np.frombuffer(data[: max_len - 1], np.uint8).astype(np.uint16) + N_SPECIAL
    return np.append(ids, np.uint16(EOS))


def listops_tokens(expr):
    """Tokens of a ListOps expression: parentheses are decoration, `]` closes an operator and is kept."""
    return expr.replace("(", " ").replace(")", " ").split()


def evaluate_listops(expr):
    """Value 0..9 of a ListOps expression (str in the LRA or original format, or a token list)."""
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


def _listops_tree(rng, depth, max_depth, max_args):
    """One LRA ListOps tree -> (string with parentheses, value, length = operators + digits + `]`)."""
    if depth >= max_depth or rng.random() > 0.25:            # a digit leaf with prob. 0.75, always at max_depth
        v = rng.randrange(10)
        return str(v), v, 1
    op = rng.choice(LISTOPS_OP_NAMES)
    kids = [_listops_tree(rng, depth + 1, max_depth, max_args) for _ in range(rng.randint(2, max_args))]
    # LRA nests ((op, a1), a2) ... then (…, "]"): "( ( ( [MAX 2 ) 9 ) ] )" for [MAX 2 9 ]
    s = "( " * (len(kids) + 1) + op + " " + " ) ".join(k[0] for k in kids) + " ) ] )"
    return s, LISTOPS_OPS[op]([k[1] for k in kids]), 2 + sum(k[2] for k in kids)


def generate_listops(root, n_train=96000, n_val=2000, n_test=2000, seed=0, *,
                     min_length=500, max_length=2000, max_depth=10, max_args=10):
    """LRA's ListOps generator: distinct trees with min_length < length < max_length, written as
    root/listops-1000/basic_{train,val,test}.tsv in the release format (header Source\\tTarget)."""
    if max_length - min_length < 2:
        raise ValueError("need max_length - min_length >= 2")
    rng, n, trees = random.Random(seed), n_train + n_val + n_test, {}     # dict: dedup, keeps generation order
    with tqdm(total=n, desc="generating ListOps") as bar:
        while len(trees) < n:
            s, value, length = _listops_tree(rng, 1, max_depth, max_args)
            if min_length < length < max_length and s not in trees:
                trees[s] = value
                bar.update()
    rows, folder = list(trees.items()), Path(root) / "listops-1000"
    folder.mkdir(parents=True, exist_ok=True)
    for part, lo, hi in (("train", 0, n_train), ("val", n_train, n_train + n_val), ("test", n_train + n_val, n)):
        with open(folder / f"basic_{part}.tsv", "w") as f:
            f.write("Source\tTarget\n")
            f.writelines(f"{s}\t{v}\n" for s, v in rows[lo:hi])
    (folder / GENERATED_MARK).write_text(f"generate_listops(seed={seed}, {n_train}/{n_val}/{n_test}, "
                                         f"{min_length} < length < {max_length}, depth <= {max_depth})\n")
    return folder


# ----------------------------------------------------------------------------- Pathfinder / PathX generator (snakes)
# path:  dash j+1 starts at a head h with |h - p| = L+m around the pivot p = ceil(p_j + (L+2m)·u(θ_j)), drawn with
#        P(h) ∝ (1 - dilate_m(occupancy)(h)) · max(cos(min(|θ_h - θ_j|·continuity, π/2)), 0)², redrawn if it touches
# image: bytescale(max(2 target paths, distractor paths, 2 marker discs)); label 1 <=> markers on both ends of one path
# Same algorithm, quirks and pixels as drewlinsley/pathfinder snakes2.py (its stamps drawn once, with PIL, as it
# draws them), ~100x faster. Check: tests/test_pathfinder_gen.py (vs ../shared/data/pathfinder_ref).

# res: dash length L, thickness t, margins m (one drawn per image), seed distance, marker radius, continuity, padding,
#      distractor budget B (B // (contour // 3) distractors of contour // 3 dashes), snake contrast, paddle contrast
PARAMS = {32: (2, 0.5, (1,), 7, 1.5, 1.0, 1, 20, 2.0, 0.75),     # LRA Pathfinder32 docstring
          64: (5, 1, (1,), 12, 2.5, 1.8, 1, 22, 0.8, 1.0),       # Pathfinder64, + snakes2_wrapper defaults
          128: (5, 1.5, (2, 3), 20, 3.0, 1.8, 1, 35, 0.9, 1.0),  # Pathfinder128 = Path-X
          256: (5, 2, (3,), 27, 5.0, 1.8, 22, 30, 1.0, 1.0)}     # Pathfinder256: padding, seed distance are defaults
AA = 2                                     # dashes and markers are drawn AA times finer, then Lanczos-resized
DASH_TRIES, SEED_TRIES, DISTRACTOR_TRIES = 3, 3, 5
TARGETS_MAY_TOUCH = False                  # True = the original: a dash is never tested against the other target path's
                                           # newest dash, so in ~25% of its images the two target paths overlap
FOLDERS = {6: "curv_baseline", 9: "curv_contour_length_9", 14: "curv_contour_length_14"}


def _disc(r):
    return [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1) if dy * dy + dx * dx <= r * r]


def _down(a, n):                           # 8-bit Lanczos resize as scipy.misc.imresize did -> float in [0, 1]
    return np.asarray(Image.fromarray(a).resize((n, n), Image.LANCZOS), np.float64) / 255


def _dash(theta, L, t, m, half):
    """Dash as the original draws it: a PIL line of width t·AA from the centre of a fine patch to ceil(centre +
    L·AA·(sin θ, cos θ)), Lanczos-resized to (2·half+1)²; its mask is the line dilated by a disc of radius m·AA."""
    n, c, r = 2 * half * AA + 1, half * AA, m * AA
    im = Image.new("L", (n, n))
    head = math.ceil(c + L * AA * np.cos(theta)), math.ceil(c + L * AA * np.sin(theta))   # (x, y): translate_coord
    ImageDraw.Draw(im).line([(c, c), head], fill=255, width=round(t * AA))
    pad = np.pad(np.asarray(im), r)
    mask = np.max([pad[r + dy:r + dy + n, r + dx:r + dx + n] for dy, dx in _disc(r)], 0)   # (n, n)
    return _down(np.asarray(im), 2 * half + 1), _down(mask, 2 * half + 1)


def _marker(r):                            # disc of radius r·AA on the fine grid, centred on the pixel (as draw_circle)
    h = math.ceil(r) + 4                   # + the reach of the Lanczos kernel
    y = np.arange((2 * h + 1) * AA) - h * AA
    return _down(((y[:, None] ** 2 + y[None, :] ** 2 <= (r * AA) ** 2) * 255).astype(np.uint8), 2 * h + 1)


@lru_cache(maxsize=None)
def _tables(res, m):
    """Everything that does not depend on the image. Dash index i < 360: seed dash at i - 180 degrees; 360 + k: the dash
    whose head is at offset k from its pivot (drawn back towards the pivot). Canvas = window + P on each side."""
    L, t, _, sd, mr, cont, pad, *_ = PARAMS[res]
    half = L + math.ceil(t) + m
    S, P = 2 * half + 1, max(L + 2 * m + 3, half + m, math.ceil(mr) + 4) + 1   # stamp side, canvas margin
    C = res + 2 * P                                                            # canvas side
    s = np.arange(0, 360, 360 / (2 * (L + m) * np.pi)) * np.pi / 180          # the original's samples of the circle
    off = np.unique(np.floor((L + m) * np.stack([np.sin(s), np.cos(s)], 1)).astype(int), axis=0)  # (K, 2): head-pivot
    ori = np.r_[np.arange(-180, 180) * np.pi / 180, np.arctan2(off[:, 0], off[:, 1])]             # (360+K,)
    flip = np.where(ori < 0, ori + np.pi, ori - np.pi)                 # flip_by_pi
    rev = np.where(ori + np.pi < np.pi, ori + np.pi, ori - np.pi)      # the seeds' reversal: same angle, other rounding
    d = np.abs(ori[:, None] - ori[None, 360:])
    W = np.maximum(np.cos(np.minimum(np.minimum(d, 2 * np.pi - d) * cont, np.pi / 2)), 0) ** 2    # (360+K, K)
    D, M = map(np.array, zip(*[_dash(a, L, t, m, half) for a in np.r_[ori[:360], flip[360:]]]))   # (360+K, S, S)
    M = M.astype(np.float32).astype(np.float64)                        # the original keeps masks in float32
    MD = np.zeros((len(M), 2, S + 2 * m, S + 2 * m))                   # (360+K, 2, S+2m, S+2m): mask, dilated mask
    MD[:, 0, m:m + S, m:m + S] = M
    for dy, dx in _disc(m):
        v = MD[:, 1, m + dy:m + dy + S, m + dx:m + dx + S]
        np.maximum(v, M, out=v)
    hot = []                               # mask pixels >= 0.8: the only ones that can make occupancy + mask >= 1.8
    for k in range(len(off)):
        a, b = np.nonzero(M[360 + k] >= 0.8 - 1e-9)
        o, v = (a - half) * C + b - half, M[360 + k, a, b]
        hot.append((o, v, list(zip(o.tolist(), v.tolist()))))
    # A seed avoids the occupancy dilated by the saturated pixels of its own mask, shifted by (1, 1) (the original's
    # head-centred struct). cv2.dilate gives -DBL_MAX where all of a pixel's references leave the image; the original
    # then finds no free pixel, so these seed angles always fail ("dead": 92% at 32 px): it thins out the distractors.
    struct = [o[(np.abs(o) <= L + m).all(1)] for o in (np.argwhere(M[i] == 1.0) - half + 1 for i in range(360))]
    g = np.arange(4 * (L + m) + 3)         # any window wider than a struct gives the same answer
    out = lambda v: (v < 0) | (v >= len(g))
    dead = [bool((out(g[:, None, None] + o[:, 0]) | out(g[None, :, None] + o[:, 1])).all(2).any()) for o in struct]
    e = max(2 * sd, pad)                   # first seed: tail in the free central box, with its struct inside the box
    assert e > L + m + 1                   # (then no reference leaves the image and the free tails form a rectangle)
    boxes = [(i, e - o[:, 0].min(), res - e - o[:, 0].max(), e - o[:, 1].min(), res - e - o[:, 1].max())
             for i, o in enumerate(struct) if not dead[i]]
    occ = np.ones((2, C, C))               # [0] occupancy: padding frame, 0 outside the window (the original clips)
    occ[0] = 0                             # [1] occupancy dilated by m, 1 outside the window: heads there weigh 0
    occ[0, P:P + res, P:P + res] = 1
    occ[0, P + pad:P + res - pad, P + pad:P + res - pad] = 0
    occ[1, P + pad + m:P + res - pad - m, P + pad + m:P + res - pad - m] = 0
    vec = lambda r, a: (r * np.stack([np.sin(a), np.cos(a)], 1)).tolist()
    return dict(res=res, m=m, half=half, S=S, P=P, C=C, off=off.tolist(), D=D, M=M, MD=MD, hot=hot, occ=occ, dead=dead,
                koff=(off[:, 0] * C + off[:, 1]).tolist(), step=vec(L + 2 * m, ori), hv=vec(L, ori), pv=vec(L + m, rev),
                cand=[[(k, int(off[k, 0] * C + off[k, 1]), float(W[i, k])) for k in np.flatnonzero(W[i] > 1e-12)]
                      for i in range(len(W))],                       # (weights cos(π/2)² ~ 4e-33 are never drawn)
                sflat=[o[:, 0] * C + o[:, 1] for o in struct], marker=_marker(mr),
                boxes=[x for x in boxes if x[1] < x[2] and x[3] < x[4]])


def _place(T, occ, i, y, x):
    """Add dash i (start at window pixel (y, x)) to the occupancy, clipped to the window as in the original, and to its
    dilation, which we keep up to date so that a step reads K pixels instead of dilating the whole image."""
    h, S, P, m, n = T["half"], T["S"], T["P"], T["m"], T["res"]
    y0, x0, e = y + P - h - m, x + P - h - m, S + 2 * m                # corner and side of the stamp in the canvas
    v = occ[:, y0:y0 + e, x0:x0 + e]
    if P <= y0 + m and y0 + m + S <= P + n and P <= x0 + m and x0 + m + S <= P + n:
        return np.maximum(v, T["MD"][i], out=v)
    np.maximum(v[1], T["MD"][i, 1], out=v[1])
    a, b, c, d = max(y0, P), min(y0 + e, P + n), max(x0, P), min(x0 + e, P + n)
    np.maximum(occ[0, a:b, c:d], T["MD"][i, 0, a - y0:b - y0, c - x0:d - x0], out=occ[0, a:b, c:d])


def _touches(T, i, y, x, other):
    """Do dash i at (y, x) and dash other = (j, yo, xo) overlap by the 1.8 rule?"""
    (j, yo, xo), S = other, T["S"]
    dy, dx = y - yo, x - xo
    if abs(dy) >= S or abs(dx) >= S:
        return False
    a = T["M"][i][max(0, -dy):S - max(0, dy), max(0, -dx):S - max(0, dx)]
    return (a + T["M"][j][max(0, dy):S - max(0, -dy), max(0, dx):S - max(0, -dx)]).max() >= 1.8


def _extend(rng, T, flat, pivot, i, avoid=None):
    """Dash after dash i with pivot `pivot` (extend_snake) -> (head, its pivot, its index), or None at a dead end.
    It may not touch the occupancy (flat view of both planes) nor the dash `avoid`. Plain Python: ~10 candidates."""
    P, C = T["P"], T["C"]
    py, px = math.ceil(pivot[0] + T["step"][i][0]), math.ceil(pivot[1] + T["step"][i][1])  # as translate_coord
    base = (py + P) * C + px + P
    cum, ks, total = [], [], 0.0
    for k, ko, wk in T["cand"][i]:         # weight = continuity x (1 - dilated occupancy at the head)
        v = wk * (1.0 - flat[C * C + base + ko])
        if v > 0:
            total += v
            cum.append(total)
            ks.append(k)
    if total < 1e-4:
        return None
    for _ in range(DASH_TRIES):
        k = ks[min(bisect_right(cum, rng.random() * total), len(ks) - 1)]
        head, (o, v, pairs) = base + T["koff"][k], T["hot"][k]
        if len(pairs) > 16:                # ~5 hot pixels at 32 px: Python; ~60 at 128 px: numpy
            free = (np.frombuffer(flat).take(head + o) + v).max() < 1.8
        else:
            free = all(flat[head + a] + b < 1.8 for a, b in pairs)
        y, x = py + T["off"][k][0], px + T["off"][k][1]
        if free and not (avoid and _touches(T, 360 + k, y, x, avoid)):
            return (y, x), (py, px), 360 + k
    return None


def _seed(T, i, y, x):
    """Pivot of seed dash i with its tail at (y, x), or None when its head or pivot leaves the window."""
    head = math.ceil(y + T["hv"][i][0]), math.ceil(x + T["hv"][i][1])
    pivot = math.ceil(head[0] + T["pv"][i][0]), math.ceil(head[1] + T["pv"][i][1])
    return pivot if 0 <= min(head + pivot) and max(head + pivot) < T["res"] else None


def _grow(rng, T, occ, paths, pivots, n_dash):
    """Grow paths (lists of dashes (i, y, x)) alternately to n_dash dashes each, in place; False at a dead end."""
    flat = memoryview(occ.reshape(-1))
    for _ in range(n_dash - 1):
        for p, path in enumerate(paths):
            other = None if TARGETS_MAY_TOUCH or len(paths) == 1 else paths[1 - p][-1]   # not yet in the occupancy
            r = _extend(rng, T, flat, pivots[p], path[-1][0], other)
            if r is None:
                return False
            head, pivots[p], i = r
            _place(T, occ, *path[-1])      # a dash joins the occupancy once the next one is down
            path.append((i, *head))
    for path in paths:                     # (two_snakes forgets target path 0's last dash here)
        _place(T, occ, *path[-1])
    return True


def _two_paths(rng, T, n_dash, seed_dist):
    """Two target paths grown alternately from seeds seed_dist apart; any failure restarts from scratch (two_snakes)."""
    while True:
        i0, y_lo, y_hi, x_lo, x_hi = T["boxes"][rng.randrange(len(T["boxes"]))]
        y0, x0 = rng.randrange(y_lo, y_hi), rng.randrange(x_lo, x_hi)
        pivots = [_seed(T, i0, y0, x0), None]
        for _ in range(SEED_TRIES if pivots[0] else 0):
            i1, a = rng.randrange(360), rng.randrange(360) * math.pi / 180
            y1, x1 = round(y0 + seed_dist * math.sin(a)), round(x0 + seed_dist * math.cos(a))   # half to even
            pivots[1] = _seed(T, i1, y1, x1)
            if pivots[1]:
                occ, paths = T["occ"].copy(), [[(i0, y0, x0)], [(i1, y1, x1)]]
                if _grow(rng, T, occ, paths, pivots, n_dash):
                    return occ, paths
                break


def _distractor(rng, T, occ, n_dash):
    """One try at a distractor path (seed_snake + make_snake) -> (new occupancy, dashes) or None."""
    n, P, C, mask = T["res"], T["P"], T["C"], occ[0]
    if (mask[P:P + n, P:P + n] <= 0.3).sum() < 0.01 * n * n:
        return None
    for _ in range(SEED_TRIES):
        i = rng.randrange(360)
        if T["dead"][i]:
            return None
        probes = np.array([(P + rng.randrange(n)) * C + P + rng.randrange(n) for _ in range(16)])
        free = probes[mask.take(probes[:, None] + T["sflat"][i]).max(1) <= 0.3]   # the first free probe is uniform
        if not len(free):                  # no free probe: list every free tail
            lin = mask.ravel()
            free = P * C + np.flatnonzero(np.max([lin[P * C + o:(P + n) * C + o] for o in T["sflat"][i]], 0) <= 0.3)
            free = free[(free % C >= P) & (free % C < P + n)]
            if not len(free):
                return None
            free = free[rng.randrange(len(free)):]
        tail = int(free[0]) // C - P, int(free[0]) % C - P
        pivot = _seed(T, i, *tail)
        if pivot:
            occ, path = occ.copy(), [(i, *tail)]
            return (occ, path) if _grow(rng, T, occ, [path], [pivot], n_dash) else None
    return None


def pathfinder_image(rng, res=32, contour_length=14, label=1, details=False):
    """One image, uint8 (res, res), max 255. rng: random.Random. label 1: the markers sit on both ends of one target
    path; label 0: on one end of each. details=True also returns dict(margin, paths, markers): paths = the two target
    paths as lists of dashes (stamp index, y, x) from the origin (seed tail) to the far end (head of the last dash)."""
    L, t, margins, sd, mr, cont, pad, budget, snake_c, paddle_c = PARAMS[res]
    T = _tables(res, margins[rng.randrange(len(margins))])
    occ, paths = _two_paths(rng, T, contour_length, sd)
    dashes = [(i, y, x, snake_c * paddle_c) for p in paths for i, y, x in p]   # 32 px: 1.5 vs 2, targets 25% dimmer
    for _ in range(budget // (contour_length // 3)):
        for _ in range(DISTRACTOR_TRIES):
            r = _distractor(rng, T, occ, contour_length // 3)
            if r:
                occ, dashes = r[0], dashes + [(i, y, x, snake_c) for i, y, x in r[1]]
                break
    P, h, hm = T["P"], T["half"], len(T["marker"]) // 2
    img = np.zeros((T["C"], T["C"]))
    for i, y, x, c in dashes:
        v = img[y + P - h:y + P + h + 1, x + P - h:x + P + h + 1]
        np.maximum(v, (c * T["D"][i]).astype(np.float32), out=v)      # float32 like the original's 'F' images
    o = rng.randrange(2)                   # origin of path o; far end of path o (label 1) or of the other one (0)
    markers = [paths[o][0][1:], paths[o if label else 1 - o][-1][1:]]
    for y, x in markers:
        v = img[y + P - hm:y + P + hm + 1, x + P - hm:x + P + hm + 1]
        np.maximum(v, T["marker"], out=v)
    img = img[P:P + res, P:P + res]
    img = ((img - img.min()) * (255 / (img.max() - img.min())) + 0.5).astype(np.uint8)   # scipy imsave's bytescale
    return (img, dict(margin=T["m"], paths=paths, markers=markers)) if details else img


def _write_batch(job):
    """Render batch k as imgs/<k>/sample_<j>.png and metadata/<k>.npy (plain text, the 11 fields of snakes2)."""
    out, res, contour_length, seed, k, labels = job
    L, t, cont = PARAMS[res][0], PARAMS[res][1], PARAMS[res][5]
    rng = random.Random(f"pathfinder/{seed}/{res}/{contour_length}/{k}")   # per batch: same bytes for any workers
    (out / "imgs" / str(k)).mkdir(parents=True, exist_ok=True)
    lines = []
    for j, label in enumerate(labels):
        img, info = pathfinder_image(rng, res, contour_length, label, details=True)
        Image.fromarray(img).save(out / "imgs" / str(k) / f"sample_{j}.png")
        lines.append(f"imgs/{k} sample_{j}.png {j} {label} {cont} {contour_length} {contour_length // 3} {L} {t} "
                     f"{info['margin']} 1\n")
    (out / "metadata" / f"{k}.tmp").write_text("".join(lines))
    (out / "metadata" / f"{k}.tmp").replace(out / "metadata" / f"{k}.npy")   # only finished batches have metadata
    return len(labels)


def generate_pathfinder(root, res=32, n=1000, contour_length=14, seed=0, workers=1, per_batch=1000):
    """Write n images, labels exactly balanced and shuffled, as root/pathfinder{res}/<difficulty folder>/{imgs/<k>/
    sample_<j>.png, metadata/<k>.npy} (the LRA release layout); returns the difficulty folder."""
    if res not in PARAMS or contour_length < 3:
        raise ValueError(f"pathfinder generator: res must be one of {sorted(PARAMS)} and contour_length >= 3, "
                         f"got res={res}, contour_length={contour_length}")
    out = Path(root) / f"pathfinder{res}" / FOLDERS.get(contour_length, f"curv_contour_length_{contour_length}")
    (out / "metadata").mkdir(parents=True, exist_ok=True)
    labels = [j % 2 for j in range(n)]
    random.Random(f"pathfinder/{seed}/{res}/{contour_length}/labels").shuffle(labels)
    jobs = [(out, res, contour_length, seed, k, labels[j:j + per_batch]) for k, j in enumerate(range(0, n, per_batch))]
    with tqdm(total=n, desc=f"pathfinder{res}/{out.name}", unit="img") as bar, \
            multiprocessing.Pool(workers) if workers > 1 else contextlib.nullcontext() as pool:
        for done in pool.imap_unordered(_write_batch, jobs) if pool else map(_write_batch, jobs):
            bar.update(done)
    return out


def measure_speed(res=32, contour_length=14, seconds=3.0):
    """Images per CPU-second of this process (= per core): pathfinder_image + PNG encoding, tables built beforehand."""
    import io
    for m in PARAMS[res][2]:
        _tables(res, m)
    rng, count, t0 = random.Random(0), 0, time.process_time()
    while time.process_time() - t0 < seconds:
        Image.fromarray(pathfinder_image(rng, res, contour_length, count % 2)).save(io.BytesIO(), format="PNG")
        count += 1
    return count / (time.process_time() - t0)


def _run_pathfinder_generator(root, res, n, difficulty, workers):
    cl = CONTOUR_LENGTH[difficulty]
    folder = generate_pathfinder(root, res=res, n=n, contour_length=cl, seed=0, workers=workers)
    (folder / GENERATED_MARK).write_text(f"generate_pathfinder(res={res}, n={n}, contour_length={cl}, seed=0)\n")
    return folder


# ----------------------------------------------------------------------------- readers of the official files
# Token readers yield (part, [ids per document], label); parts are written to the cache as they stream by.

def _blank_note(path, blank):
    if blank:
        print(f"note: skipped {blank} empty line(s) in {path}")


def _read_listops(path, max_len):
    """Rows of an LRA ListOps TSV (`expr\\tlabel`, header Source\\tTarget) or an original one (`label\\texpr`)."""
    blank, truncated = 0, 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
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
            truncated += len(ids) >= max_len
            yield np.array(ids[: max_len - 1] + [EOS], np.uint16), label
    _blank_note(path, blank)
    if truncated:
        print(f"note: {truncated} expressions in {path} were cut to {max_len} tokens (incl. EOS)")


def _listops_rows(folder):
    for part in ("train", "val", "test"):
        for ids, label in _read_listops(folder / f"basic_{part}.tsv", TASKS["listops"].max_len):
            yield part, [ids], label


def _aan_rows(folder):
    """LRA retrieval TSVs: no header; label (may be written 1.0), id1, id2, text1, text2."""
    max_len = TASKS["retrieval"].max_len
    for part, name in (("train", "train"), ("val", "eval"), ("test", "test")):
        path, blank, truncated = folder / f"new_aan_pairs.{name}.tsv", 0, 0
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip(b"\r\n")
                if not line.strip():
                    blank += 1
                    continue
                cols = line.split(b"\t")
                try:
                    label = float(cols[0])
                except ValueError:
                    label = -1.0
                if len(cols) != 5 or label not in (0.0, 1.0):
                    raise DataError(f"{path}:{lineno}: expected 5 tab-separated columns (label 0/1, id1, id2, "
                                    f"text1, text2), got {len(cols)} columns starting {line[:40]!r}")
                truncated += (len(cols[3]) >= max_len) + (len(cols[4]) >= max_len)
                yield part, [byte_ids(cols[3], max_len), byte_ids(cols[4], max_len)], int(label)
        _blank_note(path, blank)
        if truncated:
            print(f"note: {truncated} documents in {path} cut to {max_len - 1} bytes + EOS")


def _read_archive(src, keep, download):
    """{member name: bytes} of the files in a .tar.gz whose name passes `keep`, read without unpacking."""
    try:
        with tarfile.open(src, "r:gz") as archive:
            return {m.name: archive.extractfile(m).read()
                    for m in tqdm(archive, desc=f"reading {src.name}", unit=" files") if m.isfile() and keep(m.name)}
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"{src}: cannot read the archive ({e}); download {download} again") from None


IMDB_FILE = re.compile(r"(?:^|/)(train|test)/(pos|neg|unsup)/([^/]+\.txt)$")


def _find_imdb(data_dir):
    for root in (data_dir / "aclImdb", data_dir):           # the unpacked folder, or data_dir is that folder
        if all((root / s / lab).is_dir() for s in ("train", "test") for lab in ("pos", "neg")):
            return root
    tars = sorted(data_dir.glob("aclImdb*.tar.gz"), key=lambda p: (p.name != "aclImdb_v1.tar.gz", p.name))
    if tars:
        return tars[0]
    raise DataError(f"no IMDB reviews: looked for {data_dir / 'aclImdb'}/{{train,test}}/{{pos,neg}}/, "
                    f"{data_dir}/{{train,test}}/{{pos,neg}}/ and {data_dir}/aclImdb*.tar.gz; download "
                    f"aclImdb_v1.tar.gz from Stanford's Large Movie Review Dataset (aclImdb) page into {data_dir}")


def _imdb_rows(src):
    """Reviews from the aclImdb folder or straight from the archive, sorted by path so both give one order."""
    files = ({p.relative_to(src).as_posix(): p.read_bytes() for p in src.glob("*/*/*.txt")} if src.is_dir()
             else _read_archive(src, IMDB_FILE.search, "aclImdb_v1.tar.gz"))
    reviews = {m.groups(): data for name, data in files.items() if (m := IMDB_FILE.search(name))}   # (split, label, file)
    unlabeled = sum(label == "unsup" for _, label, _ in reviews)
    if unlabeled:
        print(f"note: ignored {unlabeled} unlabeled reviews in train/unsup/ (LRA uses only pos/neg)")
    max_len, truncated = TASKS["text"].max_len, 0
    for split, label, name in sorted(k for k in reviews if k[1] != "unsup"):
        data = reviews[split, label, name]
        truncated += len(data) >= max_len
        yield split, [byte_ids(data, max_len)], int(label == "pos")
    print(f"note: {truncated} of {len(reviews) - unlabeled} reviews cut to {max_len - 1} bytes + EOS")


def _cifar_batches(src):
    """{"train": (data uint8 (50000, 3072) RGB planes, labels (50000,)), "test": ...} from the folder or the archive."""
    files = ({p.name: p.read_bytes() for p in src.iterdir() if p.is_file()} if src.is_dir() else
             {Path(n).name: b for n, b in _read_archive(src, lambda n: "_batch" in n, "cifar-10-python.tar.gz").items()})
    out = {}
    for part, names in (("train", [f"data_batch_{i}" for i in range(1, 6)]), ("test", ["test_batch"])):
        datas, labels = [], []
        for name in names:
            if name not in files:
                raise DataError(f"{src}: CIFAR-10 batch {name} is missing; download cifar-10-python.tar.gz again")
            batch = pickle.loads(files[name], encoding="bytes")       # the official format is a pickle
            data, y = batch.get(b"data", batch.get("data")), batch.get(b"labels", batch.get("labels"))
            if data is None or y is None or np.shape(data) != (len(y), 3072) or not set(y) <= set(range(10)):
                raise DataError(f"{src}/{name}: not a CIFAR-10 python batch (need 'data' (n, 3072) uint8, 'labels' 0-9)")
            datas.append(np.asarray(data, np.uint8))
            labels.extend(y)
        out[part] = np.concatenate(datas), np.array(labels, np.int64)
    return out


def cifar_gray(data):                           # data: (n, 3072) uint8, R, G, B planes of 32×32 -> (n, 1024) uint8
    r, g, b = np.asarray(data, np.float64).reshape(len(data), 3, 1024).transpose(1, 0, 2)
    return np.clip(np.rint(0.2989 * r + 0.5870 * g + 0.1140 * b), 0, 255).astype(np.uint8)   # rounded to nearest


def _read_pngs(job):                            # runs in worker processes: (paths, side) -> (k, side²) uint8
    paths, side = job
    out = np.empty((len(paths), side * side), np.uint8)
    for k, path in enumerate(paths):
        try:
            with Image.open(path) as im:
                pixels = np.asarray(im if im.mode == "L" else im.convert("L"))
        except (OSError, ValueError, SyntaxError) as e:           # missing, empty, truncated or not an image
            raise DataError(f"{path}: cannot read this image ({e}); download or generate the data again") from None
        if pixels.shape != (side, side):
            raise DataError(f"{path}: image is {pixels.shape[1]}x{pixels.shape[0]} pixels, expected {side}x{side}")
        out[k] = pixels.reshape(-1)
    return out


def _metadata_files(folder):                    # batch ids can have gaps, so glob; sort numerically as S4 does
    return sorted((folder / "metadata").glob("*.npy"), key=lambda p: (not p.stem.isdigit(), int(p.stem) if p.stem.isdigit() else p.stem))


def _pathfinder_index(folder, side):
    """(image paths, labels) from metadata/<k>.npy: one line per image, `imgs/<k> sample_<j>.png <j> <label> ...`."""
    paths, labels, skipped = [], [], []
    for meta in _metadata_files(folder):
        raw = meta.read_bytes()
        if raw.startswith(b"\x93NUMPY"):        # the original generator's binary np.save of (n, 11) strings
            rows = [list(map(str, r)) for r in np.load(meta, allow_pickle=False)]
        else:
            rows = [line.split() for line in raw.decode("utf-8", errors="replace").splitlines()]
        for lineno, fields in enumerate(rows, 1):
            if not fields:
                continue
            if len(fields) < 4 or fields[3] not in ("0", "1"):
                raise DataError(f"{meta}:{lineno}: expected 'imgs/<k> sample_<j>.png <j> <label 0/1> ...', "
                                f"got {' '.join(fields)[:60]!r}")
            path = folder / fields[0] / fields[1]
            if f"pathfinder{side}/{folder.name}/{fields[0]}/{fields[1]}" in KNOWN_EMPTY and path.exists() and not path.stat().st_size:
                skipped.append(str(path))
                continue
            paths.append(path)
            labels.append(int(fields[3]))
    if skipped:
        print(f"note: skipped {len(skipped)} known-empty release image(s): {', '.join(skipped)}")
    return paths, np.array(labels, np.int64)


# ----------------------------------------------------------------------------- cache

def _writable(folder):
    # permission bits as well as os.access: root may write anywhere, yet a folder marked read-only stays untouched
    return folder.is_dir() and os.access(folder, os.W_OK) and bool(folder.stat().st_mode & stat.S_IWUSR)


def cache_root(data_dir, cache_dir=None):
    """cache_dir if given, else data_dir/cache when data_dir is writable, else ./data/cache."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(data_dir) / "cache" if _writable(Path(data_dir)) else Path("data") / "cache"


def _stamp(paths):                              # what the cache is valid for: names, sizes and times of the source
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


def _write_tokens(store, rows):
    """Stream rows (part, [ids, ...], label) into <part>.tok (uint16) + <part>.off.npy + <part>.y.npy."""
    files, offsets, labels = {}, {}, {}
    try:
        for part, docs, label in rows:
            if part not in files:
                files[part], offsets[part], labels[part] = open(store / f"{part}.tok", "wb"), [0], []
            for ids in docs:
                files[part].write(ids.astype(np.uint16).tobytes())
                offsets[part].append(offsets[part][-1] + len(ids))
            labels[part].append(label)
    finally:
        for f in files.values():
            f.close()
    for part in files:
        np.save(store / f"{part}.off.npy", np.array(offsets[part], np.int64))
        np.save(store / f"{part}.y.npy", np.array(labels[part], np.int64))
    return {part: len(labels[part]) for part in files}


def _write_pixels(store, part, labels, length, blocks):
    """Fill a uint8 (n, length) memmap block by block, so PathX (200k × 16384 bytes) never sits in RAM."""
    x = np.lib.format.open_memmap(store / f"{part}.x.npy", mode="w+", dtype=np.uint8, shape=(len(labels), length))
    i = 0
    with tqdm(total=len(labels), desc=f"caching {part} pixels", unit=" img") as bar:
        for block in blocks:                     # block: (k, length) uint8
            x[i: i + len(block)] = block
            i += len(block)
            bar.update(len(block))
    x.flush()
    np.save(store / f"{part}.y.npy", labels)
    return {part: len(labels)}


def _build_pathfinder(folder, side, workers, store):
    paths, labels = _pathfinder_index(folder, side)
    if not paths:
        raise DataError(f"{folder / 'metadata'}: the metadata files list no images")
    jobs = [(paths[i: i + 256], side) for i in range(0, len(paths), 256)]
    with multiprocessing.Pool(workers) if workers > 1 else contextlib.nullcontext() as pool:
        return _write_pixels(store, "all", labels, side * side, pool.imap(_read_pngs, jobs) if pool else map(_read_pngs, jobs))


def _build_cifar(src, store):
    sizes = {}
    for part, (data, labels) in _cifar_batches(src).items():
        sizes.update(_write_pixels(store, part, labels, 1024, [cifar_gray(data)]))
    return sizes


def _cached(store, src, stamp, build):
    """Sizes of the cached parts. Unless store/meta.json matches the source files, build(folder) runs in a
    private folder that then replaces store, so a crash or a second process never leaves a half-built cache."""
    meta = json.loads((store / "meta.json").read_text()) if (store / "meta.json").exists() else {}
    if meta.get("version") == CACHE_VERSION and meta.get("source") == str(src) and meta.get("stamp") == stamp:
        return meta["sizes"]
    tmp = store.with_name(f"{store.name}.building-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"caching {src} -> {store}")
    try:
        sizes = build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / "meta.json").write_text(json.dumps({"version": CACHE_VERSION, "source": str(src), "stamp": stamp, "sizes": sizes}))
    shutil.rmtree(store, ignore_errors=True)    # a cache of older source files
    try:
        os.replace(tmp, store)
    except OSError:                             # another process got there first with the same data
        shutil.rmtree(tmp, ignore_errors=True)
    return sizes


# ----------------------------------------------------------------------------- dataset, collate, load

class LRADataset(torch.utils.data.Dataset):
    """Examples `index` of one cached part; item = (x, label). Files are opened lazily in each process; pixel rows
    are read one by one, so a PathX-sized cache never enters memory."""

    def __init__(self, task, store, part, index, source, max_len=None):
        self.task, self.store, self.part, self.index, self.source = task, Path(store), part, index, source
        self.max_len = max_len                   # token tasks: keep the first max_len - 1 ids + EOS of each document
        self.labels = np.load(self.store / f"{part}.y.npy")[index]      # (n,) int64, for label balance / checks
        self._arrays = None

    def arrays(self):
        if self._arrays is None:
            if TASKS[self.task].kind == "pixels":
                x = np.load(self.store / f"{self.part}.x.npy", mmap_mode="r")  # (N, L) uint8; only its header is used
                self._arrays = open(x.filename, "rb"), x.offset, x.shape[1]     # file, where row 0 starts, L
            else:
                tok = self.store / f"{self.part}.tok"
                ids = np.memmap(tok, np.uint16, mode="r") if tok.stat().st_size else np.zeros(0, np.uint16)
                self._arrays = ids, np.load(self.store / f"{self.part}.off.npy")
        return self._arrays

    def __getstate__(self):                      # DataLoader workers reopen the memmap instead of pickling its bytes
        return {**self.__dict__, "_arrays": None}

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        j, y = int(self.index[i]), int(self.labels[i])
        if TASKS[self.task].kind == "pixels":
            # one row by a plain read: reading through a memmap would leave every page touched resident (PathX 3.3 GB)
            f, start, L = self.arrays()
            f.seek(start + j * L)
            return torch.frombuffer(bytearray(f.read(L)), dtype=torch.uint8), y    # (L,) uint8
        ids, off = self.arrays()
        docs = [ids[off[d]: off[d + 1]] for d in ((2 * j, 2 * j + 1) if TASKS[self.task].pair else (j,))]
        if self.max_len:                                                 # cut before copying: keep max_len - 1 + EOS
            docs = [np.append(d[: self.max_len - 1], np.uint16(EOS)) if len(d) > self.max_len else d for d in docs]
        docs = [torch.from_numpy(d.astype(np.int64)) for d in docs]
        if len(docs) == 1:
            return docs[0], y                                                    # (L,) int64
        return torch.nn.utils.rnn.pad_sequence(docs, batch_first=True, padding_value=PAD), y   # (2, L_pair)


def collate(batch):
    """[(x, label)] -> (x, lengths, y), padded with PAD to the batch's longest sequence (pixels: no padding)."""
    xs, y = [b[0] for b in batch], torch.tensor([int(b[1]) for b in batch], dtype=torch.long)    # y: (B,)
    if xs[0].dtype == torch.uint8:                                   # pixels: fixed length, raw 0..255
        x = torch.stack(xs)                                          # (B, L) uint8
        return x, torch.full((len(xs),), x.size(1), dtype=torch.long), y
    if xs[0].dim() == 2:                                             # retrieval: (2, L_pair) each
        lengths = torch.stack([(x != PAD).sum(-1) for x in xs])     # (B, 2); real ids are never PAD
        x = torch.full((len(xs), 2, int(lengths.max())), PAD, dtype=torch.long)   # (B, 2, L)
        for b, xb in enumerate(xs):
            x[b, :, : xb.size(1)] = xb
        return x, lengths, y
    lengths = torch.tensor([len(x) for x in xs], dtype=torch.long)  # (B,)
    return torch.nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=PAD), lengths, y   # (B, L)


def normalize(x, task):                          # x: (B, L) uint8 -> (B, L) float32
    x = x.float() / 255
    if task == "image":
        return (x - 122.6 / 255) / (61 / 255)     # CIFAR grey mean/std used by LRA
    if task in PATHFINDER_TASKS:
        return x * 2 - 1                          # [-1, 1]
    raise DataError(f"normalize: {task!r} is not a pixel task")


def _release_path(data_dir, rel):                # accepts data_dir/rel and the unpacked release data_dir/lra_release/rel
    candidates = [data_dir / rel, data_dir / "lra_release" / rel, data_dir / "lra_release" / "lra_release" / rel]
    return next((c for c in candidates if c.exists()), candidates[0])


def _source_text(folder):
    if (folder / GENERATED_MARK).exists():
        return f"generated by lra_data.py (not the official release) at {folder}"
    return f"release-format files, not generated by lra_data.py, at {folder}"


def _locate(task, data_dir, difficulty, generate, workers):
    """-> (source path, source description, stamp files, build(store) -> sizes); generates synthetic data on request."""
    if task == "listops":
        folder = _release_path(data_dir, "listops-1000")
        files = [folder / f"basic_{p}.tsv" for p in ("train", "val", "test")]
        if not all(f.exists() for f in files) and generate:
            n_eval = max(1, generate // 50)                          # 96000/2000/2000 for --generate 100000
            folder = generate_listops(data_dir, generate - 2 * n_eval, n_eval, n_eval)
            files = [folder / f"basic_{p}.tsv" for p in ("train", "val", "test")]
        if missing := [f for f in files if not f.exists()]:
            raise DataError(f"no ListOps file {missing[0]} (also looked under lra_release/); {LRA_DOWNLOAD} {data_dir}, "
                            f"or generate data: python lra_data.py --task listops --data-dir {data_dir} --generate 100000")
        return folder, _source_text(folder), files, lambda store: _write_tokens(store, _listops_rows(folder))
    if task == "retrieval":
        folder = _release_path(data_dir, "tsv_data")
        files = [folder / f"new_aan_pairs.{p}.tsv" for p in ("train", "eval", "test")]
        if missing := [f for f in files if not f.exists()]:
            raise DataError(f"no retrieval file {missing[0]} (also looked under lra_release/); {LRA_DOWNLOAD} {data_dir}")
        return folder, _source_text(folder), files, lambda store: _write_tokens(store, _aan_rows(folder))
    if task == "text":
        src = _find_imdb(data_dir)
        stamp = [src / s / lab for s in ("train", "test") for lab in ("pos", "neg")] if src.is_dir() else [src]
        return src, f"IMDB (Maas et al. 2011) at {src}", stamp, lambda store: _write_tokens(store, _imdb_rows(src))
    if task == "image":
        src = next((p for p in (data_dir / "cifar-10-batches-py", data_dir / "cifar-10-python.tar.gz") if p.exists()), None)
        if src is None:
            raise DataError(f"no CIFAR-10: looked for {data_dir / 'cifar-10-batches-py'}/ and "
                            f"{data_dir / 'cifar-10-python.tar.gz'}; download cifar-10-python.tar.gz from "
                            f"Krizhevsky's CIFAR-10 page into {data_dir}")
        stamp = sorted(src.iterdir()) if src.is_dir() else [src]
        return src, f"CIFAR-10 python batches at {src}", stamp, lambda store: _build_cifar(src, store)
    side = TASKS[task].side
    rel = Path(f"pathfinder{side}") / DIFFICULTY[difficulty]
    folder = _release_path(data_dir, rel)
    if not _metadata_files(folder) and generate:
        folder = _run_pathfinder_generator(data_dir, side, generate, difficulty, workers)
    if not (metas := _metadata_files(folder)):
        raise DataError(f"no {task} files: looked for {folder / 'metadata'}/*.npy (also under lra_release/); "
                        f"{LRA_DOWNLOAD} {data_dir}, or generate data: python lra_data.py --task {task} "
                        f"--data-dir {data_dir} --difficulty {difficulty} --generate 200000")
    return folder, _source_text(folder), metas, lambda store: _build_pathfinder(folder, side, workers, store)


def _split(task, split, sizes, lra_val):
    """-> (cached part, indices into it) for train/val/test."""
    if task in PATHFINDER_TASKS:                 # no official split: 80/10/10 by random_split order, as S4 does
        n = sizes["all"]
        n_val = n_test = int(0.1 * n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).numpy()
        bounds = {"train": (0, n - n_val - n_test), "val": (n - n_val - n_test, n - n_test), "test": (n - n_test, n)}
        lo, hi = bounds[split]
        return "all", np.sort(perm[lo:hi])
    if task in ("text", "image"):                # no official val split: carve 10% of train, unless the LRA habit
        if split == "test" or (split == "val" and lra_val):
            return "test", np.arange(sizes["test"])
        if lra_val:
            return "train", np.arange(sizes["train"])
        perm = torch.randperm(sizes["train"], generator=torch.Generator().manual_seed(SPLIT_SEED)).numpy()
        n_val = sizes["train"] // 10
        return "train", np.sort(perm[:n_val] if split == "val" else perm[n_val:])
    return split, np.arange(sizes.get(split, 0))  # listops, retrieval: the release's own train/val(eval)/test


def load(task, split, data_dir="data", *, data_fraction=1.0, seed=0, lra_val=False, difficulty="hard",
         cache_dir=None, generate=None, workers=1, max_len=None):
    """Dataset of (x, label) for one split of an LRA task, read through the cache (built on first use).

    data_fraction keeps a prefix of one permutation (fixed by `seed`) of the training split, so smaller
    subsets nest in larger ones; val/test never change. lra_val (text, image): validate on the test set
    and train on all of train, as LRA did; the other tasks have their own validation split.
    difficulty picks the Pathfinder/PathX folder; generate=N makes N examples of a synthetic task if missing.
    max_len (text, retrieval; >= 2) cuts each document to its first max_len - 1 bytes + EOS, below LRA's 4096/4000,
    for CPU-sized runs. ListOps cannot be cut (the answer needs the whole expression): generate shorter ones instead.
    Raises DataError for bad arguments or missing files.
    """
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if max_len is not None and (task not in ("text", "retrieval") or max_len < 2):
        raise DataError(f"max_len={max_len}: only text and retrieval documents can be cut, to at least 2 tokens "
                        f"(ListOps: generate shorter expressions; pixel tasks have a fixed length)")
    if (split not in ("train", "val", "test") or difficulty not in DIFFICULTY or not 0 < data_fraction <= 1
            or (generate is not None and generate < 10)):
        raise DataError(f"bad arguments split={split!r} (train/val/test), difficulty={difficulty!r} "
                        f"({'/'.join(DIFFICULTY)}), data_fraction={data_fraction} (0 < f <= 1), generate={generate} (>= 10)")
    data_dir = Path(data_dir)
    src, source, stamp_files, build = _locate(task, data_dir, difficulty, generate, workers)
    name = f"{task}-{difficulty}" if task in PATHFINDER_TASKS else task
    store = cache_root(data_dir, cache_dir) / f"{name}-{hashlib.sha1(str(src.resolve()).encode()).hexdigest()[:10]}"
    sizes = _cached(store, src.resolve(), _stamp(stamp_files), build)
    part, index = _split(task, split, sizes, lra_val)
    if len(index) == 0:
        raise DataError(f"{task}: the {split} split read from {src} is empty; check the files there (or generate more)")
    if split == "train" and data_fraction < 1:
        keep = torch.randperm(len(index), generator=torch.Generator().manual_seed(seed))[: max(1, round(data_fraction * len(index)))]
        index = index[np.sort(keep.numpy())]
    return LRADataset(task, store, part, index, source, max_len)


def main(argv=None):
    p = argparse.ArgumentParser(description="Read (or generate) one LRA task and cache it; prints source, sizes, label balance.")
    p.add_argument("--task", choices=TASKS, default="pathfinder", help="listops, text, retrieval, image, pathfinder, pathx, pathx256")
    p.add_argument("--data-dir", default="data", help="folder with the downloads (lra_release/ unpacked, aclImdb, CIFAR-10)")
    p.add_argument("--generate", type=int, default=None, help="listops/pathfinder/pathx: if the files are missing, generate N examples")
    p.add_argument("--workers", type=int, default=1, help="processes for reading or generating images")
    p.add_argument("--cache-dir", default=None, help="default: <data-dir>/cache if writable, else ./data/cache")
    p.add_argument("--difficulty", choices=DIFFICULTY, default="hard", help="pathfinder tasks: curv_baseline / _9 / _14")
    p.add_argument("--lra-val", action="store_true", help="text, image: validate on the test set, as LRA did")
    p.add_argument("--speed", action="store_true", help="pathfinder tasks: measure the generator's images/s per core and exit")
    args = p.parse_args(argv)
    if args.speed and args.task in PATHFINDER_TASKS:
        res, cl = TASKS[args.task].side, CONTOUR_LENGTH[args.difficulty]
        print(f"pathfinder{res} contour {cl}: {measure_speed(res, cl):.1f} images/s per core")
        return 0
    try:
        for split in ("train", "val", "test"):
            ds = load(args.task, split, args.data_dir, lra_val=args.lra_val, difficulty=args.difficulty,
                      cache_dir=args.cache_dir, generate=args.generate, workers=args.workers)
            if split == "train":
                print(f"source: {ds.source}\ncache:  {ds.store}")
            counts = np.bincount(ds.labels, minlength=TASKS[args.task].n_classes)
            balance = " ".join(f"{c}:{k / max(len(ds), 1):.1%}" for c, k in enumerate(counts))
            print(f"{split:5s} {len(ds):7d} examples | labels {balance}")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
