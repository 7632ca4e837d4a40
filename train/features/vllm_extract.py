"""Target hidden states from a vLLM engine, served to ``draftsmith data cache --backend vllm``.

Runs INSIDE the vLLM venv as a child process of the cache build
(:mod:`draftsmith.train.features.vllm_backend` starts it by path). It imports only the standard
library, torch and vLLM -- never draftsmith: the two environments cannot be one (vLLM pins
transformers below the version draftsmith needs).

How vLLM computes the features (the path vLLM's ``speculators`` project uses for its data
generation): the speculative method ``extract_hidden_states`` makes the target return its
auxiliary hidden states at ``eagle_aux_hidden_state_layer_ids`` and writes them, per token, into
a cache-only "KV" layer; the KV connector ``ExampleHiddenStatesConnector`` copies each finished
request's rows to ``<dir>/<request id>.safetensors`` (``hidden_states [T, L, H]``, ``token_ids
[T]``) and returns the path in ``RequestOutput.kv_transfer_params["hidden_states_path"]``. A
request is the sample's token ids with ``max_tokens=1``: one prefill (chunked if long), no
decode. Two adaptations:

- On CPU the stock connector cannot run (it copies through ``torch.cuda.Stream`` and pinned
  memory); :mod:`vllm_hs_connector` (beside this file) is the same connector with a synchronous
  CPU copy. On GPUs the stock connector is used.
- vLLM's aux layer ``i`` is the residual stream entering decoder layer ``i`` (0 = embeddings),
  which is draftsmith's feature layer ``i`` (Hugging Face ``hidden_states[i]``) for
  ``i < num_layers``. Draftsmith's layer ``num_layers`` is the final *normed* output, while vLLM's
  aux layer ``num_layers`` is the un-normed residual. When that layer is asked for, the worker
  extension :class:`FinalOutputCapture` makes the model put its own final output (after the
  final norm: exactly what vLLM's lm_head reads) in that aux slot.

Protocol (version 1). The parent writes one JSON object per line to stdin; the child answers on
the file descriptor ``--reply-fd`` (stdout and stderr are left to vLLM's logs):

- child, once the engine is up: ``{"op": "ready", "protocol": 1, "dtype": "float32",
  "num_layers": ..., "hidden_size": ..., "layers": [...], "versions": {...}, ...}`` + newline;
- parent: ``{"op": "extract", "samples": [[token ids], ...]}``;
- child: ``{"op": "hidden", "lengths": [T_0, ...], "shape": [sum T, L, H], "dtype": "float32",
  "nbytes": N, "seconds": s}`` + newline, then exactly ``N`` bytes: the samples' hidden states
  ``[T_i, L, H]`` concatenated in request order, layers in the order of ``--layers``, C order,
  little-endian;
- child, on any failure: ``{"op": "error", "message": "..."}`` + newline, then exit status 1;
- parent closes stdin: the child shuts the engine down and exits 0.

Usage (normally only the cache build runs it)::

    ~/.cache/draftsmith/vllm-venv/bin/python train/features/vllm_extract.py --target DIR --layers 2 15 27 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import IO, Any

import torch

PROTOCOL = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Where the connector module lives for vLLM's engine and worker processes (they import it by
# name: kv_connector_module_path / worker_extension_cls).
HERE = os.path.dirname(os.path.abspath(__file__))
CPU_CONNECTOR_MODULE = "vllm_hs_connector"
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
# KV cache for CPU runs unless the engine args say otherwise: vLLM on CPU otherwise reserves a
# fraction of the NUMA node's memory and refuses to start when that much is not free.
CPU_KV_CACHE_BYTES = 1 << 30


# ----------------------------------------------------------------------------------------------
# Inside vLLM's worker process


class FinalOutputCapture:
    """vLLM worker extension: the last aux hidden state becomes the model's final output.

    vLLM mixes this class into its worker (``worker_extension_cls``); the child calls
    :meth:`draftsmith_use_final_output` through ``LLM.collective_rpc`` once the engine is up,
    only when the feature layer ``num_layers`` is requested (then it is the last, largest aux
    layer id). The model's forward returns ``(final normed hidden states [N, H], aux list)``
    when aux outputs are on; the wrapper replaces the aux list's last entry (the un-normed
    residual after the last layer) by the first item.
    """

    model_runner: Any  # set by vLLM's worker

    def draftsmith_use_final_output(self) -> bool:
        """Wrap the model's forward (idempotent). Returns True once installed."""
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        if getattr(model, "_draftsmith_final_output", False):
            return True
        inner = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list) and out[1]:
                return out[0], [*out[1][:-1], out[0]]
            return out  # a pipeline stage that is not the last one: intermediate tensors

        model.forward = forward
        model._draftsmith_final_output = True
        return True


# ----------------------------------------------------------------------------------------------
# The engine


class VllmExtractor:
    """A vLLM ``LLM`` set up for hidden-state extraction; :meth:`extract` runs a batch."""

    def __init__(self, args: argparse.Namespace):
        """Start the engine (takes a minute or more). ``args``: see :func:`parse_args`."""
        # The engine and worker processes import the connector and the worker extension by
        # module name; spawned processes inherit this environment.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p
        )
        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        t0 = time.perf_counter()
        self.layers = list(args.layers)
        self.aux_ids = sorted(self.layers)  # vLLM returns aux layers in ascending order
        self.order = [self.aux_ids.index(x) for x in self.layers]
        self.llm: Any = None
        self.hs_dir = tempfile.mkdtemp(prefix="draftsmith_vllm_hs_", dir=args.hs_dir)
        try:
            self._start(args)
        except BaseException:
            self.close()  # the connector's directory, and an engine that did start
            raise
        self.info["load_seconds"] = time.perf_counter() - t0

    def _start(self, args: argparse.Namespace) -> None:
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        connector: dict[str, Any] = {
            "kv_connector": STOCK_CONNECTOR,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": self.hs_dir},
        }
        if on_cpu:
            connector["kv_connector"] = "CpuHiddenStatesConnector"
            connector["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
        engine_args: dict[str, Any] = {
            "model": args.target,
            "dtype": args.dtype,
            "seed": 0,
            "enforce_eager": True,
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            # Each sample's rows must come from its own prefill; a prefix-cache hit would skip
            # the forward for the shared prefix.
            "enable_prefix_caching": False,
            **json.loads(args.engine_args or "{}"),
        }
        sized = "kv_cache_memory_bytes" in engine_args or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        if on_cpu and not sized:
            engine_args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        self.engine_args = dict(engine_args)
        self.llm = LLM(
            **engine_args,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {
                    "hf_config": {"eagle_aux_hidden_state_layer_ids": self.aux_ids}
                },
            },
            kv_transfer_config=connector,
            worker_extension_cls=f"{_module_name()}.FinalOutputCapture",
        )
        vcfg = self.llm.llm_engine.vllm_config
        self.num_layers = int(vcfg.model_config.get_total_num_hidden_layers())
        self.hidden_size = int(vcfg.model_config.get_hidden_size())
        bad = [x for x in self.layers if not 0 <= x <= self.num_layers]
        if bad:
            raise ValueError(f"layers {bad} outside 0..{self.num_layers}")
        if self.num_layers in self.layers:
            self.llm.collective_rpc("draftsmith_use_final_output")
        self.dtype = vcfg.model_config.dtype
        self.params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        runner = "v2" if getattr(vcfg, "use_v2_model_runner", False) else "v1"
        self.info = {
            "platform": "cpu" if on_cpu else str(current_platform.device_type),
            "model_runner": runner,
            "connector": connector["kv_connector"],
            "engine_args": self.engine_args,
        }

    def ready_info(self) -> dict[str, Any]:
        """What the ``ready`` message reports besides the protocol fields."""
        import vllm

        return {
            "dtype": _dtype_name(self.dtype),
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "layers": self.layers,
            "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
            **self.info,
        }

    def extract(self, samples: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Hidden states ``[T_i, len(layers), H]`` of each sample (requested layer order)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in samples]
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        out = []
        for i, (ids, res) in enumerate(zip(samples, outputs, strict=True)):
            path = (res.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise RuntimeError(f"sample {i}: vLLM returned no hidden_states_path")
            data = load_hidden_states(path)  # waits for the connector's write to finish
            cleanup_hidden_states(path)
            hs, tok = data["hidden_states"], data["token_ids"]
            # The connector reads rows back by the request's block ids: the tokens it stored
            # beside them prove the rows are this sample's.
            if tok.tolist() != list(ids):
                raise RuntimeError(f"sample {i}: the stored token ids differ from the prompt")
            want = (len(ids), len(self.layers), self.hidden_size)
            if tuple(hs.shape) != want:
                raise RuntimeError(f"sample {i}: hidden states {tuple(hs.shape)}, want {want}")
            out.append(hs[:, self.order])
        return out

    def close(self) -> None:
        """Shut the engine down and remove the connector's directory."""
        import shutil

        llm, self.llm = self.llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if callable(getattr(core, "shutdown", None)):
            core.shutdown()  # the engine and worker processes; exiting would do it too
        shutil.rmtree(self.hs_dir, ignore_errors=True)


def _module_name() -> str:
    # This module's importable name in vLLM's processes (run as a script it is __main__ here).
    return os.path.splitext(os.path.basename(__file__))[0]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------
# The protocol loop (no vLLM here: tests drive it with a stand-in extractor)


def write_message(out: IO[bytes], msg: dict[str, Any], payload: torch.Tensor | None = None) -> None:
    """One JSON line, then ``payload``'s raw bytes (C order) if given; flushed."""
    out.write(json.dumps(msg).encode() + b"\n")
    if payload is not None:
        # uint8 view: bf16 has no numpy dtype; the bytes are what matter.
        out.write(memoryview(payload.contiguous().view(torch.uint8).numpy()))
    out.flush()


def serve(extractor: Any, requests: IO[str], replies: IO[bytes]) -> int:
    """Answer ``extract`` requests until ``requests`` closes. Returns the exit status."""
    write_message(replies, {"op": "ready", "protocol": PROTOCOL, **extractor.ready_info()})
    for line in requests:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") != "extract":
            raise ValueError(f"unknown request {req.get('op')!r}")
        t0 = time.perf_counter()
        hidden = extractor.extract(req["samples"])
        lengths = [int(h.shape[0]) for h in hidden]
        flat = torch.cat(hidden) if hidden else torch.zeros(0)
        write_message(
            replies,
            {
                "op": "hidden",
                "lengths": lengths,
                "shape": list(flat.shape),
                "dtype": _dtype_name(flat.dtype),
                "nbytes": flat.numel() * flat.element_size(),
                "seconds": time.perf_counter() - t0,
            },
            flat,
        )
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", required=True, help="the target's Hugging Face directory")
    ap.add_argument(
        "--layers", type=int, nargs="+", required=True, help="feature layers (draftsmith's)"
    )
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="vLLM dtype")
    ap.add_argument("--max-model-len", type=int, default=None, help="longest sample + 1")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="most requests per step")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="most tokens per step")
    ap.add_argument("--engine-args", default=None, help="more vllm.LLM arguments as JSON")
    ap.add_argument("--hs-dir", default=None, help="parent of the connector's directory")
    ap.add_argument("--reply-fd", type=int, default=None, help="answers go here (default 1)")
    args = ap.parse_args(argv)
    if args.engine_args is not None and not isinstance(json.loads(args.engine_args), dict):
        ap.error("--engine-args must be a JSON object")
    return args


def main(
    argv: Sequence[str] | None = None,
    make_extractor: Callable[[argparse.Namespace], Any] = VllmExtractor,
) -> int:
    """Start the extractor and serve requests; any failure is reported as an ``error`` message.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
        make_extractor: builds the extractor from the parsed arguments (tests pass a stand-in
            with the same ``ready_info``/``extract``/``close`` methods).
    """
    args = parse_args(argv)
    fd = args.reply_fd if args.reply_fd is not None else os.dup(sys.stdout.fileno())
    replies = os.fdopen(fd, "wb")
    extractor = None
    try:
        extractor = make_extractor(args)
        return serve(extractor, sys.stdin, replies)
    except BaseException as exc:
        traceback.print_exc()
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()
        with contextlib.suppress(OSError):  # OSError: the parent is gone
            write_message(replies, {"op": "error", "message": message[0] if message else ""})
        return 1
    finally:
        if extractor is not None:
            extractor.close()


if __name__ == "__main__":
    sys.exit(main())
