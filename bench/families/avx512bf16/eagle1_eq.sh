#!/bin/bash
# Issue 25, item 4 on the AVX512-BF16 CPU: EAGLE-1 (the shipped eagle1_smollm2.yaml) trained on
# the EAGLE-3 reference's data and cache for its 27.8 training minutes, benched greedy on the
# first LIMIT held-out Alpaca prompts: bf16 target and drafter, k = 3, 64 new tokens, plain
# bf16 baseline (the fastest plain in the 100-prompt Medusa run), two shards of one thread,
# alone.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=${EAGLE1:-$RUNS/eq/eagle1/best}
O=$RUNS/bench25_eagle1_l${LIMIT:-40}
B=bench/families/avx512bf16
mkdir -p $O
P="--prompts $ALPACA --split heldout --limit ${LIMIT:-40} \
   --max-new-tokens 64 --dtype bfloat16 --threads 1 --k 3 --temperatures 0 --no-reference-plain"
date
draftsmith bench --drafter eagle=$D $P --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
draftsmith bench --drafter eagle=$D $P --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
date
draftsmith bench --merge $O/s0.json $O/s1.json --out $B/eagle1_eq_l${LIMIT:-40} \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json --training-logs $(dirname $D)
echo EAGLE1_BENCH_DONE
