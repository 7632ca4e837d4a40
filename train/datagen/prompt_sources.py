"""Prompts from files, for Magpie's output: training prompts to add and held-out ones to avoid.

:func:`load_seed_prompts` reads the prompts written before the Magpie ones (the project's shipped
training prompts, user files; their ``train`` split); :func:`load_exclusions` reads the held-out
prompts that no output prompt may equal or nearly equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..data.files import DataFileError
from ..data.records import Conversation, load_records, select_split
from .self_distill import resolve_split

__all__ = ["SeedPrompt", "load_exclusions", "load_seed_prompts"]


@dataclass(frozen=True)
class SeedPrompt:
    """A prompt from another source, written before the Magpie prompts.

    Attributes:
        id: Output id, unique across sources (``"shipped-3"``, ``"input0-17"``).
        prompt: The user message.
        source: ``"shipped"`` or ``"input:<path>"``.
        system: The record's system prompt, if any.
    """

    id: str
    prompt: str
    source: str
    system: str | None = None


def _first_user(conv: Conversation) -> tuple[str, str | None]:
    if conv.text is not None or not conv.messages:
        raise DataFileError(conv.source, f"a {conv.shape!r} record has no user message")
    system = conv.messages[0]["content"] if conv.messages[0]["role"] == "system" else None
    user = next(m["content"] for m in conv.messages if m["role"] == "user")
    return user, system


def load_seed_prompts(
    path: str | Path,
    *,
    id_prefix: str,
    source: str,
    shape: str = "auto",
    skip_invalid: bool = False,
) -> list[SeedPrompt]:
    """The training prompts of a file: its ``train`` split when the records carry one, else all.

    A multi-turn record contributes its first user message (and its system prompt): the output
    is one-turn prompts. Held-out records (``split: heldout`` or integer ids ``% 10 == 9``) are
    never included.

    Args:
        path: Any file or directory :func:`~draftsmith.train.data.records.load_records` reads.
        id_prefix: Prefix of the output ids (``"shipped"``, ``"input0"``).
        source: The records' ``source`` field.
        shape: Record shape, or ``"auto"``.
        skip_invalid: Skip malformed records instead of failing.

    Raises:
        DataFileError: The file is missing or malformed (file, line and field named), or a
            record has no user message.
    """
    convs, _ = load_records(path, shape=shape, skip_invalid=skip_invalid)
    split, _ = resolve_split(convs, "auto")
    out = []
    for conv in select_split(convs, split):
        user, system = _first_user(conv)
        out.append(SeedPrompt(f"{id_prefix}-{conv.id}", user, source, system))
    return out


def load_exclusions(path: str | Path) -> list[str]:
    """The held-out prompts of a file: split ``heldout`` when the records carry one, else all.

    Every user message of a record counts (a multi-turn evaluation record leaks through any).

    Raises:
        DataFileError: The file is missing or malformed.
    """
    convs, _ = load_records(path)
    if all(c.split is not None for c in convs):
        convs = select_split(convs, "heldout")
    texts = []
    for conv in convs:
        if conv.text is not None:
            texts.append(conv.text)
        texts += [m["content"] for m in conv.messages if m["role"] == "user"]
    return texts
