"""The EAGLE recipe as ``accelerate launch`` starts it, with the scale check's patches (tests only).

``scripts/gpu_scale_check.py`` launches this file instead of ``recipes/eagle.py`` in its
multi-process stages; the recipe's own ``main`` runs with the command line as given. What this
file changes is read from the environment (the launcher passes it to every worker), and nothing
in the package knows about it -- there is no fault hook in production code:

``SCALE_CHECK_NAN_RANK=R`` and ``SCALE_CHECK_NAN_CALL=K``
    in the process of rank R only, the K-th training micro-batch's loss (the K-th call of
    ``eagle3_ttt_loss`` with gradients on; validation runs without) is multiplied by NaN, as a
    rank whose data or kernel went wrong would compute it. The other rank's loss stays finite.
``SCALE_CHECK_NO_TF32=1``
    keep fp32 matmuls in full fp32 on CUDA (a training run lets them use TF32): runs of
    different shapes then differ by fp32's rounding only, which their comparison's tolerance is
    made for. No effect on a CPU.
``SCALE_CHECK_EXIT_DIR=DIR``
    each rank writes the recipe's exit code to ``DIR/rank{R}.exit`` as the recipe ends: the
    launcher's own exit code does not say how each worker ended (on SIGTERM accelerate exits
    128 + 15 whatever its workers did).

Run: ``accelerate launch --config_file CONFIG scripts/scale_check_worker.py RECIPE_ARGS...``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _patch_nan_loss(rank: int, call: int) -> None:
    import torch

    from draftsmith.train.objectives import eagle_ttt

    original = eagle_ttt.eagle3_ttt_loss
    seen = 0

    def loss_with_nan(*args, **kwargs):
        nonlocal seen
        loss, metrics = original(*args, **kwargs)
        if torch.is_grad_enabled():  # a training micro-batch (validation runs under no_grad)
            seen += 1
            if seen == call and _rank() == rank:
                print(f"scale check: NaN loss injected on rank {rank}, call {call}", flush=True)
                loss = loss * float("nan")
        return loss, metrics

    # The recipe imports the loss inside train(), from the module: it finds this one.
    eagle_ttt.eagle3_ttt_loss = loss_with_nan


def _patch_no_tf32() -> None:
    from draftsmith.train.core import run

    run.allow_tf32 = lambda device: None  # TrainRun's call: "nothing changed", nothing restored


def _patch_exit_record(folder: Path) -> None:
    from draftsmith.recipes import eagle

    original = eagle.exit_process

    def record_then_exit(code: int) -> int:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{_rank()}.exit").write_text(f"{code}\n")
        return original(code)  # gloo workers end inside it (os._exit), others return

    eagle.exit_process = record_then_exit


def main() -> int:
    if os.environ.get("SCALE_CHECK_NAN_RANK"):
        _patch_nan_loss(
            int(os.environ["SCALE_CHECK_NAN_RANK"]), int(os.environ.get("SCALE_CHECK_NAN_CALL", 3))
        )
    if os.environ.get("SCALE_CHECK_NO_TF32") == "1":
        _patch_no_tf32()
    if os.environ.get("SCALE_CHECK_EXIT_DIR"):
        _patch_exit_record(Path(os.environ["SCALE_CHECK_EXIT_DIR"]))
    from draftsmith.recipes.eagle import main as eagle_main

    return eagle_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
