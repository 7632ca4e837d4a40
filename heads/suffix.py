"""Suffix lookup: the longest earlier match of the sequence's end, continued by majority vote.

Like n-gram prompt lookup (:mod:`draftsmith.heads.ngram`) it runs no model and reads only the
prompt and the text generated so far; like suffix decoding (Oliaro et al. 2024, "SuffixDecoding";
vLLM's ``suffix`` speculative method) it matches the *longest* suffix of the sequence that occurred
before, not one of a few fixed lengths, and builds its guess from every earlier occurrence of that
suffix at once: token by token it proposes what most often followed among the occurrences still
consistent with the guess so far (ties go to the most recent). Where n-gram lookup copies the one
most recent continuation, this follows the most frequent one, which helps on repetitive text
(lists, code, templated answers) where the latest repetition is not the typical one.

Its distribution q is one-hot on its guess, so in sampling mode the loop accepts a guess x with
probability p(x), as for n-gram lookup. ``--drafter suffix`` (:data:`SUFFIX`) uses the defaults.
"""

from __future__ import annotations

from collections import Counter

import torch

from .base import BuildOptions, DrafterKind, Features, Proposal
from .sampling import SamplingParams


class SuffixDrafter:
    """Propose the majority continuation of the longest earlier match of the sequence's end.

    Args:
        min_match: shortest suffix worth matching; 2 for the reason n-gram lookup skips
            single-token matches (their guesses are rarely accepted, see
            :class:`~draftsmith.heads.ngram.NGramDrafter`).
        max_match: longest suffix compared; longer matches are rare and add little evidence.
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, min_match: int = 2, max_match: int = 32) -> None:
        if min_match < 1 or max_match < min_match:
            raise ValueError(
                f"need 1 <= min_match <= max_match, got min_match={min_match}, "
                f"max_match={max_match}"
            )
        self.min_match = min_match
        self.max_match = max_match

    @property
    def name(self) -> str:
        """How reports call it: ``suffix[MIN-MAX]``."""
        return f"suffix[{self.min_match}-{self.max_match}]"

    def start(self, prompt_ids: torch.Tensor, features: Features | None) -> None:
        """Nothing to prepare: the lookup reads ``ids`` at every step."""

    def propose(
        self,
        ids: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Match the longest suffix of ``ids`` seen before; vote on what followed it.

        Args:
            ids: ``[1, T]`` accepted sequence.
            k: most tokens to propose.
            sampling: unused (the guess is deterministic).
            generator: unused.

        Returns:
            Up to k tokens, or none when no suffix of length >= min_match occurred before.
        """
        seq = ids[0]
        ends = self._match_ends(seq)
        if ends is None:
            return Proposal(tokens=seq.new_empty(0))
        tokens = seq.tolist()
        length = len(tokens)
        # Positions of the candidate next token, one per occurrence still consistent with the
        # guess; an occurrence drops out when it disagrees or reaches the end of the sequence.
        nexts = [int(e) + 1 for e in ends]
        guess: list[int] = []
        while len(guess) < k and nexts:
            votes = Counter(tokens[i] for i in nexts)
            best = max(votes.values())
            # Ties: the token of the most recent occurrence among the most frequent.
            tok = tokens[max(i for i in nexts if votes[tokens[i]] == best)]
            guess.append(tok)
            nexts = [i + 1 for i in nexts if tokens[i] == tok and i + 1 < length]
        return Proposal(tokens=torch.tensor(guess, dtype=seq.dtype, device=seq.device))

    def _match_ends(self, seq: torch.Tensor) -> torch.Tensor | None:
        """End positions of every earlier occurrence of the longest matched suffix, or None.

        Occurrences are grown one token to the left at a time, keeping those that still match,
        so each length costs only as much as the occurrences left.
        """
        length = seq.shape[0]
        # Ends before the last position: each occurrence has a following token to propose.
        ends = (seq[:-1] == seq[-1]).nonzero().flatten()
        n = 1
        while n < min(self.max_match, length - 1):
            longer = ends[ends >= n]
            longer = longer[seq[longer - n] == seq[length - 1 - n]]
            if not longer.numel():
                break
            ends, n = longer, n + 1
        return ends if ends.numel() and n >= self.min_match else None

    def accept(self, num_accepted: int, features: Features | None) -> None:
        """Stateless: nothing to update."""


def build_suffix(path: str | None, options: BuildOptions) -> SuffixDrafter:
    """``suffix``: suffix lookup with its defaults."""
    return SuffixDrafter()


SUFFIX = DrafterKind(
    build_suffix,
    help="longest-suffix lookup, most frequent continuation",
    vllm=lambda path: "vLLM's suffix method needs arctic-inference, not in our vLLM venv",
)
