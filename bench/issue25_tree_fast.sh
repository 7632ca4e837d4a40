#!/bin/bash
# Issue 25, goal 2 after the sampled-tree speed-ups (commit in the note): EAGLE-3 chain and
# 8-node tree at T = 0.7 against the fastest plain decoding, on the first LIMIT held-out Alpaca
# prompts (the 200-prompt run of bench/issue25_bf16_tree.sh, before the speed-ups, did not fit
# in the session). Same drafter and settings as that script; two shards of one thread, alone.
set -x
cd /work/main
D=${DRAFTER:-/work/runs/qs60_alpaca/eagle3/best}
O=/work/runs/bench25_fast_l${LIMIT:-60}
B=bench/issue25_bf16
mkdir -p $O
P="--prompts ../shared/data/alpaca_2k.jsonl --split heldout --limit ${LIMIT:-60} \
   --max-new-tokens 64 --dtype bfloat16 --draft-dtype float32 --threads 1 --k 3 \
   --temperatures 0.7 --tree-total-tokens 8"
date
draftsmith bench --drafter eagle=$D eagle-tree=$D $P --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
draftsmith bench --drafter eagle=$D eagle-tree=$D $P --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
date
draftsmith bench --merge $O/s0.json $O/s1.json --out $B/tree8_fast_l${LIMIT:-60} \
  --cost-profile $B/forward_cost_1thread.json --training-logs $(dirname $D)
echo TREE_BENCH_DONE
