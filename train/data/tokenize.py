"""Chat data: load records in any common shape, tokenize with the target's chat template, mask.

The one path data takes (see ``shared/DESIGN.md``)::

    files / records  --load_records-->  [Conversation]  --build_dataset-->  datasets.Dataset
                                                                            (input_ids, loss_mask, id)

**Record shapes** (auto-detected per file from its first record, or forced with ``shape=``):

==============  ==========================================================================
``messages``    OpenAI style ``{"messages": [{"role": ..., "content": ...}, ...]}``; roles
                ``system`` (first message only), ``user``, ``assistant``.
``sharegpt``    ``{"conversations": [{"from": ..., "value": ...}, ...]}``; ``from`` is
                ``human``/``user``, ``gpt``/``assistant`` or ``system``.
``alpaca``      ``{"instruction": ..., "input": ..., "output": ...}``; ``input`` and ``output``
                optional. The user turn is the instruction, then a blank line and the input
                when the input is not blank (the same rule as :mod:`draftsmith.train.data.prompts`).
``prompt``      ``{"prompt": ..., "system": ..., "completion": ...}``; ``system`` and
                ``completion`` optional (the prompt files of ``draftsmith evaluate``, and TRL's
                prompt-completion shape).
``text``        ``{"text": ...}``: plain text, every token supervised.
==============  ==========================================================================

Every shape may carry ``id`` (string or integer; default: the record's source) and ``split``;
other fields are kept in :attr:`Conversation.raw` (self-distillation writes them back). Chat
turns must be: an optional system message, then user and assistant alternating, starting with
user. A conversation may end with a user turn (a prompt, as self-distillation reads them); it
then has nothing to supervise and :func:`build_dataset` drops it (counted).

**Files**: JSON Lines (``.jsonl``; also ``.json`` files holding one object per line), JSON
arrays (``.json``), parquet (``.parquet``), or a directory searched recursively for those.
JSON Lines are parsed line by line here rather than by ``datasets``' JSON reader, because that
reader fails a whole file on one bad line and cannot name it; parquet is read with ``pyarrow``
(the engine under ``datasets``), which writes no builder cache. An in-memory
``datasets.Dataset`` or a list of dicts is accepted wherever a path is.

**Sources** name where a record came from: ``"<file>:<line>"`` (1-based line) for JSON Lines,
``"<file>[<row>]"`` (0-based row) for JSON arrays, parquet files and in-memory records.

**Loss mask convention**: ``loss_mask[t] == 1`` means token ``t`` is a training target (the
model is trained to predict it from the tokens before it). For chat records exactly the tokens
the assistant produced are targets: each assistant turn's content and its end-of-turn token
(e.g. ``<|im_end|>``); never the turn header (``<|im_start|>assistant\\n``), never system or
user turns, never template glue after the end-of-turn token. How the span is derived from the
template is described in :func:`tokenize_conversation`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.train.config import cfg_field
from draftsmith.train.data.prompts import HELDOUT_ID_MODULUS, token_ids
from draftsmith.train.errors import UsageError

__all__ = [
    "SHAPES",
    "Conversation",
    "DataFileError",
    "DataSummary",
    "LoadSummary",
    "TemplateError",
    "build_dataset",
    "chat_token_ids",
    "conversation_to_record",
    "load_records",
    "select_split",
    "template_fingerprint",
    "tokenize_conversation",
    "tokenize_text",
]

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
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
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


class DataFileError(UsageError):
    """A data file (or one of its records) is missing, unreadable or malformed (exit code 2).

    The message reads ``"<path>:<line>: field '<field>': <problem>"`` for JSON Lines, and
    ``"<path>: row <row>: field '<field>': <problem>"`` for row-based files (0-based rows);
    parts that do not apply are left out.

    Attributes:
        path: The file (or ``"<records>"`` for in-memory records).
        line: 1-based line of the record (JSON Lines), or ``None``.
        row: 0-based row of the record (JSON arrays, parquet, in-memory), or ``None``.
        field: The offending field (e.g. ``"messages[2].role"``), or ``None``.
        reason: A short category used for skip counts (e.g. ``"invalid JSON"``).
    """

    def __init__(
        self,
        path: str | Path,
        problem: str,
        *,
        line: int | None = None,
        row: int | None = None,
        field: str | None = None,
        reason: str = "invalid file",
    ) -> None:
        self.path = str(path)
        self.line, self.row, self.field, self.reason = line, row, field, reason
        self.problem = problem
        if line is not None:
            where = f"{path}:{line}"
        elif row is not None:
            where = f"{path}: row {row}"
        else:
            where = str(path)
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{problem}")


class _RecordError(Exception):
    """One record is malformed; becomes a DataFileError once the file and line are known."""

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
    for name, rows in _sources(path):
        file_shape = shape
        for loc, obj in rows:
            summary.records += 1
            try:
                if isinstance(obj, _RecordError):
                    raise obj
                if file_shape == "auto":
                    file_shape = _detect_shape(obj)
                    summary.files[name] = file_shape or "unknown"
                conv = _parse_record(obj, file_shape, _source(name, loc))
                if conv.id in seen_ids:
                    raise _RecordError(
                        "duplicate id",
                        f"id {conv.id!r} was already used by {seen_ids[conv.id]}",
                        "id",
                    )
            except _RecordError as exc:
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
        raise DataFileError(_display(path), "no records found (the input is empty)")
    if split is not None:
        kept = select_split(conversations, split)
        summary.filtered = len(conversations) - len(kept)
        conversations = kept
    summary.loaded = len(conversations)
    if not conversations:
        why = f"; first problem: {summary.examples[0]}" if summary.examples else ""
        raise DataFileError(_display(path), f"no usable records ({summary}){why}")
    return conversations, summary


def select_split(conversations: Sequence[Conversation], split: str) -> list[Conversation]:
    """The conversations of one split.

    A record's ``split`` field decides when present; otherwise an integer ``id`` is held-out
    when ``id % 10 == 9`` and train otherwise (the rule of ``shared/data/README.md``).

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


# --------------------------------------------------------------------------------------------
# Reading files
# --------------------------------------------------------------------------------------------


def _display(path: Any) -> str:
    return str(path) if isinstance(path, (str, Path)) else "<records>"


def _source(name: str, loc: tuple[str, int]) -> str:
    kind, n = loc
    return f"{name}:{n}" if kind == "line" else f"{name}[{n}]"


def _located(name: str, loc: tuple[str, int], exc: _RecordError) -> DataFileError:
    kind, n = loc
    where = {"line": n} if kind == "line" else {"row": n}
    return DataFileError(name, exc.problem, field=exc.field, reason=exc.reason, **where)


# ((kind, number), record): kind is "line" (1-based) or "row" (0-based); the record may be a
# _RecordError standing for a line that is not JSON.
Row = tuple[tuple[str, int], Any]


def _sources(path: Any) -> Iterator[tuple[str, Iterable[Row]]]:
    """Yield ``(display name, rows)`` per file (or one entry for in-memory records)."""
    if not isinstance(path, (str, Path)):
        if hasattr(path, "to_list") and hasattr(path, "column_names"):  # datasets.Dataset
            yield "<records>", ((("row", i), r) for i, r in enumerate(path))
            return
        if isinstance(path, Sequence):
            yield "<records>", ((("row", i), r) for i, r in enumerate(path))
            return
        raise TypeError(
            f"expected a path, a datasets.Dataset or a list of dicts, got {type(path).__name__}"
        )
    path = Path(path)
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix in _FILE_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise DataFileError(
                path, f"directory holds no data files ({', '.join(_FILE_SUFFIXES)})"
            )
        for f in files:
            yield str(f), _read_file(f)
        return
    if not path.exists():
        raise DataFileError(path, "file not found")
    yield str(path), _read_file(path)


def _read_file(path: Path) -> Iterator[Row]:
    if path.suffix == ".parquet":
        return _read_parquet(path)
    if path.suffix in (".jsonl", ".json"):
        return _read_json(path)
    raise DataFileError(
        path, f"unknown file type {path.suffix!r} (expected {', '.join(_FILE_SUFFIXES)})"
    )


def _read_json(path: Path) -> Iterator[Row]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataFileError(path, f"cannot read: {exc}") from exc
    if text.lstrip().startswith("["):  # a JSON array of records
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataFileError(path, f"invalid JSON: {exc}", reason="invalid JSON") from exc
        for i, obj in enumerate(data):
            yield ("row", i), obj
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            obj = _RecordError("invalid JSON", f"invalid JSON: {exc}")
        yield ("line", lineno), obj


def _read_parquet(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        pfile = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataFileError(path, f"cannot read parquet: {exc}") from exc
    row = 0
    # Batches keep memory flat for large files.
    for batch in pfile.iter_batches(batch_size=1024):
        for obj in batch.to_pylist():
            yield ("row", row), obj
            row += 1


# --------------------------------------------------------------------------------------------
# Parsing one record
# --------------------------------------------------------------------------------------------


def _detect_shape(obj: Any) -> str:
    if isinstance(obj, Mapping):
        for shape, key in _SHAPE_KEYS.items():
            if obj.get(key) is not None:
                return shape
    # Nothing recognisable: this record is the error; the next one gets another try.
    return "auto"


def _parse_record(obj: Any, shape: str, source: str) -> Conversation:
    if not isinstance(obj, Mapping):
        raise _RecordError("not an object", f"record must be a JSON object, got {_jtype(obj)}")
    if shape == "auto":
        fields = ", ".join(repr(k) for k in obj) or "none"
        wanted = ", ".join(repr(k) for k in _SHAPE_KEYS.values())
        raise _RecordError(
            "unknown shape", f"record has none of the fields {wanted}; its fields: {fields}"
        )
    key = _SHAPE_KEYS[shape]
    if obj.get(key) is None:
        raise _RecordError(
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
        raise _RecordError("wrong type", f"must be a string or an integer, got {_jtype(rid)}", "id")
    split = obj.get("split")
    if split is not None and not isinstance(split, str):
        raise _RecordError("wrong type", f"must be a string, got {_jtype(split)}", "split")
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
    if not isinstance(value, list):
        raise _RecordError("wrong type", f"must be a list of messages, got {_jtype(value)}", name)
    if not value:
        raise _RecordError("empty field", "must not be empty", name)
    messages: list[dict[str, str]] = []
    for i, msg in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(msg, Mapping):
            raise _RecordError("wrong type", f"must be an object, got {_jtype(msg)}", where)
        for key in (role_key, text_key):
            if msg.get(key) is None:
                raise _RecordError(
                    "missing field",
                    f"missing (a message needs {role_key!r} and {text_key!r})",
                    f"{where}.{key}",
                )
        raw_role = msg[role_key]
        if not isinstance(raw_role, str) or raw_role not in roles:
            raise _RecordError(
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
            raise _RecordError(
                "bad turn order", "a system message may only come first", f"{where}.{role_key}"
            )
        prev = messages[-1]["role"] if messages else None
        expected = "user" if prev in (None, "system", "assistant") else "assistant"
        if role != "system" and role != expected:
            raise _RecordError(
                "bad turn order",
                f"expected a {expected} turn here, got {role} (after an optional system "
                "message, user and assistant turns alternate, starting with user)",
                f"{where}.{role_key}",
            )
        messages.append({"role": role, "content": content})
    if all(m["role"] == "system" for m in messages):
        raise _RecordError("bad turn order", "has no user turn", name)
    return messages


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise _RecordError("wrong type", f"must be a string, got {_jtype(value)}", field)
    if not value.strip():
        raise _RecordError("empty field", "must not be empty", field)
    return value


def _opt_text(value: Any, field: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _RecordError("wrong type", f"must be a string, got {_jtype(value)}", field)
    return value


def _jtype(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    for tp, text in names.items():
        if isinstance(value, tp):
            return text
    return "a number" if isinstance(value, (int, float)) else type(value).__name__


# --------------------------------------------------------------------------------------------
# Tokenization and the assistant-only loss mask
# --------------------------------------------------------------------------------------------


class TemplateError(UsageError):
    """The chat template cannot yield an assistant mask (or failed on a conversation): exit 2."""


def chat_token_ids(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]``.
        add_generation_prompt: Append the assistant turn header (for generation).

    Returns:
        A flat list of ids (transformers 5's BatchEncoding and 4.x's list both handled).

    Raises:
        TemplateError: No chat template, or the template raised.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(
            "the tokenizer has no chat template (use the chat/instruct variant of the model, "
            "or set tokenizer.chat_template)"
        )
    try:
        out = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=True
        )
    except Exception as exc:  # jinja errors, raise_exception() in templates, ...
        raise TemplateError(f"the chat template failed: {exc}") from exc
    return token_ids(out)


def _chat_text(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool
) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:
        raise TemplateError(f"the chat template failed: {exc}") from exc


_GEN_PROMPT_CACHE: dict[str, bool] = {}


def _has_generation_prompt(tokenizer: Any) -> bool:
    """Whether ``add_generation_prompt=True`` adds anything (cached per template)."""
    key = str(tokenizer.chat_template)
    if key not in _GEN_PROMPT_CACHE:
        probe = [{"role": "user", "content": "x"}]
        with_prompt = _chat_text(tokenizer, probe, add_generation_prompt=True)
        without = _chat_text(tokenizer, probe, add_generation_prompt=False)
        _GEN_PROMPT_CACHE[key] = with_prompt != without
    return _GEN_PROMPT_CACHE[key]


def _eos_ids(tokenizer: Any, extra: Iterable[int] | None) -> set[int]:
    ids = {int(i) for i in (extra or ())}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _is_prefix(prefix: Sequence[int], full: Sequence[int]) -> bool:
    return len(prefix) <= len(full) and list(full[: len(prefix)]) == list(prefix)


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    *,
    max_length: int | None,
    eos_token_ids: Iterable[int] | None = None,
    open_ended: bool = False,
) -> dict[str, list[int]] | None:
    """Tokenize a conversation with its chat template and mask all but the assistant's tokens.

    How the mask is derived from the template itself (no header strings are hard-coded): for
    each assistant message ``i``, the conversation up to message ``i - 1`` is rendered with
    ``add_generation_prompt=True`` (ending in the assistant header) and up to message ``i``
    without it; the tokens between the two lengths are what the assistant turn added after its
    header. Both renderings must be token prefixes of the full conversation's rendering. The
    span is then cut after its last end-of-turn token (the tokenizer's EOS, plus
    ``eos_token_ids``), because what follows it -- e.g. ChatML's ``"\\n"`` -- is template glue
    that generation never produces. Without an EOS in the span the whole span is supervised.

    Fallbacks: when a prefix rendering is not a token prefix (a BPE merge across the header /
    content boundary), the span is taken in characters from the rendered texts and mapped to
    tokens with ``return_offsets_mapping`` (a token straddling the boundary belongs to the
    header). When the template ignores ``add_generation_prompt``, the content is located in
    the text of the turn.

    Args:
        tokenizer: A Hugging Face (fast) tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]`` (a :attr:`Conversation.messages`).
        max_length: Keep at most this many tokens (the first ones); ``None`` keeps all.
        eos_token_ids: Extra end-of-turn token ids (e.g. the model's generation config EOS).
        open_ended: The assistant turns were cut off (a truncated self-distilled record): their
            end-of-turn token, which the template adds but the model never generated, is left
            unsupervised along with the glue after it.

    Returns:
        ``{"input_ids": [T] ints, "loss_mask": [T] 0/1 ints}``, or ``None`` when no supervised
        token is left (no assistant turn, or truncated away).

    Raises:
        TemplateError: The template failed, or renders a conversation prefix differently from
            the same messages inside the full conversation (the message says which).
    """
    result = _tokenize_chat(
        tokenizer, messages, max_length, _eos_ids(tokenizer, eos_token_ids), open_ended
    )
    return result[0]


def tokenize_text(
    tokenizer: Any, text: str, *, max_length: int | None
) -> dict[str, list[int]] | None:
    """Tokenize plain text; every token is supervised.

    The tokenizer's own special tokens are added (e.g. a BOS for tokenizers that add one); no
    EOS is appended.

    Args:
        tokenizer: A Hugging Face tokenizer.
        text: The text.
        max_length: Keep at most this many tokens; ``None`` keeps all.

    Returns:
        ``{"input_ids": [T], "loss_mask": [T] all 1}``, or ``None`` for no tokens.
    """
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if max_length is not None:
        ids = ids[:max_length]
    return {"input_ids": ids, "loss_mask": [1] * len(ids)} if ids else None


def _tokenize_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    max_length: int | None,
    eos: set[int],
    open_ended: bool = False,
) -> tuple[dict[str, list[int]] | None, str | None, int]:
    """``(sample or None, drop reason or None, untruncated length)``."""
    full = chat_token_ids(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(full)
    gen_prompt = _has_generation_prompt(tokenizer)
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        span = None
        if gen_prompt:
            head = chat_token_ids(tokenizer, messages[:i], add_generation_prompt=True)
            upto = (
                full
                if i == last
                else chat_token_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
            )
            if _is_prefix(head, full) and _is_prefix(upto, full) and len(head) <= len(upto):
                span = (len(head), len(upto))
        if span is None:
            span = _char_span(tokenizer, messages, i, gen_prompt, len(full))
        start, end = span
        # Cut after the last end-of-turn token: the rest is glue the model never generates.
        # An open-ended (truncated) turn never produced its end-of-turn token: cut before it.
        for j in range(end - 1, start - 1, -1):
            if full[j] in eos:
                end = j if open_ended else j + 1
                break
        for j in range(start, end):
            mask[j] = 1
    length = len(full)
    if not any(mask):
        return None, "no assistant turn", length
    if max_length is not None and length > max_length:
        full, mask = full[:max_length], mask[:max_length]
        if not any(mask):
            return None, "no supervised token after truncation", length
    return {"input_ids": full, "loss_mask": mask}, None, length


def _char_span(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], i: int, gen_prompt: bool, n_full: int
) -> tuple[int, int]:
    """Assistant turn ``i``'s token span, from character offsets of the rendered text."""
    full_text = _chat_text(tokenizer, messages, add_generation_prompt=False)
    head_text = _chat_text(tokenizer, messages[:i], add_generation_prompt=gen_prompt)
    upto_text = _chat_text(tokenizer, messages[: i + 1], add_generation_prompt=False)
    for name, part in (("up to the turn before", head_text), ("up to and with", upto_text)):
        if not full_text.startswith(part):
            k = next(
                (j for j, (a, b) in enumerate(zip(part, full_text, strict=False)) if a != b),
                min(len(part), len(full_text)),
            )
            raise TemplateError(
                f"cannot derive the assistant mask: the chat template renders the conversation "
                f"{name} assistant message {i} differently from the same messages inside the "
                f"full conversation (first difference at character {k}: "
                f"{part[max(0, k - 20) : k + 20]!r} vs {full_text[max(0, k - 20) : k + 20]!r}). "
                "The template is not prefix-stable (it rewrites earlier turns depending on what "
                "follows), so masks derived from it would be wrong."
            )
    start_char, end_char = len(head_text), len(upto_text)
    if not gen_prompt:
        # The turn's text includes its header; the content starts where the content is found.
        content = str(messages[i]["content"]).strip()
        k = full_text.find(content, start_char, end_char) if content else -1
        if k < 0:
            raise TemplateError(
                "cannot derive the assistant mask: the chat template ignores "
                "add_generation_prompt (so the assistant header cannot be told from the "
                f"answer) and assistant message {i}'s content was not found in its rendering"
            )
        start_char = k
    try:
        enc = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as exc:  # slow tokenizers have no offsets
        raise TemplateError(
            "cannot derive the assistant mask: a conversation prefix is not a token prefix of "
            "the full conversation and the tokenizer gives no offsets (use a fast tokenizer)"
        ) from exc
    offsets = enc["offset_mapping"]
    if len(offsets) != n_full:
        raise TemplateError(
            "cannot derive the assistant mask: tokenizing the rendered text gives "
            f"{len(offsets)} tokens, apply_chat_template gives {n_full}"
        )
    # A token belongs to the turn when it starts inside the turn's characters; a token that
    # straddles the start (header merged with the first content characters) stays unsupervised.
    inside = [j for j, (s, _) in enumerate(offsets) if start_char <= s < end_char]
    if not inside:
        return (0, 0)
    return inside[0], inside[-1] + 1


def template_fingerprint(tokenizer: Any) -> str:
    """A hash identifying everything about a tokenizer that decides tokenized training data.

    sha256 over the chat template, the vocabulary size (``len(tokenizer)``, added tokens
    included) and the special tokens with their ids. Stored by the hidden-state cache and
    self-distillation so data made with another template or vocabulary is refused.

    Args:
        tokenizer: A Hugging Face tokenizer.

    Returns:
        64 hex characters.
    """
    specials = {}
    for tok in sorted(set(getattr(tokenizer, "all_special_tokens", []) or [])):
        specials[tok] = tokenizer.convert_tokens_to_ids(tok)
    payload = {
        "chat_template": getattr(tokenizer, "chat_template", None),
        "vocab_size": len(tokenizer),
        "special_tokens": specials,
        "eos_token_id": getattr(tokenizer, "eos_token_id", None),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------


@dataclass
class DataSummary:
    """What :func:`build_dataset` made.

    Attributes:
        load: The :class:`LoadSummary` (``None`` when conversations were passed in).
        samples: Samples in the dataset.
        tokens: Tokens in the dataset (after truncation).
        supervised_tokens: Tokens with ``loss_mask == 1``.
        truncated: Samples cut to ``max_length``.
        dropped: Samples dropped, per reason (``"no assistant turn"``,
            ``"no supervised token after truncation"``).
    """

    load: LoadSummary | None = None
    samples: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)

    def __str__(self) -> str:
        text = (
            f"{self.samples} samples, {self.tokens} tokens ({self.supervised_tokens} supervised), "
            f"{self.truncated} truncated"
        )
        if self.dropped:
            text += "; dropped: " + ", ".join(f"{r}: {n}" for r, n in self.dropped.most_common())
        return f"{self.load}\n{text}" if self.load is not None else text


def _tokenize_row(
    row: dict[str, Any], tokenizer: Any, max_length: int | None, eos: list[int]
) -> dict[str, Any]:
    """datasets.map function: one conversation -> tokens, mask and bookkeeping columns."""
    if row["text"] is not None:
        sample = tokenize_text(tokenizer, row["text"], max_length=None)
        length = len(sample["input_ids"]) if sample else 0
        if sample and max_length is not None:
            sample = {k: v[:max_length] for k, v in sample.items()}
        reason = None if sample else "empty text"
    else:
        sample, reason, length = _tokenize_chat(
            tokenizer, row["messages"], max_length, set(eos), bool(row.get("truncated"))
        )
    if sample is None:
        return {"input_ids": [], "loss_mask": [], "_drop": reason, "_length": length}
    return {**sample, "_drop": "", "_length": length}


def build_dataset(
    path_or_records: str | Path | Sequence[Conversation] | Any,
    tokenizer: Any,
    *,
    max_length: int | None = 2048,
    shape: str = "auto",
    skip_invalid: bool = False,
    split: str | None = None,
    eos_token_ids: Iterable[int] | None = None,
    num_proc: int = 1,
) -> tuple[Any, DataSummary]:
    """Load, tokenize and mask a data set for drafter training.

    Args:
        path_or_records: A file / directory / ``datasets.Dataset`` / list of dicts (read with
            :func:`load_records`), or a list of :class:`Conversation` (used as they are).
        tokenizer: The target's tokenizer (its chat template defines the tokens and masks).
        max_length: Truncate samples to this many tokens (``None``: no limit).
        shape: Record shape, see :func:`load_records`.
        skip_invalid: Skip and count malformed records instead of raising.
        split: Keep only this split (``"train"`` for training on the Alpaca file).
        eos_token_ids: Extra end-of-turn ids, see :func:`tokenize_conversation`.
        num_proc: Worker processes for tokenization (``datasets.map``).

    Returns:
        ``(dataset, summary)``: a ``datasets.Dataset`` with columns ``input_ids``
        (list of int), ``loss_mask`` (list of 0/1 int, same length) and ``id`` (str), in input
        order, samples without a supervised token dropped (counted in the summary).

    Raises:
        DataFileError: See :func:`load_records`; also when no sample is left (e.g. every record
            is a prompt without an answer), naming the reasons and what to run.
        TemplateError: See :func:`tokenize_conversation`; the message names the record.
    """
    import datasets

    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
    if (
        isinstance(path_or_records, Sequence)
        and not isinstance(path_or_records, (str, Path))
        and all(isinstance(c, Conversation) for c in path_or_records)
    ):
        conversations, load = list(path_or_records), None
        if split is not None:
            conversations = select_split(conversations, split)
    else:
        conversations, load = load_records(
            path_or_records, shape=shape, skip_invalid=skip_invalid, split=split
        )
    eos = sorted(_eos_ids(tokenizer, eos_token_ids))
    rows = {
        "id": [c.id for c in conversations],
        "messages": [c.messages if c.text is None else None for c in conversations],
        "text": [c.text for c in conversations],
        "truncated": [c.truncated for c in conversations],
    }
    # Tokenize once in this process first when num_proc == 1: no arrow round trip, and a
    # template error names its record.
    summary = DataSummary(load=load)
    fn_kwargs = {"tokenizer": tokenizer, "max_length": max_length, "eos": eos}
    if num_proc <= 1:
        out_cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "id": []}
        for conv, rid, messages, text in zip(
            conversations, rows["id"], rows["messages"], rows["text"], strict=True
        ):
            row = {"messages": messages, "text": text, "truncated": conv.truncated}
            try:
                res = _tokenize_row(row, **fn_kwargs)
            except TemplateError as exc:
                raise TemplateError(f"{conv.source}: {exc}") from exc
            _account(summary, res, max_length)
            if not res["_drop"]:
                out_cols["input_ids"].append(res["input_ids"])
                out_cols["loss_mask"].append(res["loss_mask"])
                out_cols["id"].append(rid)
        if not summary.samples:
            raise _no_samples_error(_display(path_or_records), summary)
        features = _features()
        return datasets.Dataset.from_dict(out_cols, features=features), summary

    ds = datasets.Dataset.from_dict(rows)
    ds = ds.map(
        _tokenize_row,
        fn_kwargs=fn_kwargs,
        num_proc=num_proc,
        remove_columns=["messages", "text", "truncated"],
        desc="tokenizing",
    )
    for drop, length, mask in zip(ds["_drop"], ds["_length"], ds["loss_mask"], strict=True):
        _account(summary, {"_drop": drop, "_length": length, "loss_mask": mask}, max_length)
    if not summary.samples:
        raise _no_samples_error(_display(path_or_records), summary)
    ds = ds.filter(lambda d: not d, input_columns="_drop", num_proc=num_proc)
    ds = ds.remove_columns(["_drop", "_length"]).select_columns(["input_ids", "loss_mask", "id"])
    return ds.cast(_features()), summary


def _no_samples_error(where: str, summary: DataSummary) -> DataFileError:
    """Nothing to train on: say why every record was dropped and what to do.

    An empty dataset would otherwise surface much later as a training loop with no batches
    (torch's ``num_samples=0``) or an empty saved dataset with exit code 0.
    """
    reasons = ", ".join(f"{r}: {n}" for r, n in summary.dropped.most_common()) or "no records"
    hint = ""
    if summary.dropped.get("no assistant turn"):
        hint = (
            "; these records are prompts without answers: answer them first with `draftsmith "
            "data distill --input <file> --output <answers.jsonl>`, then use that output"
        )
    elif summary.dropped.get("no supervised token after truncation"):
        hint = "; raise max_length (--max-length) so the answers survive truncation"
    return DataFileError(
        where, f"no sample left to train on (dropped: {reasons}){hint}", reason="no samples"
    )


def _features() -> Any:
    import datasets

    return datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int64")),
            "loss_mask": datasets.List(datasets.Value("int8")),
            "id": datasets.Value("string"),
        }
    )


def _account(summary: DataSummary, res: dict[str, Any], max_length: int | None) -> None:
    if res["_drop"]:
        summary.dropped[res["_drop"]] += 1
        return
    summary.samples += 1
    summary.tokens += len(res["loss_mask"])
    summary.supervised_tokens += sum(res["loss_mask"])
    if max_length is not None and res["_length"] > max_length:
        summary.truncated += 1


# --------------------------------------------------------------------------------------------
# Command line: draftsmith data tokenize
# --------------------------------------------------------------------------------------------


@dataclass
class TokenizeConfig:
    """Settings of ``draftsmith data tokenize``."""

    input: Path = cfg_field(help="conversations: a file or directory (JSONL/JSON/parquet)")
    output: Path = cfg_field(help="where to save the tokenized dataset (datasets.save_to_disk)")
    target: str | None = cfg_field(
        None, help="target whose tokenizer/chat template to use (default: SmolLM2-135M-Instruct)"
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    max_length: int | None = cfg_field(2048, help="truncate samples to this many tokens")
    shape: str = cfg_field(
        "auto",
        help="record shape",
        choices=["auto", "messages", "sharegpt", "alpaca", "text", "prompt"],
    )
    split: str | None = cfg_field(None, help="keep only this split (train/heldout)")
    skip_invalid: bool = cfg_field(False, help="skip and count malformed records")
    num_proc: int = cfg_field(1, help="tokenization worker processes")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.max_length is not None and self.max_length < 2:
            problems.append(("max_length", f"must be >= 2, got {self.max_length}"))
        if self.num_proc < 1:
            problems.append(("num_proc", f"must be >= 1, got {self.num_proc}"))
        return problems


def main_tokenize(argv: list[str] | None = None) -> int:
    """``draftsmith data tokenize``: conversations -> input_ids + assistant-only loss_mask.

    Returns:
        Exit code: 0 saved; 2 bad config, data or template (or nothing left to train on);
        1 the target cannot be loaded, another process writes the output, or the disk is full.
    """
    from draftsmith.train.errors import cli_main

    return cli_main(_main_tokenize, argv)


# A saved dataset directory holds one of these; any other existing directory is not replaced.
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _main_tokenize(argv: list[str]) -> int:
    from transformers import AutoTokenizer

    from draftsmith.train.config import parse_config
    from draftsmith.train.runinfo import OutputExistsError, output_lock, staged_dir
    from draftsmith.train.target.load import prepare_target

    cfg = parse_config(TokenizeConfig, argv, prog="draftsmith data tokenize")
    out = Path(cfg.output)
    # A re-tokenization replaces its earlier output; anything else under that name is the
    # user's and is never deleted.
    if out.exists() and not (out.is_dir() and any((out / m).is_file() for m in _DATASET_MARKERS)):
        raise OutputExistsError(
            f"output: {out} exists and is not a tokenized dataset; choose another --output"
        )
    tokenizer = AutoTokenizer.from_pretrained(prepare_target(cfg.target, cache_dir=cfg.cache_dir))
    dataset, summary = build_dataset(
        cfg.input,
        tokenizer,
        max_length=cfg.max_length,
        shape=cfg.shape,
        skip_invalid=cfg.skip_invalid,
        split=cfg.split,
        num_proc=cfg.num_proc,
    )
    # Arrow stores int64 ids and int8 mask per token, plus offsets and the ids column.
    need = summary.tokens * 9 + summary.samples * 64 + (1 << 20)
    with (
        output_lock(out, "tokenize run"),
        staged_dir(out, overwrite=True, need_bytes=need) as tmp,
    ):
        dataset.save_to_disk(str(tmp))
    print(summary)
    print(f"saved to {out}")
    return 0
