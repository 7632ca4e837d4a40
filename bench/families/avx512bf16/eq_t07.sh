#!/bin/bash
# Issue 25, item 4 at T = 0.7 on the AVX512-BF16 CPU: the equal-compute drafters of
# bench/families/avx512bf16/eq_rest.sh and bench/families/avx512bf16/medusa_eq.sh (EAGLE-1, the draft LM, Medusa-1 chain
# and 7-node tree; then Medusa-2 with its own target), sampled at T = 0.7 on the first LIMIT
# held-out Alpaca prompts: bf16 target and drafters, k = 2 (trees of depth 2, the shape that
# paid at T = 0.7 for EAGLE-3), 64 new tokens, one interleaved plain bf16 baseline per run, two
# shards of one thread, alone.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
R=$RUNS/eq
B=bench/families/avx512bf16
O=$RUNS/bench25_t07_l${LIMIT:-40}
mkdir -p $O
P="--prompts $ALPACA --split heldout --limit ${LIMIT:-40} --max-new-tokens 64 \
   --dtype bfloat16 --threads 1 --temperatures 0.7 --no-reference-plain --k 2 --tree-total-tokens 7"
D="draft-lm=$R/distill/best eagle=$R/eagle1/best medusa=$R/medusa1/heads medusa-tree=$R/medusa1/heads"
date
draftsmith bench --drafter $D $P --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
draftsmith bench --drafter $D $P --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
draftsmith bench --merge $O/s0.json $O/s1.json --out $B/eq_t07_l${LIMIT:-40} \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json --training-logs $R/distill $R/eagle1 $R/medusa1
M="medusa=$R/medusa2/heads medusa-tree=$R/medusa2/heads"  # with its own merged target
draftsmith bench --drafter $M $P --target $R/medusa2/target --shard 0/2 --out $O/m2_s0 > $O/m2_s0.log 2>&1 &
draftsmith bench --drafter $M $P --target $R/medusa2/target --shard 1/2 --out $O/m2_s1 > $O/m2_s1.log 2>&1
wait
date
draftsmith bench --merge $O/m2_s0.json $O/m2_s1.json --out $B/medusa2_eq_t07_l${LIMIT:-40} \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json --training-logs $R/medusa2
echo T07_BENCH_DONE
