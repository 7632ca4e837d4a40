"""Tests for draftsmith.train.data.prompts (prompt-file loading and chat rendering)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.train.data.prompts import (
    DEFAULT_PROMPTS,
    PromptFileError,
    PromptRecord,
    load_prompts,
    render_prompt,
)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_jsonl(path: Path, *lines: object) -> Path:
    """Write lines (objects are JSON-encoded, strings written as they are) to ``path``."""
    path.write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines),
        encoding="utf-8",
    )
    return path


def assert_error(path: Path, line: int | None, field: str | None, match: str, **kwargs) -> str:
    """Load ``path`` expecting a PromptFileError that names the file, line and field."""
    with pytest.raises(PromptFileError, match=match) as info:
        load_prompts(path, **kwargs)
    err = info.value
    msg = str(err)
    assert str(path) in msg
    assert err.line == line
    if line is not None:
        assert msg.startswith(f"{path}:{line}: ")
    assert err.field == field
    if field is not None:
        assert f"field '{field}'" in msg
    return msg


@pytest.fixture(scope="module")
def chatml_tokenizer():
    """A tiny word-level tokenizer with a ChatML chat template (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[PAD]", "system", "user", "assistant", "hello", "world", "\n"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML
    return fast


# --- record shapes ---------------------------------------------------------------------------


def test_prompt_shape(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        {"prompt": "Say hi."},
        {"prompt": "Say bye.", "system": "Be brief.", "id": "bye"},
        {"prompt": "No system.", "system": ""},
    )
    a, b, c = load_prompts(path)
    assert a == PromptRecord(
        messages=[{"role": "user", "content": "Say hi."}], id="p.jsonl:1", source="p.jsonl:1"
    )
    assert b.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say bye."},
    ]
    assert (b.id, b.source, b.reference) == ("bye", "p.jsonl:2", None)
    assert c.messages == [{"role": "user", "content": "No system."}]


def test_messages_shape_with_system_and_trailing_assistant(tmp_path):
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?", "name": "ignored extra key"},
        {"role": "assistant", "content": "6"},
    ]
    path = write_jsonl(tmp_path / "m.jsonl", {"id": 7, "messages": msgs})
    (rec,) = load_prompts(path)
    assert rec.id == "7"
    assert rec.reference == "6"
    assert rec.messages == [{"role": m["role"], "content": m["content"]} for m in msgs[:4]]


def test_alpaca_shape(tmp_path):
    path = write_jsonl(
        tmp_path / "a.jsonl",
        {"id": 0, "instruction": "Name a colour.", "input": "", "output": "Blue."},
        {"instruction": "Sum these.", "input": "1, 2, 3"},
        {"instruction": "Tell a joke.", "input": None, "output": ""},
    )
    a, b, c = load_prompts(path)
    assert a.messages == [{"role": "user", "content": "Name a colour."}]
    assert (a.id, a.reference) == ("0", "Blue.")
    assert b.messages == [{"role": "user", "content": "Sum these.\n\n1, 2, 3"}]
    assert (b.id, b.reference) == ("a.jsonl:2", None)
    assert c.messages == [{"role": "user", "content": "Tell a joke."}]
    assert c.reference is None


def test_sharegpt_shape(tmp_path):
    conv = [
        {"from": "system", "value": "Be kind."},
        {"from": "human", "value": "Hi!"},
        {"from": "gpt", "value": "Hello."},
        {"from": "human", "value": "How are you?"},
        {"from": "gpt", "value": "Fine, thanks."},
    ]
    path = write_jsonl(tmp_path / "s.jsonl", {"id": "abc_0", "conversations": conv})
    (rec,) = load_prompts(path)
    assert rec.id == "abc_0"
    assert rec.reference == "Fine, thanks."
    assert [m["role"] for m in rec.messages] == ["system", "user", "assistant", "user"]
    assert rec.messages[-1]["content"] == "How are you?"


def test_blank_lines_skipped_and_line_numbers_kept(tmp_path):
    path = write_jsonl(tmp_path / "b.jsonl", "", {"prompt": "x"}, "   ", "", {"prompt": "y"})
    assert [r.source for r in load_prompts(path)] == ["b.jsonl:2", "b.jsonl:5"]


def test_messages_shape_wins_over_prompt(tmp_path):
    # e.g. UltraChat-style records carry both "prompt" and "messages"
    path = write_jsonl(
        tmp_path / "u.jsonl",
        {
            "prompt": "Q",
            "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
        },
    )
    (rec,) = load_prompts(path)
    assert rec.messages == [{"role": "user", "content": "Q"}]
    assert rec.reference == "A"


# --- filters ---------------------------------------------------------------------------------


def test_split_field(tmp_path):
    path = write_jsonl(
        tmp_path / "s.jsonl",
        {"id": 0, "split": "train", "prompt": "a"},
        {"id": 1, "split": "heldout", "prompt": "b"},
        {"id": 9, "split": "train", "prompt": "c"},  # the field wins over the id rule
        {"id": "x", "split": "heldout", "prompt": "d"},
    )
    assert [r.id for r in load_prompts(path, split="train")] == ["0", "9"]
    assert [r.id for r in load_prompts(path, split="heldout")] == ["1", "x"]
    assert len(load_prompts(path)) == 4


def test_split_id_rule_without_split_field(tmp_path):
    path = write_jsonl(
        tmp_path / "alpaca.jsonl",
        *({"id": i, "instruction": f"task {i}", "input": "", "output": "ok"} for i in range(25)),
    )
    assert [r.id for r in load_prompts(path, split="heldout")] == ["9", "19"]
    train = load_prompts(path, split="train")
    assert len(train) == 23
    assert "9" not in {r.id for r in train}


def test_split_id_rule_only_defines_train_and_heldout(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", {"id": 1, "prompt": "a"}, {"id": 2, "prompt": "b"})
    assert_error(path, 1, "split", "defines only 'train' and 'heldout'", split="test")


def test_split_requested_but_file_has_no_split_information(tmp_path):
    path = write_jsonl(tmp_path / "n.jsonl", {"prompt": "a"}, {"prompt": "b"})
    msg = assert_error(path, 1, "split", "no 'split' field and no integer 'id'", split="train")
    assert "split='train'" in msg
    path = write_jsonl(tmp_path / "n2.jsonl", {"id": "s1", "prompt": "a"})
    assert_error(path, 1, "split", "no integer 'id'", split="heldout")


def test_limit_and_id_filter(tmp_path):
    path = write_jsonl(
        tmp_path / "l.jsonl", *({"id": i, "split": "train", "prompt": str(i)} for i in range(10))
    )
    assert [r.id for r in load_prompts(path, limit=3)] == ["0", "1", "2"]
    assert len(load_prompts(path, limit=100)) == 10
    odd = load_prompts(path, id_filter=lambda i: int(i) % 2 == 1, limit=2)
    assert [r.id for r in odd] == ["1", "3"]
    with pytest.raises(ValueError, match="limit"):
        load_prompts(path, limit=0)


def test_no_prompts_after_filtering(tmp_path):
    path = write_jsonl(tmp_path / "f.jsonl", {"split": "train", "prompt": "a"})
    msg = assert_error(path, None, None, "no prompts in", split="heldout")
    assert "split='heldout'" in msg
    assert_error(path, None, None, "after id_filter", id_filter=lambda i: False)


# --- errors ----------------------------------------------------------------------------------


def test_file_not_found(tmp_path):
    assert_error(tmp_path / "missing.jsonl", None, None, "not found")
    assert_error(tmp_path, None, None, "directory")


def test_empty_file(tmp_path):
    assert_error(write_jsonl(tmp_path / "e.jsonl", "", "  "), None, None, "no prompts in .*empty")
    (tmp_path / "e2.jsonl").write_text("", encoding="utf-8")
    assert_error(tmp_path / "e2.jsonl", None, None, "empty")


def test_invalid_json(tmp_path):
    path = write_jsonl(tmp_path / "j.jsonl", {"prompt": "ok"}, "", '{"prompt": "unterminated')
    msg = assert_error(path, 3, None, "invalid JSON")
    assert "Unterminated string" in msg  # the json error is included


@pytest.mark.parametrize("line", ['["a list"]', '"a string"', "42", "null"])
def test_record_not_an_object(tmp_path, line):
    path = write_jsonl(tmp_path / "o.jsonl", {"prompt": "ok"}, line)
    assert_error(path, 2, None, "must be a JSON object")


def test_unknown_shape_lists_accepted_fields(tmp_path):
    path = write_jsonl(tmp_path / "u.jsonl", {"prompt": "ok"}, {"question": "What?", "id": 3})
    msg = assert_error(path, 2, None, "none of the fields")
    for name in ("messages", "conversations", "instruction", "prompt", "'question'"):
        assert name in msg


BAD_RECORDS = [
    ({"messages": "hi"}, "messages", "must be a list"),
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": ["hi"]}, "messages[0]", "must be an object"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "missing"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role", "unknown role 'bot'"),
    ({"messages": [{"role": "user", "content": " "}]}, "messages[0].content", "must not be empty"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "must be a string"),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
        "messages[1].role",
        "system message may only come first",
    ),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        "messages[1].role",
        "two user turns in a row",
    ),
    ({"messages": [{"role": "system", "content": "s"}]}, "messages", "must end with a user turn"),
    (
        {"messages": [{"role": "assistant", "content": "a"}]},
        "messages[0].role",
        "expected a user turn",
    ),
    (
        {"conversations": [{"from": "gpt", "value": "hello"}]},
        "conversations[0].from",
        "expected a user turn",
    ),
    (
        {"conversations": [{"from": "robot", "value": "hi"}]},
        "conversations[0].from",
        "unknown role 'robot'",
    ),
    ({"conversations": [{"from": "human"}]}, "conversations[0].value", "missing"),
    ({"conversations": {"from": "human"}}, "conversations", "must be a list"),
    ({"instruction": ""}, "instruction", "must not be empty"),
    ({"instruction": "x", "input": 5}, "input", "must be a string"),
    ({"instruction": "x", "output": ["y"]}, "output", "must be a string"),
    ({"prompt": None}, "prompt", "must be a string"),
    ({"prompt": "x", "system": 1}, "system", "must be a string"),
    ({"prompt": "x", "id": 1.5}, "id", "must be a string or an integer"),
    ({"prompt": "x", "id": True}, "id", "must be a string or an integer"),
    ({"prompt": "x", "split": 1}, "split", "must be a string"),
]


@pytest.mark.parametrize(("record", "field", "match"), BAD_RECORDS)
def test_bad_field(tmp_path, record, field, match):
    path = write_jsonl(tmp_path / "bad.jsonl", {"prompt": "fine"}, "", {"prompt": "ok"}, record)
    assert_error(path, 4, field, match)


def test_bad_record_is_reported_even_when_filtered_out(tmp_path):
    path = write_jsonl(
        tmp_path / "f.jsonl",
        {"split": "train", "prompt": "a"},
        {"split": "heldout", "messages": "oops"},
    )
    assert_error(path, 2, "messages", "must be a list", split="train", limit=1)


# --- rendering -------------------------------------------------------------------------------


def test_render_prompt_chatml(chatml_tokenizer):
    tok = chatml_tokenizer
    rec = PromptRecord(
        messages=[
            {"role": "system", "content": "hello"},
            {"role": "user", "content": "hello world"},
        ],
        id="r",
        source="x.jsonl:1",
    )
    ids = render_prompt(tok, rec)
    assert isinstance(ids, list)
    assert all(type(i) is int for i in ids)
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    v = tok.get_vocab()
    assert ids == [
        *(start, v["system"], v["hello"], end),
        *(start, v["user"], v["hello"], v["world"], end),
        *(start, v["assistant"]),
    ]


def test_render_prompt_without_chat_template(chatml_tokenizer):
    rec = PromptRecord(messages=[{"role": "user", "content": "hi"}], id="7", source="f.jsonl:3")
    tok = chatml_tokenizer
    saved = tok.chat_template
    tok.chat_template = None
    try:
        with pytest.raises(ValueError, match=r"f\.jsonl:3: .*no chat template"):
            render_prompt(tok, rec)
    finally:
        tok.chat_template = saved


def test_render_prompt_template_error_names_source(chatml_tokenizer):
    rec = PromptRecord(messages=[{"role": "user", "content": "hi"}], id="7", source="f.jsonl:3")
    tok = chatml_tokenizer
    saved = tok.chat_template
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    try:
        with pytest.raises(ValueError, match=r"f\.jsonl:3: .*roles must alternate"):
            render_prompt(tok, rec)
    finally:
        tok.chat_template = saved


# --- the shipped prompt set ------------------------------------------------------------------


def test_default_prompt_set():
    assert DEFAULT_PROMPTS.is_file()
    records = load_prompts()
    assert len(records) == 64
    ids = [r.id for r in records]
    assert len(set(ids)) == 64
    assert sorted(int(i) for i in ids) == list(range(64))
    held = load_prompts(split="heldout")
    train = load_prompts(split="train")
    assert len(held) == len(train) == 32
    assert all(int(r.id) % 2 == 1 for r in held)
    assert all(int(r.id) % 2 == 0 for r in train)
    assert all(r.reference is None for r in records)
    assert all(r.messages[-1]["role"] == "user" for r in records)
    assert any(r.messages[0]["role"] == "system" for r in records)
    assert any(any(m["role"] == "assistant" for m in r.messages) for r in records)


def test_default_prompt_set_raw_fields():
    raw = [json.loads(line) for line in DEFAULT_PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert len(raw) == 64
    categories = {r["category"] for r in raw}
    assert len(categories) >= 8
    for r in raw:
        assert set(r) == {"id", "split", "category", "messages"}
        assert r["split"] == ("heldout" if r["id"] % 2 else "train")
    # every category appears in both splits
    for cat in categories:
        assert {r["split"] for r in raw if r["category"] == cat} == {"train", "heldout"}


def test_every_default_prompt_renders(chatml_tokenizer):
    start = chatml_tokenizer.convert_tokens_to_ids("<|im_start|>")
    for rec in load_prompts():
        ids = render_prompt(chatml_tokenizer, rec)
        assert ids.count(start) == len(rec.messages) + 1, rec.id
        assert ids[-2:] == [start, chatml_tokenizer.convert_tokens_to_ids("assistant")]
