#!/bin/bash
# Issue 24 on an AVX2-only CPU: the three drafters of bench/families/avx2/p_eagle_dflash/runs.sh (EAGLE-3, P-EAGLE,
# DFlash, 15 min each on the same data) benched on the first 100 held-out Alpaca prompts, fp32
# target (bf16 is emulated here; evaluate's reference plain times bf16 too), greedy and T = 0.7
# (first 20 prompts), one interleaved plain baseline, two shards of one thread each (one per
# core); then this machine's single-thread fp32 verification cost profile for the recommended k,
# the merge, and α up to k = 7 on 20 prompts.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
R=$RUNS
M=${MINUTES:-15}
O=$R/bench24
mkdir -p $O
DR="eagle=$R/eagle3_avx2_${M}min/best peagle=$R/peagle_avx2_${M}min/best dflash=$R/dflash_avx2_${M}min/best"
B="draftsmith bench --drafter $DR --k 3 --prompts $ALPACA --split heldout \
   --limit 100 --max-new-tokens 64 --dtype float32 --temperatures 0 0.7 --sampled-limit 20 --threads 1"
$B --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
$B --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
python scripts/bench_forward.py --threads 1 --dtypes float32 --widths 1 2 3 4 5 6 8 \
   --out bench/cpu_costs/forward_cost_avx2_fp32_1thread.json
draftsmith bench --merge $O/s0.json $O/s1.json --out $O/all --cost-profile bench/cpu_costs/forward_cost_avx2_fp32_1thread.json \
   --training-logs $R/eagle3_avx2_${M}min $R/peagle_avx2_${M}min $R/dflash_avx2_${M}min
draftsmith evaluate --drafter eagle=$R/eagle3_avx2_${M}min/best dflash=$R/dflash_avx2_${M}min/best --k 7 \
   --prompts $ALPACA --split heldout --limit 20 --max-new-tokens 64 \
   --dtype float32 --no-reference-plain --out $O/k7.json
echo BENCH_DONE
