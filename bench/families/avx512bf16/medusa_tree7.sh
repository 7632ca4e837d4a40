#!/bin/bash
# Issue 25: the Medusa-1 tree at the size its tree-size prediction picked (7 nodes, predicted
# 1.33x from the 16-node run of bench/families/avx512bf16/medusa_eq.sh), measured on the same 100 held-out
# prompts, greedy, bf16, k = 3, 64 new tokens; plain bf16 baseline (the fastest plain in that
# run), two shards of one thread, alone.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
M=${MEDUSA:-$RUNS/eq/medusa1/best}
O=$RUNS/bench25_medusa7_l${LIMIT:-100}
B=bench/families/avx512bf16
mkdir -p $O
P="--prompts $ALPACA --split heldout --limit ${LIMIT:-100} \
   --max-new-tokens 64 --dtype bfloat16 --threads 1 --k 3 --temperatures 0 \
   --tree-total-tokens 7 --no-reference-plain"
date
draftsmith bench --drafter medusa-tree=$M $P --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
draftsmith bench --drafter medusa-tree=$M $P --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
date
draftsmith bench --merge $O/s0.json $O/s1.json --out $B/medusa1_eq_tree7_l${LIMIT:-100} \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json
echo MEDUSA7_DONE
