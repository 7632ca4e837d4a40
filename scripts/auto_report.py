"""Tables and plots of the per-step decision (auto) from ``draftsmith evaluate`` results.

For each results JSON (one run, or merged shards) that holds an ``auto[...]`` method:

* ``<stem>_verify_costs.png``: the probed verify cost by chain width and by tree size, every
  repetition as a dot, the median as a line and the curve the decision used dashed (each
  shard's probe when merged);
* ``<stem>_categories.png``: every method's speedup over the fastest plain decoding per prompt
  category;
* ``auto_report.md``: per file, the methods side by side (τ, × fastest plain), the per-category
  table, auto against every other method (paired per-prompt ratios with 95 % intervals, overall
  and per category), what the decision did, and the calibration's held-out error.

Usage::

    python scripts/auto_report.py bench/auto_decision/eval32_t0.json \
        bench/auto_decision/eval32_t0.7.json --out bench/auto_decision
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _short(method: str) -> str:
    return method.split("[")[0]


def _speed(row: dict[str, Any]) -> float | None:
    return row.get("speedup_vs_fastest_plain", row.get("speedup"))


def _probes(data: dict[str, Any]) -> list[dict[str, Any]]:
    probe = data.get("verify_costs") or {}
    return probe.get("shards", [probe]) if probe else []


def plot_costs(data: dict[str, Any], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probes = _probes(data)
    if not probes:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for i, probe in enumerate(probes):
        for ax, kind, xlabel in zip(
            axes,
            ("chain", "tree"),
            ("tokens in the forward (chain: drafts + 1)", "draft nodes in the tree"),
            strict=True,
        ):
            sizes = sorted(int(s) for s in probe[kind])
            for s in sizes:
                reps = probe[kind][str(s)]
                ax.scatter([s] * len(reps), reps, s=8, alpha=0.35, color=f"C{i}")
            ax.plot(
                sizes,
                [probe["median_ms"][kind][str(s)] for s in sizes],
                "-o",
                ms=3,
                color=f"C{i}",
                label=f"probe {i + 1}" if len(probes) > 1 else "median",
            )
            if "used_ms" in probe:  # the curve the decision used (noise dips fitted away)
                ax.plot(
                    sizes,
                    [probe["used_ms"][kind][str(s)] for s in sizes],
                    "--",
                    color=f"C{i}",
                    lw=1,
                    label="used" if i == 0 else None,
                )
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
    axes[0].set_ylabel("ms per target forward")
    axes[0].set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    machine = (data.get("machine") or {}).get("cpu_model") or ""
    fig.suptitle(
        f"verify cost on this machine ({data['config'].get('dtype')}) {machine}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_categories(methods: list[dict[str, Any]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = sorted({c for m in methods for c in m.get("by_category") or {}})
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        values = [_speed((m.get("by_category") or {}).get(c, {})) or 0.0 for c in cats]
        ax.bar([j + i * width for j in range(len(cats))], values, width, label=_short(m["method"]))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=20, fontsize=8)
    ax.set_ylabel("× the fastest plain decoding")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, ncol=len(methods))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _interval(r: dict[str, Any]) -> str:
    if r.get("low") is None or r.get("high") is None:
        return f"{r['ratio']:.2f} (1 prompt)"
    return f"{r['ratio']:.2f} ({r['low']:.2f}–{r['high']:.2f})"


def report(path: Path, out: Path) -> list[str]:
    data = json.loads(path.read_text())
    methods = data.get("methods") or [data]
    auto = next((m for m in methods if str(m["method"]).startswith("auto[")), None)
    stem = path.stem
    t = data["config"].get("temperature", 0.0)
    lines = [f"## `{path.name}` (T = {t:g}, {data.get('prompts_evaluated')} prompts)", ""]
    lines += ["| method | k | τ | × fastest plain |", "|---|---|---|---|"]
    for m in methods:
        lines.append(
            f"| {_short(m['method'])} | {m['k']} | {_fmt(m['acceptance_length'])} | "
            f"{_fmt(_speed(m), '.2f', '×')} |"
        )
    cats = sorted({c for m in methods for c in m.get("by_category") or {}})
    lines += ["", "Per category (× fastest plain; τ):", ""]
    lines.append(
        "| category | prompts | " + " | ".join(_short(m["method"]) for m in methods) + " |"
    )
    lines.append("|---|---|" + "---|" * len(methods))
    for c in cats:
        rows = [(m.get("by_category") or {}).get(c, {}) for m in methods]
        cells = [f"{_fmt(_speed(r), '.2f', '×')}, {_fmt(r.get('acceptance_length'))}" for r in rows]
        lines.append(f"| {c} | {rows[0].get('prompts', '-')} | " + " | ".join(cells) + " |")
    if auto is not None:
        lines += ["", "auto ÷ each method, paired per prompt (geometric mean, 95 % interval):", ""]
        lines.append("| against | overall | lowest category |")
        lines.append("|---|---|---|")
        for v in auto.get("versus") or []:
            o = v["overall"]
            worst = min(
                ((c, r) for c, r in v["by_category"].items() if r), key=lambda cr: cr[1]["ratio"]
            )
            lines.append(
                f"| {_short(v['against'])} | {_interval(o)} | {worst[0]} {_interval(worst[1])} |"
            )
        s = auto["decision"]["stats"]
        cal = auto["decision"]["calibration"]
        lines += [
            "",
            f"The decision: {s['steps']} steps, {s['verified_nothing']} verified nothing, "
            f"{s['chain_steps']} chains, {s['tree_steps']} trees, "
            f"{s['nodes_verified'] / max(s['steps'], 1):.1f} nodes a step; the learned drafter "
            f"drafted {s['learned_drafts']} times and sat out {s['learned_sat_out']}. "
            f"Calibration: {cal['learned_nodes']} learned and {cal['lookup_nodes']} lookup "
            f"nodes on {cal['prompts']} prompts, held-out ECE {_fmt(cal['heldout_ece_raw'], '.3f')}"
            f" raw, {_fmt(cal['heldout_ece_calibrated'], '.3f')} calibrated.",
        ]
    plots = [plot_costs(data, out / f"{stem}_verify_costs.png")]
    if cats:
        plots.append(plot_categories(methods, out / f"{stem}_categories.png", f"{path.name}"))
    lines += [""] + [f"![{p.name}]({p.name})" for p in plots if p] + [""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="folder for the plots and md")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = ["# The per-step decision (auto): tables and plots", ""]
    for path in args.results:
        lines += report(path, args.out)
    (args.out / "auto_report.md").write_text("\n".join(lines))
    print(f"written {args.out / 'auto_report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
