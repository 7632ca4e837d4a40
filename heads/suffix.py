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

from .base import BuildOptions, DrafterKind
from .lookup import LookupDrafter


class SuffixDrafter(LookupDrafter):
    """Propose the majority continuation of the longest earlier match of the sequence's end.

    Args:
        min_match: shortest suffix worth matching; 2 for the reason n-gram lookup skips
            single-token matches (their guesses are rarely accepted, see
            :class:`~draftsmith.heads.ngram.NGramDrafter`).
        max_match: longest suffix compared; longer matches are rare and add little evidence.
    """

    def __init__(self, min_match: int = 2, max_match: int = 32) -> None:
        super().__init__("suffix", min_match=min_match, max_match=max_match)

    def match(self, seq: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
        """Match the longest suffix of ``seq`` seen before; vote on what followed it."""
        found = self._match_ends(seq)
        if found is None:
            return seq.new_empty(0), 0
        ends, n = found
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
        return torch.tensor(guess, dtype=seq.dtype, device=seq.device), n

    def _match_ends(self, seq: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """End positions of every earlier occurrence of the longest matched suffix, and its
        length; None when no suffix of the shortest length occurred before.

        Occurrences are grown one token to the left at a time, keeping those that still match,
        so each length costs only as much as the occurrences left.
        """
        length = seq.shape[0]
        # Ends before the last position: each occurrence has a following token to propose.
        ends = (seq[:-1] == seq[-1]).nonzero().flatten()
        n = 1
        while n < min(self.longest, length - 1):
            longer = ends[ends >= n]
            longer = longer[seq[longer - n] == seq[length - 1 - n]]
            if not longer.numel():
                break
            ends, n = longer, n + 1
        return (ends, n) if ends.numel() and n >= self.shortest else None


def build_suffix(path: str | None, options: BuildOptions) -> SuffixDrafter:
    """``suffix``: suffix lookup with its defaults."""
    return SuffixDrafter()


SUFFIX = DrafterKind(
    build_suffix,
    help="longest-suffix lookup, most frequent continuation",
)
