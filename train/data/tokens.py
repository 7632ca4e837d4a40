"""Tokenized data, read in bulk: the one home of the token loader and its error.

Tokenized samples (``input_ids`` + ``loss_mask`` per sample, from ``draftsmith data tokenize``)
are read here by every consumer: the training core's data assembly, the draft vocabulary
(:mod:`.vocab`), batching (:mod:`.batching`) and the hidden-state cache (lengths,
fingerprints), which sits above this layer and reads through it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import as_list
from ..errors import UsageError

__all__ = ["TokenChunk", "TokenDataError", "iter_token_chunks", "load_token_data"]


class TokenDataError(UsageError):
    """Tokenized data is missing or malformed; the message names the file, line or sample."""


@dataclass
class TokenChunk:
    """A run of consecutive samples, flattened (no Python ints per token).

    Attributes:
        start: index of the first sample of the chunk in the dataset.
        lengths: ``[n]`` int64 tokens per sample.
        input_ids: ``[sum(lengths)]`` int64, the samples concatenated.
        loss_mask: ``[sum(lengths)]`` int64 0/1, aligned with ``input_ids``.
    """

    start: int
    lengths: np.ndarray
    input_ids: np.ndarray
    loss_mask: np.ndarray


def load_token_data(path: str | Path) -> Any:
    """Load tokenized samples from a ``datasets.save_to_disk`` directory or a JSONL file.

    Args:
        path: A directory written by ``Dataset.save_to_disk`` (a ``DatasetDict`` must hold a
            single split), or a ``.jsonl``/``.json`` file of records with ``input_ids`` and
            ``loss_mask`` (and optionally ``id``).

    Returns:
        A ``datasets.Dataset``.

    Raises:
        TokenDataError: If ``path`` does not exist, cannot be read, lacks ``input_ids`` /
            ``loss_mask`` lists of integers, holds no samples, or is a dataset dict with several
            splits; a malformed JSONL line is named.
    """
    import datasets

    path = Path(path)
    if not path.exists():
        raise TokenDataError(
            f"tokenized data not found: {path} (make it with `draftsmith data tokenize --input "
            f"<conversations> --output {path}`)"
        )
    from datasets.utils import logging as ds_logging

    # datasets logs its own multi-line ERROR for a bad JSON line; ours names the line instead.
    verbosity = ds_logging.get_verbosity()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset("json", data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many types (FileNotFoundError, ArrowInvalid, ...)
        raise _unreadable(path, exc) from exc
    finally:
        ds_logging.set_verbosity(verbosity)
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise TokenDataError(f"{path} holds splits {list(ds)}; point at one split's directory")
        ds = next(iter(ds.values()))
    missing = [c for c in ("input_ids", "loss_mask") if c not in ds.column_names]
    if missing:
        raise TokenDataError(
            f"{path}: tokenized data lacks column(s) {missing} (has {ds.column_names}); make it "
            "with `draftsmith data tokenize`"
        )
    for name in ("input_ids", "loss_mask"):
        inner = getattr(ds.features[name], "feature", None)  # List(Value(...)) / Sequence
        if not str(getattr(inner, "dtype", "")).startswith(("int", "uint", "bool")):
            raise TokenDataError(
                f"{path}: column {name!r} must hold lists of integers, got {ds.features[name]}"
            )
        row = _first_null_row(ds.data.column(name))
        if row is not None:
            raise TokenDataError(f"{path}: sample {row}: field {name!r} is missing or null")
    if len(ds) == 0:
        raise TokenDataError(f"{path}: the tokenized data holds no samples")
    return ds


def _first_null_row(column: Any) -> int | None:
    """The first row whose list is null, or holds a null (JSON Lines rows missing the field)."""
    import pyarrow.compute as pc

    if column.null_count:
        return int(pc.index(pc.is_null(column), True).as_py())
    flat = pc.list_flatten(column)
    if flat.null_count:
        parents = pc.list_parent_indices(column)
        return int(pc.filter(parents, pc.is_null(flat))[0].as_py())
    return None


def _unreadable(path: Path, exc: Exception) -> TokenDataError:
    """Name the first bad line of a JSONL file, else pass on the reader's own message."""
    if path.is_file():
        if not path.read_bytes().strip():
            return TokenDataError(f"{path}: the file is empty (no tokenized samples)")
        with open(path, "rb") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as err:
                    return TokenDataError(f"{path}:{n}: invalid JSON ({err})")
                if not isinstance(obj, dict):
                    return TokenDataError(f"{path}:{n}: a sample must be a JSON object")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return TokenDataError(f"{path}: cannot read tokenized data ({first})")


def iter_token_chunks(
    data: Any, chunk_size: int = 4096, max_length: int | None = None
) -> Iterator[TokenChunk]:
    """Yield the samples of ``data`` as flat numpy chunks, checking lengths agree.

    ``datasets.Dataset`` inputs are read through Arrow (no per-token Python objects), so a
    million-sample dataset is scanned in seconds.

    Args:
        data: A ``datasets.Dataset`` or a sequence of mappings with ``input_ids`` and
            ``loss_mask`` (lists or 1-D tensors).
        chunk_size: samples per chunk.
        max_length: cut every sample to this many tokens.

    Raises:
        TokenDataError: If a sample's ``input_ids`` and ``loss_mask`` differ in length (naming
            it); a ValueError.
    """
    if _is_hf_dataset(data):
        import pyarrow.compute as pc

        start = 0
        for table in data.with_format("arrow").iter(batch_size=chunk_size):
            ids_col, mask_col = table.column("input_ids"), table.column("loss_mask")
            lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False)
            mask_len = pc.list_value_length(mask_col).to_numpy(zero_copy_only=False)
            lengths = np.asarray(lengths, dtype=np.int64)
            _check_lengths(data, start, lengths, np.asarray(mask_len, dtype=np.int64))
            ids = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
            mask = pc.list_flatten(mask_col).to_numpy(zero_copy_only=False).astype(np.int64)
            yield _truncate(TokenChunk(start, lengths, ids, mask), max_length)
            start += len(lengths)
        return
    for start in range(0, len(data), chunk_size):
        rows = [data[i] for i in range(start, min(start + chunk_size, len(data)))]
        ids = [np.asarray(as_list(r["input_ids"]), dtype=np.int64) for r in rows]
        mask = [np.asarray(as_list(r["loss_mask"]), dtype=np.int64) for r in rows]
        lengths = np.array([len(x) for x in ids], dtype=np.int64)
        _check_lengths(data, start, lengths, np.array([len(x) for x in mask], dtype=np.int64))
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
        yield _truncate(TokenChunk(start, lengths, cat(ids), cat(mask)), max_length)


def _truncate(chunk: TokenChunk, max_length: int | None) -> TokenChunk:
    if max_length is None or not (chunk.lengths > max_length).any():
        return chunk
    starts = np.concatenate([[0], np.cumsum(chunk.lengths)[:-1]])
    new_len = np.minimum(chunk.lengths, max_length)
    # Position of every token inside its sample; keep the first max_length of each.
    pos = np.arange(len(chunk.input_ids)) - np.repeat(starts, chunk.lengths)
    keep = pos < max_length
    return TokenChunk(chunk.start, new_len, chunk.input_ids[keep], chunk.loss_mask[keep])


def _is_hf_dataset(data: Any) -> bool:
    return type(data).__name__ == "Dataset" and hasattr(data, "with_format")


def _check_lengths(data: Any, start: int, ids_len: np.ndarray, mask_len: np.ndarray) -> None:
    bad = np.nonzero(ids_len != mask_len)[0]
    if bad.size:
        i = start + int(bad[0])
        raise TokenDataError(
            f"sample {i}: input_ids has {int(ids_len[bad[0]])} tokens but loss_mask has "
            f"{int(mask_len[bad[0]])}"
        )
