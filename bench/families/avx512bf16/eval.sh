#!/bin/bash
# Issue 24: evaluate P-EAGLE and DFlash (bench/families/avx512bf16/runs.sh) on the reference run's 20 held-out
# prompts (bf16 target, greedy), each against one interleaved plain baseline, then export both
# and serve them with vLLM on the first 16 of those prompts.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
VLLM_PYTHON=${DRAFTSMITH_VLLM_PYTHON:-$HOME/.cache/draftsmith/vllm-venv/bin/python}
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
R=$RUNS
P=$R/peagle_sd1800_25min/best
D=$R/dflash_sd1800_25min/best
E="draftsmith evaluate --prompts $ALPACA --split heldout --limit 20 \
   --max-new-tokens 128 --dtype bfloat16"
$E --k 4 --drafter peagle=$P dflash=$D --out $R/eval24/k4.json
$E --k 7 --drafter dflash=$D --out $R/eval24/dflash_k7.json
draftsmith export --format peagle --checkpoint $P --out $R/export24/peagle --speculative-tokens 4 --overwrite
draftsmith export --format dflash --checkpoint $D --out $R/export24/dflash --overwrite
V=$VLLM_PYTHON
C="scripts/vllm_check.py --prompts $ALPACA --split heldout --limit 16 \
   --max-new-tokens 128 --dtype bfloat16"
$V $C --method eagle3 --parallel-drafting --draft $R/export24/peagle --k 4 --out $R/eval24/vllm_peagle_k4.json || true
$V $C --method dflash --draft $R/export24/dflash --k 7 --out $R/eval24/vllm_dflash_k7.json || true
echo EVAL_DONE
