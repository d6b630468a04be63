"""The path a student reads, measured: the quick start (`python train.py --model dlr --task pathfinder --spt --preset
tiny`), traced with sys.setprofile and threading.setprofile from before `import train` to its first
`loss.backward()`, counts the repo files entered, the top-level ones among them, and the distinct cross-file call
edges (caller function -> callee function), of which those whose caller is a top-level file. Tests and files outside
the repo do not count. Import-time work counts: a function a module body calls while train.py's imports run is on the
path; the definitions themselves (a module's or a class's body, and the comprehensions such a body runs) are not.
The bounds are the design card's: a short path, behind one run object (lab/run.Run) and lra_data's load_splits.
"""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICK_START = ["--model", "dlr", "--task", "pathfinder", "--spt", "--preset", "tiny"]
BOUNDS = {"top_files": 6, "files": 16, "edges": 60, "top_caller_edges": 40}

TRACER = r'''
import collections, inspect, json, os, sys, threading
repo, out, argv = os.path.abspath(sys.argv[1]), sys.argv[2], sys.argv[3:]
sys.path.insert(0, repo)
import torch
files, edges, in_main = collections.Counter(), set(), [False]

def rel(path):
    path = os.path.abspath(path)
    if (not path.endswith(".py") or not path.startswith(repo + os.sep) or os.sep + "tests" + os.sep in path
            or not os.path.isfile(path)):
        return None
    return os.path.relpath(path, repo)

def definition(frame):                  # a module's or class's body (not an optimised function)
    return not frame.f_code.co_flags & inspect.CO_OPTIMIZED

def repo_caller(frame):
    caller = frame.f_back
    while caller is not None and rel(caller.f_code.co_filename) is None:
        caller = caller.f_back
    return caller

def profile(frame, event, arg):
    if event != "call" or (here := rel(frame.f_code.co_filename)) is None:
        return
    caller = repo_caller(frame)
    if not in_main[0] and (definition(frame) or (frame.f_code.co_name.startswith("<") and caller is not None
                                                 and definition(caller))):
        return                          # the imports' definitions: no one reads them as a path
    files[here] += 1
    if caller is not None and rel(caller.f_code.co_filename) != here:
        edges.add((rel(caller.f_code.co_filename), caller.f_code.co_name, here, frame.f_code.co_name))

class FirstBackward(Exception):
    pass

def backward(self, *a, **k):
    sys.setprofile(None)
    threading.setprofile(None)
    raise FirstBackward()

torch.Tensor.backward = backward
sys.argv = ["train.py", *argv]
threading.setprofile(profile)
sys.setprofile(profile)
import train
in_main[0] = True
try:
    train.main(argv)
except FirstBackward:
    pass
sys.setprofile(None)
threading.setprofile(None)
top = sorted(f for f in files if os.sep not in f)
json.dump({"files": sorted(files), "top": top, "edges": sorted(edges),
           "top_edges": sorted(e for e in edges if os.sep not in e[0])}, open(out, "w"), indent=1)
'''


def test_the_quick_start_from_import_to_its_first_backward_crosses_at_most_6_top_level_files_16_files_and_60_edges(
        tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    flags = [*QUICK_START, "--data-dir", str(data), "--out", str(tmp_path / "runs")]
    made = subprocess.run([sys.executable, "lra_data.py", "--task", "pathfinder", "--data-dir", str(data),
                           "--generate", "2500"], cwd=REPO, capture_output=True, text=True)   # the preset's size
    assert made.returncode == 0, made.stderr[-2000:]
    (tmp_path / "tracer.py").write_text(TRACER)
    traced = subprocess.run([sys.executable, str(tmp_path / "tracer.py"), str(REPO), str(tmp_path / "trace.json"),
                             *flags], cwd=tmp_path, capture_output=True, text=True)
    assert traced.returncode == 0, traced.stderr[-3000:]
    import json
    trace = json.loads((tmp_path / "trace.json").read_text())
    counts = {"top_files": len(trace["top"]), "files": len(trace["files"]), "edges": len(trace["edges"]),
              "top_caller_edges": len(trace["top_edges"])}
    print("TRACE", counts)
    print("files:", " ".join(trace["files"]))
    for caller_file, caller, callee_file, callee in trace["edges"]:
        print(f"  {caller_file}:{caller} -> {callee_file}:{callee}")
    assert "train.py" in trace["top"] and "lab/run.py" in trace["files"], "the trace did not reach main and the run"
    over = {k: (counts[k], bound) for k, bound in BOUNDS.items() if counts[k] > bound}
    assert not over, f"the quick start's path grew past its bounds (count, bound): {over}; see the printed edges"
