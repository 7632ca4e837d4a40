"""Tests for chat masks (draftsmith.train.data.chat) and the dataset build (tokenize.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.train.data.chat import (
    TemplateError,
    template_fingerprint,
    tokenize_conversation,
    tokenize_text,
)
from draftsmith.train.data.files import DataFileError
from draftsmith.train.data.records import Conversation
from draftsmith.train.data.tokenize import build_dataset

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
    # Several inputs, read in order; an id used in two of them is named.
    more = tmp_path / "more.jsonl"
    more.write_text(
        '{"id": "3#s1", "messages": [{"role": "user", "content": "hi"},'
        ' {"role": "assistant", "content": "hey"}]}\n'
    )
    both = ["--input", str(src), str(more), "--target", str(tiny_target_dir)]
    assert main_tokenize([*both, "--output", str(tmp_path / "t3")]) == 0
    assert datasets.load_from_disk(str(tmp_path / "t3"))["id"] == ["1", "2", "3#s1"]
    again = ["--input", str(src), str(src), "--target", str(tiny_target_dir)]
    assert main_tokenize([*again, "--output", str(tmp_path / "t4")]) == 2
    assert "id '1' was already used by" in capsys.readouterr().err
