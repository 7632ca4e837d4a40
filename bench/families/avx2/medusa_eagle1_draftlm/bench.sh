#!/bin/bash
# Issue 25 item 4 on an AVX2-only CPU: the drafters of bench/families/avx2/medusa_eagle1_draftlm/runs.sh and the EAGLE-3
# reference of bench/families/avx2/p_eagle_dflash/runs.sh (15 training minutes each, one data set) benched on the
# first 60 held-out Alpaca prompts, fp32 target, greedy and T = 0.7 (first 20 prompts), chains at
# k = 3 and the EAGLE-2 / Medusa trees of 8 nodes (a 24-node tree costs 3.3 plain steps in fp32
# here), one interleaved plain baseline, two shards of one thread each (one per core). Medusa-2
# changes the target, so its heads are benched separately against its own fine-tuned target
# (`target/`), whose plain decoding is the baseline there.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
ALPACA=${ALPACA:-alpaca_2k.jsonl}  # the Alpaca prompts: not shipped (docs/data.md)
VLLM_PYTHON=${DRAFTSMITH_VLLM_PYTHON:-$HOME/.cache/draftsmith/vllm-venv/bin/python}
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
R=$RUNS
M=${MINUTES:-15}
O=$R/bench25
mkdir -p $O
P="--prompts $ALPACA --split heldout --max-new-tokens 64 --dtype float32 \
   --temperatures 0 0.7 --sampled-limit 20 --threads 1 --k 3 --tree-total-tokens 8"
DR="medusa=$R/medusa1_avx2_${M}min_e6/heads medusa-tree=$R/medusa1_avx2_${M}min_e6/heads \
   eagle=$R/eagle1_avx2_${M}min/best draft-lm=$R/distill_avx2_${M}min/best \
   eagle=$R/eagle3_avx2_${M}min/best eagle-tree=$R/eagle3_avx2_${M}min/best"
draftsmith bench --drafter $DR $P --limit 60 --shard 0/2 --out $O/s0 > $O/s0.log 2>&1 &
draftsmith bench --drafter $DR $P --limit 60 --shard 1/2 --out $O/s1 > $O/s1.log 2>&1
wait
draftsmith bench --merge $O/s0.json $O/s1.json --out $O/all --cost-profile bench/cpu_costs/forward_cost_avx2_fp32_1thread.json \
   --training-logs $R/medusa1_avx2_${M}min_e6 $R/eagle1_avx2_${M}min $R/distill_avx2_${M}min $R/eagle3_avx2_${M}min
D2="medusa=$R/medusa2_avx2_${M}min/heads medusa-tree=$R/medusa2_avx2_${M}min/heads"  # Medusa-2 keeps no best/: its heads go with its final target
draftsmith bench --drafter $D2 $P --limit 30 --shard 0/2 --out $O/m2_s0 --target $R/medusa2_avx2_${M}min/target > $O/m2_s0.log 2>&1 &
draftsmith bench --drafter $D2 $P --limit 30 --shard 1/2 --out $O/m2_s1 --target $R/medusa2_avx2_${M}min/target > $O/m2_s1.log 2>&1
wait
draftsmith bench --merge $O/m2_s0.json $O/m2_s1.json --out $O/medusa2 --cost-profile bench/cpu_costs/forward_cost_avx2_fp32_1thread.json \
   --training-logs $R/medusa2_avx2_${M}min
echo BENCH25_DONE
# vLLM serves every chain export of the first run (Medusa-1, EAGLE-1, the draft LM, EAGLE-3) at one
# request in flight: τ against ours and outputs against plain vLLM.
draftsmith bench --merge $O/s0.json $O/s1.json --out $O/served --cost-profile bench/cpu_costs/forward_cost_avx2_fp32_1thread.json \
   --vllm-python $VLLM_PYTHON --served-concurrency 1 --served-limit 16 --no-served-schedule
echo SERVED25_DONE
# 2026-12-03: Medusa-2 served by vLLM (its heads with its own merged target, which the bench's
# merged report names), 16 prompts, one request in flight.
draftsmith bench --merge $O/m2_s0.json $O/m2_s1.json --out $O/served_m2 --cost-profile bench/cpu_costs/forward_cost_avx2_fp32_1thread.json \
   --vllm-python $VLLM_PYTHON --served-concurrency 1 --served-limit 16 --no-served-schedule
echo SERVED_M2_DONE
