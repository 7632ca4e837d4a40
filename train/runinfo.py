"""What produced a result: the command, package versions and machine, attached to every JSON."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

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


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON to a temp file beside ``path`` and rename it into place (no half files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        FileExistsError: ``out`` exists and ``overwrite`` is False.
    """
    import shutil

    tmp, out = Path(tmp), Path(out)
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        os.replace(out, old / "x")
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
