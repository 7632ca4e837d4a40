"""Staged writes: an output appears under its final name only once it is complete.

Every output a user would hate to find half-written (an export, a tokenized dataset, a
checkpoint, a cache shard, a results JSON) is written under a hidden temp name beside its
destination, on the same file system, and renamed into place when complete (a rename is atomic
there). A failure or a kill therefore leaves the previous output, or none, never a mix.

- :func:`staged_dir`: a directory output (context manager); :func:`prepare_stage` and
  :func:`replace_dir` are its two halves, for a write whose body runs in several processes (a
  checkpoint: every process writes into the temp dir, the main one renames it once all
  succeeded).
- :func:`staged_file`: a file output written by someone else's writer (``save_file(tensors,
  tmp)``); :func:`write_atomic` / :func:`write_json_atomic`: a file's bytes, text or JSON.
- :func:`clean_stale_dirs`: the leftovers of writers that died, removed by the next writer.

Temp names name their writer: ``.<name>.tmp-<pid>@<host>.<random>/`` (for a file output, a
directory holding the file under its final name, so files and directories share one naming
scheme and one cleanup), and ``.<name>.old-<pid>@<host>.<random>/x`` for the previous output
of a directory while it is replaced. So the next writer beside the same output can tell a dead
writer's leftover (removed; an ``old`` one is put back when the new output never arrived) from
a live writer's (kept).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import UsageError
from .runinfo import json_text
from .safety import DiskSpaceError, disk_full, ensure_free_space, make_readable

__all__ = [
    "OutputExistsError",
    "clean_stale_dirs",
    "prepare_stage",
    "replace_dir",
    "staged_dir",
    "staged_file",
    "write_atomic",
    "write_json_atomic",
]


class OutputExistsError(UsageError, FileExistsError):
    """The output exists and ``overwrite`` was not given: a usage error, and a FileExistsError."""


def _stage_prefix(out: Path, kind: str) -> str:
    """``.<name>.<kind>-<pid>@<host>.``: hidden, beside ``out``, naming the writer process."""
    return f".{out.name}.{kind}-{os.getpid()}@{socket.gethostname()}."


def _writer_alive(pid: int, host: str) -> bool:
    """Whether the process that made a staging dir may still be writing it."""
    if host != socket.gethostname():
        return True  # another machine's process (shared file system): cannot tell, keep it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def _raise_if_disk_full(exc: BaseException, path: Path, need: int) -> None:
    """Raise :class:`DiskSpaceError` from ``exc`` when it means the disk filled up."""
    if not isinstance(exc, DiskSpaceError) and disk_full(exc):
        raise DiskSpaceError(path, need) from exc


def clean_stale_dirs(out: str | Path, *, exclusive: bool = False) -> list[Path]:
    """Remove the staging dirs beside ``out`` left by writers that died (killed, crashed).

    A dir ``.<name>.tmp-<pid>@<host>.*`` is removed when that PID no longer runs on this host;
    a live writer's dir is kept. An ``.old-`` dir (the previous output, moved aside during the
    final rename) is moved back to ``out`` if the writer died before ``out`` was replaced.

    Args:
        out: the output (file or directory) whose staging dirs are cleaned.
        exclusive: the caller holds ``out`` exclusively (a lock, or a plan that gives it to
            one process), so every staging dir beside it is a dead writer's, also one naming a
            live PID or another host (a killed writer on another machine of a shared file
            system, which is otherwise kept as "cannot tell").

    Returns:
        The directories removed.
    """
    out = Path(out)
    removed: list[Path] = []
    if not out.parent.is_dir():
        return removed
    # One listing (called before every staged write, also in a cache of thousands of shards);
    # startswith, not glob: an output name may hold glob characters ("[", "*").
    with os.scandir(out.parent) as entries:
        names = sorted(e.name for e in entries if e.name.startswith(f".{out.name}."))
    for kind in ("tmp", "old"):
        head = f".{out.name}.{kind}-"
        for name in names:
            if not name.startswith(head):
                continue
            path = out.parent / name
            pid_text, at, rest = name[len(head) :].partition("@")
            if not (at and pid_text.isdigit() and path.is_dir()):
                continue  # not one of ours
            host = rest.rsplit(".", 1)[0]
            if not exclusive and _writer_alive(int(pid_text), host):
                continue
            if kind == "old" and not out.exists() and (path / "x").is_dir():
                os.replace(path / "x", out)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def replace_dir(tmp: str | Path, out: str | Path, overwrite: bool) -> None:
    """Rename a finished directory ``tmp`` to ``out`` so ``out`` is never half-written.

    A directory cannot be ``os.replace``'d onto a non-empty one, so an old ``out`` is first moved
    aside (same file system, one rename), then removed: ``out`` always holds either the old or
    the new complete directory, never a mix.

    Args:
        tmp: the finished directory, on the same file system as ``out`` (e.g. a temp dir made
            beside it).
        out: the destination.
        overwrite: replace an existing ``out``; False raises instead.

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is False (a FileExistsError).
    """
    tmp, out = Path(tmp), Path(out)
    if out.exists():
        if not overwrite:
            raise OutputExistsError(
                f"{out} exists; pass overwrite=True (--overwrite) to replace it"
            )
        # Named like the temp dirs (writer PID and host), so a run killed between the two
        # renames is repaired by the next one (see clean_stale_dirs).
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=_stage_prefix(out, "old")))
        os.replace(out, old / "x")
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def prepare_stage(
    out: str | Path, *, overwrite: bool, need_bytes: int = 0, at: str | Path | None = None
) -> Path:
    """The first half of a staged write: make an empty temp dir beside ``out`` to write in.

    Stale staging dirs of dead writers are removed, an existing ``out`` is refused without
    ``overwrite``, and ``need_bytes`` must fit in the free space. The caller writes into the
    returned dir, then renames it with :func:`replace_dir` or removes it on failure.

    Args:
        out: the destination (directory, or a file that :func:`staged_file` moves out).
        overwrite: an existing ``out`` will be replaced.
        need_bytes: estimated size of the output.
        at: a fixed temp dir (beside ``out``) instead of a new per-writer one: for a write whose
            processes must all find it without being told. Its leftover from a killed write is
            removed here, so only one writer may use it at a time.

    Returns:
        The temp dir: a new ``.<name>.tmp-<pid>@<host>.*`` (mode 0700, ``mkdtemp``), or ``at``
        made anew.

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
        DiskSpaceError: not enough free space.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_dirs(out)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    ensure_free_space(out.parent, need_bytes)
    if at is None:
        return Path(tempfile.mkdtemp(dir=out.parent, prefix=_stage_prefix(out, "tmp")))
    at = Path(at)
    shutil.rmtree(at, ignore_errors=True)
    at.mkdir()
    return at


@contextlib.contextmanager
def staged_dir(out: str | Path, *, overwrite: bool, need_bytes: int = 0) -> Iterator[Path]:
    """Write a directory output atomically: yield a temp dir beside ``out``, then rename it.

    Before: stale staging dirs of dead writers are removed, an existing ``out`` is refused
    without ``overwrite``, and ``need_bytes`` (an estimate of what will be written) must fit
    in the free space. After the body: the dir is made readable by other users (0755/0644:
    ``mkdtemp`` creates 0700, which a server running as another user cannot read) and renamed
    to ``out``. On any failure the temp dir is removed and ``out`` keeps its previous content;
    a write that failed for lack of space raises :class:`~draftsmith.train.safety.DiskSpaceError`.

    Args:
        out: the destination directory.
        overwrite: replace an existing ``out``.
        need_bytes: estimated size of the output.

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
        DiskSpaceError: not enough free space, before or during the write.
    """
    out = Path(out)
    tmp = prepare_stage(out, overwrite=overwrite, need_bytes=need_bytes)
    try:
        yield tmp
        make_readable(tmp)
        replace_dir(tmp, out, overwrite)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_if_disk_full(exc, out.parent, need_bytes)
        raise


@contextlib.contextmanager
def staged_file(
    path: str | Path, *, need_bytes: int = 0, check_space: bool = True, mode: int | None = None
) -> Iterator[Path]:
    """Write a file atomically: yield a temp path for it, then rename it to ``path``.

    The body writes the file at the yielded path (same name as ``path``, inside a staging dir
    beside it). After the body it gets ``mode`` and replaces ``path`` (an existing file is
    overwritten). On any failure nothing is renamed, the staging dir is removed, and a write
    that failed for lack of space raises :class:`~draftsmith.train.safety.DiskSpaceError`.

    Args:
        path: the destination file (its directory is created).
        need_bytes: estimated size of the file: checked against the free space first (with
            ``check_space``) and named in a disk-full error.
        check_space: check ``need_bytes`` before writing; False leaves it to the write itself
            (small files, whose estimate only sizes the error message).
        mode: chmod the file to this before the rename (e.g. 0o644 for files a writer creates
            0600); None keeps the mode it was created with.

    Raises:
        DiskSpaceError: not enough free space, before or during the write.
    """
    path = Path(path)
    stage = prepare_stage(path, overwrite=True, need_bytes=need_bytes if check_space else 0)
    tmp = stage / path.name
    try:
        yield tmp
        if mode is not None:
            tmp.chmod(mode)
        os.replace(tmp, path)
    except BaseException as exc:
        _raise_if_disk_full(exc, path.parent, need_bytes)
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def write_atomic(path: str | Path, data: bytes | str, *, mode: int | None = None) -> None:
    """Write ``data`` (bytes, or text in the default encoding) to ``path`` via :func:`staged_file`.

    Args:
        path: the destination file (its directory is created).
        data: the whole content.
        mode: the file's mode; None: as ``open`` creates it (0666 less the umask).

    Raises:
        DiskSpaceError: the write failed for lack of space (``path`` is unchanged).
    """
    with staged_file(path, need_bytes=len(data), check_space=False, mode=mode) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON (indent 2, newline-terminated) to ``path`` atomically (no half files).

    Non-finite floats are written as ``null`` (see :func:`~draftsmith.train.runinfo.finite_json`),
    so the file is always valid JSON.
    """
    # 0600: the mode these files have always had (the writer before staged_file used mkstemp);
    # kept so their readers see no change.
    write_atomic(path, json_text(data, indent=2) + "\n", mode=0o600)
