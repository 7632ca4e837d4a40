"""The learning-rate schedule every recipe uses, and its fit to a time budget.

Every recipe decays its learning rate with a linear warm-up and a cosine to 0 over the run's
planned optimizer steps (``epochs`` or ``max_steps``). When the run also has a time budget
(``max_minutes``), the planned steps are a guess at this machine's speed: on the 2-core CPU the
quickstart's guess was 25-60 % too many steps, so the budget cut the cosine at 62-80 % of its
length (the learning rate never decayed); on an H200 it was half the steps the budget allowed,
so the job ended with minutes unused. ``fit_schedule: true`` re-plans the total from the
measured step rate, validations included (:meth:`~.run.TrainRun.fit_schedule`), so the cosine
ends when the budget does.

The schedule's factor is a callable object rather than a closure: ``LambdaLR.state_dict`` keeps
the fields of such objects, so a re-fitted total is saved in every checkpoint and a resumed run
continues the same schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: A fit needs at least this many optimizer steps in its timing window.
FIT_MIN_STEPS = 5
#: Fits come after every validation and every this share of the planned steps, each timing the
#: steps since the previous fit: a window, not the run so far, because the first steps are
#: slow (on an H200 the first 36 ran ~7x slower than the rest: new batch shapes, allocator
#: growth), and a rate averaged from the start kept that bias.
FIT_EVERY_SHARE = 0.1
#: One fit changes the total by at most this factor either way: a noisy window moves the cosine
#: a little, several windows that agree move it all the way (the H200 run above, unbounded,
#: went 711 -> 205 -> 502 -> ... -> 1159 steps, its learning rate dipping toward 0 and back).
FIT_MAX_FACTOR = 1.5
#: Seconds kept free at the end of the budget for the final validation's and save's own time
#: (on top of one measured validation).
FIT_RESERVE_S = 5.0


@dataclass
class WarmupCosine:
    """LR factor at optimizer step ``step``: 0 before ``start``, linear warm-up over ``warmup``
    steps, then cosine decay to 0 at ``total``.

    ``offset`` 0 is ``transformers.get_cosine_schedule_with_warmup`` exactly (factor
    ``s / warmup`` in the warm-up, so 0 at the first step); 1 is the Medusa recipe's
    ``(s + 1) / (warmup + 1)`` (never 0 once started: the Medusa-2 adapters start late).
    """

    warmup: int
    total: int
    start: int = 0
    offset: int = 0

    def __call__(self, step: int) -> float:
        s = step - self.start
        if s < 0:
            return 0.0
        if s < self.warmup:
            return (s + self.offset) / max(1, self.warmup + self.offset)
        span = max(1, self.total - self.start - self.warmup)
        progress = min(1.0, (s - self.warmup) / span)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer,
    warmup: int,
    total: int,
    *,
    starts: Sequence[int] | None = None,
    offset: int = 0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` with one :class:`WarmupCosine` per parameter group.

    Args:
        optimizer: the (unwrapped) optimizer.
        warmup: warm-up steps.
        total: planned optimizer steps; :func:`refit` changes it.
        starts: each group's first step (default 0 for every group).
        offset: see :class:`WarmupCosine`.
    """
    starts = list(starts) if starts is not None else [0] * len(optimizer.param_groups)
    factors = [WarmupCosine(warmup, total, start, offset) for start in starts]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)


def schedule_total(scheduler: torch.optim.lr_scheduler.LambdaLR) -> int | None:
    """The planned total of a :func:`warmup_cosine_schedule` (None for any other schedule)."""
    factors = getattr(scheduler, "lr_lambdas", [])
    totals = {f.total for f in factors if isinstance(f, WarmupCosine)}
    return totals.pop() if len(totals) == 1 else None


def refit(scheduler: torch.optim.lr_scheduler.LambdaLR, total: int) -> None:
    """Give every :class:`WarmupCosine` of ``scheduler`` the planned total ``total``; the next
    ``scheduler.step()`` sets the learning rate from it (warm-up and start are kept)."""
    for factor in scheduler.lr_lambdas:
        if isinstance(factor, WarmupCosine):
            factor.total = total


def damped(total: int, fitted: int, step: int) -> int:
    """``fitted`` kept within :data:`FIT_MAX_FACTOR` of ``total`` either way, and past ``step``."""
    low, high = math.ceil(total / FIT_MAX_FACTOR), math.floor(total * FIT_MAX_FACTOR)
    return max(step + 1, min(high, max(low, fitted)))


def fitted_total(
    *,
    step: int,
    steps_timed: int,
    seconds_timed: float,
    validation_seconds: Sequence[float],
    seconds_left: float,
    eval_every: int,
) -> int:
    """The total optimizer steps that end when the budget does.

    Args:
        step: optimizer steps done.
        steps_timed: steps of this invocation in ``seconds_timed``.
        seconds_timed: their wall time, without the validations in it.
        validation_seconds: each validation's wall time so far (none yet: validations are not
            counted until one has been timed).
        seconds_left: the budget left.
        eval_every: validation interval (0: only the final one).

    Returns:
        ``step + n`` with ``n >= 1`` the steps that fit: ``n`` steps at the timed rate plus a
        validation every ``eval_every`` steps, plus the final validation and
        :data:`FIT_RESERVE_S`.
    """
    per_step = seconds_timed / max(1, steps_timed)
    per_val = sum(validation_seconds) / len(validation_seconds) if validation_seconds else 0.0
    usable = seconds_left - per_val - FIT_RESERVE_S
    per_step_all = per_step + (per_val / eval_every if eval_every else 0.0)
    return step + max(1, math.floor(usable / max(per_step_all, 1e-9)))
