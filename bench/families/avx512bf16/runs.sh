#!/bin/bash
# Issue 24: P-EAGLE and DFlash trained on the reference EAGLE-3 run's data (bench/early_decoding/ref_data_chain.sh)
# for its 25 minutes, alone on the 2 cores, then evaluated on the same 20 held-out prompts
# (greedy, bf16 target), each at its own k, one interleaved plain baseline per evaluate run.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
R=$RUNS
python recipes/eagle.py --config recipes/configs/peagle_smollm2.yaml --max-minutes 25 \
   --output-dir $R/peagle_sd1800_25min
python recipes/dflash.py --config recipes/configs/dflash_smollm2.yaml --max-minutes 25 \
   --output-dir $R/dflash_sd1800_25min
echo TRAIN_DONE
