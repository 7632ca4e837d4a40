#!/bin/bash
# Issue 26 item 1 for the distill and Medusa recipes: their equivalent of EAGLE's LK loss
# (lk_hybrid: λ KL + (1 - λ) TV, λ = exp(-3 α)) against their default KL, at equal minutes.
# Each pair trains side by side, one thread each, for the same minutes on the same data (the
# 60-minute Alpaca quickstart's records and bf16 cache, validated on its 64 validation answers),
# so both runs see the same machine and load. Then every best/ is evaluated on the first 100
# held-out Alpaca prompts (bf16 target, greedy, chain k = 3, 64 new tokens, τ only), two at a time,
# one thread each, and the pairs are compared prompt by prompt (paired_tau.py).
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=${DATA:-$RUNS/qs60_sampled_qs/data}
O=${OUT:-$RUNS/lk_eq}
M=${MINUTES:-10}
mkdir -p $O
base="--max-minutes $M --fit-schedule --threads 1 --seed 0 --target-dtype bf16 --mixed-precision bf16 --hidden-states offline --hidden-states-cache $D/cache --val-data $D/val_answers.jsonl --keep-checkpoints 1"
distill="draftsmith train distill $base --draft-init pruned --draft-layers 0 --draft-vocab-size 8192 --batch-size 8 --lr 5e-4 --max-length 512 --val-samples 32 --epochs 0.27 --eval-every 45 --save-every 45"
medusa="draftsmith train medusa $base --stage medusa1 --num-heads 4 --draft-vocab-size 8192 --head-labels target_soft --batch-size 4 --grad-accum 2 --lr 1e-3 --max-length 512 --val-samples 64 --epochs 3 --eval-every 400 --save-every 400"
date
$distill --loss fkl --output-dir $O/distill_fkl > $O/distill_fkl.log 2>&1 &
$distill --loss lk_hybrid --output-dir $O/distill_lk > $O/distill_lk.log 2>&1
wait
date
$medusa --head-loss kl --output-dir $O/medusa_kl > $O/medusa_kl.log 2>&1 &
$medusa --head-loss lk_hybrid --output-dir $O/medusa_lk > $O/medusa_lk.log 2>&1
wait
date
ev="--prompts $ALPACA --split heldout --limit 100 --dtype bfloat16 --k 3 --max-new-tokens 64 --no-baseline --threads 1"
draftsmith evaluate $ev --drafter draft-lm=$O/distill_fkl/best --out $O/eval_distill_fkl.json > $O/eval_distill_fkl.log 2>&1 &
draftsmith evaluate $ev --drafter draft-lm=$O/distill_lk/best --out $O/eval_distill_lk.json > $O/eval_distill_lk.log 2>&1
wait
draftsmith evaluate $ev --drafter medusa=$O/medusa_kl/best --out $O/eval_medusa_kl.json > $O/eval_medusa_kl.log 2>&1 &
draftsmith evaluate $ev --drafter medusa=$O/medusa_lk/best --out $O/eval_medusa_lk.json > $O/eval_medusa_lk.log 2>&1
wait
date
echo done > $O/done
