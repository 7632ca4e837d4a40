"""What produced a result (command, versions, machine), strict JSON, and the busy-machine check.

- :func:`run_info` is attached to every results JSON.
- :func:`json_text` writes strict JSON: a non-finite float (NaN, inf) is written as ``null``,
  never as the bare ``NaN`` / ``Infinity`` tokens Python's json emits by default, which other
  JSON readers reject (:func:`~draftsmith.train.staged.write_json_atomic` writes a file of it).
- :func:`machine_load` / :func:`busy_warning` record and report a machine busy with other work.
- :func:`output_lock` locks an output written as a whole (a file, or a directory that
  :func:`~draftsmith.train.staged.staged_dir` replaces).
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from .safety import OutputLock


_PACKAGES = ("draftsmith", "torch", "transformers", "accelerate", "datasets", "peft")


def run_info(device: Any = None) -> dict[str, Any]:
    """Command line, versions, git commit and machine facts for a results file.

    Args:
        device: the device the run actually uses (a ``torch.device`` or its name): recorded
            with its facts (GPU name, CUDA version, ...; :func:`draftsmith.train.device.
            device_facts`). None: the run did not say, and no device is recorded -- a GPU being
            present does not mean the run used it.
    """
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = platform.python_version()
    git = git_facts(short=True)
    import torch

    from .device import cpu_facts, device_facts

    return {
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "versions": versions,
        "git_commit": git["git_commit"],
        "git_dirty": git["git_dirty"],
        "machine": {
            "platform": platform.platform(),
            "processor": platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cuda_available": torch.cuda.is_available(),
            **cpu_facts(),
            **(device_facts(device) if device is not None else {}),
            # The machine's load averages (1, 5, 15 min) when the file is written: over a run of
            # minutes, what else shared the cores (a 2-core timing with a load near 3 is not one).
            "load_average": _load_average(),
        },
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


#: Where a working tree without ``.git`` (a copy shipped to a GPU machine) gets its commit:
#: ``<commit>`` or ``<commit>-dirty`` (what ``git describe --always --dirty`` prints).
COMMIT_ENV = "DRAFTSMITH_GIT_COMMIT"


def git_facts(commit: str | None = None, *, short: bool = False) -> dict[str, Any]:
    """The commit this checkout runs, and whether its tracked files differ from it.

    Args:
        commit: the commit as the person who shipped the tree names it (``<sha>`` or
            ``<sha>-dirty``), for a copy without ``.git``; default ``$DRAFTSMITH_GIT_COMMIT``.
            Given, it wins over git.
        short: the abbreviated hash (results files) rather than the full one.

    Returns:
        ``git_commit`` (None when neither names one), ``git_dirty`` (tracked files changed;
        None when unknown), ``git_source`` (``"git"``, ``"given"`` or why there is none) and,
        from git, ``git_untracked`` (untracked files, counted apart).
    """
    commit = commit or os.environ.get(COMMIT_ENV) or None
    if commit:
        return {
            "git_commit": commit.removesuffix("-dirty"),
            "git_dirty": commit.endswith("-dirty"),
            "git_source": "given",
        }

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(
                ["git", *args],
                capture_output=True,
                text=True,
                timeout=20,
                cwd=Path(__file__).parent,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout if proc.returncode == 0 else None

    head = git("rev-parse", *(["--short"] if short else []), "HEAD")
    if head is None:
        return {"git_commit": None, "git_dirty": None, "git_source": "no git repository here"}
    status = (git("status", "--porcelain") or "").splitlines()
    return {
        "git_commit": head.strip(),
        "git_dirty": any(not line.startswith("??") for line in status),
        "git_untracked": sum(line.startswith("??") for line in status),
        "git_source": "git",
    }


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):  # not on every platform
        return None


def finite_json(data: Any) -> Any:
    """``data`` with every non-finite float (NaN, inf, -inf) replaced by None, recursively.

    Python's json writes them as bare ``NaN``/``Infinity``, which is not JSON: ``jq``, browsers
    and most other readers reject the whole file. ``null`` keeps the file valid and says "no
    number"; a diverged metric is reported by the run itself (message, exit code), not here.
    Dicts, lists and tuples are walked; other values are returned as they are.
    """
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_json(v) for v in data]
    return data


def json_text(data: Any, **kwargs: Any) -> str:
    """``json.dumps`` after :func:`finite_json`, with ``allow_nan=False`` as a guard."""
    return json.dumps(finite_json(data), allow_nan=False, **kwargs)


def wandb_mode() -> str | None:
    """``"offline"`` when W&B has no API key configured (and ``WANDB_MODE`` is unset), else None.

    Checked without importing wandb (touching ``wandb.api`` freezes its settings before the mode
    is chosen). Recipes pass the result as ``wandb.init(mode=...)``, so a run without a key or a
    network logs to ``./wandb`` (``wandb sync`` uploads it later) instead of failing.
    """
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return None
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        if "api.wandb.ai" in netrc.read_text():
            return None
    except OSError:
        pass
    return "offline"


def output_lock(path: str | Path, what: str) -> OutputLock:
    """An :class:`~draftsmith.train.safety.OutputLock` held on ``<path>.lock`` beside ``path``.

    For outputs that are a file (distilled JSONL) or a directory replaced as a whole
    (:func:`~draftsmith.train.staged.staged_dir`): a lock file inside a replaced directory
    would move away with the old copy, and ``OutputLock``'s own choice (inside a suffix-less
    path) would turn a file output without a suffix into a directory.
    """
    from .safety import OutputLock

    path = Path(path)
    return OutputLock(path, what=what, lock_path=path.with_name(path.name + ".lock"))


#: A run is "busy" when, beyond its own threads, work kept at least this share of the cores
#: runnable (1-min load average): on 2 cores, one other core-hogging process.
BUSY_SHARE = 0.5


def machine_load(own_load: float | None = None, sibling_load: float = 0.0) -> dict[str, Any]:
    """The load average and core count: a busy 2-core machine skews every timing.

    Results JSONs record it before and after a timed run, so a reader can tell whether another
    job shared the cores. The rule (docs/metrics.md, "Busy machine"): the 1-min load average
    counts runnable threads, this process's included, so ``load_beyond_own`` = load average −
    ``own_load`` (this process's share of it, :func:`process_load_share`); the machine is
    ``busy`` when that, less ``sibling_load``, is at least :data:`BUSY_SHARE` × cores. When
    busy, ``busy_processes`` names the other processes using the CPU right now
    (:func:`busy_processes`).

    Args:
        own_load: this process's share of the 1-min load average; default
            :func:`process_load_share`.
        sibling_load: the load this run expects beside its own when they have run as long as
            it: the other shards of a ``--shard I/N`` run, one process per core by design
            (:func:`sibling_load`). Shards start together, so their share of the 1-min average
            is counted as grown as far as this run's own (``own_load`` / threads).

    Returns:
        ``loadavg_1m``, ``loadavg_5m``, ``cpu_count``, ``own_threads`` (torch's intra-op
        threads, when torch is imported), ``own_load``, ``load_beyond_own``, ``busy`` (and
        ``busy_processes`` when busy); empty where the platform has no load average.
    """
    try:
        load = os.getloadavg()
    except OSError:
        return {}
    cores = os.cpu_count() or 1
    torch = sys.modules.get("torch")
    threads = min(torch.get_num_threads() if torch is not None else 1, cores)
    if own_load is None:  # unreadable: as if every torch thread had run all minute
        own_load = process_load_share()
        own_load = float(threads) if own_load is None else own_load
    beyond = max(0.0, load[0] - own_load)
    siblings = _grown(sibling_load, own_load, threads)
    record: dict[str, Any] = {
        "loadavg_1m": load[0],
        "loadavg_5m": load[1],
        "cpu_count": cores,
        "own_threads": threads,
        "own_load": round(own_load, 2),
        "load_beyond_own": round(beyond, 2),
        "sibling_load": round(siblings, 2),
        "busy": beyond - siblings >= BUSY_SHARE * cores,
    }
    if record["busy"]:
        record["busy_processes"] = busy_processes()
    return record


def sibling_load(shards: int, threads: int, cores: int | None = None) -> float:
    """The load the other shards of a run split ``shards`` ways add: ``threads`` each, at most
    the cores this run leaves them (``cores``: this machine's by default). Sharding puts one
    process per core on purpose, so their load is expected, not other work."""
    cores = cores or os.cpu_count() or 1
    return float(max(0, min((shards - 1) * threads, cores - threads)))


def _grown(nominal: float, own_load: float, threads: int) -> float:
    """``nominal`` sibling load scaled by how far this run's own share of the 1-min load
    average has grown (siblings started with it: just after start-up both count for little)."""
    return nominal * min(1.0, max(0.0, own_load) / max(threads, 1))


def _snapshot_busy(snap: dict[str, Any], siblings: float) -> bool:
    """Whether a ``machine_load`` snapshot was busy, recomputed from its figures with the
    shard siblings' load (files written before ``sibling_load`` existed counted the other
    shards as other work); its stored verdict where the figures are missing."""
    try:
        beyond, cores = float(snap["load_beyond_own"]), int(snap["cpu_count"])
    except (KeyError, TypeError, ValueError):
        return bool(snap.get("busy"))
    return beyond - siblings >= BUSY_SHARE * cores


def process_load_share() -> float | None:
    """This process's share of the 1-min load average, estimated from its CPU time and age.

    The kernel's 1-min load average weights what ran ``s`` seconds ago by ``exp(-s/60)``; a
    process that used ``r`` cores on average over its age ``T`` adds about
    ``r · (1 − exp(−T/60))``. So a run that has just started counts for little (the load of
    the minute before it is other work's), one that has used two cores for minutes for ~2.

    Returns:
        The estimate, or None where psutil cannot read this process.
    """
    try:
        proc = psutil.Process()
        with proc.oneshot():
            times, started = proc.cpu_times(), proc.create_time()
    except (psutil.Error, OSError):
        return None
    cpu_s = times.user + times.system  # all threads
    age = max(time.time() - started, 1e-3)
    return cpu_s / age * (1.0 - math.exp(-age / 60.0))


def busy_processes(
    top: int = 5, window_s: float = 0.25, min_cores: float = 0.05
) -> list[dict[str, Any]]:
    """The processes other than this one using the most CPU now (psutil).

    Two reads of every process's CPU time ``window_s`` apart give its CPU time in that window
    (all its threads), in cores (1.0 = one core kept busy). Processes psutil may not read
    (another user's, on some platforms) are left out.

    Args:
        top: at most this many processes, busiest first.
        window_s: the measuring window.
        min_cores: leave out processes below this.

    Returns:
        ``[{"pid", "name", "cores", "command"}]`` (``command`` cut to 120 characters).
    """

    def cpu_seconds() -> dict[int, tuple[psutil.Process, float]]:
        seen = {}
        for proc in psutil.process_iter(["name", "cpu_times"]):
            times = proc.info["cpu_times"]  # None when access is denied
            if proc.pid != os.getpid() and times is not None:
                seen[proc.pid] = (proc, times.user + times.system)
        return seen

    first = cpu_seconds()
    start = time.monotonic()
    time.sleep(window_s)
    second = cpu_seconds()
    elapsed = time.monotonic() - start
    usage = []
    for pid, (proc, cpu_s) in second.items():
        if pid in first:
            cores = (cpu_s - first[pid][1]) / elapsed
            if cores >= min_cores:
                usage.append((cores, pid, proc))
    busiest = []
    for cores, pid, proc in sorted(usage, key=lambda u: (u[0], u[1]), reverse=True)[:top]:
        name = proc.info["name"] or str(pid)
        try:
            command = " ".join(proc.cmdline()).strip() or name
        except psutil.Error:  # ended, or not ours to read
            command = name
        busiest.append(
            {"pid": pid, "name": name, "cores": round(cores, 2), "command": command[:120]}
        )
    return busiest


def load_record(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """A results JSON's ``machine_load``: the two snapshots, ``busy`` if either was, and the
    busy processes seen (each once, its larger CPU share kept)."""
    processes: dict[int, dict[str, Any]] = {}
    for snap in (before, after):
        for proc in snap.get("busy_processes") or []:
            seen = processes.get(proc["pid"])
            if seen is None or proc["cores"] > seen["cores"]:
                processes[proc["pid"]] = proc
    return {
        "before": before,
        "after": after,
        "busy": bool(before.get("busy") or after.get("busy")),
        "busy_processes": sorted(processes.values(), key=lambda p: -p["cores"]),
    }


def busy_warning(record: dict[str, Any] | None) -> str | None:
    """The one-line warning for a busy run, or None (also for files without the busy fields).

    Args:
        record: a ``machine_load`` as :func:`load_record` writes it; merged shard results keep
            theirs under ``shards``, resumed runs each segment's under ``segments``.
    """
    if not record:
        return None
    # Merged shards keep theirs under "shards" (n of them: n - 1 siblings ran beside each),
    # resumed segments under "segments".
    records, todo = [], [(record, 1)]
    while todo:
        r, shards = todo.pop(0)
        records.append((r, shards))
        below = r.get("shards") or []
        todo += [(s, max(shards, len(below))) for s in below]
        todo += [(s, shards) for s in r.get("segments") or []]
    busy = []
    for r, shards in records:
        for when in ("before", "after"):
            snap = r.get(when)
            if isinstance(snap, dict):
                threads, cores = int(snap.get("own_threads") or 1), snap.get("cpu_count")
                own = float(snap.get("own_load") or 0.0)
                allowance = _grown(sibling_load(shards, threads, cores), own, threads)
                siblings = max(float(snap.get("sibling_load") or 0.0), allowance)
                if _snapshot_busy(snap, siblings):
                    busy.append((when, snap, r, siblings))
    if not busy:
        return None
    _, worst, _, siblings = max(busy, key=lambda b: b[1].get("load_beyond_own", 0.0) - b[3])
    when = " and ".join(w for w in ("before", "after") if any(w == b[0] for b in busy))
    busy_records = {id(r): r for _, _, r, _ in busy}.values()
    procs = [p for r in busy_records for p in r.get("busy_processes") or []]
    seen: set[int] = set()
    names = []
    for p in sorted(procs, key=lambda p: -p["cores"]):
        if p["pid"] not in seen:
            seen.add(p["pid"])
            names.append(f"{p['name']} (pid {p['pid']}, {100 * p['cores']:.0f}% of a core)")
    return (
        f"warning: the machine was busy {when} the timed runs (1-min load average "
        f"{worst['loadavg_1m']:.2f} on {worst['cpu_count']} cores, {worst['load_beyond_own']:.2f} "
        f"beyond this run's own {worst['own_load']:.2f}"
        + (f" and its other shards' {siblings:.2f}" if siblings else "")
        + "): tok/s and speedups are "
        "unreliable, rerun on an idle machine"
        + (f"; other busy processes: {', '.join(names[:5])}" if names else "")
    )
