"""Facts about lra_cache.py: the stamp sees a changed source file, a store is built once and then reused, a failed
build leaves nothing behind, token and pixel arrays read back as written, and the default cache never goes next to
read-only data. The same cache seen through lra_data.load (rebuilds on an edited review or a truncated PNG, notes kept
on reuse): tests/test_lra_data.py."""
import os
from pathlib import Path

import numpy as np
import pytest

from lra import cache as lra_cache


def test_default_cache_never_goes_into_read_only_data(tmp_path):
    read_only = tmp_path / "read_only"                  # our own read-only folder: the shared one may be writable
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        assert lra_cache.cache_root(read_only) == Path("data") / "cache", "would write next to read-only data"
    finally:
        read_only.chmod(0o755)
    assert lra_cache.cache_root(tmp_path) == tmp_path / "cache"
    assert lra_cache.cache_root(read_only, tmp_path / "mine") == tmp_path / "mine"


def test_stamp_changes_with_a_files_size_or_mtime_and_only_then(tmp_path):
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for f in files:
        f.write_text("12345")
    first = lra_cache.stamp(tmp_path, files)
    assert lra_cache.stamp(tmp_path, files) == first, "same files, same stamp"
    files[1].write_text("123456")                                        # size changes
    assert lra_cache.stamp(tmp_path, files) != first
    second = lra_cache.stamp(tmp_path, files)
    st = files[0].stat()
    os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))     # mtime changes, size does not
    assert lra_cache.stamp(tmp_path, files) != second


def test_a_store_is_built_once_then_reused_until_the_stamp_changes(tmp_path):
    builds = []

    def build(folder, notes):
        builds.append(folder)
        notes.append("a note")
        return lra_cache.write_tokens(folder, [("train", [np.array([5, 6, 7])], 1), ("train", [np.array([8])], 0)])

    store = tmp_path / "cache" / "text-x"
    assert lra_cache.cached(store, tmp_path, "s1", build) == ({"train": 2}, ["a note"])
    assert lra_cache.cached(store, tmp_path, "s1", build) == ({"train": 2}, ["a note"]) and len(builds) == 1, \
        "a matching meta.json must reuse the store"
    lra_cache.cached(store, tmp_path, "s2", build)
    assert len(builds) == 2 and sorted(p.name for p in store.parent.iterdir()) == ["text-x"], "rebuilt in place"
    ids, off = np.fromfile(store / "train.tok", np.uint16), np.load(store / "train.off.npy")
    assert ids.tolist() == [5, 6, 7, 8] and off.tolist() == [0, 3, 4] and np.load(store / "train.y.npy").tolist() == [1, 0]


def test_a_failed_build_leaves_no_store_and_no_half_built_folder(tmp_path):
    def build(folder, notes):
        (folder / "part.tok").write_bytes(b"half")
        raise RuntimeError("the source broke mid-way")

    with pytest.raises(RuntimeError):
        lra_cache.cached(tmp_path / "cache" / "text-x", tmp_path, "s", build)
    assert not list((tmp_path / "cache").iterdir()), "a failed build left files behind"


def test_pixels_are_written_block_by_block_and_read_back_as_uint8(tmp_path):
    blocks = [np.full((2, 4), i, np.uint8) for i in (1, 2, 3)]          # 3 blocks of (2, 4)
    assert lra_cache.write_pixels(tmp_path, "all", np.arange(6), 4, blocks) == {"all": 6}
    x = np.load(tmp_path / "all.x.npy")
    assert x.dtype == np.uint8 and x.shape == (6, 4) and x[:, 0].tolist() == [1, 1, 2, 2, 3, 3]
