#!/bin/bash
# Issue 25, item 4 on the AVX512-BF16 CPU: the draft LM and EAGLE-1, each trained on the EAGLE-3
# reference's data (the 60-minute Alpaca quickstart's 1,768 self-distilled records, its offline
# cache) for the reference's training minutes (27.8), benched greedy on the first LIMIT held-out
# Alpaca prompts with one interleaved plain bf16 baseline (the fastest plain decoding on this
# CPU): bf16 target and drafters, k = K, 64 new tokens, two shards of one thread, alone. Then
# Medusa-2 (same data and minutes; its heads go with its own merged fine-tuned target, which the
# plain baseline of that run decodes), chain and a 7-node tree, on LIMIT2 prompts.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
R=$RUNS/eq
B=bench/families/avx512bf16
O=$RUNS/bench25_rest_l${LIMIT:-200}
mkdir -p $O
P="--prompts $ALPACA --split heldout --max-new-tokens 64 --dtype bfloat16 \
   --threads 1 --temperatures 0 --no-reference-plain"
D="draft-lm=$R/distill/best eagle=$R/eagle1/best"
date
draftsmith bench --drafter $D $P --limit ${LIMIT:-200} --k ${K:-2} --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
draftsmith bench --drafter $D $P --limit ${LIMIT:-200} --k ${K:-2} --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
date
draftsmith bench --merge $O/s0.json $O/s1.json --out $B/distill_eagle1_eq_k${K:-2}_l${LIMIT:-200} \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json --training-logs $R/distill $R/eagle1
echo REST_BENCH_DONE
M="medusa=$R/medusa2/heads medusa-tree=$R/medusa2/heads"  # Medusa-2 keeps no best/: its heads go with its final target
draftsmith bench --drafter $M $P --limit ${LIMIT2:-100} --k 3 --tree-total-tokens 7 --target $R/medusa2/target --shard 0/2 --out $O/m2_s0 > $O/m2_s0.log 2>&1 &
draftsmith bench --drafter $M $P --limit ${LIMIT2:-100} --k 3 --tree-total-tokens 7 --target $R/medusa2/target --shard 1/2 --out $O/m2_s1 > $O/m2_s1.log 2>&1
wait
date
draftsmith bench --merge $O/m2_s0.json $O/m2_s1.json --out $B/medusa2_eq_l${LIMIT2:-100} \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json --training-logs $R/medusa2
echo MEDUSA2_BENCH_DONE
