"""Building a hidden-state cache: :func:`build_cache` runs the target and writes the directory.

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

The format is in :mod:`draftsmith.train.features.cache_format`, the plan and the shards in
:mod:`draftsmith.train.features.cache_shards`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...heads.base import unwrap_model
from ..core.dist import process_state
from ..data.vocab import VOCAB_STATS_FILE, save_vocab_stats, token_counts
from ..device import device_facts
from ..runinfo import json_text, output_lock
from ..safety import fmt_bytes, free_bytes
from ..staged import clean_stale_dirs, staged_file, write_atomic
from .cache_format import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    IDS_FILE,
    INDEX_FILE,
    MANIFEST_FILE,
    CacheError,
    DiskSpaceError,
)
from .cache_shards import (
    Plan,
    compute_shard,
    make_plan,
    read_header,
    shard_name,
    shard_ok,
    write_shard,
)
from .source import (
    HASH_SCHEME,
    check_layers,
    scan_token_data,
    target_fingerprint,
)

if TYPE_CHECKING:
    from accelerate import PartialState

__all__ = ["build_cache", "estimate_cache_bytes"]


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
    backend: Mapping[str, Any] | None = None,
    device: Mapping[str, Any] | None = None,
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
        target_hash: recorded in the manifest (default:
            :func:`~draftsmith.train.features.source.target_weights_hash` of ``target_path`` when
            it is a directory).
        draft_vocab_size: also store ``d2t``/``t2d`` for this N in ``vocab_stats.safetensors``.
        always_include: token ids forced into the draft vocab (see ``draft_vocab``).
        overwrite: replace a cache of another plan in ``out_dir``.
        progress: show a progress bar (rank 0).
        state: accelerate state (default: :func:`~draftsmith.train.core.dist.process_state`).
        on_shard_written: called with the shard number after each shard this rank writes.
        backend: what computes the target's forward when it is not this process's model: a
            ``{"name": ...}`` mapping (e.g. ``VllmTarget.backend``, see
            :mod:`draftsmith.train.features.vllm_backend`); recorded in the manifest
            (``{"name": "hf"}`` when None), and its name joins the plan hash so a resume never
            mixes two backends' shards.
        device: where the target ran, as :func:`~draftsmith.train.device.device_facts` gives
            it (rank 0's); recorded in the manifest (``device``). None: the device of the
            target's first weight, or nothing for another ``backend`` (its record says).

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
    config = unwrap_model(target).config
    num_layers = int(config.num_hidden_layers)
    layers = check_layers(layers, num_layers)
    hidden_size = int(config.hidden_size)
    vocab_size = int(unwrap_model(target).get_output_embeddings().weight.shape[0])
    if draft_vocab_size is not None and draft_vocab_size > vocab_size:
        # Checked now, not when the vocab stats are written after every forward.
        raise CacheError(
            f"draft_vocab_size {draft_vocab_size} is larger than the target's vocabulary "
            f"({vocab_size} tokens); use at most {vocab_size}"
        )
    t0 = time.perf_counter()

    # The embedding's rows, which may exceed the lm_head's (padded vocabularies).
    embed_rows = int(unwrap_model(target).get_input_embeddings().weight.shape[0])
    lengths, data_fp = scan_token_data(data, max_length, embed_rows)
    if len(lengths) == 0:
        raise CacheError("the tokenized data holds no samples")
    num_tokens = int(lengths.sum())
    target_path = str(target_path or getattr(config, "name_or_path", "") or "") or None
    if target_hash is None:
        target_hash = target_fingerprint(target_path)
    store = DTYPES[dtype]
    bpt = len(layers) * hidden_size * store.itemsize + 9
    plan = make_plan(lengths, batch_tokens, max_batch_size, int(shard_mb * (1 << 20)), bpt)
    plan_hash = hashlib.sha256(
        json.dumps(
            {
                "format": [FORMAT, FORMAT_VERSION],
                "data": data_fp,
                "max_length": max_length,
                "layers": layers,
                "dtype": dtype,
                "target_hash": target_hash,
                "compute_dtype": str(next(unwrap_model(target).parameters()).dtype),
                "batch_tokens": batch_tokens,
                "max_batch_size": max_batch_size,
                "shard_mb": shard_mb,
                # Only for another backend: HF-built caches keep their plan hashes.
                **({"backend": backend["name"]} if backend else {}),
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

        done = [k for k in range(len(plan.shards)) if shard_ok(out / shard_name(k), plan_hash)]
        remaining = sum(plan.shard_bytes(k) for k in range(len(plan.shards)) if k not in set(done))
        estimate = estimate_cache_bytes(num_tokens, len(layers), hidden_size, dtype)
        free = free_bytes(out)
        if state.is_main_process and progress:
            print(
                f"hidden-state cache {out}: {len(lengths)} samples, {num_tokens} tokens × "
                f"{len(layers)} layers {layers} × hidden {hidden_size} × {store.itemsize} B "
                f"({dtype}) ≈ {fmt_bytes(estimate)} in {len(plan.shards)} shards; "
                f"{len(done)} shard(s) already done, {fmt_bytes(remaining)} to write, "
                f"{fmt_bytes(free)} free",
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
        for k in todo:  # temp files left by killed writers of our shards
            # exclusive: the lock and the plan give each shard to one process, this one.
            clean_stale_dirs(out / shard_name(k), exclusive=True)

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
                tensors = compute_shard(
                    target, data, plan.shards[k], layers, store, max_length, bar
                )
                meta = {**meta_common, "shard": k}
                if pending is not None:
                    pending[1].result()
                    written.append(pending[0])
                    if on_shard_written is not None:
                        on_shard_written(pending[0])
                pending = (k, pool.submit(write_shard, out / shard_name(k), tensors, meta))
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
                backend,
                device,
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
    from ..progress import progress

    desc = "hidden states" + (
        f" (rank 0 of {state.num_processes})" if state.num_processes > 1 else ""
    )
    return progress(
        total=total, unit="tok", unit_scale=True, desc=desc, disable=not enabled, smoothing=0.1
    )


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
            ok = read_header(p).get("plan") == plan_hash and int(p.name[6:11]) < num_shards
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
    for p in out.glob(".shard-*.tmp-*"):  # shard writes killed while staged (train/staged.py)
        shutil.rmtree(p, ignore_errors=True)


def _finalize(
    out: Path,
    data: Any,
    plan: Plan,
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
    backend: Mapping[str, Any] | None,
    device: Mapping[str, Any] | None,
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
        path = out / shard_name(k)
        if not shard_ok(path, plan_hash):
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
    with staged_file(out / INDEX_FILE, mode=0o644) as tmp:  # safetensors creates 0600 files
        save_file(
            {
                "shard": torch.from_numpy(shard_of),
                "offset": torch.from_numpy(offset),
                "length": torch.from_numpy(length),
            },
            str(tmp),
            metadata={"plan": plan_hash},
        )
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
    inner = unwrap_model(target)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "plan": plan_hash,
        "target": {
            "path": target_path,
            "hash": target_hash,
            "hash_covers": HASH_SCHEME,
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
        "backend": dict(backend) if backend else {"name": "hf"},
    }
    if device is None and not backend:
        device = device_facts(next(inner.parameters()).device)
    if device is not None:
        manifest["device"] = dict(device)
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
    write_atomic(path, json_text(obj, indent=indent) + "\n")
