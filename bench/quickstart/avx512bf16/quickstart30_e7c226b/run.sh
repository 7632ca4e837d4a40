#!/bin/bash
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
cd $RUNS/fresh7/draftsmith
source $RUNS/fresh7/venv/bin/activate
export DRAFTSMITH_CACHE=$RUNS/fresh7/cache  # a fresh machine's empty cache
git log --oneline -1
date
start=$(date +%s)
pip install -q torch==2.13.0 2>&1 | grep -v WARNING; pip install -q -e ".[dev]" 2>&1 | grep -v WARNING
echo "install s: $(( $(date +%s) - start ))"
date
draftsmith quickstart
echo "rc=$?"
date
