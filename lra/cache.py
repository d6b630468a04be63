"""lra_cache.py: the LRA tasks as arrays on disk, built once per source and rebuilt when the source changes.
layout: <cache_dir>/<task>[-<difficulty>]-<hash of source path>/{meta.json, <part>.y.npy (labels, int64), and
        <part>.x.npy (pixels: (n, L) uint8, written block by block) or <part>.tok (uint16 ids, all documents back to
        back) + <part>.off.npy (where each document starts, (n_docs + 1,) int64)}
valid:  meta.json's stamp = (relative path, size, mtime) of every source file read, and the arrays it lists are there
        at their sizes (else the cache is rebuilt, never trusted); a build runs in a private folder
        that then replaces the store, so a crash or a second process never leaves half a cache
check:  stamp, reuse, rebuild, failed builds, read-only data -> tests/test_lra_cache.py (through load: test_lra_data)
"""
import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lra.files import DataError, free_space, process_alive, write_advice

CACHE_VERSION = 3    # 3: meta.json lists the arrays and their sizes (damaged)


def writable(folder):
    # permission bits as well as os.access: root may write anywhere, yet a folder marked read-only stays untouched
    return folder.is_dir() and os.access(folder, os.W_OK) and bool(folder.stat().st_mode & stat.S_IWUSR)


def cache_root(data_dir, cache_dir=None):
    """cache_dir if given, else data_dir/cache when data_dir is writable, else ./data/cache. Raises DataError when that
    fallback is read-only too (with the default --data-dir data it is inside the read-only data_dir itself)."""
    if cache_dir is not None:
        return Path(cache_dir)
    if writable(Path(data_dir)):
        return Path(data_dir) / "cache"
    fallback = Path("data") / "cache"
    if not writable(next(p for p in (fallback, fallback.parent, Path.cwd()) if p.exists())):
        raise DataError(f"{data_dir} is read-only and so is the fallback cache folder {fallback.resolve()}: pass "
                        f"--cache-dir <a writable folder>")
    return fallback


def stamp(src, files):
    """What the cache is valid for: a digest of (path relative to src, size, mtime_ns) of every source file read, one
    stat each (contents are not hashed: an edit that keeps both size and mtime is not seen)."""
    digest = hashlib.sha1()
    prefix = str(src) + os.sep
    for f in map(str, files):
        try:
            st = os.stat(f)
            size, mtime = st.st_size, st.st_mtime_ns
        except OSError:                          # missing: the build then names it
            size = mtime = -1
        line = f"{f[len(prefix):] if f.startswith(prefix) else f}\t{size}\t{mtime}\n"
        digest.update(line.encode(errors="surrogateescape"))   # a path of any bytes, as the OS gave it
    return f"{len(files)} files, sha1 {digest.hexdigest()}"


def write_tokens(store, rows):
    """Stream rows (part, [ids, ...], label) into <part>.tok (uint16) + <part>.off.npy + <part>.y.npy."""
    files, offsets, labels = {}, {}, {}
    with contextlib.ExitStack() as opened:       # every .tok file is closed, also when a reader raises
        for part, docs, label in rows:
            if part not in files:
                files[part] = opened.enter_context(open(store / f"{part}.tok", "wb"))
                offsets[part], labels[part] = [0], []
            for ids in docs:
                files[part].write(ids.astype(np.uint16).tobytes())
                offsets[part].append(offsets[part][-1] + len(ids))
            labels[part].append(label)
    for part in files:
        np.save(store / f"{part}.off.npy", np.array(offsets[part], np.int64))    # (n_docs + 1,)
        np.save(store / f"{part}.y.npy", np.array(labels[part], np.int64))       # (n,)
    return {part: len(labels[part]) for part in files}


def reserve(path):
    """Allocate every byte of `path` on the disk now (posix_fallocate): a memmap written into a sparse file on a full
    disk dies with SIGBUS, with no message; this raises OSError (no space) before anything is written instead."""
    with open(path, "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        except (AttributeError, OSError) as e:          # no posix_fallocate (macOS, Windows) or no support for it
            if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise


def write_pixels(store, part, labels, length, blocks):
    """Fill a uint8 (n, length) memmap block by block, so PathX (200k × 16384 bytes) never sits in RAM; its bytes
    are reserved on the disk first (reserve)."""
    x = np.lib.format.open_memmap(store / f"{part}.x.npy", mode="w+", dtype=np.uint8, shape=(len(labels), length))
    reserve(store / f"{part}.x.npy")
    i = 0
    with tqdm(total=len(labels), desc=f"caching {part} pixels", unit=" img") as bar:
        for block in blocks:                     # block: (k, length) uint8
            x[i: i + len(block)] = block
            i += len(block)
            bar.update(len(block))
    x.flush()
    np.save(store / f"{part}.y.npy", labels)
    return {part: len(labels)}


def remove_leftovers(store):
    """Remove the private build folders (<store>.building-<pid>) of processes that died building this cache."""
    for tmp in store.parent.glob(f"{store.name}.building-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def read_meta(store):
    """store/meta.json as a dict; {} when it is absent, cut or not a cache's (the cache is then rebuilt)."""
    try:
        meta = json.loads((store / "meta.json").read_text())
        return meta if isinstance(meta, dict) and {"sizes", "notes", "arrays"} <= set(meta) else {}
    except (OSError, ValueError):
        return {}


def damaged(store, meta):
    """What is wrong with the arrays meta.json lists (deleted, cut, grown, or an unreadable header), or None."""
    for name, size in meta["arrays"].items():
        path = store / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{name} is {'missing' if not path.is_file() else f'{path.stat().st_size:,} bytes, not {size:,}'}"
        if name.endswith(".npy"):
            try:
                np.load(path, mmap_mode="r")
            except (OSError, ValueError) as e:
                return f"{name}: {str(e)[:60]}"
    return None


def cached(store, src, stamp, build, need=None):
    """(sizes of the cached parts, notes). Unless store/meta.json matches the source files, build(folder, notes) runs
    in a private folder that then replaces store, so a crash or a second process never leaves a half-built cache.
    need: the bytes the cache will take, if known, for the message when the disk is too full (DataError)."""
    remove_leftovers(store)                     # a killed build of this cache: its folder goes now
    meta = read_meta(store)
    if meta.get("version") == CACHE_VERSION and meta.get("source") == str(src) and meta.get("stamp") == stamp:
        if (damage := damaged(store, meta)) is None:
            return meta["sizes"], meta["notes"]
        print(f"note: the cache {store} is damaged ({damage}): rebuilding it", flush=True)
    elif (store / "meta.json").exists() and not meta:
        print(f"note: the cache {store} has a damaged meta.json: rebuilding it", flush=True)
    foreign = [f.name for f in store.iterdir() if f.suffix not in (".npy", ".tok", ".json")] if store.is_dir() else []
    if foreign:                                 # a cache holds only its arrays and meta.json: never replace others
        raise DataError(f"{store} holds {foreign[0]}, which no cache of this repo holds, so it is never replaced: "
                        f"move it away or pass another --cache-dir")
    tmp = store.with_name(f"{store.name}.building-{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
    except OSError as e:                        # read-only, not a folder, no such place: the user's to fix
        raise DataError(f"cannot make the cache folder {store.parent} ({e.strerror}); pass --cache-dir "
                        f"<a writable folder>") from None
    print(f"caching {src} -> {store}")
    notes = []
    try:
        sizes = build(tmp, notes)
        arrays = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}        # what damaged() checks
        meta = {"version": CACHE_VERSION, "source": str(src), "stamp": stamp, "sizes": sizes, "notes": notes,
                "arrays": arrays}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    except OSError as e:                        # a full disk, a quota, a folder made read-only meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        if e.filename and not str(e.filename).startswith(str(tmp)):     # a source file a reader did not check
            raise DataError(f"cannot read {e.filename} ({e.strerror or e}): download or generate the data "
                            f"again") from None
        needs = f"it needs about {need / 1e9:.1f} GB, " if need else ""
        raise DataError(f"cannot write the cache {store} ({e.strerror or e}; {needs}{free_space(store.parent)}): "
                        f"{write_advice(e)} or pass --cache-dir <another folder>; nothing half-built is left") \
            from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(store, ignore_errors=True)    # a cache of older source files
    try:
        os.replace(tmp, store)
    except OSError:                             # another process got there first with the same data
        shutil.rmtree(tmp, ignore_errors=True)
    return sizes, notes
