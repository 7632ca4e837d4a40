"""Every ``--drafter`` kind, in one dict: :data:`DRAFTERS` maps a kind to how it is built.

A spec is ``KIND`` or ``KIND=PATH``. The kinds are those of the family declaration
(:data:`draftsmith.heads.families.FAMILIES`); each names its builder, a
:class:`~draftsmith.heads.base.DrafterKind` in its drafter module (a builder, whether it takes a
path, a line of help). Callers (``draftsmith evaluate``) check and build specs only through the
functions here. Adding a drafter is one module in ``heads/`` and its family's entry
(docs/design.md, "Adding a family").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from . import families
from .base import BuildOptions, DrafterKind


def _plain(path: str | None, options: BuildOptions) -> None:
    """``none``: no drafter; the caller runs plain decoding only."""
    return None


DRAFTERS: dict[str, DrafterKind] = {
    **{name: families.resolve(kind.builder) for name, kind in families.kinds().items()},
    families.PLAIN_KIND: DrafterKind(_plain, help="plain decoding only"),
}


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``KIND`` or ``KIND=PATH`` -> ``(kind, path)``; an empty path counts as none."""
    kind, _, path = spec.partition("=")
    return kind, path or None


def spec_problem(spec: str) -> str | None:
    """What is wrong with one spec (unknown kind, missing or unexpected path), or None."""
    kind, path = parse_spec(spec)
    if kind not in DRAFTERS:
        return f"{spec!r}: kind must be one of {tuple(DRAFTERS)}"
    rule = DRAFTERS[kind].path
    if rule == "required" and not path:
        return f"{spec!r}: {kind} needs a directory: {kind}=DIR"
    if rule == "none" and path:
        return f"{spec!r}: {kind} takes no path"
    return None


def unused_settings(kinds: Iterable[str], settings: Mapping[str, Any]) -> list[str]:
    """Problems with settings given for kinds that are not run (e.g. ``draft_layers`` with ngram).

    Args:
        kinds: the kinds of the run's specs.
        settings: option values by :class:`~draftsmith.heads.base.BuildOptions` field name; a
            falsy value counts as not given.

    Returns:
        One message per group of settings that the same kinds read, none of them in ``kinds``.
    """
    readers: dict[str, list[str]] = {}  # setting -> the kinds that read it
    for name, kind in DRAFTERS.items():
        for option in kind.uses:
            readers.setdefault(option, []).append(name)
    groups: dict[tuple[str, ...], list[str]] = {}  # readers -> the settings they read
    for option, names in readers.items():
        groups.setdefault(tuple(names), []).append(option)
    chosen = set(kinds)
    return [
        f"{'/'.join(options)} need drafter: {' or '.join(names)}"
        for names, options in groups.items()
        if not chosen & set(names) and any(settings.get(o) for o in options)
    ]


def build(spec: str, options: BuildOptions) -> Any:
    """The drafter a (checked, see :func:`spec_problem`) spec asks for; None for ``none``."""
    kind, path = parse_spec(spec)
    return DRAFTERS[kind].build(path, options)


def kinds_help() -> str:
    """Every kind with its path syntax and help, for ``--drafter``'s help text."""
    syntax = {"required": "=DIR", "optional": "[=DIR]", "none": ""}
    return ", ".join(
        f"{name}{syntax[kind.path]}" + (f" ({kind.help})" if kind.help else "")
        for name, kind in DRAFTERS.items()
    )
