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
from typing import TYPE_CHECKING

from ..errors import RunError, UsageError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ExportError",
    "MissingCheckpointError",
    "NonFiniteError",
    "check_finite",
    "target_card_lines",
    "target_facts",
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
