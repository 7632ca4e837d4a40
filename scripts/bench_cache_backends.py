"""Time ``draftsmith data cache`` with ``--backend hf`` and ``--backend vllm`` on the same data.

One subprocess per backend, in the order given; the vLLM run holds ``/tmp/vllm.lock`` (one vLLM
process per machine). Reports, per backend, what the command prints (tokens, build seconds,
tokens/s of the compute-and-write part, which excludes model load and vLLM's engine start), the
whole command's wall time, and the load average before and after (the CPU machines are shared).

Usage::

    python scripts/bench_cache_backends.py --data ~/.cache/draftsmith/data/sd1800_bf16_tok \\
        --limit 512 --order hf,vllm --out /tmp/timing.json
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

LINE = re.compile(r"(\d+) tokens, .* in ([\d.]+)s, (\d+) tokens/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="tokenized data (as data cache takes it)")
    ap.add_argument("--limit", type=int, default=512, help="first N samples")
    ap.add_argument("--order", default="hf,vllm", help="backends, comma-separated")
    ap.add_argument("--vllm-python", default=os.environ.get("DRAFTSMITH_VLLM_PYTHON"))
    ap.add_argument("--out", default=None, help="results JSON")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_cache_"))
    common = ["draftsmith", "data", "cache", "--data", args.data, "--limit", str(args.limit)]
    common += ["--preset", "eagle3", "--dtype", "bf16", "--target-dtype", "fp32", "--no-progress"]
    runs = {}
    try:
        for backend in args.order.split(","):
            cmd = [*common, "--out", str(work / backend), "--backend", backend]
            if backend == "vllm" and args.vllm_python:
                cmd += ["--vllm-python", args.vllm_python]
            load_before = os.getloadavg()
            with open("/tmp/vllm.lock", "w") as lock:
                if backend == "vllm":
                    fcntl.flock(lock, fcntl.LOCK_EX)
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                wall = time.perf_counter() - t0
            lines = [x for x in proc.stdout.splitlines() if "tokens/s" in x]
            m = LINE.search(lines[0]) if lines else None
            runs[backend] = {
                "command": cmd,
                "returncode": proc.returncode,
                "error": proc.stderr[-2000:] if proc.returncode else None,
                "wall_seconds": wall,
                "tokens": int(m.group(1)) if m else None,
                "build_seconds": float(m.group(2)) if m else None,
                "tokens_per_s_forward": int(m.group(3)) if m else None,
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(),
            }
            print(backend, json.dumps({k: runs[backend][k] for k in list(runs[backend])[3:]}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"data": args.data, "limit": args.limit, "order": args.order, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
