#!/bin/bash
# All 32 held-out prompts: the job's drafter as a k = 2 chain and a 5-node tree, one interleaved
# plain baseline per shard, two shards of one thread, merged.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
cd $RUNS/fresh4/draftsmith
source $RUNS/fresh4/venv/bin/activate
D=runs/quickstart/eagle3/best
for i in 0 1; do
  draftsmith evaluate --drafter eagle=$D eagle-tree=$D --dtype bfloat16 --k 2 --tree-topk 4 \
    --tree-total-tokens 5 --max-new-tokens 128 --threads 1 --shard $i/2 --out runs/eval32_s$i.json \
    > runs/eval32_s$i.log 2>&1 &
done
wait
draftsmith evaluate --merge runs/eval32_s0.json runs/eval32_s1.json --out runs/eval32.json
