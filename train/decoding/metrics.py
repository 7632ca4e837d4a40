"""Acceptance and speed metrics of speculative decoding runs, and how they are shown.

Definitions (docs/metrics.md explains the choices):

* ``acceptance_length`` τ = tokens emitted / target forward passes (prefill included, bonus token
  included). Plain decoding has τ = 1. This is the figure that bounds the wall-clock speedup.
* ``acceptance_rate_per_position[i]`` α_i = draft tokens accepted at draft position i / number of
  verification steps in which the drafter proposed anything. This is vLLM's definition
  (``vllm:spec_decode_num_accepted_tokens_per_pos`` / ``num_drafts``), so the figures compare.
* ``acceptance_length_per_draft`` = 1 + Σ α_i: mean tokens per *drafted* step, vLLM's "mean
  acceptance length". It equals τ when the drafter proposes at every step (draft LMs, EAGLE);
  it is larger than τ for n-gram lookup, which skips steps with no match.
* ``speedup`` = tokens/s of the speculative loop / tokens/s of plain decoding, same target, prompts,
  settings and process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...heads.base import GenerationOutput


def summarize(
    runs: Sequence[GenerationOutput], k: int, baseline: Sequence[GenerationOutput] | None = None
) -> dict[str, Any]:
    """Aggregate per-prompt outputs into the run's metrics.

    Args:
        runs: speculative outputs, one per prompt.
        k: draft tokens per step.
        baseline: plain-decoding outputs for the same prompts (same order), if measured.

    Returns:
        A JSON-safe dict of metrics (see the module docstring for definitions).
    """
    tokens = sum(len(r.tokens) for r in runs)
    forwards = sum(r.target_forwards for r in runs)
    wall = sum(r.wall_time for r in runs)
    drafted = sum(r.draft_steps for r in runs)
    per_pos = [sum(r.accepted_per_position[i] for r in runs) for i in range(k)]
    alpha = [c / drafted if drafted else 0.0 for c in per_pos]
    out: dict[str, Any] = {
        "num_prompts": len(runs),
        "new_tokens": tokens,
        "target_forwards": forwards,
        "acceptance_length": tokens / forwards if forwards else 0.0,
        "acceptance_length_per_draft": 1.0 + sum(alpha),
        "acceptance_rate_per_position": alpha,
        "draft_steps": drafted,
        "proposed_tokens": sum(r.proposed for r in runs),
        "accepted_tokens": sum(r.accepted for r in runs),
        "tokens_per_second": tokens / wall if wall else 0.0,
        "wall_time_s": wall,
        "draft_time_fraction": sum(r.draft_time for r in runs) / wall if wall else 0.0,
    }
    by_size = tree_sizes_sum([r.accepted_by_tree_size for r in runs])
    if by_size and drafted:
        # τ per drafted step had every tree kept only its best m nodes (m = 1..len): from the
        # path each step accepted (GenerationOutput.accepted_by_tree_size).
        out["acceptance_length_by_tree_size"] = [1.0 + a / drafted for a in by_size]
    if baseline is not None:
        base_tokens = sum(len(r.tokens) for r in baseline)
        base_wall = sum(r.wall_time for r in baseline)
        base_tps = base_tokens / base_wall if base_wall else 0.0
        out["baseline_tokens_per_second"] = base_tps
        out["baseline_wall_time_s"] = base_wall
        out["speedup"] = out["tokens_per_second"] / base_tps if base_tps else 0.0
    return out


def tree_sizes_sum(per_run: Sequence[Sequence[int]]) -> list[int]:
    """Sum runs' ``accepted_by_tree_size`` lists; a shorter list (smaller trees only) counts
    its last entry at the larger sizes, as :func:`..speculative._count_pruned` does."""
    n = max((len(s) for s in per_run), default=0)
    total = [0] * n
    for sums in per_run:
        if not sums:  # a run with no tree step
            continue
        for m in range(n):
            total[m] += sums[min(m, len(sums) - 1)]
    return total


def results_table(rows: Sequence[dict[str, Any]], title: str = "speculative decoding"):
    """A rich Table with one row per method.

    Args:
        rows: result dicts as written by the evaluation (``method``, ``k`` and :func:`summarize`'s
            keys; baseline keys optional).
        title: table title.
    """
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for col in (
        "method",
        "k",
        "prompts",
        "tokens",
        "τ",
        "α per position",
        "tok/s",
        "baseline tok/s",
        "speedup",
        "vs fastest plain",
        "draft time",
        "identical",
    ):
        table.add_column(col, justify="left" if col in ("method", "α per position") else "right")
    for r in rows:
        table.add_row(
            escape(str(r["method"])),  # method names may hold paths with "[...]" in them
            str(r["k"]),
            str(r["num_prompts"]),
            str(r["new_tokens"]),
            f"{r['acceptance_length']:.2f}",
            " ".join(f"{a:.2f}" for a in r["acceptance_rate_per_position"]),
            f"{r['tokens_per_second']:.1f}",
            f"{r['baseline_tokens_per_second']:.1f}" if "baseline_tokens_per_second" in r else "-",
            f"{r['speedup']:.2f}x" if "speedup" in r else "-",
            (
                f"{r['speedup_vs_fastest_plain']:.2f}x ({r['fastest_plain_dtype']})"
                if "speedup_vs_fastest_plain" in r
                else "-"
            ),
            f"{100 * r['draft_time_fraction']:.0f}%",
            identical_text(r),
        )
    return table


def simulated_tau(accs: Sequence[float]) -> float:
    """Acceptance length τ predicted from per-position top-1 accuracies, for chain drafting.

    ``τ = 1 + Σ_{i<k} Π_{j<=i} a_j``: the target's own (bonus) token, plus draft position i
    accepted when it and every earlier one are, each ``a_j`` taken as the conditional acceptance
    rate of position j (SpecForge's ``simulated_acc_len``). Training validations report it
    (``val/sim_tau``) from EAGLE's TTT step accuracies, Medusa's head accuracies or a draft LM's
    greedy agreement; it assumes position j's accuracy does not depend on the earlier ones.

    Args:
        accs: ``[k]`` accuracies in [0, 1].

    Returns:
        τ in ``[1, k + 1]``; NaN when an accuracy is not finite.
    """
    tau, p = 1.0, 1.0
    for a in accs:
        p *= float(a)
        tau += p
    return tau


def identical_text(r: dict[str, Any], *, sampled: str = "-", gaps: bool = False) -> str:
    """The "identical" cell of a results table: yes, NO, the bf16 near-tie summary, or ``sampled``.

    Args:
        r: one method's evaluate result.
        sampled: text for sampled runs (no per-sample check).
        gaps: also give the number of near-ties and the largest logit gap.
    """
    identical = r.get("identical_to_target")
    if identical is None:
        return sampled
    if identical:
        return "yes"
    ties = r.get("near_ties") or []
    if ties and all(t.get("near_tie") for t in ties):
        rate = f"{100 * r.get('identical_rate', 0):.0f}%"
        if not gaps:
            return f"{rate} (near-ties)"
        gap = max(abs(t.get("logit_gap", 0.0)) for t in ties)
        return f"{rate} ({len(ties)} near-ties, max gap {gap:.3f})"
    return "NO"


def category_table(rows: Sequence[dict[str, Any]], title: str = "per category"):
    """A rich Table of each method's speedup per prompt category (``by_category``), over the
    fastest plain decoding where both dtypes were timed, else over plain in the run's dtype;
    None when no method has categories or there is only one."""
    from rich.markup import escape
    from rich.table import Table

    cats = sorted({c for r in rows for c in (r.get("by_category") or {})})
    if len(cats) < 2:
        return None
    key = (
        "speedup_vs_fastest_plain"
        if all(
            "speedup_vs_fastest_plain" in c
            for r in rows
            for c in (r.get("by_category") or {}).values()
        )
        else "speedup"
    )
    label = "× fastest plain" if key == "speedup_vs_fastest_plain" else "× plain"
    table = Table(title=f"{title} ({label}; τ)")
    table.add_column("category")
    table.add_column("prompts", justify="right")
    for r in rows:
        table.add_column(escape(str(r["method"]).split("[")[0]), justify="right")
    for cat in cats:
        cells = []
        prompts = "-"
        for r in rows:
            c = (r.get("by_category") or {}).get(cat)
            if c is None:
                cells.append("-")
                continue
            prompts = str(c["prompts"])
            value = c.get(key)
            cells.append(
                f"{value:.2f}x, {c['acceptance_length']:.2f}" if value is not None else "-"
            )
        table.add_row(cat, prompts, *cells)
    return table
