"""Per-device memory of an EAGLE training job, whether it fits, and what would.

A device holds, during a training step (:func:`plan`):

====================  ========================================================================
target weights        online features: the whole target (DDP) or a 1/N shard of its decoder
                      layers plus the embedding and head, which stay whole on every rank, plus
                      two gathered layers (the one running and the one prefetched; FSDP).
                      Offline: the embedding (the drafter's input) and the head (the labels).
drafter weights       fp32 master weights (1/N of them under FSDP)
gradients             fp32 (1/N under FSDP)
optimizer state       AdamW's two fp32 moments (1/N under FSDP)
DDP buckets           DDP copies every gradient into flat buckets for the all-reduce
FSDP gathers          the drafter's full weights while it runs (in the compute dtype) and its
                      full gradients before they are reduce-scattered
activations           the step's own peak, simulated on fake tensors (:mod:`.simulate`)
runtime               CUDA context and kernels (outside ``max_memory_allocated``), or a CPU
                      process's interpreter and libraries (its resident size before loading)
====================  ========================================================================

Everything but the activations is a count of parameters times their bytes. The activations
are what the recipe's own code allocates for the step, forward, backward and optimizer step
(weights' gradients while they are accumulated included); they are the same on every rank.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from .simulate import StepMemory, StepSpec, eagle_config, simulate_step

__all__ = ["Launch", "MemoryPlan", "parameter_counts", "plan", "what_fits"]

GIB = 2**30
# CUDA context, cuBLAS/cuDNN workspaces and kernels: memory nvidia-smi shows that
# torch.cuda.max_memory_allocated does not (typically 0.5-1 GiB on an H100).
CUDA_RUNTIME_BYTES = int(0.8 * GIB)


@dataclass(frozen=True)
class Launch:
    """How the job is launched.

    Attributes:
        gpus: processes (one per GPU; one CPU process with ``device: cpu``).
        gpu_memory_gib: memory of one device (GiB).
        strategy: ``ddp`` (a whole target and drafter per process) or ``fsdp``.
        device: ``cuda`` or ``cpu``.
        headroom: share of the device kept free for the allocator's fragmentation and what the
            count misses (0.1 = plan for 90 %).
        runtime_bytes: the process's own memory (None: CUDA's typical context, or on a CPU the
            planning process's resident size).
    """

    gpus: int = 1
    gpu_memory_gib: float = 80.0
    strategy: str = "ddp"
    device: str = "cuda"
    headroom: float = 0.1
    runtime_bytes: int | None = None


@dataclass
class MemoryPlan:
    """One device's memory during a step (bytes), and the verdict."""

    parts: dict[str, int]
    total: int
    limit: int
    fits: bool
    step: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def parameter_counts(spec: StepSpec) -> dict[str, int]:
    """Parameter counts: the target's (whole, per decoder layer, embedding and head) and the
    drafter's trainable ones, from meta-device builds of both (no memory, no init cost)."""
    from transformers import AutoModelForCausalLM

    from ...heads.eagle_model import EagleDrafter

    config = spec.target_config
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(config)
        cfg = eagle_config(spec)
        drafter = EagleDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings())
    layers = target.get_decoder().layers
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    tied = embed is head
    whole = embed.numel() + (0 if tied else head.numel())
    return {
        "target": sum(p.numel() for p in target.parameters()),
        "target_layer": max(sum(p.numel() for p in layer.parameters()) for layer in layers),
        "target_layers": sum(p.numel() for layer in layers for p in layer.parameters()),
        "target_embed_head": whole,
        "drafter": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
    }


_PROBE = """
import torch
from pathlib import Path
from transformers import LlamaConfig
from draftsmith.train.plan.simulate import StepSpec, build_step, run_step
config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2)
spec = StepSpec(config, feature_layers=(1, 2, 3), ttt_steps=2, seq_len=32, online=True,
                target_dtype=torch.bfloat16, autocast={autocast}, foreach=False, device="cpu")
target = __import__("transformers").AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
run_step(spec, build_step(spec, target=target))
print([int(x.split()[1]) * 1024 for x in Path("/proc/self/status").read_text().splitlines()
       if x.startswith("VmRSS:")][0])
"""


@functools.cache
def cpu_runtime_bytes(autocast: bool = True) -> int:
    """Resident bytes of a CPU training process before its own tensors: the interpreter, the
    libraries and what a first step loads (kernels, thread pools), measured by a process that
    runs one step of a tiny drafter (whose own tensors are a few hundred kB)."""
    import subprocess
    import sys

    code = _PROBE.replace("{autocast}", str(autocast))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def _runtime(launch: Launch, autocast: bool) -> int:
    if launch.runtime_bytes is not None:
        return launch.runtime_bytes
    if launch.device == "cuda":
        return CUDA_RUNTIME_BYTES
    return cpu_runtime_bytes(autocast)


def plan(
    spec: StepSpec,
    launch: Launch,
    *,
    counts: dict[str, int] | None = None,
    step: StepMemory | None = None,
) -> MemoryPlan:
    """One device's memory for ``spec`` launched as ``launch`` (module docstring).

    Args:
        spec: the step (recipe settings, sequence length, micro-batch, features).
        launch: processes, device memory, DDP or FSDP.
        counts: :func:`parameter_counts` of ``spec`` (computed when not given).
        step: :func:`~.simulate.simulate_step` of ``spec`` (simulated when not given).
    """
    counts = counts or parameter_counts(spec)
    step = step or simulate_step(spec)
    n = max(1, launch.gpus)
    fsdp = launch.strategy == "fsdp" and n > 1
    t_bytes = _bytes(spec.target_dtype)
    compute = 2 if spec.autocast else 4
    p = counts["drafter"]
    parts: dict[str, int] = {}
    notes: list[str] = []
    if spec.online:
        if fsdp:
            layers = math.ceil(counts["target_layers"] / n) + 2 * counts["target_layer"]
            parts["target weights"] = (layers + counts["target_embed_head"]) * t_bytes
            notes.append(
                f"target: 1/{n} of its decoder layers per GPU, two layers gathered at a time; "
                "embedding and head whole on every GPU"
            )
        else:
            parts["target weights"] = counts["target"] * t_bytes
    else:
        parts["target embedding and head"] = counts["target_embed_head"] * t_bytes
    shard = math.ceil(p / n) if fsdp else p
    parts["drafter weights (fp32)"] = shard * 4
    parts["gradients (fp32)"] = shard * 4
    parts["AdamW state (fp32)"] = 2 * shard * 4
    if n > 1 and not fsdp:
        parts["DDP gradient buckets"] = p * 4
    if fsdp:
        parts["FSDP gathered drafter"] = p * compute + p * 4
    parts["activations (peak of the step)"] = step.peak
    parts["runtime"] = _runtime(launch, spec.autocast)
    total = sum(parts.values())
    limit = int(launch.gpu_memory_gib * GIB * (1 - launch.headroom))
    return MemoryPlan(
        parts=parts,
        total=total,
        limit=limit,
        fits=total <= limit,
        step=asdict(step),
        counts=counts,
        notes=notes,
    )


def _largest(lo: int, hi: int, fits) -> int | None:
    """The largest value in ``[lo, hi]`` with ``fits(value)`` (monotone), or None."""
    if not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def what_fits(
    spec: StepSpec, launch: Launch, counts: dict[str, int] | None = None
) -> dict[str, Any]:
    """The alternatives to a launch: the largest micro-batch and sequence length that fit,
    offline features, FSDP, and the fewest GPUs under FSDP.

    Activations grow linearly with micro-batch x sequence length (the attention and the loss
    keep nothing quadratic), so two simulations fit the line that the searches use; each answer
    is then checked by a simulation of its own.
    """
    counts = counts or parameter_counts(spec)
    small = scaled_step(spec, 256)
    large = scaled_step(spec, 512)
    slope = (large.peak - small.peak) / 256
    base = small.peak - slope * 256

    def predicted(b: int, t: int) -> StepMemory:
        tokens = b * t
        peak = int(base + slope * tokens)
        return StepMemory(peak, peak, peak, 0, 0)

    def fits_with(s: StepSpec, where: Launch, exact: bool = False) -> MemoryPlan:
        step = simulate_step(s) if exact else predicted(s.micro_batch, s.seq_len)
        return plan(s, where, counts=counts, step=step)

    out: dict[str, Any] = {}
    biggest = _largest(1, 1024, lambda b: fits_with(replace(spec, micro_batch=b), launch).fits)
    if biggest is not None:
        check = fits_with(replace(spec, micro_batch=biggest), launch, exact=True)
        out["largest_micro_batch"] = biggest if check.fits else max(biggest - 1, 0) or None
    else:
        out["largest_micro_batch"] = None
    longest = _largest(
        64, 1 << 20, lambda t: fits_with(replace(spec, seq_len=t, micro_batch=1), launch).fits
    )
    out["largest_seq_len_at_micro_batch_1"] = longest
    if spec.online:
        off = replace(spec, online=False)
        out["offline_features"] = _verdict(fits_with(off, launch, exact=True))
    if launch.strategy != "fsdp" and launch.gpus > 1:
        out["fsdp_same_gpus"] = _verdict(
            fits_with(spec, replace(launch, strategy="fsdp"), exact=False)
        )
    fewest = _largest_gpus(spec, launch, counts, predicted)
    out["fewest_gpus_with_fsdp"] = fewest
    return out


def _largest_gpus(spec, launch, counts, predicted) -> int | None:
    for n in (1, 2, 4, 8, 16, 32, 64):
        where = replace(launch, gpus=n, strategy="fsdp" if n > 1 else launch.strategy)
        if plan(spec, where, counts=counts, step=predicted(spec.micro_batch, spec.seq_len)).fits:
            return n
    return None


def _verdict(p: MemoryPlan) -> dict[str, Any]:
    return {"total_gib": round(p.total / GIB, 2), "fits": p.fits}


def scaled_step(spec: StepSpec, tokens: int) -> StepMemory:
    """The simulated step at ``tokens`` tokens (micro-batch 1)."""
    return simulate_step(replace(spec, seq_len=tokens, micro_batch=1))
