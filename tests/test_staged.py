"""train/staged.py: an output appears under its final name only once complete; a killed
writer's leftovers are removed by the next writer, a live writer's are not."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith.train import safety
from draftsmith.train.errors import UsageError
from draftsmith.train.safety import DiskSpaceError
from draftsmith.train.staged import (
    OutputExistsError,
    clean_stale_dirs,
    prepare_stage,
    replace_dir,
    staged_dir,
    staged_file,
    write_atomic,
    write_json_atomic,
)

REPO = Path(__file__).resolve().parents[1]
HOST = socket.gethostname()


def _hidden(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("."))


def _dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def umask():
    """Set the process umask for one test (restored after)."""
    saved = []

    def set_umask(mask: int) -> None:
        saved.append(os.umask(mask))

    yield set_umask
    if saved:
        os.umask(saved[0])


# --- a killed writer ------------------------------------------------------------------------

_KILLED_WRITER = """
import sys, time
from pathlib import Path
from draftsmith.train.staged import staged_dir, staged_file

out, ready, kind = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
stage = staged_dir(out, overwrite=True) if kind == "dir" else staged_file(out)
with stage as tmp:
    part = tmp / "model.safetensors" if kind == "dir" else tmp
    part.write_bytes(b"new, half written")
    ready.write_text("ready")
    time.sleep(60)  # killed here
"""


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_a_killed_writer_leaves_no_partial_output_and_the_next_one_cleans_up(tmp_path, kind):
    out, ready = tmp_path / "out", tmp_path / "ready"
    if kind == "dir":
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"old")
    else:
        out.write_bytes(b"old")
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(out), str(ready), kind], cwd=REPO
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "writer never started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    old = out / "model.safetensors" if kind == "dir" else out
    assert old.read_bytes() == b"old"  # the previous output, whole
    if kind == "dir":
        assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    left = _hidden(tmp_path)
    assert len(left) == 1 and left[0].startswith(f".out.tmp-{proc.pid}@{HOST}.")  # the fault
    # The next writer removes the dead one's temp dir and writes its own output whole.
    if kind == "dir":
        with staged_dir(out, overwrite=True) as tmp:
            (tmp / "model.safetensors").write_bytes(b"new")
    else:
        write_atomic(out, b"new")
    assert old.read_bytes() == b"new" and _hidden(tmp_path) == []


# --- directories: overwrite, failure, modes -------------------------------------------------


def test_an_existing_output_is_refused_without_overwrite(tmp_path):
    out = tmp_path / "e"
    out.mkdir()
    (out / "a").write_text("old")
    refused = pytest.raises(OutputExistsError, match=r"e exists; pass overwrite=True \(--")
    with refused, staged_dir(out, overwrite=False):
        raise AssertionError("the body must not run")
    assert issubclass(OutputExistsError, UsageError) and issubclass(
        OutputExistsError, FileExistsError
    )
    assert (out / "a").read_text() == "old" and _hidden(tmp_path) == []
    tmp = tmp_path / "new"
    tmp.mkdir()
    with pytest.raises(OutputExistsError):
        replace_dir(tmp, out, overwrite=False)
    assert tmp.is_dir() and (out / "a").read_text() == "old"


def test_overwrite_replaces_the_whole_directory(tmp_path):
    out = tmp_path / "e"
    with staged_dir(out, overwrite=False) as tmp:
        (tmp / "a").write_text("1")
        (tmp / "b").write_text("1")
    with staged_dir(out, overwrite=True) as tmp:
        assert not (out / "c").exists()  # not yet visible under the final name
        (tmp / "c").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["c"]  # no mix of old and new
    assert _hidden(tmp_path) == []


def test_a_failed_body_keeps_the_previous_output(tmp_path):
    out = tmp_path / "e"
    out.mkdir()
    (out / "a").write_text("old")
    with pytest.raises(RuntimeError, match="boom"), staged_dir(out, overwrite=True) as tmp:
        (tmp / "a").write_text("half")
        raise RuntimeError("boom")
    assert (out / "a").read_text() == "old" and _hidden(tmp_path) == []


def test_disk_full_before_and_during_a_directory_write(tmp_path, monkeypatch):
    out = tmp_path / "e"
    out.mkdir()
    (out / "a").write_text("old")
    full = pytest.raises(DiskSpaceError, match=re.escape(f"no space left on {tmp_path}: need ~"))
    with full, staged_dir(out, overwrite=True, need_bytes=1 << 20) as tmp:
        (tmp / "a").write_text("half")
        _enospc()
    assert (out / "a").read_text() == "old" and _hidden(tmp_path) == []
    monkeypatch.setattr(safety, "free_bytes", lambda path: 1000)
    refused = pytest.raises(DiskSpaceError, match="have 1000 B")
    with refused, staged_dir(out, overwrite=True, need_bytes=1 << 20):
        raise AssertionError("refused before the body")
    assert (out / "a").read_text() == "old" and _hidden(tmp_path) == []


def test_a_staged_directory_is_readable_by_other_users(tmp_path, umask):
    umask(0o077)  # a private umask: without the chmod everything would be 0700/0600
    out = tmp_path / "e"
    with staged_dir(out, overwrite=False) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "w").write_text("x")
        (tmp / "c.json").write_text("{}")
    assert out.stat().st_mode & 0o777 == 0o755
    modes = {p: p.stat().st_mode & 0o777 for p in out.rglob("*")}
    assert len(modes) == 3
    assert all(m == (0o755 if p.is_dir() else 0o644) for p, m in modes.items())


def test_prepare_stage_with_a_fixed_temp_dir(tmp_path):
    out, at = tmp_path / "step_2", tmp_path / ".step_2.tmp"
    (at / "rank1").mkdir(parents=True)  # a killed save's leftover
    assert prepare_stage(out, overwrite=True, at=at) == at
    assert at.is_dir() and list(at.iterdir()) == []
    (at / "state.json").write_text("{}")
    replace_dir(at, out, overwrite=True)
    assert (out / "state.json").is_file() and not at.exists()
    (at / "junk").mkdir(parents=True)
    with pytest.raises(OutputExistsError):
        prepare_stage(out, overwrite=False, at=at)
    assert (at / "junk").is_dir()  # refused before anything is touched


# --- stale staging dirs ---------------------------------------------------------------------


def test_dead_writers_dirs_are_removed_live_ones_kept(tmp_path):
    out = tmp_path / "a[1]"  # glob characters in the name
    dead = tmp_path / f".a[1].tmp-{_dead_pid()}@{HOST}.x1"
    live = tmp_path / f".a[1].tmp-{os.getpid()}@{HOST}.x2"
    remote = tmp_path / f".a[1].tmp-1@not-{HOST}.x3"  # cannot tell: kept
    foreign = [tmp_path / ".a[1].tmp-x", tmp_path / ".a[1].tmp-12.x"]  # not ours: no @pid
    for p in [dead, live, remote, *foreign]:
        p.mkdir()
    (tmp_path / f".a[1].tmp-{_dead_pid()}@{HOST}.file").write_text("a file is not ours")
    assert clean_stale_dirs(out) == [dead]
    assert live.is_dir() and remote.is_dir() and all(p.is_dir() for p in foreign)
    # exclusive: the caller holds the output, so every staging dir is a leftover.
    assert sorted(clean_stale_dirs(out, exclusive=True)) == sorted([live, remote])
    assert all(p.is_dir() for p in foreign)
    assert clean_stale_dirs(tmp_path / "missing" / "x") == []


def test_a_kill_between_the_final_renames_gets_the_old_export_back(tmp_path):
    """replace_dir moves the old export aside, then renames the new one in; a writer killed in
    between leaves only the aside copy, which the next run puts back before cleaning up."""
    out = tmp_path / "e"
    aside = tmp_path / f".e.old-{_dead_pid()}@{HOST}.q1w2e3"
    (aside / "x").mkdir(parents=True)
    (aside / "x" / "model.safetensors").write_text("old export")
    assert clean_stale_dirs(out) == [aside]
    assert (out / "model.safetensors").read_text() == "old export" and _hidden(tmp_path) == []


def test_an_aside_copy_is_dropped_when_the_new_output_arrived(tmp_path):
    out = tmp_path / "e"
    out.mkdir()
    (out / "model.safetensors").write_text("new export")
    aside = tmp_path / f".e.old-{_dead_pid()}@{HOST}.q1w2e3"
    (aside / "x").mkdir(parents=True)
    assert clean_stale_dirs(out) == [aside]
    assert (out / "model.safetensors").read_text() == "new export" and _hidden(tmp_path) == []


# --- files ----------------------------------------------------------------------------------


def test_write_atomic_bytes_and_text_replace_the_file(tmp_path, umask):
    umask(0o022)
    path = tmp_path / "sub" / "f.txt"  # the directory is created
    write_atomic(path, "héllo\n")
    assert path.read_text() == "héllo\n" and path.stat().st_mode & 0o777 == 0o644
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    write_atomic(path, b"x", mode=0o600)
    assert path.stat().st_mode & 0o777 == 0o600
    assert _hidden(path.parent) == []


def test_write_json_atomic_writes_no_bare_nan(tmp_path):
    path = tmp_path / "m.json"
    write_json_atomic(
        path,
        {
            "loss": float("nan"),
            "hist": [1.5, float("inf"), -math.inf],
            "nested": {"x": (float("nan"), 2)},
        },
    )

    def refuse(token):
        raise AssertionError(f"bare {token} in the JSON")

    data = json.loads(path.read_text(), parse_constant=refuse)
    assert data == {"loss": None, "hist": [1.5, None, None], "nested": {"x": [None, 2]}}
    assert path.read_text().endswith("}\n")
    assert path.stat().st_mode & 0o777 == 0o600  # the mode these files have always had


def test_staged_file_mode_and_failure(tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"), staged_file(path) as tmp:
        assert tmp.name == path.name and tmp.parent != path.parent
        tmp.write_bytes(b"half")
        raise RuntimeError("boom")
    assert path.read_bytes() == b"old" and _hidden(tmp_path) == []
    with staged_file(path, mode=0o644) as tmp:
        tmp.write_bytes(b"new")
        tmp.chmod(0o600)  # as safetensors creates its files
    assert path.read_bytes() == b"new" and path.stat().st_mode & 0o777 == 0o644


def test_disk_full_before_and_during_a_file_write(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    path.write_text("old")
    monkeypatch.setattr(Path, "write_text", _enospc)
    with pytest.raises(DiskSpaceError, match=re.escape(f"no space left on {tmp_path}: need ~5 B")):
        write_atomic(path, "12345")
    monkeypatch.undo()
    assert path.read_text() == "old" and _hidden(tmp_path) == []
    monkeypatch.setattr(safety, "free_bytes", lambda p: 1000)
    with pytest.raises(DiskSpaceError, match="have 1000 B"), staged_file(path, need_bytes=1 << 20):
        raise AssertionError("refused before the body")
    write_atomic(path, "x" * 2000)  # small writes are not checked before: the write tells
    assert path.read_text() == "x" * 2000 and _hidden(tmp_path) == []
