"""The draft-vocabulary maps every reduced-vocabulary drafter shares (EAGLE-3, Medusa heads).

A drafter that predicts over a frequency-ranked draft vocabulary of N tokens (EAGLE-3 §3, FR-Spec)
carries two maps, built by :func:`draftsmith.train.data.vocab.draft_vocab` (the convention of
SafeAILab/EAGLE, SpecForge and vLLM):

- ``d2t`` (int64 ``[N]``): offsets, ``target_id = draft_id + d2t[draft_id]``; draft ids are the
  chosen tokens sorted by target id.
- ``t2d`` (bool ``[V]``): True for the target ids in the draft vocabulary.

This module checks the pair and turns draft-vocab outputs into target-vocab ones: the ids, and
the logits spread over the target vocabulary with ``-inf`` outside the draft vocabulary, so the
draft distribution q is exactly zero there and the loop's rejection sampling stays lossless.
"""

from __future__ import annotations

import torch

__all__ = ["check_vocab_maps", "spread_logits", "vocab_target_ids"]


def check_vocab_maps(
    d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, vocab_size: int
) -> None:
    """Raise ValueError unless ``d2t``/``t2d`` describe one draft vocabulary of the given sizes."""
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(f"d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},)")
    if tuple(t2d.shape) != (vocab_size,):
        raise ValueError(f"t2d has shape {tuple(t2d.shape)}, expected ({vocab_size},)")
    chosen = torch.arange(draft_vocab_size) + d2t.cpu().long()
    if not torch.equal(chosen, torch.nonzero(t2d.cpu()).flatten()):
        raise ValueError(
            "d2t and t2d disagree: arange(N) + d2t must list the target ids where t2d is True, "
            "in increasing order"
        )


def vocab_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The draft vocabulary as target ids, in draft order: ``arange(N) + d2t`` (no host sync)."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


def spread_logits(draft_logits: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits ``[..., N]`` spread over the target vocabulary ``[..., V]``.

    Tokens outside the draft vocabulary get ``-inf`` (probability 0), so ``choose`` and
    ``logits_to_probs`` give the draft distribution in target ids.
    """
    out = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
    out[..., vocab_target_ids(d2t).to(out.device)] = draft_logits
    return out
