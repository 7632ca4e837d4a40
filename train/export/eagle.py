"""Export EAGLE drafters for serving (``draftsmith export --format speculators|eagle3|eagle``).

Each format is a plain weight-name mapping of a drafter saved by
:func:`draftsmith.heads.eagle.save_drafter` (tensors are only renamed, and cast when a dtype is
asked for) plus the ``config.json`` its server reads. Every field below was checked against
the loaders' source (vLLM 0.32.0, speculators v0.7.0, SGLang's ``llama_eagle3.py``) and, for
vLLM, by loading each format (``tests/test_vllm.py``, ``docs/serving.md``):

===============  ===========================================================================
``speculators``  EAGLE-3 for vLLM (vllm-project/speculators' format). ``config.json``:
                 ``speculators_model_type: "eagle3"``, ``architectures: ["Eagle3Speculator"]``,
                 ``transformer_layer_config`` (a one-layer Llama config, ``vocab_size`` = the
                 *target* vocab), ``draft_vocab_size``, ``target_hidden_size``,
                 ``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual`` (always written:
                 vLLM defaults a missing one to True, speculators to False),
                 ``speculators_config`` {algorithm, proposal_methods [greedy,
                 speculative_tokens], default_proposal_method, verifier {name_or_path,
                 architectures}}, ``speculators_version``. Weights: ``fc.weight``,
                 ``layers.0.*``, ``norm.weight``, ``lm_head.weight`` ``[V_draft, H]``, ``d2t``
                 (int64 ``[V_draft]``, target id = i + d2t[i]) and ``t2d`` (bool ``[V]``).
                 Serve: ``vllm serve <export>`` (the verifier is read from the config) or
                 ``speculative_config={"method": "eagle3", "model": <export>}``.
``eagle3``       EAGLE-3 for SGLang and the original EAGLE-3 code: the same tensors with
                 ``midlayer.*`` for ``layers.0.*``; a flat Llama ``config.json`` with
                 ``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``,
                 ``target_hidden_size``, ``num_hidden_layers: 1``,
                 ``tie_word_embeddings: false`` (SGLang ties ``lm_head`` to the embedding when
                 true). Serve: ``--speculative-algorithm EAGLE3 --speculative-draft-model-path``.
``peagle``       P-EAGLE for vLLM: the ``speculators`` layout with
                 ``speculators_model_type: "peagle"``, ``architectures: ["PEagleSpeculator"]``,
                 ``mask_token_id`` and ``embed_requires_grad: false`` (speculators 0.9's
                 ``PEagleSpeculatorConfig``; vLLM maps it to ``eagle3`` with
                 ``parallel_drafting``), plus the ``mask_hidden`` tensor ``[1, 1, 3H]``, which
                 vLLM requires for parallel drafting. Serve:
                 ``speculative_config={"method": "eagle3", "model": <export>,
                 "parallel_drafting": true, "num_speculative_tokens": k}``.
``eagle``        EAGLE-1 for vLLM (``method: "eagle"``): a flat Llama config with
                 ``architectures: ["EagleLlamaForCausalLM"]``, ``num_hidden_layers: 1``;
                 weights ``fc.weight`` (``[H, 2H]`` over concat(embedding, feature), no bias:
                 vLLM builds ``fc`` with ``bias=False``) and ``layers.0.*`` without
                 ``input_layernorm`` (vLLM swaps it for Identity).
===============  ===========================================================================

No format carries ``embed_tokens`` (or, for EAGLE-1, ``lm_head``): vLLM and SGLang give the
drafter the target's embedding (and head) when the checkpoint has none, which is exactly what
our drafter uses. When the draft vocabulary is the full vocabulary, ``d2t``/``t2d`` are left
out: vLLM creates its ``draft_id_to_target_id`` parameter only when the sizes differ and would
reject an unexpected one.

An EAGLE-1 drafter with a draft vocabulary (``draft_vocab_size < vocab_size``) drafts with those
rows of the target's head only. vLLM's EAGLE-1 loader has no draft-vocabulary maps, so the
``eagle`` export is its *full-vocabulary equivalent*: the same tensors without ``d2t``/``t2d``,
drafting over the target's whole head. Its greedy output is the target's either way; its τ can
only be at least ours (a full-vocabulary draft is never outside the vocabulary), at the cost of
the full head per draft token.

How EAGLE-3's aux layer ids are numbered for each server: see
:mod:`draftsmith.train.export.eagle_config`.

Writes are atomic: everything goes into a temporary directory beside ``out`` that is checked
(every exported tensor re-read and compared with the source) and renamed into place, so a crash
never leaves a half export under the final name (:func:`~draftsmith.train.staged.staged_dir`:
free space checked first, readable by other users, dead writers' temp dirs removed). Tensors
with NaN or inf are refused. :func:`load_export` maps an export back to an
:class:`~draftsmith.heads.eagle_model.EagleDrafter` for round-trip tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ...heads import families
from ...heads.eagle_config import EagleConfig
from ...heads.eagle_model import EagleDrafter
from ..errors import RunError
from ..runinfo import json_text
from ..staged import staged_dir
from .common import (
    ExportError,
    ExportRequest,
    MissingCheckpointError,
    check_finite,
    check_tensor_shapes,
    target_facts,
    tensor_bytes,
)
from .eagle_card import INFO_FILE, model_card, provenance
from .eagle_config import (
    CONFIG_FILE,
    config_from_export,
    dtype_name,
    eagle1_config,
    eagle3_config,
    export_format,
    speculators_config,
    verifier_architectures_of,
)

__all__ = [
    "FORMATS",
    "export_drafter",
    "export_eagle",
    "export_eagle3",
    "export_speculators",
    "load_export",
    "write",
]

#: The formats this module writes (:func:`write`), as the family declaration lists them.
FORMATS = tuple(
    name
    for name, (_, fmt) in families.export_formats().items()
    if fmt.writer == "train.export.eagle:write"
)
WEIGHTS_FILE = "model.safetensors"


# --------------------------------------------------------------------------------------------
# The drafter's tensors and the name mappings
# --------------------------------------------------------------------------------------------


def _expected_shapes(cfg: EagleConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a saved drafter (our layout) and its shape."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    attn_in = 2 * h if cfg.version == 3 else h  # EAGLE-3 attends over concat(embed, feature)
    shapes = {
        "fc.weight": (h, 3 * h if cfg.version == 3 else 2 * h),
        "layers.0.self_attn.q_proj.weight": (q, attn_in),
        "layers.0.self_attn.k_proj.weight": (kv, attn_in),
        "layers.0.self_attn.v_proj.weight": (kv, attn_in),
        "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.mlp.gate_proj.weight": (i, h),
        "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i),
        "layers.0.post_attention_layernorm.weight": (h,),
    }
    if cfg.parallel:
        shapes["mask_hidden"] = (1, 3 * h)
    if cfg.fc_norm:
        shapes |= {f"fc_norm.{i}.weight": (h,) for i in range(3)}
    if cfg.version == 3:
        shapes |= {
            "layers.0.input_layernorm.weight": (h,),
            "layers.0.hidden_norm.weight": (h,),
            "norm.weight": (h,),
            "lm_head.weight": (cfg.draft_vocab_size, h),
        }
    if cfg.version == 3 or cfg.reduced_vocab:
        shapes |= {"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)}
    return shapes


def _to_export(name: str, fmt: str) -> str:
    """Our tensor name -> the name in ``fmt`` (only SGLang's layout renames anything)."""
    if fmt == "eagle3" and name.startswith("layers.0."):
        return "midlayer." + name.removeprefix("layers.0.")
    return name


def _from_export(name: str, fmt: str) -> str:
    """Inverse of :func:`_to_export`."""
    if fmt == "eagle3" and name.startswith("midlayer."):
        return "layers.0." + name.removeprefix("midlayer.")
    return name


def _full_vocab(cfg: EagleConfig) -> bool:
    """Whether the export holds the full vocabulary (no maps written). Always for EAGLE-1: its
    head is the target's, so its full-vocabulary equivalent is the drafter as it is (module
    docstring)."""
    return cfg.version == 1 or cfg.draft_vocab_size == cfg.vocab_size


# --------------------------------------------------------------------------------------------
# Reading the source drafter
# --------------------------------------------------------------------------------------------


def _source_dir(src_dir: str | Path) -> Path:
    """The drafter directory: ``src_dir`` itself or the recipe output's ``drafter/``."""
    src = Path(src_dir)
    if not (src / CONFIG_FILE).is_file() and (src / "drafter" / CONFIG_FILE).is_file():
        src = src / "drafter"
    if not (src / CONFIG_FILE).is_file() or not (src / WEIGHTS_FILE).is_file():
        raise MissingCheckpointError(
            f"{src_dir}: no saved EAGLE drafter here (need {CONFIG_FILE} and {WEIGHTS_FILE}, "
            "as written by draftsmith.heads.eagle.save_drafter)"
        )
    return src


def _read_drafter(src: Path) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    """Config and tensors of a saved drafter, checked against each other."""
    from safetensors.torch import load_file

    from ...heads.eagle import DRAFTER_FORMAT

    try:
        raw = json.loads((src / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{src / CONFIG_FILE}: cannot read the drafter config: {exc}") from exc
    fmt = raw.pop("draftsmith_format", None) if isinstance(raw, dict) else None
    if fmt != DRAFTER_FORMAT:
        raise ExportError(
            f"{src / CONFIG_FILE}: 'draftsmith_format' is {fmt!r}, expected {DRAFTER_FORMAT!r}"
        )
    try:
        cfg = EagleConfig.from_dict(raw)
    except Exception as exc:  # any field of a foreign or hand-edited file may be wrong
        raise ExportError(f"{src / CONFIG_FILE}: not a valid EAGLE drafter config: {exc}") from exc
    try:
        _expected_shapes(cfg)
    except Exception as exc:
        raise ExportError(f"{src / CONFIG_FILE}: not a valid EAGLE drafter config: {exc}") from exc
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
# Writing
# --------------------------------------------------------------------------------------------


def _resolve_dtype(dtype: torch.dtype | str | None, state: dict[str, torch.Tensor]) -> torch.dtype:
    if dtype is None:
        return state["fc.weight"].dtype
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(value, torch.dtype) or not value.is_floating_point:
            raise ExportError(f"dtype must be a floating torch dtype name, got {dtype!r}")
        return value
    return dtype


def _config(
    fmt: str, cfg: EagleConfig, dtype: torch.dtype, target: str | None, arch: list[str], k: int
) -> dict[str, Any]:
    """The ``config.json`` of ``fmt`` (:mod:`~draftsmith.train.export.eagle_config`)."""
    family, _ = families.export_formats()[fmt]
    drafter = families.FAMILIES["peagle" if cfg.parallel else f"eagle{cfg.version}"]
    if family is not drafter:
        others = " or ".join(f.name for f in drafter.exports)
        raise ExportError(
            f"the {fmt} format holds {family.title} drafters, this is a {drafter.title} "
            f"drafter: use --format {others}"
        )
    if fmt in ("speculators", "peagle"):
        return speculators_config(cfg, dtype, target, arch, k)
    return eagle3_config(cfg, dtype) if fmt == "eagle3" else eagle1_config(cfg, dtype)


def export_drafter(
    fmt: str,
    src_dir: str | Path,
    out_dir: str | Path,
    *,
    target_name_or_path: str | None = None,
    verifier_architectures: list[str] | None = None,
    speculative_tokens: int = 3,
    dtype: torch.dtype | str | None = None,
    metrics_json: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Export a saved drafter in one of :data:`FORMATS`: read, rename, write to a temp dir, check,
    rename (what ``draftsmith export`` calls; :func:`export_speculators`, :func:`export_eagle3`
    and :func:`export_eagle` name the format for you).

    Args:
        fmt: ``speculators`` (EAGLE-3, vLLM), ``eagle3`` (EAGLE-3, SGLang) or ``eagle``
            (EAGLE-1, vLLM).
        src_dir: a drafter saved by ``save_drafter`` (or the recipe's output_dir holding
            ``drafter/``).
        out_dir: destination directory; written atomically.
        target_name_or_path: the target. ``speculators`` needs it: the verifier as vLLM should
            load it (HF id or path); ``vllm serve <out_dir>`` starts this model. The other
            formats name it in the model card's usage lines only (SGLang and vLLM take the
            target on their command line). Recorded as
            :func:`~draftsmith.train.target_model.load.describe_target` names it: a Hub cache
            snapshot directory becomes its Hub id.
        verifier_architectures: ``speculators``: the target's architectures (default: read
            from a local verifier directory or the Hub cache, else ``["LlamaForCausalLM"]``).
        speculative_tokens: k, vLLM's ``num_speculative_tokens`` when served from the
            speculators config; the draft steps the model card suggests.
        dtype: weight dtype of the export (default: as saved); ``d2t``/``t2d`` keep theirs.
        metrics_json: an evaluation results file for the model card's τ (default: searched
            beside the drafter).
        overwrite: replace an existing ``out_dir``.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        MissingCheckpointError: no saved drafter at ``src_dir`` (a FileNotFoundError).
        ExportError: the drafter is the other EAGLE version than the format holds, or is
            inconsistent (a ValueError); ``eagle3`` also refuses ``norm_before_residual=True``
            (SGLang's EAGLE-3 layer cannot express it).
        OutputExistsError: ``out_dir`` exists and ``overwrite`` is False (a FileExistsError).
        NonFiniteError: a tensor holds NaN or inf (after the dtype cast).
        DiskSpaceError: the export does not fit on the disk.
    """
    from safetensors.torch import load_file, save_file

    if fmt not in FORMATS:
        raise ExportError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    arch: list[str] = []
    if fmt in ("speculators", "peagle"):
        if not target_name_or_path:
            raise ExportError("the speculators format needs the verifier (the target)")
        if speculative_tokens < 1:
            raise ExportError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
        # Read from the directory as given, before it is renamed to a Hub id.
        arch = verifier_architectures or verifier_architectures_of(target_name_or_path)
        target_name_or_path = target_facts(target_name_or_path)["target"]
    src = _source_dir(src_dir)
    cfg, state = _read_drafter(src)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        from ..staged import OutputExistsError

        raise OutputExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    want = _resolve_dtype(dtype, state)
    config = _config(fmt, cfg, want, target_name_or_path, arch, speculative_tokens)
    # The target as a server elsewhere finds it (a Hub id, not this machine's cache path), and
    # a note when its weights are not the original model's (the default's dequantized GGUF).
    facts = target_facts(target_name_or_path)
    info = {**provenance(src, metrics_json), **facts}
    target = facts.get("target") or (info.get("training") or {}).get("target") or "the target model"

    tensors: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name in ("d2t", "t2d"):
            if _full_vocab(cfg):
                continue  # see the module docstring: vLLM rejects maps it did not create
            # Integer/bool buffers keep their dtypes (vLLM: int64 d2t; speculators: bool t2d).
            value = value.to(torch.long if name == "d2t" else torch.bool)
        elif name == "mask_hidden":
            # speculators' PEagleDraftModel holds it as [1, 1, 3H]; vLLM flattens it to [1, 3H].
            value = value.to(want).view(1, 1, -1)
        else:
            value = value.to(want)
        tensors[_to_export(name, fmt)] = value.contiguous()

    check_finite(tensors, f"{src / WEIGHTS_FILE} (as {dtype_name(want)})")
    # Weights plus the small JSON/README files.
    with staged_dir(out, overwrite=overwrite, need_bytes=tensor_bytes(tensors) + (1 << 20)) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json_text(config, indent=2) + "\n")
        export_info = {
            "format": fmt,
            "drafter_config": cfg.to_dict(),
            "dtype": dtype_name(want),
            **info,
        }
        (tmp / INFO_FILE).write_text(json_text(export_info, indent=2, default=str) + "\n")
        (tmp / "README.md").write_text(model_card(fmt, cfg, info, target, speculative_tokens))
        # The export must hold exactly the source's tensors under the new names.
        written = load_file(str(tmp / WEIGHTS_FILE))
        bad = sorted(k for k, v in tensors.items() if not torch.equal(written.get(k, v[:0]), v))
        if bad or set(written) != set(tensors):
            raise RunError(f"export check failed: tensors {bad} differ after writing")
    return out


def write(request: ExportRequest) -> Path:
    """The EAGLE formats' writer in the family declaration: :func:`export_drafter`."""
    return export_drafter(
        request.format,
        request.checkpoint,
        request.out,
        target_name_or_path=request.target,
        speculative_tokens=3 if request.speculative_tokens is None else request.speculative_tokens,
        dtype=request.dtype,
        metrics_json=request.metrics_json,
        overwrite=request.overwrite,
    )


def export_speculators(
    src_dir: str | Path, out_dir: str | Path, *, verifier_name_or_path: str, **options: Any
) -> Path:
    """Export an EAGLE-3 drafter in vllm-project/speculators' format (what vLLM loads).

    ``verifier_name_or_path`` is the target as vLLM should load it; ``options`` are
    :func:`export_drafter`'s (``verifier_architectures``, ``speculative_tokens``, ``dtype``,
    ``metrics_json``, ``overwrite``). Refuses an EAGLE-1 drafter (use :func:`export_eagle`).
    """
    return export_drafter(
        "speculators", src_dir, out_dir, target_name_or_path=verifier_name_or_path, **options
    )


def export_eagle3(src_dir: str | Path, out_dir: str | Path, **options: Any) -> Path:
    """Export an EAGLE-3 drafter in SGLang's / the original EAGLE-3 layout (``midlayer.*``).

    ``options`` are :func:`export_drafter`'s. Refuses an EAGLE-1 drafter, and one that uses
    ``norm_before_residual=True`` (SGLang's EAGLE-3 layer cannot express it).
    """
    return export_drafter("eagle3", src_dir, out_dir, **options)


def export_eagle(src_dir: str | Path, out_dir: str | Path, **options: Any) -> Path:
    """Export an EAGLE-1 drafter in vLLM's ``eagle`` layout (``EagleLlamaForCausalLM``).

    ``options`` are :func:`export_drafter`'s. Refuses an EAGLE-3 drafter (use
    :func:`export_speculators`).
    """
    return export_drafter("eagle", src_dir, out_dir, **options)


# --------------------------------------------------------------------------------------------
# Reading an export back (round trips)
# --------------------------------------------------------------------------------------------


def load_export(
    path: str | Path, target: torch.nn.Module, *, dtype: torch.dtype | None = None
) -> EagleDrafter:
    """Load an export written by this module as our :class:`EagleDrafter` (reverse mapping).

    Args:
        path: the export directory.
        target: the target it serves (shares its embedding, and head for EAGLE-1; gives the
            layer count, which no export format records).
        dtype: cast parameters to this dtype (default: as exported).

    Raises:
        ExportError: naming the file and field that is missing or wrong.
    """
    from safetensors.torch import load_file

    root = Path(path)
    for p in (root / CONFIG_FILE, root / WEIGHTS_FILE):
        if not p.is_file():
            raise MissingCheckpointError(f"EAGLE export: {p} not found")
    raw = json.loads((root / CONFIG_FILE).read_text())
    fmt = export_format(raw)
    cfg = config_from_export(fmt, raw, target.config)
    if cfg.hidden_size != target.config.hidden_size or cfg.vocab_size != target.config.vocab_size:
        raise ExportError(
            f"{root / CONFIG_FILE}: hidden/vocab size {cfg.hidden_size}/{cfg.vocab_size} do not "
            f"match the target's {target.config.hidden_size}/{target.config.vocab_size}"
        )
    state = {_from_export(k, fmt): v for k, v in load_file(str(root / WEIGHTS_FILE)).items()}
    if "mask_hidden" in state:
        state["mask_hidden"] = state["mask_hidden"].reshape(1, -1)
    if cfg.version == 3 and _full_vocab(cfg) and "d2t" not in state:
        # Full draft vocabulary: the identity maps our drafter holds (omitted in the export).
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    check_tensor_shapes(state, _expected_shapes(cfg), str(root / WEIGHTS_FILE))
    head = target.get_output_embeddings() if cfg.version == 1 else None
    embed = target.get_input_embeddings()
    saved = state["fc.weight"].dtype
    drafter = EagleDrafter(cfg, embed, head).to(saved)
    drafter.load_state_dict(state)
    return drafter.to(device=embed.weight.device, dtype=dtype or saved).eval()
