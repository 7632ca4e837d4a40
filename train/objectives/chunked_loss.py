"""A vocabulary head and its loss in row chunks, with their own backward: no ``[T, V]`` kept.

Every drafter loss reads its head's logits ``z = h Wᵀ`` (``[T, V]``: T positions, V the
vocabulary) through a log-softmax, and autograd keeps that fp32 ``[T, V]`` tensor (often p and q
beside it) until the backward: about 1 GB per EAGLE-3 training-time-test step at T = 8k and a
32k draft vocabulary, 4 GB for EAGLE-1's 128k-152k full vocabulary (issue 50, finding 2).

:func:`head_rows` applies the head and computes each loss *per row* (per position) chunk by
chunk: for each chunk of rows it computes the chunk's logits, its log-softmax, the label's
distribution and every requested per-row term, and keeps only the ``[rows]`` results. The
backward walks the chunks again, recomputes each chunk's logits (the head's matmul once more:
four head matmuls a step instead of three), forms ``∂loss/∂z`` for the chunk from the per-row
gradients, and turns it into the chunk's ``[rows, H]`` gradient and its share of the weight's
``[V, H]`` gradient. What the backward keeps is what it was given: the head's input ``[T, H]``,
its weight, and the label's source (a dense ``[T, V]`` label the caller holds anyway, or the
``[T, H']`` hidden states the label's head is recomputed from). The same technique as the
fused linear cross-entropy kernels (e.g. Liger-Kernel, SpecForge's fused log-softmax loss), in
plain PyTorch and for every loss the recipes use.

The per-row terms (``q = softmax(z / τ)``, ``p`` the label's distribution at the same τ):

- ``ce``: the soft cross-entropy ``−Σ p log q`` (EAGLE, Medusa, DFlash; ``p`` may be any
  non-negative row, e.g. all-zero at an unsupervised position);
- ``alpha``: the acceptance rate ``Σ min(p, q)`` (LK losses, :mod:`.acceptance`);
- ``fkl``/``rkl``: ``KL(p‖q)``/``KL(q‖p)``, ``tv``: ``½ Σ |p − q|``, ``jsd``: the generalised
  Jensen-Shannon divergence (:mod:`.distill`'s formulas, term for term);
- ``nll``: ``−log softmax(z)[label]`` at temperature 1 with a hard label (0 where it is < 0).

Requested in ``terms`` a term is differentiable; requested in ``metrics`` it comes without a
graph (and costs nothing in the backward). Other no-grad outputs: ``argmax`` (of z, optionally
over a subset of the columns), ``topk`` indices, the label's ``p_argmax`` (over its full
vocabulary) and ``p_entropy``, and ``accept`` (``Σ min(p, q)`` at temperature 1 whatever τ, the
distillation recipe's metric). The combination into a loss (masked means, the LK blend, the
depth weights) is left to the caller, on ``[B, T]`` tensors, with the same formulas as before.

Matmul dtype: under autocast the head runs in the autocast dtype, as ``F.linear`` would; else in
the weight's dtype (the input is cast to it, as the recipes did). The backward uses the same
dtype. A trained weight enters under autocast as one bf16 copy with its graph, shared by every
call until the weight changes (autocast's own cache does this for a linear layer): its gradient
is formed in bf16, summed over the calls and converted to fp32 once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CHUNK_ELEMENTS",
    "METRICS",
    "TERMS",
    "chunk_rows_for",
    "head_argmax",
    "head_rows",
]

#: Per-row terms :func:`head_rows` can differentiate.
TERMS: tuple[str, ...] = ("ce", "alpha", "fkl", "rkl", "tv", "jsd", "nll")
#: No-grad per-row values (the terms, plus these).
METRICS: tuple[str, ...] = (*TERMS, "accept", "p_entropy")

#: Default chunk size, rows x V: 2^24 elements, 64 MiB per fp32 ``[rows, V]`` tensor (a chunk
#: holds a handful of them at once: the logits, log q, q, p and a gradient). Smaller chunks cost
#: time: on a 2-core AVX512-BF16 CPU, the head's three matmuls at T = 1024, hidden 4096 and a 32k
#: vocabulary took 0.79 s in 512-row chunks, 1.0 s in 262-row chunks and 1.3 s in 128-row ones
#: (the weight gradient's accumulation suffers most); one 1024-row matmul set took 0.82 s.
CHUNK_ELEMENTS = 2**24

# Terms that read the label's log-probabilities (not only its probabilities).
_NEEDS_LOG_P = frozenset({"fkl", "rkl", "jsd"})


def chunk_rows_for(vocab: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Rows per chunk so that one ``[rows, vocab]`` tensor has about ``chunk_elements``."""
    return max(1, chunk_elements // max(vocab, 1))


@dataclass(frozen=True)
class _Spec:
    """What one :func:`head_rows` call computes (everything but the tensors)."""

    terms: tuple[str, ...]
    metrics: tuple[str, ...]
    temperature: float
    beta: float
    argmax: bool
    topk: int
    p_argmax: bool
    label: str  # "p" (dense probabilities), "head" (logits from p_head), "" (hard or none)
    p_head: Callable[[torch.Tensor], torch.Tensor] | None
    mm_dtype: torch.dtype
    rows: int
    autocast: tuple[str, bool, torch.dtype]  # device type, enabled, dtype (for p_head)

    @property
    def all_values(self) -> tuple[str, ...]:
        return self.terms + tuple(m for m in self.metrics if m not in self.terms)


def _as_3d(x: torch.Tensor | None, lead: int) -> torch.Tensor | None:
    """``[T, ...]`` -> ``[1, T, ...]`` (a view); ``[B, T, ...]`` unchanged."""
    if x is None:
        return None
    return x.unsqueeze(0) if lead == 1 else x


# The weight's copy in the matmul dtype, by weight: (weak reference to the weight, its version,
# weak reference to the copy). See :func:`_cast_weight`.
_CASTS: dict[int, tuple[Any, int, Any]] = {}


def _cast_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype``, cast once while the copy is in use.

    An EAGLE-3 unroll applies the same head at every TTT step, forward and backward: autocast
    would cast the weight once for the whole region (its cache) and keep that one copy for the
    backward. The same here: the copy is kept (weakly) while some step's graph holds it and the
    weight is unchanged (its version: the optimizer updates it in place), so 7 steps cost one
    cast and one copy, not 14 and 7.
    """
    if weight.dtype == dtype:
        return weight
    import weakref

    key = id(weight)
    hit = _CASTS.get(key)
    if hit is not None:
        ref, version, cast_ref = hit
        cast = cast_ref()
        if ref() is weight and version == weight._version and cast is not None:
            return cast
    cast = weight.detach().to(dtype)
    _CASTS[key] = (weakref.ref(weight), weight._version, weakref.ref(cast))
    for k in [k for k, (r, _, c) in _CASTS.items() if r() is None or c() is None]:
        del _CASTS[k]
    return cast


_TRACKED: dict[int, tuple[Any, int, Any]] = {}


def _tracked_cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight.to(dtype)`` with its graph, made once while in use (see :func:`_cast_weight`)."""
    import weakref

    key = id(weight)
    hit = _TRACKED.get(key)
    if hit is not None:
        ref, version, cast_ref = hit
        cast = cast_ref()
        if ref() is weight and version == weight._version and cast is not None:
            return cast
    cast = weight.to(dtype)
    _TRACKED[key] = (weakref.ref(weight), weight._version, weakref.ref(cast))
    for k in [k for k, (r, _, c) in _TRACKED.items() if r() is None or c() is None]:
        del _TRACKED[k]
    return cast


def _mm_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return weight.dtype


class _Chunk:
    """One chunk's logits and label, and the per-row values read from them."""

    def __init__(
        self,
        spec: _Spec,
        h: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        p: torch.Tensor | None,
        p_hidden: torch.Tensor | None,
        p_cols: torch.Tensor | None,
    ) -> None:
        self.spec = spec
        z = h.to(spec.mm_dtype) @ w.t()
        if bias is not None:
            z = z + bias.to(z.dtype)
        # [r, V] in the matmul's dtype: argmax/topk read it as it is (the fp32 upcast is exact,
        # so they pick the same columns), the log-softmax upcasts as it reads (no fp32 copy).
        self.z = z
        self._log_q: torch.Tensor | None = None
        self._q: torch.Tensor | None = None
        self.p = self.log_p = self.p_arg = None
        if spec.label == "p":
            self.p = p.float()
        elif spec.label == "head":
            kind, enabled, dtype = spec.autocast
            with torch.autocast(kind, dtype=dtype, enabled=enabled):
                logits = spec.p_head(p_hidden)
            logits = logits.float().to(self.z.device)
            if spec.p_argmax:
                self.p_arg = logits.argmax(-1)  # over the label's full vocabulary
            if p_cols is not None:
                logits = logits.index_select(-1, p_cols)
            self.p_logits = logits
            tau = spec.temperature
            scaled = logits / tau if tau != 1 else logits
            names = set(spec.all_values)
            if names & _NEEDS_LOG_P:
                self.log_p = torch.log_softmax(scaled, dim=-1)
                self.p = self.log_p.exp()
            else:
                self.p = torch.softmax(scaled, dim=-1)

    @property
    def log_q(self) -> torch.Tensor:
        """``log softmax(z / τ)`` ``[r, V]`` fp32, made when first read."""
        if self._log_q is None:
            tau = self.spec.temperature
            if tau != 1:
                self._log_q = torch.log_softmax(self.z.float() / tau, dim=-1)
            else:
                self._log_q = torch.log_softmax(self.z, dim=-1, dtype=torch.float32)
        return self._log_q

    @property
    def q(self) -> torch.Tensor:
        """``softmax(z / τ)`` ``[r, V]`` fp32, made when first read (from log q if it exists:
        the backward's soft cross-entropy needs only q, one pass over the logits)."""
        if self._q is None:
            if self._log_q is not None:
                self._q = self._log_q.exp()
            elif self.spec.temperature != 1:
                self._q = torch.softmax(self.z.float() / self.spec.temperature, dim=-1)
            else:
                self._q = torch.softmax(self.z, dim=-1, dtype=torch.float32)
        return self._q

    def log_q1(self) -> torch.Tensor:
        """``log softmax(z)`` at temperature 1 (the hard label's and ``accept``'s)."""
        if self.spec.temperature == 1:
            return self.log_q
        return torch.log_softmax(self.z, -1, dtype=torch.float32)

    def log_m(self) -> torch.Tensor:
        beta = self.spec.beta
        # log m in log space: the mixture of two tiny probabilities stays finite (as distill.jsd).
        return torch.logsumexp(
            torch.stack([self.log_p + math.log(beta), self.log_q + math.log(1 - beta)]), dim=0
        )

    def value(self, name: str, labels: torch.Tensor | None) -> torch.Tensor:
        """The per-row value ``[r]`` of a term or metric (the formulas the recipes used)."""
        p, log_p = self.p, self.log_p
        # log q only where read (alpha and the metrics need q, one softmax pass).
        log_q = self.log_q if name in ("ce", "fkl", "rkl", "jsd") else None
        if name == "ce":
            # Σ_v p log q as a batched dot product (fp32, outside autocast): no [r, V] product.
            with torch.autocast(log_q.device.type, enabled=False):
                return -torch.bmm(p[:, None, :], log_q[:, :, None])[:, 0, 0]
        q = self.q
        if name == "alpha":
            return torch.minimum(p, q).sum(-1)
        if name == "fkl":
            return _kl(p, log_p, log_q)
        if name == "rkl":
            return _kl(q, log_q, log_p)
        if name == "tv":
            return 0.5 * (p - q).abs().sum(-1)
        if name == "jsd":
            beta, log_m = self.spec.beta, self.log_m()
            return beta * _kl(p, log_p, log_m) + (1 - beta) * _kl(q, log_q, log_m)
        if name == "nll":
            inside = labels >= 0
            picked = self.log_q1().gather(-1, labels.clamp_min(0)[:, None])[:, 0]
            return torch.where(inside, -picked, torch.zeros_like(picked))
        if name == "accept":  # Σ min(p, q) at temperature 1 (the same as alpha at τ = 1)
            if self.spec.temperature == 1:
                return torch.minimum(p, q).sum(-1)
            p1 = torch.log_softmax(self.p_logits, -1).exp()
            return torch.minimum(p1, self.log_q1().exp()).sum(-1)
        if name == "p_entropy":
            return -(p * p.clamp_min(1e-30).log()).sum(-1)
        raise ValueError(f"unknown term {name!r}")

    def grad_z(self, grads: dict[str, torch.Tensor], labels: torch.Tensor | None) -> torch.Tensor:
        """``∂loss/∂z`` ``[r, V]`` fp32 from the per-row gradients ``{term: [r]}``.

        Each term's gradient with respect to ``log q`` (G below), then through the
        log-softmax: ``∂/∂z_v = (G_v − q_v Σ_u G_u) / τ``.
        """
        p, q = self.p, self.q
        if tuple(grads) == ("ce",) and self.spec.temperature == 1 and p is not None:
            # The soft cross-entropy alone (EAGLE's and Medusa's default): ∂/∂z = g (q Σp − p),
            # formed in place in q (read nowhere after this).
            g = grads["ce"][:, None]
            dz = q.mul_(p.sum(-1, keepdim=True)).sub_(p).mul_(g)
            self._q = None
            return dz
        log_p = self.log_p
        log_q = self.log_q if {"rkl", "jsd"} & set(grads) else None
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        big_g = None
        for name, g in grads.items():
            if name == "nll":
                continue
            g = g[:, None]
            if name == "ce":
                part = -g * p
            elif name == "alpha":
                # torch.minimum's rule: a tie gives each side half the gradient.
                w = (q < p).to(q.dtype) + 0.5 * (q == p).to(q.dtype)
                part = g * w * q
            elif name == "fkl":
                part = -g * p  # xlogy-style: a row's p = 0 entries give 0
            elif name == "rkl":
                part = g * torch.where(q > 0, q * (log_q - log_p + 1), zero)
            elif name == "tv":
                part = g * 0.5 * torch.sign(q - p) * q
            else:  # jsd: (1 - β) q (log q - log m), what the two KLs' gradients sum to
                part = g * torch.where(
                    q > 0, (1 - self.spec.beta) * q * (log_q - self.log_m()), zero
                )
            big_g = part if big_g is None else big_g + part
        dz = torch.zeros_like(q) if big_g is None else big_g - q * big_g.sum(-1, keepdim=True)
        if self.spec.temperature != 1:
            dz = dz / self.spec.temperature
        if "nll" in grads:
            inside = labels >= 0
            g = torch.where(inside, grads["nll"], torch.zeros_like(grads["nll"]))[:, None]
            q1 = q if self.spec.temperature == 1 else self.log_q1().exp()
            onehot = torch.zeros_like(q1).scatter_(-1, labels.clamp_min(0)[:, None], 1.0)
            dz = dz + g * (q1 - onehot)
        return dz


def _kl(a: torch.Tensor, log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """Per-row ``Σ a (log a − log b)``, 0 where ``a == 0`` (distill's ``_kl``)."""
    return (a * torch.where(a > 0, log_a - log_b, torch.zeros_like(a))).sum(-1)


def _chunks(b: int, t: int, rows: int):
    for i in range(b):
        for s in range(0, t, rows):
            yield i, s, min(s + rows, t)


class _HeadRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, hidden, weight, bias, p, p_hidden, p_cols, labels, argmax_cols):
        b, t, _ = hidden.shape
        values = spec.all_values
        dev = hidden.device
        need_h, need_w, need_b = ctx.needs_input_grad[1:4]
        # A frozen head (EAGLE-1's and DFlash's target head, a shared Medusa head, Medusa-2's
        # lm_head) and one term: the input's gradient per unit of the term, ∂term/∂z @ W, is
        # formed here ([T, H]) and only scaled in the backward, so the head's matmul is not
        # recomputed (two matmuls, as the dense head; a trained head needs the recompute for
        # its weight's gradient).
        ahead = need_h and not need_w and not need_b and len(spec.terms) == 1
        out = torch.zeros(len(values), b, t, dtype=torch.float32, device=dev)
        arg = torch.zeros(b, t, dtype=torch.long, device=dev) if spec.argmax else None
        top = torch.zeros(b, t, spec.topk, dtype=torch.long, device=dev) if spec.topk else None
        p_arg = torch.zeros(b, t, dtype=torch.long, device=dev) if spec.p_argmax else None
        unit = torch.zeros(b, t, hidden.shape[-1], device=dev) if ahead else None  # fp32
        w = _cast_weight(weight, spec.mm_dtype)
        for i, s, e in _chunks(b, t, spec.rows):
            c = _Chunk(
                spec,
                hidden[i, s:e],
                w,
                bias,
                None if p is None else p[i, s:e],
                None if p_hidden is None else p_hidden[i, s:e],
                p_cols,
            )
            lab = None if labels is None else labels[i, s:e]
            for k, name in enumerate(values):
                out[k, i, s:e] = c.value(name, lab)
            if arg is not None:
                if argmax_cols is None:
                    arg[i, s:e] = c.z.argmax(-1)
                else:
                    arg[i, s:e] = argmax_cols[c.z.index_select(-1, argmax_cols).argmax(-1)]
            if top is not None:
                top[i, s:e] = c.z.topk(spec.topk, dim=-1).indices
            if p_arg is not None:
                p_arg[i, s:e] = c.p_arg
            if ahead:
                dz = c.grad_z({spec.terms[0]: torch.ones(e - s, device=dev)}, lab)
                unit[i, s:e] = (dz.to(spec.mm_dtype) @ w).float()
        ctx.spec = spec
        ctx.ahead = ahead
        if ahead:
            ctx.save_for_backward(unit)
            ctx.hidden_dtype = hidden.dtype
        else:
            ctx.save_for_backward(hidden, weight, w, bias, p, p_hidden, p_cols, labels)
        n_terms = len(spec.terms)
        grads_out, rest = out[:n_terms], out[n_terms:]
        rest = rest if spec.metrics else None
        extras = [x for x in (rest, arg, top, p_arg) if x is not None]
        ctx.mark_non_differentiable(*extras)
        return (grads_out, *extras)

    @staticmethod
    def backward(ctx, grad_terms, *_):
        spec: _Spec = ctx.spec
        if ctx.ahead:
            (unit,) = ctx.saved_tensors
            grad_h = (grad_terms[0][..., None] * unit).to(ctx.hidden_dtype)
            return None, grad_h, None, None, None, None, None, None, None
        hidden, weight, w, bias, p, p_hidden, p_cols, labels = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[1:4]
        b, t, _ = hidden.shape
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = None  # fp32, from the first chunk's product on
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for i, s, e in _chunks(b, t, spec.rows):
            h = hidden[i, s:e]
            c = _Chunk(
                spec,
                h,
                w,
                bias,
                None if p is None else p[i, s:e],
                None if p_hidden is None else p_hidden[i, s:e],
                p_cols,
            )
            grads = {name: grad_terms[k, i, s:e] for k, name in enumerate(spec.terms)}
            dz = c.grad_z(grads, None if labels is None else labels[i, s:e])
            dz_mm = dz.to(spec.mm_dtype)
            if grad_h is not None:
                grad_h[i, s:e] = (dz_mm @ w).to(hidden.dtype)
            if need_w:
                # In the weight's dtype: the matmul dtype, the weight being autocast's bf16 copy
                # under autocast (head_rows), as a linear layer's backward would; chunks after
                # the first are added by the matmul itself.
                h_mm = h.to(spec.mm_dtype)
                if grad_w is None:
                    grad_w = dz_mm.t() @ h_mm
                else:
                    grad_w.addmm_(dz_mm.t(), h_mm)
            if grad_b is not None:
                grad_b += dz.sum(0)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return None, grad_h, grad_w, grad_b, None, None, None, None, None


def head_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    p: torch.Tensor | None = None,
    p_hidden: torch.Tensor | None = None,
    p_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    p_cols: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    terms: Sequence[str] = ("ce",),
    metrics: Sequence[str] = (),
    temperature: float = 1.0,
    beta: float = 0.5,
    argmax: bool = False,
    argmax_cols: torch.Tensor | None = None,
    topk: int = 0,
    p_argmax: bool = False,
    chunk_rows: int | None = None,
) -> dict[str, torch.Tensor]:
    """Per-row loss terms of the head ``z = hidden Wᵀ (+ bias)``, chunk by chunk (module doc).

    The label is one of: ``p``, dense probabilities; ``p_hidden`` and ``p_head``, whose logits
    (``p_head(p_hidden)``, optionally restricted to the columns ``p_cols``) give p =
    ``softmax(logits / τ)``, recomputed in the backward rather than kept; ``labels``, hard ids
    (for ``nll`` only).

    Args:
        hidden: ``[T, H]`` or ``[B, T, H]`` the head's input (any float dtype).
        weight: ``[V, H]`` the head's weight (trained or frozen).
        bias: ``[V]`` optional.
        p: ``[..., T, V]`` the label's probabilities, aligned with ``hidden``'s rows (kept for the
            backward as given: a view of a label the caller holds costs nothing more).
        p_hidden: ``[..., T, H']`` what ``p_head`` reads (no gradient).
        p_head: ``[r, H'] -> [r, V']`` logits of the label (e.g. the target's lm_head); called
            under the forward's autocast state, in the forward and again in the backward.
        p_cols: ``[V]`` long, the columns of ``p_head``'s logits that make the label.
        labels: ``[..., T]`` long hard labels for ``nll`` (< 0: no label, the row gives 0).
        terms: differentiable per-row terms, from :data:`TERMS`.
        metrics: no-grad per-row values, from :data:`METRICS`.
        temperature: τ of ``q`` and of a ``p_head`` label (``nll`` and ``accept`` use 1).
        beta: ``jsd``'s mixing weight.
        argmax: also return ``argmax`` ``[..., T]`` of z, over ``argmax_cols`` when given
            (returned as those columns' ids).
        argmax_cols: ``[V']`` long column subset for ``argmax``.
        topk: also return ``topk`` ``[..., T, k]`` indices of z (k > 0).
        p_argmax: also return ``p_argmax`` ``[..., T]``, the label head's argmax over all its
            columns (before ``p_cols``).
        chunk_rows: rows per chunk; default :func:`chunk_rows_for` the vocabulary.

    Returns:
        ``{name: [..., T]}`` fp32 for each term (with grad) and metric (without), plus the
        requested ``argmax``/``topk``/``p_argmax`` long tensors.

    Raises:
        ValueError: unknown names, a missing label, or shapes that do not line up.
    """
    terms, metrics = tuple(terms), tuple(metrics)
    bad = [n for n in terms if n not in TERMS] + [n for n in metrics if n not in METRICS]
    if bad:
        raise ValueError(f"unknown head_rows terms/metrics {bad}; terms are {TERMS}")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [T, H] or [B, T, H], got {tuple(hidden.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    label = "p" if p is not None else "head" if p_head is not None else ""
    names = set(terms) | set(metrics)
    soft = names - {"nll"}
    if soft and not label:
        raise ValueError(f"{sorted(soft)} need a label distribution: pass p or p_hidden/p_head")
    if label == "p" and (names & _NEEDS_LOG_P or temperature != 1):
        raise ValueError(
            f"{sorted(names & _NEEDS_LOG_P) or 'a temperature'} needs the label's logits: "
            "pass p_hidden/p_head instead of p"
        )
    if "nll" in names and labels is None:
        raise ValueError("nll needs labels")
    if p_argmax and label != "head":
        raise ValueError("p_argmax needs p_hidden/p_head")
    lead = hidden.dim() - 1
    h3 = _as_3d(hidden, lead)
    p3, ph3, lab3 = _as_3d(p, lead), _as_3d(p_hidden, lead), _as_3d(labels, lead)
    for name, x in (("p", p3), ("p_hidden", ph3), ("labels", lab3)):
        if x is not None and tuple(x.shape[:2]) != tuple(h3.shape[:2]):
            raise ValueError(f"{name} rows {tuple(x.shape[:2])} != hidden's {tuple(h3.shape[:2])}")
    vocab = weight.shape[0]
    ac_kind = hidden.device.type
    spec = _Spec(
        terms=terms,
        metrics=tuple(m for m in metrics if m not in terms),
        temperature=float(temperature),
        beta=float(beta),
        argmax=argmax,
        topk=min(int(topk), vocab),
        p_argmax=p_argmax,
        label=label,
        p_head=p_head,
        mm_dtype=_mm_dtype(hidden, weight),
        rows=chunk_rows or chunk_rows_for(vocab),
        autocast=(
            ac_kind,
            torch.is_autocast_enabled(ac_kind),
            torch.get_autocast_dtype(ac_kind),
        ),
    )
    if argmax_cols is not None:
        argmax_cols = argmax_cols.to(hidden.device)
    if p_cols is not None:
        p_cols = p_cols.to(hidden.device)
    if spec.mm_dtype != weight.dtype and weight.requires_grad and torch.is_grad_enabled():
        # As autocast does for a linear layer: one cast of the weight, part of the graph,
        # shared by every call until the weight changes (an EAGLE-3 unroll's 7 steps). Each
        # call's weight gradient then comes back in bf16, the steps' are summed in bf16 and
        # converted to the weight's fp32 once, by the cast's backward.
        weight = _tracked_cast(weight, spec.mm_dtype)
    outs = _HeadRows.apply(spec, h3, weight, bias, p3, ph3, p_cols, lab3, argmax_cols)
    grads_out, *extras = outs
    result: dict[str, Any] = {}
    for k, name in enumerate(spec.terms):
        result[name] = grads_out[k]
    it = iter(extras)
    if spec.metrics:
        rest = next(it)
        for k, name in enumerate(spec.metrics):
            result[name] = rest[k]
    for name, wanted in (("argmax", argmax), ("topk", spec.topk > 0), ("p_argmax", p_argmax)):
        if wanted:
            result[name] = next(it)
    if lead == 1:
        result = {k: v[0] for k, v in result.items()}
    return result


@torch.no_grad()
def head_argmax(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    chunk_rows: int | None = None,
    vocab: int | None = None,
) -> torch.Tensor:
    """``head(hidden).argmax(-1)`` ``[...]`` computed in row chunks (no ``[T, V]`` at once).

    Args:
        hidden: ``[..., H]`` inputs of the head.
        head: ``[r, H] -> [r, V]`` logits (e.g. the target's lm_head).
        chunk_rows: rows per chunk; default :func:`chunk_rows_for` ``vocab`` (or 256).
        vocab: V, to size the default chunk.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = chunk_rows or (chunk_rows_for(vocab) if vocab else 256)
    parts = [head(flat[s : s + rows]).argmax(-1) for s in range(0, flat.shape[0], rows)]
    out = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=hidden.device)
    return out.reshape(hidden.shape[:-1])
