"""Training losses for EAGLE drafters: EAGLE-1 feature regression and EAGLE-3 training-time test.

Alignment (shared with :mod:`draftsmith.heads.eagle`): drafter position t reads the target
feature ``f_t`` and the embedding of the next token ``x_{t+1}`` and predicts ``f_{t+1}``, whose
head gives the distribution of ``x_{t+2}``. ``loss_mask[i] = 1`` marks assistant tokens, so
position t is supervised iff the token it predicts, ``x_{t+2}``, is an assistant token:
``mask[t] = loss_mask[t + 2]``. In EAGLE-3's training-time test, step j predicts ``x_{t+2+j}``
from position t, so its mask is ``loss_mask[t + 2 + j]``.

The target's distribution comes from the target's own head applied to its final normed hidden
state (HF ``hidden_states[N]``), which both losses take from ``batch["hidden_states"][N]``
(:attr:`draftsmith.heads.eagle.EagleConfig.train_layers` includes N).

Batches are those of :func:`draftsmith.train.features.source.feature_source` (right-padded):
``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, T]`` and
``hidden_states {layer: [B, T, H]}``.
Both functions accept the drafter bare or inside a DDP/accelerate wrapper; every drafter
parameter is used inside ``drafter(...)`` calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...heads.attention import TTTKeys
from ...heads.base import unwrap_model
from ...heads.vocab_maps import vocab_target_ids
from .acceptance import draft_head_loss
from .chunked_loss import head_rows

__all__ = [
    "eagle1_loss",
    "eagle3_ttt_loss",
    "shift_left",
    "target_distribution",
    "ttt_attention_mask",
]


def shift_left(x: torch.Tensor, n: int, fill: float | int = 0) -> torch.Tensor:
    """``out[:, t] = x[:, t + n]``, padded with ``fill`` at the end (dim 1 is time)."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_attention_mask(
    seq_len: int,
    step: int,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Training-time-test attention mask of step ``step`` (EAGLE-3 §3.3, HASS): the layout.

    Training does not build it: :class:`~draftsmith.heads.attention.TTTKeys` computes the same
    attention with a fused causal kernel plus one score per earlier step (memory linear in T x
    steps, where this mask is ``[T, (j + 1) T]``). It stays as the written-out reference the
    tests compare that path with.

    Keys are laid out as ``step + 1`` blocks of ``seq_len``: block 0 holds the keys computed from
    the target features (step 0), block i the keys of step i. A step-j query at position t sees
    the step-0 keys at positions ``<= t`` (the verified context) and, in blocks 1..j, only the
    key at its own position t: at inference, those are the drafter's earlier draft steps along
    the same chain.

    Keys at padding positions (``attention_mask == 0``) are hidden. A query with nothing left
    to see (a left-padded query) is given its own step-0 key so attention stays finite; such
    positions are never supervised.

    Args:
        seq_len: T.
        step: j >= 0.
        attention_mask: ``[B, T]`` 1 = real token, or None (no padding).
        device: where to build the mask (default: ``attention_mask``'s device).

    Returns:
        bool ``[B, 1, T, (j + 1) * T]`` (B = 1 without ``attention_mask``), True = attend.
    """
    if device is None and attention_mask is not None:
        device = attention_mask.device
    t = seq_len
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    mask = torch.cat([causal] + [eye] * step, dim=1)[None, None]  # [1, 1, T, (j+1)T]
    if attention_mask is not None:
        valid = attention_mask.to(device=device, dtype=torch.bool)  # [B, T]
        mask = mask & valid.repeat(1, step + 1)[:, None, None, :]
        empty = ~mask.any(dim=-1, keepdim=True)  # [B, 1, T, 1]
        own = torch.cat([eye] + [torch.zeros_like(eye)] * step, dim=1)[None, None]
        mask = mask | (empty & own)
    return mask


@torch.no_grad()
def target_distribution(
    final_hidden: torch.Tensor,
    target_lm_head: nn.Module,
    t2d: torch.Tensor | None = None,
    chunk: int = 1024,
    rows: torch.Tensor | None = None,
    vocab_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token distribution and argmax from its final normed hidden states.

    Computed in chunks of ``chunk`` positions so the full ``[B, T, V]`` logits never exist at
    once (V is 49k-150k for real targets).

    Args:
        final_hidden: ``[B, T, H]`` the target's ``hidden_states[N]``.
        target_lm_head: the target's output head.
        t2d: EAGLE-3 ``[V]`` bool: restrict (and renormalise) the distribution to the draft
            vocab. None: the full vocab. Finding its True entries waits for the device; a
            training step passes ``vocab_ids`` instead.
        chunk: positions per head call.
        rows: optional ``[B, T]`` bool: compute only these positions (the ones some loss term
            reads). The full-vocab head runs over B*T*V*H multiply-adds, ~10 % of an EAGLE-3
            training step at SmolLM2's 49k vocab; prompt tokens and padding need none of it.
            Other positions get all-zero probabilities and argmax -1. Sizing the selection is
            one host sync.
        vocab_ids: EAGLE-3, instead of ``t2d``: ``[V_draft]`` long, the target ids of the draft
            vocab in draft order (``arange(V_draft) + d2t``, which lists ``t2d``'s True ids in
            ascending order): the same distribution, gathered without a host sync.

    Returns:
        ``(probs [B, T, V or V_draft] float32, argmax [B, T] long)``: the target's greedy token
        over the full vocab, as a target id. With a draft vocabulary, -1 where a token outside it
        scores higher (no draft can match there); a tie between a token inside and one outside
        goes to the inside one.
    """
    w = target_lm_head.weight
    b, t, _ = final_hidden.shape
    if vocab_ids is None and t2d is not None:
        vocab_ids = t2d.to(w.device).nonzero().flatten()  # sync: the draft vocab's ids
    where = None
    hidden = final_hidden
    if rows is not None:
        # sync: the number of selected rows sizes the head's input (once; reused to scatter).
        where = rows.to(final_hidden.device).nonzero(as_tuple=True)
        hidden = final_hidden[where][None]
    if vocab_ids is not None:
        vocab_ids = vocab_ids.to(w.device)
    probs, argmax = [], []
    for s in range(0, hidden.shape[1], chunk):
        logits = target_lm_head(hidden[:, s : s + chunk].to(device=w.device, dtype=w.dtype))
        if vocab_ids is None:
            logits = logits.float()
            argmax.append(logits.argmax(-1))
            probs.append(torch.softmax(logits, dim=-1))
            continue
        # The draft vocabulary's columns are gathered before the upcast, and the full vocab is
        # only reduced to its top logit in the head's dtype: upcasting and scanning all V
        # columns cost as much as the head itself (SmolLM2, 460 rows x 49,152, one CPU thread:
        # 150 ms -> 100 ms a call, ~5 % of an EAGLE-3 training step).
        draft = logits.index_select(-1, vocab_ids).float()  # the upcast is exact
        top_in, best = draft.max(-1)
        outside = logits.amax(-1).float() > top_in
        argmax.append(torch.where(outside, -1, vocab_ids[best]))
        probs.append(torch.softmax(draft, dim=-1))
    width = vocab_ids.numel() if vocab_ids is not None else w.shape[0]  # shapes: no sync
    if not probs:  # nothing to compute (no row selected)
        probs = [torch.zeros(1, 0, width, device=w.device)]
        argmax = [torch.zeros(1, 0, dtype=torch.long, device=w.device)]
    p, a = torch.cat(probs, dim=1), torch.cat(argmax, dim=1)
    if where is None:
        return p, a
    # Scatter the selected rows back to [B, T]: labels are sliced by position below.
    where = tuple(i.to(p.device) for i in where)
    full_p = p.new_zeros(b, t, width)
    full_a = a.new_full((b, t), -1)
    full_p[where] = p[0]
    full_a[where] = a[0]
    return full_p, full_a


def _entropy(p: torch.Tensor) -> torch.Tensor:
    """Per-position entropy ``[B, T]`` (the floor of the soft cross-entropy)."""
    return -(p * p.clamp_min(1e-30).log()).sum(-1)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where() rather than multiply: unsupervised positions may hold inf/nan-free garbage, but a
    # 0 * inf would still poison the sum.
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1)


def _batch_tensors(batch: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, ...]:
    ids = batch["input_ids"].to(device)
    attn = batch.get("attention_mask")
    attn = torch.ones_like(ids) if attn is None else attn.to(device)
    loss_mask = batch["loss_mask"].to(device)
    return ids, attn, loss_mask


def eagle1_loss(
    drafter: nn.Module,
    batch: dict[str, Any],
    target_lm_head: nn.Module | None = None,
    *,
    noise: float = 0.2,
    feature_weight: float = 1.0,
    token_weight: float = 0.1,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """EAGLE-1 loss (EAGLE §4): SmoothL1 on the next feature + 0.1 x soft cross-entropy.

    ``L = feature_weight * SmoothL1(h_t, f_{t+1}) + token_weight * CE(p_t, softmax(head(h_t)))``
    with ``p_t = softmax(head(f_{t+1}))`` the target's distribution of ``x_{t+2}``; both terms
    are averaged over the supervised positions (``loss_mask[t + 2]``).

    Noise augmentation (EAGLE §4, "data augmentation"): input features get ``U(-noise/2,
    noise/2)`` added when ``noise > 0`` (the paper's U(-0.1, 0.1) at the default 0.2). The
    SafeAILab reference additionally scales the amplitude by ``512 / seq_len``; we do not.
    Pass ``noise=0`` for evaluation.

    Args:
        drafter: an EAGLE-1 :class:`~draftsmith.heads.eagle_model.EagleDrafter` (or a wrapper).
        batch: ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, T]`` and
            ``hidden_states[N]`` ``[B, T, H]``.
        target_lm_head: the target's head (default: the one the drafter shares).
        noise: width of the uniform input noise.
        feature_weight: weight of the feature regression (EAGLE: 1.0).
        token_weight: weight of the token cross-entropy (EAGLE: 0.1).
        generator: randomness for the noise.

    Returns:
        ``(loss, metrics)``; metrics (detached 0-dim tensors): ``loss``, ``feature_loss``,
        ``token_loss``, ``token_kl`` (token_loss minus the target's entropy: 0 when the
        drafter's distribution equals the target's), ``acc`` (draft argmax == target argmax),
        ``tokens`` (supervised count).
    """
    core = unwrap_model(drafter)
    cfg = core.config
    if cfg.version != 1:
        raise ValueError("eagle1_loss is for EAGLE-1 drafters; use eagle3_ttt_loss for EAGLE-3")
    head = target_lm_head if target_lm_head is not None else core.shared.lm_head
    dev = core.device
    ids, attn, loss_mask = _batch_tensors(batch, dev)
    feats = batch["hidden_states"][cfg.target_num_layers].to(device=dev, dtype=core.dtype)
    b, t = ids.shape
    if t < 3:
        raise ValueError(f"sequences must have >= 3 tokens to supervise anything, got {t}")

    # Position t in [0, T-2]: input (f_t, x_{t+1}), target f_{t+1}, supervised iff x_{t+2} is.
    inp = feats[:, :-1]
    if noise > 0:
        u = torch.rand(inp.shape, generator=generator, device="cpu" if generator else dev)
        inp = inp + (u.to(dev, inp.dtype) - 0.5) * noise
    target_feat = feats[:, 1:].detach()
    mask = shift_left(loss_mask * attn, 2)[:, :-1] > 0  # [B, T-1]
    emb = core.embed(ids[:, 1:])
    pos = torch.arange(t - 1, device=dev)[None].expand(b, -1)
    # Causal attention, no mask: right padding keeps padded keys after every real query.
    pred, _ = drafter(emb, inp, pos, cache=TTTKeys())

    feature_loss = _masked_mean(
        F.smooth_l1_loss(pred.float(), target_feat.float(), reduction="none").mean(-1), mask
    )
    # The token term: the target's head on the predicted feature against its distribution at
    # the true next feature, both over the full vocabulary (49k-152k), applied with the loss in
    # row chunks (head_rows): neither the [B, T, V] label nor the draft's log-probabilities
    # exist whole, and the label is recomputed in the backward from the [B, T, H] feature.
    w = head.weight
    drafted_ids = None
    if getattr(core, "has_vocab_maps", False):
        # A draft vocabulary: the drafter drafts the argmax over its rows only, so the
        # accuracy (and the simulated τ from it) is that token's. The cross-entropy stays over
        # the full head: it shapes the feature, and the head is the target's.
        drafted_ids = vocab_target_ids(core.d2t).to(w.device)
    rows = head_rows(
        pred,
        w,
        bias=getattr(head, "bias", None),
        p_hidden=target_feat,
        p_head=lambda x: head(x.to(device=w.device, dtype=w.dtype)),
        terms=("ce",),
        metrics=("p_entropy",),
        argmax=True,
        argmax_cols=drafted_ids,
        p_argmax=True,
    )
    token_loss = _masked_mean(rows["ce"], mask)
    loss = feature_weight * feature_loss + token_weight * token_loss
    with torch.no_grad():
        hit = rows["argmax"] == rows["p_argmax"]
        acc = _masked_mean(hit.float(), mask)
        token_kl = token_loss.detach() - _masked_mean(rows["p_entropy"], mask)
    metrics = {
        "loss": loss.detach(),
        "feature_loss": feature_loss.detach(),
        "token_loss": token_loss.detach(),
        "token_kl": token_kl,
        "acc": acc,
        "tokens": mask.sum(),
    }
    return loss, metrics


def _ttt_head_loss(
    kind: str, n: int, p: torch.Tensor, mask: torch.Tensor, eta: float
) -> Callable[[torch.Tensor, torch.Tensor], tuple[Any, ...]]:
    """One TTT step's ``head_fn`` (:meth:`EagleDrafter.forward`): head and loss in row chunks.

    Called inside the drafter's forward with the head's input ``[B, T, H]`` and weight, so
    FSDP has the weight gathered; returns :func:`~.acceptance.draft_head_loss`'s ``(loss, ce,
    alpha, rows)`` for the first ``n`` positions, ``rows["argmax"]`` the draft argmax (draft
    ids). No ``[B, T, V_draft]`` logits or log-probabilities are kept for the backward.
    """

    def head_fn(head_in: torch.Tensor, weight: torch.Tensor) -> tuple[Any, ...]:
        return draft_head_loss(kind, head_in[:, :n], weight, mask, eta=eta, p=p, argmax=True)

    return head_fn


def eagle3_ttt_loss(
    drafter: nn.Module,
    batch: dict[str, Any],
    target_lm_head: nn.Module,
    *,
    steps: int = 7,
    decay: float = 0.8,
    supervised_labels_only: bool = True,
    loss: str = "kl",
    lk_eta: float = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """EAGLE-3 training-time test (EAGLE-3 §3.3; HASS): unroll the drafter on its own outputs.

    Step 0 reads the fused target features; step j > 0 reads the drafter's own step j-1 output
    at the same position as its feature, the ground-truth token one further on
    (``x_{t+1+j}``), RoPE position ``t + j`` (as at inference, where draft step j sits j
    positions later), and attends as :func:`ttt_attention_mask` lays out. Step j at position t thus
    predicts ``x_{t+2+j}``, supervised with ``loss_mask[t + 2 + j]``.

    P-EAGLE (a drafter with ``mask_token_id``): the same unroll, except that step j > 0 reads
    the placeholder pair (``mask_hidden`` through ``fc``, the mask token's embedding) instead of
    its own output and the ground-truth token. The attention layout is unchanged: a depth-j
    query at t sees the verified keys up to t and the placeholder keys of depths 1..j at t,
    exactly what a parallel draft of k positions sees at inference. This is P-EAGLE's
    objective with every position as an anchor at every depth (speculators' P-EAGLE samples a
    shrinking subset of positions per depth to save compute; ours costs what EAGLE-3's unroll
    costs) and the same depth weights as EAGLE-3's.

    Loss: ``sum_j decay**j * L_j`` where L_j compares the drafter's draft-vocab distribution with
    the target's distribution restricted to the draft vocab (``softmax(target_logits[...,
    t2d])``), averaged over supervised positions: the soft cross-entropy by default, or one of
    the LK losses that target the acceptance rate (:mod:`.acceptance`).

    Args:
        drafter: an EAGLE-3 :class:`~draftsmith.heads.eagle_model.EagleDrafter` (or a wrapper).
        batch: ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, T]`` and
            ``hidden_states`` holding the aux layers and N.
        target_lm_head: the target's head (its distribution is the label).
        steps: TTT unroll length (EAGLE-3 uses 7).
        decay: step weight base (EAGLE-3 uses 0.8).
        supervised_labels_only: compute the target's distribution only at positions some step
            is supervised on (the label of position q is read iff ``loss_mask[q + 1]``); the
            loss and metrics are identical, the head costs less.
        loss: the per-depth loss, one of :data:`~.acceptance.DRAFT_LOSSES` (``kl``, ``tv``,
            ``nla``, ``lk_hybrid``).
        lk_eta: ``lk_hybrid``'s decay of the KL weight with the acceptance rate.

    Returns:
        ``(loss, metrics)``; metrics (detached 0-dim tensors): ``loss``, ``loss_{j}``,
        ``kl_{j}`` (the soft cross-entropy minus the target's entropy, 0 at a perfect match),
        ``alpha_{j}`` (the acceptance rate Σ min(p, q) of sampling at temperature 1), ``acc_{j}``
        (draft argmax mapped to target ids == target argmax over the full vocab), ``tokens_{j}``
        for j in 0..steps-1.
    """
    core = unwrap_model(drafter)
    cfg = core.config
    if cfg.version != 3:
        raise ValueError("eagle3_ttt_loss is for EAGLE-3 drafters; use eagle1_loss for EAGLE-1")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    dev = core.device
    ids, attn, loss_mask = _batch_tensors(batch, dev)
    b, t = ids.shape
    hidden = batch["hidden_states"]
    feats = core.feature_tensor(hidden)  # [B, T, 3H]
    supervised = loss_mask * attn
    # Step j's label at position t is the distribution at q = t + 1 + j, read iff
    # supervised[q + 1]: so position q is needed iff supervised[q + 1], whatever j.
    rows = shift_left(supervised, 1) > 0 if supervised_labels_only else None
    # The draft vocab as target ids (arange + d2t): gathered without reading t2d on the host.
    vocab_ids = core.target_ids(torch.arange(cfg.draft_vocab_size, device=core.d2t.device))
    # The labels in the target head's own dtype, also inside a training loop's autocast region.
    with torch.autocast(dev.type, enabled=False):
        target_p, target_arg = target_distribution(
            hidden[cfg.target_num_layers].to(dev), target_lm_head, rows=rows, vocab_ids=vocab_ids
        )
    target_p, target_arg = target_p.to(dev), target_arg.to(dev)
    # Each position's entropy once (a metric): every step reads a slice of the same labels.
    entropy = _entropy(target_p)  # [B, T]
    base_pos = torch.arange(t, device=dev)[None].expand(b, -1)

    keys = TTTKeys()
    total = torch.zeros((), device=dev)
    metrics: dict[str, torch.Tensor] = {}
    h = feats
    for j in range(steps):
        if j and cfg.parallel:
            # P-EAGLE: depth j reads the placeholder pair, never the tokens or features drafted
            # before it, so all depths can be drafted in one forward at inference.
            emb, h = core.placeholders(b, t)
        else:
            emb = core.embed(shift_left(ids, 1 + j))
        # Positions t < T-1-j have a label (the target's distribution at t+1+j); slicing views
        # of target_p (not shifted copies) keeps one [B, T, V_draft] label tensor in memory
        # however many steps autograd holds on to. The head and the loss run together inside
        # the drafter's forward (head_fn): no [B, T, V_draft] logits are kept per step.
        n = max(t - 1 - j, 0)
        mask = shift_left(supervised, 2 + j)[:, :n] > 0
        p_j = target_p[:, 1 + j : 1 + j + n]
        head_fn = _ttt_head_loss(loss, n, p_j, mask, lk_eta)
        # Step 0 causal over the verified keys, step j > 0 also its own position in steps 1..j
        # (no mask: heads/attention.py keeps it linear in T x steps).
        h, (loss_j, ce_j, alpha_j, rows) = drafter(
            emb, h, base_pos + j, cache=keys, head_fn=head_fn
        )
        total = total + decay**j * loss_j
        with torch.no_grad():
            hit = core.target_ids(rows["argmax"]) == target_arg[:, 1 + j : 1 + j + n]
            metrics[f"acc_{j}"] = _masked_mean(hit.float(), mask)
            metrics[f"loss_{j}"] = loss_j.detach()
            metrics[f"kl_{j}"] = ce_j - _masked_mean(entropy[:, 1 + j : 1 + j + n], mask)
            metrics[f"alpha_{j}"] = alpha_j
            metrics[f"tokens_{j}"] = mask.sum()
    metrics["loss"] = total.detach()
    return total, metrics
