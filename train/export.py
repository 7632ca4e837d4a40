"""``draftsmith export``: write a trained drafter in the layout a serving engine loads.

Usage::

    draftsmith export --format speculators --checkpoint runs/eagle3_smollm2/drafter --out out/e3
    draftsmith export --format eagle3      --checkpoint runs/eagle3_smollm2/drafter --out out/sgl
    draftsmith export --format eagle       --checkpoint runs/eagle1_smollm2/drafter --out out/e1
    draftsmith export --format medusa-vllm --checkpoint runs/medusa1_smollm2/heads  --out out/m
    draftsmith export --format medusa      --checkpoint runs/medusa1_smollm2/heads  --out out/mo
    draftsmith export --format hf          --checkpoint runs/distill_smollm2/draft  --out out/d

Formats (each a plain weight-name mapping; see the modules for the exact keys):

* ``speculators`` -- EAGLE-3 in vllm-project/speculators' format, what vLLM loads
  (``speculative_config={"model": out, "method": "eagle3"}``).
* ``eagle3`` -- EAGLE-3 in SGLang's / the original EAGLE-3 layout (``midlayer.*``).
* ``eagle`` -- EAGLE-1 in vLLM's ``eagle`` layout.
* ``medusa-vllm`` -- Medusa heads in vLLM's layout (``blocks.*``, ``lm_heads.*``).
* ``medusa`` -- Medusa heads in FasterDecoding/Medusa's layout (``medusa_lm_head.safetensors``).
* ``hf`` -- a distilled draft LM as a ``save_pretrained`` directory (HF assisted generation,
  vLLM draft models).

Every export is written to a temporary directory beside ``--out`` and renamed into place, so a
failed export never leaves a half-written model; each carries a README model card.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from draftsmith.train.config import ConfigError, cfg_field, parse_config

FORMATS = ("speculators", "eagle3", "eagle", "medusa-vllm", "medusa", "hf")


@dataclass
class ExportConfig:
    """Settings of ``draftsmith export``."""

    format: str = cfg_field(help="output layout", choices=list(FORMATS))
    checkpoint: Path = cfg_field(
        help="what the recipe saved: an EAGLE `drafter/` dir, a Medusa `heads/` dir, or a "
        "distilled `draft/` dir"
    )
    out: Path = cfg_field(help="export directory (replaced atomically; see --overwrite)")
    target: str | None = cfg_field(
        None,
        help="the target (verifier) name or path recorded in the export; default: the local "
        "SmolLM2-135M-Instruct the recipes train on",
    )
    speculative_tokens: int = cfg_field(3, help="EAGLE: draft tokens per step to advertise")
    dtype: str | None = cfg_field(
        None, help="cast weights: bf16, fp16 or fp32 (default: as trained)",
        choices=["bf16", "fp16", "fp32"],
    )  # fmt: skip
    metrics_json: Path | None = cfg_field(
        None, help="EAGLE: an evaluation results JSON whose τ goes into the model card"
    )
    overwrite: bool = cfg_field(False, help="replace an existing export directory")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if not Path(self.checkpoint).is_dir():
            problems.append(("checkpoint", f"{self.checkpoint} is not a directory"))
        if self.speculative_tokens < 1:
            problems.append(("speculative_tokens", f"must be >= 1, got {self.speculative_tokens}"))
        if self.metrics_json is not None and not Path(self.metrics_json).is_file():
            problems.append(("metrics_json", f"{self.metrics_json} is not a file"))
        return problems


def export(cfg: ExportConfig) -> Path:
    """Run one export; returns the export directory."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        cfg.dtype or ""
    )
    target = cfg.target or _default_target()
    if cfg.format in ("speculators", "eagle3", "eagle"):
        from draftsmith.train import export_eagle

        common = dict(
            speculative_tokens=cfg.speculative_tokens,
            dtype=dtype,
            metrics_json=cfg.metrics_json,
            overwrite=cfg.overwrite,
        )
        if cfg.format == "speculators":
            return export_eagle.export_speculators(
                cfg.checkpoint, cfg.out, verifier_name_or_path=target, **common
            )
        if cfg.format == "eagle3":
            return export_eagle.export_eagle3(
                cfg.checkpoint, cfg.out, target_name_or_path=target, **common
            )
        return export_eagle.export_eagle(
            cfg.checkpoint, cfg.out, target_name_or_path=target, **common
        )
    _refuse_existing(cfg)
    if cfg.format == "medusa-vllm":
        from draftsmith.train.export_medusa import export_medusa_vllm

        return export_medusa_vllm(cfg.checkpoint, cfg.out, target_name_or_path=target, dtype=dtype)
    if cfg.format == "medusa":
        from draftsmith.train.export_medusa import export_medusa_original

        return export_medusa_original(
            cfg.checkpoint, cfg.out, base_model_name_or_path=target, dtype=dtype
        )
    from draftsmith.train.export_hf import export_hf

    if dtype is not None:
        raise ValueError("dtype: the hf export keeps the draft's own dtype")
    return export_hf(cfg.checkpoint, cfg.out, overwrite=cfg.overwrite)


def _refuse_existing(cfg: ExportConfig) -> None:
    if Path(cfg.out).exists() and not cfg.overwrite:
        raise FileExistsError(f"out: {cfg.out} exists; pass --overwrite to replace it")


def _default_target() -> str:
    from draftsmith.train.target import prepare_target

    return str(prepare_target(quiet=True))


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; exit 0 on success, 2 on a bad config or input."""
    try:
        cfg = parse_config(ExportConfig, argv, prog="draftsmith export", description=__doc__)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        out = export(cfg)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {cfg.checkpoint} as {cfg.format} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
