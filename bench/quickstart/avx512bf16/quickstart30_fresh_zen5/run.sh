#!/bin/bash
# Issue 26's 30-minute goal: README command 1, unchanged, in a fresh clone of main with
# no development data beside it, its own venv and an empty draftsmith cache, alone on the machine.
RUNS=${RUNS:-runs}  # scratch: trained drafters, shards, clones
set -u
F=$RUNS/fresh8
rm -rf $F && mkdir -p $F && cd $F
git clone -q "${REPO:-$OLDPWD}" draftsmith && cd draftsmith
python -m venv $F/venv && source $F/venv/bin/activate
export DRAFTSMITH_CACHE=$F/cache  # a fresh machine's empty cache
git log --oneline -1
grep -m1 "cpu family" /proc/cpuinfo
date
start=$(date +%s)
pip install -q torch==2.13.0 2>&1 | grep -v WARNING; pip install -q -e ".[dev]" 2>&1 | grep -v WARNING
echo "install s: $(( $(date +%s) - start ))"
date
draftsmith quickstart
echo "rc=$?"
date
