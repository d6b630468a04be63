"""lra/files.py: the official Long Range Arena files (Tay et al., ICLR 2021) as downloaded -> token ids and pixel rows.
tokens: ids 0-3 = PAD, MASK, EOS, UNK; byte b -> id b + 4; each document ends with EOS (ListOps ids: listops.py)
        Retrieval: AAN pairs (Radev et al. 2013) tsv_data/new_aan_pairs.{train,eval,test}.tsv
        Text: IMDB reviews (Maas et al. 2011), the aclImdb/ folder or aclImdb*.tar.gz, read without unpacking
pixels: Image: CIFAR-10 python batches (Krizhevsky 2009), folder or tar.gz -> grey = 0.2989 R + 0.5870 G + 0.1140 B
        Pathfinder / PathX: metadata/<k>.npy (one line per image: path, label) + the 8-bit PNGs it lists
Each reader appends one-line notes on what it skipped, found empty or cut, and raises DataError naming file and line.
check: tests/test_lra_data.py reads the real files through lra_data.load; tests/test_lra_files.py the formats' corners.
"""
import io
import multiprocessing
import os
import pickle
import re
import signal
import tarfile
import threading
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from tools.checked import free_space, write_advice  # noqa: F401  (lra/cache.py's, sources.py's)

PAD, MASK, EOS, UNK = 0, 1, 2, 3              # special ids shared by all token tasks (PAD = 0 = padding_idx)
N_SPECIAL = 4


class DataError(Exception):
    """Missing or malformed input. The message is one actionable line; train.py exits with status 2."""


# ----------------------------------------------------------------------------- worker processes

tqdm.monitor_interval = 0      # no tqdm monitor thread: a process that runs no other thread forks its pool safely
PARENT = {"pid": None}          # a pool worker's parent: if it dies (SIGKILL, the OOM killer), the worker stops


def worker_pool(workers, progress=None):
    """A multiprocessing.Pool of `workers` processes that know their parent's pid (start_worker). Forked when this
    process runs no other thread (fast: nothing is imported again), spawned otherwise: a fork copies the locks other
    threads hold (pytest-xdist's, tqdm's monitor) but not the threads, so a child can wait on one forever.
    progress: a shared counter (the context's Value) the workers add their finished items to (tick)."""
    return pool_context().Pool(workers, start_worker, (os.getpid(), progress))


def pool_context():
    """worker_pool's multiprocessing context (a shared counter for the pool must come from the same one)."""
    alone = threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if alone else "spawn")


def orphaned():
    """True in a pool worker whose parent has died: it stops instead of writing what nobody will read."""
    return PARENT["pid"] is not None and os.getppid() != PARENT["pid"]


def start_worker(parent, progress=None):
    """A pool worker's initializer: Ctrl-C is the parent's (it stops the pool); SIGTERM, which the pool sends its
    workers when it closes, ends the worker quietly (a forked worker inherits the parent's stop handler, and its
    KeyboardInterrupt printed a traceback at the end of every run that had generated data); the parent's pid and
    the progress counter are kept."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    PARENT["pid"], PARENT["progress"] = parent, progress


def tick(n=1):
    """In a pool worker: add n finished items to the pool's progress counter (if it has one)."""
    if PARENT.get("progress") is not None:
        with PARENT["progress"].get_lock():
            PARENT["progress"].value += n


def run_jobs(work, jobs, workers, bar):
    """work(job, on_item=...) for each job: in `workers` pool processes when there are several jobs, else here; `bar`
    (a tqdm) advances per finished item, counted across the processes (work calls on_item(1), default tick). A
    worker's error is raised here."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            work(job, on_item=bar.update)
        return
    done = pool_context().Value("q", 0)                      # items finished by all workers
    with worker_pool(workers, done) as pool:
        pending = pool.map_async(work, jobs)
        while not pending.ready():
            pending.wait(0.5)
            bar.update(done.value - bar.n)
        pending.get()
        bar.update(done.value - bar.n)


# ----------------------------------------------------------------------------- folders our generators write

GENERATED_MARK = "generated_by_lra_data.txt"   # written first into every folder our generators fill


def describe_folder(folder):
    """One phrase saying what a folder holds, e.g. 'found 12,000 PNG files but no metadata/ in X'."""
    files = [f.relative_to(folder).as_posix() for f in Path(folder).rglob("*") if f.is_file()]
    pngs = sum(f.lower().endswith(".png") for f in files)
    others = [f for f in files if not f.lower().endswith(".png")]
    what = [plural(pngs, "PNG file")] if pngs else []
    if others:
        what.append(f"{plural(len(others), 'other file')} ({', '.join(others[:3])}{', ...' * (len(others) > 3)})")
    no_metadata = " but no metadata/" if pngs and not (Path(folder) / "metadata").is_dir() else ""
    return f"found {' and '.join(what) or 'no files'}{no_metadata} in {folder}"


def write_mark(folder, generator, params):
    """Start GENERATED_MARK in `folder`: one line `generator(k=v, ...)` with every parameter of the run, so that a
    folder stopped half way can be recognised, checked and completed (read_mark)."""
    with open(Path(folder) / GENERATED_MARK, "w") as f:
        f.write(f"{generator}({', '.join(f'{k}={v}' for k, v in params.items())})\n")


def read_mark(folder):
    """The parameters GENERATED_MARK's first line records ({} for a mark without them, None without a mark): ints
    as ints, e.g. {"res": 32, "n": 2500, "contour_length": 14, "seed": 0, "per_batch": 1000}."""
    path = Path(folder) / GENERATED_MARK
    if not path.is_file():
        return None
    first = (read_source(path).decode(errors="replace").splitlines() or [""])[0]   # unreadable: DataError
    return {k: int(v) if re.fullmatch(r"-?\d+", v) else v for k, v in re.findall(r"(\w+)=([^,)\s]+)", first)}


def process_alive(pid):
    """Whether process `pid` still runs on this machine (a folder or file named after it is then still in use)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                          # another user's process: alive
        return True
    return True


def check_output_folder(folder):
    """Raise FileExistsError (one line) if folder holds a file but no GENERATED_MARK: then it is someone's data."""
    folder = Path(folder)
    if folder.is_dir() and not (folder / GENERATED_MARK).exists() and any(f.is_file() for f in folder.rglob("*")):
        raise FileExistsError(f"{describe_folder(folder)}, which this repo's generators did not make (no "
                              f"{GENERATED_MARK}); they never write into such a folder: generate into an empty one "
                              f"instead (--data-dir <empty folder>)")


REGET = "download or generate the data again"


def open_source(path):
    """open(path, "rb") of a source file; DataError (one line) if it is missing, a dangling link or unreadable: a read
    error is never reported as a failed write of the cache."""
    try:
        return open(path, "rb")
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror or e}): {REGET}") from None


def read_source(path):
    """The bytes of a source file; DataError as open_source's, also for an I/O error halfway (a failing disk)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror or e}): {REGET}") from None


def byte_ids(data: bytes, max_len):            # -> uint16 (≤ max_len,): byte b -> b + 4, then EOS
    ids = np.frombuffer(data[: max_len - 1], np.uint8).astype(np.uint16) + N_SPECIAL
    return np.append(ids, np.uint16(EOS))


def plural(n, word):
    return f"{n:,} {word}{'s' * (n != 1)}"


def note_if(count, text, notes):               # a note only for what happened: count > 0
    if count:
        notes.append(text)


def _read_archive(src, keep, download):
    """{member name: bytes} of the files in a .tar.gz whose name passes `keep`, read without unpacking."""
    try:
        with tarfile.open(src, "r:gz") as archive:
            return {m.name: archive.extractfile(m).read()
                    for m in tqdm(archive, desc=f"reading {src.name}", unit=" files") if m.isfile() and keep(m.name)}
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"{src}: cannot read the archive ({e}); download {download} again") from None


# ----------------------------------------------------------------------------- Retrieval (AAN)
# Token readers yield (part, [ids per document], label): the rows lra_data.py streams into its cache.

def aan_rows(folder, max_len, notes):
    """(part, [ids uint16 (≤ max_len,) of text1, of text2], label 0/1) of the LRA retrieval TSVs: no header; columns
    label (may be written 1.0), id1, id2, text1, text2. Raises DataError naming file and line."""
    for part, name in (("train", "train"), ("val", "eval"), ("test", "test")):
        path = folder / f"new_aan_pairs.{name}.tsv"
        blank, cut, empty = 0, 0, 0
        with open_source(path) as f:
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
                cut += (len(cols[3]) >= max_len) + (len(cols[4]) >= max_len)
                empty += (not cols[3]) + (not cols[4])
                yield part, [byte_ids(cols[3], max_len), byte_ids(cols[4], max_len)], int(label)
        note_if(blank, f"skipped {plural(blank, 'empty line')} in {path}", notes)
        note_if(empty, f"{plural(empty, 'empty document')} in {path} (kept as EOS only)", notes)
        note_if(cut, f"{plural(cut, 'document')} in {path} cut to {max_len - 1} bytes + EOS", notes)


# ----------------------------------------------------------------------------- Text (IMDB)

IMDB_FILE = re.compile(r"(?:^|/)(train|test)/(pos|neg|unsup)/([^/]+\.txt)$")


def imdb_files(src):             # the review files read from an aclImdb folder (sorted), or [the archive]
    if not src.is_dir():
        return [src]
    folders = [src / split / label for split in ("train", "test") for label in ("pos", "neg")]
    return sorted(p for folder in folders for p in folder.glob("*.txt"))


def imdb_rows(src, max_len, notes):
    """(part, [ids uint16 (≤ max_len,)], label 1 = pos / 0 = neg) of the reviews in the aclImdb folder or straight
    from the archive (src), sorted by path so both give one order; train/unsup/ is counted in a note and skipped."""
    if src.is_dir():
        files = {p.relative_to(src).as_posix(): read_source(p) for p in imdb_files(src)}
        unlabeled = len(list(src.glob("train/unsup/*.txt")))
    else:
        files = _read_archive(src, IMDB_FILE.search, "aclImdb_v1.tar.gz")
        unlabeled = sum(IMDB_FILE.search(name)[2] == "unsup" for name in files)
    reviews = {m.groups(): data for name, data in files.items()
               if (m := IMDB_FILE.search(name)) and m[2] != "unsup"}                      # (split, label, file)
    cut = sum(len(data) >= max_len for data in reviews.values())
    empty = sum(not data for data in reviews.values())
    note_if(unlabeled, f"ignored {plural(unlabeled, 'unlabeled review')} in train/unsup/ (LRA uses pos/neg)", notes)
    note_if(empty, f"{empty:,} of {len(reviews):,} reviews are empty (kept as EOS only)", notes)
    note_if(cut, f"{cut:,} of {len(reviews):,} reviews cut to {max_len - 1} bytes + EOS", notes)
    for split, label, name in sorted(reviews):
        yield split, [byte_ids(reviews[split, label, name], max_len)], int(label == "pos")


# ----------------------------------------------------------------------------- Image (CIFAR-10)

CIFAR_BATCHES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
CIFAR_TAR = "cifar-10-python.tar.gz"


def cifar_files(src):            # the batch files read from a cifar-10-batches-py folder, or [the archive]
    return [src / n for part in CIFAR_BATCHES.values() for n in part] if src.is_dir() else [src]


def cifar_batches(src):
    """{"train": (data uint8 (50000, 3072) RGB planes, labels int64 (50000,)), "test": ...}, folder or archive."""
    if src.is_dir():
        files = {p.name: read_source(p) for p in cifar_files(src) if p.exists() or p.is_symlink()}
    else:
        files = {Path(n).name: b for n, b in _read_archive(src, lambda n: "_batch" in n, CIFAR_TAR).items()}
    out = {}
    for part, names in CIFAR_BATCHES.items():
        datas, labels = [], []
        for name in names:
            if name not in files:
                raise DataError(f"{src}: CIFAR-10 batch {name} is missing; download {CIFAR_TAR} again")
            try:                                                      # the official format is a pickle
                batch = pickle.loads(files[name], encoding="bytes")
                data, y = batch.get(b"data", batch.get("data")), batch.get(b"labels", batch.get("labels"))
            except Exception as e:                                    # cut, empty or not a pickle of a dict
                raise DataError(f"{src}/{name}: a damaged CIFAR-10 batch ({type(e).__name__}: {str(e)[:60]}; "
                                f"{len(files[name]):,} bytes): download {CIFAR_TAR} again") from None
            if data is None or y is None or np.shape(data) != (len(y), 3072) or not set(y) <= set(range(10)):
                raise DataError(f"{src}/{name}: not a CIFAR-10 python batch (need 'data' (n, 3072) uint8, "
                                f"'labels' 0-9)")
            datas.append(np.asarray(data, np.uint8))
            labels.extend(y)
        out[part] = np.concatenate(datas), np.array(labels, np.int64)
    return out


def cifar_gray(data):                           # data: (n, 3072) uint8, R, G, B planes of 32×32 -> (n, 1024) uint8
    r, g, b = np.asarray(data, np.float64).reshape(len(data), 3, 1024).transpose(1, 0, 2)    # (n, 1024) each
    return np.clip(np.rint(0.2989 * r + 0.5870 * g + 0.1140 * b), 0, 255).astype(np.uint8)   # rounded to nearest


# ----------------------------------------------------------------------------- Pathfinder / PathX

KNOWN_EMPTY = {"pathfinder32/curv_baseline/imgs/0/sample_172.png"}     # an empty PNG in lra_release (S4 skips it too)


def grey_pixels(im, path):
    """The 8-bit grey levels of a PIL image, exactly: mode L as it is; 1-bit (0 / 255), and RGB / RGBA / LA whose
    channels are equal grey (alpha opaque) without rounding. Anything else (16-bit grey, colour, a palette) would be
    clipped or weighted, so it raises DataError naming the file and its mode."""
    if im.mode == "L":
        return np.asarray(im)                                            # (side, side) uint8
    if im.mode == "1":
        return np.asarray(im.convert("L"))                               # 0 / 255, exact
    if im.mode in ("RGB", "RGBA", "LA"):
        a = np.asarray(im)                                               # (side, side, channels) uint8
        colour, alpha = (a[..., :3], a[..., 3]) if im.mode == "RGBA" else (a[..., :1], a[..., 1]) \
            if im.mode == "LA" else (a, None)
        if (colour == colour[..., :1]).all() and (alpha is None or (alpha == 255).all()):
            return np.ascontiguousarray(colour[..., 0])
    raise DataError(f"{path}: a {im.mode} image ({'16-bit grey' if im.mode.startswith('I') else 'not 8-bit grey'}); "
                    f"the Pathfinder images are 8-bit grey and are read exactly, never converted with loss: "
                    f"convert them to 8-bit grey yourself, or generate the data again")


def read_pngs(job):                             # runs in worker processes: (paths, side) -> (k, side²) uint8
    paths, side = job
    out = np.empty((len(paths), side * side), np.uint8)
    for k, path in enumerate(paths):
        try:
            with Image.open(path) as im:
                pixels = grey_pixels(im, path)                           # (side, side) uint8
        except (OSError, ValueError, SyntaxError) as e:           # missing, empty, truncated or not an image
            raise DataError(f"{path}: cannot read this image ({e}); download or generate the data again") from None
        if pixels.shape != (side, side):
            raise DataError(f"{path}: image is {pixels.shape[1]}x{pixels.shape[0]} pixels, expected {side}x{side}")
        out[k] = pixels.reshape(-1)
    return out


def metadata_files(folder):                     # batch ids can have gaps, so glob; sort numerically as S4 does
    key = lambda p: (not p.stem.isdigit(), int(p.stem) if p.stem.isdigit() else p.stem)
    return sorted((folder / "metadata").glob("*.npy"), key=key)


def pathfinder_index(folder, side):
    """(image paths (str), labels int64 (n,), notes) from metadata/<k>.npy: one line per image, `imgs/<k>
    sample_<j>.png <j> <label> ...` (text, or the original generator's binary np.save of (n, 11) strings).
    Raises DataError naming file and line."""
    paths, labels = [], []
    known_empty, empty_files, blank = [], [], 0          # what is skipped, for the notes
    for meta in metadata_files(folder):
        raw = read_source(meta)
        if raw.startswith(b"\x93NUMPY"):
            try:
                rows = [list(map(str, r)) for r in np.load(io.BytesIO(raw), allow_pickle=False)]
            except (ValueError, OSError, EOFError) as e:                  # cut, or not an array of strings
                raise DataError(f"{meta}: a damaged metadata array ({str(e)[:60]}; {len(raw):,} bytes): "
                                f"{REGET}") from None
        else:
            rows = [line.split() for line in raw.decode("utf-8", errors="replace").splitlines()]
        if not any(rows):
            empty_files.append(meta)
            continue
        for lineno, fields in enumerate(rows, 1):
            if not fields:
                blank += 1
                continue
            if len(fields) < 4 or fields[3] not in ("0", "1"):
                raise DataError(f"{meta}:{lineno}: expected 'imgs/<k> sample_<j>.png <j> <label 0/1> ...', "
                                f"got {' '.join(fields)[:60]!r}")
            path = f"{folder}/{fields[0]}/{fields[1]}"             # str: 200k Path objects would dominate a load
            if f"pathfinder{side}/{folder.name}/{fields[0]}/{fields[1]}" in KNOWN_EMPTY and os.path.exists(path) \
                    and not os.path.getsize(path):
                known_empty.append(path)
                continue
            paths.append(path)
            labels.append(int(fields[3]))
    notes = []
    note_if(known_empty, f"skipped {len(known_empty)} known-empty release image(s): {', '.join(known_empty)}", notes)
    if empty_files:
        unused = sum(len(list((folder / "imgs" / m.stem).glob("*.png"))) for m in empty_files)
        notes.append(f"skipped {plural(len(empty_files), 'empty metadata file')}: "
                     f"{', '.join(map(str, empty_files[:3]))}{', ...' * (len(empty_files) > 3)} "
                     f"(0 images listed; {unused:,} PNGs in their imgs/<k>/ folders are not used)")
    note_if(blank, f"skipped {plural(blank, 'empty line')} in {folder / 'metadata'}/*.npy", notes)
    return paths, np.array(labels, np.int64), notes


def unfinished_batches(out, params):
    """The batches k < ⌈n / per_batch⌉ of a folder generated with `params` (read_mark) that have no metadata yet:
    a run stopped or killed before it finished them."""
    n, per_batch = params["n"], params.get("per_batch", 1000)
    return [k for k in range(-(-n // per_batch)) if not (out / "metadata" / f"{k}.npy").exists()]


RELEASE_ROOTS = ("", "lra_release", "lra_release/lra_release")     # where under data_dir the release is read


def release_path(data_dir, rel):  # data_dir/rel or the unpacked release data_dir/lra_release/rel
    candidates = [data_dir / root / rel for root in RELEASE_ROOTS]
    found = [c for c in candidates if c.exists()]
    if len(found) > 1:
        raise DataError(f"{rel} is there twice, {found[0]} and {found[1]}; which one to read is not clear: move or "
                        f"delete one of them (or point --data-dir at the folder that holds the one you mean)")
    return found[0] if found else candidates[0]


def find_imdb(data_dir):
    for root in (data_dir / "aclImdb", data_dir):  # the unpacked folder, or data_dir is that folder
        if all((root / s / lab).is_dir() for s in ("train", "test") for lab in ("pos", "neg")):
            return root
    tars = sorted(data_dir.glob("aclImdb*.tar.gz"), key=lambda p: (p.name != "aclImdb_v1.tar.gz", p.name))
    if tars:
        return tars[0]
    raise DataError(f"no IMDB reviews: looked for {data_dir / 'aclImdb'}/{{train,test}}/{{pos,neg}}/, "
                    f"{data_dir}/{{train,test}}/{{pos,neg}}/ and {data_dir}/aclImdb*.tar.gz; download "
                    f"aclImdb_v1.tar.gz from Stanford's Large Movie Review Dataset (aclImdb) page into {data_dir}")
