"""Every shipped YAML config loads into its recipe's config class, and its header says, in
commands that parse, how to make exactly the data it reads and how to launch it; a missing
input is one line that says which command makes it."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path

import pytest
import yaml

from draftsmith.recipes.cli import (
    COMMAND_CONFIGS,
    DATA_COMMANDS,
    TRAIN_RECIPES,
    command_config_class,
    parse_command,
)
from draftsmith.recipes.dflash import DFlashTrainConfig
from draftsmith.recipes.distill import DistillConfig
from draftsmith.recipes.eagle import EagleTrainConfig
from draftsmith.recipes.evaluate import EvalConfig
from draftsmith.recipes.medusa import MedusaConfig
from draftsmith.train.config import add_config_arguments, load_config
from draftsmith.train.core.data import check_inputs
from draftsmith.train.errors import UsageError
from tests.config_headers import Launch, data_commands, header_commands, launch_commands

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "recipes" / "configs"
CLASSES = {
    "evaluate": EvalConfig,
    "eagle": EagleTrainConfig,
    "peagle": EagleTrainConfig,  # P-EAGLE: the eagle recipe with parallel_drafting
    "dflash": DFlashTrainConfig,
    "medusa": MedusaConfig,
    "distill": DistillConfig,
}
ALL = sorted(CONFIGS.glob("*.yaml"))
TRAINING = [p for p in ALL if not p.stem.startswith("evaluate")]


def _recipe(path: Path) -> str:
    recipe = next((name for name in CLASSES if path.stem.startswith(name)), None)
    assert recipe is not None, f"{path.name}: no config class registered for it in this test"
    return recipe


def _target(path: Path) -> str | None:
    """The target a training config names (None: the default, SmolLM2-135M-Instruct)."""
    return load_config(CLASSES[_recipe(path)], path).target


def _flags(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def _output(cfg: object) -> Path:
    """Where a data command writes (``--output`` or ``--out``)."""
    out = getattr(cfg, "output", None) or getattr(cfg, "out", None)
    assert out is not None, f"{type(cfg).__name__}: no output field"
    return Path(out)


def _input(cfg: object) -> Path | None:
    """What a data command reads (``--input`` or ``--data``)."""
    src = getattr(cfg, "input", None) or getattr(cfg, "data", None)
    if isinstance(src, list) and len(src) == 1:  # tokenize reads one file or several
        src = src[0]
    return Path(src) if isinstance(src, (str, Path)) else None


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_shipped_config_loads(path):
    """Each YAML key is a field of the recipe's config and arrives with the YAML's value (a
    loader that dropped or renamed a key, or let a default win, fails here), and the file
    overrides at least one default (else it tests nothing)."""
    raw = yaml.safe_load(path.read_text())
    cls = CLASSES[_recipe(path)]
    cfg = load_config(cls, path)
    default = cls()
    fields = {f.name for f in dataclasses.fields(cfg)}
    assert set(raw) <= fields, f"{path.name}: not fields: {sorted(set(raw) - fields)}"
    for key, value in raw.items():
        got = getattr(cfg, key)
        if isinstance(value, str) and isinstance(got, Path):
            value = Path(value).expanduser()  # strings are accepted for Paths
        elif isinstance(value, list) and isinstance(got, tuple):
            got = list(got)
        assert got == value, f"{path.name}: {key} = {got!r}, the YAML says {value!r}"
    assert any(getattr(cfg, k) != getattr(default, k) for k in raw), path.name


def test_every_command_has_a_parse_only_config():
    assert set(COMMAND_CONFIGS["data"]) == set(DATA_COMMANDS)
    assert set(COMMAND_CONFIGS["train"]) == set(TRAIN_RECIPES)
    for group, names in COMMAND_CONFIGS.items():
        for name in names:
            assert isinstance(command_config_class(group, name), type)
    with pytest.raises(UsageError, match="not one of"):
        parse_command(["data", "nope"])


@pytest.mark.parametrize("path", TRAINING, ids=lambda p: p.name)
def test_header_commands_make_the_configs_data(path, monkeypatch):
    """The header's data commands parse with their own parsers (no target, nothing run), each
    reads what the one before wrote, and they write exactly the paths the config reads; the
    answers, tokens and features come from the config's own target; the header's train and
    launch commands train this very config."""
    monkeypatch.chdir(REPO)  # the headers' relative paths are from the repository root
    recipe = _recipe(path)
    cfg = load_config(CLASSES[recipe], path)
    commands = header_commands(path)
    data = [argv for argv in commands if argv[0] == "data"]
    train = [argv for argv in commands if argv[0] == "train"]
    assert data, f"{path.name}: the header lists no `draftsmith data ...` command"
    assert {argv[0] for argv in commands} <= {"data", "train"}, commands

    outputs: list[Path] = []
    for argv in data:
        config_class = command_config_class(argv[0], argv[1])
        parser = argparse.ArgumentParser()
        add_config_arguments(parser, config_class)
        # Exact option names: argparse would also take an abbreviation (`--out` for --output).
        unknown = set(_flags(argv[2:])) - set(parser._option_string_actions)
        assert not unknown, f"{path.name}: `draftsmith {' '.join(argv[:2])}` has no {unknown}"
        parsed = parse_command(argv)
        if outputs:  # a chain: each later stage reads an earlier stage's output
            assert _input(parsed) in outputs, (argv, outputs)
        outputs.append(_output(parsed))
    assert data[0][:2] == ["data", "prompts"], "the data starts with prompts the project makes"
    assert data[1][:2] == ["data", "distill"], "then the target's own answers"
    assert data == data_commands(path), "every data command sits in the `# data commands:` block"
    # Self-distillation: the answers (and their tokens and features) are the target's own; the
    # prompts, only questions, may come from another model, but not from the default SmolLM2
    # when the config trains for another target.
    for argv in data[1:]:
        made_by = parse_command(argv).target
        assert made_by == cfg.target, f"{path.name}: `{shlex.join(argv[:2])}` uses {made_by}"
    if cfg.target is not None:
        assert parse_command(data[0]).target is not None, f"{path.name}: SmolLM2 writes prompts"

    # The config's data fields are what the commands write (`~` expanded on both sides).
    for field in ("data", "hidden_states_cache"):
        value = getattr(cfg, field, None)
        if value is not None:
            assert Path(value) in outputs, f"{path.name}: {field}: {value} is made by no command"
    reads = [Path(p) for p in cfg.input_paths().values() if p is not None]
    assert outputs[-1] in reads, f"{path.name}: the last command writes {outputs[-1]}, not {reads}"

    launches = launch_commands(path)
    assert len(train) <= 1 and train + launches, f"{path.name}: no train or launch command"
    for argv in train:
        assert argv[1] == {"peagle": "eagle"}.get(recipe, recipe)
        trained = parse_command(argv)
        assert type(trained) is CLASSES[recipe]
        assert (REPO / argv[argv.index("--config") + 1]).resolve() == path.resolve()
    sharded = [launch for launch in launches if _launcher(launch)["distributed_type"] == "FSDP"]
    if path.stem.endswith("_fsdp"):
        # A target that needs FSDP does not fit one process: no single-process train line.
        assert sharded and not train, f"{path.name}: launched without an FSDP config"
    else:
        assert not sharded, f"{path.name}: an FSDP launch; name it *_fsdp.yaml"
    for launch in launches:
        _check_launch(path, recipe, launch)


def _launcher(launch: Launch) -> dict:
    """The accelerate config a launch line names (it must exist in the repository)."""
    file = REPO / launch.options["--config_file"]
    assert file.is_file(), f"{launch.options['--config_file']}: no such accelerate config"
    return yaml.safe_load(file.read_text(encoding="utf-8"))


def _check_launch(path: Path, recipe: str, launch: Launch) -> None:
    """An ``accelerate launch`` line runs this recipe's file on this config, with flags its
    config class parses, under an accelerate config for several processes."""
    name = {"peagle": "eagle"}.get(recipe, recipe)
    assert launch.script == f"recipes/{name}.py", f"{path.name}: launches {launch.script}"
    assert (REPO / launch.script).is_file()
    assert set(launch.options) <= {"--config_file", "--num_processes", "--num_machines"}
    launcher = _launcher(launch)
    assert launcher["distributed_type"] in {"MULTI_GPU", "FSDP"}, launcher["distributed_type"]
    trained = parse_command(["train", name, *launch.args])
    assert type(trained) is CLASSES[recipe]
    assert (REPO / launch.args[launch.args.index("--config") + 1]).resolve() == path.resolve()


def test_shipped_configs_share_one_distilled_file():
    """The training configs of one target start from the same prompts and answers; the default
    target's (SmolLM2) are made by the commands the README's "Training drafters" shows before its
    train commands."""
    by_target: dict[str | None, list[Path]] = {}
    for path in TRAINING:
        by_target.setdefault(_target(path), []).append(path)
    assert None in by_target, "no config for the default target"
    for target, paths in by_target.items():
        shared = {shlex.join(a) for path in paths for a in data_commands(path)[:2]}
        assert len(shared) == 2, (target, shared)  # one prompts command, one distill command
    first = data_commands(by_target[None][0])[:2]
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Training drafters", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    shown = [
        shlex.split(line)[1:]
        for line in block.replace("\\\n", " ").splitlines()
        if line.startswith("draftsmith ")
    ]
    assert shown == first
    assert section.index("draftsmith data prompts") < section.index("draftsmith train")


def test_header_drift_fails(tmp_path):
    """A config whose field no longer matches its header is caught by the checks above."""
    text = (CONFIGS / "eagle1_smollm2.yaml").read_text(encoding="utf-8")
    drifted = tmp_path / "eagle1_smollm2.yaml"
    drifted.write_text(text.replace("greedy128.jsonl  # self", "greedy256.jsonl  # self"))
    cfg = load_config(EagleTrainConfig, drifted)
    outputs = [_output(parse_command(a)) for a in header_commands(drifted) if a[0] == "data"]
    assert outputs[-1].name.endswith("greedy128.jsonl"), outputs  # the answers
    assert cfg.data not in outputs


# --- a missing input: one line naming the field, the path and the command that makes it ------


def test_missing_input_messages(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    missing = tmp_path / ".cache" / "x.jsonl"
    with pytest.raises(UsageError) as exc:
        check_inputs({"data": missing, "hidden_states_cache": None})
    assert str(exc.value) == (
        "data: ~/.cache/x.jsonl: file not found; make it with `draftsmith data distill --input "
        "PROMPTS --output ~/.cache/x.jsonl` (the header of each recipes/configs/*.yaml lists the "
        "exact commands)"
    )
    with pytest.raises(UsageError, match=r"^data: ~/tok: not found; .*draftsmith data tokenize"):
        check_inputs({"data": tmp_path / "tok"})
    with pytest.raises(UsageError, match=r"^hidden_states_cache: ~/c: not found; .*data cache"):
        check_inputs({"hidden_states_cache": tmp_path / "c"})
    (tmp_path / "here.jsonl").write_text("")
    check_inputs({"data": tmp_path / "here.jsonl", "draft_model": None})


def _main(recipe: str):
    if recipe == "eagle":
        from draftsmith.recipes.eagle import main
    elif recipe == "medusa":
        from draftsmith.recipes.medusa import main
    else:
        from draftsmith.recipes.distill import main
    return main


@pytest.mark.parametrize(
    "recipe, extra, field, command",
    [
        ("eagle", [], "data", "draftsmith data distill"),
        ("medusa", [], "data", "draftsmith data distill"),
        ("distill", [], "data", "draftsmith data distill"),
        ("eagle", ["--hidden-states", "offline"], "hidden_states_cache", "draftsmith data cache"),
        ("medusa", ["--hidden-states", "offline"], "hidden_states_cache", "draftsmith data cache"),
    ],
    ids=["eagle", "medusa", "distill", "eagle-cache", "medusa-cache"],
)
def test_missing_input_exits_2_naming_field_path_and_command(
    recipe, extra, field, command, tmp_path, tiny_target_dir, capsys
):
    missing = tmp_path / ("nope.jsonl" if field == "data" else "nope_cache")
    argv = ["--target", str(tiny_target_dir), "--output-dir", str(tmp_path / "out")]
    argv += ["--max-steps", "1", *extra]
    if field == "data":
        argv += ["--data", str(missing)]
    else:
        argv += ["--hidden-states-cache", str(missing)]
    assert _main(recipe)(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: {field}: {missing}: "), lines[0]
    assert command in lines[0] and f"{missing}`" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()  # refused before anything is written
