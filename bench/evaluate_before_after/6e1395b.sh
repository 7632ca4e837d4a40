#!/bin/bash
# Issue 23's "behaviour unchanged" check: the same evaluate commands on the code before issue 23
# (a worktree of 6e1395b, imported through a PYTHONPATH of symlinks) and after it, on the first 4
# held-out prompts of evaluate's default prompt set (train/data/prompt_sets/chat_prompts.jsonl,
# split heldout: ids 1, 3, 5, 7).
#   git worktree add /tmp/base 6e1395b
#   mkdir -p /tmp/basepkg/draftsmith && for d in train heads recipes; do
#       ln -sfn /tmp/base/$d /tmp/basepkg/draftsmith/$d; done
#   bash bench/evaluate_before_after/6e1395b.sh base /tmp/ref23/before
#   bash bench/evaluate_before_after/6e1395b.sh new /tmp/ref23/after
# The EAGLE-3 drafter is issue 22's (bench/evaluate_before_after/ec4d48c.sh says how it was trained).
set -e
mode=$1; out=$2; mkdir -p "$out"
if [ "$mode" = base ]; then PY="env PYTHONPATH=/tmp/basepkg python /tmp/base/recipes/evaluate.py"
else PY="python recipes/evaluate.py"; fi
common="--limit 4 --k 3 --max-new-tokens 64 --dtype bfloat16 --draft-dtype float32 --threads 1 --no-resume"
$PY $common --drafter eagle=/tmp/ref/eagle3/drafter eagle-tree=/tmp/ref/eagle3/drafter draft-lm ngram suffix \
    --draft-layers 0 1 2 29 --out "$out/greedy.json" > "$out/greedy.log" 2>&1
$PY $common --drafter eagle=/tmp/ref/eagle3/drafter draft-lm ngram --draft-layers 0 1 2 29 \
    --temperature 0.7 --seed 3 --out "$out/t07.json" > "$out/t07.log" 2>&1
