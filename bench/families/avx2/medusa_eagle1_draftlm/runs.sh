#!/bin/bash
# Issue 25 item 4 on an AVX2-only CPU (fp32: bf16 is emulated here): Medusa-1, EAGLE-1, the draft
# LM and Medusa-2 trained on the data of bench/families/avx2/p_eagle_dflash/runs.sh (1,000 Alpaca training prompts
# answered by the target) for the same 15 minutes as its EAGLE-3 reference run, each alone on the
# 2 cores, every one with an 8,192-token draft vocabulary; Medusa-1 and EAGLE-1 read the EAGLE-3
# run's offline cache (it holds the last layer), Medusa-2 and the draft LM run the target online
# (Medusa-2 trains it; the draft LM distils its logits). Each family keeps its config's settings.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=~/.cache/draftsmith/data
R=$RUNS
M=${MINUTES:-15}
DATA=$D/alpaca1000_train_sd_smollm2_fp32_greedy128.jsonl
CACHE=$D/cache_sd1000_eagle3
COMMON="--data $DATA --max-minutes $M --save-every 100 --val-samples 32 --draft-vocab-size 8192"
python recipes/medusa.py --config recipes/configs/medusa1_smollm2.yaml $COMMON --eval-every 50 \
   --hidden-states offline --hidden-states-cache $CACHE --output-dir $R/medusa1_avx2_${M}min
python recipes/eagle.py --config recipes/configs/eagle1_smollm2.yaml $COMMON --eval-every 50 \
   --hidden-states offline --hidden-states-cache $CACHE --output-dir $R/eagle1_avx2_${M}min
# Validation runs the target over the held-out records (a minute each): every 100 steps.
python recipes/distill.py --config recipes/configs/distill_smollm2.yaml $COMMON --eval-every 100 \
   --output-dir $R/distill_avx2_${M}min
python recipes/medusa.py --config recipes/configs/medusa2_smollm2.yaml $COMMON --eval-every 50 \
   --output-dir $R/medusa2_avx2_${M}min
echo TRAIN25_DONE
# Medusa-1's config trains 2 epochs: here that ended after 5.0 of its 15 minutes (242 steps), so
# it trains again with EAGLE-3's 6 epochs, which the 15 minutes cut short like the others.
python recipes/medusa.py --config recipes/configs/medusa1_smollm2.yaml $COMMON --eval-every 50 \
   --hidden-states offline --hidden-states-cache $CACHE --epochs 6 --output-dir $R/medusa1_avx2_${M}min_e6
echo MEDUSA1_E6_DONE
