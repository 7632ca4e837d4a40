"""Protecting outputs: free-space checks, disk-full errors that say so, single-writer locks.

Every stage that writes something a user would hate to lose (checkpoints, exports, hidden-state
caches, distilled data, tokenized data) goes through these helpers, so the same fault gives the
same one-line message everywhere:

- :func:`ensure_free_space` before a write of known (estimated) size;
- :func:`disk_full` to recognise a write that failed for lack of space anyway (torch's
  ``inline_container.cc`` enforce, safetensors' ``SafetensorError``, plain ``ENOSPC``) and
  :class:`DiskSpaceError` to report it ("no space left on <path>: need ~X, have Y");
- :class:`OutputLock` (a ``filelock`` lock) so a second process writing the same output is
  refused, naming the PID that holds it, or waits for it;
- :func:`make_readable` so exported directories can be read by a serving process running under
  another user (0755 directories, 0644 files).

Example:
    with OutputLock(out_dir, what="training run"):
        ensure_free_space(out_dir, estimate_bytes, what="checkpoint")
        try:
            save(...)
        except Exception as exc:
            if disk_full(exc):
                raise DiskSpaceError(out_dir, estimate_bytes) from exc
            raise
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

__all__ = [
    "DiskSpaceError",
    "OutputLock",
    "OutputLockedError",
    "disk_full",
    "ensure_free_space",
    "fmt_bytes",
    "free_bytes",
    "make_readable",
]

LOCK_NAME = ".draftsmith.lock"


class DiskSpaceError(OSError):
    """Not enough free space for a write; the message names the path and both sizes."""

    def __init__(self, path: str | Path, need: int | None = None, have: int | None = None):
        self.path = Path(path)
        self.need = need
        self.have = free_bytes(self.path) if have is None else have
        need_text = f"need ~{fmt_bytes(need)}, " if need else ""
        super().__init__(
            errno.ENOSPC,
            f"no space left on {self.path}: {need_text}have {fmt_bytes(self.have)}; free some "
            "space or choose another output directory",
        )

    def __str__(self) -> str:  # OSError's default adds "[Errno 28]"
        return self.strerror


class OutputLockedError(RuntimeError):
    """Another live process holds the output; the message names its PID."""


def fmt_bytes(n: int | float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    return shutil.disk_usage(_existing(Path(path))).free


def ensure_free_space(path: str | Path, need: int, *, margin: float = 1.1) -> None:
    """Raise :class:`DiskSpaceError` unless ``need * margin`` bytes are free at ``path``.

    Args:
        path: where the write goes (it need not exist yet).
        need: estimated size of the write in bytes.
        margin: safety factor over the estimate.
    """
    have = free_bytes(path)
    if need * margin > have:
        raise DiskSpaceError(path, int(need), have)


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) means the disk filled up.

    torch's zip writer reports ENOSPC as ``RuntimeError: [enforce fail at inline_container.cc]``
    (with "file write failed" / "No space left"), safetensors as ``SafetensorError`` with the OS
    message; both lose errno, so the message text is checked too.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DiskSpaceError):
            return True
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left" in text or ("inline_container.cc" in text and "write" in text):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class OutputLock:
    """An exclusive lock on an output (a directory or a file) for one writer process.

    A :class:`filelock.FileLock` (``flock`` on POSIX) on ``<dir>/.draftsmith.lock`` (for a
    directory) or ``<file>.lock`` (for a file). The OS drops it when the process dies, so a
    killed run never leaves a stale lock. The holder writes its PID beside it, in
    ``<lock>.pid`` (filelock may empty the lock file itself), so a refused writer can name it;
    release removes it, and the next holder rewrites one a killed holder left. Once acquired,
    the lock is held until :meth:`release` or the end of the process, even if this object is
    dropped.

    Args:
        path: the output directory or file.
        what: words for the error ("training run", "distill output", ...).
        lock_path: the lock file, instead of the default above.
        on_wait: wait for the holder instead of refusing: called with the holder's PID
            (``"unknown"`` when it left none) before the wait.

    Raises:
        OutputLockedError: on ``acquire`` when another process (or another lock in this
            process) holds it and ``on_wait`` is None.
    """

    def __init__(
        self,
        path: str | Path,
        what: str = "output",
        *,
        lock_path: str | Path | None = None,
        on_wait: Callable[[str], object] | None = None,
    ):
        self.path = Path(path)
        self.what = what
        if lock_path is not None:
            self.lock_path = Path(lock_path)
        elif self.path.is_dir() or not self.path.suffix:
            self.lock_path = self.path / LOCK_NAME
        else:
            self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.on_wait = on_wait
        self._lock: FileLock | None = None

    @property
    def pid_path(self) -> Path:
        """Where the holder writes its PID: ``<lock>.pid``."""
        return self.lock_path.with_name(self.lock_path.name + ".pid")

    def holder(self) -> str:
        """The PID the holder wrote, or ``"unknown"``."""
        try:
            return self.pid_path.read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def acquire(self) -> OutputLock:
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.lock_path, thread_local=False)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if self.on_wait is None:
                raise OutputLockedError(
                    f"{self.path} is in use by another {self.what} (PID {self.holder()}); wait "
                    "for it to finish or stop it, or choose another output"
                ) from None
            self.on_wait(self.holder())
            lock.acquire()
        try:
            self.pid_path.write_text(f"{os.getpid()}\n")
        except BaseException:
            lock.release()
            raise
        self._lock = lock
        _HELD.add(self)
        return self

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is None:
            return
        _HELD.discard(self)
        with contextlib.suppress(OSError):  # while held: never the next holder's
            self.pid_path.unlink(missing_ok=True)
        lock.release()

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


#: The acquired locks: a dropped FileLock releases itself, an OutputLock holds until released.
_HELD: set[OutputLock] = set()


def make_readable(path: str | Path) -> None:
    """chmod a written output for other users: directories 0755, files 0644 (recursively).

    ``tempfile.mkdtemp`` creates 0700 directories; an export renamed from one would be unreadable
    by a serving process under another user.
    """
    path = Path(path)
    if path.is_file():
        path.chmod(0o644)
        return
    path.chmod(0o755)
    for root, dirs, files in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
