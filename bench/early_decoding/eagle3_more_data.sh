#!/usr/bin/env bash
# Issue 12, more distinct data, part 1: the target writes 1,200 new prompts (Magpie, seed 1,
# near-duplicates of the held-out alpaca prompts excluded) plus the 32 shipped training prompts.
# Part 2 (bench/early_decoding/eagle3_more_data_2.sh) answers them, caches and trains.
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -euo pipefail
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=~/.cache/draftsmith/data
mkdir -p $D/sd_mix
date
draftsmith data prompts --output $D/magpie1200_s1_prompts.jsonl --num 1200 --include-shipped \
  --exclude $ALPACA --seed 1 --batch-size 64 --threads 2 --no-progress
date
