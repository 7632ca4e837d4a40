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
    assert result["ok"] is True and result["problems"] == [] and result["device"] == "cpu"
    stages = result["stages"]
    ran = {"facts", "tests", "distill", "train", "eval_fp32", "eval_greedy", "eval_t07"}
    assert set(stages) == ran | {"nccl"}
    assert all(stages[n]["exit_code"] == 0 for n in ran)
    assert stages["nccl"] == {"skipped": "needs 2+ GPUs; --device cpu has 0"}
    assert stages["facts"]["facts"]["device"] == "cpu"
    assert stages["tests"]["tests"] >= 8 and stages["tests"]["failures"] == 0
    assert stages["train"]["steps"] > 0 and stages["train"]["tokens_per_s_mean"] > 0
    # fp32: every greedy output is the target's own (what gates ok); both evaluations decoded.
    assert stages["eval_fp32"]["identical_rate"] == 1
    assert stages["eval_fp32"]["num_prompts"] == stages["eval_greedy"]["num_prompts"] == 2
    assert "identical_rate" in stages["eval_greedy"] and "near_ties" in stages["eval_greedy"]
    assert stages["eval_greedy"]["device"] == "cpu"
    assert "identical_rate" not in stages["eval_t07"]  # sampled: differs by design
    assert stages["eval_t07"]["acceptance_length"] >= 1
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert result["git_commit"] == head.stdout.strip() and result["git_source"] == "git"
    assert isinstance(result["git_dirty"], bool)


def _fake_stages(work: Path, fp32_same: list[bool], **exits: int) -> None:
    """What the stages leave in the work directory, written by hand."""
    names = ("facts", "tests", "distill", "train", "eval_fp32", "eval_greedy", "eval_t07")
    for name in names:
        (work / f"{name}.status").write_text(f"{exits.get(name, 0)} 1500\n")
        (work / f"{name}.log").write_text("one\ntwo\n")
    (work / "facts.log").write_text('{"device": "cuda"}\n')
    per_prompt = [{"identical_to_target": same} for same in fp32_same]
    (work / "fp32.json").write_text(json.dumps({"num_prompts": 2, "per_prompt": per_prompt}))
    bf16 = [{"identical_to_target": False}, {"identical_to_target": True}]
    (work / "greedy.json").write_text(json.dumps({"near_ties": [0.01], "per_prompt": bf16}))
    (work / "nccl.skipped").write_text("needs 2+ GPUs; --device cuda has 1\n")


def _summary(work: Path, tmp_path: Path) -> tuple[int, dict]:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check_summary
    finally:
        sys.path.pop(0)
    out = tmp_path / "summary.json"
    code = gpu_check_summary.main([str(work), str(out), "cuda", "0", "2", "2", "--out x"])
    return code, json.loads(out.read_text())


def test_ok_means_lossless_in_fp32_and_every_stage_passed(tmp_path):
    """ok: every stage exited 0 and each fp32 greedy output is the target's own; bf16 outputs
    that differ at near-ties are reported and do not gate it; a stage that did not run is
    "skipped" with its reason, not a silent absence."""
    work = tmp_path / "ok"
    work.mkdir()
    _fake_stages(work, [True, True])
    code, result = _summary(work, tmp_path)
    assert code == 0 and result["ok"] is True and result["problems"] == []
    assert result["stages"]["eval_greedy"]["identical_rate"] == 0.5  # reported apart
    assert result["stages"]["nccl"] == {"skipped": "needs 2+ GPUs; --device cuda has 1"}
    assert result["git_commit"]  # this checkout's

    # One fp32 output not the target's: not ok, and the JSON says why.
    work = tmp_path / "differs"
    work.mkdir()
    _fake_stages(work, [True, False])
    code, result = _summary(work, tmp_path)
    assert code == 1 and result["ok"] is False
    assert result["problems"] == [
        "eval_fp32: greedy outputs identical to plain decoding: 0.5 (must be 1)"
    ]
    # A failed stage, and an fp32 check that never ran, are each a problem.
    work = tmp_path / "failed"
    work.mkdir()
    _fake_stages(work, [True, True], train=1)
    (work / "eval_fp32.status").unlink()
    code, result = _summary(work, tmp_path)
    assert code == 1 and result["problems"] == [
        "train: exit 1",
        "eval_fp32: did not run (the lossless check in fp32 gates ok)",
    ]


def test_a_copy_without_git_takes_the_commit_it_is_given(tmp_path, monkeypatch):
    """A device machine gets the working tree without .git: --commit (DRAFTSMITH_GIT_COMMIT)
    names the commit, and a -dirty suffix sets the dirty flag."""
    from draftsmith.train.runinfo import git_facts

    monkeypatch.setenv("DRAFTSMITH_GIT_COMMIT", "0123abc-dirty")
    assert git_facts() == {"git_commit": "0123abc", "git_dirty": True, "git_source": "given"}
    monkeypatch.delenv("DRAFTSMITH_GIT_COMMIT")
    facts = git_facts()
    assert facts["git_source"] == "git" and len(facts["git_commit"]) == 40


@pytest.mark.rehearsal  # ~50 s: every stage starts and fails
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


@pytest.mark.rehearsal  # and the real target: -m rehearsal needs it prepared
def test_gpu_check_on_cpu_with_the_real_target(tmp_path):
    """The script as a GPU machine runs it, here on the CPU with the real SmolLM2 (< 5 min)."""
    proc, result = _run(["--device", "cpu", "--quick"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert result["ok"] is True and result["stages"]["eval_fp32"]["identical_rate"] == 1
    assert result["stages"]["eval_greedy"]["num_prompts"] == 2
