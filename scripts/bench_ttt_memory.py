"""Memory and time of one EAGLE-3 training step at an 8B drafter's widths, by sequence length.

One forward, backward and AdamW step of EAGLE-3's training-time test (7 steps, batch 1) with the
drafter of an 8B Llama (hidden 4096, 32 query / 8 KV heads of 128, intermediate 14336, draft
vocabulary 32k; the target's embedding and head, 128k tokens, shared and frozen), over random
features, every position supervised. Each measurement runs in its own process:

- ``activation_bytes``: the step's peak resident memory minus the resident memory before it,
  when the weights, the target's embedding and head, the gradients and AdamW's state all exist
  (a warm-up step at 64 tokens makes them): what the step itself needs;
- ``peak_bytes``: the process's peak resident memory during the step;
- ``step_s``: the step's wall time, the least of ``--repeats`` steps on the same batch (every
  one in ``step_s_all``);
- ``oom``: the process could not allocate what the step needs under ``--memory-limit-gib``
  (an address-space limit: allocations beyond it fail instead of the machine swapping or the
  kernel killing something else).

Peak resident memory is read from ``/proc/self/status`` (``VmHWM``) after resetting it through
``/proc/self/clear_refs``; glibc is told to return freed blocks at once (``MALLOC_*`` variables),
so the resident size tracks what is allocated.

Rows for today's code come from a Python environment where it is installed (``--today-python``,
e.g. a virtual environment with a checkout of the commit before issue 50 installed): the same
script drives it, and its rows record that code's commit. ``backend: math`` forces PyTorch's math
attention kernel (what CUDA runs for a masked call with grouped heads); ``cpu`` is this CPU's own
choice.

Run (alone on the machine; tens of minutes)::

    python scripts/bench_ttt_memory.py --today-python /path/to/old/venv/bin/python \\
        --out bench/scale/ttt_memory_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCH = REPO / "recipes" / "architectures" / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json"


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    # "5" resets the peak resident set size (VmHWM) to the current one (Linux >= 4.0).
    Path("/proc/self/clear_refs").write_text("5")


def worker(args: argparse.Namespace) -> dict:
    """One measurement in this process (the parent starts one process per row)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from draftsmith.heads.eagle import EagleConfig, build_drafter
    from draftsmith.train.objectives.eagle_ttt import eagle3_ttt_loss
    from draftsmith.train.runinfo import run_info

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.arch.parent)
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(config)
    dtype = torch.bfloat16 if args.target_dtype == "bf16" else torch.float32
    # Only the embedding and the head are used (shared with the drafter, labels): materialise
    # those, the decoder layers stay on the meta device.
    for module in (target.get_input_embeddings(), target.get_output_embeddings()):
        module.to_empty(device="cpu")
        with torch.no_grad():
            module.weight.normal_(0, 0.02)
        module.to(dtype)
    target.requires_grad_(False).eval()
    n = config.num_hidden_layers
    layers = [2, n // 2, n - 3]
    cfg = EagleConfig.from_target(
        config, 3, feature_layers=layers, draft_vocab_size=args.draft_vocab
    )
    drafter = build_drafter(target, cfg, seed=0).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    head = target.get_output_embeddings()
    h = config.hidden_size

    def batch(t: int) -> dict:
        g = torch.Generator().manual_seed(t)
        ids = torch.randint(0, config.vocab_size, (1, t), generator=g)
        hidden = {i: torch.randn(1, t, h, generator=g) for i in [*layers, n]}
        ones = torch.ones_like(ids)
        return {
            "input_ids": ids,
            "attention_mask": ones,
            "loss_mask": ones,
            "hidden_states": hidden,
        }

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.mixed_precision == "bf16")

    def step(b: dict) -> None:
        from contextlib import nullcontext

        kernel = nullcontext()
        if args.backend == "math":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kernel = sdpa_kernel([SDPBackend.MATH])
        with kernel:
            with autocast:
                loss, _ = eagle3_ttt_loss(drafter, b, head, steps=args.steps)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: part of "before"

    step(batch(64))  # allocates the gradients and AdamW's state
    b = batch(args.seq_len)
    before = _status_bytes("VmRSS")
    _reset_peak()
    times = []
    for _ in range(args.repeats):  # the same batch again: the peak is the most of the repeats
        start = time.perf_counter()
        step(b)
        times.append(round(time.perf_counter() - start, 3))
    peak = _status_bytes("VmHWM")
    info = run_info("cpu")
    return {
        "activation_bytes": peak - before,
        "peak_bytes": peak,
        "before_bytes": before,
        "step_s": min(times),  # the least disturbed of the repeats
        "step_s_all": times,
        "git_commit": info["git_commit"],
        "torch": torch.__version__,
        "attention_path": _path_name(drafter),
    }


def _path_name(drafter) -> str | None:
    """The new code's TTT attention implementation for this run's queries (None: today's)."""
    try:
        import torch

        from draftsmith.heads.attention import ttt_attention_path
    except ImportError:
        return None
    return ttt_attention_path(torch.zeros(1, 1, 1, 128, dtype=drafter.dtype))


def _limit(gib: float):
    def apply() -> None:
        size = int(gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (size, size))

    return apply


def run_row(python: str, impl: str, backend: str, seq_len: int, args: argparse.Namespace) -> dict:
    cmd = [
        python,
        __file__,
        "--worker",
        "--backend",
        backend,
        "--seq-len",
        str(seq_len),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
        "--repeats",
        str(args.repeats),
        "--draft-vocab",
        str(args.draft_vocab),
        "--target-dtype",
        args.target_dtype,
        "--mixed-precision",
        args.mixed_precision,
        "--arch",
        str(args.arch),
    ]
    env = {
        **os.environ,
        # Freed blocks go back to the OS at once, so resident memory tracks allocations.
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "MALLOC_TRIM_THRESHOLD_": "0",
        "PYTHONPATH": "",
    }
    start = time.perf_counter()
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=_limit(args.memory_limit_gib),
        cwd="/",  # the worker imports whichever draftsmith its Python has installed
    )
    row = {"impl": impl, "backend": backend, "seq_len": seq_len}
    out = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and out:
        row.update(json.loads(out[-1]), oom=False)
        return row
    err = proc.stderr.strip().splitlines()
    text = "\n".join(err[-5:])
    oom = any(s in proc.stderr for s in ("can't allocate memory", "MemoryError", "out of memory"))
    oom = oom or proc.returncode in (-9, 137)
    row.update(
        activation_bytes=None,
        peak_bytes=None,
        step_s=None,
        oom=oom,
        error=None if oom else text,
        wall_s=round(time.perf_counter() - start, 1),
    )
    return row


def goals(rows: list[dict]) -> dict:
    """The issue's four goals, read off the rows."""

    def get(impl, backend, t):
        for r in rows:
            if (r["impl"], r["backend"], r["seq_len"]) == (impl, backend, t):
                return r
        return None

    ts = sorted({r["seq_len"] for r in rows})
    out: dict = {}
    big = get("new", "cpu", 4096)
    out["new_completes_4096"] = bool(big and not big["oom"])
    a2, a4 = get("new", "cpu", 2048), get("new", "cpu", 4096)
    if a2 and a4 and not a2["oom"] and not a4["oom"]:
        ratio = a4["activation_bytes"] / a2["activation_bytes"]
        out["act_4096_over_2048"] = round(ratio, 3)
        out["linear_growth"] = ratio <= 2.2
    math_ok = [t for t in ts if (r := get("today", "math", t)) and not r["oom"]]
    if math_ok:
        t = max(math_ok)
        new, old = get("new", "cpu", t), get("today", "math", t)
        if new and not new["oom"]:
            out["largest_t_today_math_completes"] = t
            out["new_over_today_math_at_it"] = round(
                new["activation_bytes"] / old["activation_bytes"], 3
            )
            out["at_most_half_of_math"] = (
                t >= 1024 and new["activation_bytes"] <= old["activation_bytes"] / 2
            )
    per_t = []
    for t in ts:
        new, old = get("new", "cpu", t), get("today", "cpu", t)
        if not new or new["oom"]:
            per_t.append({"seq_len": t, "ok": False, "why": "new code did not complete"})
            continue
        if not old or old["oom"]:
            per_t.append({"seq_len": t, "ok": True, "why": "today's code did not complete"})
            continue
        act = new["activation_bytes"] / old["activation_bytes"]
        slow = new["step_s"] / old["step_s"]
        per_t.append(
            {
                "seq_len": t,
                "activation_ratio": round(act, 3),
                "step_time_ratio": round(slow, 3),
                "ok": act <= 1.0 and slow <= 1.10,
            }
        )
    out["vs_today_cpu"] = per_t
    out["no_more_memory_and_at_most_10pct_slower"] = all(r["ok"] for r in per_t)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=["cpu", "math"], default="cpu")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--steps", type=int, default=7, help="TTT steps")
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--arch", type=Path, default=ARCH, help="the target's config.json")
    parser.add_argument("--target-dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--mixed-precision", choices=["bf16", "no"], default="bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per row (min kept)")
    parser.add_argument("--memory-limit-gib", type=float, default=22.0)
    parser.add_argument(
        "--today-python",
        default=None,
        help="a Python with today's code installed (the rows impl=today); none: new code only",
    )
    parser.add_argument("--out", default="bench/scale/ttt_memory_cpu.json")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0

    import torch

    from draftsmith.train.runinfo import machine_load, run_info
    from draftsmith.train.staged import write_json_atomic

    plan = []
    for t in args.seq_lens:
        if args.today_python:
            plan += [
                (args.today_python, "today", "cpu", t),
                (args.today_python, "today", "math", t),
            ]
        plan.append((sys.executable, "new", "cpu", t))
    load_before = machine_load()
    rows = []
    for python, impl, backend, t in plan:
        row = run_row(python, impl, backend, t, args)
        rows.append(row)
        act = row["activation_bytes"]
        print(
            f"{impl:5s} {backend:4s} T={t:5d}: "
            + ("OOM" if row["oom"] else f"act {act / 2**30:.2f} GiB, {row['step_s']:.1f} s")
            + (f"  error: {row['error']}" if row.get("error") else ""),
            flush=True,
        )
    result = {
        **run_info("cpu"),
        "load_before": load_before,
        "load_after": machine_load(),
        "settings": {
            "arch": str(
                args.arch.relative_to(REPO) if args.arch.is_relative_to(REPO) else args.arch
            ),
            "ttt_steps": args.steps,
            "draft_vocab": args.draft_vocab,
            "batch": 1,
            "target_dtype": args.target_dtype,
            "mixed_precision": args.mixed_precision,
            "threads": args.threads,
            "memory_limit_gib": args.memory_limit_gib,
            "torch": torch.__version__,
        },
        "rows": rows,
        "goals": goals(rows),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(args.out), result)
    print(json.dumps(result["goals"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
