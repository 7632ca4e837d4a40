"""bf16 CPU linears with PyTorch's kernel against prepacked oneDNN weights, per layer and end to end.

``fast_cpu_linears`` (``train/target_model/kernels.py``) multiplies the bf16 linears of the target
and of evaluated drafters with a copy of each weight reordered once for oneDNN, where
``F.linear`` reorders it at every call. This benchmark measures what that buys on the real
target, three ways, stock (``DRAFTSMITH_PACKED_LINEARS=0``) against packed:

1. each linear shape of the target at 1, 2, 4, 8, 64 and 300 rows (median of ``--reps``, the
   two interleaved), and whether the products are bit-identical;
2. batch-1 decoding of ``--prompts`` held-out prompts: plain, and with ``--drafter`` (an EAGLE
   drafter directory) a k = 2 chain and EAGLE-2 trees of ``--tree-nodes`` nodes. Two copies of
   the target (and of the drafter) are loaded, one per setting, and every method runs both
   settings prompt by prompt, interleaved; the tokens of the two settings must be equal;
3. batched greedy generation (self-distillation's decoder) at ``--batch-size``.

Run (nothing else on the machine; decoding on one thread as evaluate's shards run)::

    python scripts/bench_packed_linear.py --drafter runs/quickstart/eagle3/best \\
        --out bench/cpu_costs/packed_linear_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROWS = (1, 2, 4, 8, 64, 300)


def _timed(fn, reps: int) -> float:
    t = time.perf_counter()  # a CPU benchmark: the host clock times the call
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="target (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=None, help="EAGLE drafter directory (optional)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts decoded")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree-nodes", type=int, nargs="*", default=[6, 7])
    parser.add_argument("--reps", type=int, default=30, help="repetitions per linear shape")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batch-new-tokens", type=int, default=48)
    parser.add_argument("--batch-threads", type=int, default=2)
    parser.add_argument("--out", default="bench/cpu_costs/packed_linear_cpu.json")
    args = parser.parse_args(argv)

    import torch.nn.functional as F

    from draftsmith.heads.eagle import load_drafter
    from draftsmith.heads.eagle_proposer import EagleProposer
    from draftsmith.train.data.prompts import load_prompts, render_prompt
    from draftsmith.train.datagen.generation import generate_batch
    from draftsmith.train.decoding.speculative import generate
    from draftsmith.train.device import make_generator
    from draftsmith.train.runinfo import run_info
    from draftsmith.train.staged import write_json_atomic
    from draftsmith.train.target_model.kernels import PACKED_ENV, packing_supported
    from draftsmith.train.target_model.load import load_target

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    info = run_info(device)
    load_before = os.getloadavg()
    os.environ.pop(PACKED_ENV, None)
    if not packing_supported():
        print("this CPU has no native bf16 math (or no oneDNN): nothing is packed here")
        return 1

    # Two copies of everything: PACKED_ENV is read when the layers are patched.
    models = {}
    for setting in ("stock", "packed"):
        os.environ[PACKED_ENV] = "0" if setting == "stock" else "1"
        target, tok = load_target(args.target, dtype=torch.bfloat16, device=device)
        drafter = None
        if args.drafter:
            from draftsmith.train.target_model.kernels import fast_cpu_linears

            drafter = load_drafter(args.drafter, target, dtype=torch.bfloat16)
            fast_cpu_linears(drafter)
        models[setting] = (target, drafter)
    os.environ.pop(PACKED_ENV, None)

    # 1. Per layer shape.
    cfg = models["stock"][0].config
    h, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    layer_shapes = {
        "q_proj / o_proj": (h, h),
        "k_proj / v_proj": (kv, h),
        "gate_proj / up_proj": (inter, h),
        "down_proj": (h, inter),
        "lm_head": (cfg.vocab_size, h),
    }
    gen = make_generator(device, 0)
    linear_rows = {}
    with torch.inference_mode():
        for name, (out_f, in_f) in layer_shapes.items():
            w = torch.randn(out_f, in_f, generator=gen).bfloat16()
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            for rows in ROWS:
                x = torch.randn(rows, in_f, generator=gen).bfloat16()

                def stock_fn(x=x, w=w):
                    return F.linear(x, w)

                def packed_fn(x=x, packed=packed):
                    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

                same = torch.equal(stock_fn(), packed_fn())
                reps = max(3, args.reps // (10 if out_f * in_f > 10_000_000 else 1))
                times = {"stock": [], "packed": []}
                for _ in range(5):
                    times["stock"].append(_timed(stock_fn, reps))
                    times["packed"].append(_timed(packed_fn, reps))
                s, p = statistics.median(times["stock"]), statistics.median(times["packed"])
                linear_rows[f"{name} [{out_f}x{in_f}] x{rows}"] = {
                    "ms_stock": 1e3 * s,
                    "ms_packed": 1e3 * p,
                    "speedup": s / p,
                    "bit_identical": same,
                }
                print(
                    f"{name:20s} [{out_f}x{in_f}] rows {rows:4d}: stock {1e3 * s:7.3f} ms  "
                    f"packed {1e3 * p:7.3f} ms  ({s / p:.2f}x){'' if same else '  DIFFERENT'}"
                )

    # 2. Batch-1 decoding, interleaved per prompt.
    recs = load_prompts(None, split="heldout", limit=args.prompts)
    prompts = [render_prompt(tok, r) for r in recs]
    eos = tok.eos_token_id

    def proposer(setting: str, method: str):
        drafter = models[setting][1]
        if method == "plain":
            return None
        if method == "chain k=2":
            return EagleProposer(drafter)
        return EagleProposer(drafter, tree=True, topk=4, total_tokens=int(method.split()[1]))

    methods = ["plain"]
    if args.drafter:
        methods += ["chain k=2"] + [f"tree {n} nodes" for n in args.tree_nodes]
    totals = {(s, m): [0, 0.0, 0, 0] for s in models for m in methods}
    identical = True
    for setting in models:  # warm-up
        generate(
            models[setting][0], prompts[0], proposer(setting, methods[-1]), k=2, max_new_tokens=8
        )
    for i, ids in enumerate(prompts):
        for method in methods:
            outs = {}
            for setting in models:
                out = generate(
                    models[setting][0],
                    ids,
                    proposer(setting, method),
                    k=2,
                    max_new_tokens=args.max_new_tokens,
                    eos_token_id=eos,
                )
                outs[setting] = out.tokens
                t = totals[(setting, method)]
                t[0] += len(out.tokens)
                t[1] += out.wall_time
                t[2] += out.accepted
                t[3] += out.draft_steps
            identical &= outs["stock"] == outs["packed"]
        print(f"[{i + 1}/{len(prompts)}] decoded")
    decoding = {}
    for setting in models:
        plain = totals[(setting, "plain")]
        base = plain[0] / plain[1]
        decoding[setting] = {}
        for method in methods:
            n, wall, acc, steps = totals[(setting, method)]
            rate = n / wall
            decoding[setting][method] = {
                "tokens_per_s": rate,
                "speedup_vs_plain": rate / base,
                "tau": (1 + acc / steps) if steps else 1.0,
                "tokens": n,
            }
        print(
            f"{setting:6s} "
            + "  ".join(
                f"{m} {decoding[setting][m]['tokens_per_s']:.1f} tok/s "
                f"({decoding[setting][m]['speedup_vs_plain']:.3f}x)"
                for m in methods
            )
        )
    print(f"tokens identical stock vs packed: {identical}")

    # 3. Batched generation.
    torch.set_num_threads(args.batch_threads)
    lengths = torch.randint(20, 81, (args.batch_size,), generator=gen).tolist()
    batch_prompts = [torch.randint(100, 30000, (n,), generator=gen).tolist() for n in lengths]
    batched: dict[str, list[float]] = {"stock": [], "packed": []}
    for _ in range(2):
        for setting in models:
            t = time.perf_counter()
            out = generate_batch(
                models[setting][0], batch_prompts, max_new_tokens=args.batch_new_tokens
            )
            batched[setting].append(sum(len(o.tokens) for o in out) / (time.perf_counter() - t))
    batch_row = {
        "batch_size": args.batch_size,
        "new_tokens": args.batch_new_tokens,
        "threads": args.batch_threads,
        "tokens_per_s_stock": statistics.mean(batched["stock"]),
        "tokens_per_s_packed": statistics.mean(batched["packed"]),
        "samples": batched,
    }
    print(
        f"generate_batch x{args.batch_size}: stock {batch_row['tokens_per_s_stock']:.0f} tok/s  "
        f"packed {batch_row['tokens_per_s_packed']:.0f} tok/s"
    )
    result = {
        "benchmark": "bf16 CPU linears: F.linear against prepacked oneDNN weights",
        "threads": args.threads,
        "linears": linear_rows,
        "decoding": {
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "drafter": args.drafter,
            "tokens_identical": identical,
            "results": decoding,
        },
        "batched_generation": batch_row,
        "machine_load": {"before": load_before, "after": os.getloadavg()},
        **info,
    }
    write_json_atomic(Path(args.out), result)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
