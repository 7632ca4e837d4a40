"""Token-level distillation losses between a target (p) and a draft (q), and the acceptance rate.

Why these losses (DistillSpec, Zhou et al. 2024, §3-4): with speculative sampling the draft token
is accepted with probability min(1, p/q), so the expected acceptance rate at one position is
``β = Σ_v min(p_v, q_v) = 1 − TVD(p, q)`` (Leviathan et al. 2023, Thm. 3.5 / Cor. 3.6). Total
variation distance is therefore the quantity acceptance depends on; forward KL, reverse KL and
the generalised JSD are smoother surrogates whose best choice depends on the task and the
decoding strategy (DistillSpec Fig. 4). Greedy decoding accepts a token iff the argmaxes agree
(:func:`greedy_agreement`).

Conventions:

* ``p`` is always the target's distribution, ``q`` the draft's; both come as logits of the same
  shape ``[..., V]`` (any leading dims, e.g. ``[B, T, V]`` or ``[N, V]``).
* ``temperature`` τ divides both sets of logits before the softmax (Hinton et al. 2015). The
  losses are not rescaled by τ²: mixes with cross-entropy use an explicit ``ce_weight`` instead.
* ``mask`` (same leading shape, 0/1 or bool) selects the positions that count; every loss is the
  mean of the per-position value over the selected positions (0 when none is selected).
* All arithmetic is in float32 whatever the logits' dtype (bf16 softmaxes over 49k tokens lose
  the small probabilities the KLs weigh).

:func:`distill_loss` takes both sides' logits (``[N, V]``: autograd keeps fp32 ``[N, V]``
log-probabilities for the backward); :func:`distill_head_loss` is the same loss applied with the
draft's lm_head in row chunks (:mod:`.chunked_loss`), keeping no ``[N, V]`` tensor.

Which positions to supervise: ``loss_mask[t] == 1`` (``train/data/chat.py``) means token ``t`` is a
training target, predicted by the logits at position ``t − 1``. :func:`prediction_mask` does that
shift once, so callers never slice logits by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...heads.base import unwrap_model
from ...heads.draft_lm import LossHead
from ..features.source import run_target
from .chunked_loss import head_rows

__all__ = [
    "LOSSES",
    "cross_entropy",
    "distill_batch_loss",
    "distill_head_loss",
    "distill_loss",
    "expected_acceptance",
    "forward_kl",
    "greedy_agreement",
    "jsd",
    "prediction_mask",
    "reverse_kl",
    "total_variation",
]

#: Loss names accepted by :func:`distill_loss` (and the recipe's ``loss`` field).
LOSSES: tuple[str, ...] = ("fkl", "rkl", "tvd", "jsd", "lk_hybrid")


def prediction_mask(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions whose logits predict a supervised token, and the tokens they predict.

    Args:
        input_ids: ``[B, T]`` token ids.
        loss_mask: ``[B, T]`` 1 where the token is a training target (assistant tokens).
        attention_mask: ``[B, T]`` 1 on real tokens, 0 on padding (None: all real).

    Returns:
        ``(keep, labels)``: ``keep [B, T]`` bool, True at position ``t`` when token ``t + 1`` is
        supervised and real (so the last position is never kept); ``labels [N]`` long, the token
        each kept position must predict, in row-major order of ``keep`` (``N = keep.sum()``). Pass
        ``keep`` as ``logits_to_keep`` to an HF causal LM to get exactly these ``[N, V]`` logits.
    """
    target = loss_mask[:, 1:].bool()
    if attention_mask is not None:
        target = target & attention_mask[:, 1:].bool()
    keep = torch.zeros_like(input_ids, dtype=torch.bool)
    keep[:, :-1] = target
    return keep, input_ids[:, 1:][target]


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[..., V]`` logits -> ``[..., V]`` float32 log-probabilities at ``temperature``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return F.log_softmax(logits.float() / temperature, dim=-1)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``values [...]`` over positions where ``mask [...]`` is set (0 if none is)."""
    if mask is None:
        return values.mean()
    if mask.shape != values.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} != per-position shape {tuple(values.shape)}"
        )
    m = mask.to(values.dtype)
    # max(count, 1): an all-masked batch gives 0 and still a graph, so backward() is safe.
    return (values * m).sum() / m.sum().clamp(min=1.0)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """Per-position KL(a ‖ b) = Σ_v a_v (log a_v − log b_v): ``[..., V]`` -> ``[...]``."""
    # xlogy-style: a_v = 0 contributes 0 even where log b_v = -inf (masked vocab entries).
    # The where() sits inside the product so its gradient stays finite too.
    a = log_a.exp()
    return (a * torch.where(a > 0, log_a - log_b, torch.zeros_like(a))).sum(-1)


def forward_kl(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Forward KL(p ‖ q), mean over masked positions (mode-covering: q spreads over p's support).

    Args:
        p_logits: ``[..., V]`` target logits.
        q_logits: ``[..., V]`` draft logits.
        mask: ``[...]`` positions to average over (None: all).
        temperature: softmax temperature applied to both.

    Returns:
        Scalar tensor.
    """
    return _masked_mean(
        _kl(_log_probs(p_logits, temperature), _log_probs(q_logits, temperature)), mask
    )


def reverse_kl(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Reverse KL(q ‖ p), mean over masked positions (mode-seeking: q concentrates on p's modes).

    Args:
        p_logits: ``[..., V]`` target logits.
        q_logits: ``[..., V]`` draft logits.
        mask: ``[...]`` positions to average over (None: all).
        temperature: softmax temperature applied to both.

    Returns:
        Scalar tensor.
    """
    return _masked_mean(
        _kl(_log_probs(q_logits, temperature), _log_probs(p_logits, temperature)), mask
    )


def total_variation(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Total variation distance ½ Σ_v |p_v − q_v| = 1 − Σ_v min(p_v, q_v), mean over positions.

    Minimising it maximises the expected acceptance rate directly (DistillSpec §3).

    Args:
        p_logits: ``[..., V]`` target logits.
        q_logits: ``[..., V]`` draft logits.
        mask: ``[...]`` positions to average over (None: all).
        temperature: softmax temperature applied to both.

    Returns:
        Scalar tensor in [0, 1].
    """
    p = _log_probs(p_logits, temperature).exp()
    q = _log_probs(q_logits, temperature).exp()
    return _masked_mean(0.5 * (p - q).abs().sum(-1), mask)


def jsd(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence, mean over masked positions.

    ``JSD_β(p ‖ q) = β KL(p ‖ m) + (1 − β) KL(q ‖ m)`` with ``m = β p + (1 − β) q`` (GKD, Agarwal
    et al. 2024, Eq. 2; DistillSpec Table 1). β = 0.5 is the symmetric JSD, bounded by ln 2.

    Args:
        p_logits: ``[..., V]`` target logits.
        q_logits: ``[..., V]`` draft logits.
        mask: ``[...]`` positions to average over (None: all).
        beta: mixing weight in (0, 1).
        temperature: softmax temperature applied to both.

    Returns:
        Scalar tensor.
    """
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    log_p = _log_probs(p_logits, temperature)
    log_q = _log_probs(q_logits, temperature)
    # log m computed in log space: the mixture of two tiny probabilities stays finite.
    log_m = torch.logsumexp(
        torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0
    )
    per_pos = beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)
    return _masked_mean(per_pos, mask)


def cross_entropy(
    q_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy of the draft on the data's tokens, mean over masked positions.

    Args:
        q_logits: ``[..., V]`` draft logits.
        labels: ``[...]`` long, the token each position should predict.
        mask: ``[...]`` positions to average over (None: all).

    Returns:
        Scalar tensor.
    """
    log_q = _log_probs(q_logits, 1.0)
    nll = -log_q.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return _masked_mean(nll, mask)


@torch.no_grad()
def expected_acceptance(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Expected speculative-sampling acceptance rate, mean over masked positions of Σ_v min(p, q).

    This is β of Leviathan et al. 2023 (Def. 3.1) measured on teacher-forced positions: the
    chance that one draft token sampled from q is accepted by a target sampling from p.

    Args:
        p_logits: ``[..., V]`` target logits.
        q_logits: ``[..., V]`` draft logits.
        mask: ``[...]`` positions to average over (None: all).
        temperature: sampling temperature of both models.

    Returns:
        Scalar tensor in [0, 1].
    """
    p = _log_probs(p_logits, temperature).exp()
    q = _log_probs(q_logits, temperature).exp()
    return _masked_mean(torch.minimum(p, q).sum(-1), mask)


@torch.no_grad()
def greedy_agreement(
    p_logits: torch.Tensor, q_logits: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Share of masked positions where the draft's argmax equals the target's.

    Greedy speculative decoding accepts a draft token iff this holds, so it is the greedy
    counterpart of :func:`expected_acceptance` (teacher-forced).

    Args:
        p_logits: ``[..., V]`` target logits.
        q_logits: ``[..., V]`` draft logits.
        mask: ``[...]`` positions to average over (None: all).

    Returns:
        Scalar tensor in [0, 1].
    """
    same = (p_logits.argmax(-1) == q_logits.argmax(-1)).float()
    return _masked_mean(same, mask)


def distill_loss(
    kind: str,
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    labels: torch.Tensor | None = None,
    ce_weight: float = 0.0,
    temperature: float = 1.0,
    beta: float = 0.5,
    eta: float = 3.0,
) -> torch.Tensor:
    """The training loss: ``(1 − ce_weight) · D(p, q) + ce_weight · CE(q, labels)``.

    Args:
        kind: divergence D, one of :data:`LOSSES`: ``fkl`` (KL(p‖q)), ``rkl`` (KL(q‖p)),
            ``tvd`` (total variation), ``jsd`` (generalised JSD with ``beta``), ``lk_hybrid``
            (``λ · KL(p‖q) + (1 − λ) · TVD`` with ``λ = exp(−η · ᾱ)``, ``ᾱ = 1 − TVD`` the mean
            acceptance rate, detached: the LK losses' hybrid, arXiv 2602.23881 §4.2, the same
            blend as the EAGLE recipes' ``loss: lk_hybrid``).
        p_logits: ``[..., V]`` target logits.
        q_logits: ``[..., V]`` draft logits.
        mask: ``[...]`` positions to average over (None: all).
        labels: ``[...]`` data tokens for the cross-entropy term; required when ``ce_weight > 0``.
        ce_weight: weight of the cross-entropy on the data labels, in [0, 1].
        temperature: softmax temperature of the divergence (the cross-entropy uses 1).
        beta: JSD mixing weight.
        eta: ``lk_hybrid``'s decay of the KL weight with the acceptance rate (0: pure KL).

    Returns:
        Scalar tensor.
    """
    if kind not in LOSSES:
        raise ValueError(f"unknown loss {kind!r}; expected one of {list(LOSSES)}")
    if not 0 <= ce_weight <= 1:
        raise ValueError(f"ce_weight must be in [0, 1], got {ce_weight}")
    if ce_weight > 0 and labels is None:
        raise ValueError("ce_weight > 0 needs labels")
    loss = q_logits.new_zeros((), dtype=torch.float32)
    if ce_weight < 1:
        if kind == "fkl":
            d = forward_kl(p_logits, q_logits, mask, temperature=temperature)
        elif kind == "rkl":
            d = reverse_kl(p_logits, q_logits, mask, temperature=temperature)
        elif kind == "tvd":
            d = total_variation(p_logits, q_logits, mask, temperature=temperature)
        elif kind == "lk_hybrid":
            # KL leads while the draft is poor (TV's gradient vanishes where p and q barely
            # overlap); TV, i.e. 1 − acceptance itself, takes over as the acceptance grows.
            # One log-softmax of each side serves both terms (each is [N, V]: the cost here).
            log_p = _log_probs(p_logits, temperature)
            log_q = _log_probs(q_logits, temperature)
            kl = _masked_mean(_kl(log_p, log_q), mask)
            tv = _masked_mean(0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1), mask)
            lam = torch.exp(-eta * (1.0 - tv.detach()))
            d = lam * kl + (1.0 - lam) * tv
        else:
            d = jsd(p_logits, q_logits, mask, beta=beta, temperature=temperature)
        loss = loss + (1 - ce_weight) * d
    if ce_weight > 0:
        loss = loss + ce_weight * cross_entropy(q_logits, labels, mask)
    return loss


# distill_loss's divergence -> the per-row terms of head_rows it is built from.
_DIVERGENCE_TERMS = {
    "fkl": ("fkl",),
    "rkl": ("rkl",),
    "tvd": ("tv",),
    "jsd": ("jsd",),
    "lk_hybrid": ("fkl", "tv"),
}


def distill_head_loss(
    kind: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    p_hidden: torch.Tensor,
    p_head: Callable[[torch.Tensor], torch.Tensor],
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    ce_weight: float = 0.0,
    temperature: float = 1.0,
    beta: float = 0.5,
    eta: float = 3.0,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`distill_loss` of the draft head ``hidden Wᵀ`` and the target head on ``p_hidden``.

    The same value and gradients as ``distill_loss(kind, p_head(p_hidden), hidden @ weight.T,
    mask, ...)``, computed in row chunks (:func:`~.chunked_loss.head_rows`): neither side's
    ``[N, V]`` logits or log-probabilities are kept for the backward, which recomputes a
    chunk's p from ``p_hidden`` (the target's head is frozen and whole on every rank).
    Call it where the draft's head weight is gathered (inside the draft's forward under FSDP:
    :class:`~draftsmith.heads.draft_lm.LossHead`).

    Args:
        kind: divergence, one of :data:`LOSSES`.
        hidden: ``[..., H]`` the draft's final normed hidden states at the supervised
            positions (e.g. ``[N, H]``).
        weight: ``[V, H]`` the draft's lm_head weight.
        p_hidden: ``[..., H']`` the target's final normed hidden states at the same positions.
        p_head: the target's lm_head (``[r, H'] -> [r, V]``), called without gradients.
        mask: ``[...]`` positions to average over (None: all).
        bias: the draft head's bias, if any.
        labels: ``[...]`` data tokens for the cross-entropy term (``ce_weight > 0``).
        ce_weight: weight of the cross-entropy on the data labels, in [0, 1].
        temperature: softmax temperature of the divergence (the cross-entropy uses 1).
        beta: JSD mixing weight.
        eta: ``lk_hybrid``'s decay of the KL weight with the acceptance rate.
        chunk_rows: rows per chunk (default: about 2^23 / V).

    Returns:
        ``(loss, metrics)``: the scalar loss, and detached means over the masked positions:
        ``expected_acceptance`` (:func:`expected_acceptance` at temperature 1) and
        ``greedy_agreement`` (:func:`greedy_agreement`).
    """
    if kind not in LOSSES:
        raise ValueError(f"unknown loss {kind!r}; expected one of {list(LOSSES)}")
    if not 0 <= ce_weight <= 1:
        raise ValueError(f"ce_weight must be in [0, 1], got {ce_weight}")
    if ce_weight > 0 and labels is None:
        raise ValueError("ce_weight > 0 needs labels")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    terms = (_DIVERGENCE_TERMS[kind] if ce_weight < 1 else ()) + (("nll",) if ce_weight > 0 else ())
    rows = head_rows(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias=bias,
        p_hidden=p_hidden.reshape(-1, p_hidden.shape[-1]),
        p_head=p_head,
        labels=None if labels is None else labels.reshape(-1),
        terms=terms,
        metrics=("accept",),
        temperature=temperature,
        beta=beta,
        argmax=True,
        p_argmax=True,
        chunk_rows=chunk_rows,
    )
    lead = hidden.shape[:-1]
    rows = {k: v.reshape(lead) for k, v in rows.items()}
    loss = hidden.new_zeros((), dtype=torch.float32)
    if ce_weight < 1:
        if kind == "lk_hybrid":
            # As distill_loss: KL leads while the draft is poor, TV takes over as α grows.
            kl = _masked_mean(rows["fkl"], mask)
            tv = _masked_mean(rows["tv"], mask)
            lam = torch.exp(-eta * (1.0 - tv.detach()))
            d = lam * kl + (1.0 - lam) * tv
        else:
            d = _masked_mean(rows[_DIVERGENCE_TERMS[kind][0]], mask)
        loss = loss + (1 - ce_weight) * d
    if ce_weight > 0:
        loss = loss + ce_weight * _masked_mean(rows["nll"], mask)
    with torch.no_grad():
        metrics = {
            "expected_acceptance": _masked_mean(rows["accept"], mask),
            "greedy_agreement": _masked_mean((rows["argmax"] == rows["p_argmax"]).float(), mask),
        }
    return loss, metrics


def distill_batch_loss(
    draft: torch.nn.Module,
    target: torch.nn.Module,
    batch: dict,
    kind: str,
    *,
    ce_weight: float = 0.0,
    temperature: float = 1.0,
    beta: float = 0.5,
    eta: float = 3.0,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One batch's distillation loss, the draft's head applied with it inside its forward.

    The chunked counterpart of ``distill_loss(kind, p, q, labels=...)`` on the supervised
    positions' logits (:func:`prediction_mask`): the target contributes its final normed hidden
    states there (from the batch's ``hidden_states`` when an offline cache supplies them, else
    from a no-grad forward) and its lm_head, the draft its hidden states, and
    :func:`distill_head_loss` runs inside the draft's forward through its
    :class:`~draftsmith.heads.draft_lm.LossHead` (FSDP gathers the head's weight there).

    Args:
        draft: the draft causal LM (or its DDP/FSDP wrapper), with
            :func:`~draftsmith.heads.draft_lm.install_loss_head` applied.
        target: the frozen target (its lm_head whole, as ``place_target`` leaves it).
        batch: ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, T]``, optionally
            ``hidden_states {L: [B, T, H]}`` (the target's final layer).
        kind, ce_weight, temperature, beta, eta, chunk_rows: as :func:`distill_head_loss`.

    Returns:
        As :func:`distill_head_loss`.

    Raises:
        ValueError: the draft has no :class:`LossHead`.
    """
    head = unwrap_model(draft).get_output_embeddings()
    if not isinstance(head, LossHead):
        raise ValueError("distill_batch_loss: install_loss_head(draft) before preparing it")
    keep, labels = prediction_mask(batch["input_ids"], batch["loss_mask"], batch["attention_mask"])
    p_head = target.get_output_embeddings()
    with torch.no_grad():
        hidden = batch.get("hidden_states")
        if hidden:
            (final,) = hidden.values()  # the cache's one layer: the last, after the final norm
        else:
            # Only the final normed state (hooks: no other layer kept, no logits): the labels'
            # logits come from it below, in chunks.
            n = unwrap_model(target).config.num_hidden_layers
            final = run_target(target, batch["input_ids"], batch["attention_mask"], [n])[n]
        p_hidden = final[keep].to(p_head.weight.dtype)

    def loss_fn(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        if h.dim() == 3 and h.shape[:2] == keep.shape:  # a model without mask support
            h = h[keep]
        return distill_head_loss(
            kind,
            h,
            weight,
            p_hidden,
            p_head,
            bias=bias,
            labels=labels,
            ce_weight=ce_weight,
            temperature=temperature,
            beta=beta,
            eta=eta,
            chunk_rows=chunk_rows,
        )

    with head.computing(loss_fn):
        out = draft(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            logits_to_keep=keep,
            use_cache=False,
        )
    return out.logits
