"""Distil a small draft LM from the target (DistillSpec, Zhou et al. 2024).

Launch::

    python recipes/distill.py --config recipes/configs/distill_smollm2.yaml
    python recipes/distill.py --data data/alpaca_sd.jsonl --draft-layers 0 --loss tvd --max-steps 200
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/distill.py \\
        --config recipes/configs/distill_smollm2.yaml
    accelerate launch --config_file recipes/accelerate/fsdp_cpu_2proc.yaml recipes/distill.py \\
        --config recipes/configs/distill_smollm2.yaml    # FSDP: target and draft sharded

The frozen target supplies its next-token distribution p online (one no-grad forward per batch);
the draft's q is trained towards it with a selectable divergence (forward KL, reverse KL, total
variation, JSD; see ``train/objectives/distill.py``) on the assistant tokens of self-distilled
conversations, optionally mixed with cross-entropy on the data and optionally on-policy: on a
fraction of the steps the answers are sampled from the draft itself and scored by the target
(DistillSpec §4.1; GKD, Agarwal et al. 2024), so the draft learns on the prefixes it will
actually produce.

The recipe reads top to bottom: config -> run (processes, output lock) -> target and draft ->
data -> optimizer and schedule -> loop (on-policy batch, loss, backward, clip, step; validation;
checkpoints) -> save. Held-out training records (``val_samples``, not the evaluation prompts)
measure, before training, every ``eval_every`` steps and at the end, the loss, the expected
acceptance Σ min(p, q), the greedy agreement (argmax match) and the simulated τ of ``sim_k``
greedy draft tokens it implies; the draft with the best one is kept in ``output_dir/best``.
Ctrl-C finishes the step, saves a checkpoint and prints how to resume (``draftsmith.train.core``).

Output directory::

    draft/                    save_pretrained model + tokenizer + model card (AutoModelForCausalLM)
    best/                     the draft of the best validation (highest val/sim_tau)
    training_metrics.json     train log (loss per logged step), validations, config, versions
    checkpoints/step_N/       accelerate state + trainer_state.json, for resuming
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: resolve the imports below (PEP 366)
    __package__ = "draftsmith.recipes"

import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..heads.draft_lm import install_loss_head
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
from ..train.data.batching import TokenDataset, collate_hidden_states
from ..train.device import DTYPE_AUTO_HELP, auto_dtype
from ..train.errors import UsageError, cli_main
from ..train.features.source import batch_to_device
from ..train.objectives.distill import (
    LOSSES,
    distill_batch_loss,
    distill_loss,
    expected_acceptance,
    greedy_agreement,
    prediction_mask,
)
from ..train.objectives.draft_init import DRAFT_INITS, compute_ratio, init_draft


@dataclass
class DistillConfig(TrainConfig):
    """Settings of one distillation run (the shared ones are in TrainConfig)."""

    # --- target and data ---
    data: Path | None = cfg_field(
        None,
        help="self-distilled conversations (JSONL/JSON/parquet file or dir), or data saved by "
        "`draftsmith data tokenize`",
    )
    split: str = cfg_field(
        "train",
        help="records to use: train (never the held-out ones) or all",
        choices=["train", "all"],
    )
    max_length: int = cfg_field(1024, help="truncate conversations to this many tokens", ge=2)
    val_samples: int = cfg_field(
        64, help="training records held back for validation (0 = none)", ge=0
    )
    hidden_states: str = cfg_field(
        "online",
        help="online: the target computes p inside the step; offline: p from the target's final "
        "hidden states read from hidden_states_cache, through its lm_head (no target forward: "
        "about half of a step's compute on our CPU)",
        choices=["online", "offline"],
    )
    hidden_states_cache: Path | None = cfg_field(
        None,
        help="offline: cache dir written by `draftsmith data cache` holding the target's final "
        "layer (its tokens are the training records; data is not read)",
    )
    target_dtype: str = cfg_field(
        "auto",
        help="target weights dtype (bf16: ~2x faster wide forwards on AVX512-BF16/AMX CPUs and "
        "GPUs; the draft keeps fp32 master weights); " + DTYPE_AUTO_HELP,
        choices=["auto", "fp32", "bf16"],
    )
    # --- draft ---
    draft_init: str = cfg_field(
        "pruned",
        help="pruned: copy of chosen target layers; fresh: new model; path: local model dir",
        choices=list(DRAFT_INITS),
    )
    draft_layers: list[int] | None = cfg_field(
        [0], help="pruned: target layers to keep, in order", ge=0
    )
    draft_model: Path | None = cfg_field(None, help="path: a local HF model dir (same tokenizer)")
    fresh_layers: int = cfg_field(2, help="fresh: decoder layers", ge=1)
    fresh_hidden_size: int | None = cfg_field(
        None, help="fresh: width (default: the target's)", ge=1
    )
    fresh_heads: int | None = cfg_field(
        None, help="fresh: attention heads (default: target's)", ge=1
    )
    fresh_kv_heads: int | None = cfg_field(None, help="fresh: key/value heads", ge=1)
    fresh_intermediate_size: int | None = cfg_field(None, help="fresh: MLP width", ge=1)
    fresh_copy_embeddings: bool = cfg_field(
        False, help="fresh: start from the target's embeddings, final norm, lm_head (same width)"
    )
    draft_vocab_size: int | None = cfg_field(
        None,
        help="draft vocabulary: the N most frequent supervised tokens of the training data; the "
        "draft drafts with those rows of its lm_head only (saved as draft_vocab.json beside it; "
        "None: the full vocabulary)",
        ge=1,
    )
    # --- loss ---
    loss: str = cfg_field(
        "fkl",
        help="fkl: KL(p||q), rkl: KL(q||p), tvd: total variation, jsd, lk_hybrid: "
        "λ fkl + (1 - λ) tvd with λ = exp(-lk_eta α) (LK losses)",
        choices=list(LOSSES),
    )
    lk_eta: float = cfg_field(
        3.0, help="lk_hybrid: decay of the KL weight with the acceptance rate (0: pure KL)", ge=0
    )
    temperature: float = cfg_field(1.0, help="softmax temperature of p and q in the loss", gt=0)
    jsd_beta: float = cfg_field(0.5, help="jsd: mixture weight beta in (0, 1)", gt=0, lt=1)
    ce_weight: float = cfg_field(
        0.0, help="weight of cross-entropy on the data tokens, in [0, 1]", ge=0, le=1
    )
    # --- on-policy data ---
    on_policy_fraction: float = cfg_field(
        0.0, help="share of optimizer steps trained on answers sampled from the draft", ge=0, le=1
    )
    on_policy_max_new_tokens: int = cfg_field(64, help="on-policy: tokens the draft samples", ge=1)
    on_policy_temperature: float = cfg_field(
        1.0, help="on-policy: draft sampling temperature (0 = greedy)", ge=0
    )
    # --- shared fields with this recipe's defaults ---
    lr: float = cfg_field(1e-4, help="peak learning rate (AdamW)", gt=0)
    save_every: int = cfg_field(
        100, help="save a resumable checkpoint every N optimizer steps (0 = never)", ge=0
    )
    sim_k: int = cfg_field(
        5, help="draft length of the simulated τ reported by validation (val/sim_tau)", ge=1
    )
    output_dir: Path = cfg_field(Path("runs/distill"), help="checkpoints, draft, metrics")

    def validate(self) -> list[tuple[str, str]]:
        problems = super().validate()
        if self.hidden_states == "offline":
            if self.hidden_states_cache is None:
                problems.append(("hidden_states_cache", "offline hidden states need a cache dir"))
        else:
            if self.data is None:
                problems.append(("data", "required: the conversations to train on"))
            if self.hidden_states_cache is not None:
                problems.append(("hidden_states_cache", "only read with hidden_states: offline"))
        if self.draft_init == "pruned":
            layers = self.draft_layers or []
            if not layers:
                problems.append(("draft_layers", "pruned draft needs at least one layer"))
            elif len(set(layers)) != len(layers):
                problems.append(("draft_layers", f"need distinct indices, got {layers}"))
        if self.draft_init == "path" and self.draft_model is None:
            problems.append(("draft_model", "draft_init path needs draft_model"))
        if self.draft_init != "path" and self.draft_model is not None:
            problems.append(("draft_model", "only used with draft_init: path"))
        return problems

    def input_paths(self) -> dict[str, Path | None]:
        """``data`` (online) or ``hidden_states_cache`` (offline), and ``draft_model``."""
        if self.hidden_states == "offline":
            return {
                "hidden_states_cache": self.hidden_states_cache,
                "draft_model": self.draft_model,
            }
        return {"data": self.data, "draft_model": self.draft_model}


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

    A batch that carries ``hidden_states`` (read from an offline cache: the target's final,
    normed layer ``{L: [B, T, H]}``) gets p from the target's lm_head on them, without running the
    target; any other batch (online data, on-policy samples) runs the target.

    Returns:
        ``(p_logits [N, V], q_logits [N, V], labels [N])``; p without gradient.
    """
    keep, labels = prediction_mask(batch["input_ids"], batch["loss_mask"], batch["attention_mask"])
    with torch.no_grad():
        hidden = batch.get("hidden_states")
        if hidden:
            (final,) = hidden.values()  # the cache's one layer: the last, after the final norm
            lm_head = target.get_output_embeddings()
            p = lm_head(final[keep].to(lm_head.weight.dtype))
        else:
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
        eta=cfg.lk_eta,
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
def validate(
    draft,
    target,
    samples,
    cfg: DistillConfig,
    accelerator,
    even: bool = False,
    t2d: torch.Tensor | None = None,
) -> dict[str, float]:
    """Loss, expected acceptance and greedy agreement on the validation samples, all ranks.

    Each rank scores every ``num_processes``-th sample; sums are reduced, so the figures are
    token-weighted means over the whole validation split. ``even``: every rank runs the same
    number of batches (the target is sharded by FSDP: each of its forwards is a collective).
    ``t2d`` (bool ``[V]``): a draft vocabulary; the acceptance and agreement are then those of
    the draft as it drafts, over those tokens only (the loss stays the training objective's).
    """
    was_training = draft.training
    draft.eval()
    rank, world = accelerator.process_index, accelerator.num_processes
    sums = torch.zeros(4, dtype=torch.float64, device=accelerator.device)
    for indices, counted in rank_batches(len(samples), rank, world, cfg.batch_size, even=even):
        batch = collate_hidden_states([samples[i] for i in indices], pad_token_id=0)
        p, q, labels = batch_logits(draft, target, batch_to_device(batch, accelerator.device))
        if not counted:
            continue
        n = labels.numel()  # from the shape: no host sync; the sums are read once, below
        drafted = q if t2d is None else q.masked_fill(~t2d.to(q.device), float("-inf"))
        figures = [
            step_loss(cfg, p, q, labels),
            expected_acceptance(p, drafted),
            greedy_agreement(p, drafted),
        ]
        sums[:3] += torch.stack([f.to(torch.float64) for f in figures]) * n
        sums[3] += n
    sums = accelerator.reduce(sums, reduction="sum")
    draft.train(was_training)
    loss, acceptance, agreement, count = sums.tolist()
    tokens = max(count, 1.0)
    return {
        "loss": loss / tokens,
        "expected_acceptance": acceptance / tokens,
        "greedy_agreement": agreement / tokens,
        "tokens": int(count),
    }


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def run(cfg: DistillConfig) -> dict[str, Any] | None:
    """Train a draft as ``cfg`` says; the metrics (None when stopped early with a checkpoint)."""

    from ..heads.draft_lm import DRAFT_VOCAB_FILE, draft_vocab_text
    from ..train.data.chat import template_fingerprint
    from ..train.data.vocab import coverage, draft_vocab, token_counts
    from ..train.decoding.metrics import simulated_tau
    from ..train.export.hf import save_draft
    from ..train.features.source import feature_source, target_fingerprint
    from ..train.progress import progress
    from ..train.runinfo import run_info
    from ..train.target_model.load import describe_target

    with TrainRun(
        cfg,
        recipe="distill",
        kind="distill",
        outputs=["draft", "metrics.json", "training_metrics.json"],
        fsdp=True,
    ) as train_run:
        accelerator, say = train_run.accelerator, train_run.say
        info = run_info(accelerator.device)  # the device this run's processes train on

        # --- target, draft --------------------------------------------------------------------
        target_dtype = auto_dtype(cfg.target_dtype, accelerator.device, fast="bf16", slow="fp32")
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[target_dtype]
        # FSDP: decoder layers on the meta device until place_target reads this process's
        # shards, except those a pruned draft copies.
        pruned = (cfg.draft_layers or []) if cfg.draft_init == "pruned" else []
        target, tokenizer = train_run.load_target(
            cfg.target, cache_dir=cfg.cache_dir, dtype=dtype, whole_layers=pruned
        )
        target.requires_grad_(False).eval()
        fresh = {
            "num_layers": cfg.fresh_layers,
            "hidden_size": cfg.fresh_hidden_size,
            "num_heads": cfg.fresh_heads,
            "num_kv_heads": cfg.fresh_kv_heads,
            "intermediate_size": cfg.fresh_intermediate_size,
            "copy_embeddings": cfg.fresh_copy_embeddings,
            "seed": cfg.seed,
        }
        try:
            draft = init_draft(
                cfg.draft_init,
                target,
                tokenizer,
                layers=cfg.draft_layers,
                path=cfg.draft_model,
                fresh=fresh,
            )
        except (ValueError, OSError) as exc:
            raise UsageError(f"draft: {exc}") from exc
        draft = draft.float().requires_grad_(True)  # fp32 master weights, whatever the target's
        # The head applies the loss chunk by chunk inside the draft's forward (no [N, V] logits
        # kept; FSDP gathers the weight there); same parameters, same names.
        install_loss_head(draft)
        ratio = compute_ratio(draft, target)
        # After the draft copied what it needs from the whole target: sharded under FSDP.
        target = train_run.place_target(target)
        say(
            f"draft: {cfg.draft_init} {cfg.draft_layers if cfg.draft_init == 'pruned' else ''}, "
            f"{draft.config.num_hidden_layers} layers, {ratio:.3f}x the target's FLOPs per token"
        )

        # --- data -----------------------------------------------------------------------------
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        if cfg.hidden_states == "online":
            dataset, summary = load_samples(
                cfg.data, tokenizer, max_length=cfg.max_length, split=cfg.split
            )
            say(str(summary or f"{len(dataset)} tokenized samples from {cfg.data}"))
            records, count_source = TokenDataset(dataset), dataset
        else:
            # The cache must come from this target and template (the error names each
            # difference); its final layer stands in for the target's forward.
            num_layers = int(target.config.num_hidden_layers)
            src = feature_source(
                "offline",
                layers=[num_layers],
                cache=cfg.hidden_states_cache,
                max_length=cfg.max_length,
                expect={
                    "num_layers": num_layers,
                    "hidden_size": int(target.config.hidden_size),
                    "vocab_size": int(target.get_output_embeddings().weight.shape[0]),
                    "template_fingerprint": template_fingerprint(tokenizer),
                    "target_hash": target_fingerprint(target),
                },
                pad_token_id=pad_id,
            )
            records, count_source, summary = src.dataset, src.dataset.token_view(), None
            say(
                f"{len(records)} cached records (layer {num_layers}) from {cfg.hidden_states_cache}"
            )
        train_idx, val_idx = split_indices(len(records), cfg.val_samples, cfg.seed)
        check_enough_data(
            len(records),
            len(train_idx),
            summary=summary,
            source=str(cfg.data or cfg.hidden_states_cache),
            min_train_samples=cfg.min_train_samples,
            allow=cfg.allow_little_data,
        )
        train_set = torch.utils.data.Subset(records, train_idx)
        val_samples = [records[i] for i in val_idx]
        # Validation like evaluation: val_data's records, when given, choose best/.
        held_samples: list = []
        if cfg.val_data is not None:
            held, held_summary = load_samples(
                cfg.val_data, tokenizer, max_length=cfg.max_length, split=None
            )
            say(f"validation data: {held_summary or f'{len(held)} tokenized samples'}")
            held_samples = [TokenDataset(held)[i] for i in range(len(held))]
        stop_ids = eos_ids(tokenizer, target)
        t2d, vocab_files, vocab_note = None, {}, {}
        if cfg.draft_vocab_size is not None:
            # FR-Spec / EAGLE-3 §3: draft over the most frequent supervised tokens of this run's
            # training records (EOS always in); the draft keeps its full head (heads/draft_lm).
            vocab = target.get_output_embeddings().weight.shape[0]
            if cfg.draft_vocab_size > vocab:
                raise UsageError(
                    f"draft_vocab_size: {cfg.draft_vocab_size} is larger than the target's "
                    f"vocabulary ({vocab}); choose <= {vocab}"
                )
            train_tokens = (  # a datasets.Dataset is counted through Arrow: select, not Subset
                count_source.select(train_idx)
                if hasattr(count_source, "select")
                else torch.utils.data.Subset(count_source, train_idx)
            )
            counts = token_counts(train_tokens, vocab, max_length=cfg.max_length)
            _, t2d = draft_vocab(counts, cfg.draft_vocab_size, always_include=stop_ids)
            vocab_note = {"draft_vocab_coverage": coverage(counts, t2d)}
            text = draft_vocab_text(t2d, coverage=vocab_note["draft_vocab_coverage"])
            vocab_files = {DRAFT_VOCAB_FILE: text}
            ratio = compute_ratio(draft, target, draft_head_rows=cfg.draft_vocab_size)
            say(
                f"draft vocab: {cfg.draft_vocab_size} tokens cover "
                f"{vocab_note['draft_vocab_coverage']:.2%} of supervised tokens; drafting over "
                f"them costs {ratio:.3f}x the target's FLOPs per token"
            )
        # Workers read (and pad) samples ahead of the step; length-grouped batches unless
        # group_by_length is off. GPU: batches copied without waiting for the device.
        loader = train_loader(
            train_set,
            cfg,
            partial(collate_hidden_states, pad_token_id=pad_id),
            device=accelerator.device,
            processes=accelerator.num_processes,
            pin_memory=train_run.pin_memory,
        )

        # --- optimizer, prepare, schedule, resume ---------------------------------------------
        optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        draft, optimizer, loader = train_run.prepare(draft, optimizer, loader)
        total = total_steps(cfg.max_steps, cfg.epochs, len(loader), cfg.grad_accum)
        # Stepped once per optimizer step by us (not prepared): its length is in optimizer steps.
        scheduler = warmup_cosine_schedule(optimizer, round(cfg.warmup_ratio * total), total)
        accelerator.register_for_checkpointing(scheduler)
        unwrapped = accelerator.unwrap_model(draft)
        total = train_run.resume(total, scheduler)  # a fitted schedule's total when resumed
        train_run.dump_config()
        train_run.init_trackers(f"distill-{train_run.out.name}", "distill")

        def card(validation: dict[str, Any] | None) -> dict[str, Any]:
            init = cfg.draft_init + (f" {cfg.draft_layers}" if cfg.draft_init == "pruned" else "")
            return {
                # As a server elsewhere finds it; the default's dequantized GGUF gets a note.
                **describe_target(cfg.target, cache_dir=cfg.cache_dir),
                "data": str(cfg.data),
                "init": init,
                "num_layers": unwrapped.config.num_hidden_layers,
                "loss": _loss_name(cfg),
                "steps": step,
                "compute_ratio": round(ratio, 4),
                **vocab_note,
                "validation": {"before": train_run.state.extra.get("before"), "after": validation},
            }

        def save_to(path: Path, validation: dict[str, Any] | None = None) -> None:
            with train_run.full_model(draft) as model:  # FSDP: gathered, collective
                if accelerator.is_main_process:
                    save_draft(
                        model, tokenizer, path, info=card(validation), extra_files=vocab_files
                    )

        def validate_all(samples: list | None = None) -> dict[str, float]:
            # FSDP: the draft gathered whole on every rank, the sharded target run evenly.
            with train_run.full_model(draft, everywhere=True) as model:
                return validate(
                    model, target, samples or val_samples, cfg, accelerator, train_run.fsdp, t2d
                )

        def scored(samples: list) -> tuple[dict[str, float], float]:
            metrics = validate_all(samples)
            tau = simulated_tau([metrics["greedy_agreement"]] * cfg.sim_k)
            return {f"val/{k}": v for k, v in metrics.items()}, tau

        def validation(step: int) -> None:
            logs, tau = held_out_validation(
                scored(val_samples) if val_samples else None,
                scored(held_samples) if held_samples else None,
            )
            chosen = {k[4:]: v for k, v in logs.items() if k.startswith("val/")}
            train_run.record_validation(step, logs, tau, partial(save_to, validation=chosen))
            say(f"step {step}: validation {_fmt_metrics(chosen)}, sim τ {tau:.3f}")

        step = train_run.state.step
        if val_samples and "before" not in train_run.state.extra:
            before = validate_all()
            train_run.state.extra["before"] = before
            accelerator.log({f"val/{k}": v for k, v in before.items()}, step=0)
            say(f"validation before training: {_fmt_metrics(before)}")

        # --- loop -----------------------------------------------------------------------------
        bar = progress(
            total=total,
            initial=step,
            desc="distill",
            disable=not (train_run.is_main and cfg.progress),
        )
        # The log window's sums stay on the device and are read once per logged step: no
        # micro-batch waits for the device.
        sums = torch.zeros(2, device=accelerator.device)  # loss, expected acceptance
        tokens = torch.zeros((), dtype=torch.long, device=accelerator.device)
        batches, window_start = 0, train_run.started
        draft.train()
        while not train_run.finished(step, total):
            for batch in train_run.position.batches_of_epoch(accelerator, loader):
                if is_on_policy_step(step, cfg.on_policy_fraction):
                    # FSDP: sampled by a whole copy on every rank (generation stops at EOS, so
                    # ranks run different numbers of forwards). Seeded by seed, step and rank
                    # apart from the global RNG: a resumed run samples what an unbroken one
                    # would (a data loader started after a resume draws from the global RNG).
                    cuda = [accelerator.device] if accelerator.device.type == "cuda" else []
                    with (
                        train_run.full_model(draft, everywhere=True) as model,
                        torch.random.fork_rng(devices=cuda),
                    ):
                        world, rank = accelerator.num_processes, accelerator.process_index
                        torch.manual_seed(cfg.seed * 1_000_003 + step * world + rank)
                        # sync: sampling stops at EOS, which the host reads to cut the answers
                        batch = on_policy_batch(model, batch, cfg, pad_id, stop_ids)
                with accelerator.accumulate(draft):
                    loss, metrics = distill_batch_loss(
                        draft,
                        target,
                        batch,
                        cfg.loss,
                        ce_weight=cfg.ce_weight,
                        temperature=cfg.temperature,
                        beta=cfg.jsd_beta,
                        eta=cfg.lk_eta,
                    )
                    accelerator.backward(loss)
                train_run.watch(loss)
                sums += torch.stack([loss.detach().float(), metrics["expected_acceptance"].float()])
                tokens += batch["attention_mask"].sum()
                batches += 1
                if not accelerator.sync_gradients:
                    continue
                grad_norm = accelerator.clip_grad_norm_(
                    draft.parameters(), cfg.max_grad_norm or math.inf
                )
                if not train_run.optimizer_step(step + 1, grad_norm, optimizer, scheduler):
                    continue  # a non-finite step, skipped (on_nonfinite: skip)
                step += 1
                bar.update(1)
                total = train_run.fit_schedule(
                    step, total, scheduler
                )  # fit_schedule: to max_minutes
                bar.total = total
                if step % cfg.log_every == 0 or step == total:
                    loss_sum, acc_sum = sums.tolist()  # the window's read (waits for it)
                    now = time.monotonic()
                    logs = {
                        "train/loss": loss_sum / batches,
                        "train/expected_acceptance": acc_sum / batches,
                        "train/lr": scheduler.get_last_lr()[0],
                        "train/grad_norm": float(grad_norm),
                        "train/tokens_per_second": int(tokens) / max(now - window_start, 1e-9),
                        "train/epoch": train_run.position.epoch,
                    }
                    train_run.log(step, logs)
                    bar.set_postfix(
                        loss=f"{logs['train/loss']:.4f}",
                        acc=f"{logs['train/expected_acceptance']:.3f}",
                    )
                    sums.zero_()
                    tokens.zero_()
                    batches, window_start = 0, now
                if (val_samples or held_samples) and train_run.eval_due(step, total):
                    validation(step)
                if train_run.save_due(step):
                    train_run.save_checkpoint(step)
                if train_run.finished(step, total):
                    break
        bar.close()

        # --- final validation and save --------------------------------------------------------
        interrupted = train_run.interrupted
        if not interrupted and (val_samples or held_samples) and not train_run.validated(step):
            validation(step)  # stopped by max_minutes
        if cfg.save_every or interrupted:
            train_run.save_checkpoint(step)
        if interrupted:
            say(train_run.resume_hint())
            return None
        history = train_run.state.validation
        after = (
            {k[4:]: v for k, v in history[-1].items() if k.startswith("val/")} if history else None
        )
        metrics = {
            **train_run.summary(step, total),
            "train_records": len(train_idx),
            "val_records": len(val_idx),
            "data_summary": str(summary),
            "compute_ratio": ratio,
            **vocab_note,
            "validation_before": train_run.state.extra.get("before"),
            "final_validation": after,
            **info,
        }
        train_run.write_output("draft", partial(save_to, validation=after))
        train_run.write_json(train_run.out / "training_metrics.json", metrics)
        say(
            f"draft saved to {train_run.out / 'draft'}; metrics in "
            f"{train_run.out / 'training_metrics.json'}"
        )
    return metrics


def _loss_name(cfg: DistillConfig) -> str:
    name = {
        "fkl": "forward KL",
        "rkl": "reverse KL",
        "tvd": "TVD",
        "jsd": f"JSD(β={cfg.jsd_beta})",
        "lk_hybrid": f"LK hybrid of forward KL and TVD (η={cfg.lk_eta})",
    }
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
    """CLI entry: 0 done (or stopped with a checkpoint), 2 usage error, 1 run error."""

    def run_recipe(args: list[str]) -> int:
        cfg = parse_config(
            DistillConfig, args, prog="draftsmith train distill", description=__doc__
        )

        with input_errors():  # missing/malformed data, target: one line, exit 2
            run(cfg)
        return 0

    # A worker of a multi-process run ends here, without interpreter teardown (see exit_process).
    return exit_process(cli_main(run_recipe, argv))


if __name__ == "__main__":
    sys.exit(main())
