"""Medusa training: head losses, accuracies, the Medusa-2 joint objective, LR schedules.

**Alignment.** ``h_t`` is the target's final normed hidden state at position t; the target's
lm_head on it predicts token t+1. Head k (0-based) on ``h_t`` predicts token **t+k+2** (Medusa
§2.1.1, 1-based head k -> t+k+1). Its label is either

* ``data``: ``input_ids[t+k+2]``, the data's own token (Medusa-1 §2.2.1), or
* ``target`` / ``target_soft``: the target's own prediction for that position, i.e. the argmax
  (or the whole distribution) of its logits at position ``t+k+1`` -- self-distillation (Medusa
  §2.3.1). On self-distilled greedy data the two agree; on other data the target's prediction
  is what greedy verification will accept.

A label counts only where ``loss_mask[t+k+2] == 1`` (an assistant token). Head k's loss is the
mean cross-entropy over its positions; the total is ``Σ_k decay^k · L_k`` with decay 0.8
(Medusa §2.2.1: later heads are less certain, so they weigh less).

**Draft vocabulary** (heads with ``draft_vocab_size`` N < V, FR-Spec / EAGLE-3's d2t): each
head's logits cover the N draft tokens only, and the labels are restricted to them the way the
EAGLE-3 objective restricts its label (:func:`~draftsmith.train.objectives.eagle_ttt.eagle3_ttt_loss`:
the target's distribution over the draft vocabulary, renormalised):

* ``target_soft``: the target's distribution restricted to the draft vocabulary and renormalised,
  ``softmax(target_logits[..., vocab_ids])`` -- exactly EAGLE-3's label;
* ``data`` / ``target``: a hard label outside the draft vocabulary has no restriction (its one-hot
  is zero on every draft token), so that position is left out of the head's cross-entropy (the
  mean is over positions whose label is a draft token). It still counts in top-1/top-5 -- as a
  miss, since the head can never propose it -- as EAGLE-3's accuracy compares the draft's choice
  with the target's token over the full vocabulary.

Full-vocabulary heads are trained exactly as before.

**Medusa-2** (§2.2.2): LoRA adapters on the target (``peft``) train jointly with the heads on
``L_target + λ Σ_k 0.8^k L_k``, where ``L_target`` is the target's next-token loss on the data,
or the KL divergence from the frozen original target (adapters disabled) to the adapted one,
which keeps the target's output distribution. A heads-only warm-up comes first (the random
heads' large early gradients would otherwise disturb the target), and the heads get a larger
learning rate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...heads.medusa import MedusaHeads, build_tree, expected_acceptance_length
from ..core.schedule import WarmupCosine
from ..data.vocab import t2d_index
from .acceptance import DRAFT_LOSSES, draft_head_loss
from .chunked_loss import head_argmax, head_rows

__all__ = [
    "HEAD_LABELS",
    "TARGET_LOSSES",
    "Medusa1Objective",
    "Medusa2Objective",
    "accuracy_report",
    "add_lora",
    "as_teacher",
    "head_label_positions",
    "head_weights",
    "medusa_head_losses",
    "rank_counts",
    "warmup_cosine",
]

HEAD_LABELS = ("data", "target", "target_soft")
TARGET_LOSSES = ("lm", "kl")
TOPK = 5  # the "top-5" of the per-head accuracy metrics


def as_teacher(lm_head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The target's lm_head as a teacher that accepts hidden states of any dtype.

    The heads train in fp32 while the target may hold bf16 weights (GPU).
    """
    dtype = lm_head.weight.dtype
    return lambda h: lm_head(h.to(dtype))


def head_weights(num_heads: int, decay: float = 0.8) -> list[float]:
    """``[decay^k for k < K]``: head k's weight in the total loss (Medusa §2.2.1)."""
    return [decay**k for k in range(num_heads)]


def head_label_positions(loss_mask: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions where head k is trained: t with ``loss_mask[b, t+k+2] == 1``.

    Args:
        loss_mask: ``[B, T]`` 1 on supervised tokens (0 on padding).
        k: head index (0-based).

    Returns:
        ``(b, t)`` index tensors of the source positions; the label is at ``t + k + 2``.
    """
    shift = k + 2
    valid = loss_mask[:, shift:].bool()  # column j <-> source position t = j
    return valid.nonzero(as_tuple=True)


def medusa_head_losses(
    heads: MedusaHeads,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    labels: str = "data",
    teacher: Callable[[torch.Tensor], torch.Tensor] | None = None,
    decay: float = 0.8,
    head_loss: str = "kl",
    lk_eta: float = 3.0,
) -> dict[str, torch.Tensor]:
    """Weighted loss of every head (cross-entropy by default), and its top-1/top-5 hits.

    Only the supervised positions go through the heads (a ``[B, T, V]`` logits tensor per head
    would dominate memory for a 49k vocabulary).

    Args:
        heads: the Medusa heads.
        hidden: ``[B, T, H]`` final normed target hidden states.
        input_ids: ``[B, T]`` tokens.
        loss_mask: ``[B, T]`` 1 on supervised tokens.
        labels: ``data``, ``target`` (teacher argmax) or ``target_soft`` (teacher
            distribution); see the module docstring.
        teacher: maps hidden states ``[n, H]`` to the target's logits ``[n, V]`` (its lm_head);
            needed for the ``target*`` labels. Called without gradients.
        decay: head k's loss weight is ``decay^k``.
        head_loss: ``kl`` (cross-entropy with the label, hard or soft) or, with ``target_soft``
            labels, one of the LK losses of :data:`~.acceptance.DRAFT_LOSSES` (``tv``, ``nla``,
            ``lk_hybrid``), which train each head's acceptance rate against the target's
            distribution directly (arXiv 2602.23881; EAGLE's ``loss`` field).
        lk_eta: ``lk_hybrid``'s decay of the KL weight with the acceptance rate.

    Returns:
        ``loss`` (scalar, with grad), and per head ``[K]`` (no grad): ``head_loss`` (mean loss),
        ``correct1``/``correct5`` (hits against the hard label), ``count`` (positions).
        With a draft vocabulary see the module docstring: the soft label is restricted to it,
        hard labels outside it are left out of the CE and counted as misses.
    """
    if labels not in HEAD_LABELS:
        raise ValueError(f"labels must be one of {HEAD_LABELS}, got {labels!r}")
    if labels != "data" and teacher is None:
        raise ValueError(f"labels={labels!r} needs the target's lm_head as teacher")
    if head_loss not in DRAFT_LOSSES:
        raise ValueError(f"head_loss must be one of {', '.join(DRAFT_LOSSES)}; got {head_loss!r}")
    if head_loss != "kl" and labels != "target_soft":
        raise ValueError(
            f"head_loss={head_loss!r} needs the target's distribution: labels='target_soft'"
        )
    K = heads.num_heads
    total = hidden.new_zeros((), dtype=torch.float32)
    stats = {
        name: torch.zeros(K, device=hidden.device)
        for name in ("head_loss", "correct1", "correct5", "count")
    }
    # Draft vocabulary: target id -> draft id (-1 outside), and the draft tokens' target ids.
    to_draft = t2d_index(heads.t2d) if heads.reduced else None
    vocab_ids = heads.vocab_ids() if heads.reduced else None
    for k, w in enumerate(head_weights(K, decay)):
        b, t = head_label_positions(loss_mask, k)
        if b.numel() == 0:
            # Keep head k in the graph (DDP expects a gradient for every trainable parameter).
            total = total + heads.head_logits(k, hidden[:0, :0]).float().sum()
            continue
        # The head's projection and its loss together, in row chunks (head_rows): no [n, N]
        # logits, log-probabilities or soft label are kept for the backward (N = V without a
        # draft vocabulary: 49k-152k for real targets).
        x = heads.head_hidden(k, hidden[b, t])  # [n, H]
        proj = heads.projections()[k]
        n_top = min(TOPK, heads.draft_vocab_size)
        if labels == "target_soft":
            # The teacher's distribution at t+k+1, restricted to the draft vocabulary and
            # renormalised; recomputed from the [n, H] hidden states in the backward.
            soft = {
                "p_hidden": hidden[b, t + k + 1].detach(),
                "p_head": teacher,
                "p_cols": vocab_ids,
                "p_argmax": True,  # the teacher's argmax over the full vocabulary
            }
            if head_loss != "kl":
                every = torch.ones(b.shape[0], dtype=torch.bool, device=hidden.device)
                loss_k, _, _, rows = draft_head_loss(
                    head_loss, x, proj.weight, every, eta=lk_eta, bias=proj.bias, topk=n_top, **soft
                )
            else:
                # Cross-entropy with the teacher's distribution (= KL + the teacher's entropy).
                rows = head_rows(x, proj.weight, bias=proj.bias, terms=("ce",), topk=n_top, **soft)
                loss_k = rows["ce"].mean()
            target_ids = rows["p_argmax"]
        else:
            if labels == "data":
                target_ids = input_ids[b, t + k + 2]
            else:  # the teacher's argmax over the full vocabulary, in row chunks
                target_ids = head_argmax(
                    hidden[b, t + k + 1].detach(), teacher, vocab=heads.vocab_size
                )
            # A draft vocabulary: labels outside it are -1, left out (mean over the others).
            hard = target_ids if to_draft is None else to_draft[target_ids]
            rows = head_rows(
                x, proj.weight, bias=proj.bias, labels=hard, terms=("nll",), topk=n_top
            )
            if to_draft is None:
                loss_k = rows["nll"].mean()
            else:
                loss_k = rows["nll"].sum() / (hard >= 0).sum().clamp_min(1)
        total = total + w * loss_k
        with torch.no_grad():
            top = heads.target_ids(rows["topk"])
            hit = top == target_ids[:, None]
            stats["head_loss"][k] = loss_k.detach()
            stats["correct1"][k] = hit[:, 0].sum()
            stats["correct5"][k] = hit.any(-1).sum()
            stats["count"][k] = b.numel()
    return {"loss": total, **stats}


class Medusa1Objective(nn.Module):
    """Medusa-1 (frozen target): the heads and their loss, as one module for DDP.

    DDP only synchronises gradients of computations that go through its wrapped module's
    ``forward``, so the loss is computed here rather than by calling head methods directly.

    Args:
        heads: the trainable heads.
        labels: see :func:`medusa_head_losses`.
        decay: head loss decay.
        head_loss: the heads' loss (see :func:`medusa_head_losses`).
        lk_eta: ``lk_hybrid``'s decay of the KL weight.
    """

    def __init__(
        self,
        heads: MedusaHeads,
        *,
        labels: str = "data",
        decay: float = 0.8,
        head_loss: str = "kl",
        lk_eta: float = 3.0,
    ) -> None:
        super().__init__()
        self.heads = heads
        self.labels = labels
        self.decay = decay
        self.head_loss = head_loss
        self.lk_eta = lk_eta

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        teacher: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """See :func:`medusa_head_losses`; ``hidden [B, T, H]`` comes from the frozen target."""
        hidden = hidden.to(next(self.heads.parameters()).dtype)
        return medusa_head_losses(
            self.heads,
            hidden,
            input_ids,
            loss_mask,
            labels=self.labels,
            teacher=teacher,
            decay=self.decay,
            head_loss=self.head_loss,
            lk_eta=self.lk_eta,
        )


def add_lora(
    target: nn.Module,
    *,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.05,
    target_modules: Sequence[str] | None = None,
) -> nn.Module:
    """Wrap the target with LoRA adapters (``peft``); only the adapters are trainable.

    Args:
        target: the HF causal LM (its own weights stay frozen).
        r: LoRA rank.
        alpha: LoRA scaling numerator (the update is ``alpha / r · B A``).
        dropout: dropout on the adapter input.
        target_modules: module names to adapt; default every attention and MLP projection.
    """
    from peft import LoraConfig, get_peft_model

    modules = list(
        target_modules
        or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    target.requires_grad_(False)
    return get_peft_model(target, config)


class Medusa2Objective(nn.Module):
    """Medusa-2: the LoRA-adapted target and the heads, trained jointly (§2.2.2).

    Args:
        target: the target wrapped by :func:`add_lora` (a ``peft`` model).
        heads: the heads.
        target_loss: ``lm`` (next-token CE on the data) or ``kl`` (KL from the original target,
            adapters disabled, to the adapted one: keeps the target's distribution).
        head_labels: see :func:`medusa_head_losses`; ``target*`` labels come from the adapted
            target being trained (the one that will verify the drafts).
        decay: head loss decay.
        head_weight: λ, the heads' weight against the target loss.
        head_loss: the heads' loss (see :func:`medusa_head_losses`).
        lk_eta: ``lk_hybrid``'s decay of the KL weight.
    """

    def __init__(
        self,
        target: nn.Module,
        heads: MedusaHeads,
        *,
        target_loss: str = "kl",
        head_labels: str = "data",
        decay: float = 0.8,
        head_weight: float = 0.2,
        head_loss: str = "kl",
        lk_eta: float = 3.0,
    ) -> None:
        super().__init__()
        if target_loss not in TARGET_LOSSES:
            raise ValueError(f"target_loss must be one of {TARGET_LOSSES}, got {target_loss!r}")
        self.target = target
        self.heads = heads
        self.target_loss = target_loss
        self.head_labels = head_labels
        self.decay = decay
        self.head_weight = head_weight
        self.head_loss = head_loss
        self.lk_eta = lk_eta

    def _hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.target(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=True,
            use_cache=False,
            logits_to_keep=1,  # logits are computed below, only where supervised
        )
        return out.hidden_states[-1]  # final normed output

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        heads_only: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Joint loss; ``heads_only`` (the warm-up) runs the target without gradients.

        Returns:
            As :func:`medusa_head_losses`, plus ``head_total`` (the weighted head loss) and
            ``target_loss`` (0 during the warm-up); ``loss`` is
            ``target_loss + head_weight * head_total``.
        """
        lm_head = self.target.get_output_embeddings()
        if heads_only:
            with torch.no_grad():
                hidden = self._hidden(input_ids, attention_mask)
        else:
            hidden = self._hidden(input_ids, attention_mask)
        heads_dtype = next(self.heads.parameters()).dtype
        out = medusa_head_losses(
            self.heads,
            hidden.to(heads_dtype),
            input_ids,
            loss_mask,
            labels=self.head_labels,
            teacher=as_teacher(lm_head),
            decay=self.decay,
            head_loss=self.head_loss,
            lk_eta=self.lk_eta,
        )
        head_total = out["loss"]
        if heads_only:
            target_loss = head_total.new_zeros(())
        else:
            # Next-token positions: t predicts t+1 where loss_mask[t+1] == 1.
            # lm_head and loss in row chunks (head_rows): no [n, V] kept for the backward.
            b, t = loss_mask[:, 1:].bool().nonzero(as_tuple=True)
            head = {"weight": lm_head.weight, "bias": lm_head.bias}
            if self.target_loss == "lm":
                nll = head_rows(hidden[b, t], **head, labels=input_ids[b, t + 1], terms=("nll",))
                target_loss = nll["nll"].mean()  # F.cross_entropy's mean
            else:
                with torch.no_grad(), self.target.disable_adapter():
                    ref = self._hidden(input_ids, attention_mask)[b, t]
                # KL(original ‖ adapted), the original's lm_head recomputed from its hidden
                # states (the head carries no adapter); per row, then F.kl_div's "batchmean".
                kl = head_rows(hidden[b, t], **head, p_hidden=ref, p_head=lm_head, terms=("fkl",))
                target_loss = kl["fkl"].sum() / b.shape[0]
        out["head_total"] = head_total.detach()
        out["target_loss"] = target_loss.detach()
        out["loss"] = target_loss + self.head_weight * head_total
        return out


@torch.no_grad()
def rank_counts(
    heads: MedusaHeads,
    hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    teacher: Callable[[torch.Tensor], torch.Tensor],
    max_rank: int = 10,
) -> tuple[torch.Tensor, torch.Tensor]:
    """How often the target's own next token sits at each rank of each head's logits.

    The reference token for head k at position t is the target's argmax at position t+k+1 --
    exactly what greedy verification accepts at that depth when the earlier tokens were right.
    With a draft vocabulary, a reference token outside it has no rank (the head never proposes
    it): it counts in the totals only.

    Args:
        heads: the heads.
        hidden: ``[B, T, H]`` final normed hidden states.
        loss_mask: ``[B, T]``; positions count where the token head k predicts is supervised.
        teacher: the target's lm_head (hidden ``[n, H]`` -> logits ``[n, V]``).
        max_rank: ranks 0 .. max_rank-1 are counted.

    Returns:
        ``(counts [K, max_rank], totals [K])`` (float, summable across processes).
    """
    K = heads.num_heads
    counts = torch.zeros(K, max_rank, device=hidden.device)
    totals = torch.zeros(K, device=hidden.device)
    hidden = hidden.to(next(heads.parameters()).dtype)
    to_draft = t2d_index(heads.t2d) if heads.reduced else None
    for k in range(K):
        b, t = head_label_positions(loss_mask, k)
        if b.numel() == 0:
            continue
        logits = heads.head_logits(k, hidden[b, t]).float()
        want = teacher(hidden[b, t + k + 1]).argmax(-1)
        if to_draft is not None:
            want = to_draft[want.to(to_draft.device)]  # -1: outside the draft vocabulary
        # Rank = how many tokens score strictly higher than the wanted one.
        rank = (logits > logits.gather(-1, want.clamp_min(0)[:, None])).sum(-1)
        rank = torch.where(want >= 0, rank, max_rank)  # no rank: counted in the totals only
        counts[k] += torch.bincount(rank[rank < max_rank], minlength=max_rank).float()
        totals[k] += b.numel()
    return counts, totals


def accuracy_report(
    counts: torch.Tensor, totals: torch.Tensor, tree_nodes: int = 64
) -> dict[str, Any]:
    """Per-head accuracies and the automatic tree built from them.

    Args:
        counts: ``[K, R]`` from :func:`rank_counts` (summed over the validation data).
        totals: ``[K]`` positions per head.
        tree_nodes: node budget of the tree recorded with the report.

    Returns:
        ``{"positions", "top1", "top5", "rank_accuracy" [K][R], "tree": {"nodes",
        "medusa_choices", "expected_acceptance_length"}, "chain_expected_acceptance_length"}``.
    """
    counts, totals = counts.double().cpu(), totals.double().cpu()
    acc = counts / totals.clamp_min(1)[:, None]
    rank_accuracy = [[round(float(a), 6) for a in row] for row in acc]
    choices = build_tree(rank_accuracy, tree_nodes)
    chain = [tuple([0] * (d + 1)) for d in range(len(rank_accuracy))]
    return {
        "reference": "the target's own greedy token (argmax of its logits at t+k+1)",
        "positions": [int(x) for x in totals],
        "top1": [float(a) for a in acc[:, 0]],
        "top5": [float(a) for a in acc[:, :TOPK].sum(-1)],
        "rank_accuracy": rank_accuracy,
        "chain_expected_acceptance_length": expected_acceptance_length(chain, rank_accuracy),
        "tree": {
            "nodes": len(choices),
            "medusa_choices": [list(c) for c in choices],
            "expected_acceptance_length": expected_acceptance_length(choices, rank_accuracy),
        },
    }


def warmup_cosine(warmup: int, total: int, start: int = 0) -> WarmupCosine:
    """LR multiplier: 0 before ``start``, then linear warm-up over ``warmup`` steps, then cosine
    decay to 0 at ``total`` (the schedule of ``transformers.get_cosine_schedule_with_warmup``,
    delayed by ``start`` -- the Medusa-2 adapters sit out the heads-only warm-up). The warm-up
    factor is ``(s + 1) / (warmup + 1)``: never 0 once started.
    """
    return WarmupCosine(warmup, total, start=start, offset=1)
