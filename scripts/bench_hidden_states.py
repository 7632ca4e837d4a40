"""Hidden-state caching throughput next to the target's plain prefill, on the same batches.

For every batch the cache would run, time a plain forward (``logits_to_keep=1``, no hidden
states) and the cache's own per-batch path (forward with hidden states, storage-dtype stack,
packing), alternating which goes first so machine load hits both alike; then time writing one
shard. Goal: caching >= 90% of plain prefill tokens/s.

Run::

    python scripts/bench_hidden_states.py --batch-tokens 8192 --out bench/data_generation/hidden_states_8192.json

The data are 64 sequences of 280-320 tokens cut from the repository's own source text (tokenized
with the target's tokenizer), half of each marked supervised.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.heads.families import cache_layers
from draftsmith.train.device import DeviceTimer, resolve_device
from draftsmith.train.features.cache_format import DTYPES
from draftsmith.train.features.cache_shards import compute_shard, make_plan, write_shard
from draftsmith.train.features.source import scan_token_data
from draftsmith.train.runinfo import run_info
from draftsmith.train.staged import write_json_atomic
from draftsmith.train.target_model.load import load_target

REPO = Path(__file__).resolve().parents[1]


class _NoBar:
    def update(self, n: int) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="default: EAGLE-3 preset")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    clock = DeviceTimer(device).now  # synchronizes before reading on a GPU
    info = run_info(device)

    model, tok = load_target(args.target, device=device)
    layers = args.layers or cache_layers("eagle3", model.config.num_hidden_layers)
    text = "".join(p.read_text() for p in sorted(REPO.glob("**/*.py")))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    g = torch.Generator(device="cpu").manual_seed(0)  # sample lengths, drawn on the host
    samples, pos = [], 0
    for _ in range(args.samples):
        n = int(torch.randint(280, 321, (1,), generator=g))
        chunk = ids[pos : pos + n]
        samples.append({"input_ids": chunk, "loss_mask": [0] * (n // 2) + [1] * (n - n // 2)})
        pos += n
    lengths, _ = scan_token_data(samples, None)
    plan = make_plan(lengths, args.batch_tokens, 64, 1 << 40, 1)
    batches = [b for shard in plan.shards for b in shard]
    store = DTYPES[args.dtype]

    def plain(batch: list[int]) -> None:
        n = [len(samples[i]["input_ids"]) for i in batch]
        width = max(n)
        x = torch.zeros(len(batch), width, dtype=torch.long, device=device)
        m = torch.zeros(len(batch), width, dtype=torch.long, device=device)
        for j, i in enumerate(batch):
            x[j, : n[j]] = torch.tensor(samples[i]["input_ids"])
            m[j, : n[j]] = 1
        with torch.inference_mode():
            model(
                input_ids=x,
                attention_mask=None if min(n) == width else m,
                use_cache=False,
                logits_to_keep=1,
            )

    plain(batches[-1])  # warm-up
    t_plain = t_cache = 0.0
    parts = []
    for k, batch in enumerate(batches):
        for which in (0, 1) if k % 2 == 0 else (1, 0):
            t0 = clock()
            if which == 0:
                plain(batch)
                t_plain += clock() - t0
            else:
                parts.append(compute_shard(model, samples, [batch], layers, store, None, _NoBar()))
                t_cache += clock() - t0
    tensors = {k: torch.cat([p[k] for p in parts]) for k in ("hidden", "input_ids", "loss_mask")}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        size = write_shard(Path(tmp) / "shard.safetensors", tensors, {"bench": 1})
        t_write = time.perf_counter() - t0
    tokens = int(lengths.sum())
    result = {
        "benchmark": "hidden_states",
        "settings": {
            "layers": layers,
            "dtype": args.dtype,
            "batch_tokens": args.batch_tokens,
            "samples": args.samples,
            "tokens": tokens,
            "batches": len(batches),
        },
        "plain_prefill_tokens_per_second": tokens / t_plain,
        "cache_forward_tokens_per_second": tokens / t_cache,
        "ratio_cache_to_plain": t_plain / t_cache,
        "shard_write_seconds": t_write,
        "bytes_per_token": size / tokens,
        **info,
    }
    for key in (
        "plain_prefill_tokens_per_second",
        "cache_forward_tokens_per_second",
        "ratio_cache_to_plain",
        "bytes_per_token",
    ):
        print(f"{key}: {result[key]:.3f}")
    if args.out:
        write_json_atomic(args.out, result)
        print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
