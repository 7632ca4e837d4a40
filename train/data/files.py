"""Data files: find and read the files that hold chat records, and the error that names them.

A data input is a JSON Lines file (``.jsonl``; also ``.json`` files holding one object per
line), a JSON array (``.json``), a parquet file (``.parquet``), a directory searched
recursively for those, or in-memory records (a ``datasets.Dataset`` or a list of dicts).
JSON Lines are parsed line by line here rather than by ``datasets``' JSON reader, because that
reader fails a whole file on one bad line and cannot name it; parquet is read with ``pyarrow``
(the engine under ``datasets``), which writes no builder cache. What the records mean is
:mod:`draftsmith.train.data.records`'s business.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import UsageError

__all__ = ["FILE_SUFFIXES", "DataFileError", "Row", "input_name", "read_sources"]

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
"""The data file types, found in directories by their suffix."""


class DataFileError(UsageError):
    """A data file (or one of its records) is missing, unreadable or malformed (exit code 2).

    The message reads ``"<path>:<line>: field '<field>': <problem>"`` for JSON Lines, and
    ``"<path>: row <row>: field '<field>': <problem>"`` for row-based files (0-based rows);
    parts that do not apply are left out.

    Attributes:
        path: The file (or ``"<records>"`` for in-memory records).
        line: 1-based line of the record (JSON Lines), or ``None``.
        row: 0-based row of the record (JSON arrays, parquet, in-memory), or ``None``.
        field: The offending field (e.g. ``"messages[2].role"``), or ``None``.
        reason: A short category used for skip counts (e.g. ``"invalid JSON"``).
    """

    def __init__(
        self,
        path: str | Path,
        problem: str,
        *,
        line: int | None = None,
        row: int | None = None,
        field: str | None = None,
        reason: str = "invalid file",
    ) -> None:
        self.path = str(path)
        self.line, self.row, self.field, self.reason = line, row, field, reason
        self.problem = problem
        if line is not None:
            where = f"{path}:{line}"
        elif row is not None:
            where = f"{path}: row {row}"
        else:
            where = str(path)
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{problem}")


def input_name(path: Any) -> str:
    """How errors name an input: the path, or ``"<records>"`` for in-memory records."""
    if _is_path_list(path):
        return ", ".join(str(p) for p in path)
    return str(path) if isinstance(path, (str, Path)) else "<records>"


def _is_path_list(path: Any) -> bool:
    """Whether ``path`` is several data paths (a list of paths, not of records)."""
    return (
        isinstance(path, Sequence)
        and not isinstance(path, (str, bytes))
        and bool(path)
        and all(isinstance(p, (str, Path)) for p in path)
    )


# ((kind, number), record): kind is "line" (1-based) or "row" (0-based); the record is the
# json.JSONDecodeError of a line that is not JSON (the loader counts it as a malformed record).
Row = tuple[tuple[str, int], Any]


def read_sources(path: Any) -> Iterator[tuple[str, Iterable[Row]]]:
    """The rows of every file of a data input, file by file.

    Args:
        path: A data file, a directory (searched recursively, in sorted order, hidden files
            skipped), a list of those (read in order), a ``datasets.Dataset`` or a list of
            dicts.

    Yields:
        ``(name, rows)`` per file (one entry, ``"<records>"``, for in-memory records); ``rows``
        iterates :data:`Row` items, lazily.

    Raises:
        DataFileError: A file is missing, unreadable or of an unknown type, or a directory
            holds no data file.
        TypeError: ``path`` is none of the above.
    """
    if _is_path_list(path):
        for one in path:
            yield from read_sources(one)
        return
    if not isinstance(path, (str, Path)):
        if hasattr(path, "to_list") and hasattr(path, "column_names"):  # datasets.Dataset
            yield "<records>", ((("row", i), r) for i, r in enumerate(path))
            return
        if isinstance(path, Sequence):
            yield "<records>", ((("row", i), r) for i, r in enumerate(path))
            return
        raise TypeError(
            f"expected a path, a datasets.Dataset or a list of dicts, got {type(path).__name__}"
        )
    path = Path(path)
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix in FILE_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise DataFileError(path, f"directory holds no data files ({', '.join(FILE_SUFFIXES)})")
        for f in files:
            yield str(f), _read_file(f)
        return
    if not path.exists():
        raise DataFileError(path, "file not found")
    yield str(path), _read_file(path)


def _read_file(path: Path) -> Iterator[Row]:
    if path.suffix == ".parquet":
        return _read_parquet(path)
    if path.suffix in (".jsonl", ".json"):
        return _read_json(path)
    raise DataFileError(
        path, f"unknown file type {path.suffix!r} (expected {', '.join(FILE_SUFFIXES)})"
    )


def _read_json(path: Path) -> Iterator[Row]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataFileError(path, f"cannot read: {exc}") from exc
    if text.lstrip().startswith("["):  # a JSON array of records
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataFileError(path, f"invalid JSON: {exc}", reason="invalid JSON") from exc
        for i, obj in enumerate(data):
            yield ("row", i), obj
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            obj = exc
        yield ("line", lineno), obj


def _read_parquet(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        pfile = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataFileError(path, f"cannot read parquet: {exc}") from exc
    row = 0
    # Batches keep memory flat for large files.
    for batch in pfile.iter_batches(batch_size=1024):
        for obj in batch.to_pylist():
            yield ("row", row), obj
            row += 1
