"""Benchmark our verification loop against HF transformers' own decoding, in one process.

Compares, prompt by prompt (methods interleaved so machine noise hits all alike), on the real
target by default:

* ``hf-greedy``        HF ``generate`` greedy                         (reference output and speed)
* ``plain``            our loop with no drafter
* ``hf-prompt-lookup`` HF ``generate(prompt_lookup_num_tokens=k)``
* ``ngram``            our loop with the n-gram drafter
* ``hf-assisted``      HF ``generate(assistant_model=draft)`` with the layer-pruned draft
* ``draft-lm``         our loop with the same draft

For every method: tokens/s, speedup over HF greedy and over our plain loop, τ (tokens per target
forward; HF's counted with a forward hook), and whether every output equals HF greedy's.

Run::

    python scripts/bench_decoding.py --k 5 --max-new-tokens 128 --out bench/early_decoding/decoding.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from draftsmith.heads.draft_lm import DraftLM, layer_pruned_copy
from draftsmith.heads.hf_assisted import HFAssisted
from draftsmith.heads.ngram import NGramDrafter
from draftsmith.train.data.prompts import load_prompts, render_prompt
from draftsmith.train.decoding.draft_length import AdaptiveDraftLength
from draftsmith.train.decoding.metrics import summarize
from draftsmith.train.decoding.speculative import generate
from draftsmith.train.device import DeviceTimer, is_cpu, resolve_device
from draftsmith.train.runinfo import run_info
from draftsmith.train.staged import write_json_atomic
from draftsmith.train.target_model.load import load_target

METHODS = ["hf-greedy", "plain", "hf-prompt-lookup", "ngram", "hf-assisted", "draft-lm"]
EXTRA_METHODS = ["ngram-adaptive", "draft-lm-adaptive"]  # cost-aware draft length


class ForwardCounter:
    """Counts forward calls of a module (target forwards, to get HF's τ)."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default=None, help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", default=None, help="prompt JSONL (default: the project's set)")
    ap.add_argument(
        "--split", default="heldout", help="split of the prompt file ('all' = every record)"
    )
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument(
        "--draft-layers",
        type=int,
        nargs="+",
        default=None,
        help="layers of the pruned draft (default: 0, N/3, 2N/3, N-1)",
    )
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + EXTRA_METHODS)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (CPU runs only)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    ap.add_argument("--out", default=None, help="results JSON")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    if args.threads and is_cpu(device):
        torch.set_num_threads(args.threads)
    clock = DeviceTimer(device).now  # synchronizes before reading on a GPU

    info = run_info(device)  # taken at the start: the code, versions and device that ran
    target, tok = load_target(args.target, device=device)
    n = target.config.num_hidden_layers
    layers = args.draft_layers or [0, n // 3, 2 * n // 3, n - 1]
    draft_model = layer_pruned_copy(target, layers)
    vocab = target.get_output_embeddings().weight.shape[0]
    split = None if args.split == "all" else args.split
    records = load_prompts(args.prompts, split=split, limit=args.limit)
    prompts = [render_prompt(tok, r) for r in records]
    eos = tok.eos_token_id
    k, max_new = args.k, args.max_new_tokens
    counter = ForwardCounter(target)

    def hf(ids: list[int], **kw):
        x = torch.tensor([ids], device=device)
        counter.calls = 0
        t0 = clock()
        with torch.inference_mode():
            out = target.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=eos,
                pad_token_id=eos,
                **kw,
            )
        wall = clock() - t0
        return out[0, len(ids) :].tolist(), wall, counter.calls

    assisted = HFAssisted(draft_model)  # a constant k drafts per step, like our chain

    def hf_assisted(ids: list[int]):
        out = assisted.generate(target, ids, k=k, max_new_tokens=max_new, eos_token_id=eos)
        return out.tokens, out.wall_time, out.target_forwards

    runners = {
        "hf-greedy": lambda ids: hf(ids),
        "hf-prompt-lookup": lambda ids: hf(ids, prompt_lookup_num_tokens=k),
        "hf-assisted": hf_assisted,
    }
    drafters = {
        "plain": None,
        "ngram": NGramDrafter(args.ngram_max, args.ngram_min),
        "draft-lm": DraftLM(draft_model, target_vocab_size=vocab),
    }

    drafters["ngram-adaptive"] = drafters["ngram"]
    drafters["draft-lm-adaptive"] = drafters["draft-lm"]
    policies = {m: AdaptiveDraftLength(k) for m in EXTRA_METHODS}

    def ours(name: str, ids: list[int]):
        counter.calls = 0
        out = generate(
            target,
            ids,
            drafters[name],
            k=k,
            max_new_tokens=max_new,
            eos_token_id=eos,
            draft_length=policies.get(name),
        )
        assert counter.calls == out.target_forwards
        return out

    # Warm-up (one-off allocation costs), untimed.
    for m in args.methods:
        (runners[m] if m in runners else lambda ids, m=m: ours(m, ids))(prompts[0][:32])

    raw = {m: [] for m in args.methods}
    ours_runs = {m: [] for m in args.methods if m in drafters}
    for i, ids in enumerate(prompts):
        for m in args.methods:
            cpu0 = time.process_time()
            if m in runners:
                tokens, wall, calls = runners[m](ids)
            else:
                out = ours(m, ids)
                ours_runs[m].append(out)
                tokens, wall, calls = out.tokens, out.wall_time, out.target_forwards
            cpu = time.process_time() - cpu0
            raw[m].append({"tokens": tokens, "wall": wall, "cpu": cpu, "forwards": calls})
        print(
            f"[{i + 1}/{len(prompts)}] "
            + "  ".join(
                f"{m} {len(raw[m][-1]['tokens']) / raw[m][-1]['wall']:.1f}" for m in args.methods
            ),
            file=sys.stderr,
        )

    ref = raw.get("hf-greedy") or raw.get("plain")
    base_name = "hf-greedy" if "hf-greedy" in raw else "plain"
    results = {}
    for m, runs in raw.items():
        tokens = sum(len(r["tokens"]) for r in runs)
        wall = sum(r["wall"] for r in runs)
        cpu = sum(r["cpu"] for r in runs)
        res = {
            "method": m,
            "tokens": tokens,
            "tokens_per_second": tokens / wall,
            # CPU seconds of this process: a check on wall-clock figures when the machine is shared.
            "tokens_per_cpu_second": tokens / cpu,
            "acceptance_length": tokens / sum(r["forwards"] for r in runs),
            "identical_to_hf_greedy": all(
                a["tokens"] == b["tokens"] for a, b in zip(runs, ref, strict=True)
            ),
            "mismatched_prompts": [
                records[i].id
                for i, (a, b) in enumerate(zip(runs, ref, strict=True))
                if a["tokens"] != b["tokens"]
            ],
        }
        if m in ours_runs:
            s = summarize(ours_runs[m], k)
            res["acceptance_rate_per_position"] = s["acceptance_rate_per_position"]
            res["acceptance_length_per_draft"] = s["acceptance_length_per_draft"]
            res["draft_time_fraction"] = s["draft_time_fraction"]
        if m in policies:
            res["mean_draft_length"] = sum(policies[m].chosen) / max(len(policies[m].chosen), 1)
        results[m] = res
    for res in results.values():
        res[f"speedup_vs_{base_name}"] = (
            res["tokens_per_second"] / results[base_name]["tokens_per_second"]
        )
        if "plain" in results:
            res["speedup_vs_plain"] = (
                res["tokens_per_second"] / results["plain"]["tokens_per_second"]
            )
            res["cpu_speedup_vs_plain"] = (
                res["tokens_per_cpu_second"] / results["plain"]["tokens_per_cpu_second"]
            )

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(prompts)} prompts, greedy, {max_new} new tokens, k={k}")
    for col in (
        "method",
        "tok/s",
        f"vs {base_name}",
        "vs plain",
        "vs plain (CPU s)",
        "τ",
        "α per position",
        "identical",
    ):
        table.add_column(col)
    for m, r in results.items():
        table.add_row(
            m,
            f"{r['tokens_per_second']:.2f}",
            f"{r[f'speedup_vs_{base_name}']:.2f}x",
            f"{r.get('speedup_vs_plain', float('nan')):.2f}x",
            f"{r.get('cpu_speedup_vs_plain', float('nan')):.2f}x",
            f"{r['acceptance_length']:.2f}",
            " ".join(f"{a:.2f}" for a in r.get("acceptance_rate_per_position", [])),
            "yes" if r["identical_to_hf_greedy"] else "NO",
        )
    Console(width=160).print(table)
    report = {
        "benchmark": "decoding",
        "settings": {
            "k": k,
            "max_new_tokens": max_new,
            "num_prompts": len(prompts),
            "split": args.split,
            "prompts": args.prompts or "default",
            "draft_layers": layers,
            "ngram": [args.ngram_min, args.ngram_max],
            "target": args.target or "default",
        },
        "results": results,
        **info,
    }
    if args.out:
        write_json_atomic(args.out, report)
        print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
