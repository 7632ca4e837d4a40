#!/bin/bash
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
S="chain:2 tree:2:4:6 tree:2:4:7 tree:3:4:6 tree:3:4:7 tree:3:4:8"
for i in 0 1; do
  python scripts/bench_tree_shapes.py --drafter $RUNS/fresh/draftsmith/runs/quickstart/eagle3/best \
    --prompts train/data/prompt_sets/chat_prompts.jsonl --split heldout --limit 32 --temperature 0 \
    --max-new-tokens 128 --draft-dtype bfloat16 --shapes $S --shard $i/2 --out $RUNS/s45/shapes_s$i.json > $RUNS/s45/shapes_s$i.log 2>&1 &
done
wait
python scripts/bench_tree_shapes.py --merge $RUNS/s45/shapes_s0.json $RUNS/s45/shapes_s1.json --out $RUNS/s45/shapes_d3.json
