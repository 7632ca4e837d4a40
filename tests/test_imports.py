"""No import circles: the package's module import graph, read from the source tree, has no cycle.

The graph is built with ``ast`` from the files under ``train/``, ``heads/`` and ``recipes/``
(what setuptools installs as ``draftsmith.train``, ``draftsmith.heads``, ``draftsmith.recipes``),
without importing anything: a node is a file, an edge ``a -> b`` means ``a`` imports a
``draftsmith.*`` name that lives in ``b`` (``draftsmith.train.x.y`` is ``train/x/y.py`` or
``train/x/y/__init__.py``; ``from draftsmith.heads import eagle`` is ``heads/eagle.py``;
``from draftsmith.heads.eagle import EagleConfig`` is ``heads/eagle.py``). Relative imports are
resolved the same way.

Every import counts, wherever it stands in the module: at the top, inside a function, and under
``if TYPE_CHECKING:``. A lazy import only moves the circle from import time to call time, and a
type-only import is still a dependency a reader, a type checker and an import-following tool
see; such imports are how circles hide (the EAGLE heads' circle ran through a ``TYPE_CHECKING``
import, the export CLI's through imports inside functions). Only ``if __name__ ==
"__main__":`` blocks would be a fair exception (the file then runs as ``__main__``, which
nothing imports back); the package has none that import a module of ours, so none is made.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOMS = ("train", "heads", "recipes")
PACKAGE = "draftsmith"


def module_files(repo: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package."""
    modules = {}
    for room in ROOMS:
        for path in sorted((repo / room).rglob("*.py")) if (repo / room).is_dir() else []:
            parts = path.relative_to(repo).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((PACKAGE, *parts))] = path
    return modules


def _owner(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module that holds ``name``: the longest dotted prefix of it that is a module."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def _imports(module: str, modules: Mapping[str, Path]) -> Iterator[tuple[str, int]]:
    """``(imported module, line)`` for every import of ours in ``module``, anywhere in it.

    ``import a.b.c`` and ``from a.b.c import name`` point at the module holding ``a.b.c``;
    ``from a.b import c`` at ``a.b.c`` when that is a module, else at ``a.b``.
    """
    path = modules[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            owner = _owner(name, modules) if name.startswith(PACKAGE + ".") else None
            if owner is not None:
                yield owner, node.lineno


def import_graph(modules: Mapping[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {imported module: line of its first import}; a module importing itself is
    left out."""
    graph: dict[str, dict[str, int]] = {}
    for module in modules:
        edges: dict[str, int] = {}
        for owner, line in sorted(_imports(module, modules), key=lambda edge: edge[1]):
            if owner != module:
                edges.setdefault(owner, line)
        graph[module] = edges
    return graph


def find_cycles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected component of several modules.

    Returns:
        Cycles as module lists ``[a, b, ..., a]``, sorted; ``[]`` when the graph is acyclic.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(start: str) -> None:  # Tarjan's algorithm, iterative
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)
    return sorted(_shortest_cycle(graph, set(c)) for c in components)


def _shortest_cycle(graph: Mapping[str, Mapping[str, int]], component: set[str]) -> list[str]:
    """The shortest cycle through the component's first module (breadth-first, inside it)."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, {})):
                if child not in component:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in its own component")  # pragma: no cover


def _describe(
    cycle: list[str],
    graph: Mapping[str, Mapping[str, int]],
    modules: Mapping[str, Path],
    root: Path = REPO,
) -> str:
    """The cycle on one line, then each import in it as ``file:line imports module``."""
    steps = [
        f"  {modules[a].relative_to(root)}:{graph[a][b]} imports {b}"
        for a, b in itertools.pairwise(cycle)
    ]
    return " -> ".join(m.removeprefix(PACKAGE + ".") for m in cycle) + "\n" + "\n".join(steps)


# --------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------


def test_no_import_cycles_between_modules() -> None:
    modules = module_files()
    graph = import_graph(modules)
    cycles = find_cycles(graph)
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(
        _describe(c, graph, modules) for c in cycles
    )


def test_the_graph_sees_every_kind_of_import() -> None:
    """The reader finds top-level, lazy, TYPE_CHECKING and ``from pkg import module`` imports
    (so an empty result means no cycles, not a reader that sees nothing)."""
    modules = module_files()
    graph = import_graph(modules)
    assert sum(map(len, graph.values())) > 200
    # `from . import families`: the submodule, not heads/__init__.py.
    assert "draftsmith.heads.families" in graph["draftsmith.heads.registry"]
    assert "draftsmith.heads" not in graph["draftsmith.heads.registry"]
    # Type-only imports.
    assert "draftsmith.heads.eagle_config" in graph["draftsmith.heads.eagle_model"]
    # Imports inside functions (the CLI's dispatch imports each command lazily).
    assert "draftsmith.recipes.evaluate" in graph["draftsmith.recipes.cli"]
    assert "draftsmith.train.export.command" in graph["draftsmith.recipes.cli"]


@pytest.mark.parametrize(
    ("sources", "cycle"),
    [
        # A lazy import inside a function closes a circle.
        (
            {
                "a.py": "from draftsmith.train.b import x\n",
                "b.py": "x = 1\ndef f():\n    from draftsmith.train.a import y\n",
            },
            ["a", "b", "a"],
        ),
        # So does a type-only import, and `from pkg import module` names the module.
        (
            {
                "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from draftsmith.train.pkg import c\n",
                "pkg/__init__.py": "",
                "pkg/c.py": "from . import d\n",
                "pkg/d.py": "from ..a import z\n",
            },
            ["a", "pkg.c", "pkg.d", "a"],
        ),
    ],
)
def test_cycles_are_found_and_printed(tmp_path, sources, cycle) -> None:
    for name, text in sources.items():
        path = tmp_path / "train" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "train" / "__init__.py").write_text("")
    modules = module_files(tmp_path)
    graph = import_graph(modules)
    assert find_cycles(graph) == [[f"{PACKAGE}.train.{m}" for m in cycle]]
    text = _describe(find_cycles(graph)[0], graph, modules, tmp_path)
    assert text.splitlines()[0] == " -> ".join(f"train.{m}" for m in cycle)
    assert "train/a.py:" in text


def test_imports_inside_the_package_are_relative() -> None:
    """Modules import each other relatively (``from ..heads import eagle``), so the graph follows
    from the folders alone: tools that read the source tree without installing it (where
    ``draftsmith.train`` maps onto ``train/`` only through ``pyproject.toml``) see every arrow.
    Recipes also run as files (``python recipes/eagle.py``); they set ``__package__`` first
    (PEP 366) so that the same relative imports resolve."""
    absolute = []
    for path in module_files().values():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            absolute += [
                f"{path.relative_to(REPO)}:{node.lineno} imports {name}"
                for name in names
                if name == PACKAGE or name.startswith(PACKAGE + ".")
            ]
    assert not absolute, "absolute imports of our own modules:\n" + "\n".join(absolute)
    for path in sorted((REPO / "recipes").glob("*.py")):
        text = path.read_text()
        if 'if __name__ == "__main__"' in text and "from ." in text:
            assert '__package__ = "draftsmith.recipes"' in text, f"{path.name} lacks PEP 366"
