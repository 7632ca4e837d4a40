#!/usr/bin/env bash
# The scale check: one prepared run on a lent GPU (<= 8 minutes), one JSON. Thin wrapper of
# scripts/gpu_scale_check.py (its docstring and docs/gpu.md, "The scale check", say what each
# stage checks; --help lists the options).
#
#   bash scripts/gpu_scale_check.sh --out bench/scale/gpu_scale_check_cuda.json \
#       --commit "<git rev-parse HEAD here>[-dirty]"       # a device machine: no .git there
#   bash scripts/gpu_scale_check.sh --device cpu --quick --out /tmp/scale.json   # the rehearsal
#
# Nothing is downloaded: the 8B target is random bf16 weights made on the GPU, the multi-process
# stages use a tiny target made on the fly. Where draftsmith is not installed (a device machine
# gets a copy of the working tree), the tree itself is made importable as `draftsmith` through
# links in a temp folder; the third-party packages must be there (docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
python=${PYTHON:-python}
links=""
if ! "$python" -c "import draftsmith.train" 2>/dev/null; then
  links=$(mktemp -d "${TMPDIR:-/tmp}/draftsmith_src.XXXXXX")
  mkdir "$links/draftsmith"
  for part in train heads recipes; do ln -s "$PWD/$part" "$links/draftsmith/$part"; done
  export PYTHONPATH="$links${PYTHONPATH:+:$PYTHONPATH}"
fi
"$python" scripts/gpu_scale_check.py "$@"
rc=$?
[ -n "$links" ] && rm -rf "$links"
exit $rc
