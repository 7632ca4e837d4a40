"""Tests for draftsmith.train.config: defaults, YAML, CLI, validation, round trip."""

# RUF009 cannot see that cfg_field returns a dataclasses.field; the project-wide fix is
# `[tool.ruff.lint.flake8-bugbear] extend-immutable-calls = ["draftsmith.train.config.cfg_field"]`.

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.train.config import (
    ConfigError,
    add_config_arguments,
    cfg_field,
    config_from_args,
    config_to_dict,
    dump_config,
    load_config,
    parse_config,
)


@dataclass
class ModelCfg:
    dim: int = cfg_field(64, help="hidden size")
    act: Literal["relu", "gelu"] = cfg_field("gelu", help="activation")


@dataclass
class TrainCfg:
    lr: float = cfg_field(3e-4, help="peak learning rate (5% warmup)")
    steps: int = cfg_field(100, help="optimizer steps")
    name: str = cfg_field("run", help="run name")
    optimizer: str = cfg_field("adamw", help="optimizer", choices=["adamw", "sgd"])
    precision: Literal["fp32", "bf16"] = cfg_field("bf16", help="training precision")
    compile: bool = cfg_field(False, help="torch.compile the draft")
    layers: list[int] = cfg_field([1, 2], help="layers to tap")
    tags: list[str] = cfg_field(default_factory=list, help="W&B tags")
    shape: tuple[int, ...] = cfg_field((2, 3), help="shape")
    out_dir: Path = cfg_field(Path("runs"), help="output directory")
    resume: Path | None = cfg_field(None, help="checkpoint to resume from")
    seed: int | None = cfg_field(None, help="random seed")
    model: ModelCfg = field(default_factory=ModelCfg, metadata={"help": "draft model"})

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.lr <= 0:
            problems.append(("lr", "must be > 0"))
        if self.steps < 1:
            problems.append(("steps", "must be >= 1"))
        return problems


@dataclass
class StrValidated:
    batch: int = cfg_field(8, help="batch size")

    def validate(self) -> list[str]:
        return ["batch: must be even"] if self.batch % 2 else []


@dataclass
class Required:
    target: str = cfg_field(help="target model id")
    n: int = cfg_field(1, help="count")


def write_yaml(tmp_path: Path, data, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def problem_fields(err: pytest.ExceptionInfo) -> list[str]:
    return [f for f, _ in err.value.problems]


def test_defaults():
    cfg = load_config(TrainCfg)
    assert cfg == TrainCfg()
    assert cfg.lr == 3e-4 and cfg.layers == [1, 2] and cfg.model.dim == 64
    assert TrainCfg().layers is not TrainCfg().layers  # list default is copied per instance


def test_yaml_overrides_only_given_fields(tmp_path):
    path = write_yaml(tmp_path, {"lr": 1, "name": "x", "model": {"dim": 128}})
    cfg = load_config(TrainCfg, path)
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # int accepted for float
    assert cfg.name == "x"
    assert cfg.model == ModelCfg(dim=128, act="gelu")
    assert cfg.steps == 100 and cfg.out_dir == Path("runs")


def test_yaml_float_written_as_1e_minus_4(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-4\n")  # PyYAML loads this as the string "1e-4"
    assert load_config(TrainCfg, path).lr == pytest.approx(1e-4)


def test_cli_overrides_yaml(tmp_path):
    path = write_yaml(tmp_path, {"lr": 0.5, "steps": 7, "model": {"dim": 16}})
    cfg = parse_config(TrainCfg, ["--config", str(path), "--lr", "0.01", "--model.dim", "32"])
    assert cfg.lr == 0.01
    assert cfg.steps == 7  # from YAML, not overridden
    assert cfg.model.dim == 32


def test_unknown_yaml_key_suggests_closest_field(tmp_path):
    path = write_yaml(tmp_path, {"learning_rat": 0.1, "stepz": 3, "model": {"dimm": 3}})
    with pytest.raises(ConfigError) as err:
        load_config(TrainCfg, path)
    problems = dict(err.value.problems)
    assert "did you mean 'steps'?" in problems["stepz"]
    assert "did you mean 'dim'?" in problems["model.dimm"]
    assert problems["learning_rat"].startswith("unknown field")


def test_several_bad_fields_one_error(tmp_path):
    path = write_yaml(
        tmp_path,
        {"lr": "fast", "steps": 1.5, "compile": "yes", "layers": [1, "a"], "name": 3},
    )
    with pytest.raises(ConfigError) as err:
        load_config(TrainCfg, path)
    assert sorted(problem_fields(err)) == ["compile", "layers", "lr", "name", "steps"]
    message = str(err.value)
    assert str(path) in message.splitlines()[0]
    for line in ("  lr: expected float", "  steps: expected int", "  layers: item 1:"):
        assert line in message
    assert "compile: expected bool" in message  # only real bools in YAML


def test_literal_and_choices(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(TrainCfg, overrides={"precision": "fp16", "optimizer": "adam"})
    problems = dict(err.value.problems)
    assert "one of ['fp32', 'bf16']" in problems["precision"]
    assert "one of ['adamw', 'sgd']" in problems["optimizer"]
    cfg = load_config(TrainCfg, write_yaml(tmp_path, {"precision": "fp32", "optimizer": "sgd"}))
    assert (cfg.precision, cfg.optimizer) == ("fp32", "sgd")
    with pytest.raises(SystemExit):  # argparse rejects a value outside the choices
        parse_config(TrainCfg, ["--precision", "fp16"])


def test_bool_flags():
    assert parse_config(TrainCfg, ["--compile"]).compile is True
    assert parse_config(TrainCfg, ["--no-compile"]).compile is False
    assert parse_config(TrainCfg, []).compile is False
    assert load_config(TrainCfg, overrides={"compile": "yes"}).compile is True
    assert load_config(TrainCfg, overrides={"compile": "0"}).compile is False
    with pytest.raises(ConfigError, match="compile: expected bool"):
        load_config(TrainCfg, overrides={"compile": "maybe"})


def test_list_fields(tmp_path):
    cfg = parse_config(TrainCfg, ["--layers", "3", "5", "7", "--tags", "a", "b", "--shape", "4"])
    assert cfg.layers == [3, 5, 7] and cfg.tags == ["a", "b"] and cfg.shape == (4,)
    cfg = load_config(TrainCfg, write_yaml(tmp_path, {"shape": [1, 2, 3]}))
    assert cfg.shape == (1, 2, 3)
    with pytest.raises(ConfigError, match="layers: item 1"):
        parse_config(TrainCfg, ["--layers", "3", "x"])
    with pytest.raises(ConfigError, match="layers: expected a list"):
        load_config(TrainCfg, write_yaml(tmp_path, {"layers": 3}))


def test_path_and_optional(tmp_path):
    cfg = load_config(TrainCfg, write_yaml(tmp_path, {"out_dir": "/tmp/x", "resume": "ck.pt"}))
    assert cfg.out_dir == Path("/tmp/x") and cfg.resume == Path("ck.pt")
    assert load_config(TrainCfg, write_yaml(tmp_path, {"seed": None})).seed is None
    cfg = parse_config(TrainCfg, ["--seed", "5", "--resume", "none"])
    assert cfg.seed == 5 and cfg.resume is None
    with pytest.raises(ConfigError, match="seed: expected int"):
        parse_config(TrainCfg, ["--seed", "five"])
    with pytest.raises(ConfigError, match="out_dir: expected Path"):
        load_config(TrainCfg, write_yaml(tmp_path, {"out_dir": 3}))


def test_three_flag_problems_at_once_one_error(tmp_path):
    """A misspelled flag no longer stops argparse before the other checks: with a wrong type
    (in the YAML and on a flag) and an out-of-range value, every problem is in one error."""
    path = write_yaml(tmp_path, {"name": 3})
    argv = ["--config", str(path), "--stpes", "10", "--seed", "abc", "--lr", "-1"]
    with pytest.raises(ConfigError) as err:
        parse_config(TrainCfg, argv, prog="train")
    assert err.value.problems == [
        ("--stpes", "unknown flag (did you mean --steps?)"),
        ("name", "expected str, got int 3"),
        ("seed", "expected int, got str 'abc' (or None)"),
        ("lr", "must be > 0"),
    ]  # "10", the misspelled flag's value, is not reported as a stray argument
    assert str(err.value).splitlines()[0] == f"invalid TrainCfg (from {path}): 4 problems"


def test_misspelled_flag_did_you_mean(capsys):
    with pytest.raises(ConfigError) as err:
        parse_config(TrainCfg, ["--stpes=10", "--out_dir", "x", "--model.dimm", "8", "--zzqx"])
    assert err.value.problems == [
        ("--stpes", "unknown flag (did you mean --steps?)"),
        ("--out_dir", "unknown flag (did you mean --out-dir?)"),
        ("--model.dimm", "unknown flag (did you mean --model.dim?)"),
        ("--zzqx", "unknown flag (--help lists the flags)"),
    ]
    assert "  --stpes: unknown flag (did you mean --steps?)" in str(err.value).splitlines()
    with pytest.raises(ConfigError) as err:  # arguments no flag takes are named too
        parse_config(TrainCfg, ["--compile", "yes", "--steps", "3", "extra", "--lr", "-2"])
    assert err.value.problems == [
        ("yes", "unexpected argument (--compile takes no value)"),
        ("extra", "unexpected argument (no flag takes it)"),
        ("lr", "must be > 0"),
    ]
    # argparse's own rules stay: a unique prefix is the flag, an ambiguous one is a usage error
    assert parse_config(TrainCfg, ["--ste", "4"]).steps == 4
    with pytest.raises(SystemExit) as exit_:
        parse_config(TrainCfg, ["--s", "4"])
    assert exit_.value.code == 2 and "ambiguous option" in capsys.readouterr().err


def test_unknown_flag_exits_2_through_cli_main(capsys):
    from draftsmith.train.errors import cli_main

    assert cli_main(lambda argv: bool(parse_config(TrainCfg, argv)), ["--stpes", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: invalid TrainCfg: 1 problem",
        "  --stpes: unknown flag (did you mean --steps?)",
    ]


def test_validate_hook_merged_with_type_errors():
    with pytest.raises(ConfigError) as err:
        load_config(TrainCfg, overrides={"lr": "-1", "steps": "many", "model.dim": "x"})
    # lr: from validate(); steps: type error (validate's "steps" line is not added on top,
    # since steps then holds its default); model.dim: nested type error.
    assert sorted(err.value.problems) == [
        ("lr", "must be > 0"),
        ("model.dim", "expected int, got str 'x'"),
        ("steps", "expected int, got str 'many'"),
    ]
    assert len(str(err.value).splitlines()) == 4  # one header, one line per problem
    with pytest.raises(ConfigError) as err:
        load_config(TrainCfg, overrides={"lr": 0.0, "steps": 0})
    assert err.value.problems == [("lr", "must be > 0"), ("steps", "must be >= 1")]


def test_validate_returning_strings():
    with pytest.raises(ConfigError) as err:
        load_config(StrValidated, overrides={"batch": 3})
    assert err.value.problems == [("batch", "must be even")]
    assert load_config(StrValidated, overrides={"batch": 4}).batch == 4


def test_required_field():
    with pytest.raises(ConfigError) as err:
        load_config(Required, overrides={"n": "x"})
    assert sorted(problem_fields(err)) == ["n", "target"]
    assert load_config(Required, overrides={"target": "t"}).target == "t"


def test_yaml_that_is_a_list_names_file(tmp_path):
    path = write_yaml(tmp_path, [1, 2, 3], name="listy.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(TrainCfg, path)
    assert err.value.problems[0][0] == str(path)
    assert "mapping" in err.value.problems[0][1]


def test_empty_yaml_means_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(TrainCfg, path) == TrainCfg()


def test_round_trip(tmp_path):
    cfg = load_config(
        TrainCfg,
        overrides={"resume": "a/b.pt", "shape": [5], "seed": 3, "model.act": "relu"},
    )
    data = config_to_dict(cfg)
    assert data["out_dir"] == "runs" and data["resume"] == "a/b.pt" and data["shape"] == [5]
    assert data["model"] == {"dim": 64, "act": "relu"}
    yaml.safe_dump(data)  # YAML-safe
    dump_config(cfg, tmp_path / "sub" / "cfg.yaml")
    assert load_config(TrainCfg, tmp_path / "sub" / "cfg.yaml") == cfg


@settings(max_examples=50, deadline=None)
@given(
    lr=st.floats(min_value=1e-9, max_value=1e3, allow_nan=False),
    steps=st.integers(min_value=1, max_value=10**9),
    name=st.text(max_size=20),
    layers=st.lists(st.integers(-5, 5), min_size=0, max_size=4),
)
def test_round_trip_property(tmp_path_factory, lr, steps, name, layers):
    cfg = TrainCfg(lr=lr, steps=steps, name=name, layers=layers)
    path = tmp_path_factory.mktemp("rt") / "cfg.yaml"
    dump_config(cfg, path)
    assert load_config(TrainCfg, path) == cfg


def test_help_text_and_own_parser(capsys):
    parser = argparse.ArgumentParser(prog="train")
    parser.add_argument("--verbose", action="store_true")
    add_config_arguments(parser, TrainCfg)
    help_text = parser.format_help()
    assert "--lr LR" not in help_text and "--lr FLOAT" in help_text
    assert "peak learning rate (5% warmup) (default: 0.0003)" in " ".join(help_text.split())
    assert "--no-compile" in help_text and "--out-dir PATH" in help_text
    assert "--model.dim INT" in help_text
    args = parser.parse_args(["--verbose", "--steps", "9"])
    assert vars(args) == {"verbose": True, "config": None, "steps": "9"}  # only given flags
    cfg = config_from_args(TrainCfg, args)
    assert cfg.steps == 9 and cfg.lr == 3e-4


def test_help_keeps_a_docstrings_examples_and_wraps_its_prose(capsys, monkeypatch):
    """A module docstring as the description: prose paragraphs are re-wrapped to the terminal,
    an indented block (``Launch::`` examples) and a bullet list print line by line as written."""
    doc = """Train a thing.

    Launch::

        python train.py --lr 1e-4 --steps 10    # short
        python train.py --config run.yaml

    Some prose that is long enough to be wrapped by the formatter at the terminal width, and
    written over two lines in the source.

    * a bullet,
      continued
    """
    monkeypatch.setenv("COLUMNS", "60")
    with pytest.raises(SystemExit):
        parse_config(TrainCfg, ["--help"], prog="train", description=doc)
    lines = capsys.readouterr().out.splitlines()
    assert "    python train.py --lr 1e-4 --steps 10    # short" in lines
    assert "    python train.py --config run.yaml" in lines
    assert "* a bullet," in lines and "  continued" in lines
    start = lines.index("Some prose that is long enough to be wrapped by the")
    assert lines[start + 1].startswith("formatter at the terminal width, and written over")
