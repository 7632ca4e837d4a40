"""scripts/gpu_scale_check.sh, the scale check prepared for the next GPU, rehearsed on the CPU.

The rehearsal (``--device cpu --quick``) runs every stage here: the training step of a tiny
architecture measured against the planner, and the recipe's multi-process checks on 2 CPU
processes (gloo). What a GPU adds (an 8B target, NCCL) cannot run here; the FLOP count and the
peak table it uses are checked below against hand-computed figures.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_scale_check.sh"
MULTI = ("ddp_vs_single", "fsdp_resume", "nan_one_rank", "sigterm")


def _module():
    spec = importlib.util.spec_from_file_location(
        "gpu_scale_check", ROOT / "scripts" / "gpu_scale_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(tmp_path: Path, *args: str, timeout: int = 400, **env: str):
    out = tmp_path / "check.json"
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={
            **os.environ,
            "TMPDIR": str(tmp_path),
            "PATH": f"{Path(sys.executable).parent}:" + os.environ.get("PATH", ""),
            **env,
        },
    )
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_step_flops_of_the_8b_step_by_hand():
    """Llama-3.1-8B, T = 2048, 7 TTT steps, draft vocabulary 32k: every matmul counted from the
    architecture's numbers (multiply-add = 2 FLOPs; the drafter's backward twice its forward)."""
    from draftsmith.recipes.plan import resolve_target_config
    from draftsmith.train.plan.simulate import StepSpec

    config = resolve_target_config("meta-llama/Llama-3.1-8B-Instruct")
    spec = StepSpec(config, draft_vocab_size=32000, ttt_steps=7, seq_len=2048, online=True)
    got = _module().step_flops(spec)

    h, i, layers, heads, d, v, vd, t = 4096, 14336, 32, 32, 128, 128256, 32000, 2048
    kv = 8 * d
    causal = t * (t + 1) // 2  # keys over all queries of a causal block
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i  # q, k, v, o; gate, up, down
    target = 2 * t * layers * per_layer + layers * 2 * 2 * heads * d * causal
    assert got["target_forward"] == target
    assert got["label_head"] == 2 * t * h * v
    # The drafter's layer reads [embedding, hidden] (2H): q, k, v from 2H; fc fuses 3 features.
    layer = 2 * h * h + 2 * 2 * h * kv + h * h + 3 * h * i
    drafter = sum(
        2 * (t * layer + (t * 3 * h * h if j == 0 else 0) + (t - 1 - j) * h * vd)
        + 2 * 2 * heads * d * (causal + j * t)
        for j in range(7)
    )
    assert got["drafter_forward"] == drafter
    assert got["drafter_backward"] == 2 * drafter
    assert got["total"] == target + 2 * t * h * v + 3 * drafter
    # About 32 GFLOP a token: the target's 2 x 7B, and 7 unrolled drafter steps x 6 x 0.37B.
    assert 3.0e10 < got["per_token"] < 3.3e10


def test_peak_table_by_gpu_name():
    peak = _module().peak_bf16_tflops
    assert peak("NVIDIA H100 80GB HBM3")[0] == 989.0
    assert peak("NVIDIA H200")[0] == 989.0
    assert peak("NVIDIA H100 PCIe")[0] == 756.0
    assert peak("NVIDIA A100-SXM4-80GB")[0] == 312.0
    value, reason = peak("NVIDIA GeForce RTX 4090")
    assert value is None and "not in the peak table" in reason
    assert peak(None)[0] is None


def test_rehearsal_of_the_training_stage(tmp_path):
    """The stages of one process (about 30 s): the step measured against the planner."""
    proc, result = _check(tmp_path, "--device", "cpu", "--quick", "--stages", "facts,scale_train")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert result["ok"] is True and result["git_commit"]
    assert result["stages"]["facts"]["figures"]["gpu_count"] == torch.cuda.device_count()
    train = result["stages"]["scale_train"]
    assert train["status"] == "ok", train
    figures = train["figures"]
    assert 1 <= figures["steps"] <= 6 and figures["losses_finite"] and figures["tokens_per_s"] > 0
    assert abs(figures["plan_ratio"] - 1) <= 0.15 and figures["plan_within_15pct"]
    assert abs(figures["plan_step_ratio"] - 1) <= 0.15, figures["plan_step_ratio"]
    assert figures["plan"]["measure"].startswith("peak resident size")
    for name in MULTI:
        assert result["stages"][name]["status"] == "skipped"


@pytest.mark.rehearsal  # 2-3 minutes on 2 shared cores: 7 launches of 2 processes
@pytest.mark.integration
def test_rehearsal_on_cpu_every_stage_ok(tmp_path):
    proc, result = _check(tmp_path, "--device", "cpu", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert result["ok"] is True and result["device"] == "cpu"
    stages = result["stages"]
    assert list(stages) == ["facts", "scale_train", *MULTI]
    assert all(s["status"] == "ok" for s in stages.values()), {
        k: s.get("reason") for k, s in stages.items()
    }
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert result["git_commit"] == head.stdout.strip() and result["git_source"] == "git"
    assert isinstance(result["git_dirty"], bool)
    assert result["command"].startswith("bash scripts/gpu_scale_check.sh --device cpu --quick")

    train = stages["scale_train"]["figures"]
    assert train["device"] == "cpu" and train["steps"] >= 1 and train["tokens_per_s"] > 0
    assert train["losses_finite"] and len(train["losses"]) == train["steps"] + 1
    # The planner against the process's peak resident size: the total (mostly the runtime at
    # these widths) and, sharper, the step's own bytes against the simulated step.
    assert abs(train["plan_ratio"] - 1) <= 0.15 and train["plan_within_15pct"]
    assert abs(train["plan_step_ratio"] - 1) <= 0.15, train["plan_step_ratio"]
    assert train["mfu"] is None and "no GPU" in train["mfu_note"]
    assert train["flops_per_step"]["total"] > 0

    ddp = stages["ddp_vs_single"]["figures"]
    assert ddp["processes"] == [2, 1] and ddp["max_rel_diff"] <= ddp["rtol"] == 1e-4
    assert len(ddp["losses_2proc"]) == 6 + 2  # 6 logged steps, 2 validations
    fsdp = stages["fsdp_resume"]["figures"]
    assert fsdp["distributed"] == ["fsdp", "fsdp"] and fsdp["resumed_from"] == 4
    assert fsdp["max_abs_diff"] <= fsdp["atol"]
    nan = stages["nan_one_rank"]["figures"]
    assert nan["launcher_exit_code"] == 1 and nan["rank_exit_codes"] == {"0": 1, "1": 1}
    assert len(nan["error_lines"]) == 2 and nan["seconds"] < nan["timeout_s"]
    term = stages["sigterm"]["figures"]
    assert term["rank_exit_codes"] == {"0": 0, "1": 0} and term["checkpoints"][-1] >= 3
    assert term["processes_started"] >= 2 and term["alive_after"] == []
    assert term["launcher_exit_code"] in (0, 143)  # accelerate: 128 + SIGTERM, by design


def test_a_broken_check_fails_the_script(tmp_path):
    """GPU_SCALE_CHECK_BREAK=scale_train scales the planner's prediction by 1.5: the stage's
    15 % comparison must catch it, and the script exits 1 with the reason in the JSON."""
    proc, result = _check(
        tmp_path,
        "--device",
        "cpu",
        "--quick",
        "--stages",
        "facts,scale_train",
        "--commit",
        "0123abc-dirty",
        "--budget-minutes",
        "60",
        timeout=200,
        GPU_SCALE_CHECK_BREAK="scale_train",
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert result["ok"] is False and result["broken"] == "scale_train"
    stages = result["stages"]
    assert stages["facts"]["status"] == "ok"
    train = stages["scale_train"]
    assert train["status"] == "failed" and "outside 1 +- 0.15" in train["reason"]
    assert train["figures"]["plan"]["broken_scale"] == 1.5
    assert not train["figures"]["plan_within_15pct"]
    for name in MULTI:
        assert stages[name]["status"] == "skipped" and "not selected" in stages[name]["reason"]
    assert (result["git_commit"], result["git_dirty"]) == ("0123abc", True)
    assert result["git_source"] == "--commit"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: its stages would run")
def test_without_a_gpu_every_stage_says_why(tmp_path):
    """--device cuda on this machine: facts and scale_train fail naming the device, the
    multi-process stages are skipped for want of 2 GPUs; exit 1."""
    # A budget no loaded test machine spends: the statuses, not the clock, are under test.
    proc, result = _check(tmp_path, "--device", "cuda", "--budget-minutes", "60", timeout=200)
    assert proc.returncode == 1
    stages = result["stages"]
    assert stages["facts"]["status"] == "failed"
    assert "device: cuda asked for" in stages["facts"]["reason"]
    assert stages["scale_train"]["status"] == "failed"
    for name in MULTI:
        assert stages[name]["status"] == "skipped"
        assert stages[name]["reason"] == "needs 2 GPUs (found 0)"


@pytest.mark.rehearsal  # ~30 s each: the multi-process checks can fail
@pytest.mark.parametrize(
    ("stage", "reason"),
    [
        ("ddp_vs_single", "losses differ by"),
        ("fsdp_resume", "final weights differ"),
        ("nan_one_rank", "the launcher exited 0, not 1"),
        ("sigterm", "no checkpoint at step >= 3"),
    ],
)
def test_each_multiprocess_check_catches_its_fault(tmp_path, stage, reason):
    proc, result = _check(
        tmp_path,
        "--device",
        "cpu",
        "--quick",
        "--stages",
        stage,
        timeout=300,
        GPU_SCALE_CHECK_BREAK=stage,
    )
    assert proc.returncode == 1
    assert result["stages"][stage]["status"] == "failed"
    assert reason in result["stages"][stage]["reason"]
