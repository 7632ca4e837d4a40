"""The quickstart's time budget: measured throughputs, and the data sizes and times they give.

:func:`make_plan` turns ``--budget-minutes`` into data sizes from the rates measured on a 2-core
CPU (:data:`RATES`): the fixed costs and the evaluation come first; of what is left, data making
gets :data:`DATA_SHARE` and training the rest. The training stage is sized again when it starts
(:meth:`Plan.train_time_left`, :func:`train_schedule`), from the time actually spent so far and
how fast this machine cached (:func:`speed_factor`): the epochs that fit, with the time left as a
hard stop, so a slow data stage shortens training instead of overrunning the budget.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "RATES",
    "STAGE_NAMES",
    "BudgetSettings",
    "Plan",
    "Rates",
    "make_plan",
    "speed_factor",
    "train_schedule",
]

#: The quickstart's stages, in job order; the plan estimates each.
STAGE_NAMES = ("prepare", "prompts", "distill", "tokenize", "cache", "train", "evaluate", "export")


@dataclass(frozen=True)
class Rates:
    """Throughputs the plan is sized by: SmolLM2-135M-Instruct, bf16, a 2-core CPU.

    Measured on the project's machine (docs/performance.md, docs/data.md) except where noted.

    Attributes:
        prepare_s: ``prepare-target`` the first time (download, conversion, checks).
        load_s: one stage's start: imports and loading the target.
        generate_tokens_per_s: batched generation at batch 64 (self-distillation; Magpie uses
            the same decoder).
        magpie_tokens_per_prompt: generated tokens per kept Magpie prompt. Not measured: about
            half of the candidates kept, ~40 tokens each, is an assumption.
        cache_tokens_per_s: hidden-state caching, bf16 target.
        train_tokens_per_s: EAGLE-3 offline training at the shipped settings.
        eval_tokens_per_s: one decoding stream of the evaluation (plain and speculative, both
            dtypes, 128 new tokens per prompt).
        prompt_tokens: tokens of a rendered prompt (chat template, system prompt, user turn).
        answer_share: average answer length as a share of ``max_new_tokens`` (SmolLM2 answers
            at length: 27 of 32 answers hit a 128-token limit).
        train_overhead_s: the training stage's start and validations.
        tokenize_s: the tokenize stage.
        export_s: the export stage.
    """

    prepare_s: float = 45.0
    load_s: float = 5.0
    generate_tokens_per_s: float = 90.0
    magpie_tokens_per_prompt: float = 80.0
    cache_tokens_per_s: float = 480.0
    train_tokens_per_s: float = 670.0
    eval_tokens_per_s: float = 10.0
    prompt_tokens: float = 80.0
    answer_share: float = 0.9
    train_overhead_s: float = 30.0
    tokenize_s: float = 10.0
    export_s: float = 10.0

    def distill_s(self, records: int, max_new_tokens: int) -> float:
        """Seconds to self-distil ``records`` answers of at most ``max_new_tokens`` tokens."""
        answer = self.answer_share * max_new_tokens
        return self.load_s + records * answer / self.generate_tokens_per_s


RATES = Rates()

#: Share of the budget the plan fills (the rest is slack for the estimates' error).
PLAN_SHARE = 0.95
#: Share of the time for data and training that goes to making data (the rest trains). A record
#: costs ~8x one training epoch over it, so 60/40 buys ~300 records seen ~7 times in 30 minutes.
DATA_SHARE = 0.6
#: Share of the budget for the evaluation when --eval-prompts is not given.
EVAL_SHARE = 0.17
#: Evaluation streams per prompt: plain bf16, plain fp32 (the reference) and speculative.
EVAL_STREAMS = 3
MIN_RECORDS = 40
MIN_TRAIN_S = 60.0


class BudgetSettings(Protocol):
    """The quickstart settings the plan reads (``QuickstartConfig`` has them)."""

    budget_minutes: float
    max_new_tokens: int
    num_prompts: int | None
    records: int | None
    eval_prompts: int | None


@dataclass
class Plan:
    """Data sizes and time estimates (seconds) for one budget.

    Attributes:
        budget_s: the budget.
        seeds: prompts from the shipped set and the user's file.
        records: prompts answered and trained on (``distill --limit``); None = all made.
        magpie: prompts the target writes.
        eval_prompts: held-out prompts evaluated.
        estimates: stage name -> estimated seconds (``train`` as planned before the job).
        reserve_s: what the training stage leaves for evaluation and export.
    """

    budget_s: float
    seeds: int
    records: int | None
    magpie: int
    eval_prompts: int
    estimates: dict[str, float] = field(default_factory=dict)
    reserve_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(self.estimates.values())

    def record(self, budget_minutes: float, rates: Rates = RATES) -> dict[str, Any]:
        """The plan as the job's state keeps it (``quickstart.json``'s ``plan``)."""
        return {
            "budget_minutes": budget_minutes,
            "seed_prompts": self.seeds,
            "magpie_prompts": self.magpie,
            "records": self.records,
            "eval_prompts": self.eval_prompts,
            "estimated_seconds": {k: round(v, 1) for k, v in self.estimates.items()},
            "rates": dataclasses.asdict(rates),
        }

    def train_time_left(self, spent_s: float) -> float:
        """Seconds for training: the planned share of the budget less ``spent_s`` (the earlier
        stages, all invocations) and the evaluation/export reserve; never less than
        :data:`MIN_TRAIN_S`, so a drafter comes out."""
        return max(MIN_TRAIN_S, self.budget_s * PLAN_SHARE - spent_s - self.reserve_s)


def _record_costs(max_new_tokens: int, rates: Rates) -> tuple[float, float]:
    """Seconds per record: (writing its prompt with Magpie, answering + caching it)."""
    answer = rates.answer_share * max_new_tokens
    magpie = rates.magpie_tokens_per_prompt / rates.generate_tokens_per_s
    rest = answer / rates.generate_tokens_per_s
    rest += (rates.prompt_tokens + answer) / rates.cache_tokens_per_s
    return magpie, rest


def make_plan(cfg: BudgetSettings, seeds: int, rates: Rates = RATES) -> Plan:
    """Split the budget into data sizes and per-stage time estimates.

    Fixed costs (prepare, stage starts, tokenize, export) and the evaluation come first; of the
    rest, :data:`DATA_SHARE` makes data (Magpie prompts, answers, the cache) and the remainder
    trains. The training time is recomputed when that stage starts, from the time really spent.

    Args:
        cfg: the job's settings.
        seeds: prompts of the shipped train split and the user's file (Magpie's seeds).
        rates: throughputs to size by.
    """
    budget = PLAN_SHARE * 60 * cfg.budget_minutes
    per_eval_prompt = EVAL_STREAMS * cfg.max_new_tokens / rates.eval_tokens_per_s
    eval_prompts = cfg.eval_prompts or int(
        min(16, max(4, round(EVAL_SHARE * 60 * cfg.budget_minutes / per_eval_prompt)))
    )
    est = {
        "prepare": rates.prepare_s,
        "tokenize": rates.tokenize_s + rates.load_s,
        "evaluate": eval_prompts * per_eval_prompt + 4 * rates.load_s,
        "export": rates.export_s,
    }
    fixed = sum(est.values()) + 4 * rates.load_s  # prompts, distill, cache, train start
    magpie_cost, record_cost = _record_costs(cfg.max_new_tokens, rates)
    data_s = DATA_SHARE * max(budget - fixed, 0.0)
    if cfg.num_prompts is not None:
        magpie = cfg.num_prompts
        records = cfg.records  # None: every prompt made is answered
    elif cfg.records is not None:
        records = cfg.records
        magpie = max(0, records - seeds)
    else:
        magpie = max(0, math.floor((data_s - seeds * record_cost) / (magpie_cost + record_cost)))
        records = max(MIN_RECORDS, seeds + magpie)
        magpie = max(magpie, records - seeds)
    answered = min(records, seeds + magpie) if records is not None else seeds + magpie
    est["prompts"] = rates.load_s + magpie * magpie_cost
    answer = rates.answer_share * cfg.max_new_tokens
    est["distill"] = rates.distill_s(answered, cfg.max_new_tokens)
    est["cache"] = (
        rates.load_s + answered * (rates.prompt_tokens + answer) / rates.cache_tokens_per_s
    )
    reserve = est["evaluate"] + est["export"]
    spent = sum(v for k, v in est.items() if k not in ("evaluate", "export"))
    est["train"] = max(MIN_TRAIN_S, budget - spent - reserve)
    return Plan(
        budget_s=60 * cfg.budget_minutes,
        seeds=seeds,
        records=records,
        magpie=magpie,
        eval_prompts=eval_prompts,
        estimates={k: est[k] for k in STAGE_NAMES},
        reserve_s=reserve,
    )


def speed_factor(cache_tokens: int, cache_record: dict[str, Any], rates: Rates = RATES) -> float:
    """This machine's speed against the measured one, from the cache stage's throughput.

    Caching and training are both wide bf16 matmuls on the same cores, so the cache's tokens/s
    scales the training rate (a busy or faster machine plans fewer or more epochs).

    Args:
        cache_tokens: tokens in the hidden-state cache.
        cache_record: the cache stage's record in the job's state (``last_seconds``, ``runs``).
        rates: the measured rates.
    """
    seconds = cache_record.get("last_seconds") or 0.0
    if not cache_tokens or not seconds or cache_record.get("runs", 0) != 1:
        return 1.0  # resumed or unknown: no clean measurement
    rate = cache_tokens / max(seconds - rates.load_s, 1.0)
    return min(4.0, max(0.5, rate / rates.cache_tokens_per_s))


def train_schedule(
    left_s: float,
    *,
    samples: int,
    val_samples: int,
    tokens: int,
    samples_per_step: int,
    train_steps: int | None,
    speed: float = 1.0,
    rates: Rates = RATES,
) -> dict[str, Any]:
    """The training schedule that fits ``left_s`` seconds: epochs and planned optimizer steps.

    Args:
        left_s: the training time (:meth:`Plan.train_time_left`).
        samples: records in the cache; ``val_samples`` of them validate.
        val_samples: records held out for validation.
        tokens: tokens in the cache.
        samples_per_step: records per optimizer step.
        train_steps: steps asked for (``--train-steps``); None: the epochs that fit.
        speed: :func:`speed_factor`.
        rates: the measured rates.

    Returns:
        ``{"epochs", "planned_steps", "train_s"}``, as kept in the job's state (a resumed run
        continues the same schedule).
    """
    train_tokens = max(1, tokens * (samples - val_samples) / max(samples, 1))
    fit = max(0.0, left_s - rates.train_overhead_s) * rates.train_tokens_per_s * speed
    epochs = round(min(30.0, max(0.1, fit / train_tokens)), 2)
    steps = train_steps or math.ceil(epochs * (samples - val_samples) / samples_per_step)
    return {"epochs": epochs, "planned_steps": steps, "train_s": round(left_s, 1)}
