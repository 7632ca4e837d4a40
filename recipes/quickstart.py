"""The main job, end to end: ``draftsmith quickstart`` trains, measures and exports a drafter.

Launch::

    draftsmith quickstart                                  # SmolLM2-135M-Instruct, 30-min budget
    draftsmith quickstart --budget-minutes 120 --prompts my_prompts.jsonl
    draftsmith quickstart --target path/to/hf_model_dir --out-dir runs/qs_mine

Ten stages, each one existing command called through the CLI dispatch (so the command a stage
prints is exactly what reruns it alone), each writing its own path under ``--out-dir``::

    [1/10] prepare target      draftsmith prepare-target              (cached target directory)
    [2/10] training prompts    draftsmith data prompts                data/prompts.jsonl
    [3/10] self-distil         draftsmith data distill                data/answers.jsonl
    [4/10] sampled answers     draftsmith data distill --samples N    data/sampled_answers.jsonl
    [5/10] validation answers  draftsmith data distill                data/val_answers.jsonl
    [6/10] tokenize            draftsmith data tokenize               data/tokenized/
    [7/10] hidden states       draftsmith data cache                  data/cache/
    [8/10] train EAGLE-3       draftsmith train eagle                 eagle3/ (best/, drafter/)
    [9/10] evaluate            draftsmith evaluate                    eval.json
    [10/10] export             draftsmith export --format speculators export/

then the summary: the results table, ``plots/``, ``summary.md`` (everything printed, plus the
``vllm serve`` command line) and ``quickstart.json`` (stage status, wall time per stage, the
plan, command, versions, machine).

Prompts: the training prompts are an optional ``--prompts`` file's, then the ones the target
writes (Magpie, ``train/datagen/magpie.py``); the shipped held-out prompts are excluded from
training and are what the evaluation decodes. Each prompt is answered greedily; when the budget
buys more records than your prompts, it first buys up to ``--sampled-answers`` more answers to each
of yours, sampled at T = 0.7 (stage 4; they cost no prompt writing, and they are answers to the
prompts you serve), and then prompts the target writes. Without ``--prompts`` stage 4 has nothing
to do.

**Validation like the evaluation**: the project's 32 shipped ``train`` prompts (the same source
and kind as the held-out ones) and a slice of ``--prompts`` (``--val-prompts``, by default a tenth
and at most 32, drawn by ``--seed``) are written to ``data/val_prompts.jsonl``; the target answers
them apart (``data/val_answers.jsonl``) and they are never trained on: the prompts stage drops
them and their near-duplicates (``--exclude``). Training validates on them (``--val-data``): their
simulated τ chooses ``best/``; the held-back training records are still validated, so the summary
shows both beside the evaluated τ.

Settings are those of ``recipes/configs/eagle3_smollm2.yaml``, which trains fastest on a CPU: the
target and autocast in the job's dtype (below), an offline hidden-state cache, 3 TTT steps, lr
6e-4; evaluation in that dtype with plain decoding in both dtypes timed alongside.

**Dtype**: ``--dtype`` (``auto``: bf16 where the device computes it natively, fp32 elsewhere) is
what the target computes in at every stage: Magpie, distil, the cache's target (its storage stays
bf16), training's target and autocast (bf16: ``bf16``/``bf16``; fp32: ``fp32``/``no``) and the
evaluation. It is resolved once, when the plan is made, and recorded in it (``plan.dtype``).
Under ``auto`` (and the probe) the evaluation runs in whichever of fp32 and bf16 the probe's plain
single-stream decoding was faster in (``plan.eval_dtype``).

**Device**: ``--device`` (``auto``: the first GPU when there is one, else the CPU) is where every
stage that runs a model runs: prompts, both distils, cache, train, evaluate, export (each gets
it as its own ``--device``). On a GPU, Magpie and self-distillation decode up to 256 prompts together
instead of 64, as the GPU's memory allows (``batch_size`` in ``plan.probe``).

**Budget** (``draftsmith.train.jobs.budget``): data sizes follow from ``--budget-minutes`` and
this machine's rates, measured once per job right after the target is prepared (a probe of a
few seconds on the device; ``plan.probe`` in ``quickstart.json``; a rerun reuses them, so the
same command makes the same plan; ``--no-probe`` plans with the 2-core-CPU reference rates).
When the prompts and answers come out faster than planned, the job makes more of them before it
trains (``plan.grown``), so training stays near the epochs the plan bought data for; when they
come out slower, the prompts stage stops at 1.25x its estimate and the answers stage answers only
what the measured rate fits in its estimate (``plan.shrunk``), so a probe that overpromised does
not eat training's share; training is sized when it starts, from the time really spent.
**Resume** (``draftsmith.train.jobs.stages``): a rerun skips every stage whose output is complete
and whose settings and inputs are unchanged, and continues a stage cut short; changed settings
rerun that stage and every later one; ``--overwrite`` starts over. docs/quickstart.md has more.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: resolve the imports below (PEP 366)
    __package__ = "draftsmith.recipes"

import dataclasses
import json
import math
import os
import random
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from ..heads import families
from ..train.config import cfg_field, config_to_dict, parse_config
from ..train.device import (
    DEVICE_HELP,
    DTYPE_AUTO_HELP,
    auto_dtype,
    device_facts,
    device_problem,
    is_cpu,
    resolve_device,
)
from ..train.errors import UsageError, cli_main
from ..train.jobs import budget
from ..train.jobs.budget import (
    RATES,
    REFERENCE_DTYPE,
    STAGE_NAMES,
    Plan,
    Probe,
    Rates,
    generation_factor,
    grow_plan,
    make_plan,
    plan_lines,
    shrink_records,
    speed_factor,
    train_schedule,
)
from ..train.jobs.stages import (
    Stage,
    StageJob,
    count_lines,
    dataset_tokens,
    file_hash,
    flags,
    hash_parts,
    read_json,
    read_meta,
    relative_path,
)
from ..train.report.quickstart import evaluated_shapes, vllm_serve_command
from ..train.report.text import console, minutes

if TYPE_CHECKING:
    from ..train.data.records import Conversation

__all__ = ["Quickstart", "QuickstartConfig", "held_out", "main"]

T = TypeVar("T")

STATE_FILE = "quickstart.json"
SUMMARY_FILE = "summary.md"  # not README.md: `--out-dir .` must not replace a project's own
STATE_FORMAT = "draftsmith-quickstart"
STATE_VERSION = 1

# Paths under --out-dir, one per stage (and what --overwrite removes; nothing else is touched).
PROMPTS = "data/prompts.jsonl"
ANSWERS = "data/answers.jsonl"
SAMPLED_ANSWERS = "data/sampled_answers.jsonl"  # more answers to your prompts, sampled
VAL_PROMPTS = "data/val_prompts.jsonl"  # written by the job itself (the validation set)
VAL_ANSWERS = "data/val_answers.jsonl"
TOKENIZED = "data/tokenized"
CACHE = "data/cache"
#: The family the quickstart trains, and its run directory's name.
FAMILY = families.FAMILIES["eagle3"]
RUN = FAMILY.name
REPORT = "eval.json"
EXPORT = "export"
PLOTS = "plots"
OWNED = (
    *(
        f"{p}{s}"
        for p in (PROMPTS, ANSWERS, SAMPLED_ANSWERS, VAL_ANSWERS)
        for s in ("", ".meta", ".lock", ".lock.pid")
    ),
    VAL_PROMPTS,
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
# fastest on this CPU (bench/training/train_throughput.json) and learn in a short budget. Its target_dtype
# and mixed_precision (bf16, bf16) follow the job's dtype: TRAIN_DTYPES. Its TTT unroll is the
# job's --k (QuickstartConfig.k), not the config's 3: the job drafts k positions deep, and a
# deeper unroll spends a third more of each step on a position it never drafts (2 against 3
# steps at equal minutes: docs/performance.md, "TTT steps as deep as the drafts").
TRAIN_SETTINGS = {
    "version": 3,
    "hidden_states": "offline",
    "ttt_decay": 0.8,
    # EAGLE-3.1: evaluated τ 1.49 against 1.44 at equal steps (docs/performance.md).
    "fc_norm": True,
    "norm_output": True,
    "lr": 6e-4,
    "warmup_ratio": 0.03,
    "max_grad_norm": 0.5,
    "batch_size": 4,
    "grad_accum": 2,
    "max_length": 512,
    "keep_checkpoints": 2,
}
#: The job's dtype (resolved ``--dtype``) as each command spells it: the train stage's target and
#: autocast, and the cache stage's target (its storage dtype stays bf16: half the disk, and the
#: conversion when training reads it is cheap).
TRAIN_DTYPES = {
    "bfloat16": {"target_dtype": "bf16", "mixed_precision": "bf16"},
    "float32": {"target_dtype": "fp32", "mixed_precision": "no"},
}
CACHE_TARGET_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}
# The evaluated tree's children per expanded node (EAGLE-2), and its default size. With packed
# bf16 weights a 6-token verify costs 0.91x a 1-token forward on the AVX512-BF16 CPU and a
# 7-token one 1.00x (oneDNN's kernels for a few rows), so 5 nodes (depth 2) is the fastest tree
# of the 30-minute drafter: τ 1.54, 1.37x plain bf16, against 6 nodes 1.56, 1.29x, 8 nodes 1.61,
# 1.30x and the k = 2 chain 1.36, 1.27x (32 held-out prompts, bench/quickstart/avx512bf16/
# quickstart30_d43cdec/shapes_packed.json).
TREE_TOPK = 4
TREE_NODES = 5
# The per-step decision's candidates (auto:eagle-tree): a tree of up to 16 nodes, depth 4, of
# which each step verifies what pays on this machine (heads/auto.py); it is calibrated on 16
# validation prompts before the evaluation.
AUTO_K = 4
AUTO_NODES = 16
AUTO_CALIBRATION_PROMPTS = budget.AUTO_CALIBRATION_PROMPTS
DRAFT_VOCAB_SIZE = 8192  # the shipped config's: ~97 % of SmolLM2's answer tokens
MAGPIE_MAX_NEW_TOKENS = 64  # a user message; longer candidates are cut ("unfinished") early
MAGPIE_ATTEMPTS_PER_PROMPT = 2.5  # stop at a kept share under 40 %: the budget, not the count
# The data stages' time limits, as a multiple of their estimates: the probe's rates come from a
# few seconds of work and a noisy machine can make them 2x too fast (a fresh clone's probe on a
# 2-core CPU measured 532 generation tokens/s where the stages then ran at 139 and 364; the prompts
# took 488 s for an estimated 277, the answers 448 for 318, and training got 5.2 min of a planned
# 11). Past 1.25x its estimate the prompts stage stops with what it made, and the answers stage
# answers only as many prompts as the rate the prompts really came at fits in its estimate.
DATA_TIME_SLACK = 1.25
# Prompts decoded together by Magpie and self-distillation on the CPU (~185-300 tok/s in bf16) and
# without a probe; the probe picks a GPU's (budget.generation_batch_size).
BATCH_SIZE = 64
SHARD_MB = 64  # small cache shards: a killed cache build loses at most one shard's work
MAGPIE_LINE = '"source": "magpie"'  # how a prompt the target wrote is marked in PROMPTS
#: The temperature of the sampled answers to your prompts (stage 4): the serving temperature the
#: project measures sampled decoding at.
SAMPLE_TEMPERATURE = 0.7
#: --sampled-answers' default.
SAMPLED_ANSWERS_DEFAULT = 2
#: Your prompts held out for validation by default: a tenth of them, at most this many (as many
#: as the shipped prompts validated on; a few dozen answers cost about a minute on the CPU).
USER_VAL_MAX = 32
USER_VAL_SHARE = 0.1


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
        help="target: a Hugging Face Hub id, a local HF model dir, a .gguf file, or None for SmolLM2-135M-Instruct "
        "(as `draftsmith prepare-target` resolves it)",
    )
    prompts: Path | None = cfg_field(
        None,
        help="your prompt file (JSONL/JSON/parquet; its train split when the records carry "
        "one): the prompts you will serve. Trained on before Magpie's, except a slice held out "
        "to validate on (--val-prompts)",
    )
    val_prompts: int | None = cfg_field(
        None,
        help="of your --prompts, how many are held out of training and validated on, with the "
        "32 shipped train prompts (drawn by --seed; their simulated τ chooses best/); None: "
        f"a tenth, at most {USER_VAL_MAX}",
        ge=0,
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
        help="prompts answered and trained on in all (yours + Magpie, in that order; the "
        "validation prompts are answered apart); None: from the budget (all of them when "
        "--num-prompts is given)",
        ge=1,
    )
    sampled_answers: int = cfg_field(
        SAMPLED_ANSWERS_DEFAULT,
        help="besides its greedy answer, at most this many answers sampled at T = "
        f"{SAMPLE_TEMPERATURE} to each of your --prompts, bought before prompts the target "
        "writes when the budget leaves time (not with --records or --num-prompts); 0: none",
        ge=0,
    )
    eval_prompts: int | None = cfg_field(
        None,
        help="held-out prompts evaluated (of the 32 shipped); None: from the budget, 4 to 16",
        ge=1,
        le=32,
    )
    k: int = cfg_field(
        2,
        help="draft tokens per step of the chain (evaluated and advertised in the export), the "
        "tree's depth, and the training's TTT unroll: a short-trained EAGLE-3 rarely gets "
        "position 3 accepted (α .03 on the 30-minute drafter), and each position costs a draft "
        "step",
        ge=1,
    )
    tree_nodes: int = cfg_field(
        TREE_NODES,
        help="also evaluate the drafter as an EAGLE-2 tree of this many draft tokens (depth k, "
        f"{TREE_TOPK} children per expanded node) beside the chain, and report the faster "
        "shape; 0: the chain alone. vLLM serves the chain",
        ge=0,
    )
    auto: bool = cfg_field(
        True,
        help="also evaluate the per-step decision (auto:eagle-tree: the drafter's tree of up to "
        f"{AUTO_NODES} nodes, depth {AUTO_K}, merged with n-gram and suffix lookup, verifying "
        "per step only what pays on this machine, calibrated first on the validation prompts) "
        "and plain n-gram lookup beside the fixed shapes; the fastest is reported",
    )
    max_new_tokens: int = cfg_field(
        128, help="answer length: self-distilled answers and evaluated outputs", ge=1
    )
    dtype: str = cfg_field(
        "auto",
        help="what the target computes in at every stage: Magpie, distil, the cache (stored in "
        "bf16 either way), training's target and autocast, and the evaluation (plain decoding "
        "is timed in both dtypes; auto with the probe: the evaluation in the dtype the probe "
        "decodes one stream faster in); " + DTYPE_AUTO_HELP,
        choices=["auto", "bfloat16", "float32"],
    )
    train_steps: int | None = cfg_field(
        None, help="optimizer steps; None: the epochs that fit the training time", ge=1
    )
    seed: int = cfg_field(0, help="seed of the Magpie prompts and of training")
    device: str = cfg_field("auto", help=DEVICE_HELP + "; every stage that runs a model runs there")
    probe: bool = cfg_field(
        True,
        help="measure this machine's rates (a few seconds on the device, once per job) and plan "
        "with them; --no-probe plans with the rates measured on a 2-core CPU",
    )
    threads: int | None = cfg_field(
        None, help="torch CPU threads per stage (when the device is the CPU)", ge=1
    )
    progress: bool = cfg_field(True, help="show each stage's progress bars")
    overwrite: bool = cfg_field(
        False, help="start over: delete the quickstart outputs in out_dir first"
    )

    def validate(self) -> list[tuple[str, str]]:
        problem = device_problem(self.device)
        return [("device", problem)] if problem else []


def held_out(prompts: Sequence[T], count: int | None, seed: int) -> tuple[list[T], list[T]]:
    """Your prompts split into ``(validation, training)``, both in file order.

    Args:
        prompts: the ``--prompts`` file's training prompts.
        count: how many to hold out (``--val-prompts``); None: a tenth (rounded down), at most
            :data:`USER_VAL_MAX`.
        seed: draws which (``--seed``): the same settings hold out the same prompts.

    Raises:
        UsageError: ``count`` would leave none to train on.
    """
    if count is None:
        count = min(USER_VAL_MAX, int(USER_VAL_SHARE * len(prompts)))
    if count and count >= len(prompts):
        raise UsageError(
            f"val_prompts: {count} of your {len(prompts)} prompts would leave none to train on"
        )
    chosen = set(random.Random(seed).sample(range(len(prompts)), count)) if count else set()
    validation = [p for i, p in enumerate(prompts) if i in chosen]
    return validation, [p for i, p in enumerate(prompts) if i not in chosen]


def _train_records(path: str | Path) -> list[Conversation]:
    """A prompt file's records as its prompts are read for training: its ``train`` split when
    the records carry one, else all (``load_seed_prompts``'s rule)."""
    from ..train.data.records import load_records, select_split
    from ..train.datagen.self_distill import resolve_split

    records, _ = load_records(path)
    return select_split(records, resolve_split(records, "auto")[0])


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------


def _no_dispatch(argv: list[str]) -> NoReturn:
    """Stands in for the CLI's dispatch when none was handed in (see :func:`main`)."""
    raise UsageError(
        "the quickstart runs each stage as a draftsmith command: start it as "
        "`draftsmith quickstart ...`"
    )


class Quickstart(StageJob):
    """One invocation of the job: builds each stage when it is reached, runs or skips it.

    Args:
        cfg: the job's settings.
        argv: the job's command line (for the command that resumes it).
        call: runs ``draftsmith ARGV`` in this process and returns its exit code: the CLI's
            dispatch, handed in by ``draftsmith quickstart`` (see :func:`main`).
    """

    def __init__(
        self,
        cfg: QuickstartConfig,
        argv: list[str],
        call: Callable[[list[str]], int] = _no_dispatch,
    ) -> None:
        # The command that resumes this job (without --overwrite: a rerun must not start over).
        resume_argv = [a for a in argv if a not in ("--overwrite", "--no-overwrite")]
        super().__init__(
            Path(cfg.out_dir),
            name="quickstart",
            command=shlex.join(["draftsmith", "quickstart", *resume_argv]),
            call=call,
            stage_names=STAGE_NAMES,
            state_file=STATE_FILE,
            state_format=STATE_FORMAT,
            state_version=STATE_VERSION,
            console=console(width=150),
        )
        self.cfg = cfg
        self.target_path: Path | None = None
        self.plan: Plan | None = None
        self.user_seeds = 0
        # The validation set (_check_inputs): the shipped train prompts and a slice of yours.
        self.validation: list[dict[str, Any]] = []
        self.user_val = 0
        self.val_hash = ""
        # What the plan is sized by; the probe (after the prepare stage) replaces them.
        self.rates: Rates = RATES
        self.batch_size = BATCH_SIZE
        self.probe_s = 0.0

    def run(self) -> int:
        from ..train.runinfo import output_lock

        cfg = self.cfg
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UsageError(
                "quickstart runs in one process; to train on several, run its stages "
                "(listed in docs/quickstart.md) with accelerate launch"
            )
        seeds_hash, seeds = self._check_inputs()
        device = resolve_device(cfg.device)  # a GPU that is not there fails now, in one line
        self.out.mkdir(parents=True, exist_ok=True)
        with output_lock(self.out / "quickstart", "quickstart run"):
            if cfg.overwrite:
                self._remove_outputs(OWNED)
            self._load_state()
            self._record_invocation(config_to_dict(cfg))
            out = relative_path(self.out)
            # The header now; the plan needs this machine's rates, measured on the prepared
            # target, so it comes after the prepare stage.
            self._say(*plan_lines(make_plan(cfg, seeds), cfg, out)[0])
            if not self._run_stages([self._prepare]):
                return 130
            self._make_plan(seeds, device)
            for text, style in plan_lines(self.plan, cfg, out)[1:]:
                self._say(text, style)
            self._write_validation_prompts()
            data = [lambda: self._prompts(seeds_hash), self._distill]
            # The key chain the data stages start from, to run them again over grown sizes.
            chain = (self.prev_key, self.prev_strict)
            if not self._run_stages(data, start=2):
                return 130
            if self._grow_data():
                self.prev_key, self.prev_strict = chain
                if not self._run_stages(data, start=2):
                    return 130
            builders = [
                self._sampled,
                self._validation,
                self._tokenize,
                self._cache,
                self._train,
                self._evaluate,
                self._export,
            ]
            if not self._run_stages(builders, start=4):
                return 130  # interrupted: the stage's output is kept and resumes
            summary = self._summary()
            self.state["summary"] = summary
            self._save_state()
        return 0

    def _check_inputs(self) -> tuple[str, int]:
        """Read the prompt sources now, so a bad file fails before any model loads, and choose
        the validation set: the shipped train prompts and a slice of yours (:func:`held_out`).

        Returns:
            ``(key of the sources, training prompts from your file)``.
        """
        from ..train.data.prompts import DEFAULT_PROMPTS
        from ..train.datagen.prompt_sources import load_seed_prompts

        cfg = self.cfg
        shipped = _train_records(DEFAULT_PROMPTS)
        digest = file_hash(DEFAULT_PROMPTS)
        mine: list[Conversation] = []
        if cfg.prompts is not None:
            if not Path(cfg.prompts).exists():
                raise UsageError(f"prompts: {cfg.prompts} does not exist")
            # As the prompts stage reads them (a record without a user message fails here).
            if not load_seed_prompts(cfg.prompts, id_prefix="input0", source="input"):
                raise UsageError(f"prompts: {cfg.prompts} holds no training prompts")
            mine = _train_records(cfg.prompts)
            path = Path(cfg.prompts)
            digest += ":" + (file_hash(path) if path.is_file() else str(path.resolve()))
        elif cfg.val_prompts:
            raise UsageError("val_prompts: holds out some of --prompts; there is no --prompts")
        if cfg.num_prompts == 0 and not mine:
            raise UsageError("num_prompts: 0 and no --prompts: nothing to train on")
        validation, train = held_out(mine, cfg.val_prompts, cfg.seed)
        # Whole records (a system prompt, earlier turns), as the evaluation decodes its own; ids
        # are strings, so no id % 10 rule gives them a split.
        self.validation = [
            {"id": f"{prefix}-{c.id}", "source": source, "messages": c.messages}
            for prefix, source, records in (
                ("shipped", "shipped", shipped),
                ("input0", f"input:{cfg.prompts}", validation),
            )
            for c in records
        ]
        self.user_val, self.user_seeds = len(validation), len(train)
        self.val_hash = hash_parts(self.validation)
        return digest, self.user_seeds

    def _write_validation_prompts(self) -> None:
        """Write the validation set (``data/val_prompts.jsonl``, records without a split: the
        validation stage answers all of them and the prompts stage excludes every user turn of
        them), and say what it is. An unchanged file is left as it is."""
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.validation)
        path = self.out / VAL_PROMPTS
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
        shipped = len(self.validation) - self.user_val
        yours = ""
        if self.cfg.prompts is not None:
            of = self.user_val + self.user_seeds
            yours = f" + {self.user_val} of your {of} (drawn by --seed {self.cfg.seed})"
        self._say(
            f"validation: the {shipped} shipped train prompts{yours}, answered by the target and "
            f"never trained on; their simulated τ chooses best/ ({relative_path(path)})",
            "dim",
        )

    # --- the plan -----------------------------------------------------------------------------

    def _make_plan(self, seeds: int, device: Any) -> None:
        """Size the job by this machine's rates: the job's earlier probe when it measured the
        same target, device and dtype (the same command then makes the same plan), else a new
        probe (``--no-probe``: the CPU reference rates). A job planned before probes existed
        keeps its reference rates, so a rerun redoes none of its stages.

        The job's dtype is resolved here, once (``auto``: bf16 where ``device`` computes it
        natively, else fp32), and kept in the plan (``plan.dtype``), which every stage reads. A
        rerun resolves it again to the same value on the same machine, so its stages' keys, and
        its probe's, are unchanged. Under ``auto`` the probe also times plain single-stream
        decoding in fp32 and bf16, and the evaluation runs in the faster (``plan.eval_dtype``;
        a rerun keeps the job's probe, so the same choice); else it runs in ``plan.dtype``."""
        cfg = self.cfg
        dtype = auto_dtype(cfg.dtype, device, fast="bfloat16", slow="float32")
        auto = cfg.dtype == "auto"
        eval_dtype, eval_rates = dtype, {}
        key = {"target": str(self.target_path), "device": str(device), "dtype": dtype}
        recorded = self.state.get("plan") or {}
        probe = (
            Probe.from_record(recorded.get("probe")) if recorded.get("probe_key") == key else None
        )
        legacy = "probe" not in recorded or (recorded["probe"] or {}).get("legacy")
        if cfg.probe and recorded.get("rates") and legacy:
            self.rates, self.batch_size, self.probe_s = RATES, BATCH_SIZE, 0.0
            record = {"probed": False, "legacy": True, "rates": "planned before probes existed"}
            self._say("rates: the 2-core-CPU reference this job was planned with", "dim")
        elif cfg.probe:
            if probe is None:
                if cfg.threads and is_cpu(device):
                    import torch

                    torch.set_num_threads(cfg.threads)  # as the stages will run
                self._say(f"measuring this machine's rates on {device} ...", "dim")
                probe = budget.probe_rates(
                    self.target_path,
                    device,
                    dtype=_torch_dtype(dtype),
                    eval_dtype=_torch_dtype(dtype),
                    compare_eval_dtypes=auto,
                    seq_tokens=TRAIN_SETTINGS["max_length"],
                    ttt_steps=cfg.k,
                    draft_vocab_size=DRAFT_VOCAB_SIZE,
                )
                self._say(_probe_line(probe), "dim")
            else:
                self._say(_probe_line(probe) + " (this job's earlier probe, kept)", "dim")
            if auto:  # the faster plain decoding, when the probe compared the dtypes
                eval_dtype, eval_rates = probe.dtype, probe.eval_rates()
            self.batch_size, self.probe_s = probe.batch_size, probe.seconds
            self.rates = probe.rates_evaluating(eval_dtype)
            record = probe.record()
        else:
            self.rates, self.batch_size, self.probe_s = RATES, BATCH_SIZE, 0.0
            record = {
                "probed": False,
                "rates": f"the 2-core-CPU reference: {REFERENCE_DTYPE}, AVX512-BF16 (--no-probe)",
            }
        # Reference rates in another dtype are used as they are, and the plan says so
        # (budget.REFERENCE_DTYPE has why they are not scaled).
        self.plan = make_plan(
            cfg,
            seeds,
            self.rates,
            probe_s=self.probe_s,
            dtype=dtype,
            reference_rates=not record["probed"],
            validation=len(self.validation),
            eval_dtype=eval_dtype,
            eval_rates=eval_rates,
        )
        base = self.plan.record(cfg.budget_minutes, self.rates)
        grown, shrunk = recorded.get("grown"), recorded.get("shrunk")
        if not (grown and recorded.get("probe_key") == key and grown.get("from") == _sizes(base)):
            grown = None
        if not (shrunk and recorded.get("probe_key") == key and shrunk.get("from") == _sizes(base)):
            shrunk = None  # another plan: its prompts stage decides again (_shrunk_records)
        self.state["plan"] = {
            **base,
            "probe": record,
            "probe_key": key,
            **({"grown": grown} if grown else {}),
            **({"shrunk": shrunk} if shrunk else {}),
        }
        if grown:
            # The data grew in an earlier invocation (_grow_data): the same sizes again, so a
            # rerun neither redoes nor shrinks them.
            self.plan = dataclasses.replace(
                self.plan,
                magpie=grown["magpie_prompts"],
                records=grown["records"],
                sampled=grown.get("sampled_answers", 0),
                estimates={**self.plan.estimates, **grown["estimated_seconds"]},
            )
        self.state["device"] = device_facts(device)
        self._save_state()

    def _grow_data(self) -> bool:
        """After the prompts and answers are made: when they came out faster than planned, plan
        more of them (:func:`~draftsmith.train.jobs.budget.grow_plan`), so the time they saved
        buys distinct records rather than more epochs over the same ones. Once per job: only
        when both stages ran whole in this invocation (a resumed stage's time is not a rate),
        not when Magpie ran out of attempts (the target writes no more), never when the sizes
        were asked for. The grown sizes are kept in the state (``plan.grown``).

        Returns:
            Whether the plan grew (the two data stages then run again and extend their output).
        """
        stages = self.state["stages"]
        made = [stages.get("prompts", {}), stages.get("distill", {})]
        if any(self.this_run.get(n) != "ran" for n in ("prompts", "distill")):
            return False
        if made[0].get("exhausted") or {"grown", "shrunk"} & set(self.state["plan"]):
            return False
        factor = generation_factor(made, self.rates)
        if factor is None:
            return False
        spent = self._spent_s("validation") + self.probe_s
        grown = grow_plan(self.plan, self.cfg, self.rates, spent_s=spent, factor=factor)
        if grown is None:
            return False
        self.state["plan"]["grown"] = {
            "from": _sizes(self.state["plan"]),
            "magpie_prompts": grown.magpie,
            "records": grown.records,
            "sampled_answers": grown.sampled,
            "generation_factor": round(factor, 3),
            "spent_seconds": round(spent, 1),
            "estimated_seconds": {k: round(v, 1) for k, v in grown.estimates.items()},
        }
        self._save_state()
        before = self.plan.records or self.plan.seeds + self.plan.magpie
        before += self.plan.sampled
        after = grown.records + grown.sampled
        self._say(
            f"the prompts and answers came out {factor:.1f}x as fast as planned: "
            f"{after - before} more ({after} records, training "
            f"~{minutes(grown.estimates['train'])}), so the time saved buys new records "
            f"rather than more epochs over the same {before}",
            "yellow",
        )
        self.plan = grown
        return True

    # --- stage builders -----------------------------------------------------------------------

    def _common(self) -> dict[str, Any]:
        return {"target": self.cfg.target}

    def _device(self) -> dict[str, Any]:
        # auto is every command's default: left out, the commands print as they always did.
        return {"device": None if self.cfg.device == "auto" else self.cfg.device}

    def _runtime(self) -> dict[str, Any]:
        return {
            **self._device(),
            "threads": self.cfg.threads,
            "progress": None if self.cfg.progress else False,
        }

    def _prepare(self) -> Stage:
        from ..train.target_model.load import prepare_target

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
            estimate_s=RATES.prepare_s,  # before the probe: the plan comes after this stage
        )

    def _prompts(self, seeds_hash: str) -> Stage:
        plan, cfg = self.plan, self.cfg
        output = self.out / PROMPTS
        attempts = math.ceil(MAGPIE_ATTEMPTS_PER_PROMPT * plan.magpie) + self.batch_size
        strict = {
            "seed": cfg.seed,
            "sources": seeds_hash,
            "validation": self.val_hash,  # excluded from the output
            "max_new_tokens": MAGPIE_MAX_NEW_TOKENS,
            "target": cfg.target,
            # bf16 is left out: the key of a job made when the prompts were always bf16.
            **({} if plan.dtype == "bfloat16" else {"dtype": plan.dtype}),
        }

        def exhausted() -> dict[str, Any] | None:
            meta = read_meta(output)
            progress, settings = meta.get("progress") or {}, meta.get("settings") or {}
            if progress.get("next_index", 0) >= settings.get("max_attempts", math.inf):
                return {"exhausted": True, "magpie_made": count_lines(output, MAGPIE_LINE)}
            return None

        def time_limited() -> bool:
            return read_meta(output).get("stopped") == "max_seconds"

        def complete() -> bool:
            return output.is_file() and (
                read_meta(output).get("complete") is True or bool(exhausted()) or time_limited()
            )

        def after() -> dict[str, Any]:
            if not time_limited():
                return {}
            made = count_lines(output, MAGPIE_LINE)
            self._say(
                f"      the target wrote {made} of {plan.magpie} prompts in the stage's time "
                f"({minutes(limit_s)}): this machine generates slower than its probe said; "
                "going on with those",
                style="yellow",
            )
            return {"time_limited": True, "magpie_made": made}

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
            *flags(
                output=output,
                num=plan.magpie,
                input=[cfg.prompts] if cfg.prompts else None,
                # The validation prompts, and any prompt near-equal to one, are not trained on.
                exclude=[self.out / VAL_PROMPTS],
                max_new_tokens=MAGPIE_MAX_NEW_TOKENS,
                batch_size=self.batch_size,
                max_attempts=attempts,
                dtype=plan.dtype,
                seed=cfg.seed,
                **self._common(),
                **self._runtime(),
            ),
        ]
        # The generation's time limit (the target's load is not in it), at least a minute: not
        # part of the stage's identity, so a rerun with another limit continues the same output.
        limit_s = max(60.0, (plan.estimates["prompts"] - self.rates.load_s) * DATA_TIME_SLACK)
        volatile = flags(max_minutes=round(limit_s / 60, 2)) if plan.magpie else []
        return Stage(
            name="prompts",
            title=f"training prompts: {f'{plan.seeds} of yours + ' if plan.seeds else ''}"
            f"{plan.magpie} by the target",
            argv=argv + volatile,
            output=output,
            complete=complete,
            identity={**strict, "num": plan.magpie, "max_attempts": attempts},
            strict=strict,
            restart=("--overwrite",),
            accept=accept,
            after=after,
            estimate_s=plan.estimates["prompts"],
        )

    def _shrunk_records(self, available: int) -> int | None:
        """The answers to make when the prompts came out slower than planned, else None.

        The prompts stage says how fast the target really generates on this machine; the answers
        stage then answers what fits its estimate at that rate (:func:`~.budget.shrink_records`),
        so the time the probe overpromised is not taken from training. Decided once, after
        this invocation's prompts stage ran whole, and kept in the state (``plan.shrunk``): a
        rerun answers the same records.
        """
        recorded = self.state.get("plan", {}).get("shrunk")
        if recorded is not None:
            return recorded["records"]
        rec = self.state["stages"].get("prompts", {})
        plan = self.plan
        if (
            self.this_run.get("prompts") != "ran"
            or rec.get("runs") != 1
            or not plan.magpie
            or "grown" in self.state.get("plan", {})
        ):
            return None
        planned = plan.records or plan.seeds + plan.magpie
        shrunk = shrink_records(
            planned,
            available=available,
            planned_prompts=plan.magpie,
            candidates=(read_meta(self.out / PROMPTS).get("progress") or {}).get("next_index", 0),
            estimate_s=rec.get("estimate_s", 0.0),
            measured_s=rec.get("last_seconds", 0.0),
            load_s=self.rates.load_s,
        )
        if shrunk is None:
            return None
        records, share = shrunk
        self.state["plan"]["shrunk"] = {
            "from": _sizes(self.state["plan"]),
            "records": records,
            "generation_share": round(share, 3),
        }
        self._save_state()
        self._say(
            f"the prompts came out at {share:.2f}x the planned rate: answering {records} of "
            f"the {available} prompts, so the answers fit their time and training keeps its share",
            "yellow",
        )
        return records

    def _distill(self) -> Stage:
        plan, cfg = self.plan, self.cfg
        output = self.out / ANSWERS
        available = count_lines(self.out / PROMPTS)
        shrunk = self._shrunk_records(available)
        if shrunk is not None:
            plan = dataclasses.replace(plan, records=shrunk)
        answered = min(plan.records or available, available)
        strict = {"max_new_tokens": cfg.max_new_tokens, "dtype": plan.dtype, "target": cfg.target}
        argv = [
            "data",
            "distill",
            *flags(
                input=self.out / PROMPTS,
                output=output,
                limit=plan.records,
                max_new_tokens=cfg.max_new_tokens,
                batch_size=self.batch_size,
                dtype=plan.dtype,
                **self._common(),
                **self._runtime(),
            ),
        ]
        return Stage(
            name="distill",
            title=f"self-distil {answered} prompts",
            argv=argv,
            output=output,
            complete=lambda: output.is_file() and read_meta(output).get("complete") is True,
            identity={**strict, "limit": plan.records},
            strict=strict,
            restart=("--overwrite",),
            # A grown plan's estimate is of the run that extends the answers (grow_plan).
            estimate_s=plan.estimates["distill"]
            if "grown" in self.state.get("plan", {})
            else self.rates.distill_s(answered, cfg.max_new_tokens),
        )

    def _sampled(self) -> Stage:
        """More answers to your prompts, sampled (``plan.sampled`` of them): your prompts come
        first in ``data/prompts.jsonl``, so ``--limit`` takes them, and ``--samples`` passes
        over them, cut at ``--answers``, make the planned count (ids ``#s1``, ``#s2``, ...)."""
        plan, cfg = self.plan, self.cfg
        output = self.out / SAMPLED_ANSWERS
        prompts = self.out / PROMPTS
        yours = count_lines(prompts) - count_lines(prompts, MAGPIE_LINE)
        sampled = min(plan.sampled, cfg.sampled_answers * yours)
        passes = max(1, math.ceil(sampled / max(yours, 1)))
        strict = {
            "max_new_tokens": cfg.max_new_tokens,
            "dtype": plan.dtype,
            "target": cfg.target,
            "temperature": SAMPLE_TEMPERATURE,
            "seed": cfg.seed + 1,
        }
        argv = [
            "data",
            "distill",
            *flags(
                input=prompts,
                output=output,
                limit=yours,
                samples=passes,
                answers=sampled,
                temperature=SAMPLE_TEMPERATURE,
                # Another seed than the training's: these generators are the answers' own.
                seed=cfg.seed + 1,
                max_new_tokens=cfg.max_new_tokens,
                batch_size=self.batch_size,
                dtype=plan.dtype,
                **self._common(),
                **self._runtime(),
            ),
        ]
        if sampled:
            skip = None
        elif cfg.prompts is None:
            skip = "none: there is no --prompts to answer again"
        elif not cfg.sampled_answers:
            skip = "none (--sampled-answers 0)"
        else:
            skip = "none: the budget buys no more records than your prompts"
        return Stage(
            name="sampled",
            title=f"sample {sampled} more answers to your {yours} prompts (T = "
            f"{SAMPLE_TEMPERATURE})"
            if sampled
            else "sampled answers",
            argv=argv,
            output=output,
            complete=lambda: output.is_file() and read_meta(output).get("complete") is True,
            identity={**strict, "answers": sampled, "samples": passes},
            strict=strict,
            restart=("--overwrite",),
            estimate_s=plan.estimates.get("sampled", 0.0),
            skip=skip,
        )

    def _answer_files(self) -> list[Path]:
        """What is trained on: the greedy answers, and the sampled ones when there are any."""
        files = [self.out / ANSWERS]
        if self.plan.sampled and (self.out / SAMPLED_ANSWERS).is_file():
            files.append(self.out / SAMPLED_ANSWERS)
        return files

    def _validation(self) -> Stage:
        """The target's answers to the validation prompts: what training validates on.

        Keyed on its own inputs alone (``chained=False``): it depends on no earlier stage's
        output, so more training prompts (a larger budget) leave it done."""
        plan, cfg = self.plan, self.cfg
        output = self.out / VAL_ANSWERS
        argv = [
            "data",
            "distill",
            *flags(
                input=self.out / VAL_PROMPTS,
                split="all",
                output=output,
                max_new_tokens=cfg.max_new_tokens,
                batch_size=self.batch_size,
                dtype=plan.dtype,
                **self._common(),
                **self._runtime(),
            ),
        ]
        identity = {
            "prompts": self.val_hash,
            "max_new_tokens": cfg.max_new_tokens,
            "dtype": plan.dtype,
            "target": cfg.target,
        }
        return Stage(
            name="validation",
            title=f"answer {len(self.validation)} validation prompts (never trained on)",
            argv=argv,
            output=output,
            complete=lambda: output.is_file() and read_meta(output).get("complete") is True,
            identity=identity,
            restart=("--overwrite",),
            estimate_s=plan.estimates["validation"],
            chained=False,
        )

    def _tokenize(self) -> Stage:
        output = self.out / TOKENIZED
        argv = [
            "data",
            "tokenize",
            *flags(
                input=self._answer_files(),
                output=output,
                max_length=TRAIN_SETTINGS["max_length"],
                **self._common(),
            ),
        ]
        markers = ("dataset_info.json", "state.json", "dataset_dict.json")
        return Stage(
            name="tokenize",
            title=f"tokenize {sum(count_lines(f) for f in self._answer_files())} conversations",
            argv=argv,
            output=output,
            complete=lambda: any((output / m).is_file() for m in markers),
            identity={"max_length": TRAIN_SETTINGS["max_length"], "target": self.cfg.target},
            estimate_s=self.plan.estimates["tokenize"],
        )

    def _cache(self) -> Stage:
        output = self.out / CACHE
        settings = {
            "preset": FAMILY.name,
            "target_dtype": CACHE_TARGET_DTYPES[self.plan.dtype],
            "dtype": "bf16",  # storage
            "max_length": TRAIN_SETTINGS["max_length"],
        }
        argv = [
            "data",
            "cache",
            *flags(
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
        tokens = dataset_tokens(self.out / TOKENIZED)
        return Stage(
            name="cache",
            title=f"cache the target's hidden states ({tokens} tokens)",
            argv=argv,
            output=output,
            complete=lambda: (output / "manifest.json").is_file(),
            identity={**settings, "target": self.cfg.target},
            estimate_s=self.rates.load_s + tokens / self.rates.cache_tokens_per_s,
        )

    def _train(self) -> Stage:
        cfg, plan = self.cfg, self.plan
        output = self.out / RUN
        manifest = read_json(self.out / CACHE / "manifest.json")
        samples, tokens = manifest.get("num_samples", 0), manifest.get("num_tokens", 0)
        val = min(32, max(2, samples // 10))
        vocab = read_json((self.target_path or Path()) / "config.json").get("vocab_size")
        draft_vocab = min(DRAFT_VOCAB_SIZE, vocab or DRAFT_VOCAB_SIZE)
        settings = {**TRAIN_SETTINGS, "ttt_steps": cfg.k, **TRAIN_DTYPES[plan.dtype]}
        # Validation like the evaluation: the answers to the validation prompts choose best/;
        # the val_samples held-back training records are validated too (val_split/*).
        val_records = count_lines(self.out / VAL_ANSWERS)
        val_tokens = round(
            val_records * (self.rates.prompt_tokens + self.rates.answer_share * cfg.max_new_tokens)
        )
        identity = {
            **settings,
            "draft_vocab_size": draft_vocab,
            "val_data": VAL_ANSWERS,
            "val_samples": val,
            "seed": cfg.seed,
            "train_steps": cfg.train_steps,
            "target": cfg.target,
        }
        key = hash_parts("train", identity, self.prev_key)
        rec = self.state["stages"].setdefault("train", {})
        # Time for training: the budget less what the data stages took (all invocations) and the
        # evaluation/export reserve. A run that continues has used part of it already.
        left = plan.train_time_left(self._spent_s("train") + self.probe_s)
        # The schedule (epochs) is fixed when the run first starts, so a resume continues the
        # same cosine schedule; a resumed run gets only the time still left as its hard stop.
        schedule = rec.get("schedule") if rec.get("key") == key else None
        if schedule is None:
            schedule = train_schedule(
                left,
                samples=samples,
                val_samples=val,
                tokens=tokens,
                samples_per_step=TRAIN_SETTINGS["batch_size"] * 2,
                train_steps=cfg.train_steps,
                speed=speed_factor(tokens, self.state["stages"].get("cache", {}), self.rates),
                # The probe timed training steps here: its rate needs no cache correction.
                train_speed=1.0
                if ((self.state.get("plan") or {}).get("probe") or {}).get("probed")
                else None,
                rates=self.rates,
                val_tokens=val_tokens,
            )
            rec["schedule"] = schedule
        steps = schedule["planned_steps"]
        remaining = left - (rec.get("seconds", 0.0) if rec.get("key") == key else 0.0)
        argv = [
            "train",
            "eagle",
            *flags(
                **settings,
                hidden_states_cache=self.out / CACHE,
                draft_vocab_size=draft_vocab,
                val_data=self.out / VAL_ANSWERS,
                val_samples=val,
                epochs=None if cfg.train_steps else schedule["epochs"],
                max_steps=cfg.train_steps,
                # The epochs are the plan's guess at this machine's speed; the run re-plans them
                # from its measured step rate so the cosine ends with the time (fit_schedule).
                fit_schedule=None if cfg.train_steps else True,
                eval_every=max(1, steps // 4),
                save_every=max(1, steps // 8),
                seed=cfg.seed,
                output_dir=output,
                **self._common(),
                **self._runtime(),
            ),
        ]
        volatile = flags(max_minutes=round(max(1.0, remaining / 60), 2))
        what = (
            f"{cfg.train_steps} steps, at most {minutes(remaining)}"
            if cfg.train_steps
            else f"{schedule['epochs']:g} epochs over {samples - val} records"
        ) + f", validated on {val_records} held-out prompts"
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

    def _data_facts(self) -> dict[str, Any]:
        """The records trained on, the epochs planned over them, and the growth or shrinking."""
        grown, shrunk = self.state["plan"].get("grown"), self.state["plan"].get("shrunk")
        schedule = self.state["stages"].get("train", {}).get("schedule") or {}
        return {
            "records": sum(count_lines(f) for f in self._answer_files()),
            "sampled_answers": count_lines(self.out / SAMPLED_ANSWERS) if self.plan.sampled else 0,
            "epochs": None if self.cfg.train_steps else schedule.get("epochs"),
            "grown": {
                "from": grown["from"]["records"]
                or self.plan.seeds + grown["from"]["magpie_prompts"],
                "generation_factor": grown["generation_factor"],
            }
            if grown
            else None,
            "shrunk": {
                "from": shrunk["from"]["records"]
                or self.plan.seeds + shrunk["from"]["magpie_prompts"],
                "records": shrunk["records"],
                "generation_share": shrunk["generation_share"],
            }
            if shrunk
            else None,
        }

    def _drafter_dir(self) -> Path:
        run = self.out / RUN
        # best/: the drafter of the highest validation τ (the recipe keeps it), else the last.
        return run / "best" if (run / "best" / "config.json").is_file() else run / "drafter"

    def _evaluate(self) -> Stage:
        cfg, plan = self.cfg, self.plan
        output = self.out / REPORT
        drafter = self._drafter_dir()
        settings = {
            "dtype": plan.eval_dtype,
            "k": cfg.k,
            "max_new_tokens": cfg.max_new_tokens,
            "limit": plan.eval_prompts,
        }
        # The tree beside the chain: one more shape per prompt on the same plain baseline.
        tree = (
            {"tree_topk": TREE_TOPK, "tree_total_tokens": cfg.tree_nodes} if cfg.tree_nodes else {}
        )
        settings.update(tree)
        shapes = [f"eagle={drafter}"] + ([f"eagle-tree={drafter}"] if tree else [])
        if cfg.auto:  # beside the fixed shapes: plain n-gram lookup and the per-step decision
            shapes += ["ngram", f"auto:eagle-tree={drafter}"]
            settings.update(
                auto_k=AUTO_K,
                auto_nodes=AUTO_NODES,
                calibration_prompts=self.out / VAL_PROMPTS,
                calibration_limit=AUTO_CALIBRATION_PROMPTS,
            )
        argv = [
            "evaluate",
            *flags(
                drafter=shapes,
                **settings,
                out=output,
                target=cfg.target,
                **self._device(),
                threads=cfg.threads,
            ),
        ]
        return Stage(
            name="evaluate",
            title=f"evaluate on {plan.eval_prompts} held-out prompts (plain vs EAGLE-3 "
            f"{'chain and tree' if tree else 'chain'}"
            f"{', n-gram and auto' if cfg.auto else ''}, {plan.eval_dtype})",
            argv=argv,
            output=output,
            complete=lambda: len(evaluated_shapes(read_json(output))) == len(shapes),
            identity={
                **{k: str(v) if isinstance(v, Path) else v for k, v in settings.items()},
                "drafter": drafter.name,
                "target": cfg.target,
                "shapes": len(shapes),
            },
            restart=("--no-resume",),  # other settings: not the prompts of a stopped run
            estimate_s=plan.estimates["evaluate"],
        )

    def _export(self) -> Stage:
        output = self.out / EXPORT
        target = str(self.target_path.resolve()) if self.target_path else None
        argv = [
            "export",
            *flags(
                format=FAMILY.vllm_export().name,  # what vLLM serves
                checkpoint=self._drafter_dir(),
                out=output,
                target=target,
                speculative_tokens=self.cfg.k,
                metrics_json=self.out / REPORT,
                overwrite=True,  # the quickstart owns this directory
                **self._device(),
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

    # --- the report ---------------------------------------------------------------------------

    def _summary(self) -> dict[str, Any]:
        """Print the results, paths and the serve command; write summary.md and the plots."""
        from ..train.decoding.metrics import results_table
        from ..train.report.plots import write_quickstart_plots
        from ..train.report.quickstart import (
            reported_shape,
            shape_label,
            summary_lines,
            summary_markdown,
            validation_figures,
        )

        evaluation = read_json(self.out / REPORT)
        shapes = evaluated_shapes(evaluation)
        # The faster shape is reported; validation simulates a chain, so the chain is what its
        # figures are compared with.
        result = reported_shape(shapes)
        chain = shapes[0] if shapes else {}
        training = read_json(self.out / RUN / "training_metrics.json")
        export = (self.out / EXPORT).resolve()
        target = (self.target_path or Path(str(self.cfg.target))).resolve()
        serve = vllm_serve_command(target, export, self.cfg.k)
        plots = write_quickstart_plots(self.out / PLOTS, training, result)
        stages = self.state["stages"]
        ran_now = sum(self.seconds_this_run.values())
        config = evaluation.get("config") if isinstance(evaluation, dict) else None
        keys = (
            "acceptance_length",
            "acceptance_rate_per_position",
            "tokens_per_second",
            "speedup",
            "speedup_vs_fastest_plain",
            "identical_rate",
            "by_category",
        )
        summary = {
            "shape": shape_label(result, config) if result else None,
            "shapes": [
                {"shape": shape_label(s, config), **{key: s.get(key) for key in keys}}
                for s in shapes
            ],
            "dtype": result.get("dtype") or self.plan.eval_dtype,
            "acceptance_length": result.get("acceptance_length"),
            "acceptance_rate_per_position": result.get("acceptance_rate_per_position"),
            "speedup": result.get("speedup"),
            "speedup_vs_fastest_plain": result.get("speedup_vs_fastest_plain"),
            "identical_to_target": result.get("identical_to_target"),
            "identical_rate": result.get("identical_rate"),
            # The validation that chose the drafter (held-out prompts and training records)
            # against the evaluated τ.
            "validation": {
                **validation_figures(training, chain, count_lines(self.out / VAL_ANSWERS)),
                "of_yours": self.user_val,
            },
            "data": self._data_facts(),
            "drafter": relative_path(self._drafter_dir()),
            "export": relative_path(self.out / EXPORT),
            "report": relative_path(self.out / REPORT),
            "plots": [relative_path(p) for p in plots],
            "summary": relative_path(self.out / SUMMARY_FILE),
            "state": relative_path(self.out / STATE_FILE),
            "vllm_serve": serve,
            "total_seconds": round(self._spent_s(), 1),
            "seconds_this_run": round(ran_now, 1),
        }
        self.console.print()
        if result:
            title = f"target: {self.cfg.target or 'SmolLM2-135M-Instruct'}"
            self.console.print(results_table(shapes, title=title))
        lines = summary_lines(summary, stages, self.this_run, self.cfg)
        for line in lines:
            self._say(line)
        readme = summary_markdown(self.cfg, summary, stages, result, training, self.command)
        (self.out / SUMMARY_FILE).write_text(readme)
        return summary


def _sizes(plan_record: dict[str, Any]) -> dict[str, Any]:
    """The data sizes of a plan as the state records it (what a grown plan grew from)."""
    return {k: plan_record.get(k) for k in ("magpie_prompts", "records")}


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _probe_line(probe: Probe) -> str:
    """One line on the rates the plan uses: where they were measured and what they came to."""
    r = probe.rates
    return (
        f"rates measured on {probe.device.get('gpu_name') or probe.device['device']} in "
        f"{probe.target_dtype}, {probe.seconds:.1f} s: generation "
        f"{r.generate_tokens_per_s:.0f} tok/s (batch {probe.batch_size}), cache "
        f"{r.cache_tokens_per_s:.0f} tok/s, training {r.train_tokens_per_s:.0f} tok/s, "
        f"evaluation {r.eval_tokens_per_s:.1f} tok/s per stream"
    )


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None, *, call: Callable[[list[str]], int] | None = None) -> int:
    """CLI entry: 0 done, 2 bad settings or input, 1 a stage failed, 130 interrupted.

    Args:
        argv: the flags after ``draftsmith quickstart`` (default: ``sys.argv[1:]``).
        call: runs ``draftsmith ARGV`` in this process and returns its exit code: the CLI's
            dispatch, which ``draftsmith quickstart`` hands in (this recipe never imports the
            CLI). Without it the job cannot run its stages: after the flags are checked, a
            usage error names ``draftsmith quickstart``.
    """
    return cli_main(lambda args: _main(args, call), argv)


def _main(argv: list[str], call: Callable[[list[str]], int] | None) -> int:
    cfg = parse_config(QuickstartConfig, argv, prog="draftsmith quickstart", description=__doc__)
    if call is None:
        _no_dispatch(argv)
    return Quickstart(cfg, argv, call).run()


if __name__ == "__main__":
    sys.exit(main())
