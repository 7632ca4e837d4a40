#!/bin/bash
# A/B at equal minutes: TTT steps 2 vs 3 on the a517fb7 job's data, one thread each, side by side.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
cd $RUNS/fresh4/draftsmith
for T in 2 3; do
  draftsmith train eagle --version 3 --hidden-states offline --ttt-steps $T --ttt-decay 0.8 --fc-norm --norm-output --lr 0.0006 --warmup-ratio 0.03 --max-grad-norm 0.5 --batch-size 4 --grad-accum 2 --max-length 512 --keep-checkpoints 2 --target-dtype bf16 --mixed-precision bf16 --hidden-states-cache runs/quickstart/data/cache --draft-vocab-size 8192 --val-data runs/quickstart/data/val_answers.jsonl --val-samples 32 --epochs 2 --fit-schedule --eval-every 60 --save-every 60 --seed 0 --output-dir $RUNS/s46/ab/ttt$T --max-minutes 16 --threads 1 --no-progress > $RUNS/s46/ab/ttt$T.log 2>&1 &
done
wait
