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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
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


# --- Pathfinder / PathX generator (snakes) ---
# generate_pathfinder(root, res=32, n=1000, contour_length=14, seed=0, workers=1) -> Path goes here (lead merges it).

def _run_pathfinder_generator(root, res, n, difficulty, workers):
    from pathfinder_gen import generate_pathfinder  # merged into this file by the lead
    cl = CONTOUR_LENGTH[difficulty]
    generate_pathfinder(root, res=res, n=n, contour_length=cl, seed=0, workers=workers)
    folder = Path(root) / f"pathfinder{res}" / DIFFICULTY[difficulty]
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
    """Examples `index` of one cached part; item = (x, label). Arrays are memory-mapped lazily in each process."""

    def __init__(self, task, store, part, index, source):
        self.task, self.store, self.part, self.index, self.source = task, Path(store), part, index, source
        self.labels = np.load(self.store / f"{part}.y.npy")[index]      # (n,) int64, for label balance / checks
        self._arrays = None

    def arrays(self):
        if self._arrays is None:
            if TASKS[self.task].kind == "pixels":
                self._arrays = np.load(self.store / f"{self.part}.x.npy", mmap_mode="r")       # (N, L) uint8 memmap
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
            return torch.from_numpy(np.array(self.arrays()[j])), y              # (L,) uint8
        ids, off = self.arrays()
        docs = [torch.from_numpy(ids[off[d]: off[d + 1]].astype(np.int64))
                for d in ((2 * j, 2 * j + 1) if TASKS[self.task].pair else (j,))]
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
    return f"official release format at {folder}"


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
    return split, np.arange(sizes[split])      # listops, retrieval: the release's own train/val(eval)/test


def load(task, split, data_dir="data", *, data_fraction=1.0, seed=0, lra_val=False, difficulty="hard",
         cache_dir=None, generate=None, workers=1):
    """Dataset of (x, label) for one split of an LRA task, read through the cache (built on first use).

    data_fraction keeps a prefix of one permutation (fixed by `seed`) of the training split, so smaller
    subsets nest in larger ones; val/test never change. lra_val (text, image): validate on the test set
    and train on all of train, as LRA did; the other tasks have their own validation split.
    difficulty picks the Pathfinder/PathX folder; generate=N makes N examples of a synthetic task if missing.
    """
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
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
    if split == "train" and data_fraction < 1:
        keep = torch.randperm(len(index), generator=torch.Generator().manual_seed(seed))[: max(1, round(data_fraction * len(index)))]
        index = index[np.sort(keep.numpy())]
    return LRADataset(task, store, part, index, source)


def main(argv=None):
    p = argparse.ArgumentParser(description="Read (or generate) one LRA task and cache it; prints source, sizes, label balance.")
    p.add_argument("--task", choices=TASKS, default="pathfinder", help="listops, text, retrieval, image, pathfinder, pathx, pathx256")
    p.add_argument("--data-dir", default="data", help="folder with the downloads (lra_release/ unpacked, aclImdb, CIFAR-10)")
    p.add_argument("--generate", type=int, default=None, help="listops/pathfinder/pathx: if the files are missing, generate N examples")
    p.add_argument("--workers", type=int, default=1, help="processes for reading or generating images")
    p.add_argument("--cache-dir", default=None, help="default: <data-dir>/cache if writable, else ./data/cache")
    p.add_argument("--difficulty", choices=DIFFICULTY, default="hard", help="pathfinder tasks: curv_baseline / _9 / _14")
    p.add_argument("--lra-val", action="store_true", help="text, image: validate on the test set, as LRA did")
    args = p.parse_args(argv)
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
