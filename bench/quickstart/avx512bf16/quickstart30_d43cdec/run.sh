#!/bin/bash
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
cd $RUNS/fresh/draftsmith
source $RUNS/fresh/venv/bin/activate
date
start=$(date +%s)
pip install -q torch==2.13.0 && pip install -q -e ".[dev]" 2>&1 | grep -v WARNING
echo "install s: $(( $(date +%s) - start ))"
date
draftsmith quickstart
echo "rc=$?"
date
