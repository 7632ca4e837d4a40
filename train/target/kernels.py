"""CPU kernel-path fixes for decoding at batch 1 (measured on AVX512-BF16 CPUs, torch 2.13).

``F.linear`` on a 3-D bf16 input whose size-1 leading dims carry "odd" strides takes a slow
kernel path: a ``[1, 1, 576]`` view of the last row of a ``[1, 300, 576]`` tensor (strides
``(172800, 576, 1)``) against SmolLM2's ``49152 x 576`` lm_head costs ~300 ms of CPU time at one
thread, the same values in a fresh ``[1, 1, 576]`` tensor ~10 ms. PyTorch calls such a tensor
contiguous (strides of size-1 dims do not count), so ``.contiguous()`` and ``clone()`` keep the
strides and the slow path. Such views are everywhere in decoding: HF's ``logits_to_keep=1``
prefill slices the last row, drafters read ``hidden[:, -1:]``. Flattening the leading dims to a
2-D ``[N, K]`` view (always possible without a copy for these tensors) takes the fast path.

fp32 is not affected measurably, but the flattened call is never slower, so targets and drafters
get it in every dtype (``scripts/bench_forward.py`` measures both).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["flatten_linear_inputs"]


def _flat_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dim() > 2:
        out = F.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])
    return F.linear(x, self.weight, self.bias)


def flatten_linear_inputs(*modules: object) -> int:
    """Make every plain ``nn.Linear`` inside ``modules`` flatten its input to 2-D first.

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
            if type(module) is nn.Linear and "forward" not in vars(module):
                module.forward = types.MethodType(_flat_linear_forward, module)
                patched += 1
    return patched
