"""The package's one progress facility: a tqdm bar on a terminal, plain lines off one.

A tqdm bar redraws itself with a carriage return per update; in a log (a redirected stream,
nohup, CI) every redraw stays, and a long run's log becomes mostly redraws. So when the stream
is not a terminal, :func:`progress` writes one plain line per interval (default 30 s; the
``interval`` argument or ``DRAFTSMITH_PROGRESS_INTERVAL`` changes it) and a final line at close:
no carriage returns, no ANSI codes. On a terminal it is an ordinary tqdm bar.

Example:
    with progress(total=len(items), desc="writing", unit="rec") as bar:
        for item in items:
            write(item)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")

:func:`hf_progress_bars` does the same for the bars transformers draws itself ("Loading
weights"): it switches them off while the stream is not a terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from typing import IO, Any

from tqdm.std import tqdm

__all__ = [
    "DEFAULT_INTERVAL",
    "INTERVAL_ENV",
    "Progress",
    "hf_progress_bars",
    "is_terminal",
    "progress",
    "progress_interval",
]

#: Seconds between two lines off a terminal.
DEFAULT_INTERVAL = 30.0
#: The environment variable that overrides :data:`DEFAULT_INTERVAL` (seconds, a number >= 0).
INTERVAL_ENV = "DRAFTSMITH_PROGRESS_INTERVAL"


def is_terminal(stream: IO[str] | None = None) -> bool:
    """Whether ``stream`` (default ``sys.stderr``) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def progress_interval(interval: float | None = None) -> float:
    """Seconds between lines off a terminal: ``interval``, else the env variable, else 30.

    A malformed or negative env value falls back to the default: a typo in a progress setting
    should not stop a long run.
    """
    if interval is not None:
        return max(0.0, float(interval))
    try:
        value = float(os.environ.get(INTERVAL_ENV, ""))
    except ValueError:
        return DEFAULT_INTERVAL
    return value if value >= 0 else DEFAULT_INTERVAL


class Progress(tqdm):
    """A tqdm bar that, in line mode, prints plain lines instead of redrawing.

    Build it with :func:`progress`. The tqdm API callers use (``update``, ``set_postfix``,
    ``set_postfix_str``, ``close``, iteration, ``with``) is unchanged.
    """

    def __init__(self, *args: Any, lines: bool = False, **kwargs: Any) -> None:
        self._lines = lines
        self._line_t: float | None = None  # when the last line was written; None: none yet
        self._line = ""  # the last line written
        self._final = False
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        """Draw the bar (terminal), or write a line when an interval has passed (line mode)."""
        if not self._lines:
            return super().display(msg, pos)
        if msg == "":  # tqdm clearing the bar: nothing to clear in a log
            return False
        now = self._time()
        # set_postfix and tqdm's constructor draw too, not only update(): the interval is
        # enforced here, so no caller can write more than one line per interval.
        last = self._line_t if self._line_t is not None else getattr(self, "start_t", now)
        if not self._final and now - last < self.mininterval:
            return True
        self._line_t = now
        if msg is None:
            # ncols=0: tqdm's text without the bar (no block characters, no colour codes).
            msg = self.format_meter(**{**self.format_dict, "ncols": 0})
        if self._final and msg == self._line:  # the last interval's line already says it
            return True
        self._line = msg
        self.fp.write(msg + "\n")
        getattr(self.fp, "flush", lambda: None)()
        return True

    def clear(self, nolock: bool = False) -> None:
        """Clear the bar on a terminal; a written line stays (tqdm would write ``\\r``)."""
        if not self._lines:
            super().clear(nolock)

    def moveto(self, n: int) -> None:
        """Move the cursor between nested bars on a terminal; lines have no cursor to move."""
        if not self._lines:
            super().moveto(n)

    def close(self) -> None:
        """Finish the bar; in line mode write the final line (with the overall rate)."""
        if self._lines and not self.disable and hasattr(self, "start_t"):
            self._final = True
            self._ema_dt = lambda: None  # as tqdm's own close: the average rate, not the last
            self.display()
            # tqdm's close would draw the bar once more and end it with "\n"; not leaving it
            # makes it only "clear" it, which display() above ignores.
            self.leave = False
        super().close()


def progress(
    iterable: Iterable[Any] | None = None,
    *,
    total: float | None = None,
    desc: str | None = None,
    unit: str = "it",
    initial: float = 0,
    file: IO[str] | None = None,
    interval: float | None = None,
    disable: bool = False,
    **kwargs: Any,
) -> Progress:
    """A progress bar on ``file``: a tqdm bar on a terminal, one plain line per interval off one.

    Args:
        iterable: What to iterate over while counting (None: count with ``update``).
        total: The expected count (None: from ``len(iterable)`` where it has one, else unknown).
        desc: The label in front of the count.
        unit: What is counted ("it", "tok", "rec", ...).
        initial: The count to start at (a resumed run).
        file: The stream written to (default ``sys.stderr``, read at call time).
        interval: Seconds between lines off a terminal (default: :func:`progress_interval`).
            A terminal bar redraws as tqdm does and ignores it.
        disable: Show nothing (the object still counts and accepts every call).
        **kwargs: Other tqdm options: ``unit_scale``, ``smoothing``, ``postfix``, ``leave``...

    Returns:
        The bar: ``update``, ``set_postfix``, ``set_postfix_str``, ``close``, iteration and
        ``with`` as in tqdm.
    """
    file = sys.stderr if file is None else file
    lines = not is_terminal(file)
    if lines:
        # miniters=1 keeps tqdm from adapting it (and its monitor thread from redrawing): the
        # interval alone decides when a line is written.
        kwargs.update(mininterval=progress_interval(interval), miniters=1)
    else:
        kwargs.setdefault("dynamic_ncols", True)
    return Progress(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        initial=initial,
        file=file,
        disable=disable,
        lines=lines,
        **kwargs,
    )


@contextlib.contextmanager
def hf_progress_bars(*, enabled: bool = True) -> Iterator[None]:
    """Show transformers' (and the Hub's) own bars only when ``enabled`` and stderr is a TTY.

    Their bars write a carriage return per update, which a log keeps; they are switched off for
    the block and the previous setting is restored after it.
    """
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not (enabled and is_terminal()):
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
