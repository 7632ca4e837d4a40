"""Per-depth draft losses that target the acceptance rate (LK losses, arXiv 2602.23881).

The feature drafters (EAGLE-3, P-EAGLE, DFlash) learn the target's distribution p at each draft
depth from the drafter's logits. The usual objective is the soft cross-entropy, i.e. forward
KL(p‖q) up to p's entropy. What speculative decoding pays off on is the acceptance rate
``α = Σ_v min(p_v, q_v)`` (Leviathan et al. 2023, Cor. 3.6). KL and α share their optimum, but a
small drafter cannot reach it, and among the distributions it can reach the KL-best is not the
α-best (LK losses, §3). The LK paper trains on α directly:

- ``kl``: soft cross-entropy (the gradient of KL(p‖q)); the default, as before.
- ``tv``: total variation ``1 − α``. Optimises α itself, but its gradient vanishes where p and q
  barely overlap (a cold start).
- ``nla``: negative log-acceptance ``−log α``: TV's target with a ``1/α`` gradient boost, so it
  trains from a cold start (§4.1).
- ``lk_hybrid``: ``λ · KL + (1 − λ) · TV`` with ``λ = exp(−η · ᾱ)``, ``ᾱ`` the mean acceptance of
  the call's supervised positions, detached (§4.2, §4.4: one blend weight per depth and call).
  KL leads while the drafter is poor, TV takes over as α grows; ``η = 3`` as in the paper.

p here is whatever the caller supervises with: for a draft vocabulary, the target's distribution
restricted to it and renormalised (EAGLE-3's label). Every loss is the mean over the masked
positions (0 when none is selected), in fp32 whatever the logits' dtype.

:func:`draft_head_loss` applies the draft head and the loss together in row chunks
(:mod:`.chunked_loss`), keeping no ``[T, V]`` tensor for the backward; :func:`draft_loss` takes
logits (dense); :func:`draft_loss_from_rows` is what both share, on per-position values.
"""

from __future__ import annotations

from typing import Any

import torch

from .chunked_loss import head_rows

__all__ = ["DRAFT_LOSSES", "draft_head_loss", "draft_loss", "draft_loss_from_rows"]

#: The losses :func:`draft_loss` knows (config fields list these as their choices).
DRAFT_LOSSES: tuple[str, ...] = ("kl", "tv", "nla", "lk_hybrid")

# nla's floor of α: log(1e-6) bounds a position's loss at ~13.8 when p and q do not overlap.
_MIN_ALPHA = 1e-6


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where() rather than multiply: a 0 * inf at an unsupervised position would poison the sum.
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1)


def _check_kind(kind: str) -> None:
    if kind not in DRAFT_LOSSES:
        raise ValueError(f"loss must be one of {', '.join(DRAFT_LOSSES)}; got {kind!r}")


def draft_loss_from_rows(
    kind: str,
    ce: torch.Tensor,
    alpha: torch.Tensor,
    mask: torch.Tensor,
    *,
    eta: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft depth's loss from its per-position soft cross-entropy and acceptance rate.

    Args:
        kind: one of :data:`DRAFT_LOSSES`.
        ce: ``[B, T]`` per-position ``−Σ p log q`` (with grad where the loss reads it).
        alpha: ``[B, T]`` per-position ``Σ min(p, q)`` (with grad unless ``kind`` is ``kl``).
        mask: ``[B, T]`` bool, the supervised positions.
        eta: ``lk_hybrid``'s decay of the KL weight with the mean acceptance (0: pure KL).

    Returns:
        As :func:`draft_loss`.

    Raises:
        ValueError: an unknown ``kind``.
    """
    _check_kind(kind)
    ce_mean = _masked_mean(ce, mask)
    mean_alpha = _masked_mean(alpha, mask)
    if kind == "kl":
        loss = ce_mean
    elif kind == "tv":
        loss = 1.0 - mean_alpha
    elif kind == "nla":
        loss = _masked_mean(-torch.log(alpha.clamp_min(_MIN_ALPHA)), mask)
    else:  # lk_hybrid
        lam = torch.exp(-eta * mean_alpha.detach())
        loss = lam * ce_mean + (1.0 - lam) * (1.0 - mean_alpha)
    return loss, ce_mean.detach(), mean_alpha.detach()


def draft_loss(
    kind: str,
    logits: torch.Tensor,
    p: torch.Tensor,
    mask: torch.Tensor,
    *,
    eta: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft depth's loss, its soft cross-entropy and its acceptance rate, from logits.

    The dense form: autograd keeps the ``[B, T, V]`` fp32 log-softmax for the backward. A
    training step applies the head and this loss together with :func:`draft_head_loss`
    instead, which keeps no ``[T, V]`` tensor.

    Args:
        kind: one of :data:`DRAFT_LOSSES`.
        logits: ``[B, T, V]`` draft logits.
        p: ``[B, T, V]`` the target's distribution over the same vocabulary.
        mask: ``[B, T]`` bool, the supervised positions.
        eta: ``lk_hybrid``'s decay of the KL weight with the mean acceptance (0: pure KL).

    Returns:
        ``(loss, ce, alpha)``: the loss to minimise (0-dim, with grad), and, detached, the mean
        soft cross-entropy and the mean acceptance rate ``α = Σ min(p, q)`` over the masked
        positions (the metrics every kind reports).

    Raises:
        ValueError: an unknown ``kind``.
    """
    _check_kind(kind)
    p = p.float()
    log_q = torch.log_softmax(logits.float(), dim=-1)
    ce = -(p * log_q).sum(-1)
    if kind == "kl":
        with torch.no_grad():  # a metric only: no graph kept for it until the backward
            alpha = torch.minimum(p, log_q.detach().exp()).sum(-1)  # [B, T]
    else:
        alpha = torch.minimum(p, log_q.exp()).sum(-1)
    return draft_loss_from_rows(kind, ce, alpha, mask, eta=eta)


def draft_head_loss(
    kind: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    mask: torch.Tensor,
    *,
    eta: float = 3.0,
    chunk_rows: int | None = None,
    **label: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`draft_loss` of the head ``hidden Wᵀ``, applied chunk by chunk with the loss.

    Same values and gradients as ``draft_loss(kind, hidden @ weight.T, p, mask)``; nothing of
    size ``[T, V]`` is kept for the backward (:func:`~.chunked_loss.head_rows`).

    Args:
        kind: one of :data:`DRAFT_LOSSES`.
        hidden: ``[B, T, H]`` (or ``[T, H]``) the head's input.
        weight: ``[V, H]`` the head's weight.
        mask: ``[B, T]`` (or ``[T]``) bool, the supervised positions.
        eta: ``lk_hybrid``'s decay of the KL weight.
        chunk_rows: rows per chunk (default: about 2^23 / V).
        **label: the label and extra outputs, as :func:`~.chunked_loss.head_rows` takes them:
            ``p`` (dense probabilities) or ``p_hidden``/``p_head``/``p_cols``, and ``argmax``,
            ``argmax_cols``, ``topk``, ``p_argmax``, ``metrics``.

    Returns:
        ``(loss, ce, alpha, rows)``: as :func:`draft_loss`, plus :func:`head_rows`' per-row
        outputs (``ce``, ``alpha`` ``[B, T]`` and whatever else was asked for).
    """
    _check_kind(kind)
    grad = {"kl": ("ce",), "tv": ("alpha",), "nla": ("alpha",), "lk_hybrid": ("ce", "alpha")}
    terms = grad[kind]
    extra = tuple(label.pop("metrics", ()))
    metrics = tuple(n for n in ("ce", "alpha") if n not in terms) + extra
    rows = head_rows(hidden, weight, terms=terms, metrics=metrics, chunk_rows=chunk_rows, **label)
    loss, ce, alpha = draft_loss_from_rows(kind, rows["ce"], rows["alpha"], mask, eta=eta)
    return loss, ce, alpha, rows
