"""Where a draft LM starts: a layer-pruned copy of the target, a fresh model, or a local model.

All three give an HF causal LM in the target's vocabulary, trainable (``train()`` mode, gradients
on), carrying the target's generation config so that HF ``generate(assistant_model=draft)`` and
our loop stop on the same EOS ids:

* ``pruned`` (:func:`pruned_draft`): the target's embeddings, a chosen subset of its decoder layers
  in order, its final norm and lm_head (Sajjad et al. 2023 "On the effect of dropping layers";
  the cheapest start that already predicts the target's tokens).
* ``fresh`` (:func:`fresh_draft`): the target's architecture class and vocabulary with new sizes
  (layers, hidden size, heads, intermediate size), randomly initialised.
* ``path`` (:func:`load_draft`): any local HF model directory whose tokenizer matches the target's.

Compatibility is checked before any training (:func:`check_draft_compatible`): same number of
output rows and the same token behind every id, else a ``ValueError`` naming both vocabulary
sizes and the first differing token.

Per-token cost (:func:`per_token_flops`): a draft is only worth running if it is much cheaper than
the target. We count multiply-adds of every linear layer (the lm_head included: for a 49k-token
vocabulary it dominates small drafts) plus attention over ``context`` cached tokens; the
embedding lookup is a gather and costs nothing.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...heads.draft_lm import check_vocab_compatible, layer_pruned_copy

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DRAFT_INITS",
    "check_draft_compatible",
    "compute_ratio",
    "fresh_draft",
    "init_draft",
    "load_draft",
    "per_token_flops",
    "pruned_draft",
]

#: Draft initialisations :func:`init_draft` knows.
DRAFT_INITS: tuple[str, ...] = ("pruned", "fresh", "path")


def _trainable(model: PreTrainedModel) -> PreTrainedModel:
    model.requires_grad_(True)
    return model.train()


def pruned_draft(target: PreTrainedModel, layers: list[int]) -> PreTrainedModel:
    """A trainable layer-pruned copy of the target (see :func:`layer_pruned_copy`).

    Args:
        target: the (frozen) target causal LM.
        layers: target layer indices to keep, in order, e.g. ``[0, 29]``.

    Returns:
        The draft in train mode; it shares no storage with the target.
    """
    return _trainable(layer_pruned_copy(target, layers))


def fresh_draft(
    target: PreTrainedModel,
    *,
    num_layers: int,
    hidden_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    copy_embeddings: bool = False,
    seed: int = 0,
) -> PreTrainedModel:
    """A new, randomly initialised model of the target's class and vocabulary.

    Args:
        target: the target; its config gives the architecture, vocabulary and special ids.
        num_layers: decoder layers.
        hidden_size: model width (None: the target's).
        num_heads: attention heads (None: the target's); must divide ``hidden_size``.
        num_kv_heads: key/value heads (None: ``num_heads`` if it changed, else the target's);
            must divide ``num_heads``.
        intermediate_size: MLP width (None: the target's ratio to the hidden size).
        copy_embeddings: start from the target's embeddings, final norm and lm_head (only when
            the width equals the target's).
        seed: initialisation seed.

    Returns:
        The draft in train mode, with the target's dtype and generation config.

    Raises:
        ValueError: a size is not positive or does not divide as required.
    """
    from transformers import AutoModelForCausalLM

    tc = target.config
    hidden = hidden_size or tc.hidden_size
    heads = num_heads or tc.num_attention_heads
    if num_kv_heads is not None:
        kv = num_kv_heads
    elif num_heads is None:
        kv = getattr(tc, "num_key_value_heads", heads)
    else:
        kv = heads
    inter = intermediate_size or round(tc.intermediate_size * hidden / tc.hidden_size)
    problems = []
    if num_layers < 1:
        problems.append(f"num_layers must be >= 1, got {num_layers}")
    if hidden < 1 or heads < 1 or kv < 1 or inter < 1:
        problems.append(
            f"sizes must be >= 1 (hidden {hidden}, heads {heads}, kv {kv}, mlp {inter})"
        )
    elif hidden % heads:
        problems.append(f"num_heads {heads} must divide hidden_size {hidden}")
    elif heads % kv:
        problems.append(f"num_kv_heads {kv} must divide num_heads {heads}")
    if copy_embeddings and hidden != tc.hidden_size:
        problems.append(
            f"copy_embeddings needs the target's width {tc.hidden_size}, got hidden_size {hidden}"
        )
    if problems:
        raise ValueError("fresh draft: " + "; ".join(problems))
    config = copy.deepcopy(tc)
    config.num_hidden_layers = num_layers
    config.hidden_size = hidden
    config.num_attention_heads = heads
    config.num_key_value_heads = kv
    config.intermediate_size = inter
    if getattr(config, "head_dim", None) is not None:
        config.head_dim = hidden // heads
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [tc.layer_types[i % len(tc.layer_types)] for i in range(num_layers)]
    dtype = next(target.parameters()).dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if copy_embeddings:
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
            draft.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight)
            t_norm, d_norm = target.get_decoder().norm, draft.get_decoder().norm
            d_norm.load_state_dict(t_norm.state_dict())
    draft.generation_config = copy.deepcopy(target.generation_config)
    return _trainable(draft)


def check_draft_compatible(
    draft: PreTrainedModel,
    target: PreTrainedModel,
    draft_tokenizer: PreTrainedTokenizerBase | None = None,
    target_tokenizer: PreTrainedTokenizerBase | None = None,
) -> None:
    """Raise unless the draft proposes in the target's vocabulary.

    Args:
        draft: the draft causal LM.
        target: the target causal LM.
        draft_tokenizer: the draft's tokenizer (compared id by id with the target's when both
            are given).
        target_tokenizer: the target's tokenizer.

    Raises:
        ValueError: naming both vocabulary sizes and the first differing token.
    """
    check_vocab_compatible(
        draft.get_output_embeddings().weight.shape[0],
        target.get_output_embeddings().weight.shape[0],
        draft_tokenizer=draft_tokenizer,
        target_tokenizer=target_tokenizer,
    )


def load_draft(
    path: str | Path,
    target: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase | None = None,
) -> PreTrainedModel:
    """Load a local HF causal LM as a trainable draft, after checking its vocabulary.

    Args:
        path: a local model directory (``config.json`` + weights; a tokenizer is compared with
            ``target_tokenizer`` when it has one).
        target: the target (gives the dtype and the vocabulary size to match).
        target_tokenizer: the target's tokenizer.

    Returns:
        The draft in train mode on the target's device and dtype.

    Raises:
        FileNotFoundError: ``path`` has no ``config.json``.
        ValueError: the vocabularies differ (see :func:`check_draft_compatible`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"draft model directory {path} has no config.json")
    param = next(target.parameters())
    draft = AutoModelForCausalLM.from_pretrained(path, dtype=param.dtype)
    draft_tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        draft_tokenizer = AutoTokenizer.from_pretrained(path)
    check_draft_compatible(draft, target, draft_tokenizer, target_tokenizer)
    if draft_tokenizer is None and target_tokenizer is not None:
        # Without a tokenizer we can only compare sizes; say so rather than guess.
        print(f"note: {path} has no tokenizer; only the vocabulary size was checked")
    return _trainable(draft.to(param.device))


def init_draft(
    kind: str,
    target: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    layers: list[int] | None = None,
    path: str | Path | None = None,
    fresh: dict[str, Any] | None = None,
) -> PreTrainedModel:
    """Make the draft the recipe config asks for.

    Args:
        kind: one of :data:`DRAFT_INITS`.
        target: the target causal LM.
        target_tokenizer: the target's tokenizer (checked against a loaded draft's).
        layers: ``pruned``: target layers to keep.
        path: ``path``: the local model directory.
        fresh: ``fresh``: keyword arguments of :func:`fresh_draft`.

    Returns:
        A trainable draft in the target's vocabulary.
    """
    if kind == "pruned":
        if not layers:
            raise ValueError("pruned draft needs layers")
        draft = pruned_draft(target, layers)
    elif kind == "fresh":
        draft = fresh_draft(target, **(fresh or {}))
    elif kind == "path":
        if path is None:
            raise ValueError("path draft needs a model path")
        return load_draft(path, target, target_tokenizer)
    else:
        raise ValueError(f"unknown draft init {kind!r}; expected one of {list(DRAFT_INITS)}")
    check_draft_compatible(draft, target)
    return draft


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found")
    return layers


def per_token_flops(model_or_config: PreTrainedModel | PretrainedConfig, context: int = 0) -> int:
    """Forward FLOPs to decode one token (2 FLOPs per multiply-add).

    Counts every ``nn.Linear`` (attention projections, MLP, lm_head) and the attention scores and
    weighted sum over ``context`` cached positions (``2 · heads · head_dim · context`` multiply-adds
    per layer). The embedding lookup, norms, activations and rotary embeddings are left out
    (gathers and elementwise work, negligible next to the matmuls).

    Args:
        model_or_config: a causal LM, or its config (instantiated on the meta device: no memory).
        context: tokens already in the KV cache.

    Returns:
        FLOPs per generated token.
    """
    model = model_or_config
    if not isinstance(model, nn.Module):
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_or_config)
    macs = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    macs += len(_decoder_layers(model)) * 2 * heads * head_dim * context
    return 2 * macs


def compute_ratio(
    draft: PreTrainedModel | PretrainedConfig,
    target: PreTrainedModel | PretrainedConfig,
    context: int = 0,
    draft_head_rows: int | None = None,
) -> float:
    """Draft FLOPs per token ÷ target FLOPs per token (see :func:`per_token_flops`).

    Args:
        draft_head_rows: the draft's lm_head rows it computes per token (a draft vocabulary,
            heads/draft_lm.py); None: the whole head.
    """
    flops = per_token_flops(draft, context)
    if draft_head_rows is not None:
        cfg = getattr(draft, "config", draft)  # a model, or its config
        flops -= 2 * (cfg.vocab_size - draft_head_rows) * cfg.hidden_size
    return flops / per_token_flops(target, context)
