"""Drafter attention whose memory grows linearly with context: training-time test and inference.

EAGLE-3's training-time test (TTT, EAGLE-3 §3.3; HASS) unrolls the drafter ``steps`` times over a
sequence of T positions. At step j a query at position t attends to

- the step-0 keys at positions ``<= t`` (the verified context: a causal T x T block), and
- in each earlier step 1..j, only the key at its own position t (the drafter's own earlier draft
  steps along the same chain: a diagonal, one score per query).

Laid out as one attention over ``(j + 1) * T`` keys with a dense ``[T, (j + 1) T]`` mask, this costs
memory quadratic in T times the steps: on CUDA a masked call with grouped heads runs PyTorch's
math kernel, which keeps every probability (``steps (steps + 1) / 2`` blocks of T x T per head;
about 15 GB per 2k-token sample at 32 heads in fp32). Here the causal block goes through a fused
kernel (flash on CPUs and on CUDA in bf16/fp16: no mask, no T x T tensor) that also returns each
query's log-sum-exp ``L``; the diagonal scores ``d_i = q . k_i / sqrt(D)`` are one number per query
and step; the two are merged exactly, as split-KV flash attention merges its partial results:

    o = (e^L o_causal + sum_i e^(d_i) v_i) / (e^L + sum_i e^(d_i))  =  softmax([L, d_1..d_j]) . [o_causal, v_1..v_j]

The backward reuses the kernel's own backward: with g = dLoss/do and w_c = e^L / Z the causal
part's weight, the kernel's gradient for (q, K, V) given ``grad_out = w_c g`` and ``out = o`` (the
*merged* output, which enters the kernel's backward only through its row sums ``D = rowsum(grad_out
* out)``) is exactly the gradient through both o_causal and L (the same identity ring and split-KV
attention use). Memory is linear in T and steps: q, the keys and values of every step, o and L.

Devices without such a kernel (or where the kernel fails a one-time check against the exact
chunked path, :func:`_kernel_ok`) use :func:`_chunked_ttt`: the same attention computed in query
chunks, each recomputed in the backward (activation checkpointing), also linear in memory.

At inference (:func:`prefix_attention`) the drafter's cache holds the verified context, which every
new query sees, then a few new keys (a chain's causal steps, or an EAGLE-2 tree's nodes) under a
small mask: the context goes through the kernel without a mask, the new keys through the small mask,
merged the same way. No call here passes a mask together with grouped heads to
``scaled_dot_product_attention``.

Padding: batches are right-padded (:func:`~draftsmith.train.data.batching.collate_hidden_states`),
so a real query never sees a padded key in the causal block (padded keys come after it), nor on its
diagonal (its own position is real). Padded positions' outputs are computed over whatever is there
and are never supervised; nothing real reads them.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = [
    "BlockLayout",
    "TTTKeys",
    "block_attention",
    "causal_attention",
    "prefix_attention",
    "ttt_attention",
    "ttt_attention_path",
]

# Query rows per chunk of the exact chunked path: each chunk holds [B, H, rows, T] scores.
CHUNK_ROWS = 256
# Up to this many positions the TTT attention takes the chunked path as one chunk.
SHORT_ROWS = 128


class TTTKeys:
    """Keys and values of one training-time-test unroll, by step.

    ``base`` holds step 0's ``(keys, values)`` ``[B, KV, T, D]`` (after RoPE), seen causally;
    ``diag`` each later step's, seen by the query at the same position only. Kept as separate
    tensors (never concatenated), so the unroll holds each step's keys once.
    """

    def __init__(self) -> None:
        self.base: tuple[torch.Tensor, torch.Tensor] | None = None
        self.diag: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return 0 if self.base is None else 1 + len(self.diag)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's keys and attend: step 0 causally, later steps as in the module doc.

        Args:
            q: ``[B, H, T, D]`` this step's queries (after RoPE).
            k: ``[B, KV, T, D]`` this step's keys (after RoPE).
            v: ``[B, KV, T, D]`` this step's values.

        Returns:
            ``[B, H, T, D]``.
        """
        if self.base is None:
            self.base = (k, v)
            return causal_attention(q, k, v)
        self.diag.append((k, v))
        return ttt_attention(q, self.base[0], self.base[1], self.diag)


# --------------------------------------------------------------------------------------------
# Fused kernels that return the log-sum-exp, and their backward
# --------------------------------------------------------------------------------------------


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, KV, S, D]`` -> ``[B, H, S, D]`` (each KV head repeated for its query group)."""
    kv = x.shape[1]
    return x if kv == heads else x.repeat_interleave(heads // kv, dim=1)


def _fold_kv(grad: torch.Tensor, kv: int) -> torch.Tensor:
    """Sum a ``[B, H, S, D]`` gradient back over each KV head's query group."""
    b, h, s, d = grad.shape
    return grad if h == kv else grad.view(b, kv, h // kv, s, d).sum(2)


def _kernel_name(q: torch.Tensor) -> str | None:
    """The fused kernel with a log-sum-exp for these queries' device and dtype, or None."""
    if q.device.type == "cpu":
        return "cpu_flash"
    # Flash on CUDA needs half precision and a head size that is a multiple of 8 up to 256.
    half = q.dtype in (torch.float16, torch.bfloat16)
    if q.device.type == "cuda" and half and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        return "cuda_flash"
    # fp32 on CUDA (its efficient kernel's backward takes an attention bias Python cannot leave
    # undefined), other devices: the exact chunked path.
    return None


def _kernel_forward(
    kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """``(out [B, H, n, D], lse [B, H, n] float32, what the backward needs)``."""
    if kernel == "cpu_flash":
        # The CPU flash kernel takes grouped heads as they are.
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse, ()
    heads = q.shape[1]
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _kernel_backward(
    kernel: str,
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    extra: tuple,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's gradients ``(dq, dk, dv)``, keys and values with ``k``'s head count."""
    if kernel == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    kv, heads = k.shape[1], q.shape[1]
    ke, ve = _expand_kv(k, heads), _expand_kv(v, heads)
    cum_q, cum_k, max_q, max_k, seed, offset = extra
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out,
        q,
        ke,
        ve,
        out,
        lse,
        cum_q,
        cum_k,
        max_q,
        max_k,
        0.0,
        causal,
        seed,
        offset,
        scale=scale,
    )
    return dq, _fold_kv(dk, kv), _fold_kv(dv, kv)


# --------------------------------------------------------------------------------------------
# Training-time test: the causal block by the kernel, the diagonals by hand, merged
# --------------------------------------------------------------------------------------------


def _diag_scores(q: torch.Tensor, keys: list[torch.Tensor], scale: float) -> torch.Tensor:
    """``[B, H, T, j]`` float32: each query's score against each step's key at its position."""
    b, h, t, d = q.shape
    kv = keys[0].shape[1]
    qg = q.float().view(b, kv, h // kv, t, d)
    cols = [(qg * k.float()[:, :, None]).sum(-1).view(b, h, t) for k in keys]
    return torch.stack(cols, dim=-1) * scale


def _diag_values(w: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    """``sum_i w[..., i] v_i`` at each query's own position: ``[B, H, T, D]`` float32."""
    b, h, t, _ = w.shape
    kv = values[0].shape[1]
    wg = w.view(b, kv, h // kv, t, -1)
    out = None
    for i, v in enumerate(values):
        term = wg[..., i, None] * v.float()[:, :, None]
        out = term if out is None else out + term
    return out.view(b, h, t, -1)


class _TTTAttention(torch.autograd.Function):
    """The merged TTT attention with a fused kernel (see the module docstring)."""

    @staticmethod
    def forward(ctx, kernel: str, scale: float, q, k0, v0, *diag):
        j = len(diag) // 2
        dk, dv = list(diag[:j]), list(diag[j:])
        out_c, lse, extra = _kernel_forward(kernel, q, k0, v0, True, scale)
        scores = _diag_scores(q, dk, scale)  # [B, H, T, j]
        w = torch.softmax(torch.cat([lse[..., None], scores], dim=-1), dim=-1)
        out = w[..., :1] * out_c.float() + _diag_values(w[..., 1:], dv)
        out = out.to(q.dtype)
        ctx.kernel, ctx.scale, ctx.j, ctx.extra = kernel, scale, j, extra
        ctx.save_for_backward(q, k0, v0, out, lse, w, *dk, *dv)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k0, v0, out, lse, w, *diag = ctx.saved_tensors
        j, scale = ctx.j, ctx.scale
        dk, dv = diag[:j], diag[j:]
        b, h, t, d = q.shape
        kv = k0.shape[1]
        g = grad.float()
        # softmax over [L, d_1..d_j] with values [o_c, v_1..v_j]: dLoss/dd_i = w_i (g.v_i - g.o)
        g_o = (g * out.float()).sum(-1, keepdim=True)  # [B, H, T, 1]
        gg = g.view(b, kv, h // kv, t, d)
        g_v = torch.stack([(gg * v.float()[:, :, None]).sum(-1).view(b, h, t) for v in dv], dim=-1)
        d_scores = w[..., 1:] * (g_v - g_o)  # [B, H, T, j]
        # The causal block: the kernel's backward with grad_out = w_c g and out = o (merged).
        grad_c = (w[..., :1] * g).to(q.dtype)
        dq, dk0, dv0 = _kernel_backward(
            ctx.kernel, grad_c, q, k0, v0, out, lse, ctx.extra, True, scale
        )
        dq = dq.float()
        qg = q.float().view(b, kv, h // kv, t, d)
        ds = d_scores.view(b, kv, h // kv, t, j)
        wg = w[..., 1:].reshape(b, kv, h // kv, t, j)
        grads_k, grads_v = [], []
        for i in range(j):
            dq = dq + (ds[..., i, None] * dk[i].float()[:, :, None]).view(b, h, t, d) * scale
            grads_k.append(((ds[..., i, None] * qg).sum(2) * scale).to(dk[i].dtype))
            grads_v.append((wg[..., i, None] * gg).sum(2).to(dv[i].dtype))
        return None, None, dq.to(q.dtype), dk0, dv0, *grads_k, *grads_v


def _chunk_ttt(start: int, scale: float, q, k0, v0, *diag) -> torch.Tensor:
    """Rows ``start .. start + n`` of the TTT attention, exactly, by plain operations."""
    j = len(diag) // 2
    b, h, n, d = q.shape
    kv = k0.shape[1]
    end = start + n
    qg = q.float().view(b, kv, h // kv, n, d)
    keys = k0[:, :, :end].float()  # causal: nothing after the chunk's last row is visible
    s = torch.einsum("bkgnd,bksd->bkgns", qg, keys) * scale
    rows = torch.arange(start, end, device=q.device)[:, None]
    cols = torch.arange(end, device=q.device)[None]
    s = s.masked_fill(cols > rows, float("-inf"))
    if j:
        dk = [x[:, :, start:end].float() for x in diag[:j]]
        dd = torch.stack([(qg * x[:, :, None]).sum(-1) for x in dk], -1) * scale
        s = torch.cat([s, dd], dim=-1)
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bkgns,bksd->bkgnd", p[..., :end], v0[:, :, :end].float())
    for i, x in enumerate(diag[j:]):
        out = out + p[..., end + i, None] * x[:, :, start:end].float()[:, :, None]
    return out.reshape(b, h, n, d).to(q.dtype)


def _chunked_ttt(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    diag: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    chunk: int = CHUNK_ROWS,
) -> torch.Tensor:
    """The TTT attention in query chunks, each recomputed in the backward (exact, any device)."""
    flat = [k for k, _ in diag] + [v for _, v in diag]
    t = q.shape[2]
    if t <= chunk:  # one chunk: its scores are the most the path holds anyway, no recompute
        return _chunk_ttt(0, scale, q, k0, v0, *flat)
    outs = []
    for s in range(0, t, chunk):
        e = min(s + chunk, t)
        args = (q[:, :, s:e], k0, v0, *flat)
        if torch.is_grad_enabled() and any(a.requires_grad for a in args):
            outs.append(checkpoint(_chunk_ttt, s, scale, *args, use_reentrant=False))
        else:
            outs.append(_chunk_ttt(s, scale, *args))
    return torch.cat(outs, dim=2)


_CHECKED: dict[tuple[str, str, torch.dtype], bool] = {}


def _kernel_ok(kernel: str, q: torch.Tensor) -> bool:
    """Check a kernel once per (kernel, device type, dtype) against the exact chunked path.

    The fused path calls the kernels' private forward and backward operators, whose contracts a
    PyTorch release may change; a tiny forward and backward (with grouped heads, two diagonal
    steps) must agree with :func:`_chunked_ttt` or the chunked path is used from then on, with a
    warning. The check runs outside inference mode (evaluate and bench decode in it, and a
    backward cannot run there), so its verdict does not depend on where it is first asked.
    """
    if type(q).__name__ == "FakeTensor":
        return True  # shapes only (draftsmith plan): the kernel's own shape rules apply
    key = (kernel, q.device.type, q.dtype)
    if key in _CHECKED:
        return _CHECKED[key]
    try:
        ok = _kernel_agrees(kernel, q.device, q.dtype)
        if not ok:
            warnings.warn(
                f"the fused attention kernel ({kernel}, {q.device.type}, {q.dtype}) disagrees "
                "with the exact path; using the chunked path (slower, same memory)",
                stacklevel=3,
            )
    except Exception as exc:  # a kernel this PyTorch build or device lacks
        ok = False
        warnings.warn(
            f"the fused attention kernel ({kernel}) is unavailable here ({exc}); using the "
            "chunked path (slower, same memory)",
            stacklevel=3,
        )
    _CHECKED[key] = ok
    return ok


def _kernel_agrees(kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """The fused path's output and gradients equal the chunked path's on a tiny problem."""
    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autocast(device.type, enabled=False),
    ):
        gen = torch.Generator(device="cpu").manual_seed(0)  # drawn here, then moved
        shapes = [(2, 4, 37, 16), (2, 2, 37, 16)] + [(2, 2, 37, 16)] * 6
        ts = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
        grad = torch.randn(shapes[0], generator=gen).to(device, dtype)
        ins = [x.requires_grad_() for x in ts]
        diag = [(ins[3], ins[4]), (ins[5], ins[6])]
        scale = 1 / math.sqrt(16)
        fast = _TTTAttention.apply(
            kernel, scale, ins[0], ins[1], ins[2], ins[3], ins[5], ins[4], ins[6]
        )
        g_fast = torch.autograd.grad(fast, ins[:7], grad)
        slow = _chunked_ttt(ins[0], ins[1], ins[2], diag, scale, chunk=16)
        g_slow = torch.autograd.grad(slow, ins[:7], grad)
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    return all(
        torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
        for a, b in zip((fast, *g_fast), (slow, *g_slow), strict=True)
    )


def ttt_attention_path(q: torch.Tensor) -> str:
    """Which implementation :func:`ttt_attention` uses for these queries: a kernel or chunked."""
    kernel = _kernel_name(q)
    return kernel if kernel is not None and _kernel_ok(kernel, q) else "chunked"


def ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    diag: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of TTT step j = ``len(diag)``: causal over step 0's keys, diagonal over the rest.

    Args:
        q: ``[B, H, T, D]`` queries of step j (after RoPE).
        k0: ``[B, KV, T, D]`` step 0's keys (after RoPE); ``v0`` its values.
        v0: ``[B, KV, T, D]``.
        diag: ``[(k_i, v_i)]`` for steps 1..j, each ``[B, KV, T, D]``: query t sees only row t.
        scale: score scale (default ``1 / sqrt(D)``).

    Returns:
        ``[B, H, T, D]`` in ``q``'s dtype; gradients flow to every input.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if not diag:
        return causal_attention(q, k0, v0, scale=scale)
    # One dtype for every input, as SDPA gets them: autocast's where it is on (the residual
    # stream may be fp32 while the projections are bf16), else the widest of them.
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = q.dtype
        for x in (k0, v0, *(t for pair in diag for t in pair)):
            dtype = torch.promote_types(dtype, x.dtype)
    q, k0, v0 = (x.to(dtype) for x in (q, k0, v0))
    diag = [(k.to(dtype), v.to(dtype)) for k, v in diag]
    # Short sequences: the scores of all T queries are one chunk's (at most CHUNK_ROWS x
    # (CHUNK_ROWS + j) per head), and plain operations beat a fused kernel's fixed cost.
    path = "chunked" if q.shape[2] <= SHORT_ROWS else ttt_attention_path(q)
    if path == "chunked":
        return _chunked_ttt(q, k0, v0, diag, scale)
    flat = [k for k, _ in diag] + [v for _, v in diag]
    return _TTTAttention.apply(path, scale, q, k0, v0, *flat)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Plain causal self-attention ``[B, H, T, D]`` through SDPA, with no mask.

    Grouped heads: the CPU's kernels take them as they are; elsewhere keys and values are
    repeated per group first (memory linear in T), because some fused CUDA kernels refuse
    ``enable_gqa`` and the call would fall back to the math kernel (a T x T tensor per head).
    """
    h = q.shape[1]
    if q.device.type == "cpu":
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != h
        )
    return F.scaled_dot_product_attention(
        q, _expand_kv(k, h), _expand_kv(v, h), is_causal=True, scale=scale
    )


# --------------------------------------------------------------------------------------------
# Inference: a visible context plus a few new keys under a small mask
# --------------------------------------------------------------------------------------------


def _masked_scores(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``[B, H, n, S]`` float32 scores of q against k, ``-inf`` where ``mask`` is False."""
    b, h, n, d = q.shape
    kv = k.shape[1]
    s = torch.einsum("bkgnd,bksd->bkgns", q.float().view(b, kv, h // kv, n, d), k.float())
    s = s.reshape(b, h, n, -1) * scale
    return s.masked_fill(~mask.to(torch.bool), float("-inf"))


def _weighted_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``p [B, H, n, S] @ v [B, KV, S, D]`` with grouped heads: ``[B, H, n, D]`` float32."""
    b, h, n, s = p.shape
    kv = v.shape[1]
    out = torch.einsum("bkgns,bksd->bkgnd", p.view(b, kv, h // kv, n, s), v.float())
    return out.reshape(b, h, n, -1)


def prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int,
    tail_mask: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over keys whose first ``prefix`` are visible to every query, the rest masked.

    At inference the drafter's cache holds the verified context (every new query sees it) and a
    few draft entries (an EAGLE-2 tree's earlier levels, a chain's causal steps) whose visibility
    ``tail_mask`` gives. The context goes through a fused kernel with no mask; the tail is scored
    by hand (``n x (S - prefix)``, small) and the two are merged through the log-sum-exp, so
    nothing grows as ``n x S`` beyond the scores of the tail.

    Args:
        q: ``[B, H, n, D]``.
        k: ``[B, KV, S, D]`` all keys (context first); ``v`` the values.
        v: ``[B, KV, S, D]``.
        prefix: how many leading keys every query sees.
        tail_mask: bool ``[B or 1, 1 or H, n, S - prefix]`` (or ``[n, S - prefix]``), True =
            visible. Every query must see at least one key overall.
        scale: score scale (default ``1 / sqrt(D)``).

    Returns:
        ``[B, H, n, D]`` in ``q``'s dtype. Differentiable (by plain operations) when grad is on.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = k.shape[2]
    if tail_mask.dim() == 2:
        tail_mask = tail_mask[None, None]
    tail = _masked_scores(q, k[:, :, prefix:], tail_mask, scale)  # [B, H, n, S - prefix]
    kernel = _kernel_name(q)
    fused = (
        prefix > 0
        and kernel is not None
        and not (torch.is_grad_enabled() and q.requires_grad)
        and _kernel_ok(kernel, q)
    )
    if not fused:
        # The exact path: every score at once (what tests and gradients use; small at inference).
        visible = torch.ones(1, 1, 1, prefix, dtype=torch.bool, device=q.device)
        full = torch.cat([_masked_scores(q, k[:, :, :prefix], visible, scale), tail], dim=-1)
        return _weighted_values(torch.softmax(full, dim=-1), v[:, :, :s]).to(q.dtype)
    with torch.no_grad():
        out_c, lse, _ = _kernel_forward(kernel, q, k[:, :, :prefix], v[:, :, :prefix], False, scale)
        w = torch.softmax(torch.cat([lse[..., None], tail], dim=-1), dim=-1)
        out = w[..., :1] * out_c.float() + _weighted_values(w[..., 1:], v[:, :, prefix:])
    return out.to(q.dtype)


# --------------------------------------------------------------------------------------------
# DFlash training: blocks beside each other, each over its own prefix of the context
# --------------------------------------------------------------------------------------------

# Block queries per chunk of :func:`block_attention` (anchors x block size).
BLOCK_CHUNK_QUERIES = 512


class BlockLayout:
    """Which keys DFlash's training blocks see, without a dense mask.

    Keys are the T context positions, then every block's S slots. Block j (anchor ``a_j``) sees
    the real context positions ``< a_j`` and its own S slots (bidirectionally), never another
    block (:func:`~draftsmith.train.objectives.dflash.dflash_attention_mask` writes the same out
    densely as ``[B, A S, T + A S]``).

    Args:
        anchors: ``[B, A]`` anchor positions.
        context_valid: ``[B, T]`` bool, real context positions.
        block_size: S.
    """

    def __init__(self, anchors: torch.Tensor, context_valid: torch.Tensor, block_size: int):
        self.anchors = anchors
        self.context_valid = context_valid.to(torch.bool)
        self.block_size = block_size

    def mask(self, first: int, last: int) -> torch.Tensor:
        """bool ``[B, 1, (last - first) S, T + (last - first) S]`` for anchors first..last-1."""
        a = self.anchors[:, first:last]
        b, n = a.shape
        s = self.block_size
        t = self.context_valid.shape[1]
        dev = a.device
        ctx = torch.arange(t, device=dev)[None, None] < a[..., None]  # [B, n, T]
        ctx = (ctx & self.context_valid.to(dev)[:, None])[:, :, None].expand(b, n, s, t)
        same = torch.eye(n, dtype=torch.bool, device=dev)[:, None, :, None].expand(n, s, n, s)
        blocks = same.reshape(n * s, n * s)[None].expand(b, -1, -1)
        return torch.cat([ctx.reshape(b, n * s, t), blocks], dim=-1)[:, None]


def _block_chunk(
    layout: BlockLayout, first: int, last: int, q, k_ctx, v_ctx, k_blk, v_blk
) -> torch.Tensor:
    keys = torch.cat([k_ctx, k_blk], dim=2)
    values = torch.cat([v_ctx, v_blk], dim=2)
    mask = layout.mask(first, last)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != q.shape[1]
    )


def block_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    layout: BlockLayout,
    *,
    chunk_queries: int = BLOCK_CHUNK_QUERIES,
) -> torch.Tensor:
    """DFlash's training attention, a chunk of blocks at a time.

    Each chunk attends over (the context, its own blocks' slots) under its slice of the block
    layout and is recomputed in the backward when there are several chunks, so what is kept for
    the backward is the queries, keys and values (linear in T) and what a chunk needs at once is
    ``chunk_queries x (T + chunk_queries)`` -- never the ``A S x (T + A S)`` mask or
    probabilities of all blocks together.

    Args:
        q: ``[B, H, A S, D]`` block queries (anchor-major).
        k_ctx: ``[B, KV, T, D]`` context keys; ``v_ctx`` its values.
        v_ctx: ``[B, KV, T, D]``.
        k_blk: ``[B, KV, A S, D]`` block keys; ``v_blk`` its values.
        v_blk: ``[B, KV, A S, D]``.
        layout: the anchors and which context positions are real.
        chunk_queries: block queries per chunk (whole blocks: at least one).

    Returns:
        ``[B, H, A S, D]``.
    """
    s = layout.block_size
    a = layout.anchors.shape[1]
    per = max(1, chunk_queries // s)
    if per >= a:
        return _block_chunk(layout, 0, a, q, k_ctx, v_ctx, k_blk, v_blk)
    outs = []
    for first in range(0, a, per):
        last = min(first + per, a)
        sl = slice(first * s, last * s)
        args = (q[:, :, sl], k_ctx, v_ctx, k_blk[:, :, sl], v_blk[:, :, sl])
        if torch.is_grad_enabled():
            outs.append(checkpoint(_block_chunk, layout, first, last, *args, use_reentrant=False))
        else:
            outs.append(_block_chunk(layout, first, last, *args))
    return torch.cat(outs, dim=2)
