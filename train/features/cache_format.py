"""The hidden-state cache's on-disk format: file names, version, storage dtypes, and its errors.

Both sides of a cache use these: the writer (:mod:`draftsmith.train.features.cache_write`) and the
reader (:mod:`draftsmith.train.features.cache_read`).

Cache directory layout::

    manifest.json               written LAST: its presence means "complete"; what, from what
    index.safetensors           sample -> (shard, offset, length), int64 [N] each
    ids.json                    the samples' ``id`` values, in dataset order
    vocab_stats.safetensors     supervised-token counts [V] (see draftsmith.train.data.vocab)
    shard-00000.safetensors     hidden [n_tok, L, H], input_ids [n_tok], loss_mask [n_tok],
    shard-00001.safetensors     offsets [n+1], sample_index [n]; header: plan hash, shard no.

Why one ``hidden [n_tok, L, H]`` tensor per shard, samples concatenated: a sample's features for
all its layers are one contiguous byte range, so a read is one slice of a memory-mapped file (no
per-sample tensor names to parse in a huge header, one sequential read on cold storage), and a
trainer that needs all layers (EAGLE-3 concatenates them) gets them in one go.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .. import safety
from ..errors import UsageError

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "FORMAT",
    "FORMAT_VERSION",
    "IDS_FILE",
    "INDEX_FILE",
    "MANIFEST_FILE",
    "META_KEY",
    "CacheError",
    "CacheMismatchError",
    "DiskSpaceError",
]

FORMAT = "draftsmith-hidden-states"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.safetensors"
IDS_FILE = "ids.json"
#: The one safetensors metadata key of a shard header (holding sorted JSON).
META_KEY = "draftsmith"

#: Storage dtypes by config name.
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
#: Config names by storage dtype.
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CacheError(UsageError):
    """A cache cannot be built or read (bad settings, stale or incomplete directory): exit 2."""


class DiskSpaceError(safety.DiskSpaceError):
    """The output filesystem cannot hold the cache (exit 1).

    :class:`draftsmith.train.safety.DiskSpaceError`'s "no space left on <path>: need ~X, have Y"
    plus ``detail``: what the cache holds and how to make it smaller.
    """

    def __init__(self, path: str | Path, need: int, have: int | None = None, detail: str = ""):
        super().__init__(path, need, have)
        if detail:
            self.strerror = f"{self.strerror} ({detail})"


class CacheMismatchError(CacheError):
    """The cache was built for something else than the trainer expects.

    Attributes:
        mismatches: ``(field, expected, found)`` triples, one per differing field.
    """

    def __init__(self, path: str | Path, mismatches: list[tuple[str, Any, Any]]):
        self.mismatches = mismatches
        lines = [f"hidden-state cache {path} does not match what the trainer expects:"]
        lines += [f"  {f}: trainer expects {e!r}, cache has {c!r}" for f, e, c in mismatches]
        lines.append(
            "  rebuild it for this trainer (`draftsmith data cache --data <tokenized data> --out "
            "<dir> --target <the trainer's target> --overwrite`) or point the run at a matching "
            "cache"
        )
        super().__init__("\n".join(lines))
