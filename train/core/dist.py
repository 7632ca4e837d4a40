"""Processes of one run: accelerate state, process group with a timeout, agreement, teardown.

Why each piece exists (each failure was seen on 2 CPU processes):

* a process-group timeout: a stopped (SIGSTOP) or stuck rank left the other waiting in an
  all-reduce for > 2 min with no message; with ``pg_timeout_minutes`` the waiting rank's
  collective fails and the run ends with a message naming the timeout;
* workers die with their launcher: killing ``accelerate launch`` left its workers running;
  ``PR_SET_PDEATHSIG`` sends each worker SIGTERM when its parent dies, which the run treats like
  Ctrl-C (finish the step, save, exit);
* teardown: a barrier, then ``destroy_process_group()``; under gloo (CPU processes) the process
  then ends without running interpreter finalisation: at finalisation a DDP ``Reducer``
  destroyed ``ProcessGroupGloo``, whose thread join held the GIL while a gloo thread waited for
  it (a deadlock that hung the test suite intermittently). NCCL and other backends end the
  standard way; what needs an exit hook (W&B, logging, output buffers) is finished first either
  way (:func:`exit_process`);
* FSDP on CPU processes: accelerate switches to FSDP only on GPU-like devices, so an FSDP
  config on CPUs (gloo) silently trained with DDP; :func:`setup_fsdp` switches it, and
  :func:`shard_frozen_target` shards the frozen target over the same processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accelerate import PartialState


def process_state(cpu: bool = False, **kwargs: Any) -> PartialState:
    """This process's accelerate state; CPU processes (gloo) when there is no accelerator.

    ``PartialState()`` alone never forms a multi-process group on a CPU-only machine (it needs
    ``cpu=True``), so 2 CPU processes started by ``accelerate launch``/``torchrun`` would each
    believe they are alone. ``ACCELERATE_USE_CPU=1`` (or ``cpu``) forces CPU processes on a GPU
    machine.

    Args:
        cpu: force CPU processes (a run's ``device: cpu``).
        **kwargs: passed on to ``PartialState`` (e.g. ``timeout``).
    """
    from accelerate import PartialState

    forced = cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    accel = getattr(torch, "accelerator", None)
    has_accelerator = accel.is_available() if accel is not None else torch.cuda.is_available()
    return PartialState(cpu=forced or not has_accelerator, **kwargs)


def start_processes(timeout_minutes: float, cpu: bool = False) -> PartialState:
    """This process's accelerate ``PartialState``, the process group created with a timeout.

    CPU processes (gloo) are used when the machine has no accelerator or ``cpu`` is set (see
    :func:`process_state`). Must run before the ``Accelerator`` is built (the state is
    process-wide).
    """
    state = process_state(cpu=cpu, timeout=datetime.timedelta(minutes=timeout_minutes))
    _note_backend()
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


def any_rank(flags: Sequence[bool | torch.Tensor], device: Any) -> list[bool]:
    """Element-wise OR of ``flags`` over all processes (one all-reduce), so ranks agree.

    A flag is a Python bool or a tensor (true when any element is nonzero), e.g. a non-finite
    flag kept on the device. The votes are combined on ``device`` and read once: that read is
    the only host sync (on a GPU, the one wait for the queued work), with one process or many.

    Args:
        flags: this rank's votes (e.g. ``[stop requested, time is up, non-finite]``).
        device: where collectives run (the accelerator's device).
    """
    multi = distributed()
    if not multi and not any(torch.is_tensor(f) for f in flags):
        return [bool(f) for f in flags]
    votes = torch.stack([_vote(f, device) for f in flags])
    if multi:
        torch.distributed.all_reduce(votes, op=torch.distributed.ReduceOp.MAX)
    return [bool(v) for v in votes.tolist()]


def broadcast_int(value: int, device: Any) -> int:
    """Rank 0's ``value`` on every rank (the value itself with one process)."""
    if not distributed():
        return int(value)
    tensor = torch.tensor([int(value)], dtype=torch.long, device=device)
    torch.distributed.broadcast(tensor, src=0)
    return int(tensor.item())


def _vote(flag: bool | torch.Tensor, device: Any) -> torch.Tensor:
    """One vote as a 0-dim float tensor on ``device``, made without a host sync."""
    if not torch.is_tensor(flag):
        return torch.full((), float(bool(flag)), device=device)  # a fill: no host-to-device copy
    if hasattr(flag, "full_tensor"):  # a DTensor (an FSDP2 gradient norm): its global value
        flag = flag.full_tensor()
    return flag.detach().ne(0).any().to(device=device, dtype=torch.float32)


# --- FSDP: the frozen target and the drafter sharded over the run's processes -------------------


def fsdp_requested() -> bool:
    """Whether the launcher asked for FSDP (``distributed_type: FSDP`` in the accelerate config).

    ``accelerate launch`` turns the config's FSDP section into ``ACCELERATE_USE_FSDP`` and
    ``FSDP_*`` environment variables, which accelerate's ``FullyShardedDataParallelPlugin`` reads.
    """
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes")


def setup_fsdp(accelerator: Any) -> list[str] | None:
    """Make ``accelerator`` an FSDP2 one when the launcher asked; the target's layer classes.

    On GPUs accelerate does this itself. On CPU processes (gloo) it never does: its state
    switches to FSDP only for GPU-like process types, so an FSDP config would silently run DDP.
    The FSDP2 machinery it then uses (``fully_shard``, DTensor gradients, DCP state dicts) works on
    CPU with gloo, so this switches the state the way accelerate's own ``AcceleratorState`` does
    (its type, mirrored into ``PartialState``, and the plugin from the ``FSDP_*`` variables).

    The config's ``fsdp_transformer_layer_cls_to_wrap`` names the *target's* decoder layer class
    (e.g. ``LlamaDecoderLayer``); it is taken off the plugin so that accelerate wraps the drafter
    (one decoder layer, no such class) as one FSDP unit instead of refusing it.

    Returns:
        None when FSDP is off; else the target's layer class names from the config (an empty
        list: use the model's own ``_no_split_modules``).

    ``fsdp_cpu_ram_efficient_loading`` (on by default in ``accelerate launch``) is turned off,
    with a note: with it, transformers leaves the target's weights on the meta device on all but
    the first process of each machine, and accelerate's rank-0 broadcast of the drafter fails on
    its buffers (EAGLE-3's vocabulary maps). Every process loads the target instead, and the
    drafter's first weights come from rank 0 (:func:`broadcast_module`).

    Raises:
        UsageError: FSDP version 1 (the target is sharded with FSDP2's ``fully_shard``; the two
            do not mix in one process group).
    """
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from ..errors import UsageError
    from .accelerate_compat import set_distributed_type

    state = accelerator.state
    if state.distributed_type == DistributedType.MULTI_CPU and fsdp_requested():
        plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables
        if accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(accelerator.mixed_precision)
        state.fsdp_plugin = plugin
        set_distributed_type(state, DistributedType.FSDP)
    if state.distributed_type != DistributedType.FSDP:
        return None
    plugin = state.fsdp_plugin
    if plugin.fsdp_version != 2:
        raise UsageError(
            f"fsdp_version: {plugin.fsdp_version} is not supported; set fsdp_version: 2 in the "
            "accelerate config (the frozen target is sharded with FSDP2's fully_shard)"
        )
    variable = "FSDP_CPU_RAM_EFFICIENT_LOADING"  # what transformers' from_pretrained reads
    if plugin.cpu_ram_efficient_loading or os.environ.get(variable, "").lower() in ("1", "true"):
        os.environ[variable] = "false"
        plugin.cpu_ram_efficient_loading = False
        accelerator.print(
            "note: fsdp_cpu_ram_efficient_loading is turned off: every process loads the "
            "target before sharding it, and the drafter's first weights are sent from rank 0"
        )
    names = list(plugin.transformer_cls_names_to_wrap or [])
    plugin.transformer_cls_names_to_wrap = None
    return names


def fsdp_mesh(accelerator: Any) -> Any:
    """The device mesh accelerate shards prepared models over (None: all processes, 1-D)."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None:
        return None
    return mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]


def shard_frozen_target(
    accelerator: Any, model: torch.nn.Module, layer_classes: list[str] | None = None
) -> torch.nn.Module:
    """Shard a frozen causal LM with FSDP2 over the processes that shard the drafter (in place).

    Each decoder layer is its own FSDP unit, gathered for its forward and freed right after it
    (whatever the config's ``reshard_after_forward``, which is for trained models: a frozen
    target has no backward that would reuse the gathered weights). The input embedding and the
    output head stay whole on every rank: the drafter and its loss use them outside the target's
    forward (token embeddings at every TTT step, the labels' distribution from the last hidden
    state), where FSDP would not gather a sharded weight. They are vocab x hidden each (for a
    70B Llama about 3% of its weights). Every rank must then run the same number of target
    forwards (accelerate's prepared loaders give every rank the same number of batches).

    Args:
        accelerator: the run's accelerator (FSDP, see :func:`setup_fsdp`).
        model: the frozen target, on the CPU or already on the device; parameters move to the
            device shard by shard.
        layer_classes: class names of its decoder layers; empty/None: ``_no_split_modules``.

    Returns:
        ``model`` itself (its class becomes ``FSDP<Class>``; it is not checkpointed).

    Raises:
        UsageError: no module of the target has one of those class names.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from ..errors import UsageError

    names = list(layer_classes or getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UsageError(
            f"fsdp_transformer_layer_cls_to_wrap: the target ({type(model).__name__}) has no "
            f"module of class {names or '(none given)'}; set it to the target's decoder layer "
            "class in the accelerate config (LlamaDecoderLayer for Llama/SmolLM2, "
            "Qwen2DecoderLayer for Qwen2, ...)"
        )
    plugin = accelerator.state.fsdp_plugin
    offload = plugin.cpu_offload
    if accelerator.device.type == "cpu" or not isinstance(offload, CPUOffloadPolicy):
        offload = None  # nothing to offload to on CPU processes
    kwargs: dict[str, Any] = {"mesh": fsdp_mesh(accelerator), "reshard_after_forward": True}
    if offload is not None:
        kwargs["offload_policy"] = offload
    whole = [model.get_input_embeddings(), model.get_output_embeddings()]
    keep = {p for m in whole if m is not None for p in m.parameters()}
    for module in whole:
        if module is not None:
            module.to(accelerator.device)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, ignored_params=keep, **kwargs)
    return model


def broadcast_module(model: torch.nn.Module) -> None:
    """Copy rank 0's parameters and buffers into every rank's ``model`` (in place).

    What DDP does when it wraps a model, done before FSDP shards one: every rank then shards the
    same weights, whatever each rank's random state was when it built the model.
    """
    if not distributed():
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            torch.distributed.broadcast(tensor.data, src=0)


def full_state_dict(model: torch.nn.Module, everywhere: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of an FSDP2 model.

    Collective: every rank must call it. By default it lands on the CPU of rank 0 only (the
    other ranks get an empty dict); ``everywhere``: on every rank, on its device.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
    return get_model_state_dict(model, options=options)


def teardown(accelerator: Any, ok: bool) -> None:
    """End the run's processes cleanly: barrier (only after success), then destroy the group.

    After a failure the other ranks may be anywhere (in a collective, or gone); a barrier would
    wait for them until the timeout, so the group is destroyed right away.

    Args:
        accelerator: the run's accelerator (None before it exists: then there is no barrier).
        ok: the run succeeded.
    """
    _note_backend()
    if ok and accelerator is not None and distributed():
        accelerator.wait_for_everyone()
    if distributed():
        torch.distributed.destroy_process_group()


# --- ending the process: gloo's finalisation deadlock ------------------------------------------

# Objects of a finished gloo run kept alive until os._exit: freeing a DDP model frees its
# Reducer, which destroys the gloo process group and joins its threads while holding the GIL,
# deadlocking with a gloo thread that needs the GIL to free a finished all-reduce's tensors.
_KEEP_ALIVE: list[Any] = []
# Whether this process was one of several in a gloo process group (noted while the group
# exists: exit_process runs after it is destroyed).
_GLOO_RUN = False


def group_backend() -> str | None:
    """The backend of this process's process group (``gloo``, ``nccl``, ...); None without one."""
    return torch.distributed.get_backend() if distributed() else None


def _note_backend() -> None:
    global _GLOO_RUN
    if not _GLOO_RUN and group_backend() == "gloo":
        _GLOO_RUN = torch.distributed.get_world_size() > 1  # a group of one has no peer thread


def gloo_workaround() -> bool:
    """Whether this process must end without interpreter finalisation (a multi-process gloo
    run: see the module docstring)."""
    _note_backend()
    return _GLOO_RUN


def keep_alive(obj: Any) -> None:
    """Under gloo, never free ``obj`` (a finished run's DDP-wrapped models) before the exit.

    Other backends (NCCL, ...) free it the standard way: nothing is kept.
    """
    if gloo_workaround():
        _KEEP_ALIVE.append(obj)


def exit_process(code: int) -> int:
    """Return ``code``; a worker of a multi-process gloo run instead ends here at once, with it.

    Called by each recipe's ``main`` last: everything the run writes is complete and the process
    group destroyed by then. Single-process runs (a gloo group of one included), runs on other
    backends (NCCL: the standard teardown) and tests calling ``main`` in-process just get
    ``code`` back. Before ``os._exit`` (which runs no exit hooks) what needs one is finished
    here: a W&B run still open (marked failed when ``code`` is not 0), logging's handlers,
    stdout and stderr.
    """
    if not gloo_workaround():
        return code
    finish_before_exit(code)
    os._exit(code)


def finish_before_exit(code: int, trackers: bool = True) -> None:
    """Do what the interpreter's exit hooks would, before an ``os._exit(code)``.

    Args:
        code: the exit code (a W&B run still open is finished with it: not 0 = failed).
        trackers: finish a W&B run still open (False where the exit must not wait for an
            upload: the second Ctrl-C); then logging's handlers, stdout and stderr.
    """
    wandb = sys.modules.get("wandb")  # only if the run imported it
    if trackers and wandb is not None and getattr(wandb, "run", None) is not None:
        with contextlib.suppress(Exception):  # a tracker problem must not keep the process alive
            wandb.finish(exit_code=code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
