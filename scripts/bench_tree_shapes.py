"""Which EAGLE-2 tree shape pays at a temperature: chains and trees of several shapes, one drafter.

``draftsmith bench`` measures one tree shape per run (``--k``, ``--tree-topk``,
``--tree-total-tokens``). This script measures many in one process, prompt by prompt and
interleaved with one plain baseline (machine noise hits all alike), so the shapes can be
compared on the same prompts, draws and clock. Each entry of ``--shapes`` is ``chain:K`` or
``tree:K:TOPK:NODES`` (K = draft depth, TOPK = children per expanded node, NODES = tree nodes
kept, the verify width is NODES + 1), optionally followed by ``@float32`` or ``@bfloat16``: the
drafter's dtype for that entry (default ``--draft-dtype``).

Per shape it reports τ, α per depth, drafting ms per round, tok/s and the speedup over the plain
baseline, and writes JSON with the command, versions and machine. Shards (``--shard I/N``, one
process per core) are merged with ``--merge A.json B.json --out C.json``.

Run (two cores, two shards)::

    python scripts/bench_tree_shapes.py --drafter runs/eagle3/best --temperature 0.7 \\
        --limit 24 --shard 0/2 --out bench/trees/shapes_s0.json &
    python scripts/bench_tree_shapes.py ... --shard 1/2 --out bench/trees/shapes_s1.json
    python scripts/bench_tree_shapes.py --merge bench/trees/shapes_s0.json bench/trees/shapes_s1.json \\
        --out bench/trees/shapes.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

DEFAULT_SHAPES = [
    "chain:2",
    "chain:3",
    "tree:2:4:6",
    "tree:3:4:8",
    "tree:3:4:12",
    "tree:4:4:12",
    "tree:4:4:16",
]
SUMMED = ("tokens", "target_forwards", "wall_time", "draft_time", "draft_steps", "prompts")


def parse_shape(text: str) -> dict:
    """``chain:K`` or ``tree:K:TOPK:NODES``, optionally ``@DTYPE`` (the drafter's dtype, else
    ``--draft-dtype``) -> a dict; raises ValueError naming the entry."""
    text, _, dtype = text.partition("@")
    if dtype not in ("", "float32", "bfloat16"):
        raise ValueError(f"--shapes: {text}@{dtype}: the dtype must be float32 or bfloat16")
    parts = text.split(":")
    try:
        if parts[0] == "chain" and len(parts) == 2:
            shape = {"kind": "chain", "k": int(parts[1])}
        elif parts[0] == "tree" and len(parts) == 4:
            k, topk, nodes = map(int, parts[1:])
            shape = {"kind": "tree", "k": k, "topk": topk, "nodes": nodes}
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"--shapes: {text!r} is not chain:K or tree:K:TOPK:NODES") from None
    if min(v for v in shape.values() if isinstance(v, int)) < 1:
        raise ValueError(f"--shapes: {text!r}: every number must be >= 1")
    shape["dtype"] = dtype or None
    return shape


def summarize(entry: dict, plain: dict) -> dict:
    """τ, α per depth, ms per round and speedup from summed counters."""
    tok_s = entry["tokens"] / max(entry["wall_time"], 1e-9)
    plain_tok_s = plain["tokens"] / max(plain["wall_time"], 1e-9)
    rounds = max(entry["draft_steps"], 1)
    return {
        "tau": entry["tokens"] / max(entry["target_forwards"], 1),
        "alpha": [a / rounds for a in entry["accepted_per_position"]],
        "draft_ms_per_round": 1000 * entry["draft_time"] / rounds,
        "tok_s": tok_s,
        "speedup": tok_s / plain_tok_s,
    }


def merge(paths: list[str], out: str) -> int:
    import json
    from pathlib import Path

    from draftsmith.train.staged import write_json_atomic

    parts = [json.loads(Path(p).read_text()) for p in paths]
    merged = {k: v for k, v in parts[0].items() if k not in ("counters", "results")}
    merged["merged_from"] = paths
    counters: dict[str, dict] = {}
    for part in parts:
        for name, c in part["counters"].items():
            acc = counters.setdefault(name, {**{k: 0 for k in SUMMED}, "accepted_per_position": []})
            for key in SUMMED:
                acc[key] += c[key]
            app = acc["accepted_per_position"]
            for i, a in enumerate(c["accepted_per_position"]):
                if i < len(app):
                    app[i] += a
                else:
                    app.append(a)
    merged["counters"] = counters
    merged["results"] = {n: summarize(c, counters["plain"]) for n, c in counters.items()}
    write_json_atomic(out, merged)
    print_table(merged["results"])
    return 0


def print_table(results: dict) -> None:
    print(f"{'shape':<14} {'tau':>5} {'speedup':>8} {'draft ms/rd':>11}  alpha")
    for name, r in results.items():
        alpha = " ".join(f"{a:.2f}" for a in r["alpha"])
        print(
            f"{name:<14} {r['tau']:5.2f} {r['speedup']:7.3f}x {r['draft_ms_per_round']:11.1f}"
            f"  {alpha}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", help="EAGLE-1/3 drafter directory (a training run's best/)")
    ap.add_argument("--target", default=None, help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument(
        "--prompts",
        default=None,
        help="prompt file (default: the shipped held-out prompts, chat_prompts.jsonl)",
    )
    ap.add_argument(
        "--split", default="heldout", help="split of the prompt file; all = every record"
    )
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--draft-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs only)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard", default=None, help="I/N: every N-th prompt from I")
    ap.add_argument("--merge", nargs="+", default=None, help="merge these shard JSONs into --out")
    ap.add_argument("--out", default="bench/trees/tree_shapes.json")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if not args.drafter:
        ap.error("--drafter is required (unless --merge)")
    try:
        shapes = {name: parse_shape(name) for name in args.shapes}
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from draftsmith.heads.eagle import load_drafter
    from draftsmith.heads.eagle_proposer import EagleProposer
    from draftsmith.heads.sampling import SamplingParams
    from draftsmith.train.data.prompts import load_prompts, render_prompt
    from draftsmith.train.decoding.speculative import generate
    from draftsmith.train.device import is_cpu, make_generator, resolve_device
    from draftsmith.train.runinfo import run_info
    from draftsmith.train.staged import write_json_atomic
    from draftsmith.train.target_model.kernels import fast_cpu_linears
    from draftsmith.train.target_model.load import load_target

    device = resolve_device(args.device)
    if args.threads and is_cpu(device):
        torch.set_num_threads(args.threads)
    info = run_info(device)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    split = None if args.split == "all" else args.split
    records = load_prompts(args.prompts, split=split, limit=args.limit)
    if args.shard:
        index, count = map(int, args.shard.split("/"))
        records = records[index::count]
    target, tokenizer = load_target(args.target, dtype=dtypes[args.dtype], device=device)
    proposers: dict[str, object | None] = {"plain": None}
    ks: dict[str, int] = {"plain": 1}
    for name, shape in shapes.items():
        dtype = dtypes[shape["dtype"] or args.draft_dtype]
        drafter = load_drafter(args.drafter, target, dtype=dtype)
        fast_cpu_linears(drafter)
        if shape["kind"] == "chain":
            proposers[name] = EagleProposer(drafter)
        else:
            proposers[name] = EagleProposer(
                drafter, tree=True, topk=shape["topk"], total_tokens=shape["nodes"]
            )
        ks[name] = shape["k"]
    sampling = SamplingParams(args.temperature, 0, args.top_p)
    # The stop tokens evaluate uses: the tokenizer's and the generation config's.
    gen_eos = target.generation_config.eos_token_id
    gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
    eos = {tokenizer.eos_token_id, *gen_eos} - {None}
    prompts = [render_prompt(tokenizer, r) for r in records]
    counters = {
        n: {**{k: 0 for k in SUMMED}, "accepted_per_position": [0] * ks[n]} for n in proposers
    }

    def run(name, ids, new_tokens):
        gen = make_generator(device, args.seed)
        return generate(
            target,
            ids,
            proposers[name],
            k=ks[name],
            max_new_tokens=new_tokens,
            sampling=sampling,
            eos_token_id=eos,
            generator=gen,
        )

    for name in proposers:  # untimed warm-up: first forwards pay one-off allocation costs
        run(name, prompts[0], 8)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        line = f"[{i + 1}/{len(prompts)}]"
        for name in proposers:  # interleaved per prompt
            out = run(name, ids, args.max_new_tokens)
            c = counters[name]
            c["tokens"] += len(out.tokens)
            c["target_forwards"] += out.target_forwards
            c["wall_time"] += out.wall_time
            c["draft_time"] += out.draft_time
            c["draft_steps"] += out.draft_steps
            c["prompts"] += 1
            for j, a in enumerate(out.accepted_per_position[: ks[name]]):
                c["accepted_per_position"][j] += a
            line += f" {name} {len(out.tokens) / out.wall_time:.1f}"
        print(line, flush=True)
    results = {n: summarize(c, counters["plain"]) for n, c in counters.items()}
    print_table(results)
    write_json_atomic(
        args.out,
        {
            "command": " ".join(sys.argv),
            "run_info": info,
            "settings": {k: v for k, v in vars(args).items() if k not in ("merge",)},
            "minutes": (time.perf_counter() - start) / 60,
            "counters": counters,
            "results": results,
        },
    )
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
