"""The quickstart's time budget: measured throughputs, and the data sizes and times they give.

:func:`make_plan` turns ``--budget-minutes`` into data sizes from a set of :class:`Rates`: the
fixed costs and the evaluation come first; what is left buys records, each costing its making
(answer, cache, and for a Magpie record its prompt) plus :data:`TARGET_EPOCHS` training
epochs over it: the user's prompts first, then up to ``sampled_answers`` more answers sampled to
each (no prompt to write: chain τ 1.920 against 1.832 in a 60-minute Alpaca job,
docs/quickstart.md), then Magpie's, so the split
between making data and training follows the measured rates and a learning-curve rule (epochs
over distinct records), not a fixed share. The training stage is sized again when it starts
(:meth:`Plan.train_time_left`, :func:`train_schedule`), from the time actually spent so far and
the training rate (the probe's; without a probe, the reference's scaled by how fast this
machine cached, :func:`speed_factor`): the epochs that fit, with the time left as a hard stop,
so a slow data stage shortens training instead of overrunning the budget. A fast data stage
grows the data instead (:func:`grow_plan`).

The rates come from :func:`probe_rates`, a probe of a few seconds on the device and target the
job runs on: a short batched generation, a forward with hidden states, a few EAGLE-3 training
steps and a few decoding steps, each timed with :class:`~draftsmith.train.device.DeviceTimer`.
What it measures is not a whole stage (no long prompts, no padding, no data loading), so each
stage rate is the reference rate scaled by how much faster the probe ran here than on the
reference machine: ``RATES.x * measured.x / PROBE_REFERENCE.x``. :data:`RATES` (the stage rates)
and :data:`PROBE_REFERENCE` (the probe's own figures) were both measured in bf16 on the project's
2-core CPU (AVX512-BF16), so there the probe reproduces the reference plan, and on a GPU it scales
every rate by what the GPU really does. The probe runs in the job's dtype (``--dtype``, resolved),
so an fp32 job's rates are the bf16 reference scaled by what fp32 does here; under ``--dtype
auto`` it times the single-stream decoding in both fp32 and bf16, and the evaluation runs in the
faster (batch-1 decoding is bound by reading the weights: bf16 can win where it is emulated).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

from ..report.text import minutes

__all__ = [
    "PROBE_REFERENCE",
    "RATES",
    "REFERENCE_DTYPE",
    "STAGE_NAMES",
    "VALIDATIONS",
    "BudgetSettings",
    "Plan",
    "Probe",
    "Rates",
    "generation_batch_size",
    "generation_factor",
    "grow_plan",
    "make_plan",
    "plan_lines",
    "probe_rates",
    "shrink_records",
    "speed_factor",
    "train_schedule",
]

#: The quickstart's stages, in job order; the plan estimates each.
STAGE_NAMES = (
    "prepare",
    "prompts",
    "distill",
    "sampled",
    "validation",
    "tokenize",
    "cache",
    "train",
    "evaluate",
    "export",
)


@dataclass(frozen=True)
class Rates:
    """Throughputs the plan is sized by. The defaults (:data:`RATES`) are the CPU reference:
    SmolLM2-135M-Instruct, bf16, a 2-core CPU with AVX512-BF16; :func:`probe_rates` scales them
    to the machine and dtype.

    Measured on the project's machine (docs/performance.md, docs/data.md) except where noted.

    Attributes:
        prepare_s: ``prepare-target`` the first time (download, conversion, checks).
        load_s: one stage's start: imports and loading the target.
        generate_tokens_per_s: batched generation at batch 64 (self-distillation; Magpie uses
            the same decoder).
        magpie_tokens_per_prompt: Magpie's cost per kept prompt, in tokens at
            ``generate_tokens_per_s``: it judges ~1.3 candidates per kept prompt, each ~40
            tokens, decoded at about half self-distillation's rate (shorter rows). Measured 83
            (491 prompts in 160 s, the 30-minute job) and 127 (369 in 143 s, a grown job's
            second Magpie run).
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
    # Recalibrated 2026-12-03 from two quickstart jobs on a 2-core AVX512-BF16 EPYC (30 min on
    # Magpie prompts, 60 min on Alpaca ones): each stage's measured rate ÷ its probe reading ×
    # PROBE_REFERENCE, the two jobs' geometric mean. The rates before (90, 480, 670, 10) planned
    # the data 1.8-2.4x slower than it ran (so every job grew its data), the cache 1.5-1.7x
    # slower, the evaluation 1.4x slower, and training 1.25x faster (the time limit cut both
    # jobs' cosine schedules at 80 % of their steps): docs/quickstart.md "The budget".
    generate_tokens_per_s: float = 185.0
    magpie_tokens_per_prompt: float = 100.0  # 83 and 127 measured, at the rate above
    cache_tokens_per_s: float = 755.0
    # Recalibrated 2026-12-05 the same way: the two 30-minute jobs at f9bb25e and d260927 ran
    # 1.39x and 1.40x the steps their plan fitted in the time (stage ÷ probe × reference:
    # 721 and 726), as stop 45's two jobs had (644 and 797, 3 TTT steps); at 520 each plan
    # bought data for 3 epochs and the fitted schedule then trained ~5 over it.
    train_tokens_per_s: float = 720.0
    # Recalibrated 2026-12-05 the same way from the two 30-minute jobs of that day (packed bf16
    # weights, the 5-node tree as the fourth stream): the stage ran at 1.26-1.27x the probe's
    # plain decoding (the speculative streams outpace it), not 0.875x; at 14 the evaluation
    # was planned ~300 s where it took ~215, time the job then left unused.
    eval_tokens_per_s: float = 20.0
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
"""The CPU reference: what the stages ran at on the project's 2-core CPU, in bf16 (``--no-probe``
plans with these)."""

#: The dtype :data:`RATES` and :data:`PROBE_REFERENCE` were measured in, on a CPU that computes it
#: natively (AVX512-BF16). Without a probe there are no fp32 rates to plan with: the reference is
#: used as it is and the plan says so (:func:`plan_lines`), rather than scaled by an fp32/bf16
#: ratio that differs per stage and per machine (on the reference machine fp32 generates about as
#: fast, trains ~1.45x slower, decodes one stream faster; on an AVX2-only CPU bf16 is the slow one).
REFERENCE_DTYPE = "bfloat16"

#: What :func:`probe_rates` measures on the reference machine (the one :data:`RATES` was measured
#: on: 2 cores, 2 torch threads, SmolLM2-135M-Instruct, bf16, batch 64), tokens/s of each probe:
#: the median of 6 probes on the idle machine (spread: generation 280-390, cache 800-1000,
#: training 720-770, evaluation 15-18), about 5.5 s each with the target's load.
PROBE_REFERENCE = {
    "generate_tokens_per_s": 290.0,
    "cache_tokens_per_s": 900.0,
    "train_tokens_per_s": 740.0,
    "eval_tokens_per_s": 16.0,
}

#: Share of the budget the plan fills (the rest is slack for the estimates' error).
PLAN_SHARE = 0.95
#: Training epochs over distinct records the plan buys data for: each planned record costs its
#: making plus this many epochs of training over it. Measured at equal training compute (EAGLE-3,
#: the same 301 steps and LR schedule on Alpaca records answered by SmolLM2, docs/performance.md
#: "Distinct data against epochs"): 968 records seen 2.5 times reach evaluated τ 1.44, 218 records
#: seen 11 times 1.36 (their learning curve flattening from step 200). A record costs ~8x one
#: training epoch over it at the reference rates, so 3 epochs put ~3/4 of the time into data.
TARGET_EPOCHS = 3.0
#: Share of the budget for the evaluation when --eval-prompts is not given.
EVAL_SHARE = 0.17
#: Evaluation streams per prompt: plain bf16, plain fp32 (the reference) and the speculative
#: chain; the tree (``tree_nodes`` > 0) is one more.
EVAL_STREAMS = 3
#: With the per-step decision (the quickstart's ``--auto``): n-gram lookup and auto, two more
#: streams, and the calibration's prompts.
AUTO_STREAMS = 2
AUTO_CALIBRATION_PROMPTS = 16
MIN_RECORDS = 40
MIN_TRAIN_S = 60.0
#: Validations a training run makes (every quarter of its steps, and at the end when it stops
#: between two), each a target forward over the validation records (their features are computed
#: online): what :func:`train_schedule` leaves time for.
VALIDATIONS = 5


class BudgetSettings(Protocol):
    """The quickstart settings the plan reads (``QuickstartConfig`` has them)."""

    budget_minutes: float
    max_new_tokens: int
    num_prompts: int | None
    records: int | None
    sampled_answers: int
    eval_prompts: int | None
    tree_nodes: int


@dataclass
class Plan:
    """Data sizes and time estimates (seconds) for one budget.

    Attributes:
        budget_s: the budget.
        seeds: training prompts from other sources than Magpie (the user's file, less the prompts
            held out of it for validation).
        records: prompts answered and trained on (``distill --limit``); None = all made.
        magpie: prompts the target writes.
        sampled: answers sampled (T > 0) to the user's prompts besides their greedy ones, at
            most ``sampled_answers`` per prompt: records that cost no prompt writing.
        validation: validation prompts the target answers apart (never trained on).
        eval_prompts: held-out prompts evaluated.
        estimates: stage name -> estimated seconds (``train`` as planned before the job).
        reserve_s: what the training stage leaves for evaluation and export.
        dtype: what the target computes in, in every stage but the evaluation (``bfloat16`` or
            ``float32``; ``--dtype`` resolved).
        eval_dtype: what the evaluation computes in: ``dtype``, or under ``--dtype auto`` the
            dtype the probe's plain single-stream decoding was fastest in.
        eval_rates: evaluation tokens/s per stream of each dtype the probe compared (scaled as
            :class:`Rates`); empty when it compared none.
        reference_rates: whether the rates are :data:`RATES` as they are (``--no-probe``), not
            measured on this machine.
    """

    budget_s: float
    seeds: int
    records: int | None
    magpie: int
    eval_prompts: int
    validation: int = 0
    sampled: int = 0
    estimates: dict[str, float] = field(default_factory=dict)
    reserve_s: float = 0.0
    dtype: str = REFERENCE_DTYPE
    reference_rates: bool = field(default=False, compare=False)  # how it is shown, not its sizes
    eval_dtype: str = REFERENCE_DTYPE
    eval_rates: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def total_s(self) -> float:
        return sum(self.estimates.values())

    def record(self, budget_minutes: float, rates: Rates = RATES) -> dict[str, Any]:
        """The plan as the job's state keeps it (``quickstart.json``'s ``plan``; the caller adds
        where the rates came from)."""
        return {
            "budget_minutes": budget_minutes,
            "dtype": self.dtype,
            "eval_dtype": self.eval_dtype,
            "seed_prompts": self.seeds,
            "magpie_prompts": self.magpie,
            "records": self.records,
            "sampled_answers": self.sampled,
            "validation_prompts": self.validation,
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


def make_plan(
    cfg: BudgetSettings,
    seeds: int,
    rates: Rates = RATES,
    *,
    probe_s: float = 0.0,
    dtype: str = REFERENCE_DTYPE,
    reference_rates: bool = False,
    validation: int = 0,
    eval_dtype: str | None = None,
    eval_rates: dict[str, float] | None = None,
) -> Plan:
    """Split the budget into data sizes and per-stage time estimates.

    Fixed costs (prepare, stage starts, the validation answers, tokenize, export) and the
    evaluation come first; the rest buys records at their making cost (Magpie prompt, answer,
    cache) plus :data:`TARGET_EPOCHS` epochs of training over each, and trains on them. The training time is recomputed when that stage starts,
    from the time really spent.

    Args:
        cfg: the job's settings.
        seeds: training prompts before Magpie's (the user's file less its validation slice).
        rates: throughputs to size by (:func:`probe_rates`, or the CPU reference).
        probe_s: seconds the probe took (counted with the prepare stage: it runs right after).
        dtype: the dtype every stage's target computes in (recorded and shown; the rates are
            assumed to be for it).
        reference_rates: ``rates`` are :data:`RATES` unmeasured (``--no-probe``): shown as such.
        validation: prompts the target answers for validation, apart from the training ones.
        eval_dtype: the evaluation's dtype (None: ``dtype``); ``rates`` are assumed to have its
            evaluation rate.
        eval_rates: the evaluation rates the probe compared, per dtype (shown in the plan line).
    """
    budget = PLAN_SHARE * 60 * cfg.budget_minutes
    auto = bool(getattr(cfg, "auto", False))
    streams = EVAL_STREAMS + (1 if cfg.tree_nodes else 0) + (AUTO_STREAMS if auto else 0)
    per_eval_prompt = streams * cfg.max_new_tokens / rates.eval_tokens_per_s
    # The per-step decision's calibration decodes validation prompts first, verifying every
    # candidate (about a plain stream's time per prompt on a CPU).
    calibrate = AUTO_CALIBRATION_PROMPTS * cfg.max_new_tokens / rates.eval_tokens_per_s
    eval_prompts = cfg.eval_prompts or int(
        min(16, max(4, round(EVAL_SHARE * 60 * cfg.budget_minutes / per_eval_prompt)))
    )
    est = {
        "prepare": rates.prepare_s + probe_s,
        "validation": rates.distill_s(validation, cfg.max_new_tokens) if validation else 0.0,
        "tokenize": rates.tokenize_s + rates.load_s,
        "evaluate": eval_prompts * per_eval_prompt + 4 * rates.load_s + (calibrate if auto else 0),
        "export": rates.export_s,
    }
    fixed = sum(est.values()) + 4 * rates.load_s  # prompts, distill, cache, train start
    magpie_cost, record_cost = _record_costs(cfg.max_new_tokens, rates)
    answer = rates.answer_share * cfg.max_new_tokens
    epochs_cost = TARGET_EPOCHS * (rates.prompt_tokens + answer) / rates.train_tokens_per_s
    usable = max(budget - fixed, 0.0)
    sampled = 0
    if cfg.num_prompts is not None:
        magpie = cfg.num_prompts
        records = cfg.records  # None: every prompt made is answered
    elif cfg.records is not None:
        records = cfg.records
        magpie = max(0, records - seeds)
    else:
        # Each seed costs its answer, cache and epochs; so does each answer sampled to a seed;
        # each Magpie prompt costs its writing besides, so the sampled answers come first.
        left = usable - seeds * (record_cost + epochs_cost)
        if left >= 0:
            sampled = min(
                cfg.sampled_answers * seeds, math.floor(left / (record_cost + epochs_cost))
            )
            left -= sampled * (record_cost + epochs_cost)
            magpie = math.floor(left / (magpie_cost + record_cost + epochs_cost))
            records = max(MIN_RECORDS, seeds + magpie)
        else:
            # More of the user's prompts than the budget answers and trains on: the first that
            # fit, in file order (answering them all would leave training a minute).
            records = max(MIN_RECORDS, math.floor(usable / (record_cost + epochs_cost)))
            magpie = 0
        magpie = max(magpie, records - seeds)
    answered = min(records, seeds + magpie) if records is not None else seeds + magpie
    est["prompts"] = rates.load_s + magpie * magpie_cost
    est["distill"] = rates.distill_s(answered, cfg.max_new_tokens)
    est["sampled"] = rates.distill_s(sampled, cfg.max_new_tokens) if sampled else 0.0
    est["cache"] = (
        rates.load_s
        + (answered + sampled) * (rates.prompt_tokens + answer) / rates.cache_tokens_per_s
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
        validation=validation,
        sampled=sampled,
        estimates={k: est[k] for k in STAGE_NAMES},
        reserve_s=reserve,
        dtype=dtype,
        reference_rates=reference_rates,
        eval_dtype=eval_dtype or dtype,
        eval_rates=dict(eval_rates or {}),
    )


#: The data grows after its first stages (:func:`grow_plan`) only by at least this share of its
#: records and :data:`MIN_GROWTH` records: less is not worth starting two stages again.
GROWTH_SHARE = 0.1
MIN_GROWTH = 16
#: The most :func:`generation_factor` believes: beyond it the stages' times are not a rate.
MAX_GENERATION_FACTOR = 8.0


def generation_factor(stage_records: list[dict[str, Any]], rates: Rates) -> float | None:
    """How much faster the data stages generated than the plan assumed: their estimated
    seconds over their measured ones, each less a stage start (``rates.load_s``).

    Args:
        stage_records: the job state's records of the stages that generate (prompts, distill),
            each with ``estimate_s`` and ``last_seconds``.
        rates: the rates the estimates came from.

    Returns:
        The factor (1 = as planned, 2 = twice as fast), clamped to
        ``[1 / MAX_GENERATION_FACTOR, MAX_GENERATION_FACTOR]``; None when a stage ran more than
        once (resumed: its last run is not the whole stage) or has no times.
    """
    estimated = measured = 0.0
    for rec in stage_records:
        if rec.get("runs") != 1 or not rec.get("estimate_s") or not rec.get("last_seconds"):
            return None
        estimated += max(rec["estimate_s"] - rates.load_s, 1.0)
        measured += max(rec["last_seconds"] - rates.load_s, 1.0)
    if not measured:
        return None
    return min(MAX_GENERATION_FACTOR, max(1 / MAX_GENERATION_FACTOR, estimated / measured))


#: The prompts' rate, as a share of the plan's, under which the answers stage answers fewer.
SHRINK_BELOW = 0.9
#: Magpie candidates judged per kept prompt (``magpie_tokens_per_prompt`` assumes about 1.3):
#: 1020 for 791, 1029 for 799 and 1856 for 1447 in three fresh-clone 30-minute jobs (2026-12-06).
CANDIDATES_PER_PROMPT = 1.3


def shrink_records(
    planned: int,
    *,
    available: int,
    planned_prompts: int,
    candidates: int,
    estimate_s: float,
    measured_s: float,
    load_s: float,
) -> tuple[int, float] | None:
    """Fewer records to answer when the prompts stage generated slower than planned.

    The target's generation rate as a share of the plan's is ``f = (candidates / (planned prompts
    x CANDIDATES_PER_PROMPT)) x (estimated / measured seconds)``, each time less a stage start
    (``load_s``): the stage decoded ``candidates`` in ``measured`` seconds where the plan had
    about ``planned_prompts x 1.3`` in ``estimated`` (a stage stopped at its time limit decoded
    fewer; candidates, not kept prompts, so a low kept share is not taken for a slow machine).
    The answers come from the same target, so ``f x planned`` answers fit the answers stage's
    estimate.

    Args:
        planned: the records the plan answers (what the answers stage's estimate is for).
        available: the prompts there are (a prompts stage stopped at its time limit made fewer).
        planned_prompts: the prompts the plan had the target write.
        candidates: the candidates the prompts stage decoded.
        estimate_s: the prompts stage's estimate.
        measured_s: its measured seconds (one whole run).
        load_s: the stage start in both.

    Returns:
        ``(records, f)``, or None when ``f >= SHRINK_BELOW`` (within the noise of a plan), when
        the rate fits every available prompt, or when there is nothing to measure.
    """
    if planned <= 1 or planned_prompts <= 0 or candidates <= 0 or measured_s <= 0:
        return None
    estimated = max(estimate_s - load_s, 1.0)
    measured = max(measured_s - load_s, 1.0)
    share = candidates / (planned_prompts * CANDIDATES_PER_PROMPT) * (estimated / measured)
    records = max(1, min(available, math.floor(planned * share)))
    if share >= SHRINK_BELOW or records >= available:
        return None
    return records, share


def grow_plan(
    plan: Plan,
    cfg: BudgetSettings,
    rates: Rates,
    *,
    spent_s: float,
    factor: float,
) -> Plan | None:
    """More records for a job whose data came out faster than planned.

    The plan's generation rate is the probe's, scaled (:func:`scaled_rates`), and the probe can
    be far from what the data stages then do: on a 2-core AVX2 CPU in fp32 it measured
    51 tokens/s where self-distillation ran at 130. A fast data stage leaves its time to
    training, which the training stage then spends on more epochs over the same records: 16
    over 171 records in a 30-minute job there, against the :data:`TARGET_EPOCHS` the plan
    bought data for. So once the prompts and answers are made, the generation rate is corrected
    by what they measured (``factor``, :func:`generation_factor`), and the time still left
    after ``spent_s``, the remaining fixed stages, and the planned records' own caching and
    epochs buys more records at the corrected making cost plus :data:`TARGET_EPOCHS` epochs.

    Args:
        plan: the job's plan, its data stages done.
        cfg: the job's settings.
        rates: the rates the plan was made with.
        spent_s: seconds spent so far (the probe, the prepare and data stages).
        factor: :func:`generation_factor`.

    Returns:
        The plan with more records answered (the user's prompts left out of it first, then
        Magpie's), or None when the sizes were asked
        for (``num_prompts``/``records``), the data was not faster, or fewer than
        ``max(MIN_GROWTH, GROWTH_SHARE * records)`` more records fit.
    """
    if cfg.num_prompts is not None or cfg.records is not None or plan.records is None:
        return None
    if factor <= 1.0:
        return None  # a slow data stage shortens training instead (Plan.train_time_left)
    fast = dataclasses.replace(rates, generate_tokens_per_s=rates.generate_tokens_per_s * factor)
    magpie_cost, record_cost = _record_costs(cfg.max_new_tokens, fast)
    answer = fast.answer_share * cfg.max_new_tokens
    tokens = fast.prompt_tokens + answer
    cache_cost = tokens / fast.cache_tokens_per_s
    epochs_cost = TARGET_EPOCHS * tokens / fast.train_tokens_per_s
    est = dict(plan.estimates)
    est["validation"] = (
        fast.distill_s(plan.validation, cfg.max_new_tokens) if plan.validation else 0.0
    )
    # Still to come: the two data stages again, validation, tokenize, cache and train starts,
    # then evaluation and export.
    later = 4 * fast.load_s + est["validation"] + est["tokenize"] + plan.reserve_s
    left = PLAN_SHARE * plan.budget_s - spent_s - later
    # The planned records' caching and epochs, and the sampled answers still to make.
    left -= plan.records * (cache_cost + epochs_cost) + plan.sampled * (record_cost + epochs_cost)
    left = max(left, 0.0)
    # The user's prompts left out of the plan come first, then more answers sampled to them
    # (no writing to pay for either), then Magpie's.
    unit = record_cost + epochs_cost
    spare = max(0, plan.seeds - plan.records)
    from_seeds = min(spare, math.floor(left / unit))
    left -= from_seeds * unit
    room = cfg.sampled_answers * plan.seeds - plan.sampled if from_seeds == spare else 0
    from_sampled = min(max(room, 0), math.floor(left / unit))
    left -= from_sampled * unit
    from_magpie = math.floor(left / (magpie_cost + unit)) if from_sampled == max(room, 0) else 0
    extra = from_seeds + from_magpie
    if extra + from_sampled < max(MIN_GROWTH, GROWTH_SHARE * (plan.records + plan.sampled)):
        return None
    records = plan.records + extra
    sampled = plan.sampled + from_sampled
    # The data stages' estimates become those of the runs that extend them.
    est["prompts"] = fast.load_s + from_magpie * magpie_cost
    est["distill"] = fast.load_s + extra * answer / fast.generate_tokens_per_s
    est["sampled"] = fast.load_s + sampled * answer / fast.generate_tokens_per_s if sampled else 0.0
    est["cache"] = fast.load_s + (records + sampled) * cache_cost
    making = est["prompts"] + est["distill"] + est["sampled"] + est["validation"] + est["tokenize"]
    est["train"] = max(
        MIN_TRAIN_S,
        PLAN_SHARE * plan.budget_s - spent_s - making - est["cache"] - plan.reserve_s,
    )
    return dataclasses.replace(
        plan,
        records=records,
        magpie=max(plan.magpie, records - plan.seeds),
        sampled=sampled,
        estimates=est,
    )


def speed_factor(cache_tokens: int, cache_record: dict[str, Any], rates: Rates = RATES) -> float:
    """This machine's speed against the measured one, from the cache stage's throughput.

    Caching and training are both wide matmuls in the job's dtype on the same cores, so the
    cache's tokens/s scales the training rate (a busy or faster machine plans fewer or more
    epochs).

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
    val_tokens: int = 0,
    train_speed: float | None = None,
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
        val_tokens: tokens of the validation records (``val_data``), whose features the target
            computes at each of the :data:`VALIDATIONS` validations (at the cache's rate).
        train_speed: the training rate's own correction; None: ``speed``. A job whose probe
            timed training steps on this machine passes 1.0: the probe measured training
            itself, and the cache's factor does not carry over to it. On a 2-core AVX2 CPU in
            fp32 the cache ran 1.7x its probed rate while training ran at 0.95x its own, so
            scaling training by the cache planned 1.4-1.6x the steps that fit, and the time
            limit cut two 30-minute runs' learning-rate schedules at 62 % and 74 %.

    Returns:
        ``{"epochs", "planned_steps", "train_s"}``, as kept in the job's state (a resumed run
        continues the same schedule).
    """
    train_tokens = max(1, tokens * (samples - val_samples) / max(samples, 1))
    validations_s = VALIDATIONS * val_tokens / (rates.cache_tokens_per_s * speed)
    fit = max(0.0, left_s - rates.train_overhead_s - validations_s)
    fit *= rates.train_tokens_per_s * (speed if train_speed is None else train_speed)
    epochs = round(min(30.0, max(0.1, fit / train_tokens)), 2)
    steps = train_steps or math.ceil(epochs * (samples - val_samples) / samples_per_step)
    return {"epochs": epochs, "planned_steps": steps, "train_s": round(left_s, 1)}


# --------------------------------------------------------------------------------------------
# The probe: this machine's rates
# --------------------------------------------------------------------------------------------

#: Rows x tokens of the probe's hidden-state forward, which is also its training batch.
PROBE_SHAPE = (4, 64)
#: Prompt tokens of each generated row: short, since the decode steps are what is measured.
PROBE_PROMPT_TOKENS = 4
#: Tokens generated per row by the batched generation.
PROBE_NEW_TOKENS = 4
#: Tokens of the single-stream decoding (the evaluation's plain and speculative streams).
PROBE_EVAL_TOKENS = 8
#: Each measurement runs at least twice and until it has run this long (at most
#: :data:`PROBE_MAX_REPS` times), and keeps its fastest run: a one-off stall (another process,
#: a page fault) is not taken for the machine's speed. Two runs on a CPU, five on a GPU.
PROBE_MIN_REPS = 2
PROBE_MIN_S = 0.3
PROBE_MAX_REPS = 5
#: Rows the data stages may decode together on a GPU (:func:`generation_batch_size`).
GPU_BATCHES = (64, 128, 256)
#: Rows on a CPU: 64 gives ~10x the tokens/s of one row on 2 cores; more add little.
CPU_BATCH = 64


@dataclass(frozen=True)
class Probe:
    """What :func:`probe_rates` measured, and the rates it gives.

    Attributes:
        rates: the plan's rates: :data:`RATES` with the probed ones scaled (module docstring).
        measured: tokens/s of each probe, keyed by the :class:`Rates` field it scales.
        seconds: the probe's wall time, the target's load included.
        device: :func:`~draftsmith.train.device.device_facts` of where it ran.
        dtype: the dtype its single-stream decoding ran in (the evaluation's).
        batch_size: rows of its batched generation: what the data stages decode together.
        target_dtype: the dtype the target was loaded in for the generation, the hidden states
            and the training steps (these autocast to bf16 only when it is bf16).
        eval_measured: tokens/s of the single-stream decoding in each dtype, when it compared
            fp32 and bf16 (``compare_eval_dtypes``; ``dtype`` is then the faster); else empty.
    """

    rates: Rates
    measured: dict[str, float]
    seconds: float
    device: dict[str, Any]
    dtype: str
    batch_size: int
    target_dtype: str = REFERENCE_DTYPE
    eval_measured: dict[str, float] = field(default_factory=dict)

    def eval_rates(self) -> dict[str, float]:
        """The evaluation's tokens/s per stream in each dtype compared (scaled as ``rates``)."""
        return {d: _scaled_eval(v) for d, v in self.eval_measured.items()}

    def rates_evaluating(self, dtype: str) -> Rates:
        """``rates`` with the evaluation's rate for ``dtype`` (measured when compared)."""
        if dtype == self.dtype or dtype not in self.eval_measured:
            return self.rates
        return dataclasses.replace(self.rates, eval_tokens_per_s=self.eval_rates()[dtype])

    def record(self) -> dict[str, Any]:
        """The probe as the job's state keeps it (``quickstart.json``'s ``plan.probe``)."""
        return {
            "probed": True,
            "device": dict(self.device),
            "dtype": self.dtype,
            "target_dtype": self.target_dtype,
            "batch_size": self.batch_size,
            # Unrounded: a rerun rebuilds exactly this probe, so the same command plans the same.
            "seconds": self.seconds,
            "measured_tokens_per_s": dict(self.measured),
            "eval_tokens_per_s_by_dtype": dict(self.eval_measured),
            "reference_tokens_per_s": dict(PROBE_REFERENCE),
            "rates": dataclasses.asdict(self.rates),
        }

    @classmethod
    def from_record(cls, record: Any) -> Probe | None:
        """The probe a job's state recorded, or None when there is none (or it is unreadable)."""
        if not isinstance(record, dict) or record.get("probed") is not True:
            return None
        try:
            return cls(
                rates=Rates(**record["rates"]),
                measured={k: float(v) for k, v in record["measured_tokens_per_s"].items()},
                seconds=float(record["seconds"]),
                device=dict(record["device"]),
                dtype=str(record["dtype"]),
                batch_size=int(record["batch_size"]),
                # A probe recorded before the dtype was a setting ran its target in bf16.
                target_dtype=str(record.get("target_dtype", REFERENCE_DTYPE)),
                # A probe recorded before the comparison timed the evaluation in one dtype.
                eval_measured={
                    str(k): float(v)
                    for k, v in (record.get("eval_tokens_per_s_by_dtype") or {}).items()
                },
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


def scaled_rates(measured: dict[str, float], load_s: float = 0.0) -> Rates:
    """:data:`RATES` with each probed rate scaled by ``measured / PROBE_REFERENCE``.

    Args:
        measured: tokens/s of the probes (:data:`PROBE_REFERENCE`'s keys).
        load_s: seconds the target took to load; a stage's start is never counted shorter than
            the reference's (imports included), but a slower load (a larger target) counts.
    """
    changes = {k: getattr(RATES, k) * measured[k] / PROBE_REFERENCE[k] for k in PROBE_REFERENCE}
    return dataclasses.replace(RATES, **changes, load_s=max(RATES.load_s, load_s))


def _scaled_eval(measured: float) -> float:
    key = "eval_tokens_per_s"
    return getattr(RATES, key) * measured / PROBE_REFERENCE[key]


def generation_batch_size(model: Any, device: torch.device, seq_tokens: int) -> int:
    """Rows Magpie and self-distillation decode together on ``device``.

    On the CPU :data:`CPU_BATCH`. On a GPU a decode step of a small target costs about the same
    for 64 rows as for 256 (it is bound by kernel launches, not arithmetic), so the most rows of
    :data:`GPU_BATCHES` whose KV cache (``seq_tokens`` per row, in the model's dtype) fits in
    half the free memory.

    Args:
        model: the target (its config and dtype give the KV cache's size per token).
        device: where the stages run.
        seq_tokens: the longest row (prompt + answer) to leave room for.
    """
    if device.type != "cuda":
        return CPU_BATCH
    import torch

    c = model.config
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    size = torch.empty((), dtype=getattr(model, "dtype", torch.bfloat16)).element_size()
    per_row = 2 * int(c.num_hidden_layers) * kv_heads * head_dim * size * seq_tokens  # K and V
    free, _ = torch.cuda.mem_get_info(device)
    fits = [b for b in GPU_BATCHES if b * per_row <= free / 2]
    return max(fits, default=GPU_BATCHES[0])


def probe_rates(
    target: str | Path | None,
    device: torch.device,
    *,
    dtype: torch.dtype | None = None,
    eval_dtype: torch.dtype | None = None,
    compare_eval_dtypes: bool = False,
    batch_size: int | None = None,
    seq_tokens: int = 512,
    ttt_steps: int = 3,
    draft_vocab_size: int = 8192,
    cache_dir: str | Path | None = None,
) -> Probe:
    """Measure this machine's rates on ``device``: a few seconds with the target loaded.

    Loads the target in ``dtype`` (as the data stages and the cache do) and times, on
    ``device``: a batched greedy generation (``batch_size`` rows, :data:`PROBE_NEW_TOKENS`
    tokens each), a forward with hidden states over :data:`PROBE_SHAPE` (copied to the host, as
    the cache does), EAGLE-3 training steps over those hidden states (``ttt_steps``, AdamW, bf16
    autocast when ``dtype`` is bf16, as the train stage's ``mixed_precision``) and
    single-stream decoding in ``eval_dtype``, or with ``compare_eval_dtypes`` in both fp32 and
    bf16 (interleaved runs, a copy of the target in the other dtype; the whole probe took
    14.9 s with SmolLM2 on a 2-core AVX2 CPU), the faster becoming the evaluation's. Every reading is taken with a
    :class:`~draftsmith.train.device.DeviceTimer` and is the fastest of at least two runs (a
    one-off stall is not the machine's speed). About 5.5 s on 2 idle CPU cores with
    SmolLM2-135M-Instruct, the target's load included; a second or two on a GPU.

    Args:
        target: the prepared target (a directory, or what ``load_target`` accepts).
        device: where the stages will run (resolved: ``cpu``, ``cuda:0``, ...).
        dtype: the dtype the stages' target computes in (default bf16, the reference's).
        eval_dtype: the evaluation's dtype (default ``dtype``).
        compare_eval_dtypes: time the single-stream decoding in fp32 and bf16 and evaluate in the
            faster (``eval_dtype`` wins a tie).
        batch_size: rows of the batched generation; None: :func:`generation_batch_size`.
        seq_tokens: the longest generated row to leave memory for (None batch size only).
        ttt_steps: EAGLE-3 training-time-test steps of the training steps.
        draft_vocab_size: the drafter's vocabulary (capped at the target's).
        cache_dir: draftsmith cache root of the target.

    Returns:
        The :class:`Probe`; its ``rates`` are what the plan is sized by.
    """
    import torch

    from ..device import DeviceTimer, device_facts
    from ..target_model.load import load_target

    dtype = dtype or torch.bfloat16
    eval_dtype = eval_dtype or dtype
    timer = DeviceTimer(device)
    start = timer.now()
    model, _ = load_target(target, cache_dir=cache_dir, dtype=dtype, device=device, quiet=True)
    load_s = timer.now() - start
    try:
        batch = batch_size or generation_batch_size(model, device, seq_tokens)
        eval_dtypes = [eval_dtype]
        if compare_eval_dtypes:
            eval_dtypes += [d for d in (torch.float32, torch.bfloat16) if d != eval_dtype]
        measured, by_dtype = _measure(
            model, device, timer, batch, dtype, eval_dtypes, ttt_steps, draft_vocab_size
        )
        eval_dtype = max(eval_dtypes, key=lambda d: by_dtype[d])  # the first on a tie
        measured["eval_tokens_per_s"] = by_dtype[eval_dtype]
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the stages load their own copy next
    return Probe(
        rates=scaled_rates(measured, load_s),
        measured=measured,
        seconds=timer.now() - start,
        device=device_facts(device),
        dtype=str(eval_dtype).removeprefix("torch."),
        batch_size=batch,
        target_dtype=str(dtype).removeprefix("torch."),
        eval_measured=(
            {str(d).removeprefix("torch."): v for d, v in by_dtype.items()}
            if compare_eval_dtypes
            else {}
        ),
    )


def _fastest(run: Callable[[], Any], timer: Any) -> tuple[float, Any]:
    """``(seconds of the fastest run, the last result)`` of ``run`` repeated per the probe's
    rule (:data:`PROBE_MIN_REPS`, :data:`PROBE_MIN_S`, :data:`PROBE_MAX_REPS`)."""
    times: list[float] = []
    result = None
    while len(times) < PROBE_MIN_REPS or (len(times) < PROBE_MAX_REPS and sum(times) < PROBE_MIN_S):
        t0 = timer.now()
        result = run()
        times.append(timer.now() - t0)
    return max(min(times), 1e-9), result


def _fastest_each(runs: dict[Any, Callable[[], Any]], timer: Any) -> dict[Any, float]:
    """Seconds of the fastest run of each of ``runs``, their runs interleaved (a slow spell of
    the machine slows them alike), each repeated per :func:`_fastest`'s rule."""
    times: dict[Any, list[float]] = {k: [] for k in runs}

    def more(t: list[float]) -> bool:
        return len(t) < PROBE_MIN_REPS or (len(t) < PROBE_MAX_REPS and sum(t) < PROBE_MIN_S)

    while any(more(t) for t in times.values()):
        for k, run in runs.items():
            if more(times[k]):
                t0 = timer.now()
                run()
                times[k].append(timer.now() - t0)
    return {k: max(min(t), 1e-9) for k, t in times.items()}


def _measure(
    model: Any,
    device: torch.device,
    timer: Any,
    batch: int,
    dtype: torch.dtype,
    eval_dtypes: list[torch.dtype],
    ttt_steps: int,
    draft_vocab_size: int,
) -> tuple[dict[str, float], dict[torch.dtype, float]]:
    """The four probes on a target loaded in ``dtype``: tokens/s keyed as
    :data:`PROBE_REFERENCE` (all but the evaluation's), and the single-stream decoding's
    tokens/s in each of ``eval_dtypes``."""
    import torch

    from ...heads.families import cache_layers
    from ..datagen.generation import generate_batch
    from ..features.source import run_target

    config = model.config
    rows, width = PROBE_SHAPE
    # Fixed ids drawn on the CPU (the same probe on every device), then moved to the device.
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, int(config.vocab_size), (rows, width), generator=gen).to(device)
    with torch.no_grad():
        model(input_ids=ids[:1, :8])  # the first forward sets up kernels and the allocator

    # The hidden-state cache: one forward with every hidden state, the cached layers to the host.
    layers = cache_layers("eagle3", int(config.num_hidden_layers))

    def cache_forward() -> tuple[torch.Tensor, ...]:
        with torch.no_grad():  # not inference_mode: the training probe reads these tensors
            hidden = run_target(model, ids, None)
            torch.stack([hidden[layer] for layer in layers], dim=2).cpu()
        return hidden

    cache_s, hidden = _fastest(cache_forward, timer)

    # Batched generation, as Magpie and self-distillation decode (greedy, never stopping early).
    prompt = ids[0, :PROBE_PROMPT_TOKENS].tolist()
    gen_s, _ = _fastest(
        lambda: generate_batch(model, [prompt] * batch, max_new_tokens=PROBE_NEW_TOKENS), timer
    )

    train_s = _train_seconds(
        model, device, timer, ids, hidden, ttt_steps, draft_vocab_size, autocast=dtype
    )
    del hidden

    # Single-stream decoding in the evaluation's dtype(s): one dtype converts the target in
    # place; two decode on the target and a copy in the other dtype, their runs interleaved.
    if eval_dtypes == [eval_dtypes[0]] and eval_dtypes[0] != dtype:
        model.to(eval_dtypes[0])
    models = {d: model if model.dtype == d else copy.deepcopy(model).to(d) for d in eval_dtypes}
    for m in models.values():
        if m.dtype != dtype:
            generate_batch(m, [prompt], max_new_tokens=2)  # the new dtype's kernels
    eval_s = _fastest_each(
        {
            d: functools.partial(generate_batch, m, [prompt], max_new_tokens=PROBE_EVAL_TOKENS)
            for d, m in models.items()
        },
        timer,
    )
    del models
    measured = {
        "generate_tokens_per_s": batch * PROBE_NEW_TOKENS / gen_s,
        "cache_tokens_per_s": rows * width / cache_s,
        "train_tokens_per_s": rows * width / train_s,
    }
    return measured, {d: PROBE_EVAL_TOKENS / s for d, s in eval_s.items()}


def _train_seconds(
    model: Any,
    device: torch.device,
    timer: Any,
    ids: torch.Tensor,
    hidden: tuple[torch.Tensor, ...],
    ttt_steps: int,
    draft_vocab_size: int,
    *,
    autocast: torch.dtype,
) -> float:
    """Seconds of the fastest EAGLE-3 training step over ``hidden`` (the target's hidden states
    of ``ids``), as the train stage runs it: fp32 drafter, clipping, AdamW, and autocast to
    ``autocast`` when it is bf16 (``mixed_precision: bf16``; fp32: ``no``, no autocast)."""
    import torch

    from ...heads.eagle import EagleConfig, build_drafter
    from ..objectives.eagle_ttt import eagle3_ttt_loss

    config = model.config
    eagle = EagleConfig.from_target(
        config, 3, draft_vocab_size=min(draft_vocab_size, int(config.vocab_size))
    )
    drafter = build_drafter(model, eagle, seed=0).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    needed = sorted({*eagle.feature_layers, eagle.target_num_layers})
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
        "hidden_states": {layer: hidden[layer] for layer in needed},
    }
    lm_head = model.get_output_embeddings()
    bf16 = autocast == torch.bfloat16

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _ = eagle3_ttt_loss(drafter, batch, lm_head, steps=ttt_steps)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first step allocates the optimizer's state
    return _fastest(step, timer)[0]


def _eval_note(plan: Plan) -> str:
    """``; evaluation in D: plain decoding X vs Y tok/s`` when the probe compared the dtypes."""
    other = [d for d in plan.eval_rates if d != plan.eval_dtype]
    if plan.eval_dtype not in plan.eval_rates or not other:
        return ""
    return (
        f"; evaluation in {plan.eval_dtype}: plain decoding "
        f"{plan.eval_rates[plan.eval_dtype]:.1f} vs {plan.eval_rates[other[0]]:.1f} tok/s"
    )


def plan_lines(plan: Plan, cfg: Any, out: str) -> list[tuple[str, str | None]]:
    """What the job prints before its first stage: the target, budget and output, the plan's
    dtype, sizes and estimated times, and a note when they exceed the budget or come from
    reference rates of another dtype.

    Args:
        plan: the job's plan.
        cfg: the quickstart's settings (``target``, ``budget_minutes``, ``max_new_tokens``,
            ``dtype``: ``auto`` is shown as such beside the dtype it resolved to).
        out: the output directory as shown.

    Returns:
        ``(text, style)`` pairs, the style a rich one or None.
    """
    answered = plan.records if plan.records is not None else plan.seeds + plan.magpie
    answered = min(answered, plan.seeds + plan.magpie)
    lines: list[tuple[str, str | None]] = [
        (
            f"quickstart: train an EAGLE-3 drafter for {cfg.target or 'SmolLM2-135M-Instruct'}"
            f" in {cfg.budget_minutes:g} min -> {out}",
            "bold",
        ),
        (
            f"plan ({plan.dtype}{' by auto' if getattr(cfg, 'dtype', None) == 'auto' else ''}"
            f"{_eval_note(plan)}): "
            f"{f'{plan.seeds} of your prompts + ' if plan.seeds else ''}{plan.magpie} prompts "
            "written by the target, "
            f"{answered} answered ({cfg.max_new_tokens} tokens max)"
            + (f" + {plan.sampled} more answers to yours sampled at T > 0" if plan.sampled else "")
            + " and trained on, "
            f"{plan.validation} validation prompts answered apart, training "
            f"~{minutes(plan.estimates['train'])}, {plan.eval_prompts} held-out prompts "
            f"evaluated; estimated {minutes(plan.total_s)} in all",
            None,
        ),
    ]
    if plan.total_s > plan.budget_s:
        lines.append(
            (
                f"note: the estimate exceeds the {cfg.budget_minutes:g}-min budget: the "
                "sizes asked for need more time than it gives",
                "yellow",
            )
        )
    if plan.reference_rates and plan.dtype != REFERENCE_DTYPE:
        lines.append(
            (
                f"note: --no-probe plans with the reference rates, measured in {REFERENCE_DTYPE} "
                f"on a CPU with AVX512-BF16; none were measured in {plan.dtype}, so the "
                "estimates are the bf16 ones (drop --no-probe to measure this machine)",
                "yellow",
            )
        )
    return lines
