"""The draft length the bench recommends, predicted from a measured run and the verify costs.

For each chain drafter, :func:`recommend` predicts the speedup at k = 1..``max_k`` with
:func:`~draftsmith.train.decoding.draft_length.predicted_speedups` from its measured α, its
measured drafting seconds per drafted token and the verify cost per width of
``scripts/bench_forward.py``'s profile (:func:`default_cost_profile`, or ``--cost-profile``).
α beyond the measured k is extrapolated (:func:`extend_alpha`: the last conditional acceptance
rate held constant) and flagged as such.

For each tree drafter that ranks its nodes (EAGLE-2's reranking), :func:`recommend_tree` predicts
the speedup of every smaller tree of the same depth and branching from what each step's best m
nodes would have accepted (``acceptance_length_by_tree_size``, counted by the loop), anchored
at the measured tree's speedup.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..decoding.draft_length import load_cost_profile, predicted_speedups, verify_cost
from ..errors import UsageError

__all__ = [
    "DEFAULT_COST_PROFILES",
    "default_cost_profile",
    "draft_seconds_per_step",
    "draft_seconds_per_token",
    "extend_alpha",
    "load_costs",
    "recommend",
    "recommend_tree",
]

#: Where the verify-cost profile is looked for when ``--cost-profile`` is not given: the working
#: directory first (a checkout), then the checkout this package is installed from (editable).
DEFAULT_COST_PROFILES = (
    Path("bench/cpu_costs/forward_cost.json"),
    Path(__file__).resolve().parents[2] / "bench" / "cpu_costs" / "forward_cost.json",
)


def default_cost_profile() -> Path:
    """The verify-cost profile to use when none is given.

    Raises:
        UsageError: none of :data:`DEFAULT_COST_PROFILES` exists (names the file and the command
            that makes it).
    """
    for path in DEFAULT_COST_PROFILES:
        if path.is_file():
            return path
    raise UsageError(
        f"no verify-cost profile: {DEFAULT_COST_PROFILES[0]} not found; make it with "
        f"`python scripts/bench_forward.py --out {DEFAULT_COST_PROFILES[0]}` or pass "
        "--cost-profile FILE"
    )


def load_costs(
    path: Path, dtype: str, threads: int, device_type: str = "cpu", kind: str = "chain"
) -> dict[int, float]:
    """``load_cost_profile`` with its failures turned into one-line usage errors (a profile of
    another device type included: a CPU profile says nothing about a GPU)."""
    try:
        return load_cost_profile(path, dtype, threads, device_type, kind)
    except OSError as exc:
        raise UsageError(
            f"cost profile {path}: cannot read it ({exc.strerror or exc}); "
            "scripts/bench_forward.py makes one"
        ) from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"cost profile {path}: not JSON ({exc})") from None
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        # ValueError: no profile for the dtype (its message names the file); the rest: a JSON
        # that is not bench_forward.py's layout.
        text = (
            str(exc) if isinstance(exc, ValueError) else f"not a bench_forward.py profile ({exc!r})"
        )
        raise UsageError(text if str(path) in text else f"cost profile {path}: {text}") from None


def extend_alpha(alpha: list[float], n: int) -> list[float]:
    """α per position for ``n`` positions: the measured ones, then an extrapolated tail.

    Past the measured k the conditional acceptance rate of the last measured position
    (α_k / α_{k-1}; α_1 when k = 1) is held constant: a chain position is accepted only when
    every earlier one is, and deeper conditional rates change slowly. Exact for the measured
    positions (a prefix of a longer chain is accepted exactly as often).

    Args:
        alpha: ``[k]`` measured α_i (unconditional, vLLM's definition).
        n: positions wanted.

    Returns:
        ``[n]`` α_i; the first ``min(k, n)`` are ``alpha``'s.
    """
    out = [float(a) for a in alpha[:n]]
    if len(out) >= n:
        return out
    if not alpha or alpha[-1] <= 0:
        ratio = 0.0
    elif len(alpha) >= 2 and alpha[-2] > 0:
        ratio = min(1.0, alpha[-1] / alpha[-2])
    else:
        ratio = min(1.0, float(alpha[-1]))
    while len(out) < n:
        out.append(out[-1] * ratio if out else 0.0)
    return out


def draft_seconds_per_token(result: dict[str, Any]) -> float:
    """D: the drafter's seconds (start, propose, accept) per drafted token over the run."""
    proposed = result.get("proposed_tokens") or 0
    if not proposed:
        return 0.0
    return result["draft_time_fraction"] * result["wall_time_s"] / proposed


def draft_seconds_per_step(result: dict[str, Any]) -> float:
    """The drafter's seconds per drafted step (a parallel drafter's cost per round)."""
    steps = result.get("draft_steps") or 0
    if not steps:
        return 0.0
    return result["draft_time_fraction"] * result["wall_time_s"] / steps


def recommend(
    result: dict[str, Any], costs: dict[int, float], max_k: int, *, parallel: bool = False
) -> dict[str, Any]:
    """The chain length predicted fastest for one measured chain or parallel drafter.

    Args:
        result: one method's evaluate result (``acceptance_rate_per_position``, ``k``,
            ``speedup``, ``draft_time_fraction``, ``wall_time_s``, ``proposed_tokens``).
        costs: seconds per target forward by width (:func:`load_cost_profile`).
        max_k: longest chain considered (the run's k is always included).
        parallel: the drafter drafts a step's positions in one forward (shape ``parallel``):
            its cost is per step, not per token (``draft_seconds_per_step``).

    Returns:
        ``predicted`` ``{k: speedup}``, ``best_k``, ``best_predicted_speedup`` (and
        ``best_anchored_speedup``: scaled by measured / predicted at the run's k), the measured
        speedup and the prediction at the run's k beside it, ``alpha_used`` (``[n]``: measured,
        then extrapolated past ``measured_positions``), ``draft_seconds_per_token`` and
        ``plain_is_faster`` (no k predicted above 1x).
    """
    alpha = list(result["acceptance_rate_per_position"])
    run_k = int(result["k"])
    n = max(max_k, run_k)
    used = extend_alpha(alpha, n)
    d = draft_seconds_per_step(result) if parallel else draft_seconds_per_token(result)
    # A drafter that drafts only on some steps (n-gram lookup finds no match elsewhere) has its
    # α per drafted step; the prediction mixes those steps with the plain ones by their share.
    verify_steps = result.get("target_forwards", 0) - result.get("num_prompts", 0)
    drafted = result.get("draft_steps", 0)
    share = min(1.0, drafted / verify_steps) if verify_steps > 0 else 1.0
    predicted = predicted_speedups(used, costs, d, drafted_share=share, per_round=parallel)
    best_k = max(predicted, key=lambda k: (predicted[k], -k))  # ties: the shorter chain
    rec = {
        "method": result["method"],
        "temperature": result.get("temperature", 0.0),
        "run_k": run_k,
        "measured_speedup": result.get("speedup"),
        "measured_speedup_vs_fastest_plain": result.get("speedup_vs_fastest_plain"),
        "predicted_at_run_k": predicted[run_k],
        "best_k": best_k,
        "best_predicted_speedup": predicted[best_k],
        # The model leaves out prefill and the loop's own overhead (the gap between the measured
        # and the predicted speedup at the run's k); scaled by that gap, the best k's figure is
        # what the measurement suggests (the best k itself is unchanged by the scaling).
        "best_anchored_speedup": (
            predicted[best_k] * result["speedup"] / predicted[run_k]
            if result.get("speedup") and predicted[run_k] > 0
            else None
        ),
        "best_is_extrapolated": best_k > len(alpha),
        "plain_is_faster": predicted[best_k] <= 1.0,
        "predicted": predicted,
        "alpha_used": used,
        "measured_positions": len(alpha),
        "draft_seconds_per_token": draft_seconds_per_token(result),
        "draft_seconds_per_step": draft_seconds_per_step(result),
        "draft_cost": "per step" if parallel else "per token",
    }
    rec["drafted_step_share"] = share
    notes = []
    if not drafted:
        notes.append("never drafted: nothing to predict from")
    elif share < 0.8:
        notes.append(f"drafted on {100 * share:.0f}% of steps (assumed the same share at every k)")
    if result.get("adaptive_k"):
        notes.append("measured with --adaptive-k: its α are of shorter drafts")
    if notes:
        rec["note"] = "; ".join(notes)
    return rec


def recommend_tree(result: dict[str, Any], costs: dict[int, float]) -> dict[str, Any] | None:
    """The tree size predicted fastest for one measured tree drafter, at its depth and top-k.

    Each step of the measured tree of n nodes also counted the path its best m nodes would have
    accepted (exact when greedy; when sampling, SpecInfer's sibling tests decide on a pruned
    tree as they did up to its first pruned path node), so τ_m per drafted step is measured, not
    modelled, for every m <= n. The drafting cost does not depend on m (the same levels are
    expanded; only the reranking keeps fewer), the verify cost does:

        speedup(m) = measured speedup · (τ_m / τ_n) · (V(n + 1) + D) / (V(m + 1) + D)

    with V the verify cost per width and D the drafter's seconds per step. Anchored at the
    measurement, so the loop's own overhead carries over in proportion. A tree larger than the
    measured one cannot be predicted: measure a large tree, prune by prediction.

    Args:
        result: one tree method's evaluate result (``acceptance_length_by_tree_size``,
            ``speedup``, ``draft_time_fraction``, ``wall_time_s``, ``draft_steps``).
        costs: seconds per target forward by width (:func:`load_costs`).

    Returns:
        None when the run has no per-size counts (a static tree, or results from before they
        were counted); else ``predicted`` and ``tau_by_size`` (``[n]``, entry m - 1 for the
        best m nodes),
        ``best_nodes``, ``best_predicted_speedup``, the measured tree's size and speedup, and
        ``extrapolated_widths`` (verify widths past the profile's widest measurement, whose
        cost is held flat).
    """
    taus = result.get("acceptance_length_by_tree_size") or []
    measured = result.get("speedup")
    if not taus or not measured:
        return None
    n = len(taus)
    d = draft_seconds_per_step(result)
    step_n = verify_cost(costs, n + 1) + d
    # Entry m - 1 is the tree of the best m nodes (lists: JSON keeps them as they are).
    predicted = [
        measured * (taus[m - 1] / taus[-1]) * step_n / (verify_cost(costs, m + 1) + d)
        for m in range(1, n + 1)
    ]
    best = max(range(1, n + 1), key=lambda m: (predicted[m - 1], -m))  # ties: the smaller
    widest = max(costs)
    vs_fastest = result.get("speedup_vs_fastest_plain")
    return {
        "method": result["method"],
        "temperature": result.get("temperature", 0.0),
        "measured_nodes": n,
        "measured_speedup": measured,
        "measured_speedup_vs_fastest_plain": vs_fastest,
        "best_nodes": best,
        "best_predicted_speedup": predicted[best - 1],
        # The same anchor for the fastest plain decoding: both scale by the same ratio.
        "best_predicted_speedup_vs_fastest_plain": (
            vs_fastest * predicted[best - 1] / measured if vs_fastest else None
        ),
        "predicted": predicted,
        "tau_by_size": list(taus),
        "draft_seconds_per_step": d,
        "extrapolated_widths": [m + 1 for m in range(1, n + 1) if m + 1 > widest],
    }
