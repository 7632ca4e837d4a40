#!/bin/bash
# DFlash with a draft vocabulary (issue 24/25): the 15-minute DFlash drafter of issue 24
# (bench/families/avx2/p_eagle_dflash/runs.sh) as trained (full vocabulary) and with the 8,192-token draft
# vocabulary of its training data (add_draft_vocab.py: the same weights, the head restricted to
# those rows), benched side by side on the first 40 held-out Alpaca prompts at k = 7 = B - 1 (the
# k vLLM serves DFlash with), fp32, one thread per shard, two shards; then served by vLLM.
# Needs an idle machine.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
VLLM_PYTHON=${DRAFTSMITH_VLLM_PYTHON:-$HOME/.cache/draftsmith/vllm-venv/bin/python}
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=~/.cache/draftsmith/data
R=$RUNS
O=$R/i26/bench_dflash_vocab
mkdir -p $O
[ -e $R/i26/dflash_15min_vocab8192/config.json ] || python bench/parallel/dflash_vocab/add_draft_vocab.py \
   $R/dflash_avx2_15min/best $D/cache_sd1000_eagle3 $R/i26/dflash_15min_vocab8192 --size 8192
python scripts/bench_draft_vocab.py --drafters dflash --dtypes float32 --threads 1 --reps 30 \
   --out bench/parallel/dflash_vocab/step_cost_avx2_fp32.json
DR="dflash=$R/dflash_avx2_15min/best dflash=$R/i26/dflash_15min_vocab8192"
B="draftsmith bench --drafter $DR --k 7 --prompts $ALPACA --split heldout \
   --limit 40 --max-new-tokens 64 --dtype float32 --temperatures 0 --threads 1"
$B --shard 0/2 --out $O/k7_s0 > $O/k7_s0.log 2>&1 &
$B --shard 1/2 --out $O/k7_s1 > $O/k7_s1.log 2>&1
wait
draftsmith bench --merge $O/k7_s0.json $O/k7_s1.json --out $O/k7 \
   --cost-profile bench/cpu_costs/forward_cost_avx2_fp32_1thread.json \
   --vllm-python $VLLM_PYTHON --served-concurrency 1 --served-limit 16 --no-served-schedule
echo BENCH_DONE
