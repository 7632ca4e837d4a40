"""Batched generation with the target, shared by self-distillation and Magpie.

:func:`generate_batch` decodes several prompts together (left padding, one KV cache, finished
rows dropped); :func:`keyed_generator` gives each row its own sampling stream, seeded from a key
(record and turn, or candidate index), so a row's tokens do not depend on its batch.
:func:`device_problems` and :func:`resolve_device` read the ``--device`` flag of the commands
that generate (``draftsmith data distill``, ``draftsmith data prompts``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from ...heads.sampling import SamplingParams, eos_set, greedy_ids, logits_to_probs

__all__ = [
    "GeneratedSequence",
    "generate_batch",
    "keyed_generator",
]


@dataclass
class GeneratedSequence:
    """One generated answer.

    Attributes:
        tokens: Generated ids, prompt excluded, the end-of-turn token included when reached.
        stop_reason: ``"eos"`` or ``"length"`` (hit ``max_new_tokens``).
    """

    tokens: list[int]
    stop_reason: str


def keyed_generator(*key: object, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` whose stream depends only on ``key``.

    The seed is the SHA-256 of the key's parts joined by NUL, e.g. ``(seed, record id, turn)``,
    so the same key draws the same tokens whichever batch, order or run it comes in.
    """
    digest = hashlib.sha256("\0".join(str(k) for k in key).encode()).digest()
    gen = torch.Generator(device=device)
    return gen.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _trim_left(cache: DynamicCache, n: int) -> None:
    """Drop the first ``n`` cached positions of every layer (columns of padding only)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", True) and layer.keys is not None:
            layer.keys = layer.keys[..., n:, :]
            layer.values = layer.values[..., n:, :]


def _pick(
    logits: torch.Tensor,
    sampling: SamplingParams,
    generators: Sequence[torch.Generator | None] | None,
) -> torch.Tensor:
    """Next token per row: argmax, or a draw from each row's own generator.

    Args:
        logits: ``[B, V]``.
        sampling: Sampling parameters.
        generators: One per row (sampling only).

    Returns:
        ``[B]`` long.
    """
    if sampling.greedy:
        return greedy_ids(logits)
    probs = logits_to_probs(logits, sampling)  # [B, V]
    gens = generators or [None] * probs.shape[0]
    # One draw per row from that row's generator (a [1, V] multinomial, exactly as the
    # single-sequence loop draws), so a row's tokens do not depend on its batch neighbours.
    return torch.cat(
        [torch.multinomial(probs[j : j + 1], 1, generator=g)[:, 0] for j, g in enumerate(gens)]
    )


@torch.inference_mode()
def generate_batch(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    eos_token_id: int | Collection[int] | None = None,
    pad_token_id: int = 0,
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[GeneratedSequence]:
    """Decode several prompts together: left padding, one KV cache, finished rows dropped.

    Per row this is plain decoding: the first token comes from the prompt's last position, and
    each next token from a one-token forward with the cache. Padding is masked with a 2D
    attention mask and position ids count real tokens only, so each row sees what it would see
    alone. When a row ends it leaves the batch (its cache rows are dropped, and so are leading
    columns that are padding for every remaining row), which keeps late steps cheap.

    Args:
        model: HF causal LM in eval mode.
        prompts: ``B`` token id lists (at least one token each).
        max_new_tokens: Most tokens to generate per prompt (>= 1).
        sampling: Greedy (default) or sampling parameters.
        eos_token_id: Token id(s) that end a sequence (kept in its output).
        pad_token_id: Id written into padding positions (masked, so any valid id).
        generators: ``B`` generators for sampling, one per prompt (``None``: torch's default).

    Returns:
        ``B`` :class:`GeneratedSequence`, in prompt order.
    """
    sampling = sampling or SamplingParams()
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_batch needs at least one prompt, each of at least one token")
    if generators is not None and len(generators) != len(prompts):
        raise ValueError(f"got {len(generators)} generators for {len(prompts)} prompts")
    eos = eos_set(eos_token_id)
    device = next(model.parameters()).device
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[r, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [B, T]; padding gets 0 (masked anyway)
    next_pos = mask.sum(-1)  # [B]: position of each row's next token

    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[:, -1]  # [B, V]
    rows = list(range(b))  # original index of each row still in the batch
    results = [GeneratedSequence(tokens=[], stop_reason="length") for _ in range(b)]
    for step in range(max_new_tokens):
        gens = [generators[r] for r in rows] if generators is not None else None
        toks = _pick(logits, sampling, gens)  # [B']
        keep = []
        for j, (r, t) in enumerate(zip(rows, toks.tolist(), strict=True)):
            results[r].tokens.append(t)
            if t in eos:
                results[r].stop_reason = "eos"
            else:
                keep.append(j)
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(rows):
            sel = torch.tensor(keep, device=device)
            cache.batch_select_indices(sel)
            rows = [rows[j] for j in keep]
            mask, toks, next_pos = mask[sel], toks[sel], next_pos[sel]
            first = int(mask.any(dim=0).to(torch.int8).argmax())  # first non-padding column
            if first:
                _trim_left(cache, first)
                mask = mask[:, first:]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        out = model(
            input_ids=toks[:, None],
            attention_mask=mask,
            position_ids=next_pos[:, None],
            cache=cache,
            use_cache=True,
        )
        next_pos = next_pos + 1
        logits = out.logits[:, -1]
    return results
