"""What the resumable data writers share: the settings file, synced appends, the progress bar.

Self-distillation (:mod:`~draftsmith.train.datagen.self_distill`) and Magpie prompts
(:mod:`~draftsmith.train.datagen.magpie`) append complete JSON lines to one output and keep their
settings in ``<output>.meta`` beside it: a resume with other values of the settings that change
the output is refused (:func:`check_meta`), and a write that fails (disk full) is cut back to
where it started (:func:`write_synced`), so the file stays resumable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..runinfo import json_text
from ..safety import DiskSpaceError, disk_full
from ..staged import write_atomic

__all__ = [
    "BYTES_PER_TOKEN",
    "check_meta",
    "meta_file",
    "progress_bar",
    "write_meta",
    "write_synced",
]

# Bytes a generated token takes in the JSON output, generously: a token is a few characters of
# UTF-8 (up to 4 bytes each) and JSON escapes (\n, \") double some of them.
BYTES_PER_TOKEN = 16


def meta_file(output: Path) -> Path:
    """The settings file of ``output``: ``<output>.meta`` beside it."""
    return output.with_name(output.name + ".meta")


def check_meta(
    meta_path: Path,
    settings: dict[str, Any],
    strict: Sequence[str],
    error: type[UsageError],
) -> dict[str, Any]:
    """The stored meta of a resumable output, after checking its ``strict`` settings.

    Args:
        meta_path: The ``<output>.meta`` file.
        settings: The settings of this run; only the ``strict`` keys present here are compared.
        strict: Keys whose values change the output (each writer has its own).
        error: The writer's error class, raised naming every differing setting.

    Returns:
        The stored meta (``{"settings": ..., "complete": ..., ...}``).
    """
    try:
        meta = json.loads(meta_path.read_text())
        old = meta["settings"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise error(f"cannot read {meta_path} ({exc}); pass --overwrite") from exc
    diff = [
        f"{k}: {old.get(k)!r} in the existing output, {settings.get(k)!r} now"
        for k in strict
        if k in settings and old.get(k) != settings.get(k)
    ]
    if diff:
        raise error(
            f"cannot resume {meta_path.with_suffix('')}: it was made with other settings ("
            + "; ".join(diff)
            + "). Use the same settings, another --output, or --overwrite to start again."
        )
    return meta


def write_meta(meta_path: Path, data: dict[str, Any]) -> None:
    """Replace ``meta_path`` with ``data`` atomically (a temp file renamed into place)."""
    write_atomic(meta_path, json_text(data, indent=2, sort_keys=True) + "\n")


def _append(fd: int, data: bytes) -> None:
    """Write all of ``data`` at the end of ``fd`` (``os.write`` may write less than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_synced(fd: int, data: bytes, output: Path) -> None:
    """Append ``data`` and fsync; on failure cut back to where it started (stays resumable).

    Raises:
        DiskSpaceError: The disk filled up (the output keeps what it held before).
    """
    if not data:
        return
    pos = os.lseek(fd, 0, os.SEEK_END)
    try:
        _append(fd, data)
        os.fsync(fd)
    except OSError as exc:
        os.ftruncate(fd, pos)
        if disk_full(exc):
            raise DiskSpaceError(output.parent, len(data)) from exc
        raise


def progress_bar(enabled: bool, total: int, initial: int, unit: str, desc: str) -> Any:
    """A progress bar on stderr starting at ``initial`` of ``total``, or None when not ``enabled``."""
    if not enabled:
        return None
    from ..progress import progress

    return progress(total=total, initial=min(initial, total), unit=unit, desc=desc)
