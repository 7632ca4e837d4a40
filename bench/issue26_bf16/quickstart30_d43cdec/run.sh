#!/bin/bash
cd /work/runs/fresh/draftsmith
source /work/runs/fresh/venv/bin/activate
date
start=$(date +%s)
pip install -q torch==2.13.0 && pip install -q -e ".[dev]" 2>&1 | grep -v WARNING
echo "install s: $(( $(date +%s) - start ))"
date
draftsmith quickstart
echo "rc=$?"
date
