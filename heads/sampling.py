"""Turning target/draft logits into the distributions that speculative sampling compares.

Speculative sampling is lossless only if the target distribution ``p`` and the draft distribution
``q`` are the *processed* ones -- after temperature, top-k and top-p -- because those are the
distributions plain decoding samples from (Leviathan et al. 2023, §2.3; Chen et al. 2023, Alg. 2).
Both sides therefore go through :func:`logits_to_probs` with the same :class:`SamplingParams`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch


def sampling_problems(temperature: float, top_k: int, top_p: float) -> list[tuple[str, str]]:
    """Every problem with a set of sampling parameters, as ``(field, problem)`` pairs."""
    problems = []
    if temperature < 0:
        problems.append(("temperature", f"must be >= 0, got {temperature}"))
    if top_k < 0:
        problems.append(("top_k", f"must be >= 0, got {top_k}"))
    if not 0.0 < top_p <= 1.0:
        problems.append(("top_p", f"must be in (0, 1], got {top_p}"))
    return problems


#: Logit dtypes whose CPU ``argmax`` takes a slow reduction (torch 2.13): upcast first.
_SLOW_CPU_ARGMAX = (torch.bfloat16, torch.float16)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The greedy tokens: ``logits.argmax(-1)``, ``[..., V]`` -> ``[...]`` long.

    On a CPU, torch's bf16/fp16 ``argmax`` is a slow scalar reduction: 1.24 ms for a 7-token
    tree verify's ``[7, 49152]`` logits against 0.32 ms in fp32 (one thread, torch 2.13), about
    1.5 % of a SmolLM2 round. The upcast is exact, so the index is the same, ties included (the
    first maximal one). Other devices take the logits as they are.
    """
    if logits.device.type == "cpu" and logits.dtype in _SLOW_CPU_ARGMAX:
        logits = logits.float()
    return logits.argmax(dim=-1)


def eos_set(eos_token_id: int | Collection[int] | None) -> set[int]:
    """The end-of-sequence ids as a set (None -> no EOS: generate to the budget)."""
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
        top_k: keep the k most likely tokens before sampling (0 = off).
        top_p: nucleus sampling: keep the smallest set of tokens whose mass reaches top_p (1 = off).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        problems = sampling_problems(self.temperature, self.top_k, self.top_p)
        if problems:
            text = "; ".join(f"{name} {problem}" for name, problem in problems)
            raise ValueError(f"invalid sampling parameters: {text}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed sampling distribution for each row of logits.

    Args:
        logits: ``[..., V]`` raw logits.
        params: sampling parameters (must not be greedy).

    Returns:
        ``[..., V]`` float32 probabilities; tokens removed by top-k/top-p have probability 0.
    """
    if params.greedy:
        raise ValueError("logits_to_probs is for sampling; greedy decoding uses argmax")
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # Mass of the tokens strictly before each one: a token is kept while that mass is < top_p,
        # so the most likely token is always kept (same rule as HF's TopPLogitsWarper).
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        remove_sorted = mass_before >= params.top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        x = x.masked_fill(remove, float("-inf"))
    return torch.softmax(x, dim=-1)


def confidence(logits: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """The drafter's confidence in each row's pick (``Proposal.confidence``), ``[...]`` float32.

    Greedy (``probs`` None): the softmax probability of the argmax, ``1 / sum(exp(l - max))``,
    without materialising the distribution. Sampling: the processed row's largest probability,
    which is known before the token is drawn, so a decision that reads it cannot favour the
    draws it likes (docs/design.md, "What to verify, per step").

    Args:
        logits: ``[..., V]`` the drafter's logits for each row.
        probs: ``[..., V]`` the processed distribution each row's token was drawn from, or None.
    """
    if probs is not None:
        return probs.max(dim=-1).values.float()
    x = logits.float()
    return 1.0 / torch.exp(x - x.max(dim=-1, keepdim=True).values).sum(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row, by inverting each row's cumulative distribution.

    One uniform per row against the row's running sum: token i is drawn when
    ``c[i-1] <= u < c[i]`` with ``u ~ U[0, c[V-1])``, i.e. with probability ``probs[i] / sum``;
    zero-probability tokens have an empty interval and are never drawn. ``torch.multinomial``
    draws the same distribution but on the CPU spends 1.05 ms on one 49,152-token row (it makes
    per-element randomness) against 0.095 ms here (``bench/cpu_costs/sampling_cpu.json``), and a sampled
    speculative step draws several rows.

    Args:
        probs: ``[..., V]`` probabilities (need not be normalised, must be non-negative with a
            positive sum per row).
        generator: source of randomness, for reproducible runs.

    Returns:
        ``[...]`` long tensor of token ids.
    """
    flat = probs.reshape(-1, probs.shape[-1])
    # float64 running sums: a 49k-term float32 sum drifts by ~1e-6, the size of rare tokens.
    cum = flat.double().cumsum(-1)  # [R, V]
    total = cum[:, -1:].contiguous()
    u = torch.rand(total.shape, generator=generator, device=flat.device, dtype=torch.float64)
    out = torch.searchsorted(cum, u * total, right=True)  # [R, 1]
    # u * total rounds up to total once in ~2^53 draws: take the last token with mass then.
    last = torch.searchsorted(cum, total, right=False)
    out = torch.minimum(out, last)
    return out.reshape(probs.shape[:-1])


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None):
    """Pick tokens from logits the way plain decoding would.

    Args:
        logits: ``[..., V]``.
        params: sampling parameters.
        generator: randomness for sampling.

    Returns:
        ``(tokens [...], probs [..., V] or None)`` -- probs is None for greedy.
    """
    if params.greedy:
        return greedy_ids(logits), None
    probs = logits_to_probs(logits, params)
    return sample(probs, generator), probs
