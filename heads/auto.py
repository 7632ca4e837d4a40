"""Speculation that never loses: decide, per step, what to verify (``--drafter auto:KIND[=DIR]``).

A fixed draft shape verifies k tokens every step, and pays a wider target forward for them
whether they are likely to be accepted or not. Where verification is not free (a CPU without
native bf16: 3 tokens cost 1.7x one) that loses to plain decoding. :class:`AutoDrafter` wraps a
learned drafter and the model-free lookups (n-gram, suffix) and, before every verification,
chooses the subset of their candidates that maximises the expected tokens per second on this
machine:

* **Candidates.** The learned drafter's chain or tree, each node with its own confidence
  (``Proposal.confidence``), and each lookup's continuation of its match, merged into one tree
  (a lookup token equal to a learned node at the same place is one node; a different one is a
  sibling). One target forward verifies whatever is chosen.
* **Acceptance.** A node's probability of being accepted given that its parent was, ``a_j``, is
  its confidence mapped through a :class:`Calibration` fitted on validation prompts (isotonic;
  ``train/decoding/calibration.py``), and for a lookup node the measured rate of its source and
  match length. The probability of reaching node j is ``r_j = r_parent(j) · a_j`` (siblings
  are exclusive events under greedy decoding: their a are scaled to sum to at most 1), so a set
  S of nodes closed under parents has ``E[accepted | S] = Σ_{j∈S} r_j``.
* **Cost.** ``C(S)``: the target's measured verify time for S's shape, a chain of n tokens or a
  tree of n nodes (:class:`VerifyCosts`, probed on the run's device, dtype and threads,
  non-monotone points kept). "Nothing" is a plain step, ``C(∅) = C_chain(0)``.
* **Choice.** Maximise ``V(S) = 1 + E[accepted | S] − R · C(S)`` where R is the run's tokens per
  second so far (Dinkelbach's rule for a ratio objective: a step that spends ΔC more seconds must
  bring R·ΔC more tokens, what the same time earns on average): tokens emitted over the chosen
  shapes' verify costs plus the measured draft times, decayed (0.98 a step) so it follows the
  text, and never below plain decoding's ``1 / C_chain(0)``. For every size m the best set
  is the m nodes of largest r (r falls along a path, so they are closed under parents); the best
  chain of each length is also tried, as chains verify without a tree mask.
* **Draft cost.** The learned drafter's time is spent before the choice. After each drafted step
  the expected value it added over the lookups alone, less ``R · draft seconds``, is averaged; a
  drafter whose average is negative sits out the next steps (1, 2, 4, ... up to
  ``max_sit_out``, reset by a step that paid, and at each new sequence). Its draft depth is one
  past the deepest level whose chosen nodes were worth that level's share of the draft time.

Lossless by construction (docs/design.md, "What to verify, per step"): greedy candidates are
functions of the accepted prefix, so any choice among them leaves the loop's greedy identity
intact. A sampled learned chain (``Proposal.probs``) is chosen causally: node i is kept or cut
from the confidences of rows 1..i (row maxima, known before each draw) and the tokens drawn
before it, never from its own token or later rows; the lookup branch is chosen before any
learned token is read. Lookup nodes carry a one-hot q row, so the loop's multi-candidate rule
(SpecInfer §4.2) verifies the mixed tree exactly.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import Features, Proposal
from .sampling import SamplingParams

__all__ = [
    "AutoDrafter",
    "Calibration",
    "Candidates",
    "VerifyCosts",
    "choose_nodes",
    "interpolate_cost",
]


def interpolate_cost(costs: dict[int, float], size: int) -> float:
    """Seconds at ``size`` from measured ``{size: seconds}``: the measured value, else linear
    between the nearest measured sizes, held flat past either end."""
    if size in costs:
        return costs[size]
    known = sorted(costs)
    lo = max((w for w in known if w < size), default=known[0])
    hi = min((w for w in known if w > size), default=known[-1])
    if lo == hi:
        return costs[lo]
    f = (size - lo) / (hi - lo)
    return (1 - f) * costs[lo] + f * costs[hi]


@dataclass
class VerifyCosts:
    """The target's verify-forward time on this machine, by shape (``train/decoding/verify_cost.py``
    measures it).

    Attributes:
        chain: ``{width: seconds}``: a causal forward over ``width`` tokens (1 = a plain step;
            a chain of n drafts is width n + 1).
        tree: ``{nodes: seconds}``: the root and n draft nodes under the loop's tree mask.
            Empty: trees cost as chains of the same width.
    """

    chain: dict[int, float]
    tree: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.chain or 1 not in self.chain:
            raise ValueError("VerifyCosts needs the chain cost of width 1 (a plain step)")
        bad = [w for w, s in {**self.chain, **self.tree}.items() if not s > 0 or w < 1]
        if bad:
            raise ValueError(f"VerifyCosts: sizes {bad} have no positive time")

    def chain_cost(self, drafts: int) -> float:
        """Seconds to verify a chain of ``drafts`` tokens (0: a plain step)."""
        return interpolate_cost(self.chain, drafts + 1)

    def tree_cost(self, nodes: int) -> float:
        """Seconds to verify a tree of ``nodes`` draft nodes."""
        if not self.tree:
            return self.chain_cost(nodes)
        return interpolate_cost(self.tree, nodes)

    def to_dict(self) -> dict[str, Any]:
        return {"chain": dict(self.chain), "tree": dict(self.tree)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VerifyCosts:
        return cls(
            chain={int(w): float(s) for w, s in data["chain"].items()},
            tree={int(n): float(s) for n, s in (data.get("tree") or {}).items()},
        )


#: A lookup rate with no evidence: about what a 2-gram continuation is accepted at on SmolLM2
#: chat answers (heads/ngram.py).
LOOKUP_PRIOR = 0.5


@dataclass
class Calibration:
    """Confidence -> acceptance probability, fitted on validation data
    (``train/decoding/calibration.py``).

    Attributes:
        knots: ``[(confidence, acceptance), ...]`` ascending in both (an isotonic fit),
            interpolated linearly and held flat past the ends.
        lookup: ``{"SOURCE:LENGTH:DEPTH": rate}``: acceptance of a lookup node given its parent,
            by source (``ngram``, ``suffix``), match length (capped at :attr:`MAX_LENGTH`) and
            depth (1, or 2 for deeper); missing keys fall back to ``SOURCE:LENGTH``, then to
            :data:`LOOKUP_PRIOR`.
        sampling: the sampling settings it was fitted at (``"T/top_k/top_p"``).
    """

    knots: list[tuple[float, float]] = field(default_factory=lambda: [(0.0, 0.0), (1.0, 1.0)])
    lookup: dict[str, float] = field(default_factory=dict)
    sampling: str = "0/0/1"

    MAX_LENGTH = 4

    def learned_rate(self, conf: float) -> float:
        """Acceptance probability of a learned node with confidence ``conf``."""
        pts = self.knots
        if conf <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(pts):
            if conf <= x1:
                return y0 if x1 == x0 else y0 + (y1 - y0) * (conf - x0) / (x1 - x0)
        return pts[-1][1]

    @classmethod
    def lookup_key(cls, source: str, length: int, depth: int | None = None) -> str:
        key = f"{source}:{min(length, cls.MAX_LENGTH)}"
        return key if depth is None else f"{key}:{min(depth, 2)}"

    def lookup_rate(self, source: str, length: int, depth: int) -> float:
        """Acceptance probability of a lookup node (its source, match length and depth)."""
        for key in (self.lookup_key(source, length, depth), self.lookup_key(source, length)):
            if key in self.lookup:
                return self.lookup[key]
        return LOOKUP_PRIOR

    def to_dict(self) -> dict[str, Any]:
        return {"knots": [list(k) for k in self.knots], "lookup": dict(self.lookup)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], sampling: str = "0/0/1") -> Calibration:
        knots = [(float(x), float(y)) for x, y in data["knots"]]
        if not knots or any(b[0] < a[0] or b[1] < a[1] for a, b in itertools.pairwise(knots)):
            raise ValueError("calibration knots must be non-empty and ascending in both values")
        return cls(
            knots=knots,
            lookup={str(k): float(v) for k, v in data["lookup"].items()},
            sampling=sampling,
        )


def sampling_key(sampling: SamplingParams) -> str:
    """How a calibration names the sampling settings it was fitted at: ``"T/top_k/top_p"``."""
    return f"{sampling.temperature:g}/{sampling.top_k}/{sampling.top_p:g}"


@dataclass
class Candidates:
    """One step's merged candidate tree, on the host (parents precede children).

    Attributes:
        tokens: each node's token.
        parents: each node's parent (-1: a child of the root, the last accepted token).
        accept: each node's acceptance probability given its parent (calibrated).
        confidence: the drafter's raw confidence (learned nodes; NaN for lookup-only nodes).
        learned: each node's index in the learned proposal, -1 for lookup-only nodes.
        lookup: each node's lookup key (``SOURCE:LENGTH``) when a lookup proposed it, else "".
        sampled: whether the node was sampled from a learned ``probs`` row.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    accept: list[float] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    learned: list[int] = field(default_factory=list)
    lookup: list[str] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(
        self,
        token: int,
        parent: int,
        accept: float,
        *,
        conf: float = math.nan,
        learned: int = -1,
        lookup: str = "",
        sampled: bool = False,
    ) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.accept.append(accept)
        self.confidence.append(conf)
        self.learned.append(learned)
        self.lookup.append(lookup)
        self.sampled.append(sampled)
        return len(self.tokens) - 1

    def depth(self, j: int) -> int:
        d = 1
        while self.parents[j] != -1:
            j, d = self.parents[j], d + 1
        return d

    def reach(self) -> list[float]:
        """r_j = r_parent · a_j, siblings' a scaled to sum to at most 1 (exclusive events)."""
        mass: dict[int, float] = {}
        for p, a in zip(self.parents, self.accept, strict=True):
            mass[p] = mass.get(p, 0.0) + a
        r: list[float] = []
        for p, a in zip(self.parents, self.accept, strict=True):
            scale = 1.0 / mass[p] if mass[p] > 1.0 else 1.0
            r.append((1.0 if p == -1 else r[p]) * a * scale)
        return r


def _is_chain(parents: Sequence[int], chosen: Sequence[int]) -> bool:
    """Whether the chosen nodes (sorted, closed under parents) form one path from the root."""
    prev = -1
    for j in chosen:
        if parents[j] != prev:
            return False
        prev = j
    return True


def choose_nodes(
    cands: Candidates, costs: VerifyCosts, rate: float, allowed: Sequence[int] | None = None
) -> tuple[list[int], float]:
    """The subset of candidates with the best value ``1 + Σ r − rate · C(S)`` (module doc).

    Args:
        cands: the merged tree.
        costs: the verify costs.
        rate: R, tokens per second the run earns (what a second of verification must beat).
        allowed: only these nodes may be chosen (closed under parents); None: all.

    Returns:
        ``(chosen node indices ascending, value)``; empty = a plain step.
    """
    r = cands.reach()
    pool = range(len(cands)) if allowed is None else allowed
    best: tuple[list[int], float] = ([], 1.0 - rate * costs.chain_cost(0))
    # The m most probable nodes for every m (ties: earlier = parent first, closed under parents).
    order = sorted(pool, key=lambda j: (-r[j], j))
    total = 1.0
    for m, j in enumerate(order, start=1):
        total += r[j]
        chosen = sorted(order[:m])
        cost = costs.chain_cost(m) if _is_chain(cands.parents, chosen) else costs.tree_cost(m)
        value = total - rate * cost
        if value > best[1]:
            best = (chosen, value)
    # The best path, as a chain (no tree mask), for every length.
    kids: dict[int, list[int]] = {}
    for j in pool:
        kids.setdefault(cands.parents[j], []).append(j)
    path, total, node = [], 1.0, -1
    while kids.get(node):
        node = max(kids[node], key=lambda j: (r[j], -j))
        path.append(node)
        total += r[node]
        value = total - rate * costs.chain_cost(len(path))
        if value > best[1]:
            best = (list(path), value)
    return best


class AutoDrafter:
    """Per-step choice of what to verify, over a learned drafter and lookups (module doc).

    Args:
        learned: the learned drafter (any :class:`~draftsmith.heads.base.Drafter`), or None
            for lookups alone.
        lookups: model-free drafters with ``match(seq, k) -> (tokens, length)`` and a
            ``label`` (:class:`~draftsmith.heads.lookup.LookupDrafter`).
        costs: the verify costs on this machine.
        calibration: confidence -> acceptance; None: an identity map and prior lookup rates
            until the caller sets :attr:`calibration`.
        max_sit_out: longest run of steps the learned drafter sits out.
        clock: seconds, read after the step's host reads (on a GPU: a synchronizing clock).
        record: calibration mode: verify every candidate and keep each step's candidates in
            :attr:`records` (``train/decoding/calibration.py`` labels them).
    """

    def __init__(
        self,
        learned: Any,
        lookups: Sequence[Any],
        costs: VerifyCosts,
        calibration: Calibration | None = None,
        *,
        max_sit_out: int = 16,
        clock: Callable[[], float] = time.perf_counter,
        record: bool = False,
    ) -> None:
        self.learned = learned
        self.lookups = list(lookups)
        self.costs = costs
        self.calibration = calibration or Calibration()
        self.max_sit_out = max_sit_out
        self.clock = clock
        self.record = record
        self.records: list[dict[str, Any]] = []
        self.feature_layers: tuple[int, ...] = (
            tuple(learned.feature_layers) if learned is not None else ()
        )
        inner = getattr(learned, "name", "none") if learned is not None else "lookup"
        self.name = f"auto[{inner}]"
        self.stats: dict[str, Any] = _new_stats()
        self._plain_rate = 1.0 / costs.chain_cost(0)
        self._tokens = 0.0  # decayed tokens and seconds of the run: R = tokens / seconds
        self._seconds = 0.0
        self._reset_sequence()

    # --- the contract ---------------------------------------------------------------------

    def _reset_sequence(self) -> None:
        self._step: dict[str, Any] | None = None  # the open step, settled at the next propose
        self._sit_out = 0  # steps left to sit out
        self._interval = 1  # the next sit-out's length
        self._net = 0.0  # average value the learned drafter added, less its cost (tokens)
        self._depth = None  # learned draft depth; None: k

    def start(self, prompt_ids: torch.Tensor, features: Features | None) -> None:
        self._reset_sequence()
        if self.learned is not None:
            self.learned.start(prompt_ids, features)

    def accept(self, num_accepted: int, features: Features | None) -> None:
        step = self._step
        if step is None or "accepted" in step:
            # No propose this step (the budget left no draft; num_accepted is 0): an open
            # step's verdict goes first, counting none of its tokens as the drafter's own,
            # which every drafter may be told (it only recomputes what it could have kept).
            self._flush(step)
            if self.learned is not None:
                self.learned.accept(num_accepted, features)
            return
        # Which of the learned drafter's own tokens were accepted is known only once the
        # emitted tokens are in ids: settled at the next propose (a drafter needs its accept
        # only before its next propose).
        step["accepted"] = num_accepted
        step["features"] = features

    def _flush(self, step: dict[str, Any] | None, own: int = 0) -> None:
        """Hand an open step's verdict to the learned drafter, once."""
        if step is None or "features" not in step or step.get("told"):
            return
        step["told"] = True
        if self.learned is not None:
            self.learned.accept(own, step["features"])

    @property
    def rate(self) -> float:
        """R: tokens per second earned so far (decayed), at least plain decoding's."""
        measured = self._tokens / self._seconds if self._seconds > 0 else 0.0
        return max(self._plain_rate, measured)

    def propose(
        self,
        ids: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        self._settle(ids)
        seq = ids[0]
        cal = self.calibration
        # Lookups first (host lists; a few tokens each).
        found = []
        for lookup in self.lookups:
            tokens, length = lookup.match(seq, k)
            if length:
                found.append((lookup.label, tokens.tolist(), length))  # sync: a few ids
        # The learned drafter, unless it sits out.
        learned = None
        draft_s = 0.0
        if self.learned is not None and (self._sit_out == 0 or self.record):
            depth = k if self._depth is None or self.record else max(1, min(k, self._depth))
            t0 = self.clock()
            learned = self.learned.propose(ids, depth, sampling, generator)
            learned = _host_view(learned)  # sync: the choice reads tokens and confidences
            draft_s = self.clock() - t0
            self.stats["learned_drafts"] += 1
            self.stats["draft_seconds"] += draft_s
        elif self.learned is not None:
            self._sit_out -= 1
            self.stats["learned_sat_out"] += 1

        cands, lookup_nodes = self._merge(learned, found, cal)
        rate = self.rate
        best = choose_nodes(cands, self.costs, rate) if not self.record else ([], 0.0)
        if self.record:
            chosen = list(range(len(cands)))
        elif learned is not None and learned["probs"] is not None:
            chosen = self._choose_sampled(cands, lookup_nodes, rate)
        else:
            chosen = best[0]
        if learned is not None and not self.record:
            # What the learned drafter added over the lookups alone, less its time (the best
            # value with it is the unconstrained choice's, a sampled chain's too: what it could
            # add, judged for the steps to come).
            without = choose_nodes(cands, self.costs, rate, allowed=lookup_nodes)[1]
            with_it = best[1]
            self._judge(with_it - without - rate * draft_s)
            self._depth = self._next_depth(cands, chosen, draft_s, rate)
        self._open_step(ids, learned, cands, chosen, draft_s)
        return self._proposal(cands, chosen, learned, ids.device)

    # --- steps ----------------------------------------------------------------------------

    def _open_step(
        self, ids, learned, cands: Candidates, chosen: list[int], draft_s: float
    ) -> None:
        s = self.stats
        s["steps"] += 1
        s["nodes_verified"] += len(chosen)
        if not chosen:
            s["verified_nothing"] += 1
        elif _is_chain(cands.parents, chosen):
            s["chain_steps"] += 1
        else:
            s["tree_steps"] += 1
        s["learned_nodes_verified"] += sum(1 for j in chosen if cands.learned[j] >= 0)
        s["lookup_nodes_verified"] += sum(1 for j in chosen if cands.lookup[j])
        chain = _is_chain(cands.parents, chosen)
        verify = self.costs.chain_cost(len(chosen)) if chain else self.costs.tree_cost(len(chosen))
        self._step = {
            "seconds": verify + draft_s,
            "length": ids.shape[1],
            "learned": learned,
            "cands": cands,
            "chosen": chosen,
        }
        if self.record:
            qx = [1.0] * len(cands)  # q of each sampled node's own token (its label's divisor)
            if learned is not None and learned["probs"] is not None:
                rows = learned["probs"]
                own = [j for j in range(len(cands)) if cands.sampled[j]]
                picked = rows[[cands.learned[j] for j in own], [cands.tokens[j] for j in own]]
                for j, q in zip(own, picked.tolist(), strict=True):
                    qx[j] = q
            self.records.append({"root": ids.shape[1] - 1, "cands": cands, "qx": qx})

    def _settle(self, ids: torch.Tensor) -> None:
        """Close the last step: tell the learned drafter what it got; update R."""
        step, self._step = self._step, None
        if step is None:
            return
        accepted = step.get("accepted", 0)
        emitted = ids[0, step["length"] : step["length"] + accepted].tolist()  # sync: a few ids
        learned = step["learned"]
        if self.learned is not None and not step.get("told"):
            # The learned drafter's own tokens on the accepted path: its proposal's nodes are
            # the merged nodes with a learned index, so follow the path while they are.
            own = 0
            if learned is not None:
                cands, node = step["cands"], -1
                for tok in emitted:
                    node = next(
                        (
                            j
                            for j in step["chosen"]
                            if cands.parents[j] == node and cands.tokens[j] == tok
                        ),
                        None,
                    )
                    if node is None or cands.learned[node] < 0:
                        break
                    own += 1
            self._flush(step, own)
        # R, decayed so it follows the text: tokens over the step's predicted verify time and
        # its measured draft time (the verify's own clock would need a device sync per step).
        self._tokens = 0.98 * self._tokens + accepted + 1
        self._seconds = 0.98 * self._seconds + step["seconds"]
        self.stats["tokens"] += accepted + 1

    def _next_depth(self, cands: Candidates, chosen: list[int], draft_s: float, rate: float) -> int:
        """The next draft depth: one past the deepest level whose chosen learned-only nodes
        were worth that level's draft time (R · draft seconds / levels drafted), so a level
        that stopped paying is no longer drafted and one that might is tried again."""
        levels = [cands.depth(j) for j in range(len(cands)) if cands.learned[j] >= 0]
        if not levels:
            return 1
        per_level = rate * draft_s / max(levels)
        r = cands.reach()
        gain: dict[int, float] = {}
        for j in chosen:
            if cands.learned[j] >= 0 and not cands.lookup[j]:
                d = cands.depth(j)
                gain[d] = gain.get(d, 0.0) + r[j]
        worth = [d for d, g in gain.items() if g >= per_level]
        return max(worth, default=0) + 1

    def _judge(self, net: float) -> None:
        """Average the learned drafter's net value; a negative average makes it sit out."""
        self._net = 0.7 * self._net + 0.3 * net
        if self._net < 0:
            self._sit_out = self._interval
            self._interval = min(2 * self._interval, self.max_sit_out)
            self._net = 0.0  # the next drafted step is judged afresh
        else:
            self._interval = 1

    # --- candidates -----------------------------------------------------------------------

    def _merge(self, learned, found, cal: Calibration) -> tuple[Candidates, list[int]]:
        """The learned nodes, then each lookup's chain merged in; also the nodes a lookup
        proposed (the set the lookups alone could verify)."""
        cands = Candidates()
        if learned is not None:
            sampled = learned["probs"] is not None
            for i, (tok, parent, conf) in enumerate(
                zip(learned["tokens"], learned["parents"], learned["confidence"], strict=True)
            ):
                cands.add(
                    tok, parent, cal.learned_rate(conf), conf=conf, learned=i, sampled=sampled
                )
        lookup_nodes: set[int] = set()
        for source, tokens, length in found:
            node = -1
            for depth, tok in enumerate(tokens, start=1):
                rate = cal.lookup_rate(source, length, depth)
                key = Calibration.lookup_key(source, length, depth)
                # A learned node at the same place is the same candidate (never a sampled one:
                # merging would make the lookup's place depend on the draw).
                same = next(
                    (
                        j
                        for j in range(len(cands))
                        if cands.parents[j] == node
                        and cands.tokens[j] == tok
                        and not cands.sampled[j]
                    ),
                    None,
                )
                if same is None:
                    same = cands.add(tok, node, rate, lookup=key)
                else:
                    cands.accept[same] = max(cands.accept[same], rate)
                    cands.lookup[same] = cands.lookup[same] or key
                lookup_nodes.add(same)
                node = same
        return cands, sorted(lookup_nodes)

    def _choose_sampled(self, cands: Candidates, lookup_nodes: list[int], rate: float) -> list[int]:
        """The causal choice for a sampled learned chain (module doc).

        First the lookup branch, from what is known before any draw (the first learned row's
        confidence stands in for every learned row). Then learned node i is kept while the best
        length, with rows past i assumed as good as row i, is at least i.
        """
        chain = [j for j in range(len(cands)) if cands.learned[j] >= 0]
        accept = list(cands.accept)

        def value(n: int, lookup: list[int], a: list[float]) -> float:
            trial = Candidates(
                tokens=cands.tokens,
                parents=cands.parents,
                accept=a,
                confidence=cands.confidence,
                learned=cands.learned,
                lookup=cands.lookup,
                sampled=cands.sampled,
            )
            r = trial.reach()
            nodes = sorted(lookup + chain[:n])
            if not nodes:
                return 1.0 - rate * self.costs.chain_cost(0)
            shape = _is_chain(cands.parents, nodes)
            cost = self.costs.chain_cost(len(nodes)) if shape else self.costs.tree_cost(len(nodes))
            return 1.0 + sum(r[j] for j in nodes) - rate * cost

        def assumed(known: int) -> list[float]:
            a = list(accept)
            if chain:
                last = accept[chain[max(known, 1) - 1]]
                for j in chain[known:]:
                    a[j] = last
            return a

        prior = assumed(1)
        # Lookup branch: the best prefix of lookup nodes (in creation order: a chain per lookup).
        options = [[]] + [lookup_nodes[:m] for m in range(1, len(lookup_nodes) + 1)]
        options = [o for o in options if all(cands.parents[j] in (-1, *o) for j in o)]
        lookup = max(options, key=lambda o: max(value(n, o, prior) for n in range(len(chain) + 1)))
        kept = 0
        for i in range(1, len(chain) + 1):
            a = assumed(i)
            best = max(range(len(chain) + 1), key=lambda n: (value(n, lookup, a), -n))
            if best < i:
                break
            kept = i
        return sorted(lookup + chain[:kept])

    def _proposal(self, cands: Candidates, chosen: list[int], learned, device) -> Proposal:
        if not chosen:
            return Proposal(tokens=torch.empty(0, dtype=torch.long, device=device))
        index = {j: i for i, j in enumerate(chosen)}
        tokens = torch.tensor([cands.tokens[j] for j in chosen], dtype=torch.long, device=device)
        conf = torch.tensor([cands.accept[j] for j in chosen])
        parents = None
        if not _is_chain(cands.parents, chosen):
            parents = torch.tensor(
                [index[cands.parents[j]] if cands.parents[j] != -1 else -1 for j in chosen],
                dtype=torch.long,
                device=device,
            )
        probs = None
        if learned is not None and learned["probs"] is not None:
            rows = learned["probs"]
            probs = torch.zeros(len(chosen), rows.shape[-1], dtype=rows.dtype, device=rows.device)
            for i, j in enumerate(chosen):
                if cands.learned[j] >= 0:
                    probs[i] = rows[cands.learned[j]]
                else:  # a lookup node: deterministic, q one-hot on its token
                    probs[i, cands.tokens[j]] = 1.0
        return Proposal(tokens=tokens, probs=probs, parents=parents, confidence=conf)


def _new_stats() -> dict[str, Any]:
    return {
        "steps": 0,
        "tokens": 0,
        "verified_nothing": 0,
        "chain_steps": 0,
        "tree_steps": 0,
        "nodes_verified": 0,
        "learned_nodes_verified": 0,
        "lookup_nodes_verified": 0,
        "learned_drafts": 0,
        "learned_sat_out": 0,
        "draft_seconds": 0.0,
    }


def _host_view(proposal: Proposal) -> dict[str, Any]:
    """A learned proposal's tokens, parents and confidences as host lists (one read)."""
    n = len(proposal)
    conf = proposal.confidence
    if conf is None:  # a drafter that gives none: an even guess
        conf = torch.full((n,), 0.5)
    parents = proposal.parents
    if parents is not None and proposal.probs is not None:
        raise ValueError(
            "auto: a sampled tree (probs and parents) cannot be chosen from causally; "
            "draft top-k trees (no probs) or a sampled chain"
        )
    flat = torch.cat([proposal.tokens.double().cpu(), conf.double().cpu()]).tolist()
    tokens = [int(t) for t in flat[:n]]
    par = parents.tolist() if parents is not None else list(range(-1, n - 1))
    return {"tokens": tokens, "parents": par, "confidence": flat[n:], "probs": proposal.probs}
