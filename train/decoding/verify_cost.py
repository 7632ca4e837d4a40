"""The verify-cost probe: what one target forward costs on this device, by draft shape.

The per-step decision (``heads/auto.py``) weighs each candidate set's expected tokens against
what verifying it costs, so it needs the target's forward time for a chain of w tokens and for a
tree of n nodes, on the run's own device, dtype and threads, with a KV cache of a typical
context. The curve is not smooth: on a CPU, oneDNN picks kernels by shape, and in fp32 on the
AVX2 kind a forward of 4 tokens is cheaper than one of 3 (docs/performance.md); on a GPU it is
nearly flat. So it is measured, not modelled: three untimed rounds, then ``reps`` rounds that
visit every shape once each (interleaved: a slow spell of the machine hits every shape alike),
and the median per shape, fitted non-decreasing in size except where a dip is beyond the
repetitions' noise (:func:`smooth`). Every repetition is kept in the record (``verify_costs`` in the
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
    reps: int = 11,
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
        ``(costs, record)``: the curve the decision uses (:func:`smooth` of the repetitions) as
        :class:`VerifyCosts` (seconds), and the record ``{"context", "reps", "chain": {w: [ms,
        ...]}, "tree": {n: [ms, ...]}, "median_ms", "used_ms"}``.
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
    chain = smooth([samples[("chain", w)] for w in chain_widths])
    tree = smooth([samples[("tree", n)] for n in tree_nodes])
    costs = VerifyCosts(
        chain=dict(zip(chain_widths, chain, strict=True)),
        tree=dict(zip(tree_nodes, tree, strict=True)),
    )
    record = {
        "context": context,
        "reps": reps,
        "warmup": warmup,
        "chain": {str(w): [round(1e3 * x, 3) for x in samples[("chain", w)]] for w in chain_widths},
        "tree": {str(n): [round(1e3 * x, 3) for x in samples[("tree", n)]] for n in tree_nodes},
        "median_ms": {
            "chain": {str(w): round(1e3 * median[("chain", w)], 3) for w in chain_widths},
            "tree": {str(n): round(1e3 * median[("tree", n)], 3) for n in tree_nodes},
        },
        "used_ms": {
            "chain": {str(w): round(1e3 * costs.chain[w], 3) for w in chain_widths},
            "tree": {str(n): round(1e3 * costs.tree[n], 3) for n in tree_nodes},
        },
    }
    return costs, record


def smooth(samples: list[list[float]], z: float = 3.0) -> list[float]:
    """The cost curve the decision uses: non-decreasing in size where the data allow it, with
    every dip the repetitions show beyond noise kept.

    A forward over more tokens costs at least as much as one over fewer unless the kernels
    change with the shape (fp32 on the AVX2 kind: 4 tokens cheaper than 3, by 12 %). The median
    of a few repetitions on a shared machine dips by noise too, and a decision that trusted such
    a dip would verify the dip's size every step. So the medians are fitted non-decreasing (pool
    adjacent violators, weights equal), and a size keeps its own median only where it lies below
    the fit by more than ``z`` standard errors of that median (1.4826 · MAD / √reps).

    Args:
        samples: the repetitions of each size, in ascending size order.

    Returns:
        The cost of each size.
    """
    medians = [statistics.median(s) for s in samples]
    blocks: list[list[float]] = []  # [sum, count]
    for m in medians:
        blocks.append([m, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted: list[float] = []
    for total, count in blocks:
        fitted += [total / count] * int(count)
    out = []
    for reps, m, f in zip(samples, medians, fitted, strict=True):
        mad = statistics.median(abs(x - m) for x in reps)
        se = 1.4826 * mad / max(len(reps), 1) ** 0.5
        out.append(m if m < f - z * se else f)
    return out
