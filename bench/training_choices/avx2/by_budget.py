"""The main job by budget: τ on the 32 held-out prompts against `--budget-minutes`, and each run's
validation curve (issue 26, docs/quickstart.md "By budget").

Reads every `quickstart*` folder beside this script (each holds one `draftsmith quickstart` run's
`quickstart.json`, `training_metrics.json` and `eval32_fp32_tau.json`, the τ of its `best/` on all
32 held-out prompts, fp32, greedy, k = 3, 128 tokens) and writes `by_budget.json` and `.png`.

    python bench/training_choices/avx2/by_budget.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftsmith.train.runinfo import run_info

HERE = Path(__file__).resolve().parent


def one_run(folder: Path) -> dict:
    """The figures of one quickstart run (its folder of results)."""
    state = json.loads((folder / "quickstart.json").read_text())
    metrics = json.loads((folder / "training_metrics.json").read_text())
    job_eval = json.loads((folder / "eval.json").read_text())
    tau32 = json.loads((folder / "eval32_fp32_tau.json").read_text())
    summary, plan = state["summary"], state["plan"]
    grown = plan.get("grown")
    return {
        "run": folder.name,
        "budget_minutes": plan["budget_minutes"],
        "total_minutes": state["total_seconds"] / 60,
        # Records made: the plan's, or what it grew to when the data came out faster than planned.
        "records": (grown or plan)["records"],
        "grown_from": grown["from"]["records"] if grown else None,
        "train_records": metrics["train_samples"],
        "steps": metrics["steps"],
        "total_steps": metrics["total_steps"],
        "train_minutes": metrics["train_seconds"] / 60,
        "job_tau": summary["acceptance_length"],
        "job_prompts": job_eval["num_prompts"],
        "job_speedup_vs_fastest_plain": summary["speedup_vs_fastest_plain"],
        "val_sim_tau": summary["validation"]["sim_tau"],
        "val_gap": summary["validation"]["gap"],
        "tau32": tau32["acceptance_length"],
        "alpha32": tau32["acceptance_rate_per_position"],
        "curve": [
            {"minutes": v["val/minutes"], "step": v["step"], "sim_tau": v["val/sim_tau"]}
            for v in metrics["validation"]
        ],
    }


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, r in enumerate(runs):
        # Runs of one budget side by side (a few minutes apart), so their labels do not overlap.
        same = sum(q["budget_minutes"] == r["budget_minutes"] for q in runs[:i])
        x = r["budget_minutes"] + 7 * same
        left.scatter(x, r["tau32"], color="C0", zorder=3)
        left.annotate(
            f"{r['records']} rec.",
            (x, r["tau32"]),
            textcoords="offset points",
            xytext=(5, -3),
            fontsize=8,
        )
        xs = [p["minutes"] for p in r["curve"]]
        ys = [p["sim_tau"] for p in r["curve"]]
        right.plot(xs, ys, marker=".", label=f"{r['budget_minutes']:g} min ({r['run']})")
        right.scatter([r["train_minutes"]], [r["tau32"]], marker="x", color="black", zorder=3)
    left.set_xlabel("--budget-minutes")
    left.set_ylabel("τ, 32 held-out prompts (fp32, greedy, k = 3)")
    left.set_xticks(sorted({r["budget_minutes"] for r in runs}))
    left.set_title("evaluated τ by budget")
    left.grid(alpha=0.3)
    right.set_xlabel("training minutes")
    right.set_ylabel("validation simulated τ")
    right.set_title("validation τ while training (x: evaluated τ at the end)")
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE / "by_budget.json"))
    args = p.parse_args()
    folders = sorted(f for f in HERE.glob("quickstart*") if (f / "eval32_fp32_tau.json").exists())
    runs = sorted((one_run(f) for f in folders), key=lambda r: (r["budget_minutes"], r["run"]))
    out = Path(args.out)
    out.write_text(json.dumps({**run_info(), "runs": runs}, indent=1) + "\n")
    plot(runs, out.with_suffix(".png"))
    for r in runs:
        print(
            f"{r['run']}: {r['budget_minutes']:g} min, {r['records']} records, {r['steps']} steps "
            f"({r['train_minutes']:.0f} min), τ32 {r['tau32']:.3f}, job τ {r['job_tau']:.2f} "
            f"{r['job_speedup_vs_fastest_plain']:.2f}x, val {r['val_sim_tau']:.2f} "
            f"(gap {100 * r['val_gap']:+.0f} %)"
        )
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
