"""The fields every training recipe shares, with their ranges (one name and meaning per value).

A recipe's config subclasses :class:`TrainConfig` and adds its own fields; it may redeclare a
shared field to change its default (``output_dir``, ``lr``, ...). Ranges are declared on the
fields (``cfg_field(ge=...)``) and checked by the config loader together with finiteness of
every float, so a recipe's ``validate()`` only holds checks across fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import cfg_field
from ..device import DEVICE_HELP, DTYPE_AUTO_HELP, device_problem

# Why fp16 autocast is refused: its loss scaling skips every step whose scaled gradients
# overflow, which the run's non-finite check would report as a fault and stop on.
FP16_REFUSED = (
    "fp16 needs a GradScaler whose skipped steps the non-finite check would stop on; use bf16 "
    "(autocast on CUDA and on the CPU, no loss scaling)"
)


@dataclass
class TrainConfig:
    """Settings shared by every training recipe (optimisation, schedule, checkpoints, logging)."""

    # --- target ---
    target: str | None = cfg_field(
        None,
        help="target: a Hugging Face Hub id, a local HF model dir, a .gguf file, or None for SmolLM2-135M-Instruct",
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    # --- optimisation ---
    epochs: float = cfg_field(1.0, help="passes over the training data (fractions allowed)", gt=0)
    max_steps: int | None = cfg_field(
        None, help="optimizer steps (overrides epochs; sets the LR schedule length)", ge=1
    )
    batch_size: int = cfg_field(4, help="samples per process per micro-batch", ge=1)
    grad_accum: int = cfg_field(1, help="micro-batches per optimizer step", ge=1)
    lr: float = cfg_field(5e-4, help="peak learning rate (AdamW)", gt=0)
    weight_decay: float = cfg_field(0.0, help="AdamW weight decay", ge=0)
    warmup_ratio: float = cfg_field(0.03, help="fraction of steps of linear warm-up", ge=0, lt=1)
    max_grad_norm: float = cfg_field(1.0, help="gradient clipping norm (0 = off)", ge=0)
    mixed_precision: str = cfg_field(
        "auto",
        help="no, or bf16: autocast of the trained model's forward and backward, fp32 master "
        "weights (accelerate; on CUDA and on the CPU). fp16 is refused (loss scaling). "
        + DTYPE_AUTO_HELP.replace("fp32 elsewhere", "no elsewhere"),
        choices=["auto", "no", "bf16", "fp16"],
    )
    seed: int = cfg_field(0, help="random seed (split, data order, initialisation)")
    on_nonfinite: str = cfg_field(
        "stop",
        help="a non-finite loss or gradient norm: stop (exit 1, last good checkpoint kept) or "
        "skip that optimizer step (counted and logged)",
        choices=["stop", "skip"],
    )
    # --- data ---
    val_samples: int = cfg_field(
        32, help="training records held back for validation (0 = none)", ge=0
    )
    val_data: Path | None = cfg_field(
        None,
        help="validation records like the evaluation's: the target's answers to held-out "
        "prompts of the kind you will serve (`draftsmith data distill` of them; every record "
        "is used). Simulated τ on them chooses best/ and is val/sim_tau; the val_samples "
        "training records are validated too, as val_split/*, and val/sim_tau_gap says how much "
        "they overstate it. None: validate on the val_samples records",
    )
    min_train_samples: int = cfg_field(
        8, help="refuse to train on fewer samples than this (see allow_little_data)", ge=1
    )
    allow_little_data: bool = cfg_field(
        False,
        help="train even when most records were dropped or fewer than min_train_samples remain",
    )
    # --- input pipeline (train.core.data.train_loader; docs/scaling.md, "Input pipeline") ---
    num_workers: int | None = cfg_field(
        None,
        help="DataLoader worker processes per training process, reading and padding batches "
        "while the step runs (an offline cache's hidden states: ~33 KB a token at 8B). None: "
        "0 on a CPU (a worker takes a core from the step), 2 on a GPU (fewer if the node's "
        "cores are short). Workers never touch the target",
        ge=0,
    )
    prefetch_factor: int = cfg_field(
        2,
        help="batches each worker prepares ahead (num_workers > 0); each process holds up to "
        "num_workers x prefetch_factor batches in shared memory",
        ge=1,
    )
    group_by_length: bool = cfg_field(
        True,
        help="batches of samples of similar length (shuffled, then sorted by length within "
        "windows of 50 batches; the batches' order random, fixed by seed and epoch): far less "
        "padding than random batches when lengths vary. Off: random batches",
    )
    # --- time ---
    max_minutes: float | None = cfg_field(
        None,
        help="time budget from the start of the run (loading included): the first optimizer "
        "step past it ends training (checkpoint, final save); the schedule is unchanged "
        "unless fit_schedule",
        gt=0,
    )
    fit_schedule: bool = cfg_field(
        False,
        help="with max_minutes: re-plan the learning-rate schedule's total steps from the "
        "measured step rate (validations included) so that its cosine ends with the budget, "
        "more steps or fewer than epochs planned; kept in checkpoints. Not with max_steps",
    )
    stop_after_steps: int | None = cfg_field(
        None,
        help="pause after N optimizer steps of this invocation (checkpoint; resume later)",
        ge=1,
    )
    # --- validation, checkpoints, output ---
    eval_every: int = cfg_field(
        100, help="validate every N optimizer steps, and at the end (0 = at the end only)", ge=0
    )
    save_every: int = cfg_field(
        200, help="save a resumable checkpoint every N optimizer steps (0 = never)", ge=0
    )
    keep_checkpoints: int = cfg_field(
        2, help="newest checkpoints kept (the best-validation one is kept too)", ge=1
    )
    resume: bool = cfg_field(True, help="continue from the newest checkpoint in output_dir")
    overwrite: bool = cfg_field(
        False, help="with resume off: start over even if output_dir holds a run (deletes it)"
    )
    output_dir: Path = cfg_field(Path("runs/run"), help="checkpoints, the drafter, metrics")
    # --- processes, logging ---
    # Under accelerate, auto lets the launcher decide (a GPU per process when there are GPUs),
    # cpu forces CPU processes, and cuda/cuda:N must be what the launcher gave the process
    # (TrainRun refuses anything else); recipes then use accelerator.device throughout.
    device: str = cfg_field("auto", help=DEVICE_HELP)
    threads: int | None = cfg_field(
        None, help="torch CPU threads per process (CPU runs; ignored on a GPU)", ge=1
    )
    pg_timeout_minutes: float = cfg_field(
        10.0,
        help="multi-process: a collective waiting longer than this (a stuck or stopped rank) "
        "ends the run with a message",
        gt=0,
    )
    load_timeout_minutes: float = cfg_field(
        60.0,
        help="multi-process: how long the processes that finished loading the target wait for "
        "the others (one reading from a slower disk) before the run ends with a message naming "
        "the late ones",
        gt=0,
    )
    log_every: int = cfg_field(10, help="log training metrics every N optimizer steps", ge=1)
    report_to: str = cfg_field("none", help="experiment tracker", choices=["none", "wandb"])
    wandb_project: str = cfg_field("draftsmith", help="W&B project")
    progress: bool = cfg_field(True, help="show a progress bar (off: one log line per log_every)")

    def input_paths(self) -> dict[str, Path | None]:
        """The files and directories this run will read, by config field (``None``: unset).

        :class:`~draftsmith.train.core.run.TrainRun` refuses a run with a missing one before
        anything is loaded or written, naming the field, the path and the command that makes
        it (:func:`~draftsmith.train.core.data.check_inputs`). Recipes list their data fields;
        a field the run will not read (offline features leave ``data`` unread) is left out.
        """
        return {}

    def validate(self) -> list[tuple[str, str]]:
        """Checks across the shared fields; recipes extend the list with their own."""
        problems = []
        if self.resume and self.overwrite:
            problems.append(("overwrite", "give resume or overwrite, not both (--no-resume)"))
        device = device_problem(self.device)
        if device:
            problems.append(("device", device))
        if self.mixed_precision == "fp16":
            problems.append(("mixed_precision", FP16_REFUSED))
        if self.fit_schedule and self.max_minutes is None:
            problems.append(("fit_schedule", "needs max_minutes: the budget the schedule fits"))
        if self.fit_schedule and self.max_steps is not None:
            problems.append(
                ("fit_schedule", "fits epochs to max_minutes; max_steps fixes the steps")
            )
        return problems
