"""Grouped-query attention with and without K/V copies in the target's cached forwards.

transformers' SDPA attention repeats every layer's cached keys and values to all query heads
(``repeat_kv``) unless ``enable_gqa`` applies, which it only does without a mask (or for one
query token). ``TRANSFORMERS_SDPA_FORCE_GQA=1`` makes it pass ``enable_gqa=True`` always;
draftsmith's decoding loop sets it while it decodes on a CPU (``grouped_kv_attention`` in
``train/target_model/kernels.py``). This benchmark measures what that buys, per forward, on the
real target with a KV cache of ``--context`` tokens: a one-token decode step, a k = 2 chain
verify (3 tokens, causal) and a 6-node depth-2 tree verify (7 tokens, the loop's 4-D ancestor
mask), each with the switch off and on, interleaved per repetition (median of ``--reps``), and
checks that the logits are identical.

Run (one thread, nothing else on the machine)::

    python scripts/bench_gqa.py --out bench/cpu_costs/gqa_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ENV = "TRANSFORMERS_SDPA_FORCE_GQA"
#: The quickstart's tree: 4 children of the root, 2 grandchildren (parents as the loop gets them).
TREE_PARENTS = [-1, -1, -1, -1, 0, 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="target (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--context", type=int, default=300, help="cached tokens")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batch-new-tokens", type=int, default=48)
    parser.add_argument("--batch-reps", type=int, default=2)
    parser.add_argument("--batch-threads", type=int, default=2)
    parser.add_argument("--out", default="bench/cpu_costs/gqa_cpu.json")
    args = parser.parse_args(argv)

    from transformers import DynamicCache

    from draftsmith.train.datagen.generation import generate_batch
    from draftsmith.train.decoding.speculative import _keep_cache, _tree_inputs
    from draftsmith.train.device import make_generator
    from draftsmith.train.runinfo import run_info
    from draftsmith.train.staged import write_json_atomic
    from draftsmith.train.target_model.load import load_target

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    info = run_info(device)
    load_before = os.getloadavg()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    target, _ = load_target(args.target, dtype=dtype, device=device)
    gen = make_generator(device, 0)
    context = torch.randint(100, 30000, (1, args.context), generator=gen)
    tokens = torch.randint(100, 30000, (1, len(TREE_PARENTS) + 1), generator=gen)
    mask, pos, _ = _tree_inputs(TREE_PARENTS, args.context, device)
    shapes = {
        "decode, 1 token": (tokens[:, :1], {}),
        "chain verify, 3 tokens": (tokens[:, :3], {}),
        "tree verify, 7 tokens": (tokens, {"attention_mask": mask, "position_ids": pos}),
    }
    cache = DynamicCache(config=target.config)

    def forward(shape: str, gqa: bool) -> tuple[float, torch.Tensor]:
        os.environ[ENV] = "1" if gqa else "0"  # read by transformers at each attention call
        ids, kwargs = shapes[shape]
        t = time.perf_counter()  # a CPU benchmark: the host clock times the forward
        out = target(input_ids=ids, cache=cache, use_cache=True, **kwargs)
        elapsed = time.perf_counter() - t
        _keep_cache(cache, args.context)
        return 1e3 * elapsed, out.logits

    results: dict = {}
    with torch.inference_mode():
        target(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
        for shape in shapes:  # warm-up, and the logits compared
            off, on = forward(shape, False)[1], forward(shape, True)[1]
            diff = (off.float() - on.float()).abs().max().item()
            results[shape] = {"max_abs_logit_difference": diff, "off": [], "on": []}
        for _ in range(args.reps):
            for shape in shapes:
                for gqa in (False, True):
                    results[shape]["on" if gqa else "off"].append(forward(shape, gqa)[0])
    rows = {}
    for shape, r in results.items():
        off, on = statistics.median(r["off"]), statistics.median(r["on"])
        rows[shape] = {
            "ms_copies": off,
            "ms_enable_gqa": on,
            "ratio": on / off,
            "max_abs_logit_difference": r["max_abs_logit_difference"],
        }
        print(
            f"{shape:24s} copies {off:6.2f} ms  enable_gqa {on:6.2f} ms  "
            f"({on / off:.3f}x, logits differ by {r['max_abs_logit_difference']:g})"
        )
    # Batched generation: self-distillation's decoder, padded prompts under a 2-D mask.
    torch.set_num_threads(args.batch_threads)
    lengths = torch.randint(20, 81, (args.batch_size,), generator=gen).tolist()
    prompts = [torch.randint(100, 30000, (n,), generator=gen).tolist() for n in lengths]
    batched: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.batch_reps):
        for gqa in (False, True):
            os.environ[ENV] = "1" if gqa else "0"
            t = time.perf_counter()
            out = generate_batch(target, prompts, max_new_tokens=args.batch_new_tokens)
            rate = sum(len(o.tokens) for o in out) / (time.perf_counter() - t)
            batched["on" if gqa else "off"].append(rate)
    os.environ.pop(ENV, None)
    batch_row = {
        "batch_size": args.batch_size,
        "new_tokens": args.batch_new_tokens,
        "threads": args.batch_threads,
        "tokens_per_s_copies": statistics.mean(batched["off"]),
        "tokens_per_s_enable_gqa": statistics.mean(batched["on"]),
        "samples": batched,
    }
    print(
        f"generate_batch x{args.batch_size}      copies {batch_row['tokens_per_s_copies']:.0f} "
        f"tok/s  enable_gqa {batch_row['tokens_per_s_enable_gqa']:.0f} tok/s"
    )
    result = {
        "benchmark": "SDPA grouped-query attention: repeat_kv copies against enable_gqa",
        "batched_generation": batch_row,
        "dtype": args.dtype,
        "context_tokens": args.context,
        "threads": args.threads,
        "reps": args.reps,
        "unit": "ms per forward (median)",
        "shapes": rows,
        "machine_load": {"before": load_before, "after": os.getloadavg()},
        **info,
    }
    write_json_atomic(Path(args.out), result)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
