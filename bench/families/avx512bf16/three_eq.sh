#!/bin/bash
# Issue 24, item 5 on the AVX512-BF16 CPU: P-EAGLE, DFlash and their EAGLE-3 reference, each
# trained on the same data (the 60-minute Alpaca quickstart's 1,768 answers and offline cache)
# for the same 27.8 training minutes, benched greedy on the first LIMIT held-out Alpaca prompts:
# bf16 target and drafters, k = K (the chains' recommended k in the 40-prompt run), 64 new
# tokens, one interleaved plain bf16 baseline, two shards of one thread, nothing else running.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
P_=${PEAGLE:-$RUNS/eq/peagle/best}
D_=${DFLASH:-$RUNS/eq/dflash/best}
E=${EAGLE3:-$RUNS/qs60_alpaca/eagle3/best}
O=$RUNS/bench24_three_k${K:-2}_l${LIMIT:-100}
B=bench/families/avx512bf16
mkdir -p $O $B
P="--prompts $ALPACA --split heldout --limit ${LIMIT:-100} \
   --max-new-tokens 64 --dtype bfloat16 --threads 1 --k ${K:-2} --temperatures 0 --no-reference-plain"
date
draftsmith bench --drafter peagle=$P_ dflash=$D_ eagle=$E $P --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
draftsmith bench --drafter peagle=$P_ dflash=$D_ eagle=$E $P --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
date
draftsmith bench --merge $O/s0.json $O/s1.json --out $B/three_eq_k${K:-2}_l${LIMIT:-100} \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json \
  --training-logs $(dirname $P_) $(dirname $D_) $(dirname $E)
echo THREE_BENCH_DONE
