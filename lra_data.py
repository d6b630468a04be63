"""lra_data.py: the seven Long Range Arena tasks (Tay et al., ICLR 2021) as cached PyTorch datasets.
tokens: ListOps (19 ids, lra/listops.py), Text and Retrieval (byte b -> id b + 4, lra/files.py);
        every sequence ends with EOS; a batch is padded to one of a few bucketed lengths (collate)
pixels: Image (CIFAR-10 grey = 0.2989 R + 0.5870 G + 0.1140 B), Pathfinder 32², PathX 128²,
        PathX-256 256² (8-bit grey)
where:  the files as downloaded, or generated data for ListOps and Pathfinder/PathX
        (lra/sources.py); cached once per source as arrays (lra/cache.py), read a row at a time
check:  splits, cache reuse and rebuilds, notes, refusals to touch a user's files:
        tests/test_lra_data.py
prepare once: python lra_data.py --task pathfinder [--data-dir data] [--generate 200000]
"""
import argparse
import contextlib
import hashlib
import os
import tempfile
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

try:
    import fcntl  # POSIX file locks; absent on Windows
except ImportError:
    fcntl = None

import denoise
from lra import check as lra_check
from lra import sources
from lra.files import EOS, MASK, N_SPECIAL, PAD, DataError, plural
from lra.listops import LISTOPS_SYMBOLS
from lra.pathfinder import DIFFICULTIES, measure_speed
from tools.checked import open_lock


@dataclass(frozen=True)
class Task:
    n_classes: int                 # C
    max_len: int                   # L: longest input, EOS included (pixels: side²)
    kind: str                      # "tokens" or "pixels"
    vocab_size: int                # V: token ids incl. the 4 specials, or 256 grey levels
    mask_ratio: float              # SPT masking probability p (Amos et al. 2024, §2)
    pool: str                      # "mean" or "max" over real positions
    pair: bool = False             # retrieval: two documents per example
    side: int | None = None        # image side in pixels


TASKS = {
    "listops":    Task(10, 2048, "tokens", N_SPECIAL + len(LISTOPS_SYMBOLS), 0.10, "mean"),
    "text":       Task(2, 4096, "tokens", N_SPECIAL + 256, 0.15, "mean"),
    "retrieval":  Task(2, 4001, "tokens", N_SPECIAL + 256, 0.15, "mean", pair=True),  # 4000 B + EOS
    "image":      Task(10, 1024, "pixels", 256, 0.50, "mean", side=32),
    "pathfinder": Task(2, 1024, "pixels", 256, 0.50, "mean", side=32),
    "pathx":      Task(2, 16384, "pixels", 256, 0.50, "max", side=128),
    "pathx256":   Task(2, 65536, "pixels", 256, 0.50, "max", side=256),
}
PATHFINDER_TASKS = ("pathfinder", "pathx", "pathx256")
DIFFICULTY = {name: d.folder for name, d in DIFFICULTIES.items()}  # name -> release folder
SPLIT_SEED = 42  # every split we carve ourselves; 42 reproduces S4's Pathfinder random_split


class LRADataset(torch.utils.data.Dataset):
    """Examples `index` of one cached part; item = (x, label). Files are opened lazily in each
    process; pixel rows are read one by one, so a PathX-sized cache never enters memory. notes:
    one-line strings on what reading the source skipped, cut or found (see load)."""

    def __init__(self, task, store, part, index, source, max_len=None, notes=()):
        self.task, self.store, self.part, self.index, self.source = (
            task, Path(store), part, index, source)
        self.max_len = max_len  # token tasks: keep the first max_len - 1 ids + EOS of each document
        self.notes = list(notes)
        self.labels = np.load(self.store / f"{part}.y.npy")[index]  # (n,) int64, for label checks
        self._arrays = None

    def arrays(self):
        if self._arrays is None:
            if TASKS[self.task].kind == "pixels":
                # x: (N, L) uint8, only its header is used; _arrays: the file, where row 0 starts, L
                x = np.load(self.store / f"{self.part}.x.npy", mmap_mode="r")
                self._arrays = x.filename, x.offset, x.shape[1]
            else:
                tok = self.store / f"{self.part}.tok"
                ids = (np.memmap(tok, np.uint16, mode="r") if tok.stat().st_size
                       else np.zeros(0, np.uint16))
                self._arrays = ids, np.load(self.store / f"{self.part}.off.npy")
        return self._arrays

    def __getstate__(self):  # DataLoader workers reopen the memmap instead of pickling its bytes
        return {**self.__dict__, "_arrays": None}

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        j, y = int(self.index[i]), int(self.labels[i])
        if TASKS[self.task].kind == "pixels":
            # a plain read of one row: a memmap keeps every page touched resident (PathX: 3.3 GB)
            path, start, L = self.arrays()
            with open(path, "rb") as f:  # opened per row: no file left open when the dataset goes
                f.seek(start + j * L)
                return torch.frombuffer(bytearray(f.read(L)), dtype=torch.uint8), y  # (L,) uint8
        ids, off = self.arrays()
        docs = [ids[off[d]: off[d + 1]]
                for d in ((2 * j, 2 * j + 1) if TASKS[self.task].pair else (j,))]
        if self.max_len:  # cut before copying: keep max_len - 1 + EOS
            docs = [np.append(d[: self.max_len - 1], np.uint16(EOS)) if len(d) > self.max_len
                    else d for d in docs]
        docs = [torch.from_numpy(d.astype(np.int64)) for d in docs]
        if len(docs) == 1:
            return docs[0], y  # (L,) int64
        return torch.nn.utils.rnn.pad_sequence(docs, batch_first=True,
                                               padding_value=PAD), y  # (2, L_pair)


def bucket_length(L):
    """The padded length of a token batch whose longest sequence has L tokens: the next of 2^k and
    3·2^(k−1) (..., 512, 768, 1024, 1536, ...), at most 1.5 × L. Two lengths per octave keep the
    FFT sizes (all 2^a·3) and the shapes a compiled model sees few; padding never changes real
    outputs (tests/test_ssm.py, test_transformer.py)."""
    p = 1 << (L - 1).bit_length()  # the power of two ≥ L
    return 3 * p // 4 if p >= 4 and 3 * p // 4 >= L else p


def clean_input(x, task):
    """(input, target) of a raw batch: token ids stay ids; pixels become normalised values (paper
    App. C), and the denoising target is the grey level 0..255 as a class (Pathfinder/PathX) or the
    normalised value (Image, L1). x: (B, L) long ids or uint8 pixels -> ((B, L) long or float,
    (B, L) long or float)."""
    if TASKS[task].kind == "tokens":
        return x, x
    value = normalize(x, task).float()                          # (B, L)
    return value, (value if task == "image" else x.long())


def collate(batch):
    """[(x, label)] -> (x, lengths, y): tokens padded with PAD to bucket_length of the batch's
    longest sequence, (B, L) with lengths (B,), or (B, 2, L) with lengths (B, 2) for retrieval
    pairs; pixels stacked (fixed length, no padding)."""
    xs = [b[0] for b in batch]
    y = torch.tensor([int(b[1]) for b in batch], dtype=torch.long)  # (B,)
    if xs[0].dtype == torch.uint8:  # pixels: fixed length, raw 0..255
        x = torch.stack(xs)  # (B, L) uint8
        return x, torch.full((len(xs),), x.size(1), dtype=torch.long), y
    lengths = torch.stack([(xb != PAD).sum(-1) for xb in xs])  # (B,) or (B, 2); ids are never PAD
    x = torch.full((*lengths.shape, bucket_length(int(lengths.max()))), PAD,
                   dtype=torch.long)  # (B, L) or (B, 2, L)
    for b, xb in enumerate(xs):  # xb: (L_b,) or (2, L_b)
        n = int(lengths[b].max())
        x[b, ..., :n] = xb[..., :n]
    return x, lengths, y


def clean_batch(examples, task):
    """The loader's collate_fn (on the host, in its workers on CUDA): [(x, label)] of `task` ->
    denoise.Clean: collate's padded batch, token ids as they are or pixels as normalised
    values with grey-level (Pathfinder) or value (Image) targets (clean_input), the labels.
    Retrieval: each document a row of its own (2B rows). padded is None when nothing is padded,
    decided here on the host, so the step never reads a device value to know."""
    x, lengths, labels = collate(examples)                  # (B, L) or (B, 2, L)
    if TASKS[task].pair:
        x, lengths = x.flatten(0, 1), lengths.flatten()                  # (2B, L), (2B,)
    padded = lengths if bool((lengths < x.size(-1)).any()) else None
    value, target = clean_input(x, task)                           # (B, L) each
    # content: the positions an objective may mask; a token task's last real token is the EOS
    content = lengths - 1 if TASKS[task].kind == "tokens" else lengths
    return denoise.Clean(value, target, lengths, content, padded, MASK, labels)


def normalize(x, task):
    """Grey levels (B, L) uint8 -> (B, L) float32: Image standardised by LRA's CIFAR grey mean 122.6
    and std 61, Pathfinder/PathX mapped to [-1, 1]. DataError for a task that is not pixels."""
    x = x.float() / 255
    if task == "image":
        return (x - 122.6 / 255) / (61 / 255)     # CIFAR grey mean/std used by LRA
    if task in PATHFINDER_TASKS:
        return x * 2 - 1                          # [-1, 1]
    raise DataError(f"normalize: {task!r} is not a pixel task")


def _split(task, split, sizes, lra_val):
    """-> (cached part, indices into it) for train/val/test."""
    if task in PATHFINDER_TASKS:  # no official split: 80/10/10 by random_split order, as S4 does
        n = sizes["all"]
        n_eval = int(0.1 * n)                                           # val and test each
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).numpy()
        lo, hi = {"train": (0, n - 2 * n_eval), "val": (n - 2 * n_eval, n - n_eval),
                  "test": (n - n_eval, n)}[split]
        return "all", np.sort(perm[lo:hi])
    # no official val split: carve 10% of train, unless the LRA habit
    if task in ("text", "image"):
        if split == "test" or (split == "val" and lra_val):
            return "test", np.arange(sizes["test"])
        if lra_val:
            return "train", np.arange(sizes["train"])
        perm = torch.randperm(sizes["train"],
                              generator=torch.Generator().manual_seed(SPLIT_SEED)).numpy()
        n_val = sizes["train"] // 10
        return "train", np.sort(perm[:n_val] if split == "val" else perm[n_val:])
    # listops, retrieval: the release's own train/val(eval)/test
    return split, np.arange(sizes.get(split, 0))


# ---------------------------------------------------------------- load, CLI


@dataclass(frozen=True)
class Files:
    """Where a task's files are and how load prepares them (train.py's flags of the same names)."""
    data_dir: str | Path = "data"       # the files as downloaded; synthetic tasks generated here
    cache_dir: str | Path | None = None  # the prepared arrays (None: lra/cache.cache_root's rule)
    difficulty: str = "hard"            # Pathfinder / PathX folder: easy, intermediate, hard
    generate: int | None = None         # make this many examples of a synthetic task if absent
    workers: int = 1                    # generator processes
    max_len: int | None = None          # text, retrieval: cut each document at read time (>= 2)


def load(task, split, files="data", *, keep=None, data_fraction=1.0, lra_val=False):
    """LRADataset of (x, label) for one split of an LRA task, read through the cache (built on
    first use). x: (L,) int64 token ids ending in EOS, (2, L) for retrieval, or (side²,) uint8
    pixels; label int. files: a Files, or a data folder (Files(data_dir), the rest default).

    keep=N (None or 0: all) and data_fraction=f (train only) keep a prefix of one fixed
    permutation of the split (seed 0): the first round(f·n) examples, then at most N of them, in
    their original order, so smaller subsets nest in larger ones (train.py: --data-fraction and
    --max-train on train, --max-eval on val and test). lra_val (text, image): validate on the test
    set and train on all of train, as LRA did; the other tasks have their own validation split.
    files.difficulty picks the Pathfinder/PathX folder. files.generate=N makes N examples of a
    synthetic task when its files are missing, only into an absent or empty folder (or one our
    generator made, which it completes if a run was stopped half way); nothing is ever
    overwritten. files.max_len (text, retrieval; >= 2) cuts each document to its first
    max_len - 1 bytes + EOS, below LRA's 4096/4000, for CPU-sized runs. ListOps cannot be cut
    (the answer needs the whole expression): generate shorter ones instead.
    The cache is rebuilt when a source file read changes its size or mtime (lra/cache.stamp).
    .notes lists, one line each, what was skipped, empty or cut while reading (kept in the cache's
    meta.json, so a reused cache reports them too) and a count that differs from `generate`: the
    same list for every split of a source; load does not print them (the CLI does).
    Raises DataError (one line) for bad arguments, missing, ambiguous, half-made or malformed
    files, folders it will not write into, and a disk too full for the cache.
    """
    files = files if isinstance(files, Files) else Files(files)
    max_len, difficulty, generate = files.max_len, files.difficulty, files.generate
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if max_len is not None and (task not in ("text", "retrieval") or max_len < 2):
        raise DataError(f"max_len={max_len}: only text and retrieval documents can be cut, to at "
                        f"least 2 tokens (ListOps: generate shorter expressions; pixel tasks have "
                        f"a fixed length)")
    if (split not in ("train", "val", "test") or difficulty not in DIFFICULTIES
            or not 0 < data_fraction <= 1 or (generate is not None and generate < 10)):
        raise DataError(f"bad arguments split={split!r} (train/val/test), difficulty="
                        f"{difficulty!r} ({'/'.join(DIFFICULTIES)}), data_fraction={data_fraction} "
                        f"(0 < f <= 1), generate={generate} (>= 10)")
    src, source, store, sizes, notes = sources.prepare(task, TASKS[task], Path(files.data_dir),
                                                       files.cache_dir, difficulty, generate,
                                                       files.workers)
    part, index = _split(task, split, sizes, lra_val)
    if len(index) == 0:
        raise DataError(f"{task}: the {split} split read from {src} is empty; check the files "
                        f"there (or generate more)")
    n = max(1, round((data_fraction if split == "train" else 1.0) * len(index)))
    if keep and keep > n:                # e.g. --max-eval 8 on a split of 2: say so, use them all
        notes = notes + [f"at most {keep:,} {split} examples asked for (--max-"
                         f"{'train' if split == 'train' else 'eval'}), but the {split} split has "
                         f"{plural(n, 'example')}: all of them used"]
    n = min(keep or n, n)
    if n < len(index):  # a prefix of one fixed permutation: fractions and caps nest
        perm = torch.randperm(len(index), generator=torch.Generator().manual_seed(0)).numpy()
        index = index[np.sort(perm[:n])]
    if max_len is not None:  # cut at read time (the cache keeps LRA's length): say how many
        cut = _cut_count(store, part, index, max_len, TASKS[task].pair)
        notes = notes + [f"--max-len {max_len}: {plural(cut, 'document')} of the {split} split "
                         f"cut to {max_len - 1} tokens + EOS"] * (cut > 0)
    return LRADataset(task, store, part, index, source, max_len, notes)


@contextlib.contextmanager
def file_lock(path):
    """Wait for an exclusive lock on `path` (created if absent) and hold it for the block; the OS
    drops it when the process dies, so a killed process never leaves a stale lock. Without fcntl
    (Windows) there is no lock."""
    if fcntl is None:
        yield
        return
    try:        # another user's lock (mode 644) is opened read-only: flock needs no write access
        f = open_lock(path)
    except OSError as e:
        raise DataError(f"cannot open the lock file {path} ({e.strerror or e}; another user's?): "
                        f"make it writable, or delete it") from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def load_splits(args):
    """The train, val and test LRADatasets of a train.py run (args: its task, data_dir, generate,
    difficulty, cache_dir, lra_val, max_len, max_train, max_eval, data_fraction; see load),
    generated and cached under a file lock per data folder, so the processes of a DDP run (or two
    runs) prepare the data once and wait, never on a collective's timeout. Raises DataError (one
    line)."""
    digest = hashlib.sha1(os.fsencode(Path(args.data_dir).resolve())).hexdigest()[:12]
    with file_lock(Path(tempfile.gettempdir()) / f"lra-prepare-{digest}.lock"):  # others wait here
        files = Files(args.data_dir, args.cache_dir, args.difficulty, args.generate or None,
                      workers=os.cpu_count() or 1, max_len=args.max_len)
        splits = {split: load(args.task, split, files, lra_val=args.lra_val,
                              keep=args.max_train if split == "train" else args.max_eval,
                              data_fraction=args.data_fraction)
                  for split in ("train", "val", "test")}
    check_classes(splits["train"], args.task)
    return splits


def fingerprint(splits):
    """A digest of what the train/val/test splits hold, not where: each split's size and labels
    and up to 16 of its examples spread over it. A resume that reads the data from another folder
    compares it with the run's (runs.run_folder)."""
    digest = hashlib.sha1()
    for name in ("train", "val", "test"):
        ds = splits[name]
        digest.update(f"{name} {len(ds)} ".encode() + np.asarray(ds.labels, np.int64).tobytes())
        for i in np.linspace(0, len(ds) - 1, min(16, len(ds))).astype(int):
            digest.update(ds[int(i)][0].numpy().tobytes())
    return digest.hexdigest()[:16]


def check_classes(train, task):
    """DataError (one line) when the training split cannot teach the task's classes: fewer
    examples than classes, or all of one class (e.g. a tiny --data-fraction or --max-train)."""
    n, classes, seen = len(train), TASKS[task].n_classes, np.unique(train.labels)
    if n < classes or len(seen) < 2:
        what = (f"{plural(n, 'example')} for {classes} classes" if n < classes
                else f"{plural(n, 'example')}, all of class {seen[0]}")
        raise DataError(f"{task}: the train split keeps {what} (after --data-fraction and "
                        f"--max-train): a classifier cannot learn from that; keep at least "
                        f"{classes} examples of two classes or more")


def _cut_count(store, part, index, max_len, pair):
    """How many documents of the examples `index` of a cached token part are longer than max_len."""
    lengths = np.diff(np.load(store / f"{part}.off.npy"))  # (documents,)
    docs = np.stack([2 * index, 2 * index + 1], 1).ravel() if pair else index
    return int((lengths[docs] > max_len).sum())


def main(argv=None):
    from lab import run as runs                             # the command line's plumbing only
    from tools import checked
    p = argparse.ArgumentParser(description="Read (or generate) one LRA task and cache it; prints "
                                            "source, sizes, label balance and notes on what was "
                                            "skipped or cut.")
    p.add_argument("--task", choices=TASKS, default=None,
                   help=", ".join(TASKS) + " (default: pathfinder; with --check: every task)")
    p.add_argument("--data-dir", default="data",
                   help="downloads: lra_release/ unpacked, aclImdb, CIFAR-10")
    p.add_argument("--generate", type=checked.at_least(10), default=None,
                   help="synthetic tasks: N examples if missing")
    p.add_argument("--workers", type=checked.at_least(1), default=1,
                   help="processes for reading or generating images")
    p.add_argument("--cache-dir", default=None,
                   help="default: <data-dir>/cache if writable, else ./data/cache")
    p.add_argument("--difficulty", choices=DIFFICULTIES, default="hard",
                   help="pathfinder tasks: contour 6, 9 or 14")
    p.add_argument("--lra-val", action="store_true",
                   help="text, image: validate on the test set, as LRA did")
    p.add_argument("--speed", action="store_true",
                   help="pathfinder tasks: images/s of the generator")
    p.add_argument("--check", action="store_true", help="every task: what --data-dir holds against "
                   "the LRA release's split sizes, what is missing or misplaced, what to do; exit "
                   "0 if all found is complete, else 2")
    p.error = lambda message: (print(f"lra_data.py: error: {checked.flag_message(message)} (python "
                                     f"lra_data.py --help lists the flags)", file=sys.stderr),
                               sys.exit(2))
    args = p.parse_args(argv)
    for flag, path in (("--data-dir", args.data_dir), ("--cache-dir", args.cache_dir)):
        if path and Path(path).exists() and not Path(path).is_dir():
            p.error(f"{flag} {path} is a file, not a folder")
    checking, args.task = args.task, args.task or "pathfinder"  # --check without --task: every task
    if args.speed and args.task not in PATHFINDER_TASKS:
        p.error(f"--speed measures the Pathfinder generator: use it with "
                f"--task {' / '.join(PATHFINDER_TASKS)}")
    if args.check:                              # reads only: no cache, nothing generated
        return lra_check.main(args.data_dir, args.difficulty, [checking] if checking else None)
    if args.speed:
        res = TASKS[args.task].side
        contour_length = DIFFICULTIES[args.difficulty].contour_length
        rate = measure_speed(res, contour_length)
        load_1, load_5, load_15 = os.getloadavg()  # the speed depends on what else runs
        print(f"pathfinder{res} contour {contour_length}: {rate:.1f} images/s per core | load "
              f"average {load_1:.2f} {load_5:.2f} {load_15:.2f} (1/5/15 min, this run included) "
              f"on {os.cpu_count()} CPUs")
        return 0
    runs.stop_on_sigterm()                      # the run plumbing's: a SIGTERM is a Ctrl-C
    checked.console_as_os_bytes()          # a path of any bytes prints as the OS gave it
    files = Files(args.data_dir, args.cache_dir, args.difficulty, args.generate, args.workers)
    try:
        for split in ("train", "val", "test"):
            ds = load(args.task, split, files, lra_val=args.lra_val)
            if split == "train":
                print(f"source: {ds.source}\ncache:  {ds.store}")
                print("".join(f"note: {note}\n" for note in ds.notes), end="")
            counts = np.bincount(ds.labels, minlength=TASKS[args.task].n_classes)
            balance = " ".join(f"{c}:{k / max(len(ds), 1):.1%}" for c, k in enumerate(counts))
            print(f"{split:5s} {len(ds):7d} examples | labels {balance}")
    except DataError as e:
        print(f"lra_data.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lra_data.py: stopped by {runs.STOP['cause']}; a half-built cache was removed; "
              f"data being generated is left half made, and the same command completes it",
              file=sys.stderr)
        return runs.stop_status()
    return 0


if __name__ == "__main__":
    sys.exit(main())
