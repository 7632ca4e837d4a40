#!/usr/bin/env bash
# Final issue-12 evaluation: EAGLE-3 chain, k = 3, bf16 target, fp32 drafter, 100 held-out prompts.
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
date
common="--prompts $ALPACA --split heldout --limit 100 --dtype bfloat16 \
  --draft-dtype float32 --drafter eagle=runs/eagle3_smollm2/best \
  --k 3 --max-new-tokens 128 --threads 1 --max-minutes 45"
draftsmith evaluate $common --shard 0/2 --out bench/early_decoding/eagle3_bf16_k3_heldout100_s0.json > logs/evalk3_s0.log 2>&1 &
draftsmith evaluate $common --shard 1/2 --out bench/early_decoding/eagle3_bf16_k3_heldout100_s1.json > logs/evalk3_s1.log 2>&1 &
wait
date
draftsmith evaluate --merge bench/early_decoding/eagle3_bf16_k3_heldout100_s0.json bench/early_decoding/eagle3_bf16_k3_heldout100_s1.json \
  --out bench/early_decoding/eagle3_bf16_k3_heldout100.json > logs/evalk3_merge.log 2>&1
date
