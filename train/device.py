"""The one device setting: parse it, resolve it, describe it, time on it, seed on it.

Every command that runs a model has a ``device`` field (``auto`` | ``cpu`` | ``cuda`` |
``cuda:N``). :func:`device_problem` checks its spelling during config validation (so a typo is
reported with every other bad field), :func:`resolve_device` turns it into a ``torch.device``
(``auto`` = the first CUDA device when there is one, else the CPU) and refuses a device this
machine does not have with one line naming the field. Recipes under accelerate do not read it:
they use ``accelerator.device`` (the launcher decides).

On an asynchronous device a wall-clock read right after a launch measures the launch, not the
work: :class:`DeviceTimer` synchronizes the device before every read, so the loop's draft time,
the adaptive draft length's cost model, evaluate's tokens/s and the benches mean the same thing
on a GPU as on the CPU.

Random numbers are drawn on the device of the tensors they feed (``torch.rand(...,
device=cuda, generator=g)`` refuses a CPU generator): :func:`make_generator` builds one there.
For a given seed and device the draws are reproducible; CPU and CUDA draw different streams.

TF32 (:func:`allow_tf32`): a training run on CUDA lets fp32 matmuls and cuDNN convolutions use
TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation; several times fp32's matmul rate
on Ampere and later), set by ``TrainRun`` once its device is known and put back when the run
ends. Evaluation does not: its fp32 run is the exactness check (any speculative output that
differs from plain greedy decoding is an error), and TF32's rounding would turn the verify
forward's other batch shape into flipped near-ties.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import time
from typing import Any

import torch

from .errors import UsageError

__all__ = [
    "DEVICE_HELP",
    "DTYPE_AUTO_HELP",
    "DeviceTimer",
    "allow_tf32",
    "auto_dtype",
    "device_facts",
    "device_problem",
    "is_cpu",
    "make_generator",
    "native_bf16",
    "resolve_device",
    "restore_tf32",
    "synchronize",
    "tf32_enabled",
]

DEVICE_HELP = (
    "where the models run: auto (CUDA when present, else the CPU), cpu, cuda or cuda:N "
    "(the N-th GPU)"
)

_SPEC = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def device_problem(spec: object) -> str | None:
    """What is wrong with a ``device`` value's spelling, or None (no hardware is asked).

    Args:
        spec: the configured value (a string, or a ``torch.device`` passed by code).
    """
    if isinstance(spec, torch.device):
        return None
    if not isinstance(spec, str) or not _SPEC.match(spec):
        return f"must be auto, cpu, cuda or cuda:N (N = 0, 1, ...), got {spec!r}"
    return None


def resolve_device(spec: str | torch.device | None = "auto", field: str = "device") -> torch.device:
    """The ``torch.device`` that ``spec`` names on this machine.

    Args:
        spec: ``auto`` (or None), ``cpu``, ``cuda``, ``cuda:N`` or a ``torch.device``.
        field: the config field named in errors.

    Raises:
        UsageError: a misspelled value, or a GPU this machine does not have (the message names
            the field and what is there instead).
    """
    if spec is None:
        spec = "auto"
    problem = device_problem(spec)
    if problem:
        raise UsageError(f"{field}: {problem}")
    if isinstance(spec, torch.device):
        return spec
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if _cuda_count() else _CPU
    if spec == "cpu":
        return _CPU
    count = _cuda_count()
    index = int(spec.partition(":")[2] or 0)
    if count == 0:
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise UsageError(
            f"{field}: {spec} asked for, but this machine has no usable CUDA GPU (torch "
            f"{torch.__version__}, {build}); use --device cpu or auto"
        )
    if index >= count:
        raise UsageError(
            f"{field}: {spec} asked for, but this machine has {count} CUDA GPU(s) "
            f"(cuda:0 to cuda:{count - 1})"
        )
    return torch.device("cuda", index)


_CPU = torch.device("cpu")


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def is_cpu(device: torch.device | str) -> bool:
    """Whether ``device`` is the CPU (where the CPU-only workarounds apply)."""
    return torch.device(device).type == "cpu"


def device_facts(device: torch.device | str) -> dict[str, Any]:
    """What a results JSON records about the device that actually ran.

    Returns:
        ``{"device": "cuda:0", "device_type": "cuda", "gpu_name": ..., "gpu_count": ...,
        "cuda_version": ..., "gpu_memory_gib": ..., "tf32": ...}`` (``tf32``: whether fp32
        matmuls may use TF32 at the time, :func:`allow_tf32`); on the CPU just the first two.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    facts: dict[str, Any] = {"device": str(device), "device_type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(
            gpu_name=props.name,
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda_version=torch.version.cuda,
            tf32=tf32_enabled(),
        )
    return facts


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on CUDA may use TF32 now (what a GPU result records)."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


def allow_tf32(device: torch.device | str) -> tuple[bool, bool] | None:
    """Let fp32 matmuls and cuDNN convolutions use TF32 on a CUDA ``device``; nothing elsewhere.

    TF32 keeps fp32's range with a 10-bit mantissa on the inputs of a matmul and accumulates in
    fp32: the precision bf16 autocast already trades away, at several times fp32's rate on
    Ampere and later GPUs. It matters for what stays fp32 on a GPU run: an fp32 target's
    forward, and the matmuls autocast leaves in fp32.

    The legacy flags (``torch.backends.cuda.matmul.allow_tf32``, ``cudnn.allow_tf32``) are the
    ones set, on purpose: since torch 2.9, setting the per-backend ``fp32_precision`` makes a
    later read of the legacy flags raise (accelerate and older code read them), and
    ``torch.set_float32_matmul_precision("high")`` also switches oneDNN's CPU matmuls to TF32.

    Args:
        device: the device the run computes on.

    Returns:
        The previous ``(matmul, cudnn)`` flags, for :func:`restore_tf32`; None when ``device``
        is not a CUDA device (the flags are left as they are).
    """
    if torch.device(device).type != "cuda":
        return None
    previous = (bool(torch.backends.cuda.matmul.allow_tf32), bool(torch.backends.cudnn.allow_tf32))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return previous


def restore_tf32(previous: tuple[bool, bool] | None) -> None:
    """Put back the TF32 flags :func:`allow_tf32` returned (None: it changed nothing)."""
    if previous is None:
        return
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


DTYPE_AUTO_HELP = (
    "auto: bf16 where the device computes it natively (CUDA GPUs with bf16, CPUs with "
    "AVX512-BF16 or AMX, Arm CPUs with BF16), fp32 elsewhere: on a CPU without them (AVX2 "
    "only) bf16 is emulated, ~7x slower than fp32"
)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo`` on Linux; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


#: The CPU features a result records (what decides fp32 vs bf16 speed here).
RECORDED_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "bf16", "sve")


def cpu_facts() -> dict[str, Any]:
    """The CPU's model name and the features in :data:`RECORDED_CPU_FLAGS` it has."""
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                    break
    except OSError:
        pass
    flags = _cpu_flags()
    return {
        "cpu_model": model or platform.processor() or None,
        "cpu_flags": [f for f in RECORDED_CPU_FLAGS if f in flags],
        "cpu_native_bf16": _cpu_native_bf16(),
    }


@functools.cache
def _cpu_native_bf16() -> bool:
    # oneDNN, which runs torch's CPU bf16 matmuls, capped below its bf16 ISAs by the user
    # (ONEDNN_MAX_CPU_ISA=AVX2 or AVX512_CORE, e.g. to rehearse an AVX2-only machine) emulates
    # bf16 whatever the CPU has.
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if (
        cap
        and cap not in ("ALL", "DEFAULT")
        and not any(isa in cap for isa in ("BF16", "AMX", "FP16", "AVX10"))
    ):
        return False
    # torch's own dispatch checks first (x86: the AVX512-BF16 and AMX kernels it would pick).
    cpu = getattr(torch, "cpu", None)
    for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(cpu, check, None)
        if fn is not None and fn():
            return True
    flags = _cpu_flags()
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in flags  # Armv8.6 BF16 (Graviton3, Neoverse V1/N2)
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` runs bf16 matmuls natively, so that they beat fp32.

    Measured on a 2-core AMD EPYC with AVX2 only (no AVX512-BF16), torch 2.13, one thread
    (``scripts/bench_dtype.py``, ``bench/cpu_costs/dtype_cpu_avx2.json``): bf16 takes 7.3x fp32's time on a
    ``[64, 576] x [576, 1536]`` linear, 7.6x on SmolLM2's forward over 8 x 128 tokens and 5.2x
    on a 64-sequence decode step; on the Zen 4 machines with AVX512-BF16 bf16 is the faster one
    (docs/performance.md).

    Args:
        device: a resolved device (``cpu``, ``cuda``, ``cuda:N``).

    Returns:
        CUDA: whether the GPU supports bf16 without emulation. CPU: whether it has AVX512-BF16
        or AMX (x86) or BF16 (Arm). Any other device: False.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return _cpu_native_bf16()
    return False


def auto_dtype(value: str, device: torch.device | str, *, fast: str, slow: str) -> str:
    """Resolve a dtype setting that may be ``auto``, in the spelling of the field that holds it.

    Args:
        value: the setting (``auto`` or an explicit dtype name, returned as it is).
        device: where the model runs.
        fast: the field's name for bf16 (``bfloat16``, ``bf16``).
        slow: its name for the fallback (``float32``, ``fp32``, or ``no`` for autocast).

    Returns:
        ``value`` unless it is ``auto``; then ``fast`` where :func:`native_bf16`, else ``slow``.
    """
    if value != "auto":
        return value
    return fast if native_bf16(device) else slow


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the work queued on ``device`` (no-op on the CPU and the meta device)."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta"):
        accel = getattr(torch, "accelerator", None)
        if accel is not None and accel.is_available():
            accel.synchronize(device)


class DeviceTimer:
    """Wall-clock seconds of work on one device, synchronized before every read.

    Example::

        timer = DeviceTimer(device)
        t0 = timer.now()          # waits for queued work, then reads the clock
        run_step()
        seconds = timer.now() - t0

    On the CPU ``now()`` is ``time.perf_counter()``; on CUDA it synchronizes first, so a read
    includes every kernel launched before it.
    """

    def __init__(self, device: torch.device | str | None) -> None:
        self.device = None if device is None else torch.device(device)
        self._sync = self.device is not None and self.device.type not in ("cpu", "meta")

    def now(self) -> float:
        """Seconds on a monotonic clock, after the device has finished its queued work."""
        if self._sync:
            synchronize(self.device)
        return time.perf_counter()


class IntervalTimer:
    """Seconds of marked intervals of device work, read once: no synchronize inside them.

    The decoding loop times every draft (propose and accept) of a prompt. A synchronize around
    each would stall a GPU's queue four times a step that plain decoding never stalls, tilting
    the race against speculation (issue 51, finding 8). Instead each interval is a pair of device
    events recorded on the stream (``torch.Event``), and :meth:`total` synchronizes once, when
    the prompt is done, and sums their elapsed times. On the CPU an event is the host clock
    (work there is synchronous), so nothing changes.

    Example::

        timer = IntervalTimer(device)
        mark = timer.start()
        drafter.propose(...)
        timer.stop(mark)
        ...
        draft_seconds = timer.total()   # one synchronize

    Args:
        device: where the timed work runs.
        event: ``() -> event`` with ``record()`` and ``elapsed_time(end)`` in milliseconds (tests
            pass a stand-in); default device events where the device has them.
        sync: ``() -> None`` waiting for the device's queued work (default :func:`synchronize`).
    """

    def __init__(
        self,
        device: torch.device | str | None,
        *,
        event: Any = None,
        sync: Any = None,
    ) -> None:
        self.device = None if device is None else torch.device(device)
        host = self.device is None or self.device.type in ("cpu", "meta")
        if event is None and not host:
            event = _event_factory(self.device)
        self._event = event
        self._sync = sync or (lambda: synchronize(self.device))
        self._pairs: list[tuple[Any, Any]] = []
        self._host_s = 0.0
        # A device without timing events: synchronized host reads (what DeviceTimer does).
        self._clock = None if (event is not None or host) else DeviceTimer(self.device).now

    def start(self) -> Any:
        """Mark the start of an interval; returns its handle for :meth:`stop`."""
        if self._event is None:
            return (self._clock or time.perf_counter)()
        mark = self._event()
        mark.record()
        return mark

    def stop(self, mark: Any) -> None:
        """Mark the end of the interval begun by ``mark`` (no synchronize)."""
        if self._event is None:
            self._host_s += (self._clock or time.perf_counter)() - mark
            return
        end = self._event()
        end.record()
        self._pairs.append((mark, end))

    def total(self) -> float:
        """Seconds of every interval so far: one synchronize, then the events' elapsed times."""
        if self._pairs:
            self._sync()
            self._host_s += sum(a.elapsed_time(b) for a, b in self._pairs) / 1000
            self._pairs.clear()
        return self._host_s


def _event_factory(device: torch.device) -> Any:
    """``() -> event`` timing work on ``device``'s current stream, or None where there is none."""
    event_type = getattr(torch, "Event", None)
    if event_type is None:
        return None
    try:
        event_type(device=device, enable_timing=True)
    except (RuntimeError, TypeError, ValueError):
        return None
    return lambda: event_type(device=device, enable_timing=True)


def make_generator(device: torch.device | str, seed: int | None = None) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` (where the tensors it feeds live), seeded if asked."""
    gen = torch.Generator(device=torch.device(device))
    if seed is not None:
        gen.manual_seed(seed)
    return gen
