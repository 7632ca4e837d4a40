"""Train an EAGLE-1 or EAGLE-3 drafter on the frozen target's hidden states.

Launch::

    python recipes/eagle.py --config recipes/configs/eagle3_smollm2.yaml
    python recipes/eagle.py --config recipes/configs/eagle1_smollm2.yaml --max-minutes 20
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/eagle.py \\
        --config recipes/configs/eagle3_smollm2.yaml            # 2 processes on CPU
    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml recipes/eagle.py ...

Then evaluate and export::

    draftsmith evaluate --drafter eagle --drafter-path runs/eagle3_smollm2/drafter --k 5
    draftsmith export --format speculators --checkpoint runs/eagle3_smollm2/drafter --out out/

The recipe reads top to bottom: config -> accelerator -> target (frozen) -> data and its hidden
states (computed online by the target inside the step, or read from a cache built by ``draftsmith
data cache``; one config field switches, the batches are identical) -> drafter -> optimizer and
schedule -> loop (accumulate, backward, clip, step; periodic ``save_state``) -> save.

EAGLE-1 (Li et al. 2024, §3): regress the next target feature (SmoothL1) plus 0.1 x cross-entropy
of its token distribution against the target's. EAGLE-3 (Li et al. 2025, §3): fuse three target
layers, predict tokens directly over a reduced draft vocabulary, and train with the "training-time
test" -- the drafter is unrolled on its own outputs for ``ttt_steps`` steps, step j weighted
``ttt_decay ** j``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.train.config import ConfigError, cfg_field, config_to_dict, parse_config


@dataclass
class EagleTrainConfig:
    """Settings of one EAGLE training run."""

    version: int = cfg_field(3, help="EAGLE version: 1 or 3", choices=[1, 3])
    target: str | None = cfg_field(
        None, help="target: a local HF model dir, a .gguf file, or None for SmolLM2-135M-Instruct"
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    data: Path | None = cfg_field(
        None,
        help="training records (JSONL/JSON/parquet; self-distilled answers, see `draftsmith data "
        "distill`); online mode",
    )
    split: str | None = cfg_field("train", help="keep only records of this split (None = all)")
    limit: int | None = cfg_field(None, help="use the first N training records only")
    max_length: int = cfg_field(512, help="truncate samples to this many tokens")
    hidden_states: str = cfg_field(
        "online",
        help="online: the target computes features inside the step; offline: read them from "
        "hidden_states_cache",
        choices=["online", "offline"],
    )
    hidden_states_cache: Path | None = cfg_field(
        None, help="offline: cache directory written by `draftsmith data cache`"
    )
    aux_layers: list[int] | None = cfg_field(
        None,
        help="EAGLE-3 fused layers as HF hidden_states indices (i = input to layer i); default "
        "[2, N//2, N-3], the EAGLE/vLLM convention",
    )
    draft_vocab_size: int = cfg_field(
        8192, help="EAGLE-3 reduced draft vocabulary: the N most frequent supervised tokens"
    )
    ttt_steps: int = cfg_field(7, help="EAGLE-3 training-time-test unroll steps")
    ttt_decay: float = cfg_field(0.8, help="EAGLE-3 loss weight of step j is ttt_decay ** j")
    feature_noise: float = cfg_field(
        0.2, help="EAGLE-1 uniform noise U(-a/2, a/2) added to input features (0 = off)"
    )
    init_from: Path | None = cfg_field(
        None, help="start from this saved drafter (a `drafter/` dir) instead of a fresh one"
    )
    epochs: float = cfg_field(1.0, help="passes over the training data (fractions allowed)")
    max_steps: int | None = cfg_field(
        None, help="optimizer steps (overrides epochs; sets the LR schedule length)"
    )
    max_minutes: float | None = cfg_field(
        None, help="stop (and save) after this much training time; the schedule is unchanged"
    )
    batch_size: int = cfg_field(4, help="samples per process per micro-batch")
    grad_accum: int = cfg_field(1, help="micro-batches per optimizer step")
    lr: float = cfg_field(5e-4, help="peak learning rate (AdamW)")
    weight_decay: float = cfg_field(0.0, help="AdamW weight decay")
    warmup_ratio: float = cfg_field(0.03, help="fraction of steps of linear warm-up")
    max_grad_norm: float = cfg_field(0.5, help="gradient clipping norm (0 = off)")
    mixed_precision: str = cfg_field(
        "no", help="no, bf16 or fp16 (accelerate; only where the device supports it)",
        choices=["no", "bf16", "fp16"],
    )  # fmt: skip
    val_samples: int = cfg_field(
        32, help="training records held back to measure per-step accuracy (0 = none)"
    )
    eval_every: int = cfg_field(100, help="measure validation accuracy every N steps")
    log_every: int = cfg_field(10, help="log training metrics every N steps")
    save_every: int = cfg_field(200, help="save a resumable checkpoint every N steps (0 = off)")
    keep_checkpoints: int = cfg_field(2, help="how many resumable checkpoints to keep")
    resume: bool = cfg_field(True, help="continue from the latest checkpoint in output_dir")
    output_dir: Path = cfg_field(Path("runs/eagle"), help="where checkpoints and the drafter go")
    seed: int = cfg_field(0, help="random seed (data order, init, noise)")
    threads: int | None = cfg_field(None, help="torch CPU threads per process")
    report_to: str = cfg_field("none", help="experiment tracker", choices=["none", "wandb"])
    wandb_project: str = cfg_field("draftsmith", help="W&B project")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.hidden_states == "online" and self.data is None:
            problems.append(("data", "online hidden states need training records (data)"))
        if self.hidden_states == "offline" and self.hidden_states_cache is None:
            problems.append(("hidden_states_cache", "offline hidden states need a cache dir"))
        for name in ("max_length", "batch_size", "grad_accum", "ttt_steps", "draft_vocab_size"):
            if getattr(self, name) < 1:
                problems.append((name, f"must be >= 1, got {getattr(self, name)}"))
        for name in ("limit", "max_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append((name, f"must be >= 1 or None, got {value}"))
        if self.epochs <= 0:
            problems.append(("epochs", f"must be > 0, got {self.epochs}"))
        if self.max_minutes is not None and self.max_minutes <= 0:
            problems.append(("max_minutes", f"must be > 0, got {self.max_minutes}"))
        if self.lr <= 0:
            problems.append(("lr", f"must be > 0, got {self.lr}"))
        if not 0 <= self.warmup_ratio < 1:
            problems.append(("warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}"))
        if not 0 < self.ttt_decay <= 1:
            problems.append(("ttt_decay", f"must be in (0, 1], got {self.ttt_decay}"))
        if self.feature_noise < 0:
            problems.append(("feature_noise", f"must be >= 0, got {self.feature_noise}"))
        if self.max_grad_norm < 0:
            problems.append(("max_grad_norm", f"must be >= 0, got {self.max_grad_norm}"))
        for name in ("val_samples", "save_every"):
            if getattr(self, name) < 0:
                problems.append((name, f"must be >= 0, got {getattr(self, name)}"))
        for name in ("eval_every", "log_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                problems.append((name, f"must be >= 1, got {getattr(self, name)}"))
        if self.version == 1 and self.aux_layers is not None:
            problems.append(("aux_layers", "EAGLE-1 uses the last layer only; set version: 3"))
        if self.aux_layers is not None and len(self.aux_layers) != 3:
            problems.append(("aux_layers", f"EAGLE-3 fuses 3 layers, got {self.aux_layers}"))
        return problems


def main(argv: list[str] | None = None) -> int:
    # --- config -------------------------------------------------------------------------------
    try:
        cfg = parse_config(EagleTrainConfig, argv, prog="recipes/eagle.py", description=__doc__)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Heavy imports after the config is known good: `--help` and typos answer in a second.
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    from draftsmith.heads.eagle import EagleConfig, build_drafter, load_drafter, save_drafter
    from draftsmith.train.data import build_dataset, template_fingerprint
    from draftsmith.train.eagle_ttt import eagle1_loss, eagle3_ttt_loss
    from draftsmith.train.hidden_states import CacheError, feature_source, process_state
    from draftsmith.train.runinfo import run_info, wandb_mode, write_json_atomic
    from draftsmith.train.target import TargetError, load_target
    from draftsmith.train.vocab import coverage, draft_vocab, token_counts

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    info = run_info()
    out = Path(cfg.output_dir)
    # CPU processes need a CPU state before the Accelerator, or 2 CPU processes started by
    # `accelerate launch` each believe they are alone (see process_state).
    state = process_state()
    accelerator = Accelerator(
        cpu=state.device.type == "cpu",
        gradient_accumulation_steps=cfg.grad_accum,
        mixed_precision=cfg.mixed_precision,
        log_with="wandb" if cfg.report_to == "wandb" else None,
        project_dir=str(out),
        # Seeded sampler: a resumed run sees the same order of batches as an unbroken one.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(cfg.seed)
    say = accelerator.print

    # --- target (frozen) ----------------------------------------------------------------------
    try:
        target, tokenizer = load_target(cfg.target, cache_dir=cfg.cache_dir)
    except TargetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    target.requires_grad_(False).eval().to(accelerator.device)
    num_layers = target.config.num_hidden_layers
    eagle_cfg = EagleConfig.from_target(
        target.config,
        cfg.version,
        draft_vocab_size=cfg.draft_vocab_size if cfg.version == 3 else None,
        aux_layers=cfg.aux_layers,
    )
    layers = list(eagle_cfg.train_layers)

    # --- data and features --------------------------------------------------------------------
    if cfg.hidden_states == "online":
        data, summary = build_dataset(
            cfg.data, tokenizer, max_length=cfg.max_length, split=cfg.split
        )
        if cfg.limit is not None:
            data = data.select(range(min(cfg.limit, len(data))))
        say(f"data: {summary}")
        src = feature_source("online", layers=layers, data=data, target=target,
                             max_length=cfg.max_length, pad_token_id=0)  # fmt: skip
        count_source = data
    else:
        # The cache must come from this target and template (error names each difference);
        # stored bf16 features are computed on in the drafter's fp32.
        expect = {
            "num_layers": num_layers,
            "hidden_size": target.config.hidden_size,
            "vocab_size": target.config.vocab_size,
            "template_fingerprint": template_fingerprint(tokenizer),
        }
        try:
            src = feature_source("offline", layers=layers, cache=cfg.hidden_states_cache,
                                 max_length=cfg.max_length, dtype=torch.float32,
                                 expect=expect)  # fmt: skip
        except (CacheError, OSError) as exc:
            print(f"error: hidden_states_cache: {exc}", file=sys.stderr)
            return 2
        count_source = cfg.hidden_states_cache
    n_all = len(src.dataset)
    # A fixed permutation splits train / validation the same way in every process and on resume.
    order = torch.randperm(n_all, generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    n_val = min(cfg.val_samples, max(0, n_all - 1))
    val_idx, train_idx = sorted(order[:n_val]), sorted(order[n_val:])
    train_set = torch.utils.data.Subset(src.dataset, train_idx)
    val_set = torch.utils.data.Subset(src.dataset, val_idx)
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=cfg.batch_size, shuffle=True, collate_fn=src.collate
    )
    val_loader = torch.utils.data.DataLoader(
        val_set, batch_size=cfg.batch_size, shuffle=False, collate_fn=src.collate
    )

    # --- drafter ------------------------------------------------------------------------------
    d2t = t2d = None
    vocab_note = {}
    if cfg.version == 3 and cfg.init_from is None:
        # EAGLE-3 §3: the draft head predicts over the most frequent target tokens only. Counted
        # on the supervised tokens of this run's training data (the validation rows included:
        # they are training records too), EOS always in.
        counts = token_counts(count_source, target.config.vocab_size, max_length=cfg.max_length)
        eos = {tokenizer.eos_token_id, *_as_list(target.generation_config.eos_token_id)} - {None}
        d2t, t2d = draft_vocab(counts, cfg.draft_vocab_size, always_include=sorted(eos))
        vocab_note = {"draft_vocab_coverage": coverage(counts, t2d)}
        say(f"draft vocab: {cfg.draft_vocab_size} tokens cover "
            f"{vocab_note['draft_vocab_coverage']:.2%} of supervised tokens")  # fmt: skip
    if cfg.init_from is not None:
        drafter = load_drafter(cfg.init_from, target)
        if drafter.config.version != cfg.version:
            print(f"error: init_from: {cfg.init_from} holds an EAGLE-{drafter.config.version} "
                  f"drafter, config asks for version {cfg.version}", file=sys.stderr)  # fmt: skip
            return 2
    else:
        drafter = build_drafter(target, eagle_cfg, d2t=d2t, t2d=t2d)
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    say(f"drafter: EAGLE-{cfg.version}, {sum(p.numel() for p in params) / 1e6:.1f}M trainable "
        f"parameters; features from target layers {layers} ({cfg.hidden_states})")  # fmt: skip

    # --- optimizer, schedule, prepare ---------------------------------------------------------
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    micro_per_epoch = math.ceil(len(train_set) / (cfg.batch_size * accelerator.num_processes))
    steps_per_epoch = max(1, micro_per_epoch // cfg.grad_accum)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, int(cfg.warmup_ratio * total_steps), total_steps
    )
    # The scheduler is stepped here once per optimizer step, not prepared: accelerate's wrapper
    # steps it once per process, which would finish the schedule early on several processes.
    drafter, optimizer, loader, val_loader = accelerator.prepare(
        drafter, optimizer, loader, val_loader
    )
    accelerator.register_for_checkpointing(scheduler)
    lm_head = target.get_output_embeddings()

    def loss_fn(batch):
        # The (possibly DDP-wrapped) drafter goes in whole: its forward is what syncs gradients.
        if cfg.version == 1:
            return eagle1_loss(drafter, batch, lm_head, noise=cfg.feature_noise)
        return eagle3_ttt_loss(drafter, batch, lm_head, steps=cfg.ttt_steps, decay=cfg.ttt_decay)

    # --- resume -------------------------------------------------------------------------------
    ckpt_root = out / "checkpoints"
    step = 0
    latest = _latest_checkpoint(ckpt_root) if cfg.resume else None
    if latest is not None:
        accelerator.load_state(str(latest))
        step = json.loads((latest / "trainer_state.json").read_text())["step"]
        say(f"resumed from {latest} (step {step} of {total_steps})")
    if cfg.report_to == "wandb":
        accelerator.init_trackers(
            cfg.wandb_project,
            config=config_to_dict(cfg),
            # No API key configured: log offline to ./wandb (`wandb sync` uploads it later).
            init_kwargs={
                "wandb": {
                    "name": f"eagle{cfg.version}-{out.name}",
                    "job_type": "train",
                    "mode": wandb_mode(),
                }
            },
        )

    # --- loop ---------------------------------------------------------------------------------
    history: list[dict] = []
    val_history: list[dict] = []
    start = time.perf_counter()
    tokens_seen = 0
    stop_reason = "done"
    bar = tqdm(total=total_steps, initial=step, desc=f"EAGLE-{cfg.version}",
               disable=not accelerator.is_main_process, dynamic_ncols=True)  # fmt: skip
    running: dict[str, float] = {}
    running_n = 0
    while step < total_steps and stop_reason == "done":
        epoch, skip = divmod(step * cfg.grad_accum, micro_per_epoch)
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in batches:
            batch = src.complete(batch, accelerator.device)
            with accelerator.accumulate(drafter):
                loss, metrics = loss_fn(batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            tokens_seen += int(batch["attention_mask"].sum())
            for key, value in metrics.items():
                running[key] = running.get(key, 0.0) + float(value)
            running_n += 1
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            if step % cfg.log_every == 0 or step == total_steps:
                logs = {f"train/{k}": v / running_n for k, v in running.items()}
                logs["train/lr"] = scheduler.get_last_lr()[0]
                logs = _mean_over_processes(accelerator, logs)
                elapsed = time.perf_counter() - start
                logs["train/tokens_per_s"] = tokens_seen * accelerator.num_processes / elapsed
                accelerator.log(logs, step=step)
                history.append({"step": step, **logs})
                bar.set_postfix(loss=f"{logs['train/loss']:.3f}",
                                acc=f"{logs.get('train/acc_0', logs.get('train/acc', 0)):.2f}")  # fmt: skip
                running, running_n = {}, 0
            if n_val and (step % cfg.eval_every == 0 or step == total_steps):
                val = _validate(accelerator, drafter, val_loader, src, loss_fn)
                accelerator.log(val, step=step)
                val_history.append({"step": step, **val})
                say(f"step {step}: " + ", ".join(f"{k.split('/')[-1]} {v:.3f}"
                                                 for k, v in val.items()))  # fmt: skip
            if cfg.save_every and step % cfg.save_every == 0:
                _save_checkpoint(accelerator, ckpt_root, step, cfg.keep_checkpoints)
            if cfg.max_minutes is not None and time.perf_counter() - start > 60 * cfg.max_minutes:
                stop_reason = "max_minutes"
            if step >= total_steps or stop_reason != "done":
                break
    bar.close()
    train_seconds = time.perf_counter() - start

    # --- save ---------------------------------------------------------------------------------
    if cfg.save_every:
        _save_checkpoint(accelerator, ckpt_root, step, cfg.keep_checkpoints)
    if n_val and (not val_history or val_history[-1]["step"] != step):
        val_history.append({"step": step,
                            **_validate(accelerator, drafter, val_loader, src, loss_fn)})  # fmt: skip
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(drafter)
        save_drafter(model, out / "drafter")
        result = {
            "recipe": "eagle",
            "version": cfg.version,
            "steps": step,
            "total_steps": total_steps,
            "stop_reason": stop_reason if step < total_steps else "done",
            "train_seconds": round(train_seconds, 1),
            "train_samples": len(train_set),
            "val_samples": n_val,
            "processes": accelerator.num_processes,
            "feature_layers": layers,
            "final_validation": val_history[-1] if val_history else None,
            "validation": val_history,
            "train_log": history,
            **vocab_note,
            "data": str(cfg.data or cfg.hidden_states_cache),
            "config": config_to_dict(cfg),
            **info,
        }
        write_json_atomic(out / "drafter" / "training_metrics.json", result)
        write_json_atomic(out / "training_metrics.json", result)
        say(f"saved the drafter to {out / 'drafter'} after {step} steps "
            f"({train_seconds / 60:.1f} min)")  # fmt: skip
    accelerator.end_training()
    return 0


def _validate(accelerator, drafter, val_loader, src, loss_fn) -> dict[str, float]:
    """Mean loss and per-step top-1 accuracy over the validation rows (all processes)."""
    drafter.eval()
    sums: dict[str, float] = {}
    n = 0
    with torch.no_grad():
        for batch in val_loader:
            batch = src.complete(batch, accelerator.device)
            _, metrics = loss_fn(batch)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
            n += 1
    drafter.train()
    return _mean_over_processes(accelerator, {f"val/{k}": v / max(n, 1) for k, v in sums.items()})


def _mean_over_processes(accelerator, logs: dict[str, float]) -> dict[str, float]:
    if accelerator.num_processes == 1 or not logs:
        return logs
    keys = sorted(logs)
    values = torch.tensor([logs[k] for k in keys], device=accelerator.device)
    values = accelerator.reduce(values, reduction="mean")
    return dict(zip(keys, values.tolist(), strict=True))


def _latest_checkpoint(root: Path) -> Path | None:
    done = [p for p in root.glob("step_*") if (p / "trainer_state.json").exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def _save_checkpoint(accelerator, root: Path, step: int, keep: int) -> None:
    """``save_state`` into ``step_N``; ``trainer_state.json`` written last marks it complete."""
    path = root / f"step_{step}"
    if (path / "trainer_state.json").exists():
        return
    accelerator.save_state(str(path))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (path / "trainer_state.json").write_text(json.dumps({"step": step}))
        import shutil

        finished = sorted(
            (p for p in root.glob("step_*") if (p / "trainer_state.json").exists()),
            key=lambda p: int(p.name.split("_")[1]),
        )
        for old in finished[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple, set)) else [x]


if __name__ == "__main__":
    sys.exit(main())
