"""What every export format shares: its errors, the finite-weights check, the size estimate and
the target's name and model-card note.

The format modules (:mod:`~draftsmith.train.export.eagle`, :mod:`~draftsmith.train.export.medusa`,
:mod:`~draftsmith.train.export.hf`, with :mod:`~draftsmith.train.export.eagle_config` and
:mod:`~draftsmith.train.export.eagle_card`) and the command that dispatches to them
(:mod:`~draftsmith.train.export.command`, ``draftsmith export``) import these from here; this
module imports none of them.

Errors: :class:`ExportError` (exit 2: a bad checkpoint, format or flag) and
:class:`NonFiniteError` (exit 1: the weights hold NaN or inf).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import RunError, UsageError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ExportError",
    "ExportRequest",
    "MissingCheckpointError",
    "NonFiniteError",
    "check_finite",
    "check_tensor_shapes",
    "target_card_lines",
    "target_facts",
    "target_head_rows",
    "tensor_bytes",
]


class ExportError(UsageError):
    """The checkpoint cannot be exported as asked: missing, inconsistent, or the wrong kind."""


class MissingCheckpointError(ExportError, FileNotFoundError):
    """The checkpoint, or a file it needs (weights, config, tokenizer), is not there.

    Still a FileNotFoundError, as these errors were before they became usage errors.
    """


class NonFiniteError(RunError):
    """Weights hold NaN or inf; the message names each such tensor."""


@dataclass(frozen=True)
class ExportRequest:
    """One export, as every format's writer takes it (``writer(request) -> Path``).

    The writer of each format is named in the family declaration
    (:class:`~draftsmith.heads.families.ExportFormat`); ``draftsmith export`` builds the request
    from its flags.

    Attributes:
        format: the ``--format`` name.
        checkpoint: what the recipe saved (a drafter, heads or draft directory).
        out: the export directory (written staged, then renamed into place).
        target: the target's name as the export records it (a Hub id, or a local directory).
        speculative_tokens: k, the draft tokens per step the export advertises; None = the
            format's default (EAGLE: 3; DFlash: its block size - 1).
        dtype: cast weights to this dtype; None keeps the checkpoint's.
        metrics_json: an evaluation results JSON for the model card's τ.
        overwrite: replace an existing ``out``.
        tokenizer: where the hf export takes the tokenizer from (default: the checkpoint).
        device: where the hf export's reload check runs.
    """

    format: str
    checkpoint: Path
    out: Path
    target: str
    speculative_tokens: int | None = None
    dtype: torch.dtype | None = None
    metrics_json: Path | None = None
    overwrite: bool = False
    tokenizer: str | None = None
    device: torch.device | None = None


def check_finite(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse tensors holding NaN or inf, naming them (a diverged run must not be served).

    Args:
        tensors: name -> tensor, as they will be written (after any dtype cast: a cast to
            fp16 can overflow finite fp32 weights to inf).
        where: the source, for the message.

    Raises:
        NonFiniteError: naming every non-finite tensor with its NaN and inf counts.
    """
    import torch

    bad = []
    for name, t in tensors.items():
        if not t.is_floating_point() or bool(torch.isfinite(t).all()):
            continue
        nan = int(torch.isnan(t).sum())
        bad.append(f"{name} ({nan} NaN, {t.numel() - nan - int(torch.isfinite(t).sum())} inf)")
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise NonFiniteError(
            f"{where}: non-finite weights in {shown}; the run diverged (or the dtype cast "
            "overflowed) -- export an earlier checkpoint, or retrain with a lower learning rate"
        )


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes the tensors take on disk (payload only), for a free-space estimate."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def target_facts(name: str | None) -> dict[str, str]:
    """:func:`~draftsmith.train.target_model.load.describe_target` of an exporter's target name.

    Exporters call it on the name they are given (idempotent: a name it returned maps to
    itself), so library calls name targets as the CLI does. ``{}`` for None.
    """
    if not name:
        return {}
    from ..target_model.load import describe_target

    return describe_target(name)


def target_card_lines(facts: dict[str, str]) -> list[str]:
    """Model-card paragraph on a target that is not the original model's weights (or none)."""
    if not facts.get("target_note"):
        return []
    original = facts.get("original_model")
    also = (
        f" The original model is `{original}` on the Hugging Face Hub; a server may load it "
        "instead, but every figure here was measured against the dequantized weights."
        if original
        else ""
    )
    return ["", f"**Note on the target:** {facts['target_note']}.{also}"]


def check_tensor_shapes(
    state: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]], where: str
) -> None:
    """Refuse tensors that are not exactly ``shapes`` (names and shapes), naming each problem.

    Exact, not a subset: vLLM rejects unknown names, and for some models (DFlash's
    ``load_weights``) leaves missing ones uninitialised without a word.

    Raises:
        ExportError: ``where``, then the missing, unexpected and wrongly shaped tensors.
    """
    missing = sorted(set(shapes) - set(state))
    unexpected = sorted(set(state) - set(shapes))
    wrong = [
        f"{k}: {tuple(state[k].shape)} != {v}"
        for k, v in shapes.items()
        if k in state and tuple(state[k].shape) != v
    ]
    if missing or unexpected or wrong:
        raise ExportError(
            f"{where}: tensors do not match the config: missing {missing}, unexpected "
            f"{unexpected}, wrong shape {wrong}"
        )


def target_head_rows(name_or_path: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the target's output head, read from its safetensors files alone.

    Only the head tensor is read (``safe_open``), so a large target is never loaded: the
    ``lm_head.weight`` tensor, or with tied embeddings (SmolLM2) ``model.embed_tokens.weight``.
    An export that ships a draft vocabulary's head (DFlash's ``lm_head`` ``[N, H]``) takes its
    rows from here.

    Args:
        name_or_path: a local model directory, or a Hub id already in the Hub cache (nothing is
            downloaded).
        ids: ``[N]`` long, the target ids in draft order.

    Returns:
        ``[N, H]`` in the checkpoint's dtype.

    Raises:
        ExportError: no safetensors weights found, or none of them holds the head.
    """
    import os

    from safetensors import safe_open

    root = Path(os.path.expanduser(name_or_path))
    if not root.is_dir():
        try:
            from huggingface_hub import snapshot_download

            root = Path(
                snapshot_download(
                    name_or_path, local_files_only=True, allow_patterns=["*.safetensors"]
                )
            )
        except Exception as exc:  # not cached, or not a repo id
            raise ExportError(
                f"target {name_or_path!r}: not a local directory nor in the Hub cache, and the "
                f"export needs its lm_head rows ({exc})"
            ) from exc
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ExportError(f"target {root}: no *.safetensors weights to read the lm_head from")
    for key in ("lm_head.weight", "model.embed_tokens.weight"):  # the head, else the tied one
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                if key in f.keys():  # noqa: SIM118 (safe_open has keys(), no __contains__)
                    return f.get_slice(key)[:][ids.cpu().long()].contiguous()
    raise ExportError(
        f"target {root}: neither lm_head.weight nor model.embed_tokens.weight in {len(files)} "
        "safetensors file(s)"
    )
