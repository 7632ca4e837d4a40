#!/bin/bash
# 1 process x 2 threads vs 2 DDP processes x 1 thread, same global batch (8), same data, 24 steps.
set -x
common="--version 3 --hidden-states offline --target-dtype bf16 --mixed-precision bf16 --ttt-steps 3 --ttt-decay 0.8 --lr 0.0006 --warmup-ratio 0.03 --max-grad-norm 0.5 --batch-size 4 --max-length 512 --hidden-states-cache runs/quickstart/data/cache --draft-vocab-size 8192 --val-samples 31 --eval-every 0 --save-every 0 --seed 0 --max-steps 24 --log-every 4 --overwrite --no-resume"
for rep in 1 2; do
uptime
/usr/bin/time -f "WALL threads2 %e s" draftsmith train eagle $common --grad-accum 2 --threads 2 --output-dir /tmp/dvt/t2_$rep
uptime
/usr/bin/time -f "WALL ddp2 %e s" accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/eagle.py $common --grad-accum 1 --threads 1 --output-dir /tmp/dvt/ddp_$rep
done
