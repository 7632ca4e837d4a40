#!/bin/bash
# Issue 26, the shape of the data at equal compute (2026-12-03, AVX2 CPU, fp32): what ran, in order.
# Reference: EAGLE-3.1 on 1,000 Alpaca training prompts x one greedy answer (<= 128 tokens),
# 301 of the 726-step schedule (bench/training_choices/avx2/runs.sh: eagle31_301, eval_eagle31.json).
# The two variants spend about the same generated tokens on 500 of those prompts (every other
# line of the length-ordered answer file, $RUNS/i26b/sampled/greedy500.jsonl):
#   500x2:   the greedy answer + one answer sampled at T = 0.7 (ids + 100000 keep the id % 10 split)
#   long500: one greedy answer of up to 256 tokens
# Both trained beside each other with one thread each (steps, not minutes, are compared; the
# long run's steps are scaled to the reference's padded positions: equal_compute_steps.py).
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
set -e
D=~/.cache/draftsmith/data
R=$RUNS/i26b
O=$RUNS/i27
EV="--k 3 --prompts $ALPACA --split heldout --max-new-tokens 64 --dtype float32 --no-baseline --no-reference-plain --threads 1"
CFG="python recipes/eagle.py --config recipes/configs/eagle3_smollm2.yaml --max-minutes 90 --threads 1"

# 500 x 2: sampled answers
draftsmith data distill --input $R/sampled_prompts.jsonl --split all --dtype float32 --max-new-tokens 128 \
   --batch-size 64 --temperature 0.7 --seed 1 --threads 1 --output $R/sampled/sampled500_t07.jsonl
draftsmith data tokenize --input $R/sampled --output $D/sd500x2_tok --max-length 512
draftsmith data cache --data $D/sd500x2_tok --preset eagle3 --target-dtype auto --dtype bf16 \
   --max-length 512 --draft-vocab-size 8192 --threads 1 --out $D/cache_sd500x2_eagle3
$CFG --eval-every 50 --save-every 100 --max-steps 726 --stop-after-steps 301 --data $R/sampled \
   --hidden-states-cache $D/cache_sd500x2_eagle3 --output-dir $O/eagle31_500x2
draftsmith evaluate --drafter eagle=$O/eagle31_500x2/best $EV --limit 100 --out bench/training_choices/avx2/eval_500x2.json

# long500: longer answers
mkdir -p $O/long
draftsmith data distill --input $R/sampled/greedy500.jsonl --split all --dtype float32 --max-new-tokens 256 \
   --batch-size 64 --threads 1 --output $O/long/long500_g256.jsonl
draftsmith data tokenize --input $O/long --output $D/long500_tok --max-length 512
draftsmith data cache --data $D/long500_tok --preset eagle3 --target-dtype auto --dtype bf16 \
   --max-length 512 --draft-vocab-size 8192 --threads 1 --out $D/cache_long500_eagle3
python bench/training_choices/avx2/equal_compute_steps.py $D/sd1000_fp32_tok $D/long500_tok > bench/training_choices/avx2/equal_compute_long500.json
$CFG --eval-every 25 --save-every 50 --max-steps 430 --stop-after-steps 178 --data $O/long \
   --hidden-states-cache $D/cache_long500_eagle3 --output-dir $O/eagle31_long500
draftsmith evaluate --drafter eagle=$O/eagle31_long500/best $EV --limit 100 --out bench/training_choices/avx2/eval_long500.json

# T = 0.7, first 30 prompts, one seed: the reference and 500x2
EV7="$EV --limit 30 --temperature 0.7 --seed 0"
draftsmith evaluate --drafter eagle=$RUNS/i26/eagle31_301/best $EV7 --out bench/training_choices/avx2/eval_t07_eagle31.json
draftsmith evaluate --drafter eagle=$O/eagle31_500x2/best $EV7 --out bench/training_choices/avx2/eval_t07_500x2.json
for V in 500x2 long500; do
  python bench/training_choices/avx2/paired_tau.py bench/training_choices/avx2/eval_eagle31.json bench/training_choices/avx2/eval_$V.json
done
python bench/training_choices/avx2/paired_tau.py bench/training_choices/avx2/eval_t07_eagle31.json bench/training_choices/avx2/eval_t07_500x2.json

# The third 30-minute README run's best/ on all 32 held-out quickstart prompts
draftsmith evaluate --drafter eagle=/tmp/qs_fresh3/runs/quickstart/eagle3/best --k 3 --max-new-tokens 128 --dtype float32 \
   --no-baseline --no-reference-plain --threads 1 --out bench/quickstart/avx2/quickstart30_3acf1bb/eval32_fp32_tau.json
