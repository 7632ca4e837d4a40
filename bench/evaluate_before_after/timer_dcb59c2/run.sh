#!/bin/bash
# Timer change before/after: evaluate the same drafter on the first 16 held-out prompts, chain k=2,
# bf16, 2 threads; before = the fresh clone at dcb59c2 (its venv), after = the working checkout.
# Order: before, after, before, after (each a full evaluate run), nothing else running.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
set -u
D=$RUNS/qs_s3/draftsmith/runs/quickstart/eagle3/best
export DRAFTSMITH_CACHE=$RUNS/qs_s3/cache
O=$RUNS/s3/timer
mkdir -p $O
grep -o -w 'avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for r in 1 2; do
  (cd $RUNS/qs_s3/draftsmith && $RUNS/qs_s3/venv/bin/draftsmith evaluate --drafter eagle=$D \
     --dtype bfloat16 --k 2 --limit 16 --max-new-tokens 128 --threads 2 --no-resume \
     --out $O/before_$r.json > $O/before_$r.log 2>&1); echo "before $r rc=$?"; date
  (cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)" && draftsmith evaluate --drafter eagle=$D --dtype bfloat16 --k 2 --limit 16 \
     --max-new-tokens 128 --threads 2 --no-resume --out $O/after_$r.json > $O/after_$r.log 2>&1)
  echo "after $r rc=$?"; date
done
