"""``config.json`` of each EAGLE export format, and the way back to an ``EagleConfig``.

:func:`speculators_config`, :func:`eagle3_config` and :func:`eagle1_config` write the config of
each format described in :mod:`draftsmith.train.export.eagle`; :func:`export_format` and
:func:`config_from_export` read one back (for :func:`~draftsmith.train.export.eagle.load_export`).

**Aux layer ids** (EAGLE-3). Our ``EagleConfig.feature_layers`` are HF ``hidden_states`` indices
(i = the input to decoder layer i). vLLM's ``eagle_aux_hidden_state_layer_ids`` use the same
numbering (``EagleModelMixin._maybe_add_hidden_state`` records id 0 before the first layer and
id i+1 after layer i), and so does speculators (its DFlash converter turns z-lab's "output of
layer i" into ``i + 1``), so the speculators export writes ours unchanged. SGLang adds 1 to the
ids it reads from ``eagle_config.eagle_aux_hidden_state_layer_ids`` ("for the ith layer, it
takes the output of the (i-1)th layer"), i.e. its ids count layer *outputs*; the ``eagle3``
export therefore writes ``aux - 1`` there, and omits the field when the layers are the default
``[2, N//2, N-3]``, which SGLang and vLLM both use without it (vLLM reads that same field
unshifted, so an ``eagle3`` export with custom layers is for SGLang only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ...heads.eagle_config import EagleConfig
from .common import ExportError

__all__ = [
    "CONFIG_FILE",
    "SPECULATORS_VERSION",
    "config_from_export",
    "dtype_name",
    "eagle1_config",
    "eagle3_config",
    "export_format",
    "read_json",
    "speculators_config",
    "verifier_architectures_of",
]

#: The vllm-project/speculators release whose config classes this export follows (v0.7.0:
#: ``Eagle3SpeculatorConfig``, ``SpeculatorsConfig``, ``GreedyTokenProposalConfig``).
SPECULATORS_VERSION = "0.7.0"
CONFIG_FILE = "config.json"
ARCH_SPECULATORS = "Eagle3Speculator"
ARCH_PEAGLE = "PEagleSpeculator"
ARCH_EAGLE3 = "LlamaForCausalLMEagle3"
ARCH_EAGLE1 = "EagleLlamaForCausalLM"


# --------------------------------------------------------------------------------------------
# config.json of each format
# --------------------------------------------------------------------------------------------


def _default_aux(num_layers: int) -> list[int]:
    """The aux layers vLLM and SGLang pick when a checkpoint names none (HF indices)."""
    return [2, num_layers // 2, num_layers - 3]


def read_json(path: Path) -> Any:
    """The content of a JSON file, or None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as config files spell it (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def _llama_fields(cfg: EagleConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A one-decoder-layer Llama config dict with the drafter's shapes.

    RoPE (and the dtype) is written both ways: ``rope_theta``/``rope_scaling`` (transformers v4,
    which SGLang and older vLLM read) and ``rope_parameters`` (transformers v5); v5 accepts both.
    """
    return {
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rope_parameters": cfg.rope_parameters(),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        # transformers v5 reads "dtype", v4 (SGLang, older vLLM) "torch_dtype".
        "dtype": dtype_name(dtype),
        "torch_dtype": dtype_name(dtype),
    }


def verifier_architectures_of(name_or_path: str) -> list[str]:
    """``architectures`` of a local verifier directory, or of a Hub id's config in the Hub
    cache (nothing is downloaded); Llama when neither can be read."""
    config = read_json(Path(os.path.expanduser(name_or_path)) / CONFIG_FILE)
    if not isinstance(config, dict) and "/" in name_or_path:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name_or_path, CONFIG_FILE)
        except Exception:  # not a valid repo id: no cached config
            cached = None
        if isinstance(cached, str):
            config = read_json(Path(cached))
    if isinstance(config, dict) and config.get("architectures"):
        return list(config["architectures"])
    return ["LlamaForCausalLM"]


def speculators_config(
    cfg: EagleConfig,
    dtype: torch.dtype,
    verifier_name_or_path: str,
    verifier_architectures: list[str] | None,
    speculative_tokens: int,
) -> dict[str, Any]:
    """``config.json`` of the speculators format (Eagle3SpeculatorConfig, speculators v0.7), or
    for a P-EAGLE drafter speculators 0.9's ``PEagleSpeculatorConfig`` (the same fields plus
    ``mask_token_id`` and ``embed_requires_grad``)."""
    model_type = "peagle" if cfg.parallel else "eagle3"
    parallel = {}
    if cfg.parallel:
        # The embedding is the target's, frozen and not exported: vLLM shares the target's.
        parallel = {"mask_token_id": cfg.mask_token_id, "embed_requires_grad": False}
    return {
        "architectures": [ARCH_PEAGLE if cfg.parallel else ARCH_SPECULATORS],
        "speculators_model_type": model_type,
        **parallel,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _llama_fields(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        # HF hidden_states indices == vLLM/speculators ids (module docstring).
        "eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers),
        "norm_before_residual": cfg.norm_before_residual,
        # A variant our drafter does not implement, written so no reader guesses.
        "norm_before_fc": False,
        # EAGLE-3.1 (vLLM 0.32 reads both for eagle3; its peagle reader neither, which
        # EagleConfig refuses).
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier_name_or_path,
                "architectures": verifier_architectures
                or verifier_architectures_of(verifier_name_or_path),
            },
        },
        "dtype": dtype_name(dtype),
        "torch_dtype": dtype_name(dtype),
    }


def eagle3_config(cfg: EagleConfig, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of the SGLang / original EAGLE-3 layout."""
    if cfg.norm_before_residual:
        # SGLang's LlamaDecoderLayer (llama_eagle3.py) always keeps the un-normed feature as the
        # residual; it has no switch, so a drafter trained the other way would run wrongly.
        raise ExportError(
            "the eagle3 (SGLang) format has no norm_before_residual=True variant; export this "
            "drafter with format 'speculators' (vLLM) instead"
        )
    if cfg.fc_norm or cfg.norm_output:
        # Not checked against SGLang's loader here: refuse rather than write a config that a
        # server may read without the variant.
        raise ExportError(
            "the eagle3 (SGLang) format is not written for EAGLE-3.1 drafters (fc_norm, "
            "norm_output); export with format 'speculators' (vLLM) instead"
        )
    out = {
        "architectures": [ARCH_EAGLE3],
        **_llama_fields(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
    }
    if list(cfg.feature_layers) != _default_aux(cfg.target_num_layers):
        # SGLang reads these as "output of layer i" and adds 1 (module docstring).
        out["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.feature_layers],
            "use_aux_hidden_state": True,
        }
    return out


def eagle1_config(cfg: EagleConfig, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of vLLM's EAGLE-1 layout (``EagleLlamaForCausalLM``)."""
    return {"architectures": [ARCH_EAGLE1], **_llama_fields(cfg, dtype)}


# --------------------------------------------------------------------------------------------
# Reading a config.json back
# --------------------------------------------------------------------------------------------


def export_format(config: dict[str, Any]) -> str:
    """Which of :data:`~draftsmith.train.export.eagle.FORMATS` a ``config.json`` dict is."""
    arch = config.get("architectures") or []
    if config.get("speculators_model_type") is not None:
        kind = config["speculators_model_type"]
        if kind not in ("eagle3", "peagle"):
            raise ExportError(
                f"speculators_model_type {kind!r}: only eagle3 and peagle are supported"
            )
        return "speculators" if kind == "eagle3" else "peagle"
    if ARCH_EAGLE3 in arch:
        return "eagle3"
    if ARCH_EAGLE1 in arch or config.get("model_type") == "eagle":
        return "eagle"
    raise ExportError(f"not an EAGLE export: architectures {arch}")


def _rope_from_export(layer: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    if "rope_theta" in layer:
        return float(layer["rope_theta"]), layer.get("rope_scaling")
    params = dict(layer.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", 10000.0))
    return theta, (params if params.get("rope_type", "default") != "default" else None)


def config_from_export(fmt: str, raw: dict[str, Any], target_config: Any) -> EagleConfig:
    """Rebuild our :class:`EagleConfig` from an export's ``config.json`` (inverse mapping)."""
    speculators = fmt in ("speculators", "peagle")
    layer = raw["transformer_layer_config"] if speculators else raw
    n = int(target_config.num_hidden_layers)
    unsupported = {
        "num_hidden_layers": (layer.get("num_hidden_layers", 1), 1),
        "attention_bias": (layer.get("attention_bias", False), False),
        "mlp_bias": (layer.get("mlp_bias", False), False),
        "norm_before_fc": (raw.get("norm_before_fc", False), False),
        "target_hidden_size": (
            raw.get("target_hidden_size", layer["hidden_size"]),
            layer["hidden_size"],
        ),
    }
    bad = [f"{k} = {got!r}" for k, (got, ok) in unsupported.items() if got != ok]
    if bad:
        raise ExportError(f"export uses variants our EagleDrafter does not implement: {bad}")
    version = 1 if fmt == "eagle" else 3
    aux: list[int] = [n]  # EAGLE-1 reads the final output
    norm_before_residual = False
    if speculators:
        if "norm_before_residual" not in raw:
            # vLLM defaults a missing one to True, speculators to False: refuse to guess.
            raise ExportError("speculators config lacks norm_before_residual")
        norm_before_residual = bool(raw["norm_before_residual"])
        aux = list(raw.get("eagle_aux_hidden_state_layer_ids") or _default_aux(n))
    elif fmt == "eagle3":
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = [i + 1 for i in ids] if ids else _default_aux(n)
        if raw.get("norm_before_residual"):
            raise ExportError("eagle3 (SGLang) exports cannot use norm_before_residual=True")
    eagle31 = {k: bool(raw.get(k, False)) for k in ("fc_norm", "norm_output")}
    if any(eagle31.values()) and fmt != "speculators":
        raise ExportError(f"{fmt} exports do not carry EAGLE-3.1's variants, got {eagle31}")
    theta, scaling = _rope_from_export(layer)
    vocab = int(layer["vocab_size"])
    return EagleConfig(
        version=version,
        hidden_size=int(layer["hidden_size"]),
        intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=int(layer["num_attention_heads"]),
        num_key_value_heads=int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        head_dim=int(layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]),
        rms_norm_eps=float(layer["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(layer["max_position_embeddings"]),
        hidden_act=str(layer.get("hidden_act", "silu")),
        vocab_size=vocab,
        draft_vocab_size=int(raw.get("draft_vocab_size") or vocab) if version == 3 else vocab,
        target_num_layers=n,
        feature_layers=aux,
        norm_before_residual=norm_before_residual,
        mask_token_id=raw.get("mask_token_id") if fmt == "peagle" else None,
        **eagle31,
    )
