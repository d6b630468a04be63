#!/usr/bin/env bash
# results/study.sh: the CPU-scale study (README "CPU-scale study"): TFS vs masked SPT for the Transformer, S4 and DLR
# on Text (real IMDB) and short generated ListOps, 3 seeds per cell; ListOps SPT variants; a longer Pathfinder pair;
# a training-set-size sweep on Text for S4 and the Transformer. About 4 CPU-hours (results/study holds 0.6 more from
# an earlier Pathfinder slice); runs JOBS training processes at a time, one core each.
#     SHARED=../shared/data DATA=/tmp/study_data OUT=results/study JOBS=2 bash results/study.sh
#     python results/summarize.py                    # results/summary.md and the plots, from results/study
# Every run folder keeps config.json, log.jsonl, log.txt and results.json (+ kernels.json for S4/DLR on Text); the
# checkpoints are deleted at the end (results/kernels.py --clean) so the folders are small enough to commit.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared/data}; DATA=${DATA:-/tmp/study_data}; OUT=${OUT:-results/study}; JOBS=${JOBS:-2}
mkdir -p "$DATA" "$OUT"

# ListOps: LRA's generator with shorter expressions (20 < length < 100, like the original ListOps, median 46 tokens)
# instead of LRA's 500..2000: at LRA length a CPU-sized model stays at the majority class for the whole budget.
if [ ! -f "$DATA/listops/listops-1000/basic_test.tsv" ]; then
    python -c "from lra.listops import generate_listops; generate_listops('$DATA/listops', 20000, 1000, 1000, seed=0,
               min_length=20, max_length=100)"
fi

# One setting for every model: width 64, 2 layers (N = 64), batch 16, AdamW lr 2e-3 (SSM parameters at the model's own
# lr, no decay: S4 1e-3, DLR 1e-4), warm-up 20 steps, then constant; 4,000
# training examples; fine-tuning 1,250 steps, SPT 750 steps before it; val (500 examples) every 250 steps.
COMMON="--preset tiny --d-model 64 --n-layers 2 --batch-size 16 --max-eval 500 --device cpu --out $OUT"
TEXT="--task text --data-dir $SHARED/text --max-len 512"        # IMDB reviews cut to 511 bytes + EOS
LISTOPS="--task listops --data-dir $DATA/listops"
# --max-train N --epochs E --pretrain-epochs P --eval-every K --max-steps S: 1,250 fine-tuning / ~750 SPT steps
FULL="--max-train 4000 --epochs 5 --pretrain-epochs 3"                          # 250 steps an epoch
F20="--max-train 800 --epochs 25 --pretrain-epochs 15 --eval-every 5"           # 0.2 of it: 50 steps an epoch
F05="--max-train 200 --epochs 97 --pretrain-epochs 58 --eval-every 19 --max-steps 1250"  # 0.05: 13 steps an epoch

# Pathfinder: the common setting stays at chance (results/explore, and the first slice in results/study), so one
# longer pair instead of a grid: DLR (the fastest here), 4 layers, 20,000 generated *easy* images (contour length 6),
# SSM lr 1e-3, 3,750 fine-tuning steps (3 epochs), SPT 1,250 steps (1 epoch); seed 0 only.
PATHFINDER="--task pathfinder --difficulty easy --data-dir $DATA/pathfinder --generate 0 --max-train 0 --n-layers 4"
PATHFINDER="$PATHFINDER --ssm-lr 1e-3 --epochs 3 --pretrain-epochs 1"
if [ ! -d "$DATA/pathfinder/pathfinder32/curv_baseline" ]; then
    mkdir -p "$DATA/pathfinder"
    python lra_data.py --task pathfinder --difficulty easy --data-dir "$DATA/pathfinder" --generate 25000 \
        --workers "$JOBS"
fi

commands() {
    for seed in 0 1 2; do
        for model in transformer s4 dlr; do
            for spt in "" "--spt"; do
                echo "python train.py --model $model $spt --seed $seed $COMMON $TEXT $FULL"
                echo "python train.py --model $model $spt --seed $seed $COMMON $LISTOPS $FULL"
            done
        done
    done
    # ListOps: SPT did not beat TFS above; try 5x longer SPT, and mask ratio 0.3 (the cheap models)
    for seed in 0 1 2; do
        for model in transformer dlr; do
            echo "python train.py --model $model --spt --seed $seed $COMMON $LISTOPS --max-train 4000 --epochs 5" \
                "--pretrain-epochs 15"
            echo "python train.py --model $model --spt --seed $seed $COMMON $LISTOPS $FULL --mask-ratio 0.3"
        done
    done
    echo "python train.py --model dlr --seed 0 $COMMON $PATHFINDER"
    echo "python train.py --model dlr --spt --seed 0 $COMMON $PATHFINDER"
    for seed in 0 1 2; do
        for model in transformer s4; do
            for spt in "" "--spt"; do
                echo "python train.py --model $model $spt --seed $seed $COMMON $TEXT $F20"
                echo "python train.py --model $model $spt --seed $seed $COMMON $TEXT $F05"
            done
        done
    done
}

export OMP_NUM_THREADS=1             # one core per process: two small processes beat one with two threads here
# each run's own log is log.txt in its folder; the console output (progress bars) is kept only when the run fails
commands | xargs -P "$JOBS" -I{} \
    sh -c 'out=$(mktemp); {} > "$out" 2>&1 || { echo "failed: {}"; tail -n 3 "$out"; }; rm -f "$out"'
python results/kernels.py "$OUT" --task text --clean      # kernel profiles of the S4/DLR Text runs; drop checkpoints
