"""The command lines in the header comments of the shipped configs (recipes/configs/*.yaml).

A training config's header holds the commands that make its data in one block: a line
``# data commands:``, then one ``#   draftsmith data ...`` line per command (a trailing ``\\``
continues it on the next comment line), as a user copies them into a shell. The tests read the
commands from there, so a header and its checks never hold two copies.

A config trained on several processes gives its launch line too, ``#   accelerate launch
--config_file recipes/accelerate/X.yaml recipes/eagle.py --config ...``
(:func:`launch_commands`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

DATA_MARKER = "# data commands:"


def header_lines(path: Path) -> list[str]:
    """The config's leading comment lines, as written."""
    header = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    return header


def _commands(
    lines: list[str], stop_at_prose: bool, program: str = "draftsmith"
) -> list[list[str]]:
    """``draftsmith ...`` (or other ``program``) commands of comment ``lines`` (``\\`` joins
    continuation lines), as argv lists without the program's words; with ``stop_at_prose`` the
    first other line ends the search."""
    commands: list[str] = []
    continued = False
    for line in lines:
        text = line[1:].strip()
        if continued:
            commands[-1] += " " + text.removesuffix("\\").strip()
        elif text.startswith(program + " "):
            commands.append(text.removesuffix("\\").strip())
        elif stop_at_prose:
            break
        else:
            continue
        continued = text.endswith("\\")
    words = len(program.split())
    return [shlex.split(command)[words:] for command in commands]


@dataclass
class Launch:
    """One ``accelerate launch`` line of a header.

    Attributes:
        options: accelerate's own flags before the script (``{"--config_file": PATH, ...}``).
        script: the recipe file it runs (``recipes/eagle.py``).
        args: the recipe's flags, after the script.
    """

    options: dict[str, str]
    script: str
    args: list[str]


def launch_commands(path: Path) -> list[Launch]:
    """Every ``accelerate launch ... recipes/<recipe>.py ...`` line of a config's leading comment
    block (every accelerate flag written as ``--flag VALUE``).

    Raises:
        ValueError: a launch line runs no ``.py`` script.
    """
    launches = []
    for argv in _commands(header_lines(path), stop_at_prose=False, program="accelerate launch"):
        options: dict[str, str] = {}
        i = 0
        while i < len(argv) and argv[i].startswith("--"):
            options[argv[i]] = argv[i + 1]
            i += 2
        if i >= len(argv) or not argv[i].endswith(".py"):
            raise ValueError(f"{path.name}: `accelerate launch {shlex.join(argv)}` runs no script")
        launches.append(Launch(options, argv[i], argv[i + 1 :]))
    return launches


def header_commands(path: Path) -> list[list[str]]:
    """Every ``draftsmith ...`` command line of a config's leading comment block, as argv lists
    without ``draftsmith``."""
    return _commands(header_lines(path), stop_at_prose=False)


def data_commands(path: Path) -> list[list[str]]:
    """The commands of the config's ``# data commands:`` block, in order (none: no block).

    Raises:
        ValueError: the header has more than one such block.
    """
    lines = header_lines(path)
    starts = [i for i, line in enumerate(lines) if line.strip() == DATA_MARKER]
    if len(starts) > 1:
        raise ValueError(f"{path.name}: {len(starts)} {DATA_MARKER!r} lines; one block only")
    if not starts:
        return []
    return _commands(lines[starts[0] + 1 :], stop_at_prose=True)
