#!/bin/bash
# τ of this 60-minute Alpaca job's drafter on the 200 held-out Alpaca prompts (bf16 target, fp32
# drafter, greedy, k = 3, 64 new tokens), τ only (--no-baseline: no speed figure, so it may share
# the machine), two shards of one thread each, then merged.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
R=$RUNS/qs60_alpaca_1a0
common="--prompts $ALPACA --split heldout --drafter eagle=$R/eagle3/best --dtype bfloat16 --draft-dtype float32 --k 3 --max-new-tokens 64 --no-baseline --threads 1"
draftsmith evaluate $common --shard 0/2 --out $R/eval200_s0.json > $R/eval200_s0.log 2>&1 &
draftsmith evaluate $common --shard 1/2 --out $R/eval200_s1.json > $R/eval200_s1.log 2>&1
wait
draftsmith evaluate --merge $R/eval200_s0.json $R/eval200_s1.json --out $R/eval200_tau.json > $R/eval200_merge.log 2>&1
echo $? > $R/eval200.done
