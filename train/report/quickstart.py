"""The quickstart's summary: the lines it prints at the end and its ``summary.md``.

Both are written from the job's summary dict (τ, speedups, losslessness, the validation's
figures against the evaluation's, paths, the ``vllm serve`` line, times), its stage records in
``quickstart.json``, the evaluation's results and the training metrics.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from ...heads.families import FAMILIES
from .text import fmt_number, is_finite_number, minutes

__all__ = [
    "data_line",
    "evaluated_shapes",
    "reported_shape",
    "shape_label",
    "summary_lines",
    "summary_markdown",
    "validation_figures",
    "validation_line",
    "vllm_serve_command",
]


def evaluated_shapes(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The drafter shapes an ``eval.json`` holds, in the order evaluated (the chain first).

    One drafter evaluated: the file is its result; several (chain and tree, sharing one plain
    baseline): one entry each under ``methods``. Entries without a τ are left out.
    """
    if not isinstance(result, dict):
        return []
    methods = result.get("methods")
    rows = methods if isinstance(methods, list) else [result]
    return [r for r in rows if isinstance(r, dict) and "acceptance_length" in r]


def _speed(result: dict[str, Any]) -> float:
    for key in ("speedup_vs_fastest_plain", "speedup"):
        if is_finite_number(result.get(key)):
            return float(result[key])
    return float("-inf")


def reported_shape(shapes: list[dict[str, Any]]) -> dict[str, Any]:
    """The shape the job reports: the fastest against the fastest plain decoding (its speedup
    over same-dtype plain where that is all there is); the first (the chain) on a tie.

    Both shapes decode the same prompts interleaved with one plain baseline, so their speedups
    compare like with like. An empty dict when nothing was evaluated.
    """
    best: dict[str, Any] = {}
    for shape in shapes:
        if not best or _speed(shape) > _speed(best):
            best = shape
    return best


def shape_label(result: dict[str, Any], config: dict[str, Any] | None = None) -> str:
    """``chain, k = 2`` or ``tree of 6 nodes, depth 2`` for one evaluated shape.

    Args:
        result: one entry of :func:`evaluated_shapes`.
        config: the evaluation's config (``eval.json``'s ``config``: ``tree_total_tokens``).
    """
    k = result.get("k", "-")
    method = str(result.get("method", ""))
    if method.startswith("auto["):
        nodes = (config or {}).get("auto_nodes") or (config or {}).get("tree_total_tokens", "-")
        return f"auto (tree of up to {nodes} nodes, depth {k}, with lookup)"
    if method.startswith("ngram["):
        return f"n-gram lookup, k = {k}"
    if "-tree[" in method:
        nodes = (config or {}).get("tree_total_tokens", "-")
        return f"tree of {nodes} nodes, depth {k}"
    return f"chain, k = {k}"


def vllm_serve_command(target: str | Path, export: str | Path, k: int) -> str:
    """The ``vllm serve`` line for an EAGLE-3 speculators export (as scripts/vllm_check.py
    builds ``speculative_config``: method, num_speculative_tokens, model).

    The target is named as the export names its verifier
    (:func:`~draftsmith.train.target_model.load.describe_target`): a Hub id stays one, and a Hub
    cache snapshot directory (what a Hub id was loaded from) becomes its id again, so the line
    also works on a machine with another cache; a local directory is its absolute path.
    """
    from ..target_model.load import describe_target

    name = describe_target(str(target))["target"]
    method = FAMILIES["eagle3"].vllm_export().method
    spec = {"method": method, "num_speculative_tokens": k, "model": str(export)}
    return shlex.join(["vllm", "serve", name, "--speculative-config", json.dumps(spec)])


def validation_figures(
    training: dict[str, Any], result: dict[str, Any], prompts: int | None = None
) -> dict[str, Any]:
    """The validation of the evaluated drafter against the evaluation (``quickstart.json``'s
    ``summary.validation``).

    The evaluated drafter is ``best/`` when the run kept one: its validation is the entry of
    ``training["validation"]`` at ``training["best"]["step"]`` (``final_validation`` is the last
    one, not necessarily the best); else the last validation (``drafter/``).

    Args:
        training: the training metrics (``training_metrics.json``).
        result: the evaluation's results (``eval.json``).
        prompts: validation prompts the simulated τ was measured on (``val_data``'s records).

    Returns:
        ``{"step", "drafter", "prompts", "sim_tau", "split_sim_tau", "evaluated_tau", "gap",
        "split_gap"}``: ``sim_tau`` on the held-out validation prompts (``val/sim_tau``; None
        for a run without ``val_data``), ``split_sim_tau`` on the held-back training records,
        the evaluated τ, and each one's gap to it (simulated / evaluated - 1); None where not
        known.
    """
    entries = [e for e in training.get("validation") or [] if isinstance(e, dict)]
    best = training.get("best") or {}
    entry = next((e for e in entries if e.get("step") == best.get("step")), None)
    drafter = "best" if entry is not None else "drafter"
    if entry is None:
        entry = training.get("final_validation") or (entries[-1] if entries else {})
    # Without val_data, val/sim_tau is the held-back training records' (runs before it existed).
    held = training.get("val_data") is not None or "val_split/sim_tau" in entry
    sim_tau = entry.get("val/sim_tau") if held else None
    split_tau = entry.get("val_split/sim_tau") if held else entry.get("val/sim_tau")
    evaluated = result.get("acceptance_length")

    def gap(tau: float | None) -> float | None:
        ok = is_finite_number(tau) and is_finite_number(evaluated) and evaluated > 0
        return tau / evaluated - 1 if ok else None

    return {
        "step": entry.get("step"),
        "drafter": drafter,
        "prompts": prompts,
        "sim_tau": sim_tau,
        "split_sim_tau": split_tau,
        "evaluated_tau": evaluated,
        "gap": gap(sim_tau),
        "split_gap": gap(split_tau),
    }


def _percent(gap: float | None) -> str:
    return f"{100 * gap:+.0f} %" if is_finite_number(gap) else "-"


def validation_line(figures: dict[str, Any]) -> str:
    """One line: the validation's simulated τ (held-out prompts, training records), the
    evaluated τ and the gap."""
    where = f"{figures.get('drafter') or '-'}/, step {figures.get('step', '-')}"
    n = figures.get("prompts")
    on = f"the {n} held-out validation prompts" if n else "the held-out validation prompts"
    return (
        f"validation ({where}): simulated τ {fmt_number(figures.get('sim_tau'))} on {on}, "
        f"{fmt_number(figures.get('split_sim_tau'))} on held-back training records; evaluated "
        f"τ {fmt_number(figures.get('evaluated_tau'))}; gap {_percent(figures.get('gap'))} "
        f"(training records: {_percent(figures.get('split_gap'))})"
    )


def data_line(data: dict[str, Any]) -> str:
    """One line: the records trained on, the epochs over them, and whether the data grew or
    shrank (the job's plan, ``plan.grown``, ``plan.shrunk``)."""
    epochs = data.get("epochs")
    sampled = data.get("sampled_answers")
    text = (
        f"data: {data.get('records', '-')} records made"
        + (f" ({sampled} of them answers sampled to your prompts)" if sampled else "")
        + (f", {epochs:g} training epochs planned" if epochs is not None else "")
    )
    grown = data.get("grown")
    if grown:
        text += (
            f"; grown from the plan's {grown['from']} because the prompts and answers came "
            f"out {grown['generation_factor']:.1f}x as fast as planned"
        )
    shrunk = data.get("shrunk")
    if shrunk:
        text += (
            f"; {shrunk['records']} of the planned {shrunk['from']} answered because the "
            f"prompts came out at {shrunk['generation_share']:.2f}x the planned rate"
        )
    return text


def _identical(summary: dict[str, Any]) -> str:
    """The "lossless" entry: all outputs identical, or the share that is and why the rest is not."""
    if summary.get("identical_to_target"):
        return "yes, every output is the target's own"
    rate = summary.get("identical_rate")
    if rate is None:
        return "-"
    dtype = _short(summary.get("dtype"))
    return f"{100 * rate:.0f} % of outputs identical; the others differ at {dtype} near-ties"


def _short(dtype: str | None) -> str:
    """``bfloat16`` -> ``bf16``, ``float32`` -> ``fp32`` (None: the quickstart's bf16 before the
    dtype was a setting)."""
    return {"bfloat16": "bf16", "float32": "fp32"}.get(dtype or "bfloat16", str(dtype))


def summary_lines(
    summary: dict[str, Any], stages: dict[str, Any], this_run: dict[str, str], cfg: Any
) -> list[str]:
    """The lines printed after the results table: τ and speedups, stage times, paths, serve line.

    Args:
        summary: the job's summary (``quickstart.json``'s ``summary``).
        stages: the stage records, in job order.
        this_run: stage name -> ``ran`` or ``skipped`` in this invocation.
        cfg: the quickstart's settings (``budget_minutes`` is read).
    """
    plain = _short(summary.get("dtype"))
    shape = summary.get("shape")
    lines = [
        (f"{shape}: " if shape else "")
        + f"τ (tokens per target forward): {fmt_number(summary['acceptance_length'])}; speedup "
        f"over plain {plain}: {fmt_number(summary['speedup'], '.2f', 'x')}; over the fastest "
        f"plain decoding: {fmt_number(summary['speedup_vs_fastest_plain'], '.2f', 'x')}; lossless: "
        f"{_identical(summary)}",
        *_shapes_line(summary),
        validation_line(summary.get("validation") or {}),
        data_line(summary.get("data") or {}),
        "stages: "
        + ", ".join(
            f"{name} {minutes(rec.get('seconds', 0.0))}"
            + (" (skipped now)" if this_run.get(name) == "skipped" else "")
            for name, rec in stages.items()
        ),
        f"total: {minutes(summary['total_seconds'])} of the {cfg.budget_minutes:g}-min budget "
        f"({minutes(summary['seconds_this_run'])} in this run)",
        f"drafter: {summary['drafter']}",
        f"export:  {summary['export']} (speculators format: what vLLM loads)",
        f"report:  {summary['report']}",
        f"plots:   {', '.join(summary['plots']) or '-'}",
        f"summary: {summary['summary']} (stage status and times: {summary['state']})",
        "serve it with vLLM:",
        f"  {summary['vllm_serve']}",
    ]
    return lines


def _shapes_line(summary: dict[str, Any]) -> list[str]:
    """The evaluated shapes side by side (none when one shape was evaluated)."""
    shapes = summary.get("shapes") or []
    if len(shapes) < 2:
        return []
    each = "; ".join(
        f"{s['shape']}: τ {fmt_number(s.get('acceptance_length'))}, "
        f"{fmt_number(s.get('speedup_vs_fastest_plain'), '.2f', 'x')}"
        for s in shapes
    )
    lines = [
        f"shapes (× the fastest plain decoding): {each}; reported: the fastest; vLLM serves the "
        f"chain (EAGLE-2 trees and auto run in draftsmith's loop)"
    ]
    auto = next((s for s in shapes if str(s["shape"]).startswith("auto")), None)
    if auto is not None and auto["shape"] != summary.get("shape"):
        lines.append(
            f"auto was not the fastest shape here: {summary.get('shape')} ran "
            f"{fmt_number(summary.get('speedup_vs_fastest_plain'), '.2f', 'x')} against auto's "
            f"{fmt_number(auto.get('speedup_vs_fastest_plain'), '.2f', 'x')} (the fastest plain "
            "decoding = 1)"
        )
    return lines


def _shapes_table(summary: dict[str, Any]) -> str:
    """Markdown: one column per evaluated shape (empty when one shape was evaluated)."""
    shapes = summary.get("shapes") or []
    if len(shapes) < 2:
        return ""
    cols = [
        f"{s['shape']}{' (reported)' if s['shape'] == summary.get('shape') else ''}" for s in shapes
    ]

    def row(title: str, key: str, spec: str = ".2f", suffix: str = "") -> str:
        cells = " | ".join(fmt_number(s.get(key), spec, suffix) for s in shapes)
        return f"| {title} | {cells} |"

    alpha = " | ".join(
        " ".join(f"{a:.2f}" for a in s.get("acceptance_rate_per_position") or []) or "-"
        for s in shapes
    )
    lines = [
        "",
        "Every shape on the same prompts, interleaved with one plain baseline; the table above "
        "is the fastest one's. vLLM serves the chain; EAGLE-2 trees and auto (the per-step "
        "decision over the drafter's tree and n-gram/suffix lookup) run in draftsmith's loop "
        "(`draftsmith evaluate --drafter eagle-tree=DIR auto:eagle-tree=DIR`).",
        "",
        f"| | {' | '.join(cols)} |",
        "|---|" + "---:|" * len(shapes),
        row("τ (tokens per target forward)", "acceptance_length"),
        f"| α per depth | {alpha} |",
        row("speculative tok/s", "tokens_per_second", ".1f"),
        row("speedup over plain, same dtype", "speedup", ".2f", "x"),
        row("speedup over the fastest plain", "speedup_vs_fastest_plain", ".2f", "x"),
    ]
    lines += ["", *_shapes_line(summary)[1:]]  # says so when auto was not the fastest
    lines += _categories_table(shapes)
    return "\n".join(lines) + "\n"


def _categories_table(shapes: list[dict[str, Any]]) -> list[str]:
    """Markdown: every shape's speedup over the fastest plain decoding (and τ) per category of
    the held-out prompts (none when the prompts carry no categories)."""
    cats = sorted({c for s in shapes for c in s.get("by_category") or {}})
    if len(cats) < 2:
        return []
    lines = [
        "",
        "Per category of the held-out prompts (× the fastest plain decoding; τ):",
        "",
        "| category | prompts | " + " | ".join(s["shape"] for s in shapes) + " |",
        "|---|---:|" + "---:|" * len(shapes),
    ]
    for cat in cats:
        rows = [(s.get("by_category") or {}).get(cat) or {} for s in shapes]
        cells = [
            f"{fmt_number(r.get('speedup_vs_fastest_plain', r.get('speedup')), '.2f', 'x')}, "
            f"{fmt_number(r.get('acceptance_length'))}"
            for r in rows
        ]
        prompts = next((r["prompts"] for r in rows if "prompts" in r), "-")
        lines.append(f"| {cat} | {prompts} | " + " | ".join(cells) + " |")
    return lines


def summary_markdown(
    cfg: Any,
    summary: dict[str, Any],
    stages: dict[str, Any],
    result: dict[str, Any],
    training: dict[str, Any],
    command: str,
) -> str:
    """The job's summary as Markdown (``<out-dir>/summary.md``).

    Args:
        cfg: the quickstart's settings (``target``, ``k``, ``max_new_tokens``,
            ``budget_minutes`` are read).
        summary: as :func:`summary_lines`.
        stages: as :func:`summary_lines`.
        result: the evaluation's results (``eval.json``).
        training: the training metrics (``training_metrics.json``).
        command: the command that reruns the job.
    """
    alpha = " ".join(f"{a:.2f}" for a in summary.get("acceptance_rate_per_position") or [])
    val = summary.get("validation") or {}
    n = val.get("prompts")
    where = f"{f'{n} ' if n else ''}held-out validation prompts; `{val.get('drafter') or '-'}/`"
    validation_rows = "\n".join(
        [
            f"| simulated τ, {where} at step {val.get('step', '-')} | "
            f"{fmt_number(val.get('sim_tau'))} |",
            f"| simulated τ, held-back training records | {fmt_number(val.get('split_sim_tau'))} |",
            f"| gap, validation vs evaluated τ | {_percent(val.get('gap'))} (training records: "
            f"{_percent(val.get('split_gap'))}) |",
        ]
    )
    mine = val.get("of_yours")
    yours = f" and {mine} of your prompts (`--val-prompts`)" if mine else ""
    rows = "\n".join(
        f"| {name} | {rec.get('status', '-')} | {minutes(rec.get('seconds', 0.0))} | "
        f"`{rec.get('command', '')}` |"
        for name, rec in stages.items()
    )
    ref = result.get("reference_plain") or {}
    plain_tps = fmt_number(result.get("baseline_tokens_per_second"), ".1f")
    vs_fastest = fmt_number(summary.get("speedup_vs_fastest_plain"), ".2f", "x")
    trained = f"{training.get('steps', '-')} steps, {minutes(training.get('train_seconds', 0.0))}"
    return f"""# draftsmith quickstart

`{command}` trained an EAGLE-3 drafter for `{cfg.target or "SmolLM2-135M-Instruct"}` and measured
it against plain decoding on {result.get("num_prompts", "-")} of the project's held-out prompts
({result.get("dtype", "bfloat16")}, greedy, {summary.get("shape") or f"k = {cfg.k}"}, \
{cfg.max_new_tokens} new tokens).

## Results

| | |
|---|---|
| τ (tokens per target forward) | {fmt_number(summary.get("acceptance_length"))} |
| α per position | {alpha or "-"} |
| speculative tok/s | {fmt_number(result.get("tokens_per_second"), ".1f")} |
| plain tok/s ({result.get("dtype", "-")}) | {plain_tps} |
| plain tok/s ({ref.get("dtype", "-")}) | {fmt_number(ref.get("tokens_per_second"), ".1f")} |
| speedup over plain, same dtype | {fmt_number(summary.get("speedup"), ".2f", "x")} |
| speedup over the fastest plain | {vs_fastest} |
| lossless | {_identical(summary)} |
{validation_rows}
| training | {trained} |
| data | {data_line(summary.get("data") or {}).removeprefix("data: ")} |
{_shapes_table(summary)}
The validation prompts are the project's shipped `train` prompts (the held-out ones' kind){yours},
answered by the target and never trained on: their simulated τ chose the drafter, and the gap says
how well it predicted the evaluated τ of the chain (validation simulates a chain).

## Files

- drafter: `{summary["drafter"]}` (draftsmith's layout; `draftsmith evaluate --drafter eagle=DIR`)
- export: `{summary["export"]}` (speculators format, what vLLM loads)
- report: `{summary["report"]}` (every metric and per-prompt outputs, see docs/metrics.md)
- plots: {", ".join(f"`{p}`" for p in summary["plots"]) or "-"}
- stage status and wall times: `{summary["state"]}`

## Serve with vLLM

```bash
{summary["vllm_serve"]}
```

## Stages

| stage | status | wall time | command (reruns it alone) |
|---|---|---|---|
{rows}

Total {minutes(summary["total_seconds"])} of the {cfg.budget_minutes:g}-min budget. Rerun
`{command}` to resume or refresh; see docs/quickstart.md to scale up.
"""
