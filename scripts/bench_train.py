"""Training throughput of the EAGLE-3 step: today's recipe vs faster variants, interleaved.

Every variant trains its own copy of the same freshly initialised drafter on the same batches
(same samples, same order) with the shipped model settings (1 decoder layer, draft vocab 8,192,
micro-batch 4, AdamW). Variants run round-robin — a few optimizer steps of each per round — so a
machine that slows down mid-run slows every variant alike; the report gives each variant's
tokens/s and optimizer steps/min and its ratio to the first variant ("today").

Variants (name: what changes against today):

* ``today``: online target features (fp32 target forward inside the step), fp32 drafter, 7 TTT
  steps, the target's distribution at every position.
* ``labels``: the target's distribution only at supervised positions.
* ``bf16``: + bf16 autocast of the drafter forward and backward (what ``mixed_precision: bf16``
  does), + a bf16 target for the online features.
* ``offline``: + features read from a hidden-state cache (``draftsmith data cache``) instead of
  the target forward.
* ``offline-ttt3``: + 3 TTT steps instead of 7 (vLLM speculators' and ModelOpt's default).

Run::

    python scripts/bench_train.py --data ~/.cache/draftsmith/data/<distilled>.jsonl \\
        --samples 48 --rounds 3 --out bench/train_throughput.json

Writes the JSON (command, versions, machine, per-variant figures) and a PNG bar chart beside it.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Variant:
    name: str
    offline: bool
    bf16: bool
    ttt_steps: int
    supervised_labels_only: bool


VARIANTS = [
    Variant("today", offline=False, bf16=False, ttt_steps=7, supervised_labels_only=False),
    Variant("labels", offline=False, bf16=False, ttt_steps=7, supervised_labels_only=True),
    Variant("bf16", offline=False, bf16=True, ttt_steps=7, supervised_labels_only=True),
    Variant("offline", offline=True, bf16=True, ttt_steps=7, supervised_labels_only=True),
    Variant("offline-ttt3", offline=True, bf16=True, ttt_steps=3, supervised_labels_only=True),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="distilled conversations (JSONL)")
    parser.add_argument("--samples", type=int, default=48, help="training samples used")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="round-robin rounds")
    parser.add_argument("--steps-per-round", type=int, default=3, help="optimizer steps each")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--variants", nargs="+", default=[v.name for v in VARIANTS])
    parser.add_argument("--out", default="bench/train_throughput.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from draftsmith.heads.eagle import EagleConfig, build_drafter
    from draftsmith.train.data.tokenize import build_dataset
    from draftsmith.train.data.vocab import draft_vocab, token_counts
    from draftsmith.train.features.cache_write import build_cache
    from draftsmith.train.features.source import feature_source
    from draftsmith.train.objectives.eagle_ttt import eagle3_ttt_loss
    from draftsmith.train.runinfo import run_info, write_json_atomic
    from draftsmith.train.target.load import load_target

    info = run_info()
    load_before = os.getloadavg()
    target, tok = load_target(dtype=torch.float32)
    target_bf16, _ = load_target(dtype=torch.bfloat16)
    data, summary = build_dataset(args.data, tok, max_length=args.max_length, split=None)
    data = data.select(range(min(args.samples, len(data))))
    eagle_cfg = EagleConfig.from_target(target.config, 3, draft_vocab_size=8192)
    layers = list(eagle_cfg.train_layers)
    counts = token_counts(data, target.config.vocab_size, max_length=args.max_length)
    d2t, t2d = draft_vocab(counts, 8192, always_include=[tok.eos_token_id])
    base = build_drafter(target, eagle_cfg, d2t=d2t, t2d=t2d)

    # The offline cache of exactly these samples (not timed: built once, read every epoch).
    cache_dir = Path(tempfile.mkdtemp(prefix="bench_train_cache_"))
    t0 = time.perf_counter()
    build_cache(
        target, data, cache_dir, layers, dtype="bf16", max_length=args.max_length, progress=False
    )
    cache_seconds = time.perf_counter() - t0
    offline = feature_source(
        "offline", layers=layers, cache=cache_dir, max_length=args.max_length, dtype=torch.float32
    )
    order = list(range(len(data)))
    batches = [order[i : i + args.batch_size] for i in range(0, len(order), args.batch_size)]
    lm_head = target.get_output_embeddings()

    # Online features are cast to bf16 like the cache stores them: both paths feed the drafter the
    # same precision, so only the cost differs.
    online = {
        bf16: feature_source(
            "online",
            layers=layers,
            data=data,
            target=model,
            max_length=args.max_length,
            dtype=torch.bfloat16,
        )
        for bf16, model in ((False, target), (True, target_bf16))
    }

    def online_batch(idx: list[int], bf16: bool) -> dict:
        src = online[bf16]
        return src.complete(src.collate([src.dataset[i] for i in idx]))

    def offline_batch(idx: list[int]) -> dict:
        return offline.complete(offline.collate([offline.dataset[i] for i in idx]))

    chosen = [v for v in VARIANTS if v.name in args.variants]
    state = {}
    for v in chosen:
        drafter = copy.deepcopy(base).train()
        if v.bf16:  # what accelerate's mixed_precision="bf16" does to the prepared model
            drafter.forward = torch.autocast("cpu", dtype=torch.bfloat16)(drafter.forward)
        params = [p for p in drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=5e-4)
        state[v.name] = {
            "drafter": drafter,
            "opt": opt,
            "params": params,
            "seconds": 0.0,
            "tokens": 0,
            "steps": 0,
            "losses": [],
            "cursor": 0,
        }

    def step(v: Variant) -> None:
        s = state[v.name]
        idx = batches[s["cursor"] % len(batches)]
        s["cursor"] += 1
        t = time.perf_counter()
        batch = offline_batch(idx) if v.offline else online_batch(idx, v.bf16)
        loss, _ = eagle3_ttt_loss(
            s["drafter"],
            batch,
            lm_head,
            steps=v.ttt_steps,
            supervised_labels_only=v.supervised_labels_only,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(s["params"], 0.5)
        s["opt"].step()
        s["opt"].zero_grad()
        s["seconds"] += time.perf_counter() - t
        s["tokens"] += int(batch["attention_mask"].sum())
        s["steps"] += 1
        s["losses"].append(float(loss))

    for v in chosen:  # warm-up step each, untimed
        step(v)
        state[v.name].update(seconds=0.0, tokens=0, steps=0)
    for r in range(args.rounds):
        for v in chosen:
            for _ in range(args.steps_per_round):
                step(v)
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(
                f"{v.name} {state[v.name]['tokens'] / state[v.name]['seconds']:.0f} tok/s"
                for v in chosen
            ),
            flush=True,
        )

    ref = state[chosen[0].name]
    ref_tps = ref["tokens"] / ref["seconds"]
    rows = []
    for v in chosen:
        s = state[v.name]
        tps = s["tokens"] / s["seconds"]
        rows.append(
            {
                **v.__dict__,
                "tokens_per_s": tps,
                "steps_per_min": 60 * s["steps"] / s["seconds"],
                "speedup_vs_today": tps / ref_tps,
                "steps": s["steps"],
                "tokens": s["tokens"],
                "mean_loss": sum(s["losses"]) / len(s["losses"]),
            }
        )
    result = {
        "benchmark": "EAGLE-3 training step throughput (micro-batch, one optimizer step each)",
        "data": str(args.data),
        "samples": len(data),
        "data_summary": str(summary),
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "rounds": args.rounds,
        "steps_per_round": args.steps_per_round,
        "cache_build_seconds": cache_seconds,
        "variants": rows,
        "machine_load": {"before": load_before, "after": os.getloadavg()},
        **info,
    }
    out = Path(args.out)
    write_json_atomic(out, result)
    _plot(rows, out.with_suffix(".png"))
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(
            f"{r['name']:<{width}}  {r['tokens_per_s']:7.0f} tok/s  "
            f"{r['steps_per_min']:6.1f} steps/min  {r['speedup_vs_today']:.2f}x"
        )
    print(f"written {out} and {out.with_suffix('.png')}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["name"] for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    bars = ax.barh(names[::-1], values[::-1], color="#4c72b0")
    for bar, r in zip(bars, rows[::-1], strict=True):
        ax.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {r['speedup_vs_today']:.2f}x",
            va="center",
        )
    ax.set_xlabel("training tokens / s (EAGLE-3, SmolLM2-135M target, CPU)")
    ax.set_xlim(0, max(values) * 1.2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
