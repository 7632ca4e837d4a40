#!/bin/bash
# Issue 25, item 4 on the AVX512-BF16 CPU: Medusa-1 trained on the EAGLE-3 reference's data
# (the 60-minute Alpaca quickstart's 1,768 self-distilled records and its offline cache) for
# the reference's training minutes (27.8), benched greedy beside that EAGLE-3 on the first
# LIMIT held-out Alpaca prompts: bf16 target and drafters, k = 3, 64 new tokens, Medusa's tree
# of 16 nodes (its tree-size prediction picks the size), one interleaved plain baseline in
# each dtype, two shards of one thread, alone.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
M=${MEDUSA:-$RUNS/eq/medusa1/heads}
E=${EAGLE3:-$RUNS/qs60_alpaca/eagle3/best}
O=$RUNS/bench25_medusa_l${LIMIT:-100}
B=bench/families/avx512bf16
mkdir -p $O
P="--prompts $ALPACA --split heldout --limit ${LIMIT:-100} \
   --max-new-tokens 64 --dtype bfloat16 --threads 1 --k 3 --temperatures 0 \
   --tree-total-tokens 16"
date
draftsmith bench --drafter medusa=$M medusa-tree=$M eagle=$E $P --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
draftsmith bench --drafter medusa=$M medusa-tree=$M eagle=$E $P --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
date
draftsmith bench --merge $O/s0.json $O/s1.json --out $B/medusa1_eq_l${LIMIT:-100} \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json --training-logs $RUNS/eq/medusa1 $(dirname $E)
echo MEDUSA_BENCH_DONE
