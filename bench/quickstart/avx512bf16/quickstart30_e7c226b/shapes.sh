#!/bin/bash
# The job's drafter in other depth-2 shapes on all 32 held-out prompts: one interleaved plain
# baseline per shard, two shards of one thread, merged.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
cd $RUNS/fresh7/draftsmith
source $RUNS/fresh7/venv/bin/activate
S="chain:2 tree:2:4:5 tree:2:4:6 tree:2:4:8"
for i in 0 1; do
  python scripts/bench_tree_shapes.py --drafter runs/quickstart/eagle3/best \
    --prompts train/data/prompt_sets/chat_prompts.jsonl --split heldout --limit 32 --temperature 0 \
    --max-new-tokens 128 --draft-dtype bfloat16 --shapes $S --shard $i/2 --out runs/shapes_s$i.json > runs/shapes_s$i.log 2>&1 &
done
wait
python scripts/bench_tree_shapes.py --merge runs/shapes_s0.json runs/shapes_s1.json --out runs/shapes.json
