"""The contract between drafters and the speculative verification loop.

The loop (``draftsmith.train.decoding.speculative``) owns the target, its KV cache, sampling and acceptance.
A drafter only proposes tokens and keeps its own state in step with what was accepted. The loop
never asks which kind of drafter it runs; adding a drafter never changes the loop.

Call order for one sequence::

    drafter.start(prompt_ids, features)             # once; features of the prompt positions
    loop:
        proposal = drafter.propose(ids, k, sampling, generator)
        ... target verifies proposal in one forward ...
        drafter.accept(num_accepted, features)     # features of the newly verified, kept positions

``ids`` always holds the accepted sequence: the prompt followed by every emitted token. Its last
token is the one the target has just produced (the target has not yet run on it). ``features`` are
the target's hidden states at every position of ``ids`` except that last one, delivered
incrementally: the prompt's at ``start`` and, after each verification, those of the positions the
step kept (the previous last token plus the accepted draft tokens). They come from the verification
forward itself -- no extra target pass (EAGLE §3; Medusa §2.1 use the same hidden states).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from draftsmith.heads.sampling import SamplingParams

# Target hidden states keyed by layer index in HF's ``output_hidden_states`` convention:
# 0 = embedding output (input to layer 0), i = output of layer i-1 (= input to layer i),
# num_layers = final output after the model's last norm. Each tensor is ``[1, n, H]``.
Features = dict[int, torch.Tensor]


@dataclass
class Proposal:
    """Tokens a drafter proposes for one verification step.

    Attributes:
        tokens: ``[n]`` long, ``0 <= n <= k``. n = 0 means "no guess": the step becomes a plain
            decoding step.
        probs: ``[n, V]`` float, the processed draft distribution q each token was sampled from
            (row i is q for ``tokens[i]``). None means the drafter is deterministic (q is one-hot
            on its token), as for n-gram lookup or greedy drafting.
        parents: ``[n]`` long, tree drafts only: index of each node's parent in ``tokens``, -1 for
            children of the root (the last accepted token). Parents come before children. None
            means a chain (node i's parent is i-1).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@runtime_checkable
class Drafter(Protocol):
    """What the verification loop needs from a drafter."""

    #: Target hidden-state layers this drafter needs (see :data:`Features`); empty for none.
    feature_layers: tuple[int, ...]

    def start(self, prompt_ids: torch.Tensor, features: Features | None) -> None:
        """Begin a new sequence.

        Args:
            prompt_ids: ``[1, T]`` prompt tokens (without the first generated token).
            features: target hidden states over the T prompt positions, or None if not requested.
        """
        ...

    def propose(
        self,
        ids: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Propose up to k tokens to follow ``ids``.

        Args:
            ids: ``[1, T]`` accepted sequence (prompt + emitted tokens).
            k: most tokens to propose (chain length, or tree depth for tree drafters).
            sampling: the run's sampling parameters; a sampling drafter samples from its processed
                distribution and returns it as ``probs``.
            generator: randomness shared with the loop, for reproducible runs.
        """
        ...

    def accept(self, num_accepted: int, features: Features | None) -> None:
        """Learn the outcome of the last verification.

        Called after every target forward, also after steps where ``propose`` was not called
        (the budget or an adaptive draft length allowed no draft); ``num_accepted`` is then 0 and
        ``features`` cover just the one position the step verified.

        Args:
            num_accepted: how many proposed tokens the target accepted (for a tree: the length
                of the accepted path). The token the target emitted after them arrives as the
                last element of ``ids`` at the next ``propose``.
            features: target hidden states at the kept positions: ``[1, num_accepted + 1, H]``
                per layer (the previous last token, then the accepted draft tokens).
        """
        ...
