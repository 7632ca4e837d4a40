"""Distil a small draft LM from the target (DistillSpec, Zhou et al. 2024).

Launch::

    python recipes/distill.py --config recipes/configs/distill_smollm2.yaml
    python recipes/distill.py --data data/alpaca_sd.jsonl --draft-layers 0 --loss tvd --max-steps 200
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/distill.py \\
        --config recipes/configs/distill_smollm2.yaml

The frozen target supplies its next-token distribution p online (one no-grad forward per batch);
the draft's q is trained towards it with a selectable divergence (forward KL, reverse KL, total
variation, JSD; see ``train/distill_losses.py``) on the assistant tokens of self-distilled
conversations, optionally mixed with cross-entropy on the data and optionally on-policy: on a
fraction of the steps the answers are sampled from the draft itself and scored by the target
(DistillSpec §4.1; GKD, Agarwal et al. 2024), so the draft learns on the prefixes it will
actually produce.

A held-out fraction of the training records (not the evaluation prompts) measures, before
training and every ``eval_every`` steps, the loss, the expected acceptance Σ min(p, q) and the
greedy agreement (argmax match). Checkpoints (``accelerator.save_state``) go to
``output_dir/checkpoints/step_N``; a rerun with ``resume: true`` continues from the latest one,
skipping the batches already seen. The result is ``output_dir/draft/`` (``save_pretrained`` model
+ tokenizer + model card, loadable by ``AutoModelForCausalLM``) and ``output_dir/metrics.json``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from draftsmith.train.config import (
    ConfigError,
    cfg_field,
    config_to_dict,
    dump_config,
    parse_config,
)
from draftsmith.train.data import DataFileError, TemplateError, build_dataset
from draftsmith.train.distill_losses import (
    LOSSES,
    distill_loss,
    expected_acceptance,
    greedy_agreement,
    prediction_mask,
)
from draftsmith.train.draft_init import DRAFT_INITS, compute_ratio, init_draft
from draftsmith.train.export_hf import save_draft
from draftsmith.train.hidden_states import TokenDataset, collate_hidden_states, process_state
from draftsmith.train.runinfo import run_info, wandb_mode, write_json_atomic
from draftsmith.train.target import TargetError, load_target


@dataclass
class DistillConfig:
    """Settings of one distillation run."""

    # --- target and data ---
    target: str | None = cfg_field(
        None, help="target: a local HF model dir, a .gguf file, or None for SmolLM2-135M-Instruct"
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    data: Path | None = cfg_field(
        None,
        help="self-distilled conversations (JSONL/JSON/parquet file or dir), or a dir saved by "
        "`draftsmith data tokenize`",
    )
    split: str = cfg_field(
        "train",
        help="records to use: train (never the held-out ones) or all",
        choices=["train", "all"],
    )
    max_length: int = cfg_field(1024, help="truncate conversations to this many tokens")
    val_fraction: float = cfg_field(
        0.05, help="share of the training records held out for validation (0 = none)"
    )
    val_max_samples: int = cfg_field(64, help="at most this many validation records")
    # --- draft ---
    draft_init: str = cfg_field(
        "pruned",
        help="pruned: copy of chosen target layers; fresh: new model; path: local model dir",
        choices=list(DRAFT_INITS),
    )
    draft_layers: list[int] | None = cfg_field([0], help="pruned: target layers to keep, in order")
    draft_model: Path | None = cfg_field(None, help="path: a local HF model dir (same tokenizer)")
    fresh_layers: int = cfg_field(2, help="fresh: decoder layers")
    fresh_hidden_size: int | None = cfg_field(None, help="fresh: width (default: the target's)")
    fresh_heads: int | None = cfg_field(None, help="fresh: attention heads (default: target's)")
    fresh_kv_heads: int | None = cfg_field(None, help="fresh: key/value heads")
    fresh_intermediate_size: int | None = cfg_field(None, help="fresh: MLP width")
    fresh_copy_embeddings: bool = cfg_field(
        False, help="fresh: start from the target's embeddings, final norm, lm_head (same width)"
    )
    # --- loss ---
    loss: str = cfg_field(
        "fkl", help="fkl: KL(p||q), rkl: KL(q||p), tvd: total variation, jsd", choices=list(LOSSES)
    )
    temperature: float = cfg_field(1.0, help="softmax temperature of p and q in the loss")
    jsd_beta: float = cfg_field(0.5, help="jsd: mixture weight beta in (0, 1)")
    ce_weight: float = cfg_field(0.0, help="weight of cross-entropy on the data tokens, in [0, 1]")
    # --- on-policy data ---
    on_policy_fraction: float = cfg_field(
        0.0, help="share of optimizer steps trained on answers sampled from the draft"
    )
    on_policy_max_new_tokens: int = cfg_field(64, help="on-policy: tokens the draft samples")
    on_policy_temperature: float = cfg_field(1.0, help="on-policy: draft sampling temperature")
    # --- optimisation ---
    batch_size: int = cfg_field(4, help="conversations per batch per process")
    gradient_accumulation_steps: int = cfg_field(1, help="batches per optimizer step")
    lr: float = cfg_field(1e-4, help="peak learning rate (AdamW)")
    weight_decay: float = cfg_field(0.0, help="AdamW weight decay")
    warmup_ratio: float = cfg_field(0.03, help="share of the steps with linear warmup")
    epochs: int = cfg_field(1, help="passes over the training records (unless max_steps is set)")
    max_steps: int | None = cfg_field(None, help="optimizer steps in total (overrides epochs)")
    max_minutes: float | None = cfg_field(
        None,
        help="time budget of this invocation (wall clock from start, loading and validation "
        "included): the first step past it ends training (final validation, save)",
    )
    stop_after_steps: int | None = cfg_field(
        None, help="pause this invocation after N optimizer steps (checkpoint only; resume later)"
    )
    max_grad_norm: float = cfg_field(1.0, help="gradient clipping norm (0 = off)")
    mixed_precision: str = cfg_field(
        "no", help="accelerate mixed precision", choices=["no", "bf16", "fp16"]
    )
    seed: int = cfg_field(0, help="seed for data order, validation split and initialisation")
    # --- logging and checkpoints ---
    output_dir: Path = cfg_field(Path("runs/distill"), help="checkpoints, draft, metrics")
    log_every: int = cfg_field(10, help="log training metrics every N optimizer steps")
    eval_every: int = cfg_field(100, help="validate every N optimizer steps (0 = start and end)")
    save_every: int = cfg_field(100, help="checkpoint every N optimizer steps (0 = never)")
    keep_checkpoints: int = cfg_field(2, help="checkpoints kept (oldest deleted)")
    resume: bool = cfg_field(True, help="continue from the latest checkpoint in output_dir")
    report_to: str = cfg_field("none", help="experiment tracker", choices=["none", "wandb"])
    wandb_project: str = cfg_field("draftsmith", help="W&B project")
    threads: int | None = cfg_field(None, help="torch CPU threads per process")
    progress: bool = cfg_field(True, help="show a progress bar")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.data is None:
            problems.append(("data", "required: the conversations to train on"))
        if self.max_length < 2:
            problems.append(("max_length", f"must be >= 2, got {self.max_length}"))
        if not 0 <= self.val_fraction < 1:
            problems.append(("val_fraction", f"must be in [0, 1), got {self.val_fraction}"))
        if self.val_max_samples < 1:
            problems.append(("val_max_samples", f"must be >= 1, got {self.val_max_samples}"))
        if self.draft_init == "pruned":
            layers = self.draft_layers or []
            if not layers:
                problems.append(("draft_layers", "pruned draft needs at least one layer"))
            elif min(layers) < 0 or len(set(layers)) != len(layers):
                problems.append(("draft_layers", f"need distinct indices >= 0, got {layers}"))
        if self.draft_init == "path" and self.draft_model is None:
            problems.append(("draft_model", "draft_init path needs draft_model"))
        if self.draft_init != "path" and self.draft_model is not None:
            problems.append(("draft_model", "only used with draft_init: path"))
        if self.fresh_layers < 1:
            problems.append(("fresh_layers", f"must be >= 1, got {self.fresh_layers}"))
        for name in (
            "fresh_hidden_size",
            "fresh_heads",
            "fresh_kv_heads",
            "fresh_intermediate_size",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append((name, f"must be >= 1, got {value}"))
        if self.temperature <= 0:
            problems.append(("temperature", f"must be > 0, got {self.temperature}"))
        if not 0 < self.jsd_beta < 1:
            problems.append(("jsd_beta", f"must be in (0, 1), got {self.jsd_beta}"))
        if not 0 <= self.ce_weight <= 1:
            problems.append(("ce_weight", f"must be in [0, 1], got {self.ce_weight}"))
        if not 0 <= self.on_policy_fraction <= 1:
            problems.append(
                ("on_policy_fraction", f"must be in [0, 1], got {self.on_policy_fraction}")
            )
        if self.on_policy_max_new_tokens < 1:
            problems.append(("on_policy_max_new_tokens", "must be >= 1"))
        if self.on_policy_temperature < 0:
            problems.append(("on_policy_temperature", "must be >= 0 (0 = greedy)"))
        for name in ("batch_size", "gradient_accumulation_steps", "epochs", "log_every"):
            if getattr(self, name) < 1:
                problems.append((name, f"must be >= 1, got {getattr(self, name)}"))
        if self.lr <= 0:
            problems.append(("lr", f"must be > 0, got {self.lr}"))
        if self.weight_decay < 0:
            problems.append(("weight_decay", f"must be >= 0, got {self.weight_decay}"))
        if not 0 <= self.warmup_ratio < 1:
            problems.append(("warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}"))
        for name in ("max_steps", "stop_after_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append((name, f"must be >= 1, got {getattr(self, name)}"))
        if self.max_minutes is not None and self.max_minutes <= 0:
            problems.append(("max_minutes", f"must be > 0, got {self.max_minutes}"))
        if self.max_grad_norm < 0:
            problems.append(("max_grad_norm", f"must be >= 0, got {self.max_grad_norm}"))
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                problems.append((name, f"must be >= 0, got {getattr(self, name)}"))
        if self.keep_checkpoints < 1:
            problems.append(("keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}"))
        if self.threads is not None and self.threads < 1:
            problems.append(("threads", f"must be >= 1, got {self.threads}"))
        return problems


class InputError(Exception):
    """A problem with the run's inputs (data, target, draft): exit code 2, no traceback."""


# --------------------------------------------------------------------------------------------
# Pieces of the step
# --------------------------------------------------------------------------------------------


def masked_logits(model, batch: dict[str, Any], keep: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` logits at the ``keep [B, T]`` positions (HF ``logits_to_keep`` as a bool mask).

    Only the kept positions go through the lm_head: for a 49k-token vocabulary the full
    ``[B, T, V]`` logits would be most of the memory of a step.
    """
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        logits_to_keep=keep,
        use_cache=False,
    ).logits
    if out.dim() == 3 and out.shape[:2] == keep.shape:  # a model without mask support
        out = out[keep]
    return out


def batch_logits(draft, target, batch: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """Target and draft logits at the supervised positions of a batch.

    Returns:
        ``(p_logits [N, V], q_logits [N, V], labels [N])``; p without gradient.
    """
    keep, labels = prediction_mask(batch["input_ids"], batch["loss_mask"], batch["attention_mask"])
    with torch.no_grad():
        p = masked_logits(target, batch, keep)
    q = masked_logits(draft, batch, keep)
    return p, q, labels


def step_loss(cfg: DistillConfig, p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor):
    """The configured loss on ``[N, V]`` logits."""
    return distill_loss(
        cfg.loss,
        p,
        q,
        labels=labels,
        ce_weight=cfg.ce_weight,
        temperature=cfg.temperature,
        beta=cfg.jsd_beta,
    )


def is_on_policy_step(step: int, fraction: float) -> bool:
    """Whether optimizer step ``step`` trains on draft samples: spread evenly, same on all ranks."""
    return math.floor((step + 1) * fraction) > math.floor(step * fraction)


@torch.no_grad()
def on_policy_batch(
    draft, batch: dict[str, Any], cfg: DistillConfig, pad_id: int, eos_ids: list[int]
) -> dict[str, Any]:
    """Replace each answer by a continuation the draft samples after the answer's prompt.

    The prompt of a sample is everything before its first supervised token (system, user turn and
    assistant header); the draft samples up to ``on_policy_max_new_tokens`` tokens (stopping at
    EOS), which become the supervised tokens scored by the target (GKD §3: on-policy data).

    Args:
        draft: the unwrapped draft model.
        batch: a collated batch (``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, T]``).
        cfg: the run's config.
        pad_id: padding id.
        eos_ids: ids that end an answer.

    Returns:
        A right-padded batch of the same form, ``loss_mask`` 1 on the sampled tokens.
    """
    ids, mask = batch["input_ids"], batch["loss_mask"]
    prompts = [ids[i, : int(mask[i].nonzero()[0])] for i in range(ids.shape[0])]
    width = max(len(p) for p in prompts)
    left = torch.full((len(prompts), width), pad_id, dtype=ids.dtype, device=ids.device)
    attn = torch.zeros_like(left)
    for i, p in enumerate(prompts):  # left-padded, as generate() needs for a batch
        left[i, width - len(p) :] = p
        attn[i, width - len(p) :] = 1
    sampling = (
        {"do_sample": True, "temperature": cfg.on_policy_temperature, "top_k": 0, "top_p": 1.0}
        if cfg.on_policy_temperature > 0
        else {"do_sample": False}
    )
    was_training = draft.training
    draft.eval()
    out = draft.generate(
        input_ids=left,
        attention_mask=attn,
        max_new_tokens=cfg.on_policy_max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos_ids or None,
        **sampling,
    )
    draft.train(was_training)
    samples = []
    for i, p in enumerate(prompts):
        gen = out[i, width:].tolist()
        cut = next((j + 1 for j, t in enumerate(gen) if t in eos_ids), len(gen))
        gen = gen[:cut]
        new = torch.cat([p.cpu(), torch.tensor(gen, dtype=torch.long)])
        loss_mask = torch.cat(
            [torch.zeros(len(p), dtype=torch.long), torch.ones(len(gen), dtype=torch.long)]
        )
        samples.append({"input_ids": new, "loss_mask": loss_mask})
    new_batch = collate_hidden_states(samples, pad_token_id=pad_id)
    return {k: v.to(ids.device) if torch.is_tensor(v) else v for k, v in new_batch.items()}


@torch.no_grad()
def validate(draft, target, samples, cfg: DistillConfig, accelerator) -> dict[str, float]:
    """Loss, expected acceptance and greedy agreement on the validation samples, all ranks.

    Each rank scores every ``num_processes``-th sample; sums are reduced, so the figures are
    token-weighted means over the whole validation split.
    """
    was_training = draft.training
    draft.eval()
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = [samples[i] for i in range(rank, len(samples), world)]
    sums = torch.zeros(4, dtype=torch.float64, device=accelerator.device)
    for start in range(0, len(mine), cfg.batch_size):
        batch = collate_hidden_states(mine[start : start + cfg.batch_size], pad_token_id=0)
        batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        p, q, labels = batch_logits(draft, target, batch)
        n = labels.numel()
        sums += torch.tensor(
            [
                float(step_loss(cfg, p, q, labels)) * n,
                float(expected_acceptance(p, q)) * n,
                float(greedy_agreement(p, q)) * n,
                n,
            ],
            dtype=torch.float64,
            device=sums.device,
        )
    sums = accelerator.reduce(sums, reduction="sum")
    draft.train(was_training)
    tokens = max(float(sums[3]), 1.0)
    return {
        "loss": float(sums[0]) / tokens,
        "expected_acceptance": float(sums[1]) / tokens,
        "greedy_agreement": float(sums[2]) / tokens,
        "tokens": int(sums[3]),
    }


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------

_STATE_FILE = "trainer_state.json"


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step (its state file is written last)."""
    root = output_dir / "checkpoints"
    found = []
    for path in root.glob("step_*") if root.is_dir() else []:
        m = re.fullmatch(r"step_(\d+)", path.name)
        if m and (path / _STATE_FILE).is_file():
            found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


def save_checkpoint(accelerator, output_dir: Path, state: dict[str, Any], keep: int) -> Path:
    """``save_state`` into ``checkpoints/step_N``, then the loop state; prune old ones."""
    path = output_dir / "checkpoints" / f"step_{state['step']}"
    accelerator.save_state(str(path))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json_atomic(path / _STATE_FILE, state)
        done = sorted(
            (int(p.name.split("_")[1]), p)
            for p in path.parent.glob("step_*")
            if (p / _STATE_FILE).is_file()
        )
        for _, old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _split_validation(n: int, cfg: DistillConfig) -> tuple[list[int], list[int]]:
    """Seeded split of record indices into (train, validation)."""
    n_val = (
        0
        if cfg.val_fraction == 0
        else min(cfg.val_max_samples, max(1, round(cfg.val_fraction * n)))
    )
    if n - n_val < 1:
        raise InputError(f"{n} training records leave none for training after validation")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    return sorted(order[n_val:]), sorted(order[:n_val])


def load_data(cfg: DistillConfig, tokenizer) -> tuple[Any, Any]:
    """The training records as a tokenized ``datasets.Dataset`` (input_ids, loss_mask, id).

    ``cfg.data`` is either conversations (tokenized here with the target's chat template, see
    :func:`build_dataset`) or a directory saved by ``draftsmith data tokenize`` (used as is: its
    split and length were chosen when it was made; ``max_length`` still truncates).
    """
    path = Path(cfg.data)
    if (path / "dataset_info.json").is_file():
        import datasets

        dataset = datasets.load_from_disk(str(path))
        missing = {"input_ids", "loss_mask"} - set(dataset.column_names)
        if missing:
            raise ValueError(f"{path}: tokenized dataset lacks columns {sorted(missing)}")
        # keep_in_memory: no cache files written into the user's dataset directory.
        dataset = dataset.map(
            lambda row: {k: row[k][: cfg.max_length] for k in ("input_ids", "loss_mask")},
            keep_in_memory=True,
        ).filter(lambda row: sum(row["loss_mask"][1:]) > 0, keep_in_memory=True)
        return dataset, f"{len(dataset)} tokenized samples from {path}"
    return build_dataset(
        path, tokenizer, max_length=cfg.max_length, split=None if cfg.split == "all" else cfg.split
    )


def _eos_ids(tokenizer, target) -> list[int]:
    ids = {tokenizer.eos_token_id}
    eos = target.generation_config.eos_token_id
    ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return sorted(i for i in ids if i is not None)


def run(cfg: DistillConfig) -> dict[str, Any]:
    """Train a draft as ``cfg`` says; return the metrics (also written to ``metrics.json``).

    Raises:
        InputError: bad data, target or draft (the message says which).
    """
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    info = run_info()
    started = time.monotonic()
    # --- accelerator --------------------------------------------------------------------------
    # CPU processes need a CPU state before the Accelerator (see process_state); on a GPU
    # machine this is the normal one-process-per-device state.
    state = process_state()
    accelerator = Accelerator(
        cpu=state.device.type == "cpu",
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        mixed_precision=cfg.mixed_precision,
        log_with="wandb" if cfg.report_to == "wandb" else None,
        project_config=ProjectConfiguration(project_dir=str(cfg.output_dir)),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    main_proc = accelerator.is_main_process
    say = accelerator.print
    set_seed(cfg.seed)

    # --- target, draft ------------------------------------------------------------------------
    try:
        target, tokenizer = load_target(cfg.target, cache_dir=cfg.cache_dir)
    except TargetError as exc:
        raise InputError(str(exc)) from exc
    target.to(accelerator.device)
    try:
        draft = init_draft(
            cfg.draft_init,
            target,
            tokenizer,
            layers=cfg.draft_layers,
            path=cfg.draft_model,
            fresh={
                "num_layers": cfg.fresh_layers,
                "hidden_size": cfg.fresh_hidden_size,
                "num_heads": cfg.fresh_heads,
                "num_kv_heads": cfg.fresh_kv_heads,
                "intermediate_size": cfg.fresh_intermediate_size,
                "copy_embeddings": cfg.fresh_copy_embeddings,
                "seed": cfg.seed,
            },
        )
    except (ValueError, FileNotFoundError, OSError) as exc:
        raise InputError(f"draft: {exc}") from exc
    ratio = compute_ratio(draft, target)
    say(
        f"draft: {cfg.draft_init} {cfg.draft_layers if cfg.draft_init == 'pruned' else ''}, "
        f"{draft.config.num_hidden_layers} layers, {ratio:.3f}x the target's FLOPs per token"
    )

    # --- data ---------------------------------------------------------------------------------
    try:
        dataset, summary = load_data(cfg, tokenizer)
    except (DataFileError, TemplateError, ValueError) as exc:
        raise InputError(str(exc)) from exc
    say(str(summary))
    train_idx, val_idx = _split_validation(len(dataset), cfg)
    train_set = TokenDataset(dataset.select(train_idx))
    val_set = TokenDataset(dataset.select(val_idx)) if val_idx else None
    val_samples = [val_set[i] for i in range(len(val_set))] if val_set else []
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos_ids = _eos_ids(tokenizer, target)
    loader = torch.utils.data.DataLoader(
        train_set,
        batch_size=cfg.batch_size,
        shuffle=True,
        collate_fn=partial(collate_hidden_states, pad_token_id=pad_id),
    )

    # --- optimizer, prepare, schedule ---------------------------------------------------------
    optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    draft, optimizer, loader = accelerator.prepare(draft, optimizer, loader)
    steps_per_epoch = math.ceil(len(loader) / cfg.gradient_accumulation_steps)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    # Stepped once per optimizer step by us (not prepared): its length is in optimizer steps.
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, round(cfg.warmup_ratio * total_steps), total_steps
    )
    accelerator.register_for_checkpointing(scheduler)
    unwrapped = accelerator.unwrap_model(draft)

    # --- resume -------------------------------------------------------------------------------
    loop = {"step": 0, "micro_step": 0, "history": [], "before": None}
    ckpt = latest_checkpoint(cfg.output_dir) if cfg.resume else None
    if ckpt is not None:
        accelerator.load_state(str(ckpt))
        loop.update(json.loads((ckpt / _STATE_FILE).read_text()))
        say(f"resumed from {ckpt} (step {loop['step']})")
    if main_proc:
        cfg.output_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, cfg.output_dir / "config.yaml")
    if cfg.report_to == "wandb":
        accelerator.init_trackers(
            cfg.wandb_project,
            config=config_to_dict(cfg),
            # No API key configured: log offline to ./wandb (`wandb sync` uploads it later).
            init_kwargs={
                "wandb": {"job_type": "distill", "dir": str(cfg.output_dir), "mode": wandb_mode()}
            },
        )
    if loop["before"] is None and val_samples:
        loop["before"] = validate(unwrapped, target, val_samples, cfg, accelerator)
        say(f"validation before training: {_fmt_metrics(loop['before'])}")
        accelerator.log({f"val/{k}": v for k, v in loop["before"].items()}, step=loop["step"])

    # --- loop ---------------------------------------------------------------------------------
    step, micro = loop["step"], loop["micro_step"]
    epoch, skip = divmod(micro, len(loader))
    bar = tqdm(
        total=total_steps,
        initial=step,
        desc="distill",
        disable=not (main_proc and cfg.progress),
        dynamic_ncols=True,
    )
    window = {"loss": 0.0, "acc": 0.0, "tokens": 0, "batches": 0, "t": time.monotonic()}
    budget_end = started + 60 * cfg.max_minutes if cfg.max_minutes else None
    stop_at = step + cfg.stop_after_steps if cfg.stop_after_steps else None
    finished, paused = step >= total_steps, False
    draft.train()
    while not (finished or paused):
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for batch in batches:
            if is_on_policy_step(step, cfg.on_policy_fraction):
                batch = on_policy_batch(unwrapped, batch, cfg, pad_id, eos_ids)
            with accelerator.accumulate(draft):
                p, q, labels = batch_logits(draft, target, batch)
                loss = step_loss(cfg, p, q, labels)
                accelerator.backward(loss)
                grad_norm = None
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(draft.parameters(), cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            micro += 1
            window["loss"] += float(loss.detach())
            window["acc"] += float(expected_acceptance(p, q))
            window["tokens"] += int(batch["attention_mask"].sum())
            window["batches"] += 1
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            step += 1
            bar.update(1)
            if step % cfg.log_every == 0:
                now = time.monotonic()
                logs = {
                    "train/loss": window["loss"] / window["batches"],
                    "train/expected_acceptance": window["acc"] / window["batches"],
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/tokens_per_second": window["tokens"] / max(now - window["t"], 1e-9),
                    "train/epoch": epoch,
                }
                if grad_norm is not None:
                    logs["train/grad_norm"] = float(grad_norm)
                accelerator.log(logs, step=step)
                bar.set_postfix(
                    loss=f"{logs['train/loss']:.4f}", acc=f"{logs['train/expected_acceptance']:.3f}"
                )
                window = {"loss": 0.0, "acc": 0.0, "tokens": 0, "batches": 0, "t": now}
            if val_samples and cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
                metrics = validate(unwrapped, target, val_samples, cfg, accelerator)
                loop["history"].append({"step": step, **metrics})
                accelerator.log({f"val/{k}": v for k, v in metrics.items()}, step=step)
                say(f"step {step}: validation {_fmt_metrics(metrics)}")
            finished = step >= total_steps or _out_of_time(budget_end, accelerator)
            paused = not finished and stop_at is not None and step >= stop_at
            if (cfg.save_every and step % cfg.save_every == 0) or paused:
                loop.update(step=step, micro_step=micro)
                save_checkpoint(accelerator, cfg.output_dir, loop, cfg.keep_checkpoints)
            if finished or paused:
                break
        else:
            epoch += 1
    bar.close()

    if paused:
        say(f"paused after step {step} of {total_steps}; rerun with resume: true to continue")
        accelerator.end_training()
        return {"paused": True, "step": step, "total_steps": total_steps}

    # --- final validation and save ------------------------------------------------------------
    after = validate(unwrapped, target, val_samples, cfg, accelerator) if val_samples else None
    if after is not None:
        loop["history"].append({"step": step, **after})
        accelerator.log({f"val/{k}": v for k, v in after.items()}, step=step)
        say(f"validation after training: {_fmt_metrics(after)}")
    metrics = {
        "steps": step,
        "total_steps": total_steps,
        "train_records": len(train_idx),
        "val_records": len(val_idx),
        "data_summary": str(summary),
        "compute_ratio": ratio,
        "validation": {"before": loop["before"], "after": after, "history": loop["history"]},
        "wall_seconds": time.monotonic() - started,
        "num_processes": accelerator.num_processes,
        "config": config_to_dict(cfg),
        **info,
    }
    card = {
        "target": cfg.target or "HuggingFaceTB/SmolLM2-135M-Instruct",
        "data": str(cfg.data),
        "init": f"{cfg.draft_init} {cfg.draft_layers}"
        if cfg.draft_init == "pruned"
        else cfg.draft_init,
        "num_layers": unwrapped.config.num_hidden_layers,
        "loss": _loss_name(cfg),
        "steps": step,
        "compute_ratio": round(ratio, 4),
        "validation": {"before": loop["before"], "after": after},
    }
    state_dict = accelerator.get_state_dict(draft)
    if main_proc:
        save_draft(unwrapped, tokenizer, cfg.output_dir / "draft", info=card, state_dict=state_dict)
        write_json_atomic(cfg.output_dir / "metrics.json", metrics)
        say(
            f"draft saved to {cfg.output_dir / 'draft'}; metrics in {cfg.output_dir / 'metrics.json'}"
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics


def _out_of_time(budget_end: float | None, accelerator) -> bool:
    """Whether the time budget is spent; rank 0 decides, so every rank stops at the same step."""
    if budget_end is None:
        return False
    from accelerate.utils import broadcast

    flag = torch.tensor([float(time.monotonic() > budget_end)], device=accelerator.device)
    return bool(broadcast(flag, from_process=0).item())


def _loss_name(cfg: DistillConfig) -> str:
    name = {"fkl": "forward KL", "rkl": "reverse KL", "tvd": "TVD", "jsd": f"JSD(β={cfg.jsd_beta})"}
    text = name[cfg.loss] + (f" at T={cfg.temperature}" if cfg.temperature != 1 else "")
    if cfg.ce_weight:
        text += f" + {cfg.ce_weight} × cross-entropy"
    if cfg.on_policy_fraction:
        text += f"; on-policy on {cfg.on_policy_fraction:.0%} of steps"
    return text


def _fmt_metrics(m: dict[str, float]) -> str:
    return (
        f"loss {m['loss']:.4f}, expected acceptance {m['expected_acceptance']:.4f}, "
        f"greedy agreement {m['greedy_agreement']:.4f} ({m['tokens']} tokens)"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(DistillConfig, argv, prog="draftsmith distill", description=__doc__)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        run(cfg)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
