"""The verify-cost probe: what one target forward costs on this device, by draft shape.

The per-step decision (``heads/auto.py``) weighs each candidate set's expected tokens against
what verifying it costs, so it needs the target's forward time for a chain of w tokens and for a
tree of n nodes, on the run's own device, dtype and threads, with a KV cache of a typical
context. The curve is not smooth: on a CPU, oneDNN picks kernels by shape, and in fp32 on the
AVX2 kind a forward of 4 tokens is cheaper than one of 3 (docs/performance.md); on a GPU it is
nearly flat. So it is measured, not modelled: two untimed rounds, then ``reps`` rounds that
visit every shape once each (interleaved: a slow spell of the machine hits every shape alike),
and the median per shape. Every repetition is kept in the record (``verify_costs`` in the
evaluation's JSON). A few seconds on a CPU.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from transformers import DynamicCache

from ...heads.auto import VerifyCosts
from ..device import DeviceTimer, make_generator
from ..target_model.kernels import grouped_kv_attention
from .speculative import _tree_inputs

CHAIN_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
TREE_NODES = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)


def tree_parents(nodes: int, topk: int = 4) -> list[int]:
    """A breadth-first top-k tree of ``nodes`` nodes, the shape an EAGLE-2 tree takes."""
    parents: list[int] = []
    frontier, nxt = [-1], []
    while len(parents) < nodes:
        for p in frontier:
            for _ in range(topk):
                if len(parents) == nodes:
                    break
                parents.append(p)
                nxt.append(len(parents) - 1)
        frontier, nxt = nxt[:topk], []
    return parents


@torch.inference_mode()
def probe_verify_costs(
    target: Any,
    *,
    context: int = 256,
    chain_widths: tuple[int, ...] = CHAIN_WIDTHS,
    tree_nodes: tuple[int, ...] = TREE_NODES,
    reps: int = 9,
    warmup: int = 3,
) -> tuple[VerifyCosts, dict[str, Any]]:
    """Time the target's verify forwards on its device (module doc).

    Args:
        target: the HF causal LM, on its device and in the run's dtype.
        context: tokens in the KV cache while timing (about a prompt plus half an answer).
        chain_widths: chain forwards to time (1 = a plain step).
        tree_nodes: tree sizes to time (root + n nodes, the loop's ancestor mask).
        reps: timed rounds; the median of each shape is its cost.
        warmup: untimed rounds first.

    Returns:
        ``(costs, record)``: the medians as :class:`VerifyCosts` (seconds), and the record
        ``{"context", "reps", "chain": {w: [ms, ...]}, "tree": {n: [ms, ...]}, "median_ms"}``.
    """
    device = target.device
    clock = DeviceTimer(device).now
    gen = make_generator(device, 0)
    vocab = int(target.config.vocab_size)
    cache = DynamicCache(config=target.config)
    shapes = [("chain", w) for w in chain_widths] + [("tree", n) for n in tree_nodes]
    masks = {n: _tree_inputs(tree_parents(n), context, device)[:2] for n in tree_nodes}
    samples: dict[tuple[str, int], list[float]] = {s: [] for s in shapes}
    with grouped_kv_attention(device):
        prompt = torch.randint(0, vocab, (1, context), generator=gen, device=device)
        target(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
        for rnd in range(warmup + reps):
            for kind, size in shapes:
                width = size if kind == "chain" else size + 1
                ids = torch.randint(0, vocab, (1, width), generator=gen, device=device)
                extra = {}
                if kind == "tree":
                    mask, pos = masks[size]
                    extra = {"attention_mask": mask, "position_ids": pos}
                t0 = clock()  # synchronized on a GPU: the forward's kernels fall inside
                target(input_ids=ids, cache=cache, use_cache=True, **extra)
                seconds = clock() - t0
                cache.crop(-width)  # back to the context
                if rnd >= warmup:
                    samples[(kind, size)].append(seconds)
    median = {s: statistics.median(v) for s, v in samples.items()}
    costs = VerifyCosts(
        chain={w: median[("chain", w)] for w in chain_widths},
        tree={n: median[("tree", n)] for n in tree_nodes},
    )
    record = {
        "context": context,
        "reps": reps,
        "warmup": warmup,
        "chain": {str(w): [round(1e3 * x, 3) for x in samples[("chain", w)]] for w in chain_widths},
        "tree": {str(n): [round(1e3 * x, 3) for x in samples[("tree", n)]] for n in tree_nodes},
        "median_ms": {
            "chain": {str(w): round(1e3 * costs.chain[w], 3) for w in chain_widths},
            "tree": {str(n): round(1e3 * costs.tree[n], 3) for n in tree_nodes},
        },
    }
    return costs, record
