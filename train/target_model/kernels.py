"""CPU kernel-path fixes for decoding at batch 1 (measured on AVX512-BF16 CPUs, torch 2.13).

``F.linear`` on a 3-D bf16 input whose size-1 leading dims carry "odd" strides takes a slow
kernel path: a ``[1, 1, 576]`` view of the last row of a ``[1, 300, 576]`` tensor (strides
``(172800, 576, 1)``) against SmolLM2's ``49152 x 576`` lm_head costs ~300 ms of CPU time at one
thread, the same values in a fresh ``[1, 1, 576]`` tensor ~10 ms. PyTorch calls such a tensor
contiguous (strides of size-1 dims do not count), so ``.contiguous()`` and ``clone()`` keep the
strides and the slow path. Such views are everywhere in decoding: HF's ``logits_to_keep=1``
prefill slices the last row, drafters read ``hidden[:, -1:]``. Flattening the leading dims to a
2-D ``[N, K]`` view (always possible without a copy for these tensors) takes the fast path.

Where it applies (``scripts/bench_forward.py`` measures it): only CPU layers with bf16 or fp16
weights. fp32 showed no measurable difference, and on a GPU the slow path does not exist (cuBLAS
takes any strides), so layers on other devices or in fp32 are left as they are: a CPU-only
workaround stays on the CPU.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PATCHED_DTYPES", "flatten_linear_inputs", "grouped_kv_attention", "needs_flat_inputs"]

#: transformers' switch: SDPA with ``enable_gqa=True`` even under an attention mask.
FORCE_GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"


def _flat_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dim() > 2:
        out = F.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])
    return F.linear(x, self.weight, self.bias)


#: Weight dtypes whose CPU kernels take the slow path (measured: bf16; fp16 shares its kernels).
PATCHED_DTYPES = (torch.bfloat16, torch.float16)


def needs_flat_inputs(module: nn.Linear) -> bool:
    """Whether this layer gets the patch: a CPU layer with bf16/fp16 weights."""
    weight = module.weight
    return weight.device.type == "cpu" and weight.dtype in PATCHED_DTYPES


def flatten_linear_inputs(*modules: object) -> int:
    """Make every plain CPU bf16/fp16 ``nn.Linear`` inside ``modules`` flatten its input to 2-D.

    Call it after the modules are on their device and in their dtype: layers elsewhere (a GPU,
    the meta device) or in fp32 are not patched (:func:`needs_flat_inputs`).

    Objects that are not modules (e.g. a proposer holding its drafter module in an attribute)
    are searched one level deep for module attributes. Idempotent; the patch is an instance
    attribute, so state dicts, ``save_pretrained`` and exports are unchanged. Subclasses of
    ``nn.Linear`` (LoRA layers, quantized linears) keep their own forward.

    Returns:
        The number of layers patched now.
    """
    roots: list[nn.Module] = []
    for obj in modules:
        if isinstance(obj, nn.Module):
            roots.append(obj)
        elif obj is not None:
            roots += [v for v in vars(obj).values() if isinstance(v, nn.Module)]
    patched = 0
    for root in roots:
        for module in root.modules():
            if (
                type(module) is nn.Linear
                and "forward" not in vars(module)
                and needs_flat_inputs(module)
            ):
                module.forward = types.MethodType(_flat_linear_forward, module)
                patched += 1
    return patched


@contextlib.contextmanager
def grouped_kv_attention(device: torch.device) -> Iterator[None]:
    """While decoding one sequence on a CPU, let SDPA read grouped K/V heads without copies.

    transformers' SDPA attention passes ``enable_gqa=True`` only when no mask is given (or for
    a single query token); any other forward first repeats every layer's cached keys and values
    to all query heads (``repeat_kv``, a copy of the whole cache per layer per forward). The
    verify forwards of speculative decoding have several queries and, for trees, a mask. On
    SmolLM2 (9 query, 3 K/V heads, bf16, 300 cached positions, one thread) a 3-token chain
    verify took 54.8 ms with the copies and 53.5 ms without, a 7-token tree verify 60.6 and
    59.1 ms, and a one-token decode 56.2 and 56.0 ms, with identical logits
    (``scripts/bench_gqa.py``, ``bench/gqa_cpu.json``).

    Only around batch-1 decoding (the loop in ``train/decoding/speculative.py``): batched
    generation with padding masks got slower with it: ``generate_batch`` at batch 64, 202
    tokens/s against 296 (the same benchmark; a 30-minute job with the switch process-wide
    self-distilled at ~215 tokens/s where the one before it had ~315). Only on a CPU: CUDA's fused kernels do not take masked GQA (they fall back to
    the math kernel). A user's own setting of the variable is kept. The switch is transformers'
    ``TRANSFORMERS_SDPA_FORCE_GQA``, read at each attention call, so it is set for the block
    and removed after.
    """
    if device.type != "cpu" or FORCE_GQA_ENV in os.environ:
        yield
        return
    os.environ[FORCE_GQA_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(FORCE_GQA_ENV, None)
