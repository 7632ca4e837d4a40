"""Load chat prompt files for evaluation and self-distillation.

A prompt file is JSON Lines: one JSON object per line, blank lines skipped. Its records are read
by the parser of :mod:`draftsmith.train.data.records`, with its shapes and rules; the shape is
detected per record. This module takes the prompt view of each: the conversation up to its last
user turn, a trailing assistant turn (Alpaca ``output``, prompt ``completion``) being the
reference answer. ``text`` records hold no prompt. The project's own prompt set,
:data:`DEFAULT_PROMPTS`, is described in ``prompt_sets/README.md`` next to this module.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chat import TemplateError, chat_token_ids
from .files import DataFileError
from .records import (
    HELDOUT_ID_MODULUS,
    Conversation,
    RecordError,
    detect_shape,
    parse_record,
)

__all__ = [
    "DEFAULT_PROMPTS",
    "PromptFileError",
    "PromptRecord",
    "load_prompts",
    "render_prompt",
]

DEFAULT_PROMPTS: Path = Path(__file__).resolve().parent / "prompt_sets" / "chat_prompts.jsonl"
"""The project's own 64-prompt set (32 ``train``, 32 ``heldout``), shipped as package data."""


@dataclass
class PromptRecord:
    """One prompt to be answered by the model.

    Attributes:
        messages: Chat messages (``{"role": ..., "content": ...}``), optionally starting with a
            system message and always ending with the user turn the model must answer.
        id: The record's ``id`` field as a string, or ``"<file name>:<line>"`` when it has none.
        source: Where the record came from, ``"<file name>:<line>"`` (1-based line).
        reference: A reference answer when the record carried one (Alpaca ``output``, prompt
            ``completion`` or a trailing assistant turn, which is then not part of
            ``messages``), else ``None``.
        category: The record's ``category`` field (``coding``, ``math``, ...; the shipped
            prompt sets carry one), else ``None``: evaluations report per category.
    """

    messages: list[dict[str, str]]
    id: str
    source: str
    reference: str | None = None
    category: str | None = None


class PromptFileError(DataFileError):
    """A prompt file is missing, empty or malformed (exit code 2).

    The message reads ``"<path>:<line>: field '<field>': <problem>"`` (line and field are left
    out when they do not apply), as for any :class:`~draftsmith.train.data.files.DataFileError`.

    Attributes:
        path: The prompt file.
        line: The 1-based line number of the offending record, or ``None``.
        field: The offending field (e.g. ``"messages[2].role"``), or ``None``.
    """

    def __init__(
        self, path: str | Path, problem: str, *, line: int | None = None, field: str | None = None
    ) -> None:
        super().__init__(path, problem, line=line, field=field)
        self.path = Path(path)  # a Path here, where DataFileError keeps a string


def load_prompts(
    path: str | Path | None = None,
    *,
    split: str | None = None,
    limit: int | None = None,
    id_filter: Callable[[str], bool] | None = None,
) -> list[PromptRecord]:
    """Load the prompts of a JSON Lines prompt file.

    Every record of the file is validated, whatever the filters; then the records are filtered
    by ``split``, then by ``id_filter``, and the first ``limit`` are kept, in file order.

    Split rule: a record's ``split`` field, when present, must equal ``split``. A record without
    a ``split`` field but with an integer ``id`` is held-out when ``id % 10 == 9`` and train
    otherwise, so ``split="heldout"`` / ``split="train"`` work on an Alpaca-style file with
    integer ids (2,000 records: 200 held-out, 1,800 train). Any other record is an error when a
    split is requested.

    Args:
        path: The prompt file; ``None`` for the project's own set, :data:`DEFAULT_PROMPTS`.
        split: Keep only the records of this split (e.g. ``"train"`` or ``"heldout"``).
        limit: Keep at most this many records (after filtering); ``None`` keeps all.
        id_filter: Keep only records whose ``PromptRecord.id`` makes this return true.

    Returns:
        The records, in file order.

    Raises:
        PromptFileError: The file does not exist, cannot be read, holds no records (before or
            after filtering), or a record is not valid JSON, not an object, of no known shape, or
            has a field of the wrong type or value; the message names the file, the 1-based line
            and the field.
        ValueError: ``limit`` is less than 1.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    path = DEFAULT_PROMPTS if path is None else Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "file not found"
        raise PromptFileError(path, f"prompt {what}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(path, f"cannot read prompt file: {exc}") from exc

    records: list[PromptRecord] = []
    total = 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        total += 1
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(path, f"invalid JSON: {exc}", line=lineno) from exc
        source = f"{path.name}:{lineno}"
        try:
            conv = parse_record(obj, detect_shape(obj), source)
            record = _prompt_record(conv)
            keep = split is None or _in_split(conv, split)
        except RecordError as exc:
            raise PromptFileError(path, exc.problem, line=lineno, field=exc.field) from None
        if keep and (id_filter is None or id_filter(record.id)):
            records.append(record)

    if not total:
        raise PromptFileError(path, f"no prompts in {path} (the file is empty)")
    if not records:
        filters = []
        if split is not None:
            filters.append(f"split={split!r}")
        if id_filter is not None:
            filters.append("id_filter")
        raise PromptFileError(
            path, f"no prompts in {path} (after {', '.join(filters)}; {total} records in all)"
        )
    return records[:limit] if limit is not None else records


def render_prompt(tokenizer: Any, record: PromptRecord) -> list[int]:
    """Token ids of a record's messages followed by the assistant generation prompt.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template.
        record: The prompt to render.

    Returns:
        A flat list of token ids, ready to be fed to the model for generation.

    Raises:
        ValueError: The tokenizer has no chat template, or the template rejected the messages;
            the message names the record's source.
    """
    try:
        return chat_token_ids(tokenizer, record.messages, add_generation_prompt=True)
    except TemplateError as exc:
        raise ValueError(f"{record.source}: cannot render prompt {record.id!r}: {exc}") from exc


def _prompt_record(conv: Conversation) -> PromptRecord:
    """The prompt view of a parsed record (see :mod:`draftsmith.train.data.records`)."""
    if conv.text is not None:
        raise RecordError(
            "no prompt",
            "a plain-text record holds no chat prompt (use 'messages', 'conversations', "
            "'instruction' or 'prompt')",
            "text",
        )
    messages = list(conv.messages)
    # By the turn rule a chat ends with a user turn once one trailing answer is dropped.
    reference = messages.pop()["content"] if messages[-1]["role"] == "assistant" else None
    # The record's ``category`` (the shipped sets carry one) groups results per kind of prompt.
    category = conv.raw.get("category")
    return PromptRecord(
        messages=messages,
        id=conv.id,
        source=conv.source,
        reference=reference,
        category=str(category) if category is not None else None,
    )


def _in_split(conv: Conversation, split: str) -> bool:
    """Whether a parsed record belongs to ``split``; see :func:`load_prompts`."""
    if conv.raw.get("split") is not None:
        return conv.split == split
    if conv.split is not None:  # from the integer-id rule
        if split not in ("train", "heldout"):
            raise RecordError(
                "no split",
                f"record has no 'split' field, and the id rule (id % {HELDOUT_ID_MODULUS} == "
                f"{HELDOUT_ID_MODULUS - 1} is held-out) defines only 'train' and 'heldout', "
                f"not {split!r}",
                "split",
            )
        return conv.split == split
    raise RecordError(
        "no split",
        f"split={split!r} was requested, but the record has no 'split' field and no integer "
        f"'id' (records with an integer id follow id % {HELDOUT_ID_MODULUS} == "
        f"{HELDOUT_ID_MODULUS - 1} = held-out)",
        "split",
    )
