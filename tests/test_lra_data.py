"""Tests for lra_data.py against the real data in ../shared/data (see SOURCES.md there). CPU only, caches in tmp_path."""
import io
import pickle
import shutil
import sys
import tarfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import lra_data
from lra_data import EOS, PAD, TASKS, DataError, collate, evaluate_listops, generate_listops, load, normalize

LISTOPS_TEST = "listops/nyu_listops_original/test_d20s.tsv"
PF32 = "pathfinder_ref/pathfinder32/curv_contour_length_14"


def shared_file(shared_data, rel):
    path = shared_data / rel
    if not path.exists():
        pytest.skip(f"shared file {path} not found")
    return path


def operator_depth_and_arity(tokens):
    """Deepest operator nesting and each operator's number of arguments, from tokens without parentheses."""
    n_args, deepest, arities = [0], 0, []        # n_args[-1]: arguments the innermost open operator has so far
    for t in tokens:
        if t == "]":
            arities.append(n_args.pop())
        else:
            n_args[-1] += 1
            if t.startswith("["):
                n_args.append(0)
                deepest = max(deepest, len(n_args) - 1)
    return deepest, arities


# ----------------------------------------------------------------------------- ListOps

def test_evaluate_listops_reproduces_all_10000_original_test_labels(shared_data):
    rows = [line.split("\t") for line in shared_file(shared_data, LISTOPS_TEST).read_text().splitlines()]
    assert len(rows) == 10000
    wrong = [(label, expr) for label, expr in rows if evaluate_listops(expr) != int(label)]
    assert not wrong, f"{len(wrong)} labels differ, first: {wrong[0][0]} for {wrong[0][1][:80]}"


def test_listops_loader_keeps_closing_bracket_in_both_file_formats(shared_data, tmp_path):
    lines = shared_file(shared_data, LISTOPS_TEST).read_text().splitlines()[:300]
    original, lra = tmp_path / "orig" / "listops-1000", tmp_path / "lra" / "lra_release" / "listops-1000"
    for folder, text in ((original, "\n".join(lines) + "\n"),          # label<TAB>expr, no header
                         (lra, "Source\tTarget\n" + "".join(f"{e}\t{y}\n" for y, e in (l.split("\t") for l in lines)))):
        folder.mkdir(parents=True)
        for part in ("train", "val", "test"):
            (folder / f"basic_{part}.tsv").write_text(text)
    a = load("listops", "test", tmp_path / "orig", cache_dir=tmp_path / "cache")
    b = load("listops", "test", tmp_path / "lra", cache_dir=tmp_path / "cache")
    assert len(a) == len(b) == 300 and a.labels.tolist() == b.labels.tolist() == [int(l.split("\t")[0]) for l in lines]
    n_brackets = 0
    for i in range(300):
        x, tokens = a[i][0], lra_data.listops_tokens(lines[i].split("\t")[1])
        assert torch.equal(x, b[i][0]), "the two file formats tokenise differently"
        assert x[-1] == EOS and len(x) == len(tokens) + 1
        n_close = int((x == lra_data.LISTOPS_ID["]"]).sum())
        assert n_close == sum(t.startswith("[") for t in tokens), "']' was dropped"
        n_brackets += n_close
        assert int(x.max()) < TASKS["listops"].vocab_size == 19
    assert n_brackets > 300


def test_listops_generator_follows_the_lra_rules_and_labels_match_evaluate(tmp_path):
    folder = generate_listops(tmp_path / "a", n_train=40, n_val=5, n_test=5, seed=1, min_length=20, max_length=200)
    generate_listops(tmp_path / "b", n_train=40, n_val=5, n_test=5, seed=1, min_length=20, max_length=200)
    real = generate_listops(tmp_path / "real", n_train=2, n_val=1, n_test=1)      # the real 500 < length < 2000 rule
    exprs = []
    for root, lo, hi in ((folder, 20, 200), (real, 500, 2000)):
        for part in ("train", "val", "test"):
            lines = (root / f"basic_{part}.tsv").read_text().splitlines()
            assert lines[0] == "Source\tTarget", "release header missing"
            for line in lines[1:]:
                expr, label = line.split("\t")
                tokens = lra_data.listops_tokens(expr)
                depth, arities = operator_depth_and_arity(tokens)
                assert lo < len(tokens) < hi, f"length {len(tokens)} outside ({lo}, {hi})"
                assert depth <= 9, "an operator deeper than depth 9 (LRA forces digits at depth 10)"
                assert all(2 <= k <= 10 for k in arities), "an operator without 2..10 arguments"
                assert {t for t in tokens if t.startswith("[")} <= {"[MIN", "[MAX", "[MED", "[SM"}
                assert evaluate_listops(expr) == int(label)
                if root == folder:
                    exprs.append(expr)
    assert len(set(exprs)) == len(exprs) == 50, "duplicate trees across splits"
    for part in ("train", "val", "test"):
        assert (folder / f"basic_{part}.tsv").read_bytes() == (tmp_path / "b/listops-1000" / f"basic_{part}.tsv").read_bytes(), "same seed, different data"


def test_load_generates_listops_on_request_and_says_so(tmp_path):
    ds = load("listops", "train", tmp_path, generate=100, cache_dir=tmp_path / "cache")
    assert len(ds) == 96 and len(load("listops", "val", tmp_path, cache_dir=tmp_path / "cache")) == 2
    assert ds.source.startswith("generated by lra_data.py") and str(tmp_path / "listops-1000") in ds.source


# ----------------------------------------------------------------------------- Text (IMDB)

def test_text_is_bytes_plus_4_truncated_to_4096_with_eos_and_val_is_carved_from_train(shared_data, tmp_path):
    root = shared_file(shared_data, "text/aclImdb_sample")
    kw = dict(cache_dir=tmp_path)
    train, val, test = (load("text", s, root, **kw) for s in ("train", "val", "test"))
    assert (len(train), len(val), len(test)) == (450, 50, 500)
    assert not set(train.index) & set(val.index) and train.part == val.part == "train", "val must come from train, disjoint"
    files = sorted((root / "test" / "neg").glob("*.txt")) + sorted((root / "test" / "pos").glob("*.txt"))   # documented order
    assert test.labels.tolist() == [0] * 250 + [1] * 250
    n_long = 0
    for i, path in enumerate(files):
        raw, x = path.read_bytes(), test[i][0]
        assert len(x) == min(len(raw) + 1, 4096) and x[-1] == EOS
        assert x[:-1].tolist() == [b + 4 for b in raw[:4095]], f"{path.name}: ids are not bytes + 4"
        n_long += len(raw) >= 4096
    assert n_long > 0, "the sample should contain reviews longer than 4096 bytes"
    lra_train, lra_val = load("text", "train", root, lra_val=True, **kw), load("text", "val", root, lra_val=True, **kw)
    assert len(lra_train) == 500 and lra_val.part == "test" and len(lra_val) == 500, "lra_val: validate on test"


def test_text_reads_the_50k_archive_directly_and_reuses_its_cache(shared_data, tmp_path, monkeypatch):
    archive = shared_file(shared_data, "text/aclImdb_v1_labeled_50k.tar.gz")
    train, val, test = (load("text", s, archive.parent, cache_dir=tmp_path) for s in ("train", "val", "test"))
    assert str(archive) in test.source
    assert (len(train), len(val), len(test)) == (22500, 2500, 25000)
    assert np.bincount(test.labels).tolist() == [12500, 12500]
    first = (shared_data / "text/aclImdb_sample/test/neg/0_2.txt").read_bytes()
    assert test[0][0][:-1].tolist() == [b + 4 for b in first[:4095]], "archive and folder disagree on test/neg/0_2.txt"
    monkeypatch.setattr(lra_data, "_imdb_rows", lambda src: pytest.fail("cache was rebuilt"))
    assert len(load("text", "val", archive.parent, cache_dir=tmp_path)) == 2500


# ----------------------------------------------------------------------------- Image (CIFAR-10)

def cifar_batch(pngs, labels):
    rgb = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in pngs])      # (n, 32, 32, 3)
    return {b"data": rgb.transpose(0, 3, 1, 2).reshape(len(pngs), 3072), b"labels": list(labels), b"batch_label": b"x"}


def test_cifar_batches_give_lra_grayscale_and_keep_label_order(shared_data, tmp_path):
    kaggle = shared_file(shared_data, "image/cifar10_train_first200_kaggle")
    classes = "airplane automobile bird cat deer dog frog horse ship truck".split()
    names = dict(l.split(",") for l in (kaggle / "trainLabels.csv").read_text().split())
    train_pngs = [kaggle / "train" / f"{k}.png" for k in range(1, 201)]
    train_labels = [classes.index(names[f"{k}.png"]) for k in range(1, 201)]
    test_pngs = sorted((shared_data / "image/cifar10_test_first20_foolbox").glob("*.png"))
    folder = tmp_path / "dir" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for b in range(5):
        (folder / f"data_batch_{b + 1}").write_bytes(pickle.dumps(cifar_batch(train_pngs[40 * b: 40 * b + 40], train_labels[40 * b: 40 * b + 40])))
    (folder / "test_batch").write_bytes(pickle.dumps(cifar_batch(test_pngs, [int(p.stem[-1]) for p in test_pngs])))
    (tmp_path / "tar").mkdir()
    with tarfile.open(tmp_path / "tar" / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-py")
    for root in (tmp_path / "dir", tmp_path / "tar"):
        test = load("image", "test", root, cache_dir=tmp_path / "cache")
        assert test.labels.tolist() == [3, 8, 8, 0, 6, 6, 1, 6, 3, 1, 0, 9, 5, 7, 9, 8, 5, 7, 8, 6], "label order changed"
        for i, png in enumerate(test_pngs):
            rgb = np.asarray(Image.open(png).convert("RGB"), np.float64)
            grey = np.rint(rgb @ [0.2989, 0.5870, 0.1140]).reshape(-1)
            assert test[i][0].dtype == torch.uint8 and test[i][0].tolist() == grey.tolist()
            pil = np.asarray(Image.open(png).convert("L"), np.int64).reshape(-1)
            assert np.abs(test[i][0].numpy().astype(np.int64) - pil).max() <= 1
        train, val = load("image", "train", root, cache_dir=tmp_path / "cache"), load("image", "val", root, cache_dir=tmp_path / "cache")
        assert len(val) == 20 and len(train) == 180 and not set(train.index) & set(val.index)
        assert train.labels.tolist() == [train_labels[i] for i in train.index], "train labels out of batch order"


# ----------------------------------------------------------------------------- Pathfinder / PathX

def test_pathfinder32_reference_reads_12000_images_split_80_10_10(shared_data, tmp_path):
    folder = shared_file(shared_data, PF32)
    splits = {s: load("pathfinder", s, shared_data / "pathfinder_ref", cache_dir=tmp_path) for s in ("train", "val", "test")}
    assert [len(d) for d in splits.values()] == [9600, 1200, 1200]
    idx = [set(d.index.tolist()) for d in splits.values()]
    assert set.union(*idx) == set(range(12000)) and sum(map(len, idx)) == 12000, "splits overlap or miss images"
    pixels = np.load(splits["train"].store / "all.x.npy", mmap_mode="r")   # the uint8 cache, in tmp_path
    assert pixels.shape == (12000, 1024) and str(tmp_path) in str(splits["train"].store)
    labels = np.concatenate([d.labels for d in splits.values()])
    assert np.bincount(labels).tolist() == [6020, 5980], "labels are not field 4 of the metadata"
    meta = (folder / "metadata" / "0.npy").read_text().splitlines()       # batch 0 comes first in the cache
    assert np.load(splits["train"].store / "all.y.npy")[:500].tolist() == [int(l.split()[3]) for l in meta]
    assert abs(float(pixels.mean()) - 20.15) < 0.05, "mean intensity differs from the README"
    for i in (0, 1199):
        (x, y), j = splits["val"][i], int(splits["val"].index[i])          # example j = line j % 500 of batch j // 500
        line = (folder / "metadata" / f"{j // 500}.npy").read_text().splitlines()[j % 500].split()
        png = np.asarray(Image.open(folder / line[0] / line[1])).reshape(-1)
        assert x.tolist() == png.tolist() and y == int(line[3])
    assert splits["train"].source.startswith("release-format files, not generated")


def test_pathx_reference_reads_525_images_despite_gaps_in_batch_ids(shared_data, tmp_path):
    shared_file(shared_data, "pathfinder_ref/pathfinder128/curv_contour_length_14")
    ds = [load("pathx", s, shared_data / "pathfinder_ref", cache_dir=tmp_path) for s in ("train", "val", "test")]
    assert [len(d) for d in ds] == [421, 52, 52]
    assert np.bincount(np.concatenate([d.labels for d in ds])).tolist() == [266, 259]
    x, lengths, y = collate([ds[0][i] for i in range(3)])
    assert x.shape == (3, 16384) and x.dtype == torch.uint8 and lengths.tolist() == [16384] * 3
    assert len(pickle.dumps(ds[0])) < 100_000, "pickling the dataset copied the memmap (DataLoader workers would too)"


def test_difficulty_picks_the_curv_folder(shared_data, tmp_path):
    for difficulty in ("easy", "intermediate"):
        src = shared_file(shared_data, f"pathfinder_ref/pathfinder32/{lra_data.DIFFICULTY[difficulty]}")
        dst = tmp_path / "data" / "pathfinder32" / src.name
        (dst / "metadata").mkdir(parents=True)
        shutil.copy(src / "metadata" / "0.npy", dst / "metadata" / "0.npy")    # one batch of 500 is enough
        (dst / "imgs").symlink_to(src / "imgs")
        ds = load("pathfinder", "test", tmp_path / "data", difficulty=difficulty, cache_dir=tmp_path / "c")
        assert len(ds) == 50 and src.name in ds.source
    with pytest.raises(DataError, match="curv_contour_length_14"):
        load("pathfinder", "test", tmp_path / "data", cache_dir=tmp_path / "c")


def write_pathfinder(folder, images, labels):
    (folder / "imgs" / "0").mkdir(parents=True)
    for j, img in enumerate(images):
        if isinstance(img, bytes):
            (folder / "imgs" / "0" / f"sample_{j}.png").write_bytes(img)
        else:
            Image.fromarray(img).save(folder / "imgs" / "0" / f"sample_{j}.png")
    (folder / "metadata").mkdir()
    (folder / "metadata" / "0.npy").write_text("".join(f"imgs/0 sample_{j}.png {j} {y} 1.0 14 4 2 0.5 1 1\n" for j, y in enumerate(labels)))


def test_pathfinder_generate_writes_release_layout_and_marks_source(tmp_path, monkeypatch):
    def fake_generate_pathfinder(root, res=32, n=1000, contour_length=14, seed=0, workers=1):
        folder = root / f"pathfinder{res}" / "curv_contour_length_14"
        write_pathfinder(folder, [np.full((res, res), j, np.uint8) for j in range(n)], [j % 2 for j in range(n)])
        return folder
    if hasattr(lra_data, "generate_pathfinder"):        # after the lead merges the generator into lra_data.py
        monkeypatch.setattr(lra_data, "generate_pathfinder", fake_generate_pathfinder)
    else:
        monkeypatch.setitem(sys.modules, "pathfinder_gen", types.SimpleNamespace(generate_pathfinder=fake_generate_pathfinder))
    ds = load("pathfinder", "train", tmp_path, generate=20, cache_dir=tmp_path / "c")
    assert len(ds) == 16 and ds.source.startswith("generated by lra_data.py")
    assert all(int(ds[i][0][0]) == int(ds.index[i]) for i in range(len(ds))), "image j is not example j"


# ----------------------------------------------------------------------------- Retrieval, fractions, collate

def test_retrieval_reads_release_tsv_and_collates_pairs(tmp_path):
    folder = tmp_path / "lra_release" / "tsv_data"
    folder.mkdir(parents=True)
    rows = [("1.0", "a", "b", "x" * 5000, "short"), ("0.0", "c", "d", "hello", "world!"), ("1", "e", "f", "é", "z")]
    for name in ("train", "eval", "test"):
        (folder / f"new_aan_pairs.{name}.tsv").write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    ds = load("retrieval", "val", tmp_path, cache_dir=tmp_path / "c")
    assert ds.labels.tolist() == [1, 0, 1]
    x0, _ = ds[0]
    assert x0.shape == (2, 4001) and x0[0, -1] == EOS and (x0[0, :-1] == ord("x") + 4).all(), "doc not cut to 4000 + EOS"
    assert x0[1, :6].tolist() == [b + 4 for b in b"short"] + [EOS] and (x0[1, 6:] == PAD).all()
    x, lengths, y = collate([ds[1], ds[2]])
    assert x.shape == (2, 2, 7) and lengths.tolist() == [[6, 7], [3, 2]] and y.tolist() == [0, 1]
    assert x[1, 0, :3].tolist() == [0xC3 + 4, 0xA9 + 4, EOS], "utf-8 bytes of é"


def test_max_len_cuts_documents_to_max_len_with_eos_and_refuses_listops(tmp_path):
    folder = tmp_path / "tsv_data"
    folder.mkdir()
    rows = [("1", "a", "b", "x" * 50, "short"), ("0", "c", "d", "hello", "y" * 9)]
    for name in ("train", "eval", "test"):
        (folder / f"new_aan_pairs.{name}.tsv").write_text("".join("\t".join(r) + "\n" for r in rows))
    ds = load("retrieval", "train", tmp_path, cache_dir=tmp_path / "c", max_len=8)
    x0, x1 = ds[0][0], ds[1][0]
    assert x0.shape == (2, 8) and x0[0].tolist() == [ord("x") + 4] * 7 + [EOS], "cut to 7 bytes + EOS"
    assert x0[1, :6].tolist() == [b + 4 for b in b"short"] + [EOS], "a short document is left as it was"
    assert x1[1].tolist() == [ord("y") + 4] * 7 + [EOS]
    with pytest.raises(DataError, match="max_len"):
        load("listops", "train", tmp_path, max_len=8)


def test_data_fraction_subsets_nest_and_leave_val_and_test_alone(shared_data, tmp_path):
    root = shared_file(shared_data, "text/aclImdb_sample")
    sets = [set(load("text", "train", root, data_fraction=f, cache_dir=tmp_path).index.tolist()) for f in (0.1, 0.5, 1.0)]
    assert [len(s) for s in sets] == [45, 225, 450] and sets[0] < sets[1] < sets[2], "subsets do not nest"
    other_seed = set(load("text", "train", root, data_fraction=0.1, seed=1, cache_dir=tmp_path).index.tolist())
    assert other_seed != sets[0]
    val = load("text", "val", root, data_fraction=0.1, cache_dir=tmp_path)
    assert len(val) == 50 and not set(val.index.tolist()) & sets[2]


def test_collate_pads_tokens_and_stacks_pixels_and_normalize_matches_lra():
    x, lengths, y = collate([(torch.tensor([5, 6, EOS]), 1), (torch.tensor([7, EOS]), 0)])
    assert x.tolist() == [[5, 6, EOS], [7, EOS, PAD]] and lengths.tolist() == [3, 2] and y.tolist() == [1, 0]
    x, lengths, y = collate([(torch.zeros(1024, dtype=torch.uint8), 0), (torch.full((1024,), 255, dtype=torch.uint8), 1)])
    assert x.dtype == torch.uint8 and x.shape == (2, 1024) and lengths.tolist() == [1024, 1024]
    assert normalize(x, "pathfinder")[:, 0].tolist() == [-1.0, 1.0]
    torch.testing.assert_close(normalize(x, "image")[:, 0], torch.tensor([-122.6 / 61, (255 - 122.6) / 61]))


# ----------------------------------------------------------------------------- bad input

def test_missing_files_name_the_path_the_download_and_the_generate_command(tmp_path):
    expected = {"listops": ["listops-1000", "lra_release.gz", "--generate"], "retrieval": ["new_aan_pairs", "lra_release.gz"],
                "text": ["aclImdb", "Stanford"], "image": ["cifar-10-python.tar.gz", "Krizhevsky"],
                "pathfinder": ["pathfinder32/curv_contour_length_14/metadata", "lra_release.gz", "--task pathfinder", "--generate"],
                "pathx": ["pathfinder128", "--task pathx", "--generate"], "pathx256": ["pathfinder256", "--generate"]}
    for task, words in expected.items():
        with pytest.raises(DataError) as e:
            load(task, "train", tmp_path / "nothing", cache_dir=tmp_path)
        msg = str(e.value)
        assert "\n" not in msg and str(tmp_path / "nothing") in msg and all(w in msg for w in words), f"{task}: {msg}"


def test_malformed_rows_name_file_and_line(tmp_path):
    listops = tmp_path / "a" / "listops-1000"
    listops.mkdir(parents=True)
    for part in ("train", "val", "test"):
        (listops / f"basic_{part}.tsv").write_text("Source\tTarget\n( [MAX 2 3 ] )\t3\n( [MAX 2 3 ] )\tthree\n")
    with pytest.raises(DataError, match=r"basic_train\.tsv:3:"):
        load("listops", "train", tmp_path / "a", cache_dir=tmp_path / "c")
    aan = tmp_path / "b" / "tsv_data"
    aan.mkdir(parents=True)
    for name in ("train", "eval", "test"):
        (aan / f"new_aan_pairs.{name}.tsv").write_text("1.0\ta\tb\tx\ty\n0\ta\tb\tonly four\n")
    with pytest.raises(DataError, match=r"new_aan_pairs\.train\.tsv:2:"):
        load("retrieval", "train", tmp_path / "b", cache_dir=tmp_path / "c")
    pf = tmp_path / "d" / "pathfinder32" / "curv_contour_length_14"
    write_pathfinder(pf, [np.zeros((32, 32), np.uint8)] * 2, [0, 1])
    (pf / "metadata" / "0.npy").write_text("imgs/0 sample_0.png 0 1 1.0\nimgs/0 sample_1.png 1 yes 1.0\n")
    with pytest.raises(DataError, match=r"metadata/0\.npy:2:"):
        load("pathfinder", "train", tmp_path / "d", cache_dir=tmp_path / "c")


def test_corrupt_missing_or_wrongly_sized_image_names_the_file(tmp_path):
    good = np.zeros((32, 32), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(np.full((32, 32), 7, np.uint8)).save(buf, format="PNG")
    for k, bad in enumerate([b"not a png", buf.getvalue()[:40], np.zeros((31, 31), np.uint8), None]):
        folder = tmp_path / f"d{k}" / "pathfinder32" / "curv_contour_length_14"
        write_pathfinder(folder, [good, good if bad is None else bad], [0, 1])
        if bad is None:
            (folder / "imgs" / "0" / "sample_1.png").unlink()
        with pytest.raises(DataError, match=r"imgs/0/sample_1\.png"):
            load("pathfinder", "train", tmp_path / f"d{k}", cache_dir=tmp_path / "c", workers=2 if k == 0 else 1)
    assert not list((tmp_path / "c").iterdir()), "a failed build left a half-written cache behind"


def test_default_cache_never_goes_into_read_only_data(shared_data, tmp_path):
    assert lra_data.cache_root(shared_data / "text") == Path("data") / "cache", "would write next to read-only shared data"
    assert lra_data.cache_root(tmp_path) == tmp_path / "cache"
    assert lra_data.cache_root(shared_data, tmp_path / "mine") == tmp_path / "mine"


def test_cli_prints_source_split_sizes_and_label_balance(shared_data, tmp_path, capsys):
    root = shared_file(shared_data, "text/aclImdb_sample")
    assert lra_data.main(["--task", "text", "--data-dir", str(root), "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"source: IMDB (Maas et al. 2011) at {root}" in out
    assert "train     450 examples" in out and "val        50 examples" in out and "test      500 examples | labels 0:50.0% 1:50.0%" in out
    assert lra_data.main(["--task", "listops", "--data-dir", str(tmp_path / "none")]) == 2
