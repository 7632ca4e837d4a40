"""The README model card of an EAGLE export, and the provenance it reports.

:func:`provenance` gathers what is known about a drafter from the files beside it (the training
run's facts, a measured τ); :func:`model_card` turns that into the export's ``README.md``, with
the serving command for its format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...heads import families
from ...heads.eagle_config import EagleConfig
from .common import ExportError, target_card_lines
from .eagle_config import CONFIG_FILE, read_json

__all__ = ["INFO_FILE", "model_card", "provenance"]

#: Provenance written beside the weights (source drafter config, training and eval metrics).
INFO_FILE = "draftsmith_export.json"


# --------------------------------------------------------------------------------------------
# Provenance
# --------------------------------------------------------------------------------------------


def _eval_result(obj: Any) -> dict[str, Any] | None:
    """The EAGLE entry of an evaluation results file (``draftsmith evaluate`` / vllm_check)."""
    if not isinstance(obj, dict):
        return None
    if "acceptance_length" in obj:
        return obj
    methods = obj.get("methods")
    if isinstance(methods, list):
        rows = [m for m in methods if isinstance(m, dict) and "acceptance_length" in m]
        eagle = [m for m in rows if "eagle" in str(m.get("method", "")).lower()]
        return (eagle or rows or [None])[0]
    return None


def provenance(src: Path, metrics_json: str | Path | None) -> dict[str, Any]:
    """What the model card reports: training run facts and measured τ, where files exist.

    Looks in the drafter directory and its parent (the recipe's ``output_dir``) for the
    recipe's ``training_metrics.json`` and for any evaluation results JSON (a file holding
    ``acceptance_length``), unless ``metrics_json`` names the evaluation file.
    """
    info: dict[str, Any] = {"source": str(src)}
    places = [src, src.parent]
    for place in places:
        training = read_json(place / "training_metrics.json")
        if isinstance(training, dict):
            config = training.get("config") or {}
            info["training"] = {
                "target": config.get("target"),
                "data": training.get("data"),
                "steps": training.get("steps"),
                "train_seconds": training.get("train_seconds"),
                "train_samples": training.get("train_samples"),
                "final_validation": training.get("final_validation"),
            }
            break
    candidates = [Path(metrics_json)] if metrics_json else []
    if not metrics_json:
        skip = {CONFIG_FILE, INFO_FILE, "training_metrics.json", "trainer_state.json"}
        for place in places:
            # Results files are small; a size cap keeps a stray big JSON from being parsed.
            candidates += [
                p
                for p in sorted(place.glob("*.json"))
                if p.name not in skip and p.stat().st_size < 50 * 2**20
            ]
    for path in candidates:
        result = _eval_result(read_json(path))
        if result is not None:
            keep = (
                "method",
                "k",
                "temperature",
                "num_prompts",
                "acceptance_length",
                "acceptance_length_per_draft",
                "acceptance_rate_per_position",
                "speedup",
                "tokens_per_second",
                "baseline_tokens_per_second",
                "identical_to_target",
            )
            info["evaluation"] = {k: result.get(k) for k in keep if k in result}
            info["evaluation"]["file"] = str(path)
            data = read_json(path)
            methods = data.get("methods") if isinstance(data, dict) else None
            if isinstance(methods, list):  # every shape of the run, for the serving section
                info["evaluation"]["shapes"] = [
                    {
                        "method": m.get("method"),
                        "k": m.get("k"),
                        "acceptance_length": m.get("acceptance_length"),
                        "speedup_vs_fastest_plain": m.get("speedup_vs_fastest_plain"),
                    }
                    for m in methods
                    if isinstance(m, dict) and "acceptance_length" in m
                ]
            break
    if metrics_json and "evaluation" not in info:
        raise ExportError(f"{metrics_json}: no acceptance_length found (not an evaluation JSON)")
    return info


# --------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return "-" if value is None else str(value)


def _usage(fmt: str, target: str, k: int) -> list[str]:
    """How the format's engine serves it, with the engine's method name from the declaration."""
    export = families.export_formats()[fmt][1]
    method = export.method
    extra = "".join(f', "{key}": {json.dumps(value)}' for key, value in export.speculative_config)
    if fmt == "speculators":  # its config.json names the verifier: `vllm serve DIR` suffices
        return [
            "```bash",
            "# the verifier (target) is read from config.json",
            "vllm serve <this directory>",
            "```",
            "```python",
            "from vllm import LLM",
            f'llm = LLM(model="{target}", speculative_config={{"method": "{method}", '
            f'"model": "<this directory>", "num_speculative_tokens": {k}}})',
            "```",
        ]
    if export.engine == "sglang":
        return [
            "```bash",
            f"python -m sglang.launch_server --model-path {target} \\",
            f"    --speculative-algorithm {method} \\",
            "    --speculative-draft-model-path <this directory> \\",
            f"    --speculative-num-steps {k} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {k + 1}",
            "```",
        ]
    return [
        "```python",
        "from vllm import LLM",
        f'llm = LLM(model="{target}", speculative_config={{"method": "{method}", '
        f'"model": "<this directory>", "num_speculative_tokens": {k}{extra}}})',
        "```",
    ]


def model_card(fmt: str, cfg: EagleConfig, info: dict[str, Any], target: str, k: int) -> str:
    """README.md: what the drafter is for, how it was trained, τ if measured, how to serve.

    ``info`` is :func:`provenance` plus the target's ``target_note`` / ``original_model``
    (:func:`~draftsmith.train.export.common.target_facts`) when it has them.
    """
    training = info.get("training") or {}
    evaluation = info.get("evaluation")
    if evaluation:
        tau = (
            f"{_fmt(evaluation.get('acceptance_length'))} (k = {_fmt(evaluation.get('k'))}, "
            f"{_fmt(evaluation.get('num_prompts'))} prompts, temperature "
            f"{_fmt(evaluation.get('temperature'))}; from `{Path(evaluation['file']).name}`)"
        )
    else:
        tau = "not measured"
    aux = "-"
    if cfg.version == 3:
        aux = (
            f"{list(cfg.feature_layers)} as HF hidden_states indices (input to layer i) = vLLM "
            f"`eagle_aux_hidden_state_layer_ids`; outputs of layers "
            f"{[i - 1 for i in cfg.feature_layers]} (SGLang/SpecForge numbering)"
        )
    rows = [
        ("target", f"`{target}`"),
        *(
            [("original model", f"`{info['original_model']}`")]
            if info.get("original_model")
            else []
        ),
        ("training data", _fmt(training.get("data"))),
        ("training steps", _fmt(training.get("steps"))),
        ("EAGLE version", str(cfg.version)),
        ("draft vocabulary", f"{cfg.draft_vocab_size} of {cfg.vocab_size} tokens"),
        ("fused target layers", aux),
        ("norm_before_residual", str(cfg.norm_before_residual) if cfg.version == 3 else "-"),
        *(
            [("EAGLE-3.1", f"fc_norm {cfg.fc_norm}, norm_output {cfg.norm_output}")]
            if cfg.fc_norm or cfg.norm_output
            else []
        ),
        ("τ (tokens per target forward)", tau),
    ]
    if evaluation:
        rows += [
            ("acceptance per position α_i", _fmt(evaluation.get("acceptance_rate_per_position"))),
            ("speedup over plain decoding", _fmt(evaluation.get("speedup"))),
        ]
    lines = [
        "---",
        "tags: [speculative-decoding, eagle, draftsmith]",
        "---",
        "",
        f"# {families.export_formats()[fmt][1].title}",
        "",
        f"A draft head trained by draftsmith for **{target}**. The target verifies every "
        "proposed token, so outputs are the target's own (greedy) or follow its distribution "
        "(sampling). It reads the target's hidden states and shares the target's token "
        "embedding" + (" and output head" if cfg.version == 1 else "") + ", so it only works "
        "with that target.",
        *target_card_lines(info),
        "",
        "| | |",
        "|---|---|",
        *[f"| {a} | {b} |" for a, b in rows],
        "",
        "τ as defined in draftsmith's docs/metrics.md: tokens emitted per target forward, prefill "
        "and bonus token included (plain decoding = 1).",
        "",
        "## Usage",
        "",
        *_usage(fmt, target, k),
        "",
        *_serving_lines(evaluation or {}, k),
    ]
    return "\n".join(lines)


def _serving_lines(evaluation: dict[str, Any], k: int) -> list[str]:
    """What an engine serves of the measured shapes: the chain is this export; draftsmith's
    per-step decision (auto) and its trees run in draftsmith's loop only."""
    shapes = evaluation.get("shapes") or []
    if not any(str(s.get("method", "")).startswith("auto[") for s in shapes):
        return []
    rows = [
        f"| `{s['method'].split('[')[0]}` | {_fmt(s.get('k'))} | "
        f"{_fmt(s.get('acceptance_length'))} | {_fmt(s.get('speedup_vs_fastest_plain'))} |"
        for s in shapes
    ]
    return [
        "## What an engine serves of the measurements",
        "",
        f"Measured in draftsmith's loop (`{Path(evaluation['file']).name}`; speedup over the "
        "fastest plain decoding timed in the same run):",
        "",
        "| shape | k | τ | × fastest plain |",
        "|---|---|---|---|",
        *rows,
        "",
        f"- **The chain** (k = {k}) is what this export serves, as the usage above says.",
        "- **The lookup alone** is vLLM's own `ngram` method (`--speculative-config "
        '\'{"method": "ngram", "num_speculative_tokens": ' + str(k) + ", "
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'`), without this drafter.',
        "- **auto** (draftsmith's per-step decision: verify per step only what its calibrated "
        "confidences and this machine's verify costs say pays, over the drafter's tree and "
        "n-gram/suffix lookup) is **draftsmith's loop's figure**: no engine serves it; vLLM "
        "verifies a fixed k every step and cannot merge lookup and drafter candidates in one "
        "step or skip a step on low confidence.",
        "",
    ]
