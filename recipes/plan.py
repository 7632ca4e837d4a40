"""``draftsmith plan``: will this EAGLE training job fit, and if not, what would?

Reads the recipe's config (its target, EAGLE version, draft vocabulary, TTT steps, sequence
length, micro-batch, features and dtypes; flags override each), simulates one training step on
fake tensors (:mod:`.simulate`), adds what the weights, gradients, optimizer state and the
launch (DDP, FSDP) hold (:mod:`.memory`), and prints the per-device peak, whether it fits, and
the alternatives: the largest micro-batch and sequence length, offline features, FSDP, the
fewest GPUs::

    draftsmith plan --train-config recipes/configs/eagle3_llama31_8b.yaml --gpus 1 \\
        --gpu-memory-gib 80
    draftsmith plan --target recipes/architectures/meta-llama/Llama-3.1-70B-Instruct \\
        --seq-len 4096 --gpus 8 --strategy fsdp --hidden-states online

A target is a local model directory, a ``config.json``, or a Hub id whose architecture the
repository ships (``recipes/architectures/<org>/<name>/config.json``): no weights are read.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: resolve the imports below (PEP 366)
    __package__ = "draftsmith.recipes"

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..train.config import cfg_field
from ..train.errors import UsageError, cli_main

__all__ = ["PlanConfig", "main", "resolve_target_config"]

ARCHITECTURES = Path(__file__).resolve().parent / "architectures"


@dataclass
class PlanConfig:
    """Settings of ``draftsmith plan``."""

    train_config: Path | None = cfg_field(
        None,
        help="the EAGLE recipe's YAML (recipes/configs/eagle3_*.yaml): target, version, "
        "draft_vocab_size, ttt_steps, max_length, batch_size, hidden_states, target_dtype, "
        "mixed_precision; the flags below override it",
    )
    target: str | None = cfg_field(
        None,
        help="the target: a model dir, a config.json, or a Hub id the repository ships the "
        "architecture of (recipes/architectures/); default: the train config's",
    )
    version: int | None = cfg_field(None, help="EAGLE version 1 or 3", choices=[1, 3])
    parallel_drafting: bool | None = cfg_field(None, help="P-EAGLE (version 3)")
    draft_vocab_size: int | None = cfg_field(None, help="draft vocabulary", ge=1)
    ttt_steps: int | None = cfg_field(None, help="EAGLE-3 TTT steps", ge=1)
    seq_len: int | None = cfg_field(
        None, help="tokens per sample (default: the train config's max_length, else 2048)", ge=2
    )
    micro_batch: int | None = cfg_field(
        None, help="samples per GPU per micro-batch (default: batch_size, else 1)", ge=1
    )
    hidden_states: str | None = cfg_field(
        None,
        help="online or offline features (default: the train config's)",
        choices=["online", "offline"],
    )
    gpus: int = cfg_field(1, help="GPUs (one process each)", ge=1)
    gpu_memory_gib: float = cfg_field(80.0, help="memory of one GPU, GiB", gt=0)
    strategy: str = cfg_field(
        "ddp",
        help="ddp (whole target per GPU) or fsdp (target and drafter sharded)",
        choices=["ddp", "fsdp"],
    )
    device: str = cfg_field(
        "cuda",
        help="cuda, or cpu (one CPU process: memory is the machine's RAM)",
        choices=["cuda", "cpu"],
    )
    target_dtype: str | None = cfg_field(
        None,
        help="the target's weights: bf16 or fp32 (default: the config's; auto = bf16)",
        choices=["auto", "bf16", "fp32"],
    )
    mixed_precision: str | None = cfg_field(
        None,
        help="bf16 autocast of the drafter or no (default: the config's; auto = bf16)",
        choices=["auto", "bf16", "no"],
    )
    headroom: float = cfg_field(
        0.1, help="share of the device kept free (allocator fragmentation)", ge=0, lt=1
    )
    alternatives: bool = cfg_field(
        True, help="also search what fits (largest micro-batch and sequence, FSDP, GPUs)"
    )
    json: Path | None = cfg_field(None, help="also write the plan as JSON here")


def resolve_target_config(target: str) -> Any:
    """The target's Hugging Face config from a directory, a ``config.json`` or a shipped Hub id.

    Raises:
        UsageError: nothing of the three, naming what was looked for.
    """
    from transformers import AutoConfig

    path = Path(target).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        path = path.parent
    shipped = ARCHITECTURES / target
    for candidate in (path, shipped):
        if (candidate / "config.json").is_file():
            return AutoConfig.from_pretrained(str(candidate), local_files_only=True)
    known = sorted(
        str(p.parent.relative_to(ARCHITECTURES)) for p in ARCHITECTURES.glob("*/*/config.json")
    )
    raise UsageError(
        f"target: {target!r} is neither a model directory, a config.json, nor a Hub id whose "
        f"architecture draftsmith ships ({', '.join(known)}); give a directory holding its "
        "config.json"
    )


def build_spec(cfg: PlanConfig) -> tuple[Any, Any, dict[str, Any]]:
    """``(StepSpec, Launch, the settings used)`` from the plan's config."""
    import torch

    from ..train.config import load_config
    from ..train.plan.memory import Launch
    from ..train.plan.simulate import StepSpec

    fields: dict[str, Any] = {
        "target": None,
        "version": 3,
        "parallel_drafting": False,
        "draft_vocab_size": None,
        "ttt_steps": 7,
        "max_length": 2048,
        "batch_size": 1,
        "hidden_states": "offline",
        "target_dtype": "auto",
        "mixed_precision": "auto",
        "feature_layers": None,
        "fc_norm": False,
        "norm_output": False,
        "loss": "kl",
    }
    if cfg.train_config is not None:
        train = _load_train_config(cfg.train_config, load_config)
        fields.update({k: getattr(train, k) for k in fields})
    flags = {
        "target": cfg.target,
        "version": cfg.version,
        "parallel_drafting": cfg.parallel_drafting,
        "draft_vocab_size": cfg.draft_vocab_size,
        "ttt_steps": cfg.ttt_steps,
        "max_length": cfg.seq_len,
        "batch_size": cfg.micro_batch,
        "hidden_states": cfg.hidden_states,
        "target_dtype": cfg.target_dtype,
        "mixed_precision": cfg.mixed_precision,
    }
    fields.update({k: v for k, v in flags.items() if v is not None})
    if fields["target"] is None:
        raise UsageError("target: give --target or a --train-config that names one")
    target_config = resolve_target_config(str(fields["target"]))
    gpu = cfg.device == "cuda"
    # auto: bf16 on GPUs; on a CPU, bf16 where it is native (what the recipes resolve).
    native = gpu
    if not gpu:
        from ..train.device import native_bf16

        native = native_bf16("cpu")
    target_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        "bf16"
        if fields["target_dtype"] == "auto" and native
        else ("fp32" if fields["target_dtype"] == "auto" else fields["target_dtype"])
    ]
    autocast = fields["mixed_precision"] == "bf16" or (
        fields["mixed_precision"] == "auto" and native
    )
    spec = StepSpec(
        target_config=target_config,
        version=int(fields["version"]),
        parallel=bool(fields["parallel_drafting"]),
        feature_layers=tuple(fields["feature_layers"]) if fields["feature_layers"] else None,
        draft_vocab_size=fields["draft_vocab_size"],
        ttt_steps=int(fields["ttt_steps"]),
        loss=str(fields["loss"]),
        fc_norm=bool(fields["fc_norm"]),
        norm_output=bool(fields["norm_output"]),
        seq_len=int(fields["max_length"]),
        micro_batch=int(fields["batch_size"]),
        online=fields["hidden_states"] == "online",
        target_dtype=target_dtype,
        autocast=autocast,
        foreach=gpu,  # AdamW's default: multi-tensor on CUDA, per-tensor on the CPU
        device=cfg.device,
    )
    gpus = cfg.gpus if gpu else 1
    launch = Launch(
        gpus=gpus,
        gpu_memory_gib=cfg.gpu_memory_gib,
        strategy=cfg.strategy if gpus > 1 else "ddp",
        device=cfg.device,
        headroom=cfg.headroom,
    )
    used = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in fields.items()},
        "target_dtype": str(target_dtype).replace("torch.", ""),
        "mixed_precision": "bf16" if autocast else "no",
    }
    return spec, launch, used


def _load_train_config(path: Path, load_config) -> Any:
    from .eagle import EagleTrainConfig

    if not Path(path).is_file():
        raise UsageError(f"train_config: {path} does not exist")
    # The plan reads the config's shape fields only: its data paths need not exist here.
    return load_config(EagleTrainConfig, path)


def _gib(n: int | float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def report(
    spec: Any, launch: Any, result: Any, alternatives: dict[str, Any] | None, used: dict
) -> str:
    """The plan as the command prints it."""
    c = spec.target_config
    name = getattr(c, "_name_or_path", "") or used.get("target") or "target"
    family = "P-EAGLE" if spec.parallel else f"EAGLE-{spec.version}"
    where = (
        f"{launch.gpus} x {launch.gpu_memory_gib:g} GiB GPU, {launch.strategy.upper()}"
        if launch.device == "cuda"
        else f"one CPU process, {launch.gpu_memory_gib:g} GiB"
    )
    lines = [
        f"{family} drafter for {Path(str(name)).name} ({c.num_hidden_layers} layers, hidden "
        f"{c.hidden_size}, vocabulary {c.vocab_size}) on {where}",
        f"{spec.micro_batch} x {spec.seq_len} tokens per micro-batch, "
        + (f"{spec.ttt_steps} TTT steps, " if spec.version == 3 else "")
        + f"{'online' if spec.online else 'offline'} features, target "
        f"{used['target_dtype']}, drafter autocast {used['mixed_precision']}",
        "",
        f"{'per device':<34}{'':>12}",
    ]
    for key, value in result.parts.items():
        lines.append(f"  {key:<32}{_gib(value):>12}")
    lines.append(f"  {'total':<32}{_gib(result.total):>12}")
    share = result.total / (launch.gpu_memory_gib * 2**30)
    verdict = "fits" if result.fits else "does NOT fit"
    lines.append(
        f"\n{verdict}: {share:.0%} of {launch.gpu_memory_gib:g} GiB "
        f"(plans for {1 - launch.headroom:.0%}; drafter {result.counts['drafter'] / 1e6:,.0f}M "
        f"parameters, target {result.counts['target'] / 1e9:,.1f}B)"
    )
    for note in result.notes:
        lines.append(f"  {note}")
    if alternatives:
        lines.append("")
        mb = alternatives.get("largest_micro_batch")
        lines.append(
            f"largest micro-batch at {spec.seq_len} tokens: " + (str(mb) if mb else "none fits")
        )
        sl = alternatives.get("largest_seq_len_at_micro_batch_1")
        lines.append(
            "longest sequence at micro-batch 1: " + (f"{sl:,} tokens" if sl else "none fits")
        )
        if "offline_features" in alternatives:
            v = alternatives["offline_features"]
            lines.append(
                f"offline features instead: {v['total_gib']} GiB "
                f"({'fits' if v['fits'] else 'does not fit'})"
            )
        if "fsdp_same_gpus" in alternatives:
            v = alternatives["fsdp_same_gpus"]
            lines.append(
                f"FSDP on the same {launch.gpus} GPUs: {v['total_gib']} GiB "
                f"({'fits' if v['fits'] else 'does not fit'})"
            )
        few = alternatives.get("fewest_gpus_with_fsdp")
        if launch.device == "cuda":
            lines.append(
                "fewest GPUs of this size: "
                + (f"{few}" + (" (FSDP)" if few and few > 1 else "") if few else "more than 64")
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point of ``draftsmith plan``: 0 when the job fits, 3 when it does not."""
    return cli_main(_main_plan, argv)


def _main_plan(argv: list[str]) -> int:
    from ..train.config import parse_config
    from ..train.plan.memory import parameter_counts, plan, what_fits
    from ..train.staged import write_json_atomic

    cfg = parse_config(PlanConfig, argv, prog="draftsmith plan", description=__doc__)
    spec, launch, used = build_spec(cfg)
    counts = parameter_counts(spec)
    result = plan(spec, launch, counts=counts)
    alternatives = what_fits(spec, launch, counts) if cfg.alternatives else None
    print(report(spec, launch, result, alternatives, used))
    if cfg.json is not None:
        write_json_atomic(
            Path(cfg.json),
            {
                "settings": used,
                "launch": {
                    "gpus": launch.gpus,
                    "gpu_memory_gib": launch.gpu_memory_gib,
                    "strategy": launch.strategy,
                    "device": launch.device,
                    "headroom": launch.headroom,
                },
                "seq_len": spec.seq_len,
                "micro_batch": spec.micro_batch,
                "plan": result.as_dict(),
                "alternatives": alternatives,
            },
        )
    return 0 if result.fits else 3


if __name__ == "__main__":
    sys.exit(main())
