"""Processes of one run: accelerate state, process group with a timeout, agreement, teardown.

Why each piece exists (each failure was seen on 2 CPU processes):

* a process-group timeout: a stopped (SIGSTOP) or stuck rank left the other waiting in an
  all-reduce for > 2 min with no message; with ``pg_timeout_minutes`` the waiting rank's
  collective fails and the run ends with a message naming the timeout;
* workers die with their launcher: killing ``accelerate launch`` left its workers running;
  ``PR_SET_PDEATHSIG`` sends each worker SIGTERM when its parent dies, which the run treats like
  Ctrl-C (finish the step, save, exit);
* teardown: a barrier, then ``destroy_process_group()``, then the process ends without running
  interpreter finalisation: at finalisation a DDP ``Reducer`` destroyed ``ProcessGroupGloo``,
  whose thread join held the GIL while a gloo thread waited for it (a deadlock that hung the
  test suite intermittently).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accelerate import PartialState


def process_state(**kwargs: Any) -> PartialState:
    """This process's accelerate state; CPU processes (gloo) when there is no accelerator.

    ``PartialState()`` alone never forms a multi-process group on a CPU-only machine (it needs
    ``cpu=True``), so 2 CPU processes started by ``accelerate launch``/``torchrun`` would each
    believe they are alone. ``ACCELERATE_USE_CPU=1`` forces CPU processes on a GPU machine.

    Args:
        **kwargs: passed on to ``PartialState`` (e.g. ``timeout``).
    """
    from accelerate import PartialState

    forced = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    accel = getattr(torch, "accelerator", None)
    has_accelerator = accel.is_available() if accel is not None else torch.cuda.is_available()
    return PartialState(cpu=forced or not has_accelerator, **kwargs)


def start_processes(timeout_minutes: float) -> PartialState:
    """This process's accelerate ``PartialState``, the process group created with a timeout.

    CPU processes (gloo) are used when the machine has no accelerator (see
    :func:`process_state`). Must run before the ``Accelerator`` is built (the state is
    process-wide).
    """
    state = process_state(timeout=datetime.timedelta(minutes=timeout_minutes))
    if state.num_processes > 1:
        _die_with_parent()
    return state


def _die_with_parent() -> None:
    """Ask Linux to send this worker SIGTERM when its launcher dies (no orphaned workers)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:  # no libc.so.6 (e.g. musl): orphaned workers are the old behaviour
        pass


def distributed() -> bool:
    """Whether this process is one of several in an initialised process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def any_rank(flags: list[bool], device: Any) -> list[bool]:
    """Element-wise OR of ``flags`` over all processes (one all-reduce), so ranks agree.

    Args:
        flags: this rank's votes (e.g. ``[stop requested, time is up, non-finite]``).
        device: where collectives run (the accelerator's device).
    """
    if not distributed():
        return list(flags)
    t = torch.tensor([float(f) for f in flags], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def teardown(accelerator: Any, ok: bool) -> None:
    """End the run's processes cleanly: barrier (only after success), then destroy the group.

    After a failure the other ranks may be anywhere (in a collective, or gone); a barrier would
    wait for them until the timeout, so the group is destroyed right away.
    """
    if ok and distributed():
        accelerator.wait_for_everyone()
    if distributed():
        torch.distributed.destroy_process_group()


# Objects of a finished multi-process run kept alive until os._exit: freeing a DDP model frees
# its Reducer, which destroys the gloo process group and joins its threads while holding the GIL,
# deadlocking with a gloo thread that needs the GIL to free a finished all-reduce's tensors.
_KEEP_ALIVE: list[Any] = []


def keep_alive(obj: Any) -> None:
    """Never free ``obj`` (a finished run's DDP-wrapped models) before the process exits."""
    _KEEP_ALIVE.append(obj)


def exit_process(code: int) -> int:
    """Return ``code``, or end a multi-process worker at once with it (see the module docstring).

    Called by each recipe's ``main`` last: everything the run writes is complete and the process
    group destroyed by then; output is flushed. Single-process runs (and tests calling ``main``
    in-process) just get ``code`` back.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
