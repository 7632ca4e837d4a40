"""One checkpoint shape for every recipe: accelerate state + ``trainer_state.json``.

``output_dir/checkpoints/step_N/`` holds what ``accelerator.save_state`` writes (model,
optimizer, registered scheduler, every process's RNG state) and ``trainer_state.json``
(:class:`TrainerState`: step, data position, process count, the full train/validation history).
A checkpoint is written into ``.step_N.tmp`` and renamed when complete, so a ``step_N`` dir is
always whole; a kill during a save leaves only a temp dir, which is never read and is removed by
the next save. Loading tries the newest checkpoint and falls back to the previous one when it
cannot be read (truncated file, corrupt state), with a warning.

Under FSDP (``distributed_type: FSDP``) ``save_state`` writes the drafter and its optimizer as
sharded state dicts (``torch.distributed.checkpoint``: ``pytorch_model_fsdp_0/``,
``optimizer_0/``), each process its own shards, and ``load_state`` reads them back into the
same sharding; with DDP the main process writes one ``model.safetensors``. Either way every
process writes into the checkpoint directory (its RNG state at least), so a run over several
machines needs ``output_dir`` on a filesystem they all mount at the same path; a run checks
this when it starts (:func:`check_shared_output`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .. import safety
from ..errors import RunError, UsageError
from ..runinfo import finite_json
from ..staged import prepare_stage, replace_dir
from .dist import any_rank
from .stop import NonFiniteError, non_finite_parameters

STATE_FILE = "trainer_state.json"
CHECKPOINTS = "checkpoints"


@dataclass
class TrainerState:
    """What a checkpoint records besides the tensors.

    Attributes:
        recipe: ``eagle``, ``medusa`` or ``distill``.
        kind: the recipe's variant (``eagle3``, ``medusa2``, ...): a checkpoint of another kind
            is refused on resume.
        run_id: set when a run starts fresh, kept across resumes; rotation only deletes this
            run's checkpoints.
        step: optimizer steps done.
        epoch: the epoch in progress.
        batches: micro-batches of that epoch consumed by each process.
        num_processes: processes that wrote it (the data position is per process).
        train_log: every training log entry since the run started (resumes included).
        validation: every validation result (each with ``step`` and ``val/sim_tau``).
        best: ``{"step", "sim_tau"}`` of the best validation so far (its drafter is in
            ``output_dir/best``), or None.
        skipped_nonfinite: optimizer steps skipped for a non-finite loss/gradient.
        extra: recipe-specific values (e.g. distill's validation before training).
    """

    recipe: str
    kind: str
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    step: int = 0
    epoch: int = 0
    batches: int = 0
    num_processes: int = 1
    train_log: list[dict[str, Any]] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    skipped_nonfinite: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> TrainerState:
        """Read ``path/trainer_state.json``; unknown keys are ignored, missing ones defaulted."""
        data = json.loads((path / STATE_FILE).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("step"), int):
            raise ValueError(f"{path / STATE_FILE}: not a trainer state (no integer 'step')")
        known = {f.name for f in fields(cls)}
        data.setdefault("recipe", "?")
        data.setdefault("kind", data["recipe"])
        return cls(**{k: v for k, v in data.items() if k in known})


def finished_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints ``(step, path)`` of ``output_dir``, oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    found = []
    for p in root.glob("step_*") if root.is_dir() else []:
        if p.is_dir() and p.name[5:].isdigit() and (p / STATE_FILE).is_file():
            found.append((int(p.name[5:]), p))
    return sorted(found)


def checkpoint_bytes(
    models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> int:
    """Estimated size of a checkpoint: the prepared models' state dicts + optimizer states.

    AdamW keeps two tensors per trainable parameter; RNG states and the JSON are small.

    Args:
        models: the models ``accelerator.prepare`` returned (what ``save_state`` writes;
            :attr:`~draftsmith.train.core.run.TrainRun.models`).
        optimizers: the optimizers it returned.
    """
    total = 1 << 20
    for model in models:
        total += sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for opt in optimizers:
        for group in opt.param_groups:
            total += sum(2 * p.numel() * p.element_size() for p in group["params"])
    return total


def _fail(exc: BaseException, path: Path, need: int) -> BaseException:
    """The error to report for a failed write: a DiskSpaceError when the disk filled up."""
    if safety.disk_full(exc):
        return safety.DiskSpaceError(path, need)
    return exc


def save_checkpoint(
    accelerator: Any,
    output_dir: Path,
    state: TrainerState,
    keep: int,
    *,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
) -> Path:
    """Write ``checkpoints/step_{state.step}`` (temp dir + rename), then rotate old ones.

    Free space is checked first against :func:`checkpoint_bytes`; a save that fails anyway
    removes its temp dir and keeps every earlier checkpoint. Rotation keeps the newest ``keep``
    checkpoints and only deletes this run's (``run_id``) older ones. All processes call this.

    Args:
        accelerator: the run's accelerator (``save_state`` writes everything it prepared).
        output_dir: the run's output directory.
        state: what ``trainer_state.json`` records; ``state.step`` names the checkpoint.
        keep: newest checkpoints kept.
        models: the prepared models (checked for NaN/inf, sized for the free-space check).
        optimizers: the prepared optimizers (sized for the free-space check).

    Raises:
        NonFiniteError: a parameter holds NaN/inf (a NaN checkpoint is never written).
        DiskSpaceError: not enough space, before or during the write.
    """
    root = Path(output_dir) / CHECKPOINTS
    final, tmp = root / f"step_{state.step}", root / f".step_{state.step}.tmp"
    need = checkpoint_bytes(models, optimizers)
    bad = [n for m in models for n in non_finite_parameters(m)]
    if bad:
        raise NonFiniteError(
            f"step {state.step}: parameter {bad[0]} is not finite; no checkpoint written"
        )
    error: BaseException | None = None
    if accelerator.is_main_process:
        try:
            # A fixed temp dir (at=), not staged_dir's per-writer one: every process, on every
            # machine, writes its part into it and must find it without being told. A killed
            # save's leftover is removed here, by the next save.
            prepare_stage(final, overwrite=True, need_bytes=need, at=tmp)
        except Exception as exc:
            error = exc
    if not any_rank([error is not None], accelerator.device)[0]:
        try:
            accelerator.save_state(str(tmp))
            if accelerator.is_main_process:
                data = finite_json(asdict(state))
                (tmp / STATE_FILE).write_text(json.dumps(data, indent=1, allow_nan=False))
        except Exception as exc:
            error = exc
    failed = any_rank([error is not None], accelerator.device)[0]
    if accelerator.is_main_process:
        # The rename waits for every process's verdict (any_rank), so this is staged_dir's
        # second half by hand: remove on failure, else replace a same-step leftover of a killed
        # run (one a resume fell back past) and rename.
        if failed:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            replace_dir(tmp, final, overwrite=True)
            _rotate(root.parent, keep, state.run_id)
    if failed:
        if error is None:
            raise RunError(f"saving {final} failed in another process")
        raise _fail(error, root, need) from error
    return final


def check_shared_output(accelerator: Any, output_dir: Path) -> None:
    """Refuse to start when the processes do not all write into the same ``output_dir``.

    Each process writes a probe file; the main process must see all of them. All processes
    call this (after the main one created the directory); one process: nothing to check.

    Raises:
        UsageError: a process's probe is missing (another machine with its own disk at that
            path): its checkpoint shards and RNG state would be lost at the first save.
    """
    n, rank = accelerator.num_processes, accelerator.process_index
    if n == 1:
        return
    root = Path(output_dir)
    mine = root / f".shared-check.rank{rank}"
    failed = False
    try:
        root.mkdir(parents=True, exist_ok=True)
        mine.write_text(str(os.getpid()))
    except OSError:
        failed = True
    missing: list[int] = []
    if not any_rank([failed], accelerator.device)[0] and accelerator.is_main_process:
        missing = [i for i in range(n) if not (root / f".shared-check.rank{i}").is_file()]
    bad = any_rank([failed or bool(missing)], accelerator.device)[0]
    mine.unlink(missing_ok=True)
    if bad:
        who = f"process(es) {missing} wrote" if missing else "a process could not write"
        raise UsageError(
            f"output_dir: {root} is not one directory shared by all {n} processes ({who} "
            "their probe file elsewhere): put it on a filesystem every machine mounts at the "
            "same path -- every process writes its checkpoint shards and RNG state there"
        )


def _rotate(output_dir: Path, keep: int, run_id: str) -> None:
    done = finished_checkpoints(output_dir)
    for _, old in done[:-keep]:
        try:
            owner = TrainerState.read(old).run_id
        except (OSError, ValueError, TypeError):
            continue  # unreadable: not provably ours, leave it
        if owner == run_id:
            shutil.rmtree(old, ignore_errors=True)


def load_latest(
    accelerator: Any, output_dir: Path, *, recipe: str, kind: str, say: Any = print
) -> tuple[TrainerState, Path] | None:
    """Load the newest readable checkpoint into the prepared objects; None when there is none.

    A checkpoint that cannot be read is reported and the previous one tried.

    Raises:
        UsageError: the checkpoints belong to another recipe/kind, or were written by another
            number of processes (the data position is per process).
        RunError: checkpoints exist but none can be read.
    """
    found = finished_checkpoints(output_dir)
    first_error = None
    for _, path in reversed(found):
        try:
            state = TrainerState.read(path)
        except (OSError, ValueError, TypeError) as exc:
            say(f"warning: {path} is unreadable ({exc}); trying the previous checkpoint")
            first_error = first_error or exc
            continue
        if state.recipe not in ("?", recipe) or state.kind not in (state.recipe, kind):
            raise UsageError(
                f"{path} is a {state.kind} checkpoint, this is a {kind} run: choose another "
                "output_dir, or start over with --no-resume --overwrite"
            )
        if state.num_processes != accelerator.num_processes:
            raise UsageError(
                f"{path} was written by {state.num_processes} process(es), this run has "
                f"{accelerator.num_processes}: resume with {state.num_processes} (the data "
                "position is per process), or start over with --no-resume --overwrite"
            )
        ok, error = True, None
        try:
            accelerator.load_state(str(path))
        except Exception as exc:  # truncated/corrupt files raise many kinds of errors
            ok, error = False, exc
        if all(not bad for bad in any_rank([not ok], accelerator.device)):
            return state, path
        say(f"warning: {path} cannot be loaded ({error}); trying the previous checkpoint")
        first_error = first_error or error
    if found:
        raise RunError(
            f"no checkpoint in {Path(output_dir) / CHECKPOINTS} can be loaded (newest: "
            f"{first_error}); start over with --no-resume --overwrite"
        )
    return None
