"""τ of two evaluations on the prompts both decoded, and a bootstrap interval of their ratio.

    python bench/training_choices/avx2/paired_tau.py bench/training_choices/avx2/eval_eagle31.json \
        bench/training_choices/avx2/eval_layers_2_15_29.json

τ over a set of prompts is their new tokens over their target forwards (as ``draftsmith evaluate``
reports it); the interval resamples prompts with replacement (2,000 draws, seed 0), the same
prompts for both evaluations in each draw, so it shows how much of a difference the choice of
prompts alone could make.
"""

from __future__ import annotations

import argparse
import json
import random


def per_prompt(path: str) -> dict[str, tuple[int, int]]:
    """Prompt id -> (new tokens, target forwards) of one ``draftsmith evaluate`` JSON."""
    with open(path) as f:
        rows = json.load(f)["per_prompt"]
    return {str(r["id"]): (r["new_tokens"], r["counters"]["target_forwards"]) for r in rows}


def tau(rows: list[tuple[int, int]]) -> float:
    return sum(n for n, _ in rows) / sum(f for _, f in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", help="evaluation JSON of the reference")
    ap.add_argument("variant", help="evaluation JSON of the variant")
    ap.add_argument("--draws", type=int, default=2000)
    args = ap.parse_args()
    ref, var = per_prompt(args.reference), per_prompt(args.variant)
    ids = [i for i in ref if i in var]
    a, b = [ref[i] for i in ids], [var[i] for i in ids]
    rng = random.Random(0)
    ratios = []
    for _ in range(args.draws):
        pick = [rng.randrange(len(ids)) for _ in ids]
        ratios.append(tau([b[j] for j in pick]) / tau([a[j] for j in pick]))
    ratios.sort()
    lo, hi = ratios[int(0.025 * args.draws)], ratios[int(0.975 * args.draws) - 1]
    result = {
        "prompts": len(ids),
        "reference_tau": round(tau(a), 4),
        "variant_tau": round(tau(b), 4),
        "ratio": round(tau(b) / tau(a), 4),
        "ratio_95ci": [round(lo, 4), round(hi, 4)],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
