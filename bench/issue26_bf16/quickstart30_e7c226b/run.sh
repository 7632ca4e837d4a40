#!/bin/bash
cd /work/runs/fresh7/draftsmith
source /work/runs/fresh7/venv/bin/activate
export DRAFTSMITH_CACHE=/work/runs/fresh7/cache  # a fresh machine's empty cache
git log --oneline -1
date
start=$(date +%s)
pip install -q torch==2.13.0 2>&1 | grep -v WARNING; pip install -q -e ".[dev]" 2>&1 | grep -v WARNING
echo "install s: $(( $(date +%s) - start ))"
date
draftsmith quickstart
echo "rc=$?"
date
