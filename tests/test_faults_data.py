"""Faults on the data / cache / export side: each test injects one and checks the
one-line error, the exit code, and that earlier good files survive with no temp dirs left."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from draftsmith.heads.eagle import EagleConfig, build_drafter, save_drafter
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.recipes.cli import main as cli
from draftsmith.train import safety
from draftsmith.train.datagen import distill_command, resumable
from draftsmith.train.datagen import self_distill as sd_mod
from draftsmith.train.export.hf import save_draft
from draftsmith.train.features.cache_format import CacheMismatchError
from draftsmith.train.features.cache_read import HiddenStateCache
from draftsmith.train.features.cache_write import build_cache
from draftsmith.train.features.source import feature_source, target_fingerprint
from draftsmith.train.objectives.draft_init import pruned_draft
from draftsmith.train.runinfo import output_lock
from draftsmith.train.safety import DiskSpaceError, OutputLockedError
from draftsmith.train.target_model.load import load_target
from tests.conftest import tiny_llama, tiny_model_dir

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["hi", "What is 2 + 2?", "Name a colour.", "Say yes.", "Tell a joke.", "x"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(str(target_dir))


def _err_line(capsys) -> str:
    """The one ``error: ...`` line of stderr since the last read: the last line printed (info
    lines such as distill's input summary and progress bars may come before it), no traceback.
    """
    text = capsys.readouterr().err
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]
    assert "Traceback" not in text and len(errors) == 1 and lines[-1] == errors[0], lines
    return errors[0]


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _hidden(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("."))


# --------------------------------------------------------------------------------------------
# Exports: non-finite weights, disk full, permissions, stale temp dirs
# --------------------------------------------------------------------------------------------


def _checkpoint(fmt: str, tmp_path: Path, target_dir: Path, target, bad: float) -> tuple[Path, str]:
    """A saved drafter of the kind ``fmt`` exports with ``bad`` written into one weight; returns
    the directory and the name the export gives that tensor."""
    model, tok = target
    if fmt in ("speculators", "eagle3", "eagle"):
        version = 1 if fmt == "eagle" else 3
        aux = [1, 2, 3] if version == 3 else None
        drafter = build_drafter(
            model, EagleConfig.from_target(model.config, version, feature_layers=aux)
        )
        with torch.no_grad():
            drafter.fc.weight[0, 1] = bad
        return save_drafter(drafter, tmp_path / "drafter"), "fc.weight"
    if fmt in ("medusa-vllm", "medusa"):
        heads = MedusaHeads.from_target(model, 2, 1)
        heads.save(tmp_path / "heads", extra={"target_name_or_path": str(target_dir)})
        # save() refuses non-finite heads, so the bad value is written into the file (as a
        # checkpoint from an older version, or a damaged one, would hold it).
        weights = tmp_path / "heads" / "model.safetensors"
        state = safetensors.torch.load_file(weights)
        state["blocks.1.layers.0.weight"][2, 2] = bad
        safetensors.torch.save_file(state, weights)
        return tmp_path / "heads", "blocks.1.layers.0.weight"
    draft = pruned_draft(model, [0, 3]).eval()
    with torch.no_grad():
        draft.model.layers[1].mlp.down_proj.weight[0, 0] = bad
    save_draft(draft, tok, tmp_path / "draft")
    return tmp_path / "draft", "model.layers.1.mlp.down_proj.weight"


FORMATS = ["speculators", "eagle3", "eagle", "medusa-vllm", "medusa", "hf"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_export_format_refuses_nan_weights(tmp_path, target_dir, target, fmt, capsys):
    src, name = _checkpoint(fmt, tmp_path, target_dir, target, float("nan"))
    out = tmp_path / "exports" / fmt
    out.parent.mkdir()
    code = cli(
        [
            "export",
            "--format",
            fmt,
            "--checkpoint",
            str(src),
            "--out",
            str(out),
            "--target",
            str(target_dir),
        ]
    )
    line = _err_line(capsys)
    assert code == 1
    assert name in line and "1 NaN" in line and "non-finite" in line
    assert not out.exists() and list(out.parent.iterdir()) == []  # no half export, no temp dir


def test_export_refuses_inf_from_a_dtype_cast(tmp_path, target_dir, target, capsys):
    """fp32 weights that are finite but overflow fp16 become inf in the export: refused too."""
    src, _ = _checkpoint("speculators", tmp_path, target_dir, target, 1e6)
    out = tmp_path / "e"
    argv = [
        "export",
        "--format",
        "speculators",
        "--checkpoint",
        str(src),
        "--out",
        str(out),
        "--target",
        str(target_dir),
    ]
    assert cli([*argv, "--dtype", "fp16"]) == 1
    line = _err_line(capsys)
    assert "fc.weight (0 NaN, 1 inf)" in line and "as float16" in line
    assert cli([*argv, "--dtype", "fp32"]) == 0  # the same weights, exported as they are


@pytest.mark.parametrize("fmt", ["speculators", "medusa-vllm", "hf"])
def test_export_disk_full_keeps_the_old_export(
    tmp_path, target_dir, target, fmt, capsys, monkeypatch
):
    src, _ = _checkpoint(fmt, tmp_path, target_dir, target, 0.5)
    out = tmp_path / "exports" / "x"
    argv = [
        "export",
        "--format",
        fmt,
        "--checkpoint",
        str(src),
        "--out",
        str(out),
        "--target",
        str(target_dir),
        "--overwrite",
    ]
    assert cli(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    # The write itself fails: safetensors (EAGLE, Medusa) or save_pretrained (hf).
    import transformers

    monkeypatch.setattr(safetensors.torch, "save_file", _enospc)
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", _enospc)
    assert cli(argv) == 1
    assert _err_line(capsys).startswith(f"error: no space left on {out.parent}")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _hidden(out.parent) == []
    monkeypatch.undo()
    # Not enough free space for the estimate: refused before anything is written.
    monkeypatch.setattr(safety, "free_bytes", lambda path: 1000)
    assert cli(argv) == 1
    line = _err_line(capsys)
    assert "no space left on" in line and "have 1000 B" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _hidden(out.parent) == []


@pytest.mark.parametrize("fmt", ["eagle", "medusa", "hf"])
def test_exports_are_readable_by_other_users(tmp_path, target_dir, target, fmt):
    src, _ = _checkpoint(fmt, tmp_path, target_dir, target, 0.5)
    out = tmp_path / "x"
    old = os.umask(0o077)  # a private umask: without the chmod everything would be 0700/0600
    try:
        assert (
            cli(
                [
                    "export",
                    "--format",
                    fmt,
                    "--checkpoint",
                    str(src),
                    "--out",
                    str(out),
                    "--target",
                    str(target_dir),
                ]
            )
            == 0
        )
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.rglob("*")}
    assert modes and all(m == (0o755 if (out / n).is_dir() else 0o644) for n, m in modes.items())


_SLOW_EXPORT = """
import sys, time
from pathlib import Path
from draftsmith.train.export import eagle as export_eagle
card = export_eagle.model_card

def slow_card(*args, **kwargs):  # the weights are written; a kill now leaves the temp dir
    Path(sys.argv[3]).write_text("ready")
    time.sleep(60)
    return card(*args, **kwargs)

export_eagle.model_card = slow_card
export_eagle.export_eagle(sys.argv[1], sys.argv[2], target_name_or_path="t")
"""


def test_killed_export_leaves_no_temp_dir_after_the_next_one(tmp_path, target_dir, target):
    src, _ = _checkpoint("eagle", tmp_path, target_dir, target, 0.5)
    out, ready = tmp_path / "exports" / "e1", tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_EXPORT, str(src), str(out), str(ready)], cwd=REPO
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "export never started"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    left = _hidden(out.parent)
    assert len(left) == 1 and left[0].startswith(f".e1.tmp-{proc.pid}@")  # the fault
    # A live writer's temp dir is not touched by a concurrent export...
    live = out.parent / f".e1.tmp-{os.getpid()}@{socket.gethostname()}.abcd"
    live.mkdir()
    assert (
        cli(
            [
                "export",
                "--format",
                "eagle",
                "--checkpoint",
                str(src),
                "--out",
                str(out),
                "--target",
                str(target_dir),
            ]
        )
        == 0
    )
    # ... but the dead one's is removed by it.
    assert _hidden(out.parent) == [live.name]
    assert (out / "model.safetensors").is_file()


# --------------------------------------------------------------------------------------------
# data distill: one writer per output, disk full
# --------------------------------------------------------------------------------------------


def _prompts(tmp_path: Path, n: int = 6) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "id": f"p{i}"}) + "\n"
            for i in range(n)
        )
    )
    return path


def _distill_argv(tmp_path, target_dir, out) -> list[str]:
    return [
        "--input",
        str(_prompts(tmp_path)),
        "--output",
        str(out),
        "--target",
        str(target_dir),
        "--max-new-tokens",
        "4",
        "--batch-size",
        "2",
        "--no-progress",
    ]


_HELD_DISTILL = """
import sys, time
from pathlib import Path
from draftsmith.train.datagen import distill_command
from draftsmith.train.datagen import self_distill
batch = self_distill._distill_batch
ready, go = Path(sys.argv[1]), Path(sys.argv[2])

def held(*args, **kwargs):  # the first run holds the output until the test says go
    ready.write_text("ready")
    while not go.exists():
        time.sleep(0.05)
    return batch(*args, **kwargs)

self_distill._distill_batch = held
sys.exit(distill_command.main_distill(sys.argv[3:]))
"""


def test_second_distill_into_one_output_is_refused(tmp_path, target_dir):
    out, ready, go = tmp_path / "sd.jsonl", tmp_path / "ready", tmp_path / "go"
    argv = _distill_argv(tmp_path, target_dir, out)
    first = subprocess.Popen(
        [sys.executable, "-c", _HELD_DISTILL, str(ready), str(go), *argv],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.1)
        second = subprocess.run(
            [sys.executable, "-m", "draftsmith.recipes.cli", "data", "distill", *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        go.write_text("go")
        first_err = first.communicate(timeout=300)[1]
    assert second.returncode == 1, second.stderr
    err = [line for line in second.stderr.splitlines() if line.startswith("error")]
    assert err == [
        f"error: {out} is in use by another distill run (PID {first.pid}); wait "
        "for it to finish or stop it, or choose another output"
    ]
    assert "Traceback" not in second.stderr
    assert first.returncode == 0, first_err
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == [f"p{i}" for i in range(6)]  # every record once


def test_distill_checks_free_space_before_generating(tmp_path, target_dir, monkeypatch, capsys):
    calls = []
    batch = sd_mod._distill_batch
    monkeypatch.setattr(sd_mod, "_distill_batch", lambda *a, **k: calls.append(1) or batch(*a, **k))
    monkeypatch.setattr(safety, "free_bytes", lambda path: 100)
    out = tmp_path / "sd.jsonl"
    assert distill_command.main_distill(_distill_argv(tmp_path, target_dir, out)) == 1
    assert _err_line(capsys).startswith(f"error: no space left on {tmp_path}: need ~")
    assert calls == [] and out.read_text() == ""  # no generation time spent, nothing written


def test_distill_disk_full_mid_write_keeps_complete_batches(
    tmp_path, target_dir, monkeypatch, capsys
):
    argv_ref = _distill_argv(tmp_path, target_dir, tmp_path / "ref.jsonl")
    assert distill_command.main_distill(argv_ref) == 0
    reference = (tmp_path / "ref.jsonl").read_bytes()

    writes = []
    append = resumable._append

    def fill_up(fd, data):  # the second batch: half its bytes land, then the disk is full
        writes.append(len(data))
        if len(writes) == 2:
            os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        append(fd, data)

    monkeypatch.setattr(resumable, "_append", fill_up)
    out = tmp_path / "sd.jsonl"
    argv = _distill_argv(tmp_path, target_dir, out)
    capsys.readouterr()
    assert distill_command.main_distill(argv) == 1
    assert _err_line(capsys).startswith(f"error: no space left on {tmp_path}")
    lines = out.read_bytes()
    assert lines.endswith(b"\n") and len(lines) == writes[0]  # exactly the first batch
    monkeypatch.undo()
    assert distill_command.main_distill(argv) == 0  # resumes after space was freed
    assert out.read_bytes() == reference


# --------------------------------------------------------------------------------------------
# data tokenize: nothing to train on, one writer, disk full, foreign directories
# --------------------------------------------------------------------------------------------


def _tokenize(tmp_path, target_dir, data: Path, out: Path) -> int:
    return cli(
        [
            "data",
            "tokenize",
            "--input",
            str(data),
            "--output",
            str(out),
            "--target",
            str(target_dir),
        ]
    )


def _chats(tmp_path: Path, name: str = "chats.jsonl") -> Path:
    path = tmp_path / name
    rows = [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "ok"}]}
        for p in PROMPTS
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_tokenize_prompts_without_answers_fails_with_what_to_run(tmp_path, target_dir, capsys):
    prompts = _prompts(tmp_path)
    assert _tokenize(tmp_path, target_dir, prompts, tmp_path / "tok") == 2
    line = _err_line(capsys)
    assert line.startswith(f"error: {prompts}: no sample left to train on")
    assert "no assistant turn: 6" in line and "draftsmith data distill" in line
    assert not (tmp_path / "tok").exists()


def test_tokenize_output_lock_disk_full_and_foreign_dirs(tmp_path, target_dir, capsys, monkeypatch):
    import datasets

    data, out = _chats(tmp_path), tmp_path / "tok"
    assert _tokenize(tmp_path, target_dir, data, out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    # Another process writes this output (the lock is per open file, so this process's own
    # lock is "another writer" too).
    with output_lock(out, "tokenize run"):
        assert _tokenize(tmp_path, target_dir, data, out) == 1
    assert f"(PID {os.getpid()})" in _err_line(capsys)

    # The disk fills up during the save: the previous dataset stays, no temp dir is left.
    def half_save(self, path, **kwargs):
        Path(path, "data-00000-of-00001.arrow").write_bytes(b"x" * 10)
        _enospc()

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", half_save)
    assert _tokenize(tmp_path, target_dir, data, out) == 1
    assert _err_line(capsys).startswith(f"error: no space left on {tmp_path}")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _hidden(tmp_path) == []
    monkeypatch.undo()
    # A directory that is not a tokenized dataset is never replaced.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert _tokenize(tmp_path, target_dir, data, mine) == 2
    assert "is not a tokenized dataset" in _err_line(capsys)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


# --------------------------------------------------------------------------------------------
# data cache: one builder, disk full mid-build, another target with the same shapes
# --------------------------------------------------------------------------------------------


def _samples(n: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(0, 64, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g)
        out.append({"input_ids": ids.tolist(), "loss_mask": [1] * len(ids), "id": f"s{i}"})
    return out


def _build(model, out, **kw):
    kw = {"dtype": "fp32", "batch_tokens": 64, "shard_mb": 0.005, "progress": False, **kw}
    return build_cache(model, _samples(), out, [2, 4], **kw)


def test_cache_build_lock_and_disk_full_mid_build(tmp_path, monkeypatch):
    model = tiny_llama(seed=0)
    out = tmp_path / "c"
    with output_lock(out, "cache build"), pytest.raises(OutputLockedError) as err:
        _build(model, out)
    assert f"PID {os.getpid()}" in str(err.value)

    save = safetensors.torch.save_file
    shards = []

    def full_on_second(tensors, filename, metadata=None):
        if Path(filename).parent.name.startswith(".shard-"):  # a shard's staged temp file
            shards.append(filename)
            if len(shards) == 2:
                Path(filename).write_bytes(b"partial")
                raise RuntimeError("Error while serializing: IoError(No space left on device)")
        return save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_on_second)
    with pytest.raises(DiskSpaceError, match=f"no space left on {out}: need ~"):
        _build(model, out)
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000.safetensors"]  # no temp file
    monkeypatch.undo()
    summary = _build(model, out)  # resumes: the finished shard is kept
    assert summary["skipped"] == [0] and summary["num_shards"] > 2
    assert len(HiddenStateCache(out)) == 12


def test_cache_from_another_target_with_the_same_shapes_is_refused(tmp_path, target):
    model_a, _ = target
    other_dir = tiny_model_dir(tmp_path / "other", seed=1)
    model_b, _ = load_target(str(other_dir))
    _build(model_a, tmp_path / "c")  # records A's hash (its name_or_path is a model dir)
    fp_a, fp_b = target_fingerprint(model_a), target_fingerprint(model_b)
    assert fp_a and fp_b and fp_a != fp_b
    assert target_fingerprint(model_a.config.name_or_path) == fp_a  # a path gives the same
    assert target_fingerprint(tiny_llama()) is None  # built in memory: nothing to compare
    feature_source("offline", layers=[4], cache=tmp_path / "c", expect={"target_hash": fp_a})
    with pytest.raises(CacheMismatchError) as err:
        feature_source("offline", layers=[4], cache=tmp_path / "c", expect={"target_hash": fp_b})
    msg = str(err.value)
    assert f"target_hash: trainer expects {fp_b!r}, cache has {fp_a!r}" in msg
    assert "draftsmith data cache" in msg


def test_cache_cli_refuses_bad_layers_and_draft_vocab_before_any_forward(
    tmp_path, target_dir, capsys
):
    tok = tmp_path / "tok.jsonl"
    tok.write_text("".join(json.dumps(s) + "\n" for s in _samples(3)))
    base = [
        "data",
        "cache",
        "--data",
        str(tok),
        "--out",
        str(tmp_path / "c"),
        "--target",
        str(target_dir),
        "--no-progress",
    ]
    assert cli([*base, "--layers", "2", "9"]) == 2
    line = _err_line(capsys)
    assert "layers [9] out of range" in line and "valid feature layers are 0..4" in line
    assert cli([*base, "--draft-vocab-size", "100000"]) == 2
    assert "draft_vocab_size 100000 is larger than the target's vocabulary" in _err_line(capsys)
    assert not list((tmp_path / "c").glob("shard-*"))
    assert (
        cli(
            [
                "data",
                "vocab",
                "--data",
                str(tok),
                "--out",
                str(tmp_path / "v.safetensors"),
                "--target",
                str(target_dir),
                "--draft-vocab-size",
                "100000",
            ]
        )
        == 2
    )
    assert "draft_vocab_size 100000 is larger" in _err_line(capsys)
