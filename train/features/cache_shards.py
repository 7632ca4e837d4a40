"""The units of a hidden-state cache build: the deterministic plan, and one shard's work.

Samples are sorted by length (longest first, ties by index), packed into forwards of at most
``batch_tokens`` padded tokens, and the forwards grouped into shards of about ``shard_mb``
(:func:`make_plan`). A shard's forwards are run and packed (:func:`compute_shard`), then written
to a temp file and renamed (:func:`write_shard`), so a shard file is always whole; its header
records the plan hash (:func:`shard_ok`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import safety
from ..staged import staged_file
from .cache_format import META_KEY, DiskSpaceError
from .source import run_target

__all__ = [
    "Plan",
    "compute_shard",
    "make_plan",
    "read_header",
    "shard_name",
    "shard_ok",
    "write_shard",
]


@dataclass
class Plan:
    """Deterministic work plan: shards of forwards of sample indices (length-sorted)."""

    shards: list[list[list[int]]]  # shard -> batch -> sample indices
    shard_tokens: list[int]
    bytes_per_token: int

    def shard_bytes(self, k: int) -> int:
        """Bytes shard ``k`` takes (its tokens × bytes per token)."""
        return self.shard_tokens[k] * self.bytes_per_token


def make_plan(
    lengths: np.ndarray,
    batch_tokens: int,
    max_batch_size: int,
    shard_bytes: int,
    bytes_per_token: int,
) -> Plan:
    """Pack samples into forwards and forwards into shards; depends only on the arguments.

    Args:
        lengths: ``[N]`` tokens per sample (after truncation).
        batch_tokens: most padded tokens (batch × longest) per forward.
        max_batch_size: most samples per forward.
        shard_bytes: a shard is closed once it holds at least this many bytes.
        bytes_per_token: cache bytes per token (all layers, plus ids and mask).
    """
    # Longest first: the biggest forward (the one that could run out of memory) comes first,
    # and the ETA starts pessimistic. Stable sort -> ties keep dataset order (deterministic).
    order = np.argsort(-lengths, kind="stable")
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order.tolist():
        n = int(lengths[i])
        new_max = max(cur_max, n)
        if cur and (new_max * (len(cur) + 1) > batch_tokens or len(cur) >= max_batch_size):
            batches.append(cur)
            cur, new_max = [], n
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    shards: list[list[list[int]]] = []
    tokens: list[int] = []
    acc: list[list[int]] = []
    acc_tok = 0
    for b in batches:
        acc.append(b)
        acc_tok += int(lengths[b].sum())
        if acc_tok * bytes_per_token >= shard_bytes:
            shards.append(acc)
            tokens.append(acc_tok)
            acc, acc_tok = [], 0
    if acc:
        shards.append(acc)
        tokens.append(acc_tok)
    return Plan(shards, tokens, bytes_per_token)


def shard_name(k: int) -> str:
    """File name of shard ``k`` in the cache directory."""
    return f"shard-{k:05d}.safetensors"


def read_header(path: Path) -> dict[str, Any]:
    """A shard's draftsmith metadata, read from its header without touching its tensors."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        meta = json.loads(fh.read(n)).get("__metadata__") or {}
    return json.loads(meta.get(META_KEY, "{}"))


def shard_ok(path: Path, plan_hash: str) -> bool:
    """Whether ``path`` is a whole shard written for the plan ``plan_hash`` (kept on resume)."""
    if not path.is_file():
        return False
    try:
        return read_header(path).get("plan") == plan_hash
    except (OSError, ValueError):
        return False


def write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> int:
    """Write to a temp file, fsync, rename: a shard file is either absent or whole.

    Raises:
        DiskSpaceError: the shard does not fit (checked first), or its write failed for lack
            of space; the temp file is removed, earlier shards are kept for a resume.
    """
    from safetensors.torch import save_file

    need = sum(t.numel() * t.element_size() for t in tensors.values()) + (1 << 16)
    # safetensors creates files 0600; ranks/trainers running as other users must read them.
    with staged_file(path, need_bytes=need, mode=0o644) as tmp:
        try:
            # One metadata key holding sorted JSON: safetensors writes a multi-key metadata map
            # in hash order, which would make otherwise identical shards differ byte-wise
            # between runs.
            save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(metadata, sort_keys=True)})
            # fsync before the rename (only here): a shard is large and kept across a resume,
            # so after a power loss its name must not point at unwritten blocks.
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except Exception as exc:
            # The cache's own DiskSpaceError, which says what to shrink (staged_file would
            # raise the plain one).
            if safety.disk_full(exc):
                raise DiskSpaceError(path.parent, need, detail=f"writing {path.name}") from exc
            raise
    return path.stat().st_size


def _fetch_rows(
    data: Any, indices: list[int], max_length: int | None
) -> list[tuple[list, list, str]]:
    """``(input_ids, loss_mask, id)`` of the given samples, truncated."""
    if hasattr(data, "with_format") and hasattr(data, "select"):
        cols = data[indices]  # one Arrow take for the whole batch
        ids_col = cols.get("id") or [None] * len(indices)
        rows = zip(cols["input_ids"], cols["loss_mask"], ids_col, strict=True)
    else:
        rows = ((data[i]["input_ids"], data[i]["loss_mask"], data[i].get("id")) for i in indices)
    out = []
    for i, (ids, mask, sid) in zip(indices, rows, strict=True):
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        mask = mask.tolist() if hasattr(mask, "tolist") else list(mask)
        out.append((ids[:max_length], mask[:max_length], str(i if sid is None else sid)))
    return out


def compute_shard(
    target: torch.nn.Module,
    data: Any,
    batches: list[list[int]],
    layers: list[int],
    store: torch.dtype,
    max_length: int | None,
    bar: Any,
) -> dict[str, torch.Tensor]:
    """Forward every batch of one shard; pack the valid positions into shard tensors."""
    hidden, ids_all, mask_all, index, lens = [], [], [], [], []
    for batch in batches:
        rows = _fetch_rows(data, batch, max_length)
        n = [len(r[0]) for r in rows]
        t = max(n)
        input_ids = torch.zeros((len(rows), t), dtype=torch.long)
        attn = torch.zeros((len(rows), t), dtype=torch.long)
        for i, (ids, _, _) in enumerate(rows):
            input_ids[i, : n[i]] = torch.tensor(ids, dtype=torch.long)
            attn[i, : n[i]] = 1
        # No mask when nothing is padded (common after length sorting): plain causal attention.
        mask = None if min(n) == t else attn
        with torch.inference_mode():
            hs = run_target(target, input_ids, mask, layers)  # only these are kept
            # Cast per layer before stacking so the [B, T, L, H] copy is in the storage dtype.
            # .cpu() after the stack: one device->host transfer per forward.
            stacked = torch.stack([hs[layer].to(store) for layer in layers], dim=2).cpu()
        for i, (ids, lmask, _) in enumerate(rows):
            hidden.append(stacked[i, : n[i]])
            ids_all.append(torch.tensor(ids, dtype=torch.long))
            mask_all.append(torch.tensor(lmask, dtype=torch.uint8))
        index.extend(batch)
        lens.extend(n)
        bar.update(sum(n))
    offsets = torch.zeros(len(lens) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.long), 0)
    return {
        "hidden": torch.cat(hidden).contiguous(),
        "input_ids": torch.cat(ids_all),
        "loss_mask": torch.cat(mask_all),
        "offsets": offsets,
        "sample_index": torch.tensor(index, dtype=torch.long),
    }
