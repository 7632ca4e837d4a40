#!/bin/bash
# Shared data for issues 24/25/26: the shipped *_smollm2.yaml configs' documented data commands.
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=~/.cache/draftsmith/data
draftsmith data distill --input $ALPACA --split train --dtype bfloat16 \
   --max-new-tokens 128 --batch-size 64 --device cpu \
   --output $D/alpaca1800_train_sd_smollm2_bf16_greedy128.jsonl
draftsmith data tokenize --input $D/alpaca1800_train_sd_smollm2_bf16_greedy128.jsonl \
   --output $D/sd1800_bf16_tok --max-length 512
draftsmith data cache --data $D/sd1800_bf16_tok --preset eagle3 \
   --target-dtype bf16 --dtype bf16 --max-length 512 --draft-vocab-size 8192 \
   --out $D/cache_sd1800_eagle3_bf16
echo CHAIN_DONE
