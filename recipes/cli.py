"""The ``draftsmith`` command: one subcommand per stage, each a thin entry to a module or recipe.

Subcommands are dispatched by a plain dict of functions taking their own argv, so each keeps its
own ``--help``. The dispatch runs under :func:`~draftsmith.train.errors.cli_main`: a known error
from any subcommand (bad data, config, checkpoint or cache; disk full; a locked output) prints
one ``error: ...`` line and exits 2 (usage) or 1 (runtime); ``--debug`` anywhere on the command
line, or ``DRAFTSMITH_DEBUG=1``, shows the traceback instead.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: resolve the imports below (PEP 366)
    __package__ = "draftsmith.recipes"

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ..heads import families
from ..train.errors import UsageError, cli_main


def _prepare_target(argv: list[str]) -> int:
    from ..train.target_model.load import main_prepare_target

    return main_prepare_target(argv)


def _evaluate(argv: list[str]) -> int:
    from .evaluate import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    """Every drafter against one plain baseline, greedy and sampled: tables, plots, best k.

    The bench runs ``draftsmith evaluate`` through this dispatch (:func:`main`), handed to it
    here: a recipe never imports this module.
    """
    from .bench import main as bench

    return bench(argv, call=main)


def _plan(argv: list[str]) -> int:
    from .plan import main

    return main(argv)


def _export(argv: list[str]) -> int:
    from ..train.export.command import main

    return main(argv)


#: ``draftsmith train RECIPE``: the recipes of the family declaration (heads/families.py).
TRAIN_RECIPES = families.RECIPES


def _train(argv: list[str]) -> int:
    """``draftsmith train RECIPE ...`` = ``python recipes/RECIPE.py ...`` (same flags)."""
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in TRAIN_RECIPES:
        lines = ["usage: draftsmith train <recipe> [--config FILE] [options]", "", "recipes:"]
        lines += [f"  {name:<10} {recipe.help}" for name, recipe in TRAIN_RECIPES.items()]
        helping = bool(argv) and argv[0] in ("-h", "--help")
        stream = sys.stdout if helping else sys.stderr
        if argv and not helping:
            import difflib

            close = difflib.get_close_matches(argv[0], TRAIN_RECIPES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            print(f"draftsmith train: unknown recipe {argv[0]!r}{hint}", file=stream)
        print("\n".join(lines), file=stream)
        return 0 if helping else 2
    return families.resolve(f"{TRAIN_RECIPES[argv[0]].module}:main")(argv[1:])


DATA_COMMANDS = {
    "prompts": (
        "draftsmith.train.datagen.prompts_command",
        "main_prompts",
        "make training prompts: the target writes them (Magpie) + shipped + your files, deduped",
    ),
    "tokenize": (
        "draftsmith.train.data.tokenize",
        "main_tokenize",
        "chat-template tokenization with assistant-only loss masks -> a saved dataset",
    ),
    "distill": (
        "draftsmith.train.datagen.distill_command",
        "main_distill",
        "regenerate the assistant turns of a dataset with the target (self-distillation)",
    ),
    "cache": (
        "draftsmith.train.features.cache_command",
        "main_cache",
        "store the target's hidden states of chosen layers for offline training",
    ),
    "vocab": (
        "draftsmith.train.features.vocab_command",
        "main_vocab",
        "token frequencies over supervised tokens; EAGLE-3 draft vocabulary (d2t/t2d)",
    ),
}


# The config dataclass each command parses its flags into, by (module, class name): what
# :func:`parse_command` checks a written command line against without running it.
COMMAND_CONFIGS: dict[str, dict[str, tuple[str, str]]] = {
    "data": {
        "prompts": ("draftsmith.train.datagen.prompts_command", "PromptsConfig"),
        "tokenize": ("draftsmith.train.data.tokenize", "TokenizeConfig"),
        "distill": ("draftsmith.train.datagen.distill_command", "SelfDistillConfig"),
        "cache": ("draftsmith.train.features.cache_command", "CacheConfig"),
        "vocab": ("draftsmith.train.features.vocab_command", "VocabConfig"),
    },
    "train": {
        name: (f"draftsmith.{recipe.module}", recipe.config)
        for name, recipe in TRAIN_RECIPES.items()
    },
}


def parse_command(argv: list[str]) -> Any:
    """Parse a ``draftsmith data ...`` or ``draftsmith train ...`` command line, without running it.

    The command's own parser and config loader (its flags, ``--config`` YAML, the config's
    ranges and ``validate()``) build its config; no target is loaded, no data read, nothing
    written. Used to check command lines written in docs and config headers.

    Args:
        argv: the command line after ``draftsmith``, e.g.
            ``["data", "distill", "--input", "p.jsonl", "--output", "a.jsonl"]``.

    Returns:
        The command's config (a dataclass instance, e.g. ``distill_command.SelfDistillConfig``).

    Raises:
        UsageError: ``argv`` does not name a data or train command.
        ConfigError: a value the command would refuse (named by field).
        SystemExit: a flag without its value or a value outside its choices (argparse, as the
            command); an unknown flag is a ConfigError with the other problems.
    """
    from ..train.config import parse_config

    group, name = [*argv, "", ""][:2]
    config_class = command_config_class(group, name)
    return parse_config(config_class, argv[2:], prog=f"draftsmith {group} {name}")


def command_config_class(group: str, name: str) -> type:
    """The config dataclass of ``draftsmith GROUP NAME`` (e.g. ``data``, ``distill``).

    Raises:
        UsageError: not a data or train command.
    """
    import importlib

    if name not in COMMAND_CONFIGS.get(group, {}):
        known = ", ".join(f"{g} {n}" for g, names in COMMAND_CONFIGS.items() for n in names)
        raise UsageError(f"'{group} {name}' is not one of: {known}")
    module, cls = COMMAND_CONFIGS[group][name]
    return getattr(importlib.import_module(module), cls)


def _data(argv: list[str]) -> int:
    """`draftsmith data <distill|cache|vocab> ...`: the data stages, each with its own --help."""
    import importlib

    if not argv or argv[0] in ("-h", "--help") or argv[0] not in DATA_COMMANDS:
        lines = ["usage: draftsmith data <command> [options]", "", "commands:"]
        lines += [f"  {name:<10} {text}" for name, (_, _, text) in DATA_COMMANDS.items()]
        stream = sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr
        if argv and argv[0] not in ("-h", "--help"):
            print(f"draftsmith data: unknown command {argv[0]!r}", file=stream)
        print("\n".join(lines), file=stream)
        return 0 if stream is sys.stdout else 2
    module, func, _ = DATA_COMMANDS[argv[0]]
    return getattr(importlib.import_module(module), func)(argv[1:])


def _quickstart(argv: list[str]) -> int:
    """The main job on one target: prompts -> answers -> cache -> EAGLE-3 -> evaluate -> export.

    Each stage is one of the commands below, called through this dispatch (:func:`main`),
    handed to ``draftsmith.recipes.quickstart`` here: a recipe never imports this module.
    """
    from .quickstart import main as quickstart

    return quickstart(argv, call=main)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "quickstart": (
        _quickstart,
        "start here: train, evaluate and export an EAGLE-3 drafter in one command",
    ),
    "prepare-target": (_prepare_target, "convert/cache a target model (default: SmolLM2-135M)"),
    "data": (_data, "data stages: prompts, distill, tokenize, cache (hidden states), vocab"),
    "train": (_train, "train a drafter: eagle, medusa or distill (the recipes/ files)"),
    "evaluate": (
        _evaluate,
        "plain vs speculative decoding on a prompt set: τ, speedup, losslessness",
    ),
    "bench": (
        _bench,
        "every drafter + HF references on one prompt set: report, plots, recommended k",
    ),
    "export": (_export, "write a drafter for vLLM / SGLang / HF (speculators, eagle3, ...)"),
    "plan": (
        _plan,
        "will an EAGLE training job fit? per-GPU peak memory, and what would fit instead",
    ),
}


def _usage() -> str:
    lines = ["usage: draftsmith <command> [options]", "", "commands:"]
    lines += [f"  {name:<16} {text}" for name, (_, text) in COMMANDS.items()]
    lines += [
        "",
        "Run `draftsmith <command> --help` for a command's options.",
        "Errors print one line (exit 2: bad input or usage, 1: the run failed); add --debug (or",
        "set DRAFTSMITH_DEBUG=1) to see the full traceback.",
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def _debug_env(on: bool) -> Iterator[None]:
    """Set DRAFTSMITH_DEBUG=1 for the call when --debug was given.

    The outer :func:`cli_main` strips ``--debug`` from argv, so the subcommand's own
    ``cli_main`` (and processes it launches) learn it from the environment instead; the old
    value is restored so an in-process caller (tests) is not left in debug mode.
    """
    if not on:
        yield
        return
    old = os.environ.get("DRAFTSMITH_DEBUG")
    os.environ["DRAFTSMITH_DEBUG"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DRAFTSMITH_DEBUG", None)
        else:
            os.environ["DRAFTSMITH_DEBUG"] = old


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``draftsmith`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with _debug_env("--debug" in argv):
        return cli_main(_dispatch, argv)


def _dispatch(argv: list[str]) -> int:
    """Run the subcommand ``argv[0]`` with the rest (``--debug`` already removed)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(f"draftsmith {version('draftsmith')}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"draftsmith: unknown command {name!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    return COMMANDS[name][0](rest)


if __name__ == "__main__":
    sys.exit(main())
