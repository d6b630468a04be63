#!/usr/bin/env bash
# results/objectives.sh: which self pre-training objective? Masked denoising (the paper's), span masking (SpanBERT,
# Joshi et al. 2020) and replaced-token detection (ELECTRA, Clark et al. 2020, with DeBERTaV3's GDES) against training
# from scratch, for the Transformer, S4 and DLR on Text (real IMDB), in the CPU-scale study's setting, 3 seeds each,
# all at one commit; plus a compute-tied slice like the paper's Table 8: S4 and the Transformer with one budget of
# 1,250 steps split 0 % / 40 % / 60 % between SPT and fine-tuning (masked and rtd; 0 % is the TFS run).
#     SHARED=../shared/data OUT=results/objectives JOBS=2 bash results/objectives.sh     # about 3.5 CPU-hours
#     python results/summarize.py                                                        # summary.md and the plots
# Every run folder keeps config.json, log.jsonl, log.txt and results.json (+ kernels.json for S4/DLR); checkpoints
# are deleted at the end (results/kernels.py --clean) so the folders are small enough to commit.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared/data}; OUT=${OUT:-results/objectives}; JOBS=${JOBS:-2}; CACHE=${CACHE:-/tmp/lra_cache}
mkdir -p "$OUT" "$CACHE"

# The study's setting (results/study.sh): width 64, 2 layers (N = 64), batch 16, AdamW lr 2e-3 (SSM parameters at the
# model's lr without decay), 20 warm-up steps then constant, 4,000 training reviews cut to 511 bytes + EOS, 500 val
# and 500 test reviews, val every 250 steps; 1,250 fine-tuning steps, 750 SPT steps before them (mask ratio 0.15).
# rtd: a 1-layer generator of width 16 (train.py's default, D/4), λ = 50, GDES embedding sharing.
COMMON="--preset tiny --d-model 64 --n-layers 2 --batch-size 16 --max-eval 500 --device cpu"
COMMON="$COMMON --out $OUT --cache-dir $CACHE"
TEXT="--task text --data-dir $SHARED/text --max-len 512 --max-train 4000"

commands() {
    for seed in 0 1 2; do
        for model in transformer s4 dlr; do
            echo "python train.py --model $model --seed $seed $COMMON $TEXT --epochs 5"
            for objective in masked span rtd; do
                echo "python train.py --model $model --spt --objective $objective --seed $seed $COMMON $TEXT" \
                    "--epochs 5 --pretrain-epochs 3"
            done
        done
    done
    for seed in 0 1 2; do          # compute-tied: 500 SPT + 750 fine-tuning steps, and 750 + 500 (250 steps an epoch)
        for model in transformer s4; do
            for objective in masked rtd; do
                echo "python train.py --model $model --spt --objective $objective --seed $seed $COMMON $TEXT" \
                    "--epochs 3 --pretrain-epochs 2"
                echo "python train.py --model $model --spt --objective $objective --seed $seed $COMMON $TEXT" \
                    "--epochs 2 --pretrain-epochs 3"
            done
        done
    done
}

export OMP_NUM_THREADS=1             # one core per process: two small processes beat one with two threads here
# each run's own log is log.txt in its folder; the console output (progress bars) is kept only when the run fails
commands | xargs -P "$JOBS" -I{} \
    sh -c 'out=$(mktemp); {} > "$out" 2>&1 || { echo "failed: {}"; tail -n 3 "$out"; }; rm -f "$out"'
python results/kernels.py "$OUT" --task text --clean      # kernel profiles of the S4/DLR runs; drop checkpoints
