"""The house rules, checked on the source tree: who may import whom, and what a wheel contains.

- ``heads/`` (drafters and their contract) imports nothing from ``train/`` or ``recipes/``.
- ``train/`` (the library) never imports ``recipes/``: recipes and the console entry sit on top.
- Every package directory is listed in ``pyproject.toml``'s ``packages``, so a non-editable
  install (a wheel) holds every room, not only the top-level ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOMS = ("train", "heads", "recipes")


def _imports(path: Path) -> list[str]:
    """Every module name imported by ``path``, also inside functions; relative imports of a
    module in a room are resolved to their ``draftsmith.*`` names (``from ..errors import x`` in
    ``train/data/files.py`` is ``draftsmith.train.errors`` and ``draftsmith.train.errors.x``)."""
    parts = path.relative_to(REPO).parts
    package = ["draftsmith", *parts[:-1]] if parts[0] in ROOMS else []
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                assert package, f"{path}: a relative import outside the package"
                anchor = package[: len(package) - (node.level - 1)]
                module = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def _sources(room: str) -> list[Path]:
    return sorted((REPO / room).rglob("*.py"))


@pytest.mark.parametrize(
    ("room", "forbidden"),
    [("heads", ("draftsmith.train", "draftsmith.recipes")), ("train", ("draftsmith.recipes",))],
)
def test_import_direction(room: str, forbidden: tuple[str, ...]) -> None:
    bad = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in _sources(room)
        for name in _imports(path)
        if name.startswith(forbidden)
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("room", "forbidden"),
    [
        # Tokenized data (train/data) sits below hidden states (train/features): a feature
        # cache is built from token data, never the other way round.
        ("train/data", ("draftsmith.train.features", "draftsmith.train.core")),
        # The training core assembles data and runs; it does not know feature caches' types.
        ("train/core", ("draftsmith.train.features",)),
        # Reports format what others computed; the job runner (train/jobs) calls them.
        ("train/report", ("draftsmith.train.jobs",)),
    ],
)
def test_imports_do_not_run_up_the_layers(room: str, forbidden: tuple[str, ...]) -> None:
    bad = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in sorted((REPO / room).rglob("*.py"))
        for name in _imports(path)
        if name.startswith(forbidden)
    ]
    assert not bad, "\n".join(bad)


def test_every_package_is_listed_for_the_wheel() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    on_disk = {
        "draftsmith." + ".".join(init.parent.relative_to(REPO).parts)
        for room in ROOMS
        for init in (REPO / room).rglob("__init__.py")
    }
    assert on_disk == listed


def test_imports_name_modules_that_exist() -> None:
    """Every ``draftsmith.*`` module imported anywhere in the tree is a file or package here."""
    missing = []
    for room in (*ROOMS, "scripts", "tests"):
        for path in _sources(room):
            for name in _imports(path):
                if not name.startswith("draftsmith."):
                    continue
                parts = name.split(".")[1:]
                base = REPO.joinpath(*parts)
                parent = REPO.joinpath(*parts[:-1])
                # `from pkg.mod import name`: the last part may be a name inside parent.py.
                if not (
                    base.with_suffix(".py").is_file()
                    or (base / "__init__.py").is_file()
                    or parent.with_suffix(".py").is_file()
                    or (parent / "__init__.py").is_file()
                ):
                    missing.append(f"{path.relative_to(REPO)}: {name}")
    assert not missing, "\n".join(missing)
