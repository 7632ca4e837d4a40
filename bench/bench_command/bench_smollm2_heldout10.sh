#!/usr/bin/env bash
# A small real `draftsmith bench` run (10 held-out prompts, greedy and T=0.7), two shards of one thread.
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
while pgrep -f "draftsmith quickstart" > /dev/null; do sleep 5; done
date
common="--prompts $ALPACA --split heldout --limit 10 \
  --dtype bfloat16 --draft-dtype float32 --threads 1 --k 3 --max-new-tokens 128 \
  --temperatures 0 0.7 \
  --drafter ngram eagle=runs/eagle3_smollm2/best eagle-tree=runs/eagle3_smollm2/best hf-prompt-lookup"
draftsmith bench $common --shard 0/2 --out bench/bench_command/bench_smollm2_heldout10_s0 > logs/bench_s0.log 2>&1 &
draftsmith bench $common --shard 1/2 --out bench/bench_command/bench_smollm2_heldout10_s1 > logs/bench_s1.log 2>&1 &
wait
date
draftsmith bench --merge bench/bench_command/bench_smollm2_heldout10_s0.json bench/bench_command/bench_smollm2_heldout10_s1.json \
    --out bench/bench_command/bench_smollm2_heldout10 --training-logs runs/eagle3_smollm2 runs/quickstart/eagle3 > logs/bench_merge.log 2>&1
date
