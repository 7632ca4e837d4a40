"""Tests for draftsmith.train.data.tokenize: record shapes, files, errors, skips, masks, truncation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.train.data.tokenize import (
    Conversation,
    DataFileError,
    TemplateError,
    build_dataset,
    conversation_to_record,
    load_records,
    select_split,
    template_fingerprint,
    tokenize_conversation,
    tokenize_text,
)

# SmolLM2-135M-Instruct's template, verbatim: a default system prompt is injected when the
# conversation has none.
SMOLLM2_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)
CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>"]

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def make_tokenizer(
    template: str,
    specials: list[str],
    eos: str,
    bos: str | None = None,
    merges: list[tuple[str, str]] | None = None,
):
    """A byte-level BPE tokenizer: one token per byte (plus optional merges) + special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for a, b in merges or []:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges or [])))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    kwargs = {"bos_token": bos} if bos else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, **kwargs)
    fast.add_special_tokens({"additional_special_tokens": specials})
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def chatml():
    return make_tokenizer(SMOLLM2_CHATML, CHATML_SPECIALS, eos="<|im_end|>")


@pytest.fixture(scope="module")
def llama3():
    return make_tokenizer(LLAMA3, LLAMA3_SPECIALS, eos="<|eot_id|>", bos="<|begin_of_text|>")


def expected(tokenizer, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Hand-built ids and mask: each text piece is encoded alone (exact for byte tokenizers)."""
    ids, mask = [], []
    for text, flag in pieces:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [flag] * len(piece)
    return ids, mask


def write_jsonl(path: Path, *lines: object) -> Path:
    path.write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines),
        encoding="utf-8",
    )
    return path


CHAT = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "and?"},
    {"role": "assistant", "content": "ok."},
]


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


# --------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------


def check_mask(tokenizer, messages, pieces, max_length=None):
    ids, mask = expected(tokenizer, pieces)
    got = tokenize_conversation(tokenizer, messages, max_length=max_length)
    assert got is not None
    # Also equal to the template's own tokenization, so the expectation is the real sequence.
    full = tokenizer.apply_chat_template(list(messages), tokenize=True)["input_ids"]
    assert ids == full[: len(ids)]
    for t, (a, b, m, n) in enumerate(
        zip(got["input_ids"], ids, got["loss_mask"], mask, strict=True)
    ):
        assert (a, m) == (b, n), f"token {t} ({tokenizer.decode([b])!r}): got {(a, m)}"
    return got


def test_chatml_mask_with_injected_default_system_prompt_multi_turn(chatml):
    got = check_mask(
        chatml,
        CHAT,
        [
            (SMOLLM2_SYSTEM, 0),
            ("<|im_start|>user\nhi<|im_end|>\n", 0),
            ("<|im_start|>assistant\n", 0),
            ("yo<|im_end|>", 1),
            ("\n", 0),
            ("<|im_start|>user\nand?<|im_end|>\n", 0),
            ("<|im_start|>assistant\n", 0),
            ("ok.<|im_end|>", 1),
            ("\n", 0),
        ],
    )
    supervised = [t for t, m in zip(got["input_ids"], got["loss_mask"], strict=True) if m]
    assert chatml.decode(supervised) == "yo<|im_end|>ok.<|im_end|>"
    # Exactly two end-of-turn tokens are supervised: one per assistant turn, none of user/system.
    eot = chatml.convert_tokens_to_ids("<|im_end|>")
    assert sum(m for t, m in zip(got["input_ids"], got["loss_mask"], strict=True) if t == eot) == 2


def test_chatml_mask_with_explicit_system(chatml):
    messages = [{"role": "system", "content": "S"}, *CHAT[:2]]
    check_mask(
        chatml,
        messages,
        [
            ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n", 0),
            ("<|im_start|>assistant\n", 0),
            ("yo<|im_end|>", 1),
            ("\n", 0),
        ],
    )


def test_llama3_mask_multi_turn(llama3):
    messages = [{"role": "system", "content": "S"}, *CHAT]
    check_mask(
        llama3,
        messages,
        [
            ("<|begin_of_text|>", 0),
            ("<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>", 0),
            ("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", 0),
            ("<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
            ("yo<|eot_id|>", 1),
            ("<|start_header_id|>user<|end_header_id|>\n\nand?<|eot_id|>", 0),
            ("<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
            ("ok.<|eot_id|>", 1),
        ],
    )


def test_llama3_trims_content_and_mask_follows(llama3):
    # The template trims content: the supervised span is what was rendered, not the raw string.
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  yo \n"}]
    check_mask(
        llama3,
        messages,
        [
            ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", 0),
            ("<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
            ("yo<|eot_id|>", 1),
        ],
    )


def test_bpe_merge_across_header_falls_back_to_offsets():
    # "\n" + "y" merge into one token, so "…assistant\n" is not a token prefix of "…assistant\nyo".
    tok = make_tokenizer(SMOLLM2_CHATML, CHATML_SPECIALS, eos="<|im_end|>", merges=[("Ċ", "y")])
    messages = CHAT[:2]
    got = tokenize_conversation(tok, messages, max_length=None)
    pairs = [(tok.decode([t]), m) for t, m in zip(got["input_ids"], got["loss_mask"], strict=True)]
    # The merged token straddles header and answer: it stays unsupervised (belongs to the header).
    i = pairs.index(("\ny", 0))
    assert pairs[i + 1 :] == [("o", 1), ("<|im_end|>", 1), ("\n", 0)]
    assert sum(got["loss_mask"]) == 2


def test_template_without_generation_prompt_locates_content():
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}"
    )
    tok = make_tokenizer(template, CHATML_SPECIALS, eos="<|im_end|>")
    check_mask(
        tok,
        CHAT[:2],
        [
            ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0),
            ("yo<|im_end|>", 1),
            ("\n", 0),
        ],
    )


def test_prefix_unstable_template_is_a_clear_error():
    # Renders earlier assistant turns differently once another turn follows (like templates that
    # strip reasoning from history): masks cannot be derived from it.
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}[old]{% else %}{{ m['content'] }}"
        "{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = make_tokenizer(template, CHATML_SPECIALS, eos="<|im_end|>")
    with pytest.raises(TemplateError, match="not prefix-stable"):
        tokenize_conversation(tok, CHAT, max_length=None)


def test_truncation_keeps_mask_aligned(chatml):
    full = tokenize_conversation(chatml, CHAT, max_length=None)
    n = len(full["input_ids"])
    first_answer_end = full["loss_mask"].index(1) + 3  # "yo<|im_end|>"
    for cut in (n - 1, n - 4, first_answer_end + 2, first_answer_end - 1):
        got = tokenize_conversation(chatml, CHAT, max_length=cut)
        assert got["input_ids"] == full["input_ids"][:cut]
        assert got["loss_mask"] == full["loss_mask"][:cut]
    # Cut before the first answer: nothing left to learn.
    assert tokenize_conversation(chatml, CHAT, max_length=first_answer_end - 3) is None


def test_truncated_turn_does_not_supervise_end_of_turn(chatml):
    # A self-distilled answer that hit max_new_tokens never produced <|im_end|>; the template
    # still renders one, and it must stay unsupervised (else the drafter learns to stop early).
    got = check_mask(
        chatml,
        CHAT[:2],
        [
            (SMOLLM2_SYSTEM, 0),
            ("<|im_start|>user\nhi<|im_end|>\n", 0),
            ("<|im_start|>assistant\n", 0),
            ("yo<|im_end|>", 1),
            ("\n", 0),
        ],
    )
    cut = tokenize_conversation(chatml, CHAT[:2], max_length=None, open_ended=True)
    assert cut["input_ids"] == got["input_ids"]
    eot = chatml.convert_tokens_to_ids("<|im_end|>")
    expected_mask = list(got["loss_mask"])
    expected_mask[got["input_ids"].index(eot, got["loss_mask"].index(1))] = 0
    assert cut["loss_mask"] == expected_mask
    supervised = [t for t, m in zip(cut["input_ids"], cut["loss_mask"], strict=True) if m]
    assert chatml.decode(supervised) == "yo"


@pytest.mark.parametrize("num_proc", [1, 2])
def test_build_dataset_honours_truncated_flag(tmp_path, chatml, num_proc):
    path = write_jsonl(
        tmp_path / "sd.jsonl",
        {"id": 1, "instruction": "hi", "output": "yo"},
        {"id": 2, "instruction": "hi", "output": "yo", "truncated": True},
    )
    ds, _ = build_dataset(path, chatml, max_length=None, num_proc=num_proc)
    eot = chatml.convert_tokens_to_ids("<|im_end|>")
    done, cut = ds[0], ds[1]
    assert done["input_ids"] == cut["input_ids"]
    sup = [[t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m] for r in ds]
    assert sup[0][-1] == eot and eot not in sup[1]
    assert sup[0][:-1] == sup[1]


def test_text_records_fully_supervised(chatml):
    got = tokenize_text(chatml, "abc", max_length=None)
    assert got == {"input_ids": chatml.encode("abc"), "loss_mask": [1, 1, 1]}
    assert tokenize_text(chatml, "abcdef", max_length=2)["loss_mask"] == [1, 1]


# --------------------------------------------------------------------------------------------
# build_dataset
# --------------------------------------------------------------------------------------------


def test_build_dataset_columns_drops_and_counts(tmp_path, chatml):
    long_user = "u" * 200
    # "d" fits, "a" (two turns) is cut inside its second turn, "c" is cut before its answer.
    limit = len(tokenize_conversation(chatml, CHAT[:2], max_length=None)["input_ids"]) + 2
    path = write_jsonl(
        tmp_path / "d.jsonl",
        {"id": "a", "messages": CHAT},
        {"id": "b", "messages": [{"role": "user", "content": "prompt only"}]},
        {"id": "c", "messages": [{"role": "user", "content": long_user}, CHAT[1]]},
        {"id": "d", "messages": CHAT[:2]},
    )
    ds, summary = build_dataset(path, chatml, max_length=limit)
    assert ds.column_names == ["input_ids", "loss_mask", "id"]
    assert ds["id"] == ["a", "d"]
    assert dict(summary.dropped) == {
        "no assistant turn": 1,
        "no supervised token after truncation": 1,
    }
    assert summary.samples == 2 and summary.truncated == 1
    for row in ds:
        ref = tokenize_conversation(
            chatml, CHAT if row["id"] == "a" else CHAT[:2], max_length=limit
        )
        assert row["input_ids"] == ref["input_ids"] and row["loss_mask"] == ref["loss_mask"]
    assert summary.tokens == sum(len(x) for x in ds["input_ids"])
    assert summary.supervised_tokens == sum(sum(x) for x in ds["loss_mask"])
    assert "dropped: " in str(summary)


def test_build_dataset_text_and_conversations_and_num_proc(tmp_path, chatml):
    convs = [
        Conversation(messages=CHAT, id="x", source="s:1", shape="messages"),
        Conversation(messages=[], id="t", source="s:2", shape="text", text="hello"),
    ]
    ds1, s1 = build_dataset(convs, chatml, max_length=None)
    assert ds1["id"] == ["x", "t"] and ds1[1]["loss_mask"] == [1] * 5
    ds2, s2 = build_dataset(convs, chatml, max_length=None, num_proc=2)
    assert ds2.to_dict() == ds1.to_dict()
    assert (s2.samples, s2.tokens, s2.supervised_tokens) == (
        s1.samples,
        s1.tokens,
        s1.supervised_tokens,
    )


@pytest.mark.parametrize("num_proc", [1, 2])
def test_build_dataset_with_nothing_to_train_on_says_why(tmp_path, chatml, num_proc):
    """Prompts without answers used to give an empty dataset (and `data tokenize` exit 0)."""
    path = write_jsonl(tmp_path / "p.jsonl", {"prompt": "hi"}, {"prompt": "yo"})
    with pytest.raises(DataFileError) as info:
        build_dataset(path, chatml, num_proc=num_proc)
    assert str(info.value) == (
        f"{path}: no sample left to train on (dropped: no assistant turn: 2); these records are "
        "prompts without answers: answer them first with `draftsmith data distill --input "
        "<file> --output <answers.jsonl>`, then use that output"
    )
    chat = write_jsonl(tmp_path / "c.jsonl", {"messages": CHAT})
    with pytest.raises(DataFileError, match=r"no supervised token after truncation: 1.*max_length"):
        build_dataset(chat, chatml, max_length=2)


def test_template_error_names_the_record(tmp_path):
    tok = make_tokenizer("{{ raise_exception('no!') }}", CHATML_SPECIALS, eos="<|im_end|>")
    path = write_jsonl(tmp_path / "d.jsonl", {"messages": CHAT})
    with pytest.raises(TemplateError, match=r"d\.jsonl:1: the chat template failed: no!"):
        build_dataset(path, tok)


def test_template_fingerprint(chatml, llama3):
    fp = template_fingerprint(chatml)
    assert len(fp) == 64 and fp == template_fingerprint(chatml)
    assert fp != template_fingerprint(llama3)
    other = make_tokenizer(SMOLLM2_CHATML + " ", CHATML_SPECIALS, eos="<|im_end|>")
    assert template_fingerprint(other) != fp


def test_tokenize_cli_saves_masked_dataset(tmp_path, tiny_target_dir, capsys):
    import datasets

    from draftsmith.train.data.tokenize import main_tokenize

    src = tmp_path / "chats.jsonl"
    src.write_text(
        '{"id": 1, "messages": [{"role": "user", "content": "hi"},'
        ' {"role": "assistant", "content": "hello there"}]}\n'
        '{"id": 2, "messages": [{"role": "user", "content": "1+1?"},'
        ' {"role": "assistant", "content": "2"}]}\n'
    )
    out = tmp_path / "tok"
    assert (
        main_tokenize(["--input", str(src), "--output", str(out), "--target", str(tiny_target_dir)])
        == 0
    )
    ds = datasets.load_from_disk(str(out))
    assert ds.num_rows == 2 and set(ds.column_names) >= {"input_ids", "loss_mask", "id"}
    for row in ds:
        assert len(row["input_ids"]) == len(row["loss_mask"]) and sum(row["loss_mask"]) > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "robot", "content": "x"}]}\n')
    assert (
        main_tokenize(
            [
                "--input",
                str(bad),
                "--output",
                str(tmp_path / "t2"),
                "--target",
                str(tiny_target_dir),
            ]
        )
        == 2
    )
    assert "bad.jsonl:1" in capsys.readouterr().err
