"""Hidden states computed by a vLLM engine for the offline cache (``data cache --backend vllm``).

vLLM and draftsmith cannot share an environment (vLLM pins transformers below the version
draftsmith needs), so the engine runs in the vLLM venv as a child process:
``train/features/vllm_extract.py`` (stdlib + torch + vLLM only; its docstring specifies the
protocol and how vLLM extracts the states). This module is the parent side:

- :class:`ExtractorProcess` starts the child, waits for its ``ready`` message and sends it
  batches of token ids; it gets back ``[T, L, H]`` per sample. Errors of the child (including
  its death) become one-line :class:`~draftsmith.train.errors.RunError` s naming its log file.
- :class:`VllmTarget` wraps a running child as the ``target`` that
  :func:`~draftsmith.train.features.cache_write.build_cache` runs: it answers the few things the
  builder asks of a target (config, vocabulary rows, compute dtype) from the model's
  ``config.json`` and the child, and its forward unpads the batch, has vLLM compute it and
  returns the requested layers. So the vLLM cache is planned, sharded, resumed, fingerprinted and
  read exactly like an HF-built one (same manifest, same shards); only the numbers come from
  another engine. The manifest's ``backend`` records which (``{"name": "vllm", versions, engine
  settings}``), and the backend's name is part of the plan hash, so a resume never mixes shards
  of the two backends.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..errors import RunError, UsageError

__all__ = [
    "EXTRACT_SCRIPT",
    "VLLM_PYTHON_ENV",
    "ExtractorProcess",
    "VllmTarget",
    "find_vllm_python",
    "vllm_target",
]

#: The script the vLLM venv runs (found by path: it is not imported here).
EXTRACT_SCRIPT = Path(__file__).with_name("vllm_extract.py")
#: Environment variable naming the vLLM venv's python (the ``vllm_python`` setting wins).
VLLM_PYTHON_ENV = "DRAFTSMITH_VLLM_PYTHON"
PROTOCOL = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Our storage-dtype names -> vLLM's --dtype.
VLLM_DTYPE = {"auto": "auto", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def find_vllm_python(explicit: str | Path | None = None) -> str:
    """The python that runs the extractor: ``explicit``, else ``$DRAFTSMITH_VLLM_PYTHON``, else
    this interpreter when it can import vllm.

    Raises:
        UsageError: If none is given and this interpreter has no vllm, or the path is no file.
    """
    path = explicit or os.environ.get(VLLM_PYTHON_ENV)
    if not path:
        if importlib.util.find_spec("vllm") is not None:
            return sys.executable
        raise UsageError(
            "vllm_python: --backend vllm runs vLLM from its own environment; pass its python "
            f"with --vllm-python or {VLLM_PYTHON_ENV} (create one with "
            "scripts/setup_vllm_venv.sh)"
        )
    if not Path(path).is_file():
        raise UsageError(f"vllm_python: no python at {path}")
    return str(path)


class ExtractorProcess:
    """The child process running ``vllm_extract.py``: start, :meth:`extract` batches, close.

    Use as a context manager; leaving it (also on an error or Ctrl-C) shuts the engine down and
    kills the child's whole process group if it does not exit in time.

    Attributes:
        info: the child's ``ready`` message (``dtype``, ``num_layers``, ``hidden_size``,
            ``versions``, ``engine_args``, ``load_seconds``, ...).
        log_path: where the child's stdout/stderr (vLLM's log) go; removed when the child
            exits with status 0.
    """

    def __init__(
        self,
        python: str,
        target_dir: str | Path,
        layers: Sequence[int],
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 8192,
        engine_args: dict[str, Any] | None = None,
        startup_timeout: float = 1800.0,
        batch_timeout: float = 1800.0,
        script: str | Path | None = None,
        progress: bool = True,
    ):
        """Start the child and wait until its engine is ready.

        Args:
            python: the vLLM venv's python (:func:`find_vllm_python`).
            target_dir: the target's Hugging Face directory.
            layers: feature layers (:data:`~draftsmith.heads.base.Features` convention).
            dtype: vLLM's ``dtype`` (``auto``, ``float32``, ``bfloat16``, ``float16``).
            max_model_len: longest sample + 1 (a request is the sample plus one sampled token).
            max_num_seqs: most requests vLLM runs in one step.
            max_num_batched_tokens: most tokens vLLM runs in one step.
            engine_args: more ``vllm.LLM`` keyword arguments (e.g. ``tensor_parallel_size``).
            startup_timeout: seconds to wait for the engine.
            batch_timeout: seconds to wait for one batch's answer.
            script: the extractor script (default :data:`EXTRACT_SCRIPT`; tests pass a
                stand-in speaking the same protocol).
            progress: say on stderr that the engine is starting and where its log goes.

        Raises:
            UsageError: If ``python`` cannot run or has no vllm.
            RunError: If the child fails or times out before it is ready.
        """
        script = script or EXTRACT_SCRIPT
        self.python = python
        self.batch_timeout = batch_timeout
        self.layers = [int(x) for x in layers]
        fd, log = tempfile.mkstemp(prefix="draftsmith_vllm_extract_", suffix=".log")
        self.log_path = Path(log)
        cmd = [python, str(script), "--target", str(target_dir), "--layers"]
        cmd += [str(x) for x in self.layers]
        cmd += ["--dtype", dtype, "--max-num-seqs", str(max_num_seqs)]
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        if max_model_len is not None:
            cmd += ["--max-model-len", str(max_model_len)]
        if engine_args:
            cmd += ["--engine-args", json.dumps(engine_args)]
        read_fd, write_fd = os.pipe()
        cmd += ["--reply-fd", str(write_fd)]
        if progress:
            print(f"starting vLLM for hidden states (log: {self.log_path})", file=sys.stderr)
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=fd,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                # Its own process group: vLLM starts engine and worker processes, and a close
                # that times out ends all of them (and only them).
                start_new_session=True,
            )
        except OSError as exc:
            os.close(read_fd)
            raise UsageError(f"vllm_python: cannot run {python}: {exc.strerror}") from exc
        finally:
            os.close(fd)
            os.close(write_fd)
        # Larger pipe buffer (Linux): fewer wake-ups for the tens of MB a batch sends.
        with contextlib.suppress(AttributeError, OSError):
            import fcntl

            fcntl.fcntl(read_fd, fcntl.F_SETPIPE_SZ, 1 << 20)
        self._replies = io.FileIO(read_fd, "rb", closefd=True)
        self._buf = bytearray()
        try:
            msg = self._read_message(time.monotonic() + startup_timeout, "starting")
            if msg.get("op") != "ready" or msg.get("protocol") != PROTOCOL:
                raise RunError(
                    f"the vLLM extractor answered {msg.get('op')!r} protocol "
                    f"{msg.get('protocol')!r}, expected 'ready' protocol {PROTOCOL} (is "
                    f"{script} from this draftsmith?)"
                )
            self.info: dict[str, Any] = msg
        except BaseException:
            self.close(ok=False)
            raise

    # -- protocol ----------------------------------------------------------------------------

    def extract(self, samples: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Hidden states ``[T_i, len(layers), H]`` (the engine's dtype) of each sample.

        Raises:
            RunError: If the child fails, dies or does not answer within ``batch_timeout``.
        """
        req = {"op": "extract", "samples": [[int(t) for t in s] for s in samples]}
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self._fail("extracting")
        deadline = time.monotonic() + self.batch_timeout
        msg = self._read_message(deadline, "extracting")
        if msg.get("op") != "hidden":
            raise RunError(f"the vLLM extractor answered {msg.get('op')!r} to an extract request")
        payload = self._read_exact(int(msg["nbytes"]), deadline, "extracting")
        dtype = _DTYPES[msg["dtype"]]
        flat = torch.frombuffer(payload, dtype=dtype).view(msg["shape"])
        lengths = [int(n) for n in msg["lengths"]]
        if lengths != [len(s) for s in samples]:
            raise RunError(f"the vLLM extractor answered lengths {lengths[:8]} for other samples")
        return list(torch.split(flat, lengths))

    def _read_message(self, deadline: float, doing: str) -> dict[str, Any]:
        while b"\n" not in self._buf:
            self._fill(deadline, doing)
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        msg = json.loads(line)
        if msg.get("op") == "error":
            self._fail(doing, msg.get("message") or "unknown error")
        return msg

    def _read_exact(self, n: int, deadline: float, doing: str) -> bytearray:
        out = bytearray(n)
        got = min(n, len(self._buf))
        out[:got] = self._buf[:got]
        del self._buf[:got]
        view = memoryview(out)
        while got < n:
            self._wait(deadline, doing)
            k = self._replies.readinto(view[got:])
            if not k:
                self._fail(doing)
            got += k
        return out

    def _fill(self, deadline: float, doing: str) -> None:
        self._wait(deadline, doing)
        chunk = self._replies.read(1 << 16)
        if not chunk:
            self._fail(doing)
        self._buf += chunk

    def _wait(self, deadline: float, doing: str) -> None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(ok=False)
                raise RunError(
                    f"the vLLM extractor gave no answer in time while {doing}; its log: "
                    f"{self.log_path}"
                )
            if select.select([self._replies], [], [], min(left, 5.0))[0]:
                return

    def _fail(self, doing: str, message: str | None = None) -> None:
        """Raise the one-line error for a child that reported ``message`` or died."""
        self.close(ok=False)
        if message is None:
            rc = self.proc.returncode
            message = f"exited with status {rc}" + (f": {self._last_log_line()}" if rc else "")
        if "No module named 'vllm'" in message:
            self.log_path.unlink(missing_ok=True)  # nothing in it but that
            raise UsageError(
                f"vllm_python: {self.python} has no vllm ({message}); pass the python of the "
                "vLLM environment"
            )
        where = f"(python: {self.python}; log: {self.log_path})"
        raise RunError(f"the vLLM extractor failed while {doing}: {message} {where}")

    def _last_log_line(self) -> str:
        with contextlib.suppress(OSError):
            lines = [x.strip() for x in self.log_path.read_text(errors="replace").splitlines()]
            lines = [x for x in lines if x]
            if lines:
                return lines[-1][:300]
        return "(empty log)"

    # -- life cycle --------------------------------------------------------------------------

    def close(self, ok: bool = True, timeout: float = 120.0) -> None:
        """End the child: close its stdin (it shuts vLLM down), wait, else kill its group.

        Args:
            ok: a clean end (else the child gets at most 30 s to exit). The log is removed
                when the child exits with status 0, else kept for the error message.
            timeout: seconds to wait for the child to exit by itself.
        """
        proc = getattr(self, "proc", None)
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=timeout if ok else min(timeout, 30.0))
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=15)
                    break
                except subprocess.TimeoutExpired:
                    continue
        with contextlib.suppress(OSError):
            self._replies.close()
        if proc.returncode == 0:  # the child ended well: its log holds nothing to look into
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> ExtractorProcess:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(ok=exc_type is None)


class _Rows:
    """Stands in for an embedding/lm_head: only ``.weight``'s shape, dtype and device are read."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype):
        # Stride-0 view of one element: the shape without the memory.
        self.weight = torch.zeros((), dtype=dtype).expand(rows, cols)


class _Layers(Sequence):
    """``hidden_states`` of a forward: ``num_layers + 1`` entries, only the extracted ones set."""

    def __init__(self, stacked: torch.Tensor, layers: list[int], num_layers: int):
        self._stacked, self._layers, self._n = stacked, layers, num_layers

    def __len__(self) -> int:
        return self._n + 1

    def __getitem__(self, i: Any) -> Any:
        i = self._n + 1 + i if isinstance(i, int) and i < 0 else i
        if i not in self._layers:
            raise IndexError(f"layer {i} was not extracted (the engine serves {self._layers})")
        return self._stacked[:, :, self._layers.index(i)]


class VllmTarget(torch.nn.Module):
    """A target whose forward runs in a vLLM engine (an :class:`ExtractorProcess`).

    What :func:`~draftsmith.train.features.cache_write.build_cache` reads of a target: ``config``
    (from the model's ``config.json``), the vocabulary rows (``get_input_embeddings`` /
    ``get_output_embeddings().weight.shape[0]``), the compute dtype (its one parameter) and
    ``forward(input_ids [B, T], attention_mask [B, T] | None, output_hidden_states=True)`` ->
    ``.hidden_states`` indexable by the feature layers the engine was started for. Padded rows
    (right padding) are zero.

    Attributes:
        backend: what the manifest records: ``{"name": "vllm", "versions", "engine", ...}``.
    """

    def __init__(self, extractor: ExtractorProcess, config: Any):
        super().__init__()
        info = extractor.info
        if int(info["num_layers"]) != int(config.num_hidden_layers) or int(
            info["hidden_size"]
        ) != int(config.hidden_size):
            raise RunError(
                f"vLLM loaded {info['num_layers']} layers × hidden {info['hidden_size']}, the "
                f"config says {config.num_hidden_layers} × {config.hidden_size}"
            )
        self.extractor = extractor
        self.config = config
        self.layers = list(extractor.layers)
        dtype = _DTYPES[info["dtype"]]
        # build_cache reads the compute dtype from the first parameter: this is it.
        self.compute_dtype = torch.nn.Parameter(torch.zeros((), dtype=dtype), requires_grad=False)
        self._rows = _Rows(int(config.vocab_size), int(config.hidden_size), dtype)
        self.backend = {
            "name": "vllm",
            "versions": info.get("versions", {}),
            "engine": {
                k: info.get(k)
                for k in ("platform", "model_runner", "connector", "engine_args", "dtype")
            },
            "method": "speculative_config.method=extract_hidden_states",
        }

    def get_input_embeddings(self) -> _Rows:
        return self._rows

    def get_output_embeddings(self) -> _Rows:
        return self._rows

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> SimpleNamespace:
        """Hidden states of a right-padded batch, computed by vLLM one request per sample.

        Args:
            input_ids: ``[B, T]``.
            attention_mask: ``[B, T]``, 1 = token (right padding); None = no padding.
            kwargs: ignored (``output_hidden_states``, ``use_cache``: always what is meant).

        Returns:
            ``.hidden_states[layer]`` ``[B, T, H]`` for each extracted layer.
        """
        b, t = input_ids.shape
        if attention_mask is None:
            lengths = [t] * b
        else:
            lengths = [int(n) for n in attention_mask.sum(1).tolist()]
            if any(not bool(attention_mask[i, :n].all()) for i, n in enumerate(lengths)):
                raise ValueError("VllmTarget expects right padding (1s, then 0s)")
        ids = input_ids.cpu()
        hidden = self.extractor.extract([ids[i, :n].tolist() for i, n in enumerate(lengths)])
        dtype = self.compute_dtype.dtype
        stacked = torch.zeros((b, t, len(self.layers), int(self.config.hidden_size)), dtype=dtype)
        for i, h in enumerate(hidden):
            stacked[i, : lengths[i]] = h
        return SimpleNamespace(
            hidden_states=_Layers(stacked, self.layers, int(self.config.num_hidden_layers))
        )


@contextlib.contextmanager
def vllm_target(
    target_dir: str | Path,
    layers: Sequence[int],
    *,
    python: str | Path | None = None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 8192,
    engine_args: dict[str, Any] | None = None,
    script: str | Path | None = None,
    progress: bool = True,
) -> Iterator[VllmTarget]:
    """Start vLLM on ``target_dir`` for ``layers``; yield it as a :class:`VllmTarget`.

    Args:
        target_dir: the prepared Hugging Face directory
            (:func:`~draftsmith.train.target_model.load.prepare_target`).
        layers: feature layers to extract.
        python: the vLLM venv's python (default: :func:`find_vllm_python`).
        dtype: ``auto`` (vLLM's choice) or ``fp32``/``bf16``/``fp16``.
        max_model_len, max_num_seqs, max_num_batched_tokens, engine_args, script, progress:
            see :class:`ExtractorProcess`.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir)
    config.name_or_path = str(target_dir)
    with ExtractorProcess(
        find_vllm_python(python),
        target_dir,
        layers,
        dtype=VLLM_DTYPE.get(dtype, dtype),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        engine_args=engine_args,
        script=script,
        progress=progress,
    ) as proc:
        yield VllmTarget(proc, config).eval()
