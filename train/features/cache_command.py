"""The ``draftsmith data cache`` command: load the target and data, then build the cache.

``--backend hf`` (default) runs the target with transformers in this process, on ``--device``
(``auto``: under ``accelerate launch`` the device accelerate gives each process, else the first
GPU when there is one, else the CPU); ``--backend vllm`` runs it in a vLLM engine in its own
environment (:mod:`draftsmith.train.features.vllm_backend`), writing the same cache format, on
the platform that vLLM build runs on (its GPUs are chosen with ``CUDA_VISIBLE_DEVICES``), so
``--device`` stays ``auto`` there. The manifest records the device that ran the target
(``device``: :func:`~draftsmith.train.device.device_facts`; for vLLM, ``backend.engine``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...heads import families
from ..config import cfg_field
from ..core.dist import process_state
from ..data.tokens import load_token_data
from ..device import (
    DEVICE_HELP,
    DTYPE_AUTO_HELP,
    auto_dtype,
    device_facts,
    device_problem,
    is_cpu,
    resolve_device,
)
from ..errors import UsageError, cli_main
from .cache_format import DTYPES, CacheError
from .cache_write import build_cache
from .source import check_layers, scan_token_data

__all__ = ["CacheConfig", "main_cache", "run_cache"]


@dataclass
class CacheConfig:
    """Settings of ``draftsmith data cache``."""

    data: Path = cfg_field(
        help="tokenized data: a datasets.save_to_disk dir or JSONL with input_ids/loss_mask"
    )
    out: Path = cfg_field(help="cache directory (resumes if it holds a partial cache)")
    target: str | None = cfg_field(
        None,
        help="target: a Hugging Face Hub id, a local HF model dir, a .gguf file, or None for SmolLM2-135M-Instruct",
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    layers: list[int] | None = cfg_field(
        None, help="feature layers (0 = embeddings, num_layers = final normed output)"
    )
    preset: str = cfg_field(
        "eagle3",
        help="layers when --layers is not given: the family's (heads/families.py) plus the final "
        "output n; eagle3 = [2, n/2, n-3, n], eagle1/medusa = [n]",
        choices=list(families.cache_presets()),
    )
    dtype: str = cfg_field("bf16", help="storage dtype", choices=list(DTYPES))
    target_dtype: str = cfg_field(
        "auto",
        help="dtype the target computes in (" + DTYPE_AUTO_HELP + "; with --backend vllm: "
        "vLLM's choice)",
        choices=["auto", *DTYPES],
    )
    device: str = cfg_field(
        "auto",
        help=DEVICE_HELP + "; under accelerate launch auto is each process's own device; "
        "--backend vllm and --device-map place the target themselves (leave auto)",
    )
    backend: str = cfg_field(
        "hf",
        help="what runs the target: hf = transformers in this process; vllm = a vLLM engine in "
        "its own environment (--vllm-python), same cache format",
        choices=["hf", "vllm"],
    )
    vllm_python: str | None = cfg_field(
        None,
        help="--backend vllm: python of the vLLM environment (default: $DRAFTSMITH_VLLM_PYTHON, "
        "else this python if it has vllm)",
    )
    vllm_engine_args: str | None = cfg_field(
        None,
        help="--backend vllm: more vllm.LLM arguments as a JSON object, e.g. "
        '{"tensor_parallel_size": 4}',
    )
    device_map: str | None = cfg_field(
        None,
        help="model parallelism for targets larger than one device (auto, balanced, "
        "sequential); passed to from_pretrained",
    )
    batch_tokens: int = cfg_field(8192, help="most padded tokens (batch × longest) per forward")
    max_batch_size: int = cfg_field(64, help="most samples per forward")
    shard_mb: float = cfg_field(512.0, help="shard size in MiB")
    max_length: int | None = cfg_field(None, help="truncate samples to this many tokens")
    limit: int | None = cfg_field(None, help="cache the first N samples only")
    draft_vocab_size: int | None = cfg_field(
        None, help="also store EAGLE-3 d2t/t2d for this draft vocab size (EOS always included)"
    )
    template_fingerprint: str | None = cfg_field(
        None, help="chat-template fingerprint to record (default: computed from the tokenizer)"
    )
    overwrite: bool = cfg_field(False, help="replace a cache built with other data/settings")
    threads: int | None = cfg_field(
        None, help="torch CPU threads when the device is the CPU (default: torch's choice)"
    )
    progress: bool = cfg_field(True, help="show the progress bar")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        for name in ("batch_tokens", "max_batch_size", "max_length", "limit", "threads"):
            v = getattr(self, name)
            if v is not None and v < 1:
                problems.append((name, f"must be >= 1, got {v}"))
        if self.shard_mb <= 0:
            problems.append(("shard_mb", f"must be > 0, got {self.shard_mb}"))
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            problems.append(("draft_vocab_size", f"must be >= 1, got {self.draft_vocab_size}"))
        if self.layers is not None and (not self.layers or min(self.layers) < 0):
            problems.append(("layers", f"must be one or more indices >= 0, got {self.layers}"))
        if self.device_map not in (None, *_DEVICE_MAPS):
            problems.append(("device_map", f"must be one of {list(_DEVICE_MAPS)} or unset"))
        problem = device_problem(self.device)
        if problem:
            problems.append(("device", problem))
        elif self.device != "auto" and (self.backend == "vllm" or self.device_map is not None):
            # Either places the target itself: a device asked for would silently not be used.
            how = (
                "vLLM runs on its own platform (CUDA_VISIBLE_DEVICES picks its GPUs)"
                if self.backend == "vllm"
                else "device_map spreads the target over the visible devices"
            )
            problems.append(("device", f"{how}; leave auto"))
        if self.backend == "vllm":
            if self.device_map is not None:
                problems.append(
                    (
                        "device_map",
                        "is for --backend hf; vLLM spreads a target itself "
                        "(--vllm-engine-args '{\"tensor_parallel_size\": N}')",
                    )
                )
            if self.threads is not None:
                problems.append(
                    (
                        "threads",
                        "is for --backend hf; vLLM on CPU binds its own threads "
                        "(VLLM_CPU_OMP_THREADS_BIND)",
                    )
                )
        if self.vllm_engine_args is not None:
            try:
                ok = isinstance(json.loads(self.vllm_engine_args), dict)
            except ValueError:
                ok = False
            if not ok:
                problems.append(("vllm_engine_args", "must be a JSON object, e.g. '{}'"))
        return problems


# What from_pretrained accepts as a named device_map.
_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def main_cache(argv: list[str] | None = None) -> int:
    """CLI entry point for ``draftsmith data cache`` (run under ``accelerate launch`` for ranks).

    Args:
        argv: Arguments without the program/subcommand name; ``None`` means ``sys.argv[1:]``.

    Returns:
        Exit code: 0 on success; 2 on a config, data or cache error (missing or malformed data,
        layers outside the target, a draft vocab larger than the vocab, a directory holding
        another cache); 1 when the target cannot be loaded, another build holds the directory,
        or the disk is full.
    """
    return cli_main(_main_cache, argv)


def _main_cache(argv: list[str]) -> int:
    from ..config import parse_config

    cfg = parse_config(
        CacheConfig,
        argv,
        prog="draftsmith data cache",
        description="Run the frozen target over tokenized data and cache the hidden states "
        "drafters train on (resumable; one slice per accelerate process).",
    )
    summary = run_cache(cfg)
    if summary.get("is_main_process", True):
        rate = summary["tokens_per_s"]
        print(
            f"{summary['out']}: {summary['num_samples']} samples, {summary['num_tokens']} tokens, "
            f"{summary['num_shards']} shards ({len(summary['written'])} written, "
            f"{len(summary['skipped'])} already done by this rank) in {summary['seconds']:.1f}s"
            + (f", {rate:.0f} tokens/s" if rate else "")
        )
    return 0


def run_cache(cfg: CacheConfig) -> dict[str, Any]:
    """Load the target and data a :class:`CacheConfig` names and call :func:`build_cache`.

    With ``backend="vllm"`` the target is a vLLM engine started for the run
    (:func:`_vllm_target`) and shut down when the cache is built or the build fails.
    """
    from ..target_model.load import load_target

    state = process_state()
    for spreads, what in (
        (cfg.device_map is not None, f"device_map={cfg.device_map!r}"),
        (cfg.backend == "vllm", "--backend vllm"),
    ):
        if spreads and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
            raise CacheError(
                f"{what} spreads the target over every visible device, so run one process per "
                "machine (e.g. `accelerate launch --num_processes <machines>` on several "
                "machines, or plain `draftsmith data cache` on one)"
            )
    device = _device(cfg, state)  # a GPU that is not there fails now, in one line
    # The data first: a wrong path fails before the (slow) target load.
    data = load_token_data(cfg.data)
    if cfg.limit is not None:
        data = data.select(range(min(cfg.limit, len(data))))
    if cfg.threads and is_cpu(device):
        torch.set_num_threads(cfg.threads)
    compute = DTYPES[auto_dtype(cfg.target_dtype, device, fast="bf16", slow="fp32")]
    with contextlib.ExitStack() as stack:
        if cfg.backend == "vllm":
            model, tokenizer = stack.enter_context(_vllm_target(cfg, data, state))
        else:
            model, tokenizer = load_target(
                cfg.target,
                cache_dir=cfg.cache_dir,
                dtype=compute,
                device=device,
                device_map=cfg.device_map,
                quiet=not state.is_main_process,
            )
        summary = _build(cfg, model, tokenizer, data, state)
    summary["is_main_process"] = state.is_main_process
    return summary


def _device(cfg: CacheConfig, state: Any) -> torch.device:
    """The device this process runs the target on (``cfg.device`` resolved).

    ``auto`` is the device accelerate gives this process (one process: the first GPU when there
    is one, else the CPU). Under several processes ``cuda`` is each process's own GPU, and
    ``cuda:N`` is refused: it would put every process on one GPU.

    Raises:
        UsageError: a GPU this machine does not have, or ``cuda:N`` with several processes
            (one line naming ``device``).
    """
    if cfg.device == "auto":
        return state.device
    device = resolve_device(cfg.device)
    if device.type == "cuda" and state.num_processes > 1:
        if cfg.device == "cuda" and state.device.type == "cuda":
            return state.device
        raise UsageError(
            f"device: {cfg.device} would put all {state.num_processes} processes on one GPU; "
            "use auto (or cuda): each process then runs on its own GPU"
        )
    return device


def _build(cfg: CacheConfig, model: Any, tokenizer: Any, data: Any, state: Any) -> dict[str, Any]:
    """:func:`build_cache` for a loaded target (an HF model or a ``VllmTarget``)."""
    from ..data.chat import template_fingerprint

    layers = cfg.layers or families.cache_layers(cfg.preset, int(model.config.num_hidden_layers))
    eos = []
    for v in (tokenizer.eos_token_id, model.config.eos_token_id):
        eos += [v] if isinstance(v, int) else list(v or [])
    return build_cache(
        model,
        data,
        cfg.out,
        layers,
        dtype=cfg.dtype,
        batch_tokens=cfg.batch_tokens,
        max_batch_size=cfg.max_batch_size,
        shard_mb=cfg.shard_mb,
        max_length=cfg.max_length,
        template_fingerprint=cfg.template_fingerprint or template_fingerprint(tokenizer),
        target_path=model.config.name_or_path,  # the prepared directory load_target read
        draft_vocab_size=cfg.draft_vocab_size,
        always_include=sorted(set(eos)),
        overwrite=cfg.overwrite,
        progress=cfg.progress,
        state=state,
        backend=model.backend if cfg.backend == "vllm" else None,
        # vLLM's platform is in the backend's record; an HF target's first weight says where
        # it ran (with device_map, where its first layers are).
        device=None if cfg.backend == "vllm" else device_facts(next(model.parameters()).device),
    )


@contextlib.contextmanager
def _vllm_target(cfg: CacheConfig, data: Any, state: Any) -> Iterator[tuple[Any, Any]]:
    """Start vLLM for the run: yield ``(VllmTarget, tokenizer)``; the engine stops on exit.

    The data are scanned first (lengths, token ids within the vocabulary): a bad sample fails
    in seconds, not after the engine's start, and the longest sample sizes vLLM's
    ``max_model_len``.
    """
    from transformers import AutoConfig

    from ..target_model.load import load_tokenizer, prepare_target
    from .vllm_backend import vllm_target

    target_dir = prepare_target(
        cfg.target, cache_dir=cfg.cache_dir, quiet=not state.is_main_process
    )
    tokenizer = load_tokenizer(target_dir)
    config = AutoConfig.from_pretrained(target_dir)
    num_layers = int(config.num_hidden_layers)
    layers = check_layers(cfg.layers or families.cache_layers(cfg.preset, num_layers), num_layers)
    lengths, _ = scan_token_data(data, cfg.max_length, int(config.vocab_size))
    if len(lengths) == 0:
        raise CacheError("the tokenized data holds no samples")
    with vllm_target(
        target_dir,
        layers,
        python=cfg.vllm_python,
        dtype=cfg.target_dtype,
        # A request is the sample plus the one token vLLM samples after it.
        max_model_len=int(lengths.max()) + 1,
        # vLLM requires max_num_batched_tokens >= max_num_seqs.
        max_num_seqs=min(cfg.max_batch_size, cfg.batch_tokens),
        max_num_batched_tokens=cfg.batch_tokens,
        engine_args=json.loads(cfg.vllm_engine_args) if cfg.vllm_engine_args else None,
        progress=cfg.progress and state.is_main_process,
    ) as model:
        yield model, tokenizer
