"""The accelerate internals draftsmith needs, in one place: accelerate has no public API for them.

Everything else uses accelerate's public API. What is here touches private attributes, each
listed in :data:`PRIVATE` with why it is needed; ``tests/test_accelerate_compat.py`` checks that
every one still exists in the installed accelerate, so an upgrade that renames one fails there,
naming it, instead of deep inside a training run. At run time a missing one raises
:class:`AccelerateCompatError` naming it too.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PRIVATE",
    "AccelerateCompatError",
    "private",
    "reset_accelerate_state",
    "set_distributed_type",
]

# "Class.attribute" of accelerate.state -> why draftsmith needs it.
PRIVATE: dict[str, str] = {
    "AcceleratorState._reset_state": (
        "forget the process-wide Accelerator state between in-process stages and tests "
        "(accelerate refuses an Accelerator whose settings differ from an earlier one)"
    ),
    "GradientState._reset_state": "forget the process-wide gradient-accumulation state (same)",
    "PartialState._shared_state": (
        "mirror a switched distributed type into the process state, as AcceleratorState's own "
        "__init__ does (FSDP on CPU processes, train/core/dist.py setup_fsdp)"
    ),
}


class AccelerateCompatError(RuntimeError):
    """The installed accelerate lacks an internal that draftsmith relies on."""


def private(name: str) -> Any:
    """The private accelerate attribute ``name`` (a key of :data:`PRIVATE`), checked.

    Raises:
        AccelerateCompatError: it no longer exists; the message names it and the version.
    """
    import accelerate
    from accelerate import state

    owner, _, attr = name.partition(".")
    try:
        return getattr(getattr(state, owner), attr)
    except AttributeError:
        raise AccelerateCompatError(
            f"accelerate {accelerate.__version__} has no accelerate.state.{name}, which "
            f"draftsmith uses to {PRIVATE.get(name, '?')}: update "
            "draftsmith/train/core/accelerate_compat.py for this accelerate version"
        ) from None


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide state (process, accelerator and gradient state).

    The next ``PartialState``/``Accelerator`` starts from scratch. A process group that is
    initialised stays so (accelerate's own reset leaves it too).
    """
    private("AcceleratorState._reset_state")(reset_partial_state=True)
    private("GradientState._reset_state")()


def set_distributed_type(state: Any, distributed_type: Any) -> None:
    """Switch an ``AcceleratorState``'s distributed type, mirrored into the ``PartialState``.

    What accelerate's ``AcceleratorState.__init__`` does after choosing the type itself; the
    ``Accelerator`` reads the accelerator state, data loaders and ``accelerate.utils`` read the
    process state.

    Args:
        state: the run's ``accelerator.state``.
        distributed_type: an ``accelerate.utils.DistributedType``.
    """
    shared = private("PartialState._shared_state")
    state.distributed_type = distributed_type
    shared["distributed_type"] = distributed_type
