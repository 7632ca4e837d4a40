"""Tests for the one record parser (draftsmith.train.data.records) through both of its views.

Each shape is read as training data (``load_records`` -> ``Conversation``) and as a prompt file
(``load_prompts`` -> ``PromptRecord``); malformed records fail the same way in both, naming the
field and the file:line. Then the training loader alone: file types, skips, splits, write-back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.train.data.files import DataFileError
from draftsmith.train.data.prompts import PromptFileError, load_prompts
from draftsmith.train.data.records import (
    conversation_to_record,
    load_records,
    select_split,
)

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "2+2?"}
ANSWER = {"role": "assistant", "content": "4"}
CHAT = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "and?"},
    {"role": "assistant", "content": "ok."},
]


def write_jsonl(path: Path, *lines: object) -> Path:
    """Write lines (objects are JSON-encoded, strings written as they are) to ``path``."""
    path.write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines),
        encoding="utf-8",
    )
    return path


def load_one(tmp_path: Path, record: dict) -> tuple:
    """The record through both views: ``(Conversation, PromptRecord)``."""
    path = write_jsonl(tmp_path / "r.jsonl", record)
    (conv,) = load_records(path)[0]
    (prompt,) = load_prompts(path)
    return conv, prompt


# --------------------------------------------------------------------------------------------
# One test per shape, both views
# --------------------------------------------------------------------------------------------


def test_prompt_shape(tmp_path):
    conv, prompt = load_one(
        tmp_path, {"id": 3, "prompt": "2+2?", "system": "Be brief.", "completion": "4"}
    )
    assert conv.shape == "prompt" and conv.id == "3" and conv.split == "train"
    assert conv.messages == [SYSTEM, USER, ANSWER]
    assert prompt.messages == [SYSTEM, USER] and prompt.reference == "4" and prompt.id == "3"


def test_prompt_shape_without_answer_or_system(tmp_path):
    conv, prompt = load_one(tmp_path, {"prompt": "2+2?", "system": " ", "completion": ""})
    assert conv.messages == [USER] and conv.id == f"{tmp_path / 'r.jsonl'}:1"
    assert prompt.messages == [USER] and prompt.reference is None and prompt.id == "r.jsonl:1"


def test_messages_shape(tmp_path):
    turns = [SYSTEM, USER, ANSWER, {"role": "user", "content": "3+3?"}, ANSWER | {"content": "6"}]
    conv, prompt = load_one(tmp_path, {"id": "m", "messages": turns})
    assert conv.shape == "messages" and conv.messages == turns
    assert prompt.messages == turns[:4] and prompt.reference == "6"


def test_messages_shape_keeps_an_empty_assistant_turn(tmp_path):
    # An empty answer is a real target output (the model ends its turn at once).
    turns = [USER, {"role": "assistant", "content": ""}]
    conv, prompt = load_one(tmp_path, {"messages": turns})
    assert conv.messages == turns
    assert prompt.messages == [USER] and prompt.reference == ""


def test_alpaca_shape(tmp_path):
    record = {"id": 19, "instruction": "Add.", "input": "2 + 2", "output": "4"}
    conv, prompt = load_one(tmp_path, record)
    user = {"role": "user", "content": "Add.\n\n2 + 2"}
    assert conv.shape == "alpaca" and conv.split == "heldout"
    assert conv.messages == [user, ANSWER]
    assert prompt.messages == [user] and prompt.reference == "4"


def test_sharegpt_shape(tmp_path):
    record = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "2+2?"},
            {"from": "gpt", "value": "4"},
            {"from": "user", "value": "3+3?"},
        ]
    }
    conv, prompt = load_one(tmp_path, record)
    turns = [SYSTEM, USER, ANSWER, {"role": "user", "content": "3+3?"}]
    assert conv.shape == "sharegpt" and conv.messages == turns
    assert prompt.messages == turns and prompt.reference is None


def test_text_records_are_training_data_but_no_prompt(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", {"text": "plain"})
    (conv,) = load_records(path)[0]
    assert conv.text == "plain" and conv.messages == []
    with pytest.raises(PromptFileError, match="holds no chat prompt") as info:
        load_prompts(path)
    assert info.value.field == "text"


# --------------------------------------------------------------------------------------------
# Errors: the same in both views, naming the field and the file:line
# --------------------------------------------------------------------------------------------

BAD_IN_BOTH_VIEWS = [
    ({"messages": {"role": "user"}}, "messages", "must be a list of messages"),
    ({"messages": [USER | {"content": 4}]}, "messages[0].content", "must be a string"),
    ({"instruction": "x", "input": 5}, "input", "must be a string"),
    ({"prompt": "x", "id": 1.5}, "id", "must be a string or an integer"),
    ({"prompt": None}, "prompt", "must be a string, got null"),
    (
        {"messages": [{"role": "bot", "content": "x"}]},
        "messages[0].role",
        "unknown role 'bot'",
    ),
    (
        {"conversations": [{"from": "robot", "value": "x"}]},
        "conversations[0].from",
        "unknown role 'robot'",
    ),
    ({"messages": [USER, USER]}, "messages[1].role", "two user turns in a row"),
    ({"messages": [USER, ANSWER, ANSWER]}, "messages[2].role", "two assistant turns in a row"),
    ({"messages": [USER, SYSTEM]}, "messages[1].role", "system message may only come first"),
    ({"messages": [SYSTEM]}, "messages", "has no user turn"),
    ({"messages": [ANSWER, USER]}, "messages[0].role", "expected a user turn"),
    ({"messages": [SYSTEM, ANSWER]}, "messages[1].role", "expected a user turn"),
]


@pytest.mark.parametrize("view", ["training", "prompt"])
@pytest.mark.parametrize(("record", "field", "match"), BAD_IN_BOTH_VIEWS)
def test_malformed_record_names_field_and_line(tmp_path, view, record, field, match):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n" + json.dumps(record) + "\n", encoding="utf-8")  # line 2
    load, error = (
        (load_records, DataFileError) if view == "training" else (load_prompts, PromptFileError)
    )
    with pytest.raises(error, match=match) as info:
        load(path)
    assert info.value.line == 2 and info.value.field == field
    assert str(info.value).startswith(f"{path}:2: field '{field}': ")


# --------------------------------------------------------------------------------------------
# Shapes and files
# --------------------------------------------------------------------------------------------

SHAPE_RECORDS = {
    "messages": {
        "id": 7,
        "messages": [{"role": "system", "content": "be brief"}, *CHAT],
    },
    "sharegpt": {
        "id": "s1",
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "yo"},
            {"from": "human", "value": "and?"},
            {"from": "gpt", "value": "ok."},
        ],
    },
    "alpaca": {"instruction": "Add.", "input": "1 + 1", "output": "2"},
    "prompt": {"prompt": "hi", "system": "be brief", "completion": "yo"},
    "text": {"text": "plain text"},
}
SHAPE_MESSAGES = {
    "messages": [{"role": "system", "content": "be brief"}, *CHAT],
    "sharegpt": CHAT,
    "alpaca": [
        {"role": "user", "content": "Add.\n\n1 + 1"},
        {"role": "assistant", "content": "2"},
    ],
    "prompt": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ],
    "text": [],
}


@pytest.mark.parametrize("shape", list(SHAPE_RECORDS))
def test_every_shape_jsonl_autodetected(tmp_path, shape):
    path = write_jsonl(tmp_path / "d.jsonl", SHAPE_RECORDS[shape])
    convs, summary = load_records(path)
    (conv,) = convs
    assert conv.shape == shape
    assert conv.messages == SHAPE_MESSAGES[shape]
    assert conv.source == f"{path}:1"
    assert conv.text == ("plain text" if shape == "text" else None)
    assert conv.id == str(SHAPE_RECORDS[shape].get("id", conv.source))
    assert summary.files == {str(path): shape} and summary.loaded == 1


def test_json_array_parquet_and_directory(tmp_path):
    import datasets

    write_jsonl(
        tmp_path / "a.jsonl", SHAPE_RECORDS["alpaca"], "", SHAPE_RECORDS["alpaca"] | {"id": 1}
    )
    (tmp_path / "b.json").write_text(json.dumps([SHAPE_RECORDS["sharegpt"]]))
    sub = tmp_path / "sub"
    sub.mkdir()
    datasets.Dataset.from_list([SHAPE_RECORDS["messages"]]).to_parquet(str(sub / "c.parquet"))
    write_jsonl(tmp_path / ".hidden.jsonl", {"nonsense": 1})  # hidden: skipped
    (tmp_path / "notes.txt").write_text("not data")  # other suffix: skipped

    convs, summary = load_records(tmp_path)
    assert [c.shape for c in convs] == ["alpaca", "alpaca", "sharegpt", "messages"]
    assert [c.source for c in convs] == [
        f"{tmp_path / 'a.jsonl'}:1",
        f"{tmp_path / 'a.jsonl'}:3",  # blank line 2 is not a record
        f"{tmp_path / 'b.json'}[0]",
        f"{sub / 'c.parquet'}[0]",
    ]
    assert convs[3].messages == SHAPE_MESSAGES["messages"]
    assert convs[3].id == "7"
    assert summary.records == 4 and len(summary.files) == 3

    # A JSON array and a parquet file alone; in-memory records too.
    assert load_records(tmp_path / "b.json")[0][0].messages == CHAT
    assert load_records(sub / "c.parquet")[0][0].shape == "messages"
    ds = datasets.Dataset.from_list([SHAPE_RECORDS["prompt"]])
    (conv,) = load_records(ds)[0]
    assert conv.source == "<records>[0]" and conv.shape == "prompt"


def test_shape_argument_overrides_detection(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", {"messages": CHAT, "text": "raw"})
    assert load_records(path)[0][0].shape == "messages"
    (conv,) = load_records(path, shape="text")[0]
    assert conv.text == "raw" and conv.messages == []
    with pytest.raises(ValueError, match="unknown record shape"):
        load_records(path, shape="chatml")


# --------------------------------------------------------------------------------------------
# Malformed records
# --------------------------------------------------------------------------------------------

BAD = [
    ("{not json", None, "invalid JSON", "invalid JSON"),
    ('["a list"]', None, "not an object", "must be a JSON object"),
    ('{"messages": "hi"}', "messages", "wrong type", "must be a list"),
    ('{"messages": []}', "messages", "empty field", "must not be empty"),
    ('{"messages": [{"role": "user"}]}', "messages[0].content", "missing field", "missing"),
    (
        '{"messages": [{"role": "robot", "content": "x"}]}',
        "messages[0].role",
        "unknown role",
        "unknown role 'robot'",
    ),
    (
        '{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}',
        "messages[1].role",
        "bad turn order",
        "expected a assistant turn",
    ),
    (
        '{"messages": [{"role": "assistant", "content": "x"}]}',
        "messages[0].role",
        "bad turn order",
        "expected a user turn",
    ),
    (
        '{"messages": [{"role": "user", "content": " "}]}',
        "messages[0].content",
        "empty field",
        "empty",
    ),
    ('{"instruction": "x"}', "messages", "missing field", "need 'messages'"),
    (
        '{"messages": [{"role": "user", "content": "x"}], "id": 1.5}',
        "id",
        "wrong type",
        "string or an integer",
    ),
    ('{"messages": [{"role": "user", "content": "x"}], "id": 0}', "id", "duplicate id", "already"),
]


@pytest.mark.parametrize(("line", "field", "reason", "match"), BAD)
def test_malformed_record_error_names_file_line_field(tmp_path, line, field, reason, match):
    good = {"id": 0, "messages": [{"role": "user", "content": "fine"}]}
    path = write_jsonl(tmp_path / "d.jsonl", good, line)
    with pytest.raises(DataFileError, match=match) as info:
        load_records(path)
    err = info.value
    assert err.line == 2 and err.field == field and err.reason == reason
    assert str(err).startswith(f"{path}:2: ")
    if field:
        assert f"field '{field}'" in str(err)


def test_row_based_errors_name_the_row(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": "ok"}, {"text": 3}]))
    with pytest.raises(DataFileError) as info:
        load_records(path)
    assert info.value.row == 1 and info.value.line is None
    assert str(info.value).startswith(f"{path}: row 1: field 'text': must be a string")


def test_skip_invalid_counts_per_reason(tmp_path):
    good = {"messages": CHAT}
    path = write_jsonl(
        tmp_path / "d.jsonl",
        "{broken",
        good,
        {"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]},
        {"instruction": "wrong shape for this file"},
        "{also broken",
        good,
    )
    convs, summary = load_records(path, skip_invalid=True)
    assert [c.source for c in convs] == [f"{path}:2", f"{path}:6"]
    assert summary.files == {str(path): "messages"}  # detected from the first object
    assert dict(summary.skipped) == {"invalid JSON": 2, "bad turn order": 1, "missing field": 1}
    assert summary.records == 6 and summary.loaded == 2
    assert summary.examples[0].startswith(f"{path}:1: invalid JSON")
    assert "4 malformed skipped (invalid JSON: 2" in str(summary)

    only_bad = write_jsonl(tmp_path / "bad.jsonl", "{x")
    with pytest.raises(DataFileError, match="no usable records"):
        load_records(only_bad, skip_invalid=True)


def test_file_level_errors(tmp_path):
    with pytest.raises(DataFileError, match="file not found"):
        load_records(tmp_path / "missing.jsonl")
    with pytest.raises(DataFileError, match="holds no data files"):
        load_records(tmp_path)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataFileError, match="unknown file type"):
        load_records(tmp_path / "x.csv")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(DataFileError, match="no records found"):
        load_records(tmp_path / "e.jsonl")


def test_split_rule_and_filter(tmp_path):
    rows = [SHAPE_RECORDS["alpaca"] | {"id": i} for i in range(20)]
    path = write_jsonl(tmp_path / "a.jsonl", *rows)
    train, summary = load_records(path, split="train")
    held, _ = load_records(path, split="heldout")
    assert [c.id for c in held] == ["9", "19"]
    assert len(train) == 18 and summary.filtered == 2
    assert all(c.split == "train" for c in train)
    # A split field wins over the id rule; records with neither cannot be split.
    mixed = write_jsonl(
        tmp_path / "m.jsonl",
        {"id": 9, "split": "train", "text": "a"},
        {"id": "x", "text": "b"},
    )
    convs, _ = load_records(mixed)
    assert convs[0].split == "train" and convs[1].split is None
    with pytest.raises(DataFileError, match="no 'split' field and no integer 'id'"):
        select_split(convs, "train")
    assert len(select_split(convs, "all")) == 2


def test_conversation_to_record_keeps_shape_and_fields(tmp_path):
    rows = [
        {"id": 1, "category": "x", "messages": [{"role": "user", "content": "q", "name": "u"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "old"}]},
        {"id": 3, "instruction": "q", "input": "", "output": "old"},
        {"id": 4, "prompt": "q", "system": "s"},
    ]
    convs = [
        load_records(write_jsonl(tmp_path / f"{i}.jsonl", r))[0][0] for i, r in enumerate(rows)
    ]
    new = [
        [*c.messages[:-1], c.messages[-1]]
        if c.messages[-1]["role"] == "assistant"
        else [*c.messages, {"role": "assistant", "content": ""}]
        for c in convs
    ]
    for msgs in new:
        msgs[-1] = {"role": "assistant", "content": "NEW"}
    out = [conversation_to_record(c, m) for c, m in zip(convs, new, strict=True)]
    assert out[0] == {
        "id": 1,
        "category": "x",
        "messages": [
            {"role": "user", "content": "q", "name": "u"},
            {"role": "assistant", "content": "NEW"},
        ],
    }
    assert out[1] == {
        "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "NEW"}],
        "id": f"{tmp_path / '1.jsonl'}:1",
    }
    assert out[2] == {"id": 3, "instruction": "q", "input": "", "output": "NEW"}
    assert out[3] == {"id": 4, "prompt": "q", "system": "s", "completion": "NEW"}
    # Each written record reads back as the same conversation.
    for i, (rec, msgs) in enumerate(zip(out, new, strict=True)):
        (back,) = load_records(write_jsonl(tmp_path / f"back{i}.jsonl", rec))[0]
        assert back.messages == msgs
