"""Target hidden states for drafter training: an offline sharded cache, or computed online.

Feature-level drafters (EAGLE-1/3, Medusa) learn from the frozen target's hidden states at the
layers they declare (see :data:`draftsmith.heads.base.Features` for the index convention: 0 =
embeddings, i = output of layer i-1, ``num_layers`` = final output after the last norm). A recipe
gets them in one of two ways, switched by one config field (``hidden_states: online|offline``),
with identical batches either way (:func:`feature_source`):

- **offline**: :func:`build_cache` runs the target once over the tokenized data and writes a
  cache directory; :class:`HiddenStateCache` reads it (a ``torch.utils.data.Dataset``) after
  checking its manifest against what the trainer expects (:meth:`HiddenStateCache.verify`).
- **online**: :class:`OnlineHiddenStates` runs the target inside the training step on each
  padded batch (:func:`compute_hidden_states`).

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

Building is deterministic: samples are sorted by length (longest first, ties by index), packed
into forwards of at most ``batch_tokens`` padded tokens, and the forwards grouped into shards of
about ``shard_mb``. The plan depends only on the data and the settings, so

- a restart skips the shards already on disk (each is written to a temp file and renamed, so a
  shard file is always whole) and recomputes the others with the same batches: the result is
  byte-identical to an uninterrupted run;
- accelerate rank r of W processes shards r, r + W, ...; the cache does not depend on W (up to
  floating-point differences between devices/thread counts); rank 0 merges the index after a
  barrier. The output directory must be on a filesystem every rank can see.

One build per directory: rank 0 holds ``<out>.lock`` beside it, and a second build into the same
directory is refused naming the holder's PID. Free space is checked before the build (the whole
estimate) and before each shard; a shard that still fails for lack of space is removed and the
build stops with "no space left on ...", keeping the finished shards for a resume.

A cache records its target's weights hash (:func:`target_weights_hash`); a trainer passes
``expect={"target_hash": target_fingerprint(target)}`` to :func:`feature_source`, so a cache
built from another target of the same shapes is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from draftsmith.train import safety
from draftsmith.train.config import cfg_field
from draftsmith.train.data.vocab import (
    VOCAB_STATS_FILE,
    iter_token_chunks,
    load_token_data,
    save_vocab_stats,
    token_counts,
)
from draftsmith.train.errors import UsageError, cli_main
from draftsmith.train.runinfo import json_text, output_lock

if TYPE_CHECKING:
    from accelerate import PartialState

__all__ = [
    "DTYPES",
    "CacheConfig",
    "CacheError",
    "CacheMismatchError",
    "DiskSpaceError",
    "FeatureSource",
    "HiddenStateCache",
    "OnlineHiddenStates",
    "TokenDataset",
    "build_cache",
    "collate_hidden_states",
    "compute_hidden_states",
    "dataset_fingerprint",
    "default_layers",
    "estimate_cache_bytes",
    "feature_source",
    "main_cache",
    "process_state",
    "run_cache",
    "target_fingerprint",
    "target_weights_hash",
]

FORMAT = "draftsmith-hidden-states"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.safetensors"
IDS_FILE = "ids.json"
_META_KEY = "draftsmith"

#: Storage dtypes by config name.
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# What the weights hash reads of each weight file: name, size, safetensors header and this many
# evenly spaced chunks. Re-training or re-quantizing changes (nearly) every weight, so sampled
# bytes catch it while reading ~16 MiB per file instead of the whole checkpoint.
_HASH_CHUNKS = 16
_HASH_CHUNK_BYTES = 1 << 20
_HASH_SCHEME = (
    "sha256 of config.json, and per weight file (*.safetensors, *.bin, *.pt, *.gguf): name, size, "
    f"safetensors header, {_HASH_CHUNKS} evenly spaced {_HASH_CHUNK_BYTES >> 20} MiB chunks"
)


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


# --------------------------------------------------------------------------------------------
# Identity of what went into a cache
# --------------------------------------------------------------------------------------------


def default_layers(kind: str, num_layers: int) -> list[int]:
    """Feature layers a drafter kind reads, in the :data:`~draftsmith.heads.base.Features` convention.

    EAGLE-3 fuses a low, a middle and a high layer (outputs of layers 1, n/2-1 and n-4, as in
    SpecForge/vLLM) and trains against the final normed output; EAGLE-1 and Medusa read the
    final output only.

    Args:
        kind: ``eagle3``, ``eagle1`` or ``medusa``.
        num_layers: the target's ``num_hidden_layers``.

    Returns:
        e.g. ``[2, 15, 27, 30]`` for EAGLE-3 on a 30-layer target.
    """
    if kind == "eagle3":
        return sorted({2, num_layers // 2, num_layers - 3, num_layers})
    if kind in ("eagle1", "medusa"):
        return [num_layers]
    raise ValueError(f"unknown drafter kind {kind!r}; expected eagle3, eagle1 or medusa")


def target_weights_hash(path: str | Path) -> str:
    """A cheap content hash of a Hugging Face model directory (see ``_HASH_SCHEME``).

    Covers ``config.json`` and every weight file's name, size, safetensors header (tensor names,
    dtypes, shapes, offsets) and 16 evenly spaced 1 MiB chunks of its bytes. Any re-training,
    conversion or quantization changes it; a single hand-edited weight could slip through.

    Args:
        path: the model directory.

    Returns:
        Hex sha256 digest.

    Raises:
        CacheError: If ``path`` has no ``config.json`` or no weight file.
    """
    path = Path(path)
    weights = sorted(
        p
        for pattern in ("*.safetensors", "*.bin", "*.pt", "*.gguf")
        for p in path.glob(pattern)
        if p.is_file()
    )
    if not (path / "config.json").is_file() or not weights:
        raise CacheError(f"{path} is not a model directory (needs config.json and weight files)")
    h = hashlib.sha256()
    h.update(b"config.json\0" + (path / "config.json").read_bytes())
    for p in weights:
        size = p.stat().st_size
        h.update(f"\0{p.name}\0{size}\0".encode())
        with open(p, "rb") as fh:
            if p.suffix == ".safetensors":
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(min(n, size)))
            if size <= _HASH_CHUNKS * _HASH_CHUNK_BYTES:
                fh.seek(0)
                h.update(fh.read())
                continue
            step = (size - _HASH_CHUNK_BYTES) // (_HASH_CHUNKS - 1)
            for i in range(_HASH_CHUNKS):
                fh.seek(i * step)
                h.update(fh.read(_HASH_CHUNK_BYTES))
    return h.hexdigest()


def target_fingerprint(target: str | Path | torch.nn.Module | None) -> str | None:
    """The weights hash a cache records for ``target``, for ``expect={"target_hash": ...}``.

    A trainer passes it to :func:`feature_source` (or :meth:`HiddenStateCache.verify`) so that a
    cache built from another target with the same shapes (another fine-tune, a quantization) is
    refused instead of silently training the drafter on the wrong features.

    Args:
        target: the target's model directory, or the loaded model (its ``name_or_path`` -- what
            ``from_pretrained``/``load_target`` set -- must be a local directory; DDP/FSDP
            wrappers are looked through).

    Returns:
        :func:`target_weights_hash` of the directory (the value :func:`build_cache` records),
        or None when the target has no local directory (a model built in memory): then there
        is nothing to compare and the field is not checked.
    """
    if target is None:
        return None
    if isinstance(target, torch.nn.Module):
        inner = _unwrap(target)
        config = getattr(inner, "config", None)
        path = getattr(config, "name_or_path", "") or getattr(inner, "name_or_path", "")
    else:
        path = target
    if not path or not Path(path).is_dir():
        return None
    return target_weights_hash(path)


def dataset_fingerprint(data: Any, max_length: int | None = None) -> str:
    """Content hash of tokenized data: every sample's ``input_ids`` and ``loss_mask``.

    Independent of the container (``datasets.Dataset`` or list of dicts) and of chunking; the
    ``id`` column is not included (it does not change any tensor).

    Args:
        data: see :func:`draftsmith.train.data.vocab.iter_token_chunks`.
        max_length: if set, samples are hashed as truncated to this many tokens.

    Returns:
        Hex sha256 digest.
    """
    return _scan(data, max_length)[1]


def _scan(
    data: Any, max_length: int | None, vocab_size: int | None = None
) -> tuple[np.ndarray, str]:
    """Lengths ``[N]`` (after truncation) and the content fingerprint, in one pass.

    With ``vocab_size``, also refuses token ids the target cannot embed (before any forward).
    """
    h_len, h_ids, h_mask = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    lengths = []
    for chunk in iter_token_chunks(data, max_length=max_length):
        ids, mask, lens = chunk.input_ids, chunk.loss_mask, chunk.lengths
        if vocab_size is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            pos = int(np.argmax((ids < 0) | (ids >= vocab_size)))
            sample = chunk.start + int(np.searchsorted(np.cumsum(lens), pos, side="right"))
            raise CacheError(
                f"sample {sample}: token id {int(ids[pos])} is outside the target's vocabulary "
                f"[0, {vocab_size}) -- was the data tokenized for another model?"
            )
        bad_mask = (mask != 0) & (mask != 1)
        if bad_mask.any():
            pos = int(np.argmax(bad_mask))
            sample = chunk.start + int(np.searchsorted(np.cumsum(lens), pos, side="right"))
            raise CacheError(
                f"sample {sample}: loss_mask value {int(mask[pos])}; values must be 0 or 1"
            )
        if lens.size and lens.min() == 0:
            # A forward over zero tokens fails deep inside the model; name the sample instead.
            raise CacheError(f"sample {chunk.start + int(np.argmin(lens))}: no tokens")
        h_len.update(lens.astype("<i8").tobytes())
        h_ids.update(ids.astype("<i8").tobytes())
        h_mask.update(mask.astype(np.uint8).tobytes())
        lengths.append(lens)
    digest = hashlib.sha256(
        b"".join(h.digest() for h in (h_len, h_ids, h_mask)) + f"{max_length}".encode()
    ).hexdigest()
    return (np.concatenate(lengths) if lengths else np.zeros(0, np.int64)), digest


def _template_fingerprint(tokenizer: Any) -> str:
    """The tokenizer's template fingerprint, exactly as the data stage records it."""
    from draftsmith.train.data.tokenize import template_fingerprint

    return template_fingerprint(tokenizer)


# --------------------------------------------------------------------------------------------
# Running the target
# --------------------------------------------------------------------------------------------


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside DDP/FSDP1 wrappers (FSDP2 keeps the class, so this is a no-op)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _input_device(target: torch.nn.Module) -> torch.device:
    """Where input ids go: the embedding's device (first device under ``device_map``)."""
    inner = _unwrap(target)
    with contextlib.suppress(AttributeError, NotImplementedError):
        return inner.get_input_embeddings().weight.device
    return next(inner.parameters()).device


def _forward_kwargs(target: torch.nn.Module) -> dict[str, Any]:
    # Only the last position's logits: the lm_head over the full vocab would otherwise cost up
    # to a fifth of a small target's forward and a [B, T, V] tensor nobody reads.
    params = inspect.signature(type(_unwrap(target)).forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def _run_target(
    target: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """All hidden states (``num_layers + 1`` tensors ``[B, T, H]``), in the caller's grad mode."""
    device = _input_device(target)
    out = target(
        input_ids=input_ids.to(device),
        attention_mask=None if attention_mask is None else attention_mask.to(device),
        output_hidden_states=True,
        use_cache=False,
        **_forward_kwargs(target),
    )
    return out.hidden_states


def _check_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    layers = [int(x) for x in layers]
    if not layers:
        raise CacheError("no layers requested")
    bad = [x for x in layers if not 0 <= x <= num_layers]
    if bad:
        raise CacheError(
            f"layers {bad} out of range: the target has {num_layers} layers, so valid feature "
            f"layers are 0..{num_layers} (0 = embeddings, {num_layers} = final normed output)"
        )
    if len(set(layers)) != len(layers):
        raise CacheError(f"layers {layers} has duplicates")
    return layers


def compute_hidden_states(
    target: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    layers: Sequence[int],
    *,
    dtype: torch.dtype | None = None,
) -> dict[int, torch.Tensor]:
    """Run the frozen target on a padded batch and return the requested hidden states.

    Runs under ``torch.no_grad()`` rather than ``inference_mode``: inference tensors cannot be
    saved for backward, and the drafter's first layer saves its input.

    Args:
        target: the (frozen) causal LM, possibly wrapped by DDP/FSDP or spread by ``device_map``.
        batch: ``input_ids [B, T]`` and optionally ``attention_mask [B, T]`` (1 = real token,
            right padding).
        layers: feature layers (:data:`~draftsmith.heads.base.Features` convention).
        dtype: cast the results to this dtype (e.g. the cache's storage dtype); default: keep.

    Returns:
        ``{layer: [B, T, H]}`` on the target's input device; padded positions are zero, as in a
        collated offline batch.
    """
    mask = batch.get("attention_mask")
    with torch.no_grad():
        hs = _run_target(target, batch["input_ids"], mask)
        layers = _check_layers(layers, len(hs) - 1)
        keep = None if mask is None else mask.to(hs[0].device).bool().unsqueeze(-1)
        out = {}
        for layer in layers:
            t = hs[layer] if dtype is None else hs[layer].to(dtype)
            out[layer] = t if keep is None else t.masked_fill(~keep, 0)
    return out


# --------------------------------------------------------------------------------------------
# Samples, collation and the online path
# --------------------------------------------------------------------------------------------


class TokenDataset(torch.utils.data.Dataset):
    """Tokenized samples as tensors, the online counterpart of :class:`HiddenStateCache`.

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

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.data[int(i)]
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)[: self.max_length]
        mask = torch.as_tensor(row["loss_mask"], dtype=torch.long)[: self.max_length]
        if ids.shape != mask.shape:
            raise CacheError(f"sample {i}: {ids.numel()} input_ids but {mask.numel()} loss_mask")
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
        samples: items of :class:`TokenDataset` or :class:`HiddenStateCache`.
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
            out = first.new_zeros((b, t, first.shape[-1]))
            for i, (s, n) in enumerate(zip(samples, lengths, strict=True)):
                out[i, :n] = s["hidden_states"][layer]
            hidden[layer] = out
        batch["hidden_states"] = hidden
    return batch


class OnlineHiddenStates:
    """Fill a collated batch's ``hidden_states`` from the frozen target, inside the train step.

    Call it on the batch after moving it to the device (not in DataLoader workers: the target
    lives on the accelerator, possibly sharded by FSDP).
    """

    def __init__(
        self,
        target: torch.nn.Module,
        layers: Sequence[int],
        dtype: torch.dtype | None = None,
    ):
        """Args:
        target: the frozen causal LM (put in eval mode here).
        layers: feature layers to compute.
        dtype: cast hidden states to this dtype (match the offline cache's storage dtype to get
            the same batches from both paths).
        """
        self.target = target.eval()
        self.layers = list(layers)
        self.dtype = dtype

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Return ``batch`` with ``hidden_states {layer: [B, T, H]}`` added (a new dict)."""
        hidden = compute_hidden_states(self.target, batch, self.layers, dtype=self.dtype)
        return {**batch, "hidden_states": hidden}


@dataclass
class FeatureSource:
    """What a recipe needs to get feature batches, online or offline alike.

    Use::

        src = feature_source(cfg.hidden_states, layers=..., data=tokens, cache=cfg.cache_dir,
                             target=target, expect={...})
        loader = DataLoader(src.dataset, batch_size=8, collate_fn=src.collate, shuffle=True)
        for batch in loader:
            batch = src.complete(batch, device)   # hidden_states {layer: [B, T, H]} on device

    Attributes:
        mode: ``online`` or ``offline``.
        dataset: a map-style dataset of samples.
        collate: pads samples into a batch (:func:`collate_hidden_states`).
        layers: the feature layers batches carry.
        target: online only, the frozen target.
        dtype: hidden-state dtype of completed batches (None: as computed / as stored).
    """

    mode: str
    dataset: torch.utils.data.Dataset
    collate: Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]
    layers: list[int]
    target: torch.nn.Module | None = None
    dtype: torch.dtype | None = None
    _online: OnlineHiddenStates | None = field(default=None, repr=False)

    def complete(self, batch: dict[str, Any], device: str | torch.device | None = None) -> dict:
        """Move the batch's tensors to ``device`` and make sure it carries hidden states.

        Online: the target computes them now. Offline: they came from the cache and are cast to
        ``dtype`` if one was set.
        """
        moved = _to_device(batch, device)
        if self._online is not None:
            return self._online(moved)
        if self.dtype is not None:
            moved["hidden_states"] = {
                k: v.to(self.dtype) for k, v in moved["hidden_states"].items()
            }
        return moved


def feature_source(
    mode: str,
    *,
    layers: Sequence[int],
    data: Any = None,
    cache: str | Path | None = None,
    target: torch.nn.Module | None = None,
    dtype: torch.dtype | None = None,
    expect: Mapping[str, Any] | None = None,
    max_length: int | None = None,
    pad_token_id: int = 0,
) -> FeatureSource:
    """Build the online or offline feature source from one config value.

    Args:
        mode: ``online`` (needs ``data`` and ``target``) or ``offline`` (needs ``cache``).
        layers: feature layers the drafter needs (offline: a subset of the cached ones).
        data: tokenized samples (``input_ids``/``loss_mask``/``id``), online mode.
        cache: cache directory, offline mode.
        target: the frozen target, online mode.
        dtype: hidden-state dtype of completed batches.
        expect: offline: fields :meth:`HiddenStateCache.verify` checks (``layers`` is always
            checked).
        max_length: truncate samples (online; an offline cache keeps what it stored, truncated
            to this too).
        pad_token_id: padding id for ``input_ids``.

    Raises:
        ValueError: If ``mode`` is unknown or its inputs are missing.
        CacheMismatchError: Offline, if the cache does not match ``expect``/``layers``.
    """
    collate = _Collate(pad_token_id)
    if mode == "online":
        if data is None or target is None:
            raise ValueError("hidden_states: online needs the tokenized data and the target")
        online = OnlineHiddenStates(target, layers, dtype)
        return FeatureSource(
            "online", TokenDataset(data, max_length), collate, list(layers), target, dtype, online
        )
    if mode == "offline":
        if cache is None:
            raise ValueError("hidden_states: offline needs the cache directory")
        ds = HiddenStateCache(cache, layers=layers, max_length=max_length)
        ds.verify(**{**dict(expect or {}), "layers": list(layers)})
        return FeatureSource("offline", ds, collate, list(layers), None, dtype)
    raise ValueError(f"hidden_states must be 'online' or 'offline', got {mode!r}")


@dataclass
class _Collate:
    """Picklable collate (DataLoader workers pickle it under spawn)."""

    pad_token_id: int = 0

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return collate_hidden_states(samples, self.pad_token_id)


def _to_device(batch: dict[str, Any], device: str | torch.device | None) -> dict[str, Any]:
    if device is None:
        return dict(batch)
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.to(device, non_blocking=True)
        elif isinstance(v, dict):
            out[k] = {kk: vv.to(device, non_blocking=True) for kk, vv in v.items()}
        else:
            out[k] = v
    return out


# --------------------------------------------------------------------------------------------
# Offline: planning and building
# --------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """Deterministic work plan: shards of forwards of sample indices (length-sorted)."""

    shards: list[list[list[int]]]  # shard -> batch -> sample indices
    shard_tokens: list[int]
    bytes_per_token: int

    def shard_bytes(self, k: int) -> int:
        return self.shard_tokens[k] * self.bytes_per_token


def _make_plan(
    lengths: np.ndarray,
    batch_tokens: int,
    max_batch_size: int,
    shard_bytes: int,
    bytes_per_token: int,
) -> _Plan:
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
    return _Plan(shards, tokens, bytes_per_token)


def estimate_cache_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype: str) -> int:
    """Bytes a cache takes: tokens × layers × hidden × dtype bytes, plus 9 bytes/token of ids.

    Args:
        num_tokens: total tokens (after truncation).
        num_layers: number of cached feature layers.
        hidden_size: H.
        dtype: storage dtype name (``bf16``/``fp16``/``fp32``).
    """
    elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
    return num_tokens * (num_layers * hidden_size * elem + 9)


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def _read_header(path: Path) -> dict[str, Any]:
    """A shard's draftsmith metadata, read from its header without touching its tensors."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        meta = json.loads(fh.read(n)).get("__metadata__") or {}
    return json.loads(meta.get(_META_KEY, "{}"))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> int:
    """Write to a temp file, fsync, rename: a shard file is either absent or whole.

    Raises:
        DiskSpaceError: the shard does not fit (checked first), or its write failed for lack
            of space; the temp file is removed, earlier shards are kept for a resume.
    """
    from safetensors.torch import save_file

    need = sum(t.numel() * t.element_size() for t in tensors.values()) + (1 << 16)
    safety.ensure_free_space(path.parent, need)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        # One metadata key holding sorted JSON: safetensors writes a multi-key metadata map in
        # hash order, which would make otherwise identical shards differ byte-wise between runs.
        save_file(tensors, str(tmp), metadata={_META_KEY: json.dumps(metadata, sort_keys=True)})
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        if safety.disk_full(exc):
            raise DiskSpaceError(path.parent, need, detail=f"writing {path.name}") from exc
        raise
    # safetensors creates files 0600; ranks/trainers running as other users must read them.
    tmp.chmod(0o644)
    os.replace(tmp, path)
    return path.stat().st_size


def _fetch(data: Any, indices: list[int], max_length: int | None) -> list[tuple[list, list, str]]:
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


def process_state() -> PartialState:
    """This process's accelerate state; CPU processes (gloo) when there is no accelerator.

    ``PartialState()`` alone never forms a multi-process group on a CPU-only machine (it needs
    ``cpu=True``), so 2 CPU processes started by ``accelerate launch``/``torchrun`` would each
    believe they are alone. ``ACCELERATE_USE_CPU=1`` forces CPU processes on a GPU machine.
    """
    from accelerate import PartialState

    forced = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    accel = getattr(torch, "accelerator", None)
    has_accelerator = accel.is_available() if accel is not None else torch.cuda.is_available()
    return PartialState(cpu=forced or not has_accelerator)


def _is_fsdp_sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - old torch
        FSDPModule = ()
    return isinstance(model, FSDPModule) or "FullyShardedDataParallel" in type(model).__name__


def build_cache(
    target: torch.nn.Module,
    data: Any,
    out_dir: str | Path,
    layers: Sequence[int],
    *,
    dtype: str = "bf16",
    batch_tokens: int = 8192,
    max_batch_size: int = 64,
    shard_mb: float = 512.0,
    max_length: int | None = None,
    template_fingerprint: str | None = None,
    target_path: str | Path | None = None,
    target_hash: str | None = None,
    draft_vocab_size: int | None = None,
    always_include: Sequence[int] = (),
    overwrite: bool = False,
    progress: bool = True,
    state: PartialState | None = None,
    on_shard_written: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run the frozen target over tokenized data and write a hidden-state cache (resumable).

    Every accelerate process calls this with the same arguments; each computes its own shards
    and rank 0 writes the index, vocab stats and manifest after a barrier. Shards already on
    disk from an interrupted run with the same plan are kept; a directory holding a cache of
    another plan is refused unless ``overwrite``.

    Args:
        target: the frozen causal LM, on this process's device (or spread by ``device_map``).
        data: tokenized samples: a ``datasets.Dataset`` or sequence of mappings with
            ``input_ids``, ``loss_mask`` and optionally ``id``.
        out_dir: cache directory (created).
        layers: feature layers to store (:data:`~draftsmith.heads.base.Features` convention).
        dtype: storage dtype, ``bf16``/``fp16``/``fp32``.
        batch_tokens: most padded tokens (batch × longest) per forward.
        max_batch_size: most samples per forward.
        shard_mb: target shard size in MiB (a shard holds whole forwards).
        max_length: truncate samples to this many tokens.
        template_fingerprint: the chat template fingerprint the data was tokenized with.
        target_path: recorded in the manifest (default: ``target.name_or_path``).
        target_hash: recorded in the manifest (default: :func:`target_weights_hash` of
            ``target_path`` when it is a directory).
        draft_vocab_size: also store ``d2t``/``t2d`` for this N in ``vocab_stats.safetensors``.
        always_include: token ids forced into the draft vocab (see ``draft_vocab``).
        overwrite: replace a cache of another plan in ``out_dir``.
        progress: show a progress bar (rank 0).
        state: accelerate state (default: :func:`process_state`).
        on_shard_written: called with the shard number after each shard this rank writes.

    Returns:
        Summary: ``out``, ``process_index``, ``num_processes``, ``num_samples``,
        ``num_tokens``, ``num_shards``, ``written`` and ``skipped`` (this rank's shard numbers),
        ``seconds``, ``tokens_per_s`` (this rank), ``estimate_bytes``.

    Raises:
        DiskSpaceError: If the free space cannot hold the shards still to write.
        CacheError: On bad settings or a stale directory.
    """
    state = state or process_state()
    if state.num_processes > 1 and _is_fsdp_sharded(target):
        # Each rank runs its own number of forwards here; FSDP needs every rank in every
        # forward (all-gathers), so ranks would wait on each other forever.
        raise CacheError(
            "offline caching does not support an FSDP-sharded target across processes: load it "
            "with device_map (one process per machine) or unsharded (one copy per process)"
        )
    if dtype not in DTYPES:
        raise CacheError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if draft_vocab_size is not None and draft_vocab_size < 1:
        raise CacheError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    if batch_tokens < 1 or max_batch_size < 1 or shard_mb <= 0:
        raise CacheError("batch_tokens, max_batch_size and shard_mb must be positive")
    out = Path(out_dir)
    config = _unwrap(target).config
    num_layers = int(config.num_hidden_layers)
    layers = _check_layers(layers, num_layers)
    hidden_size = int(config.hidden_size)
    vocab_size = int(_unwrap(target).get_output_embeddings().weight.shape[0])
    if draft_vocab_size is not None and draft_vocab_size > vocab_size:
        # Checked now, not when the vocab stats are written after every forward.
        raise CacheError(
            f"draft_vocab_size {draft_vocab_size} is larger than the target's vocabulary "
            f"({vocab_size} tokens); use at most {vocab_size}"
        )
    t0 = time.perf_counter()

    # The embedding's rows, which may exceed the lm_head's (padded vocabularies).
    embed_rows = int(_unwrap(target).get_input_embeddings().weight.shape[0])
    lengths, data_fp = _scan(data, max_length, embed_rows)
    if len(lengths) == 0:
        raise CacheError("the tokenized data holds no samples")
    num_tokens = int(lengths.sum())
    target_path = str(target_path or getattr(config, "name_or_path", "") or "") or None
    if target_hash is None:
        target_hash = target_fingerprint(target_path)
    store = DTYPES[dtype]
    bpt = len(layers) * hidden_size * store.itemsize + 9
    plan = _make_plan(lengths, batch_tokens, max_batch_size, int(shard_mb * (1 << 20)), bpt)
    plan_hash = hashlib.sha256(
        json.dumps(
            {
                "format": [FORMAT, FORMAT_VERSION],
                "data": data_fp,
                "max_length": max_length,
                "layers": layers,
                "dtype": dtype,
                "target_hash": target_hash,
                "compute_dtype": str(next(_unwrap(target).parameters()).dtype),
                "batch_tokens": batch_tokens,
                "max_batch_size": max_batch_size,
                "shard_mb": shard_mb,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()

    # One build per directory: rank 0 holds the lock for the job (its ranks share the directory).
    with contextlib.ExitStack() as stack:
        if state.is_main_process:
            stack.enter_context(output_lock(out, "hidden-state cache build"))
            _prepare_out_dir(out, plan_hash, len(plan.shards), overwrite)
        state.wait_for_everyone()

        done = [k for k in range(len(plan.shards)) if _shard_ok(out / _shard_name(k), plan_hash)]
        remaining = sum(plan.shard_bytes(k) for k in range(len(plan.shards)) if k not in set(done))
        estimate = estimate_cache_bytes(num_tokens, len(layers), hidden_size, dtype)
        free = _free_bytes(out)
        if state.is_main_process and progress:
            print(
                f"hidden-state cache {out}: {len(lengths)} samples, {num_tokens} tokens × "
                f"{len(layers)} layers {layers} × hidden {hidden_size} × {store.itemsize} B ({dtype}) "
                f"≈ {_fmt_bytes(estimate)} in {len(plan.shards)} shards; "
                f"{len(done)} shard(s) already done, {_fmt_bytes(remaining)} to write, "
                f"{_fmt_bytes(free)} free",
                file=sys.stderr,
            )
        if remaining > free:
            raise DiskSpaceError(
                out,
                remaining,
                free,
                detail=f"the hidden-state cache needs {remaining} bytes: {num_tokens} tokens × "
                f"{len(layers)} layers × {hidden_size} hidden × {store.itemsize} bytes in total, "
                f"only {free} bytes are free; cache fewer layers or use --dtype bf16",
            )

        mine = [k for k in range(state.process_index, len(plan.shards), state.num_processes)]
        todo = [k for k in mine if k not in set(done)]
        skipped = [k for k in mine if k in set(done)]
        for k in todo:  # a temp file left by a killed writer of one of our shards
            (out / f".{_shard_name(k)}.tmp").unlink(missing_ok=True)

        written: list[int] = []
        my_tokens = sum(plan.shard_tokens[k] for k in todo)
        t_work = time.perf_counter()
        bar = _progress_bar(my_tokens, progress and state.is_main_process, state)
        meta_common = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "plan": plan_hash,
            "layers": layers,
            "dtype": dtype,
        }
        # One writer thread: serializing/writing shard k overlaps the forwards of shard k+1.
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending: tuple[int, Future] | None = None
            for k in todo:
                tensors = _compute_shard(
                    target, data, plan.shards[k], layers, store, max_length, bar
                )
                meta = {**meta_common, "shard": k}
                if pending is not None:
                    pending[1].result()
                    written.append(pending[0])
                    if on_shard_written is not None:
                        on_shard_written(pending[0])
                pending = (k, pool.submit(_write_shard, out / _shard_name(k), tensors, meta))
            if pending is not None:
                pending[1].result()
                written.append(pending[0])
                if on_shard_written is not None:
                    on_shard_written(pending[0])
        bar.close()
        seconds = time.perf_counter() - t_work

        state.wait_for_everyone()
        if state.is_main_process:
            _finalize(
                out,
                data,
                plan,
                plan_hash,
                lengths,
                layers,
                dtype,
                hidden_size,
                num_layers,
                vocab_size,
                target,
                target_path,
                target_hash,
                template_fingerprint,
                data_fp,
                max_length,
                batch_tokens,
                max_batch_size,
                shard_mb,
                draft_vocab_size,
                always_include,
            )
        state.wait_for_everyone()
    return {
        "out": str(out),
        "process_index": state.process_index,
        "num_processes": state.num_processes,
        "num_samples": len(lengths),
        "num_tokens": num_tokens,
        "num_shards": len(plan.shards),
        "written": written,
        "skipped": skipped,
        "seconds": time.perf_counter() - t0,
        "tokens_per_s": my_tokens / seconds if seconds > 0 and my_tokens else None,
        "estimate_bytes": estimate,
    }


def _progress_bar(total: int, enabled: bool, state: Any) -> Any:
    from tqdm.auto import tqdm

    desc = "hidden states" + (
        f" (rank 0 of {state.num_processes})" if state.num_processes > 1 else ""
    )
    return tqdm(
        total=total,
        unit="tok",
        unit_scale=True,
        desc=desc,
        disable=not enabled,
        dynamic_ncols=True,
        smoothing=0.1,
    )


def _compute_shard(
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
        rows = _fetch(data, batch, max_length)
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
            hs = _run_target(target, input_ids, mask)
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


def _shard_ok(path: Path, plan_hash: str) -> bool:
    if not path.is_file():
        return False
    try:
        return _read_header(path).get("plan") == plan_hash
    except (OSError, ValueError):
        return False


def _prepare_out_dir(out: Path, plan_hash: str, num_shards: int, overwrite: bool) -> None:
    """Refuse (or with ``overwrite`` clear) a directory holding a cache of another plan."""
    out.mkdir(parents=True, exist_ok=True)
    stale: list[str] = []
    manifest = out / MANIFEST_FILE
    if manifest.is_file():
        with contextlib.suppress(OSError, ValueError):
            if json.loads(manifest.read_text()).get("plan") != plan_hash:
                stale.append(MANIFEST_FILE)
    for p in sorted(out.glob("shard-*.safetensors")):
        try:
            ok = _read_header(p).get("plan") == plan_hash and int(p.name[6:11]) < num_shards
        except (OSError, ValueError):
            ok = False  # unreadable: a shard is renamed into place whole, so this is foreign
        if not ok:
            stale.append(p.name)
    if not stale:
        return
    if not overwrite:
        raise CacheError(
            f"{out} holds a hidden-state cache built with other data or settings "
            f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}); choose another "
            f"output directory or pass overwrite (--overwrite) to replace it"
        )
    # The manifest goes first: a crash during cleanup must not leave a "complete" marker.
    for name in (MANIFEST_FILE, INDEX_FILE, IDS_FILE, VOCAB_STATS_FILE):
        (out / name).unlink(missing_ok=True)
    for p in out.glob("shard-*.safetensors"):
        p.unlink()
    for p in out.glob(".shard-*.tmp"):
        p.unlink()


def _finalize(
    out: Path,
    data: Any,
    plan: _Plan,
    plan_hash: str,
    lengths: np.ndarray,
    layers: list[int],
    dtype: str,
    hidden_size: int,
    num_layers: int,
    vocab_size: int,
    target: torch.nn.Module,
    target_path: str | None,
    target_hash: str | None,
    template_fp: str | None,
    data_fp: str,
    max_length: int | None,
    batch_tokens: int,
    max_batch_size: int,
    shard_mb: float,
    draft_vocab_size: int | None,
    always_include: Sequence[int],
) -> None:
    """Rank 0, after every shard exists: index, ids, vocab stats, then the manifest."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    n = len(lengths)
    shard_of = np.full(n, -1, dtype=np.int64)
    offset = np.zeros(n, dtype=np.int64)
    length = np.zeros(n, dtype=np.int64)
    shards_meta = []
    for k in range(len(plan.shards)):
        path = out / _shard_name(k)
        if not _shard_ok(path, plan_hash):
            raise CacheError(f"shard {path} is missing or stale after every rank finished")
        with safe_open(str(path), framework="pt") as f:
            idx = f.get_tensor("sample_index").numpy()
            offs = f.get_tensor("offsets").numpy()
        shard_of[idx] = k
        offset[idx] = offs[:-1]
        length[idx] = np.diff(offs)
        shards_meta.append(
            {
                "file": path.name,
                "num_samples": len(idx),
                "num_tokens": int(offs[-1]),
                "bytes": path.stat().st_size,
            }
        )
    if (shard_of < 0).any():
        raise CacheError(f"samples {np.nonzero(shard_of < 0)[0][:5].tolist()} are in no shard")
    if not np.array_equal(length, lengths):
        raise CacheError("shard contents disagree with the data's lengths (mixed caches?)")
    tmp = out / f".{INDEX_FILE}.tmp"
    save_file(
        {
            "shard": torch.from_numpy(shard_of),
            "offset": torch.from_numpy(offset),
            "length": torch.from_numpy(length),
        },
        str(tmp),
        metadata={"plan": plan_hash},
    )
    tmp.chmod(0o644)
    tmp.replace(out / INDEX_FILE)
    ids = [r[2] for r in _fetch_ids(data)]
    _write_json(out / IDS_FILE, ids, indent=None)
    counts = token_counts(data, vocab_size, max_length=max_length)
    save_vocab_stats(
        out / VOCAB_STATS_FILE,
        counts,
        n=draft_vocab_size,
        always_include=always_include,
        metadata={"dataset_fingerprint": data_fp},
    )
    from importlib import metadata as im

    versions = {}
    for pkg in ("draftsmith", "torch", "transformers"):
        with contextlib.suppress(im.PackageNotFoundError):
            versions[pkg] = im.version(pkg)
    inner = _unwrap(target)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "plan": plan_hash,
        "target": {
            "path": target_path,
            "hash": target_hash,
            "hash_covers": _HASH_SCHEME,
            "model_type": getattr(inner.config, "model_type", None),
            "num_layers": num_layers,
            "hidden_size": hidden_size,
            "vocab_size": vocab_size,
            "compute_dtype": str(next(inner.parameters()).dtype).removeprefix("torch."),
        },
        "layers": layers,
        "dtype": dtype,
        "hidden_size": hidden_size,
        "template_fingerprint": template_fp,
        "dataset_fingerprint": data_fp,
        "max_length": max_length,
        "num_samples": n,
        "num_tokens": int(lengths.sum()),
        "num_supervised_tokens": int(counts.sum()),
        "bytes_per_token": plan.bytes_per_token,
        "layout": {
            "hidden": "[tokens, len(layers), hidden_size] per shard, samples concatenated",
            "input_ids": "[tokens] int64",
            "loss_mask": "[tokens] uint8",
            "offsets": "[samples + 1] int64, sample j of a shard = rows offsets[j]:offsets[j+1]",
            "sample_index": "[samples] int64, dataset index of each sample of the shard",
        },
        "index": INDEX_FILE,
        "ids": IDS_FILE,
        "vocab_stats": VOCAB_STATS_FILE,
        "shards": shards_meta,
        "settings": {
            "batch_tokens": batch_tokens,
            "max_batch_size": max_batch_size,
            "shard_mb": shard_mb,
        },
        "versions": versions,
    }
    _write_json(out / MANIFEST_FILE, manifest, indent=2)


def _fetch_ids(data: Any) -> list[tuple[None, None, str]]:
    if hasattr(data, "column_names"):
        if "id" in data.column_names:
            return [(None, None, str(i if v is None else v)) for i, v in enumerate(data["id"])]
        return [(None, None, str(i)) for i in range(len(data))]
    return [
        (None, None, str(r.get("id", i) if r.get("id") is not None else i))
        for i, r in enumerate(data)
    ]


def _write_json(path: Path, obj: Any, indent: int | None) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json_text(obj, indent=indent) + "\n")
    tmp.replace(path)


# --------------------------------------------------------------------------------------------
# Offline: reading
# --------------------------------------------------------------------------------------------


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
            target_hash: :func:`target_weights_hash` of the target the trainer loads.
            target_path: the target directory (compared after resolving).
            template_fingerprint: the chat-template fingerprint of the trainer's tokenizer.
            hidden_size, vocab_size, num_layers: the target's dimensions.
            dtype: storage dtype name (``bf16``/``fp16``/``fp32``).
            dataset_fingerprint: :func:`dataset_fingerprint` of the trainer's tokenized data.
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
                want = _DTYPE_NAMES.get(want, str(want))
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


# --------------------------------------------------------------------------------------------
# CLI: draftsmith data cache
# --------------------------------------------------------------------------------------------


@dataclass
class CacheConfig:
    """Settings of ``draftsmith data cache``."""

    data: Path = cfg_field(
        help="tokenized data: a datasets.save_to_disk dir or JSONL with input_ids/loss_mask"
    )
    out: Path = cfg_field(help="cache directory (resumes if it holds a partial cache)")
    target: str | None = cfg_field(
        None, help="target: a local HF model dir, a .gguf file, or None for SmolLM2-135M-Instruct"
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    layers: list[int] | None = cfg_field(
        None, help="feature layers (0 = embeddings, num_layers = final normed output)"
    )
    preset: str = cfg_field(
        "eagle3",
        help="layers when --layers is not given: eagle3 = [2, n/2, n-3, n], eagle1/medusa = [n]",
        choices=["eagle3", "eagle1", "medusa"],
    )
    dtype: str = cfg_field("bf16", help="storage dtype", choices=list(DTYPES))
    target_dtype: str = cfg_field(
        "auto",
        help="dtype the target computes in (auto: fp32 on CPU, bf16 on GPU)",
        choices=["auto", *DTYPES],
    )
    device_map: str | None = cfg_field(
        None,
        help="model parallelism for targets larger than one device (auto, balanced, "
        "sequential); passed to from_pretrained",
    )
    batch_tokens: int = cfg_field(8192, help="most padded tokens (batch × longest) per forward")
    max_batch_size: int = cfg_field(64, help="most samples per forward")
    shard_mb: float = cfg_field(512.0, help="shard size in MiB")
    max_length: int | None = cfg_field(None, help="truncate samples to this many tokens")
    limit: int | None = cfg_field(None, help="cache the first N samples only")
    draft_vocab_size: int | None = cfg_field(
        None, help="also store EAGLE-3 d2t/t2d for this draft vocab size (EOS always included)"
    )
    template_fingerprint: str | None = cfg_field(
        None, help="chat-template fingerprint to record (default: computed from the tokenizer)"
    )
    overwrite: bool = cfg_field(False, help="replace a cache built with other data/settings")
    threads: int | None = cfg_field(None, help="torch CPU threads (default: torch's choice)")
    progress: bool = cfg_field(True, help="show the progress bar")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        for name in ("batch_tokens", "max_batch_size", "max_length", "limit", "threads"):
            v = getattr(self, name)
            if v is not None and v < 1:
                problems.append((name, f"must be >= 1, got {v}"))
        if self.shard_mb <= 0:
            problems.append(("shard_mb", f"must be > 0, got {self.shard_mb}"))
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            problems.append(("draft_vocab_size", f"must be >= 1, got {self.draft_vocab_size}"))
        if self.layers is not None and (not self.layers or min(self.layers) < 0):
            problems.append(("layers", f"must be one or more indices >= 0, got {self.layers}"))
        if self.device_map not in (None, *_DEVICE_MAPS):
            problems.append(("device_map", f"must be one of {list(_DEVICE_MAPS)} or unset"))
        return problems


# What from_pretrained accepts as a named device_map.
_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def main_cache(argv: list[str] | None = None) -> int:
    """CLI entry point for ``draftsmith data cache`` (run under ``accelerate launch`` for ranks).

    Args:
        argv: Arguments without the program/subcommand name; ``None`` means ``sys.argv[1:]``.

    Returns:
        Exit code: 0 on success; 2 on a config, data or cache error (missing or malformed data,
        layers outside the target, a draft vocab larger than the vocab, a directory holding
        another cache); 1 when the target cannot be loaded, another build holds the directory,
        or the disk is full.
    """
    return cli_main(_main_cache, argv)


def _main_cache(argv: list[str]) -> int:
    from draftsmith.train.config import parse_config

    cfg = parse_config(
        CacheConfig,
        argv,
        prog="draftsmith data cache",
        description="Run the frozen target over tokenized data and cache the hidden states "
        "drafters train on (resumable; one slice per accelerate process).",
    )
    summary = run_cache(cfg)
    if summary.get("is_main_process", True):
        rate = summary["tokens_per_s"]
        print(
            f"{summary['out']}: {summary['num_samples']} samples, {summary['num_tokens']} tokens, "
            f"{summary['num_shards']} shards ({len(summary['written'])} written, "
            f"{len(summary['skipped'])} already done by this rank) in {summary['seconds']:.1f}s"
            + (f", {rate:.0f} tokens/s" if rate else "")
        )
    return 0


def run_cache(cfg: CacheConfig) -> dict[str, Any]:
    """Load the target and data a :class:`CacheConfig` names and call :func:`build_cache`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.train.target.load import TargetError, prepare_target

    state = process_state()
    if cfg.device_map is not None and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        raise CacheError(
            f"device_map={cfg.device_map!r} spreads the target over every visible device, so "
            "run one process per machine (e.g. `accelerate launch --num_processes <machines>` "
            "on several machines, or plain `draftsmith data cache` on one)"
        )
    # The data first: a wrong path fails before the (slow) target load.
    data = load_token_data(cfg.data)
    if cfg.limit is not None:
        data = data.select(range(min(cfg.limit, len(data))))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    path = prepare_target(cfg.target, cache_dir=cfg.cache_dir, quiet=not state.is_main_process)
    if cfg.target_dtype == "auto":
        compute = torch.bfloat16 if state.device.type == "cuda" else torch.float32
    else:
        compute = DTYPES[cfg.target_dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=compute, attn_implementation="sdpa", device_map=cfg.device_map
        )
    except Exception as exc:
        raise TargetError(f"cannot load target model weights from {path}: {exc}") from exc
    if cfg.device_map is None:
        model.to(state.device)
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    layers = cfg.layers or default_layers(cfg.preset, int(model.config.num_hidden_layers))
    eos = []
    for v in (tokenizer.eos_token_id, model.config.eos_token_id):
        eos += [v] if isinstance(v, int) else list(v or [])
    summary = build_cache(
        model,
        data,
        cfg.out,
        layers,
        dtype=cfg.dtype,
        batch_tokens=cfg.batch_tokens,
        max_batch_size=cfg.max_batch_size,
        shard_mb=cfg.shard_mb,
        max_length=cfg.max_length,
        template_fingerprint=cfg.template_fingerprint or _template_fingerprint(tokenizer),
        target_path=str(path),
        draft_vocab_size=cfg.draft_vocab_size,
        always_include=sorted(set(eos)),
        overwrite=cfg.overwrite,
        progress=cfg.progress,
        state=state,
    )
    summary["is_main_process"] = state.is_main_process
    return summary
