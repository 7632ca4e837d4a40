"""One training run's plumbing, the same for every recipe: :class:`TrainRun`.

A recipe builds its target, drafter, data and optimizer and writes its own loop; the run object
holds what the loop shares with every other recipe::

    with TrainRun(cfg, recipe="eagle", kind="eagle3", outputs=["drafter"]) as run:
        accelerator = run.accelerator
        target, tokenizer = run.load_target(cfg.target, dtype=dtype)  # FSDP: layers on meta
        target = run.place_target(target)     # on the device; sharded (own rows read) under FSDP
        ...                                   # data, drafter, optimizer, run.prepare(...)
        run.resume()                          # newest good checkpoint -> run.state, run.position
        step = run.state.step
        while not run.finished(step, total):
            for batch in run.position.batches_of_epoch(accelerator, loader):
                with accelerator.accumulate(model):
                    loss = ...
                    accelerator.backward(loss)
                run.watch(loss)                   # a device flag: no host sync
                window += loss.detach()           # metrics stay on the device too
                if not accelerator.sync_gradients:
                    continue
                grad_norm = accelerator.clip_grad_norm_(params, max_norm)
                if run.step_ok(step + 1, grad_norm):   # all ranks agree; NaN: raise or skip
                    optimizer.step(); scheduler.step()
                optimizer.zero_grad()
                ...                               # read window once per log_every steps
                if run.finished(step, total): break
        run.save_checkpoint(step)                 # and the recipe's final outputs

On a GPU nothing in a micro-batch waits for the device: the loss's finiteness is a flag on the
device, metrics are summed there, and :meth:`TrainRun.step_ok` folds the flag and the gradient
norm's finiteness into the all-reduce it makes anyway, whose one read is the host sync of the
optimizer step.

Leaving the ``with`` block tears the processes down (barrier, ``destroy_process_group``),
restores the signal handlers and releases the output lock, also after an error.

Under an FSDP accelerate config (``recipes/accelerate/fsdp_*.yaml``, recipes that pass
``fsdp=True``) the drafter is sharded by accelerate's FSDP2 plugin, the frozen target by
:meth:`TrainRun.place_target`, and trained models are saved through :meth:`TrainRun.full_model`;
docs/scaling.md has the whole picture.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import safety
from ..config import config_to_dict, dump_config
from ..device import allow_tf32, auto_dtype, is_cpu, resolve_device, restore_tf32
from ..errors import RunError, UsageError
from ..runinfo import finite_json
from . import checkpoint as ckpt
from .config import TrainConfig
from .data import DataPosition, check_inputs
from .dist import (
    RankTimeoutError,
    any_rank,
    broadcast_int,
    broadcast_module,
    full_state_dict,
    keep_alive,
    setup_fsdp,
    shard_frozen_target,
    start_processes,
    teardown,
    wait_for_ranks,
)
from .schedule import FIT_EVERY_SHARE, FIT_MIN_STEPS, damped, fitted_total, refit
from .stop import NonFiniteError, StopSignals, check_finite

BEST = "best"


class TrainRun:
    """Process group, accelerator, output ownership, resume, stop verdicts, best drafter.

    Args:
        cfg: the recipe's config (a :class:`TrainConfig`).
        recipe: ``eagle``, ``medusa`` or ``distill`` (recorded in checkpoints).
        kind: the variant (``eagle3``, ``medusa1``, ...); checkpoints of another kind are refused.
        outputs: the recipe's final outputs under ``output_dir`` (deleted by ``overwrite``, and
            their presence means the dir holds a run).
        find_unused_parameters: DDP option (Medusa-2's warm-up leaves the adapters unused).
        fsdp: the recipe runs under an FSDP config (``distributed_type: FSDP``): it places its
            frozen target with :meth:`place_target` (sharded) and saves trained models through
            :meth:`full_model` (gathered). Other recipes refuse such a launch.

    The run's device is accelerate's (``accelerator.device``): ``cfg.device`` ``auto`` lets
    the launcher decide, ``cpu`` forces CPU processes, ``cuda``/``cuda:N`` is checked against
    what the launcher gave. ``cfg.threads`` applies to CPU runs only.

    Raises:
        UsageError: an input the config names (``cfg.input_paths()``) does not exist; the
            message names the field, the path and the command that makes it. An FSDP launch
            of a recipe without ``fsdp``, or with FSDP version 1. A ``device`` this machine
            does not have, or other than the one the launcher gave the process.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        recipe: str,
        kind: str,
        outputs: Sequence[str],
        find_unused_parameters: bool = False,
        fsdp: bool | str = False,
    ) -> None:
        from accelerate import Accelerator
        from accelerate.utils import (
            DataLoaderConfiguration,
            DistributedDataParallelKwargs,
            ProjectConfiguration,
            set_seed,
        )

        # Missing inputs first: one line saying what makes them, before any process group,
        # lock or output directory exists.
        check_inputs({**cfg.input_paths(), "val_data": cfg.val_data})
        self.started = time.monotonic()
        self.cfg = cfg
        self.recipe, self.kind = recipe, kind
        self.out = Path(cfg.output_dir)
        self.outputs = [*outputs, ckpt.CHECKPOINTS, BEST]
        if cfg.device not in ("auto", "cpu"):
            resolve_device(cfg.device)  # a GPU this machine lacks: one line, before any group
        # The process group first, with the configured timeout (the Accelerator reuses it).
        state = start_processes(cfg.pg_timeout_minutes, cpu=cfg.device == "cpu")
        problem = device_mismatch(cfg.device, state.device)
        if any_rank([problem is not None], state.device)[0]:  # every rank raises; none waits
            teardown(None, ok=False)
            raise UsageError(problem or f"device: {cfg.device} does not match another process's")
        on_cpu = is_cpu(state.device)
        if cfg.threads and on_cpu:
            torch.set_num_threads(cfg.threads)
        # On a GPU, batches are copied from pinned memory without waiting for the device
        # (recipes build their loaders with pin_memory=run.pin_memory).
        self.pin_memory = state.device.type == "cuda"
        # auto: bf16 autocast only where bf16 is native (an AVX2-only CPU emulates it, ~7x
        # slower than fp32); resolved once, so the dumped config says what ran.
        cfg.mixed_precision = auto_dtype(cfg.mixed_precision, state.device, fast="bf16", slow="no")
        self.accelerator = Accelerator(
            cpu=on_cpu,
            gradient_accumulation_steps=cfg.grad_accum,
            mixed_precision=cfg.mixed_precision,
            log_with="wandb" if cfg.report_to == "wandb" else None,
            project_config=ProjectConfiguration(project_dir=str(self.out)),
            # Seeded sampler: a resumed run sees the same order of batches as an unbroken one.
            dataloader_config=DataLoaderConfiguration(
                use_seedable_sampler=True, non_blocking=self.pin_memory
            ),
            kwargs_handlers=[
                DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters)
            ],
        )
        if cfg.threads and not on_cpu:
            self.accelerator.print(
                f"note: threads is for CPU runs; this one runs on {state.device}"
            )
        # An FSDP config: accelerate shards the prepared drafter, place_target the frozen target.
        try:
            self._target_layers = setup_fsdp(self.accelerator)
            self.fsdp = self._target_layers is not None
            if self.fsdp and fsdp is not True:
                what = fsdp if isinstance(fsdp, str) else f"the {recipe} recipe"
                raise UsageError(
                    f"{what} does not run under FSDP (distributed_type: FSDP in the "
                    "accelerate config): launch it with a DDP config (recipes/accelerate/"
                    "cpu_2proc.yaml, multi_gpu.yaml)"
                )
        except UsageError:
            teardown(self.accelerator, ok=False)  # every rank raises the same; none waits
            raise
        self._plain: dict[int, torch.nn.Module] = {}  # FSDP: meta copies for full_model
        set_seed(cfg.seed)
        self.is_main = self.accelerator.is_main_process
        self.multi = self.accelerator.num_processes > 1
        self.say = self.accelerator.print
        self.state = ckpt.TrainerState(recipe, kind, num_processes=self.accelerator.num_processes)
        self.position = DataPosition()
        self.resumed_from: int | None = None
        self.stop_reason: str | None = None
        self.signals = StopSignals()
        self._lock: safety.OutputLock | None = None
        self._nonfinite: torch.Tensor | None = None  # on the device: no sync per micro-batch
        self._invocation_start = 0
        self._saved: tuple[int, int] | None = None  # (step, validations) of the last save
        self._prepared: list[Any] = []
        # fit_schedule: where this invocation's timing starts (step, clock, validation seconds),
        # each validation's wall time, and the validations already fitted on.
        self._fit_from: tuple[int, float, float] | None = None
        self._val_started: float | None = None
        self._val_seconds: list[float] = []
        self._fit_validations = 0
        self._fit_every = FIT_MIN_STEPS
        self._tf32_before: tuple[bool, bool] | None = None  # set by __enter__ on CUDA
        self.tf32 = False

    # --- setup and teardown -----------------------------------------------------------------

    def __enter__(self) -> TrainRun:
        # CUDA: fp32 matmuls on TF32 tensor cores for the run (device.allow_tf32), put back
        # by __exit__ (the quickstart evaluates in the same process, where fp32 means exact).
        self._tf32_before = allow_tf32(self.accelerator.device)
        self.tf32 = self._tf32_before is not None
        try:
            self.on_main(self._claim_output, "claiming the output directory")
            ckpt.check_shared_output(self.accelerator, self.out)
        except BaseException as exc:
            self.__exit__(type(exc), exc, None)
            raise
        self.signals.install()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.signals.restore()
        ok = exc is None
        if self.multi:
            keep_alive(self._prepared)  # gloo: DDP wrappers must outlive the process (dist.py)
        try:
            # Trackers before the processes end, on success and failure alike: a gloo worker
            # ends with os._exit, which runs no exit hook that would finish a W&B run.
            self._finish_trackers(ok)
            teardown(self.accelerator, ok)
        finally:
            restore_tf32(self._tf32_before)
            self._tf32_before = None
            if self._lock is not None:
                self._lock.release()
        timed_out = isinstance(exc, RankTimeoutError)  # its own message names its setting
        if exc is not None and self.multi and not timed_out and _collective_failed(exc):
            raise RunError(
                f"another process of this run stopped answering or died ({exc}); a collective "
                f"waits at most pg_timeout_minutes ({self.cfg.pg_timeout_minutes:g})"
            ) from exc

    def _finish_trackers(self, ok: bool) -> None:
        """Finish the experiment trackers (what ``end_training`` does, without its teardown).

        A failed run's W&B run is marked failed (exit code 1), not finished; a tracker that
        cannot finish is reported, and the teardown goes on.
        """
        for tracker in self.accelerator.trackers:
            try:
                if not ok and tracker.name == "wandb":
                    tracker.tracker.finish(exit_code=1)
                else:
                    tracker.finish()
            except Exception as error:
                self.say(f"warning: the {tracker.name} tracker did not finish: {error}")

    def _claim_output(self) -> None:
        """Lock ``output_dir``; refuse to start over a run in it unless ``overwrite``."""
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock = safety.OutputLock(self.out, what="training run").acquire()
        checkpoints = ckpt.finished_checkpoints(self.out)
        outputs = [n for n in self.outputs if (self.out / n).exists()]
        if self.cfg.overwrite:
            for name in outputs:
                target = self.out / name
                shutil.rmtree(target) if target.is_dir() else target.unlink()
            return
        # What shows a run was here: a finished checkpoint or a final output. A run killed before
        # its first checkpoint (only temp dirs, maybe best/) is simply started again.
        held = [n for n in outputs if n not in (ckpt.CHECKPOINTS, BEST)]
        held += [ckpt.CHECKPOINTS] if checkpoints else []
        if held and not (self.cfg.resume and checkpoints):
            why = "resume is off" if not self.cfg.resume else "it has no checkpoint to resume"
            raise UsageError(
                f"{self.out} already holds a {self.recipe} run ({', '.join(held)}) and "
                f"{why}: set resume to continue it, choose another output_dir, or pass "
                "--no-resume --overwrite to start over (deletes it)"
            )

    def on_main(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on the main process; if it fails, every process raises (none hangs)."""
        error: BaseException | None = None
        result = None
        if self.is_main:
            try:
                result = fn()
            except Exception as exc:
                error = exc
        if any_rank([error is not None], self.accelerator.device)[0]:
            if error is not None:
                raise error
            raise RunError(f"{what} failed in the main process (see its message)")
        return result

    def load_target(
        self, source: str | Path | None, *, whole_layers: Sequence[int] = (), **kwargs: Any
    ) -> tuple[Any, Any]:
        """The frozen target and its tokenizer, for :meth:`place_target`.

        Without FSDP: :func:`~draftsmith.train.target_model.load.load_target`, the whole
        target. Under FSDP: the target with its decoder layers on the meta device
        (:func:`~draftsmith.train.target_model.load.load_target_meta`); :meth:`place_target`
        shards them and reads this process's rows of each weight only, so a machine holds about
        one copy of the target (plus the embedding and head, whole in every process). A target
        that cannot be read shard by shard (no safetensors files, quantized or converted
        weights) is loaded whole by every process, as without FSDP, with a one-line note.

        Args:
            source: the target (see ``prepare_target``).
            whole_layers: under FSDP, decoder layers loaded whole before sharding (a draft
                copies them from the target before :meth:`place_target`).
            **kwargs: ``cache_dir``, ``dtype``, ``quiet`` (see ``load_target``).
        """
        from ..target_model.load import NotShardable, load_target, load_target_meta

        if self.fsdp:
            try:
                return load_target_meta(source, whole_layers=whole_layers, **kwargs)
            except NotShardable as why:
                self.say(f"note: every process loads the whole target before sharding it ({why})")
        return load_target(source, **kwargs)

    def place_target(self, target: torch.nn.Module) -> torch.nn.Module:
        """Put the frozen target on this process's device: whole, or sharded under FSDP.

        FSDP: each decoder layer is sharded over the processes (see
        :func:`~draftsmith.train.core.dist.shard_frozen_target`); its embedding and output head
        stay whole. A target from :meth:`load_target` whose layers are still on the meta device
        gets only this process's rows of each weight, read from its files. Call it before
        :meth:`prepare` and never prepare the target: it is not trained and not checkpointed.

        With several processes, every process then waits until all have placed the target, at
        most ``load_timeout_minutes`` (loading is where they differ most: a slower disk),
        instead of the first collective after it failing after ``pg_timeout_minutes``.

        Raises:
            RankTimeoutError: a process had not finished loading within
                ``load_timeout_minutes``; the message names it and the setting.
        """
        if self.fsdp:
            from ..target_model.load import fill_target_shards

            layers = self._target_layers
            target = shard_frozen_target(self.accelerator, target, layers, fill=fill_target_shards)
        else:
            target = target.to(self.accelerator.device)
        wait_for_ranks("loading the target", self.cfg.load_timeout_minutes, "load_timeout_minutes")
        return target

    def prepare(self, *objects: Any) -> Any:
        """``accelerator.prepare``, remembering the wrapped objects (DDP models) for teardown.

        Under FSDP (one model per call, with its optimizer) every rank's model first gets rank
        0's weights, and the main process keeps a copy of it on the meta device, which
        :meth:`full_model` fills to save it.
        """
        for obj in objects:
            if self.fsdp and isinstance(obj, torch.nn.Module):
                broadcast_module(obj)  # every rank shards rank 0's weights (as DDP syncs them)
                self._plain[id(obj)] = _empty_copy(obj, self.accelerator.device)
        prepared = self.accelerator.prepare(*objects)
        self._prepared.append(prepared)
        return prepared

    def _prepared_objects(self) -> list[Any]:
        flat: list[Any] = []
        for prepared in self._prepared:
            flat.extend(prepared if isinstance(prepared, tuple) else (prepared,))
        return flat

    @property
    def models(self) -> list[torch.nn.Module]:
        """The models :meth:`prepare` returned (what a checkpoint's ``save_state`` writes)."""
        return [o for o in self._prepared_objects() if isinstance(o, torch.nn.Module)]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers :meth:`prepare` returned (accelerate's wrappers)."""
        return [o for o in self._prepared_objects() if isinstance(o, torch.optim.Optimizer)]

    @contextlib.contextmanager
    def full_model(
        self, model: torch.nn.Module, everywhere: bool = False
    ) -> Iterator[torch.nn.Module | None]:
        """The prepared ``model`` with all its weights (every process enters).

        DDP or one process: the unwrapped model itself. FSDP: the full state dict is gathered
        (collective) into a plain copy, which is yielded and emptied again on exit -- on the
        main process only (to save it; the others get None), or with ``everywhere`` on every
        process: to run forwards whose number differs between ranks (validation shares,
        on-policy generation that stops at EOS), which a sharded model cannot, since each of
        its forwards is a collective. The plain copy is not trained: what it learns is lost.
        """
        if not self.fsdp:
            yield self.accelerator.unwrap_model(model)
            return
        state = full_state_dict(model, everywhere=everywhere)
        if not (self.is_main or everywhere):
            yield None
            return
        plain = self._plain[id(model)]
        plain.load_state_dict(state, assign=True)
        if hasattr(plain, "tie_weights"):
            plain.tie_weights()  # assign=True loaded tied weights (input/output) as two tensors
        try:
            yield plain
        finally:
            _params_to_meta(plain)

    def init_trackers(self, name: str, job_type: str) -> None:
        """W&B (when ``report_to: wandb``); offline without an API key (``wandb sync`` later)."""
        if self.cfg.report_to != "wandb":
            return
        from ..runinfo import wandb_mode

        self.accelerator.init_trackers(
            self.cfg.wandb_project,
            config=config_to_dict(self.cfg),
            init_kwargs={
                "wandb": {
                    "name": name,
                    "job_type": job_type,
                    "dir": str(self.out),
                    "mode": wandb_mode(),
                }
            },
        )

    def dump_config(self, name: str = "train_config.yaml") -> None:
        if self.is_main:
            dump_config(self.cfg, self.out / name)

    # --- resume, checkpoints ----------------------------------------------------------------

    def resume(self, total: int | None = None, scheduler: Any = None) -> int | None:
        """Load the newest good checkpoint (if resuming): state, data position, RNG, tensors.

        Args:
            total: the optimizer steps this invocation plans.
            scheduler: the run's :func:`~.schedule.warmup_cosine_schedule` (registered for
                checkpointing, so loading restored the total it had when saved).

        Returns:
            the schedule's total from here on, also given to ``scheduler``: the one a fitted
            schedule (:meth:`fit_schedule`) planned before the checkpoint, so a resumed run
            continues that cosine; else ``total`` (a resume that asks for more steps gets them).
        """
        found = None
        if self.cfg.resume:
            found = ckpt.load_latest(
                self.accelerator, self.out, recipe=self.recipe, kind=self.kind, say=self.say
            )
        if found is not None:
            self.state, path = found
            self.position = DataPosition(self.state.epoch, self.state.batches)
            self.resumed_from = self.state.step
            self.say(
                f"resumed from {path} (step {self.state.step}, epoch "
                f"{self.state.epoch}, batch {self.state.batches})"
            )
        self._invocation_start = self.state.step
        # Training time before this invocation: learning curves are plotted against total
        # minutes across resumes.
        self._seconds_before = float(self.state.extra.get("train_seconds", 0.0))
        if self.resumed_from is not None:
            self._saved = (self.state.step, len(self.state.validation))
        fitted = self.state.extra.get("fitted_total")
        if fitted is not None and total is not None and self.cfg.fit_schedule:
            total = int(fitted)
            self.say(f"continuing the schedule fitted to max_minutes: {total} optimizer steps")
        if scheduler is not None and total is not None:
            refit(scheduler, total)
        return total

    def save_checkpoint(self, step: int) -> Path | None:
        """Checkpoint at ``step`` (all processes).

        Skipped when this step is already saved with the same history; rewritten (temp dir +
        rename) when a validation was added since, so the final state is what resumes.
        """
        if self._saved == (step, len(self.state.validation)):
            return None
        self.state.step = step
        self.state.epoch, self.state.batches = self.position.epoch, self.position.batches
        self.state.extra["train_seconds"] = self.train_seconds()
        path = ckpt.save_checkpoint(
            self.accelerator,
            self.out,
            self.state,
            self.cfg.keep_checkpoints,
            models=self.models,
            optimizers=self.optimizers,
        )
        self._saved = (step, len(self.state.validation))
        return path

    def save_due(self, step: int) -> bool:
        return bool(self.cfg.save_every) and step % self.cfg.save_every == 0

    def eval_due(self, step: int, total: int) -> bool:
        """Validate every ``eval_every`` steps and at the last step (``eval_every: 0``: only then).

        A due validation is timed until :meth:`record_validation` (:meth:`fit_schedule` counts
        validations apart from training steps)."""
        every = self.cfg.eval_every
        due = step >= total or (bool(every) and step % every == 0)
        if due:
            self._val_started = time.monotonic()
        return due

    def fit_schedule(self, step: int, total: int, scheduler: Any) -> int:
        """With ``fit_schedule``: re-plan the schedule's total so its cosine ends with the budget.

        Called after every optimizer step. It acts after every validation and every
        :data:`~.schedule.FIT_EVERY_SHARE` of the planned steps, timing the window of steps
        since its previous fit (the first window starts after this invocation's first step,
        so loading and start-up are left out). Rank 0 times the window (validations apart),
        fits the steps left in ``max_minutes`` (:func:`~.schedule.fitted_total`), moves the
        total at most :data:`~.schedule.FIT_MAX_FACTOR` either way (:func:`~.schedule.damped`)
        and broadcasts it; the scheduler's cosine is stretched or shortened to it (the step's
        learning rate changes a little), and the total is saved with the next checkpoint
        (:meth:`resume`).

        Returns:
            the planned total from here on (``total`` when nothing was fitted).
        """
        cfg = self.cfg
        if not cfg.fit_schedule or cfg.max_minutes is None or cfg.max_steps is not None:
            return total
        now = time.monotonic()
        if self._fit_from is None:
            self._fit_from = (step, now, sum(self._val_seconds))
            self._fit_validations = len(self._val_seconds)
            self._fit_every = max(FIT_MIN_STEPS, math.ceil(FIT_EVERY_SHARE * total))
            return total
        first_step, first_time, first_val = self._fit_from
        timed = step - first_step
        validated = len(self._val_seconds) > self._fit_validations
        # Every rank takes the same branch: steps and validations are the same on all of them.
        if step >= total or timed < FIT_MIN_STEPS or not (validated or timed >= self._fit_every):
            return total
        fitted = total
        if self.is_main:  # rank 0's clock decides, as for max_minutes
            fitted = fitted_total(
                step=step,
                steps_timed=timed,
                seconds_timed=now - first_time - (sum(self._val_seconds) - first_val),
                validation_seconds=self._val_seconds,
                seconds_left=60 * cfg.max_minutes - (now - self.started),
                eval_every=cfg.eval_every,
            )
            fitted = damped(total, fitted, step)
        fitted = broadcast_int(fitted, self.accelerator.device)
        self._fit_from = (step, now, sum(self._val_seconds))
        self._fit_validations = len(self._val_seconds)
        if fitted != total:
            refit(scheduler, fitted)
            self.state.extra["fitted_total"] = fitted
            self.say(
                f"schedule fitted to max_minutes at step {step}: {total} -> {fitted} "
                f"optimizer steps ({timed} steps timed)"
            )
        return fitted

    def validated(self, step: int) -> bool:
        return bool(self.state.validation) and self.state.validation[-1]["step"] == step

    # --- the per-step verdict ---------------------------------------------------------------

    def watch(self, loss: torch.Tensor) -> None:
        """Note a micro-batch's loss; a non-finite one fails this optimizer step's check.

        The verdict stays on the loss's device (no host sync per micro-batch); :meth:`step_ok`
        reads it with the step's other votes.
        """
        bad = ~torch.isfinite(loss.detach()).all()
        self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad

    def step_ok(self, next_step: int, grad_norm: torch.Tensor | float | None) -> bool:
        """Agree over all processes whether optimizer step ``next_step`` may be applied.

        One all-reduce carries every process's votes: a stop signal, the time budget (rank 0's
        clock decides, so all ranks stop at the same step) and a non-finite loss (the flag of
        :meth:`watch`) or gradient norm, both still on the device; reading its result is the
        step's one host sync (also with one process). With ``on_nonfinite: stop`` a non-finite
        step raises; with ``skip`` it returns False (the caller zeroes the gradients and goes
        on) and is counted.

        Raises:
            NonFiniteError: non-finite loss/gradient and ``on_nonfinite: stop``.
        """
        bad_loss = self._nonfinite if self._nonfinite is not None else False
        self._nonfinite = None
        time_up = (
            self.is_main
            and self.cfg.max_minutes is not None
            and (time.monotonic() - self.started > 60 * self.cfg.max_minutes)
        )
        signal_, time_up, bad_loss, bad_norm = any_rank(
            [self.signals.requested is not None, time_up, bad_loss, _nonfinite(grad_norm)],
            self.accelerator.device,
        )
        bad = bad_loss or bad_norm
        if signal_:
            self.stop_reason = "interrupted"
        elif time_up and self.stop_reason is None:
            self.stop_reason = "max_minutes"
        if not bad:
            return True
        norm = float(grad_norm) if grad_norm is not None else float("nan")
        if self.cfg.on_nonfinite == "skip":
            self.state.skipped_nonfinite += 1
            self.say(
                f"warning: step {next_step}: non-finite loss or gradient (grad norm "
                f"{norm:g}); skipped ({self.state.skipped_nonfinite} so far)"
            )
            return False
        done = ckpt.finished_checkpoints(self.out)
        kept = f"the last good checkpoint is {done[-1][1]}" if done else "no checkpoint was saved"
        raise NonFiniteError(
            f"non-finite loss or gradient at step {next_step} (grad norm {norm:g}); stopped "
            f"without saving it: {kept}. Lower lr (now {self.cfg.lr:g}) and resume, or set "
            "on_nonfinite: skip to skip such steps"
        )

    def optimizer_step(
        self, next_step: int, grad_norm: torch.Tensor | float, optimizer: Any, scheduler: Any
    ) -> bool:
        """Apply optimizer step ``next_step`` if all ranks agree it is finite (:meth:`step_ok`).

        Steps the optimizer and the schedule (once per optimizer step, not per process), and
        zeroes the gradients either way. Returns False for a skipped non-finite step.
        """
        ok = self.step_ok(next_step, grad_norm)
        if ok:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad()
        return ok

    def finished(self, step: int, total: int) -> bool:
        """Whether the loop ends after ``step``: done, stopped, out of time, or paused."""
        if step >= total:
            return True
        if self.stop_reason is not None:
            return True
        pause = self.cfg.stop_after_steps
        if pause is not None and step - self._invocation_start >= pause:
            self.stop_reason = "paused"
            return True
        return False

    @property
    def interrupted(self) -> bool:
        """Stopped by a signal or paused: checkpoint and exit 0, no final outputs."""
        return self.stop_reason in ("interrupted", "paused")

    def resume_hint(self) -> str:
        """The one line that says how to continue an interrupted run."""
        argv = [a for a in sys.argv if a not in ("--no-resume", "--overwrite")]
        if argv and argv[0].endswith(".py"):
            # Several processes: the same launcher and options as this run had.
            argv.insert(
                0, "accelerate launch <this run's launch options>" if self.multi else "python"
            )
        command = " ".join(a if i == 0 else shlex.quote(a) for i, a in enumerate(argv))
        return (
            f"stopped ({self.stop_reason}) after step {self.state.step}; checkpoint saved; "
            f"resume with: {command}"
        )

    # --- logs, validation, best drafter -------------------------------------------------------

    def train_seconds(self) -> float:
        """Seconds of this run so far, every resumed invocation included."""
        return getattr(self, "_seconds_before", 0.0) + time.monotonic() - self.started

    def log(self, step: int, logs: dict[str, float]) -> None:
        """Send training logs to the tracker and keep them in the run's history."""
        logs = {**logs, "train/minutes": self.train_seconds() / 60}
        self.accelerator.log(logs, step=step)
        self.state.train_log.append(finite_json({"step": step, **logs}))

    def record_validation(
        self,
        step: int,
        metrics: dict[str, float],
        sim_tau: float,
        save_best: Callable[[Path], None] | None = None,
    ) -> dict[str, float]:
        """Log a validation with its simulated τ; keep the best drafter in ``output_dir/best``.

        Args:
            step: the optimizer step validated.
            metrics: ``val/...`` figures.
            sim_tau: :func:`draftsmith.train.decoding.metrics.simulated_tau` of the validation.
            save_best: writes the drafter into a directory (called on every process, writes on
                the main one); None: no best drafter is kept.
        """
        if self._val_started is not None:
            self._val_seconds.append(time.monotonic() - self._val_started)
            self._val_started = None
        entry = {**metrics, "val/sim_tau": sim_tau, "val/minutes": self.train_seconds() / 60}
        self.accelerator.log(entry, step=step)
        self.state.validation.append(finite_json({"step": step, **entry}))
        best = self.state.best
        if (
            save_best is not None
            and math.isfinite(sim_tau)
            and (best is None or sim_tau > best["sim_tau"])
        ):
            self.write_output(BEST, save_best)
            self.state.best = {"step": step, "sim_tau": sim_tau}
        return entry

    def write_output(
        self, name: str, write: Callable[[Path], None], need: int | None = None
    ) -> Path:
        """Write ``output_dir/name`` via a temp dir and a rename (never half-written).

        ``write(tmp_dir)`` runs on every process (gathering a sharded state dict is collective)
        and writes on the main one. Free space is checked against ``need`` (default: the size
        of the prepared models); a write that fails for lack of space raises DiskSpaceError and
        leaves the previous ``name`` and no temp dir.
        """
        from ..staged import prepare_stage, replace_dir

        path, tmp = self.out / name, self.out / f".{name}.tmp"
        need = need or ckpt.checkpoint_bytes(self.models, self.optimizers) // 2

        # staged_dir's two halves by hand: ``write`` runs on every process, so the temp dir has
        # a fixed name they all know (at=), and the rename waits for every process's verdict.
        def prepare() -> None:
            prepare_stage(path, overwrite=True, need_bytes=need, at=tmp)

        self.on_main(prepare, f"preparing {path}")
        error: BaseException | None = None
        try:
            write(tmp)
        except Exception as exc:
            error = exc
        failed = any_rank([error is not None], self.accelerator.device)[0]
        if self.is_main:
            if failed:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                replace_dir(tmp, path, overwrite=True)
        if failed:
            if error is None:
                raise RunError(f"writing {path} failed in another process")
            if safety.disk_full(error):
                raise safety.DiskSpaceError(self.out, need) from error
            raise error
        return path

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        """Strict JSON (NaN/inf -> null) written atomically, main process only."""
        from ..staged import write_json_atomic

        if self.is_main:
            write_json_atomic(path, data)

    def summary(self, step: int, total: int) -> dict[str, Any]:
        """The fields every recipe's ``training_metrics.json`` starts with."""
        return {
            "recipe": self.recipe,
            "kind": self.kind,
            "steps": step,
            "total_steps": total,
            "stop_reason": "done" if step >= total else (self.stop_reason or "done"),
            "resumed_from": self.resumed_from,
            "train_seconds": round(time.monotonic() - self.started, 1),
            "processes": self.accelerator.num_processes,
            "distributed": "fsdp" if self.fsdp else ("ddp" if self.multi else "none"),
            "tf32": self.tf32,  # fp32 matmuls on TF32 (CUDA runs; device.allow_tf32)
            "skipped_nonfinite": self.state.skipped_nonfinite,
            "best": self.state.best,
            "validation": self.state.validation,
            "train_log": self.state.train_log,
            "config": config_to_dict(self.cfg),
        }


def validate_drafter(
    drafter: torch.nn.Module,
    step: int,
    split: Callable[[], tuple[dict[str, float], float]] | None,
    held: Callable[[], tuple[dict[str, float], float]] | None,
) -> tuple[dict[str, float], float]:
    """One validation of a (possibly wrapped) drafter: refused if a parameter is not finite,
    measured in eval mode, combined by :func:`held_out_validation`, back to train mode.

    Args:
        drafter: the prepared drafter (DDP/FSDP-wrapped or plain).
        step: the optimizer step, named in a non-finite error.
        split: measures the held-back training records, or None when there are none.
        held: measures ``val_data``'s records, or None without it.
    """
    from ...heads.base import unwrap_model  # heads sit below train; imported where used

    check_finite(unwrap_model(drafter), f"validation at step {step}: drafter")
    drafter.eval()
    try:
        return held_out_validation(split() if split else None, held() if held else None)
    finally:
        drafter.train()


def validation_line(step: int, metrics: dict[str, float], sim_tau: float) -> str:
    """One console line for a validation: τ (and the training records' τ with the gap when the
    run has ``val_data``), the loss, top-1 accuracy and acceptance rate per draft position."""

    def per_position(name: str) -> str:
        keys = sorted(
            (k for k in metrics if re.fullmatch(rf"val/{name}(_\d+)?", k)),
            key=lambda k: int(k.rsplit("_", 1)[1]) if k[-1].isdigit() else 0,
        )
        return " ".join(f"{metrics[k]:.2f}" for k in keys)

    line = f"step {step}: sim τ {sim_tau:.3f}"
    if "val_split/sim_tau" in metrics:
        line += (
            f" (training records {metrics['val_split/sim_tau']:.3f}, "
            f"{metrics['val/sim_tau_gap']:+.0%})"
        )
    if "val/loss" in metrics:
        line += f", loss {metrics['val/loss']:.3f}"
    for name, label in (("acc", "acc"), ("alpha", "α")):
        values = per_position(name)
        if values:
            line += f", {label} {values}"
    return line


def held_out_validation(
    split: tuple[dict[str, float], float] | None,
    held: tuple[dict[str, float], float] | None,
) -> tuple[dict[str, float], float]:
    """One validation's figures from the held-back training records and from ``val_data``.

    The simulated τ that chooses ``best/`` is ``val_data``'s when the run has it: records like
    the evaluation's predict its τ, while training records from the training prompts' own
    distribution overstate it (issue 26: 1.64 against an evaluated 1.31). The split's figures
    are kept under ``val_split/`` with ``val/sim_tau_gap`` = split τ / held-out τ - 1.

    Args:
        split: ``(metrics keyed "val/...", sim τ)`` of the held-back training records, or None
            (``val_samples: 0``).
        held: the same for ``val_data``'s records, or None (no ``val_data``).

    Returns:
        ``(metrics, sim τ)``; at least one of the two must be given.
    """
    if held is None:
        if split is None:
            raise ValueError("nothing was validated: no val_samples records and no val_data")
        return split
    metrics, tau = held
    if split is not None:
        split_metrics, split_tau = split
        metrics = {
            **metrics,
            **{f"val_split/{k.split('/', 1)[1]}": v for k, v in split_metrics.items()},
            "val_split/sim_tau": split_tau,
            "val/sim_tau_gap": split_tau / tau - 1 if tau else float("nan"),
        }
    return metrics, tau


def mean_over_processes(accelerator: Any, logs: dict[str, float]) -> dict[str, float]:
    """Average scalar logs over processes (one all-reduce)."""
    if accelerator.num_processes == 1 or not logs:
        return logs
    keys = sorted(logs)
    values = torch.tensor([float(logs[k]) for k in keys], device=accelerator.device)
    values = accelerator.reduce(values, reduction="mean")
    return dict(zip(keys, values.tolist(), strict=True))


def device_mismatch(want: str, got: torch.device) -> str | None:
    """Why the process's device ``got`` (accelerate's choice) is not the ``device`` asked for.

    Args:
        want: the config's ``device``: ``auto`` accepts anything, ``cpu`` only the CPU,
            ``cuda`` any GPU, ``cuda:N`` that GPU.
        got: the device accelerate gave this process.

    Returns:
        One line naming ``device``, or None when they agree.
    """
    if want == "auto" or (want == "cpu" and got.type == "cpu"):
        return None
    if want.startswith("cuda") and got.type == "cuda":
        index = want.partition(":")[2]
        got_index = got.index if got.index is not None else torch.cuda.current_device()
        if not index or int(index) == got_index:
            return None
        return (
            f"device: {want} asked for, but the launcher gave this process cuda:{got_index} "
            "(one GPU per process, by local rank); use --device cuda to take the GPU each "
            "process is given, or choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
    why = (
        "this process's accelerate state was set up for another device earlier"
        if want == "cpu"
        else "ACCELERATE_USE_CPU or the launch config's use_cpu forces CPU processes"
    )
    return f"device: {want} asked for, but accelerate runs this process on {got} ({why})"


def _nonfinite(value: torch.Tensor | float | None) -> torch.Tensor | bool:
    """Whether a gradient norm is NaN/inf: a device tensor for a tensor (no host sync)."""
    if value is None:
        return False
    if torch.is_tensor(value):
        if hasattr(value, "full_tensor"):  # an FSDP2 norm (DTensor): its global value
            value = value.full_tensor()
        return ~torch.isfinite(value.detach()).all()
    return not math.isfinite(float(value))


def _collective_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that timed out or lost its peer (gloo/NCCL)."""
    text = str(exc).lower()
    names = {type(e).__name__ for e in (exc, exc.__cause__) if e is not None}
    return bool(names & {"DistBackendError", "DistNetworkError", "DistError"}) or any(
        w in text for w in ("timed out", "timeout", "connection closed", "connection reset")
    )


__all__ = [
    "NonFiniteError",
    "TrainRun",
    "device_mismatch",
    "held_out_validation",
    "mean_over_processes",
    "validate_drafter",
    "validation_line",
]


def _params_to_meta(model: torch.nn.Module) -> None:
    """Drop ``model``'s parameter storage (meta tensors of the same shapes); keep its buffers."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.device.type != "meta":
                module._parameters[name] = torch.nn.Parameter(
                    param.detach().to("meta"), requires_grad=param.requires_grad
                )


def _empty_copy(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A copy of ``model`` without parameter storage, its buffers on ``device``.

    Filled by a gathered state dict when needed (:meth:`TrainRun.full_model`). Buffers stay
    real: non-persistent ones (rotary ``inv_freq``) are in no state dict, yet a forward needs them.
    """
    plain = copy.deepcopy(model)
    _params_to_meta(plain)
    for module in plain.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    return plain
