"""Target hidden states as drafter training features: identity, computing them, the feature API.

Feature-level drafters (EAGLE-1/3, Medusa) learn from the frozen target's hidden states at the
layers they declare (see :data:`draftsmith.heads.base.Features` for the index convention: 0 =
embeddings, i = output of layer i-1, ``num_layers`` = final output after the last norm). A recipe
gets them in one of two ways, switched by one config field (``hidden_states: online|offline``),
with identical batches either way (:func:`feature_source`):

- **offline**: :func:`~draftsmith.train.features.cache_write.build_cache` runs the target once over
  the tokenized data and writes a cache directory;
  :class:`~draftsmith.train.features.cache_read.HiddenStateCache` reads it (a
  ``torch.utils.data.Dataset``) after checking its manifest against what the trainer expects
  (:meth:`~draftsmith.train.features.cache_read.HiddenStateCache.verify`).
- **online**: :class:`OnlineHiddenStates` runs the target inside the training step on each
  padded batch (:func:`compute_hidden_states`).

Either way the target's forward keeps only the requested layers (forward hooks, not
``output_hidden_states``), stops after the deepest one and never runs the LM head
(:func:`run_target`).

A cache records its target's weights hash (:func:`target_weights_hash`); a trainer passes
``expect={"target_hash": target_fingerprint(target)}`` to :func:`feature_source`, so a cache
built from another target of the same shapes is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...heads.base import unwrap_model
from ..data.batching import Collate, TokenDataset
from ..data.tokens import iter_token_chunks
from .cache_format import CacheError
from .cache_read import HiddenStateCache

__all__ = [
    "HASH_SCHEME",
    "FeatureSource",
    "OnlineHiddenStates",
    "check_layers",
    "compute_hidden_states",
    "dataset_fingerprint",
    "feature_source",
    "run_target",
    "scan_token_data",
    "target_fingerprint",
    "target_weights_hash",
    "val_data_source",
]

# What the weights hash reads of each weight file: name, size, safetensors header and this many
# evenly spaced chunks. Re-training or re-quantizing changes (nearly) every weight, so sampled
# bytes catch it while reading ~16 MiB per file instead of the whole checkpoint.
_HASH_CHUNKS = 16
_HASH_CHUNK_BYTES = 1 << 20
HASH_SCHEME = (
    "sha256 of config.json, and per weight file (*.safetensors, *.bin, *.pt, *.gguf): name, size, "
    f"safetensors header, {_HASH_CHUNKS} evenly spaced {_HASH_CHUNK_BYTES >> 20} MiB chunks"
)


# --------------------------------------------------------------------------------------------
# Identity of what went into a cache
# --------------------------------------------------------------------------------------------


def target_weights_hash(path: str | Path) -> str:
    """A cheap content hash of a Hugging Face model directory (see ``HASH_SCHEME``).

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
        :func:`target_weights_hash` of the directory (the value
        :func:`~draftsmith.train.features.cache_write.build_cache` records), or None when the target
        has no local directory (a model built in memory): then there is nothing to compare and
        the field is not checked.
    """
    if target is None:
        return None
    if isinstance(target, torch.nn.Module):
        inner = unwrap_model(target)
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
        data: see :func:`draftsmith.train.data.tokens.iter_token_chunks`.
        max_length: if set, samples are hashed as truncated to this many tokens.

    Returns:
        Hex sha256 digest.
    """
    return scan_token_data(data, max_length)[1]


def scan_token_data(
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


# --------------------------------------------------------------------------------------------
# Running the target
# --------------------------------------------------------------------------------------------


def _input_device(target: torch.nn.Module) -> torch.device:
    """Where input ids go: the embedding's device (first device under ``device_map``)."""
    inner = unwrap_model(target)
    with contextlib.suppress(AttributeError, NotImplementedError):
        return inner.get_input_embeddings().weight.device
    return next(inner.parameters()).device


def _forward_kwargs(target: torch.nn.Module) -> dict[str, Any]:
    # Only the last position's logits: the lm_head over the full vocab would otherwise cost up
    # to a fifth of a small target's forward and a [B, T, V] tensor nobody reads. (The hooked
    # forward below usually stops before the head; this bounds it where it cannot.)
    params = inspect.signature(type(unwrap_model(target)).forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


class _StopForward(Exception):
    """Raised by a capture hook once the deepest requested hidden state is in hand: it ends the
    target's forward before the layers and the LM head nobody reads. Caught in :func:`run_target`
    only."""


# Where 🤗 decoder-only models keep their decoder layers, in call order (Llama, Qwen2/3, Mistral,
# Gemma, Phi-3 ...: ``layers``; GPT-2, Falcon, Bloom: ``h``; MPT: ``blocks``).
_LAYER_LISTS = ("layers", "h", "blocks", "layer")
_warned_fallback: set[str] = set()


def _decoder_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.nn.Module]] | str:
    """The decoder body (whose output's ``last_hidden_state`` is the final normed output) and its
    decoder layers in call order, or why they cannot be found.

    Args:
        model: the unwrapped target (FSDP2 keeps the class and the attributes).
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return "not a transformers model"
    try:
        body = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        body = model.base_model
    if not isinstance(body, torch.nn.Module):
        return "get_decoder() returned no module"
    # 🤗 runs ``layers[: config.num_hidden_layers]`` (a few checkpoints carry extra MTP layers).
    n = getattr(getattr(body, "config", None) or model.config, "num_hidden_layers", None)
    for name in _LAYER_LISTS:
        found = getattr(body, name, None)
        if isinstance(found, torch.nn.ModuleList) and len(found) and len(found) >= (n or 0):
            return body, list(found)[: n or len(found)]
    names = "/".join(_LAYER_LISTS)
    return f"no list of decoder layers ({names}) on its decoder {type(body).__name__}"


def _fsdp_wrapped(modules: Sequence[torch.nn.Module]) -> bool:
    """Whether any of ``modules`` is sharded by FSDP2 (``fully_shard``) or wrapped by FSDP1."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in modules)


def _first(output: Any) -> torch.Tensor:
    """A decoder layer's hidden-state output: the tensor itself, or item 0 of a tuple (as 🤗's
    own ``output_hidden_states`` recorder reads it)."""
    return output[0] if isinstance(output, tuple | list) else output


def _hooked_forward(
    target: torch.nn.Module,
    kwargs: dict[str, Any],
    body: torch.nn.Module,
    blocks: list[torch.nn.Module],
    wanted: set[int],
) -> dict[int, torch.Tensor]:
    """Run ``target`` with forward hooks that keep exactly the hidden states in ``wanted``.

    Each index is read where 🤗's ``output_hidden_states`` reads it (so the tensors are the same
    ones, bit for bit): 0 = the first layer's input (after any embedding scaling, e.g. Gemma's),
    ``i`` = layer ``i-1``'s output, ``len(blocks)`` = the decoder body's ``last_hidden_state``
    (after the final norm), or the last layer's output where the config sets
    ``tie_last_hidden_states=False``. Nothing else is kept, so the forward's peak holds the
    requested layers plus one layer's working set, whatever the depth.

    The hook of the deepest requested index raises :class:`_StopForward`: deeper layers and the
    LM head never run. Not under FSDP, where an exception would leave FSDP's forward state (the
    root's forward, its reshard) half done on a model that runs again next step; there the
    forward runs to the end (``logits_to_keep=1`` keeps the head to one position). The hooks are
    removed whatever happens.
    """
    n = len(blocks)
    captured: dict[int, torch.Tensor] = {}
    deepest = max(wanted)
    stop = not _fsdp_wrapped([target, unwrap_model(target), body, *blocks])
    config = getattr(body, "config", None)
    tie_last = getattr(config, "tie_last_hidden_states", None) is not False
    # Hooks are per module, not per call: a forward of the same target in another thread (or
    # nn.DataParallel's replicas) must neither fill nor stop this one.
    caller = threading.get_ident()

    def keep(index: int, tensor: torch.Tensor) -> None:
        if threading.get_ident() != caller:
            return
        captured[index] = tensor
        if stop and index == deepest:
            raise _StopForward

    def first_input(module: torch.nn.Module, args: tuple, kw: dict[str, Any]) -> None:
        keep(0, args[0] if args else kw["hidden_states"])

    def layer_output(index: int) -> Callable[..., None]:
        return lambda module, args, output: keep(index, _first(output))

    def final_output(module: torch.nn.Module, args: tuple, output: Any) -> None:
        last = getattr(output, "last_hidden_state", None)
        last = _first(output) if last is None else last
        if not isinstance(last, torch.Tensor):
            raise RuntimeError(
                f"{type(body).__name__}: its forward returned no last_hidden_state to read the "
                f"final normed output (layer {n}) from"
            )
        keep(n, last)

    handles = []
    try:
        if 0 in wanted:
            handles.append(blocks[0].register_forward_pre_hook(first_input, with_kwargs=True))
        for i in sorted(wanted - {0}):
            if i == n and tie_last:
                handles.append(body.register_forward_hook(final_output))
            else:
                handles.append(blocks[i - 1].register_forward_hook(layer_output(i)))
        with contextlib.suppress(_StopForward):
            target(**kwargs)
    finally:
        for handle in handles:
            handle.remove()
    missing = sorted(wanted - captured.keys())
    if missing:
        raise RuntimeError(
            f"{type(unwrap_model(target)).__name__}: the forward never produced hidden states "
            f"{missing} (its decoder layers did not run in the order {type(body).__name__} lists "
            "them)"
        )
    return captured


def run_target(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layers: Sequence[int] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """The target's hidden states, ``num_layers + 1`` entries ``[B, T, H]``, in the caller's
    grad mode (index convention: :data:`~draftsmith.heads.base.Features`).

    A 🤗 model runs without ``output_hidden_states``: forward hooks on its decoder layers (and its
    decoder body, for the final normed output) keep only the requested entries, so the forward's
    peak memory does not grow with the number of layers, and the forward stops after the deepest
    requested one: the LM head never runs, nor do the layers deeper than that (see
    :func:`_hooked_forward`; FSDP-sharded targets run to the end). The values are the very
    tensors ``output_hidden_states=True`` would return.

    Fallback: a target that is not a 🤗 model (e.g.
    :class:`~draftsmith.train.features.vllm_backend.VllmTarget`) is called with
    ``output_hidden_states=True`` and serves them itself; a 🤗 model whose decoder layers cannot
    be found gets the same, with a one-time warning naming its class (memory then grows with its
    depth).

    Args:
        target: the causal LM, possibly wrapped by DDP/FSDP/accelerate or spread by
            ``device_map``.
        input_ids: ``[B, T]``.
        attention_mask: ``[B, T]`` (1 = token), or None.
        layers: the entries to compute; None: all of them.

    Returns:
        A tuple of ``num_layers + 1`` entries: ``[B, T, H]`` for each requested index (on the
        device of the layer that made it), None for the others.

    Raises:
        CacheError: If ``layers`` is empty, repeats one or is out of range (see
            :func:`check_layers`).
    """
    device = _input_device(target)
    kwargs = {
        "input_ids": input_ids.to(device),
        "attention_mask": None if attention_mask is None else attention_mask.to(device),
        "use_cache": False,
        **_forward_kwargs(target),
    }
    inner = unwrap_model(target)
    parts = _decoder_parts(inner)
    if isinstance(parts, str):
        from transformers import PreTrainedModel

        name = type(inner).__name__
        if isinstance(inner, PreTrainedModel) and name not in _warned_fallback:
            _warned_fallback.add(name)
            warnings.warn(
                f"{name}: {parts}; its features come from output_hidden_states=True, which keeps "
                "every layer's hidden states alive (memory grows with depth)",
                stacklevel=2,
            )
        hs = target(**kwargs, output_hidden_states=True).hidden_states
        if layers is None:
            return tuple(hs)
        wanted = set(check_layers(layers, len(hs) - 1))
        return tuple(hs[i] if i in wanted else None for i in range(len(hs)))
    body, blocks = parts
    num_layers = len(blocks)
    wanted = set(range(num_layers + 1) if layers is None else check_layers(layers, num_layers))
    # Explicitly off: a config with output_hidden_states=True would make 🤗 record them all.
    captured = _hooked_forward(
        target, {**kwargs, "output_hidden_states": False}, body, blocks, wanted
    )
    return tuple(captured.get(i) for i in range(num_layers + 1))


def check_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    """``layers`` as ints, checked against a target of ``num_layers`` layers.

    Raises:
        CacheError: If no layer is given, one is out of ``0..num_layers``, or one repeats.
    """
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

    Only those are kept during the forward, which stops after the deepest one (see
    :func:`run_target`): peak memory holds the requested layers, not all of them. Runs under ``torch.no_grad()`` rather than ``inference_mode``: inference tensors cannot be
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
    layers = [int(x) for x in layers]
    with torch.no_grad():
        hs = run_target(target, batch["input_ids"], mask, layers)
        device = _input_device(target)
        keep = None if mask is None else mask.to(device).bool().unsqueeze(-1)
        out = {}
        for layer in layers:
            # Under device_map a deep layer lives on a later device: bring it to the inputs'.
            t = hs[layer].to(device) if dtype is None else hs[layer].to(device, dtype)
            out[layer] = t if keep is None else t.masked_fill(~keep, 0)
    return out


# --------------------------------------------------------------------------------------------
# The feature API: online and offline alike
# --------------------------------------------------------------------------------------------


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
        collate: pads samples into a batch
            (:func:`~draftsmith.train.data.batching.collate_hidden_states`).
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
        moved = batch_to_device(batch, device)
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
    collate = Collate(pad_token_id)
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


def val_data_source(
    cfg: Any, tokenizer: Any, target: Any, layers: Sequence[int], say: Any
) -> tuple[Any, Any]:
    """``val_data``'s records as a validation feature source and its (unprepared) loader.

    Validation like evaluation: a few dozen records of the evaluation's kind, their features
    computed by the target when validating (online, whatever the training's ``hidden_states``),
    cast to fp32 like the offline cache's so both paths score the same values.

    Args:
        cfg: the run's config (``val_data``, ``max_length``, ``batch_size``).
        tokenizer: the target's tokenizer.
        target: the frozen target.
        layers: the feature layers the drafter trains on.
        say: prints a line on the main process.

    Returns:
        ``(FeatureSource, DataLoader)``, or ``(None, None)`` without ``val_data``.
    """
    if cfg.val_data is None:
        return None, None
    from ..core.data import load_samples  # the training data's own reader

    held, summary = load_samples(cfg.val_data, tokenizer, max_length=cfg.max_length, split=None)
    say(f"validation data: {summary or f'{len(held)} tokenized samples'}")
    src = feature_source(
        "online",
        layers=layers,
        data=held,
        target=target,
        max_length=cfg.max_length,
        dtype=torch.float32,
        pad_token_id=0,
    )
    loader = torch.utils.data.DataLoader(
        src.dataset, batch_size=cfg.batch_size, collate_fn=src.collate
    )
    return src, loader


def batch_to_device(batch: dict[str, Any], device: str | torch.device | None) -> dict[str, Any]:
    """A collated batch's tensors, and those of its dicts (``hidden_states``), on ``device``
    (None: a shallow copy, unmoved)."""
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
