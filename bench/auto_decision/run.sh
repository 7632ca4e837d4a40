#!/usr/bin/env bash
# The per-step decision (auto) measured as a new user meets it: README command 1 in a fresh clone
# (new venv, empty cache), then every shape of its drafter on all 32 shipped held-out prompts,
# greedy and at T = 0.7, in two 1-thread shards merged (one per core).
#
#   bench/auto_decision/run.sh COMMIT WORKDIR [OUTDIR]
#
# COMMIT: what to check out; WORKDIR: where the clone, venv, cache and job go (outside the
# repository); OUTDIR: where the result files are copied (default: this folder, as
# quickstart_COMMIT/ and eval32_t*.json). Nothing else should run on the machine meanwhile.
set -euo pipefail
COMMIT=$1
WORK=$2
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${3:-$HERE}
REPO=$(cd "$HERE/../.." && pwd)
rm -rf "$WORK" && mkdir -p "$WORK"
git clone -q "$REPO" "$WORK/clone" && cd "$WORK/clone" && git checkout -q "$COMMIT"
python -m venv "$WORK/venv" && . "$WORK/venv/bin/activate"
export DRAFTSMITH_CACHE="$WORK/cache"
# README command 1, unchanged (CPU line).
start=$(date +%s)
pip install -q "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu \
  && pip install -q -e ".[dev]" && draftsmith quickstart > "$WORK/quickstart.log" 2>&1
echo "README command 1: $(( $(date +%s) - start )) s" | tee -a "$WORK/quickstart.log"
JOB="$WORK/clone/runs/quickstart"
D="$JOB/eagle3/best"
[ -f "$D/config.json" ] || D="$JOB/eagle3/drafter"
mkdir -p "$OUT/quickstart_$COMMIT"
cp "$JOB/eval.json" "$JOB/quickstart.json" "$JOB/summary.md" "$OUT/quickstart_$COMMIT/"
cp "$D"/calibration*.png "$OUT/quickstart_$COMMIT/" 2>/dev/null || true
"$HERE/eval32.sh" "$JOB" "$WORK/eval32" "$OUT"
