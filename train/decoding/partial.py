"""Resumable evaluations: each finished prompt's entries, appended to a file beside ``--out``.

A long ``draftsmith evaluate`` (a 200-prompt bench is hours on a small CPU) must not lose its
finished prompts to Ctrl-C, a ``--max-minutes`` budget or a killed session. While it runs,
``OUT.partial.jsonl`` holds:

* line 1, the header: ``{"format": "draftsmith-evaluate-partial", "version": 1, "settings":
  {...}, "methods": [...]}`` -- the run's settings (those that change a result) and the
  methods' names;
* one line per finished prompt: ``{"id": ..., "entries": [one per method]}``, each entry what
  :func:`~draftsmith.train.decoding.results.prompt_entry` wrote, raw counters included, so every
  figure can be recomputed from the file;
* one line per stopped segment: ``{"segment": {"prompts": n, "machine_load": {...}}}``.

Every line is flushed and fsync'ed as it is written. A rerun of the same command reads the
file, skips the prompts it holds and measures the rest; the finished results JSON covers all
of them and the partial file is removed. Settings that differ (another k, drafter, prompt
file, ...) are refused with one line naming them: rerun with ``--no-resume`` to start over.
A line cut short by a kill (the last one) is dropped and rewritten.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..runinfo import json_text

__all__ = ["FORMAT", "RESULT_IRRELEVANT", "PartialRun", "partial_path"]

FORMAT = "draftsmith-evaluate-partial"

#: Config fields that do not change a prompt's result: a resumed run may change them.
RESULT_IRRELEVANT = frozenset(
    {"max_minutes", "threads", "report_to", "wandb_project", "out", "merge", "resume", "config"}
)


def partial_path(out: Path) -> Path:
    """``OUT.partial.jsonl`` beside the results file ``OUT``."""
    return out.with_name(out.name + ".partial.jsonl")


class PartialRun:
    """The finished prompts of one evaluation, on disk beside its results file.

    Args:
        out: the results JSON the run writes (``--out``).
        settings: the run's config as a dict; fields in :data:`RESULT_IRRELEVANT` are ignored.
        methods: the names of the measured methods, in order.
    """

    def __init__(self, out: Path, settings: dict[str, Any], methods: list[str]):
        self.path = partial_path(Path(out))
        self.settings = {k: v for k, v in settings.items() if k not in RESULT_IRRELEVANT}
        self.methods = list(methods)
        self.segments: list[dict[str, Any]] = []

    def load(self, resume: bool) -> dict[str, list[dict[str, Any]]]:
        """The finished prompts (id -> one entry per method), and the file ready to append to.

        Args:
            resume: False: an existing file is discarded and the run starts over.

        Raises:
            UsageError: the file holds another run (settings or methods differ), or is not a
                partial file.
        """
        done: dict[str, list[dict[str, Any]]] = {}
        good = 0  # bytes of whole, parsed lines
        if resume and self.path.is_file():
            raw = self.path.read_bytes()
            lines = raw.split(b"\n")
            for n, line in enumerate(lines):
                if not line.strip():
                    good += len(line) + 1
                    continue
                try:
                    obj = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    if n == len(lines) - 1:  # the last line, cut short by a kill
                        break
                    raise UsageError(
                        f"{self.path}: line {n + 1} is not JSON; delete the file or rerun with "
                        "--no-resume"
                    ) from None
                if n == 0:
                    self._check_header(obj)
                elif "segment" in obj:
                    self.segments.append(obj["segment"])
                else:
                    done[str(obj["id"])] = obj["entries"]
                good += len(line) + 1
            good = min(good, len(raw))
            if good == 0:  # not even a header: start over
                self.path.unlink()
        elif self.path.exists():
            self.path.unlink()
        if good:
            with open(self.path, "r+b") as f:  # drop a torn last line before appending
                f.truncate(good)
                if not raw[:good].endswith(b"\n"):
                    f.seek(0, os.SEEK_END)
                    f.write(b"\n")
        else:
            header = {
                "format": FORMAT,
                "version": 1,
                "settings": self.settings,
                "methods": self.methods,
            }
            self._append(header)
        return done

    def _check_header(self, obj: Any) -> None:
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise UsageError(
                f"{self.path} is not a partial evaluation file; delete it or rerun with --no-resume"
            )
        saved = json.loads(json_text(obj.get("settings", {})))
        mine = json.loads(json_text(self.settings))  # the same JSON round trip as the file's
        diff = sorted(k for k in saved.keys() | mine.keys() if saved.get(k) != mine.get(k))
        if obj.get("methods") != self.methods:
            diff.append("drafter (methods " + ", ".join(obj.get("methods") or []) + ")")
        if diff:
            raise UsageError(
                f"{self.path} holds a run with other settings ({', '.join(diff)}); rerun with "
                "--no-resume to start over, or with the same settings to continue it"
            )

    def add(self, record_id: str, entries: list[dict[str, Any]]) -> None:
        """Record one finished prompt (one entry per method)."""
        self._append({"id": record_id, "entries": entries})

    def stop(self, prompts: int, machine_load: dict[str, Any]) -> None:
        """Record that this segment stopped after ``prompts`` new prompts, with its load."""
        segment = {"prompts": prompts, "machine_load": machine_load}
        self.segments.append(segment)
        self._append({"segment": segment})

    def finish(self) -> None:
        """Every prompt is done and the results file written: remove the partial file."""
        self.path.unlink(missing_ok=True)

    def _append(self, obj: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json_text(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())
