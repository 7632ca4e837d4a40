"""Is bf16 faster than fp32 on this device? The measurement behind ``dtype: auto``.

``auto`` (``draftsmith.train.device.native_bf16``) picks bf16 only where the device computes it
natively: CUDA GPUs with bf16, x86 CPUs with AVX512-BF16 or AMX, Arm CPUs with BF16. Elsewhere
bf16 matmuls are emulated. This benchmark times, in fp32 and bf16, interleaved per repetition
(median of ``--reps``, so machine noise hits both alike):

- one ``[64, 576] x [576, 1536]`` linear (SmolLM2-135M's MLP shape; GFLOP/s);
- the real target's forward over a batch of 8 sequences of 128 tokens (what data making's prefill,
  the hidden-state cache and training's online features do);
- one batched decode step: 64 sequences, one new token each, over a 128-token KV cache (what
  Magpie and self-distillation do per generated token).

It writes JSON with the CPU's flags, what ``native_bf16`` says, the bf16 ÷ fp32 time ratios and
the command, versions and machine.

Run::

    python scripts/bench_dtype.py --out bench/cpu_costs/dtype_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--target", default=None)
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--out", default="bench/cpu_costs/dtype_cpu.json")
    args = parser.parse_args(argv)

    from transformers import DynamicCache

    from draftsmith.train.device import (
        DeviceTimer,
        _cpu_flags,
        is_cpu,
        make_generator,
        native_bf16,
        resolve_device,
    )
    from draftsmith.train.runinfo import run_info
    from draftsmith.train.staged import write_json_atomic
    from draftsmith.train.target_model.load import load_target

    device = resolve_device(args.device)
    if is_cpu(device):
        torch.set_num_threads(args.threads)
    info = run_info(device)
    clock = DeviceTimer(device).now
    load_before = os.getloadavg()
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    gen = make_generator(device, 0)
    models = {n: load_target(args.target, dtype=d, device=device)[0] for n, d in dtypes.items()}
    hidden = models["float32"].config.hidden_size
    inter = models["float32"].config.intermediate_size
    x = {n: torch.randn(64, hidden, generator=gen, device=device).to(d) for n, d in dtypes.items()}
    w = {
        n: torch.randn(inter, hidden, generator=gen, device=device).to(d) for n, d in dtypes.items()
    }
    batch = torch.randint(100, 30000, (8, 128), generator=gen, device=device)
    prompts = torch.randint(100, 30000, (64, 128), generator=gen, device=device)
    step_ids = torch.randint(100, 30000, (64, 1), generator=gen, device=device)
    caches = {}
    with torch.inference_mode():
        for name, model in models.items():
            caches[name] = DynamicCache(config=model.config)
            model(input_ids=prompts, cache=caches[name], use_cache=True, logits_to_keep=1)

    def linear(name: str) -> float:
        t = clock()
        for _ in range(20):
            torch.nn.functional.linear(x[name], w[name])
        return (clock() - t) / 20

    def forward(name: str) -> float:
        t = clock()
        models[name](input_ids=batch, logits_to_keep=1)
        return clock() - t

    def decode(name: str) -> float:
        cache = caches[name]
        t = clock()
        models[name](input_ids=step_ids, cache=cache, use_cache=True)
        elapsed = clock() - t
        cache.crop(-1)
        return elapsed

    cases = {"linear_64x576x1536": linear, "forward_8x128": forward, "decode_step_64": decode}
    results: dict = {}
    with torch.inference_mode():
        for case, fn in cases.items():
            samples = {name: [] for name in dtypes}
            for name in dtypes:  # warm-up
                fn(name)
            for _ in range(args.reps):
                for name in dtypes:
                    samples[name].append(fn(name))
            ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
            results[case] = {
                "ms": ms,
                "bf16_over_fp32": ms["bfloat16"] / ms["float32"],
            }
            if case.startswith("linear"):
                flop = 2 * 64 * hidden * inter
                results[case]["gflops"] = {n: flop / (v / 1e3) / 1e9 for n, v in ms.items()}
            print(
                f"{case}: fp32 {ms['float32']:.2f} ms, bf16 {ms['bfloat16']:.2f} ms "
                f"(bf16/fp32 {results[case]['bf16_over_fp32']:.2f})",
                flush=True,
            )
    flags = sorted(f for f in _cpu_flags() if "avx" in f or "amx" in f or f in ("bf16", "fma"))
    result = {
        "benchmark": "bf16 against fp32: a linear, a batched forward, a batched decode step",
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "threads": args.threads if is_cpu(device) else None,
        "reps": args.reps,
        "native_bf16": native_bf16(device),
        "auto_picks": "bfloat16" if native_bf16(device) else "float32",
        "cpu_flags": flags,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "results": results,
        "machine_load": {"before": load_before, "after": os.getloadavg()},
        **info,
    }
    write_json_atomic(Path(args.out), result)
    print(f"native_bf16: {result['native_bf16']} -> auto picks {result['auto_picks']}")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
