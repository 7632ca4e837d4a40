#!/usr/bin/env bash
# Issue 14: the committed bench. Every trained drafter on the 200 held-out prompts of
# $ALPACA, greedy and T = 0.7, one interleaved plain bf16 baseline (plain
# fp32 timed beside it), two shards of one thread each, then merged. 64 new tokens per prompt:
# with 128 the eleven timed runs per prompt took ~2.5 min per prompt per shard (8+ hours for
# both temperatures); 64 halves it. The sampled run takes the first 60 of the 200 prompts
# (--sampled-limit 60): at ~85 s per prompt per shard, all 200 would have left no time in the
# session for the served stage; greedy carries the speed figures, T = 0.7 its τ.
#
# Resumable: each shard keeps its finished prompts (OUT.t<T>.json.partial.jsonl); rerunning this
# script continues where it stopped (kill -TERM the two `draftsmith bench` processes to pause).
# MAX_MINUTES (per evaluate run) bounds one sitting; the script then exits and is rerun later.
RUNS=${RUNS:-runs}  # scratch: shards
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
R=runs
common="--prompts $ALPACA --split heldout --limit 200 \
  --dtype bfloat16 --draft-dtype float32 --threads 1 --k 3 --max-new-tokens 64 \
  --temperatures 0 0.7 --sampled-limit 60 ${MAX_MINUTES:+--max-minutes $MAX_MINUTES} \
  --drafter ngram draft-lm=$R/distill_smollm2_mix/draft hf-assisted=$R/distill_smollm2_mix/draft \
  medusa=$R/medusa1_smollm2_mix/heads medusa-tree=$R/medusa1_smollm2_mix/heads \
  eagle=$R/eagle1_smollm2_mix/best \
  eagle=$R/eagle3_smollm2_mix/best eagle-tree=$R/eagle3_smollm2_mix/best hf-prompt-lookup"
date
draftsmith bench $common --shard 0/2 --out $RUNS/heldout200/s0 > logs/bench200_s0.log 2>&1 &
draftsmith bench $common --shard 1/2 --out $RUNS/heldout200/s1 > logs/bench200_s1.log 2>&1 &
wait
date
if [ -f $RUNS/heldout200/s0.json ] && [ -f $RUNS/heldout200/s1.json ] && \
   ! ls $RUNS/heldout200/*.partial.jsonl > /dev/null 2>&1; then
  draftsmith bench --merge $RUNS/heldout200/s0.json $RUNS/heldout200/s1.json \
    --out bench/bench_command/bench_smollm2_heldout200 \
    --training-logs runs/eagle3_smollm2 runs/eagle3_smollm2_mix runs/eagle1_smollm2_mix \
    runs/medusa1_smollm2_mix runs/distill_smollm2_mix > logs/bench200_merge.log 2>&1
fi
date
