"""Conversation records in any common chat shape: the one parser, and loading them from files.

Training data (:func:`load_records` -> :class:`Conversation`) and prompt files
(:func:`draftsmith.train.data.prompts.load_prompts`, the prompt view) are parsed by the same
code, with the same rules.

**Record shapes** (auto-detected, or forced with ``shape=``):

==============  ==========================================================================
``messages``    OpenAI style ``{"messages": [{"role": ..., "content": ...}, ...]}``; roles
                ``system``, ``user``, ``assistant``.
``sharegpt``    ``{"conversations": [{"from": ..., "value": ...}, ...]}``; ``from`` is
                ``human``/``user``, ``gpt``/``assistant`` or ``system``.
``alpaca``      ``{"instruction": ..., "input": ..., "output": ...}``; ``input`` and ``output``
                optional. The user turn is the instruction, then a blank line and the input
                when the input is not blank; ``output`` is the answer.
``prompt``      ``{"prompt": ..., "system": ..., "completion": ...}``; ``system`` and
                ``completion`` optional (the prompt files of ``draftsmith evaluate``, and TRL's
                prompt-completion shape).
``text``        ``{"text": ...}``: plain text, every token supervised.
==============  ==========================================================================

**Rules** (one set for every reader):

- A record is a JSON object. Its shape is the first in the table whose field it has with a
  non-null value (a null field counts as absent). :func:`load_records` detects it once per file,
  from the file's first record that has such a field; ``load_prompts`` per record.
- Chat turns: an optional leading system message, then user and assistant alternate, starting
  with user. User and system contents are non-empty strings. An empty assistant turn is kept as
  ``""``: it is a real target output (the model ends its turn at once). An empty Alpaca
  ``output`` or prompt ``completion`` means the record has no answer; a blank ``system`` is none.
- A conversation may end with a user turn (a prompt). It then has nothing to supervise and
  :func:`~draftsmith.train.data.tokenize.build_dataset` drops it (counted).
- Prompt view: a prompt is a conversation that ends with a user turn after dropping one trailing
  assistant turn as the reference answer (by the turn rule, every chat record qualifies);
  ``text`` records hold no prompt.
- Every shape may carry ``id`` (string or integer; default: the record's source; unique within
  a :func:`load_records` call) and ``split`` (string). Without a ``split`` field, integer ids follow
  ``id % 10 == 9`` = held-out, the rest train. Other fields are kept in :attr:`Conversation.raw`
  (self-distillation writes them back).
- An error names the field (e.g. ``messages[2].role``) and where the record is: ``file:line``
  (JSON Lines) or ``file: row n``.

**Files** (read by :mod:`draftsmith.train.data.files`): JSON Lines, JSON arrays, parquet, a
directory of those, or in-memory records (a ``datasets.Dataset`` or a list of dicts).

**Sources** name where a record came from: ``"<file>:<line>"`` (1-based line) for JSON Lines,
``"<file>[<row>]"`` (0-based row) for JSON arrays, parquet files and in-memory records.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .files import DataFileError, input_name, read_sources

__all__ = [
    "HELDOUT_ID_MODULUS",
    "SHAPES",
    "Conversation",
    "LoadSummary",
    "RecordError",
    "conversation_to_record",
    "detect_shape",
    "load_records",
    "parse_record",
    "select_split",
]

HELDOUT_ID_MODULUS = 10
"""For records without a ``split`` field: integer ``id % 10 == 9`` is held-out, the rest train."""

SHAPES: tuple[str, ...] = ("messages", "sharegpt", "alpaca", "prompt", "text")
"""Record shapes, in auto-detection priority order (a record with several shapes' fields gets
the first)."""

# The field that identifies each shape, in detection order.
_SHAPE_KEYS: dict[str, str] = {
    "messages": "messages",
    "sharegpt": "conversations",
    "alpaca": "instruction",
    "prompt": "prompt",
    "text": "text",
}
_MESSAGE_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
_MAX_EXAMPLES = 5  # error messages kept in a summary (the counts cover all of them)


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass
class Conversation:
    """One record, normalised.

    Attributes:
        messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``; empty
            for ``text`` records.
        id: The record's ``id`` as a string, or its :attr:`source` when it has none.
        source: Where it came from: ``"<file>:<line>"`` or ``"<file>[<row>]"``.
        shape: The record shape (one of :data:`SHAPES`).
        text: The text of a ``text`` record, else ``None``.
        split: ``"train"`` / ``"heldout"`` / another ``split`` field value; for records without
            a ``split`` field, integer ids follow ``id % 10 == 9`` = held-out; ``None`` when the
            record has neither.
        raw: The record as read (self-distillation rewrites it in the same shape).
        truncated: The record's ``"truncated": true`` flag (self-distillation sets it when a
            regenerated turn hit ``max_new_tokens``): its assistant turns did not end on their
            own, so their end-of-turn token is not supervised (the template appends one the
            target never produced; teaching it would teach the drafter to stop early).
    """

    messages: list[dict[str, str]]
    id: str
    source: str
    shape: str
    text: str | None = None
    split: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    truncated: bool = False


class RecordError(Exception):
    """One record is malformed; the loader turns it into its file error with the file and line.

    Attributes:
        reason: A short category used for skip counts (e.g. ``"bad turn order"``).
        problem: What is wrong, e.g. ``"must be a string, got null"``.
        field: The offending field (e.g. ``"messages[2].role"``), or ``None``.
    """

    def __init__(self, reason: str, problem: str, field: str | None = None) -> None:
        super().__init__(problem)
        self.reason, self.problem, self.field = reason, problem, field


@dataclass
class LoadSummary:
    """What :func:`load_records` read.

    Attributes:
        files: Each file read and the shape used for it.
        records: Records seen (valid or not; blank lines are not records).
        loaded: Records returned.
        skipped: Malformed records skipped (``skip_invalid=True``), counted per reason.
        filtered: Valid records left out by the ``split`` filter.
        examples: The first few skip messages (file, line/row, field, problem).
    """

    files: dict[str, str] = field(default_factory=dict)
    records: int = 0
    loaded: int = 0
    skipped: Counter = field(default_factory=Counter)
    filtered: int = 0
    examples: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        shapes = Counter(self.files.values())
        kinds = ", ".join(f"{n} {s}" for s, n in sorted(shapes.items()))
        text = (
            f"{self.loaded} of {self.records} records loaded from {len(self.files)} file"
            f"{'s' if len(self.files) != 1 else ''} ({kinds})"
        )
        if self.filtered:
            text += f"; {self.filtered} left out by the split filter"
        if self.skipped:
            reasons = ", ".join(f"{r}: {n}" for r, n in self.skipped.most_common())
            text += f"; {sum(self.skipped.values())} malformed skipped ({reasons})"
        return text


def load_records(
    path: str | Path | Any,
    *,
    shape: str = "auto",
    skip_invalid: bool = False,
    split: str | None = None,
) -> tuple[list[Conversation], LoadSummary]:
    """Read and validate every record of a file, a directory of files, or in-memory records.

    Args:
        path: A ``.jsonl`` / ``.json`` / ``.parquet`` file, a directory (searched recursively
            for those, in sorted order, hidden files skipped), a ``datasets.Dataset`` or a
            list of dicts.
        shape: ``"auto"`` (detected per file from its first record that has a known field) or
            one of :data:`SHAPES`, used for every file.
        skip_invalid: Skip malformed records and count them in the summary instead of raising.
        split: Keep only records of this split (see :func:`select_split`); ``None`` keeps all.

    Returns:
        ``(conversations, summary)``, conversations in file order.

    Raises:
        DataFileError: A file is missing, unreadable or of an unknown type, nothing was found,
            or (unless ``skip_invalid``) a record is malformed; the message names the file, the
            line or row and the field. Also when no record is left.
        ValueError: ``shape`` is not ``"auto"`` or one of :data:`SHAPES`.
    """
    if shape != "auto" and shape not in SHAPES:
        raise ValueError(f"unknown record shape {shape!r}; expected 'auto' or one of {SHAPES}")
    summary = LoadSummary()
    conversations: list[Conversation] = []
    seen_ids: dict[str, str] = {}
    for name, rows in read_sources(path):
        file_shape = shape
        for loc, obj in rows:
            summary.records += 1
            try:
                if isinstance(obj, json.JSONDecodeError):  # a line that is not JSON
                    raise RecordError("invalid JSON", f"invalid JSON: {obj}")
                if file_shape == "auto":
                    file_shape = detect_shape(obj)
                    summary.files[name] = file_shape or "unknown"
                conv = parse_record(obj, file_shape, _source(name, loc))
                if conv.id in seen_ids:
                    raise RecordError(
                        "duplicate id",
                        f"id {conv.id!r} was already used by {seen_ids[conv.id]}",
                        "id",
                    )
            except RecordError as exc:
                err = _located(name, loc, exc)
                if not skip_invalid:
                    raise err from None
                summary.skipped[exc.reason] += 1
                if len(summary.examples) < _MAX_EXAMPLES:
                    summary.examples.append(str(err))
                continue
            seen_ids[conv.id] = conv.source
            conversations.append(conv)
        summary.files.setdefault(name, file_shape if file_shape != "auto" else "unknown")
    if not summary.records:
        raise DataFileError(input_name(path), "no records found (the input is empty)")
    if split is not None:
        kept = select_split(conversations, split)
        summary.filtered = len(conversations) - len(kept)
        conversations = kept
    summary.loaded = len(conversations)
    if not conversations:
        why = f"; first problem: {summary.examples[0]}" if summary.examples else ""
        raise DataFileError(input_name(path), f"no usable records ({summary}){why}")
    return conversations, summary


def select_split(conversations: Sequence[Conversation], split: str) -> list[Conversation]:
    """The conversations of one split.

    A record's ``split`` field decides when present; otherwise an integer ``id`` is held-out
    when ``id % 10 == 9`` and train otherwise (the usual rule of Alpaca-style development files).

    Args:
        conversations: Loaded conversations.
        split: ``"all"`` (everything), ``"train"``, ``"heldout"``, or another split name.

    Returns:
        The matching conversations, in order.

    Raises:
        DataFileError: A conversation has no split information (no ``split`` field and no
            integer id), naming its source.
    """
    if split == "all":
        return list(conversations)
    for conv in conversations:
        if conv.split is None:
            raise DataFileError(
                conv.source,
                f"split={split!r} was requested, but the record has no 'split' field and no "
                f"integer 'id' (integer ids follow id % {HELDOUT_ID_MODULUS} == "
                f"{HELDOUT_ID_MODULUS - 1} = held-out); use split 'all' to keep every record",
                field="split",
                reason="no split",
            )
    return [c for c in conversations if c.split == split]


def conversation_to_record(conv: Conversation, messages: Sequence[Mapping[str, str]]) -> dict:
    """Write ``messages`` back into the conversation's own record shape.

    Fields of the original record that are not part of the conversation (``id``, ``split``,
    ``category``, per-message extras like ``name``) are kept, in their order; the original
    spelling of roles (``human``/``gpt``) is kept too. An ``id`` field is added when the
    record had none (its source), so every written record can be matched to its input.

    Args:
        conv: The conversation whose :attr:`~Conversation.raw` record gives the shape.
        messages: The new conversation; same roles as ``conv.messages``, possibly with one
            more assistant turn at the end.

    Returns:
        A new record (the input is not modified).

    Raises:
        ValueError: The shape cannot hold ``messages`` (e.g. Alpaca with two assistant turns,
            or a ``text`` record).
    """
    out = dict(conv.raw)
    roles = [m["role"] for m in messages]
    if conv.shape in ("messages", "sharegpt"):
        key, role_key, text_key = (
            ("messages", "role", "content")
            if conv.shape == "messages"
            else ("conversations", "from", "value")
        )
        old = list(conv.raw.get(key) or [])
        # The spelling this record uses for the assistant, for turns we append.
        assistant_name = next(
            (
                m.get(role_key)
                for m in old
                if isinstance(m, Mapping)
                and _SHAREGPT_ROLES.get(str(m.get(role_key))) == "assistant"
            ),
            "assistant" if conv.shape == "messages" else "gpt",
        )
        new = []
        for i, msg in enumerate(messages):
            if i < len(old) and isinstance(old[i], Mapping):
                item = dict(old[i])
                item[text_key] = msg["content"]
            else:
                name = assistant_name if msg["role"] == "assistant" else msg["role"]
                if conv.shape == "sharegpt" and msg["role"] == "user":
                    name = "human"
                item = {role_key: name, text_key: msg["content"]}
            new.append(item)
        out[key] = new
    elif conv.shape == "alpaca":
        if roles not in (["user"], ["user", "assistant"]):
            raise ValueError(f"{conv.source}: an Alpaca record holds one user and one answer")
        out["output"] = messages[1]["content"] if len(messages) > 1 else ""
    elif conv.shape == "prompt":
        body = roles[1:] if roles and roles[0] == "system" else roles
        if body not in (["user"], ["user", "assistant"]):
            raise ValueError(f"{conv.source}: a prompt record holds one user turn and one answer")
        if body[-1] == "assistant":
            out["completion"] = messages[-1]["content"]
        else:
            out.pop("completion", None)
    else:
        raise ValueError(f"{conv.source}: a {conv.shape!r} record holds no conversation")
    if "id" not in out or out["id"] is None:
        out["id"] = conv.id
    return out


def _source(name: str, loc: tuple[str, int]) -> str:
    kind, n = loc
    return f"{name}:{n}" if kind == "line" else f"{name}[{n}]"


def _located(name: str, loc: tuple[str, int], exc: RecordError) -> DataFileError:
    kind, n = loc
    where = {"line": n} if kind == "line" else {"row": n}
    return DataFileError(name, exc.problem, field=exc.field, reason=exc.reason, **where)


# --------------------------------------------------------------------------------------------
# Parsing one record
# --------------------------------------------------------------------------------------------


def detect_shape(obj: Any) -> str:
    """A record's shape: the first of :data:`SHAPES` whose field it has (not null), or "auto"."""
    if isinstance(obj, Mapping):
        for shape, key in _SHAPE_KEYS.items():
            if obj.get(key) is not None:
                return shape
    # Nothing recognisable: this record is the error; the next one gets another try.
    return "auto"


def parse_record(obj: Any, shape: str, source: str) -> Conversation:
    """Validate one record of ``shape`` (``"auto"``: none detected) and normalise it.

    The rules are those of the module docstring; ``source`` becomes :attr:`Conversation.source`
    (and the id of a record without one).

    Raises:
        RecordError: The record is malformed; names the field.
    """
    if not isinstance(obj, Mapping):
        raise RecordError("not an object", f"record must be a JSON object, got {_jtype(obj)}")
    if shape == "auto":
        # A shape's field is there but null: name it rather than list the fields.
        for name, key in _SHAPE_KEYS.items():
            if key in obj:
                what = "a list of messages" if name in ("messages", "sharegpt") else "a string"
                raise RecordError("wrong type", f"must be {what}, got null", key)
        fields = ", ".join(repr(k) for k in obj) or "none"
        wanted = ", ".join(repr(k) for k in _SHAPE_KEYS.values())
        raise RecordError(
            "unknown shape", f"record has none of the fields {wanted}; its fields: {fields}"
        )
    key = _SHAPE_KEYS[shape]
    if obj.get(key) is None:
        raise RecordError(
            "missing field",
            f"missing (the file's records are {shape!r} records, which need {key!r})",
            key,
        )
    text = None
    if shape == "messages":
        messages = _parse_chat(obj["messages"], "messages", "role", "content", _MESSAGE_ROLES)
    elif shape == "sharegpt":
        messages = _parse_chat(
            obj["conversations"], "conversations", "from", "value", _SHAREGPT_ROLES
        )
    elif shape == "alpaca":
        user = _text(obj["instruction"], "instruction")
        extra = _opt_text(obj.get("input"), "input")
        if extra and extra.strip():
            user = f"{user}\n\n{extra}"
        messages = [{"role": "user", "content": user}]
        output = _opt_text(obj.get("output"), "output")
        if output:
            messages.append({"role": "assistant", "content": output})
    elif shape == "prompt":
        messages = []
        system = _opt_text(obj.get("system"), "system")
        if system and system.strip():
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": _text(obj["prompt"], "prompt")})
        completion = _opt_text(obj.get("completion"), "completion")
        if completion:
            messages.append({"role": "assistant", "content": completion})
    else:  # text
        text = _text(obj["text"], "text")
        messages = []

    rid = obj.get("id")
    if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
        raise RecordError("wrong type", f"must be a string or an integer, got {_jtype(rid)}", "id")
    split = obj.get("split")
    if split is not None and not isinstance(split, str):
        raise RecordError("wrong type", f"must be a string, got {_jtype(split)}", "split")
    if split is None and isinstance(rid, int) and not isinstance(rid, bool):
        split = "heldout" if rid % HELDOUT_ID_MODULUS == HELDOUT_ID_MODULUS - 1 else "train"
    return Conversation(
        messages=messages,
        id=source if rid is None else str(rid),
        source=source,
        shape=shape,
        text=text,
        split=split,
        raw=dict(obj),
        truncated=obj.get("truncated") is True,
    )


def _parse_chat(
    value: Any, name: str, role_key: str, text_key: str, roles: Mapping[str, str]
) -> list[dict[str, str]]:
    """Validate a list of chat messages and map it to ``{"role", "content"}`` dicts."""
    if not isinstance(value, list):
        raise RecordError("wrong type", f"must be a list of messages, got {_jtype(value)}", name)
    if not value:
        raise RecordError("empty field", "must not be empty", name)
    messages: list[dict[str, str]] = []
    for i, msg in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(msg, Mapping):
            raise RecordError("wrong type", f"must be an object, got {_jtype(msg)}", where)
        for key in (role_key, text_key):
            if msg.get(key) is None:
                raise RecordError(
                    "missing field",
                    f"missing (a message needs {role_key!r} and {text_key!r})",
                    f"{where}.{key}",
                )
        raw_role = msg[role_key]
        if not isinstance(raw_role, str) or raw_role not in roles:
            raise RecordError(
                "unknown role",
                f"unknown role {raw_role!r} (expected one of: {', '.join(roles)})",
                f"{where}.{role_key}",
            )
        role = roles[raw_role]
        if role == "assistant":
            # An empty answer is a real target output (end-of-turn first): keep it.
            content = _opt_text(msg[text_key], f"{where}.{text_key}") or ""
        else:
            content = _text(msg[text_key], f"{where}.{text_key}")
        if role == "system" and i != 0:
            raise RecordError(
                "bad turn order", "a system message may only come first", f"{where}.{role_key}"
            )
        prev = messages[-1]["role"] if messages else None
        expected = "user" if prev in (None, "system", "assistant") else "assistant"
        if role != "system" and role != expected:
            again = f"; two {role} turns in a row" if role == prev else ""
            raise RecordError(
                "bad turn order",
                f"expected a {expected} turn here, got {role}{again} (after an optional system "
                "message, user and assistant turns alternate, starting with user)",
                f"{where}.{role_key}",
            )
        messages.append({"role": role, "content": content})
    if all(m["role"] == "system" for m in messages):
        raise RecordError(
            "bad turn order",
            "has no user turn (a conversation starts with one after the optional system "
            "message; a prompt must end with a user turn)",
            name,
        )
    return messages


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise RecordError("wrong type", f"must be a string, got {_jtype(value)}", field)
    if not value.strip():
        raise RecordError("empty field", "must not be empty", field)
    return value


def _opt_text(value: Any, field: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise RecordError("wrong type", f"must be a string, got {_jtype(value)}", field)
    return value


def _jtype(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    for tp, text in names.items():
        if isinstance(value, tp):
            return text
    return "a number" if isinstance(value, (int, float)) else type(value).__name__
