"""Issue 24: where would a parallel drafter's learning curve cross EAGLE-3's in speedup?

From one merged bench (``draftsmith bench --merge``) of P-EAGLE, DFlash and EAGLE-3 trained on the
same data for the same minutes, and their training runs:

1. **What each parallel drafter needs.** A round at draft length k costs a verify of width k + 1
   (the bench's cost profile) plus the drafting: once per round for a parallel drafter, k forwards
   for EAGLE-3 (the bench's measured draft seconds). Speedup is τ over that cost, so the
   parallel drafter matches EAGLE-3 when ``τ_par / τ_eagle3 >= (verify + draft_par) / (verify +
   draft_eagle3)``: the ratio ``r_k`` printed.
2. **Where the curves are.** Each validation's simulated τ at draft length k (from its per-position
   accuracies, :func:`simulated_tau`), against training samples seen (steps x batch x accumulation).
3. **Where they would cross.** ``τ(n) = a + b ln n`` fitted to each curve; the crossing is the n
   where ``τ_par(n) = r_k τ_eagle3(n)``, or none when the parallel curve's slope is below
   ``r_k`` times EAGLE-3's (the gap widens). A fit over one data set and ~4x of samples: read the
   crossing as an order of magnitude, not a forecast.

Run::

    python bench/cpu_costs/crossing.py bench/families/avx512bf16/three_eq_k2_l100.json \\
        --runs peagle=$RUNS/eq/peagle dflash=$RUNS/eq/dflash \\
        eagle3=$RUNS/qs60_alpaca/eagle3 --out bench/cpu_costs/crossing.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from draftsmith.train.decoding.metrics import simulated_tau
from draftsmith.train.runinfo import run_info


def curve(run: Path, k: int) -> list[tuple[float, float]]:
    """(samples seen, simulated τ at draft length k) at each validation of a training run."""
    metrics = json.loads((run / "training_metrics.json").read_text())
    cfg = metrics["config"]
    per_step = cfg["batch_size"] * cfg["grad_accum"] * metrics.get("processes", 1)
    points = []
    for v in metrics["validation"]:
        accs = [v[f"val/acc_{j}"] for j in range(k) if f"val/acc_{j}" in v]
        if len(accs) == k:
            points.append((v["step"] * per_step, simulated_tau(accs)))
    return points


def log_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``τ = a + b ln n``: (a, b)."""
    xs = [math.log(n) for n, _ in points]
    ys = [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return my - b * mx, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", type=Path, help="the merged bench JSON")
    parser.add_argument("--runs", nargs="+", required=True, help="name=training output dir")
    parser.add_argument("--reference", default="eagle3", help="the autoregressive drafter")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    bench = json.loads(args.bench.read_text())
    verify = {int(w): s for w, s in bench["cost_profile"]["seconds_per_width"].items()}
    runs = dict(spec.split("=", 1) for spec in args.runs)
    recs = {r["spec"].split("=", 1)[0]: r for r in bench["recommendations"]}
    names = {"peagle": "peagle", "dflash": "dflash", "eagle3": "eagle"}
    ref = recs[names.get(args.reference, args.reference)]
    result: dict = {"bench": str(args.bench), "runs": runs, "by_k": {}}
    for k in args.k:
        width = min(verify, key=lambda w: abs(w - (k + 1)))
        v = verify[width]
        d_ref = ref["draft_seconds_per_token"] * k
        ref_curve = curve(Path(runs[args.reference]), k)
        a_ref, b_ref = log_fit(ref_curve)
        rows = {}
        for name, run in runs.items():
            if name == args.reference:
                continue
            rec = recs[names.get(name, name)]
            d = rec["draft_seconds_per_step"]  # once per round
            r = (v + d) / (v + d_ref)
            pts = curve(Path(run), k)
            a, b = log_fit(pts)
            n_now = pts[-1][0]
            denom = b - r * b_ref
            crossing = None
            if denom > 0:
                crossing = math.exp((r * a_ref - a) / denom)
            rows[name] = {
                "needed_tau_ratio": round(r, 4),
                "tau_ratio_now": round(pts[-1][1] / ref_curve[-1][1], 4),
                "fit": {"a": round(a, 4), "b": round(b, 4)},
                "samples_now": n_now,
                "crossing_samples": None if crossing is None else round(crossing),
                "curve": [(n, round(t, 4)) for n, t in pts],
            }
            where = (
                "never: its slope is below r x EAGLE-3's"
                if crossing is None
                else f"at ~{crossing:,.0f} samples seen ({crossing / n_now:.1f}x now)"
            )
            print(
                f"k = {k}: {name} needs τ ≥ {r:.3f} × EAGLE-3's (verify {1e3 * v:.1f} ms, "
                f"drafting {1e3 * d:.1f} against {1e3 * d_ref:.1f} ms); now "
                f"{pts[-1][1] / ref_curve[-1][1]:.3f} (sim τ {pts[-1][1]:.3f} against "
                f"{ref_curve[-1][1]:.3f}); fits τ = {a:.3f} + {b:.4f} ln n against "
                f"{a_ref:.3f} + {b_ref:.4f} ln n; crossing {where}"
            )
        result["by_k"][str(k)] = {
            "verify_seconds": v,
            "reference_draft_seconds": d_ref,
            "reference_fit": {"a": round(a_ref, 4), "b": round(b_ref, 4)},
            "reference_curve": [(n, round(t, 4)) for n, t in ref_curve],
            "drafters": rows,
        }
    result.update(run_info())
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
