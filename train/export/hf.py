"""Export a draft LM as a plain Hugging Face model directory (``draftsmith export --format hf``).

The directory is what every engine loads without custom code::

    <out>/config.json, model.safetensors     AutoModelForCausalLM.from_pretrained(<out>)
    <out>/generation_config.json             the target's EOS / pad ids
    <out>/tokenizer.json, tokenizer_config.json, chat_template.jinja   the target's tokenizer
    <out>/README.md                          model card: target, data, measured acceptance, usage
    <out>/draftsmith_draft.json              what produced it (target, data, metrics), if known

and it serves as ``target.generate(..., assistant_model=draft)`` in transformers and as a draft
model in vLLM (``speculative_config={"method": "draft_model", "model": <out>, ...}``).

Writes are atomic: everything goes into a temporary directory beside ``out`` that is renamed into
place once complete (and, on export, reloaded and checked), so a crash never leaves a half model
under the final name (:func:`~draftsmith.train.staged.staged_dir`: free space checked first,
readable by other users, dead writers' temp dirs removed). An export of weights holding NaN or
inf is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...heads.draft_lm import load_draft_vocab
from ..device import device_facts, resolve_device
from ..errors import RunError
from ..progress import hf_progress_bars
from ..runinfo import json_text
from ..staged import OutputExistsError, staged_dir
from .common import (
    ExportError,
    ExportRequest,
    MissingCheckpointError,
    check_finite,
    target_card_lines,
    target_facts,
    tensor_bytes,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["INFO_FILE", "export_hf", "model_card", "save_draft", "write"]

#: Training metadata written beside the weights (read back by :func:`export_hf` for the card).
INFO_FILE = "draftsmith_draft.json"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return "-" if value is None else str(value)


def model_card(info: dict[str, Any], out_name: str = "<this directory>") -> str:
    """The README.md of a draft directory.

    Args:
        info: what is known about the draft; keys used when present: ``target`` (with
            ``target_note`` / ``original_model`` for a converted GGUF target), ``data``,
            ``init`` (e.g. ``"pruned [0]"``), ``loss``, ``steps``, ``compute_ratio``,
            ``num_layers``, ``validation`` (``{"before": {...}, "after": {...}}`` with
            ``expected_acceptance``, ``greedy_agreement``, ``tokens``).
        out_name: how the usage snippets refer to the directory.

    Returns:
        Markdown with a YAML front matter (``library_name: transformers``).
    """
    target = info.get("target") or "the target model it was trained against"
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [speculative-decoding, draft-model, draftsmith]",
        "---",
        "",
        "# Draft model for speculative decoding",
        "",
        f"A small causal LM trained by draftsmith to predict the next tokens of **{target}**, "
        "sharing its tokenizer. Use it as the draft (assistant) model: the target verifies every "
        "proposed token, so outputs are exactly the target's (greedy) or follow the target's "
        "distribution (sampling).",
        *target_card_lines(info),
        "",
        "| | |",
        "|---|---|",
        f"| target | `{target}` |",
        *(
            [f"| original model | `{info['original_model']}` |"]
            if info.get("original_model")
            else []
        ),
        f"| initialisation | {_fmt(info.get('init'))} |",
        f"| decoder layers | {_fmt(info.get('num_layers'))} |",
        f"| compute per token vs target | {_fmt(info.get('compute_ratio'))} |",
        f"| training data | `{_fmt(info.get('data'))}` |",
        f"| loss | {_fmt(info.get('loss'))} |",
        f"| optimizer steps | {_fmt(info.get('steps'))} |",
    ]
    if info.get("draft_vocab_size"):
        lines.append(
            f"| draft vocabulary | {info['draft_vocab_size']} tokens in draftsmith's loop "
            f"(covering {_fmt(info.get('draft_vocab_coverage'))} of the training tokens); "
            "written here as the full-vocabulary model, which servers draft with over every "
            "token |"
        )
    val = info.get("validation") or {}
    if val:
        lines += [
            "",
            "## Measured on the validation split (teacher-forced, held out from training)",
            "",
            "`expected_acceptance` = mean over answer tokens of Σ_v min(p, q) (the speculative "
            "sampling acceptance rate at temperature 1); `greedy_agreement` = share of tokens "
            "where the draft's argmax is the target's (greedy acceptance).",
            "",
            "| | expected_acceptance | greedy_agreement | tokens |",
            "|---|---|---|---|",
        ]
        for name in ("before", "after"):
            m = val.get(name)
            if m:
                lines.append(
                    f"| {name} training | {_fmt(m.get('expected_acceptance'))} | "
                    f"{_fmt(m.get('greedy_agreement'))} | {_fmt(m.get('tokens'))} |"
                )
    lines += [
        "",
        "## Use",
        "",
        "transformers (assisted generation, batch size 1):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "tok = AutoTokenizer.from_pretrained(TARGET)",
        "target = AutoModelForCausalLM.from_pretrained(TARGET)",
        f'draft = AutoModelForCausalLM.from_pretrained("{out_name}")',
        "out = target.generate(**tok(prompt, return_tensors='pt'), assistant_model=draft,",
        "                      do_sample=False, max_new_tokens=128)",
        "```",
        "",
        "vLLM:",
        "",
        "```python",
        "from vllm import LLM",
        "llm = LLM(model=TARGET, speculative_config={",
        f'    "method": "draft_model", "model": "{out_name}", "num_speculative_tokens": 5}})',
        "```",
        "",
        "draftsmith: `draftsmith evaluate --drafter draft-lm --draft-model " + out_name + "`.",
        "",
    ]
    return "\n".join(lines)


def save_draft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    out_dir: str | Path,
    *,
    info: dict[str, Any] | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    overwrite: bool = True,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write a draft as a ``save_pretrained`` directory with tokenizer and model card, atomically.

    Args:
        model: the draft causal LM (unwrapped from DDP/FSDP).
        tokenizer: its tokenizer (the target's), or None to write none.
        out_dir: destination directory.
        info: metadata for the model card, also stored as ``draftsmith_draft.json``.
        state_dict: weights to save instead of ``model.state_dict()`` (e.g. gathered from FSDP).
        overwrite: replace an existing ``out_dir``.
        extra_files: more text files to write inside it, ``{name: text}`` (the draft
            vocabulary, :data:`~draftsmith.heads.draft_lm.DRAFT_VOCAB_FILE`).

    Returns:
        ``out_dir`` as a Path.
    """
    out = Path(out_dir)
    weights = state_dict if state_dict is not None else model.state_dict()
    # Weights plus tokenizer and JSON files (a large vocabulary's tokenizer.json is tens of MiB).
    need = tensor_bytes(weights) + (64 << 20)
    with staged_dir(out, overwrite=overwrite, need_bytes=need) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        info = dict(info or {})
        (tmp / INFO_FILE).write_text(json_text(info, indent=2, default=str) + "\n")
        (tmp / "README.md").write_text(model_card(info, out_name=str(out)))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return out


def _probe_ids(vocab_size: int, device: torch.device, length: int = 16) -> torch.Tensor:
    """A fixed ``[1, length]`` token sequence for the reload check, on ``device``.

    Drawn with a CPU generator and moved, so the check feeds the same tokens on every device.
    """
    g = torch.Generator(device="cpu").manual_seed(0)
    return torch.randint(0, vocab_size, (1, length), generator=g).to(device)


def write(request: ExportRequest) -> Path:
    """The ``hf`` format's writer in the family declaration: :func:`export_hf`."""
    if request.dtype is not None:
        raise ExportError("dtype: the hf export keeps the draft's own dtype")
    return export_hf(
        request.checkpoint,
        request.out,
        tokenizer_src=request.tokenizer,
        overwrite=request.overwrite,
        target_name_or_path=request.target,
        device=request.device or "auto",
    )


def export_hf(
    src_dir: str | Path,
    out_dir: str | Path,
    *,
    tokenizer_src: str | Path | None = None,
    overwrite: bool = False,
    target_name_or_path: str | None = None,
    device: str | torch.device = "auto",
) -> Path:
    """Export a trained draft as a standalone HF model directory, checked by reloading it.

    Args:
        src_dir: a draft directory written by ``recipes/distill.py`` (its ``output_dir`` or the
            ``draft/`` directory inside it) or any local HF causal-LM directory.
        out_dir: destination; written atomically.
        tokenizer_src: where to take the tokenizer from (default: ``src_dir``); give the target's
            directory when the source has none.
        overwrite: replace an existing ``out_dir``.
        target_name_or_path: the target the card names (default: the one the draft's
            ``draftsmith_draft.json`` records); either is named as
            :func:`~draftsmith.train.target_model.load.describe_target` names it.
        device: where the reload check runs both models (a ``device`` setting or a
            ``torch.device``; ``auto``: the first GPU when there is one, else the CPU). The
            weights are written from the CPU either way; ``checked_on`` in
            ``draftsmith_draft.json`` records the device.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        MissingCheckpointError: no model (``config.json``) or no tokenizer was found (an
            ExportError and a FileNotFoundError).
        ExportError: the tokenizer has more tokens than the model has output rows.
        OutputExistsError: ``out_dir`` exists and ``overwrite`` is False (a FileExistsError).
        NonFiniteError: a weight holds NaN or inf.
        RunError: the reloaded export's logits differ from the source's.
        UsageError: ``device`` names a GPU this machine does not have.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device, "device")
    src = Path(src_dir)
    if not (src / "config.json").is_file() and (src / "draft" / "config.json").is_file():
        src = src / "draft"  # the recipe's output_dir
    if not (src / "config.json").is_file():
        raise MissingCheckpointError(
            f"{src_dir}: no draft model here (no config.json); pass the output_dir of "
            "`draftsmith train distill` or its draft/ directory"
        )
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    tok_dir = Path(tokenizer_src) if tokenizer_src is not None else src
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    except Exception as exc:
        hint = "" if tokenizer_src else " (pass tokenizer_src / --tokenizer, e.g. the target dir)"
        raise MissingCheckpointError(
            f"cannot load a tokenizer from {tok_dir}: {exc}{hint}"
        ) from exc
    try:
        with hf_progress_bars():  # the loading bar on a terminal only, not as `\r` runs in logs
            model = AutoModelForCausalLM.from_pretrained(src).eval()
    except Exception as exc:  # missing/damaged weights, an unknown architecture
        raise ExportError(f"{src}: cannot load the draft model: {exc}") from exc
    check_finite(model.state_dict(), str(src))
    rows = model.get_output_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise ExportError(
            f"tokenizer from {tok_dir} has {len(tokenizer)} tokens but the model only {rows} "
            "output rows: it is not this model's tokenizer"
        )
    info_file = src / INFO_FILE
    info = _read_info(info_file)
    info.setdefault("num_layers", model.config.num_hidden_layers)
    if target_name_or_path:  # a note recorded for the training target is not this one's
        for key in ("target_note", "original_model", "target_revision"):
            info.pop(key, None)
    info.update(target_facts(target_name_or_path or info.get("target")))
    try:
        vocab_ids = load_draft_vocab(src, rows)
    except ValueError as exc:
        raise ExportError(str(exc)) from exc
    if vocab_ids is not None:  # not copied: the export is the full-vocabulary equivalent
        info["draft_vocab_size"] = len(vocab_ids)
    info["exported_from"] = str(src)
    info["checked_on"] = device_facts(device)
    save_draft(model, tokenizer, out, info=info, overwrite=overwrite)
    # Check the export really is the same model (not merely loadable): same logits, bit for bit,
    # both models on one device (the same kernels, so equal weights give equal bits).
    model.to(device)
    with hf_progress_bars():
        reloaded = AutoModelForCausalLM.from_pretrained(out).to(device).eval()
    ids = _probe_ids(min(rows, len(tokenizer)), device)
    with torch.no_grad():
        same = torch.equal(model(ids).logits, reloaded(ids).logits)
    if not same:
        raise RunError(f"export check failed: {out} gives different logits than {src}")
    return out


def _read_info(path: Path) -> dict[str, Any]:
    """The draft's metadata file, or {} when absent or unreadable (it only feeds the card)."""
    import json

    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}
