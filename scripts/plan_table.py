"""What fits where: ``draftsmith plan``'s verdict for the shipped 8B and 70B targets on common GPUs.

Each row is one launch of the EAGLE recipe as its shipped config sets it (EAGLE-3, draft
vocabulary 32k, 7 TTT steps, micro-batch 1, bf16 target and autocast) at one sequence length,
with online or offline features, on N GPUs of a given memory under DDP or FSDP: the per-GPU
peak the planner predicts (weights, gradients, AdamW state, DDP/FSDP terms, the step's simulated
activations, 0.8 GiB of CUDA context) and whether it fits in 90 % of the GPU. No GPU is used:
the step runs on fake tensors. Writes JSON and prints a Markdown table (docs/scaling.md).

Run::

    python scripts/plan_table.py --out bench/scale/plan_table.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCH = REPO / "recipes" / "architectures"

# (target, features, seq_len, gpus, GiB per GPU, strategy, what it stands for)
ROWS = [
    (
        "meta-llama/Llama-3.1-8B-Instruct",
        "offline",
        2048,
        1,
        24,
        "ddp",
        "one 24 GB GPU (4090, A10)",
    ),
    ("meta-llama/Llama-3.1-8B-Instruct", "offline", 4096, 1, 24, "ddp", "one 24 GB GPU"),
    ("meta-llama/Llama-3.1-8B-Instruct", "online", 2048, 1, 24, "ddp", "one 24 GB GPU"),
    ("meta-llama/Llama-3.1-8B-Instruct", "online", 2048, 8, 24, "fsdp", "8 x 24 GB, FSDP"),
    (
        "meta-llama/Llama-3.1-8B-Instruct",
        "offline",
        4096,
        1,
        48,
        "ddp",
        "one 48 GB GPU (A6000, L40S)",
    ),
    (
        "meta-llama/Llama-3.1-8B-Instruct",
        "online",
        4096,
        1,
        80,
        "ddp",
        "one 80 GB GPU (A100, H100)",
    ),
    ("meta-llama/Llama-3.1-8B-Instruct", "online", 8192, 1, 80, "ddp", "one 80 GB GPU"),
    ("Qwen/Qwen3-8B", "online", 4096, 1, 80, "ddp", "one 80 GB GPU"),
    ("Qwen/Qwen3-8B", "online", 8192, 8, 80, "ddp", "8 x 80 GB, DDP"),
    ("meta-llama/Llama-3.1-70B-Instruct", "offline", 4096, 1, 80, "ddp", "one 80 GB GPU"),
    ("meta-llama/Llama-3.1-70B-Instruct", "online", 4096, 8, 80, "ddp", "8 x 80 GB, DDP"),
    ("meta-llama/Llama-3.1-70B-Instruct", "online", 4096, 8, 80, "fsdp", "8 x 80 GB, FSDP"),
    ("meta-llama/Llama-3.1-70B-Instruct", "online", 8192, 8, 80, "fsdp", "8 x 80 GB, FSDP"),
    ("meta-llama/Llama-3.1-70B-Instruct", "online", 4096, 8, 141, "fsdp", "8 x H200, FSDP"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--out", default="bench/scale/plan_table.json")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoConfig

    from draftsmith.train.plan.memory import GIB, Launch, parameter_counts, plan
    from draftsmith.train.plan.simulate import StepSpec, simulate_step
    from draftsmith.train.runinfo import run_info
    from draftsmith.train.staged import write_json_atomic

    steps: dict = {}
    counts: dict = {}
    rows = []
    for target, features, seq_len, gpus, gib, strategy, label in ROWS:
        config = AutoConfig.from_pretrained(str(ARCH / target), local_files_only=True)
        spec = StepSpec(
            target_config=config,
            draft_vocab_size=args.draft_vocab,
            ttt_steps=args.ttt_steps,
            seq_len=seq_len,
            micro_batch=1,
            online=features == "online",
            target_dtype=torch.bfloat16,
            autocast=True,
            foreach=True,
            device="cuda",
        )
        key = (target, features, seq_len)
        if key not in steps:
            steps[key] = simulate_step(spec)
        if target not in counts:
            counts[target] = parameter_counts(replace(spec, online=True))
        launch = Launch(gpus=gpus, gpu_memory_gib=gib, strategy=strategy, device="cuda")
        p = plan(spec, launch, counts=counts[target], step=steps[key])
        row = {
            "target": target,
            "features": features,
            "seq_len": seq_len,
            "gpus": gpus,
            "gpu_memory_gib": gib,
            "strategy": strategy,
            "label": label,
            "total_gib": round(p.total / GIB, 1),
            "activations_gib": round(p.parts["activations (peak of the step)"] / GIB, 1),
            "fits": p.fits,
            "parts_gib": {k: round(v / GIB, 2) for k, v in p.parts.items()},
        }
        rows.append(row)
    print("| target | features | tokens | GPUs | per-GPU peak | of which activations | fits |")
    print("|---|---|---:|---|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['target'].split('/')[-1]} | {r['features']} | {r['seq_len']:,} | {r['label']} "
            f"| {r['total_gib']} GiB | {r['activations_gib']} GiB | "
            f"{'yes' if r['fits'] else '**no**'} |"
        )
    out = {
        **run_info(None),
        "settings": {
            "recipe": "eagle (EAGLE-3)",
            "draft_vocab": args.draft_vocab,
            "ttt_steps": args.ttt_steps,
            "micro_batch": 1,
            "target_dtype": "bf16",
            "mixed_precision": "bf16",
            "headroom": 0.1,
        },
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(args.out), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
