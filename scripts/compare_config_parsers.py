"""Our config parser against jsonargparse, tyro and HfArgumentParser, measured (issue 23).

Each parser declares the same representative config the way its documentation shows -- eight
fields: an int and a float with a declared range, a Literal, a bool, a list of ints, a Path, an
optional str and a second ranged int -- and gets the same bad inputs, as command-line flags and
as a YAML file where the parser reads one:

1. ``three_at_once``: a misspelled key (``stpes`` for ``steps``), a wrong type (``seed: abc``)
   and an out-of-range value (``lr: 7.5``, declared ``0 < lr <= 1``);
2. ``misspelled``: the misspelled key alone (is ``steps`` suggested?);
3. ``out_of_range``: ``lr: 7.5`` alone (does the declared range stop it?);
4. ``wrong_choice``: ``precision: fp16`` (a Literal of fp32/bf16).

For each parser, case and source it records how the parser stops (an exit code or the exception),
how many of the case's problems the first error names (a problem counts as named when its bad
key or value appears in the error, usage lines left out), whether ``steps`` is suggested, and the
message; per parser the lines (and characters) the declaration took, how many of them are
hand-written validation, and the median in-process time of ``--help`` and of a valid parse, and
of importing the library (a fresh interpreter each time).

Ranges: ours, ``cfg_field(ge=, gt=, le=)``; jsonargparse, its restricted types (``PositiveInt``,
``NonNegativeInt``, ``restricted_number_type``); tyro and HfArgumentParser declare no ranges, so
they get the usual hand-written ``__post_init__`` check (counted). YAML: ours and jsonargparse
read ``--config FILE`` under the flags; tyro's documented way is ``default=Config(**yaml)``;
HfArgumentParser reads ``parse_yaml_file`` (no flags on top).

Run::

    pip install jsonargparse tyro     # not draftsmith dependencies
    python scripts/compare_config_parsers.py --out bench/cpu_costs/config_parsers.json
"""

import argparse
import contextlib
import io
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import yaml

from draftsmith.train.config import cfg_field, parse_config
from draftsmith.train.runinfo import machine_load, run_info

# Each case: the flags, the same input as a YAML file, and per problem the text (the bad key or
# value) an error must contain to count as naming it.
CASES: dict[str, dict[str, Any]] = {
    "three_at_once": {
        "flags": ["--stpes", "10", "--seed", "abc", "--lr", "7.5"],
        "yaml": "stpes: 10\nseed: abc\nlr: 7.5\n",
        "problems": {"misspelled key stpes": "stpes", "seed not an int": "abc", "lr > 1": "7.5"},
    },
    "misspelled": {
        "flags": ["--stpes", "10"],
        "yaml": "stpes: 10\n",
        "problems": {"misspelled key stpes": "stpes"},
    },
    "out_of_range": {
        "flags": ["--lr", "7.5"],
        "yaml": "lr: 7.5\n",
        "problems": {"lr > 1": "7.5"},
    },
    "wrong_choice": {
        "flags": ["--precision", "fp16"],
        "yaml": "precision: fp16\n",
        "problems": {"precision not fp32/bf16": "fp16"},
    },
}
VALID_YAML = "steps: 10\nlr: 0.1\nlayers: [3, 4]\n"
SUGGESTION = re.compile(r"\bsteps\b")


# ---- The declarations. Lines between "# <decl" and "# </decl>" are counted; "# <hand>" marks
# ---- the validation written by hand because the parser declares no ranges.


def declare_ours() -> type:
    # <decl ours>
    @dataclass
    class OursConfig:
        steps: int = cfg_field(100, help="optimizer steps", ge=1)
        lr: float = cfg_field(3e-4, help="peak learning rate", gt=0, le=1)
        precision: Literal["fp32", "bf16"] = cfg_field("bf16", help="training precision")
        compile: bool = cfg_field(False, help="torch.compile the draft")
        layers: list[int] = cfg_field([1, 2], help="target layers to tap")
        out_dir: Path = cfg_field(Path("runs"), help="output directory")
        resume: str | None = cfg_field(None, help="checkpoint to resume from")
        seed: int = cfg_field(0, help="random seed", ge=0)

    # </decl>
    return OursConfig


def declare_jsonargparse() -> type:
    from jsonargparse.typing import NonNegativeInt, PositiveInt, restricted_number_type

    # <decl jsonargparse>
    LearningRate = restricted_number_type("LearningRate", float, [(">", 0), ("<=", 1)])

    @dataclass
    class JsonargparseConfig:
        steps: PositiveInt = 100
        """optimizer steps"""
        lr: LearningRate = 3e-4
        """peak learning rate"""
        precision: Literal["fp32", "bf16"] = "bf16"
        """training precision"""
        compile: bool = False
        """torch.compile the draft"""
        layers: list[int] = field(default_factory=lambda: [1, 2])
        """target layers to tap"""
        out_dir: Path = Path("runs")
        """output directory"""
        resume: str | None = None
        """checkpoint to resume from"""
        seed: NonNegativeInt = 0
        """random seed"""

    # </decl>
    return JsonargparseConfig


def declare_tyro() -> type:
    # <decl tyro>
    @dataclass
    class TyroConfig:
        steps: int = 100
        """optimizer steps (>= 1)"""
        lr: float = 3e-4
        """peak learning rate, in (0, 1]"""
        precision: Literal["fp32", "bf16"] = "bf16"
        """training precision"""
        compile: bool = False
        """torch.compile the draft"""
        layers: list[int] = field(default_factory=lambda: [1, 2])
        """target layers to tap"""
        out_dir: Path = Path("runs")
        """output directory"""
        resume: str | None = None
        """checkpoint to resume from"""
        seed: int = 0
        """random seed (>= 0)"""

        # <hand>
        def __post_init__(self) -> None:
            if self.steps < 1:
                raise ValueError(f"steps must be >= 1, got {self.steps}")
            if not 0 < self.lr <= 1:
                raise ValueError(f"lr must be in (0, 1], got {self.lr}")
            if self.seed < 0:
                raise ValueError(f"seed must be >= 0, got {self.seed}")

        # </hand>

    # </decl>
    return TyroConfig


def declare_hf() -> type:
    # <decl HfArgumentParser>
    @dataclass
    class HfConfig:
        steps: int = field(default=100, metadata={"help": "optimizer steps (>= 1)"})
        lr: float = field(default=3e-4, metadata={"help": "peak learning rate, in (0, 1]"})
        precision: Literal["fp32", "bf16"] = field(
            default="bf16", metadata={"help": "training precision"}
        )
        compile: bool = field(default=False, metadata={"help": "torch.compile the draft"})
        layers: list[int] = field(
            default_factory=lambda: [1, 2], metadata={"help": "target layers to tap"}
        )
        out_dir: Path = field(default=Path("runs"), metadata={"help": "output directory"})
        resume: str | None = field(default=None, metadata={"help": "checkpoint to resume from"})
        seed: int = field(default=0, metadata={"help": "random seed (>= 0)"})

        # <hand>
        def __post_init__(self) -> None:
            if self.steps < 1:
                raise ValueError(f"steps must be >= 1, got {self.steps}")
            if not 0 < self.lr <= 1:
                raise ValueError(f"lr must be in (0, 1], got {self.lr}")
            if self.seed < 0:
                raise ValueError(f"seed must be >= 0, got {self.seed}")

        # </hand>

    # </decl>
    return HfConfig


# ---- How each parser is called: flags, a YAML file (with flags on top where it can), --help.


def _ours_flags(cls: type, argv: Sequence[str]) -> Any:
    return parse_config(cls, list(argv), prog="train")


def _ours_yaml(cls: type, path: Path, argv: Sequence[str] = ()) -> Any:
    return parse_config(cls, ["--config", str(path), *argv], prog="train")


def _jsonargparse_flags(cls: type, argv: Sequence[str]) -> Any:
    from jsonargparse import auto_cli

    return auto_cli(cls, args=list(argv))


def _jsonargparse_yaml(cls: type, path: Path, argv: Sequence[str] = ()) -> Any:
    return _jsonargparse_flags(cls, ["--config", str(path), *argv])


def _tyro_flags(cls: type, argv: Sequence[str]) -> Any:
    import tyro

    return tyro.cli(cls, args=list(argv))


def _tyro_yaml(cls: type, path: Path, argv: Sequence[str] = ()) -> Any:
    import tyro

    # tyro's documented way to start from a YAML file: build the defaults from it.
    return tyro.cli(cls, args=list(argv), default=cls(**yaml.safe_load(path.read_text())))


def _hf_flags(cls: type, argv: Sequence[str]) -> Any:
    from transformers import HfArgumentParser

    return HfArgumentParser(cls).parse_args_into_dataclasses(list(argv))


def _hf_yaml(cls: type, path: Path, argv: Sequence[str] = ()) -> Any:
    from transformers import HfArgumentParser

    return HfArgumentParser(cls).parse_yaml_file(path)  # no flags on top


@dataclass
class Parser:
    name: str
    package: str  # for the version
    import_line: str  # what a CLI module imports (timed in a fresh interpreter)
    declare: Callable[[], type]
    flags: Callable[[type, Sequence[str]], Any]
    yaml: Callable[..., Any]
    valid_flags: list[str]
    ranges: str
    yaml_how: str


PARSERS = [
    Parser(
        "ours",
        "draftsmith",
        "from draftsmith.train.config import parse_config",
        declare_ours,
        _ours_flags,
        _ours_yaml,
        ["--steps", "5", "--lr", "0.1", "--precision", "fp32", "--compile", "--layers", "3", "4"],
        "declared: cfg_field(ge=, gt=, le=, lt=)",
        "--config FILE, flags on top; values type-checked",
    ),
    Parser(
        "jsonargparse",
        "jsonargparse",
        "from jsonargparse import auto_cli",
        declare_jsonargparse,
        _jsonargparse_flags,
        _jsonargparse_yaml,
        [
            "--steps",
            "5",
            "--lr",
            "0.1",
            "--precision",
            "fp32",
            "--compile",
            "true",
            "--layers",
            "[3,4]",
        ],
        "declared: restricted types (PositiveInt, NonNegativeInt, restricted_number_type)",
        "--config FILE, flags on top; values type-checked",
    ),
    Parser(
        "tyro",
        "tyro",
        "import tyro",
        declare_tyro,
        _tyro_flags,
        _tyro_yaml,
        ["--steps", "5", "--lr", "0.1", "--precision", "fp32", "--compile", "--layers", "3", "4"],
        "hand-written __post_init__ (no range declaration)",
        "default=Config(**yaml.safe_load(f)), flags on top; YAML values not type-checked",
    ),
    Parser(
        "HfArgumentParser",
        "transformers",
        "from transformers import HfArgumentParser",
        declare_hf,
        _hf_flags,
        _hf_yaml,
        ["--steps", "5", "--lr", "0.1", "--precision", "fp32", "--compile", "--layers", "3", "4"],
        "hand-written __post_init__ (no range declaration)",
        "parse_yaml_file(FILE), no flags on top; YAML values not type-checked",
    ),
]


# ---- Measuring.


def attempt(fn: Callable[[], Any]) -> tuple[str, str]:
    """Run ``fn`` quietly: ``("accepted", "")``, ``("exit N", stderr)`` or ``(exception, text)``."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            fn()
    except SystemExit as e:
        return f"exit {e.code}", err.getvalue() or out.getvalue()
    except Exception as e:  # the parser's own error, whatever its class
        return type(e).__name__, str(e)
    return "accepted", ""


def error_lines(message: str) -> list[str]:
    """The error's own lines: usage blocks, tips and box rules left out, lines stripped."""
    lines, in_usage = [], False
    for line in message.splitlines():
        if line.startswith("usage:"):
            in_usage = True
            continue
        if in_usage and line[:1].isspace():
            continue
        in_usage = False
        text = line.strip().strip("│").strip()
        if not text or text.startswith("tip:") or set(text) <= set("-─╭╮╰╯│ "):
            continue
        lines.append(text)
    return lines


def judge(outcome: str, message: str, case: dict[str, Any]) -> dict[str, Any]:
    lines = error_lines(message)
    text = "\n".join(lines)
    named = [p for p, token in case["problems"].items() if token in text]
    result = {
        "outcome": outcome,
        "problems": len(case["problems"]),
        "named": len(named),
        "named_problems": named,
        "first_line": lines[0] if lines else "",
        "message": text[:800],
    }
    if any(token == "stpes" for token in case["problems"].values()):
        result["suggests_steps"] = bool(SUGGESTION.search(text))
    return result


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        attempt(fn)
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def import_ms(line: str, repeats: int) -> float:
    """Median wall time of ``line`` in a fresh interpreter (startup itself not counted)."""
    code = f"import time; t = time.perf_counter(); {line}; print(time.perf_counter() - t)"
    runs = [
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
        for _ in range(repeats)
    ]
    return round(statistics.median(runs) * 1e3, 1)


def declaration_size(parser: str) -> dict[str, int]:
    """Non-blank, non-comment lines (and their characters) of a parser's declaration."""
    lines = Path(__file__).read_text().splitlines()
    start = lines.index(f"    # <decl {parser}>")
    end = lines.index("    # </decl>", start)
    code, hand, in_hand = [], 0, False
    for line in lines[start + 1 : end]:
        text = line.strip()
        if text in ("# <hand>", "# </hand>"):
            in_hand = text == "# <hand>"
            continue
        if text and not text.startswith("#"):
            code.append(text)
            hand += in_hand
    return {"lines": len(code), "chars": sum(len(t) for t in code), "hand_validation_lines": hand}


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def measure(parser: Parser, tmp: Path, repeats: int) -> dict[str, Any]:
    cls = parser.declare()
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        path = tmp / f"{parser.name}_{name}.yaml"
        path.write_text(case["yaml"])
        flags_outcome, flags_message = attempt(lambda c=case: parser.flags(cls, c["flags"]))
        yaml_outcome, yaml_message = attempt(lambda p=path: parser.yaml(cls, p))
        results[name] = {
            "flags": judge(flags_outcome, flags_message, case),
            "yaml": judge(yaml_outcome, yaml_message.replace(str(path), path.name), case),
        }
    valid = tmp / f"{parser.name}_valid.yaml"
    valid.write_text(VALID_YAML)
    for what, fn in (
        ("valid_flags", lambda: parser.flags(cls, parser.valid_flags)),
        ("valid_yaml", lambda: parser.yaml(cls, valid)),
    ):
        outcome, message = attempt(fn)
        if outcome != "accepted":
            raise RuntimeError(f"{parser.name}: a valid input was refused ({what}): {message}")
    return {
        "version": version(parser.package),
        "declaration": declaration_size(parser.name),
        "ranges": parser.ranges,
        "yaml": parser.yaml_how,
        "results": results,
        "timing_ms": {
            "help": median_ms(lambda: parser.flags(cls, ["--help"]), repeats),
            "parse_valid_flags": median_ms(lambda: parser.flags(cls, parser.valid_flags), repeats),
            "parse_valid_yaml": median_ms(lambda: parser.yaml(cls, valid), repeats),
            "import": import_ms(parser.import_line, max(3, repeats // 2)),
        },
    }


def table(report: dict[str, Any]) -> str:
    rows = [("parser", "case", "source", "stops with", "named", "did-you-mean", "first line")]
    for name, entry in report["parsers"].items():
        for case, sources in entry["results"].items():
            for source, r in sources.items():
                suggest = {True: "yes", False: "no"}.get(r.get("suggests_steps"), "")
                first = r["first_line"][:70]
                rows.append(
                    (
                        name,
                        case,
                        source,
                        r["outcome"],
                        f"{r['named']}/{r['problems']}",
                        suggest,
                        first,
                    )
                )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in rows
    ]
    lines += ["", "parser            decl lines (hand)  help ms  flags ms  yaml ms  import ms"]
    for name, entry in report["parsers"].items():
        d, t = entry["declaration"], entry["timing_ms"]
        lines.append(
            f"{name:<17} {d['lines']:>5} ({d['hand_validation_lines']:>2})     "
            f"{t['help']:>7.1f}  {t['parse_valid_flags']:>8.1f}  {t['parse_valid_yaml']:>7.1f}  "
            f"{t['import']:>9.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/cpu_costs/config_parsers.json"))
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per measure (median)")
    args = ap.parse_args(argv)
    missing = [p.package for p in PARSERS if version(p.package) is None]
    if missing:
        print(f"error: not installed: {', '.join(missing)} (pip install {' '.join(missing)})")
        return 2
    info = run_info()
    info["versions"].update({p.package: version(p.package) for p in PARSERS})
    info["versions"]["pyyaml"] = version("pyyaml")
    load_before = machine_load()
    with tempfile.TemporaryDirectory() as tmp:
        parsers = {p.name: measure(p, Path(tmp), args.repeats) for p in PARSERS}
    report = {
        **info,
        "what": "config parsers on one 8-field config and the same bad inputs (issue 23)",
        "cases": {n: {k: c[k] for k in ("flags", "yaml", "problems")} for n, c in CASES.items()},
        "repeats": args.repeats,
        "load_before": load_before,
        "load_after": machine_load(),
        "parsers": parsers,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    print(table(report))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
