"""Errors, not tracebacks: random malformed configs, records and checkpoints fed to the CLI.

Every case is certain to be wrong (a bad record or an unusable checkpoint is always present), so
each run must end with exit code 1 or 2 and a named ``error: ...`` on stderr -- never a
traceback. The entry points run in-process (``draftsmith.recipes.cli.main``) on a tiny target.
Examples are derandomized so the default suite is reproducible; raise ``max_examples`` locally
to search further.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftsmith.recipes.cli import TRAIN_RECIPES
from draftsmith.recipes.cli import main as cli
from draftsmith.train.data.tokenize import TokenizeConfig
from draftsmith.train.datagen.distill_command import SelfDistillConfig
from draftsmith.train.export.command import FORMATS, ExportConfig
from draftsmith.train.features.cache_command import CacheConfig
from draftsmith.train.features.vocab_command import VocabConfig
from tests.conftest import tiny_model_dir

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Fields left out of the random configs: they change this test process itself (torch threads)
# or start expensive machinery (worker processes, device maps) -- not what is probed here.
EXCLUDED = {"threads", "num_proc", "device_map"}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("target"))


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _run(argv: list[str], capsys) -> tuple[int, list[str], str]:
    """Exit code, the stderr lines that are not progress bars, and the raw stderr."""
    capsys.readouterr()
    code = cli([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    return code, [line for line in lines if "it/s]" not in line], err


def _assert_named_error(code: int, lines: list[str], err: str, *names: str) -> None:
    """Exit 1 or 2 and one ``error:`` line naming one of ``names``; a config error lists its
    problems (and a YAML parser the position) on a few lines after it. Nothing that looks like
    a traceback."""
    assert code in (1, 2), (code, err)
    assert "Traceback" not in err and not re.search(r'^\s*File ".*", line \d+', err, re.M), err
    errors = [i for i, line in enumerate(lines) if line.startswith("error")]
    assert len(errors) == 1 and len(lines) - errors[0] <= 16, err
    text = "\n".join(lines[errors[0] :])
    assert any(name in text for name in names), (names, err)


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _config_text(cls: type) -> st.SearchStrategy[str]:
    """YAML text: a mapping of real or made-up field names to random values, or junk text."""
    names = sorted({f.name for f in dataclasses.fields(cls)} - EXCLUDED)
    keys = st.sampled_from(names) | st.text(min_size=1, max_size=10)
    mapping = st.dictionaries(keys, _values, max_size=5).map(
        lambda d: yaml.safe_dump(d, allow_unicode=True)
    )
    return st.one_of(mapping, mapping, st.text(max_size=40))


_word = st.text(alphabet="abcdefgh xyz?!", min_size=1, max_size=12)


@st.composite
def _bad_chat_line(draw) -> str:
    """One line that ``load_records`` must reject (or a prompt with no answer: nothing to train)."""
    kind = draw(st.integers(0, 7))
    if kind == 0:  # not JSON
        return draw(st.sampled_from(['{"messages": [', "{'prompt': 'x'}", "nan", "{"])) + draw(
            _word
        )
    if kind == 1:  # JSON, not an object
        return json.dumps(draw(st.one_of(_scalars, st.lists(_scalars, max_size=3))))
    if kind == 2:  # an object of no known shape
        return json.dumps(draw(st.dictionaries(st.sampled_from(["foo", "msg", "q", "x"]), _values)))
    if kind == 3:  # a known field of the wrong type
        field = draw(st.sampled_from(["messages", "conversations", "instruction", "prompt"]))
        value = draw(
            st.one_of(
                st.integers(),
                st.lists(st.integers(), min_size=1, max_size=3),
                st.dictionaries(_word, _word, min_size=1, max_size=2),
            )
        )
        return json.dumps({field: value})
    if kind == 4:  # an unknown role, or roles out of order
        role = draw(st.sampled_from(["robot", "assistant", "system", ""]))
        turns = [{"role": role, "content": draw(_word)}, {"role": "system", "content": "s"}]
        return json.dumps({"messages": turns})
    if kind == 5:  # an empty field
        return json.dumps(
            draw(st.sampled_from([{"prompt": ""}, {"instruction": " "}, {"messages": []}]))
        )
    if kind == 6:  # a message that is not an object / lacks content
        return json.dumps({"messages": [draw(st.sampled_from([1, "hi", {"role": "user"}]))]})
    return json.dumps({"prompt": draw(_word)})  # a prompt without an answer


@st.composite
def _chat_file(draw, prompts_ok: bool) -> str:
    """JSONL whose every line is rejected (``prompts_ok``: or is an unanswered prompt)."""
    lines = draw(st.lists(_bad_chat_line(), min_size=1, max_size=4))
    if not prompts_ok:
        # distill answers prompts, so an answerable line would make a valid file
        lines = [
            line if not line.startswith('{"prompt": "') or line == '{"prompt": ""}' else "["
            for line in lines
        ]
    return "".join(line + "\n" for line in lines)


def _good_tokens(draw) -> dict:
    n = draw(st.integers(1, 6))
    return {
        "input_ids": draw(st.lists(st.integers(0, 63), min_size=n, max_size=n)),
        "loss_mask": draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
    }


@st.composite
def _token_file(draw, command: str) -> str:
    """Tokenized-data JSONL with at least one sample the command must refuse."""
    lines = [json.dumps(_good_tokens(draw)) for _ in range(draw(st.integers(0, 3)))]
    kinds = ["not json", "not object", "missing", "wrong type", "lengths"]
    kinds += ["out of vocab", "empty", "mask value"] if command == "cache" else ["out of vocab"]
    kind = draw(st.sampled_from(kinds))
    sample = _good_tokens(draw)
    if kind == "not json":
        bad = draw(st.sampled_from(['{"input_ids": [1, 2', "{input_ids: []}", "]"]))
    elif kind == "not object":
        bad = json.dumps(draw(st.one_of(st.integers(), st.lists(st.integers(), max_size=3))))
    elif kind == "missing":
        sample.pop(draw(st.sampled_from(["input_ids", "loss_mask"])))
        bad = json.dumps(sample)
    elif kind == "wrong type":
        field = draw(st.sampled_from(["input_ids", "loss_mask"]))
        sample[field] = draw(st.sampled_from(["abc", [1.5, 2.5], [[1], [2]], {"a": 1}, [None]]))
        bad = json.dumps(sample)
    elif kind == "lengths":
        sample["loss_mask"] = sample["loss_mask"] + [1]
        bad = json.dumps(sample)
    elif kind == "out of vocab":
        # vocab counts supervised positions only, so the bad id is supervised
        sample["input_ids"][-1] = draw(st.sampled_from([-1, 10**6]))
        sample["loss_mask"][-1] = 1
        bad = json.dumps(sample)
    elif kind == "empty":
        bad = json.dumps({"input_ids": [], "loss_mask": []})
    else:
        sample["loss_mask"][0] = 2
        bad = json.dumps(sample)
    lines.insert(draw(st.integers(0, len(lines))), bad)
    return "".join(line + "\n" for line in lines)


# --------------------------------------------------------------------------------------------
# Random configs
# --------------------------------------------------------------------------------------------

_CONFIG_CASES = {
    "tokenize": (
        TokenizeConfig,
        lambda d, t: [
            "data",
            "tokenize",
            "--input",
            d / "bad.jsonl",
            "--output",
            d / "out",
            "--target",
            t,
        ],
    ),
    "distill": (
        SelfDistillConfig,
        lambda d, t: [
            "data",
            "distill",
            "--input",
            d / "bad.jsonl",
            "--output",
            d / "sd.jsonl",
            "--target",
            t,
            "--no-progress",
        ],
    ),
    "cache": (
        CacheConfig,
        lambda d, t: [
            "data",
            "cache",
            "--data",
            d / "bad.jsonl",
            "--out",
            d / "c",
            "--target",
            t,
            "--no-progress",
        ],
    ),
    "vocab": (
        VocabConfig,
        lambda d, t: [
            "data",
            "vocab",
            "--data",
            d / "bad.jsonl",
            "--out",
            d / "v.safetensors",
            "--target",
            t,
        ],
    ),
    "export": (
        ExportConfig,
        lambda d, t: [
            "export",
            "--checkpoint",
            d / "no_checkpoint",
            "--out",
            d / "e",
            "--target",
            t,
        ],
    ),
}


@pytest.mark.parametrize("command", list(_CONFIG_CASES))
def test_random_configs_give_a_named_error(command, target_dir, capsys, monkeypatch):
    cls, argv_for = _CONFIG_CASES[command]
    # The data is malformed too, so a config that happens to be valid still fails, by name.
    data = _token_file(command) if command in ("cache", "vocab") else _chat_file(prompts_ok=False)

    @SETTINGS
    @given(config=_config_text(cls), records=data)
    def check(config: str, records: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            monkeypatch.chdir(d)  # a relative path in a random config lands here
            (d / "bad.jsonl").write_text(records)
            (d / "cfg.yaml").write_text(config)
            code, lines, err = _run([*argv_for(d, target_dir), "--config", d / "cfg.yaml"], capsys)
            _assert_named_error(
                code, lines, err, "cfg.yaml", "bad.jsonl", "no_checkpoint", "sample "
            )

    check()


# --------------------------------------------------------------------------------------------
# Random records
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(records=_chat_file(prompts_ok=True))
def test_tokenize_random_malformed_records(records, target_dir, capsys):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chats.jsonl"
        path.write_text(records)
        argv = [
            "data",
            "tokenize",
            "--input",
            path,
            "--output",
            Path(tmp) / "out",
            "--target",
            target_dir,
        ]
        code, lines, err = _run(argv, capsys)
        _assert_named_error(code, lines, err, f"{path}:", f"{path}: no sample left")
        assert code == 2 and not (Path(tmp) / "out").exists()


@SETTINGS
@given(records=_chat_file(prompts_ok=False))
def test_distill_random_malformed_records(records, target_dir, capsys):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.jsonl"
        path.write_text(records)
        argv = [
            "data",
            "distill",
            "--input",
            path,
            "--output",
            Path(tmp) / "sd.jsonl",
            "--target",
            target_dir,
            "--no-progress",
        ]
        code, lines, err = _run(argv, capsys)
        _assert_named_error(code, lines, err, f"{path}:")
        assert code == 2 and not (Path(tmp) / "sd.jsonl").exists()


@pytest.mark.parametrize("command", ["cache", "vocab"])
def test_cache_and_vocab_random_malformed_tokens(command, target_dir, capsys):
    @settings(SETTINGS, max_examples=25)
    @given(records=_token_file(command))
    def check(records: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "tok.jsonl"
            path.write_text(records)
            out = Path(tmp) / ("c" if command == "cache" else "v.safetensors")
            argv = ["data", command, "--data", path, "--out", out, "--target", target_dir]
            code, lines, err = _run(
                [*argv, *(["--no-progress"] if command == "cache" else [])], capsys
            )
            _assert_named_error(code, lines, err, str(path), "sample ")
            assert code == 2 and not list(out.parent.glob("shard-*"))

    check()


@SETTINGS
@given(
    fmt=st.sampled_from(FORMATS),
    config=st.one_of(
        st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
        st.dictionaries(st.text(max_size=8), _values, max_size=4).map(json.dumps),
        st.dictionaries(
            st.sampled_from(["version", "hidden_size", "vocab_size", "num_heads"]),
            _values,
            max_size=4,
        ).map(lambda d: json.dumps({"draftsmith_format": "eagle-drafter", **d})),
    ),
    weights=st.binary(max_size=64),
)
def test_export_random_broken_checkpoints(fmt, config, weights, target_dir, capsys):
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, out = Path(tmp) / "ckpt", Path(tmp) / "out"
        ckpt.mkdir()
        (ckpt / "config.json").write_text(config)
        (ckpt / "model.safetensors").write_bytes(weights)
        argv = [
            "export",
            "--format",
            fmt,
            "--checkpoint",
            ckpt,
            "--out",
            out,
            "--target",
            target_dir,
        ]
        code, lines, err = _run(argv, capsys)
        _assert_named_error(code, lines, err, str(ckpt))
        assert code == 2 and not out.exists()
        assert [p.name for p in Path(tmp).iterdir() if p.name.startswith(".")] == []


# --------------------------------------------------------------------------------------------
# --debug and the help text
# --------------------------------------------------------------------------------------------


def test_debug_shows_the_traceback_and_help_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_DEBUG", raising=False)
    argv = ["data", "vocab", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "v")]
    assert cli(argv) == 2
    assert _run(argv, capsys)[1] == [
        f"error: data: {tmp_path / 'nope'} not found (a hidden-state cache from `draftsmith data "
        "cache`, or tokenized data from `draftsmith data tokenize`)"
    ]
    from draftsmith.train.data.tokens import TokenDataError

    with pytest.raises(TokenDataError):  # --debug anywhere: the exception propagates
        cli(["--debug", *argv])
    assert "DRAFTSMITH_DEBUG" not in os.environ  # restored after the call
    monkeypatch.setenv("DRAFTSMITH_DEBUG", "1")
    with pytest.raises(TokenDataError):
        cli(argv)
    assert cli(["--help"]) == 0
    assert "--debug" in capsys.readouterr().out


def _first_example(module: str) -> str:
    """The first command line of a module docstring's ``Launch::`` (or ``Usage::``) block."""
    doc = importlib.import_module(module).__doc__
    block = doc.split("::\n", 1)[1]
    return next(line.strip() for line in block.splitlines() if line.strip())


@pytest.mark.parametrize(
    ("argv", "module"),
    [
        (["evaluate"], "draftsmith.recipes.evaluate"),
        (["quickstart"], "draftsmith.recipes.quickstart"),
        (["train", "eagle"], "draftsmith." + TRAIN_RECIPES["eagle"].module),
        (["train", "medusa"], "draftsmith." + TRAIN_RECIPES["medusa"].module),
        (["export"], "draftsmith.train.export.command"),
    ],
)
def test_help_prints_launch_examples_line_by_line(argv, module, capsys, monkeypatch):
    """``--help`` shows a docstring's launch examples as written, each on its own line (argparse's
    default formatter ran them into the prose as one paragraph); prose is still wrapped."""
    monkeypatch.setenv("COLUMNS", "80")  # narrower than the examples: they are not re-wrapped
    with pytest.raises(SystemExit) as exit_:
        cli([*argv, "--help"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert _first_example(module) in [line.strip() for line in lines]
    if argv == ["quickstart"]:
        assert "    draftsmith quickstart --budget-minutes 120 --prompts my_prompts.jsonl" in lines
        prose = [line for line in lines if line.startswith("The main job, end to end")]
        assert prose and len(prose[0]) <= 80
