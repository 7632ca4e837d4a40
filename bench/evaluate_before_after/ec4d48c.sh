#!/bin/bash
# Issue 22's "CPU behaviour unchanged" check: the same evaluate commands on the code before the
# change (a worktree of ec4d48c, imported through a PYTHONPATH of symlinks) and after it.
#   git worktree add /tmp/base ec4d48c
#   mkdir -p /tmp/basepkg/draftsmith && for d in train heads recipes; do
#       ln -sfn /tmp/base/$d /tmp/basepkg/draftsmith/$d; done
#   bash bench/evaluate_before_after/ec4d48c.sh base /tmp/ref/before
#   bash bench/evaluate_before_after/ec4d48c.sh new /tmp/ref/after
# The EAGLE-3 drafter: 17 steps of recipes/eagle.py (the code before the change), online,
# --config recipes/configs/eagle3_smollm2.yaml --data $ALPACA
# --hidden-states online --split train --limit 300 --max-minutes 4 --epochs 1 --eval-every 0
# --save-every 0 --val-samples 8 --output-dir /tmp/ref/eagle3
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -e
mode=$1; out=$2; mkdir -p "$out"
if [ "$mode" = base ]; then PY="env PYTHONPATH=/tmp/basepkg python /tmp/base/recipes/evaluate.py"
else PY="python recipes/evaluate.py"; fi
common="--limit 8 --k 3 --max-new-tokens 64 --dtype bfloat16 --draft-dtype float32 --threads 1 --no-resume"
$PY $common --drafter eagle=/tmp/ref/eagle3/drafter eagle-tree=/tmp/ref/eagle3/drafter draft-lm ngram suffix \
    --draft-layers 0 1 2 29 --out "$out/greedy.json" > "$out/greedy.log" 2>&1
$PY $common --drafter eagle=/tmp/ref/eagle3/drafter draft-lm ngram --draft-layers 0 1 2 29 \
    --temperature 0.7 --seed 3 --out "$out/t07.json" > "$out/t07.log" 2>&1
