"""Generic token batching used by every recipe: tokenized samples as tensors, right-padding.

Distillation trains on tokens alone; the feature-level recipes (EAGLE, Medusa) batch the same
samples with the target's hidden states added (:mod:`draftsmith.train.features.source`), so one
collate pads both. Which samples share a batch (random, or grouped by length) is the training
loader's business: :func:`draftsmith.train.core.data.train_loader`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .tokens import TokenDataError

__all__ = ["Collate", "TokenDataset", "collate_hidden_states"]


class TokenDataset(torch.utils.data.Dataset):
    """Tokenized samples as tensors, the online counterpart of
    :class:`~draftsmith.train.features.cache_read.HiddenStateCache`.

    Item ``i`` is ``{"input_ids": [T] long, "loss_mask": [T] long, "id": str, "index": i}``.
    """

    def __init__(self, data: Any, max_length: int | None = None):
        """Args:
        data: a ``datasets.Dataset`` or a sequence of mappings with ``input_ids``,
            ``loss_mask`` and optionally ``id``.
        max_length: truncate samples to this many tokens.
        """
        self.data = data
        self.max_length = max_length

    def __len__(self) -> int:
        return len(self.data)

    @property
    def lengths(self) -> np.ndarray:
        """``[N]`` tokens per sample (after ``max_length``), read without building the samples'
        tensors, e.g. for length-grouped batching (a ``datasets.Dataset`` through Arrow)."""
        if hasattr(self.data, "with_format"):  # datasets.Dataset: list lengths, no row decoded
            import pyarrow.compute as pc

            column = self.data.with_format("arrow")["input_ids"]  # honours select()/filter()
            lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        else:
            lengths = np.array([len(row["input_ids"]) for row in self.data], dtype=np.int64)
        lengths = lengths.astype(np.int64)
        return np.minimum(lengths, self.max_length) if self.max_length is not None else lengths

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.data[int(i)]
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)[: self.max_length]
        mask = torch.as_tensor(row["loss_mask"], dtype=torch.long)[: self.max_length]
        if ids.shape != mask.shape:
            raise TokenDataError(
                f"sample {i}: {ids.numel()} input_ids but {mask.numel()} loss_mask"
            )
        sid = row.get("id") if isinstance(row, Mapping) else None
        return {
            "input_ids": ids,
            "loss_mask": mask,
            "id": str(i if sid is None else sid),
            "index": int(i),
        }


def collate_hidden_states(
    samples: Sequence[Mapping[str, Any]], pad_token_id: int = 0
) -> dict[str, Any]:
    """Right-pad samples into a batch.

    Args:
        samples: items of :class:`TokenDataset` or
            :class:`~draftsmith.train.features.cache_read.HiddenStateCache`.
        pad_token_id: id written into padded ``input_ids`` positions (masked anyway).

    Returns:
        ``input_ids [B, T]`` long, ``attention_mask [B, T]`` long (1 = real token),
        ``loss_mask [B, T]`` long (0 in padding), ``hidden_states {layer: [B, T, H]}`` (zeros in
        padding; only if the samples carry them), ``ids`` list[str], ``index [B]`` long.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    b, t = len(samples), max(lengths)
    input_ids = torch.full((b, t), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, t), dtype=torch.long)
    loss_mask = torch.zeros((b, t), dtype=torch.long)
    for i, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        input_ids[i, :n] = s["input_ids"]
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = s["loss_mask"]
    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "ids": [str(s.get("id", "")) for s in samples],
        "index": torch.tensor([int(s.get("index", -1)) for s in samples], dtype=torch.long),
    }
    if "hidden_states" in samples[0]:
        hidden = {}
        for layer, first in samples[0]["hidden_states"].items():
            out = _batch_tensor((b, t, first.shape[-1]), first.dtype)
            for i, (s, n) in enumerate(zip(samples, lengths, strict=True)):
                out[i, :n] = s["hidden_states"][layer]
                out[i, n:] = 0  # each element written once: the padding zeroed, not the batch
            hidden[layer] = out
        batch["hidden_states"] = hidden
    return batch


def _batch_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor for a batch's hidden states; in shared memory in a DataLoader
    worker.

    A worker hands its batch to the training process through shared memory; a tensor made in
    ordinary memory is copied there first (for an 8B target's features, ~33 KB a token: one
    more copy of ~270 MB per 8k-token batch). Made there directly, as torch's default collate
    does, it is written once.
    """
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


@dataclass
class Collate:
    """Picklable collate (DataLoader workers pickle it under spawn)."""

    pad_token_id: int = 0

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return collate_hidden_states(samples, self.pad_token_id)
