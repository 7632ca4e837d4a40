"""The main job, end to end: ``draftsmith quickstart`` trains, measures and exports a drafter.

Launch::

    draftsmith quickstart                                  # SmolLM2-135M-Instruct, 30-min budget
    draftsmith quickstart --budget-minutes 120 --prompts my_prompts.jsonl
    draftsmith quickstart --target path/to/hf_model_dir --out-dir runs/qs_mine

Eight stages, each one existing command called through the CLI dispatch (so the command a stage
prints is exactly what reruns it alone), each writing its own path under ``--out-dir``::

    [1/8] prepare target      draftsmith prepare-target              (cached target directory)
    [2/8] training prompts    draftsmith data prompts                data/prompts.jsonl
    [3/8] self-distil         draftsmith data distill                data/answers.jsonl
    [4/8] tokenize            draftsmith data tokenize               data/tokenized/
    [5/8] hidden states       draftsmith data cache                  data/cache/
    [6/8] train EAGLE-3       draftsmith train eagle                 eagle3/ (best/, drafter/)
    [7/8] evaluate            draftsmith evaluate                    eval.json
    [8/8] export              draftsmith export --format speculators export/

then the summary: the results table, ``plots/``, ``summary.md`` (everything printed, plus the
``vllm serve`` command line) and ``quickstart.json`` (stage status, wall time per stage, the
plan, command, versions, machine).

Prompts: the project's 32 shipped ``train`` prompts and an optional ``--prompts`` file are the
Magpie seeds, then the target writes the rest (``train/data/magpie.py``); the shipped held-out prompts
are excluded from training and are what the evaluation decodes. Settings are those of
``recipes/configs/eagle3_smollm2.yaml``, which trains fastest on a CPU: bf16 target, bf16
autocast, an offline hidden-state cache, 3 TTT steps, lr 6e-4; evaluation in bf16 with plain
decoding in both dtypes timed alongside.

**Budget** (:func:`make_plan`): the data sizes follow from ``--budget-minutes`` and the rates
measured on a 2-core CPU (:data:`RATES`): data making gets 60 % of what is left after the fixed
costs and the evaluation reserve, training the rest. The training stage is sized when it starts,
from the time actually spent so far (the epochs that fit, and ``max_minutes`` as a hard stop), so
a slow data stage shortens training instead of overrunning the budget.

**Resume**: a rerun of the same command skips every stage whose output is complete (each stage's
own marker: the ``.meta`` of prompts and answers, the tokenized dataset's files, the cache's
``manifest.json``, the recipe's ``drafter/``, ``eval.json``, the export's ``config.json``) and
whose settings and inputs are unchanged (a key per stage, chained through the earlier stages'
keys, in ``quickstart.json``). A stage killed midway is rerun and continues its own output:
Magpie and self-distillation resume their files, the cache its shards, the recipe its newest
checkpoint. Changed settings rerun the stage and every later one: a larger budget extends the
prompts and answers already made; other changes start that stage over. ``--overwrite`` starts
the whole job over.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import json
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from draftsmith.train.config import (
    add_config_arguments,
    cfg_field,
    config_from_args,
    config_to_dict,
)
from draftsmith.train.errors import RunError, UsageError, cli_main

__all__ = [
    "RATES",
    "Plan",
    "QuickstartConfig",
    "Rates",
    "main",
    "make_plan",
    "vllm_serve_command",
]

STATE_FILE = "quickstart.json"
SUMMARY_FILE = "summary.md"  # not README.md: `--out-dir .` must not replace a project's own
STATE_FORMAT = "draftsmith-quickstart"
STATE_VERSION = 1
STAGE_NAMES = ("prepare", "prompts", "distill", "tokenize", "cache", "train", "evaluate", "export")
NUM_STAGES = len(STAGE_NAMES)

# Paths under --out-dir, one per stage (and what --overwrite removes; nothing else is touched).
PROMPTS = "data/prompts.jsonl"
ANSWERS = "data/answers.jsonl"
TOKENIZED = "data/tokenized"
CACHE = "data/cache"
RUN = "eagle3"
REPORT = "eval.json"
EXPORT = "export"
PLOTS = "plots"
OWNED = (
    *(f"{p}{s}" for p in (PROMPTS, ANSWERS) for s in ("", ".meta", ".lock")),
    TOKENIZED,
    CACHE,
    RUN,
    REPORT,
    EXPORT,
    PLOTS,
    SUMMARY_FILE,
    STATE_FILE,
)

# The shipped EAGLE-3 recipe settings (recipes/configs/eagle3_smollm2.yaml): the ones that train
# fastest on this CPU (bench/train_throughput.json) and learn in a short budget.
TRAIN_SETTINGS = {
    "version": 3,
    "hidden_states": "offline",
    "target_dtype": "bf16",
    "mixed_precision": "bf16",
    "ttt_steps": 3,
    "ttt_decay": 0.8,
    "lr": 6e-4,
    "warmup_ratio": 0.03,
    "max_grad_norm": 0.5,
    "batch_size": 4,
    "grad_accum": 2,
    "max_length": 512,
    "keep_checkpoints": 2,
}
DRAFT_VOCAB_SIZE = 8192  # the shipped config's: ~97 % of SmolLM2's answer tokens
MAGPIE_MAX_NEW_TOKENS = 64  # a user message; longer candidates are cut ("unfinished") early
MAGPIE_ATTEMPTS_PER_PROMPT = 2.5  # stop at a kept share under 40 %: the budget, not the count
BATCH_SIZE = 64  # prompts decoded together by Magpie and self-distillation (~90 tok/s in bf16)
SHARD_MB = 64  # small cache shards: a killed cache build loses at most one shard's work


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


@dataclass
class QuickstartConfig:
    """Settings of ``draftsmith quickstart``."""

    budget_minutes: float = cfg_field(
        30.0,
        help="wall-clock budget of the whole job; data sizes and training time follow from it",
        gt=0,
    )
    target: str | None = cfg_field(
        None,
        help="target: a local HF model dir, a .gguf file, or None for SmolLM2-135M-Instruct "
        "(as `draftsmith prepare-target` resolves it)",
    )
    prompts: Path | None = cfg_field(
        None,
        help="your prompt file to train on too (JSONL/JSON/parquet; its train split when the "
        "records carry one), added to the shipped prompts as Magpie seeds",
    )
    out_dir: Path = cfg_field(Path("runs/quickstart"), help="every stage's output goes here")
    num_prompts: int | None = cfg_field(
        None,
        help="prompts the target writes (Magpie); None: what the budget leaves after the "
        "shipped prompts and yours",
        ge=0,
    )
    records: int | None = cfg_field(
        None,
        help="prompts answered and trained on in all (shipped + yours + Magpie, in that order); "
        "None: from the budget (all of them when --num-prompts is given)",
        ge=1,
    )
    eval_prompts: int | None = cfg_field(
        None,
        help="held-out prompts evaluated (of the 32 shipped); None: from the budget, 4 to 16",
        ge=1,
        le=32,
    )
    k: int = cfg_field(
        3,
        help="draft tokens per step, evaluated and advertised in the export: a short-trained "
        "EAGLE-3 (3 TTT steps) rarely gets positions 4-5 accepted, and each costs a draft step",
        ge=1,
    )
    max_new_tokens: int = cfg_field(
        128, help="answer length: self-distilled answers and evaluated outputs", ge=1
    )
    dtype: str = cfg_field(
        "bfloat16",
        help="evaluation dtype of the target and drafter (plain decoding is timed in both): "
        "bfloat16 pays off on CPUs with AVX512-BF16/AMX and GPUs; float32 elsewhere",
        choices=["bfloat16", "float32"],
    )
    train_steps: int | None = cfg_field(
        None, help="optimizer steps; None: the epochs that fit the training time", ge=1
    )
    seed: int = cfg_field(0, help="seed of the Magpie prompts and of training")
    threads: int | None = cfg_field(None, help="torch CPU threads per stage", ge=1)
    progress: bool = cfg_field(True, help="show each stage's progress bars")
    overwrite: bool = cfg_field(
        False, help="start over: delete the quickstart outputs in out_dir first"
    )


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


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


def _record_costs(max_new_tokens: int, rates: Rates) -> tuple[float, float]:
    """Seconds per record: (writing its prompt with Magpie, answering + caching it)."""
    answer = rates.answer_share * max_new_tokens
    magpie = rates.magpie_tokens_per_prompt / rates.generate_tokens_per_s
    rest = answer / rates.generate_tokens_per_s
    rest += (rates.prompt_tokens + answer) / rates.cache_tokens_per_s
    return magpie, rest


def make_plan(cfg: QuickstartConfig, seeds: int, rates: Rates = RATES) -> Plan:
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
    est["distill"] = rates.load_s + answered * answer / rates.generate_tokens_per_s
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


def vllm_serve_command(target: str | Path, export: str | Path, k: int) -> str:
    """The ``vllm serve`` line for an EAGLE-3 speculators export (as scripts/vllm_check.py
    builds ``speculative_config``: method, num_speculative_tokens, model)."""
    spec = {"method": "eagle3", "num_speculative_tokens": k, "model": str(export)}
    return shlex.join(["vllm", "serve", str(target), "--speculative-config", json.dumps(spec)])


# --------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------


@dataclass
class Stage:
    """One stage: the command it runs and how to tell it is done.

    Attributes:
        name: key in ``quickstart.json``.
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


def _hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _meta(path: Path) -> dict[str, Any]:
    """The ``<path>.meta`` a data command writes (``{}`` when missing or unreadable)."""
    try:
        return json.loads(path.with_name(path.name + ".meta").read_text())
    except (OSError, ValueError):
        return {}


def _flags(**values: Any) -> list[str]:
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


def _minutes(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 600 else f"{seconds / 60:.0f} min"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _rel(path: Path) -> str:
    """``path`` relative to the working directory when below it (shorter commands)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


class _Interrupted(Exception):
    """A stage stopped on Ctrl-C/SIGTERM (its output is resumable)."""


def _fresh_accelerate_state() -> None:
    """Forget accelerate's process-wide state between in-process stages.

    The cache builds a ``PartialState`` and the recipe an ``Accelerator`` with bf16 mixed
    precision; accelerate keeps both for the life of the process and refuses an Accelerator
    whose settings differ from an earlier one (the conftest does the same between tests).
    """
    with contextlib.suppress(ImportError, AttributeError):
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


class Quickstart:
    """One invocation of the job: builds each stage when it is reached, runs or skips it."""

    def __init__(self, cfg: QuickstartConfig, argv: list[str]) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        # The command that resumes this job (without --overwrite: a rerun must not start over).
        resume_argv = [a for a in argv if a not in ("--overwrite", "--no-overwrite")]
        self.command = shlex.join(["draftsmith", "quickstart", *resume_argv])
        self.state: dict[str, Any] = {}
        self.prev_key = self.prev_strict = ""
        self.this_run: dict[str, str] = {}
        self.target_path: Path | None = None
        self.plan: Plan | None = None
        self.user_seeds = 0
        self.console = _console()

    # --- state ------------------------------------------------------------------------------

    def _load_state(self) -> None:
        path = self.out / STATE_FILE
        state: dict[str, Any] = {}
        if path.is_file():
            try:
                state = json.loads(path.read_text())
            except ValueError:
                state = {}  # unreadable: every stage checks its own output again
            if state.get("format") != STATE_FORMAT:
                state = {}
        state.setdefault("format", STATE_FORMAT)
        state.setdefault("version", STATE_VERSION)
        state.setdefault("stages", {})
        state.setdefault("invocations", [])
        self.state = state

    def _save_state(self) -> None:
        from draftsmith.train.runinfo import write_json_atomic

        stages = self.state["stages"]
        self.state["total_seconds"] = round(sum(s.get("seconds", 0.0) for s in stages.values()), 1)
        write_json_atomic(self.out / STATE_FILE, self.state)

    def _spent_s(self, before: str | None = None) -> float:
        """Seconds spent on the outputs in use (all invocations), of the stages before
        ``before`` in job order (all stages when None)."""
        stages = self.state["stages"]
        names = list(STAGE_NAMES[: STAGE_NAMES.index(before)] if before else STAGE_NAMES)
        return sum(stages.get(name, {}).get("seconds", 0.0) for name in names)

    # --- running one stage --------------------------------------------------------------------

    def run_stage(self, index: int, stage: Stage) -> None:
        """Skip ``stage`` if its output is complete and unchanged; else run (or resume) it."""
        from draftsmith.recipes import cli

        rec = self.state["stages"].setdefault(stage.name, {})
        key = _hash(stage.name, stage.identity, self.prev_key)
        # A stage that can extend its output (strict given) may continue over an earlier stage's
        # extended output; any other stage starts over when anything before it changed.
        if stage.strict is None:
            strict = _hash(stage.name, stage.identity, key)
        else:
            strict = _hash(stage.name, stage.strict, self.prev_strict)
        self.prev_key, self.prev_strict = key, strict
        header = f"[{index}/{NUM_STAGES}] {stage.title}"
        if rec.get("status") == "done" and rec.get("key") == key and stage.complete():
            self._say(f"{header}: done before, skipped ({_rel(stage.output)})", style="dim")
            self.this_run[stage.name] = "skipped"
            return
        # Same settings as the output on disk (or no record of it): the stage continues its own
        # output. Other settings: it starts over.
        restart = bool(rec.get("strict")) and rec.get("strict") != strict
        argv = stage.argv + (list(stage.restart) if restart else [])
        resume_cmd = shlex.join(["draftsmith", *stage.argv])
        self._say(f"{header} (est. {_minutes(stage.estimate_s)})", style="bold")
        self._say(f"      $ {shlex.join(['draftsmith', *argv])}", style="dim")
        rec.update(
            status="running",
            key=key,
            strict=strict,
            command=resume_cmd,
            output=_rel(stage.output),
            started=_now(),
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
            code = cli.main(argv)
        except KeyboardInterrupt:
            self._finish(rec, start, "interrupted")
            raise _Interrupted(header) from None
        except BaseException as exc:
            self._finish(rec, start, "failed", error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            gc.collect()  # each stage loads its own target: free the last one first
        note = stage.accept(code) if (code and stage.accept is not None) else None
        if code and note is None:
            self._finish(rec, start, "failed", error=f"exit code {code}")
            kind = UsageError if code == 2 else RunError
            raise kind(
                f"stage {header} failed (exit {code}; its error is above). Rerun only this "
                f"stage with: {resume_cmd} -- or rerun the quickstart to continue from it: "
                f"{self.command}"
            )
        if stage.after is not None:
            note = {**(note or {}), **stage.after()}
        if not stage.complete():
            # The recipe returns 0 after Ctrl-C with a checkpoint but no drafter/.
            self._finish(rec, start, "interrupted")
            raise _Interrupted(header)
        self._finish(rec, start, "done", **(note or {}))

    def _finish(self, rec: dict[str, Any], start: float, status: str, **extra: Any) -> None:
        seconds = time.monotonic() - start
        rec["status"] = status
        rec["finished"] = _now()
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

    # --- the job ------------------------------------------------------------------------------

    def run(self) -> int:
        from draftsmith.train.runinfo import output_lock, run_info

        cfg = self.cfg
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UsageError(
                "quickstart runs in one process; to train on several, run its stages "
                "(listed in docs/quickstart.md) with accelerate launch"
            )
        seeds_hash, seeds = self._check_inputs()
        self.out.mkdir(parents=True, exist_ok=True)
        with output_lock(self.out / "quickstart", "quickstart run"):
            if cfg.overwrite:
                self._remove_outputs()
            self._load_state()
            info = run_info()
            self.state.update(
                {k: info[k] for k in ("command", "versions", "git_commit", "machine", "date")}
            )
            self.state["quickstart_command"] = self.command
            self.state["config"] = config_to_dict(cfg)
            self.state["invocations"].append({"date": info["date"], "command": self.command})
            self.plan = make_plan(cfg, seeds)
            self.state["plan"] = {
                "budget_minutes": cfg.budget_minutes,
                "seed_prompts": seeds,
                "magpie_prompts": self.plan.magpie,
                "records": self.plan.records,
                "eval_prompts": self.plan.eval_prompts,
                "estimated_seconds": {k: round(v, 1) for k, v in self.plan.estimates.items()},
                "rates": dataclasses.asdict(RATES),
            }
            self._save_state()
            self._intro()
            builders = [
                self._prepare,
                lambda: self._prompts(seeds_hash),
                self._distill,
                self._tokenize,
                self._cache,
                self._train,
                self._evaluate,
                self._export,
            ]
            try:
                for index, build in enumerate(builders, start=1):
                    self.run_stage(index, build())
            except _Interrupted as exc:
                self._save_state()
                print(
                    f"\nstopped during {exc}; its output is kept and resumes: {self.command}",
                    file=sys.stderr,
                )
                return 130
            summary = self._summary()
            self.state["summary"] = summary
            self._save_state()
        return 0

    def _check_inputs(self) -> tuple[str, int]:
        """Read the prompt sources now, so a bad file fails before any model loads."""
        from draftsmith.train.data.magpie import load_seed_prompts
        from draftsmith.train.data.prompts import DEFAULT_PROMPTS

        shipped = load_seed_prompts(DEFAULT_PROMPTS, id_prefix="shipped", source="shipped")
        digest = _file_hash(DEFAULT_PROMPTS)
        if self.cfg.prompts is not None:
            if not Path(self.cfg.prompts).exists():
                raise UsageError(f"prompts: {self.cfg.prompts} does not exist")
            mine = load_seed_prompts(self.cfg.prompts, id_prefix="input0", source="input")
            self.user_seeds = len(mine)
            if not mine:
                raise UsageError(f"prompts: {self.cfg.prompts} holds no training prompts")
            path = Path(self.cfg.prompts)
            digest += ":" + (_file_hash(path) if path.is_file() else str(path.resolve()))
        return digest, len(shipped) + self.user_seeds

    def _remove_outputs(self) -> None:
        """``--overwrite``: delete this job's outputs (and nothing else) in ``out_dir``."""
        if not (self.out / STATE_FILE).is_file() and any(
            (self.out / name).exists() for name in OWNED
        ):
            raise UsageError(
                f"overwrite: {self.out} has no {STATE_FILE}, so its files are not a quickstart's; "
                "choose another --out-dir"
            )
        for name in OWNED:
            path = self.out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def _intro(self) -> None:
        plan = self.plan
        assert plan is not None
        answered = plan.records if plan.records is not None else plan.seeds + plan.magpie
        answered = min(answered, plan.seeds + plan.magpie)
        self._say(
            f"quickstart: train an EAGLE-3 drafter for {self.cfg.target or 'SmolLM2-135M-Instruct'}"
            f" in {self.cfg.budget_minutes:g} min -> {_rel(self.out)}",
            style="bold",
        )
        self._say(
            f"plan: {plan.seeds} seed prompts + {plan.magpie} written by the target, "
            f"{answered} answered ({self.cfg.max_new_tokens} tokens max), training "
            f"~{_minutes(plan.estimates['train'])}, {plan.eval_prompts} held-out prompts "
            f"evaluated; estimated {_minutes(plan.total_s)} in all",
        )
        if plan.total_s > plan.budget_s:
            self._say(
                f"note: the estimate exceeds the {self.cfg.budget_minutes:g}-min budget: the "
                "sizes asked for need more time than it gives",
                style="yellow",
            )

    # --- stage builders -----------------------------------------------------------------------

    def _common(self) -> dict[str, Any]:
        return {"target": self.cfg.target}

    def _runtime(self) -> dict[str, Any]:
        return {"threads": self.cfg.threads, "progress": None if self.cfg.progress else False}

    def _prepare(self) -> Stage:
        from draftsmith.train.target.load import prepare_target

        def complete() -> bool:
            recorded = self.state["stages"].get("prepare", {}).get("target_path")
            if self.target_path is None and recorded:
                self.target_path = Path(recorded)
            return self.target_path is not None and (self.target_path / "config.json").is_file()

        def after() -> dict[str, Any]:
            # Answers from the cache the command just filled (well under a second).
            self.target_path = prepare_target(self.cfg.target, quiet=True).resolve()
            return {"target_path": str(self.target_path)}

        argv = ["prepare-target", *([self.cfg.target] if self.cfg.target else [])]
        return Stage(
            name="prepare",
            title=f"prepare target {self.cfg.target or '(SmolLM2-135M-Instruct)'}",
            argv=argv,
            output=Path(self.cfg.target or "~/.cache/draftsmith/targets"),
            complete=complete,
            identity={"target": self.cfg.target},
            after=after,
            estimate_s=self.plan.estimates["prepare"],
        )

    def _prompts(self, seeds_hash: str) -> Stage:
        plan, cfg = self.plan, self.cfg
        output = self.out / PROMPTS
        attempts = math.ceil(MAGPIE_ATTEMPTS_PER_PROMPT * plan.magpie) + BATCH_SIZE
        strict = {
            "seed": cfg.seed,
            "sources": seeds_hash,
            "max_new_tokens": MAGPIE_MAX_NEW_TOKENS,
            "target": cfg.target,
        }

        def exhausted() -> dict[str, Any] | None:
            meta = _meta(output)
            progress, settings = meta.get("progress") or {}, meta.get("settings") or {}
            if progress.get("next_index", 0) >= settings.get("max_attempts", math.inf):
                return {"exhausted": True, "magpie_made": _count_magpie(output)}
            return None

        def complete() -> bool:
            return output.is_file() and (_meta(output).get("complete") is True or bool(exhausted()))

        def accept(code: int) -> dict[str, Any] | None:
            # Out of attempts: the target kept fewer candidates than planned. The file is valid;
            # the job goes on with the prompts there are (and training gets the time left).
            note = exhausted() if code == 1 else None
            if note is not None:
                self._say(
                    f"      the target wrote {note['magpie_made']} of {plan.magpie} prompts "
                    f"within {attempts} candidates; going on with those",
                    style="yellow",
                )
            return note

        argv = [
            "data",
            "prompts",
            *_flags(
                output=output,
                num=plan.magpie,
                include_shipped=True,
                input=[cfg.prompts] if cfg.prompts else None,
                max_new_tokens=MAGPIE_MAX_NEW_TOKENS,
                batch_size=BATCH_SIZE,
                max_attempts=attempts,
                dtype="bfloat16",
                seed=cfg.seed,
                **self._common(),
                **self._runtime(),
            ),
        ]
        return Stage(
            name="prompts",
            title=f"training prompts: {plan.seeds} shipped/yours + {plan.magpie} by the target",
            argv=argv,
            output=output,
            complete=complete,
            identity={**strict, "num": plan.magpie, "max_attempts": attempts},
            strict=strict,
            restart=("--overwrite",),
            accept=accept,
            estimate_s=plan.estimates["prompts"],
        )

    def _distill(self) -> Stage:
        plan, cfg = self.plan, self.cfg
        output = self.out / ANSWERS
        available = _count_lines(self.out / PROMPTS)
        answered = min(plan.records or available, available)
        strict = {"max_new_tokens": cfg.max_new_tokens, "dtype": "bfloat16", "target": cfg.target}
        argv = [
            "data",
            "distill",
            *_flags(
                input=self.out / PROMPTS,
                output=output,
                limit=plan.records,
                max_new_tokens=cfg.max_new_tokens,
                batch_size=BATCH_SIZE,
                dtype="bfloat16",
                **self._common(),
                **self._runtime(),
            ),
        ]
        answer = RATES.answer_share * cfg.max_new_tokens
        return Stage(
            name="distill",
            title=f"self-distil {answered} prompts",
            argv=argv,
            output=output,
            complete=lambda: output.is_file() and _meta(output).get("complete") is True,
            identity={**strict, "limit": plan.records},
            strict=strict,
            restart=("--overwrite",),
            estimate_s=RATES.load_s + answered * answer / RATES.generate_tokens_per_s,
        )

    def _tokenize(self) -> Stage:
        output = self.out / TOKENIZED
        argv = [
            "data",
            "tokenize",
            *_flags(
                input=self.out / ANSWERS,
                output=output,
                max_length=TRAIN_SETTINGS["max_length"],
                **self._common(),
            ),
        ]
        markers = ("dataset_info.json", "state.json", "dataset_dict.json")
        return Stage(
            name="tokenize",
            title=f"tokenize {_count_lines(self.out / ANSWERS)} conversations",
            argv=argv,
            output=output,
            complete=lambda: any((output / m).is_file() for m in markers),
            identity={"max_length": TRAIN_SETTINGS["max_length"], "target": self.cfg.target},
            estimate_s=self.plan.estimates["tokenize"],
        )

    def _cache(self) -> Stage:
        output = self.out / CACHE
        settings = {
            "preset": "eagle3",
            "target_dtype": "bf16",
            "dtype": "bf16",
            "max_length": TRAIN_SETTINGS["max_length"],
        }
        argv = [
            "data",
            "cache",
            *_flags(
                data=self.out / TOKENIZED,
                out=output,
                **settings,
                shard_mb=SHARD_MB,
                # Only shards of another plan are removed; this plan's shards are kept (resume).
                overwrite=True,
                **self._common(),
                **self._runtime(),
            ),
        ]
        tokens = _dataset_tokens(self.out / TOKENIZED)
        return Stage(
            name="cache",
            title=f"cache the target's hidden states ({tokens} tokens)",
            argv=argv,
            output=output,
            complete=lambda: (output / "manifest.json").is_file(),
            identity={**settings, "target": self.cfg.target},
            estimate_s=RATES.load_s + tokens / RATES.cache_tokens_per_s,
        )

    def _train(self) -> Stage:
        cfg, plan = self.cfg, self.plan
        output = self.out / RUN
        manifest = _read_json(self.out / CACHE / "manifest.json")
        samples, tokens = manifest.get("num_samples", 0), manifest.get("num_tokens", 0)
        val = min(32, max(2, samples // 10))
        vocab = _read_json((self.target_path or Path()) / "config.json").get("vocab_size")
        draft_vocab = min(DRAFT_VOCAB_SIZE, vocab or DRAFT_VOCAB_SIZE)
        identity = {
            **TRAIN_SETTINGS,
            "draft_vocab_size": draft_vocab,
            "val_samples": val,
            "seed": cfg.seed,
            "train_steps": cfg.train_steps,
            "target": cfg.target,
        }
        key = _hash("train", identity, self.prev_key)
        rec = self.state["stages"].setdefault("train", {})
        # Time for training: the budget less what the data stages took (all invocations) and the
        # evaluation/export reserve; never less than a minute, so a drafter comes out. A run
        # that continues has used part of it already.
        left = max(
            MIN_TRAIN_S, plan.budget_s * PLAN_SHARE - self._spent_s("train") - plan.reserve_s
        )
        # The schedule (epochs) is fixed when the run first starts, so a resume continues the
        # same cosine schedule; a resumed run gets only the time still left as its hard stop.
        schedule = rec.get("schedule") if rec.get("key") == key else None
        if schedule is None:
            speed = self._speed_factor()
            train_tokens = max(1, tokens * (samples - val) / max(samples, 1))
            fit = max(0.0, left - RATES.train_overhead_s) * RATES.train_tokens_per_s * speed
            epochs = round(min(30.0, max(0.1, fit / train_tokens)), 2)
            steps = cfg.train_steps or math.ceil(
                epochs * (samples - val) / (TRAIN_SETTINGS["batch_size"] * 2)
            )
            schedule = {"epochs": epochs, "planned_steps": steps, "train_s": round(left, 1)}
            rec["schedule"] = schedule
        steps = schedule["planned_steps"]
        remaining = left - (rec.get("seconds", 0.0) if rec.get("key") == key else 0.0)
        argv = [
            "train",
            "eagle",
            *_flags(
                **TRAIN_SETTINGS,
                hidden_states_cache=self.out / CACHE,
                draft_vocab_size=draft_vocab,
                val_samples=val,
                epochs=None if cfg.train_steps else schedule["epochs"],
                max_steps=cfg.train_steps,
                eval_every=max(1, steps // 4),
                save_every=max(1, steps // 8),
                seed=cfg.seed,
                output_dir=output,
                **self._common(),
                **self._runtime(),
            ),
        ]
        volatile = _flags(max_minutes=round(max(1.0, remaining / 60), 2))
        what = (
            f"{cfg.train_steps} steps, at most {_minutes(remaining)}"
            if cfg.train_steps
            else f"{schedule['epochs']:g} epochs over {samples - val} records"
        )
        return Stage(
            name="train",
            title=f"train EAGLE-3 ({what})",
            argv=argv + volatile,
            output=output,
            complete=lambda: (output / "drafter" / "config.json").is_file(),
            identity=identity,
            restart=("--no-resume", "--overwrite"),
            estimate_s=remaining,
        )

    def _speed_factor(self) -> float:
        """This machine's speed against the measured one, from the cache stage's throughput.

        Caching and training are both wide bf16 matmuls on the same cores, so the cache's
        tokens/s scales the training rate (a busy or faster machine plans fewer or more epochs).
        """
        rec = self.state["stages"].get("cache", {})
        tokens = _read_json(self.out / CACHE / "manifest.json").get("num_tokens", 0)
        seconds = rec.get("last_seconds") or 0.0
        if not tokens or not seconds or rec.get("runs", 0) != 1:
            return 1.0  # resumed or unknown: no clean measurement
        rate = tokens / max(seconds - RATES.load_s, 1.0)
        return min(4.0, max(0.5, rate / RATES.cache_tokens_per_s))

    def _drafter_dir(self) -> Path:
        run = self.out / RUN
        # best/: the drafter of the highest validation τ (the recipe keeps it), else the last.
        return run / "best" if (run / "best" / "config.json").is_file() else run / "drafter"

    def _evaluate(self) -> Stage:
        cfg, plan = self.cfg, self.plan
        output = self.out / REPORT
        drafter = self._drafter_dir()
        settings = {
            "dtype": cfg.dtype,
            "k": cfg.k,
            "max_new_tokens": cfg.max_new_tokens,
            "limit": plan.eval_prompts,
        }
        argv = [
            "evaluate",
            *_flags(
                drafter=[f"eagle={drafter}"],
                **settings,
                out=output,
                target=cfg.target,
                threads=cfg.threads,
            ),
        ]
        return Stage(
            name="evaluate",
            title=f"evaluate on {plan.eval_prompts} held-out prompts (plain vs EAGLE-3, "
            f"{cfg.dtype})",
            argv=argv,
            output=output,
            complete=lambda: "acceptance_length" in _read_json(output),
            identity={**settings, "drafter": drafter.name, "target": cfg.target},
            estimate_s=plan.estimates["evaluate"],
        )

    def _export(self) -> Stage:
        output = self.out / EXPORT
        target = str(self.target_path.resolve()) if self.target_path else None
        argv = [
            "export",
            *_flags(
                format="speculators",
                checkpoint=self._drafter_dir(),
                out=output,
                target=target,
                speculative_tokens=self.cfg.k,
                metrics_json=self.out / REPORT,
                overwrite=True,  # the quickstart owns this directory
            ),
        ]
        return Stage(
            name="export",
            title="export for vLLM (speculators format)",
            argv=argv,
            output=output,
            complete=lambda: (output / "config.json").is_file(),
            identity={"format": "speculators", "k": self.cfg.k, "target": target},
            estimate_s=self.plan.estimates["export"],
        )

    # --- summary ------------------------------------------------------------------------------

    def _summary(self) -> dict[str, Any]:
        """Print the results, paths and the serve command; write summary.md and the plots."""
        from draftsmith.train.decoding.metrics import results_table

        result = _read_json(self.out / REPORT)
        training = _read_json(self.out / RUN / "training_metrics.json")
        export = (self.out / EXPORT).resolve()
        target = (self.target_path or Path(str(self.cfg.target))).resolve()
        serve = vllm_serve_command(target, export, self.cfg.k)
        plots = _plots(self.out / PLOTS, training, result)
        stages = self.state["stages"]
        ran_now = sum(
            stages[s].get("last_seconds", 0.0) for s, r in self.this_run.items() if r == "ran"
        )
        summary = {
            "acceptance_length": result.get("acceptance_length"),
            "acceptance_rate_per_position": result.get("acceptance_rate_per_position"),
            "speedup": result.get("speedup"),
            "speedup_vs_fastest_plain": result.get("speedup_vs_fastest_plain"),
            "identical_to_target": result.get("identical_to_target"),
            "identical_rate": result.get("identical_rate"),
            "drafter": _rel(self._drafter_dir()),
            "export": _rel(self.out / EXPORT),
            "report": _rel(self.out / REPORT),
            "plots": [_rel(p) for p in plots],
            "summary": _rel(self.out / SUMMARY_FILE),
            "state": _rel(self.out / STATE_FILE),
            "vllm_serve": serve,
            "total_seconds": round(self._spent_s(), 1),
            "seconds_this_run": round(ran_now, 1),
        }
        self.console.print()
        if result:
            title = f"target: {self.cfg.target or 'SmolLM2-135M-Instruct'}"
            self.console.print(results_table([result], title=title))
        lines = _summary_lines(summary, stages, self.this_run, self.cfg)
        for line in lines:
            self._say(line)
        readme = _readme(self.cfg, summary, stages, result, training, self.command)
        (self.out / SUMMARY_FILE).write_text(readme)
        return summary


# --------------------------------------------------------------------------------------------
# Helpers: files, summary text, plots
# --------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def _count_magpie(path: Path) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            return sum(1 for line in f if '"source": "magpie"' in line)
    except OSError:
        return 0


def _dataset_tokens(path: Path) -> int:
    """Tokens in a tokenized dataset directory (0 when it cannot be read)."""
    try:
        from datasets import load_from_disk

        data = load_from_disk(str(path))
        return int(sum(len(ids) for ids in data["input_ids"]))
    except Exception:  # not there yet, or unreadable: the cache stage reports it
        return 0


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _identical(summary: dict[str, Any]) -> str:
    if summary.get("identical_to_target"):
        return "yes, every output is the target's own"
    rate = summary.get("identical_rate")
    if rate is None:
        return "-"
    return f"{100 * rate:.0f} % of outputs identical; the others differ at bf16 near-ties"


def _summary_lines(
    summary: dict[str, Any], stages: dict[str, Any], this_run: dict[str, str], cfg: Any
) -> list[str]:
    lines = [
        f"τ (tokens per target forward): {_fmt(summary['acceptance_length'])}; speedup over "
        f"plain bf16: {_fmt(summary['speedup'], '.2f', 'x')}; over the fastest plain decoding: "
        f"{_fmt(summary['speedup_vs_fastest_plain'], '.2f', 'x')}; lossless: "
        f"{_identical(summary)}",
        "stages: "
        + ", ".join(
            f"{name} {_minutes(rec.get('seconds', 0.0))}"
            + (" (skipped now)" if this_run.get(name) == "skipped" else "")
            for name, rec in stages.items()
        ),
        f"total: {_minutes(summary['total_seconds'])} of the {cfg.budget_minutes:g}-min budget "
        f"({_minutes(summary['seconds_this_run'])} in this run)",
        f"drafter: {summary['drafter']}",
        f"export:  {summary['export']} (speculators format: what vLLM loads)",
        f"report:  {summary['report']}",
        f"plots:   {', '.join(summary['plots']) or '-'}",
        f"summary: {summary['summary']} (stage status and times: {summary['state']})",
        "serve it with vLLM:",
        f"  {summary['vllm_serve']}",
    ]
    return lines


def _readme(
    cfg: QuickstartConfig,
    summary: dict[str, Any],
    stages: dict[str, Any],
    result: dict[str, Any],
    training: dict[str, Any],
    command: str,
) -> str:
    """The job's summary as Markdown (``<out-dir>/summary.md``)."""
    alpha = " ".join(f"{a:.2f}" for a in summary.get("acceptance_rate_per_position") or [])
    validation = (training.get("final_validation") or {}).get("val/sim_tau")
    rows = "\n".join(
        f"| {name} | {rec.get('status', '-')} | {_minutes(rec.get('seconds', 0.0))} | "
        f"`{rec.get('command', '')}` |"
        for name, rec in stages.items()
    )
    ref = result.get("reference_plain") or {}
    return f"""# draftsmith quickstart

`{command}` trained an EAGLE-3 drafter for `{cfg.target or "SmolLM2-135M-Instruct"}` and measured
it against plain decoding on {result.get("num_prompts", "-")} of the project's held-out prompts
({result.get("dtype", "bfloat16")}, greedy, k = {cfg.k}, {cfg.max_new_tokens} new tokens).

## Results

| | |
|---|---|
| τ (tokens per target forward) | {_fmt(summary.get("acceptance_length"))} |
| α per position | {alpha or "-"} |
| speculative tok/s | {_fmt(result.get("tokens_per_second"), ".1f")} |
| plain tok/s ({result.get("dtype", "-")}) | {_fmt(result.get("baseline_tokens_per_second"), ".1f")} |
| plain tok/s ({ref.get("dtype", "-")}) | {_fmt(ref.get("tokens_per_second"), ".1f")} |
| speedup over plain, same dtype | {_fmt(summary.get("speedup"), ".2f", "x")} |
| speedup over the fastest plain | {_fmt(summary.get("speedup_vs_fastest_plain"), ".2f", "x")} |
| lossless | {_identical(summary)} |
| training | {training.get("steps", "-")} steps, {_minutes(training.get("train_seconds", 0.0))}; validation simulated τ {_fmt(validation)} |

## Files

- drafter: `{summary["drafter"]}` (draftsmith's layout; `draftsmith evaluate --drafter eagle=DIR`)
- export: `{summary["export"]}` (speculators format, what vLLM loads)
- report: `{summary["report"]}` (every metric and per-prompt outputs, see docs/metrics.md)
- plots: {", ".join(f"`{p}`" for p in summary["plots"]) or "-"}
- stage status and wall times: `{summary["state"]}`

## Serve with vLLM

```bash
{summary["vllm_serve"]}
```

## Stages

| stage | status | wall time | command (reruns it alone) |
|---|---|---|---|
{rows}

Total {_minutes(summary["total_seconds"])} of the {cfg.budget_minutes:g}-min budget. Rerun
`{command}` to resume or refresh; see docs/quickstart.md to scale up.
"""


def _plots(folder: Path, training: dict[str, Any], result: dict[str, Any]) -> list[Path]:
    """``training.png`` (loss, validation τ) and ``evaluation.png`` (α per position, τ per
    prompt); an empty list when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    log, val = training.get("train_log") or [], training.get("validation") or []
    if log or val:
        fig, ax = plt.subplots(figsize=(7, 4))
        steps = [e["step"] for e in log if e.get("train/loss") is not None]
        ax.plot(steps, [e["train/loss"] for e in log if e.get("train/loss") is not None])
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        if val:
            ax2 = ax.twinx()
            ax2.plot([v["step"] for v in val], [v.get("val/sim_tau") for v in val], "o-", c="C1")
            ax2.set_ylabel("validation simulated τ", color="C1")
        ax.set_title("EAGLE-3 training")
        fig.tight_layout()
        fig.savefig(folder / "training.png", dpi=110)
        plt.close(fig)
        written.append(folder / "training.png")
    alpha = result.get("acceptance_rate_per_position") or []
    per_prompt = result.get("per_prompt") or []
    if alpha or per_prompt:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.bar(range(1, len(alpha) + 1), alpha)
        a.set_xlabel("draft position")
        a.set_ylabel("α (accepted / steps)")
        a.set_title(f"acceptance per position (τ {result.get('acceptance_length', 0):.2f})")
        b.bar(range(len(per_prompt)), [p["acceptance_length"] for p in per_prompt])
        b.axhline(1.0, color="grey", lw=0.8)
        b.set_xlabel("held-out prompt")
        b.set_ylabel("τ")
        b.set_title("τ per prompt")
        fig.tight_layout()
        fig.savefig(folder / "evaluation.png", dpi=110)
        plt.close(fig)
        written.append(folder / "evaluation.png")
    return written


def _console():
    from rich.console import Console

    console = Console(highlight=False)
    return console if console.is_terminal else Console(width=150, highlight=False)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

_DESCRIPTION = """\
The main job on one target, end to end: prepare it, make training prompts (the shipped ones,
yours, and prompts the target writes), let the target answer them (self-distillation), tokenize,
cache its hidden states, train an EAGLE-3 drafter within the budget, evaluate it against plain
decoding on the project's held-out prompts, and export it in the speculators format vLLM loads.
Prints the results table, where the export, the report and the plots are, and the `vllm serve`
command line; everything is also in OUT_DIR/summary.md and OUT_DIR/quickstart.json."""

_EPILOG = """\
examples:
  draftsmith quickstart                      # SmolLM2-135M-Instruct, 30-min budget (2 CPU cores)
  draftsmith quickstart --budget-minutes 120 --prompts my_prompts.jsonl   # more data, longer
  draftsmith quickstart --target path/to/model_dir --out-dir runs/qs_mine

Rerunning the same command skips finished stages and resumes an interrupted one; --overwrite
starts over. docs/quickstart.md describes every stage and output."""


def main(argv: list[str] | None = None) -> int:
    """CLI entry: 0 done, 2 bad settings or input, 1 a stage failed, 130 interrupted."""
    return cli_main(_main, argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="draftsmith quickstart",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(parser, QuickstartConfig)
    cfg = config_from_args(QuickstartConfig, parser.parse_args(argv))
    return Quickstart(cfg, argv).run()


if __name__ == "__main__":
    sys.exit(main())
