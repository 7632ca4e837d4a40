#!/bin/bash
# Issue 24, item 5 on the AVX512-BF16 CPU: DFlash (the shipped dflash_smollm2.yaml: 2 layers,
# block 8, 8,192-token draft vocabulary) trained on the EAGLE-3 reference's data, offline cache and
# validation records for its 27.8 training minutes, alone on both cores, bf16 autocast; epochs
# sized from the measured step rate so the schedule ends near the budget (1.05 s a step here: 6.8 epochs).
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=$RUNS/qs60_alpaca/data
date
draftsmith train dflash --config recipes/configs/dflash_smollm2.yaml \
  --data $D/answers.jsonl --hidden-states-cache $D/cache --val-data $D/val_answers.jsonl \
  --target-dtype bf16 --mixed-precision bf16 --max-minutes 27.81 --epochs ${EPOCHS:-6.8} \
  --output-dir $RUNS/eq/dflash
date
echo DFLASH_TRAIN_DONE
