"""Reading a finished hidden-state cache: :class:`HiddenStateCache`, a map-style dataset."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .cache_format import (
    DTYPE_NAMES,
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    CacheError,
    CacheMismatchError,
)

__all__ = ["HiddenStateCache", "cached_max_length"]


def cached_max_length(path: str | Path) -> int | None:
    """The ``max_length`` a cache was built with (its samples truncated to it), or None when
    it has none or no readable manifest (opening the cache then names the problem)."""
    try:
        value = json.loads((Path(path) / MANIFEST_FILE).read_text()).get("max_length")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


class HiddenStateCache(torch.utils.data.Dataset):
    """A finished hidden-state cache as a map-style dataset, in the original sample order.

    Item ``i`` is ``{"input_ids": [T] long, "loss_mask": [T] long, "hidden_states": {layer:
    [T, H]} (storage dtype), "id": str, "index": i}``. Shards are memory-mapped lazily per
    process (safe with forked DataLoader workers); a read is one contiguous slice.
    """

    def __init__(
        self,
        path: str | Path,
        layers: Sequence[int] | None = None,
        max_length: int | None = None,
    ):
        """Args:
        path: the cache directory.
        layers: return only these layers (must be cached); default: all cached layers.
        max_length: cut samples to this many tokens on read.

        Raises:
            CacheError: If the directory holds no finished cache (no manifest).
            CacheMismatchError: If ``layers`` asks for layers the cache lacks.
        """
        from safetensors.torch import load_file

        self.path = Path(path)
        mpath = self.path / MANIFEST_FILE
        if not mpath.is_file():
            partial = any(self.path.glob("shard-*.safetensors"))
            hint = (
                " (shards exist: the build did not finish; rerun the same cache command to resume)"
                if partial
                else f"; build it with `draftsmith data cache --data <tokenized data> --out "
                f"{self.path}`"
            )
            raise CacheError(f"{self.path} holds no finished hidden-state cache{hint}")
        try:
            self.manifest: dict[str, Any] = json.loads(mpath.read_text())
        except (OSError, ValueError) as exc:
            raise CacheError(
                f"{mpath}: cannot read the cache manifest ({exc}); rebuild the cache with "
                "`draftsmith data cache ... --overwrite`"
            ) from exc
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != FORMAT_VERSION:
            raise CacheError(
                f"{self.path}: cache format {self.manifest.get('format')!r} v"
                f"{self.manifest.get('version')} is not {FORMAT!r} v{FORMAT_VERSION}"
            )
        self.cached_layers: list[int] = list(self.manifest["layers"])
        self.layers = list(layers) if layers is not None else list(self.cached_layers)
        self.verify(layers=self.layers)
        self._cols = [self.cached_layers.index(x) for x in self.layers]
        self.max_length = max_length
        index = load_file(str(self.path / self.manifest["index"]))
        self._shard = index["shard"].numpy()
        self._offset = index["offset"].numpy()
        self._length = index["length"].numpy()
        self._files = [self.path / s["file"] for s in self.manifest["shards"]]
        self._ids: list[str] | None = None
        self._handles: dict[int, Any] = {}
        self._pid = os.getpid()

    @property
    def dtype(self) -> torch.dtype:
        """Storage dtype of the hidden states."""
        return DTYPES[self.manifest["dtype"]]

    @property
    def lengths(self) -> np.ndarray:
        """``[N]`` tokens per sample (after ``max_length``), e.g. for length-grouped batching."""
        return np.minimum(self._length, self.max_length or np.iinfo(np.int64).max)

    @property
    def ids(self) -> list[str]:
        """The samples' ``id`` values in dataset order."""
        if self._ids is None:
            self._ids = json.loads((self.path / self.manifest["ids"]).read_text())
        return self._ids

    def __len__(self) -> int:
        return len(self._shard)

    def __getstate__(self) -> dict[str, Any]:
        # Open file handles cannot be pickled (spawned DataLoader workers); workers reopen them.
        return {**self.__dict__, "_handles": {}}

    def _handle(self, k: int) -> Any:
        from safetensors import safe_open

        if self._pid != os.getpid():  # a forked worker must not share the parent's handles
            self._handles, self._pid = {}, os.getpid()
        h = self._handles.get(k)
        if h is None:
            h = self._handles[k] = safe_open(str(self._files[k]), framework="pt")
        return h

    def _slice(self, i: int) -> tuple[Any, int, int]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for a cache of {len(self)} samples")
        i = i % len(self)
        n = int(self._length[i])
        if self.max_length is not None:
            n = min(n, self.max_length)
        return self._handle(int(self._shard[i])), int(self._offset[i]), n

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = int(i)
        h, off, n = self._slice(i)
        hidden = h.get_slice("hidden")[off : off + n]  # [n, L, H], one contiguous read
        return {
            "input_ids": h.get_slice("input_ids")[off : off + n],
            "loss_mask": h.get_slice("loss_mask")[off : off + n].long(),
            "hidden_states": {
                layer: hidden[:, c] for layer, c in zip(self.layers, self._cols, strict=True)
            },
            "id": self.ids[i % len(self)],
            "index": i % len(self),
        }

    def token_view(self) -> _TokenView:
        """The cached ``input_ids``/``loss_mask`` only (no hidden states read), as a sequence."""
        return _TokenView(self)

    def verify(self, **expected: Any) -> None:
        """Check the manifest against what the trainer expects; raise on any difference.

        Keyword Args (each optional; None = not checked):
            layers: feature layers the drafter needs; must all be cached.
            target_hash: :func:`~draftsmith.train.features.source.target_weights_hash` of the
                target the trainer loads.
            target_path: the target directory (compared after resolving).
            template_fingerprint: the chat-template fingerprint of the trainer's tokenizer.
            hidden_size, vocab_size, num_layers: the target's dimensions.
            dtype: storage dtype name (``bf16``/``fp16``/``fp32``).
            dataset_fingerprint: :func:`~draftsmith.train.features.source.dataset_fingerprint`
                of the trainer's tokenized data.
            max_length: truncation length used when building.

        Raises:
            CacheMismatchError: Naming every differing field with both values.
            TypeError: For an unknown field.
        """
        m = self.manifest
        t = m.get("target", {})
        found = {
            "target_hash": t.get("hash"),
            "target_path": t.get("path"),
            "template_fingerprint": m.get("template_fingerprint"),
            "hidden_size": m.get("hidden_size"),
            "vocab_size": t.get("vocab_size"),
            "num_layers": t.get("num_layers"),
            "dtype": m.get("dtype"),
            "dataset_fingerprint": m.get("dataset_fingerprint"),
            "max_length": m.get("max_length"),
        }
        mismatches: list[tuple[str, Any, Any]] = []
        for key, want in expected.items():
            if key != "layers" and key not in found:
                raise TypeError(
                    f"verify() got an unknown field {key!r}; known: layers, {', '.join(found)}"
                )
            if want is None:
                continue
            if key == "layers":
                want = [int(x) for x in want]
                if not set(want) <= set(m["layers"]):
                    missing = sorted(set(want) - set(m["layers"]))
                    mismatches.append((f"layers (missing {missing})", want, list(m["layers"])))
                continue
            have = found[key]
            if key == "target_path":
                same = have is not None and Path(want).resolve() == Path(have).resolve()
                want = str(want)
            elif key == "dtype" and isinstance(want, torch.dtype):
                want = DTYPE_NAMES.get(want, str(want))
                same = want == have
            else:
                same = want == have
            if not same:
                mismatches.append((key, want, have))
        if mismatches:
            raise CacheMismatchError(self.path, mismatches)


class _TokenView:
    """Sequence of ``{"input_ids", "loss_mask"}`` read from a cache's shards."""

    def __init__(self, cache: HiddenStateCache):
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        h, off, n = self.cache._slice(int(i))
        return {
            "input_ids": h.get_slice("input_ids")[off : off + n],
            "loss_mask": h.get_slice("loss_mask")[off : off + n].long(),
        }
