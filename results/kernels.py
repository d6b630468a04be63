"""kernels.py: the data of the paper's Figure 4 (Amos et al. 2024, §5) from train.py run folders. For each layer of an
S4 or DLR run: max over channels (and over both directions of a bidirectional layer) of |K[l]| for l = 0..L-1, at
initialisation (rebuilt from the run's seed, exactly as train.py built it), after SPT (spt.pt) and after fine-tuning
(best.pt). The profiles go to <run>/kernels.json, so results/summarize.py can redraw the picture after the checkpoints
are gone. Only finished runs (with results.json) are read.
    python results/kernels.py results/study --task text           # S4/DLR Text runs that still have best.pt
    python results/kernels.py results/study --task text --clean   # ... then delete the *.pt of every finished run
L: --length if given, else the run's --max-len, else the task's LRA length (TASKS[task].max_len); give --length for
data shorter than LRA's (e.g. generated short ListOps), or the profile runs past the lags the model ever used.
In the backward direction index l is lag l + 1 (ssm.fft_conv shifts that branch by one), as in S4.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lra_data  # noqa: E402
import models  # noqa: E402
from tools import checked  # noqa: E402  (checked flags and reads; writes over our own files only)

CHECKPOINTS = ("spt.pt", "best.pt", "last.pt")     # what train.py writes into a run folder: all --clean deletes


@torch.no_grad()
def kernel_profiles(backbone, L):
    """backbone: S4 or DLR (layers[i].kernel(L) -> (H, L) or (2, H, L)). -> [layers][L] floats: max over channels
    (and directions) of |K[l]|."""
    return [layer.kernel(L).abs().reshape(-1, L).amax(0).tolist() for layer in backbone.layers]    # per layer (L,)


def profiles_of_run(folder, config, L=None):
    """{"L": L, "model", "task", "seed", "spt", "stages": {"init" | "spt" | "finetune": [layers][L]}} for one run
    folder with best.pt (and spt.pt after SPT); config: its config.json."""
    args, name = config["args"], config["model_name"]
    L = L or args.get("max_len") or lra_data.TASKS[config["task"]].max_len
    # as train.py: manual_seed(seed), then build_model (backbone first)
    torch.manual_seed(args["seed"])
    stages = {"init": kernel_profiles(models.build_model(config).backbone, L)}
    for stage, file in (("spt", "spt.pt"), ("finetune", "best.pt")):
        if (folder / file).is_file():
            model, _ = models.load_model(folder / file)
            stages[stage] = kernel_profiles(model.backbone, L)
    round4 = lambda xs: [float(f"{x:.4g}") for x in xs]                 # 4 significant digits: the picture's precision
    return {"L": L, "model": name, "task": config["task"], "seed": args["seed"], "spt": args["spt"],
            "stages": {k: [round4(p) for p in v] for k, v in stages.items()}}


def main(argv=None):
    p = argparse.ArgumentParser(description="Write kernels.json (Figure 4 data) into S4/DLR run folders.")
    p.add_argument("runs", help="folder whose subfolders are train.py run folders")
    p.add_argument("--task", choices=lra_data.TASKS, default=None, help="only runs of this task (default: all)")
    p.add_argument("--length", type=checked.at_least(1), default=None,
                   help="kernel length L (default: the run's longest input)")
    p.add_argument("--clean", action="store_true",
                   help="afterwards delete the checkpoints (*.pt) of every finished run")
    p.error = lambda message: (print(f"kernels.py: error: {checked.flag_message(message)}", file=sys.stderr),
                               sys.exit(2))
    args = p.parse_args(argv)
    runs = Path(args.runs)
    folders = sorted(f for f in runs.iterdir() if (f / "results.json").is_file()) if runs.is_dir() else []
    if not folders:
        p.error(f"no finished run folders (with results.json) in {args.runs}")
    for folder in folders:
        try:
            config = checked.read_json(folder / "config.json", "skipped: rerun the run", needs=checked.CONFIG_KEYS)
            if (config["model_name"] in ("s4", "dlr") and args.task in (None, config["task"])
                    and (folder / "best.pt").is_file()
                    and not config["args"].get("init_from")):      # an --init-from run did not start from its seed
                checked.write_owned(folder / "kernels.json",
                                    json.dumps(profiles_of_run(folder, config, args.length)) + "\n", "kernels.py")
                print(f"wrote {folder / 'kernels.json'}")
        except (checked.Damaged, checked.NotOwned) as e:             # one bad folder: a note, the others go on
            print(f"note: {e}", flush=True)
        except ValueError as e:                                     # a damaged checkpoint (runs.read_checkpoint)
            print(f"note: {folder}: {e}; skipped", flush=True)
    if args.clean:                                                  # train.py's checkpoints, nothing else
        for ck in sorted(folder / name for folder in folders for name in CHECKPOINTS):
            ck.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
