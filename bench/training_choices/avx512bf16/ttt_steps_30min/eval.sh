#!/bin/bash
# The two A/B drafters on all 32 held-out prompts: chain k = 2 and the 5-node tree, one
# interleaved plain baseline per shard, two shards of one thread, merged.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
cd $RUNS/fresh4/draftsmith
A=$RUNS/s46/ab
for i in 0 1; do
  draftsmith evaluate --drafter eagle=$A/ttt2/best eagle-tree=$A/ttt2/best eagle=$A/ttt3/best eagle-tree=$A/ttt3/best \
    --dtype bfloat16 --k 2 --tree-topk 4 --tree-total-tokens 5 --max-new-tokens 128 --threads 1 \
    --shard $i/2 --out $A/eval_s$i.json > $A/eval_s$i.log 2>&1 &
done
wait
draftsmith evaluate --merge $A/eval_s0.json $A/eval_s1.json --out $A/eval.json > $A/eval_merge.log 2>&1
