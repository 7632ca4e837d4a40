"""The bench's report: evaluate's results per temperature read into one JSON, and its markdown.

:func:`build_report` reads each temperature's evaluate results (every ``--drafter`` of one run,
sharing one plain baseline), keeps the summaries without the per-prompt entries, recommends a
chain length per chain drafter (:mod:`.recommend`), lists the trees as measured and joins the
training curves (:func:`read_training_log`) with the τ measured from each run's drafter.
:func:`write_outputs` writes ``OUT.json``, ``OUT.md`` (:func:`markdown`) and the plots
(:func:`~draftsmith.train.report.plots.write_plots`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ...heads import families, registry
from ..decoding.metrics import identical_text
from ..errors import UsageError
from ..runinfo import busy_warning
from ..staged import write_json_atomic
from .plots import write_plots
from .recommend import load_costs, recommend, recommend_tree
from .text import (
    fmt_number,
    is_finite_number,
    markdown_table,
)

__all__ = [
    "RESULT_COLUMNS",
    "build_report",
    "busy_warnings",
    "differs_from_plain",
    "drafter_family",
    "markdown",
    "read_training_log",
    "recommendation_text",
    "results_rows",
    "write_outputs",
]


def read_training_log(path: str | Path) -> dict[str, Any]:
    """One training run's validation curve, from its ``training_metrics.json``.

    Args:
        path: a training ``output_dir`` (holding ``training_metrics.json``) or the file itself.

    Returns:
        ``{"run", "path", "dir", "recipe", "kind", "minutes": [n], "sim_tau": [n], "best"}``,
        the validations in order (``val/minutes``, ``val/sim_tau``).

    Raises:
        UsageError: no such file, not JSON, or no validation with both values.
    """
    path = Path(path)
    file = path / "training_metrics.json" if path.is_dir() else path
    if not file.is_file():
        raise UsageError(
            f"training log {path}: no training_metrics.json there (give a training output_dir "
            "or its training_metrics.json)"
        )
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"training log {file}: not JSON ({exc})") from None
    points = []
    for entry in (data.get("validation") or []) if isinstance(data, dict) else []:
        minutes, tau = entry.get("val/minutes"), entry.get("val/sim_tau")
        if is_finite_number(minutes) and is_finite_number(tau):
            points.append((float(minutes), float(tau), entry.get("step")))
    if not points:
        raise UsageError(
            f"training log {file}: no validation entries with val/minutes and val/sim_tau"
        )
    return {
        "run": file.parent.name,
        "path": str(file),
        "dir": str(file.parent),
        "recipe": data.get("recipe"),
        "kind": data.get("kind"),
        "minutes": [m for m, _, _ in points],
        "sim_tau": [t for _, t, _ in points],
        "steps": [step for _, _, step in points],
        "best": data.get("best"),
    }


def drafter_family(spec: str) -> dict[str, str | None]:
    """The family declaration's columns for a ``--drafter`` spec (:mod:`draftsmith.heads.families`).

    Returns:
        ``{"family": name or None, "shape": "chain" | "tree" | "parallel", "loop": "ours" |
        "transformers"}``; the family is None for a kind several families share whose
        checkpoint names none of them.
    """
    kind, path = registry.parse_spec(spec)
    auto = registry.is_auto(kind)
    kind = registry.inner_kind(kind)
    declared = families.kinds()[kind]
    family = families.family_of(kind, path)
    return {
        "family": family.name if family else None,
        # auto:KIND: what it verifies is chosen per step, its own shape (no recommendation).
        "shape": "auto" if auto else declared.shape,
        "loop": declared.loop,
    }


def differs_from_plain(report: dict[str, Any]) -> bool:
    """Whether a greedy output differs from plain decoding beyond a bf16 near-tie (evaluate's
    rule): a merge must fail where its shards did."""
    for entry in report["runs"]:
        for m in entry["methods"]:
            if m.get("identical_to_target") is False:
                ties = m.get("near_ties") or []
                if m.get("dtype") == "float32" or not all(t.get("near_tie") for t in ties):
                    return True
    return False


def build_report(
    runs: list[tuple[float, Path, str]],
    stem: Path,
    profile: Path,
    max_k: int,
    training: list[dict[str, Any]],
) -> dict[str, Any]:
    """The bench JSON (without run info) from evaluate's results, one file per temperature.

    Args:
        runs: ``(temperature, evaluate results JSON, the command that wrote it)``, in run
            order.
        stem: the output stem (results files are recorded relative to its folder).
        profile: the verify-cost profile.
        max_k: longest chain the recommendation considers.
        training: :func:`read_training_log` curves.
    """
    entries, recs, trees = [], [], []
    costs_info: dict[str, Any] = {"path": str(profile)}
    first: dict[str, Any] = {}
    for t, raw, command in runs:
        data = json.loads(raw.read_text())
        first = first or data
        config = data["config"]
        methods = data.get("methods", [data])
        specs = config["drafter"]
        machine = data.get("machine") or {}
        threads = machine.get("torch_threads") or 1
        dtype = methods[0].get("dtype", config.get("dtype", "float32"))
        # The device the runs were timed on (results before the device setting: the CPU).
        device_type = machine.get("device_type") or "cpu"
        costs = load_costs(profile, dtype, threads, device_type)
        # Trees: the profile's tree verifies (ancestor mask) where measured, chains below them.
        tree_costs = {**costs, **load_costs(profile, dtype, threads, device_type, kind="tree")}
        costs_info.update(dtype=dtype, threads=threads, seconds_per_width=costs)
        summaries = []
        for spec, m in zip(specs, methods, strict=True):
            summary = {key: v for key, v in m.items() if key != "per_prompt"}
            summary["spec"] = spec
            summary.update(drafter_family(spec))
            summary["temperature"] = t
            summaries.append(summary)
            # A reference in transformers' loop is measured, not recommended.
            ours = summary["loop"] == "ours"
            if ours and summary["shape"] in ("chain", "parallel"):
                parallel = summary["shape"] == "parallel"
                recs.append({"spec": spec, **recommend(summary, costs, max_k, parallel=parallel)})
            elif ours and summary["shape"] == "tree":
                trees.append(
                    {
                        "method": m["method"],
                        "spec": spec,
                        "temperature": t,
                        "tree_total_tokens": config.get("tree_total_tokens"),
                        "tree_topk": config.get("tree_topk"),
                        # Trees at every temperature (sampled: SpecInfer's rule, docs/design.md).
                        "drafts": "tree",
                        **{
                            key: m.get(key)
                            for key in (
                                "acceptance_length",
                                "speedup",
                                "speedup_vs_fastest_plain",
                                "tokens_per_second",
                                "identical_to_target",
                            )
                        },
                        # Smaller trees of the same depth and top-k, from the same steps.
                        "size": recommend_tree(summary, tree_costs),
                    }
                )
        entries.append(
            {
                "temperature": t,
                "results_file": os.path.relpath(raw, stem.parent),
                "prompts_evaluated": data.get("prompts_evaluated"),
                "prompts_selected": data.get("prompts_selected"),
                "machine_load": data.get("machine_load"),
                "evaluate_command": command,  # evaluate's own `command` is the bench's argv
                "evaluate_machine": data.get("machine"),
                "evaluate_config": config,
                "methods": summaries,
            }
        )
    config = first.get("config", {})
    return {
        "bench": {
            "temperatures": [t for t, _, _ in runs],
            "drafters": config.get("drafter"),
            "k": config.get("k"),
            "max_k": max_k,
            "dtype": config.get("dtype"),
            "draft_dtype": config.get("draft_dtype", "same"),
            "target": config.get("target"),
            "prompts": config.get("prompts"),
            "split": config.get("split"),
            "max_new_tokens": config.get("max_new_tokens"),
        },
        "seed": config.get("seed"),
        "runs": entries,
        "cost_profile": costs_info,
        "recommendations": recs,
        "trees": trees,
        "training": [_with_measured(tr, entries) for tr in training],
    }


def tree_size_markdown(trees: list[dict[str, Any]]) -> list[str]:
    """The "Tree size" section: each ranked tree's predicted speedup at every smaller size."""
    lines = [
        "## Tree size (predicted from the measured tree)",
        "",
        "Every step of a measured EAGLE-2 tree also counted what its best m nodes alone would "
        "have accepted (the reranking keeps a prefix of its order), so τ at each smaller size "
        "of the same depth and top-k is measured on the same steps; the speedup scales the "
        "measured one by τ and by the verify cost per width of the cost profile "
        "(train/report/recommend.py). To try larger trees, measure a large one.",
        "",
    ]
    rows = []
    for r in trees:
        size = r["size"]
        shown = sorted({1, 2, 4, 6, 8, 12, 16, 24, size["best_nodes"], size["measured_nodes"]})
        cells = " ".join(
            f"{m}: {size['tau_by_size'][m - 1]:.2f} / {size['predicted'][m - 1]:.2f}x"
            for m in shown
            if m <= len(size["predicted"])
        )
        vs_fastest = size.get("best_predicted_speedup_vs_fastest_plain")
        rows.append(
            [
                r["method"],
                f"{r['temperature']:g}",
                str(size["measured_nodes"]),
                fmt_number(size["measured_speedup"], ".2f", "x"),
                str(size["best_nodes"]),
                fmt_number(size["best_predicted_speedup"], ".2f", "x"),
                fmt_number(vs_fastest, ".2f", "x"),
                cells,
            ]
        )
    cols = [
        "method",
        "T",
        "measured nodes",
        "measured",
        "best nodes",
        "predicted at best",
        "vs fastest plain",
        "nodes: τ / predicted speedup",
    ]
    lines += [markdown_table(cols, rows), ""]
    flat = sorted({w for r in trees for w in r["size"]["extrapolated_widths"]})
    if flat:
        lines += [
            f"Verify widths {flat[0]}-{flat[-1]} are past the cost profile's widest "
            "measurement; their cost is held at it (optimistic for the largest trees).",
            "",
        ]
    return lines


def _with_measured(training: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The training curve plus the measured τ of every drafter benched from that run's dir."""
    run_dir = Path(training["dir"]).resolve()
    # `best/` holds the drafter of the best validation, anything else the last one.
    best_step = (training.get("best") or {}).get("step")
    at_best = next(
        (m for m, s in zip(training["minutes"], training["steps"], strict=True) if s == best_step),
        training["minutes"][-1],
    )
    measured = []
    for entry in entries:
        for m in entry["methods"]:
            _, _, path = m["spec"].partition("=")
            if path and Path(path).resolve().is_relative_to(run_dir):
                measured.append(
                    {
                        "method": m["method"],
                        "temperature": entry["temperature"],
                        "k": m["k"],
                        "acceptance_length": m["acceptance_length"],
                        "training_minutes": at_best
                        if "best" in Path(path).parts
                        else training["minutes"][-1],
                    }
                )
    return {**training, "measured": measured}


def write_outputs(report: dict[str, Any], stem: Path) -> dict[str, Any]:
    """Write ``OUT.json``, ``OUT.md`` and the plots; returns their paths (also in the JSON)."""
    plots_dir = stem.with_name(stem.name + "_plots")
    plots = write_plots(report, plots_dir)
    outputs = {
        "json": str(stem.with_name(stem.name + ".json")),
        "markdown": str(stem.with_name(stem.name + ".md")),
        "plots": [str(p) for p in plots],
        "results_files": [str(stem.parent / e["results_file"]) for e in report["runs"]],
    }
    report["outputs"] = outputs
    write_json_atomic(outputs["json"], report)
    md = markdown(report, [os.path.relpath(p, stem.parent) for p in plots])
    Path(outputs["markdown"]).write_text(md)
    return outputs


def results_rows(report: dict[str, Any]) -> list[list[str]]:
    """The main table's rows: one per method and temperature, in run order."""
    rows = []
    for entry in report["runs"]:
        for m in entry["methods"]:
            vs = (
                f"{m['speedup_vs_fastest_plain']:.2f}x ({m['fastest_plain_dtype']})"
                if "speedup_vs_fastest_plain" in m
                else "-"
            )
            rows.append(
                [
                    m["method"],
                    m.get("family") or "-",
                    m["shape"] if m.get("loop", "ours") == "ours" else f"{m['shape']} (hf loop)",
                    f"{entry['temperature']:g}",
                    str(m["k"]),
                    str(m["num_prompts"]),
                    fmt_number(m["acceptance_length"]),
                    " ".join(f"{a:.2f}" for a in m["acceptance_rate_per_position"]),
                    fmt_number(m["tokens_per_second"], ".1f"),
                    fmt_number(m.get("baseline_tokens_per_second"), ".1f"),
                    fmt_number(m.get("speedup"), ".2f", "x"),
                    vs,
                    fmt_number(100 * m["draft_time_fraction"], ".0f", "%"),
                    identical_text(m, sampled="- (sampled)", gaps=True),
                ]
            )
    return rows


RESULT_COLUMNS = [
    "method",
    "family",
    "shape",
    "T",
    "k",
    "prompts",
    "τ",
    "α per position",
    "tok/s",
    "plain tok/s",
    "speedup",
    "vs fastest plain",
    "draft share",
    "identical",
]


def recommendation_text(rec: dict[str, Any]) -> str:
    """One line: the best k and its predicted speedup beside the measured one."""
    measured = fmt_number(rec["measured_speedup"], ".2f", "x")
    line = (
        f"{rec['method']} (T={rec['temperature']:g}): measured {measured} at k={rec['run_k']} "
        f"(predicted {rec['predicted_at_run_k']:.2f}x); best k={rec['best_k']}: predicted "
        f"{rec['best_predicted_speedup']:.2f}x"
    )
    if rec.get("best_anchored_speedup") and rec["best_k"] != rec["run_k"]:
        line += f", {rec['best_anchored_speedup']:.2f}x anchored at the measurement"
    if rec.get("note"):
        line += f" ({rec['note']})"
    if rec["best_is_extrapolated"]:
        line += f" (α extrapolated past k={rec['measured_positions']}: measure it with --k)"
    if rec["plain_is_faster"]:
        line += " -- plain decoding is predicted faster at every k"
    return line


def busy_warnings(report: dict[str, Any]) -> list[str]:
    """The busy-machine warnings of the bench and of each evaluate run it read (docs/metrics.md:
    other work's load of at least half the cores before or after a timed run)."""
    found = [("bench", busy_warning(report.get("machine_load")))]
    found += [
        (f"T={entry['temperature']:g}", busy_warning(entry.get("machine_load")))
        for entry in report.get("runs", [])
    ]
    return [f"{where}: {text}" for where, text in found if text]


def markdown(report: dict[str, Any], plots: list[str]) -> str:
    """The bench report as markdown (busy-machine warnings, tables, recommendation, plots,
    provenance)."""
    b = report["bench"]
    lines = [
        "# draftsmith bench",
        "",
        f"Target {b['target'] or 'SmolLM2-135M-Instruct'}, prompts "
        f"{b['prompts'] or 'shipped set'} (split {b['split']}), {b['max_new_tokens']} new tokens "
        f"per prompt, dtype {b['dtype']} (drafters {b['draft_dtype']}), k={b['k']}, seed "
        f"{report['seed']}. Every drafter of one run shares one plain-decoding baseline, "
        "measured prompt by prompt between them.",
        "",
    ]
    for entry in report["runs"]:
        t = entry["temperature"]
        lines.append(
            f"- T={t:g} ({'greedy' if t == 0 else 'sampled'}): {entry['prompts_evaluated']} "
            f"prompts; results `{entry['results_file']}`"
        )
    warnings = busy_warnings(report)
    if warnings:
        lines += ["", *(f"> **{text}**" for text in warnings)]
    lines += ["", "## Results", "", markdown_table(RESULT_COLUMNS, results_rows(report)), ""]
    lines += [
        "τ = tokens per target forward; α per position as vLLM counts it; speedup over plain "
        "decoding in the same dtype, and over the fastest plain decoding measured "
        "(docs/metrics.md). Sampled runs (T > 0) have no token-for-token check: the loop's "
        "rejection sampling keeps the target's distribution (tested in "
        "tests/test_speculative.py).",
        "",
    ]
    cp = report["cost_profile"]
    if report["recommendations"]:
        lines += [
            "## Recommended draft length",
            "",
            f"Predicted from each chain drafter's measured α, its measured drafting time per "
            f"token and the verify cost per width in `{cp['path']}` ({cp.get('dtype')}, "
            f"{cp.get('threads')} thread(s)): speedup(k) = τ(k)·V(1) / (V(k+1) + k·D), mixed "
            "with plain 1-token steps by the share s of steps that drafted (n-gram lookup "
            "drafts only on a match). Prefill and loop overhead are left out, so predictions "
            "run high; 'anchored' scales the best k's prediction by measured / predicted at the "
            "run's k. α past the measured k is extrapolated.",
            "",
        ]
        rows = [
            [
                r["method"],
                f"{r['temperature']:g}",
                str(r["run_k"]),
                fmt_number(r["measured_speedup"], ".2f", "x"),
                f"{r['predicted_at_run_k']:.2f}x",
                str(r["best_k"]) + (" (extrapolated)" if r["best_is_extrapolated"] else ""),
                f"{r['best_predicted_speedup']:.2f}x",
                fmt_number(r.get("best_anchored_speedup"), ".2f", "x"),
                f"{1000 * r['draft_seconds_per_token']:.2f}",
            ]
            for r in report["recommendations"]
        ]
        cols = [
            "method",
            "T",
            "run k",
            "measured",
            "predicted at run k",
            "best k",
            "predicted at best k",
            "anchored at best k",
            "draft ms/token",
        ]
        lines += [markdown_table(cols, rows), ""]
    if report["trees"]:
        lines += ["## Trees (measured)", ""]
        rows = [
            [
                r["method"],
                f"{r['temperature']:g}",
                f"{r['tree_total_tokens']} nodes, top-{r['tree_topk']}",
                r["drafts"],
                fmt_number(r["acceptance_length"]),
                fmt_number(r["speedup"], ".2f", "x"),
                fmt_number(r["speedup_vs_fastest_plain"], ".2f", "x"),
            ]
            for r in report["trees"]
        ]
        cols = ["method", "T", "tree", "drafts", "τ", "speedup", "vs fastest plain"]
        lines += [markdown_table(cols, rows), ""]
        sized = [r for r in report["trees"] if r.get("size")]
        if sized:
            lines += tree_size_markdown(sized)
    if report["training"]:
        lines += ["## Training", ""]
        rows = []
        for tr in report["training"]:
            measured = ", ".join(
                # The method without its path: chain and tree (or ours and HF's) of one drafter.
                f"{m['method'].split('[')[0]} {m['acceptance_length']:.2f} "
                f"(k={m['k']}, T={m['temperature']:g})"
                for m in tr["measured"]
            )
            rows.append(
                [
                    tr["run"],
                    str(len(tr["minutes"])),
                    f"{tr['minutes'][-1]:.1f}",
                    f"{tr['sim_tau'][-1]:.2f}",
                    f"{max(tr['sim_tau']):.2f}",
                    measured or "-",
                ]
            )
        cols = ["run", "validations", "minutes", "last sim τ", "best sim τ", "measured τ"]
        lines += [markdown_table(cols, rows), ""]
    served = report.get("served")
    if served:
        from .served import SERVED_COLUMNS, schedule_markdown, served_rows

        version = served.get("vllm_version") or "?"
        lines += [
            "## Served by vLLM",
            "",
            f"vLLM {version}, target {served['target']} in {served['dtype']}, the first "
            f"{served['prompts']} prompts above, greedy, {served['max_new_tokens']} new tokens, "
            "each export served by its own server (exports under `"
            + str(Path(report["outputs"]["json"]).with_suffix("").name)
            + "_served/`). At each concurrency c, c requests are in flight at once; tok/s is "
            "all new tokens / wall time, speedup is over the plain server at the same c, "
            "latency is per request. τ vLLM is from its `vllm:spec_decode_*` counters, τ ours "
            "from our greedy run on the same prompts; a gap over "
            f"{100 * served['tau_gap_threshold']:.0f}% is marked.",
            "",
            markdown_table(SERVED_COLUMNS, served_rows(served)),
            "",
        ]
        lines += [f"- not served: {s['drafter']}: {s['reason']}" for s in served["skipped"]]
        lines += ["", *schedule_markdown(served)]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    lines += [
        "## Provenance",
        "",
        f"- command: `{report.get('command', '')}`",
        f"- versions: {json.dumps(report.get('versions'))}",
        f"- git commit: {report.get('git_commit')}; date {report.get('date')}",
        f"- machine: {json.dumps(report.get('machine'))}",
        f"- machine load: {json.dumps(report.get('machine_load'))}",
        "",
    ]
    return "\n".join(lines)
