"""What one sampled token costs: ``torch.multinomial`` against draftsmith's ``sample``.

A sampled speculative step draws several tokens over the full vocabulary: the drafter's k draft
tokens (their q rows are mapped to the target's vocabulary) and the target's correction or
bonus token. ``draftsmith.heads.sampling.sample`` inverts each row's cumulative distribution
with one uniform; ``torch.multinomial`` draws the same distribution. This benchmark times both
on ``--rows`` rows of a ``--vocab``-token distribution (SmolLM2's 49,152 by default), in one
process, interleaved per repetition (median of ``--reps``), and writes JSON with the command,
versions and machine.

Run::

    python scripts/bench_sampling.py --out bench/cpu_costs/sampling_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 9])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--out", default="bench/cpu_costs/sampling_cpu.json")
    args = parser.parse_args(argv)

    from draftsmith.heads.sampling import SamplingParams, logits_to_probs, sample
    from draftsmith.train.device import DeviceTimer, is_cpu, make_generator, resolve_device
    from draftsmith.train.runinfo import run_info
    from draftsmith.train.staged import write_json_atomic

    device = resolve_device(args.device)
    if is_cpu(device):
        torch.set_num_threads(args.threads)
    clock = DeviceTimer(device).now
    gen = make_generator(device, 0)
    sampling = SamplingParams(temperature=0.7)
    results = []
    for rows in args.rows:
        # A peaked distribution, like a chat model's at T = 0.7.
        logits = 3.0 * torch.randn(rows, args.vocab, generator=make_generator("cpu", rows))
        probs = logits_to_probs(logits.to(device), sampling)
        ways = {
            "multinomial": lambda p=probs: torch.multinomial(p, 1, generator=gen),
            "sample": lambda p=probs: sample(p, gen),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.reps):
            for name, way in ways.items():  # interleaved: drift hits both alike
                t0 = clock()
                way()
                times[name].append(1000 * (clock() - t0))
        ms = {name: statistics.median(v) for name, v in times.items()}
        results.append({"rows": rows, "ms": ms, "speedup": ms["multinomial"] / ms["sample"]})
        print(
            f"{rows} row(s) x {args.vocab}: multinomial {ms['multinomial']:.3f} ms, "
            f"sample {ms['sample']:.3f} ms ({ms['multinomial'] / ms['sample']:.1f}x)"
        )
    write_json_atomic(
        args.out,
        {
            "benchmark": "one sampled token per row: torch.multinomial vs draftsmith sample",
            "vocab": args.vocab,
            "threads": args.threads if is_cpu(device) else None,
            "reps": args.reps,
            "results": results,
            **run_info(device),
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
