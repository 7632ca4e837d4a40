#!/usr/bin/env bash
# Issue 12, more distinct data: the target writes 1,200 new prompts (Magpie, seed 1, held-out
# alpaca prompts excluded), answers them (greedy, 128 tokens), and EAGLE-3 trains from scratch on
# those plus the 1,800 alpaca training answers for at most 60 minutes (same settings otherwise).
set -euo pipefail
set -x
cd /work/main
D=~/.cache/draftsmith/data
mkdir -p $D/sd_mix
date
draftsmith data prompts --output $D/magpie1200_s1_prompts.jsonl --num 1200 --include-shipped \
  --exclude ../shared/data/alpaca_2k.jsonl --seed 1 --batch-size 64 --threads 2 --no-progress
date
draftsmith data distill --input $D/magpie1200_s1_prompts.jsonl --dtype float32 \
  --max-new-tokens 128 --batch-size 64 --threads 2 --no-progress \
  --output $D/sd_mix/magpie1200_s1_sd_smollm2_greedy128.jsonl
cp -f $D/alpaca1800_train_sd_smollm2_bf16_greedy128.jsonl $D/sd_mix/
date
draftsmith data tokenize --input $D/sd_mix --output $D/sd_mix_tok --max-length 512
date
draftsmith data cache --data $D/sd_mix_tok --preset eagle3 --target-dtype bf16 --dtype bf16 \
  --max-length 512 --draft-vocab-size 8192 --threads 2 --no-progress --out $D/cache_mix_eagle3_bf16
date
draftsmith train eagle --config recipes/configs/eagle3_smollm2.yaml --data $D/sd_mix \
  --hidden-states-cache $D/cache_mix_eagle3_bf16 --epochs 4 --output-dir runs/eagle3_smollm2_mix
date
