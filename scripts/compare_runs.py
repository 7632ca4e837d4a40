"""Learning curves of several training runs side by side: validation simulated τ vs minutes.

Reads each run's ``training_metrics.json`` (any recipe: its ``validation`` entries carry
``val/sim_tau`` and ``val/minutes``) and writes one JSON (the curves, each run's steps, minutes
and best validation, with the command, versions and machine) and a PNG beside it. No model is
loaded: it reads what the runs recorded, so it costs nothing on a busy machine.

Run::

    python scripts/compare_runs.py --run eagle3=bench/early_decoding/ref_eagle3_sd1800_25min_training_metrics.json \\
        --run peagle=runs/peagle/training_metrics.json --run dflash=runs/dflash \\
        --out bench/parallel/avx512bf16/learning_curves.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_run(spec: str) -> tuple[str, dict]:
    """``LABEL=PATH`` (a run directory or its ``training_metrics.json``) -> (label, metrics)."""
    label, sep, path = spec.partition("=")
    if not sep:
        raise SystemExit(f"error: --run {spec!r}: expected LABEL=PATH")
    p = Path(path)
    if p.is_dir():
        p = p / "training_metrics.json"
    try:
        return label, json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: --run {label}: cannot read {p}: {exc}") from exc


def curve(metrics: dict) -> list[dict]:
    """``[{step, minutes, sim_tau, accs}]`` from a run's validations."""
    out = []
    for v in metrics.get("validation") or []:
        accs = [v[k] for k in sorted(v, key=_acc_index) if k.startswith("val/acc_")]
        out.append(
            {
                "step": v["step"],
                "minutes": v.get("val/minutes"),
                "sim_tau": v.get("val/sim_tau"),
                "accs": accs,
            }
        )
    return out


def _acc_index(key: str) -> int:
    tail = key.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, help="LABEL=PATH, repeated")
    parser.add_argument("--out", required=True, help="results JSON (a PNG is written beside it)")
    args = parser.parse_args(argv)

    from draftsmith.train.runinfo import run_info

    runs = {}
    for spec in args.run:
        label, metrics = read_run(spec)
        runs[label] = {
            "kind": metrics.get("kind"),
            "steps": metrics.get("steps"),
            "train_minutes": (metrics.get("train_seconds") or 0) / 60,
            "best": metrics.get("best"),
            "data": metrics.get("data"),
            "curve": curve(metrics),
        }
    out = Path(args.out)
    result = {"runs": runs, "command": " ".join(sys.argv), **run_info()}
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, run in runs.items():
        pts = [(c["minutes"], c["sim_tau"]) for c in run["curve"] if c["minutes"] is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"{label} ({run['steps']} steps)")
    ax.set_xlabel("training minutes (2 CPU cores)")
    ax.set_ylabel("validation simulated τ")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    for label, run in runs.items():
        last = run["curve"][-1] if run["curve"] else {}
        print(
            f"{label}: {run['steps']} steps in {run['train_minutes']:.1f} min, "
            f"final sim τ {last.get('sim_tau', float('nan')):.3f}"
        )
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
