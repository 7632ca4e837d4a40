"""A job of stages, each one ``draftsmith`` command run in this process: skipped when done, resumed
when cut short.

A :class:`StageJob` runs the :class:`Stage` s a recipe builds, in order, through the command
dispatch the recipe gives it (the CLI's ``main``: the command a stage prints is exactly what
reruns it alone, and this library never imports the recipes). Its state is one JSON file in the
output directory: per stage a key, the status, the command and the wall time (all invocations).

**Resume**: a rerun skips every stage whose output is complete (the stage's own marker, always
asked of the output: a ``.meta`` file, a ``manifest.json``, ...) and whose key is unchanged. The
key hashes the stage's settings and inputs, chained through the earlier stages' keys, so a change
reruns that stage and every later one. A stage killed midway is rerun and its command continues
its own output. Whether a rerun continues or starts over: a stage with a ``strict`` part of its
settings continues (extends its output) while only the rest changed, e.g. a larger count, also
over an earlier stage's extended output; any other change adds its ``restart`` flags. A stage
whose inputs are none of the earlier stages' outputs (``chained=False``: the quickstart's
validation answers) is keyed on its own settings alone, so a change before it does not rerun
it; the stages after it are keyed on it and on everything before it.
"""

from __future__ import annotations

import gc
import hashlib
import json
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import RunError, UsageError
from ..report.text import minutes
from ..runinfo import run_info
from ..staged import write_json_atomic

__all__ = [
    "Stage",
    "StageInterrupted",
    "StageJob",
    "count_lines",
    "dataset_tokens",
    "file_hash",
    "flags",
    "hash_parts",
    "read_json",
    "read_meta",
    "relative_path",
]


@dataclass
class Stage:
    """One stage: the command it runs and how to tell it is done.

    Attributes:
        name: key in the job's state file.
        title: the header's words ("self-distil 300 prompts").
        argv: ``draftsmith`` arguments that run (or resume) it.
        output: its output path (shown, and checked by ``complete``).
        complete: whether the output is complete (the stage's own marker).
        identity: what the output depends on besides earlier stages; a change reruns it.
        strict: the part of ``identity`` whose change means starting over; the rest (a larger
            count) lets the stage extend its output, also over an extended earlier output.
            None: any change, here or in an earlier stage, starts it over.
        restart: flags that make the command start over instead of resuming.
        accept: decides whether a non-zero exit still completed the stage (Magpie running out
            of attempts); returns a note for the state, or None.
        after: runs after a successful command; returns facts for the state.
        estimate_s: the header's estimate.
        skip: why the stage has nothing to do in this job (the quickstart's sampled answers
            when it plans none): then it is not run, only marked done. None: it runs.
        chained: whether its key (and ``strict``) chain through the earlier stages' keys.
            False: its output depends on none of theirs, so ``identity`` names every input
            it has (the target, its input file's hash, ...) and a change before it leaves it
            done; the stages after it chain through its key and the earlier ones' alike.
    """

    name: str
    title: str
    argv: list[str]
    output: Path
    complete: Callable[[], bool]
    identity: dict[str, Any]
    strict: dict[str, Any] | None = None
    restart: tuple[str, ...] = ()
    accept: Callable[[int], dict[str, Any] | None] | None = None
    after: Callable[[], dict[str, Any]] | None = None
    estimate_s: float = 0.0
    skip: str | None = None
    chained: bool = True


class StageInterrupted(Exception):
    """A stage stopped on Ctrl-C/SIGTERM (its output is resumable)."""


class StageJob:
    """One invocation of a job: runs or skips each stage it is given and keeps the state file.

    A recipe subclasses it, builds each stage when it is reached (a stage's size may follow from
    what the earlier ones made) and passes it to :meth:`run_stage`, after :meth:`_load_state`.
    The underscored methods are for those subclasses.

    Args:
        out: the output directory; holds the state file.
        name: the job's name in messages ("rerun the quickstart ...").
        command: the command line that reruns the whole job.
        call: runs ``draftsmith ARGV`` in this process and returns its exit code.
        stage_names: every stage's name, in job order.
        state_file: the state file's name in ``out``.
        state_format: the state's ``format``; a file of another format is not read.
        state_version: the state's ``version``.
        console: a rich console that progress is printed to.
    """

    def __init__(
        self,
        out: Path,
        *,
        name: str,
        command: str,
        call: Callable[[list[str]], int],
        stage_names: Sequence[str],
        state_file: str,
        state_format: str,
        state_version: int,
        console: Any,
    ) -> None:
        self.out = Path(out)
        self.name = name
        self.command = command
        self.call = call
        self.stage_names = tuple(stage_names)
        self.state_file = state_file
        self.state_format = state_format
        self.state_version = state_version
        self.console = console
        self.state: dict[str, Any] = {}
        self.prev_key = self.prev_strict = ""
        self.this_run: dict[str, str] = {}
        #: Seconds each stage ran in this process, every time it ran.
        self.seconds_this_run: dict[str, float] = {}

    # --- state ------------------------------------------------------------------------------

    def _load_state(self) -> None:
        path = self.out / self.state_file
        state: dict[str, Any] = {}
        if path.is_file():
            try:
                state = json.loads(path.read_text())
            except ValueError:
                state = {}  # unreadable: every stage checks its own output again
            if state.get("format") != self.state_format:
                state = {}
        state.setdefault("format", self.state_format)
        state.setdefault("version", self.state_version)
        state.setdefault("stages", {})
        state.setdefault("invocations", [])
        self.state = state

    def _save_state(self) -> None:
        stages = self.state["stages"]
        self.state["total_seconds"] = round(sum(s.get("seconds", 0.0) for s in stages.values()), 1)
        write_json_atomic(self.out / self.state_file, self.state)

    def _spent_s(self, before: str | None = None) -> float:
        """Seconds spent on the outputs in use (all invocations), of the stages before
        ``before`` in job order (all stages when None)."""
        stages = self.state["stages"]
        names = self.stage_names
        names = names[: names.index(before)] if before else names
        return sum(stages.get(name, {}).get("seconds", 0.0) for name in names)

    def _remove_outputs(self, owned: Sequence[str]) -> None:
        """``--overwrite``: delete the job's outputs ``owned`` (and nothing else) in ``out``.

        Raises:
            UsageError: ``out`` holds some of them but no state file: not this job's files.
        """
        if not (self.out / self.state_file).is_file() and any(
            (self.out / name).exists() for name in owned
        ):
            raise UsageError(
                f"overwrite: {self.out} has no {self.state_file}, so its files are not a "
                f"{self.name}'s; choose another --out-dir"
            )
        for name in owned:
            path = self.out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def _record_invocation(self, config: dict[str, Any]) -> None:
        """Note this invocation in the state: what ran it (command, versions, commit, machine,
        date), the job's command (``<name>_command``) and its config."""
        info = run_info()
        self.state.update(
            {k: info[k] for k in ("command", "versions", "git_commit", "machine", "date")}
        )
        self.state[f"{self.name}_command"] = self.command
        self.state["config"] = config
        self.state["invocations"].append({"date": info["date"], "command": self.command})

    # --- running the stages -------------------------------------------------------------------

    def _run_stages(self, builders: Sequence[Callable[[], Stage]], start: int = 1) -> bool:
        """Build each stage when it is reached and run (or skip) it, in order.

        Args:
            builders: one per stage, called when the stage is reached.
            start: the first one's number in the job (a job that does something between its
                stages runs them in several calls: ``[1/9]``, then from ``[2/9]``).

        Returns:
            False when a stage was interrupted (the state is saved, and how to resume printed).
        """
        try:
            for index, build in enumerate(builders, start=start):
                self.run_stage(index, build())
        except StageInterrupted as exc:
            self._save_state()
            print(
                f"\nstopped during {exc}; its output is kept and resumes: {self.command}",
                file=sys.stderr,
            )
            return False
        return True

    def run_stage(self, index: int, stage: Stage) -> None:
        """Skip ``stage`` if its output is complete and unchanged; else run (or resume) it.

        Raises:
            StageInterrupted: stopped by Ctrl-C/SIGTERM; the state records it.
            UsageError: the command exited 2 (bad input); RunError: any other failure.
        """
        rec = self.state["stages"].setdefault(stage.name, {})
        prev_key, prev_strict = (self.prev_key, self.prev_strict) if stage.chained else ("", "")
        key = hash_parts(stage.name, stage.identity, prev_key)
        # A stage that can extend its output (strict given) may continue over an earlier stage's
        # extended output; any other stage starts over when anything before it changed.
        if stage.strict is None:
            strict = hash_parts(stage.name, stage.identity, key)
        else:
            strict = hash_parts(stage.name, stage.strict, prev_strict)
        if stage.chained:
            self.prev_key, self.prev_strict = key, strict
        else:  # the later stages depend on this one and on everything before it
            self.prev_key = hash_parts(self.prev_key, key)
            self.prev_strict = hash_parts(self.prev_strict, strict)
        header = f"[{index}/{len(self.stage_names)}] {stage.title}"
        if stage.skip is not None:
            self._say(f"{header}: {stage.skip}", "dim")
            rec.clear()
            rec.update(
                status="done", key=key, strict=strict, skipped=stage.skip, seconds=0.0, runs=0
            )
            self.this_run[stage.name] = "skipped"
            self._save_state()
            return
        if rec.get("status") == "done" and rec.get("key") == key and stage.complete():
            self._say(f"{header}: done before, skipped ({relative_path(stage.output)})", "dim")
            self.this_run[stage.name] = "skipped"
            return
        # Same settings as the output on disk (or no record of it): the stage continues its own
        # output. Other settings: it starts over.
        restart = bool(rec.get("strict")) and rec.get("strict") != strict
        argv = stage.argv + (list(stage.restart) if restart else [])
        resume_cmd = shlex.join(["draftsmith", *stage.argv])
        self._say(f"{header} (est. {minutes(stage.estimate_s)})", style="bold")
        self._say(f"      $ {shlex.join(['draftsmith', *argv])}", style="dim")
        rec.update(
            status="running",
            key=key,
            strict=strict,
            command=resume_cmd,
            output=relative_path(stage.output),
            started=_utc_now(),
            estimate_s=round(stage.estimate_s, 1),
        )
        rec.pop("error", None)
        if restart:
            rec["seconds"] = 0.0  # a new output: the old one's time no longer counts
        self._save_state()
        self.this_run[stage.name] = "ran"
        _fresh_accelerate_state()
        start = time.monotonic()
        try:
            code = self.call(argv)
        except KeyboardInterrupt:
            self._finish(stage.name, rec, start, "interrupted")
            raise StageInterrupted(header) from None
        except BaseException as exc:
            self._finish(stage.name, rec, start, "failed", error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            gc.collect()  # each stage loads its own target: free the last one first
        if code == 130:  # the command caught Ctrl-C/SIGTERM itself and kept its output
            self._finish(stage.name, rec, start, "interrupted")
            raise StageInterrupted(header)
        note = stage.accept(code) if (code and stage.accept is not None) else None
        if code and note is None:
            self._finish(stage.name, rec, start, "failed", error=f"exit code {code}")
            kind = UsageError if code == 2 else RunError
            raise kind(
                f"stage {header} failed (exit {code}; its error is above). Rerun only this "
                f"stage with: {resume_cmd} -- or rerun the {self.name} to continue from it: "
                f"{self.command}"
            )
        if stage.after is not None:
            note = {**(note or {}), **stage.after()}
        if not stage.complete():
            # A command may return 0 after Ctrl-C with its output resumable but not complete
            # (a training recipe with a checkpoint but no drafter/).
            self._finish(stage.name, rec, start, "interrupted")
            raise StageInterrupted(header)
        self._finish(stage.name, rec, start, "done", **(note or {}))

    def _finish(
        self, name: str, rec: dict[str, Any], start: float, status: str, **extra: Any
    ) -> None:
        seconds = time.monotonic() - start
        # Summed, not replaced: a stage may run twice in one job (the quickstart growing its data).
        self.seconds_this_run[name] = self.seconds_this_run.get(name, 0.0) + seconds
        rec["status"] = status
        rec["finished"] = _utc_now()
        rec["last_seconds"] = round(seconds, 1)
        rec["seconds"] = round(rec.get("seconds", 0.0) + seconds, 1)
        rec["runs"] = rec.get("runs", 0) + 1
        rec.update(extra)
        self._save_state()

    def _say(self, text: str, style: str | None = None) -> None:
        from rich.markup import escape

        # soft_wrap: a command line stays one line (copyable from a log), however long.
        self.console.print(f"[{style}]{escape(text)}[/]" if style else escape(text), soft_wrap=True)
        sys.stdout.flush()


def _fresh_accelerate_state() -> None:
    """Forget accelerate's process-wide state between in-process stages.

    A hidden-state cache builds a ``PartialState`` and a recipe an ``Accelerator`` with bf16
    mixed precision; accelerate keeps both for the life of the process and refuses an Accelerator
    whose settings differ from an earlier one (the conftest does the same between tests).
    """
    from ..core.accelerate_compat import reset_accelerate_state

    reset_accelerate_state()


# --------------------------------------------------------------------------------------------
# What stages are built from: flags, keys, and what their outputs hold
# --------------------------------------------------------------------------------------------


def flags(**values: Any) -> list[str]:
    """``--name value`` pairs (None skipped, True -> ``--name``, False -> ``--no-name``)."""
    out: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def hash_parts(*parts: Any) -> str:
    """A short key of JSON-able ``parts`` (dict order does not matter)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_hash(path: Path) -> str:
    """A short key of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file (``{}`` when missing, unreadable or not an object)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_meta(path: Path) -> dict[str, Any]:
    """The ``<path>.meta`` a data command writes (``{}`` when missing or unreadable)."""
    try:
        return json.loads(path.with_name(path.name + ".meta").read_text())
    except (OSError, ValueError):
        return {}


def count_lines(path: Path, containing: str | None = None) -> int:
    """Non-blank lines of a file (0 when it cannot be read); only those holding ``containing``
    when given."""
    needle = containing.encode() if containing is not None else None
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip() and (needle is None or needle in line))
    except OSError:
        return 0


def dataset_tokens(path: Path) -> int:
    """Tokens in a tokenized dataset directory (0 when it cannot be read)."""
    try:
        from datasets import load_from_disk

        data = load_from_disk(str(path))
        return int(sum(len(ids) for ids in data["input_ids"]))
    except Exception:  # not there yet, or unreadable: the stage that reads it reports it
        return 0


def relative_path(path: Path) -> str:
    """``path`` relative to the working directory when below it (shorter commands)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
