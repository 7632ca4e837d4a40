#!/bin/bash
# Issue 26, item 1: the learning-rate runs evaluated by decoding. Evaluated τ (greedy, k = 3,
# 128 new tokens, bf16 target and drafter, as the main job evaluates) of the four drafters on the
# project's 32 held-out prompts (the main job's evaluation set). τ only: no plain baseline, so
# the two shards may share the cores with other untimed work.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
R=$RUNS
O=$R/exp26/eval_tau
mkdir -p $O
P="--limit 32 --k 3 --max-new-tokens 128 --dtype bfloat16 --threads 1 --no-baseline \
   --no-reference-plain --drafter eagle=$R/qs30_cal/eagle3/best eagle=$R/exp26/lr15/best \
   eagle=$R/exp26/lr6e-4_s1/best eagle=$R/exp26/lr1.5e-3_s1/best"
draftsmith evaluate $P --shard 0/2 --out $O/s0.json > $O/s0.log 2>&1 &
draftsmith evaluate $P --shard 1/2 --out $O/s1.json > $O/s1.log 2>&1
wait
draftsmith evaluate --merge $O/s0.json $O/s1.json --out bench/training_choices/avx512bf16/lr_30min/eval_tau.json
echo EVAL_TAU_DONE
