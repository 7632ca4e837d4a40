"""Training loss of DFlash block drafters (:mod:`draftsmith.heads.dflash`).

One training step mirrors inference: random *anchors* a are picked in each sequence, and each
anchor gets a block ``[x_a, mask, ..., mask]`` at positions ``a .. a+B-1`` that sees the target
features of every real position < a and, bidirectionally, its own block -- not the context at or
after its anchor, and not the other blocks laid beside it in the same forward. All of a batch's
blocks go through the drafter in one forward over (context K/V of every position, every block),
as speculators' DFlash trainer and SpecForge do with a block-sparse mask.

Alignment: block slot s >= 1 predicts token ``a+s``; its label is the target's distribution at
position ``a+s-1`` (the target's lm_head on its final normed hidden state, ``hidden_states[N]``),
i.e. distillation as in speculators 0.9 (``core.py``: verifier logits at ``anchor+k-1``; SpecForge
uses the data token with hard CE instead). Slot 0 (the anchor itself) is not trained, as vLLM never
samples it. A slot is supervised iff ``a+s < T`` and token ``a+s`` is supervised
(``loss_mask * attention_mask``); an anchor is eligible iff token ``a+1`` is supervised, so every
block has at least one supervised slot.

Loss: soft cross-entropy per slot, weighted ``w_s = exp(-(s-1)/gamma)`` (the DFlash paper's and
speculators' ``dflash_loss_decay``: later slots are accepted only after the earlier ones, so they
matter less), normalised by the sum of the weights of the supervised slots (SpecForge's choice;
speculators divides by the slot count instead, which only rescales the loss by a constant for
full blocks but makes short trailing blocks count less here).

Batches are those of :func:`draftsmith.train.features.source.feature_source` (right-padded):
``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, T]`` and ``hidden_states {layer: [B, T,
H]}`` holding the drafter's feature layers and N. The drafter may be wrapped (DDP/accelerate):
every trained parameter is used inside the single ``drafter(...)`` call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...heads.attention import BlockLayout
from ...heads.base import unwrap_model
from ...heads.vocab_maps import vocab_target_ids
from .chunked_loss import head_rows
from .eagle_ttt import _batch_tensors, shift_left, target_distribution

__all__ = [
    "block_forward",
    "block_inputs",
    "dflash_attention_mask",
    "dflash_loss",
    "sample_anchors",
    "slot_weights",
]


def sample_anchors(
    supervised: torch.Tensor,
    max_anchors: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random block anchors per row: positions a with ``supervised[a + 1]``, without replacement.

    Each row keeps ``min(#eligible, max_anchors)`` anchors drawn uniformly among its eligible
    positions (the ``A`` smallest of i.i.d. uniform scores, eligible ones first), sorted by
    position; rows with fewer are padded with invalid entries at the end. No host sync.

    Args:
        supervised: ``[B, T]`` bool, tokens that are supervised (loss mask and not padding).
        max_anchors: most anchors per row.
        generator: randomness (a CPU generator; its draws are moved to the device), for
            reproducible anchors (validation). None: the global RNG on the device.

    Returns:
        ``(anchors [B, A] long, valid [B, A] bool)`` with ``A = min(max_anchors, T)``; invalid
        anchors hold some position in ``[0, T)`` and must be masked out.
    """
    if max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1, got {max_anchors}")
    b, t = supervised.shape
    dev = supervised.device
    eligible = shift_left(supervised.bool(), 1, fill=False)  # supervised[a + 1]
    a = min(max_anchors, t)
    u = torch.rand((b, t), generator=generator, device="cpu" if generator else dev).to(dev)
    score = torch.where(eligible, u, u + 2.0)  # every eligible position before any other
    idx = score.topk(a, dim=1, largest=False).indices
    valid = eligible.gather(1, idx)
    order = torch.where(valid, idx, idx + t).argsort(dim=1)  # by position, invalid last
    return idx.gather(1, order), valid.gather(1, order)


def block_inputs(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tokens and positions for each anchor.

    Args:
        input_ids: ``[B, T]``.
        anchors: ``[B, A]`` anchor positions.
        block_size: S (the drafter's B).
        mask_token_id: the mask token.

    Returns:
        ``(tokens [B, A, S], positions [B, A, S])``: ``[x_a, mask, ..., mask]`` at
        ``a, a+1, ..., a+S-1``.
    """
    offsets = torch.arange(block_size, device=anchors.device)
    positions = anchors[..., None] + offsets
    tokens = torch.full_like(positions, mask_token_id)
    tokens[..., 0] = input_ids.gather(1, anchors)
    return tokens, positions


def dflash_attention_mask(
    anchors: torch.Tensor, attention_mask: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Which keys each block query sees, written out densely (the reference layout).

    Training does not build it: :class:`~draftsmith.heads.attention.BlockLayout` makes each
    chunk of blocks' slice of it as the attention goes (memory linear in T).

    Keys are laid out as the T context positions, then the ``A * S`` block slots (anchor j's
    block at ``j*S .. j*S+S-1``). A query of anchor j's block sees context position p iff
    ``p < a_j`` and p is a real token, and every slot of its own block (bidirectional), never
    another block. Every query sees its own block, so no row is empty.

    Args:
        anchors: ``[B, A]`` anchor positions.
        attention_mask: ``[B, T]`` 1 = real token.
        block_size: S.

    Returns:
        bool ``[B, 1, A*S, T + A*S]``, True = attend (SDPA's convention).
    """
    b, a = anchors.shape
    t = attention_mask.shape[1]
    s = block_size
    dev = anchors.device
    ctx = torch.arange(t, device=dev)[None, None] < anchors[..., None]  # [B, A, T]
    ctx = ctx & attention_mask.to(device=dev, dtype=torch.bool)[:, None]
    ctx = ctx[:, :, None].expand(b, a, s, t).reshape(b, a * s, t)
    same = torch.eye(a, dtype=torch.bool, device=dev)[:, None, :, None].expand(a, s, a, s)
    blocks = same.reshape(a * s, a * s)[None].expand(b, -1, -1)
    return torch.cat([ctx, blocks], dim=-1)[:, None]


def block_forward(
    drafter: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    hidden_states: dict[int, torch.Tensor],
    anchors: torch.Tensor,
) -> torch.Tensor:
    """The drafter's final hidden states of every anchor's block, in one forward.

    Args:
        drafter: a :class:`~draftsmith.heads.dflash.DFlashDrafter` (or a wrapper).
        input_ids: ``[B, T]``.
        attention_mask: ``[B, T]``.
        hidden_states: ``{layer: [B, T, H]}`` holding the feature layers.
        anchors: ``[B, A]``.

    Returns:
        ``[B, A, S, H]`` (after the drafter's final norm; the target head gives the logits).
    """
    core = unwrap_model(drafter)
    cfg = core.config
    dev = core.device
    b, t = input_ids.shape
    s = cfg.block_size
    anchors = anchors.to(dev)
    tokens, positions = block_inputs(input_ids.to(dev), anchors, s, cfg.mask_token_id)
    a = anchors.shape[1]
    # Which keys each block sees (dflash_attention_mask's layout), attended a chunk of blocks at
    # a time: no [A S, T + A S] mask or probability tensor.
    mask = BlockLayout(anchors, attention_mask.to(dev) > 0, s)
    hidden = drafter(
        core.embed(tokens.view(b, a * s)),
        positions.view(b, a * s),
        features=core.feature_tensor(hidden_states),
        feature_positions=torch.arange(t, device=dev)[None].expand(b, -1),
        attention_mask=mask,
    )
    return hidden.view(b, a, s, -1)


def slot_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """``[S]`` loss weights: 0 for the anchor slot, ``exp(-(s-1)/gamma)`` for slot s >= 1."""
    s = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(s - 1).clamp_min(0) / gamma)
    w[0] = 0.0
    return w


def dflash_loss(
    drafter: nn.Module,
    batch: dict[str, Any],
    target_lm_head: nn.Module,
    *,
    max_anchors: int = 64,
    gamma: float = 4.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DFlash block loss (module docstring): decayed soft CE of every supervised block slot.

    The target head (the full vocabulary: 49k-150k) runs only where needed: the draft logits at
    the supervised slots, and the labels at the distinct positions they read (overlapping blocks
    share label rows). Selecting them sizes tensors, two host syncs per call.

    Args:
        drafter: a :class:`~draftsmith.heads.dflash.DFlashDrafter` (or a wrapper).
        batch: ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, T]``, ``hidden_states``
            holding the feature layers and N.
        target_lm_head: the target's head (labels; the drafter's logits use the same one).
        max_anchors: most blocks per sequence (speculators' default is 512 for long data).
        gamma: slot weight decay (DFlash: 7 for B=16, 4 for B=8).
        generator: anchor randomness (a CPU generator), e.g. fixed anchors for validation.

    Returns:
        ``(loss, metrics)``; metrics (detached 0-dim tensors): ``loss``, and for draft slot
        ``j = s - 1`` in ``0 .. B-2``: ``acc_{j}`` (draft argmax == target argmax over the
        supervised slots; feed them to ``simulated_tau``), ``loss_{j}`` (its mean soft CE) and
        ``tokens_{j}`` (supervised slots).
    """
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    core = unwrap_model(drafter)
    cfg = core.config
    dev = core.device
    ids, attn, loss_mask = _batch_tensors(batch, dev)
    b, t = ids.shape
    s = cfg.block_size
    supervised = (loss_mask * attn) > 0
    anchors, valid = sample_anchors(supervised, max_anchors, generator)
    hidden = block_forward(drafter, ids, attn, batch["hidden_states"], anchors)  # [B, A, S, H]

    # Slot (j, s) predicts token a_j + s: supervised iff that token exists and is supervised.
    offsets = torch.arange(s, device=dev)
    pos = anchors[..., None] + offsets  # [B, A, S]
    inside = pos < t
    target_sup = supervised.gather(1, pos.clamp(max=t - 1).flatten(1)).view_as(pos)
    slot_mask = valid[..., None] & (offsets >= 1) & inside & target_sup
    # sync: the number of supervised slots sizes the head's input.
    bi, ai, si = slot_mask.nonzero(as_tuple=True)
    label_pos = anchors[bi, ai] + si - 1

    # Labels at the distinct positions read (blocks overlap), then spread to the slots.
    need = torch.zeros(b, t, dtype=torch.bool, device=dev)
    need[bi, label_pos] = True
    row_of = need.flatten().cumsum(0) - 1  # compact row of each (row, position)
    final = batch["hidden_states"][cfg.target_num_layers].to(dev)
    # A draft vocabulary: the target's distribution restricted to it and renormalised (EAGLE-3
    # §3), which is what the drafter's rows of the head can express.
    vocab_ids = vocab_target_ids(core.d2t) if cfg.reduced_vocab else None
    # sync (boolean index): sizes the label rows.
    target_p, target_arg = target_distribution(
        final[need][None], target_lm_head, vocab_ids=vocab_ids
    )
    rows = row_of[bi * t + label_pos].to(target_p.device)
    target_p = target_p[0, rows].to(dev)
    target_arg = target_arg[0, rows].to(dev)

    # The head (core.logits: the target's, or its draft-vocabulary rows) and the soft CE in row
    # chunks (head_rows): the [N, V] logits and log-probabilities are not kept for the backward;
    # the label target_p is the one [N, V] tensor left.
    head = core.shared.lm_head
    weight = core.shared.head_rows(core.d2t) if cfg.reduced_vocab else head.weight
    bias = None if cfg.reduced_vocab else head.bias
    rows = head_rows(hidden[bi, ai, si], weight, bias=bias, p=target_p, terms=("ce",), argmax=True)
    ce = rows["ce"]  # [N]
    w = slot_weights(s, gamma, dev)[si]
    loss = (w * ce).sum() / w.sum().clamp_min(1e-12)

    metrics: dict[str, torch.Tensor] = {"loss": loss.detach()}
    with torch.no_grad():
        hit = (core.target_ids(rows["argmax"]).to(dev) == target_arg).float()
        j = si - 1
        count = torch.bincount(j, minlength=s - 1)
        hits = torch.bincount(j, weights=hit, minlength=s - 1)
        ces = torch.bincount(j, weights=ce.detach().float(), minlength=s - 1)
        denom = count.clamp_min(1).float()
        acc, slot_ce = hits / denom, ces / denom
        for k in range(s - 1):
            metrics[f"acc_{k}"] = acc[k]
            metrics[f"loss_{k}"] = slot_ce[k]
            metrics[f"tokens_{k}"] = count[k]
    return loss, metrics
