"""Verification cost profile: one cached target forward over w tokens (chain) or a w-node tree.

What speculative decoding pays per step is one target forward over the last accepted token plus
the draft tokens. On a GPU that cost is nearly flat in width; on a CPU it depends on the dtype,
the threads and the kernels. This benchmark measures it on the real target with a KV cache of
``--context`` tokens, for chain widths 1..32 and for tree verification (4-D ancestor mask, the
loop's own ``_tree_inputs``) of 8..64 nodes, in fp32 and bf16, at 1 and 2 threads. Dtypes are
interleaved per repetition (median of ``--reps``), so machine noise hits both alike.

It writes a JSON cost profile (ms per forward; ratios to width 1; the break-even acceptance
length τ = cost(w) / cost(1) of a chain drafter with free drafting) and a PNG plot. The profile
feeds ``draftsmith evaluate --adaptive-k --cost-profile FILE`` and the bench's recommendation.

Run::

    python scripts/bench_forward.py --out bench/cpu_costs/forward_cost.json
    python scripts/bench_forward.py --device cuda --out bench/gpu/forward_cost_gpu.json

On a GPU the thread counts do not apply (one profile entry, under the torch thread count) and
every forward is timed with a device synchronize before each clock read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

CHAIN_WIDTHS = [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32]
TREE_SIZES = [8, 16, 24, 32, 48, 64]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=300, help="tokens already in the cache")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--widths", type=int, nargs="+", default=CHAIN_WIDTHS)
    parser.add_argument("--tree-sizes", type=int, nargs="+", default=TREE_SIZES)
    parser.add_argument("--target", default=None)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--out", default="bench/cpu_costs/forward_cost.json")
    args = parser.parse_args(argv)

    from transformers import DynamicCache

    from draftsmith.train.decoding.speculative import _tree_inputs
    from draftsmith.train.decoding.verify_cost import tree_parents
    from draftsmith.train.device import DeviceTimer, is_cpu, make_generator, resolve_device
    from draftsmith.train.runinfo import run_info
    from draftsmith.train.staged import write_json_atomic
    from draftsmith.train.target_model.load import load_target

    device = resolve_device(args.device)
    info = run_info(device)
    clock = DeviceTimer(device).now
    load_before = os.getloadavg()
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    models = {
        name: load_target(args.target, dtype=dtypes[name], device=device)[0] for name in args.dtypes
    }
    gen = make_generator(device, 0)
    context = torch.randint(100, 30000, (1, args.context), generator=gen, device=device)
    caches = {}
    with torch.inference_mode():
        for name, model in models.items():
            caches[name] = DynamicCache(config=model.config)
            model(input_ids=context, cache=caches[name], use_cache=True, logits_to_keep=1)

    def timed(name: str, width: int, parents: list[int] | None) -> float:
        model, cache = models[name], caches[name]
        ids = torch.randint(100, 30000, (1, width), generator=gen, device=device)
        kwargs = {}
        if parents is not None:
            mask, pos, _ = _tree_inputs(parents[: width - 1], args.context, device)
            kwargs = {"attention_mask": mask, "position_ids": pos}
        t = clock()  # synchronized: the forward's kernels are inside the interval
        model(input_ids=ids, cache=cache, use_cache=True, **kwargs)
        elapsed = clock() - t
        cache.crop(-width)
        return elapsed * 1e3

    profile: dict = {}
    with torch.inference_mode():
        # Thread counts are a CPU setting; a GPU profile has one entry.
        for threads in args.threads if is_cpu(device) else [torch.get_num_threads()]:
            if is_cpu(device):
                torch.set_num_threads(threads)
            shapes = [("chain", w, None) for w in args.widths]
            shapes += [("tree", n, tree_parents(n)) for n in args.tree_sizes]
            for kind, width, parents in shapes:
                samples = {name: [] for name in models}
                # Tree of n nodes = a forward of n + 1 tokens (the root is the last token).
                w = width + 1 if kind == "tree" else width
                par = None if parents is None else [-1, *[p + 1 for p in parents]]
                for name in models:  # warm-up
                    timed(name, w, par)
                for _ in range(args.reps):
                    for name in models:
                        samples[name].append(timed(name, w, par))
                for name in models:
                    ms = statistics.median(samples[name])
                    entry = profile.setdefault(name, {}).setdefault(str(threads), {})
                    entry.setdefault(kind, {})[str(width)] = ms
                print(
                    f"threads {threads} {kind} {width:>2}: "
                    + "  ".join(
                        f"{n} {profile[n][str(threads)][kind][str(width)]:.1f} ms" for n in models
                    ),
                    flush=True,
                )

    for per_threads in profile.values():
        for entry in per_threads.values():
            one = entry["chain"]["1"]
            entry["ratio_to_width_1"] = {
                kind: {w: ms / one for w, ms in entry[kind].items()} for kind in ("chain", "tree")
            }
    result = {
        "benchmark": "cached target forward cost per width (chain) and tree size",
        "context_tokens": args.context,
        "reps": args.reps,
        "unit": "ms per forward (median)",
        "profile": profile,
        "machine_load": {"before": load_before, "after": os.getloadavg()},
        **info,
    }
    out = Path(args.out)
    write_json_atomic(out, result)
    _plot(profile, out.with_suffix(".png"))
    print(f"written {out} and {out.with_suffix('.png')}")
    return 0


def _plot(profile: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, per_threads in profile.items():
        for threads, entry in per_threads.items():
            style = "-" if name == "bfloat16" else "--"
            for ax, kind in zip(axes, ("chain", "tree"), strict=True):
                xs = [int(w) for w in entry[kind]]
                ax.plot(
                    xs,
                    list(entry[kind].values()),
                    style,
                    marker="o",
                    label=f"{name}, {threads} thread{'s' if threads != '1' else ''}",
                )
    axes[0].set_xlabel("tokens verified in one forward (chain: k + 1)")
    axes[1].set_xlabel("tree nodes verified in one forward")
    for ax in axes:
        ax.set_ylabel("ms per target forward")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M cached forward cost (300-token context, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
