#!/bin/bash
# Issue 25, goal 2 after the sampled-tree speed-ups (commit in the note): EAGLE-3 chain and
# 8-node tree at T = 0.7 against the fastest plain decoding, on the first LIMIT held-out Alpaca
# prompts (the 200-prompt run of bench/trees/avx512bf16/tree8.sh, before the speed-ups, did not fit
# in the session). Same drafter and settings as that script; two shards of one thread, alone.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=${DRAFTER:-$RUNS/qs60_alpaca/eagle3/best}
O=$RUNS/bench25_fast_l${LIMIT:-60}
B=bench/trees/avx512bf16
mkdir -p $O
P="--prompts $ALPACA --split heldout --limit ${LIMIT:-60} \
   --max-new-tokens 64 --dtype bfloat16 --draft-dtype float32 --threads 1 --k 3 \
   --temperatures 0.7 --tree-total-tokens 8"
date
draftsmith bench --drafter eagle=$D eagle-tree=$D $P --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
draftsmith bench --drafter eagle=$D eagle-tree=$D $P --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
date
draftsmith bench --merge $O/s0.json $O/s1.json --out $B/tree8_fast_l${LIMIT:-60} \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json --training-logs $(dirname $D)
echo TREE_BENCH_DONE
