"""Self-distillation throughput: the in-process HF batched path vs a vLLM server, same prompts.

Both paths answer the same prompts (``--prompts``, default the shipped training prompts; the
held-out ones are never used) greedily with up to 128 new tokens:

* ``hf``: :func:`~draftsmith.train.datagen.self_distill.self_distill` with the target loaded
  here (``--dtype``, ``--batch-size``, torch threads as ``--threads``);
* ``vllm[<bind>]``: ``vllm serve`` of the same target directory started from the vLLM venv
  (same ``--dtype``), answered through ``draftsmith data distill --endpoint``'s client with
  ``--concurrency`` requests in flight, once per ``--vllm-omp-bind`` value
  (``VLLM_CPU_OMP_THREADS_BIND``: ``auto`` = vLLM's default, which on x86 keeps one core for
  its scheduler process; ``0-1`` = engine threads on both cores of a 2-core machine).

tokens/s = generated tokens (end-of-turn tokens included) / wall time of the generation loop;
the model load and the server start are timed separately and not included. The JSON also
records how many records are identical between the paths (greedy both; near-ties may flip), the
re-tokenization mismatches of the server's answers, the load average before and after each run
(another job on the machine skews everything), versions and the command.

The whole run holds ``--lock`` (``/tmp/vllm.lock``: one vLLM engine at a time on this machine,
and none beside the HF timing) and each server is killed when its run ends.

Run::

    python scripts/bench_distill.py --out bench/data_generation/distill_hf_vs_vllm.json
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

from draftsmith.heads.sampling import SamplingParams
from draftsmith.train.config import as_list
from draftsmith.train.data.prompts import DEFAULT_PROMPTS
from draftsmith.train.data.records import load_records, select_split
from draftsmith.train.datagen.endpoint import EndpointClient
from draftsmith.train.datagen.endpoint_distill import endpoint_distill
from draftsmith.train.datagen.self_distill import DistillStats, resolve_split, self_distill
from draftsmith.train.datagen.vllm_server import default_vllm_python, local_vllm_server
from draftsmith.train.report.served import vllm_version
from draftsmith.train.runinfo import machine_load, run_info
from draftsmith.train.staged import write_json_atomic
from draftsmith.train.target_model.load import load_target, prepare_target

REPO = Path(__file__).resolve().parents[1]


def stats_dict(stats: DistillStats) -> dict:
    return {
        "records": stats.written,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "seconds": round(stats.seconds, 2),
        "tokens_per_second": round(stats.tokens_per_second, 1),
        "truncated": stats.truncated,
        "checked_turns": stats.checked_turns,
        "token_mismatches": stats.token_mismatches,
        "retries": stats.retries,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default=None, help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument(
        "--prompts",
        default=str(DEFAULT_PROMPTS),
        help="prompt file, its train split answered (default: the shipped chat_prompts.jsonl)",
    )
    ap.add_argument("--limit", type=int, default=64, help="prompts (train split)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--batch-size", type=int, default=32, help="HF path batch size")
    ap.add_argument("--threads", type=int, default=None, help="HF path torch threads")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (vLLM)")
    ap.add_argument(
        "--vllm-omp-bind",
        nargs="+",
        default=["auto"],
        help="VLLM_CPU_OMP_THREADS_BIND values, one server run each",
    )
    ap.add_argument(
        "--vllm-args",
        default="--enforce-eager",
        help="extra vllm serve flags, one string (default: no torch.compile at start-up)",
    )
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--lock", default="/tmp/vllm.lock", help="flock held while vLLM runs")
    ap.add_argument("--skip-hf", action="store_true", help="vLLM runs only")
    ap.add_argument(
        "--out", default=str(REPO / "bench" / "data_generation" / "distill_hf_vs_vllm.json")
    )
    args = ap.parse_args(argv)

    # The vLLM lock is held for the whole benchmark, HF phase included: another vLLM job
    # starting meanwhile would share the cores with the HF timing.
    lock = open(args.lock, "a+")  # noqa: SIM115 - held until the process exits
    fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
    target = prepare_target(args.target, quiet=True)
    convs, _ = load_records(args.prompts)
    split, _ = resolve_split(convs, "auto")
    convs = select_split(convs, split)[: args.limit]
    sampling = SamplingParams()  # greedy
    work = Path(tempfile.mkdtemp(prefix="bench_distill_"))
    results: dict = {}
    outputs: dict[str, Path] = {}
    print(f"{len(convs)} prompts ({split} split of {args.prompts}); outputs in {work}")

    if not args.skip_hf:
        if args.threads:
            torch.set_num_threads(args.threads)
        t0 = time.perf_counter()
        model, tok = load_target(target, dtype=getattr(torch, args.dtype))
        load_s = time.perf_counter() - t0
        load_before = machine_load()
        outputs["hf"] = work / "hf.jsonl"
        stats = self_distill(
            model,
            tok,
            convs,
            outputs["hf"],
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            sampling=sampling,
            progress=False,
        )
        results["hf"] = {
            **stats_dict(stats),
            "batch_size": args.batch_size,
            "torch_threads": torch.get_num_threads(),
            "model_load_seconds": round(load_s, 1),
            "load_before": load_before,
            "load_after": machine_load(),
        }
        print(f"hf: {results['hf']}")
        del model
    else:
        from draftsmith.train.target_model.load import load_tokenizer

        tok = load_tokenizer(target)

    # The HF path stops at the tokenizer's EOS and generation_config's; so does the server.
    eos = [int(t) for t in as_list(GenerationConfig.from_pretrained(target).eos_token_id)]
    for bind in args.vllm_omp_bind:
        name = f"vllm[{bind}]"
        log = work / f"vllm_serve_{bind}.log"
        t0 = time.perf_counter()
        with local_vllm_server(
            target,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            kv_cache_gib=args.kv_cache_gib,
            lock=None,  # held above
            env={"VLLM_CPU_OMP_THREADS_BIND": bind},
            extra_args=shlex.split(args.vllm_args),
            log_path=log,
        ) as url:
            start_s = time.perf_counter() - t0
            client = EndpointClient(url)
            server = client.connect(None)
            load_before = machine_load()
            outputs[name] = work / f"vllm_{bind}.jsonl"
            stats = endpoint_distill(
                client,
                server,
                tok,
                convs,
                outputs[name],
                max_new_tokens=args.max_new_tokens,
                sampling=sampling,
                concurrency=args.concurrency,
                eos_token_ids=eos,
                progress=False,
            )
            load_after = machine_load()
        results[name] = {
            **stats_dict(stats),
            "concurrency": args.concurrency,
            "omp_threads_bind": bind,
            "vllm_args": args.vllm_args,
            "server_start_seconds": round(start_s, 1),
            "load_before": load_before,
            "load_after": load_after,
        }
        print(f"{name}: {results[name]}")

    if "hf" in outputs:
        ref = {json.loads(x)["id"]: x for x in outputs["hf"].read_text().splitlines()}
        for name, path in outputs.items():
            if name != "hf":
                got = {json.loads(x)["id"]: x for x in path.read_text().splitlines()}
                results[name]["records_equal_to_hf"] = sum(got[k] == ref.get(k) for k in got)

    info = run_info()
    info["versions"]["vllm"] = vllm_version(default_vllm_python())
    report = {
        **info,
        "target": str(target),
        "dtype": args.dtype,
        "prompts": args.prompts,
        "split": split,
        "num_prompts": len(convs),
        "max_new_tokens": args.max_new_tokens,
        "sampling": "greedy",
        "results": results,
    }
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
