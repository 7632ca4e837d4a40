"""Train Medusa heads: Medusa-1 (frozen target) or Medusa-2 (LoRA target + heads, jointly).

Launch::

    python recipes/medusa.py --config recipes/configs/medusa1_smollm2.yaml
    python recipes/medusa.py --config recipes/configs/medusa2_smollm2.yaml --max-minutes 30
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/medusa.py \\
        --config recipes/configs/medusa1_smollm2.yaml            # 2 processes on CPU
    accelerate launch --config_file recipes/accelerate/fsdp_cpu_2proc.yaml recipes/medusa.py \\
        --config recipes/configs/medusa1_smollm2.yaml            # Medusa-1, FSDP (docs/scaling.md)

Then evaluate and export::

    draftsmith evaluate --drafter medusa=runs/medusa1_smollm2/heads \\
        medusa-tree=runs/medusa1_smollm2/heads --k 4
    draftsmith export --format medusa-vllm --checkpoint runs/medusa1_smollm2/heads --out out/

The recipe reads top to bottom: config -> run (processes, output lock) -> target (frozen) -> heads
(+ LoRA adapters on the target for Medusa-2) -> data and the target's final hidden states
(computed online inside the step, or read from a cache built by ``draftsmith data cache --preset
medusa``) -> optimizer and warm-up + cosine schedule -> loop (accumulate, backward, clip, step;
validation; checkpoints) -> per-head validation accuracies -> save. Ctrl-C finishes the step,
saves a checkpoint and prints how to resume (``draftsmith.train.core`` holds that plumbing).

Output directory::

    heads/config.json, heads/model.safetensors   the heads (heads.medusa.load_medusa)
    heads/head_accuracy.json    per-head, per-rank validation accuracy and the automatic tree
    heads/training_metrics.json training log, final metrics, config, versions (also at the root)
    best/                       Medusa-1: the heads of the best validation (highest val/sim_tau)
    target/                     Medusa-2 only: the merged fine-tuned target + tokenizer
    train_config.yaml           the full config of the run
    checkpoints/step_N/         accelerate state + trainer_state.json, for resuming

Medusa-2 changes the target: its speculative outputs are lossless with respect to the merged
fine-tuned target in ``target/``, not the original target. Evaluate and serve with that target
(so Medusa-2 keeps no separate best heads: they would need their own target). See
``docs/medusa.md``.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: resolve the imports below (PEP 366)
    __package__ = "draftsmith.recipes"

import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..heads.medusa import ACCURACY_FILE, TARGET_SUBDIR, MedusaHeads
from ..train.config import cfg_field, parse_config
from ..train.core.config import TrainConfig
from ..train.core.data import (
    check_enough_data,
    eos_ids,
    input_errors,
    load_samples,
    rank_batches,
    split_indices,
    total_steps,
    train_loader,
)
from ..train.core.dist import exit_process
from ..train.core.run import TrainRun, held_out_validation
from ..train.core.schedule import warmup_cosine_schedule
from ..train.core.stop import check_finite
from ..train.decoding.metrics import simulated_tau
from ..train.device import DTYPE_AUTO_HELP, auto_dtype
from ..train.errors import UsageError, cli_main
from ..train.objectives.acceptance import DRAFT_LOSSES
from ..train.objectives.medusa import (
    HEAD_LABELS,
    TARGET_LOSSES,
    Medusa1Objective,
    Medusa2Objective,
    accuracy_report,
    add_lora,
    as_teacher,
    rank_counts,
)

HEADS_SUBDIR = "heads"
METRICS_FILE = "training_metrics.json"


@dataclass
class MedusaConfig(TrainConfig):
    """Settings of one Medusa training run (the shared ones are in TrainConfig)."""

    stage: str = cfg_field(
        "medusa1",
        help="medusa1: frozen target, heads only; medusa2: LoRA on the target + heads, jointly",
        choices=["medusa1", "medusa2"],
    )
    # --- target and data ---------------------------------------------------------------------
    target_dtype: str = cfg_field(
        "auto",
        help="target weights dtype (" + DTYPE_AUTO_HELP + ")",
        choices=["auto", "fp32", "bf16", "fp16"],
    )
    data: Path | None = cfg_field(
        None,
        help="training conversations (JSONL/JSON/parquet, e.g. self-distilled) or tokenized data "
        "(datasets dir / JSONL with input_ids+loss_mask); offline mode may omit it",
    )
    split: str | None = cfg_field(
        "train", help="keep only records of this split from conversation files (None = all)"
    )
    limit: int | None = cfg_field(None, help="use the first N samples only", ge=1)
    max_length: int = cfg_field(512, help="truncate samples to this many tokens", ge=1)
    val_samples: int = cfg_field(
        64, help="samples held back to measure per-head accuracy (for the automatic tree)", ge=1
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
    num_heads: int = cfg_field(4, help="Medusa heads K (head k predicts token t+k+2)", ge=1)
    num_layers: int = cfg_field(1, help="residual layers per head", ge=1)
    share_lm_head: bool = cfg_field(
        False, help="all heads use the target's frozen lm_head (vLLM original_lm_head)"
    )
    draft_vocab_size: int | None = cfg_field(
        None,
        help="reduced draft vocabulary (FR-Spec, as EAGLE-3's): each head predicts over the N "
        "most frequent supervised tokens, EOS always in; None or 0 = the full vocabulary",
        ge=0,
    )
    head_labels: str = cfg_field(
        "data",
        help="data: the data's tokens; target / target_soft: the target's argmax / distribution "
        "(self-distillation)",
        choices=list(HEAD_LABELS),
    )
    head_decay: float = cfg_field(0.8, help="head k's loss weight is head_decay**k", gt=0, le=1)
    head_loss: str = cfg_field(
        "kl",
        help="the heads' loss: kl (cross-entropy with the labels), or with head_labels "
        "target_soft an LK loss on each head's acceptance: tv (1 - α), nla (-log α), lk_hybrid "
        "(λ KL + (1 - λ) TV, λ = exp(-lk_eta α))",
        choices=list(DRAFT_LOSSES),
    )
    lk_eta: float = cfg_field(
        3.0, help="lk_hybrid: decay of the KL weight with the acceptance rate (0: pure KL)", ge=0
    )
    lr: float = cfg_field(1e-3, help="peak learning rate (Medusa-2: of the LoRA adapters)", gt=0)
    eval_every: int = cfg_field(
        0, help="validate every N optimizer steps, and at the end (0 = at the end only)", ge=0
    )
    # --- Medusa-2 ----------------------------------------------------------------------------
    target_loss: str = cfg_field(
        "kl",
        help="medusa2 target loss: kl (to the original target: keeps its distribution) or lm",
        choices=list(TARGET_LOSSES),
    )
    head_weight: float = cfg_field(0.2, help="medusa2: λ, weight of the head losses", ge=0)
    heads_lr_multiplier: float = cfg_field(4.0, help="medusa2: heads LR = lr × this", gt=0)
    heads_warmup_steps: int = cfg_field(
        50, help="medusa2: first steps train the heads only (target frozen)", ge=0
    )
    lora_r: int = cfg_field(16, help="medusa2: LoRA rank", ge=1)
    lora_alpha: int = cfg_field(32, help="medusa2: LoRA alpha")
    lora_dropout: float = cfg_field(0.05, help="medusa2: LoRA dropout", ge=0, lt=1)
    lora_target_modules: list[str] | None = cfg_field(
        None, help="medusa2: modules to adapt (default: all attention and MLP projections)"
    )
    # --- the automatic tree ------------------------------------------------------------------
    tree_nodes: int = cfg_field(
        64, help="node budget of the automatic tree recorded at the end", ge=1
    )
    tree_max_rank: int = cfg_field(10, help="top-k ranks measured per head for the tree", ge=1)
    output_dir: Path = cfg_field(Path("runs/medusa"), help="where heads, metrics, checkpoints go")

    def validate(self) -> list[tuple[str, str]]:
        problems = super().validate()
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
        if self.head_loss != "kl" and self.head_labels != "target_soft":
            problems.append(
                (
                    "head_loss",
                    f"{self.head_loss} needs the target's distribution: head_labels target_soft",
                )
            )
        return problems

    def input_paths(self) -> dict[str, Path | None]:
        """``data`` (read whenever set) and, offline, ``hidden_states_cache``."""
        offline = self.hidden_states == "offline"
        return {
            "data": self.data,
            "hidden_states_cache": self.hidden_states_cache if offline else None,
        }


@torch.no_grad()
def validate_heads(run, cfg, objective, val_set, collate, features) -> dict[str, Any]:
    """Per-head rank accuracies over the validation samples, summed over processes.

    Each process takes every W-th sample; ``features(model, batch)`` returns the final hidden
    states ``[B, T, H]`` and the lm_head that judges them (the target's, possibly adapted).
    Under FSDP the heads are gathered whole on every rank first, and every rank runs the same
    number of batches (an online feature batch is a forward of the sharded target).

    Raises:
        NonFiniteError: a head weight is NaN/inf (its accuracies would be meaningless: NaN
            logits rank every token first).
    """
    accelerator = run.accelerator
    with run.full_model(objective, everywhere=True) as model:
        heads = model.heads
        check_finite(heads, "validation: head")
        was_training = model.training
        model.eval()
        counts = torch.zeros(heads.num_heads, cfg.tree_max_rank, device=accelerator.device)
        totals = torch.zeros(heads.num_heads, device=accelerator.device)
        shares = rank_batches(
            len(val_set),
            accelerator.process_index,
            accelerator.num_processes,
            cfg.batch_size,
            even=run.fsdp,
        )
        for indices, counted in shares:
            batch = collate([val_set[i] for i in indices])
            hidden, loss_mask, lm_head = features(model, batch)
            c, t = rank_counts(heads, hidden, loss_mask, as_teacher(lm_head), cfg.tree_max_rank)
            if counted:
                counts += c
                totals += t
        model.train(was_training)
    counts = accelerator.reduce(counts, reduction="sum")
    totals = accelerator.reduce(totals, reduction="sum")
    return accuracy_report(counts, totals, cfg.tree_nodes)


def train(cfg: MedusaConfig) -> dict[str, Any] | None:
    """Run the recipe; returns the final metrics (None when stopped early with a checkpoint)."""
    from torch.utils.data import Subset

    from ..train.data.batching import TokenDataset, collate_hidden_states
    from ..train.data.chat import template_fingerprint
    from ..train.data.vocab import coverage, draft_vocab, token_counts
    from ..train.features.cache_format import DTYPES
    from ..train.features.cache_read import cached_max_length
    from ..train.features.source import (
        dataset_fingerprint,
        feature_source,
        target_fingerprint,
        val_data_source,
    )
    from ..train.progress import progress
    from ..train.runinfo import run_info
    from ..train.target_model.load import prepare_target

    medusa2 = cfg.stage == "medusa2"
    outputs = [HEADS_SUBDIR, METRICS_FILE, TARGET_SUBDIR]
    # Medusa-1 runs under FSDP (frozen target sharded, heads sharded); Medusa-2 trains the target
    # itself through LoRA adapters, which is not wired for sharding.
    fsdp = "Medusa-2 (LoRA adapters train the target itself)" if medusa2 else True
    with TrainRun(
        cfg,
        recipe="medusa",
        kind=cfg.stage,
        outputs=outputs,
        find_unused_parameters=medusa2,
        fsdp=fsdp,
    ) as run:
        accelerator, say, out = run.accelerator, run.say, run.out
        info = run_info(accelerator.device)  # the device this run's processes train on

        # --- target (frozen) ------------------------------------------------------------------
        target_path = prepare_target(cfg.target, cache_dir=cfg.cache_dir, quiet=not run.is_main)
        dtype_name = auto_dtype(cfg.target_dtype, accelerator.device, fast="bf16", slow="fp32")
        # FSDP: decoder layers on the meta device until place_target reads this process's shards.
        target, tokenizer = run.load_target(target_path, dtype=DTYPES[dtype_name])
        feature_layer = int(target.config.num_hidden_layers)  # final normed output (heads.base)
        tokens, summary = None, None
        if cfg.data is not None:
            tokens, summary = load_samples(
                cfg.data, tokenizer, max_length=cfg.max_length, split=cfg.split, limit=cfg.limit
            )

        # --- draft vocabulary (draft_vocab_size) ----------------------------------------------
        # FR-Spec / EAGLE-3 §3: the heads predict over the most frequent target tokens only,
        # counted on the supervised tokens of this run's data, EOS always in (as the eagle
        # recipe does). The maps are buffers of the heads: checkpoints and saves carry them.
        d2t = t2d = None
        vocab_note: dict[str, Any] = {}
        vocab = int(target.get_output_embeddings().weight.shape[0])
        if cfg.draft_vocab_size and cfg.draft_vocab_size > vocab:
            raise UsageError(
                f"draft_vocab_size: {cfg.draft_vocab_size} is larger than the target's "
                f"vocabulary ({vocab}); choose <= {vocab}"
            )
        if cfg.draft_vocab_size and cfg.draft_vocab_size < vocab:
            if tokens is not None:
                count_source = tokens
            else:  # offline without data: the cache's tokens
                from ..train.features.cache_read import HiddenStateCache

                count_source = HiddenStateCache(cfg.hidden_states_cache).token_view()
            counts = token_counts(count_source, vocab, max_length=cfg.max_length)
            d2t, t2d = draft_vocab(
                counts, cfg.draft_vocab_size, always_include=eos_ids(tokenizer, target)
            )
            vocab_note = {
                "draft_vocab_size": cfg.draft_vocab_size,
                "draft_vocab_coverage": coverage(counts, t2d),
            }
            say(
                f"draft vocab: {cfg.draft_vocab_size} of {vocab} tokens cover "
                f"{vocab_note['draft_vocab_coverage']:.2%} of supervised tokens"
            )

        # --- heads (+ LoRA on the target for Medusa-2) ----------------------------------------
        # Heads train in fp32 whatever the target's dtype (mixed_precision autocasts matmuls).
        # Built from the whole target's lm_head, before the target is placed (sharded by FSDP).
        heads = MedusaHeads.from_target(
            target,
            cfg.num_heads,
            cfg.num_layers,
            share_lm_head=cfg.share_lm_head,
            d2t=d2t,
            t2d=t2d,
        ).float()
        if medusa2:
            target.to(accelerator.device)  # prepared inside the objective below
        else:
            target = run.place_target(target)  # sharded under FSDP; embeddings and head whole
        lm_head = target.get_output_embeddings()  # the teacher of the `target*` head labels
        if medusa2:
            target = add_lora(
                target,
                r=cfg.lora_r,
                alpha=cfg.lora_alpha,
                dropout=cfg.lora_dropout,
                target_modules=cfg.lora_target_modules,
            )
            objective = Medusa2Objective(
                target,
                heads,
                target_loss=cfg.target_loss,
                head_labels=cfg.head_labels,
                decay=cfg.head_decay,
                head_weight=cfg.head_weight,
                head_loss=cfg.head_loss,
                lk_eta=cfg.lk_eta,
            )
        else:
            objective = Medusa1Objective(
                heads,
                labels=cfg.head_labels,
                decay=cfg.head_decay,
                head_loss=cfg.head_loss,
                lk_eta=cfg.lk_eta,
            )
        trainable = sum(p.numel() for p in objective.parameters() if p.requires_grad)
        say(
            f"{cfg.stage}: {cfg.num_heads} heads x {cfg.num_layers} layers, "
            f"{trainable / 1e6:.2f}M trainable parameters; target {target_path}"
        )

        # --- data -----------------------------------------------------------------------------
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        if medusa2:
            # The target is trained, so it runs inside the step with gradients: token batches.
            dataset = TokenDataset(tokens, cfg.max_length)
            collate = functools.partial(collate_hidden_states, pad_token_id=pad)

            def complete(batch):
                return {
                    k: v.to(accelerator.device) if torch.is_tensor(v) else v
                    for k, v in batch.items()
                }

            def features(model, batch):  # validation: the adapted target's own hidden states
                batch = complete(batch)
                hidden = model._hidden(batch["input_ids"], batch["attention_mask"])
                return hidden, batch["loss_mask"], model.target.get_output_embeddings()
        else:
            # An offline cache must come from this target and template (the error names each
            # difference); the heads compute in fp32 on stored bf16 features.
            expect = {
                "hidden_size": int(target.config.hidden_size),
                "num_layers": feature_layer,
                "vocab_size": int(lm_head.weight.shape[0]),
                "template_fingerprint": template_fingerprint(tokenizer),
                "target_hash": target_fingerprint(target_path),  # other weights: refused
            }
            if tokens is not None and cfg.hidden_states == "offline" and cfg.limit is None:
                # The data as the cache truncated it: the cache may be longer than the run's
                # max_length (samples are cut again on read).
                built = cached_max_length(cfg.hidden_states_cache)
                expect["dataset_fingerprint"] = dataset_fingerprint(tokens, built)
            src = feature_source(
                cfg.hidden_states,
                layers=[feature_layer],
                data=tokens,
                cache=cfg.hidden_states_cache,
                target=target,
                expect=expect,
                max_length=cfg.max_length,
                pad_token_id=pad,
            )
            dataset, collate = src.dataset, src.collate
            if cfg.hidden_states == "offline" and cfg.limit is not None:
                dataset = Subset(dataset, range(min(cfg.limit, len(dataset))))

            def complete(batch):
                return src.complete(batch, accelerator.device)

            def features(model, batch):
                batch = complete(batch)
                return batch["hidden_states"][feature_layer], batch["loss_mask"], lm_head

        train_idx, val_idx = split_indices(len(dataset), cfg.val_samples, cfg.seed)
        check_enough_data(
            len(dataset),
            len(train_idx),
            summary=summary,
            source=str(cfg.data or cfg.hidden_states_cache),
            min_train_samples=cfg.min_train_samples,
            allow=cfg.allow_little_data,
        )
        train_set, val_set = Subset(dataset, train_idx), Subset(dataset, val_idx)
        # Validation like evaluation: val_data's records, when given, choose best/ and the
        # automatic tree (their accuracies predict the evaluated τ; training records overstate
        # it). Medusa-1 reads their features from the frozen target, Medusa-2 from the adapted
        # one as it validates.
        held_set = held_collate = held_features = None
        if cfg.val_data is not None and medusa2:
            held, held_summary = load_samples(
                cfg.val_data, tokenizer, max_length=cfg.max_length, split=None
            )
            say(f"validation data: {held_summary or f'{len(held)} tokenized samples'}")
            held_set, held_collate, held_features = (
                TokenDataset(held, cfg.max_length),
                collate,
                features,
            )
        elif cfg.val_data is not None:
            held_src, _ = val_data_source(cfg, tokenizer, target, [feature_layer], say)
            held_set, held_collate = held_src.dataset, held_src.collate

            def held_features(model, batch):
                batch = held_src.complete(batch, accelerator.device)
                return batch["hidden_states"][feature_layer], batch["loss_mask"], lm_head

        # Workers read (and pad) cached features ahead of the step; length-grouped batches
        # unless group_by_length is off. GPU: batches copied without waiting for the device.
        loader = train_loader(
            train_set,
            cfg,
            collate,
            device=accelerator.device,
            processes=accelerator.num_processes,
            pin_memory=run.pin_memory,
        )

        # --- optimizer, prepare, schedule, resume ---------------------------------------------
        groups = [
            {
                "params": [p for p in heads.parameters() if p.requires_grad],
                "lr": cfg.lr * (cfg.heads_lr_multiplier if medusa2 else 1.0),
            }
        ]
        if medusa2:
            groups.append(
                {"params": [p for p in target.parameters() if p.requires_grad], "lr": cfg.lr}
            )
        optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
        objective, optimizer, loader = run.prepare(objective, optimizer, loader)
        total = total_steps(cfg.max_steps, cfg.epochs, len(loader), cfg.grad_accum)
        warmup = int(cfg.warmup_ratio * total)
        # Per-group LR factors: the heads warm up from step 0; Medusa-2's adapters sit out the
        # heads-only warm-up (factor 0), then get their own warm-up and cosine decay. Stepped
        # here once per optimizer step, not prepared (accelerate steps it once per process).
        starts = [0, cfg.heads_warmup_steps] if medusa2 else [0]
        scheduler = warmup_cosine_schedule(
            optimizer.optimizer, warmup, total, starts=starts, offset=1
        )
        accelerator.register_for_checkpointing(scheduler)
        total = run.resume(total, scheduler)  # a fitted schedule's total when resumed
        run.dump_config()
        run.init_trackers(f"{cfg.stage}-{out.name}", f"train-{cfg.stage}")

        def validate(step: int) -> dict[str, Any]:
            report = validate_heads(run, cfg, objective, val_set, collate, features)
            split = val_logs(report), simulated_tau(report["top1"])
            held = None
            if held_set is not None:
                held_report = validate_heads(
                    run, cfg, objective, held_set, held_collate, held_features
                )
                held = val_logs(held_report), simulated_tau(held_report["top1"])
                split_report = {**report, "val_samples": len(val_set)}
                report = {**held_report, "val_data_samples": len(held_set), "split": split_report}
            logs, tau = held_out_validation(split, held)

            def save_best(path: Path) -> None:
                # Like heads/: the config extras, and this validation's accuracies (the
                # automatic tree of `medusa-tree=best` is built from them).
                save_heads(path, extra)
                run.write_json(path / ACCURACY_FILE, report)

            # Medusa-2 keeps no best heads: they would need the target of their own step.
            run.record_validation(step, logs, tau, None if medusa2 else save_best)
            gap = (
                f" (training records {logs['val_split/sim_tau']:.3f}, "
                f"{logs['val/sim_tau_gap']:+.0%})"
                if held
                else ""
            )
            say(
                f"step {step}: sim τ {tau:.3f}{gap}, validation top-1 per head "
                f"{[round(a, 3) for a in report['top1']]}"
            )
            return report

        extra = {
            "stage": cfg.stage,
            "feature_layer": feature_layer,
            "target_name_or_path": str(target_path),
            "head_labels": cfg.head_labels,
            "head_loss": cfg.head_loss,
        }

        def save_heads(path: Path, extra: dict[str, Any] | None = None) -> None:
            with run.full_model(objective) as model:  # FSDP: gathered, collective
                if accelerator.is_main_process:
                    model.heads.save(path, extra=extra)

        # --- loop -----------------------------------------------------------------------------
        K = cfg.num_heads
        # Per head: loss x positions, top-1 hits, top-5 hits, positions; summed over the window.
        window = torch.zeros(4, K, device=accelerator.device)
        window_loss = torch.zeros(3, device=accelerator.device)  # loss, target loss, batches
        params = [p for g in optimizer.param_groups for p in g["params"]]
        step = run.state.step
        bar = progress(
            total=total, initial=step, desc=cfg.stage, disable=not (run.is_main and cfg.progress)
        )
        objective.train()
        report = None
        while not run.finished(step, total):
            for batch in run.position.batches_of_epoch(accelerator, loader):
                batch = complete(batch)
                with accelerator.accumulate(objective):
                    if medusa2:
                        out_ = objective(
                            batch["input_ids"],
                            batch["attention_mask"],
                            batch["loss_mask"],
                            heads_only=step < cfg.heads_warmup_steps,
                        )
                    else:
                        # The wrapped module's forward is what DDP synchronises: loss inside.
                        out_ = objective(
                            batch["hidden_states"][feature_layer],
                            batch["input_ids"],
                            batch["loss_mask"],
                            teacher=as_teacher(lm_head),
                        )
                    accelerator.backward(out_["loss"])
                run.watch(out_["loss"])
                window += torch.stack(
                    [
                        out_["head_loss"] * out_["count"],
                        out_["correct1"],
                        out_["correct5"],
                        out_["count"],
                    ]
                )
                loss = out_["loss"].detach().float()
                window_loss += torch.stack(
                    [loss, out_.get("target_loss", loss * 0).float(), torch.ones_like(loss)]
                )
                if not accelerator.sync_gradients:
                    continue
                grad_norm = accelerator.clip_grad_norm_(params, cfg.max_grad_norm or math.inf)
                if not run.optimizer_step(step + 1, grad_norm, optimizer, scheduler):
                    continue  # a non-finite step, skipped (on_nonfinite: skip)
                step += 1
                bar.update(1)
                total = run.fit_schedule(step, total, scheduler)  # fit_schedule: to max_minutes
                bar.total = total
                if step % cfg.log_every == 0 or step == total:
                    logs = train_logs(accelerator, window, window_loss, medusa2)
                    logs["train/lr"] = scheduler.get_last_lr()[0]
                    logs["train/grad_norm"] = float(grad_norm)
                    logs["train/epoch"] = run.position.epoch
                    run.log(step, logs)
                    bar.set_postfix(
                        loss=f"{logs['train/loss']:.3f}", top1=f"{logs['train/head0_top1']:.2f}"
                    )
                    if not cfg.progress:  # logs (nohup, CI) still show how training goes
                        say(
                            f"step {step}/{total}: loss {logs['train/loss']:.3f}, head-0 "
                            f"top-1 {logs['train/head0_top1']:.3f}"
                        )
                    window.zero_()
                    window_loss.zero_()
                if run.eval_due(step, total):
                    report = validate(step)
                if run.save_due(step):
                    run.save_checkpoint(step)
                if run.finished(step, total):
                    break
        bar.close()

        # --- validate, save -------------------------------------------------------------------
        if not run.interrupted and (report is None or not run.validated(step)):
            report = validate(step)  # stopped by max_minutes, or resumed at the end
        if cfg.save_every or run.interrupted:
            run.save_checkpoint(step)
        if run.interrupted:
            say(run.resume_hint())
            return None
        report["val_samples"] = len(val_set)
        result = {
            **run.summary(step, total),
            "stage": cfg.stage,
            "train_samples": len(train_set),
            "trainable_parameters": trainable,
            **vocab_note,
            "final_validation": report,
            "data": str(cfg.data or cfg.hidden_states_cache),
            **info,
        }
        if medusa2:
            # Medusa-2 outputs are lossless w.r.t. this merged fine-tuned target, not the
            # original: it is written beside the heads, which point at it.
            def save_target(path: Path) -> None:
                if run.is_main:
                    merged = accelerator.unwrap_model(objective).target.merge_and_unload()
                    merged.save_pretrained(path)
                    tokenizer.save_pretrained(path)

            run.write_output(TARGET_SUBDIR, save_target)
            extra["target_dir"] = f"../{TARGET_SUBDIR}"

        def save_final(path: Path) -> None:
            save_heads(path, extra)
            run.write_json(path / ACCURACY_FILE, report)
            run.write_json(path / METRICS_FILE, result)

        run.write_output(HEADS_SUBDIR, save_final)
        run.write_json(out / METRICS_FILE, result)
        top1 = ", ".join(f"{a:.3f}" for a in report["top1"])
        say(
            f"saved heads to {out / HEADS_SUBDIR} after {step} steps "
            f"({result['train_seconds'] / 60:.1f} min); validation top-1 per head [{top1}]; "
            f"automatic tree of {report['tree']['nodes']} nodes, predicted τ "
            f"{report['tree']['expected_acceptance_length']:.2f}"
        )
    return result


def train_logs(accelerator, window, window_loss, medusa2: bool) -> dict[str, float]:
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


def val_logs(report: dict[str, Any]) -> dict[str, float]:
    logs = {}
    for k, (a1, a5) in enumerate(zip(report["top1"], report["top5"], strict=True)):
        logs[f"val/head{k}_top1"] = a1
        logs[f"val/head{k}_top5"] = a5
    logs["val/tree_expected_tau"] = report["tree"]["expected_acceptance_length"]
    logs["val/chain_expected_tau"] = report["chain_expected_acceptance_length"]
    return logs


def main(argv: list[str] | None = None) -> int:
    """CLI entry: 0 done (or stopped with a checkpoint), 2 usage error, 1 run error."""

    def run_recipe(args: list[str]) -> int:
        cfg = parse_config(MedusaConfig, args, prog="draftsmith train medusa", description=__doc__)

        with input_errors():  # missing/malformed data, target, cache: one line, exit 2
            train(cfg)
        return 0

    # A worker of a multi-process run ends here, without interpreter teardown (see exit_process).
    return exit_process(cli_main(run_recipe, argv))


if __name__ == "__main__":
    sys.exit(main())
