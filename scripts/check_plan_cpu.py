"""``draftsmith plan``'s predictions against measured peaks, at an 8B drafter's widths on this CPU.

For each setting (offline or online features; sequence lengths), one process builds a real
EAGLE-3 training step -- the target of ``--arch`` cut to 2 decoder layers (random bf16 weights:
its embedding, head and layers at full width), the drafter at full size reading layers 0, 1, 2,
fp32 master weights with bf16 autocast, AdamW -- runs a warm-up step at 64 tokens (the gradients
and AdamW's state), then one step at the setting's length, and reads its peak resident memory
(``VmHWM``, reset before the step). The same settings go through the planner (the same step
code, on fake tensors: :mod:`draftsmith.train.plan`), with the runtime taken as the resident size
of a process that ran one step of a tiny drafter (:func:`~draftsmith.train.plan.memory.cpu_runtime_bytes`). Both are written to one JSON with the
ratio of each prediction to its measurement; the goal is within 15 %.

Run (alone on the machine; about half an hour)::

    python scripts/check_plan_cpu.py --out bench/scale/plan_vs_measured_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCH = REPO / "recipes" / "architectures" / "meta-llama" / "Llama-3.1-8B-Instruct"


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def spec_for(args: argparse.Namespace, online: bool, seq_len: int):
    import torch
    from transformers import AutoConfig

    from draftsmith.train.plan.simulate import StepSpec, target_config_with_layers

    config = AutoConfig.from_pretrained(str(args.arch), local_files_only=True)
    config = target_config_with_layers(config, args.layers)
    return StepSpec(
        target_config=config,
        feature_layers=tuple(range(args.layers + 1))[-3:],
        draft_vocab_size=args.draft_vocab,
        ttt_steps=args.steps,
        seq_len=seq_len,
        micro_batch=args.micro_batch,
        online=online,
        target_dtype=torch.bfloat16,
        autocast=True,
        foreach=False,  # AdamW's CPU default
        device="cpu",
    )


def worker(args: argparse.Namespace) -> dict:
    """One real step, measured (the parent runs one process per setting)."""
    from dataclasses import replace

    import torch
    from transformers import AutoModelForCausalLM

    from draftsmith.train.plan.simulate import build_step, run_step

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rss_start = _status("VmRSS")
    spec = spec_for(args, args.online, args.seq_len)
    target = AutoModelForCausalLM.from_config(spec.target_config, dtype=torch.bfloat16)
    models = build_step(spec, target=target)  # the drafter keeps nn.Linear's own init
    run_step(replace(spec, seq_len=64), models)  # warm-up: every lasting allocation made
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current size
    start = time.perf_counter()
    run_step(spec, models)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    return {
        "rss_start": rss_start,
        "before_bytes": before,
        "peak_bytes": peak,
        "activation_bytes": peak - before,
        "step_s": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--online", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--features", nargs="+", default=["offline", "online"])
    parser.add_argument("--arch", type=Path, default=ARCH, help="the target's config dir")
    parser.add_argument("--layers", type=int, default=2, help="the target's decoder layers")
    parser.add_argument("--steps", type=int, default=7, help="TTT steps")
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/scale/plan_vs_measured_cpu.json")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0

    from draftsmith.train.plan.memory import Launch, cpu_runtime_bytes, plan
    from draftsmith.train.runinfo import machine_load, run_info
    from draftsmith.train.staged import write_json_atomic

    runtime = cpu_runtime_bytes(True)
    launch = Launch(gpus=1, gpu_memory_gib=24, device="cpu", headroom=0.0, runtime_bytes=runtime)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    load_before = machine_load()
    rows = []
    for features in args.features:
        for t in args.seq_lens:
            online = features == "online"
            spec = spec_for(args, online, t)
            predicted = plan(spec, launch)
            cmd = [sys.executable, __file__, "--worker", "--seq-len", str(t)]
            cmd += [
                "--arch",
                str(args.arch),
                "--layers",
                str(args.layers),
                "--steps",
                str(args.steps),
            ]
            cmd += ["--draft-vocab", str(args.draft_vocab), "--micro-batch", str(args.micro_batch)]
            cmd += ["--threads", str(args.threads)] + (["--online"] if online else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if proc.returncode or not lines:
                raise SystemExit(f"worker failed ({features}, T={t}):\n{proc.stderr[-2000:]}")
            measured = json.loads(lines[-1])
            act = predicted.parts["activations (peak of the step)"]
            row = {
                "features": features,
                "seq_len": t,
                "micro_batch": args.micro_batch,
                "measured": measured,
                "predicted": {
                    "total_bytes": predicted.total,
                    "activation_bytes": act,
                    "parts": predicted.parts,
                },
                "total_ratio": round(predicted.total / measured["peak_bytes"], 4),
                "activation_ratio": round(act / measured["activation_bytes"], 4),
            }
            row["within_15pct"] = abs(row["total_ratio"] - 1) <= 0.15
            rows.append(row)
            print(
                f"{features:7s} T={t:5d}: measured peak {measured['peak_bytes'] / 2**30:.2f} GiB "
                f"(step {measured['activation_bytes'] / 2**30:.2f}), predicted "
                f"{predicted.total / 2**30:.2f} ({act / 2**30:.2f}): total x{row['total_ratio']:.3f}"
                f", step x{row['activation_ratio']:.3f}",
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
            "target_layers": args.layers,
            "ttt_steps": args.steps,
            "draft_vocab": args.draft_vocab,
            "runtime_bytes": runtime,
            "threads": args.threads,
        },
        "rows": rows,
        "all_within_15pct": all(r["within_15pct"] for r in rows),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(args.out), result)
    return 0 if result["all_within_15pct"] else 1


if __name__ == "__main__":
    sys.exit(main())
