"""The repo's layout as facts: the top level holds the concept files a class reads and train.py, and nothing else of
code; the layers (a concept file imports only the standard library, torch, numpy, tqdm, other concept files and
tools/checked.py; the machinery may import concepts, never the reverse; nothing imports train.py but tests); the
import graph has no cycle; the README's reading order never uses a file before it is read."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FILES = sorted([*REPO.glob("*.py"), *REPO.glob("lra/*.py"), *REPO.glob("lab/*.py"), *REPO.glob("tools/*.py"),
                *REPO.glob("results/*.py")])
MODULES = {str(f.relative_to(REPO).with_suffix("")).replace("/", "."): f for f in FILES}
TOP = {name for name in MODULES if "." not in name}                 # the top-level .py files
CONCEPTS = TOP - {"train"}                                          # what a class reads, besides train.py
THE_CARD = {"transformer", "s4", "dlr", "ssm", "lra_data", "denoise", "train"}     # the design card's
OUTSIDE = {"torch", "numpy", "tqdm"}                               # and the standard library


def imports(path, own_name, in_main=True):
    """The repo modules that `path` (module own_name) imports anywhere: at module level and the lazy imports inside
    functions (which run only when called, and close a cycle all the same). in_main=False: not those inside a
    function named main (a concept file's command line may reach the machinery there)."""
    tree, found, skip = ast.parse(path.read_text()), set(), set()
    if not in_main:
        skip = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "main"
                for n in ast.walk(f)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in MODULES}
    return found - {own_name}


def outside_imports(path):
    """The top-level package names `path` imports that are neither the repo's nor the standard library's."""
    import sys
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {n.split(".")[0] for n in MODULES}


# what each module imports when imported (a main()'s imports run in a command's own process, all imports done)
GRAPH = {name: imports(path, name, in_main=False) for name, path in MODULES.items()}


def test_the_import_graph_sees_lazy_imports_inside_functions_and_can_leave_out_main(tmp_path):
    lazy = tmp_path / "lazy.py"
    lazy.write_text("import os\n\n\ndef main():\n    import models\n    if True:\n        from lra import files\n")
    assert imports(lazy, "lazy") == {"models", "lra.files"}, "a lazy import inside a function was not seen"
    assert imports(lazy, "lazy", in_main=False) == set()


def test_the_import_graph_has_no_cycle():
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name not in done:
            path.append(name)
            for dep in sorted(GRAPH[name]):
                visit(dep)
            path.pop()
            done.add(name)
    for name in sorted(GRAPH):
        visit(name)


def reading_order():
    """The files README.md's "Reading the code" list names, in its order (`name.py` -> name)."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Reading the code")[1].split("\n## ")[0]
    items = "\n".join(re.findall(r"^\d+\. .*(?:\n   .*)*", section, flags=re.M))     # the numbered list
    return list(dict.fromkeys(re.findall(r"`(\w+)\.py`", items)))


def test_the_top_level_is_the_design_cards_concept_files_and_train_py():
    """At most 9 .py files at the top, each a step of the README's reading order; a fork's own model file (a MODELS
    entry's module, docs/fork.md) may stand beside them without being one."""
    import models
    forks = {entry.Config.__module__ for entry in models.MODELS.values()} - set(reading_order())
    assert THE_CARD <= TOP, f"missing at the top: {sorted(THE_CARD - TOP)}"
    ours = TOP - forks
    assert len(ours) <= 9, f"{len(ours)} .py files at the top (at most 9): {sorted(ours)}"
    assert ours <= set(reading_order()), f"at the top but not read: {sorted(ours - set(reading_order()))}"


def test_a_concept_file_imports_only_concept_files_and_tools_checked_outside_its_main():
    allowed = CONCEPTS | {"tools.checked"}
    for name in sorted(CONCEPTS):
        deps = imports(MODULES[name], name, in_main=False)
        own = {d for d in deps if d.startswith("lra.")} if name == "lra_data" else set()   # its formats, caches
        assert deps - own <= allowed, f"{name}.py imports {sorted(deps - own - allowed)} outside its main()"
        assert outside_imports(MODULES[name]) <= OUTSIDE, (name, outside_imports(MODULES[name]))


def test_the_official_formats_import_only_their_own_folder_and_tools_checked():
    for name in (n for n in MODULES if n.startswith("lra.")):
        assert GRAPH[name] <= {n for n in MODULES if n.startswith("lra.")} | {"tools.checked"}, (name, GRAPH[name])
        assert outside_imports(MODULES[name]) <= OUTSIDE | {"PIL"}, (name, outside_imports(MODULES[name]))
    assert GRAPH["tools.checked"] == set(), "tools/checked.py imports nothing of the repo: any file may import it"


def test_nothing_imports_train_py_and_the_machinery_is_never_imported_by_a_concept():
    users = sorted(name for name, deps in GRAPH.items() if "train" in deps)
    assert users == [], f"only tests import train.py: {users}"
    machinery = {n for n in MODULES if n.startswith(("lab.", "tools.", "results."))} - {"tools.checked"}
    for name in sorted(CONCEPTS | {n for n in MODULES if n.startswith("lra.")}):
        deps = imports(MODULES[name], name, in_main=False) & machinery
        assert not deps, f"{name} imports the machinery {sorted(deps)} outside its main()"


def test_each_concept_file_imports_only_what_its_concept_needs():
    assert GRAPH["ssm"] == set() and GRAPH["denoise"] == set()
    assert GRAPH["transformer"] == {"ssm"}, "the Transformer shares only ssm.py's config and shape rules"
    assert GRAPH["s4"] == {"ssm"} and GRAPH["dlr"] == {"ssm"}, "a kernel needs only the shared SSM block"
    assert GRAPH["models"] - {"tools.checked"} <= CONCEPTS, GRAPH["models"]     # the models (a fork's too), the data
    for generator in ("lra.listops", "lra.pathfinder"):                 # generators never import each other
        assert GRAPH[generator] == {"lra.files"}, (generator, GRAPH[generator])
    models = {"transformer", "s4", "dlr"}
    users = {name for name, deps in GRAPH.items() if deps & models}
    assert users <= {"models", "tools.speed"}, f"models are built through models.MODELS only: {users}"


def test_the_readme_reading_order_never_uses_a_file_before_it_is_read():
    order = reading_order()
    assert THE_CARD <= set(order), f"the reading order leaves out {sorted(THE_CARD - set(order))}"
    for i, name in enumerate(order):           # a file the list leaves out (a fork's lru.py) is no reading step
        needed = {dep for dep in GRAPH[name] if dep in order}
        unread = needed - set(order[:i])
        assert not unread, f"README: {name}.py (item {i + 1}) imports {sorted(unread)}, read later or not at all"


def test_the_readme_reading_order_gives_each_files_size_to_within_half():
    """Each step says "(≈ 250 lines)" or "(≈ 250)": a reader's sense of size, which stays right when a fork pastes a
    recipe or two into a file (docs/fork.md), and goes wrong when a file doubles or halves."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Reading the code")[1].split("\n## ")[0]
    sizes = re.findall(r"`(\w+\.py)` \(≈ (\d+)", section)
    assert {name for name, _ in sizes} >= {f"{n}.py" for n in THE_CARD}, sizes
    for name, count in sizes:
        lines = len((REPO / name).read_text().splitlines())
        assert int(count) / 1.5 - 20 <= lines <= 1.5 * int(count) + 20, (
            f"README's reading order: {name} has {lines} lines, it says about {count}")


def test_the_readme_is_at_most_200_lines_and_no_code_readme_or_doc_names_an_issue_number():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, len(readme.splitlines())
    for path in [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("results/**/README.md"), *FILES,
                 *REPO.glob("tests/*.py")]:
        found = re.findall(r"\b(?:issue|issues) #?\d+|\[[a-z-]+-\d\]", path.read_text())
        assert not found, f"{path.relative_to(REPO)} names an issue: {found}"


FOLDERS = ("lab/", "tools/", "lra/", "results/", "docs/", "tests/")       # the repo's own folders


def cited(text):
    """What a document cites of the repo: paths in its folders (`lab/steps.py`, `results/why_spt/`), bare .py files
    (`train.py`), and names (`models.MODELS`, `lab/presets.PAPER`) -> (paths, bare files, (module, name) pairs).
    Placeholders (`<run folder>`, `...`) and a run folder's own files (`config.json`) are not the repo's."""
    paths, files, names = set(), set(), set()
    for token in re.findall(r"`([^`\s]+)`", text):
        if "<" in token or "..." in token or token.startswith(("/", "./")):
            continue
        if m := re.fullmatch(r"((?:lab|tools|lra)/\w+|[a-z_]+)\.([A-Za-z_]\w*)", token):
            if m[2] not in ("py", "md", "json", "png", "txt", "sh", "sbatch", "jsonl", "pt", "gz"):
                names.add((m[1].replace("/", "."), m[2]))
                continue
        if token.startswith(FOLDERS):
            paths.add(token.rstrip("/"))
        elif re.fullmatch(r"\w+\.py", token):
            files.add(token)
    return paths, files, names


def test_every_file_and_name_the_readme_and_docs_cite_exists():
    import importlib
    missing = []
    for doc in [REPO / "README.md", *REPO.glob("docs/*.md")]:
        text = doc.read_text().split("## Where things moved")[0]        # the table of moves names what has gone
        paths, files, names = cited(text)
        for p in sorted(paths):
            path, _, test = p.partition("::")                           # tests/test_x.py::test_name
            if not list(REPO.glob(path)) or test and f"def {test}(" not in (REPO / path).read_text():
                missing.append(f"{doc.name}: {p}")
        missing += [f"{doc.name}: {f}" for f in sorted(files) if not list(REPO.glob(f"**/{f}"))]
        for module, name in sorted(names):
            if module in MODULES and not hasattr(importlib.import_module(module), name):
                missing.append(f"{doc.name}: {module}.{name}")
    assert not missing, f"cited but not there: {missing}"


def test_no_file_of_the_code_is_over_500_lines():
    files = [*FILES, *REPO.glob("results/*.py")]                    # the tests may be longer
    long = {str(f.relative_to(REPO)): n for f in files if (n := len(f.read_text().splitlines())) > 500}
    assert not long, f"over 500 lines: {long}"


def test_the_readme_quick_start_shows_the_last_lines_of_the_run_it_cites():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start")[1].split("\n## ")[0]
    folder = re.search(r"`(results/runs/pathfinder-[^`]+)/`", section)[1]
    block = re.findall(r"```\w*\n(.*?)```", section, flags=re.S)[1].splitlines()   # the run's last lines
    log = (REPO / folder / "log.txt").read_text().splitlines()
    assert block[:3] == log[-4:-1], f"README's lines differ from {folder}/log.txt:\n{block[:3]}\n{log[-4:-1]}"
    assert block[3].split(":")[0] == log[-1].split(":")[0], (block[3], log[-1])    # 'done in 0.6 min (...)'
    assert block[4].startswith("note: no curves.png: matplotlib is not installed (pip install matplotlib")


def readme_train_commands():
    """Every `python train.py ...` line of README.md's code blocks, continuation lines joined -> [(argv, comment)]."""
    readme = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            code, _, comment = line.strip().partition("#")
            if code.startswith("python train.py"):
                commands.append((code.split()[2:], comment.strip()))
    return commands


def test_every_train_py_command_of_the_readme_parses_and_each_cited_text_run_is_the_command_given():
    import json
    import train
    commands = readme_train_commands()
    assert len(commands) >= 3, commands                                     # the quick start and the Text pair
    for argv, _ in commands:
        train.parse_flags(argv)                                             # a bad flag exits here, naming it
    paths = {"--data-dir", "--cache-dir", "--out"}
    def flags(argv):                                                        # the run itself: no paths, no device
        out, skip = [], False
        for i, a in enumerate(argv):
            if skip:
                skip = False
            elif a in paths or (a == "--device" and argv[i + 1] == "cpu"):
                skip = True
            else:
                out.append(a)
        return out
    cited = [(argv, comment) for argv, comment in commands if re.match(r"(TFS|SPT): test \d\.\d+$", comment)]
    assert len(cited) == 2, cited
    for argv, comment in cited:
        kind, acc = comment.split(": test ")
        runs = [f for f in sorted(REPO.glob(f"results/control/text-dlr-{kind.lower()}-s0-*"))
                if flags(json.loads((f / "config.json").read_text())["command"][1:]) == flags(argv)]
        assert runs, f"no results/control/text-dlr-{kind.lower()}-s0-* run has the README's flags {flags(argv)}"
        got = json.loads((runs[0] / "results.json").read_text())["test_acc"]
        assert f"{got:.3f}" == acc, f"README says {kind} test {acc}, {runs[0].name} has {got}"
