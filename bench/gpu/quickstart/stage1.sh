#!/bin/bash
# GPU quickstart, call 1 of 2 on the lent H200 (no network): install the wheels carried in .whl/
# (what its image lacks: docs/gpu.md "Preparing a GPU machine with no route to PyPI") into
# /tmp/site, and keep the target wheel's first piece in /tmp/w: outside the repository copy, which
# each call replaces, they last while the machine stays warm.
set -x
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -V
python -c "import torch; print(torch.__version__, torch.cuda.is_available())"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -3
mkdir -p /tmp/w && cp .whl/smol.part1 /tmp/w/
PYTHONPATH=/tmp/site python -c "import draftsmith.recipes, transformers, kernels, accelerate; print(transformers.__version__, accelerate.__version__)"
ls /tmp/site/bin/draftsmith /tmp/w
