"""Draft vocabulary statistics: supervised-token frequencies and EAGLE-3's reduced draft vocabulary.

EAGLE-3 drafters predict over a smaller vocabulary of the N tokens the target most often emits in
the training data. Two tensors map between the vocabularies (the convention of SafeAILab/EAGLE,
SpecForge and vLLM, which load them from the exported checkpoint):

- ``d2t`` (int64 ``[N]``): offsets, ``target_id = draft_id + d2t[draft_id]``. The draft ids are
  the chosen tokens **sorted by target id**, so ``d2t`` is non-decreasing and ``d2t[0]`` equals
  the smallest chosen target id.
- ``t2d`` (bool ``[V]``): ``t2d[target_id]`` is True iff the target token is in the draft vocab.

Choosing the N tokens: highest supervised count first, ties (zero counts included) broken by the
smaller token id, so the choice is deterministic. SpecForge breaks ties by ``Counter`` insertion
order and pads a short vocabulary with the lowest unused ids; ours gives the same padding and a
reproducible order otherwise. ``always_include`` forces tokens in before the frequency ranking:
the CLI forces the tokenizer's EOS token(s) so a drafter can always propose the end of a turn,
even on a small or odd dataset (in chat data it is among the most frequent supervised tokens
anyway). Other special tokens (``<|im_start|>``, role headers) are never supervised under
assistant-only masks and are not forced.

The counts are stored as ``vocab_stats.safetensors`` (``counts [V]`` int64, plus ``d2t``/``t2d``
when a draft size was asked for) beside a hidden-state cache, or anywhere with ``draftsmith data
vocab``. The draft size is a training decision, so the counts are what a cache keeps; call
:func:`draft_vocab` to derive any N from them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UsageError
from .tokens import TokenDataError, iter_token_chunks, load_token_data

__all__ = [
    "VOCAB_STATS_FILE",
    "VocabError",
    "coverage",
    "draft_vocab",
    "load_vocab_stats",
    "save_vocab_stats",
    "t2d_index",
    "token_counts",
]

VOCAB_STATS_FILE = "vocab_stats.safetensors"


class VocabError(UsageError):
    """A draft vocabulary cannot be built as asked (size outside ``[1, V]``, bad forced ids)."""


def token_counts(
    data: Any, vocab_size: int, max_length: int | None = None, *, source: str | None = None
) -> torch.Tensor:
    """Count each token id over supervised positions (``loss_mask == 1``).

    Args:
        data: A tokenized-data path (see :func:`~draftsmith.train.data.tokens.load_token_data`),
            a ``datasets.Dataset``, a cache's token view, or a sequence of mappings with
            ``input_ids`` and ``loss_mask``.
        vocab_size: V, the target's vocabulary size (``lm_head`` rows).
        max_length: count only the first ``max_length`` tokens of each sample.
        source: what errors name the data by (default: the path, when ``data`` is one).

    Returns:
        ``[V]`` int64 counts.

    Raises:
        TokenDataError: If a token id is outside ``[0, V)`` (a ValueError).
    """
    where = f"{source}: " if source else ""
    if isinstance(data, (str, Path)):
        where = where or f"{data}: "
        data = load_token_data(Path(data))
    counts = np.zeros(vocab_size, dtype=np.int64)
    for chunk in iter_token_chunks(data, max_length=max_length):
        supervised = chunk.loss_mask == 1
        sup = chunk.input_ids[supervised]
        if sup.size and (sup.min() < 0 or sup.max() >= vocab_size):
            ids = chunk.input_ids
            pos = int(np.argmax(supervised & ((ids < 0) | (ids >= vocab_size))))
            sample = chunk.start + int(np.searchsorted(np.cumsum(chunk.lengths), pos, "right"))
            raise TokenDataError(
                f"{where}sample {sample}: token id {int(ids[pos])} is outside the vocabulary "
                f"[0, {vocab_size}) -- was the data tokenized for another model?"
            )
        counts += np.bincount(sup, minlength=vocab_size)
    return torch.from_numpy(counts)


# --------------------------------------------------------------------------------------------
# The reduced draft vocabulary
# --------------------------------------------------------------------------------------------


def draft_vocab(
    counts: torch.Tensor, n: int, always_include: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's reduced draft vocabulary: the N most frequent tokens, as ``(d2t, t2d)``.

    Args:
        counts: ``[V]`` supervised-token counts (:func:`token_counts`).
        n: N, draft vocabulary size, ``1 <= N <= V``.
        always_include: target ids placed in the draft vocab whatever their count (e.g. EOS).

    Returns:
        ``d2t``: ``[N]`` int64 offsets, ``target_id = i + d2t[i]``, draft ids sorted by target id.
        ``t2d``: ``[V]`` bool, True for target ids in the draft vocabulary.

    Raises:
        VocabError: If ``n`` is out of range, or ``always_include`` holds more than ``n`` ids or
            an id outside the vocabulary.
    """
    counts_np = counts.detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)
    v = counts_np.shape[0]
    if not 1 <= n <= v:
        raise VocabError(f"draft_vocab_size must be in [1, {v}] (the target's vocabulary), got {n}")
    forced = np.zeros(v, dtype=bool)
    for t in always_include:
        if not 0 <= int(t) < v:
            raise VocabError(f"always_include id {t} is outside the vocabulary [0, {v})")
        forced[int(t)] = True
    if forced.sum() > n:
        raise VocabError(f"always_include holds {int(forced.sum())} ids, more than N = {n}")
    ids = np.arange(v, dtype=np.int64)
    # lexsort: last key is primary. Forced first, then by descending count, then by id.
    order = np.lexsort((ids, -counts_np, ~forced))
    chosen = np.sort(order[:n])
    d2t = torch.from_numpy(chosen - np.arange(n, dtype=np.int64))
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[torch.from_numpy(chosen)] = True
    return d2t, t2d


def t2d_index(t2d: torch.Tensor) -> torch.Tensor:
    """Target id → draft id lookup (``-1`` outside the draft vocab), e.g. to map labels.

    Args:
        t2d: ``[V]`` bool mask from :func:`draft_vocab`.

    Returns:
        ``[V]`` int64, on ``t2d``'s device (computed there, without a host sync).
    """
    rank = torch.cumsum(t2d.long(), dim=0) - 1  # draft ids are the chosen ids in target order
    return torch.where(t2d.bool(), rank, torch.full_like(rank, -1))


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of supervised tokens whose id is in the draft vocabulary (0 if no tokens)."""
    total = int(counts.sum())
    return float(int(counts[t2d].sum()) / total) if total else 0.0


# --------------------------------------------------------------------------------------------
# Storage
# --------------------------------------------------------------------------------------------


def save_vocab_stats(
    path: str | Path,
    counts: torch.Tensor,
    *,
    n: int | None = None,
    always_include: Sequence[int] = (),
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``counts`` (and ``d2t``/``t2d`` for draft size ``n``) to a safetensors file.

    Written to a temp file and renamed, so a reader never sees half a file.

    Args:
        path: output file (``vocab_stats.safetensors`` by convention).
        counts: ``[V]`` int64 supervised-token counts.
        n: draft vocabulary size; None stores the counts only.
        always_include: see :func:`draft_vocab`.
        metadata: extra string-able facts stored in the file header.

    Returns:
        The header metadata written (stored as one JSON string under the key ``draftsmith``).
    """
    from safetensors.torch import save_file

    from ..staged import staged_file

    path = Path(path)
    counts = counts.to(torch.int64).contiguous()
    tensors = {"counts": counts}
    meta: dict[str, Any] = {
        "vocab_size": int(counts.numel()),
        "supervised_tokens": int(counts.sum()),
        "distinct_tokens": int((counts > 0).sum()),
        **(dict(metadata) if metadata else {}),
    }
    if n is not None:
        d2t, t2d = draft_vocab(counts, n, always_include)
        tensors |= {"d2t": d2t, "t2d": t2d}
        meta |= {
            "draft_vocab_size": n,
            "always_include": [int(t) for t in always_include],
            "coverage": coverage(counts, t2d),
        }
    need = sum(t.numel() * 8 for t in tensors.values())
    # No free-space check before (check_space=False): the file is small and the estimate only
    # sizes a disk-full error. 0644: safetensors creates 0600 files; caches are shared.
    with staged_file(path, need_bytes=need, check_space=False, mode=0o644) as tmp:
        # One key of sorted JSON: safetensors writes several keys in hash order (not
        # reproducible).
        save_file(tensors, str(tmp), metadata={"draftsmith": json.dumps(meta, sort_keys=True)})
    return meta


def load_vocab_stats(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a ``vocab_stats.safetensors`` file (or a cache directory holding one).

    Returns:
        ``(tensors, metadata)``: tensors ``counts`` and, if stored, ``d2t``/``t2d``.
    """
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        path = path / VOCAB_STATS_FILE
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iter
        meta = json.loads((f.metadata() or {}).get("draftsmith", "{}"))
    return tensors, meta
