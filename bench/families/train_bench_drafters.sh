#!/usr/bin/env bash
# Issue 14: the drafters the 200-prompt bench needs besides EAGLE-3, trained side by side on the
# same data as runs/eagle3_smollm2_mix (alpaca 1,800 + 1,232 target-written prompts, answered by
# the target), one thread each, ~22 minutes each. Medusa-1 and EAGLE-1 read the EAGLE-3 cache's
# final layer offline; the draft LM distils online (it needs the target's logits).
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=~/.cache/draftsmith/data
date
# Medusa-1 with one frozen copy of the target's lm_head (1.3M trainable parameters): a first run
# with four own heads (114.6M) made 26 steps in 11 minutes beside the other two and was stopped.
draftsmith train medusa --config recipes/configs/medusa1_smollm2.yaml --data $D/sd_mix \
  --hidden-states offline --hidden-states-cache $D/cache_mix_eagle3_bf16 --threads 1 \
  --share-lm-head --max-minutes 18 --eval-every 1000 --output-dir runs/medusa1_smollm2_mix \
  --overwrite --no-resume --no-progress > logs/train_medusa_mix2.log 2>&1 &
draftsmith train eagle --config recipes/configs/eagle1_smollm2.yaml --data $D/sd_mix \
  --hidden-states offline --hidden-states-cache $D/cache_mix_eagle3_bf16 --threads 1 \
  --max-minutes 22 --output-dir runs/eagle1_smollm2_mix --no-progress > logs/train_eagle1_mix.log 2>&1 &
draftsmith train distill --config recipes/configs/distill_smollm2.yaml --data $D/sd_mix \
  --threads 1 --max-minutes 22 --output-dir runs/distill_smollm2_mix > logs/train_distill_mix.log 2>&1 &
wait
date
# What actually ran (2026-12-01): this file was edited while it ran, and bash, reading on at its
# old offset, launched the distill line a second time at 21:23; that run resumed from step 50 and
# was stopped at step 80 (SIGTERM, 21:31). The final draft was then written from step 80 with:
#   draftsmith train distill --config recipes/configs/distill_smollm2.yaml --data $D/sd_mix \
#     --threads 2 --max-minutes 0.01 --output-dir runs/distill_smollm2_mix
# (step 81: greedy agreement 0.195, simulated τ 1.24). EAGLE-1 ended at its budget (21:22),
# Medusa-1 at 70 steps (19.4 min).
