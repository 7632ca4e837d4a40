#!/usr/bin/env bash
# Every shape of a quickstart job's drafter on all 32 shipped held-out prompts, greedy and at
# T = 0.7, in two 1-thread shards merged (one per core): the EAGLE-3 chain (k = 2), its 5-node
# tree, n-gram lookup and auto (the per-step decision, calibrated on the job's validation
# prompts), with plain decoding in bf16 and fp32 interleaved.
#
#   bench/auto_decision/eval32.sh JOB_DIR WORKDIR OUTDIR
#
# JOB_DIR: the quickstart's --out-dir (runs/quickstart); WORKDIR: for the shards' files;
# OUTDIR: where eval32_t0.json, eval32_t0.7.json and the report go.
set -euo pipefail
JOB=$1
WORK=$2
OUT=$3
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$WORK" "$OUT"
D="$JOB/eagle3/best"
[ -f "$D/config.json" ] || D="$JOB/eagle3/drafter"
for T in 0 0.7; do
  args=(--drafter "eagle=$D" "eagle-tree=$D" ngram "auto:eagle-tree=$D" --dtype bfloat16 --k 2
        --tree-topk 4 --tree-total-tokens 5 --auto-k 4 --auto-nodes 16
        --calibration-prompts "$JOB/data/val_prompts.jsonl" --max-new-tokens 128
        --temperature "$T" --threads 1)
  draftsmith evaluate "${args[@]}" --shard 0/2 --out "$WORK/t$T.s0.json" > "$WORK/t$T.s0.log" 2>&1 &
  draftsmith evaluate "${args[@]}" --shard 1/2 --out "$WORK/t$T.s1.json" > "$WORK/t$T.s1.log" 2>&1
  wait
  draftsmith evaluate --merge "$WORK/t$T.s0.json" "$WORK/t$T.s1.json" --out "$OUT/eval32_t$T.json" \
    > "$WORK/t$T.merge.log" 2>&1
done
cp "$D"/calibration*.png "$OUT/" 2>/dev/null || true
python "$HERE/../../scripts/auto_report.py" "$OUT"/eval32_t0.json "$OUT"/eval32_t0.7.json --out "$OUT"
