"""FSDP2 under ``accelerate launch`` on 2 CPU processes: the EAGLE recipe trains, saves and
resumes with the target and the drafter sharded, and its losses equal the DDP run's. (Medusa-1
and distill: the same check in tests/test_medusa_recipe.py and tests/test_distill_recipe.py;
the target's shard-by-shard loading: tests/test_fsdp_loading.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.heads.eagle import load_drafter
from draftsmith.train.core.checkpoint import check_shared_output
from draftsmith.train.errors import UsageError
from draftsmith.train.target_model.load import load_target
from tests.test_eagle_recipe import REPO, _free_port, base_args, launch_eagle
from tests.test_medusa_recipe import args as medusa_args

FSDP_CONFIG = REPO / "recipes/accelerate/fsdp_cpu_2proc.yaml"
DDP_CONFIG = REPO / "recipes/accelerate/cpu_2proc.yaml"

# Relative tolerance of the FSDP run's logged losses against the DDP run's. Both runs see the
# same batches, the same initial drafter and the same target features (the sharded target's
# forward gathers the very same weights: equal to the unsharded one's bit for bit on the same
# thread count). What differs is how gradients are summed: DDP all-reduces gradient buckets,
# FSDP reduce-scatters each parameter's gradient (another summation order and a division by the
# world size at another point), and gradient clipping sums the squared norm over shards. That is
# a ~1e-7 relative difference per gradient; Adam's update m / (sqrt(v) + eps) passes it on
# undamped, so after 6 steps (measured: 6.6e-8 in the loss, see docs/scaling.md) it stays far
# below 1e-4 -- while one skipped or doubled micro-batch, a wrongly averaged gradient or a
# checkpoint restored into the wrong shards changes the loss by > 1e-2.
RTOL = 1e-4


def _args(tmp_path: Path, target_dir: Path, out: str, **over) -> list[str]:
    """EAGLE-3 on the tiny target: 6 steps of 2 x 2 micro-batches, validations at 3 and 6."""
    values = {
        "output_dir": tmp_path / out,
        "max_steps": 6,
        "ttt_steps": 2,
        "save_every": 2,
        "log_every": 2,
        "eval_every": 3,
        "target_dtype": "fp32",  # RTOL is fp32's summation-order difference (the defaults
        "mixed_precision": "no",  # are bf16 where the device computes it natively)
    }
    values.update(over)
    return [*base_args(tmp_path, target_dir, 3, **values), "--no-progress"]


@pytest.mark.integration
def test_fsdp_trains_resumes_and_matches_ddp(tmp_path, tiny_target_dir):
    """2 CPU processes, FSDP2: stop after 4 of 6 steps, resume to 6; losses equal DDP's."""
    # FSDP, first invocation: paused after 4 steps (same schedule as an unbroken 6-step run).
    proc = launch_eagle(FSDP_CONFIG, _args(tmp_path, tiny_target_dir, "fsdp", stop_after_steps=4))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The target was read shard by shard (tests/test_fsdp_loading.py), not loaded whole.
    assert "loads the whole target" not in proc.stdout + proc.stderr
    fsdp = tmp_path / "fsdp"
    step_4 = fsdp / "checkpoints" / "step_4"
    # An FSDP checkpoint: sharded state dicts (DCP) for the drafter and its optimizer, no
    # consolidated model file; one RNG state per rank.
    held = {p.name for p in step_4.iterdir()}
    assert {"pytorch_model_fsdp_0", "optimizer_0", "random_states_1.pkl"} <= held, held
    assert not any(n.endswith((".safetensors", ".bin")) for n in held), held
    assert not (fsdp / "drafter").exists()  # paused: no final drafter yet

    # Second invocation: resumes from step 4 and finishes at step 6.
    proc = launch_eagle(FSDP_CONFIG, _args(tmp_path, tiny_target_dir, "fsdp"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    got = json.loads((fsdp / "training_metrics.json").read_text())
    assert got["distributed"] == "fsdp" and got["processes"] == 2
    assert got["steps"] == 6 and got["resumed_from"] == 4 and got["stop_reason"] == "done"
    assert [e["step"] for e in got["train_log"]] == [2, 4, 6]
    assert [v["step"] for v in got["validation"]] == [3, 6]

    # DDP reference: the same data, seed and steps in one invocation.
    proc = launch_eagle(DDP_CONFIG, _args(tmp_path, tiny_target_dir, "ddp"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ref = json.loads((tmp_path / "ddp" / "training_metrics.json").read_text())
    assert ref["distributed"] == "ddp" and ref["steps"] == 6

    def losses(metrics):
        train = [e["train/loss"] for e in metrics["train_log"]]
        return train + [v["val/loss"] for v in metrics["validation"]]

    a, b = losses(got), losses(ref)
    assert len(a) == len(b) == 5
    assert max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)) < RTOL, (a, b)
    assert a[0] > a[2]  # and it learned something (the comparison is not of two constants)

    # The saved drafter is the full (gathered) one: loadable alone, and the DDP run's weights.
    target, _ = load_target(str(tiny_target_dir))
    mine = load_drafter(fsdp / "drafter", target).state_dict()
    theirs = load_drafter(tmp_path / "ddp" / "drafter", target).state_dict()
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=1e-3, atol=1e-5, msg=name)


class _Rank0:
    """Rank 0 of 2 as ``check_shared_output`` sees it (no process group: votes stay local)."""

    num_processes, process_index, is_main_process, device = 2, 0, True, "cpu"


def test_output_dir_must_be_shared_by_all_processes(tmp_path):
    """A multi-machine run whose output_dir is not one shared directory is refused at start:
    the other process's probe never shows up where rank 0 looks."""
    with pytest.raises(UsageError, match=r"output_dir: .* not one directory shared by all 2"):
        check_shared_output(_Rank0(), tmp_path / "run")
    assert not list((tmp_path / "run").iterdir())  # rank 0's probe is gone again
    # Rank 1 on the same filesystem: its probe is there, the run starts.
    (tmp_path / "run" / ".shared-check.rank1").write_text("1")
    check_shared_output(_Rank0(), tmp_path / "run")
    assert [p.name for p in (tmp_path / "run").iterdir()] == [".shared-check.rank1"]


def test_recipes_without_fsdp_refuse_an_fsdp_launch(tmp_path, tiny_target_dir, monkeypatch, capsys):
    """Medusa-2 (LoRA on the target) under an FSDP config: one error line naming the configs
    that work, not a silent DDP run. One process in a gloo group of one, with the variables
    `accelerate launch` sets. (Medusa-1 and distill run under FSDP: their recipe tests.)"""
    from draftsmith.recipes.medusa import main as medusa

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env |= {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "OMP_NUM_THREADS": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert medusa(medusa_args(tmp_path, tiny_target_dir, stage="medusa2")) == 2
    err = capsys.readouterr().err
    assert "error: Medusa-2 (LoRA adapters train the target itself) does not run under FSDP" in err
    assert "cpu_2proc.yaml" in err
    assert not torch.distributed.is_initialized()  # the group was torn down before the error
