"""N-gram prompt lookup: a drafter with no model (Saxena 2023, "prompt lookup decoding").

Chat answers often repeat spans of the prompt or of themselves (code being fixed, names, quoted
text). The drafter finds the most recent earlier occurrence of the sequence's last n tokens and
proposes the tokens that followed it. Its distribution q is one-hot on its guess, so in sampling
mode the loop accepts a guess x with probability p(x).

``--drafter ngram`` (:data:`NGRAM`) matches suffixes of ``ngram_min``..``ngram_max`` tokens.
"""

from __future__ import annotations

import torch

from .base import BuildOptions, DrafterKind, Features, Proposal
from .sampling import SamplingParams


class NGramDrafter:
    """Propose the continuation of the most recent earlier match of the last n tokens.

    Args:
        max_ngram: longest suffix to match; longer matches are tried first (more specific).
        min_ngram: shortest suffix to match. The default 2 skips single-token matches: on
            SmolLM2 chat answers their first guess was accepted 17% of the time against 50% for
            2-gram and 70% for 3-gram matches, too rarely to pay for the wider verification
            forward on a CPU (docs/performance.md).
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, "
                f"max_ngram={max_ngram}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    @property
    def name(self) -> str:
        """How reports call it: ``ngram[MIN-MAX]``."""
        return f"ngram[{self.min_ngram}-{self.max_ngram}]"

    def start(self, prompt_ids: torch.Tensor, features: Features | None) -> None:
        """Nothing to prepare: the lookup reads ``ids`` at every step."""

    def propose(
        self,
        ids: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Search ``ids`` for the last n tokens, longest n first; propose what followed.

        Args:
            ids: ``[1, T]`` accepted sequence.
            k: most tokens to propose.
            sampling: unused (the guess is deterministic).
            generator: unused.

        Returns:
            Up to k tokens, or none when no suffix of length >= min_ngram occurred before.
        """
        seq = ids[0]
        length = seq.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # Windows over seq[:-1] start at 0..length-1-n, so the suffix itself never matches
            # and every match has at least one following token.
            windows = seq[:-1].unfold(0, n, 1)  # [length - n, n]
            hits = (windows == seq[length - n :]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return Proposal(tokens=seq[start : start + k].clone())
        return Proposal(tokens=seq.new_empty(0))

    def accept(self, num_accepted: int, features: Features | None) -> None:
        """Stateless: nothing to update."""


def build_ngram(path: str | None, options: BuildOptions) -> NGramDrafter:
    """``ngram``: prompt lookup over suffixes of ``ngram_min``..``ngram_max`` tokens."""
    return NGramDrafter(max_ngram=options.ngram_max, min_ngram=options.ngram_min)


NGRAM = DrafterKind(build_ngram, help="prompt lookup", vllm=lambda path: (None, "ngram"))
