#!/bin/bash
# Issue 24, item 5 on the AVX512-BF16 CPU: P-EAGLE (the shipped peagle_smollm2.yaml) trained on
# the EAGLE-3 reference's data and cache for its 27.8 training minutes, benched greedy beside
# that EAGLE-3 on the first LIMIT held-out Alpaca prompts: bf16 target and drafters, k = K,
# 64 new tokens, one interleaved plain bf16 baseline, two shards of one thread, alone.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
P_=${PEAGLE:-$RUNS/eq/peagle/best}
E=${EAGLE3:-$RUNS/qs60_alpaca/eagle3/best}
O=$RUNS/bench24_peagle_k${K:-3}_l${LIMIT:-40}
B=bench/parallel/avx512bf16
mkdir -p $O $B
P="--prompts $ALPACA --split heldout --limit ${LIMIT:-40} \
   --max-new-tokens 64 --dtype bfloat16 --threads 1 --k ${K:-3} --temperatures 0 --no-reference-plain"
date
draftsmith bench --drafter peagle=$P_ eagle=$E $P --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
draftsmith bench --drafter peagle=$P_ eagle=$E $P --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
date
draftsmith bench --merge $O/s0.json $O/s1.json --out $B/peagle_eq_k${K:-3}_l${LIMIT:-40} \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json --training-logs $(dirname $P_) $(dirname $E)
echo PEAGLE_BENCH_DONE
