"""What a draft vocabulary saves a Medusa drafter per draft step (issue 25 item 2).

Each Medusa head ends in a projection over the vocabulary: SmolLM2's 49,152 rows, or the
``draft_vocab_size`` most frequent tokens with a draft vocabulary (EAGLE-3's d2t/t2d). A
greedy draft step of K heads is their residual blocks and projections over the last verified
hidden state, the argmax per head and the map back to target ids. This benchmark times that step
with heads shaped as the real target's (weights from its lm_head; the cost does not depend on
training), for the full vocabulary and each ``--draft-vocab`` size, in each ``--dtypes``,
interleaved per repetition (median of ``--reps``), and writes JSON with the command, versions
and machine.

Run::

    python scripts/bench_draft_vocab.py --out bench/draft_vocab_medusa.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, nargs="+", default=[8192, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--target", default=None)
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--out", default="bench/draft_vocab_medusa.json")
    args = parser.parse_args(argv)

    from draftsmith.heads.medusa import MedusaHeads
    from draftsmith.train.device import DeviceTimer, is_cpu, make_generator, resolve_device
    from draftsmith.train.runinfo import run_info
    from draftsmith.train.staged import write_json_atomic
    from draftsmith.train.target_model.kernels import flatten_linear_inputs
    from draftsmith.train.target_model.load import load_target

    device = resolve_device(args.device)
    if is_cpu(device):
        torch.set_num_threads(args.threads)
    info = run_info(device)
    clock = DeviceTimer(device).now
    load_before = os.getloadavg()
    target, _ = load_target(args.target, dtype=torch.float32, device=device)
    vocab = target.config.vocab_size
    gen = make_generator(device, 0)
    sizes = [None, *args.draft_vocab]
    variants = {}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for n in sizes:
            d2t = t2d = None
            if n is not None:
                ids = torch.randperm(vocab, generator=gen, device=device)[:n].sort().values
                d2t = ids - torch.arange(n, device=device)
                t2d = torch.zeros(vocab, dtype=torch.bool, device=device)
                t2d[ids] = True
            heads = MedusaHeads.from_target(target, num_heads=args.heads, d2t=d2t, t2d=t2d)
            heads = heads.to(dtype).eval()
            flatten_linear_inputs(heads)  # as evaluate runs drafters (the bf16 CPU kernel path)
            variants[(dtype_name, n or vocab)] = heads
    hidden = torch.randn(1, 1, target.config.hidden_size, generator=gen, device=device)

    def step(heads: MedusaHeads) -> float:
        x = hidden.to(next(heads.parameters()).dtype)
        t = clock()
        heads.target_ids(heads(x).argmax(-1)).tolist()  # sync: the loop reads each draft once
        return clock() - t

    samples: dict = {key: [] for key in variants}
    with torch.inference_mode():
        for heads in variants.values():  # warm-up
            step(heads)
        for _ in range(args.reps):
            for key, heads in variants.items():
                samples[key].append(step(heads))
    results = {}
    for (dtype_name, n), values in samples.items():
        ms = statistics.median(values) * 1e3
        full = statistics.median(samples[(dtype_name, vocab)]) * 1e3
        results.setdefault(dtype_name, {})[str(n)] = {"ms": ms, "fraction_of_full": ms / full}
        print(f"{dtype_name} vocab {n:>6}: {ms:.2f} ms per draft step ({ms / full:.2f} of full)")
    result = {
        "benchmark": "Medusa greedy draft step (K heads over the last hidden state) by vocabulary",
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "heads": args.heads,
        "target_vocab": vocab,
        "threads": args.threads if is_cpu(device) else None,
        "reps": args.reps,
        "unit": "ms per draft step (median)",
        "results": results,
        "machine_load": {"before": load_before, "after": os.getloadavg()},
        **info,
    }
    write_json_atomic(Path(args.out), result)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
