"""Typed configs: dataclasses with defaults and help, YAML overrides, CLI flags, validation.

A config is a dataclass whose fields carry a type, a default and a help string
(:func:`cfg_field`). Values are layered: field defaults, then a YAML file (which may only
override existing fields), then overrides (command-line flags). Every problem found on the
way -- unknown keys and flags (with a did-you-mean), wrong types, bad choices, and whatever the
class's own ``validate()`` returns -- is collected and raised as ONE :class:`ConfigError` that
names each field.

Example:
    @dataclass
    class TrainConfig:
        lr: float = cfg_field(3e-4, help="peak learning rate")

        def validate(self) -> list[tuple[str, str]]:
            return [("lr", "must be > 0")] if self.lr <= 0 else []

    cfg = parse_config(TrainConfig)  # e.g. --config run.yaml --lr 1e-4
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
import sys
import textwrap
import types
from collections.abc import Mapping, Sequence
from dataclasses import MISSING
from pathlib import Path, PurePath
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")
_NONE = type(None)
_BOOL_STRINGS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


class ConfigError(ValueError):
    """Every problem with a config at once.

    Attributes:
        problems: ``(field, problem)`` pairs; nested fields are dotted (``"model.dim"``).
    """

    def __init__(self, problems: Sequence[tuple[str, str]], header: str = "invalid config"):
        self.problems = [(str(f), str(p)) for f, p in problems]
        n = len(self.problems)
        lines = [f"{header}: {n} problem{'s' if n != 1 else ''}"]
        lines += [f"  {f}: {p}" for f, p in self.problems]
        super().__init__("\n".join(lines))


class _Mismatch(Exception):
    """A value that does not fit an annotation (internal; becomes a ConfigError line)."""


def cfg_field(
    default: Any = MISSING,
    *,
    help: str,
    default_factory: Any = MISSING,
    choices: Sequence | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A ``dataclasses.field`` carrying help text, optional allowed values and a range.

    A list/dict/set ``default`` is turned into a copying ``default_factory``. The range bounds
    apply to a number (or each item of a list of numbers; ``None`` is always allowed) and are
    checked by the loader, so ``validate()`` keeps only the checks that involve several fields.
    Every float field must also be finite: ``nan`` or ``inf`` never passes (a NaN learning rate
    would train a NaN model to the end).

    Args:
        default: The default value; omit (with no factory) to make the field required.
        help: One line for ``--help``.
        default_factory: Zero-argument callable producing the default.
        choices: If given, the value (or each item of a list value) must be one of these.
        ge: The value must be ``>= ge``.
        gt: The value must be ``> gt``.
        le: The value must be ``<= le``.
        lt: The value must be ``< lt``.
    """
    if isinstance(default, (list, dict, set)):
        default, default_factory = MISSING, functools.partial(copy.deepcopy, default)
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    metadata = {
        "help": help,
        "choices": tuple(choices) if choices is not None else None,
        "bounds": bounds,
    }
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


_BOUND_TEXT = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
_BOUND_OK = {
    "ge": lambda v, b: v >= b,
    "gt": lambda v, b: v > b,
    "le": lambda v, b: v <= b,
    "lt": lambda v, b: v < b,
}


def _range_problem(value: Any, bounds: Mapping[str, float]) -> str | None:
    """Why ``value`` (a number, a list of numbers or None) is out of range, or None if it is not."""
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            continue
        if isinstance(item, float) and not math.isfinite(item):
            return f"must be a finite number, got {item}"
        failed = [k for k, b in bounds.items() if not _BOUND_OK[k](item, b)]
        if failed:
            if len(bounds) == 1:
                return f"must be {_BOUND_TEXT[failed[0]]} {bounds[failed[0]]}, got {item}"
            low = next((k for k in ("ge", "gt") if k in bounds), None)
            high = next((k for k in ("le", "lt") if k in bounds), None)
            left = "[" if low == "ge" else "("
            right = "]" if high == "le" else ")"
            lo = bounds[low] if low else "-inf"
            hi = bounds[high] if high else "inf"
            return f"must be in {left}{lo}, {hi}{right}, got {item}"
    return None


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _type_name(tp: Any) -> str:
    if get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if tp is _NONE:
        return "None"
    return tp.__name__ if isinstance(tp, type) and not get_args(tp) else repr(tp)


def _coerce(value: Any, tp: Any, lenient: bool) -> Any:
    """Convert ``value`` to annotation ``tp``; ``lenient`` also parses strings (CLI)."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and _NONE in args:
            return None
        if lenient and _NONE in args and str not in args and str(value).lower() in ("none", "null"):
            return None
        arms = [a for a in args if a is not _NONE]
        for arm in arms:
            try:
                return _coerce(value, arm, lenient)
            except _Mismatch as e:
                if len(arms) == 1:
                    raise _Mismatch(f"{e} (or None)" if _NONE in args else str(e)) from None
        raise _Mismatch(f"expected {_type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        for allowed in args:
            if type(value) is type(allowed) and value == allowed:
                return allowed
            if lenient and isinstance(value, str) and value == str(allowed):
                return allowed
        raise _Mismatch(f"must be one of {list(args)}, got {value!r}")
    if origin in (list, tuple) or tp in (list, tuple):  # list[X], tuple[X, ...]
        if not isinstance(value, (list, tuple)):
            raise _Mismatch(f"expected a list ({_type_name(tp)}), got {_describe(value)}")
        items = []
        for i, item in enumerate(value):
            try:
                items.append(_coerce(item, args[0] if args else Any, lenient))
            except _Mismatch as e:
                raise _Mismatch(f"item {i}: {e}") from None
        return tuple(items) if (origin or tp) is tuple else items
    if tp is bool:
        if isinstance(value, bool):
            return value
        if lenient and isinstance(value, str) and value.lower() in _BOOL_STRINGS:
            return _BOOL_STRINGS[value.lower()]
        raise _Mismatch(f"expected bool (true/false), got {_describe(value)}")
    if tp in (int, float) and not isinstance(value, bool):
        if isinstance(value, int) or (tp is float and isinstance(value, float)):
            return tp(value)
        # Strings: from the CLI, and for floats also from YAML (PyYAML reads `1e-4` as a str).
        if isinstance(value, str) and (lenient or tp is float):
            with contextlib.suppress(ValueError):
                return tp(value)
    if isinstance(tp, type) and issubclass(tp, PurePath) and isinstance(value, (str, PurePath)):
        # "~/..." in a shipped YAML means the user's home, as on a command line.
        return tp(os.path.expanduser(str(value)))
    if isinstance(tp, type) and origin is None:
        if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
            return value
        raise _Mismatch(f"expected {_type_name(tp)}, got {_describe(value)}")
    return value  # an annotation we do not check (e.g. a TypeVar)


def _is_config_class(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else MISSING


def _shallow(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in _init_fields(type(obj))}


def _build(cls: type, layers: list[tuple[Mapping, bool]], prefix: str, problems: list) -> Any:
    """Instantiate ``cls`` from ``(mapping, lenient)`` layers (later wins); append problems."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in _init_fields(cls)}
    for data, _ in layers:
        for key in data:
            if key not in fields:
                close = difflib.get_close_matches(str(key), list(fields), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                problems.append((f"{prefix}{key}", f"unknown field{hint}"))
    kwargs: dict[str, Any] = {}
    complete = True
    for name, f in fields.items():
        tp, path = hints[name], prefix + name
        given = [(data[name], lenient) for data, lenient in layers if name in data]
        if _is_config_class(tp):
            default = _default_of(f)
            sub = [(_shallow(default), False)] if isinstance(default, tp) else []
            for value, lenient in given:
                if isinstance(value, tp):
                    sub = [(_shallow(value), False)]
                elif isinstance(value, Mapping):
                    sub.append((value, lenient))
                else:
                    problems.append((path, f"expected a mapping, got {_describe(value)}"))
            kwargs[name] = _build(tp, sub, path + ".", problems)
            complete = complete and kwargs[name] is not None
            continue
        for value, lenient in given:
            try:
                kwargs[name] = _coerce(value, tp, lenient)
            except _Mismatch as e:
                problems.append((path, str(e)))
        choices = f.metadata.get("choices")
        if choices is not None and name in kwargs:
            items = kwargs[name] if isinstance(kwargs[name], (list, tuple)) else [kwargs[name]]
            bad = [v for v in items if v not in choices]
            if bad:
                problems.append((path, f"must be one of {list(choices)}, got {bad[0]!r}"))
                del kwargs[name]
        if name in kwargs:
            problem = _range_problem(kwargs[name], f.metadata.get("bounds") or {})
            if problem is not None:
                problems.append((path, problem))
        if name not in kwargs and _default_of(f) is MISSING:
            complete = False
            if not any(p == path for p, _ in problems):
                problems.append((path, "required (no default) but not set"))
    if not complete:
        return None
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        problems.append((prefix.rstrip(".") or cls.__name__, f"{type(e).__name__}: {e}"))
        return None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        reported = {p for p, _ in problems}  # a field with a type error holds its default
        for item in validate() or []:
            field, problem = item if isinstance(item, tuple) else _split_problem(str(item))
            if prefix + field not in reported:
                problems.append((prefix + field if field else cls.__name__, problem))
    return obj


def _split_problem(text: str) -> tuple[str, str]:
    field, sep, problem = text.partition(": ")
    return (field, problem) if sep and " " not in field else ("", text)


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"model.dim": 8}`` -> ``{"model": {"dim": 8}}`` (copies; never mutates ``flat``)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = str(key).split(".")
        node = out
        for parent in parents:
            existing = node.get(parent)
            node[parent] = dict(existing) if isinstance(existing, Mapping) else {}
            node = node[parent]
        node[leaf] = value
    return out


def load_config(
    cls: type[T],
    yaml_path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build a config: defaults <- YAML file <- ``overrides``, then check everything.

    YAML values must already have the field's type (ints are accepted for floats, strings
    for Paths); override values may also be strings as typed on a command line. Override
    keys may be dotted to reach nested configs (``"model.dim"``).

    Args:
        cls: The config dataclass.
        yaml_path: Optional YAML file holding a mapping of field names to values.
        overrides: Optional field values that win over the YAML.

    Returns:
        The config instance.

    Raises:
        ConfigError: Listing every problem: unknown keys, type errors, bad choices,
            missing required fields and the problems ``cls.validate()`` returns.
    """
    return _load_config(cls, yaml_path, overrides, [])


def _load_config(
    cls: type[T],
    yaml_path: str | Path | None,
    overrides: Mapping[str, Any] | None,
    problems: list[tuple[str, str]],
) -> T:
    """:func:`load_config`, reporting ``problems`` found before (bad flags) with its own."""
    layers: list[tuple[Mapping, bool]] = []
    if yaml_path is not None:
        try:
            data = yaml.safe_load(Path(yaml_path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            problems.append((str(yaml_path), f"cannot read YAML: {e}"))
            data = {}
        if isinstance(data, Mapping):
            layers.append((data, False))
        else:
            kind = type(data).__name__
            problems.append((str(yaml_path), f"must hold a mapping of fields, got a {kind}"))
    if overrides:
        layers.append((_nest(overrides), True))
    obj = _build(cls, layers, "", problems)
    if problems:
        source = f" (from {yaml_path})" if yaml_path is not None else ""
        raise ConfigError(problems, f"invalid {cls.__name__}{source}")
    return obj


def as_list(x: Any) -> list:
    """``x`` as a list: None is empty, arrays and tensors convert, a single value is wrapped.

    For values that come as one item or several (``generation_config.eos_token_id``: None, an
    int or a list) and token rows that come as lists, tuples, numpy arrays or tensors.

    >>> as_list(None), as_list(2), as_list((1, 2))
    ([], [2], [1, 2])
    """
    if x is None:
        return []
    if hasattr(x, "tolist"):  # numpy arrays and scalars, torch tensors
        x = x.tolist()
    return list(x) if isinstance(x, (list, tuple, set)) else [x]


def _plain(value: Any) -> Any:
    if _is_config_class(type(value)):
        return {name: _plain(v) for name, v in _shallow(value).items()}
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain JSON/YAML-safe data (Paths -> str, tuples -> lists), nested."""
    return _plain(cfg)


def dump_config(cfg: Any, path: str | Path) -> None:
    """Write the config as YAML that :func:`load_config` reads back to an equal config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def _add_fields(
    parser: argparse.ArgumentParser, group: Any, cls: type, prefix: str, defaults: Any
) -> None:
    hints = get_type_hints(cls)
    for f in _init_fields(cls):
        tp, path = hints[f.name], prefix + f.name
        default = getattr(defaults, f.name) if defaults is not None else _default_of(f)
        if _is_config_class(tp):
            sub = parser.add_argument_group(path, f.metadata.get("help"))
            _add_fields(parser, sub, tp, path + ".", default if isinstance(default, tp) else None)
            continue
        shown = "required" if default is MISSING else f"default: {_plain(default)}"
        help_text = f"{f.metadata.get('help', '')} ({shown})".strip().replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": path, "default": argparse.SUPPRESS, "help": help_text}
        args = [a for a in get_args(tp) if a is not _NONE]
        base = args[0] if get_origin(tp) in (Union, types.UnionType) and len(args) == 1 else tp
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            item = base
            if get_origin(base) in (list, tuple) or base in (list, tuple):
                kwargs["nargs"] = "+"
                item = get_args(base)[0] if get_args(base) else str
            choices = f.metadata.get("choices") or (
                get_args(item) if get_origin(item) is Literal else None
            )
            if choices:
                kwargs["choices"] = [str(c) for c in choices] + (["none"] if base is not tp else [])
            else:
                kwargs["metavar"] = item.__name__.upper() if isinstance(item, type) else "VALUE"
        group.add_argument("--" + path.replace("_", "-"), **kwargs)


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` that keeps the layout of a description or epilog written as a docstring.

    argparse's default formatter joins every line into one paragraph, so a recipe docstring's
    ``Launch::`` examples run together. Here paragraphs (split at blank lines) are re-wrapped to
    the terminal as before, but a paragraph holding an indented line or a bullet (``*``, ``-``)
    -- a launch example, a table, a list -- prints line by line as written. Option help is
    wrapped as by default (the config flags already show their defaults).
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(text))
        out = []
        for paragraph in paragraphs:
            lines = paragraph.splitlines()
            if any(line[:1].isspace() or line.startswith(("* ", "- ")) for line in lines):
                out.append("\n".join(indent + line.rstrip() for line in lines))
            else:
                out.append(
                    textwrap.fill(
                        " ".join(paragraph.split()),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                    )
                )
        return "\n\n".join(out)


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add ``--config PATH`` and one ``--field-name`` flag per field of ``cls``.

    Flags default to ``argparse.SUPPRESS``, so only flags the user gave appear in the
    namespace. Bools get ``--flag/--no-flag``, lists take one or more values, Literal and
    ``choices`` fields list their choices; nested configs get ``--outer.inner-name``.
    Values stay strings: :func:`config_from_args` converts and checks them.
    """
    parser.add_argument(
        "--config", metavar="PATH", default=None, help="YAML file overriding the defaults"
    )
    _add_fields(parser, parser, cls, "", None)


def _leaf_paths(cls: type, prefix: str = "") -> list[str]:
    hints = get_type_hints(cls)
    paths = []
    for f in _init_fields(cls):
        tp = hints[f.name]
        paths += (
            _leaf_paths(tp, f"{prefix}{f.name}.") if _is_config_class(tp) else [prefix + f.name]
        )
    return paths


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build ``cls`` from a namespace parsed by a parser given :func:`add_config_arguments`."""
    return _config_from_args(cls, args, [])


def _config_from_args(cls: type[T], args: argparse.Namespace, problems: list) -> T:
    given = {path: getattr(args, path) for path in _leaf_paths(cls) if hasattr(args, path)}
    return _load_config(cls, getattr(args, "config", None), given, problems)


_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse's: a value, not a flag


def _unrecognized(
    parser: argparse.ArgumentParser, argv: Sequence[str], extras: Sequence[str]
) -> list[tuple[str, str]]:
    """Problems for the ``extras`` of ``parser.parse_known_args(argv)``: unknown flags, each
    with a did-you-mean to the closest real flag, and arguments that no flag takes. The values
    after an unknown flag (``--stpes 10``) are taken as its own, not reported again."""
    flags = sorted(s for s in parser._option_string_actions if s.startswith("--"))
    problems: list[tuple[str, str]] = []
    at, values_at = -1, None  # argv index of the extra; where an unknown flag's values start
    for i, token in enumerate(extras):
        with contextlib.suppress(ValueError):  # extras are argv's own tokens, in order
            at = argv.index(token, at + 1)
        if token == "--":
            rest = " ".join(extras[i + 1 :])
            problems.append(("--", f"this command takes flags only, got {rest!r} after '--'"))
            break
        # A flag as argparse tells them apart: not "-1", not a value holding a space.
        flag_like = token[:1] in parser.prefix_chars and len(token) > 1 and " " not in token
        if flag_like and not _NEGATIVE_NUMBER.match(token):
            name, inline, _ = token.partition("=")
            close = difflib.get_close_matches(name, flags, n=1)
            hint = f"did you mean {close[0]}?" if close else "--help lists the flags"
            problems.append((name, f"unknown flag ({hint})"))
            values_at = None if inline else at + 1
            continue
        if at == values_at:  # a value of the unknown flag just before
            values_at += 1
            continue
        before = argv[at - 1] if at > 0 else ""
        action = parser._option_string_actions.get(before.partition("=")[0])
        why = f"{before} takes no value" if action and action.nargs == 0 else "no flag takes it"
        problems.append((token, f"unexpected argument ({why})"))
    return problems


def parse_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    description: str | None = None,
) -> T:
    """Parse command-line flags (``sys.argv[1:]`` by default) into a ``cls`` config.

    ``description`` may be a module docstring: its launch examples print as written
    (:class:`HelpFormatter`).

    Unknown flags (``--stpes: unknown flag (did you mean --steps?)``) and arguments no flag
    takes are problems of the same :class:`ConfigError` as those of the YAML and of the flags'
    values (type, range, ``validate()``), so one run names them all. A unique prefix of a flag
    is still that flag.

    Raises:
        ConfigError: As :func:`load_config`; errors name the field, not the flag, except
            for unknown flags and stray arguments.
        SystemExit: ``--help`` (0), or what argparse itself refuses (2): a flag without its
            value, a value outside a flag's choices, an ambiguous prefix.
    """
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=HelpFormatter
    )
    add_config_arguments(parser, cls)
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extras = parser.parse_known_args(argv)
    return _config_from_args(cls, args, _unrecognized(parser, argv, extras))
