#!/usr/bin/env bash
# Issue 12, more distinct data, second half (eagle3_more_data.sh makes the 1,200 Magpie prompts;
# its later stages were replaced by these, to fit the session): answer the new prompts (greedy, 128 tokens),
# cache the hidden states of them plus the 1,800 alpaca training answers, and continue the
# shipped EAGLE-3 drafter (runs/eagle3_smollm2/best, 53.8 min of training) on the union for at
# most 40 more minutes.
set -euo pipefail
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=~/.cache/draftsmith/data
while pgrep -f "draftsmith data prompts" > /dev/null; do sleep 5; done  # part 1's Magpie stage
date
draftsmith data distill --input $D/magpie1200_s1_prompts.jsonl --dtype float32 \
  --max-new-tokens 128 --batch-size 64 --threads 2 --no-progress \
  --output $D/sd_mix/magpie_s1_sd_smollm2_greedy128.jsonl
cp -f $D/alpaca1800_train_sd_smollm2_bf16_greedy128.jsonl $D/sd_mix/
date
draftsmith data tokenize --input $D/sd_mix --output $D/sd_mix_tok --max-length 512
date
draftsmith data cache --data $D/sd_mix_tok --preset eagle3 --target-dtype bf16 --dtype bf16 \
  --max-length 512 --draft-vocab-size 8192 --threads 2 --no-progress --out $D/cache_mix_eagle3_bf16
date
draftsmith train eagle --config recipes/configs/eagle3_smollm2.yaml --data $D/sd_mix \
  --hidden-states-cache $D/cache_mix_eagle3_bf16 --init-from runs/eagle3_smollm2/best \
  --epochs 3 --lr 3e-4 --max-minutes 40 --output-dir runs/eagle3_smollm2_mix
date
