"""Speculation that follows load: a vLLM draft-length schedule from the served measurements.

A drafter that pays off at batch 1 can cost throughput once the server is full: verifying k
drafted tokens per request competes with other requests for the same forward. vLLM (0.32+)
takes a load-following draft length, ``speculative_config["num_speculative_tokens_per_batch_size"]``:
a list of ``[range_start, range_end, k]`` entries over inclusive batch-size ranges (sorted,
non-overlapping, the first starting at 1, ``k >= 0`` where 0 switches speculation off, each k
clamped to ``num_speculative_tokens``; batch sizes past the last range keep its k).

:func:`recommend_schedule` reads the bench's served measurements of one drafter and its plain
server at the same concurrency levels: at each measured level c the drafter keeps its fixed k
when its tokens/s beat the plain server's by more than the noise margin, else 0. Each level's
choice covers the batch sizes nearer to it than to its neighbours on a log scale (boundaries at
the geometric midpoints: levels 1, 4, 16 give [1, 2], [3, 8], [9, max_num_seqs]), and adjacent
ranges with the same k are merged. :func:`validate_schedule` applies vLLM's own rules
(``vllm/v1/spec_decode/dynamic/utils.py``), so the bench never prints a schedule vLLM refuses.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NOISE", "SCHEDULE_KEY", "Schedule", "recommend_schedule", "validate_schedule"]

#: Relative tokens/s margin within which two servers count as tied: speculation is kept at a
#: level only when it beats the plain server by more than this, and a schedule server passes when
#: it is within this of the best of plain and fixed k.
NOISE = 0.03

#: The key vLLM reads the schedule from.
SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"


@dataclass
class Schedule:
    """A recommended draft length per batch size for one drafter.

    Attributes:
        k: the fixed draft length the drafter was measured with.
        noise: the tie margin the choices were made with.
        entries: ``(range_start, range_end, k)`` inclusive batch-size ranges covering 1 to the
            server's ``max_num_seqs`` (vLLM carries the last k on past it); None when
            speculation won at no measured level: then the advice is not to speculate at all.
        per_level: measured concurrency → ``{"k": chosen, "tokens_per_second": the drafter's,
            "plain_tokens_per_second": the plain server's, "gain": drafter / plain - 1}``.
    """

    k: int
    noise: float
    entries: list[tuple[int, int, int]] | None
    per_level: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def speculates(self) -> bool:
        """Whether the schedule drafts at any batch size (False: serve without a drafter)."""
        return self.entries is not None

    def speculative_config(self, base: Mapping[str, Any]) -> dict[str, Any] | None:
        """A copy of ``base`` (the drafter's fixed-k ``speculative_config``) following load.

        ``num_speculative_tokens`` becomes the schedule's largest k (vLLM clamps each entry to
        it, so it must be the maximum) and ``num_speculative_tokens_per_batch_size`` the entries.

        Returns:
            The config, or None when the schedule is "don't speculate" (``entries`` None).
        """
        if self.entries is None:
            return None
        config = copy.deepcopy(dict(base))
        config["num_speculative_tokens"] = max(k for _, _, k in self.entries)
        config[SCHEDULE_KEY] = [list(entry) for entry in self.entries]
        return config

    def summary(self) -> str:
        """One line: the ranges, or why there is no schedule."""
        if self.entries is None:
            gains = ", ".join(
                f"c={c}: {_pct(level['gain'])}" for c, level in sorted(self.per_level.items())
            )
            return (
                f"don't speculate: the drafter beat the plain server by more than "
                f"{100 * self.noise:.0f}% at no measured load ({gains})"
            )
        return ", ".join(f"batch {a}-{b}: k={k}" for a, b, k in self.entries)

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict (``per_level`` a list ordered by concurrency)."""
        return {
            "k": self.k,
            "noise": self.noise,
            "entries": None if self.entries is None else [list(e) for e in self.entries],
            "per_level": [{"concurrency": c, **v} for c, v in sorted(self.per_level.items())],
            "summary": self.summary(),
        }


def _pct(gain: float | None) -> str:
    return "-" if gain is None else f"{100 * gain:+.1f}%"


def recommend_schedule(
    levels: Sequence[Mapping[str, Any]],
    plain: Mapping[int, Mapping[str, Any]],
    k: int,
    *,
    noise: float = NOISE,
    max_num_seqs: int | None = None,
) -> Schedule:
    """The draft length per batch size that the served measurements of one drafter advise.

    Args:
        levels: the drafter's server at each concurrency (:func:`~.served.measure` results:
            ``concurrency`` and ``tokens_per_second`` are read).
        plain: the plain server's results by concurrency.
        k: the fixed draft length the drafter was served with.
        noise: the relative margin the drafter must beat the plain server by to keep k.
        max_num_seqs: the last range's end (the server's batch limit); None: the largest
            measured concurrency.

    Returns:
        The :class:`Schedule` (``entries`` None when speculation wins at no measured level).

    Raises:
        ValueError: ``k < 1``, or no concurrency measured by both servers.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1 to recommend a schedule, got {k}")
    per_level: dict[int, dict[str, Any]] = {}
    for level in levels:
        c = int(level["concurrency"])
        base = plain.get(c)
        if base is None:
            continue  # nothing to compare with: that level decides nothing
        spec_tps, plain_tps = float(level["tokens_per_second"]), float(base["tokens_per_second"])
        per_level[c] = {
            "k": k if spec_tps > plain_tps * (1.0 + noise) else 0,
            "tokens_per_second": spec_tps,
            "plain_tokens_per_second": plain_tps,
            "gain": spec_tps / plain_tps - 1.0 if plain_tps else None,
        }
    if not per_level:
        raise ValueError("no concurrency level measured by both the drafter's and the plain server")
    cs = sorted(per_level)
    if all(per_level[c]["k"] == 0 for c in cs):
        return Schedule(k=k, noise=noise, entries=None, per_level=per_level)
    last = max(max_num_seqs or cs[-1], cs[-1])
    entries: list[tuple[int, int, int]] = []
    start = 1  # the smallest level's choice covers every batch size below it too
    for i, c in enumerate(cs):
        # Up to the geometric midpoint with the next level (floor): each batch size goes to the
        # level nearer on a log scale; isqrt(a*b) lies in [a, b), so no range is empty.
        end = math.isqrt(c * cs[i + 1]) if i + 1 < len(cs) else last
        choice = per_level[c]["k"]
        if entries and entries[-1][2] == choice:
            entries[-1] = (entries[-1][0], end, choice)
        else:
            entries.append((start, end, choice))
        start = end + 1
    return Schedule(k=k, noise=noise, entries=validate_schedule(entries), per_level=per_level)


def validate_schedule(entries: object) -> list[tuple[int, int, int]]:
    """``entries`` checked by vLLM's rules for ``num_speculative_tokens_per_batch_size``.

    Mirrors ``validate_and_normalize_dynamic_sd_schedule`` of vLLM 0.32: a non-empty list of
    3-item ``(range_start, range_end, k)`` entries, positive inclusive ranges with start <= end,
    k >= 0, non-overlapping once sorted by start (vLLM sorts them), the first starting at 1.

    Returns:
        The entries as int tuples, sorted by start.

    Raises:
        ValueError: one line naming the first problem.
    """
    if not isinstance(entries, list | tuple) or not entries:
        raise ValueError("schedule: give a non-empty list of (range_start, range_end, k) entries")
    parsed = []
    for entry in entries:
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise ValueError(f"schedule entry {entry!r}: not a (range_start, range_end, k) triple")
        try:
            start, end, k = (int(v) for v in entry)
        except (TypeError, ValueError):
            raise ValueError(f"schedule entry {entry!r}: values must be integers") from None
        if start <= 0 or end <= 0:
            raise ValueError(f"schedule entry {entry!r}: batch-size range must be positive")
        if start > end:
            raise ValueError(f"schedule entry {entry!r}: range start {start} > end {end}")
        if k < 0:
            raise ValueError(f"schedule entry {entry!r}: k must be >= 0, got {k}")
        parsed.append((start, end, k))
    parsed.sort(key=lambda e: e[0])
    previous = None
    for entry in parsed:
        if previous is not None and entry[0] <= previous[1]:
            raise ValueError(f"schedule entries {previous} and {entry} overlap")
        previous = entry
    if parsed[0][0] != 1:
        raise ValueError(
            f"schedule: the first range starts at {parsed[0][0]}, not 1 (every batch size "
            "needs a k)"
        )
    return parsed
