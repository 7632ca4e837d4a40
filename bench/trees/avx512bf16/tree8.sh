#!/bin/bash
# Issue 25, goal 2 on a CPU that computes bf16 (2-core AMD EPYC with AVX512-BF16, no AMX): the
# EAGLE-3 tree at T = 0.7 against the chain and the fastest plain decoding, on the 200 held-out
# prompts of $ALPACA.
#
# Drafter: the `best/` of the 60-minute quickstart on Alpaca prompts (README's second measured
# run: `draftsmith quickstart --budget-minutes 60 --prompts $ALPACA
# --out-dir $RUNS/qs60_alpaca`). bf16 target, fp32 drafter, k = 3 (the tree's depth too),
# tree of TREE nodes (top-4 expansion), 64 new tokens, one interleaved plain baseline (plain bf16,
# plain fp32 timed beside it), two shards of one thread each (one per core), nothing else running.
# First the verify cost per width and tree size on this machine at one thread (the bench's
# recommendation reads it; bench/cpu_costs/forward_cost.json is a Sapphire Rapids with AMX).
#
# Resumable: rerunning continues each shard's finished prompts (MAX_MINUTES bounds a sitting).
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=${DRAFTER:-$RUNS/qs60_alpaca/eagle3/best}
TREE=${TREE:-16}
O=$RUNS/bench25_bf16_tree$TREE
B=bench/trees/avx512bf16
mkdir -p $O $B
[ -f bench/cpu_costs/forward_cost_1thread.json ] || python scripts/bench_forward.py --threads 1 \
  --dtypes bfloat16 float32 --widths 1 2 3 4 6 8 --tree-sizes 8 16 24 32 \
  --out bench/cpu_costs/forward_cost_1thread.json
P="--prompts $ALPACA --split heldout --limit ${LIMIT:-200} \
   --max-new-tokens 64 --dtype bfloat16 --draft-dtype float32 --threads 1 --k 3 \
   --temperatures ${TEMPS:-0.7} --tree-total-tokens $TREE ${MAX_MINUTES:+--max-minutes $MAX_MINUTES}"
date
draftsmith bench --drafter eagle=$D eagle-tree=$D $P --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
draftsmith bench --drafter eagle=$D eagle-tree=$D $P --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
date
if [ -f $O/s0.json ] && [ -f $O/s1.json ] && ! ls $O/*.partial.jsonl > /dev/null 2>&1; then
  draftsmith bench --merge $O/s0.json $O/s1.json --out $B/tree$TREE \
    --cost-profile bench/cpu_costs/forward_cost_1thread.json --training-logs $(dirname $D)
fi
echo TREE_BENCH_DONE
