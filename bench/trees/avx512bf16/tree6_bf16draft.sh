#!/bin/bash
# Issue 25, goal 2: the EAGLE-3 tree at T = 0.7 against the fastest plain decoding, on the
# first LIMIT of the 200 held-out Alpaca prompts, in the shape and drafter dtype that
# scripts/bench_tree_shapes.py found fastest on 24 prompts (bench/trees/avx512bf16/tree_shapes*.json):
# depth 2, top-4, 6 nodes, bf16 drafter (this CPU has AVX512-BF16). The chain at the same k
# beside it. Same drafter as bench/trees/avx512bf16/tree8_fast.sh; two shards of one thread, alone.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=${DRAFTER:-$RUNS/qs60_alpaca/eagle3/best}
O=$RUNS/bench25_k2_l${LIMIT:-200}
B=bench/trees/avx512bf16
mkdir -p $O
P="--prompts $ALPACA --split heldout --limit ${LIMIT:-200} \
   --max-new-tokens 64 --dtype bfloat16 --draft-dtype bfloat16 --threads 1 --k 2 \
   --temperatures 0.7 --tree-topk 4 --tree-total-tokens 6"
date
draftsmith bench --drafter eagle=$D eagle-tree=$D $P --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
draftsmith bench --drafter eagle=$D eagle-tree=$D $P --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
date
draftsmith bench --merge $O/s0.json $O/s1.json --out $B/tree6_k2_bf16draft_l${LIMIT:-200} \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json --training-logs $(dirname $D)
echo TREE_BENCH_DONE
