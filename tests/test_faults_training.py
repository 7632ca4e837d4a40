"""Faults injected into the training recipes: each gives a named outcome, no lost work.

Signals are sent to real recipe subprocesses; the other faults run the recipes in-process on a
tiny target (a few optimizer steps each).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from draftsmith.recipes.distill import main as distill
from draftsmith.recipes.eagle import main as eagle
from draftsmith.recipes.medusa import main as medusa
from draftsmith.train import safety
from draftsmith.train.core.checkpoint import finished_checkpoints
from tests.test_eagle_recipe import base_args, write_records

REPO = Path(__file__).resolve().parents[1]


def eagle_args(tmp_path, target_dir, version: int = 1, **over) -> list[str]:
    """A small EAGLE run: no validation, no checkpoints unless asked, log lines instead of a bar."""
    values = {"eval_every": 0, "save_every": 0, "log_every": 1, "val_samples": 2}
    values.update(over)
    return [*base_args(tmp_path, target_dir, version, **values), "--no-progress"]


def strict_json(path: Path):
    """Parse ``path`` as strict JSON: a bare NaN/Infinity fails."""

    def refuse(name):
        raise ValueError(f"{path}: {name} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def one_error_line(err: str) -> str:
    """The recipe's message: exactly one ``error:`` line (a config error lists its fields on the
    lines below it) and no traceback; returned from that line on."""
    lines = err.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert len(starts) == 1 and "Traceback" not in err, err[-2000:]
    return "\n".join(lines[starts[0] :])


def _start(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(REPO / "recipes/eagle.py"), *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(proc: subprocess.Popen, text: str, timeout: float = 120) -> list[str]:
    """Read the recipe's stdout until a line holds ``text``."""
    lines, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    proc.kill()
    pytest.fail(
        f"never saw {text!r}; stdout: {''.join(lines)[-2000:]}; "
        f"stderr: {proc.stderr.read()[-2000:]}"
    )


# --- signals -------------------------------------------------------------------------------


def test_sigint_finishes_the_step_saves_and_resume_continues(tmp_path, tiny_target_dir):
    proc = _start(eagle_args(tmp_path, tiny_target_dir, max_steps=100_000))
    _wait_for(proc, "step 3/")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGINT: stopping after this optimizer step" in err and "Traceback" not in err
    resume_line = [line for line in out.splitlines() if "resume with" in line]
    assert len(resume_line) == 1 and "recipes/eagle.py" in resume_line[0]
    (step, path), *_ = finished_checkpoints(tmp_path / "run")
    assert step >= 3 and strict_json(path / "trainer_state.json")["step"] == step
    assert not (tmp_path / "run" / "drafter").exists()  # stopped, not finished
    # Resume: the step count continues from the checkpoint, the history before it is kept.
    assert eagle(eagle_args(tmp_path, tiny_target_dir, max_steps=step + 2)) == 0
    metrics = strict_json(tmp_path / "run" / "training_metrics.json")
    assert metrics["resumed_from"] == step and metrics["steps"] == step + 2
    assert [e["step"] for e in metrics["train_log"]][: step + 2] == list(range(1, step + 3))


def test_second_signal_exits_at_once_and_keeps_checkpoints(tmp_path, tiny_target_dir):
    proc = _start(eagle_args(tmp_path, tiny_target_dir, max_steps=100_000, save_every=1))
    _wait_for(proc, "step 3/")
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "again: exiting now" in err and "Traceback" not in err
    done = finished_checkpoints(tmp_path / "run")
    assert done and all(strict_json(p / "trainer_state.json")["step"] == s for s, p in done)


# --- numerical faults ----------------------------------------------------------------------


def test_nan_loss_stops_naming_the_step_and_keeps_the_good_checkpoint(
    tmp_path, tiny_target_dir, capsys
):
    # fp32 (the defaults are bf16 where native): lr 1e6 overflows fp32 within 20 steps.
    argv = eagle_args(tmp_path, tiny_target_dir, version=3, lr=1e6, save_every=1, max_steps=20)
    argv += ["--target-dtype", "fp32", "--mixed-precision", "no"]
    assert eagle(argv) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "non-finite loss or gradient at step" in line and "checkpoints/step_" in line
    done = finished_checkpoints(tmp_path / "run")
    assert done, "the last good checkpoint was deleted"
    from safetensors.torch import load_file

    for _, path in done:
        weights = load_file(path / "model.safetensors")
        assert all(torch.isfinite(t).all() for t in weights.values()), path
    for file in (tmp_path / "run").rglob("*.json"):
        strict_json(file)
    assert not (tmp_path / "run" / "drafter").exists()


@pytest.mark.parametrize("recipe", [eagle, medusa, distill], ids=["eagle", "medusa", "distill"])
def test_nan_learning_rate_is_a_config_error(recipe, tmp_path, capsys):
    assert recipe(["--lr", "nan", "--data", "x.jsonl", "--output-dir", str(tmp_path)]) == 2
    assert "lr: must be a finite number, got nan" in capsys.readouterr().err


def test_on_nonfinite_skip_counts_and_goes_on(tmp_path, tiny_target_dir, monkeypatch, capsys):
    import draftsmith.recipes.distill as recipe

    calls = {"n": 0}
    real = recipe.distill_batch_loss

    def loss_with_one_nan(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 3:
                return loss * float("nan"), metrics
        return loss, metrics

    monkeypatch.setattr(recipe, "distill_batch_loss", loss_with_one_nan)
    argv = [
        "--target",
        str(tiny_target_dir),
        "--data",
        str(write_records(tmp_path / "d.jsonl")),
        "--output-dir",
        str(tmp_path / "run"),
        "--max-steps",
        "4",
        "--batch-size",
        "2",
        "--val-samples",
        "2",
        "--save-every",
        "0",
        "--no-progress",
        "--max-length",
        "96",
        "--on-nonfinite",
        "skip",
        "--log-every",
        "1",
    ]
    assert distill(argv) == 0
    assert "step 3: non-finite loss or gradient" in capsys.readouterr().out
    metrics = strict_json(tmp_path / "run" / "training_metrics.json")
    assert metrics["skipped_nonfinite"] == 1 and metrics["steps"] == 4
    assert calls["n"] == 5  # 4 applied steps + the skipped one
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "run" / "draft" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


# --- disk ----------------------------------------------------------------------------------


def test_too_little_free_space_refuses_the_save_and_keeps_the_previous(
    tmp_path, tiny_target_dir, monkeypatch, capsys
):
    run = tmp_path / "run"
    real = safety.free_bytes
    # Plenty of space until the first checkpoint exists, then a full disk.
    monkeypatch.setattr(
        safety,
        "free_bytes",
        lambda p: 1000 if (run / "checkpoints" / "step_2").exists() else real(p),
    )
    assert eagle(eagle_args(tmp_path, tiny_target_dir, save_every=2, max_steps=6)) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "no space left on" in line and "have 1000 B" in line
    assert [s for s, _ in finished_checkpoints(run)] == [2]
    assert not list((run / "checkpoints").glob(".*tmp"))


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(
    tmp_path, tiny_target_dir, monkeypatch, capsys
):
    from accelerate import Accelerator

    real, calls = Accelerator.save_state, {"n": 0}

    def save_state(self, output_dir=None, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # half a file written, then the disk is full
            (Path(output_dir) / "model.safetensors").write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", save_state)
    run = tmp_path / "run"
    assert eagle(eagle_args(tmp_path, tiny_target_dir, save_every=2, max_steps=6)) == 1
    assert "no space left on" in one_error_line(capsys.readouterr().err)
    assert [s for s, _ in finished_checkpoints(run)] == [2]
    assert not list((run / "checkpoints").glob(".*tmp"))


def test_final_save_without_checkpoints_fails_loudly(
    tmp_path, tiny_target_dir, monkeypatch, capsys
):
    import draftsmith.heads.eagle as heads

    def full_disk(*args, **kwargs):  # what torch's zip writer says on ENOSPC
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . PytorchStreamWriter "
            "failed writing file data/0: file write failed"
        )

    monkeypatch.setattr(heads, "save_drafter", full_disk)
    assert eagle(eagle_args(tmp_path, tiny_target_dir, max_steps=2)) == 1
    assert "no space left on" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "run" / "drafter").exists()
    assert not list((tmp_path / "run").glob(".*tmp"))


# --- ownership -----------------------------------------------------------------------------


def test_a_second_run_into_a_locked_output_is_refused_naming_the_pid(
    tmp_path, tiny_target_dir, capsys
):
    run = tmp_path / "run"
    code = (
        "import sys, time; from draftsmith.train.safety import OutputLock; "
        f"OutputLock({str(run)!r}).acquire(); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert eagle(eagle_args(tmp_path, tiny_target_dir, max_steps=2)) == 1
        line = one_error_line(capsys.readouterr().err)
        assert f"in use by another training run (PID {holder.pid})" in line
    finally:
        holder.kill()
        holder.wait()


def test_starting_over_an_eagle_run_needs_overwrite(tmp_path, tiny_target_dir, capsys):
    run = tmp_path / "run"
    assert eagle(eagle_args(tmp_path, tiny_target_dir, save_every=2, max_steps=4)) == 0
    capsys.readouterr()
    fresh = eagle_args(tmp_path, tiny_target_dir, save_every=1, max_steps=2)
    assert eagle([*fresh, "--no-resume"]) == 2
    assert "already holds a eagle run" in one_error_line(capsys.readouterr().err)
    assert [s for s, _ in finished_checkpoints(run)] == [2, 4]  # untouched
    assert eagle([*fresh, "--no-resume", "--overwrite"]) == 0
    # The new run's checkpoints survive rotation (the old run's higher steps are gone).
    assert [s for s, _ in finished_checkpoints(run)] == [1, 2]
    metrics = strict_json(run / "training_metrics.json")
    assert metrics["steps"] == 2 and metrics["resumed_from"] is None


def test_a_run_killed_before_its_first_checkpoint_starts_again(tmp_path, tiny_target_dir):
    run = tmp_path / "run"
    (run / "checkpoints" / ".step_2.tmp").mkdir(parents=True)  # a save killed half-way
    (run / "best").mkdir()
    assert eagle(eagle_args(tmp_path, tiny_target_dir, save_every=2, max_steps=2)) == 0
    assert [s for s, _ in finished_checkpoints(run)] == [2]
    assert not (run / "checkpoints" / ".step_2.tmp").exists()


def test_resume_falls_back_from_a_truncated_checkpoint(tmp_path, tiny_target_dir, capsys):
    run = tmp_path / "run"
    assert eagle(eagle_args(tmp_path, tiny_target_dir, save_every=2, max_steps=4)) == 0
    (run / "checkpoints" / "step_4" / "model.safetensors").write_bytes(b"\0" * 64)
    assert eagle(eagle_args(tmp_path, tiny_target_dir, save_every=2, max_steps=6)) == 0
    out = capsys.readouterr().out
    assert "step_4 cannot be loaded" in out and "resumed from" in out
    assert strict_json(run / "training_metrics.json")["resumed_from"] == 2
    # Another recipe variant's checkpoints are refused by name.
    assert eagle(eagle_args(tmp_path, tiny_target_dir, version=3, max_steps=8)) == 2
    assert "is a eagle1 checkpoint, this is a eagle3 run" in capsys.readouterr().err


# --- data position -------------------------------------------------------------------------


def test_every_training_sample_is_seen_once_per_epoch(tmp_path, tiny_target_dir, monkeypatch):
    """20 training samples, batch 2, grad_accum 3: 10 micro-batches an epoch, not a multiple."""
    import draftsmith.train.objectives.eagle_ttt as ttt

    seen: list[str] = []
    real = ttt.eagle1_loss

    def recording_loss(drafter, batch, *args, **kwargs):
        if drafter.training:
            seen.extend(batch["ids"])
        return real(drafter, batch, *args, **kwargs)

    monkeypatch.setattr(ttt, "eagle1_loss", recording_loss)
    common = {"max_steps": "None", "epochs": 3, "grad_accum": 3, "batch_size": 2}
    assert eagle(eagle_args(tmp_path, tiny_target_dir, **common)) == 0
    metrics = strict_json(tmp_path / "run" / "training_metrics.json")
    assert metrics["train_samples"] == 20 and metrics["steps"] == 3 * 4
    straight, seen[:] = list(seen), []
    train_ids = sorted(set(straight))
    assert len(train_ids) == 20
    epochs = [straight[i * 20 : (i + 1) * 20] for i in range(3)]
    assert len(straight) == 60 and all(sorted(e) == train_ids for e in epochs)

    # Interrupted mid-epoch (step 6 = 18 micro-batches in), then resumed: the same samples in
    # the same order as the unbroken run.
    paused = eagle_args(tmp_path, tiny_target_dir, output_dir=tmp_path / "paused", **common)
    assert eagle([*paused, "--stop-after-steps", "6"]) == 0
    assert [s for s, _ in finished_checkpoints(tmp_path / "paused")] == [6]
    assert eagle(paused) == 0
    assert seen == straight


# --- errors, not tracebacks ----------------------------------------------------------------


def _prompts_only(tmp_path: Path) -> Path:
    return REPO / "train" / "data" / "prompt_sets" / "chat_prompts.jsonl"


def _malformed(tmp_path: Path) -> Path:
    path = write_records(tmp_path / "bad.jsonl")
    with open(path, "a") as f:
        f.write('{"id": 99, "instruction": \n')
    return path


def _empty(tmp_path: Path) -> Path:
    (tmp_path / "empty.jsonl").write_text("")
    return tmp_path / "empty.jsonl"


@pytest.mark.parametrize(
    "make_data, over, expect",
    [
        (lambda p: p / "missing.jsonl", {}, "missing.jsonl"),
        (_malformed, {}, "bad.jsonl:25"),
        (_empty, {}, "empty.jsonl"),
        (_prompts_only, {"split": "all"}, "draftsmith data distill"),
        (None, {"version": 3, "feature_layers": "1 2 9"}, "feature_layers: [1, 2, 9] is outside"),
        (None, {"version": 3, "draft_vocab_size": 100_000}, "draft_vocab_size: 100000 is larger"),
        (lambda p: None, {"init_from": "nowhere/drafter"}, "init_from: nowhere/drafter"),
    ],
    ids=["missing", "malformed", "empty", "prompts-only", "feature-layers", "vocab", "init-from"],
)
def test_input_errors_are_one_line(tmp_path, tiny_target_dir, capsys, make_data, over, expect):
    over = dict(over)
    version = over.pop("version", 1)
    argv = eagle_args(tmp_path, tiny_target_dir, version=version, max_steps=2, **over)
    if make_data is not None and make_data(tmp_path) is not None:
        argv[argv.index("--data") + 1] = str(make_data(tmp_path))
    if "feature_layers" in over:  # a list flag takes several values
        i = argv.index("--feature-layers")
        argv[i + 1 : i + 2] = over["feature_layers"].split()
    assert eagle(argv) == 2
    assert expect in one_error_line(capsys.readouterr().err)


def test_prompts_without_answers_train_only_when_allowed(tmp_path, tiny_target_dir, capsys):
    argv = eagle_args(tmp_path, tiny_target_dir, max_steps=1, split="all")
    argv[argv.index("--data") + 1] = str(_prompts_only(tmp_path))
    assert eagle(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "records dropped (" in line and "no assistant" in line and "allow_little_data" in line
    assert eagle([*argv, "--allow-little-data"]) == 0


# --- multi-process -------------------------------------------------------------------------


def _workers(launcher_pid: int) -> dict[int, int]:
    """``{local rank: pid}`` of the worker processes a launcher started."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        ranks = [e[len(b"LOCAL_RANK=") :] for e in env if e.startswith(b"LOCAL_RANK=")]
        if ranks:
            found[int(ranks[0])] = int(stat.parent.name)
    return found


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stopped_rank_ends_the_run_with_a_message(tmp_path, tiny_target_dir):
    """SIGSTOP one of 2 workers: the other's collective times out (pg_timeout_minutes) and the
    run ends with a message instead of waiting forever."""
    import shutil
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = eagle_args(tmp_path, tiny_target_dir, max_steps=100_000, pg_timeout_minutes=0.25)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(
        [
            shutil.which("accelerate") or "accelerate",
            "launch",
            "--config_file",
            str(REPO / "recipes/accelerate/cpu_2proc.yaml"),
            "--main_process_port",
            str(port),
            str(REPO / "recipes/eagle.py"),
            *argv,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    workers: dict[int, int] = {}
    try:
        _wait_for(launcher, "step 2/", timeout=240)
        workers = _workers(launcher.pid)
        assert set(workers) == {0, 1}, workers
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = launcher.communicate(timeout=240)
        waited = time.monotonic() - stopped
    finally:
        for pid in workers.values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        launcher.kill()
    assert launcher.returncode != 0
    assert "another process of this run stopped answering or died" in err, err[-3000:]
    assert waited < 200  # the 15 s timeout, plus the launcher tearing down; never "forever"
