"""Steps of one data set that cost what N steps of another cost (issue 26, longer answers).

An offline EAGLE-3 step right-pads `batch_size` random records to the longest of them, and its
cost (the drafter layer and the 8,192-row head over every padded position, `ttt_steps` times) is
close to proportional to the padded positions. So "equal minutes" between data sets of different
lengths is taken as equal expected padded positions per step, estimated by drawing batches.

    python bench/training_choices/avx2/equal_compute_steps.py REF_TOKENIZED OTHER_TOKENIZED --steps 301 --max-steps 726
"""

from __future__ import annotations

import argparse
import json
import random

from datasets import load_from_disk

from draftsmith.train.runinfo import run_info


def padded_per_batch(path: str, batch_size: int, draws: int, seed: int) -> tuple[float, float, int]:
    lengths = [len(x) for x in load_from_disk(path)["input_ids"]]
    rng = random.Random(seed)
    mean_pad = sum(max(rng.sample(lengths, batch_size)) for _ in range(draws)) / draws
    return mean_pad * batch_size, sum(lengths) / len(lengths), len(lengths)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ref")
    p.add_argument("other")
    p.add_argument("--steps", type=int, default=301)
    p.add_argument("--max-steps", type=int, default=726)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--draws", type=int, default=20000)
    args = p.parse_args()
    ref = padded_per_batch(args.ref, args.batch_size, args.draws, 0)
    other = padded_per_batch(args.other, args.batch_size, args.draws, 0)
    ratio = ref[0] / other[0]
    out = {
        **run_info(),
        "ref": {
            "path": args.ref,
            "padded_positions_per_batch": ref[0],
            "mean_tokens": ref[1],
            "records": ref[2],
        },
        "other": {
            "path": args.other,
            "padded_positions_per_batch": other[0],
            "mean_tokens": other[1],
            "records": other[2],
        },
        "cost_ratio_other_over_ref": 1 / ratio,
        "stop_after_steps": round(args.steps * ratio),
        "max_steps": round(args.max_steps * ratio),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
