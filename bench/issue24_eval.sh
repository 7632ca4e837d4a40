#!/bin/bash
# Issue 24: evaluate P-EAGLE and DFlash (bench/issue24_runs.sh) on the reference run's 20 held-out
# prompts (bf16 target, greedy), each against one interleaved plain baseline, then export both
# and serve them with vLLM on the first 16 of those prompts.
set -e
cd /work/main
R=/work/runs
P=$R/peagle_sd1800_25min/best
D=$R/dflash_sd1800_25min/best
E="draftsmith evaluate --prompts ../shared/data/alpaca_2k.jsonl --split heldout --limit 20 \
   --max-new-tokens 128 --dtype bfloat16"
$E --k 4 --drafter peagle=$P dflash=$D --out $R/eval24/k4.json
$E --k 7 --drafter dflash=$D --out $R/eval24/dflash_k7.json
draftsmith export --format peagle --checkpoint $P --out $R/export24/peagle --speculative-tokens 4 --overwrite
draftsmith export --format dflash --checkpoint $D --out $R/export24/dflash --overwrite
V=/work/venvs/vllm/bin/python
C="scripts/vllm_check.py --prompts ../shared/data/alpaca_2k.jsonl --split heldout --limit 16 \
   --max-new-tokens 128 --dtype bfloat16"
$V $C --method eagle3 --parallel-drafting --draft $R/export24/peagle --k 4 --out $R/eval24/vllm_peagle_k4.json || true
$V $C --method dflash --draft $R/export24/dflash --k 7 --out $R/eval24/vllm_dflash_k7.json || true
echo EVAL_DONE
