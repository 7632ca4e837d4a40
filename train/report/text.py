"""How reports write numbers, durations and tables: markdown cells, a console for the summaries."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["cell", "console", "fmt_number", "is_finite_number", "markdown_table", "minutes"]


def is_finite_number(x: Any) -> bool:
    """Whether ``x`` is an int or float (not a bool) and finite."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fmt_number(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    """``value`` formatted with ``spec`` and ``suffix``; ``-`` when it is missing or not finite."""
    return f"{value:{spec}}{suffix}" if is_finite_number(value) else "-"


def minutes(seconds: float) -> str:
    """A duration as people read it: ``45 s``, ``7.5 min``, ``25 min``."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 600 else f"{seconds / 60:.0f} min"


def cell(text: Any) -> str:
    """``text`` as a markdown table cell (a ``|`` inside would end the cell)."""
    return str(text).replace("|", "\\|")


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the header, the separator, one line per row."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def console(width: int):
    """A rich console for summaries: the terminal's width, or ``width`` when stdout is not one
    (a log keeps the results table's columns)."""
    from rich.console import Console

    out = Console(highlight=False)
    return out if out.is_terminal else Console(width=width, highlight=False)
