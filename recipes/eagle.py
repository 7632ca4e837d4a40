"""Train an EAGLE-1 or EAGLE-3 drafter on the frozen target's hidden states.

Launch::

    python recipes/eagle.py --config recipes/configs/eagle3_smollm2.yaml
    python recipes/eagle.py --config recipes/configs/eagle1_smollm2.yaml --max-minutes 20
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/eagle.py \\
        --config recipes/configs/eagle3_smollm2.yaml            # 2 processes on CPU
    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml recipes/eagle.py ...
    accelerate launch --config_file recipes/accelerate/fsdp_cpu_2proc.yaml recipes/eagle.py ...
        # FSDP: target and drafter sharded (docs/scaling.md)

Then evaluate and export::

    draftsmith evaluate --drafter eagle=runs/eagle3_smollm2/best --k 3 --dtype bfloat16
    draftsmith export --format speculators --checkpoint runs/eagle3_smollm2/best --out out/

The recipe reads top to bottom: config -> run (processes, output lock) -> target (frozen) -> data
and its hidden states (computed online by the target inside the step, or read from a cache built
by ``draftsmith data cache``; one config field switches, the batches are identical) -> drafter ->
optimizer and schedule -> loop (accumulate, backward, clip, step; validation; checkpoints) ->
save. Ctrl-C finishes the step, saves a checkpoint and prints how to resume; the shared
plumbing (checkpoints, stop, data position, ownership) is ``draftsmith.train.core``.

EAGLE-1 (Li et al. 2024, §3): regress the next target feature (SmoothL1) plus 0.1 x cross-entropy
of its token distribution against the target's. EAGLE-3 (Li et al. 2025, §3): fuse three target
layers, predict tokens directly over a reduced draft vocabulary, and train with the "training-time
test" -- the drafter is unrolled on its own outputs for ``ttt_steps`` steps, step j weighted
``ttt_decay ** j``. Validation reports each step's top-1 accuracy and the simulated τ they imply
(``val/sim_tau``); the drafter with the best one is kept in ``output_dir/best``.

Output directory::

    drafter/                  the last drafter (heads.eagle.load_drafter) + training_metrics.json
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
from ..train.objectives.acceptance import DRAFT_LOSSES


@dataclass
class EagleTrainConfig(TrainConfig):
    """Settings of one EAGLE training run (the shared ones are in TrainConfig)."""

    version: int = cfg_field(3, help="EAGLE version: 1 or 3", choices=[1, 3])
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
        None, help="offline: cache directory written by `draftsmith data cache`"
    )
    target_dtype: str = cfg_field(
        "auto",
        help="target weights dtype for online features and the label head (bf16: ~2x faster "
        "wide forwards on AVX512-BF16/AMX CPUs and GPUs; the drafter keeps fp32 master "
        "weights); " + DTYPE_AUTO_HELP,
        choices=["auto", "fp32", "bf16"],
    )
    feature_layers: list[int] | None = cfg_field(
        None,
        help="target layers the drafter reads, as HF hidden_states indices (i = input to layer "
        "i): EAGLE-3's 3 fused layers, default [2, N//2, N-3] (the EAGLE/vLLM convention); "
        "EAGLE-1 reads the final output N (leave unset)",
        ge=0,
    )
    draft_vocab_size: int = cfg_field(
        8192,
        help="draft vocabulary: the N most frequent supervised tokens (EAGLE-3's own head has N "
        "rows; EAGLE-1 drafts with these N rows of the target head; the full vocabulary size "
        "turns it off)",
        ge=1,
    )
    parallel_drafting: bool = cfg_field(
        False,
        help="P-EAGLE (version 3): train the drafter to draft all k positions in one forward, "
        "placeholders standing in for the positions after the first; ttt_steps is then the "
        "deepest position trained (serve with k <= ttt_steps)",
    )
    mask_token_id: int | None = cfg_field(
        None,
        help="P-EAGLE's placeholder token (default: the tokenizer's unknown token when it is "
        "none of BOS/EOS/pad, else another special token)",
        ge=0,
    )
    fc_norm: bool = cfg_field(
        False,
        help="EAGLE-3.1 (version 3): an RMSNorm on each fused target feature before fc "
        "(arXiv 2605.09992; served by vLLM from the speculators export)",
    )
    norm_output: bool = cfg_field(
        False,
        help="EAGLE-3.1 (version 3): the drafter passes its post-norm state to the next draft "
        "step and the head (fc_norm + norm_output = EAGLE-3.1)",
    )
    ttt_steps: int = cfg_field(7, help="EAGLE-3 training-time-test unroll steps", ge=1)
    ttt_decay: float = cfg_field(
        0.8, help="EAGLE-3 loss weight of step j is ttt_decay ** j", gt=0, le=1
    )
    loss: str = cfg_field(
        "kl",
        help="EAGLE-3/P-EAGLE per-step loss: kl (soft cross-entropy), or an LK loss that targets "
        "the acceptance rate α = Σ min(p, q) (arXiv 2602.23881): tv (1 - α), nla (-log α), "
        "lk_hybrid (λ KL + (1 - λ) TV, λ = exp(-lk_eta α))",
        choices=list(DRAFT_LOSSES),
    )
    lk_eta: float = cfg_field(
        3.0, help="lk_hybrid: decay of the KL weight with the acceptance rate (0: pure KL)", ge=0
    )
    feature_noise: float = cfg_field(
        0.2, help="EAGLE-1 uniform noise U(-a/2, a/2) added to input features (0 = off)", ge=0
    )
    init_from: Path | None = cfg_field(
        None, help="start from this saved drafter (a `drafter/` dir) instead of a fresh one"
    )
    max_grad_norm: float = cfg_field(0.5, help="gradient clipping norm (0 = off)", ge=0)
    output_dir: Path = cfg_field(Path("runs/eagle"), help="where checkpoints and the drafter go")

    def validate(self) -> list[tuple[str, str]]:
        problems = super().validate()
        if self.hidden_states == "online" and self.data is None:
            problems.append(("data", "online hidden states need training records (data)"))
        if self.hidden_states == "offline" and self.hidden_states_cache is None:
            problems.append(("hidden_states_cache", "offline hidden states need a cache dir"))
        if self.version == 1 and self.parallel_drafting:
            problems.append(("parallel_drafting", "P-EAGLE drafts with EAGLE-3: set version: 3"))
        for name in ("fc_norm", "norm_output"):
            if getattr(self, name) and self.version == 1:
                problems.append((name, "EAGLE-3.1's variants are for version 3"))
            elif getattr(self, name) and self.parallel_drafting:
                problems.append(
                    (name, "vLLM 0.32 serves P-EAGLE without EAGLE-3.1's variants: leave it off")
                )
        if self.mask_token_id is not None and not self.parallel_drafting:
            problems.append(("mask_token_id", "only parallel drafting (P-EAGLE) uses it"))
        if self.version == 1 and self.loss != "kl":
            problems.append(
                ("loss", "EAGLE-1 trains on features and tokens; LK losses are EAGLE-3's")
            )
        if self.version == 1 and self.feature_layers is not None:
            problems.append(("feature_layers", "EAGLE-1 uses the last layer only; set version: 3"))
        if self.feature_layers is not None and len(self.feature_layers) != 3:
            problems.append(
                ("feature_layers", f"EAGLE-3 fuses 3 layers, got {self.feature_layers}")
            )
        if self.init_from is not None and not (Path(self.init_from) / "config.json").is_file():
            problems.append(
                (
                    "init_from",
                    f"{self.init_from} is not a saved drafter directory "
                    "(no config.json): give the `drafter/` dir of an EAGLE run",
                )
            )
        return problems

    def input_paths(self) -> dict[str, Path | None]:
        """Online: ``data``; offline: ``hidden_states_cache`` only (``data`` is not read)."""
        if self.hidden_states == "offline":
            return {"hidden_states_cache": self.hidden_states_cache}
        return {"data": self.data}


def train(cfg: EagleTrainConfig) -> int:
    """Run the recipe; 0 when finished or stopped on purpose (a checkpoint to resume from)."""
    # Heavy imports after the config is known good: `--help` and typos answer in a second.

    from ..heads.eagle import EagleConfig, build_drafter, load_drafter, save_drafter
    from ..train.data.chat import template_fingerprint
    from ..train.decoding.metrics import simulated_tau
    from ..train.features.source import feature_source, target_fingerprint, val_data_source
    from ..train.objectives.eagle_ttt import eagle1_loss, eagle3_ttt_loss
    from ..train.progress import progress
    from ..train.runinfo import run_info

    kind = "peagle" if cfg.parallel_drafting else f"eagle{cfg.version}"
    title = "P-EAGLE" if cfg.parallel_drafting else f"EAGLE-{cfg.version}"
    with TrainRun(cfg, recipe="eagle", kind=kind, outputs=["drafter"], fsdp=True) as run:
        accelerator, say = run.accelerator, run.say
        info = run_info(accelerator.device)  # the device this run's processes train on

        # --- target (frozen) ------------------------------------------------------------------
        target_dtype = auto_dtype(cfg.target_dtype, accelerator.device, fast="bf16", slow="fp32")
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[target_dtype]
        # FSDP: decoder layers on the meta device, each process reads its own shards below.
        target, tokenizer = run.load_target(cfg.target, cache_dir=cfg.cache_dir, dtype=dtype)
        target = run.place_target(target.requires_grad_(False).eval())  # sharded under FSDP
        num_layers, vocab = target.config.num_hidden_layers, target.config.vocab_size
        if cfg.feature_layers is not None and max(cfg.feature_layers) > num_layers:
            raise UsageError(
                f"feature_layers: {cfg.feature_layers} is outside the target's hidden "
                f"states 0..{num_layers} (it has {num_layers} layers)"
            )
        if cfg.draft_vocab_size > vocab:
            raise UsageError(
                f"draft_vocab_size: {cfg.draft_vocab_size} is larger than the "
                f"target's vocabulary ({vocab}); choose <= {vocab}"
            )
        mask_token_id = None
        if cfg.parallel_drafting:
            mask_token_id = cfg.mask_token_id
            if mask_token_id is None:
                mask_token_id = default_mask_token(tokenizer, vocab)
            if mask_token_id >= vocab:
                raise UsageError(
                    f"mask_token_id: {mask_token_id} is not a token of the target's "
                    f"vocabulary (0..{vocab - 1})"
                )
        eagle_cfg = EagleConfig.from_target(
            target.config,
            cfg.version,
            feature_layers=cfg.feature_layers,
            draft_vocab_size=cfg.draft_vocab_size,
            mask_token_id=mask_token_id,
            fc_norm=cfg.fc_norm,
            norm_output=cfg.norm_output,
        )
        # What the target provides to training: the drafter's feature layers plus the last
        # one, whose target head gives the labels.
        train_layers = list(eagle_cfg.train_layers)

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
            count_source = data
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
            count_source = src.dataset.token_view()  # the cached tokens (a HiddenStateCache)
        if cfg.hidden_states == "offline":
            # limit: the cache's first N records, as online mode keeps the first N records.
            src.dataset = first_records(src.dataset, cfg.limit)
            count_source = first_records(count_source, cfg.limit)
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
        d2t = t2d = None
        vocab_note = {}
        if eagle_cfg.draft_vocab_size < vocab and cfg.init_from is None:
            # EAGLE-3 §3 (FR-Spec for EAGLE-1): the drafter predicts over the most frequent
            # target tokens only, counted on the supervised tokens of this run's training data.
            d2t, t2d, vocab_note = run_draft_vocab(
                count_source, cfg.draft_vocab_size, tokenizer, target, cfg.max_length, say
            )
        if cfg.init_from is not None:
            drafter = load_drafter(cfg.init_from, target)
            if drafter.config.version != cfg.version:
                raise UsageError(
                    f"init_from: {cfg.init_from} holds an EAGLE-"
                    f"{drafter.config.version} drafter, config asks for version "
                    f"{cfg.version}"
                )
            if drafter.config.parallel != cfg.parallel_drafting:
                raise UsageError(
                    f"init_from: {cfg.init_from} holds a drafter "
                    f"{'with' if drafter.config.parallel else 'without'} parallel drafting; "
                    f"the config sets parallel_drafting: {cfg.parallel_drafting}"
                )
            for name in ("fc_norm", "norm_output"):
                if getattr(drafter.config, name) != getattr(cfg, name):
                    raise UsageError(
                        f"{name}: the config sets {getattr(cfg, name)}, the drafter in "
                        f"init_from {cfg.init_from} has {getattr(drafter.config, name)}"
                    )
        else:
            drafter = build_drafter(target, eagle_cfg, d2t=d2t, t2d=t2d)
        drafter.train()
        params = [p for p in drafter.parameters() if p.requires_grad]
        say(
            f"drafter: {title}, {sum(p.numel() for p in params) / 1e6:.1f}M "
            f"trainable parameters; features from target layers {train_layers} "
            f"({cfg.hidden_states})"
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
        run.init_trackers(f"{kind}-{run.out.name}", "train")
        lm_head = target.get_output_embeddings()

        def loss_fn(batch):
            # The (possibly DDP-wrapped) drafter goes in whole: its forward syncs gradients.
            if cfg.version == 1:
                return eagle1_loss(drafter, batch, lm_head, noise=cfg.feature_noise)
            return eagle3_ttt_loss(
                drafter,
                batch,
                lm_head,
                steps=cfg.ttt_steps,
                decay=cfg.ttt_decay,
                loss=cfg.loss,
                lk_eta=cfg.lk_eta,
            )

        def measure(val_loader, source) -> tuple[dict[str, float], float]:
            """Mean loss and per-step top-1 accuracy over one validation set (all processes)."""
            sums: dict[str, torch.Tensor] = {}  # on the device, read once at the end
            with torch.no_grad():
                for batch in val_loader:
                    _, metrics = loss_fn(source.complete(batch, accelerator.device))
                    for key, value in metrics.items():
                        sums[key] = sums.get(key, 0.0) + value.float()
            totals = torch.stack(list(sums.values())).tolist() if sums else []
            n = max(len(val_loader), 1)
            val = {f"val/{k}": v / n for k, v in zip(sums, totals, strict=True)}
            val = mean_over_processes(accelerator, val)
            accs = (
                [val["val/acc"]]
                if cfg.version == 1
                else [val[f"val/acc_{j}"] for j in range(cfg.ttt_steps)]
            )
            return val, simulated_tau(accs)

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
            total=total,
            initial=step,
            desc=title,
            disable=not (run.is_main and cfg.progress),
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
                # One autocast region around the whole unroll: the drafter's forward is called
                # once per TTT step, and each call's own region would cast (and keep for the
                # backward) its own bf16 copy of every weight -- 0.5 GB a step at 8B widths.
                with accelerator.accumulate(drafter):
                    with accelerator.autocast():
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
                    acc = logs.get("train/acc_0", logs.get("train/acc", 0.0))
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
            "version": cfg.version,
            "parallel_drafting": cfg.parallel_drafting,
            "mask_token_id": mask_token_id,
            "train_samples": len(train_set),
            "val_samples": len(val_idx),
            "val_data": str(cfg.val_data) if cfg.val_data is not None else None,
            "target_dtype": target_dtype,  # as resolved (auto: by the device's bf16 support)
            "mixed_precision": cfg.mixed_precision,
            # What the drafter reads (EAGLE-3's fused layers, or the last for EAGLE-1) and what
            # the target had to provide for training (those plus the last layer, for the labels).
            "feature_layers": list(eagle_cfg.feature_layers),
            "train_layers": train_layers,
            "final_validation": run.state.validation[-1] if run.state.validation else None,
            **vocab_note,
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
        cfg = parse_config(EagleTrainConfig, args, prog="recipes/eagle.py", description=__doc__)

        with input_errors():  # missing/malformed data, target, cache: one line, exit 2
            return train(cfg)

    # A worker of a multi-process run ends here, without interpreter teardown (see exit_process).
    return exit_process(cli_main(run_recipe, argv))


if __name__ == "__main__":
    sys.exit(main())
