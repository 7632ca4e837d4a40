"""The one progress facility (train/progress.py): plain lines off a terminal, a bar on one.

Time is a fake clock: tqdm reads ``tqdm.std.time`` when a bar is made, so patching it makes
every "second" an explicit step of the test.
"""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest
from tqdm.std import tqdm

from draftsmith.train.progress import (
    DEFAULT_INTERVAL,
    INTERVAL_ENV,
    hf_progress_bars,
    progress,
    progress_interval,
)

REPO = Path(__file__).resolve().parents[1]


class _Clock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr("tqdm.std.time", fake)
    return fake


def _lines(stream: io.StringIO) -> list[str]:
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text, repr(text)
    assert text.endswith("\n")
    return text.splitlines()


def test_off_a_terminal_one_plain_line_per_interval_and_one_at_close(clock) -> None:
    out = io.StringIO()
    with progress(total=95, desc="train", unit="step", file=out, interval=10) as bar:
        for step in range(95):
            clock.now += 1
            bar.update(1)
            bar.set_postfix(loss=f"{step / 10:.1f}")  # draws too; must not add lines
    lines = _lines(out)
    # Seconds 10, 20, ..., 90, then the final line at 95.
    assert len(lines) == 10, lines
    assert [line.split()[2] for line in lines] == [f"{n}/95" for n in range(10, 100, 10)] + [
        "95/95"
    ]
    assert lines[0].startswith("train: ") and "step/s" in lines[0]
    assert lines[-1].endswith("loss=9.4]")


def test_no_line_before_the_first_interval_except_the_final_one(clock) -> None:
    out = io.StringIO()
    bar = progress(total=3, desc="short", file=out, interval=30)
    for _ in range(3):
        clock.now += 1
        bar.update(1)
        bar.set_postfix_str("x")
    assert out.getvalue() == ""
    bar.close()
    bar.close()  # a second close (an except and a finally) writes nothing more
    assert _lines(out) == ["short: 100% 3/3 [00:03<00:00,  1.00it/s, x]"]


def test_iterating_writes_lines_too(clock) -> None:
    out = io.StringIO()
    seen = []
    for item in progress(range(25), desc="items", file=out, interval=10):
        clock.now += 1
        seen.append(item)
    assert seen == list(range(25))
    lines = _lines(out)
    assert [line.split()[2] for line in lines] == ["10/25", "20/25", "25/25"]


def test_a_resumed_bar_starts_at_initial(clock) -> None:
    out = io.StringIO()
    with progress(total=10, initial=7, desc="resumed", file=out, interval=5) as bar:
        clock.now += 1
        bar.update(3)
    assert _lines(out)[-1].split()[2] == "10/10"


def test_the_last_line_is_not_repeated_at_close(clock) -> None:
    out = io.StringIO()
    with progress(total=10, file=out, interval=5) as bar:
        for _ in range(10):
            clock.now += 1
            bar.update(1)
    lines = _lines(out)
    assert [line.split()[1] for line in lines] == ["5/10", "10/10"]


def test_the_default_stream_is_stderr_at_call_time(clock, capsys) -> None:
    with progress(total=2, desc="to stderr", interval=1) as bar:
        bar.update(2)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("to stderr: 100% 2/2") and "\r" not in captured.err


def test_disabled_writes_nothing_and_takes_every_call(clock) -> None:
    out = io.StringIO()
    with progress(total=5, file=out, disable=True) as bar:
        bar.update(5)
        bar.set_postfix(loss="1.0")
        bar.set_postfix_str("x")
    assert out.getvalue() == ""


def test_on_a_terminal_it_is_a_tqdm_bar(clock) -> None:
    out = _Terminal()
    with progress(total=4, desc="tty", file=out, interval=1_000) as bar:
        assert isinstance(bar, tqdm)
        for _ in range(4):
            clock.now += 1
            bar.update(1)
    text = out.getvalue()
    # Redrawn in place (a carriage return per draw), with a bar, the interval not applying.
    assert text.count("\r") >= 4
    assert "|" in text and "4/4" in text


def test_the_interval_comes_from_the_argument_then_the_env(monkeypatch) -> None:
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    assert progress_interval() == DEFAULT_INTERVAL == 30.0
    monkeypatch.setenv(INTERVAL_ENV, "5")
    assert progress_interval() == 5.0
    assert progress_interval(2) == 2.0
    for bad in ("soon", "-1", ""):
        monkeypatch.setenv(INTERVAL_ENV, bad)
        assert progress_interval() == DEFAULT_INTERVAL


def test_the_env_interval_paces_the_lines(clock, monkeypatch) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "4")
    out = io.StringIO()
    with progress(total=8, file=out) as bar:
        for _ in range(8):
            clock.now += 1
            bar.update(1)
    assert [line.split()[1] for line in _lines(out)] == ["4/8", "8/8"]


def test_transformers_bars_are_off_while_stderr_is_not_a_terminal(monkeypatch) -> None:
    from transformers.utils import logging as hf_logging

    monkeypatch.setattr("sys.stderr", io.StringIO())
    hf_logging.enable_progress_bar()
    try:
        with hf_progress_bars():
            assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.is_progress_bar_enabled()  # restored
        monkeypatch.setattr("sys.stderr", _Terminal())
        with hf_progress_bars():
            assert hf_logging.is_progress_bar_enabled()
        with hf_progress_bars(enabled=False):
            assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_only_train_progress_draws_progress_bars() -> None:
    """tqdm is imported only by train/progress.py; rich only for tables and consoles.

    A second bar library (or a direct tqdm bar) would bring back the carriage returns in logs.
    """
    bad = []
    for room in ("heads", "train", "recipes", "scripts"):
        for path in sorted((REPO / room).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for name in _imported_modules(path):
                top, _, sub = name.partition(".")
                if top == "tqdm" and rel != "train/progress.py":
                    bad.append(f"{rel} imports {name}")
                if top == "rich" and sub.split(".")[0] in ("progress", "live", "status"):
                    bad.append(f"{rel} imports {name}")
    assert not bad, "\n".join(bad) + "\nuse draftsmith.train.progress.progress instead"
