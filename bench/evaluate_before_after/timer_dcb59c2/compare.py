"""Compare the four evaluate runs of run.sh: figures, output ids, per-prompt paired ratios."""

import json
import math
import statistics as st
from pathlib import Path

HERE = Path(__file__).resolve().parent
TAGS = ("before_1", "after_1", "before_2", "after_2")
T95 = 2.13  # Student's t, 15 degrees of freedom (16 prompts)


def method(result: dict) -> dict:
    return result["methods"][0] if "methods" in result else result


def interval(logs: list[float]) -> str:
    m, se = st.mean(logs), st.stdev(logs) / math.sqrt(len(logs))
    lo, hi = math.exp(m - T95 * se), math.exp(m + T95 * se)
    return f"{math.exp(m):.3f} (95% {lo:.3f}..{hi:.3f})"


def main() -> None:
    runs = {t: json.loads((HERE / f"{t}.json").read_text()) for t in TAGS}
    for tag, result in runs.items():
        m = method(result)
        print(
            f"{tag}: τ {m['acceptance_length']:.3f} tok/s {m['tokens_per_second']:.2f} "
            f"plain {m['baseline_tokens_per_second']:.2f} speedup {m['speedup']:.3f} "
            f"vs fastest {m.get('speedup_vs_fastest_plain'):.3f} "
            f"draft share {m.get('draft_time_fraction', 0):.3f} git {result.get('git_commit')}"
        )
    ref = method(runs["before_1"])["per_prompt"]
    for tag, result in runs.items():
        pp = method(result)["per_prompt"]
        spec = all(a["output_ids"] == b["output_ids"] for a, b in zip(ref, pp, strict=True))
        base = all(
            a.get("baseline_output_ids") == b.get("baseline_output_ids")
            for a, b in zip(ref, pp, strict=True)
        )
        print(f"{tag}: output ids identical to before_1: drafter {spec}, plain {base}")
    pairs = (("before_1", "after_1"), ("before_2", "after_2"))
    pairs += (("before_1", "before_2"), ("after_1", "after_2"))
    for a, b in pairs:
        pa, pb = method(runs[a])["per_prompt"], method(runs[b])["per_prompt"]
        for key in ("tokens_per_second", "baseline_tokens_per_second"):
            logs = [math.log(y[key] / x[key]) for x, y in zip(pa, pb, strict=True)]
            print(f"{b}/{a} {key}: geometric mean ratio {interval(logs)}")
        logs = [
            math.log(
                (y["tokens_per_second"] / y["baseline_tokens_per_second"])
                / (x["tokens_per_second"] / x["baseline_tokens_per_second"])
            )
            for x, y in zip(pa, pb, strict=True)
        ]
        print(f"{b}/{a} per-prompt speedup ratio {interval(logs)}")


if __name__ == "__main__":
    main()
