"""Load chat prompt files for evaluation and self-distillation.

A prompt file is JSON Lines: one JSON object per line, blank lines skipped. Four record shapes are
accepted (when a record has the fields of more than one, the first in this list wins):

- OpenAI-style ``{"messages": [{"role": ..., "content": ...}, ...]}``; roles are ``system``
  (first message only), ``user`` and ``assistant``. A trailing assistant turn becomes the
  record's reference answer.
- ShareGPT ``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}, ...]}``
  (``user``/``assistant`` are accepted as ``from`` values too); mapped to the roles above.
- Alpaca ``{"instruction": ..., "input": ..., "output": ...}``; ``input`` and ``output`` are
  optional. The user turn is the instruction, followed by a blank line and the input when the
  input is not empty; ``output`` becomes the reference answer.
- Plain ``{"prompt": ..., "system": ...}``; ``system`` is optional.

Any shape may also carry ``id`` (a string or an integer) and ``split`` (a string); other fields
are ignored. The project's own prompt set, :data:`DEFAULT_PROMPTS`, is described in
``prompts/README.md`` next to this module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.train.errors import UsageError

__all__ = [
    "DEFAULT_PROMPTS",
    "HELDOUT_ID_MODULUS",
    "PromptFileError",
    "PromptRecord",
    "load_prompts",
    "render_prompt",
]

DEFAULT_PROMPTS: Path = Path(__file__).resolve().parent / "prompt_sets" / "chat_prompts.jsonl"
"""The project's own 64-prompt set (32 ``train``, 32 ``heldout``), shipped as package data."""

HELDOUT_ID_MODULUS = 10
"""For records without a ``split`` field: integer ``id % 10 == 9`` is held-out, the rest train."""

_ROLES = ("system", "user", "assistant")
_ROLES_MAP = {role: role for role in _ROLES}
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_SHAPES = (
    "'messages' (OpenAI-style chat), 'conversations' (ShareGPT), "
    "'instruction' (Alpaca, with optional 'input'/'output') or 'prompt' (with optional 'system')"
)


@dataclass
class PromptRecord:
    """One prompt to be answered by the model.

    Attributes:
        messages: Chat messages (``{"role": ..., "content": ...}``), optionally starting with a
            system message and always ending with the user turn the model must answer.
        id: The record's ``id`` field as a string, or ``"<file name>:<line>"`` when it has none.
        source: Where the record came from, ``"<file name>:<line>"`` (1-based line).
        reference: A reference answer when the record carried one (Alpaca ``output`` or a
            trailing assistant turn, which is then not part of ``messages``), else ``None``.
    """

    messages: list[dict[str, str]]
    id: str
    source: str
    reference: str | None = None


class PromptFileError(UsageError):
    """A prompt file is missing, empty or malformed (exit code 2).

    The message reads ``"<path>:<line>: field '<field>': <problem>"`` (line and field are left
    out when they do not apply); they are also available as attributes.

    Attributes:
        path: The prompt file.
        line: The 1-based line number of the offending record, or ``None``.
        field: The offending field (e.g. ``"messages[2].role"``), or ``None``.
    """

    def __init__(
        self, path: str | Path, problem: str, *, line: int | None = None, field: str | None = None
    ) -> None:
        self.path = Path(path)
        self.line = line
        self.field = field
        where = f"{path}:{line}" if line is not None else str(path)
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{problem}")


class _RecordError(Exception):
    """Raised while parsing one record; turned into a PromptFileError with the file and line."""

    def __init__(self, problem: str, field: str | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.field = field


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
    otherwise, so ``split="heldout"`` / ``split="train"`` work on the Alpaca development file
    ``shared/data/alpaca_2k.jsonl`` (200 held-out, 1,800 train records). Any other record is an
    error when a split is requested.

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
            if not isinstance(obj, dict):
                raise _RecordError(f"record must be a JSON object, got {_json_type(obj)}")
            record = _parse_record(obj, source)
            keep = split is None or _in_split(obj, split)
        except _RecordError as exc:
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
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{record.source}: cannot render prompt {record.id!r}: the tokenizer has no chat "
            "template (use the chat/instruct variant of the model, or set tokenizer.chat_template)"
        )
    try:
        out = tokenizer.apply_chat_template(
            record.messages, add_generation_prompt=True, tokenize=True
        )
    except Exception as exc:  # jinja errors (raise_exception in templates), TemplateError, ...
        raise ValueError(
            f"{record.source}: the chat template failed on prompt {record.id!r}: {exc}"
        ) from exc
    return token_ids(out)


def token_ids(out: Any) -> list[int]:
    """Flat token ids from whatever ``apply_chat_template(tokenize=True)`` returned.

    transformers 5 returns a BatchEncoding by default; 4.x returns a list (or a tensor); either
    may hold a batch of one.
    """
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if len(out) == 1 and isinstance(out[0], (list, tuple)):  # a batch of one
        out = list(out[0])
    return [int(t) for t in out]


def _parse_record(obj: dict[str, Any], source: str) -> PromptRecord:
    """Build a PromptRecord from a JSON object, or raise _RecordError."""
    if "messages" in obj:
        messages = _parse_chat(obj["messages"], "messages", "role", "content", _ROLES_MAP)
    elif "conversations" in obj:
        messages = _parse_chat(
            obj["conversations"], "conversations", "from", "value", _SHAREGPT_ROLES
        )
    elif "instruction" in obj:
        instruction = _text(obj["instruction"], "instruction")
        user = instruction
        extra = obj.get("input")
        if extra is not None:
            if not isinstance(extra, str):
                raise _RecordError(f"must be a string, got {_json_type(extra)}", "input")
            if extra.strip():
                user = f"{instruction}\n\n{extra}"
        messages = [{"role": "user", "content": user}]
        output = obj.get("output")
        if output is not None and not isinstance(output, str):
            raise _RecordError(f"must be a string, got {_json_type(output)}", "output")
        if output:
            messages.append({"role": "assistant", "content": output})
    elif "prompt" in obj:
        messages = []
        system = obj.get("system")
        if system is not None:
            if not isinstance(system, str):
                raise _RecordError(f"must be a string, got {_json_type(system)}", "system")
            if system.strip():
                messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": _text(obj["prompt"], "prompt")})
    else:
        fields = ", ".join(repr(k) for k in obj) or "none"
        raise _RecordError(f"record has none of the fields {_SHAPES}; its fields: {fields}")

    reference = None
    if messages[-1]["role"] == "assistant":
        reference = messages.pop()["content"]
    if not messages or messages[-1]["role"] != "user":
        shape = "messages" if "messages" in obj else "conversations"
        raise _RecordError(
            "the conversation must end with a user turn (after dropping one trailing assistant "
            "turn as the reference answer)",
            shape,
        )

    rid = obj.get("id")
    if rid is None:
        rid = source
    elif isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise _RecordError(f"must be a string or an integer, got {_json_type(rid)}", "id")
    split = obj.get("split")
    if split is not None and not isinstance(split, str):
        raise _RecordError(f"must be a string, got {_json_type(split)}", "split")
    return PromptRecord(messages=messages, id=str(rid), source=source, reference=reference)


def _parse_chat(
    value: Any, name: str, role_key: str, text_key: str, roles: Mapping[str, str]
) -> list[dict[str, str]]:
    """Validate a list of chat messages and map it to ``{"role", "content"}`` dicts."""
    if not isinstance(value, list):
        raise _RecordError(f"must be a list of messages, got {_json_type(value)}", name)
    if not value:
        raise _RecordError("must not be empty", name)
    messages: list[dict[str, str]] = []
    for i, msg in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            raise _RecordError(f"must be an object, got {_json_type(msg)}", where)
        for key in (role_key, text_key):
            if key not in msg:
                raise _RecordError(
                    f"missing (a message needs {role_key!r} and {text_key!r})", f"{where}.{key}"
                )
        raw_role = msg[role_key]
        if not isinstance(raw_role, str) or raw_role not in roles:
            raise _RecordError(
                f"unknown role {raw_role!r} (expected one of: {', '.join(roles)})",
                f"{where}.{role_key}",
            )
        role = roles[raw_role]
        content = _text(msg[text_key], f"{where}.{text_key}")
        if role == "system" and i != 0:
            raise _RecordError("a system message may only come first", f"{where}.{role_key}")
        if messages and messages[-1]["role"] == role:
            raise _RecordError(
                f"two {role} turns in a row (user and assistant turns must alternate)",
                f"{where}.{role_key}",
            )
        messages.append({"role": role, "content": content})
    return messages


def _text(value: Any, field: str) -> str:
    """A non-empty string field, or raise _RecordError."""
    if not isinstance(value, str):
        raise _RecordError(f"must be a string, got {_json_type(value)}", field)
    if not value.strip():
        raise _RecordError("must not be empty", field)
    return value


def _in_split(obj: dict[str, Any], split: str) -> bool:
    """Whether a (validated) record belongs to ``split``; see :func:`load_prompts`."""
    if "split" in obj and obj["split"] is not None:
        return obj["split"] == split
    rid = obj.get("id")
    if isinstance(rid, int) and not isinstance(rid, bool):
        if split not in ("train", "heldout"):
            raise _RecordError(
                f"record has no 'split' field, and the id rule (id % {HELDOUT_ID_MODULUS} == "
                f"{HELDOUT_ID_MODULUS - 1} is held-out) defines only 'train' and 'heldout', "
                f"not {split!r}",
                "split",
            )
        heldout = rid % HELDOUT_ID_MODULUS == HELDOUT_ID_MODULUS - 1
        return heldout == (split == "heldout")
    raise _RecordError(
        f"split={split!r} was requested, but the record has no 'split' field and no integer "
        f"'id' (records with an integer id follow id % {HELDOUT_ID_MODULUS} == "
        f"{HELDOUT_ID_MODULUS - 1} = held-out)",
        "split",
    )


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
