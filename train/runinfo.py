"""What produced a result (command, versions, machine), and writing outputs safely.

- :func:`run_info` is attached to every results JSON.
- :func:`write_json_atomic` / :func:`json_text` write strict JSON: a non-finite float (NaN,
  inf) is written as ``null``, never as the bare ``NaN`` / ``Infinity`` tokens Python's json
  emits by default, which other JSON readers reject.
- :func:`staged_dir` writes an output directory (an export, a tokenized dataset) into a hidden
  temp dir beside it and renames it into place, so a failure or a kill never leaves a half
  output under the final name; temp dirs of dead writers are removed on the next run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith.train.errors import UsageError

if TYPE_CHECKING:
    from draftsmith.train.safety import OutputLock


class OutputExistsError(UsageError, FileExistsError):
    """The output exists and ``overwrite`` was not given: a usage error, and a FileExistsError."""


_PACKAGES = ("draftsmith", "torch", "transformers", "accelerate", "datasets", "peft")


def run_info() -> dict[str, Any]:
    """Command line, versions, git commit and machine facts for a results file."""
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = platform.python_version()
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=Path(__file__).parent,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    import torch

    return {
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "versions": versions,
        "git_commit": commit,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "device": "cuda" if torch.cuda.is_available() else "cpu",
        },
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def finite_json(data: Any) -> Any:
    """``data`` with every non-finite float (NaN, inf, -inf) replaced by None, recursively.

    Python's json writes them as bare ``NaN``/``Infinity``, which is not JSON: ``jq``, browsers
    and most other readers reject the whole file. ``null`` keeps the file valid and says "no
    number"; a diverged metric is reported by the run itself (message, exit code), not here.
    Dicts, lists and tuples are walked; other values are returned as they are.
    """
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_json(v) for v in data]
    return data


def json_text(data: Any, **kwargs: Any) -> str:
    """``json.dumps`` after :func:`finite_json`, with ``allow_nan=False`` as a guard."""
    return json.dumps(finite_json(data), allow_nan=False, **kwargs)


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON to a temp file beside ``path`` and rename it into place (no half files).

    Non-finite floats are written as ``null`` (see :func:`finite_json`), so the file is always
    valid JSON.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json_text(data, indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        _raise_if_disk_full(exc, path.parent, len(text))
        raise


def _raise_if_disk_full(exc: BaseException, path: Path, need: int) -> None:
    from draftsmith.train.safety import DiskSpaceError, disk_full

    if not isinstance(exc, DiskSpaceError) and disk_full(exc):
        raise DiskSpaceError(path, need) from exc


def wandb_mode() -> str | None:
    """``"offline"`` when W&B has no API key configured (and ``WANDB_MODE`` is unset), else None.

    Checked without importing wandb (touching ``wandb.api`` freezes its settings before the mode
    is chosen). Recipes pass the result as ``wandb.init(mode=...)``, so a run without a key or a
    network logs to ``./wandb`` (``wandb sync`` uploads it later) instead of failing.
    """
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return None
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        if "api.wandb.ai" in netrc.read_text():
            return None
    except OSError:
        pass
    return "offline"


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


def output_lock(path: str | Path, what: str) -> OutputLock:
    """An :class:`~draftsmith.train.safety.OutputLock` held on ``<path>.lock`` beside ``path``.

    For outputs that are a file (distilled JSONL) or a directory replaced as a whole
    (:func:`staged_dir`): a lock file inside a replaced directory would move away with the old
    copy, and ``OutputLock``'s own choice (inside a suffix-less path) would turn a file output
    without a suffix into a directory.
    """
    from draftsmith.train.safety import OutputLock

    path = Path(path)
    lock = OutputLock(path, what=what)
    lock.lock_path = path.with_name(path.name + ".lock")
    return lock


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


def clean_stale_dirs(out: str | Path) -> list[Path]:
    """Remove the staging dirs beside ``out`` left by writers that died (killed, crashed).

    A dir ``.<name>.tmp-<pid>@<host>.*`` is removed when that PID no longer runs on this host;
    a live writer's dir is kept. An ``.old-`` dir (the previous output, moved aside during the
    final rename) is moved back to ``out`` if the writer died before ``out`` was replaced.

    Returns:
        The directories removed.
    """
    out = Path(out)
    removed: list[Path] = []
    if not out.parent.is_dir():
        return removed
    for kind in ("tmp", "old"):
        head = f".{out.name}.{kind}-"
        for path in out.parent.glob(f"{head}*"):
            pid_text, at, rest = path.name[len(head) :].partition("@")
            if not (at and pid_text.isdigit() and path.is_dir()):
                continue  # not one of ours
            host = rest.rsplit(".", 1)[0]
            if _writer_alive(int(pid_text), host):
                continue
            if kind == "old" and not out.exists() and (path / "x").is_dir():
                os.replace(path / "x", out)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


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
    from draftsmith.train.safety import ensure_free_space, make_readable

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_dirs(out)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    ensure_free_space(out.parent, need_bytes)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=_stage_prefix(out, "tmp")))
    try:
        yield tmp
        make_readable(tmp)
        replace_dir(tmp, out, overwrite)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_if_disk_full(exc, out.parent, need_bytes)
        raise


def machine_load() -> dict[str, float | int]:
    """The load average and core count: a busy 2-core machine skews every timing.

    Results JSONs record it before and after a timed run, so a reader can tell whether another
    job shared the cores. Empty where the platform has no load average.
    """
    try:
        load = os.getloadavg()
    except OSError:
        return {}
    return {"loadavg_1m": load[0], "loadavg_5m": load[1], "cpu_count": os.cpu_count()}
