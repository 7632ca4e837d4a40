"""Stopping a run on purpose: SIGINT/SIGTERM, and what counts as a numerical fault.

The first SIGINT (Ctrl-C) or SIGTERM only sets a flag: the loop finishes its optimizer step,
saves a checkpoint and exits 0 with the command that resumes. A second signal exits at once
(exit 130): checkpoints are written into a temp dir and renamed, so every finished one stays
intact, and the temp dir of an interrupted save is never taken for a checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch

from ..errors import RunError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class NonFiniteError(RunError):
    """A non-finite loss or gradient norm with ``on_nonfinite: stop``."""


class StopSignals:
    """Turns SIGINT/SIGTERM into a flag for the loop; the second one exits at once.

    Installed only in the main thread (Python delivers signals there), restored on
    :meth:`restore`. Use ``requested`` as this process's vote in the per-step stop verdict.

    Args:
        interrupt: raise ``KeyboardInterrupt`` at the first signal instead of setting the flag:
            for work whose unit is not worth finishing (evaluate: a prompt in progress is
            dropped, the finished ones are kept), also when SIGINT is ignored (a background
            job) or a scheduler sends SIGTERM.
    """

    def __init__(self, say=print, *, interrupt: bool = False) -> None:
        self.requested: str | None = None
        self._say = say
        self._interrupt = interrupt
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self._interrupt:
            self.requested = name
            raise KeyboardInterrupt
        if self.requested is not None:
            # The user insists: leave now. A save in progress is a temp dir, never a checkpoint.
            # os._exit runs no exit hook: logs and output are flushed first; an open W&B run is
            # left to its files (wandb sync), as finishing it could wait for an upload.
            from .dist import finish_before_exit

            print(f"\n{name} again: exiting now; finished checkpoints are kept", file=sys.stderr)
            finish_before_exit(130, trackers=False)
            os._exit(130)
        self.requested = name
        print(
            f"\n{name}: stopping after this optimizer step and saving a checkpoint "
            "(send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def non_finite_parameters(module: torch.nn.Module) -> list[str]:
    """Names of the parameters holding a NaN or an infinity (empty when all are finite)."""
    return [n for n, p in module.named_parameters() if not bool(torch.isfinite(p).all())]


def check_finite(module: torch.nn.Module, where: str) -> None:
    """Refuse to validate or save a model with a NaN/inf parameter (its figures would be noise).

    Raises:
        NonFiniteError: naming ``where`` (e.g. ``validation at step 40: drafter``) and the first
            such parameter.
    """
    bad = non_finite_parameters(module)
    if bad:
        raise NonFiniteError(f"{where} parameter {bad[0]} is not finite")
