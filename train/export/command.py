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
  vLLM draft models); ``--tokenizer DIR`` when the draft was saved without its tokenizer.

Every export is written to a temporary directory beside ``--out`` and renamed into place, so a
failed export never leaves a half-written model (temp dirs of killed exports are removed by the
next export to the same place); the result is readable by other users (0755/0644); each carries
a README model card. Tensors holding NaN or inf are refused (exit 1, the tensors named); the
free space is checked against the export's size first.

Errors: exit 2 for a bad checkpoint, format or flag (:class:`ExportError`), exit 1 when the export
cannot be written (non-finite weights, disk full). The errors and the helpers every format
shares are in :mod:`draftsmith.train.export.common`, which the format modules import; this
module only dispatches to them.

Self-checks: the ``hf`` export reloads the written model and compares its logits with the
source's, bit for bit, on ``--device`` (``auto``: the first GPU when there is one, else the CPU).
The EAGLE and Medusa exports run no model: they re-read the written tensors and compare them
with the source's, byte for byte, on the host; ``--device`` is still checked there (a GPU that is
not there fails as it does everywhere).

The target an export names (the speculators ``verifier.name_or_path``, the Medusa
``base_model_name_or_path``, every model card) is ``--target`` when given, else the target the
training run recorded (its ``training_metrics.json`` config, the Medusa heads' or the draft's
metadata), else the default; it is written as
:func:`~draftsmith.train.target_model.load.describe_target` names it: a Hub id as given (also when the
run loaded it from its Hub cache snapshot), not this machine's cache path, so ``vllm serve`` on
another machine finds it; the default SmolLM2 (a dequantized GGUF) as its local directory with a
``target_note`` and ``original_model`` in ``draftsmith_export.json`` and the model card.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ...heads import families
from ..config import cfg_field, parse_config
from ..device import DEVICE_HELP, device_problem, resolve_device
from ..errors import cli_main
from .common import ExportError, ExportRequest, MissingCheckpointError, NonFiniteError

__all__ = [
    "FORMATS",
    "ExportConfig",
    "ExportError",
    "MissingCheckpointError",
    "NonFiniteError",
    "export",
    "export_target",
    "main",
    "recorded_target",
]

#: Every format of the family declaration (heads/families.py), in its order.
FORMATS = tuple(families.export_formats())


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
        help="the target (verifier) recorded in the export: a Hub id (kept as given), a local "
        "dir or .gguf; default: the target the training run recorded, else the local "
        "SmolLM2-135M-Instruct the recipes train on",
    )
    tokenizer: str | None = cfg_field(
        None,
        help="hf: where the export takes the tokenizer from (default: the checkpoint); the "
        "target's directory when the draft was saved without one",
    )
    speculative_tokens: int | None = cfg_field(
        None,
        help="draft tokens per step the export advertises (EAGLE, P-EAGLE: default 3; DFlash: "
        "always its block size - 1)",
    )
    dtype: str | None = cfg_field(
        None,
        help="cast weights: bf16, fp16 or fp32 (default: as trained)",
        choices=["bf16", "fp16", "fp32"],
    )
    metrics_json: Path | None = cfg_field(
        None, help="EAGLE: an evaluation results JSON whose τ goes into the model card"
    )
    overwrite: bool = cfg_field(False, help="replace an existing export directory")
    device: str = cfg_field(
        "auto", help=DEVICE_HELP + "; where the hf export's reload check runs its logits"
    )

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        problem = device_problem(self.device)
        if problem:
            problems.append(("device", problem))
        if not Path(self.checkpoint).is_dir():
            problems.append(("checkpoint", f"{self.checkpoint} is not a directory"))
        if self.speculative_tokens is not None and self.speculative_tokens < 1:
            problems.append(("speculative_tokens", f"must be >= 1, got {self.speculative_tokens}"))
        if self.metrics_json is not None and not Path(self.metrics_json).is_file():
            problems.append(("metrics_json", f"{self.metrics_json} is not a file"))
        if self.tokenizer is not None and self.format != "hf":
            problems.append(("tokenizer", f"only the hf export takes one, not {self.format}"))
        return problems


def export(cfg: ExportConfig) -> Path:
    """Run one export; returns the export directory."""
    import torch

    device = resolve_device(cfg.device)  # a GPU that is not there fails now, for every format
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        cfg.dtype or ""
    )
    target = export_target(cfg.target, Path(cfg.checkpoint))
    _refuse_existing(cfg)
    _, fmt = families.export_formats()[cfg.format]
    writer = families.resolve(fmt.writer)  # the format's entry names its writer
    return writer(
        ExportRequest(
            format=cfg.format,
            checkpoint=Path(cfg.checkpoint),
            out=Path(cfg.out),
            target=target,
            speculative_tokens=cfg.speculative_tokens,
            dtype=dtype,
            metrics_json=cfg.metrics_json,
            overwrite=cfg.overwrite,
            tokenizer=cfg.tokenizer,
            device=device,
        )
    )


def _refuse_existing(cfg: ExportConfig) -> None:
    from ..staged import OutputExistsError

    if Path(cfg.out).exists() and not cfg.overwrite:
        raise OutputExistsError(f"out: {cfg.out} exists; pass --overwrite to replace it")


def export_target(given: str | None, checkpoint: Path) -> str:
    """The target name an export records (see the module docstring).

    Args:
        given: ``--target``, or None.
        checkpoint: the checkpoint being exported; its run's metadata is read when ``given`` is
            None.

    Returns:
        :func:`~draftsmith.train.target_model.load.describe_target`'s name of the given target, else
        of the recorded one, else of the default target. Nothing is downloaded or converted.
    """
    from ..target_model.load import describe_target

    if given is not None:
        return describe_target(given)["target"]
    recorded, cache_dir = recorded_target(checkpoint)
    return describe_target(recorded, cache_dir=cache_dir)["target"]


def recorded_target(checkpoint: Path) -> tuple[str | None, str | None]:
    """The target (as the user gave it) and cache root the training run of ``checkpoint`` used.

    Looks for the recipe's ``training_metrics.json`` beside the checkpoint or in its parent (the
    run's ``output_dir``), then for the Medusa heads' ``target_name_or_path`` and the draft's
    ``draftsmith_draft.json``. ``(None, None)`` means the default target (also when nothing
    was recorded).
    """
    import json

    def read(path: Path) -> dict:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    for place in (checkpoint, checkpoint.parent):
        config = read(place / "training_metrics.json").get("config")
        if isinstance(config, dict):
            return config.get("target"), config.get("cache_dir")
    for place in (checkpoint, checkpoint / "heads", checkpoint / "draft"):
        recorded = read(place / "config.json").get("target_name_or_path")
        recorded = recorded or read(place / "draftsmith_draft.json").get("target")
        if recorded:
            return str(recorded), None
    return None, None


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: exit 0 on success, 2 on a bad config or checkpoint, 1 when the export
    cannot be written (non-finite weights, disk full); ``--debug`` shows tracebacks."""
    return cli_main(_main, argv)


def _main(argv: list[str]) -> int:
    cfg = parse_config(ExportConfig, argv, prog="draftsmith export", description=__doc__)
    out = export(cfg)
    print(f"exported {cfg.checkpoint} as {cfg.format} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
