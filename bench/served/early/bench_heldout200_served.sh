#!/usr/bin/env bash
# Issue 14: the served stage of the committed bench (after bench_smollm2_heldout200.sh). Merges
# the two shards again and serves every chain drafter with vLLM (the separate venv of
# scripts/setup_vllm_venv.sh): plain, ngram, draft LM, Medusa, EAGLE-1 and EAGLE-3 servers, the
# first 16 held-out prompts, 1, 4 and 16 requests in flight. Run it on an otherwise idle machine.
RUNS=${RUNS:-runs}  # scratch: shards
VLLM_PYTHON=${DRAFTSMITH_VLLM_PYTHON:-$HOME/.cache/draftsmith/vllm-venv/bin/python}
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
date
draftsmith bench --merge $RUNS/heldout200/s0.json $RUNS/heldout200/s1.json \
  --out bench/bench_command/bench_smollm2_heldout200 \
  --training-logs runs/eagle3_smollm2 runs/eagle3_smollm2_mix runs/eagle1_smollm2_mix \
  runs/medusa1_smollm2_mix runs/distill_smollm2_mix \
  --vllm-python $VLLM_PYTHON --served-limit 16 --served-concurrency 1 4 16
date
