"""Check every marked figure in the docs against the result file it names.

A figure in README.md or docs/*.md is tied to its result by an HTML comment right after it (it
renders as nothing)::

    τ 1.42<!-- fig Q:methods[method^=eagle3-chain].acceptance_length -->

with the file named once per document, before its first use::

    <!-- figfile Q = bench/quickstart/avx512bf16/quickstart30_d260927/eval32.json -->

or inline (``<!-- fig bench/x.json:some.field -->``). The figure is the last number before the
marker on its line (``1.42`` above; ``1,234`` reads 1234, ``α .30`` reads 30: tie it with ``x100``); it must equal the field's value
rounded to the decimals shown. A path is dotted keys, ``[N]`` list indices, ``[key=value]`` (the
first element whose key equals value), ``[key^=prefix]`` (whose key starts with prefix), ``[key*=part]`` (whose key holds part: a
method named after a run directory is picked by the directory's own name, not a machine path) and
``["a key"]`` (a key taken as written, brackets and all: ``results["vllm[auto]"]``); several
conditions in one bracket, separated by commas, must all hold. Options after the path: ``x100`` (a share shown as a percentage),
``minutes`` (seconds shown as minutes), ``gib`` (bytes shown in GiB), ``abs`` (a magnitude
shown without its sign).

Usage::

    python scripts/check_figures.py README.md docs/*.md     # exit 1 and one line per problem
    python scripts/check_figures.py --untied docs/eagle.md  # list what looks like an unmarked result

``--untied`` lists, without failing, the numbers that read like measured results (followed by
×, %, tok/s, s, min, GiB…, or after τ/α) and have no marker: a figure to tie, or a number that is
no measurement of a result file here (a setting, a goal, an estimate, a paper's figure), which a
line ending in ``<!-- not measured -->`` says once for the whole line. What is left is what the
docs quote without a file to check it against (derived by arithmetic, or kept only in a log).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MARK = re.compile(r"<!--\s*fig\s+(?P<ref>\S+)(?P<opts>(?:\s+\w+)*)\s*-->")
ALIAS = re.compile(r"<!--\s*figfile\s+(?P<name>\w+)\s*=\s*(?P<path>\S+)\s*-->")
# A hyphen right after a digit is a range ("1.03-1.06"), not the second number's sign.
NUMBER = re.compile(r"(?:(?<![\d.])[-−])?\d[\d,]*(?:\.\d+)?")
CODE = re.compile(r"`[^`]*`")
UNTIED_SKIP = re.compile(r"<!--\s*not measured\s*-->")
# What reads like a measured result: a number with a unit of speed, share, time or size after it,
# or after τ / α (acceptance length, rates).
LOOKS_MEASURED = re.compile(
    r"(?:[τα]\s*(?:=\s*)?(?P<after>[-−]?\d[\d,]*(?:\.\d+)?))"
    r"|(?P<num>[-−]?\d[\d,]*(?:\.\d+)?)(?:\*\*)?\s?"
    r"(?:×|%|x\b|tok/s|tokens/s|GiB|GB|MiB|MB|ms\b|s\b|min\b|minutes\b)"
)
STEP = re.compile(r'\["([^"]+)"\]|\.?([^.\[\]]+)|\[([^\]]+)\]')


@dataclass
class Figure:
    """One marked figure: where it is, what it shows and what it names."""

    doc: str
    line: int
    shown: str
    file: str
    path: str
    options: tuple[str, ...]


def figures(text: str, doc: str) -> tuple[list[Figure], list[str]]:
    """The marked figures of one document, and the problems found while reading them."""
    aliases: dict[str, str] = {}
    found: list[Figure] = []
    problems: list[str] = []
    for n, line in enumerate(text.splitlines(), start=1):
        # A marker shown as an example in inline code is not one.
        line = CODE.sub(lambda m: " " * len(m.group()), line)
        for m in ALIAS.finditer(line):
            aliases[m["name"]] = m["path"]
        for m in MARK.finditer(line):
            ref = m["ref"]
            name, sep, path = ref.partition(":")
            if not sep:
                problems.append(f"{doc}:{n}: marker {ref!r} has no FILE:PATH")
                continue
            file = aliases.get(name, name)
            before = MARK.sub("", ALIAS.sub("", line[: m.start()]))
            numbers = NUMBER.findall(before)
            if not numbers:
                problems.append(f"{doc}:{n}: no figure before the marker {ref!r}")
                continue
            found.append(Figure(doc, n, numbers[-1], file, path, tuple(m["opts"].split())))
    return found, problems


def untied(text: str, doc: str) -> list[str]:
    """``doc:line: number | the line`` for each number that reads like a measured result and has
    no marker (outside code, fenced or inline, and lines marked ``<!-- not measured -->``)."""
    out: list[str] = []
    fenced = False
    for n, raw in enumerate(text.splitlines(), start=1):
        if raw.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or UNTIED_SKIP.search(raw):
            continue
        line = CODE.sub(lambda m: " " * len(m.group()), raw)
        line = ALIAS.sub(lambda m: " " * len(m.group()), line)
        # The spans of numbers a marker ties: the last number before each marker.
        tied: set[int] = set()
        for m in MARK.finditer(line):
            before = MARK.sub(lambda x: " " * len(x.group()), line[: m.start()])
            spans = [x.start() for x in NUMBER.finditer(before)]
            if spans:
                tied.add(spans[-1])
        bare = MARK.sub(lambda x: " " * len(x.group()), line)
        for m in LOOKS_MEASURED.finditer(bare):
            group = "after" if m["after"] else "num"
            if m.start(group) not in tied:
                out.append(f"{doc}:{n}: {m[group]} | {raw.strip()[:160]}")
    return out


def resolve(data: Any, path: str) -> Any:
    """The value at ``path`` (module doc) in ``data``; KeyError naming the step that failed."""
    value = data
    for quoted, key, select in STEP.findall(path):
        key = quoted or key
        if key:
            if not isinstance(value, dict) or key not in value:
                raise KeyError(f"no key {key!r}")
            value = value[key]
        elif select.lstrip("-").isdigit():
            if not isinstance(value, list) or not -len(value) <= int(select) < len(value):
                raise KeyError(f"no index [{select}]")
            value = value[int(select)]
        else:
            conditions = [re.match(r"(\w+)([\^*]?=)(.*)", c).groups() for c in select.split(",")]
            hits = [
                v
                for v in (value if isinstance(value, list) else [])
                if isinstance(v, dict) and all(_holds(v, *c) for c in conditions)
            ]
            if not hits:
                raise KeyError(f"no element [{select}]")
            value = hits[0]
    return value


def _holds(item: dict, field: str, op: str, want: str) -> bool:
    have = str(item.get(field, ""))
    if op == "*=":
        return want in have
    return have == want if op == "=" else have.startswith(want)


def check(fig: Figure, root: Path = REPO) -> str | None:
    """None when the figure matches its field, else the problem in one line."""
    where = f"{fig.doc}:{fig.line}"
    path = root / fig.file
    if not path.is_file():
        return f"{where}: {fig.file} does not exist"
    try:
        value = resolve(json.loads(path.read_text()), fig.path)
    except (KeyError, ValueError, AttributeError) as exc:
        return f"{where}: {fig.file}:{fig.path}: {exc}"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return f"{where}: {fig.file}:{fig.path} is {value!r}, not a number"
    if "x100" in fig.options:
        value *= 100
    if "minutes" in fig.options:
        value /= 60
    if "abs" in fig.options:
        value = abs(value)
    if "gib" in fig.options:
        value /= 2**30
    text = fig.shown.replace(",", "").replace("−", "-")
    decimals = len(text.split(".")[1]) if "." in text else 0
    shown = float(text)
    if abs(value - shown) > 0.5 * 10**-decimals + 1e-9:
        return (
            f"{where}: shows {fig.shown} but {fig.file}:{fig.path} is {value:.{decimals + 2}f} "
            f"({value:.{decimals}f} at the decimals shown)"
        )
    return None


def check_docs(paths: list[Path], root: Path = REPO) -> tuple[int, list[str]]:
    """``(figures checked, problems)`` over the documents."""
    problems: list[str] = []
    count = 0
    for path in paths:
        doc = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        found, read = figures(path.read_text(encoding="utf-8"), doc)
        problems += read
        count += len(found)
        problems += [p for p in (check(f, root) for f in found) if p]
    return count, problems


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    listing = "--untied" in argv
    argv = [a for a in argv if a != "--untied"]
    paths = [Path(a).resolve() for a in argv] or [
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
    ]
    if listing:
        rows = [row for p in paths for row in untied(p.read_text(encoding="utf-8"), p.name)]
        print("\n".join(rows))
        print(f"{len(rows)} numbers that look measured have no marker")
        return 0
    count, problems = check_docs(paths)
    for problem in problems:
        print(problem)
    print(f"{count} figures checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
