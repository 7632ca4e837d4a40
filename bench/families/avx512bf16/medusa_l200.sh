#!/bin/bash
# Issue 25, item 4 on the AVX512-BF16 CPU, greedy: Medusa-1 and Medusa-2 at equal compute (the
# EAGLE-3 reference's data and training minutes, bench/families/avx512bf16/medusa_eq.sh and
# bench/families/avx512bf16/eq_rest.sh trained them) on all LIMIT held-out Alpaca prompts, chain and 7-node
# tree at k = 3, with one interleaved plain bf16 baseline (the fastest plain decoding on this CPU):
# bf16 target and heads, 64 new tokens, two shards of one thread, alone. Medusa-2's heads go with
# its own merged fine-tuned target, which that run's plain baseline decodes.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
R=$RUNS/eq
B=bench/families/avx512bf16
L=${LIMIT:-200}
O=$RUNS/bench25_medusa_greedy_l$L
mkdir -p $O
P="--prompts $ALPACA --split heldout --limit $L --max-new-tokens 64 \
   --dtype bfloat16 --threads 1 --temperatures 0 --no-reference-plain --k 3 --tree-total-tokens 7"
date
M1="medusa=$R/medusa1/heads medusa-tree=$R/medusa1/heads"
draftsmith bench --drafter $M1 $P --shard 0/2 --out $O/m1_s0 > $O/m1_s0.log 2>&1 &
draftsmith bench --drafter $M1 $P --shard 1/2 --out $O/m1_s1 > $O/m1_s1.log 2>&1
wait
draftsmith bench --merge $O/m1_s0.json $O/m1_s1.json --out $B/medusa1_eq_l$L \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json --training-logs $R/medusa1
date
M2="medusa=$R/medusa2/heads medusa-tree=$R/medusa2/heads"
draftsmith bench --drafter $M2 $P --target $R/medusa2/target --shard 0/2 --out $O/m2_s0 > $O/m2_s0.log 2>&1 &
draftsmith bench --drafter $M2 $P --target $R/medusa2/target --shard 1/2 --out $O/m2_s1 > $O/m2_s1.log 2>&1
wait
draftsmith bench --merge $O/m2_s0.json $O/m2_s1.json --out $B/medusa2_eq_l$L \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json --training-logs $R/medusa2
date
echo MEDUSA_GREEDY_DONE
