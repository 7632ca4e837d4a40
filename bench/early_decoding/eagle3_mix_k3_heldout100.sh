#!/usr/bin/env bash
# Issue 12: the EAGLE-3 drafter continued on more distinct data (bench/early_decoding/eagle3_more_data_2.sh),
# chain k = 3, bf16 target, fp32 drafter, 100 held-out prompts; same command as
# bench/early_decoding/eagle3_bf16_k3_heldout100.sh otherwise (one interleaved plain bf16 baseline per shard,
# plain fp32 timed beside it as the fastest plain decoding at one thread).
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
date
common="--prompts $ALPACA --split heldout --limit 100 --dtype bfloat16 \
  --draft-dtype float32 --drafter eagle=runs/eagle3_smollm2_mix/best \
  --k 3 --max-new-tokens 128 --threads 1 --max-minutes 45"
draftsmith evaluate $common --shard 0/2 --out bench/early_decoding/eagle3_mix_k3_heldout100_s0.json > logs/evalmix_s0.log 2>&1 &
draftsmith evaluate $common --shard 1/2 --out bench/early_decoding/eagle3_mix_k3_heldout100_s1.json > logs/evalmix_s1.log 2>&1 &
wait
date
draftsmith evaluate --merge bench/early_decoding/eagle3_mix_k3_heldout100_s0.json bench/early_decoding/eagle3_mix_k3_heldout100_s1.json \
  --out bench/early_decoding/eagle3_mix_k3_heldout100.json > logs/evalmix_merge.log 2>&1
date
