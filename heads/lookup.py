"""What the model-free lookup drafters share (:mod:`.ngram`, :mod:`.suffix`).

A lookup drafter runs no model and keeps no state: at every step it searches the accepted
sequence ``ids`` (prompt and tokens generated so far) for an earlier match of its end, between a
shortest and a longest match length, and proposes a continuation of that match. It needs no
target features and learns nothing from what the target accepted. Its guess is deterministic
(q one-hot on it, so no ``probs``): in sampling mode the loop accepts a guess x with probability
p(x).

A subclass passes its label and its two length bounds to :class:`LookupDrafter` and implements
:meth:`LookupDrafter.lookup`.
"""

from __future__ import annotations

import torch

from .base import Features, Proposal
from .sampling import SamplingParams


class LookupDrafter:
    """A stateless drafter that proposes from the token history alone (see the module doc).

    Args:
        label: how reports call the method (``LABEL[SHORTEST-LONGEST]``).
        **bounds: the shortest and then the longest match length, under the subclass's
            argument names (``min_ngram=2, max_ngram=4``), which errors quote.

    Attributes:
        shortest: shortest match worth proposing from (>= 1).
        longest: longest match compared (>= ``shortest``).
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, label: str, **bounds: int) -> None:
        (low, shortest), (high, longest) = bounds.items()
        if shortest < 1 or longest < shortest:
            raise ValueError(f"need 1 <= {low} <= {high}, got {low}={shortest}, {high}={longest}")
        self.label = label
        self.shortest = shortest
        self.longest = longest

    @property
    def name(self) -> str:
        """How reports call it: ``LABEL[SHORTEST-LONGEST]`` (``ngram[2-4]``)."""
        return f"{self.label}[{self.shortest}-{self.longest}]"

    def start(self, prompt_ids: torch.Tensor, features: Features | None) -> None:
        """Nothing to prepare: the lookup reads ``ids`` at every step."""

    def propose(
        self,
        ids: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """The :meth:`lookup` of ``ids``'s one row.

        Args:
            ids: ``[1, T]`` accepted sequence.
            k: most tokens to propose.
            sampling: unused (the guess is deterministic).
            generator: unused.

        Returns:
            Up to k tokens, or none when no match of the shortest length occurred before.
        """
        return Proposal(tokens=self.lookup(ids[0], k))

    def lookup(self, seq: torch.Tensor, k: int) -> torch.Tensor:
        """Up to k tokens (``[n]``, ``seq``'s dtype and device) to follow ``seq`` (``[T]``)."""
        return self.match(seq, k)[0]

    def match(self, seq: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
        """:meth:`lookup`'s tokens and the length of the match they continue (0: none).

        The match length is the per-step decision's evidence (:mod:`.auto`): a continuation of
        a longer match is accepted more often (its calibration keeps one rate per length).
        """
        raise NotImplementedError

    def accept(self, num_accepted: int, features: Features | None) -> None:
        """Stateless: nothing to update."""
