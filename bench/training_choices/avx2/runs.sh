#!/bin/bash
# Issue 26 on the AVX2-only CPU (fp32): objective and data variants of EAGLE-3 against the
# reference run of bench/families/avx2/p_eagle_dflash/runs.sh (same data, config and LR schedule), each paused at
# step 301 (the reference's 15 minutes), then evaluated on 100 held-out prompts (τ only). What was
# run, in order (the runs shared the machine with tests at times: compare steps, not minutes).
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
VLLM_PYTHON=${DRAFTSMITH_VLLM_PYTHON:-$HOME/.cache/draftsmith/vllm-venv/bin/python}
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=~/.cache/draftsmith/data
R=$RUNS/i26
DATA="--data $D/alpaca1000_train_sd_smollm2_fp32_greedy128.jsonl --hidden-states-cache $D/cache_sd1000_eagle3"
EV="--k 3 --prompts $ALPACA --split heldout --max-new-tokens 64 --dtype float32 \
    --no-baseline --no-reference-plain --threads 1"
CFG="python recipes/eagle.py --config recipes/configs/eagle3_smollm2.yaml $DATA --eval-every 50 --save-every 100"
# 1. LK loss (15 min, then resumed to step 301).
$CFG --loss lk_hybrid --max-minutes 15 --output-dir $R/eagle3_lkhybrid_15min
$CFG --loss lk_hybrid --max-minutes 30 --stop-after-steps 82 --output-dir $R/eagle3_lkhybrid_15min
# 2. EAGLE-3.1 (the shipped config now sets both; written out for the record).
$CFG --fc-norm --norm-output --max-minutes 40 --stop-after-steps 301 --output-dir $R/eagle31_301
# 3. Distinct data: the first 250 records, the reference's schedule (726 steps), paused at 301.
$CFG --limit 250 --max-steps 726 --max-minutes 40 --stop-after-steps 301 --output-dir $R/eagle3_limit250_301
for V in lkhybrid:eagle3_lkhybrid_15min eagle31:eagle31_301 limit250:eagle3_limit250_301; do
  draftsmith evaluate --drafter eagle=$R/${V#*:}/best $EV --limit 100 --out bench/training_choices/avx2/eval_${V%%:*}.json
done
# Sampled (T = 0.7, first 30 prompts): KL reference against LK.
draftsmith evaluate --drafter eagle=$RUNS/eagle3_avx2_15min/best $EV --limit 30 --temperature 0.7 \
  --out bench/training_choices/avx2/eval_t07_kl.json
draftsmith evaluate --drafter eagle=$R/eagle3_lkhybrid_15min/best $EV --limit 30 --temperature 0.7 \
  --out bench/training_choices/avx2/eval_t07_lkhybrid.json
# EAGLE-3.1 served by vLLM against ours on the first 16 prompts.
draftsmith export --format speculators --checkpoint $R/eagle31_301/best --out $R/eagle31_export \
  --target ~/.cache/draftsmith/targets/smollm2-135m-instruct --speculative-tokens 3 --overwrite
$VLLM_PYTHON scripts/vllm_check.py --target ~/.cache/draftsmith/targets/smollm2-135m-instruct \
  --method eagle3 --draft $R/eagle31_export --k 3 --prompts $ALPACA --split heldout \
  --limit 16 --max-new-tokens 64 --dtype float32 --out bench/training_choices/avx2/vllm31.json
draftsmith evaluate --drafter eagle=$R/eagle31_301/best $EV --limit 16 --out bench/training_choices/avx2/eval16_eagle31.json
# --- Later the same day (commit d8f2273 and after) -------------------------------------------
# 4. Target layers 2 15 29 (EAGLE-3.1 settings), its own cache, the same schedule paused at 301.
D2=$RUNS/i26b
draftsmith data cache --data $D/sd1000_fp32_tok --layers 2 15 29 30 --target-dtype auto --dtype bf16 \
   --max-length 512 --draft-vocab-size 8192 --out $D/cache_sd1000_l2_15_29
python recipes/eagle.py --config recipes/configs/eagle3_smollm2.yaml --eval-every 50 --save-every 100 \
   --max-steps 726 --max-minutes 60 --stop-after-steps 301 --data $D/alpaca1000_train_sd_smollm2_fp32_greedy128.jsonl \
   --hidden-states-cache $D/cache_sd1000_l2_15_29 --feature-layers 2 15 29 --output-dir $D2/eagle31_layers_2_15_29
draftsmith evaluate --drafter eagle=$D2/eagle31_layers_2_15_29/best $EV --limit 100 --out bench/training_choices/avx2/eval_layers_2_15_29.json
# Paired comparisons over the same prompts (bootstrap over prompts).
for V in layers_2_15_29 lkhybrid limit250; do
  python bench/training_choices/avx2/paired_tau.py bench/training_choices/avx2/eval_eagle31.json bench/training_choices/avx2/eval_$V.json
done
# 5. README command 1 on fresh clones (venv /tmp/qsvenv), before (29b9760) and after (d8f2273) the
#    data growth: pip install torch==2.13.0 && pip install -e ".[dev]" && draftsmith quickstart
#    (state, summary, evaluation, training metrics in bench/quickstart/avx2/quickstart30_*), then each
#    best/ on all 32 held-out prompts, τ only:
for V in 29b9760:/tmp/qs_fresh d8f2273:/tmp/qs_fresh2; do
  draftsmith evaluate --drafter eagle=${V#*:}/runs/quickstart/eagle3/best --k 3 --max-new-tokens 128 \
    --dtype float32 --no-baseline --no-reference-plain --threads 1 \
    --out bench/quickstart/avx2/quickstart30_${V%%:*}/eval32_fp32_tau.json
done
