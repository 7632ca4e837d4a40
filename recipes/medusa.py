"""Train Medusa heads: Medusa-1 (frozen target) or Medusa-2 (LoRA target + heads, jointly).

Launch::

    python recipes/medusa.py --config recipes/configs/medusa1_smollm2.yaml
    python recipes/medusa.py --config recipes/configs/medusa2_smollm2.yaml --max-minutes 30
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/medusa.py \\
        --config recipes/configs/medusa1_smollm2.yaml            # 2 processes on CPU

Then evaluate and export::

    draftsmith evaluate --drafter medusa=runs/medusa1_smollm2/heads \\
        medusa-tree=runs/medusa1_smollm2/heads --k 4
    draftsmith export --format medusa-vllm --checkpoint runs/medusa1_smollm2/heads --out out/

The recipe reads top to bottom: config -> accelerator -> target (frozen) -> heads (+ LoRA
adapters on the target for Medusa-2) -> data and the target's final hidden states (computed online
inside the step, or read from a cache built by ``draftsmith data cache --preset medusa``) ->
optimizer and warm-up + cosine schedule -> loop (accumulate, backward, clip, step; periodic
``save_state``; resume from the newest checkpoint) -> per-head validation accuracies -> save.

Output directory::

    heads/config.json, heads/model.safetensors   the heads (heads.medusa.load_medusa)
    heads/head_accuracy.json    per-head, per-rank validation accuracy and the automatic tree
    heads/training_metrics.json training log, final metrics, config, versions (also at the root)
    target/                     Medusa-2 only: the merged fine-tuned target + tokenizer
    train_config.yaml           the full config of the run
    checkpoints/step_N/         accelerate state for resuming

Medusa-2 changes the target: its speculative outputs are lossless with respect to the merged
fine-tuned target in ``target/``, not the original target. Evaluate and serve with that target.
See ``docs/medusa.md``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.heads.medusa import ACCURACY_FILE, TARGET_SUBDIR, MedusaHeads
from draftsmith.train.config import (
    ConfigError,
    cfg_field,
    config_to_dict,
    dump_config,
    parse_config,
)
from draftsmith.train.medusa_train import (
    HEAD_LABELS,
    TARGET_LOSSES,
    Medusa1Objective,
    Medusa2Objective,
    accuracy_report,
    add_lora,
    as_teacher,
    rank_counts,
    warmup_cosine,
)
from draftsmith.train.runinfo import run_info, wandb_mode, write_json_atomic

TRAINER_STATE = "trainer_state.json"
HEADS_SUBDIR = "heads"
METRICS_FILE = "training_metrics.json"


@dataclass
class MedusaConfig:
    """Settings of one Medusa training run."""

    stage: str = cfg_field(
        "medusa1",
        help="medusa1: frozen target, heads only; medusa2: LoRA on the target + heads, jointly",
        choices=["medusa1", "medusa2"],
    )
    # --- target and data ---------------------------------------------------------------------
    target: str | None = cfg_field(
        None, help="target: a local HF model dir, a .gguf file, or None for SmolLM2-135M-Instruct"
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    target_dtype: str = cfg_field(
        "auto", help="target weights dtype (auto: fp32 on CPU, bf16 on GPU)",
        choices=["auto", "fp32", "bf16", "fp16"],
    )  # fmt: skip
    data: Path | None = cfg_field(
        None,
        help="training conversations (JSONL/JSON/parquet, e.g. self-distilled) or tokenized data "
        "(datasets dir / JSONL with input_ids+loss_mask); offline mode may omit it",
    )
    split: str | None = cfg_field(
        "train", help="keep only records of this split from conversation files (None = all)"
    )
    limit: int | None = cfg_field(None, help="use the first N samples only")
    max_length: int = cfg_field(512, help="truncate samples to this many tokens")
    val_samples: int = cfg_field(
        64, help="samples held back to measure per-head accuracy (for the automatic tree)"
    )
    hidden_states: str = cfg_field(
        "online",
        help="online: the target runs in the training step; offline: read a hidden-state cache",
        choices=["online", "offline"],
    )
    hidden_states_cache: Path | None = cfg_field(
        None, help="offline: cache dir from `draftsmith data cache --preset medusa`"
    )
    # --- heads and loss ----------------------------------------------------------------------
    num_heads: int = cfg_field(4, help="Medusa heads K (head k predicts token t+k+2)")
    num_layers: int = cfg_field(1, help="residual layers per head")
    share_lm_head: bool = cfg_field(
        False, help="all heads use the target's frozen lm_head (vLLM original_lm_head)"
    )
    head_labels: str = cfg_field(
        "data",
        help="data: the data's tokens; target / target_soft: the target's argmax / distribution "
        "(self-distillation)",
        choices=list(HEAD_LABELS),
    )
    head_decay: float = cfg_field(0.8, help="head k's loss weight is head_decay**k")
    # --- optimisation ------------------------------------------------------------------------
    epochs: float = cfg_field(1.0, help="passes over the training data (fractions allowed)")
    max_steps: int | None = cfg_field(
        None, help="optimizer steps (overrides epochs; sets the LR schedule length)"
    )
    max_minutes: float | None = cfg_field(
        None, help="stop (and save) after this much training time; the schedule is unchanged"
    )
    batch_size: int = cfg_field(4, help="samples per micro-batch per process")
    grad_accum: int = cfg_field(1, help="micro-batches per optimizer step")
    lr: float = cfg_field(1e-3, help="peak learning rate (Medusa-2: of the LoRA adapters)")
    weight_decay: float = cfg_field(0.0, help="AdamW weight decay")
    warmup_ratio: float = cfg_field(0.03, help="fraction of steps of linear LR warm-up")
    max_grad_norm: float = cfg_field(1.0, help="gradient clipping norm (0 = off)")
    mixed_precision: str = cfg_field("no", help="autocast", choices=["no", "bf16", "fp16"])
    seed: int = cfg_field(0, help="random seed (init, shuffling)")
    # --- Medusa-2 ----------------------------------------------------------------------------
    target_loss: str = cfg_field(
        "kl",
        help="medusa2 target loss: kl (to the original target: keeps its distribution) or lm",
        choices=list(TARGET_LOSSES),
    )
    head_weight: float = cfg_field(0.2, help="medusa2: λ, weight of the head losses")
    heads_lr_multiplier: float = cfg_field(4.0, help="medusa2: heads LR = lr × this")
    heads_warmup_steps: int = cfg_field(
        50, help="medusa2: first steps train the heads only (target frozen)"
    )
    lora_r: int = cfg_field(16, help="medusa2: LoRA rank")
    lora_alpha: int = cfg_field(32, help="medusa2: LoRA alpha")
    lora_dropout: float = cfg_field(0.05, help="medusa2: LoRA dropout")
    lora_target_modules: list[str] | None = cfg_field(
        None, help="medusa2: modules to adapt (default: all attention and MLP projections)"
    )
    # --- checkpoints, validation, logging ----------------------------------------------------
    save_every: int = cfg_field(200, help="save a resumable checkpoint every N steps (0 = off)")
    keep_checkpoints: int = cfg_field(2, help="keep the newest N checkpoints")
    resume: bool = cfg_field(True, help="continue from the newest checkpoint in output_dir")
    overwrite: bool = cfg_field(
        False, help="with resume off: start over even if output_dir holds a run"
    )
    eval_every: int = cfg_field(0, help="measure validation accuracy every N steps (0 = at end)")
    tree_nodes: int = cfg_field(64, help="node budget of the automatic tree recorded at the end")
    tree_max_rank: int = cfg_field(10, help="top-k ranks measured per head for the tree")
    log_every: int = cfg_field(10, help="log metrics every N steps")
    report_to: str = cfg_field("none", help="experiment tracker", choices=["none", "wandb"])
    wandb_project: str = cfg_field("draftsmith", help="W&B project")
    threads: int | None = cfg_field(None, help="torch CPU threads per process")
    num_workers: int = cfg_field(0, help="DataLoader worker processes")
    progress: bool = cfg_field(True, help="show the progress bar")
    output_dir: Path = cfg_field(Path("runs/medusa"), help="where heads, metrics, checkpoints go")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        positive = ("num_heads", "num_layers", "batch_size", "grad_accum", "max_length",
                    "log_every", "tree_nodes", "tree_max_rank", "keep_checkpoints", "lora_r")  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                problems.append((name, f"must be >= 1, got {getattr(self, name)}"))
        for name in ("max_steps", "limit", "threads"):
            v = getattr(self, name)
            if v is not None and v < 1:
                problems.append((name, f"must be >= 1, got {v}"))
        for name in ("val_samples", "save_every", "eval_every",
                     "heads_warmup_steps", "num_workers"):  # fmt: skip
            if getattr(self, name) < 0:
                problems.append((name, f"must be >= 0, got {getattr(self, name)}"))
        if self.epochs <= 0:
            problems.append(("epochs", f"must be > 0, got {self.epochs}"))
        if self.max_minutes is not None and self.max_minutes <= 0:
            problems.append(("max_minutes", f"must be > 0, got {self.max_minutes}"))
        if not 0 <= self.warmup_ratio < 1:
            problems.append(("warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}"))
        if self.lr <= 0:
            problems.append(("lr", f"must be > 0, got {self.lr}"))
        if not 0 < self.head_decay <= 1:
            problems.append(("head_decay", f"must be in (0, 1], got {self.head_decay}"))
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            bad = "weight_decay" if self.weight_decay < 0 else "max_grad_norm"
            problems.append((bad, f"must be >= 0, got {getattr(self, bad)}"))
        if self.head_weight < 0:
            problems.append(("head_weight", f"must be >= 0, got {self.head_weight}"))
        if self.heads_lr_multiplier <= 0:
            problems.append(("heads_lr_multiplier", f"must be > 0, got {self.heads_lr_multiplier}"))
        if not 0 <= self.lora_dropout < 1:
            problems.append(("lora_dropout", f"must be in [0, 1), got {self.lora_dropout}"))
        if self.hidden_states == "offline":
            if self.hidden_states_cache is None:
                problems.append(("hidden_states_cache", "offline hidden states need a cache dir"))
            if self.stage == "medusa2":
                problems.append(("hidden_states", "medusa2 trains the target: it must run online"))
        else:
            if self.hidden_states_cache is not None:
                problems.append(("hidden_states_cache", "only read with hidden_states: offline"))
            if self.data is None:
                problems.append(("data", "online hidden states need training records (data)"))
        if self.resume and self.overwrite:
            problems.append(("overwrite", "give resume or overwrite, not both"))
        return problems


# ------------------------------------------------------------------------------------------------
# Helpers (data, checkpoints, validation); the recipe itself is `train` below.
# ------------------------------------------------------------------------------------------------


def _has_accelerator() -> bool:
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return False
    accel = getattr(torch, "accelerator", None)
    return accel.is_available() if accel is not None else torch.cuda.is_available()


def _is_tokenized(path: Path) -> bool:
    """A ``save_to_disk`` directory or a JSON Lines file whose records carry ``input_ids``."""
    if path.is_dir():
        return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
    if path.suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        return "input_ids" in json.loads(line)
                    except (json.JSONDecodeError, TypeError):
                        return False
    return False


def load_tokens(cfg: MedusaConfig, tokenizer: Any) -> Any:
    """The tokenized training data (``datasets.Dataset``: input_ids, loss_mask, id)."""
    from draftsmith.train.data import build_dataset
    from draftsmith.train.vocab import load_token_data

    if _is_tokenized(cfg.data):
        ds = load_token_data(cfg.data)
    else:
        split = None if cfg.split == "all" else cfg.split
        ds, _ = build_dataset(cfg.data, tokenizer, max_length=cfg.max_length, split=split)
    if cfg.limit is not None:
        ds = ds.select(range(min(cfg.limit, len(ds))))
    return ds


def _checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Finished checkpoints (they hold ``trainer_state.json``), oldest first."""
    found = []
    for p in (output_dir / "checkpoints").glob("step_*"):
        if p.is_dir() and p.name[5:].isdigit() and (p / TRAINER_STATE).is_file():
            found.append((int(p.name[5:]), p))
    return sorted(found)


def _save_checkpoint(accelerator, cfg: MedusaConfig, state: dict[str, int]) -> None:
    """``save_state`` into a temp dir, then rename: a ``step_N`` dir is always complete."""
    root = cfg.output_dir / "checkpoints"
    tmp, final = root / f"step_{state['step']}.tmp", root / f"step_{state['step']}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / TRAINER_STATE).write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in _checkpoints(cfg.output_dir)[: -cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


@torch.no_grad()
def _validate(accelerator, cfg, objective, val_set, collate, features) -> dict[str, Any]:
    """Per-head rank accuracies over the validation samples, summed over processes.

    Each process takes every W-th sample; ``features(model, batch)`` returns the final hidden
    states ``[B, T, H]`` and the lm_head that judges them (the target's, possibly adapted).
    """
    model = accelerator.unwrap_model(objective)
    heads = model.heads
    was_training = model.training
    model.eval()
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = [val_set[i] for i in range(rank, len(val_set), world)]
    counts = torch.zeros(heads.num_heads, cfg.tree_max_rank, device=accelerator.device)
    totals = torch.zeros(heads.num_heads, device=accelerator.device)
    for i in range(0, len(mine), cfg.batch_size):
        batch = collate(mine[i : i + cfg.batch_size])
        hidden, loss_mask, lm_head = features(model, batch)
        c, t = rank_counts(heads, hidden, loss_mask, as_teacher(lm_head), cfg.tree_max_rank)
        counts += c
        totals += t
    counts = accelerator.reduce(counts, reduction="sum")
    totals = accelerator.reduce(totals, reduction="sum")
    model.train(was_training)
    return accuracy_report(counts, totals, cfg.tree_nodes)


# ------------------------------------------------------------------------------------------------
# The recipe
# ------------------------------------------------------------------------------------------------


def train(cfg: MedusaConfig) -> dict[str, Any]:
    """Run the recipe; returns the final metrics (what ``training_metrics.json`` holds)."""
    from accelerate import Accelerator
    from accelerate.utils import (
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        ProjectConfiguration,
        set_seed,
    )
    from torch.utils.data import DataLoader, Subset
    from tqdm.auto import tqdm

    from draftsmith.train.data import template_fingerprint
    from draftsmith.train.hidden_states import (
        DTYPES,
        TokenDataset,
        collate_hidden_states,
        dataset_fingerprint,
        feature_source,
    )
    from draftsmith.train.target import load_target, prepare_target

    info = run_info()  # taken at the start: the code and versions that actually ran
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    medusa2 = cfg.stage == "medusa2"

    # --- accelerator ---------------------------------------------------------------------------
    accelerator = Accelerator(
        cpu=not _has_accelerator(),  # CPU processes form one gloo group (see process_state)
        gradient_accumulation_steps=cfg.grad_accum,
        mixed_precision=cfg.mixed_precision,
        log_with="wandb" if cfg.report_to == "wandb" else None,
        project_config=ProjectConfiguration(project_dir=str(out)),
        # Seeded sampler: a resumed run sees the same order of batches as an unbroken one.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        # The Medusa-2 warm-up runs the target without gradients: its adapters get none.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=medusa2)],
    )
    set_seed(cfg.seed)
    main_process = accelerator.is_main_process
    say = accelerator.print
    checkpoints = _checkpoints(out)
    if not cfg.resume and (checkpoints or (out / HEADS_SUBDIR).exists()):
        if not cfg.overwrite:
            raise FileExistsError(
                f"{out} already holds a Medusa run: set resume to continue it or overwrite to "
                "start over"
            )
        if main_process:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
        checkpoints = []
    accelerator.wait_for_everyone()

    # --- target (frozen) -----------------------------------------------------------------------
    target_path = prepare_target(cfg.target, cache_dir=cfg.cache_dir, quiet=not main_process)
    dtype_name = cfg.target_dtype
    if dtype_name == "auto":
        dtype_name = "bf16" if accelerator.device.type == "cuda" else "fp32"
    target, tokenizer = load_target(target_path, dtype=DTYPES[dtype_name],
                                    device=accelerator.device)  # fmt: skip
    feature_layer = int(target.config.num_hidden_layers)  # final normed output (heads.base)
    lm_head = target.get_output_embeddings()  # the teacher of the `target*` head labels

    # --- heads (+ LoRA on the target for Medusa-2) ---------------------------------------------
    # Heads train in fp32 whatever the target's dtype (mixed_precision autocasts the matmuls).
    heads = MedusaHeads.from_target(
        target, cfg.num_heads, cfg.num_layers, share_lm_head=cfg.share_lm_head
    ).float()
    if medusa2:
        target = add_lora(target, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                          target_modules=cfg.lora_target_modules)  # fmt: skip
        objective = Medusa2Objective(target, heads, target_loss=cfg.target_loss,
                                     head_labels=cfg.head_labels, decay=cfg.head_decay,
                                     head_weight=cfg.head_weight)  # fmt: skip
    else:
        objective = Medusa1Objective(heads, labels=cfg.head_labels, decay=cfg.head_decay)
    trainable = sum(p.numel() for p in objective.parameters() if p.requires_grad)
    say(f"{cfg.stage}: {cfg.num_heads} heads x {cfg.num_layers} layers, {trainable / 1e6:.2f}M "
        f"trainable parameters; target {target_path}")  # fmt: skip

    # --- data ----------------------------------------------------------------------------------
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tokens = load_tokens(cfg, tokenizer) if cfg.data is not None else None
    if medusa2:
        # The target is trained, so it runs inside the step with gradients: plain token batches.
        dataset = TokenDataset(tokens, cfg.max_length)
        collate = functools.partial(collate_hidden_states, pad_token_id=pad)

        def complete(batch):
            return {k: v.to(accelerator.device) if torch.is_tensor(v) else v
                    for k, v in batch.items()}  # fmt: skip

        def features(model, batch):  # validation: the adapted target's own hidden states
            batch = complete(batch)
            hidden = model._hidden(batch["input_ids"], batch["attention_mask"])
            return hidden, batch["loss_mask"], model.target.get_output_embeddings()
    else:
        # An offline cache must come from this target and template (the error names each
        # difference); the heads compute in fp32 on stored bf16 features.
        expect = {"hidden_size": int(target.config.hidden_size), "num_layers": feature_layer,
                  "vocab_size": int(lm_head.weight.shape[0]),
                  "template_fingerprint": template_fingerprint(tokenizer)}  # fmt: skip
        if tokens is not None and cfg.hidden_states == "offline" and cfg.limit is None:
            expect["dataset_fingerprint"] = dataset_fingerprint(tokens)
        src = feature_source(cfg.hidden_states, layers=[feature_layer], data=tokens,
                             cache=cfg.hidden_states_cache, target=target, expect=expect,
                             max_length=cfg.max_length, pad_token_id=pad)  # fmt: skip
        dataset, collate = src.dataset, src.collate
        if cfg.hidden_states == "offline" and cfg.limit is not None:
            dataset = Subset(dataset, range(min(cfg.limit, len(dataset))))

        def complete(batch):
            return src.complete(batch, accelerator.device)

        def features(model, batch):
            batch = complete(batch)
            return batch["hidden_states"][feature_layer], batch["loss_mask"], lm_head

    n_all = len(dataset)
    n_val = min(cfg.val_samples, n_all - 1)
    if n_val < 1:
        raise ValueError(f"{n_all} samples: need at least 2 (one to train, one to validate)")
    # A fixed permutation splits train / validation the same way in every process and on resume.
    order = torch.randperm(n_all, generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    train_set = Subset(dataset, sorted(order[n_val:]))
    val_set = Subset(dataset, sorted(order[:n_val]))
    loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, collate_fn=collate,
                        num_workers=cfg.num_workers)  # fmt: skip

    # --- optimizer, prepare, schedule ----------------------------------------------------------
    groups = [{"params": [p for p in heads.parameters() if p.requires_grad],
               "lr": cfg.lr * (cfg.heads_lr_multiplier if medusa2 else 1.0)}]  # fmt: skip
    if medusa2:
        groups.append({"params": [p for p in target.parameters() if p.requires_grad],
                       "lr": cfg.lr})  # fmt: skip
    optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    objective, optimizer, loader = accelerator.prepare(objective, optimizer, loader)
    steps_per_epoch = max(1, len(loader) // cfg.grad_accum)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    warmup = int(cfg.warmup_ratio * total_steps)
    # Per-group LR factors: the heads warm up from step 0; Medusa-2's adapters sit out the
    # heads-only warm-up (factor 0), then get their own warm-up and cosine decay. Stepped here once
    # per optimizer step and not prepared (accelerate would step it once per process).
    lambdas = [warmup_cosine(warmup, total_steps)]
    if medusa2:
        lambdas.append(warmup_cosine(warmup, total_steps, start=cfg.heads_warmup_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambdas)
    accelerator.register_for_checkpointing(scheduler)

    # --- resume --------------------------------------------------------------------------------
    step, epoch, skip, resumed_from = 0, 0, 0, None
    if cfg.resume and checkpoints:
        resumed_from, last = checkpoints[-1]
        accelerator.load_state(str(last))
        state = json.loads((last / TRAINER_STATE).read_text())
        if state.get("num_processes") != accelerator.num_processes:
            say(f"warning: {last} was written by {state.get('num_processes')} processes, this run "
                f"has {accelerator.num_processes}: the data order differs from an unbroken run")  # fmt: skip
        step, epoch, skip = state["step"], state["epoch"], state["batches"]
        if skip >= len(loader):
            epoch, skip = epoch + 1, 0
        say(f"resumed from {last} (step {step} of {total_steps}, epoch {epoch}, batch {skip})")
    if main_process:
        out.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, out / "train_config.yaml")
    if cfg.report_to == "wandb":
        accelerator.init_trackers(
            cfg.wandb_project, config=config_to_dict(cfg),
            init_kwargs={"wandb": {"name": f"{cfg.stage}-{out.name}", "dir": str(out),
                                   "job_type": f"train-{cfg.stage}",
                                   "mode": wandb_mode()}},  # offline without an API key
        )  # fmt: skip

    # --- loop ----------------------------------------------------------------------------------
    K = cfg.num_heads
    history: list[dict[str, Any]] = []
    # Per head: loss x positions, top-1 hits, top-5 hits, positions; summed over the log window.
    window = torch.zeros(4, K, device=accelerator.device)
    window_loss = torch.zeros(3, device=accelerator.device)  # loss, target loss, micro-batches
    params = [p for g in optimizer.param_groups for p in g["params"]]
    bar = tqdm(total=total_steps, initial=step, desc=cfg.stage, dynamic_ncols=True,
               disable=not (main_process and cfg.progress))  # fmt: skip
    objective.train()
    start = time.perf_counter()
    stop_reason = "done"
    batches = skip
    while step < total_steps and stop_reason == "done":
        loader.set_epoch(epoch)  # the seeded sampler: a fixed shuffle per epoch
        epoch_loader = accelerator.skip_first_batches(loader, skip) if skip else loader
        batches, skip = skip, 0
        for batch in epoch_loader:
            batch = complete(batch)
            with accelerator.accumulate(objective):
                if medusa2:
                    out_ = objective(batch["input_ids"], batch["attention_mask"],
                                     batch["loss_mask"], heads_only=step < cfg.heads_warmup_steps)  # fmt: skip
                else:
                    # The wrapped module's forward is what DDP synchronises: the loss runs inside.
                    out_ = objective(batch["hidden_states"][feature_layer], batch["input_ids"],
                                     batch["loss_mask"], teacher=as_teacher(lm_head))  # fmt: skip
                accelerator.backward(out_["loss"])
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            batches += 1
            window += torch.stack([out_["head_loss"] * out_["count"], out_["correct1"],
                                   out_["correct5"], out_["count"]])  # fmt: skip
            loss = out_["loss"].detach().float()
            window_loss += torch.stack([loss, out_.get("target_loss", loss * 0).float(),
                                        torch.ones_like(loss)])  # fmt: skip
            if not accelerator.sync_gradients:
                continue
            step += 1
            scheduler.step()
            bar.update(1)
            if step % cfg.log_every == 0 or step == total_steps:
                logs = _train_logs(accelerator, window, window_loss, medusa2)
                logs["train/lr"] = scheduler.get_last_lr()[0]
                logs["train/epoch"] = epoch
                accelerator.log(logs, step=step)
                history.append({"step": step, **logs})
                bar.set_postfix(loss=f"{logs['train/loss']:.3f}",
                                top1=f"{logs['train/head0_top1']:.2f}")  # fmt: skip
                if not cfg.progress:  # logs (nohup, CI) still show how training goes
                    say(f"step {step}/{total_steps}: loss {logs['train/loss']:.3f}, head-0 "
                        f"top-1 {logs['train/head0_top1']:.3f}")  # fmt: skip
                window.zero_()
                window_loss.zero_()
            if cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
                val = _validate(accelerator, cfg, objective, val_set, collate, features)
                accelerator.log(_val_logs(val), step=step)
                history.append({"step": step, **_val_logs(val)})
                say(f"step {step}: validation top-1 per head "
                    f"{[round(a, 3) for a in val['top1']]}")  # fmt: skip
            if cfg.save_every and step % cfg.save_every == 0:
                _save_checkpoint(accelerator, cfg, _state(step, epoch, batches, accelerator))
            if cfg.max_minutes is not None and time.perf_counter() - start > 60 * cfg.max_minutes:
                stop_reason = "max_minutes"
            if step >= total_steps or stop_reason != "done":
                break
        else:
            epoch += 1
    bar.close()
    train_seconds = time.perf_counter() - start

    # --- validate, save ------------------------------------------------------------------------
    if cfg.save_every and not (out / "checkpoints" / f"step_{step}").exists():
        _save_checkpoint(accelerator, cfg, _state(step, epoch, batches, accelerator))
    report = _validate(accelerator, cfg, objective, val_set, collate, features)
    report["val_samples"] = len(val_set)
    accelerator.log(_val_logs(report), step=step)
    result = {"recipe": "medusa", "stage": cfg.stage, "steps": step, "total_steps": total_steps,
              "stop_reason": stop_reason if step < total_steps else "done",
              "resumed_from": resumed_from, "train_seconds": round(train_seconds, 1),
              "processes": accelerator.num_processes, "train_samples": len(train_set),
              "trainable_parameters": trainable, "validation": report, "train_log": history,
              "data": str(cfg.data or cfg.hidden_states_cache), "config": config_to_dict(cfg),
              **info}  # fmt: skip
    accelerator.wait_for_everyone()
    if main_process:
        model = accelerator.unwrap_model(objective)
        extra = {"stage": cfg.stage, "feature_layer": feature_layer,
                 "target_name_or_path": str(target_path), "head_labels": cfg.head_labels}  # fmt: skip
        if medusa2:
            # Medusa-2 outputs are lossless w.r.t. this merged fine-tuned target, not the original.
            merged = model.target.merge_and_unload()
            merged.save_pretrained(out / TARGET_SUBDIR)
            tokenizer.save_pretrained(out / TARGET_SUBDIR)
            extra["target_dir"] = f"../{TARGET_SUBDIR}"
        model.heads.save(out / HEADS_SUBDIR, extra=extra)
        write_json_atomic(out / HEADS_SUBDIR / ACCURACY_FILE, report)
        write_json_atomic(out / HEADS_SUBDIR / METRICS_FILE, result)
        write_json_atomic(out / METRICS_FILE, result)
        top1 = ", ".join(f"{a:.3f}" for a in report["top1"])
        say(f"saved heads to {out / HEADS_SUBDIR} after {step} steps ({train_seconds / 60:.1f} "
            f"min); validation top-1 per head [{top1}]; automatic tree of "
            f"{report['tree']['nodes']} nodes, predicted τ "
            f"{report['tree']['expected_acceptance_length']:.2f}")  # fmt: skip
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


def _state(step: int, epoch: int, batches: int, accelerator) -> dict[str, int]:
    """Where the loop stands, for resuming: optimizer steps, epoch, batches into the epoch."""
    return {"step": step, "epoch": epoch, "batches": batches,
            "num_processes": accelerator.num_processes}  # fmt: skip


def _train_logs(accelerator, window, window_loss, medusa2: bool) -> dict[str, float]:
    """Mean loss and per-head loss/top-1/top-5 over the log window, all processes together."""
    w = accelerator.reduce(window, reduction="sum")
    wl = accelerator.reduce(window_loss, reduction="sum")
    n = w[3].clamp_min(1)
    logs = {"train/loss": float(wl[0] / wl[2])}
    if medusa2:
        logs["train/target_loss"] = float(wl[1] / wl[2])
    for k in range(w.shape[1]):
        logs[f"train/head{k}_loss"] = float(w[0, k] / n[k])
        logs[f"train/head{k}_top1"] = float(w[1, k] / n[k])
        logs[f"train/head{k}_top5"] = float(w[2, k] / n[k])
    return logs


def _val_logs(report: dict[str, Any]) -> dict[str, float]:
    logs = {}
    for k, (a1, a5) in enumerate(zip(report["top1"], report["top5"], strict=True)):
        logs[f"val/head{k}_top1"] = a1
        logs[f"val/head{k}_top5"] = a5
    logs["val/tree_expected_tau"] = report["tree"]["expected_acceptance_length"]
    logs["val/chain_expected_tau"] = report["chain_expected_acceptance_length"]
    return logs


def main(argv: list[str] | None = None) -> int:
    """CLI entry: exit 0 on success, 2 on a config error, 1 on a data/target/run error."""
    from draftsmith.train.data import DataFileError, TemplateError
    from draftsmith.train.hidden_states import CacheError
    from draftsmith.train.target import TargetError

    try:
        cfg = parse_config(MedusaConfig, argv, prog="draftsmith train medusa", description=__doc__)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        train(cfg)
    except (DataFileError, TemplateError, TargetError, CacheError, FileExistsError,
            FileNotFoundError, ValueError) as exc:  # fmt: skip
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
