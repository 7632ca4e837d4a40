"""Filters and deduplication of prompts: which generated or gathered prompts are kept.

:func:`check_text` drops degenerate or badly sized prompts (the first failing check names the
reason); :class:`PromptIndex` finds exact (normalised) and near-duplicates. Magpie judges its
candidates in index order against both, which makes its output a function of the settings alone.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["FilterRules", "PromptIndex", "check_text", "normalize"]


@dataclass(frozen=True)
class FilterRules:
    """When a generated prompt is dropped. See :func:`check_text` for the order of the checks.

    Attributes:
        min_words: Fewer whitespace-separated words is "too short".
        max_words: More words is "too long".
        min_letter_share: Letters (any script) among non-space characters below this is
            "degenerate: few letters" (symbol soup, numbers only, broken bytes).
        repeat_ngram: ``n`` of the word n-gram repetition check.
        max_repeat_share: Word n-grams that occur at least 3 times covering at least this share
            of the words is "degenerate: repetition" (a looping text).
        near_duplicate: Jaccard similarity of word-trigram sets (normalised text) at or above
            which two prompts are near-duplicates.
    """

    min_words: int = 3
    max_words: int = 200
    min_letter_share: float = 0.5
    repeat_ngram: int = 3
    max_repeat_share: float = 0.5
    near_duplicate: float = 0.7


_WS = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Text for duplicate checks: NFKC, case-folded, punctuation as spaces, spaces collapsed.

    >>> normalize("  What's   the TIME?! ")
    'what s the time'
    """
    text = unicodedata.normalize("NFKC", text).casefold()
    text = "".join(" " if unicodedata.category(c).startswith("P") else c for c in text)
    return _WS.sub(" ", text).strip()


def _repeat_share(words: Sequence[str], n: int) -> float:
    """Share of the words inside a word n-gram that occurs at least 3 times in the text.

    A loop of any period repeats all of its n-grams, so a text that is mostly one looping
    sentence scores near 1; a phrase said twice, or thrice in a long text, scores low.
    """
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    counts = Counter(grams)
    covered = [False] * len(words)
    for i, g in enumerate(grams):
        if counts[g] >= 3:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(words) if words else 0.0


def check_text(text: str, rules: FilterRules, markers: Iterable[str] = ()) -> str | None:
    """Why a finished generated prompt is dropped, or None to keep it.

    Checks, first failing one wins: a marker or special token in the text ("degenerate:
    template marker"); U+FFFD from invalid UTF-8 ("degenerate: broken text"); word count
    ("too short" / "too long"); letter share ("degenerate: few letters"); a repeated word
    n-gram ("degenerate: repetition", on normalised words).

    Args:
        text: The generated user message, end-of-turn token excluded.
        rules: Thresholds.
        markers: Strings that must not occur (see :class:`UserPrefix`).

    Returns:
        The reason, or None.
    """
    if any(m in text for m in markers):
        return "degenerate: template marker"
    if "\ufffd" in text:
        return "degenerate: broken text"
    words = text.split()
    if len(words) < rules.min_words:
        return "too short"
    if len(words) > rules.max_words:
        return "too long"
    chars = [c for c in text if not c.isspace()]
    if sum(c.isalpha() for c in chars) < rules.min_letter_share * len(chars):
        return "degenerate: few letters"
    if _repeat_share(normalize(text).split(), rules.repeat_ngram) >= rules.max_repeat_share:
        return "degenerate: repetition"
    return None


def _shingles(norm: str) -> frozenset[tuple[str, ...]]:
    words = norm.split()
    if len(words) < 3:
        return frozenset([tuple(words)])
    return frozenset(tuple(words[i : i + 3]) for i in range(len(words) - 2))


class PromptIndex:
    """Exact (normalised) and near-duplicate lookup over a growing set of prompts.

    Near-duplicates: the Jaccard similarity of the two prompts' sets of word trigrams, taken on
    :func:`normalize`'d text, is at least ``threshold`` (0.7: roughly, at most one word in ten
    differs; prompts under three words compare as one shingle, i.e. exactly). Candidates are found
    through an inverted index from trigram to prompts, so a check costs the postings of its
    trigrams, not a pass over every prompt.

    Args:
        threshold: Near-duplicate Jaccard threshold in (0, 1]; 1 keeps only the exact check.
    """

    def __init__(self, threshold: float = 0.7) -> None:
        self.threshold = threshold
        self._exact: dict[str, str] = {}
        self._sets: list[frozenset] = []
        self._keys: list[str] = []
        self._postings: dict[tuple[str, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, text: str) -> tuple[str, str] | None:
        """``("duplicate" | "near-duplicate", key of the match)``, or None."""
        norm = normalize(text)
        if norm in self._exact:
            return "duplicate", self._exact[norm]
        if self.threshold >= 1.0:
            return None
        mine = _shingles(norm)
        overlap = Counter(j for s in mine for j in self._postings.get(s, ()))
        for j, common in overlap.items():
            if common / (len(mine) + len(self._sets[j]) - common) >= self.threshold:
                return "near-duplicate", self._keys[j]
        return None

    def add(self, text: str, key: str) -> None:
        """Index ``text`` under ``key`` (no check; call :meth:`match` first)."""
        norm = normalize(text)
        self._exact.setdefault(norm, key)
        sh = _shingles(norm)
        j = len(self._keys)
        self._keys.append(key)
        self._sets.append(sh)
        for s in sh:
            self._postings.setdefault(s, []).append(j)
