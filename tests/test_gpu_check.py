"""scripts/gpu_check.sh, rehearsed on the CPU: every stage runs and the one JSON says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The tiny target's byte tokenizer makes a token of every byte: a chat prompt is ~300 tokens.
TINY_TRAIN = ["--draft-vocab-size", "64", "--max-length", "512", "--batch-size", "2"]
TINY_TRAIN += ["--grad-accum", "1", "--threads", "1"]


def _run(args: list[str], tmp_path: Path, timeout: int) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "check.json"
    env = {
        **os.environ,
        "TMPDIR": str(tmp_path),
        "PATH": f"{Path(sys.executable).parent}:" + os.environ.get("PATH", ""),
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return proc, json.loads(out.read_text())


def test_gpu_check_rehearsal_on_cpu(tiny_target_dir, tmp_path):
    train = [x for flag in TINY_TRAIN for x in ("--train-arg", flag)]
    # --train-arg takes one word: flags and values alternate.
    proc, result = _run(
        [
            "--device",
            "cpu",
            "--quick",
            "--target",
            str(tiny_target_dir),
            "--train-minutes",
            "0.1",
            *train,
        ],
        tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert result["ok"] is True and result["device"] == "cpu"
    stages = result["stages"]
    assert set(stages) == {"facts", "tests", "distill", "train", "eval_greedy", "eval_t07"}
    assert stages["facts"]["facts"]["device"] == "cpu"
    assert stages["tests"]["tests"] >= 8 and stages["tests"]["failures"] == 0
    assert stages["train"]["steps"] > 0 and stages["train"]["tokens_per_s_mean"] > 0
    # bf16: an output may differ from plain decoding at a near-tie; the rate is reported.
    assert 0 <= stages["eval_greedy"]["identical_rate"] <= 1
    assert stages["eval_greedy"]["device"] == "cpu"
    assert stages["eval_t07"]["acceptance_length"] >= 1


@pytest.mark.slow  # ~50 s: every stage starts and fails
def test_gpu_check_reports_a_failing_stage(tmp_path):
    """No GPU here: --device cuda fails its stages, the JSON says which, the exit code is 1."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the stages would pass")
    proc, result = _run(
        ["--device", "cuda", "--quick", "--target", str(tmp_path / "no_such_model")],
        tmp_path,
        timeout=300,
    )
    assert proc.returncode == 1 and result["ok"] is False
    assert result["stages"]["facts"]["exit_code"] != 0
    assert "device: cuda asked for" in "\n".join(result["stages"]["facts"]["log_tail"])


@pytest.mark.slow
def test_gpu_check_on_cpu_with_the_real_target(tmp_path):
    """The script as a GPU machine runs it, here on the CPU with the real SmolLM2 (< 5 min)."""
    proc, result = _run(["--device", "cpu", "--quick"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert result["stages"]["eval_greedy"]["identical_rate"] >= 0
