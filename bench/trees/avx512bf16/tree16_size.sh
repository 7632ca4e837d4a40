#!/bin/bash
# Issue 25, item 5: the tree size predicted from one measured tree. A generous EAGLE-2 tree
# (depth 2, top-4, 16 nodes, bf16 drafter, T = 0.7) on the first LIMIT held-out Alpaca prompts;
# the bench predicts every smaller tree's speedup from the same steps ("Tree size" section),
# to be checked against the 6-node tree measured directly (bench/trees/avx512bf16/tree6_bf16draft.sh).
# Plain bf16 is the baseline (the fastest plain decoding on this CPU in every run so far).
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=${DRAFTER:-$RUNS/qs60_alpaca/eagle3/best}
O=$RUNS/bench25_size_l${LIMIT:-40}
B=bench/trees/avx512bf16
mkdir -p $O
P="--prompts $ALPACA --split heldout --limit ${LIMIT:-40} \
   --max-new-tokens 64 --dtype bfloat16 --draft-dtype bfloat16 --threads 1 --k 2 \
   --temperatures 0.7 --tree-topk 4 --tree-total-tokens 16 --no-reference-plain"
date
draftsmith bench --drafter eagle-tree=$D $P --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
draftsmith bench --drafter eagle-tree=$D $P --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
date
draftsmith bench --merge $O/s0.json $O/s1.json --out $B/tree16_k2_size_l${LIMIT:-40} \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json
echo TREE_SIZE_DONE
