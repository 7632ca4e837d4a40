"""Tests for self-distillation (data.generation, data.self_distill, data.distill_command).

Covered: batched generation, record shapes, resume, seeds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from draftsmith.heads.sampling import SamplingParams
from draftsmith.train.data.chat import chat_token_ids
from draftsmith.train.data.records import load_records
from draftsmith.train.datagen.distill_command import main_distill
from draftsmith.train.datagen.generation import generate_batch
from draftsmith.train.datagen.self_distill import DistillError, read_completed, self_distill
from draftsmith.train.decoding.speculative import generate
from tests.conftest import byte_tokenizer, tiny_llama

MAX_NEW = 8
PROMPTS = [
    "hi",
    "What is the capital of France?",
    "Write a haiku about the sea, please, and make it rhyme.",
    "2 + 2 = ?",
    "x",
    "Tell me a story.",
    "Explain recursion in one sentence, as if to a five-year-old child.",
]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    """Tiny random target. A second EOS id -- a token its greedy decoding emits early for some
    prompts -- makes some sequences end before max_new_tokens, so batches shrink mid-run."""
    m = tiny_llama(vocab_size=len(tok), init_std=0.1)
    m.generation_config.eos_token_id = [tok.eos_token_id]
    ids = chat_token_ids(tok, [{"role": "user", "content": PROMPTS[1]}], add_generation_prompt=True)
    out = generate(m, ids, None, max_new_tokens=MAX_NEW).tokens
    m.generation_config.eos_token_id = [tok.eos_token_id, out[3]]
    return m


def eos_ids(model, tok) -> set[int]:
    return {tok.eos_token_id, *model.generation_config.eos_token_id}


def prompt_ids(tok, text: str) -> list[int]:
    return chat_token_ids(tok, [{"role": "user", "content": text}], add_generation_prompt=True)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def alpaca_rows(n: int = len(PROMPTS)) -> list[dict]:
    return [
        {"id": i, "instruction": PROMPTS[i % len(PROMPTS)], "input": "", "output": "OLD"}
        for i in range(n)
    ]


# --------------------------------------------------------------------------------------------
# generate_batch
# --------------------------------------------------------------------------------------------


def test_batched_greedy_equals_unbatched_loop(model, tok):
    prompts = [prompt_ids(tok, p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 3  # real left padding
    eos = eos_ids(model, tok)
    ref = [generate(model, p, None, max_new_tokens=MAX_NEW, eos_token_id=eos) for p in prompts]
    out = generate_batch(
        model, prompts, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=tok.pad_token_id
    )
    assert [o.tokens for o in out] == [r.tokens for r in ref]
    assert [o.stop_reason for o in out] == [r.stop_reason for r in ref]
    # The test is only meaningful if some rows left the batch early and some ran to the end.
    assert {o.stop_reason for o in out} == {"eos", "length"}


def test_batched_sampling_equals_unbatched_with_same_generators(model, tok):
    prompts = [prompt_ids(tok, p) for p in PROMPTS[:4]]
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    # Each prompt alone (a batch of one, no padding) with its own generator: a row's tokens
    # must not depend on its batch neighbours. Not the speculative loop's plain decoding: that
    # draws by inverting the CDF, which a top-p boundary moved by padding's rounding can shift.
    ref = [
        generate_batch(
            model,
            [p],
            max_new_tokens=MAX_NEW,
            sampling=sampling,
            generators=[torch.Generator().manual_seed(100 + i)],
        )[0].tokens
        for i, p in enumerate(prompts)
    ]
    gens = [torch.Generator().manual_seed(100 + i) for i in range(len(prompts))]
    out = generate_batch(model, prompts, max_new_tokens=MAX_NEW, sampling=sampling, generators=gens)
    assert [o.tokens for o in out] == ref


def test_generate_batch_rejects_bad_input(model):
    with pytest.raises(ValueError, match="at least one prompt"):
        generate_batch(model, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_batch(model, [[1]], max_new_tokens=0)


# --------------------------------------------------------------------------------------------
# Record shapes
# --------------------------------------------------------------------------------------------

SHAPE_INPUTS = {
    "alpaca": [
        {"id": 1, "instruction": "Say hi.", "input": "", "output": "OLD"},
        {"id": 2, "instruction": "Add.", "input": "1 + 1", "category": "math"},
    ],
    "messages": [
        {"id": "m1", "messages": [{"role": "user", "content": "hi"}]},
        {
            "id": "m2",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "OLD"},
                {"role": "user", "content": "two"},
                {"role": "assistant", "content": "OLD"},
            ],
        },
    ],
    "sharegpt": [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "OLD"}]},
        {
            "conversations": [
                {"from": "human", "value": "one"},
                {"from": "gpt", "value": "OLD"},
                {"from": "human", "value": "two"},
            ]
        },
    ],
    "prompt": [
        {"id": 5, "prompt": "hi", "system": "Be brief."},
        {"id": 6, "prompt": "two", "completion": "OLD"},
    ],
}


@pytest.mark.parametrize("shape", list(SHAPE_INPUTS))
def test_output_has_the_input_shape(tmp_path, model, tok, shape):
    src = write_jsonl(tmp_path / "in.jsonl", SHAPE_INPUTS[shape])
    convs, _ = load_records(src)
    out = tmp_path / "out.jsonl"
    stats = self_distill(
        model, tok, convs, out, max_new_tokens=MAX_NEW, batch_size=2, progress=False
    )
    assert stats.written == 2 and stats.generated_tokens > 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    new, _ = load_records(out)
    assert {c.shape for c in new} == {shape}
    by_id = {c.id: c for c in new}
    for conv, raw in zip(convs, SHAPE_INPUTS[shape], strict=True):
        rec = next(r for r in records if str(r["id"]) == conv.id)
        # Same fields as the input (plus id when it had none, plus the truncation flag).
        assert set(rec) - {"truncated"} == set(raw) | {"id"} | (
            {"output"} if shape == "alpaca" else {"completion"} if shape == "prompt" else set()
        )
        got = by_id[conv.id].messages
        # Non-assistant turns unchanged; every assistant turn regenerated; one appended when the
        # input ended with a user turn.
        want_roles = [m["role"] for m in conv.messages]
        if want_roles[-1] == "user":
            want_roles.append("assistant")
        assert [m["role"] for m in got] == want_roles
        for old, m in zip(conv.messages, got, strict=False):
            if m["role"] != "assistant":
                assert m == old
        assert all(m["content"] != "OLD" for m in got if m["role"] == "assistant")
        assert rec.get("truncated", False) == any(
            _greedy_turns(model, tok, got)[i][1] == "length"
            for i in range(sum(r == "assistant" for r in want_roles))
        )
        for key in set(raw) - {"messages", "conversations", "output", "completion"}:
            assert rec[key] == raw[key]  # other fields kept, ids keep their type


def _greedy_turns(model, tok, messages):
    """(answer text, stop reason) of each assistant turn, regenerated one by one, unbatched."""
    eos = eos_ids(model, tok)
    history, turns = [], []
    for m in messages:
        if m["role"] != "assistant":
            history.append(m)
            continue
        ids = chat_token_ids(tok, history, add_generation_prompt=True)
        out = generate(model, ids, None, max_new_tokens=MAX_NEW, eos_token_id=eos)
        answer = out.tokens[:-1] if out.stop_reason == "eos" else out.tokens
        text = tok.decode(answer, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        turns.append((text, out.stop_reason))
        history.append({"role": "assistant", "content": text})
    return turns


def test_multi_turn_regenerates_on_regenerated_history(tmp_path, model, tok):
    row = SHAPE_INPUTS["messages"][1]
    src = write_jsonl(tmp_path / "in.jsonl", [row])
    convs, _ = load_records(src)
    self_distill(model, tok, convs, tmp_path / "all.jsonl", max_new_tokens=MAX_NEW, progress=False)
    (rec,) = [json.loads(x) for x in (tmp_path / "all.jsonl").read_text().splitlines()]
    answers = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
    assert answers == [t for t, _ in _greedy_turns(model, tok, rec["messages"])]

    # turns="last": the original first answer stays in the history.
    self_distill(
        model,
        tok,
        convs,
        tmp_path / "last.jsonl",
        max_new_tokens=MAX_NEW,
        turns="last",
        progress=False,
    )
    (last,) = [json.loads(x) for x in (tmp_path / "last.jsonl").read_text().splitlines()]
    assert last["messages"][2]["content"] == "OLD"
    ids = chat_token_ids(tok, row["messages"][:4], add_generation_prompt=True)
    ref = generate(model, ids, None, max_new_tokens=MAX_NEW, eos_token_id=eos_ids(model, tok))
    toks = ref.tokens[:-1] if ref.stop_reason == "eos" else ref.tokens
    assert last["messages"][4]["content"] == tok.decode(toks, skip_special_tokens=False)


def test_text_records_are_rejected(tmp_path, model, tok):
    convs, _ = load_records(write_jsonl(tmp_path / "t.jsonl", [{"text": "abc"}]))
    with pytest.raises(DistillError, match="no turns to answer"):
        self_distill(model, tok, convs, tmp_path / "o.jsonl", progress=False)


# --------------------------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------------------------


class Kill(Exception):
    pass


def _run(model, tok, convs, out, **kw):
    kw = {"max_new_tokens": MAX_NEW, "batch_size": 2, "progress": False, **kw}
    return self_distill(model, tok, convs, out, **kw)


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=1.0)])
def test_kill_and_resume_is_byte_identical(tmp_path, model, tok, sampling):
    convs, _ = load_records(write_jsonl(tmp_path / "in.jsonl", alpaca_rows(9)))
    full = tmp_path / "full.jsonl"
    _run(model, tok, convs, full, sampling=sampling, seed=3)
    reference = full.read_bytes()
    assert len(reference.splitlines()) == 9

    # 1. An exception after two batches (a kill between batches).
    out = tmp_path / "killed.jsonl"

    def kill_after_two(n: int) -> None:
        if n == 2:
            raise Kill

    with pytest.raises(Kill):
        _run(model, tok, convs, out, sampling=sampling, seed=3, on_batch=kill_after_two)
    assert len(out.read_bytes().splitlines()) == 4
    stats = _run(model, tok, convs, out, sampling=sampling, seed=3)
    assert stats.already_done == 4 and stats.written == 5 and stats.regenerated == 0
    assert out.read_bytes() == reference

    # 2. A kill during a write: the file ends in the middle of a line, inside a batch.
    lines = reference.splitlines(keepends=True)
    for cut_line in (2, 3):  # first record of batch 2, and second record of batch 2
        cut = tmp_path / f"cut{cut_line}.jsonl"
        cut.write_bytes(b"".join(lines[:cut_line]) + lines[cut_line][: len(lines[cut_line]) // 2])
        shutil.copy(full.with_name(full.name + ".meta"), cut.with_name(cut.name + ".meta"))
        stats = _run(model, tok, convs, cut, sampling=sampling, seed=3)
        assert stats.discarded_partial_line and stats.already_done == cut_line
        # Cut inside batch 2 (lines 2-3), its written record is answered again, not written twice.
        assert stats.regenerated == cut_line - 2 and stats.written == 9 - cut_line
        assert cut.read_bytes() == reference

    # 3. Nothing left to do: the file is untouched.
    stats = _run(model, tok, convs, full, sampling=sampling, seed=3)
    assert stats.written == 0 and full.read_bytes() == reference


def test_a_grown_selection_answers_only_the_new_records(tmp_path, model, tok):
    """More prompts than the output was made for (the quickstart growing its data): the written
    records stay as they are and are not answered again; only the new ones are generated."""
    convs, _ = load_records(write_jsonl(tmp_path / "in.jsonl", alpaca_rows(9)))
    out = tmp_path / "o.jsonl"
    first = _run(model, tok, convs[:5], out)
    assert first.written == 5
    written = out.read_bytes()

    grown = _run(model, tok, convs, out)
    assert grown.already_done == 5 and grown.written == 4
    # Sorted by length, the 9 prompts' batches of 2 mix written and new records; none is redone.
    assert grown.regenerated == 0
    assert out.read_bytes().startswith(written)
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == list(range(9))


def test_resume_refuses_other_settings_and_foreign_files(tmp_path, model, tok):
    convs, _ = load_records(write_jsonl(tmp_path / "in.jsonl", alpaca_rows(3)))
    out = tmp_path / "o.jsonl"
    _run(model, tok, convs, out)
    with pytest.raises(DistillError, match=r"max_new_tokens: 8 in the existing output, 9 now"):
        _run(model, tok, convs, out, max_new_tokens=9)
    with pytest.raises(DistillError, match="temperature"):
        _run(model, tok, convs, out, sampling=SamplingParams(temperature=0.5))
    # batch size may change on resume (the answers stay valid)
    assert _run(model, tok, convs, out, batch_size=3).written == 0
    # overwrite starts again
    assert _run(model, tok, convs, out, max_new_tokens=9, overwrite=True).written == 3

    foreign = write_jsonl(tmp_path / "foreign.jsonl", [{"id": 0, "text": "x"}])
    with pytest.raises(DistillError, match=r"has no foreign\.jsonl\.meta"):
        _run(model, tok, convs, foreign)


def test_read_completed(tmp_path):
    path = tmp_path / "o.jsonl"
    assert read_completed(path) == ([], False)
    path.write_bytes(b'{"id": 1}\n{"id": "a"}\n{"id": 3, "ou')
    assert read_completed(path, repair=False) == (["1", "a"], True)
    assert path.read_bytes().endswith(b'"ou')  # not repaired
    assert read_completed(path) == (["1", "a"], True)
    assert path.read_bytes() == b'{"id": 1}\n{"id": "a"}\n'
    path.write_bytes(b'{"id": 1}\n{"id": 2, "x\n')  # a damaged last line with its newline
    assert read_completed(path) == (["1"], True)
    path.write_bytes(b'{"id": 1}\ngarbage\n{"id": 3}\n')
    with pytest.raises(DistillError, match=r"o\.jsonl:2: not a complete distilled record"):
        read_completed(path)


def test_seeded_sampling_is_reproducible(tmp_path, model, tok):
    convs, _ = load_records(write_jsonl(tmp_path / "in.jsonl", alpaca_rows(4)))
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    files = []
    for name, seed, batch in (("a", 1, 2), ("b", 1, 2), ("c", 2, 2), ("d", 1, 4)):
        out = tmp_path / f"{name}.jsonl"
        _run(model, tok, convs, out, sampling=sampling, seed=seed, batch_size=batch)
        files.append({json.loads(x)["id"]: x for x in out.read_text().splitlines()})
    assert files[0] == files[1]
    assert files[0] != files[2]
    # Per-record generators: another batch size gives the same answers (order aside).
    assert files[0] == files[3]


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def test_main_distill_skips_heldout_and_resumes(tmp_path, tiny_target_dir, capsys):
    src = write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows(12))
    out = tmp_path / "sd.jsonl"
    args = [
        "--input",
        str(src),
        "--output",
        str(out),
        "--target",
        str(tiny_target_dir),
        "--max-new-tokens",
        "4",
        "--batch-size",
        "4",
        "--no-progress",
        "--device",
        "cpu",
    ]
    assert main_distill(args) == 0
    ids = sorted(json.loads(x)["id"] for x in out.read_text().splitlines())
    assert ids == [i for i in range(12) if i % 10 != 9]  # the held-out id 9 is never answered
    err = capsys.readouterr()
    assert "split: train" in err.err and "11 of 11 records complete" in err.out
    assert main_distill(args) == 0
    assert "0 written now, 11 already there" in capsys.readouterr().out
    assert main_distill([*args, "--max-new-tokens", "5"]) == 2
    assert "other settings" in capsys.readouterr().err
    assert main_distill(["--output", str(out), "--batch-size", "0"]) == 2
    assert main_distill(["--output", str(out), "--input", str(tmp_path / "nope.jsonl")]) == 2


def test_prompt_tokens_are_counted(tmp_path, model, tok):
    # The summary's prompt token count (the --endpoint path reports the same number).
    convs, _ = load_records(write_jsonl(tmp_path / "in.jsonl", alpaca_rows(5)))
    stats = _run(model, tok, convs, tmp_path / "o.jsonl")
    want = sum(len(prompt_ids(tok, c.messages[0]["content"])) for c in convs)
    assert stats.prompt_tokens == want > 0


def test_main_distill_samples_several_answers_per_record(tmp_path, tiny_target_dir, capsys):
    """--samples N answers the selected records N times over, pass by pass, ids suffixed #sJ
    (each its own generator: the passes' answers differ), --answers keeps the first of them,
    and the split of integer-id records is written out; greedy repeats are refused."""
    src = write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows(12))
    out = tmp_path / "sampled.jsonl"
    args = ["--input", str(src), "--output", str(out), "--target", str(tiny_target_dir)]
    args += ["--max-new-tokens", "6", "--batch-size", "4", "--no-progress", "--device", "cpu"]
    args += ["--temperature", "1.0", "--seed", "1", "--limit", "5", "--samples", "3"]
    assert main_distill([*args, "--answers", "12"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    ids = sorted(r["id"] for r in rows)
    want = [f"{i}#s{j}" for j in (1, 2) for i in range(5)] + ["0#s3", "1#s3"]
    assert ids == sorted(want)
    assert all(r["split"] == "train" for r in rows)  # "3#s1" follows no id % 10 rule
    by_id = {r["id"]: r["output"] for r in rows}
    assert any(by_id[f"{i}#s1"] != by_id[f"{i}#s2"] for i in range(5))
    assert "5 records to answer, 3 answers each (12 in all)" in capsys.readouterr().err
    # A larger --answers extends the file (the quickstart growing its data).
    assert main_distill([*args, "--answers", "15"]) == 0
    assert len(out.read_text().splitlines()) == 15
    greedy = [a for a in args if a not in ("--temperature", "1.0")]
    assert main_distill([*greedy, "--output", str(tmp_path / "g.jsonl")]) == 2
    assert "samples: more than 1 answer per record needs --temperature > 0" in (
        capsys.readouterr().err
    )
