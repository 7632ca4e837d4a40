"""Tests for Magpie prompts (data.user_turn, prompt_filters, prompt_sources, magpie, prompts_command).

Covered: prefix derivation, filters, dedupe, determinism, resume.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from draftsmith.heads.sampling import SamplingParams
from draftsmith.train.data.chat import TemplateError
from draftsmith.train.data.files import DataFileError
from draftsmith.train.data.prompts import DEFAULT_PROMPTS
from draftsmith.train.data.records import load_records
from draftsmith.train.datagen.distill_command import main_distill
from draftsmith.train.datagen.magpie import MagpieError, make_prompts
from draftsmith.train.datagen.prompt_filters import FilterRules, PromptIndex, check_text, normalize
from draftsmith.train.datagen.prompt_sources import SeedPrompt, load_exclusions, load_seed_prompts
from draftsmith.train.datagen.prompts_command import main_prompts
from draftsmith.train.datagen.user_turn import user_turn_prefix
from draftsmith.train.runinfo import output_lock
from draftsmith.train.safety import OutputLockedError
from tests.conftest import byte_tokenizer, tiny_llama

MAX_NEW = 32
# A tiny random model that writes a-p and spaces and often ends its turn: about one candidate in
# six passes the default filters, so a handful of prompts takes a few batches.
ALPHABET = "abcdefghijklmnop"


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def writer(tok):
    return rigged_writer(tok)


def rigged_writer(tok):
    """Tiny Llama whose lm_head rows outside a-p, space and EOS point against the mean hidden
    state of the prefix (so those tokens are all but never drawn) and whose EOS row is zero
    (logit 0: a turn ends every few dozen tokens)."""
    m = tiny_llama(vocab_size=len(tok), init_std=0.1)
    m.generation_config.eos_token_id = [tok.eos_token_id]
    allowed = {tok.convert_tokens_to_ids(c) for c in ALPHABET} | {tok.convert_tokens_to_ids("Ġ")}
    with torch.no_grad():
        prefix = user_turn_prefix(tok).ids
        mean = m.model(torch.tensor([prefix])).last_hidden_state[0].mean(0)
        away = -30 * mean / mean.norm() ** 2
        for t in range(len(tok)):
            if t not in allowed:
                m.lm_head.weight[t] = away
        m.lm_head.weight[tok.eos_token_id] = 0
    return m


def run(model, tok, out, **kw):
    kw = {"num": 6, "max_new_tokens": MAX_NEW, "batch_size": 4, "progress": False, **kw}
    return make_prompts(model, tok, out, **kw)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


# --------------------------------------------------------------------------------------------
# The user-turn prefix
# --------------------------------------------------------------------------------------------


def test_prefix_of_chatml(tok):
    p = user_turn_prefix(tok)
    assert p.text == "<|im_start|>user\n"
    assert p.ids == tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    assert p.ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # parsed as the special token
    assert p.stop_ids == {tok.eos_token_id} and p.token_prefix
    assert {"<|im_start|>", "<|im_end|>"} <= set(p.markers)


def test_prefix_with_system_prompt(tok):
    p = user_turn_prefix(tok, system="Ask about cooking.")
    assert p.text == "<|im_start|>system\nAsk about cooking.<|im_end|>\n<|im_start|>user\n"
    # A template that injects its own default system prompt (as SmolLM2's does) keeps it.
    injecting = byte_tokenizer(
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe nice.<|im_end|>\n"
        "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert user_turn_prefix(injecting).text == (
        "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\n"
    )
    assert user_turn_prefix(injecting, "Terse.").text.startswith("<|im_start|>system\nTerse.")


def test_prefix_of_other_templates():
    # Llama-3 style: the user turn ends with <|eot_id|>, which is not the tokenizer's EOS.
    llama3 = byte_tokenizer(
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"
    )
    llama3.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    p = user_turn_prefix(llama3)
    assert p.text == "<|im_start|><|start_header_id|>user<|end_header_id|>\n\n"  # bos = im_start
    assert p.stop_ids == {llama3.eos_token_id, llama3.convert_tokens_to_ids("<|eot_id|>")}
    # A plain-text template: its role headers become markers a prompt must not contain.
    plain = byte_tokenizer(
        "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}"
    )
    p = user_turn_prefix(plain)
    assert p.text == "User: " and {"User:", "Assistant:"} <= set(p.markers)
    assert check_text("Tell me more. Assistant: sure", FilterRules(), p.markers) is not None
    # A template that never shows the user's message cannot be used.
    hiding = byte_tokenizer("{% for m in messages %}<|im_start|>{{ m['role'] }}{% endfor %}")
    with pytest.raises(TemplateError, match="verbatim exactly once"):
        user_turn_prefix(hiding)


# --------------------------------------------------------------------------------------------
# Filters and dedupe
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("How do I bake sourdough bread at home?", None),
        ("What is 2+2?", None),
        ("Solve 3x + 5 = 20 for x.", None),
        ("Hi there", "too short"),
        ("", "too short"),
        (" ".join(["word"] * 201), "too long"),
        ("?? 12345 !!! ### 9876 %% $$", "degenerate: few letters"),
        ("Tell me why the sky is blue. " * 4, "degenerate: repetition"),
        ("no no no no no no no no", "degenerate: repetition"),
        ("Write a poem<|im_start|>assistant\nSure", "degenerate: template marker"),
        ("Explain this code [INST] please now", "degenerate: template marker"),
        ("What does caf\ufffd mean in French?", "degenerate: broken text"),
    ],
)
def test_filters(tok, text, reason):
    assert check_text(text, FilterRules(), user_turn_prefix(tok).markers) == reason


def test_repetition_needs_three_occurrences_and_most_of_the_text():
    rules = FilterRules()
    # Twice, even if it is most of the text, is not a loop.
    assert check_text("what is the time and what is the time", rules) is None
    # Three times in a long prompt is a small share.
    long = "in the end " + " ".join(f"w{i}" for i in range(30)) + " in the end in the end"
    assert check_text(long, rules) is None
    assert check_text("in the end in the end in the end ok", rules) == "degenerate: repetition"


def test_word_limits_are_rules():
    assert check_text("one two", FilterRules(min_words=2)) is None
    assert check_text("one two three four", FilterRules(max_words=3)) == "too long"


def test_normalize_and_index():
    assert normalize("  What's   the TIME?! ") == "what s the time"
    index = PromptIndex(0.7)
    index.add("Can you explain the concept of photosynthesis in simple terms?", "a")
    assert index.match("can you EXPLAIN the concept of photosynthesis, in simple terms") == (
        "duplicate",
        "a",
    )
    # One word in ten changed: near-duplicate (trigram Jaccard 7/9).
    assert index.match("Can you explain the concept of photosynthesis in simple words?") == (
        "near-duplicate",
        "a",
    )
    # Another topic with the same opening words: kept.
    assert index.match("Can you explain the concept of inflation to a teenager?") is None
    # Short prompts are compared exactly.
    index.add("Hello there", "b")
    assert index.match("hello, there!") == ("duplicate", "b")
    assert index.match("hello you") is None
    assert PromptIndex(1.0).match("anything") is None


# --------------------------------------------------------------------------------------------
# Other sources
# --------------------------------------------------------------------------------------------


def test_shipped_and_user_sources(tmp_path):
    shipped = load_seed_prompts(DEFAULT_PROMPTS, id_prefix="shipped", source="shipped")
    train_ids = [r["id"] for r in records(DEFAULT_PROMPTS) if r["split"] == "train"]
    assert [s.id for s in shipped] == [f"shipped-{i}" for i in train_ids]
    heldout = load_exclusions(DEFAULT_PROMPTS)
    # Every user turn of a held-out record counts (some are multi-turn).
    assert heldout == [
        m["content"]
        for r in records(DEFAULT_PROMPTS)
        if r["split"] == "heldout"
        for m in r["messages"]
        if m["role"] == "user"
    ]
    assert not {s.prompt for s in shipped} & set(heldout)

    # Integer ids follow id % 10 == 9 = held-out; multi-turn records give their first user turn.
    user = write_jsonl(
        tmp_path / "u.jsonl",
        [
            {"id": 1, "instruction": "Name three rivers.", "input": "Europe"},
            {"id": 9, "instruction": "A held-out prompt"},
            {
                "id": 2,
                "messages": [
                    {"role": "system", "content": "Be terse."},
                    {"role": "user", "content": "First question here"},
                    {"role": "assistant", "content": "A"},
                    {"role": "user", "content": "Second"},
                ],
            },
        ],
    )
    with pytest.raises(
        DataFileError, match=r"u\.jsonl:3: field 'instruction'"
    ):  # one file, one shape
        load_seed_prompts(user, id_prefix="input0", source="u")
    user = write_jsonl(
        tmp_path / "u.jsonl",
        [
            {"id": 1, "prompt": "Name three rivers."},
            {"id": 9, "prompt": "A held-out prompt"},
            {"id": 2, "prompt": "First question here", "system": "Be terse."},
        ],
    )
    seeds = load_seed_prompts(user, id_prefix="input0", source="input:u")
    assert seeds == [
        SeedPrompt("input0-1", "Name three rivers.", "input:u"),
        SeedPrompt("input0-2", "First question here", "input:u", "Be terse."),
    ]
    # Without split information every record of an exclusion file counts.
    plain = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "A"}, {"prompt": "B"}])
    assert load_exclusions(plain) == ["A", "B"]


def test_dedupe_across_sources(tmp_path, writer, tok):
    # What the writer makes on its own.
    alone = tmp_path / "alone.jsonl"
    run(writer, tok, alone, num=3)
    made = [r["prompt"] for r in records(alone)]
    assert len(made) == 3

    seeds = [
        SeedPrompt("shipped-0", "How do I boil an egg well?", "shipped"),
        SeedPrompt("input0-a", "how do i BOIL an egg, well", "input:u"),  # duplicate
        SeedPrompt("input0-b", "Which planet is the largest one?", "input:u"),  # held-out
        SeedPrompt("input0-c", made[0].upper() + "!", "input:u"),  # the writer's first prompt
    ]
    out = tmp_path / "both.jsonl"
    stats = run(
        writer,
        tok,
        out,
        num=3,
        seeds=seeds,
        exclude=["Which planet is the largest one", made[1]],
    )
    recs = records(out)
    assert [r["id"] for r in recs[:2]] == ["shipped-0", "input0-c"]
    assert stats.seed_dropped == {"duplicate": 1, "held-out": 1}
    # The writer's first prompt is now a duplicate of a seed, its second one held out.
    assert stats.counts["duplicate"] >= 1 and stats.counts["held-out"] >= 1
    magpie = [r for r in recs if r["source"] == "magpie"]
    assert len(magpie) == 3 and made[0] not in [r["prompt"] for r in magpie]
    assert made[1] not in [r["prompt"] for r in magpie]
    assert made[2] in [r["prompt"] for r in magpie]
    # No two records of the output are duplicates of each other.
    index = PromptIndex()
    for r in recs:
        assert index.match(r["prompt"]) is None
        index.add(r["prompt"], r["id"])


# --------------------------------------------------------------------------------------------
# The run: output, determinism, resume
# --------------------------------------------------------------------------------------------


def test_output_is_a_prompt_file_distill_reads(tmp_path, writer, tok):
    out = tmp_path / "p.jsonl"
    stats = run(writer, tok, out, seeds=[SeedPrompt("shipped-0", "Hello there, how are you?", "s")])
    recs = records(out)
    assert stats.made == 6 and stats.seeds == 1 and len(recs) == 7
    assert stats.counts["kept"] == 6 and sum(stats.counts.values()) > 6  # some were dropped
    for r in recs[1:]:
        assert r["source"] == "magpie" and r["seed"] == 0 and r["split"] == "train"
        assert r["id"] == f"magpie-0-{r['index']}"
        assert check_text(r["prompt"], FilterRules()) is None
    convs, _ = load_records(out)
    assert [c.shape for c in convs] == ["prompt"] * 7 and {c.split for c in convs} == {"train"}
    assert convs[1].messages == [{"role": "user", "content": recs[1]["prompt"]}]
    meta = json.loads(out.with_name("p.jsonl.meta").read_text())
    assert meta["complete"] and meta["settings"]["seed"] == 0


def test_same_seed_same_file_at_any_batch_size(tmp_path, writer, tok):
    ref = tmp_path / "ref.jsonl"
    assert not run(writer, tok, ref, seed=5, num=4).exhausted
    assert len(records(ref)) == 4
    for name, kw in (("again", {}), ("b1", {"batch_size": 1}), ("b3", {"batch_size": 3})):
        out = tmp_path / f"{name}.jsonl"
        run(writer, tok, out, seed=5, num=4, **kw)
        assert out.read_bytes() == ref.read_bytes(), name
    other = tmp_path / "other.jsonl"
    run(writer, tok, other, seed=6, num=4)
    texts = {r["prompt"] for r in records(other)}
    assert not texts & {r["prompt"] for r in records(ref)}


def test_a_system_prompt_is_written_into_the_records(tmp_path, writer, tok):
    out = tmp_path / "s.jsonl"
    run(writer, tok, out, num=2, system="Ask about maps.")
    assert {r["system"] for r in records(out)} == {"Ask about maps."}


class Kill(Exception):
    pass


def test_kill_and_resume_is_byte_identical(tmp_path, writer, tok):
    seeds = [SeedPrompt(f"s-{i}", f"Seed prompt number {i} is here", "s") for i in range(3)]
    kw = {"num": 8, "seeds": seeds, "seed": 2}
    full = tmp_path / "full.jsonl"
    ref_counts = run(writer, tok, full, **kw).counts
    reference = full.read_bytes()
    lines = reference.splitlines(keepends=True)
    assert len(lines) == 11
    meta = full.with_name(full.name + ".meta")

    # 1. A kill between batches.
    out = tmp_path / "killed.jsonl"

    def kill_after_two(n: int) -> None:
        if n == 2:
            raise Kill

    with pytest.raises(Kill):
        run(writer, tok, out, on_batch=kill_after_two, **kw)
    assert 3 <= len(out.read_bytes().splitlines()) < 11
    stats = run(writer, tok, out, **kw)
    assert out.read_bytes() == reference and stats.counts == ref_counts

    # 2. A kill mid-write (file cut mid-line), or records lost at the end; the meta file of
    # the finished run says more than the output holds. Cuts inside the sources' block too.
    for n_lines, half in ((6, True), (10, False), (4, False), (1, True)):
        cut = tmp_path / f"cut{n_lines}{half}.jsonl"
        tail = lines[n_lines][: len(lines[n_lines]) // 2] if half else b""
        cut.write_bytes(b"".join(lines[:n_lines]) + tail)
        shutil.copy(meta, cut.with_name(cut.name + ".meta"))
        stats = run(writer, tok, cut, **kw)
        assert stats.discarded_partial_line == half
        assert cut.read_bytes() == reference, (n_lines, half)
        assert stats.counts == ref_counts and stats.counts_complete

    # 3. Nothing left to do: the file is untouched; a larger num extends it.
    before = full.stat().st_mtime_ns
    assert run(writer, tok, full, **kw).written == 0
    assert full.read_bytes() == reference and full.stat().st_mtime_ns == before
    stats = run(writer, tok, full, **{**kw, "num": 9})
    assert stats.written == 1 and full.read_bytes().startswith(reference)


def test_resume_refuses_other_settings_and_foreign_files(tmp_path, writer, tok):
    out = tmp_path / "o.jsonl"
    run(writer, tok, out, num=2)
    with pytest.raises(MagpieError, match=r"max_new_tokens: 32 in the existing output, 31 now"):
        run(writer, tok, out, num=2, max_new_tokens=31)
    with pytest.raises(MagpieError, match="top_p"):
        run(writer, tok, out, num=2, sampling=SamplingParams(temperature=1.0, top_p=0.5))
    with pytest.raises(MagpieError, match="sources"):
        run(writer, tok, out, num=2, seeds=[SeedPrompt("x", "Some other prompt here", "s")])
    assert run(writer, tok, out, num=2, batch_size=3).written == 0  # batch size may change
    assert run(writer, tok, out, num=2, seed=1, overwrite=True).written == 2

    foreign = write_jsonl(tmp_path / "foreign.jsonl", [{"id": 0, "prompt": "x"}])
    with pytest.raises(MagpieError, match=r"has no foreign\.jsonl\.meta"):
        run(writer, tok, foreign, num=1)
    out.write_text(out.read_text() + '{"id": "z", "prompt": "a b c"}\n')
    with pytest.raises(MagpieError, match=r"o\.jsonl:3: not a Magpie prompt record"):
        run(writer, tok, out, num=2, seed=1)


def test_a_second_writer_is_refused(tmp_path, writer, tok):
    out = tmp_path / "o.jsonl"
    with output_lock(out, "prompts run"), pytest.raises(OutputLockedError) as err:
        run(writer, tok, out, num=1)
    assert f"PID {os.getpid()}" in str(err.value)
    assert not out.exists()


def test_exhausted_attempts_stop_and_resume(tmp_path, writer, tok):
    out = tmp_path / "o.jsonl"
    stats = run(writer, tok, out, num=6, max_attempts=8)
    assert stats.exhausted and stats.made < 6 and sum(stats.counts.values()) == 8
    stats = run(writer, tok, out, num=6)
    assert not stats.exhausted and stats.made == 6
    ref = tmp_path / "ref.jsonl"
    run(writer, tok, ref, num=6)
    assert out.read_bytes() == ref.read_bytes()


def test_a_time_limit_stops_with_what_was_made_and_resumes(tmp_path, writer, tok):
    """max_seconds (the quickstart's share of its budget): the run stops between batches once
    past it, keeps what it made, records why in its meta, and a rerun without it finishes the
    same file a run without a limit writes."""
    from draftsmith.train.datagen.resumable import meta_file

    out = tmp_path / "o.jsonl"
    stats = run(writer, tok, out, num=6, max_seconds=0.0)  # one batch of 4, then the limit
    assert stats.time_limited and not stats.exhausted
    assert stats.made < 6 and sum(stats.counts.values()) == 4
    meta = json.loads(meta_file(out).read_text())
    assert meta["stopped"] == "max_seconds" and meta["complete"] is False
    stats = run(writer, tok, out, num=6)
    assert not stats.time_limited and stats.made == 6
    assert "stopped" not in json.loads(meta_file(out).read_text())
    ref = tmp_path / "ref.jsonl"
    run(writer, tok, ref, num=6)
    assert out.read_bytes() == ref.read_bytes()


def test_greedy_is_refused(tmp_path, writer, tok):
    with pytest.raises(ValueError, match="sampling"):
        run(writer, tok, tmp_path / "o.jsonl", sampling=SamplingParams())


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.startswith("error")]
    assert len(lines) == 1, err
    return err[err.index("error") :]


def test_cli_errors_are_one_named_line(tmp_path, capsys):
    assert main_prompts(["--num", "3"]) == 2
    assert "output: required" in _error_line(capsys)
    assert main_prompts(["--output", str(tmp_path / "o.jsonl"), "--batch-size", "0"]) == 2
    assert "batch_size: must be >= 1" in _error_line(capsys)
    assert main_prompts(["--output", str(tmp_path / "o.jsonl"), "--temperature", "0"]) == 2
    assert "temperature" in _error_line(capsys)
    missing = tmp_path / "nope.jsonl"
    assert main_prompts(["--output", str(tmp_path / "o.jsonl"), "--input", str(missing)]) == 2
    assert "nope.jsonl" in _error_line(capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    assert main_prompts(["--output", str(tmp_path / "o.jsonl"), "--exclude", str(bad)]) == 2
    assert re.search(r"bad\.jsonl:2: field 'prompt'", _error_line(capsys))
    assert main_prompts(["--output", str(tmp_path / "o.jsonl"), "--num", "0"]) == 2
    assert "nothing to do" in _error_line(capsys)


def test_cli_combines_and_distill_answers(tmp_path, tiny_target_dir, capsys):
    user = write_jsonl(tmp_path / "mine.jsonl", [{"prompt": "Name a red fruit, please."}])
    out = tmp_path / "prompts.jsonl"
    base = ["--output", str(out), "--target", str(tiny_target_dir), "--device", "cpu"]
    args = [*base, "--num", "0", "--include-shipped", "--input", str(user), "--no-progress"]
    assert main_prompts(args) == 0
    recs = records(out)
    shipped_train = sum(r["split"] == "train" for r in records(DEFAULT_PROMPTS))
    assert sum(r["source"] == "shipped" for r in recs) <= shipped_train
    assert recs[-1] == {
        "id": f"input0-{user}:1",
        "prompt": "Name a red fruit, please.",
        "source": f"input:{user}",
        "split": "train",
    }
    assert "answer them with: draftsmith data distill" in capsys.readouterr().out
    # The file is what `draftsmith data distill --input` answers.
    sd = tmp_path / "sd.jsonl"
    distill = ["--input", str(out), "--output", str(sd), "--target", str(tiny_target_dir)]
    distill += ["--max-new-tokens", "2", "--limit", "3", "--no-progress", "--device", "cpu"]
    assert main_distill(distill) == 0
    assert len(records(sd)) == 3

    # The random tiny target never ends a user turn in 4 tokens: the run stops, named, exit 1.
    args = [*base, "--num", "2", "--max-new-tokens", "4", "--max-attempts", "3", "--no-progress"]
    capsys.readouterr()
    assert main_prompts([*args, "--output", str(tmp_path / "m.jsonl")]) == 1
    assert "made 0 of 2 Magpie prompts before max_attempts" in _error_line(capsys)

    # A time limit is not a failure: exit 0 with what was made, and how to make the rest.
    args = [*base, "--num", "2", "--max-new-tokens", "4", "--no-progress"]
    capsys.readouterr()
    code = main_prompts([*args, "--max-minutes", "1e-9", "--output", str(tmp_path / "t.jsonl")])
    assert code == 0  # one batch: the random target ends no turn in 4 tokens, so 0 made
    assert "stopped at --max-minutes 1e-09 with 0 of 2 Magpie prompts" in capsys.readouterr().out


def test_cli_refuses_a_locked_output(tmp_path, tiny_target_dir, capsys):
    out = tmp_path / "o.jsonl"
    with output_lock(out, "prompts run"):
        code = main_prompts(["--output", str(out), "--target", str(tiny_target_dir)])
    assert code == 1
    assert f"in use by another prompts run (PID {os.getpid()})" in _error_line(capsys)
