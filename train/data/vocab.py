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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import as_list, cfg_field
from ..errors import UsageError, cli_main

__all__ = [
    "VOCAB_STATS_FILE",
    "TokenChunk",
    "TokenDataError",
    "VocabError",
    "coverage",
    "draft_vocab",
    "iter_token_chunks",
    "load_token_data",
    "load_vocab_stats",
    "main_vocab",
    "save_vocab_stats",
    "t2d_index",
    "token_counts",
]

VOCAB_STATS_FILE = "vocab_stats.safetensors"


class TokenDataError(UsageError):
    """Tokenized data is missing or malformed; the message names the file, line or sample."""


class VocabError(UsageError):
    """A draft vocabulary cannot be built as asked (size outside ``[1, V]``, bad forced ids)."""


# --------------------------------------------------------------------------------------------
# Reading tokenized data in bulk (also used by the hidden-state cache for lengths/fingerprints)
# --------------------------------------------------------------------------------------------


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


def token_counts(data: Any, vocab_size: int, max_length: int | None = None) -> torch.Tensor:
    """Count each token id over supervised positions (``loss_mask == 1``).

    Args:
        data: A hidden-state cache directory, a tokenized-data path (see
            :func:`load_token_data`), a ``datasets.Dataset``, or a sequence of mappings with
            ``input_ids`` and ``loss_mask``.
        vocab_size: V, the target's vocabulary size (``lm_head`` rows).
        max_length: count only the first ``max_length`` tokens of each sample.

    Returns:
        ``[V]`` int64 counts.

    Raises:
        TokenDataError: If a token id is outside ``[0, V)`` (a ValueError).
    """
    where = ""
    if isinstance(data, (str, Path)):
        where = f"{data}: "
        data = _open_any(Path(data))
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
        ``[V]`` int64.
    """
    out = torch.full(t2d.shape, -1, dtype=torch.long)
    out[t2d] = torch.arange(int(t2d.sum()), dtype=torch.long)
    return out


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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        # One key of sorted JSON: safetensors writes several keys in hash order (not
        # reproducible).
        save_file(tensors, str(tmp), metadata={"draftsmith": json.dumps(meta, sort_keys=True)})
    except Exception as exc:
        from ..safety import DiskSpaceError, disk_full

        tmp.unlink(missing_ok=True)
        if disk_full(exc):
            raise DiskSpaceError(path.parent, sum(t.numel() * 8 for t in tensors.values())) from exc
        raise
    tmp.chmod(0o644)  # safetensors creates 0600 files; caches are shared
    tmp.replace(path)
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


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


@dataclass
class VocabConfig:
    """Settings of ``draftsmith data vocab``."""

    data: Path = cfg_field(
        help="a hidden-state cache dir, a datasets.save_to_disk dir or a JSONL of input_ids/loss_mask"
    )
    out: Path | None = cfg_field(
        None, help="output file (default: <data>/vocab_stats.safetensors for a cache dir)"
    )
    draft_vocab_size: int | None = cfg_field(
        None, help="N: also store d2t/t2d for the top-N tokens"
    )
    vocab_size: int | None = cfg_field(
        None, help="target vocab size V; None = from the cache manifest or the target config"
    )
    target: str | None = cfg_field(
        None, help="target (HF dir / .gguf / None = SmolLM2) for V and the EOS id(s)"
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    include_eos: bool = cfg_field(
        True, help="force the tokenizer's EOS token(s) into the draft vocab"
    )

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            problems.append(("draft_vocab_size", f"must be >= 1, got {self.draft_vocab_size}"))
        if self.vocab_size is not None and self.vocab_size < 1:
            problems.append(("vocab_size", f"must be >= 1, got {self.vocab_size}"))
        return problems


def main_vocab(argv: list[str] | None = None) -> int:
    """CLI entry point for ``draftsmith data vocab``: count supervised tokens, build d2t/t2d.

    Args:
        argv: Arguments without the program/subcommand name; ``None`` means ``sys.argv[1:]``.

    Returns:
        Exit code: 0 on success; 2 on a config or data error (missing or malformed data, a
        draft vocab larger than the vocab); 1 when the target cannot be read or the disk is full.
    """
    return cli_main(_main_vocab, argv)


def _main_vocab(argv: list[str]) -> int:
    from ..config import parse_config

    cfg = parse_config(
        VocabConfig,
        argv,
        prog="draftsmith data vocab",
        description="Supervised-token frequencies and EAGLE-3's reduced draft vocabulary.",
    )
    summary = _run_vocab(cfg)
    for key, value in summary.items():
        print(f"  {key}: {value}")
    return 0


def _run_vocab(cfg: VocabConfig) -> dict[str, Any]:
    data_path = Path(cfg.data)
    # Everything about the input is checked before a target is looked up (which may download).
    if not data_path.exists():
        raise TokenDataError(
            f"data: {data_path} not found (a hidden-state cache from `draftsmith data cache`, or "
            "tokenized data from `draftsmith data tokenize`)"
        )
    manifest = _read_manifest(data_path)
    out = cfg.out or (data_path / VOCAB_STATS_FILE if manifest else None)
    if out is None:
        raise UsageError("out: give --out (the data is not a hidden-state cache directory)")
    vocab_size = cfg.vocab_size or (manifest or {}).get("target", {}).get("vocab_size")
    eos: list[int] = []
    if vocab_size is None or (cfg.include_eos and cfg.draft_vocab_size):
        from transformers import AutoConfig, AutoTokenizer

        from ..target_model.load import prepare_target

        tpath = (manifest or {}).get("target", {}).get("path") if cfg.target is None else None
        tpath = tpath if tpath and Path(tpath).is_dir() else None
        path = tpath or prepare_target(cfg.target, cache_dir=cfg.cache_dir, quiet=True)
        tconf = AutoConfig.from_pretrained(path)
        vocab_size = vocab_size or int(tconf.vocab_size)
        if cfg.include_eos:
            tok = AutoTokenizer.from_pretrained(path)
            eos = _eos_ids(tok, tconf)
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > int(vocab_size):
        raise VocabError(
            f"draft_vocab_size {cfg.draft_vocab_size} is larger than the target's vocabulary "
            f"({vocab_size} tokens); use at most {vocab_size}"
        )
    counts = token_counts(data_path, int(vocab_size))
    meta = save_vocab_stats(
        out,
        counts,
        n=cfg.draft_vocab_size,
        always_include=eos,
        metadata={"source": str(data_path)},
    )
    return {"written": str(out), **meta}


def _eos_ids(tokenizer: Any, config: Any) -> list[int]:
    """EOS id(s) of the tokenizer and the model config (which may list several)."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def _read_manifest(path: Path) -> dict[str, Any] | None:
    manifest = path / "manifest.json"
    if not (path.is_dir() and manifest.is_file()):
        return None
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise TokenDataError(f"{manifest}: cannot read the cache manifest ({exc})") from exc
    return data if isinstance(data, dict) else None


def _open_any(path: Path) -> Any:
    """A cache directory (read through its shards) or tokenized data."""
    if _read_manifest(path) is not None:
        from ..features.cache_read import HiddenStateCache

        return HiddenStateCache(path).token_view()
    return load_token_data(path)


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
