"""The plots the bench and the quickstart draw (matplotlib, written as PNG files).

- The bench (:func:`write_plots`, files :data:`PLOTS`): α per draft position per drafter,
  speedup against the draft length (predicted for chains, measured for trees and HF's loops) and,
  with training logs, validation τ against training minutes.
- The quickstart (:func:`write_quickstart_plots`): its training curve and its evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .text import is_finite_number

__all__ = ["PLOTS", "write_plots", "write_quickstart_plots"]

#: The bench's plot files, in the order :func:`write_plots` writes them.
PLOTS = (
    "alpha_by_position.png",
    "speedup_vs_k.png",
    "tau_vs_training.png",
    "served_vs_concurrency.png",
)


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(report: dict[str, Any], folder: Path) -> list[Path]:
    """``alpha_by_position.png``, ``speedup_vs_k.png`` and (with training logs)
    ``tau_vs_training.png`` in ``folder``; returns the paths written."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()

    folder.mkdir(parents=True, exist_ok=True)
    runs = report["runs"]
    written = []

    # α per position: one line per drafter, one panel per temperature.
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, entry in zip(axes[0], runs, strict=True):
        for m in entry["methods"]:
            alpha = m["acceptance_rate_per_position"]
            ax.plot(range(1, len(alpha) + 1), alpha, marker="o", label=m["method"])
        ax.set_title(f"T={entry['temperature']:g}")
        ax.set_xlabel("draft position i")
        ax.set_ylabel("α_i (accepted at i / drafted steps)")
        ax.set_ylim(-0.02, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.suptitle("acceptance rate by draft position")
    _legend_below(fig, axes[0])
    _save(fig, folder / PLOTS[0], written)

    # Speedup vs draft tokens per step: chains predicted over k (solid where α was measured,
    # dashed where extrapolated) with the measured point; trees and HF loops as measured.
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, entry in zip(axes[0], runs, strict=True):
        t = entry["temperature"]
        chains = [r for r in report["recommendations"] if r["temperature"] == t]
        ticks: set[int] = set()
        for i, rec in enumerate(chains):
            color = f"C{i % 10}"
            ks = sorted(rec["predicted"], key=int)
            ys = [rec["predicted"][k] for k in ks]
            xs = [int(k) for k in ks]
            ticks.update(xs)
            n = rec["measured_positions"]
            ax.plot(xs[:n], ys[:n], "-", color=color, label=f"{rec['method']} (predicted)")
            if len(xs) > n:
                ax.plot(xs[n - 1 :], ys[n - 1 :], "--", color=color, alpha=0.7)
            if is_finite_number(rec["measured_speedup"]):
                ax.plot([rec["run_k"]], [rec["measured_speedup"]], "*", color=color, ms=12)
            ax.plot([rec["best_k"]], [rec["best_predicted_speedup"]], "o", mfc="none", color=color)
        others = [m for m in entry["methods"] if m["shape"] != "chain" or m["loop"] != "ours"]
        for j, m in enumerate(others):
            if not is_finite_number(m.get("speedup")):
                continue
            tree = m["shape"] == "tree" and t == 0
            x = int(entry["evaluate_config"].get("tree_total_tokens") if tree else m["k"])
            ticks.add(x)
            ax.plot(
                [x],
                [m["speedup"]],
                "D" if tree else "x",
                color=f"C{(len(chains) + j) % 10}",
                ms=8,
                label=f"{m['method']} (measured)",
            )
        ax.axhline(1.0, color="grey", lw=0.8)
        if any(m["shape"] == "tree" for m in others) and t == 0:
            ax.set_xscale("log", base=2)  # tree sizes (8-64) beside chain lengths (1-8)
        if ticks:
            ax.set_xticks(sorted(ticks), [str(x) for x in sorted(ticks)])
        ax.set_title(f"T={t:g}: ★ measured, ○ best predicted")
        ax.set_xlabel("draft tokens verified per step (chain: k; tree: nodes)")
        ax.set_ylabel("speedup over plain decoding")
        ax.grid(alpha=0.3)
    fig.suptitle("speedup vs k (verify costs: " + Path(report["cost_profile"]["path"]).name + ")")
    _legend_below(fig, axes[0])
    _save(fig, folder / PLOTS[1], written)

    if report["training"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, tr in enumerate(report["training"]):
            color = f"C{i % 10}"
            ax.plot(
                tr["minutes"],
                tr["sim_tau"],
                "o-",
                color=color,
                label=f"{tr['run']}: validation simulated τ",
            )
            for j, m in enumerate(tr["measured"]):
                ax.plot(
                    [m["training_minutes"]],
                    [m["acceptance_length"]],
                    "*PXD^s"[j % 6],
                    color=color,
                    ms=12,
                    label=f"{m['method']}: measured τ (k={m['k']}, T={m['temperature']:g})",
                )
        ax.set_xlabel("training minutes")
        ax.set_ylabel("τ (tokens per target forward)")
        ax.grid(alpha=0.3)
        ax.set_title("τ vs training time")
        _legend_below(fig, [ax])
        _save(fig, folder / PLOTS[2], written)

    # Served by vLLM: tokens/s and speedup over the plain server against requests in flight.
    served = report.get("served") or {}
    if served.get("rows"):
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        for i, row in enumerate(served["rows"]):
            conc = [lv["concurrency"] for lv in row["levels"]]
            style = {"color": f"C{i % 10}", "marker": "o", "label": row["label"]}  # same in both
            left.plot(conc, [lv["tokens_per_second"] for lv in row["levels"]], **style)
            if row["label"] != "plain" and any(lv.get("speedup") for lv in row["levels"]):
                right.plot(conc, [lv.get("speedup") or 0 for lv in row["levels"]], **style)
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("requests in flight")
            ax.grid(alpha=0.3)
        _legend_below(fig, [left, right])
        left.set_ylabel("tokens/s (all requests)")
        right.set_ylabel("speedup over the plain server")
        right.axhline(1.0, color="grey", lw=0.8)
        fig.suptitle("served by vLLM")
        _save(fig, folder / PLOTS[3], written)
    return written


def write_quickstart_plots(
    folder: Path, training: dict[str, Any], result: dict[str, Any]
) -> list[Path]:
    """``training.png`` (loss, validation τ) and ``evaluation.png`` (α per position, τ per
    prompt); an empty list when there is nothing to draw."""
    plt = _pyplot()

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    log, val = training.get("train_log") or [], training.get("validation") or []
    if log or val:
        fig, ax = plt.subplots(figsize=(7, 4))
        steps = [e["step"] for e in log if e.get("train/loss") is not None]
        ax.plot(steps, [e["train/loss"] for e in log if e.get("train/loss") is not None])
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        if val:
            ax2 = ax.twinx()
            ax2.plot([v["step"] for v in val], [v.get("val/sim_tau") for v in val], "o-", c="C1")
            ax2.set_ylabel("validation simulated τ", color="C1")
        ax.set_title("EAGLE-3 training")
        _save(fig, folder / "training.png", written)
    alpha = result.get("acceptance_rate_per_position") or []
    per_prompt = result.get("per_prompt") or []
    if alpha or per_prompt:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.bar(range(1, len(alpha) + 1), alpha)
        a.set_xlabel("draft position")
        a.set_ylabel("α (accepted / steps)")
        a.set_title(f"acceptance per position (τ {result.get('acceptance_length', 0):.2f})")
        b.bar(range(len(per_prompt)), [p["acceptance_length"] for p in per_prompt])
        b.axhline(1.0, color="grey", lw=0.8)
        b.set_xlabel("held-out prompt")
        b.set_ylabel("τ")
        b.set_title("τ per prompt")
        _save(fig, folder / "evaluation.png", written)
    return written


def _legend_below(fig, axes) -> None:
    """One legend for all panels, under them: with nine drafters a legend inside a panel hides
    the lines it names. Labels shared by panels (the same drafter) are listed once."""
    entries: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    if entries:
        ncol = max(1, min(3, int(fig.get_figwidth() // 4)))
        fig.legend(
            list(entries.values()),
            list(entries),
            loc="upper center",
            bbox_to_anchor=(0.5, 0.0),
            ncol=ncol,
            fontsize=7,
            frameon=False,
        )


def _save(fig, path: Path, written: list[Path]) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": the legend under the panels
    plt.close(fig)
    written.append(path)
