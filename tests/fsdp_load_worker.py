"""One process of a 2-process FSDP run that only loads and places a target (no training).

Started by tests/test_fsdp_loading.py as ``python tests/fsdp_load_worker.py OUT TARGET MODE``
with the environment variables ``accelerate launch`` gives an FSDP worker (RANK, WORLD_SIZE,
MASTER_ADDR, ACCELERATE_USE_FSDP, ...). It goes through ``TrainRun`` exactly as the recipes do:

* MODE ``sharded``: ``run.load_target`` + ``run.place_target`` (what the recipes run);
* MODE ``whole``: ``load_target`` + ``run.place_target`` (every rank loads the whole target
  first: the path before sharded loading, kept for comparison).

It writes ``OUT/rank{R}.pt``: every target tensor as this rank holds it (its local shard and
the rows of the full tensor that shard is), its buffers, the target's logits for a fixed batch,
the peak resident size (``ru_maxrss``) before and after loading, and the bytes of target
parameters held after ``load_target`` and after ``place_target``.

Optional environment: ``SLEEP_RANK``/``SLEEP_S`` (that rank sleeps before placing the target,
i.e. before the load barrier), ``LOAD_TIMEOUT_MINUTES``, ``TARGET_DTYPE`` (fp32, bf16).
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import time
from pathlib import Path

import torch


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of target parameters this process holds (a DTensor: its local shard)."""
    total = 0
    for p in model.parameters():
        if p.is_meta:
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _warm_up() -> None:
    """Import and touch what loading uses once (module imports, FSDP and DTensor set-up), so
    that the peak resident size measured around loading grows by the target's tensors only."""
    import transformers.models.llama.modeling_llama  # noqa: F401
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoTokenizer  # noqa: F401

    layer = torch.nn.Sequential(torch.nn.Linear(4, 4))
    fully_shard(layer)
    layer(torch.ones(1, 4))


def main() -> int:
    out, target_dir, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    from draftsmith.train.core.config import TrainConfig
    from draftsmith.train.core.dist import exit_process
    from draftsmith.train.core.run import TrainRun
    from draftsmith.train.errors import RunError
    from draftsmith.train.target_model.load import load_target
    from draftsmith.train.target_model.sharded import local_rows

    rank = int(os.environ["RANK"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[os.environ.get("TARGET_DTYPE", "fp32")]
    cfg = TrainConfig(
        output_dir=out / "run",
        device="cpu",
        load_timeout_minutes=float(os.environ.get("LOAD_TIMEOUT_MINUTES", "5")),
    )
    code = 0
    try:
        with TrainRun(cfg, recipe="eagle", kind="eagle3", outputs=["drafter"], fsdp=True) as run:
            assert run.fsdp, "the worker must run under an FSDP launch"
            _warm_up()
            gc.collect()
            before = _peak_kib()
            if mode == "sharded":
                target, _ = run.load_target(target_dir, dtype=dtype)
            else:
                target, _ = load_target(target_dir, dtype=dtype)
            after_load = _held_bytes(target)
            if str(rank) == os.environ.get("SLEEP_RANK"):
                time.sleep(float(os.environ["SLEEP_S"]))
            target = run.place_target(target)
            gc.collect()
            after = _peak_kib()
            tensors = {}
            for name, p in target.named_parameters():
                rows = local_rows(p)
                local = p.to_local() if rows is not None else p
                tensors[name] = (None if rows is None else (rows.start, rows.stop), local.clone())
            ids = torch.arange(24).reshape(2, 12) % target.config.vocab_size
            with torch.no_grad():
                logits = target(input_ids=ids).logits
            torch.save(
                {
                    "tensors": tensors,
                    "buffers": {n: b.clone() for n, b in target.named_buffers()},
                    "logits": logits,
                    "peak_kib_before": before,
                    "peak_kib_after": after,
                    "held_after_load": after_load,
                    "held_after_place": _held_bytes(target),
                    "generation_eos": target.generation_config.eos_token_id,
                    "name_or_path": target.config.name_or_path,
                },
                out / f"rank{rank}.pt",
            )
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = 1
    return exit_process(code)


if __name__ == "__main__":
    sys.exit(main())
