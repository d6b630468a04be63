"""pathfinder.py: the Pathfinder / PathX image generator ("snakes", Linsley et al., NeurIPS 2018) with LRA's settings.
path:  dash j+1 has its head h at distance length + margin from the pivot p = ceil(p_j + (length + 2·margin)·u(θ_j)),
       P(h) ∝ (1 - dilated occupancy(h)) · max(cos(min(|θ_h - θ_j|·continuity, π/2)), 0)², redrawn if it touches
image: bytescale(max(2 target paths, distractor paths, 2 marker discs)); label 1 <=> markers on both ends of one path
A re-implementation of drewlinsley/pathfinder snakes2.py: same algorithm, quirks and pixels, stamps drawn once with PIL.
Check: tests/test_pathfinder_gen.py (the original's pixel statistics, same bytes for any workers); speed: --speed.
"""
import io
import math
import random
import shutil
import time
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from lra.files import (GENERATED_MARK, check_output_folder, orphaned, read_mark, run_jobs, tick,
                       unfinished_batches, write_mark)

# Names used below (y, x = row, column; the repo's shape legend B, L, D, ... does not apply in this file):
#   dash        one short anti-aliased line segment ("paddle" in snakes2); a path ("snake") is a chain of dashes
#   tail, head  the start and the end of a dash; pivot: the centre of the circle on which the next dash's head lies
#   window      the res × res image; canvas: the window plus `border` pixels on each side, so stamps are never clipped
#   stamp       a dash pre-rendered on a side × side patch centred on its tail, side = 2·half + 1
#   dash index  i < 360: a seed dash at angle i - 180°; 360 + k: the dash whose head is head_offsets[k] from its pivot
#   occupancy   (2, canvas, canvas) float64: [0] the dash masks drawn so far, [1] the same dilated by the margin;
#               flat = a memoryview of both planes, pixel (y, x) of plane p at p·canvas² + y·canvas + x
#   mask        a dash dilated by a disc of radius margin: two dashes "touch" when mask + mask >= 1.8 somewhere
#   T, p        the Tables of one (res, margin) and the Params of one res; K: the number of head offsets
#   struct      the offsets a seed's tail must find free; flat offset: dy·canvas + dx in the flat occupancy
#   i, j, k     dash indices (see above) and a head offset; a, b, v: short-lived values explained where they appear


@dataclass(frozen=True)
class Params:                   # one per resolution; snakes2 names in brackets
    dash_length: int            # (paddle_length) pixels from a dash's tail to its head
    thickness: float            # (paddle_thickness) width of the drawn line, pixels
    margins: tuple              # (paddle_margin_list) free pixels kept around every dash; one is drawn per image
    seed_distance: int          # (seed_distance) pixels between the tails of the two target paths' first dashes
    marker_radius: float        # (marker_radius) radius of the two marker discs, pixels
    continuity: float           # (continuity) larger = straighter paths: turns are weighted by cos(Δθ·continuity)²
    padding: int                # (padding) frame at the window's edge that no dash may enter, pixels
    distractor_budget: int      # (num_distractor_snakes · distractor_length) budget // (contour // 3) distractors
    snake_contrast: float       # (snake_contrast_list) brightness of the distractor paths
    paddle_contrast: float      # (paddle_contrast_list) the target paths get snake_contrast × paddle_contrast


PARAMS = {   # values: the docstrings of LRA's lra_benchmarks/data/pathfinder.py, else snakes2_wrapper.py's defaults
    32: Params(dash_length=2, thickness=0.5, margins=(1,), seed_distance=7, marker_radius=1.5, continuity=1.0,
               padding=1, distractor_budget=20, snake_contrast=2.0, paddle_contrast=0.75),     # Pathfinder32
    64: Params(dash_length=5, thickness=1, margins=(1,), seed_distance=12, marker_radius=2.5, continuity=1.8,
               padding=1, distractor_budget=22, snake_contrast=0.8, paddle_contrast=1.0),      # Pathfinder64
    128: Params(dash_length=5, thickness=1.5, margins=(2, 3), seed_distance=20, marker_radius=3.0, continuity=1.8,
                padding=1, distractor_budget=35, snake_contrast=0.9, paddle_contrast=1.0),     # Pathfinder128, Path-X
    256: Params(dash_length=5, thickness=2, margins=(3,), seed_distance=27, marker_radius=5.0, continuity=1.8,
                padding=22, distractor_budget=30, snake_contrast=1.0, paddle_contrast=1.0),    # Pathfinder256; its
}   # padding and seed distance are the wrapper's defaults. distractor_budget follows LRA's docstrings (20 // 4 = 5
#     distractors at 32 px hard); snakes2_wrapper.py's own loop would give 10


@dataclass(frozen=True)
class Difficulty:
    contour_length: int         # dashes per target path; distractors have contour_length // 3
    folder: str                 # the LRA release's folder name


DIFFICULTIES = {"easy": Difficulty(6, "curv_baseline"), "intermediate": Difficulty(9, "curv_contour_length_9"),
                "hard": Difficulty(14, "curv_contour_length_14")}
AA = 2                          # anti-aliasing: dashes and markers are drawn AA times finer, then Lanczos-resized
DASH_TRIES = 3                  # snakes2's retries: heads drawn per dash,
SEED_TRIES = 3                  # second seeds per first seed (and seed angles per distractor),
DISTRACTOR_TRIES = 5            # and attempts per distractor path
TARGETS_MAY_TOUCH = False       # True = the original: a dash is never tested against the other target path's newest
                                # dash, so in about a quarter of its images the two target paths overlap


# ----------------------------------------------------------------------------- stamps drawn once per (res, margin)

def _disc(r):                   # offsets (dy, dx) of the pixels of a disc of radius r
    return [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1) if dy * dy + dx * dx <= r * r]


def _down(a, n):                # uint8 fine square -> float64 (n, n) in [0, 1]: 8-bit Lanczos as scipy.misc.imresize
    return np.asarray(Image.fromarray(a).resize((n, n), Image.LANCZOS), np.float64) / 255


def _dash(theta, length, thickness, margin, half):
    """Dash as the original draws it: a PIL line of width thickness·AA from the centre of a fine patch to
    ceil(centre + length·AA·(cos θ, sin θ)) in (x, y), Lanczos-resized -> (ink, mask), float64 (side, side) each;
    the mask is the line dilated by a disc of radius margin·AA."""
    fine = 2 * half * AA + 1                        # side of the fine patch
    centre = half * AA
    r = margin * AA                                 # the margin on the fine grid
    im = Image.new("L", (fine, fine))
    head = math.ceil(centre + length * AA * np.cos(theta)), math.ceil(centre + length * AA * np.sin(theta))  # (x, y)
    ImageDraw.Draw(im).line([(centre, centre), head], fill=255, width=round(thickness * AA))
    padded = np.pad(np.asarray(im), r)                                                       # (fine + 2r, fine + 2r)
    mask = np.max([padded[r + dy:r + dy + fine, r + dx:r + dx + fine] for dy, dx in _disc(r)], 0)   # (fine, fine)
    return _down(np.asarray(im), 2 * half + 1), _down(mask, 2 * half + 1)


def _marker(radius):            # disc of radius·AA on the fine grid, centred on the pixel (as draw_circle)
    half = math.ceil(radius) + 4                    # + the reach of the Lanczos kernel
    y = np.arange((2 * half + 1) * AA) - half * AA
    disc = (y[:, None] ** 2 + y[None, :] ** 2 <= (radius * AA) ** 2) * 255             # (fine, fine) on the fine grid
    return _down(disc.astype(np.uint8), 2 * half + 1)                                 # (2·half+1, 2·half+1)


@dataclass(frozen=True)
class Tables:                   # everything that does not depend on the image, for one (res, margin)
    res: int                    # window side
    margin: int
    half: int                   # stamp half side: a stamp covers tail ± half
    side: int                   # stamp side = 2·half + 1
    border: int                 # canvas pixels on each side of the window
    canvas: int                 # canvas side = res + 2·border
    head_offsets: list          # (K,) of (dy, dx): where a head may sit relative to its pivot
    head_offsets_flat: list     # (K,) the same as flat canvas offsets
    ink: np.ndarray             # (360+K, side, side) float64: brightness of each dash stamp
    mask: np.ndarray            # (360+K, side, side) float64 (float32 values): each stamp dilated by the margin
    mask_planes: np.ndarray     # (360+K, 2, side+2m, side+2m): mask and mask dilated by the margin again
    hot: list                   # per head offset k: (flat offsets, values, pairs) of mask pixels >= 0.8
    empty_occupancy: np.ndarray  # (2, canvas, canvas): the padding frame only
    step: list                  # (360+K,) of (dy, dx): pivot to next pivot, (length + 2·margin)·u(θ_i)
    seed_head: list             # (360+K,) of (dy, dx): a seed's tail to its head, length·u(θ_i)
    seed_pivot: list            # (360+K,) of (dy, dx): a seed's head to its pivot, (length + margin)·u(θ_i reversed)
    candidates: list            # per dash index i: [(k, flat offset, continuity weight)] for the next dash's head
    dead: list                  # (360,) bool: seed angles that never find a free tail in the original
    seed_struct: list           # (360,) flat offsets a seed's tail must find free
    seed_boxes: list            # [(i, y_lo, y_hi, x_lo, x_hi)]: free tails of the first target seed at angle i
    marker: np.ndarray          # (2·half+1, 2·half+1) float64, its own half: a marker disc


def _head_offsets(length, margin):
    """(K, 2) int: the distinct offsets head - pivot on the original's samples of a circle of radius length+margin."""
    angles = np.arange(0, 360, 360 / (2 * (length + margin) * np.pi)) * np.pi / 180
    return np.unique(np.floor((length + margin) * np.stack([np.sin(angles), np.cos(angles)], 1)).astype(int), axis=0)


def _stamps(p, margin, half, angles, canvas):
    """Ink and mask of every dash index -> (ink, mask, mask_planes, hot); see Tables."""
    ink, mask = map(np.array, zip(*[_dash(a, p.dash_length, p.thickness, margin, half) for a in angles]))
    mask = mask.astype(np.float32).astype(np.float64)                  # (360+K, side, side): the original keeps float32
    side = 2 * half + 1
    planes = np.zeros((len(mask), 2, side + 2 * margin, side + 2 * margin))    # (360+K, 2, side+2m, side+2m)
    planes[:, 0, margin:margin + side, margin:margin + side] = mask
    for dy, dx in _disc(margin):
        v = planes[:, 1, margin + dy:margin + dy + side, margin + dx:margin + dx + side]
        np.maximum(v, mask, out=v)
    hot = []                    # mask pixels >= 0.8: the only ones that can make occupancy + mask >= 1.8
    for i in range(360, len(mask)):
        rows, cols = np.nonzero(mask[i] >= 0.8 - 1e-9)
        flat, values = (rows - half) * canvas + cols - half, mask[i, rows, cols]
        hot.append((flat, values, list(zip(flat.tolist(), values.tolist()))))
    return ink, mask, planes, hot


def _seed_geometry(res, p, margin, half, mask):
    """-> (dead, struct, boxes) for the 360 seed angles; see Tables."""
    # A seed avoids the occupancy dilated by the saturated pixels of its own mask, shifted by (1, 1) (the original's
    # head-centred struct). cv2.dilate gives -DBL_MAX where all of a pixel's references leave the image; the original
    # then finds no free pixel, so these seed angles always fail ("dead": 92% at 32 px): it thins out the distractors.
    reach = p.dash_length + margin
    struct = [o[(np.abs(o) <= reach).all(1)]       # o: (n, 2) offsets (dy, dx)
              for o in (np.argwhere(mask[i] == 1.0) - half + 1 for i in range(360))]
    grid = np.arange(4 * reach + 3)                 # any window wider than a struct gives the same answer
    out = lambda v: (v < 0) | (v >= len(grid))
    dead = [bool((out(grid[:, None, None] + o[:, 0]) | out(grid[None, :, None] + o[:, 1])).all(2).any())
            for o in struct]
    edge = max(2 * p.seed_distance, p.padding)      # first seed: tail in the free central box, its struct inside it
    assert edge > reach + 1                         # (then no reference leaves the image and the free tails form a box)
    boxes = [(i, edge - o[:, 0].min(), res - edge - o[:, 0].max(), edge - o[:, 1].min(), res - edge - o[:, 1].max())
             for i, o in enumerate(struct) if not dead[i]]
    return dead, struct, [b for b in boxes if b[1] < b[2] and b[3] < b[4]]


def _empty_occupancy(res, border, canvas, padding, margin):
    occ = np.ones((2, canvas, canvas))  # [0] occupancy: padding frame, 0 outside the window (the original clips)
    occ[0] = 0                          # [1] occupancy dilated by the margin, 1 outside the window: heads there weigh 0
    occ[0, border:border + res, border:border + res] = 1
    inner = slice(border + padding, border + res - padding)
    occ[0, inner, inner] = 0
    inner = slice(border + padding + margin, border + res - padding - margin)
    occ[1, inner, inner] = 0
    return occ


@lru_cache(maxsize=None)
def _tables(res, margin):
    p = PARAMS[res]
    length = p.dash_length
    half = length + math.ceil(p.thickness) + margin
    border = max(length + 2 * margin + 3, half + margin, math.ceil(p.marker_radius) + 4) + 1
    canvas = res + 2 * border
    offsets = _head_offsets(length, margin)                                                 # (K, 2)
    angles = np.r_[np.arange(-180, 180) * np.pi / 180, np.arctan2(offsets[:, 0], offsets[:, 1])]   # (360+K,)
    flip = np.where(angles < 0, angles + np.pi, angles - np.pi)        # flip_by_pi: heads are drawn back to the pivot
    rev = np.where(angles + np.pi < np.pi, angles + np.pi, angles - np.pi)   # the seeds' reversal: other rounding
    turn = np.abs(angles[:, None] - angles[None, 360:])                                     # (360+K, K)
    weight = np.maximum(np.cos(np.minimum(np.minimum(turn, 2 * np.pi - turn) * p.continuity, np.pi / 2)), 0) ** 2
    ink, mask, planes, hot = _stamps(p, margin, half, np.r_[angles[:360], flip[360:]], canvas)
    dead, struct, boxes = _seed_geometry(res, p, margin, half, mask)
    vec = lambda r, a: (r * np.stack([np.sin(a), np.cos(a)], 1)).tolist()                   # (n,) of (dy, dx)
    offsets_flat = offsets[:, 0] * canvas + offsets[:, 1]
    candidates = [[(k, int(offsets_flat[k]), float(weight[i, k])) for k in np.flatnonzero(weight[i] > 1e-12)]
                  for i in range(len(weight))]                          # (weights cos(π/2)² ~ 4e-33 are never drawn)
    return Tables(res=res, margin=margin, half=half, side=2 * half + 1, border=border, canvas=canvas,
                  head_offsets=offsets.tolist(), head_offsets_flat=offsets_flat.tolist(), ink=ink, mask=mask,
                  mask_planes=planes, hot=hot, empty_occupancy=_empty_occupancy(res, border, canvas, p.padding, margin),
                  step=vec(length + 2 * margin, angles), seed_head=vec(length, angles),
                  seed_pivot=vec(length + margin, rev),
                  candidates=candidates, dead=dead, seed_struct=[o[:, 0] * canvas + o[:, 1] for o in struct],
                  seed_boxes=boxes, marker=_marker(p.marker_radius))


# ----------------------------------------------------------------------------- growing paths

def _place(T, occ, i, y, x):
    """Add dash i (tail at window pixel (y, x)) to the occupancy, clipped to the window as in the original, and to its
    dilation, which we keep up to date so that a step reads K pixels instead of dilating the whole image."""
    half, side, border, margin, res = T.half, T.side, T.border, T.margin, T.res
    y0, x0 = y + border - half - margin, x + border - half - margin       # corner of the mask planes in the canvas
    e = side + 2 * margin                                                 # their side
    v = occ[:, y0:y0 + e, x0:x0 + e]                                      # (2, e, e) view
    if border <= y0 + margin and y0 + margin + side <= border + res and \
            border <= x0 + margin and x0 + margin + side <= border + res:
        return np.maximum(v, T.mask_planes[i], out=v)
    np.maximum(v[1], T.mask_planes[i, 1], out=v[1])
    top, bottom, left, right = max(y0, border), min(y0 + e, border + res), max(x0, border), min(x0 + e, border + res)
    v = occ[0, top:bottom, left:right]                                    # plane 0 clipped to the window
    np.maximum(v, T.mask_planes[i, 0, top - y0:bottom - y0, left - x0:right - x0], out=v)


def _touches(T, i, y, x, other):
    """Do dash i at (y, x) and dash other = (j, y_other, x_other) overlap by the 1.8 rule?"""
    (j, y_other, x_other), side = other, T.side
    dy, dx = y - y_other, x - x_other
    if abs(dy) >= side or abs(dx) >= side:
        return False
    mine = T.mask[i][max(0, -dy):side - max(0, dy), max(0, -dx):side - max(0, dx)]          # the overlapping parts
    return (mine + T.mask[j][max(0, dy):side - max(0, -dy), max(0, dx):side - max(0, -dx)]).max() >= 1.8


def _extend(rng, T, flat, pivot, i, avoid=None):
    """Dash after dash i with pivot `pivot` (extend_snake) -> (head, its pivot, its index), or None at a dead end.
    It may not touch the occupancy (flat view of both planes) nor the dash `avoid`. Plain Python: ~10 candidates."""
    border, canvas = T.border, T.canvas
    py, px = math.ceil(pivot[0] + T.step[i][0]), math.ceil(pivot[1] + T.step[i][1])   # the new pivot (translate_coord)
    base = (py + border) * canvas + px + border
    cum, ks, total = [], [], 0.0              # cumulative weights of the candidate heads ks
    for k, k_flat, w in T.candidates[i]:      # weight v = continuity w x (1 - dilated occupancy at the head)
        v = w * (1.0 - flat[canvas * canvas + base + k_flat])
        if v > 0:
            total += v
            cum.append(total)
            ks.append(k)
    if total < 1e-4:
        return None
    for _ in range(DASH_TRIES):
        k = ks[min(bisect_right(cum, rng.random() * total), len(ks) - 1)]
        head, (hot_flat, hot_values, pairs) = base + T.head_offsets_flat[k], T.hot[k]
        if len(pairs) > 16:                   # ~5 hot pixels at 32 px: Python; ~60 at 128 px: numpy
            free = (np.frombuffer(flat).take(head + hot_flat) + hot_values).max() < 1.8
        else:
            free = all(flat[head + a] + b < 1.8 for a, b in pairs)
        y, x = py + T.head_offsets[k][0], px + T.head_offsets[k][1]
        if free and not (avoid and _touches(T, 360 + k, y, x, avoid)):
            return (y, x), (py, px), 360 + k
    return None


def _seed(T, i, y, x):
    """Pivot of seed dash i with its tail at (y, x), or None when its head or pivot leaves the window."""
    head = math.ceil(y + T.seed_head[i][0]), math.ceil(x + T.seed_head[i][1])
    pivot = math.ceil(head[0] + T.seed_pivot[i][0]), math.ceil(head[1] + T.seed_pivot[i][1])
    return pivot if 0 <= min(head + pivot) and max(head + pivot) < T.res else None


def _grow(rng, T, occ, paths, pivots, n_dash):
    """Grow paths (lists of dashes (i, y, x)) alternately to n_dash dashes each, in place; False at a dead end."""
    flat = memoryview(occ.reshape(-1))
    for _ in range(n_dash - 1):
        for which, path in enumerate(paths):
            other = None if TARGETS_MAY_TOUCH or len(paths) == 1 else paths[1 - which][-1]   # not yet in the occupancy
            r = _extend(rng, T, flat, pivots[which], path[-1][0], other)
            if r is None:
                return False
            head, pivots[which], i = r
            _place(T, occ, *path[-1])         # a dash joins the occupancy once the next one is down
            path.append((i, *head))
    for path in paths:                        # (two_snakes forgets target path 0's last dash here)
        _place(T, occ, *path[-1])
    return True


def _two_paths(rng, T, n_dash, seed_distance):
    """Two target paths grown alternately from seeds seed_distance apart; a failure restarts all (two_snakes)."""
    while True:
        i0, y_lo, y_hi, x_lo, x_hi = T.seed_boxes[rng.randrange(len(T.seed_boxes))]
        y0, x0 = rng.randrange(y_lo, y_hi), rng.randrange(x_lo, x_hi)
        pivots = [_seed(T, i0, y0, x0), None]
        for _ in range(SEED_TRIES if pivots[0] else 0):
            i1, angle = rng.randrange(360), rng.randrange(360) * math.pi / 180   # the second seed's dash, direction
            y1 = round(y0 + seed_distance * math.sin(angle))          # round half to even, as the original
            x1 = round(x0 + seed_distance * math.cos(angle))
            pivots[1] = _seed(T, i1, y1, x1)
            if pivots[1]:
                occ, paths = T.empty_occupancy.copy(), [[(i0, y0, x0)], [(i1, y1, x1)]]
                if _grow(rng, T, occ, paths, pivots, n_dash):
                    return occ, paths
                break


def _free_tails(T, mask, i):
    """Flat canvas indices of every window tail where seed i finds its struct free (mask <= 0.3)."""
    res, border, canvas = T.res, T.border, T.canvas
    lin = mask.ravel()
    free = border * canvas + np.flatnonzero(
        np.max([lin[border * canvas + o:(border + res) * canvas + o] for o in T.seed_struct[i]], 0) <= 0.3)
    return free[(free % canvas >= border) & (free % canvas < border + res)]


def _distractor(rng, T, occ, n_dash):
    """One try at a distractor path (seed_snake + make_snake) -> (new occupancy, dashes) or None."""
    res, border, canvas, mask = T.res, T.border, T.canvas, occ[0]
    if (mask[border:border + res, border:border + res] <= 0.3).sum() < 0.01 * res * res:
        return None
    for _ in range(SEED_TRIES):
        i = rng.randrange(360)
        if T.dead[i]:
            return None
        probes = np.array([(border + rng.randrange(res)) * canvas + border + rng.randrange(res) for _ in range(16)])
        free = probes[mask.take(probes[:, None] + T.seed_struct[i]).max(1) <= 0.3]   # the first free probe is uniform
        if not len(free):                     # no free probe: list every free tail
            free = _free_tails(T, mask, i)
            if not len(free):
                return None
            free = free[rng.randrange(len(free)):]
        tail = int(free[0]) // canvas - border, int(free[0]) % canvas - border
        pivot = _seed(T, i, *tail)
        if pivot:
            occ, path = occ.copy(), [(i, *tail)]
            return (occ, path) if _grow(rng, T, occ, [path], [pivot], n_dash) else None
    return None


# ----------------------------------------------------------------------------- images and datasets

def pathfinder_image(rng, res=32, contour_length=14, label=1, details=False):
    """One image, uint8 (res, res), min 0, max 255. rng: random.Random; res: a key of PARAMS. label 1: the markers sit
    on both ends of one target path; label 0: on one end of each. details=True also returns dict(margin, paths,
    markers): paths = the two target paths as lists of dashes (dash index, y, x) from the origin (seed tail) to the
    far end (head of the last dash); markers = [(y, x), (y, x)]."""
    p = PARAMS[res]
    T = _tables(res, p.margins[rng.randrange(len(p.margins))])
    occ, paths = _two_paths(rng, T, contour_length, p.seed_distance)
    target_contrast = p.snake_contrast * p.paddle_contrast                 # 32 px: 1.5 vs 2, targets 25% dimmer
    dashes = [(i, y, x, target_contrast) for path in paths for i, y, x in path]
    for _ in range(p.distractor_budget // (contour_length // 3)):
        for _ in range(DISTRACTOR_TRIES):
            r = _distractor(rng, T, occ, contour_length // 3)
            if r:
                occ, dashes = r[0], dashes + [(i, y, x, p.snake_contrast) for i, y, x in r[1]]
                break
    border, half = T.border, T.half
    img = np.zeros((T.canvas, T.canvas))                                   # (canvas, canvas) float64
    for i, y, x, contrast in dashes:
        v = img[y + border - half:y + border + half + 1, x + border - half:x + border + half + 1]
        np.maximum(v, (contrast * T.ink[i]).astype(np.float32), out=v)    # float32 like the original's 'F' images
    o = rng.randrange(2)                      # origin of path o; far end of path o (label 1) or of the other one (0)
    markers = [paths[o][0][1:], paths[o if label else 1 - o][-1][1:]]
    h = len(T.marker) // 2                    # the marker's half side
    for y, x in markers:
        v = img[y + border - h:y + border + h + 1, x + border - h:x + border + h + 1]
        np.maximum(v, T.marker, out=v)
    img = img[border:border + res, border:border + res]                    # (res, res)
    img = ((img - img.min()) * (255 / (img.max() - img.min())) + 0.5).astype(np.uint8)   # scipy imsave's bytescale
    return (img, dict(margin=T.margin, paths=paths, markers=markers)) if details else img


def _exists(path, out):         # the error for a file that is already there: the generator never overwrites one
    return FileExistsError(f"{path} already exists (left by an interrupted run?); the generator never overwrites a "
                           f"file: delete {out} if it made it ({GENERATED_MARK} is there), or generate into an "
                           f"empty folder (--data-dir <empty folder>)")


def _exclusive(path, out):      # a new file opened for writing, or FileExistsError
    try:
        return open(path, "xb")
    except FileExistsError:
        raise _exists(path, out) from None


# images per second per core, measured here (results/generator_speed.txt): a large set's time is printed first
IMAGES_PER_CORE_S = {32: 265.0, 128: 17.0, 256: 229.0}


def _write_batch(job, on_item=tick):
    """Render batch k as imgs/<k>/sample_<j>.png and metadata/<k>.npy (plain text, the 11 fields of snakes2); the
    metadata last, so only finished batches have it. A worker whose parent died stops before its next image.
    on_item(1) after each image: the pool's shared counter (tick) or, in this process, the progress bar's update."""
    out, res, contour_length, seed, k, labels = job
    p = PARAMS[res]
    rng = random.Random(f"pathfinder/{seed}/{res}/{contour_length}/{k}")   # per batch: same bytes for any workers
    (out / "imgs" / str(k)).mkdir(parents=True, exist_ok=True)
    lines = []
    for j, label in enumerate(labels):
        if orphaned():
            raise SystemExit(1)                          # nobody will read what it would write
        img, info = pathfinder_image(rng, res, contour_length, label, details=True)
        with _exclusive(out / "imgs" / str(k) / f"sample_{j}.png", out) as f:
            Image.fromarray(img).save(f, format="PNG")
        on_item(1)
        lines.append(f"imgs/{k} sample_{j}.png {j} {label} {p.continuity} {contour_length} {contour_length // 3} "
                     f"{p.dash_length} {p.thickness} {info['margin']} 1\n")
    tmp, meta = out / "metadata" / f"{k}.tmp", out / "metadata" / f"{k}.npy"
    with _exclusive(tmp, out) as f:
        f.write("".join(lines).encode())
    if meta.exists():
        tmp.unlink()
        raise _exists(meta, out)
    tmp.replace(meta)                         # only finished batches have metadata
    return len(labels)


def generate_pathfinder(root, res=32, n=1000, contour_length=14, seed=0, workers=1, per_batch=1000):
    """Write n images, labels exactly balanced and shuffled, as root/pathfinder{res}/<difficulty folder>/{imgs/<k>/
    sample_<j>.png (uint8 res × res), metadata/<k>.npy (text)}, the LRA release layout; returns that folder.
    The folder must be absent, empty, or made by this generator (GENERATED_MARK, written first, records every
    parameter); a folder it made with the same parameters but left unfinished (a stopped or killed run) is completed:
    its unfinished batches are made again, byte for byte as they would have been. No other file is overwritten.
    Out of space (OSError) in a folder this call created: the folder is removed before the error goes on.
    Raises ValueError for a res not in PARAMS or contour_length < 3, FileExistsError otherwise."""
    if res not in PARAMS or contour_length < 3:
        raise ValueError(f"pathfinder generator: res must be one of {sorted(PARAMS)} and contour_length >= 3, "
                         f"got res={res}, contour_length={contour_length}")
    name = next((d.folder for d in DIFFICULTIES.values() if d.contour_length == contour_length),
                f"curv_contour_length_{contour_length}")           # the release's folder of that contour length
    out = Path(root) / f"pathfinder{res}" / name
    check_output_folder(out)
    params = dict(res=res, n=n, contour_length=contour_length, seed=seed, per_batch=per_batch)
    mark = read_mark(out)
    labels = [j % 2 for j in range(n)]
    random.Random(f"pathfinder/{seed}/{res}/{contour_length}/labels").shuffle(labels)
    jobs = [(out, res, contour_length, seed, k, labels[j:j + per_batch]) for k, j in enumerate(range(0, n, per_batch))]
    fresh = mark is None and not (out.is_dir() and any(out.iterdir()))     # a failure gives back what it wrote
    if mark is not None and {**dict(per_batch=1000), **mark} == params:     # ours, same run: complete it
        todo = unfinished_batches(out, params)
        for k in todo:                                   # an unfinished batch of ours: its files are made again
            shutil.rmtree(out / "imgs" / str(k), ignore_errors=True)
            (out / "metadata" / f"{k}.tmp").unlink(missing_ok=True)
        jobs = [jobs[k] for k in todo]
    else:
        targets = [out / "metadata" / f"{k}.npy" for k in range(len(jobs))]    # checked before anything is written;
        targets += [out / "imgs" / str(j // per_batch) / f"sample_{j % per_batch}.png" for j in range(n)]   # and later
        if existing := next((t for t in targets if t.exists()), None):
            raise _exists(existing, out)
        made = next((p for p in (out.parent, out) if not p.exists()), None)     # what a failure gives back
        (out / "metadata").mkdir(parents=True, exist_ok=True)
        write_mark(out, "generate_pathfinder", params)
    try:
        with tqdm(total=sum(len(j[-1]) for j in jobs), desc=f"pathfinder{res}/{out.name}", unit="img") as bar:
            run_jobs(_write_batch, jobs, workers, bar)   # the bar moves per image: a 128 px batch takes minutes
    except OSError:
        if fresh:                                       # a full disk: give back what this call wrote
            for child in [made] if made else list(out.iterdir()):
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()
        raise
    return out


def measure_speed(res=32, contour_length=14, seconds=3.0):
    """Images per CPU-second of this process (= per core): pathfinder_image + PNG encoding, tables built beforehand.
    The result depends on the machine and its load: report it with os.getloadavg() (lra_data.py --speed does)."""
    for margin in PARAMS[res].margins:
        _tables(res, margin)
    rng = random.Random(0)
    count, t0 = 0, time.process_time()
    while time.process_time() - t0 < seconds:
        Image.fromarray(pathfinder_image(rng, res, contour_length, count % 2)).save(io.BytesIO(), format="PNG")
        count += 1
    return count / (time.process_time() - t0)
