"""Cost-aware draft length: verify as many draft tokens as pay for themselves on this machine.

Verification is not free on a CPU: one SmolLM2 forward costs ~55 ms for 1 token and ~100 ms for
6. A drafter whose first guess is accepted 20% of the time makes decoding *slower* at a fixed k.
Following the idea of dynamic speculation lookahead (Mamou et al. 2024, "DISCO"; Liu et al. 2024,
"SpecDec++"), :class:`AdaptiveDraftLength` picks, before each step, the draft length n in [0, k]
that maximises the expected tokens per second

    E(n) / (V(n + 1) + n · D),    E(n) = 1 + Σ_{i<n} Π_{j≤i} β_j

from quantities it measures online: β_j, the drafter's acceptance rate at position j given that
positions < j were accepted; V(m), the wall time of a target forward over m tokens; D, the
drafter's time per proposed token. n = 0 means a plain decoding step. So that a drafter judged
useless gets a chance to prove otherwise, after ``explore_every`` plain steps in a row it drafts
one token; each failed probe doubles that interval (up to ``max_explore_every``), so a useless
drafter costs little, and an accepted probe resets it. The choice never affects *which* tokens
come out (acceptance is lossless for any n), only how fast.
"""

from __future__ import annotations

import json
from pathlib import Path


class AdaptiveDraftLength:
    """Online estimates of acceptance and costs, and the draft length they favour.

    One instance may serve many sequences (pass it to every ``generate`` call): what it learned
    about the drafter and the machine carries over.

    Args:
        k: the longest draft allowed.
        prior_accept: β assumed before any evidence, with the weight of ``prior_weight`` trials.
        prior_weight: pseudo-trials behind the prior.
        decay: per-step forgetting factor of the acceptance counts (adapts within a sequence).
        explore_every: probe with a one-token draft after this many plain steps in a row.
        max_explore_every: the probe interval doubles after each rejected probe up to this.
        cost_profile: measured seconds per target forward by width (``{tokens: s}``, e.g. from
            :func:`load_cost_profile`); seeds the verify-cost estimates, which measurements then
            refine. Without it the first steps extrapolate from a guessed slope.
    """

    def __init__(
        self,
        k: int,
        prior_accept: float = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.99,
        explore_every: int = 8,
        max_explore_every: int = 128,
        cost_profile: dict[int, float] | None = None,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self.prior_accept, self.prior_weight = prior_accept, prior_weight
        self.decay, self.explore_every = decay, explore_every
        self.max_explore_every = max_explore_every
        self._interval = explore_every
        self._probing = False
        self.hits = [0.0] * k
        self.trials = [0.0] * k
        # tokens in the forward -> EMA seconds
        self.verify_time: dict[int, float] = dict(cost_profile or {})
        self.draft_time_per_token: float | None = None
        self._plain_streak = 0
        self.chosen: list[int] = []  # history, for reports

    def acceptance(self) -> list[float]:
        """β_j: estimated acceptance rate at position j given positions < j were accepted.

        Position 0 shrinks toward ``prior_accept``; position j toward β_{j-1}: deeper positions
        are tried only when the earlier ones pass, so they have less evidence, and conditional
        acceptance is rarely much lower deeper in the draft.
        """
        out, prior = [], self.prior_accept
        for h, t in zip(self.hits, self.trials, strict=True):
            prior = (h + self.prior_weight * prior) / (t + self.prior_weight)
            out.append(prior)
        return out

    def _verify_cost(self, m: int) -> float:
        if m in self.verify_time:
            return self.verify_time[m]
        known = sorted(self.verify_time)
        if not known:
            return 1.0 + 0.1 * (m - 1)  # relative units until the first measurement
        lo = max((x for x in known if x < m), default=None)
        hi = min((x for x in known if x > m), default=None)
        if lo is not None and hi is not None:  # interpolate
            f = (m - lo) / (hi - lo)
            return (1 - f) * self.verify_time[lo] + f * self.verify_time[hi]
        ref = lo if lo is not None else hi
        # Extrapolate with a gentle slope: CPU forwards grow far slower than linearly in width.
        return self.verify_time[ref] * max(0.5, 1.0 + 0.1 * (m - ref))

    def choose(self, limit: int) -> int:
        """Draft length for the next step, at most ``min(k, limit)``."""
        limit = min(self.k, limit)
        if limit <= 0:
            return 0
        beta = self.acceptance()
        d = self.draft_time_per_token or 0.0
        best_n, best_rate, expected, survive = 0, 1.0 / self._verify_cost(1), 1.0, 1.0
        for n in range(1, limit + 1):
            survive *= beta[n - 1]
            expected += survive
            rate = expected / (self._verify_cost(n + 1) + n * d)
            if rate > best_rate:
                best_n, best_rate = n, rate
        self._probing = False
        if best_n == 0:
            self._plain_streak += 1
            if self._plain_streak >= self._interval:
                self._plain_streak = 0
                self._probing = True
                best_n = 1  # probe: the cheapest way to measure the drafter again
        else:
            self._plain_streak = 0
        self.chosen.append(best_n)
        return best_n

    def update(self, proposed: int, accepted: int, verify_s: float, draft_s: float) -> None:
        """Record one step: drafts proposed/accepted and the measured times."""
        m = proposed + 1
        old = self.verify_time.get(m)
        self.verify_time[m] = verify_s if old is None else 0.8 * old + 0.2 * verify_s
        if self._probing:
            rejected = proposed > 0 and accepted == 0
            self._interval = (
                min(2 * self._interval, self.max_explore_every) if rejected else self.explore_every
            )
        if proposed:
            per_token = draft_s / proposed
            old_d = self.draft_time_per_token
            self.draft_time_per_token = (
                per_token if old_d is None else 0.8 * old_d + 0.2 * per_token
            )
            for j in range(self.k):
                self.hits[j] *= self.decay
                self.trials[j] *= self.decay
            for j in range(min(accepted + 1, proposed)):
                self.trials[j] += 1.0
            for j in range(accepted):
                self.hits[j] += 1.0


def load_cost_profile(
    path: str | Path, dtype: str, threads: int, device_type: str = "cpu", kind: str = "chain"
) -> dict[int, float]:
    """Seconds per verify forward by width, from ``scripts/bench_forward.py``'s JSON.

    Args:
        path: the benchmark's JSON file.
        dtype: ``float32`` or ``bfloat16``.
        threads: torch threads the evaluation runs with (the nearest measured count is used;
            a GPU profile has one entry).
        device_type: where the evaluation runs (``cpu``, ``cuda``): a profile measured on
            another kind of device says nothing about this one and is refused.
        kind: ``chain`` (a causal forward over w tokens) or ``tree``: the profile's tree
            verifies (the loop's 4-D ancestor mask) of n nodes, keyed by their width n + 1;
            empty when the profile measured none.

    Returns:
        ``{width: seconds}``.

    Raises:
        ValueError: naming the file when it holds no profile for ``dtype`` or was measured on
            another kind of device.
    """
    data = json.loads(Path(path).read_text())
    # Profiles written before the device setting were all measured on the CPU.
    measured = str(data.get("machine", {}).get("device_type") or "cpu")
    if measured != device_type:
        raise ValueError(
            f"{path}: cost profile measured on {measured}, this run is on {device_type}; "
            f"measure one with scripts/bench_forward.py --device {device_type}"
        )
    per_threads = data.get("profile", {}).get(dtype)
    if not per_threads:
        raise ValueError(
            f"{path}: no cost profile for dtype {dtype} (has {list(data.get('profile', {}))})"
        )
    nearest = min(per_threads, key=lambda t: abs(int(t) - threads))
    if kind == "tree":
        tree = per_threads[nearest].get("tree") or {}
        return {int(n) + 1: ms / 1000.0 for n, ms in tree.items()}
    chain = per_threads[nearest]["chain"]
    return {int(w): ms / 1000.0 for w, ms in chain.items()}


def verify_cost(costs: dict[int, float], width: int) -> float:
    """Seconds of one target forward over ``width`` tokens: measured, else interpolated
    linearly between the nearest measured widths (held flat past the widest one)."""
    if width in costs:
        return costs[width]
    known = sorted(costs)
    lo = max((w for w in known if w < width), default=known[0])
    hi = min((w for w in known if w > width), default=known[-1])
    if lo == hi:
        return costs[lo]
    f = (width - lo) / (hi - lo)
    return (1 - f) * costs[lo] + f * costs[hi]


def predicted_speedups(
    alpha: list[float],
    costs: dict[int, float],
    draft_seconds_per_token: float,
    drafted_share: float = 1.0,
    *,
    per_round: bool = False,
) -> dict[int, float]:
    """Speedup over plain decoding predicted for each chain length k from measured rates.

    ``speedup(k) = τ(k) · V(1) / (V(k + 1) + k · D)`` with ``τ(k) = 1 + Σ_{i<k} α_i`` (α_i the
    per-position acceptance rates of a run at k >= that length: a prefix of a longer chain is
    accepted exactly as often), V the verify cost per width (``costs``, from
    :func:`load_cost_profile`), D the drafter's time per drafted token. Prefill and the loop's own
    overhead are left out, so the figures are slightly optimistic for short outputs.

    Args:
        alpha: α_i per draft position, measured at the longest k considered.
        costs: seconds per target forward by width; widths without a measurement are
            interpolated linearly.
        draft_seconds_per_token: D.
        drafted_share: s, the fraction of verification steps that carried a draft (n-gram
            lookup drafts only where it finds a match; ``alpha`` is then per drafted step). The
            other steps are plain 1-token forwards, so the prediction mixes both by their time:
            ``(s·τ(k) + 1 - s) · V(1) / (s·(V(k + 1) + k·D) + (1 - s)·V(1))``.
        per_round: a parallel drafter (P-EAGLE, DFlash) drafts every position of a step in one
            forward, so D is its seconds per *step*, paid once whatever k: ``V(k + 1) + D``.

    Returns:
        ``{k: predicted speedup}`` for k = 1..len(alpha).
    """

    def verify(width: int) -> float:
        return verify_cost(costs, width)

    out, tau = {}, 1.0
    for k, a in enumerate(alpha, start=1):
        tau += a
        step = verify(k + 1) + (1 if per_round else k) * draft_seconds_per_token
        share = drafted_share
        out[k] = (share * tau + 1 - share) * verify(1) / (share * step + (1 - share) * verify(1))
    return out
