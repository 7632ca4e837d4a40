"""The training input pipeline at an 8B target's width: today's loader against workers, prefetch
and length-grouped batches (issue 50, finding 5).

A synthetic offline hidden-state cache (``draftsmith data cache``'s format, read by the trainer's
own ``HiddenStateCache``): hidden 4096, 4 layers (EAGLE-3's three fused layers and the last),
bf16, ~32 KB a token; a few hundred samples whose lengths follow a long-tailed (log-normal)
distribution clipped to 100-4096 tokens, or the lengths of a real tokenized set (``--lengths``).
Each variant reads one epoch of it through the training loader exactly as the recipes build it
(``train.core.data.train_loader``, prepared by accelerate with its seedable sampler), for batch
sizes 1, 4 and 8:

- ``before``: today's loader (random batches, no workers);
- ``grouped``: length-grouped batches, no workers;
- ``workers``: random batches, ``--workers`` worker processes with prefetch;
- ``after_wN``: length-grouped batches and N workers with prefetch.

Per variant, in the steady state after the first batch (whose wait, workers' start-up and first
reads included, is ``first_batch_s``): real tokens delivered per second (the loader alone), the
real tokens per CPU second the pipeline spends (training process and workers, user + system,
the whole epoch: what it costs whatever else the machine runs, where its wall time depends on
that), the padding share (padded positions / all positions of the batches) and, with a simulated device
step (``--step-us-per-token``: the training thread sleeps that long per padded token, as it
waits for a GPU), the share of the time the step waits for data and the tokens/s the run gets.
Every pass runs in a fresh process, and the shards are evicted from the page cache before it
(``posix_fadvise``, these files only), so the reads come from storage, as they do for a cache
larger than memory; ``--warm`` keeps them cached.

It writes JSON with the command, versions, machine (CPU flags) and git commit.

Run::

    nice -n 19 python scripts/bench_input_pipeline.py --out bench/scale/input_pipeline_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import torch


def draw_lengths(n: int, low: int, high: int, seed: int, median: float = 700.0) -> np.ndarray:
    """``n`` sample lengths, log-normal (median ``median``, sigma 0.9) clipped to [low, high].

    A long tail like chat SFT data's: most samples a few hundred tokens, a few at the limit.
    """
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.normal(math.log(median), 0.9, n))
    return np.clip(lengths.astype(np.int64), low, high)


def read_lengths(path: str, n: int, low: int, high: int) -> np.ndarray:
    """The first ``n`` lengths of a tokenized set (``input_ids`` per record), clipped to
    [low, high] (samples shorter than ``low`` are left out)."""
    from draftsmith.train.data.batching import TokenDataset
    from draftsmith.train.data.tokens import load_token_data

    lengths = TokenDataset(load_token_data(Path(path)), max_length=high).lengths
    return lengths[lengths >= low][:n]


def write_cache(
    path: Path,
    lengths: np.ndarray,
    hidden: int,
    layers: int,
    dtype: str,
    shard_mb: float,
    source: str = "",
) -> int:
    """A cache of random features in ``draftsmith data cache``'s format; returns its bytes.

    Only what the reader opens is written: shards (``hidden [tokens, layers, hidden]``,
    ``input_ids``, ``loss_mask``, ``offsets``, ``sample_index``), the index, the ids and the
    manifest.
    """
    from safetensors.torch import save_file

    from draftsmith.train.features.cache_format import (
        DTYPES,
        FORMAT,
        FORMAT_VERSION,
        IDS_FILE,
        INDEX_FILE,
        MANIFEST_FILE,
    )

    torch_dtype = DTYPES[dtype]
    per_token = layers * hidden * torch_dtype.itemsize
    path.mkdir(parents=True)
    n = len(lengths)
    shard_of = np.zeros(n, dtype=np.int64)
    offset = np.zeros(n, dtype=np.int64)
    shards, start, gen = [], 0, torch.Generator().manual_seed(0)
    while start < n:
        stop, tokens = start, 0
        while stop < n and (
            stop == start or (tokens + lengths[stop]) * per_token < shard_mb * 2**20
        ):
            tokens += int(lengths[stop])
            stop += 1
        k = len(shards)
        offs = np.concatenate([[0], np.cumsum(lengths[start:stop])]).astype(np.int64)
        shard_of[start:stop], offset[start:stop] = k, offs[:-1]
        name = f"shard-{k:05d}.safetensors"
        tensors = {
            "hidden": torch.randn(tokens, layers, hidden, generator=gen).to(torch_dtype),
            "input_ids": torch.randint(0, 32000, (tokens,), generator=gen),
            "loss_mask": torch.ones(tokens, dtype=torch.uint8),
            "offsets": torch.from_numpy(offs),
            "sample_index": torch.arange(start, stop),
        }
        save_file(tensors, str(path / name))
        shards.append({"file": name, "num_samples": stop - start, "num_tokens": tokens})
        start = stop
    save_file(
        {
            "shard": torch.from_numpy(shard_of),
            "offset": torch.from_numpy(offset),
            "length": torch.from_numpy(lengths.astype(np.int64)),
        },
        str(path / INDEX_FILE),
    )
    (path / IDS_FILE).write_text(json.dumps([str(i) for i in range(n)]))
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "layers": list(range(layers)),
        "dtype": dtype,
        "hidden_size": hidden,
        "max_length": int(lengths.max()),
        "num_samples": n,
        "num_tokens": int(lengths.sum()),
        "index": INDEX_FILE,
        "ids": IDS_FILE,
        "shards": shards,
        "target": {"hidden_size": hidden, "num_layers": layers},
        "synthetic_lengths": source,  # read back when the cache is kept (--cache)
    }
    (path / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    os.sync()
    return sum(f.stat().st_size for f in path.glob("shard-*.safetensors"))


def evict(path: Path) -> None:
    """Drop the cache's shards from the page cache (these files only; needs no privileges)."""
    for f in path.glob("shard-*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one_pass(
    cache: Path,
    *,
    batch_size: int,
    group_by_length: bool,
    workers: int,
    prefetch: int,
    step_us_per_token: float,
    warm: bool,
) -> dict:
    """One epoch of the cache through the recipes' training loader; its figures."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from draftsmith.train.core.data import DataPosition, train_loader
    from draftsmith.train.data.batching import Collate
    from draftsmith.train.features.cache_read import HiddenStateCache

    torch.set_num_threads(1)  # the loader's own work; a training step would hold the rest
    dataset = HiddenStateCache(cache)
    cfg = SimpleNamespace(
        batch_size=batch_size,
        group_by_length=group_by_length,
        num_workers=workers,
        prefetch_factor=prefetch,
        seed=0,
    )
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
    set_seed(0)  # as TrainRun does: random batches are the same for every variant and run
    loader = accelerator.prepare(
        train_loader(dataset, cfg, Collate(0), device=accelerator.device, processes=1)
    )
    if not warm:
        evict(cache)
    me = psutil.Process()
    tokens = positions = batches = 0
    waited = stepped = 0.0
    cpu_start = sum(me.cpu_times()[:2])  # the workers start with the first iteration
    workers_cpu: dict[int, float] = {}
    start = time.perf_counter()
    first = ready = t0 = None
    for batch in DataPosition().batches_of_epoch(accelerator, loader):
        got = time.perf_counter()
        mask = batch["attention_mask"]
        real, padded = int(mask.sum()), mask.numel()  # once per batch, outside any device loop
        if first is None:  # start-up (workers forked, first reads): reported on its own
            first, skipped = got - start, real
        else:
            waited += got - ready
        tokens, positions, batches = tokens + real, positions + padded, batches + 1
        if step_us_per_token:
            time.sleep(step_us_per_token * 1e-6 * padded)  # the device computes; the CPU waits
            stepped += step_us_per_token * 1e-6 * padded
        del batch, mask
        for child in me.children(recursive=True):  # the workers' CPU time so far
            with contextlib.suppress(psutil.Error):
                workers_cpu[child.pid] = sum(child.cpu_times()[:2])
        ready = time.perf_counter()
        t0 = ready if t0 is None else t0
    seconds = time.perf_counter() - t0  # steady state: the batches after the first
    cpu = sum(me.cpu_times()[:2]) - cpu_start + sum(workers_cpu.values())
    steady = tokens - skipped
    per_token = 0
    with torch.no_grad():
        sample = dataset[0]["hidden_states"]
        per_token = sum(v[0].numel() * v.element_size() for v in sample.values())
    row = {
        "batch_size": batch_size,
        "group_by_length": group_by_length,
        "num_workers": workers,
        "prefetch_factor": prefetch if workers else None,
        "batches": batches,
        "tokens": tokens,
        "padded_positions": positions,
        "padding_share": round(1 - tokens / positions, 4),
        "seconds": round(seconds, 3),
        "first_batch_s": round(first, 3),
        # CPU seconds of the whole epoch, training process and workers (user + system): what
        # the pipeline costs whatever else the machine runs (its wall time depends on that).
        "cpu_s": round(cpu, 2),
        "tokens_per_cpu_s": round(tokens / cpu) if cpu else None,
        "step_us_per_token": step_us_per_token,
    }
    if step_us_per_token:
        row |= {
            "step_seconds": round(stepped, 3),
            "wait_seconds": round(waited, 3),
            "wait_share": round(waited / seconds, 4),
            "tokens_per_s": round(steady / seconds),
        }
    else:
        row |= {
            "tokens_per_s": round(steady / seconds),
            "read_mb_per_s": round(steady * per_token / seconds / 2**20, 1),
        }
    return row


def isolated_pass(cache: Path, **settings) -> dict:
    """:func:`one_pass` in a fresh Python process: no shard stays mapped by an earlier pass
    (a mapped page cannot be evicted: the next pass would read it warm), no accelerate state
    or worker is left over."""
    code = (
        "import json, sys; from pathlib import Path; sys.argv = ['bench'];"
        "import importlib.util as u;"
        f"s = u.spec_from_file_location('bench', {str(Path(__file__).resolve())!r});"
        "m = u.module_from_spec(s); s.loader.exec_module(m);"
        f"print(json.dumps(m.one_pass(Path({str(cache)!r}), **json.loads(sys.stdin.read()))))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(settings),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(f"a pass with {settings} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def variants(workers: list[int], prefetch: int) -> dict[str, tuple[bool, int]]:
    """name -> (group_by_length, num_workers)."""
    most = max(workers) if workers else 0
    out = {"before": (False, 0), "grouped": (True, 0)}
    if most:
        out["workers"] = (False, most)
    for w in workers:
        if w:
            out[f"after_w{w}"] = (True, w)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=256, help="samples in the cache")
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument(
        "--lengths", default=None, help="a tokenized set whose lengths to use (else log-normal)"
    )
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (8B: 4096)")
    parser.add_argument("--layers", type=int, default=4, help="cached layers (EAGLE-3: 4)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--shard-mb", type=float, default=512.0)
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--workers", default="1,2", help="worker counts of the 'after' rows")
    parser.add_argument("--prefetch-factor", type=int, default=2)
    parser.add_argument(
        "--step-us-per-token",
        type=float,
        default=0.0,
        help="also time each variant with a simulated device step of this many microseconds "
        "per padded token (0: the loader alone only)",
    )
    parser.add_argument("--warm", action="store_true", help="do not evict the page cache")
    parser.add_argument("--cache", default=None, help="keep the synthetic cache here (reused)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/scale/input_pipeline_cpu.json")
    args = parser.parse_args(argv)

    from draftsmith.train.device import _cpu_flags
    from draftsmith.train.runinfo import run_info
    from draftsmith.train.staged import write_json_atomic

    info = run_info("cpu")
    if args.lengths:
        lengths = read_lengths(args.lengths, args.samples, args.min_len, args.max_len)
        source = f"the first {len(lengths)} samples of {args.lengths}"
    else:
        lengths = draw_lengths(args.samples, args.min_len, args.max_len, args.seed)
        source = "log-normal, median 700, sigma 0.9, clipped"
    keep = args.cache is not None
    cache = Path(args.cache) if keep else Path(tempfile.mkdtemp(prefix="bench_input_")) / "c"
    load_before = os.getloadavg()
    try:
        if not (cache / "manifest.json").is_file():
            t = time.perf_counter()
            size = write_cache(
                cache, lengths, args.hidden, args.layers, args.dtype, args.shard_mb, source
            )
            print(f"cache: {size / 2**30:.2f} GiB written in {time.perf_counter() - t:.0f}s")
        else:  # a kept cache: its own lengths and width
            from draftsmith.train.features.cache_read import HiddenStateCache

            kept = HiddenStateCache(cache)
            lengths = kept.lengths
            source = kept.manifest.get("synthetic_lengths") or f"a kept cache ({cache})"
            args.hidden, args.layers = kept.manifest["hidden_size"], len(kept.cached_layers)
            args.dtype = kept.manifest["dtype"]
            del kept  # no shard stays open in this process
        size = sum(f.stat().st_size for f in cache.glob("shard-*.safetensors"))
        workers = [int(w) for w in args.workers.split(",") if w]
        runs = []
        steps = [0.0] + ([args.step_us_per_token] if args.step_us_per_token else [])
        for step in steps:
            for bs in [int(b) for b in args.batch_sizes.split(",")]:
                for name, (grouped, w) in variants(workers, args.prefetch_factor).items():
                    row = isolated_pass(
                        cache,
                        batch_size=bs,
                        group_by_length=grouped,
                        workers=w,
                        prefetch=args.prefetch_factor,
                        step_us_per_token=step,
                        warm=args.warm,
                    )
                    runs.append({"variant": name, **row, "loadavg_1min": os.getloadavg()[0]})
                    extra = f", waits {row['wait_share']:.0%}" if step else ""
                    print(
                        f"step {step:g}us/tok bs {bs} {name:9s}: {row['tokens_per_s']:>8} tok/s, "
                        f"{row['tokens_per_cpu_s']:>8} tok/cpu-s, padding "
                        f"{row['padding_share']:.1%}{extra}",
                        flush=True,
                    )
    finally:
        if not keep:
            shutil.rmtree(cache.parent, ignore_errors=True)
    result = {
        "benchmark": "training input pipeline: today's loader against workers, prefetch and "
        "length-grouped batches, reading an offline hidden-state cache at 8B width",
        "cache": {
            "samples": len(lengths),
            "lengths": source,
            "tokens": int(lengths.sum()),
            "length_quantiles": {q: int(np.quantile(lengths, q / 100)) for q in (10, 50, 90, 99)}
            | {"max": int(lengths.max())},
            "hidden_size": args.hidden,
            "layers": args.layers,
            "dtype": args.dtype,
            "bytes": size,
            "bytes_per_token": round(size / int(lengths.sum())),
            "page_cache": "warm" if args.warm else "evicted before every pass",
        },
        "runs": runs,
        "cpu_flags": sorted(_cpu_flags()),
        "machine_load": {"before": load_before, "after": os.getloadavg()},
        **info,
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
    }
    write_json_atomic(Path(args.out), result)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
