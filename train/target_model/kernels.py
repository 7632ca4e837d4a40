"""CPU kernel-path fixes for decoding at batch 1 (measured on AVX512-BF16 CPUs, torch 2.13).

Two fixes for the ``nn.Linear`` layers of the target and of the drafters, applied by
:func:`fast_cpu_linears` (``load_target`` calls it; ``evaluate`` calls it on drafters):

* **Strided views.** ``F.linear`` on a 3-D bf16 input whose size-1 leading dims carry "odd"
  strides takes a slow kernel path: a ``[1, 1, 576]`` view of the last row of a ``[1, 300, 576]``
  tensor (strides ``(172800, 576, 1)``) against SmolLM2's ``49152 x 576`` lm_head costs ~300 ms
  of CPU time at one thread, the same values in a fresh ``[1, 1, 576]`` tensor ~10 ms. PyTorch
  calls such a tensor contiguous (strides of size-1 dims do not count), so ``.contiguous()`` and
  ``clone()`` keep the strides and the slow path. Such views are everywhere in decoding: HF's
  ``logits_to_keep=1`` prefill slices the last row, drafters read ``hidden[:, -1:]``. Flattening
  the leading dims to a 2-D ``[N, K]`` view (always possible without a copy for these tensors)
  takes the fast path.
* **Prepacked bf16 weights.** ``F.linear`` in bf16 reorders the weight for oneDNN at every call.
  Reordered once (oneDNN's blocked layout, the copy PyTorch's own CPU inference compiler makes
  when it freezes a model) and multiplied with ``torch.ops.mkldnn._linear_pointwise``, the
  products are the same (bit-identical in every SmolLM2 shape measured; oneDNN may round one
  differently by a bf16 ulp, as seen in a tiny test model's 64 -> 32 projection) and, at the
  few rows of decoding, 1.4-2.5x as fast: SmolLM2's lm_head 6.4 -> 3.8 ms for one row and
  8.2 -> 4.0 ms for eight, its MLP down projection 84 -> 44 us for one row; at 64 rows the gain
  is ~7 %, at 300 ~3 % (``scripts/bench_packed_linear.py``, ``bench/cpu_costs/packed_linear_cpu.json``).
  Plain bf16 decoding of SmolLM2 went from 18.5 to 24.4 tokens/s, with the same tokens. The
  packed copy is made at the first call that needs no gradient, kept beside the layer (not in
  its state dict; copies of a module start without one) and remade when the weight changes
  (its storage or version); it costs one more copy of the weights in memory. Used only where
  it was measured: bf16 weights on a CPU with native bf16 instructions (AVX512-BF16 or AMX),
  outside autograd, on plain (not sharded) tensors. Set ``DRAFTSMITH_PACKED_LINEARS=0`` to turn
  it off (benchmarks compare the two).

Where it applies (``scripts/bench_forward.py`` measures the first): only CPU layers with bf16 or
fp16 weights. fp32 showed no measurable difference, and on a GPU neither path exists (cuBLAS
takes any strides and keeps its own layouts), so layers on other devices or in fp32 are left as
they are: a CPU-only workaround stays on the CPU.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..device import native_bf16

__all__ = [
    "PACKED_ENV",
    "PATCHED_DTYPES",
    "fast_cpu_linears",
    "grouped_kv_attention",
    "needs_fast_path",
    "packing_supported",
]

#: transformers' switch: SDPA with ``enable_gqa=True`` even under an attention mask.
FORCE_GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"
#: Set to ``0`` to multiply bf16 CPU linears with PyTorch's own kernel (no packed copy).
PACKED_ENV = "DRAFTSMITH_PACKED_LINEARS"

#: Weight dtypes whose CPU kernels take the slow path (measured: bf16; fp16 shares its kernels).
PATCHED_DTYPES = (torch.bfloat16, torch.float16)


def packing_supported() -> bool:
    """Whether bf16 weights are prepacked: oneDNN present and a CPU with native bf16 math.

    Without AVX512-BF16 or AMX oneDNN emulates bf16, which was never measured here; with
    oneDNN capped below its bf16 ISAs (``ONEDNN_MAX_CPU_ISA=AVX2``) it cannot pack bf16 weights
    at all, so :func:`~draftsmith.train.device.native_bf16`, which reads the cap, must hold too.
    """
    if os.environ.get(PACKED_ENV, "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # x86 kernels only
    return any(getattr(cpu, name, lambda: False)() for name in checks) and native_bf16("cpu")


class _PackedWeight:
    """A linear layer's weight in oneDNN's blocked layout, remade when the weight changes.

    An opaque oneDNN tensor cannot be deep-copied or pickled, so copies of the holder (and of
    the module holding it: EMA, snapshots) start empty and pack their own weight when used.
    """

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, weight.shape)
        if key != self.key:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self.key = key
        return self.packed

    def __deepcopy__(self, memo: dict) -> _PackedWeight:
        return _PackedWeight()

    def __reduce__(self) -> tuple:
        return (_PackedWeight, ())


_PLAIN_TENSORS = (nn.Parameter, torch.Tensor)


def _fast_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]) if x.dim() > 2 else x
    packed: _PackedWeight | None = self.__dict__.get("_packed_weight")
    weight = self.weight
    if (
        packed is not None
        and type(weight) in _PLAIN_TENSORS  # not a sharded (DTensor) or otherwise wrapped one
        and weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.bfloat16
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        out = torch.ops.mkldnn._linear_pointwise(
            flat, packed.get(weight), self.bias, "none", [], ""
        )
    else:
        out = F.linear(flat, weight, self.bias)
    return out.view(*x.shape[:-1], out.shape[-1]) if x.dim() > 2 else out


def needs_fast_path(module: nn.Linear) -> bool:
    """Whether this layer gets the patch: a CPU layer with bf16/fp16 weights."""
    weight = module.weight
    return weight.device.type == "cpu" and weight.dtype in PATCHED_DTYPES


def fast_cpu_linears(*modules: object) -> int:
    """Give every plain CPU bf16/fp16 ``nn.Linear`` inside ``modules`` the fast CPU paths.

    Each patched layer flattens its input to 2-D and, for bf16 weights on a CPU with native
    bf16 math (:func:`packing_supported`), multiplies with a packed copy of its weight (see the
    module docstring). Call it after the modules are on their device and in their dtype: layers
    elsewhere (a GPU, the meta device) or in fp32 are not patched (:func:`needs_fast_path`).

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
    pack = packing_supported()
    patched = 0
    for root in roots:
        for module in root.modules():
            if (
                type(module) is nn.Linear
                and "forward" not in vars(module)
                and needs_fast_path(module)
            ):
                if pack and module.weight.dtype == torch.bfloat16:
                    module.__dict__["_packed_weight"] = _PackedWeight()
                module.forward = types.MethodType(_fast_linear_forward, module)
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
    (``scripts/bench_gqa.py``, ``bench/cpu_costs/gqa_cpu.json``).

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
