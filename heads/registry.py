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


def is_auto(spec_or_kind: str) -> bool:
    """Whether a spec (or its kind) is ``auto:KIND[=DIR]``: chosen per step (``heads/auto.py``)."""
    return spec_or_kind.startswith(families.AUTO_PREFIX)


def inner_kind(kind: str) -> str:
    """The wrapped kind of ``auto:KIND``; any other kind itself."""
    return kind[len(families.AUTO_PREFIX) :] if is_auto(kind) else kind


def spec_problem(spec: str) -> str | None:
    """What is wrong with one spec (unknown kind, missing or unexpected path), or None."""
    kind, path = parse_spec(spec)
    if is_auto(kind):
        inner = inner_kind(kind)
        if inner not in families.auto_kinds():
            return f"{spec!r}: auto wraps one of {tuple(families.auto_kinds())}, not {inner!r}"
        kind = inner
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
    chosen = {inner_kind(k) for k in kinds} | ({"ngram"} if any(map(is_auto, kinds)) else set())
    return [
        f"{'/'.join(options)} need drafter: {' or '.join(names)}"
        for names, options in groups.items()
        if not chosen & set(names) and any(settings.get(o) for o in options)
    ]


def build(spec: str, options: BuildOptions) -> Any:
    """The drafter a (checked, see :func:`spec_problem`) spec asks for; None for ``none``.

    ``auto:KIND[=DIR]``: KIND's drafter and the lookups (n-gram with the run's bounds, suffix)
    under a per-step decision (:class:`~draftsmith.heads.auto.AutoDrafter`) over
    ``options.verify_costs``, with an identity calibration until the caller fits or loads one.
    """
    kind, path = parse_spec(spec)
    if not is_auto(kind):
        return DRAFTERS[kind].build(path, options)
    from .auto import AutoDrafter
    from .ngram import NGramDrafter
    from .suffix import SuffixDrafter

    if options.verify_costs is None:
        raise ValueError(f"{spec!r}: auto needs the target's verify costs (evaluate probes them)")
    learned = DRAFTERS[inner_kind(kind)].build(path, options)
    lookups = [NGramDrafter(max_ngram=options.ngram_max, min_ngram=options.ngram_min)]
    lookups.append(SuffixDrafter())
    return AutoDrafter(learned, lookups, options.verify_costs, clock=options.clock)


def kinds_help() -> str:
    """Every kind with its path syntax and help, for ``--drafter``'s help text."""
    syntax = {"required": "=DIR", "optional": "[=DIR]", "none": ""}
    return ", ".join(
        f"{name}{syntax[kind.path]}" + (f" ({kind.help})" if kind.help else "")
        for name, kind in DRAFTERS.items()
    ) + (
        f", {families.AUTO_PREFIX}KIND[=DIR] (KIND = {'/'.join(families.auto_kinds())} with "
        "n-gram and suffix lookup; what to verify chosen per step from calibrated confidences "
        "and this machine's verify costs)"
    )
