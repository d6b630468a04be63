"""Facts about lra/check.py (python lra_data.py --check): every expected split size carries its source (or says none
was found); small files written in each official layout are judged complete, cut (short or missing split),
misplaced (one folder level off, data_dir inside the folder) or mixed up (another difficulty); the exit status is 0
only when all that is present is complete; a run on a short release-format split says so in a data note on the
console, in log.txt and in results.json."""
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import run, shared_file
from lra import check

REPO = Path(__file__).resolve().parents[1]
SMALL = {"listops": {"train": 6, "val": 2, "test": 2}, "retrieval": {"train": 4, "val": 2, "test": 2},
         "text": {"train": 4, "test": 4}, "image": {"train": 10, "test": 2}, "pathfinder": {"all": 6}}


@pytest.fixture
def small_release(monkeypatch):
    """The release's sizes shrunk to SMALL, so a complete release fits in a test (the real numbers: the next test)."""
    for task, sizes in SMALL.items():
        monkeypatch.setitem(check.EXPECTED, task, check.EXPECTED[task].__class__(
            **{**check.EXPECTED[task].__dict__, "release": sizes}))


def write_listops(folder, sizes):
    folder.mkdir(parents=True)
    for split, n in sizes.items():
        rows = "".join(f"( ( ( [MAX {i % 10} ) {(i + 3) % 10} ) ] )\t{max(i % 10, (i + 3) % 10)}\n" for i in range(n))
        (folder / f"basic_{split}.tsv").write_text("Source\tTarget\n" + rows)


def write_retrieval(folder, sizes):
    folder.mkdir(parents=True)
    for split, name in (("train", "train"), ("val", "eval"), ("test", "test")):
        rows = "".join(f"{i % 2}.0\ta{i}\tb{i}\tsome text\tother text\n" for i in range(sizes[split]))
        (folder / f"new_aan_pairs.{name}.tsv").write_text(rows)


def write_imdb(folder, per_label):
    for split in ("train", "test"):
        for label in ("pos", "neg"):
            (folder / split / label).mkdir(parents=True)
            for i in range(per_label):
                (folder / split / label / f"{i}_7.txt").write_text("a fine film")


def write_cifar(folder, rows_per_batch, test_rows):
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = test_rows if name == "test_batch" else rows_per_batch
        batch = {b"data": np.zeros((n, 3072), np.uint8), b"labels": [i % 10 for i in range(n)]}
        (folder / name).write_bytes(pickle.dumps(batch))


def write_pathfinder(folder, n, contour_length=14):
    (folder / "metadata").mkdir(parents=True)
    (folder / "imgs" / "0").mkdir(parents=True)
    lines = []
    for j in range(n):
        Image.fromarray(np.full((32, 32), 9 * j, np.uint8)).save(folder / "imgs" / "0" / f"sample_{j}.png")
        lines.append(f"imgs/0 sample_{j}.png {j} {j % 2} 1.0 {contour_length} 4 2 0.5 1 1\n")
    (folder / "metadata" / "0.npy").write_text("".join(lines))


def write_all(root, cut=None):
    """Every task in its official layout under root/lra_release (text and image beside it, as downloaded); cut:
    the one split of ListOps written one example short."""
    listops = dict(SMALL["listops"], **({cut: SMALL["listops"][cut] - 1} if cut else {}))
    write_listops(root / "lra_release" / "listops-1000", listops)
    write_retrieval(root / "lra_release" / "tsv_data", SMALL["retrieval"])
    write_imdb(root / "aclImdb", 2)
    write_cifar(root / "cifar-10-batches-py", 2, 2)
    write_pathfinder(root / "lra_release" / "pathfinder32" / "curv_contour_length_14", 6)


def verdicts(root):
    return {t: check.check_task(t, root) for t in check.EXPECTED}


def test_every_expected_size_has_a_source_or_says_none_was_found():
    assert check.EXPECTED["listops"].release == {"train": 96_000, "val": 2_000, "test": 2_000}
    assert check.EXPECTED["retrieval"].release == {"train": 147_086, "val": 18_090, "test": 17_437}
    assert check.EXPECTED["text"].release == {"train": 25_000, "test": 25_000}
    assert check.EXPECTED["image"].release == {"train": 50_000, "test": 10_000}
    for task, exp in check.EXPECTED.items():
        for sizes, source in ((exp.release, exp.release_source), (exp.original, exp.original_source)):
            for split, n in sizes.items():
                assert source, f"{task} {split}: a size without a source"
                assert n is not None or "no source found" in source, f"{task} {split}: no number, no reason"


def test_the_original_listops_test_size_is_what_the_shared_file_holds(shared_data):
    path = shared_file(shared_data, "listops/nyu_listops_original/test_d20s.tsv")
    lines = Path(path).read_text().splitlines()
    assert sum(1 for line in lines if line.strip()) == check.EXPECTED["listops"].original["test"]


def test_the_shared_imdb_archive_is_complete(shared_data):
    folder = shared_file(shared_data, "text/aclImdb_v1_labeled_50k.tar.gz").parent
    report = check.check_task("text", folder)
    assert report.verdict == "complete" and report.sizes == {"train": 25_000, "test": 25_000}, report


def test_an_imdb_archive_one_folder_down_is_found_and_named_with_the_data_dir_to_give(shared_data):
    archive = shared_file(shared_data, "text/aclImdb_v1_labeled_50k.tar.gz")
    report = check.check_task("text", shared_data)                  # the archive is in text/, one level down
    assert report.verdict == "problems" and report.problems == [
        f"found {archive}, not where it is read (aclImdb/{{train,test}}/{{pos,neg}}/*.txt or aclImdb*.tar.gz under "
        f"{shared_data}): move it there, or point --data-dir at {archive.parent}"], report.problems


def test_complete_official_layouts_are_judged_complete_and_exit_0(small_release, tmp_path, capsys):
    write_all(tmp_path)
    found = verdicts(tmp_path)
    assert {t: r.verdict for t, r in found.items() if r.verdict != "not found"} == {
        t: "complete" for t in SMALL}, {t: r.problems for t, r in found.items()}
    assert found["listops"].found == tmp_path / "lra_release" / "listops-1000"
    assert found["pathfinder"].sizes == {"all": 6} and found["image"].sizes == {"train": 10, "test": 2}
    assert check.main(tmp_path) == 0
    assert "all complete" in capsys.readouterr().out


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_a_cut_split_is_named_with_its_size_and_what_to_do_and_exits_2(small_release, tmp_path, split):
    write_all(tmp_path, cut=split)
    report = check.check_task("listops", tmp_path)
    want = SMALL["listops"][split]
    assert report.problems == [f"the {split} split holds {want - 1:,} of the release's {want:,} examples: a cut or "
                               f"partial download; download lra_release.gz (google-research/long-range-arena "
                               f"README) and unpack it (tar xzf) into {tmp_path}, or generate: python lra_data.py "
                               f"--task listops --data-dir <empty folder> --generate 100000"], report.problems
    assert check.main(tmp_path) == 2


def test_a_missing_split_file_and_missing_images_are_problems(small_release, tmp_path):
    write_all(tmp_path)
    (tmp_path / "lra_release" / "tsv_data" / "new_aan_pairs.eval.tsv").unlink()
    (tmp_path / "lra_release" / "pathfinder32" / "curv_contour_length_14" / "imgs" / "0" / "sample_3.png").unlink()
    found = verdicts(tmp_path)
    assert any("new_aan_pairs.eval.tsv is missing" in p for p in found["retrieval"].problems), found["retrieval"]
    assert any("1 of the 6 images listed" in p for p in found["pathfinder"].problems), found["pathfinder"]


def test_files_one_folder_level_off_are_found_and_named(small_release, tmp_path):
    write_listops(tmp_path / "downloads" / "lra" / "listops-1000", SMALL["listops"])   # two levels too deep
    report = check.check_task("listops", tmp_path)
    assert report.verdict == "problems" and report.problems[0].startswith(
        f"found {tmp_path / 'downloads' / 'lra' / 'listops-1000'}, not where it is read"), report.problems
    write_pathfinder(tmp_path / "pathfinder32" / "curv_contour_length_14", 6)
    inside = check.check_task("pathfinder", tmp_path / "pathfinder32")      # --data-dir pointing inside
    assert "point --data-dir at the folder that holds pathfinder32" in inside.problems[0], inside.problems


def test_a_difficulty_mix_up_is_named(small_release, tmp_path):
    write_pathfinder(tmp_path / "pathfinder32" / "curv_baseline", 6, contour_length=6)
    only_easy = check.check_task("pathfinder", tmp_path)
    assert "only curv_baseline" in only_easy.problems[0] and "curv_contour_length_14" in only_easy.problems[0]
    write_pathfinder(tmp_path / "pathfinder32" / "curv_contour_length_14", 6, contour_length=6)   # renamed easy
    renamed = check.check_task("pathfinder", tmp_path)
    assert any("lists contour length 6" in p for p in renamed.problems), renamed.problems


def test_check_on_the_command_line_exits_0_when_complete_and_2_otherwise(tmp_path):
    write_listops(tmp_path / "listops-1000", check.EXPECTED["listops"].release)   # the release's own sizes
    command = [sys.executable, "lra_data.py", "--check", "--data-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "listops: complete" in done.stdout, done.stdout + done.stderr
    assert " 96,000       96,000" in done.stdout, done.stdout
    with open(tmp_path / "listops-1000" / "basic_val.tsv", "r+") as f:     # a cut archive: half the val file
        f.truncate(len(f.read()) // 2)
    cut = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert cut.returncode == 2 and "the val split holds" in cut.stdout, cut.stdout
    empty = subprocess.run([*command[:-1], str(tmp_path / "nothing")], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert empty.returncode == 2 and "found no LRA task's files" in empty.stdout, empty.stdout


def test_a_run_on_a_short_release_split_names_the_shortfall_in_console_log_and_results(tmp_path, capsys):
    write_listops(tmp_path / "data" / "listops-1000", {"train": 40, "val": 8, "test": 8})
    results, run_dir = run(tmp_path / "data", tmp_path / "runs", "--task", "listops", "--model", "dlr",
                           "--epochs", "1")
    note = (f"{tmp_path / 'data' / 'listops-1000'} holds fewer examples than the LRA release (train 40 of 96,000; "
            f"val 8 of 2,000; test 8 of 2,000)")
    assert any(n.startswith(note) for n in results["data_notes"]), results["data_notes"]
    assert f"data note: {note}" in capsys.readouterr().out
    assert f"data note: {note}" in (run_dir / "log.txt").read_text()


def test_check_with_a_task_reports_that_task_only(tmp_path):
    write_listops(tmp_path / "listops-1000", check.EXPECTED["listops"].release)
    command = [sys.executable, "lra_data.py", "--check", "--data-dir", str(tmp_path)]
    only = subprocess.run([*command, "--task", "text"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert only.returncode == 2 and "found no LRA task's files" in only.stdout, only.stdout   # text is not there
    assert "listops" not in only.stdout, f"--task text reported another task:\n{only.stdout}"
    listops = subprocess.run([*command, "--task", "listops"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert listops.returncode == 0 and "listops: complete" in listops.stdout and "text" not in listops.stdout.lower()


def test_the_advice_for_an_empty_folder_names_that_folder_and_its_generate_command_fills_it(tmp_path, capsys):
    import shlex
    data = tmp_path / "my data"
    data.mkdir()
    assert check.main(str(data), difficulty="easy") == 2
    advice = [line.split("to get it: ", 1)[1] for line in capsys.readouterr().out.splitlines() if "to get it: " in line]
    assert len(advice) == len(check.EXPECTED) and all(f"into {shlex.quote(str(data))}" in a for a in advice), advice
    generate = [shlex.split(a.split("generate: ", 1)[1]) for a in advice if "generate: " in a]
    assert len(generate) == 4 and all(g[g.index("--data-dir") + 1] == str(data) for g in generate), generate
    assert [g[g.index("--difficulty") + 1] for g in generate if "--difficulty" in g] == ["easy"] * 3, generate
    listops = next(g for g in generate if "listops" in g)
    listops[listops.index("--generate") + 1] = "40"                       # the advice's command, at a test's size
    subprocess.run(listops, cwd=REPO, check=True, capture_output=True, timeout=120)
    assert check.main(str(data), tasks=["listops"]) == 0 and "listops: not found" not in capsys.readouterr().out


def test_a_split_holding_every_line_twice_is_named_as_surplus_not_complete(small_release, tmp_path):
    write_all(tmp_path)
    train = tmp_path / "lra_release" / "listops-1000" / "basic_train.tsv"
    header, *rows = train.read_text().splitlines(keepends=True)
    train.write_text(header + "".join(rows * 2))                        # every line twice
    report = check.check_task("listops", tmp_path)
    assert report.verdict == "problems" and any(
        f"holds {2 * SMALL['listops']['train']:,} examples, more than the release's" in p for p in report.problems), \
        report.problems


def test_pathx_images_in_the_pathfinder_folder_are_named_by_their_resolution(small_release, tmp_path):
    folder = tmp_path / "pathfinder32" / "curv_contour_length_14"
    write_pathfinder(folder, 6)
    for png in (folder / "imgs" / "0").glob("*.png"):
        Image.fromarray(np.zeros((128, 128), np.uint8)).save(png)        # PathX's size in Pathfinder's place
    report = check.check_task("pathfinder", tmp_path)
    assert any("128×128 pixels, not this task's 32×32" in p for p in report.problems), report.problems


def test_an_unreadable_file_is_named_and_the_other_tasks_are_still_checked(small_release, tmp_path, monkeypatch,
                                                                          capsys):
    write_all(tmp_path)
    bad = tmp_path / "lra_release" / "listops-1000" / "basic_val.tsv"
    real_open = open

    def guarded(path, *a, **k):                                         # root reads anything: deny this one file
        if Path(path) == bad:
            raise PermissionError(13, "Permission denied", str(bad))
        return real_open(path, *a, **k)
    monkeypatch.setattr("builtins.open", guarded)
    assert check.main(tmp_path) == 2
    out = capsys.readouterr().out
    assert f"cannot read {bad} (Permission denied)" in out and "retrieval: complete" in out, out


def test_a_huge_split_without_line_breaks_is_counted_in_bounded_memory(tmp_path):
    import tracemalloc
    one_line = tmp_path / "basic_train.tsv"
    one_line.write_bytes(b"x" * (24 << 20))                             # 24 MiB, no line break
    tracemalloc.start()
    assert check.tsv_rows(one_line) == (1, False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB for a 24 MiB line"
    lines = tmp_path / "lines.tsv"
    lines.write_bytes(b"Source\tTarget\r\na\t1\n\n  \nb\t2")             # header, blank lines, no final break
    assert check.tsv_rows(lines) == check.tsv_rows(lines, chunk=3) == (2, True)
