#!/bin/bash
# Issues 24/25/26 on an AVX2-only CPU (no AVX512-BF16: bf16 is emulated here, so training and the
# data run in fp32, `auto`): one data set, then EAGLE-3, P-EAGLE and DFlash for the same minutes,
# each alone on the 2 cores, then one bench of all three on 100 held-out prompts (below).
# Data: 1,000 Alpaca training prompts answered by the target (fp32 greedy, 128 tokens); Alpaca's
# licence keeps the data out of the repository (docs/data.md).
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=~/.cache/draftsmith/data
R=$RUNS
M=${MINUTES:-15}
draftsmith data distill --input $ALPACA --split train --limit 1000 \
   --dtype float32 --max-new-tokens 128 --batch-size 64 --device cpu \
   --output $D/alpaca1000_train_sd_smollm2_fp32_greedy128.jsonl
draftsmith data tokenize --input $D/alpaca1000_train_sd_smollm2_fp32_greedy128.jsonl \
   --output $D/sd1000_fp32_tok --max-length 512
draftsmith data cache --data $D/sd1000_fp32_tok --preset eagle3 \
   --target-dtype auto --dtype bf16 --max-length 512 --draft-vocab-size 8192 \
   --out $D/cache_sd1000_eagle3
# Nothing else may run while the drafters train: wait for a vLLM venv being set up beside the data.
while [ -e $RUNS/vllm_setup.running ]; do sleep 5; done
COMMON="--data $D/alpaca1000_train_sd_smollm2_fp32_greedy128.jsonl --hidden-states-cache $D/cache_sd1000_eagle3 --max-minutes $M --eval-every 50 --save-every 100"
python recipes/eagle.py --config recipes/configs/eagle3_smollm2.yaml $COMMON --output-dir $R/eagle3_avx2_${M}min
python recipes/eagle.py --config recipes/configs/peagle_smollm2.yaml $COMMON --output-dir $R/peagle_avx2_${M}min
python recipes/dflash.py --config recipes/configs/dflash_smollm2.yaml $COMMON --output-dir $R/dflash_avx2_${M}min
echo TRAIN_DONE
