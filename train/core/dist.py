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
  :func:`shard_frozen_target` shards the frozen target over the same processes (built on the
  meta device and filled shard by shard: no process holds the whole target);
* a barrier with its own time-out (:func:`wait_for_ranks`): loading a target is where ranks
  differ most (one reading from a slower disk), longer than a collective should ever wait.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import itertools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import RunError

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
    its buffers (EAGLE-3's vocabulary maps). Its aim, host memory of about one target per
    machine, is met without it: every process builds the target's decoder layers on the meta
    device and reads only its own shards of them (``TrainRun.load_target``); the drafter's first
    weights come from rank 0 (:func:`broadcast_module`).

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
            "note: fsdp_cpu_ram_efficient_loading is turned off: each process reads only its "
            "own shards of the target, and the drafter's first weights are sent from rank 0"
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
    accelerator: Any,
    model: torch.nn.Module,
    layer_classes: list[str] | None = None,
    fill: Callable[[torch.nn.Module, list[str]], Any] | None = None,
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
        fill: for a target whose decoder layers are still on the meta device
            (:func:`~draftsmith.train.target_model.load.load_target_meta`): called after they
            are sharded and given empty storage on the device, with the names of those
            parameters, to read this rank's rows of each
            (:func:`~draftsmith.train.target_model.load.fill_target_shards`). Only the shards
            are ever made: no process holds the whole target.

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
    if not any(p.is_meta for p in model.parameters()):  # else materialize_meta moves them
        for module in whole:
            if module is not None:
                module.to(accelerator.device)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, ignored_params=keep, **kwargs)
    empty = materialize_meta(model, accelerator.device)
    if empty and fill is None:
        raise ValueError(f"the target's {empty[0]} (and others) has no weights and no fill")
    if empty:
        fill(model, empty)
    return model


def materialize_meta(model: torch.nn.Module, device: Any) -> list[str]:
    """Give a sharded model's meta parameters empty storage on ``device``; keep everything else.

    ``to_empty`` is how FSDP2 makes sharded meta parameters real (it resets each FSDP unit's
    shards), but it makes *every* tensor of the module empty: the parameters and buffers that
    already hold values (embedding and head loaded whole, rotary buffers computed by the model,
    layers loaded whole) are kept aside and put back: by reference where they are on ``device``
    already, else copied into the storage ``to_empty`` made there (so a GPU never holds the
    embedding and head twice).

    Returns:
        The names of the parameters that were on the meta device (now uninitialised), in
        ``named_parameters`` order; empty when there were none (nothing is changed then).
    """
    params = list(model.named_parameters())
    empty = [name for name, p in params if p.is_meta]
    if not empty:
        return []
    kept_params = [(p, _local(p).detach()) for _, p in params if not p.is_meta]
    kept_buffers = [
        (module, name, buffer)
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None
    ]
    model.to_empty(device=device)
    with torch.no_grad():
        for param, value in kept_params:
            if hasattr(param, "to_local"):  # an FSDP shard: FSDP owns its new storage
                param.to_local().copy_(value)
            elif param.device == value.device:
                param.data = value  # no copy (the empty storage is never touched)
            else:
                param.data.copy_(value)
        for module, name, buffer in kept_buffers:
            module._buffers[name] = buffer.to(device)
    return empty


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class RankTimeoutError(RunError):
    """Ranks did not all reach a point of the run within their own time-out (not a collective)."""


# Barrier keys must differ between barriers of one process group; every rank counts the same.
_BARRIERS = itertools.count()


def wait_for_ranks(phase: str, timeout_minutes: float, setting: str) -> None:
    """A barrier with its own time-out, for a phase whose duration differs between ranks.

    The process group's time-out (``pg_timeout_minutes``) bounds how long a collective waits:
    right for training steps, short for loading a target, where one rank reading from a slower
    disk can be minutes behind the others. This barrier goes through the process group's store
    (the rendezvous every rank reached), not a collective, so it works alike on gloo and NCCL,
    bounds only the wait at this point and can name the ranks that are late.

    Args:
        phase: what the ranks were doing (named in the error).
        timeout_minutes: how long a rank waits here for the others.
        setting: the config field that sets ``timeout_minutes`` (named in the error).

    Raises:
        RankTimeoutError: a rank still missing after the time-out (raised on the ranks that
            waited, naming the late ones), or a late rank arriving after the others gave up.
    """
    if not distributed() or torch.distributed.get_world_size() == 1:
        return
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    key = f"draftsmith/wait/{next(_BARRIERS)}"
    try:
        store.set(f"{key}/rank{rank}", b"1")
        arrived = store.add(f"{key}/count", 1)
        deadline = time.monotonic() + 60 * timeout_minutes
        pause = 0.005
        while arrived < world:
            gave_up = store.check([f"{key}/gave_up"])
            if gave_up or time.monotonic() > deadline:
                late = [r for r in range(world) if not store.check([f"{key}/rank{r}"])]
                if late:
                    store.set(f"{key}/gave_up", b"1")
                    raise RankTimeoutError(
                        f"{phase}: rank(s) {', '.join(map(str, late))} of {world} had not "
                        f"finished after this rank ({rank}) waited {timeout_minutes:g} minutes "
                        f"({setting}); raise {setting} if that rank is only slower (a slower "
                        "disk), else see its own error"
                    )
            time.sleep(pause)
            pause = min(2 * pause, 0.5)
            arrived = store.add(f"{key}/count", 0)
        gave_up = store.check([f"{key}/gave_up"])
    except RankTimeoutError:
        raise
    except Exception as exc:  # the store's host (rank 0 or the launcher) is gone
        raise RankTimeoutError(
            f"{phase}: this rank ({rank}) finished after the others had stopped waiting "
            f"({setting}: {timeout_minutes:g} minutes; {exc})"
        ) from exc
    if gave_up:
        raise RankTimeoutError(
            f"{phase}: this rank ({rank}) finished after the others had waited {setting} "
            f"({timeout_minutes:g} minutes) for it; raise {setting} if it is only slower"
        )


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
