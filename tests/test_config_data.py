"""Configs a user can run: every shipped config trains on data the project makes (issue 26).

Each training config's header lists the commands that make its data (``# data commands:``, read
by :mod:`tests.config_headers`): prompts the target writes plus the shipped training prompts,
the target's own answers, and for the cached configs their tokenization and hidden-state cache.
Here those very commands run, through the ``draftsmith`` entry point, on a tiny random target
with ``~/.cache/draftsmith/data`` moved to a temporary directory and the sizes shrunk; then every
file the config names must exist and the config must load and read it. No config may name a file
that only a development machine has.

The configs for real 8B-70B targets (``target:`` a Hub id) run the same way, their target
replaced by the tiny one; a command that answers through a server (``data distill --endpoint``,
the 70B's) is sent to an in-process fake OpenAI-compatible server answering with the tiny target
(tests/test_endpoint_distill.py), the only part of it that changes being the URL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from draftsmith.recipes.cli import command_config_class, main
from draftsmith.recipes.dflash import DFlashTrainConfig
from draftsmith.recipes.distill import DistillConfig
from draftsmith.recipes.eagle import EagleTrainConfig
from draftsmith.recipes.evaluate import EvalConfig
from draftsmith.recipes.medusa import MedusaConfig
from draftsmith.train.config import load_config
from draftsmith.train.core.data import check_inputs, load_samples
from draftsmith.train.features.cache_read import HiddenStateCache
from tests.config_headers import data_commands, header_commands
from tests.conftest import byte_tokenizer
from tests.test_endpoint_distill import FakeServer, model_rule
from tests.test_magpie import rigged_writer

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "recipes" / "configs"
ALL = sorted(CONFIGS.glob("*.yaml"))
TRAINING = [p for p in ALL if not p.stem.startswith("evaluate")]
CLASSES = {
    "evaluate": EvalConfig,
    "eagle": EagleTrainConfig,
    "peagle": EagleTrainConfig,
    "dflash": DFlashTrainConfig,
    "medusa": MedusaConfig,
    "distill": DistillConfig,
}
DATA_DIR = "~/.cache/draftsmith/data"  # where every header writes, and every config reads
OUTPUT_FIELDS = {"output_dir", "out"}  # paths a config writes, not reads
# Flags a header must give, with the values the tiny target runs them at: a handful of prompts
# and short answers instead of 1,800 and 128 tokens; a draft vocabulary within its 259 tokens.
SHRINK = {
    "prompts": {"--num": "2", "--max-new-tokens": "32", "--batch-size": "4"},
    "distill": {"--max-new-tokens": "8", "--batch-size": "16"},
    "cache": {"--draft-vocab-size": "64"},
}
# Through a server the batch is the server's: the requests in flight shrink instead.
SHRINK_ENDPOINT = {"distill": {"--max-new-tokens": "8", "--concurrency": "4"}}
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # a config's `target:` when it is not the default
ALPHABET = "abcdefghijklmnop"


def _class(path: Path) -> type:
    return next(cls for name, cls in CLASSES.items() if path.stem.startswith(name))


def _writer_dir(path: Path) -> Path:
    """tests/test_magpie.py's tiny writer (short user turns of a-p and spaces, so Magpie keeps
    about one candidate in six), saved as a target directory."""
    tok = byte_tokenizer()
    model = rigged_writer(tok)
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _localize(value: str, data_dir: Path) -> str:
    """``value`` with the data directory moved under ``data_dir``; anything else of the user's
    home directory is refused (a test must not read or write there)."""
    if value.startswith(DATA_DIR + "/"):
        return str(data_dir) + value[len(DATA_DIR) :]
    assert "~" not in value, f"{value}: outside {DATA_DIR}"
    return value


def _tiny_argv(
    argv: list[str], target: Path, data_dir: Path, server: str | None = None
) -> list[str]:
    """A header's command as the test runs it: paths under ``data_dir``, sizes shrunk, the tiny
    target on the CPU on one thread, no progress bars; a command with ``--endpoint`` asks the
    fake ``server`` instead (the server decides the device: none is given)."""
    name = argv[1]
    out = [_localize(a, data_dir) for a in argv]
    endpoint = "--endpoint" in out
    for flag, value in (SHRINK_ENDPOINT if endpoint else SHRINK).get(name, {}).items():
        assert flag in out, f"`draftsmith data {name}` in the headers no longer has {flag}"
        out[out.index(flag) + 1] = value
    fields = {f.name for f in dataclasses.fields(command_config_class("data", name))}
    out += ["--target", str(target)]
    if endpoint:
        assert server is not None
        out[out.index("--endpoint") + 1] = server
    else:
        out += ["--device", "cpu"] if "device" in fields else []
        out += ["--threads", "1"] if "threads" in fields else []
    out += ["--no-progress"] if "progress" in fields else []
    return out


def _target(path: Path) -> str | None:
    """The target a training config names (None: the default, SmolLM2-135M-Instruct)."""
    return load_config(_class(path), path).target


def _chains() -> dict[str | None, list[list[str]]]:
    """Each target's longest header chain (its configs' chains are prefixes of it, see
    test_configs_share_one_chain), by the target the configs name."""
    chains: dict[str | None, list[list[str]]] = {}
    for path in TRAINING:
        commands = data_commands(path)
        if len(commands) > len(chains.get(_target(path), [])):
            chains[_target(path)] = commands
    return chains


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Runs every target's longest header chain on the tiny target (a command two chains share,
    such as a prompts file two targets read, once): ``(data_dir, target_dir)``."""
    root = tmp_path_factory.mktemp("config_data")
    target = _writer_dir(root / "target")
    data_dir = root / "data"
    done: set[tuple[str, ...]] = set()
    server = None
    with contextlib.ExitStack() as stack:
        for chain in _chains().values():
            for argv in chain:
                if tuple(argv) in done:
                    continue
                done.add(tuple(argv))
                if "--endpoint" in argv and server is None:
                    from draftsmith.train.target_model.load import load_target

                    model, tok = load_target(target, quiet=True)
                    server = stack.enter_context(FakeServer(tok, model_rule(model, tok)))
                url = server.url if server is not None else None
                assert main(_tiny_argv(argv, target, data_dir, url)) == 0, argv
    return data_dir, target


def test_no_config_names_a_development_file():
    """No shipped config, header or field, names a file outside what the project makes."""
    for path in ALL:
        text = path.read_text(encoding="utf-8").lower()
        for word in ("shared/", "alpaca"):
            assert word not in text, f"{path.name} mentions {word!r}"


def test_configs_share_one_chain():
    """The training configs of one target take their data commands from the start of one chain
    (so one run makes every config's data), which starts from prompts the project makes and
    goes on in the order prompts, answers, tokens, cache; the default target's chain has all
    four. The header holds no data command outside its block; evaluate.yaml needs none."""
    chains = _chains()
    stages = [["data", "prompts"], ["data", "distill"], ["data", "tokenize"], ["data", "cache"]]
    assert [argv[:2] for argv in chains[None]] == stages
    for chain in chains.values():
        assert [argv[:2] for argv in chain] == stages[: len(chain)]
        assert "--include-shipped" in chain[0] and "--input" not in chain[0]
    for path in TRAINING:
        commands = data_commands(path)
        chain = chains[_target(path)]
        assert len(commands) >= 2, f"{path.name}: no `# data commands:` block"
        assert commands == chain[: len(commands)], f"{path.name}: its own data commands"
        assert [a for a in header_commands(path) if a[0] == "data"] == commands, path.name
    for path in ALL:
        if path not in TRAINING:
            assert data_commands(path) == [] and header_commands(path) == [], path.name


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_config_reads_what_its_commands_made(path, made):
    data_dir, target = made
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    made_here = set()
    for argv in data_commands(path):
        cfg = command_config_class("data", argv[1])
        flag = "--out" if "out" in {f.name for f in dataclasses.fields(cfg)} else "--output"
        made_here.add(Path(_localize(argv[argv.index(flag) + 1], data_dir)))

    # Every path-like value the config reads is one its own header's commands made.
    overrides = {}
    for key, value in raw.items():
        if key in OUTPUT_FIELDS:
            continue
        if key == "target" and value is not None:
            # A Hub id (its shapes: tests/test_scale_configs.py), never a local directory.
            assert HUB_ID.match(value) and not value.startswith("."), f"{path.name}: {value}"
            continue
        for item in value if isinstance(value, list) else [value]:
            looks_like_a_path = isinstance(item, str) and ("/" in item or item.startswith("~"))
            assert not (looks_like_a_path and isinstance(value, list)), f"{path.name}: {key}"
            if looks_like_a_path:
                local = _localize(item, data_dir)
                assert Path(local) in made_here, f"{path.name}: {key}: {item} is made by none"
                assert Path(local).exists(), f"{path.name}: {key}: {item} was not made"
                overrides[key] = local

    cls = _class(path)
    cfg = load_config(cls, path, overrides)
    if path in TRAINING:
        assert {"data"} <= set(overrides), f"{path.name}: reads no data the commands made"
        check_inputs(cfg.input_paths())  # what the recipe checks first; raises when missing
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target)
        distill = next(argv for argv in data_commands(path) if argv[1] == "distill")
        answers = Path(_localize(distill[distill.index("--output") + 1], data_dir))
        assert answers == Path(cfg.data), f"{path.name}: trains on other answers than its own"
        records = [json.loads(line) for line in answers.read_text().splitlines()]
        assert {r["source"] for r in records} >= {"magpie", "shipped"}
        # The config's split keeps every answer (data prompts marks each prompt train).
        samples, _ = load_samples(cfg.data, tokenizer, max_length=cfg.max_length, split=cfg.split)
        assert len(samples) == len(records)
        cache = getattr(cfg, "hidden_states_cache", None)
        if cache is not None:
            opened = HiddenStateCache(cache)
            assert len(opened) == len(records)
            assert opened.manifest["max_length"] == cfg.max_length
    else:
        assert not overrides and not data_commands(path)
