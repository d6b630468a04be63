"""tools/gpu_summary.py: what the GPU check (tools/gpu_check.py) leaves: each part's log as it comes (logged), and
summary.md: per part measured / failed / skipped, the deadline kept, then each part's numbers as tables.
Check: tests/test_gpu_check.py."""
import contextlib
import sys
import time
from pathlib import Path

from lab.memory import table


class Tee:
    """A stream that writes to `stream` and appends every line to `log_path` as it comes (tqdm's bars: the last
    state of each), so a part killed mid-way leaves its log on disk."""

    def __init__(self, stream, log_path):
        self.stream, self.file = stream, open(log_path, "a", buffering=1)

    def write(self, text):
        self.stream.write(text)
        self.file.write(text.replace("\r", "\n"))
        return len(text)

    def flush(self):
        self.stream.flush()
        self.file.flush()

    def isatty(self):
        return False


@contextlib.contextmanager
def logged(log_path):
    """stdout and stderr of the block, also into log_path."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Tee(out, log_path), Tee(err, log_path)
    try:
        yield
    finally:
        sys.stdout.file.close(), sys.stderr.file.close()
        sys.stdout, sys.stderr = out, err


def last_lines(log_path, n=40):
    """The last n non-empty lines of a part's log."""
    if not Path(log_path).is_file():
        return []
    return [line for line in Path(log_path).read_text(errors="replace").splitlines() if line.strip()][-n:]


def summary_lines(check):
    """summary.md: measured numbers only; the device, torch, commit and command first, each part's verdict, its
    numbers."""
    m, parts = check.machine, check.parts
    used = (time.time() - check.started) / 60
    lines = [f"# tools/bench.py --gpu-check: {m['cpu']}", "",
             f"device {m['cpu']} ({check.args.device}, {m['gpu_memory_mib']:.0f} MiB, {m['cores']} CPU cores) | "
             f"torch {m['torch']} (CUDA {m['cuda']}) | commit {m['commit']} | `{m['command']}` | scale "
             f"{check.args.check_scale}", "",
             f"deadline: {used:.1f} of {check.args.minutes:g} min from the process's start "
             f"({'kept' if time.time() <= check.deadline + check.margin_s else 'exceeded'}; the check stops "
             f"{check.margin_s} s before)", ""]
    for name in check.names:
        part = parts.get(name)
        if part is None:
            lines.append(f"- {name}: not reached")
        elif part["status"] == "ok":
            lines.append(f"- {name}: measured ({part.get('seconds', 0):.1f} s)")
        else:
            why = part.get("reason") or ((part.get("error") or "").strip().splitlines() or ["?"])[-1]
            lines.append(f"- {name}: {'skipped' if part['status'] == 'skipped' else 'failed'}: {why}")
    ok = {name: part for name, part in parts.items() if part["status"] == "ok"}
    if "tf32" in ok:
        lines += ["", "## (a) TF32 state per --precision (cuBLAS's query after / inside the kernel guard)", "",
                  *table(["precision", "cuBLAS TF32 after", "inside guard", "get_float32_matmul_precision"],
                         [[r["precision"], r["after"]["cublas_allow_tf32"], r["inside_guard"]["cublas_allow_tf32"],
                           r["after"]["float32_matmul_precision"]] for r in parts["tf32"]["rows"]])]
    if "kernels" in ok:
        lines += ["", "## (b) kernels against float64, worst channel (forward) and gradient, relative L2", "",
                  *table(["kernel", "L", "matmuls", "forward error", "gradient error"],
                         [[r["kernel"], r["L"], "guarded" if r["guarded"] else "TF32 allowed",
                           f"{r['forward_error']:.1e}", f"{r['grad_error']:.1e}"] for r in parts["kernels"]["rows"]])]
    if main := ok.get("main"):
        lines += ["", "## (c) the main command", "",
                  f"sync debug mode: {main['sync_debug_mode']}"
                  + ("" if main["syncs"] is None else f" ({main['syncs']} syncs in the whole run, evaluations and "
                     f"checkpoints included; where: {main['sync_sites'] or 'none'})")
                  + f"; precision {main['precision']}; SPT {main['spt_steps']} "
                  f"steps at {1e3 * main['spt_s_per_step']:.0f} ms/step (batch {main['pretrain_batch_size']}), "
                  f"fine-tuning {main['finetune_steps']} at {1e3 * main['finetune_s_per_step']:.0f} ms/step (batch "
                  f"{main['batch_size']}), evaluation included; peak {main['peak_mib']:.0f} MiB"
                  + ("" if main["reserved_mib"] is None else f", reserved {main['reserved_mib']:.0f} MiB")
                  + f"; other warnings: {main.get('other_warnings') or 'none'}"]
    if "largest" in ok:
        lines += ["", "## (d) the largest paper presets, one training step", "",
                  *table(["model", "task", "phase", "L", "micro-batch × accum", "est. GiB", "peak GiB", "reserved GiB",
                          "s"], [[r["model"], r["task"], r["phase"], r["L"], f"{r['micro_batch']} × {r['accum_steps']}",
                                  f"{r['est_gib']:.2f}", f"{r['peak_gib']:.2f}", f"{r['reserved_gib']:.2f}",
                                  f"{r['seconds']:.1f}"] for r in parts["largest"]["rows"]])]
    if att := ok.get("attention"):
        lines += ["", f"## (e) attention: forward + backward at L {att['L']} (batch {att['batch']}, {att['precision']}) "
                  f"with SDPA limited to {', '.join(att['backends'])}: {att['seconds']:.2f} s"]
    if "records" in (comp := parts.get("compile", {})):
        lines += ["", f"## (f) --compile ({comp['backend']}): fell back to eager: {'yes' if comp['fell_back'] else 'no'}",
                  "", *(f"- after {r['after']}: {r['graphs']} graphs, {r['frames_compiled']} frames compiled, "
                        f"{r['frames_eager']} eager, graph breaks {sum(r['graph_breaks'].values())}"
                        for r in comp["records"])]
    if g := ok.get("spt_batch"):
        lines += ["", f"## (g) SPT batch: {g['pretrain_batch_size']} (the preset's {g['preset']})"]
    return lines
