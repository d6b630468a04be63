"""lra/check.py: what a data folder holds against what each LRA task should hold (python lra_data.py --check).
expected: the split sizes of the LRA release and of the original datasets, each with where the number comes from
          (EXPECTED; a size no source confirmed says so instead of a number)
found:    the layout looked for (under each of lra/files.RELEASE_ROOTS, as release_path reads), the sizes read
          (lines, files, pickled rows; no cache is built), and one line per problem (missing split, short split,
          files one folder level off, a difficulty mix-up) saying what to do
notes:    shortfall_note: the data note of a run on a short release-format split (lra_data.load)
Check: tests/test_lra_check.py (small files in each official layout: complete, cut, misplaced).
"""
import fnmatch
import os
import shlex
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from lra import files as lra_files
from lra.files import GENERATED_MARK, find_imdb, read_mark, release_path
from lra.pathfinder import DIFFICULTIES

LRA_LISTOPS = "google-research/long-range-arena, lra_benchmarks/data/listops.py (its flags' defaults: " \
              "num_train_samples 96000, num_valid_samples 2000, num_test_samples 2000)"
LRA_APPENDIX = "the LRA task descriptions as a paper's appendix gives them (S5, Smith et al., ICLR 2023); " \
               "not checked against the release's files"
IMDB = "IMDB (Maas et al. 2011), aclImdb v1 as released: 12,500 pos + 12,500 neg reviews per split, counted"
CIFAR_PAGE = "CIFAR-10 python batches: data_batch_1..5 and test_batch of 10,000 rows each (docs/data.md, SPEC)"
NO_SOURCE = "no source found: not confirmed offline"


@dataclass(frozen=True)
class Expected:
    layout: str                         # what is looked for, relative to the data folder
    release: dict                       # split -> examples in the LRA release (None: no source found)
    release_source: str
    original: dict = field(default_factory=dict)    # split -> examples of the original dataset
    original_source: str = ""
    get: str = ""                       # what to do when it is absent


DOWNLOAD = "download lra_release.gz (google-research/long-range-arena README) and unpack it (tar xzf) into"
EXPECTED = {
    "listops": Expected("listops-1000/basic_{train,val,test}.tsv",
                        {"train": 96_000, "val": 2_000, "test": 2_000}, LRA_LISTOPS,
                        {"train": None, "test": 10_000}, "original ListOps (Nangia & Bowman 2018): nyu-mll/spinn's "
                        "listops-release test_d20s.tsv, 10,000 lines, counted; its train split: " + NO_SOURCE,
                        f"{DOWNLOAD} DIR, or generate: python lra_data.py --task listops --generate 100000"),
    "text": Expected("aclImdb/{train,test}/{pos,neg}/*.txt or aclImdb*.tar.gz",
                     {"train": 25_000, "test": 25_000}, "LRA uses IMDB's splits as they are: " + LRA_APPENDIX,
                     {"train": 25_000, "test": 25_000}, IMDB,
                     "download aclImdb_v1.tar.gz (Stanford's Large Movie Review Dataset page) into DIR"),
    "retrieval": Expected("tsv_data/new_aan_pairs.{train,eval,test}.tsv",
                          {"train": 147_086, "val": 18_090, "test": 17_437}, LRA_APPENDIX, {}, "",
                          f"{DOWNLOAD} DIR"),
    "image": Expected("cifar-10-batches-py/ or cifar-10-python.tar.gz", {"train": 50_000, "test": 10_000},
                      CIFAR_PAGE + "; LRA trains on 45,000 and validates on 5,000 of them: " + LRA_APPENDIX,
                      {"train": 50_000, "test": 10_000}, CIFAR_PAGE,
                      "download cifar-10-python.tar.gz (Krizhevsky's CIFAR-10 page) into DIR"),
    "pathfinder": Expected("pathfinder32/curv_contour_length_14/metadata/*.npy + imgs/",
                           {"all": 200_000}, "160,000 / 20,000 / 20,000 examples: " + LRA_APPENDIX
                           + "; split 80/10/10 at random, seed 42, as state-spaces/s4 src/dataloaders/lra.py",
                           {}, "", f"{DOWNLOAD} DIR, or generate: python lra_data.py --task pathfinder "
                           "--generate 200000"),
    "pathx": Expected("pathfinder128/curv_contour_length_14/metadata/*.npy + imgs/", {"all": None},
                      NO_SOURCE + " (the release's image count for 128 px)", {}, "",
                      f"{DOWNLOAD} DIR, or generate: python lra_data.py --task pathx --generate 200000"),
    "pathx256": Expected("pathfinder256/curv_contour_length_14/metadata/*.npy + imgs/", {"all": None},
                         NO_SOURCE + " (the release's image count for 256 px)", {}, "",
                         f"{DOWNLOAD} DIR, or generate: python lra_data.py --task pathx256 --generate 200000"),
}
SIDE = {"pathfinder": 32, "pathx": 128, "pathx256": 256}


@dataclass
class Report:
    task: str
    data_dir: Path
    looked: list                        # the places looked at
    found: Path | None = None           # where the files are (None: not found)
    kind: str = ""                      # "release format", "generated by lra_data.py", "original ListOps", ...
    sizes: dict = field(default_factory=dict)       # split -> examples read
    problems: list = field(default_factory=list)    # one line each, saying what to do
    difficulty: str = "hard"            # the Pathfinder difficulty checked

    @property
    def verdict(self):
        if self.found is None and not self.problems:
            return "not found"
        if self.problems:
            return "problems"
        known = [EXPECTED[self.task].release.get(s) for s in self.sizes]
        return "complete" if all(known) else "read (no release size known to compare with)"


# ---------------------------------------------------------------- counting, without building a cache

def tsv_rows(path, chunk=1 << 20):
    """(non-empty lines, minus a ListOps header; whether the header of the LRA format was there) of a TSV, read in
    chunks of `chunk` bytes: a huge file without line breaks takes no more memory than one chunk."""
    n, first, content, line_no = 0, b"", False, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            for i, part in enumerate(block.split(b"\n")):
                if i:                                       # a line ended before this part
                    n, content, line_no = n + content, False, line_no + 1
                if line_no == 0 and len(first) < 64:
                    first += part[:64]
                content = content or bool(part.strip())
    n += content
    header = first.rstrip(b"\r") == b"Source\tTarget"
    return n - header, header


def imdb_counts(src):
    """{"train": reviews, "test": reviews} (pos + neg) of an aclImdb folder or archive."""
    if src.is_dir():
        names = [p.relative_to(src).as_posix() for p in lra_files.imdb_files(src)]
    else:
        with tarfile.open(src) as tar:
            names = tar.getnames()
    splits = [m[1] for name in names if (m := lra_files.IMDB_FILE.search(name)) and m[2] != "unsup"]
    return {"train": splits.count("train"), "test": splits.count("test")}


def cifar_counts(src, problems):
    """{"train": rows, "test": rows} of the CIFAR-10 batches (folder or archive); a batch missing is a problem."""
    if src.is_dir():
        missing = [n for part in lra_files.CIFAR_BATCHES.values() for n in part if not (src / n).is_file()]
        problems += [f"{src / n} is missing: download {lra_files.CIFAR_TAR} again" for n in missing]
    try:
        return {part: len(labels) for part, (_, labels) in lra_files.cifar_batches(src).items()}
    except (lra_files.DataError, OSError) as e:         # cifar_batches names a damaged pickle or archive
        problems.append(f"{src}: cannot read the batches ({e}): download {lra_files.CIFAR_TAR} again")
        return {}


def pathfinder_counts(folder, contour_length, problems, side=None):
    """{"all": images listed} of a difficulty folder; listed images that are absent, a first image that is not
    side × side, and metadata whose contour length is another difficulty's (a mix-up of folders) are problems."""
    listed, absent, lengths, first = 0, 0, set(), None
    for meta in lra_files.metadata_files(folder):
        raw = meta.read_bytes()
        if raw.startswith(b"\x93NUMPY"):
            continue                                       # the original generator's binary form: not counted
        for line in raw.decode("utf-8", errors="replace").splitlines():
            fields = line.split()
            if len(fields) >= 6:
                listed += 1
                first = first or folder / fields[0] / fields[1]      # the image whose size is checked
                absent += not os.path.exists(folder / fields[0] / fields[1])
                lengths.add(fields[5])
    if side and first is not None and first.is_file():
        from PIL import Image
        with Image.open(first) as image:                   # the header only
            if image.size != (side, side):
                problems.append(f"{first} is {image.size[0]}×{image.size[1]} pixels, not this task's "
                                f"{side}×{side}: images of another task (PathX is 128, Pathfinder 32) are in "
                                f"{folder}; unpack the release again")
    if absent:
        problems.append(f"{absent:,} of the {listed:,} images listed in {folder / 'metadata'} are missing: the "
                        f"archive was cut or unpacked only in part; unpack lra_release.gz again")
    if lengths and lengths != {str(contour_length)}:
        problems.append(f"{folder} is the contour-length-{contour_length} folder, but its metadata lists contour "
                        f"length {', '.join(sorted(lengths))}: folders of two difficulties were mixed up or "
                        f"renamed; unpack the release again")
    return {"all": listed}


# ---------------------------------------------------------------- one task

def misplaced(data_dir, names, depth=4):
    """Paths under data_dir (at most `depth` levels, skipping image and cache folders) whose name matches one of
    names (exact names or fnmatch patterns: IMDB's archive is read as aclImdb*.tar.gz)."""
    hits, data_dir = [], Path(data_dir)
    for root, dirs, filenames in os.walk(data_dir):
        level = len(Path(root).relative_to(data_dir).parts)
        dirs[:] = [d for d in dirs if d not in ("imgs", "cache") and level < depth]
        hits += [Path(root) / n for n in list(dirs) + filenames if any(fnmatch.fnmatch(n, m) for m in names)]
    return sorted(hits)


def advice(report):
    """What to do: download into the folder checked; generate into it if nothing was found there, else into an
    empty folder (generated files never replace release files), at the difficulty checked."""
    here = shlex.quote(str(report.data_dir))
    into = here if report.found is None else "<empty folder>"
    level = "" if report.task not in SIDE or report.difficulty == "hard" else f" --difficulty {report.difficulty}"
    get = EXPECTED[report.task].get.replace(" --generate", f" --data-dir {into}{level} --generate")
    return get.replace("DIR", here)


def compare(report, expected):
    """Short splits of release-format files against the release's sizes, as problems."""
    get = advice(report)
    for split, n in report.sizes.items():
        want = expected.release.get(split)
        what = "the folder holds" if split == "all" else f"the {split} split holds"
        if want and n < want:
            report.problems.append(f"{what} {n:,} of the release's {want:,} examples: a cut or partial download; {get}")
        elif want and n > want and not expected.original.get(split) == n:
            report.problems.append(f"{what} {n:,} examples, more than the release's {want:,}: lines or files "
                                   f"repeated, or another source mixed in; {get}")


def check_task(task, data_dir, difficulty="hard"):
    """Report for one task under data_dir: where it looked, what it found, the sizes and the problems."""
    data_dir, exp = Path(data_dir), EXPECTED[task]
    rel = {"listops": "listops-1000", "retrieval": "tsv_data"}.get(task)
    if task in SIDE:
        rel = f"pathfinder{SIDE[task]}/{DIFFICULTIES[difficulty].folder}"
    looked = ([data_dir / root / rel for root in lra_files.RELEASE_ROOTS] if rel else
              [data_dir / "aclImdb", data_dir / "aclImdb*.tar.gz"] if task == "text" else
              [data_dir / "cifar-10-batches-py", data_dir / lra_files.CIFAR_TAR])
    report = Report(task, data_dir, looked, difficulty=difficulty)
    try:
        where = (find_imdb(data_dir) if task == "text" else release_path(data_dir, rel) if rel else
                 next((p for p in looked if p.exists()), None))
    except lra_files.DataError as e:                       # there twice, or no IMDB
        if task != "text":
            report.problems.append(str(e))
            return report
        where = None
    if where is None or not where.exists():
        names = {"listops": {"listops-1000", "basic_train.tsv"}, "retrieval": {"tsv_data", "new_aan_pairs.train.tsv"},
                 "text": {"aclImdb", "aclImdb*.tar.gz"}, "image": {"cifar-10-batches-py", lra_files.CIFAR_TAR}}
        elsewhere = misplaced(data_dir, names.get(task, {f"pathfinder{SIDE.get(task)}"}))
        if task in SIDE and f"pathfinder{SIDE[task]}" in (data_dir.name, data_dir.parent.name):
            elsewhere = [data_dir]
        if task in SIDE and (others := [d for d in DIFFICULTIES.values() if d.folder != where.name
                                        and (where.parent / d.folder / "metadata").is_dir()]):
            report.problems.append(f"no {where.name} (the {difficulty} split), only "
                                   f"{', '.join(d.folder for d in others)} in {where.parent}: the paper's task is "
                                   f"{DIFFICULTIES['hard'].folder}; unpack it from lra_release.gz")
        elif elsewhere:
            read_in = f"{data_dir} or {data_dir}/lra_release/" if rel else f"{data_dir}"    # release tasks
            holds = (f"{elsewhere[0].parent}" if task == "text" else       # IMDB's archive: any aclImdb*.tar.gz
                     f"the folder that holds {exp.layout.split('/')[0]}")
            report.problems.append(f"found {elsewhere[0]}, not where it is read ({exp.layout} under {read_in}): "
                                   f"move it there, or point --data-dir at {holds}")
        return report
    report.found = where
    mark = read_mark(where)                                 # None: not generated by lra_data.py
    if task in ("listops", "retrieval"):
        names = ([f"basic_{s}.tsv" for s in ("train", "val", "test")] if task == "listops" else
                 [f"new_aan_pairs.{s}.tsv" for s in ("train", "eval", "test")])
        for split, name in zip(("train", "val", "test"), names):
            if not (where / name).is_file():
                report.problems.append(f"{where / name} is missing: {advice(report)}")
                continue
            report.sizes[split], header = tsv_rows(where / name)
            if task == "listops" and not header and mark is None:
                report.kind = "original ListOps format (label<TAB>expression, read too)"
    elif task == "text":
        report.sizes = imdb_counts(where)
        report.problems += [f"{where}: no {s} reviews (train/test/pos,neg/*.txt)" for s, n in report.sizes.items()
                            if not n]
    elif task == "image":
        report.sizes = cifar_counts(where, report.problems)
    else:
        report.sizes = pathfinder_counts(where, DIFFICULTIES[difficulty].contour_length, report.problems, SIDE[task])
    if mark is not None:
        report.kind = "generated by lra_data.py, not the release"
        asked = mark.get("n") or sum(mark.get(k, 0) for k in ("n_train", "n_val", "n_test"))
        if asked and sum(report.sizes.values()) < asked:
            report.problems.append(f"the generator was asked for {asked:,} examples and {where} holds "
                                   f"{sum(report.sizes.values()):,} (stopped half way): run the same "
                                   f"lra_data.py --generate {asked} command again to complete it")
    else:
        report.kind = report.kind or "release format"
        compare(report, exp)
    return report


def shortfall_note(task, sizes, folder, difficulty="hard"):
    """The data note of a run reading release-format files with fewer examples than the release has (e.g. a cut
    download), or [] (generated data, a complete split, or no source for the size)."""
    if (Path(folder) / GENERATED_MARK).exists() or (task in SIDE and difficulty != "hard"):
        return []                               # generated; the sizes known are the hard split's
    exp = EXPECTED[task].release
    short = [f"{split} {n:,} of {exp[split]:,}" for split, n in sizes.items()
             if exp.get(split) and n is not None and n < exp[split]]
    if not short:
        return []
    return [f"{folder} holds fewer examples than the LRA release ({'; '.join(short)}): a cut or partial download? "
            f"python lra_data.py --check --data-dir <data folder> says what is missing"]


# ---------------------------------------------------------------- the printout

def report_lines(report):
    exp = EXPECTED[report.task]
    lines = [f"{report.task}: {report.verdict}" + (f" ({report.kind})" if report.kind else ""),
             f"  layout: {exp.layout}; looked in {', '.join(str(p) for p in report.looked)}"]
    if report.found is not None:
        lines.append(f"  found:  {report.found}")
        splits = list(dict.fromkeys([*report.sizes, *exp.release, *exp.original]))
        fmt = lambda n: "-" if n is None else f"{n:,}"       # noqa: E731
        lines.append(f"  {'split':6s} {'read':>9s} {'LRA release':>12s} {'original':>10s}")
        lines += [f"  {s:6s} {fmt(report.sizes.get(s)):>9s} {fmt(exp.release.get(s)):>12s} "
                  f"{fmt(exp.original.get(s)):>10s}" for s in splits]
        lines.append(f"  release sizes: {exp.release_source}")
        if exp.original_source:
            lines.append(f"  original sizes: {exp.original_source}")
    lines += [f"  problem: {p}" for p in report.problems]
    if report.found is None and not report.problems:
        lines.append(f"  to get it: {advice(report)}")
    return lines


def main(data_dir, difficulty="hard", tasks=None):
    """Print the report of each of `tasks` (default: every task); 0 when every task found is complete, 2 when one has
    a problem or none is found."""
    reports = []
    for task in tasks or EXPECTED:
        try:
            reports.append(check_task(task, data_dir, difficulty))
        except OSError as e:                                # unreadable: named, the other tasks still checked
            reports.append(Report(task, Path(data_dir), [], problems=[f"cannot read {e.filename or data_dir} "
                                  f"({e.strerror or e}): make it readable (chmod u+r), then check again"]))
    for report in reports:
        print("\n".join(report_lines(report)))
    present = [r for r in reports if r.verdict != "not found"]
    bad = [r.task for r in present if r.problems]
    if not present:
        print(f"found no LRA task's files under {data_dir}: see 'to get it' above (docs/data.md)")
        return 2
    print(f"checked {len(present)} task(s) found under {data_dir}: "
          + (f"problems in {', '.join(bad)}" if bad else "all complete"))
    return 2 if bad else 0
