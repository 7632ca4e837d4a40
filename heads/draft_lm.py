"""A separate small causal LM as the drafter (Leviathan et al. 2023; Chen et al. 2023).

Any HF causal LM that shares the target's vocabulary works. The draft keeps its own KV cache
across steps and rolls it back to the accepted prefix, so each step feeds it only the tokens it has
not seen (usually one or two) instead of re-reading the context.

``--drafter draft-lm[=DIR]`` (:data:`DRAFT_LM`) loads the draft from DIR (or ``draft_model``), or
without one makes an untrained layer-pruned copy of the target (``draft_layers``).

Draft vocabulary (FR-Spec; EAGLE-3 §3's d2t): a draft directory holding ``draft_vocab.json``
(written by ``recipes/distill.py`` with ``draft_vocab_size``) drafts over those N token ids only:
each draft token's logits are its last hidden state times those N rows of its own lm_head, not
all V. For SmolLM2 the head is 49,152 x 576 multiply-adds a token, most of a pruned draft's
cost. The draft distribution q is exactly zero outside the vocabulary, so verification stays
lossless. The model itself keeps its full head: an HF export of it (``--format hf``) is the
full-vocabulary equivalent, which servers load as any draft model.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from .base import BuildOptions, DrafterKind, Features, Proposal
from .sampling import SamplingParams, choose, confidence

DRAFT_VOCAB_FILE = "draft_vocab.json"


def draft_vocab_text(t2d: torch.Tensor, *, coverage: float | None = None) -> str:
    """A draft model's draft vocabulary as the text of its ``draft_vocab.json``.

    Args:
        t2d: bool ``[V]``, True for the target ids in the draft vocabulary
            (:func:`draftsmith.train.data.vocab.draft_vocab`).
        coverage: share of the training data's supervised tokens the vocabulary holds.
    """
    ids = torch.nonzero(t2d.cpu()).flatten().tolist()
    body = {"vocab_size": int(t2d.shape[0]), "draft_vocab_size": len(ids), "token_ids": ids}
    if coverage is not None:
        body["coverage"] = round(float(coverage), 6)
    return json.dumps(body) + "\n"


def load_draft_vocab(model_dir: str | Path | None, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary's target ids ``[N]`` (increasing) saved beside a draft model, or None.

    Raises:
        ValueError: naming the file and field when it is malformed or made for another vocabulary.
    """
    if model_dir is None or not (Path(model_dir) / DRAFT_VOCAB_FILE).is_file():
        return None
    path = Path(model_dir) / DRAFT_VOCAB_FILE
    try:
        body = json.loads(path.read_text())
        ids = torch.tensor(body["token_ids"], dtype=torch.long)
        size = int(body["vocab_size"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a draft vocabulary file ({exc})") from exc
    if size != vocab_size:
        raise ValueError(f"{path}: vocab_size is {size}, the model has {vocab_size} output rows")
    if ids.numel() == 0 or ids.min() < 0 or ids.max() >= size or not (ids.diff() > 0).all():
        raise ValueError(f"{path}: token_ids must be distinct increasing ids in [0, {size})")
    return ids


def first_vocab_difference(
    draft_tokenizer: PreTrainedTokenizerBase, target_tokenizer: PreTrainedTokenizerBase
) -> tuple[int, str | None, str | None] | None:
    """The first token id whose token differs between two tokenizers.

    Args:
        draft_tokenizer: the draft's tokenizer.
        target_tokenizer: the target's tokenizer.

    Returns:
        ``(id, draft_token, target_token)`` for the lowest id that maps to different tokens (a side
        is ``None`` when that tokenizer has no such id), or ``None`` when both map every id to the
        same token (added/special tokens included).
    """
    draft = {i: t for t, i in draft_tokenizer.get_vocab().items()}
    target = {i: t for t, i in target_tokenizer.get_vocab().items()}
    for i in sorted(draft.keys() | target.keys()):
        if draft.get(i) != target.get(i):
            return i, draft.get(i), target.get(i)
    return None


def check_vocab_compatible(
    draft_vocab_size: int,
    target_vocab_size: int,
    *,
    draft_tokenizer: PreTrainedTokenizerBase | None = None,
    target_tokenizer: PreTrainedTokenizerBase | None = None,
) -> None:
    """Raise when a draft model cannot propose in the target's vocabulary.

    Speculative sampling compares p and q token by token, so both must index the same vocabulary:
    the same number of output rows and, when both tokenizers are given, the same token behind
    every id.

    Args:
        draft_vocab_size: rows of the draft's output embedding (lm_head).
        target_vocab_size: rows of the target's output embedding.
        draft_tokenizer: the draft's tokenizer, compared id by id with ``target_tokenizer``.
        target_tokenizer: the target's tokenizer.

    Raises:
        ValueError: naming both vocabulary sizes and, when tokenizers were given and differ, the
            first token id whose token differs.
    """
    diff = None
    if draft_tokenizer is not None and target_tokenizer is not None:
        diff = first_vocab_difference(draft_tokenizer, target_tokenizer)
    if draft_vocab_size == target_vocab_size and diff is None:
        return
    sizes = f"draft model vocab size {draft_vocab_size} != target vocab size {target_vocab_size}"
    if draft_vocab_size == target_vocab_size:
        sizes = (
            f"draft and target vocab size are both {draft_vocab_size}, but the tokenizers differ"
        )
    if diff is not None:
        i, d, t = diff
        sizes += (
            f"; tokenizers ({len(draft_tokenizer)} vs {len(target_tokenizer)} tokens) first differ "
            f"at id {i}: draft {d!r} vs target {t!r}"
        )
    raise ValueError(f"{sizes}: the draft must share the target's tokenizer and vocabulary")


class LossHead(nn.Linear):
    """A causal LM's output head that can return a loss in place of its logits (training).

    FSDP gathers a sharded weight only inside the forward of the module it wraps, so a loss
    that applies the draft's head itself, chunk by chunk so that no ``[N, V]`` logits are kept
    (``train/objectives/chunked_loss.py``), must run inside the draft's forward. Installed as
    the model's output embeddings by :func:`install_loss_head` (the same parameters under the
    same names: state dicts, checkpoints and ``save_pretrained`` are unchanged, and a tied
    weight stays tied), it is ``F.linear`` as before, except inside :meth:`computing`, where a
    call returns ``fn(hidden, weight, bias)`` instead: what the HF model then returns as its
    ``logits``.
    """

    def __init__(self, head: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = head.in_features, head.out_features
        self.weight = head.weight
        self.register_parameter("bias", head.bias)
        self._fn: Callable[..., Any] | None = None

    def forward(self, hidden: torch.Tensor) -> Any:
        """``[..., H] -> [..., V]`` logits, or inside :meth:`computing` what its ``fn`` returns."""
        if self._fn is None:
            return F.linear(hidden, self.weight, self.bias)
        return self._fn(hidden, self.weight, self.bias)

    @contextlib.contextmanager
    def computing(self, fn: Callable[..., Any]) -> Iterator[None]:
        """Calls inside the block return ``fn(hidden [..., H], weight [V, H], bias [V] | None)``."""
        self._fn = fn
        try:
            yield
        finally:
            self._fn = None


def install_loss_head(model: PreTrainedModel) -> LossHead:
    """Make ``model``'s output head a :class:`LossHead` (in place; idempotent), and return it.

    Raises:
        TypeError: the head is not a plain ``nn.Linear``.
    """
    head = model.get_output_embeddings()
    if isinstance(head, LossHead):
        return head
    if type(head) is not nn.Linear:
        raise TypeError(f"the draft's output head is a {type(head).__name__}, not an nn.Linear")
    loss_head = LossHead(head)
    model.set_output_embeddings(loss_head)
    return loss_head


class DraftLM(nn.Module):
    """Wrap an HF causal LM as a drafter.

    Args:
        model: the draft causal LM (put in eval mode here).
        target_vocab_size: the target's vocabulary size; checked against the draft's.
        name: how reports call it.
        vocab_ids: a draft vocabulary ``[N]`` of target ids (:func:`load_draft_vocab`): draft
            over these only (module docstring). None: the full vocabulary.
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(
        self,
        model: PreTrainedModel,
        target_vocab_size: int | None = None,
        name: str = "draft-lm",
        vocab_ids: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.name = name
        head = model.get_output_embeddings()
        draft_vocab = head.weight.shape[0]
        if target_vocab_size is not None:
            check_vocab_compatible(draft_vocab, target_vocab_size)
        self.vocab_size = draft_vocab
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(head.weight.device)
        # The head's rows of the draft vocabulary, gathered once (the draft is not trained here).
        self._rows = None if vocab_ids is None else head.weight[self.vocab_ids].detach()
        if vocab_ids is not None and getattr(head, "bias", None) is not None:
            raise ValueError("a draft vocabulary needs an lm_head without bias")
        self._cache: DynamicCache | None = None
        self._valid = 0  # cached positions that belong to the accepted sequence
        self._context = 0  # length of ids at the last propose
        self._fed_drafts = 0  # draft tokens fed to the model during the last propose
        self._pending = False

    @torch.inference_mode()
    def start(self, prompt_ids: torch.Tensor, features: Features | None) -> None:
        """Prefill the draft's cache with the prompt."""
        self._cache = DynamicCache(config=self.model.config)
        self.model(input_ids=prompt_ids, cache=self._cache, use_cache=True, logits_to_keep=1)
        self._valid = prompt_ids.shape[1]
        self._fed_drafts = 0
        self._pending = False  # a proposal awaits its verdict

    @torch.inference_mode()
    def propose(
        self,
        ids: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Run the draft autoregressively for k tokens after ``ids``.

        Returns:
            k tokens; with sampling, ``probs [k, V]`` is the processed draft distribution each was
            drawn from.
        """
        if self._cache is None:
            raise RuntimeError("DraftLM.propose called before start()")
        cached = self._cache.get_seq_length()
        if cached > self._valid:
            self._cache.crop(self._valid - cached)  # drop rejected draft tokens
        feed = ids[:, self._valid :]
        tokens, probs, conf = [], [], []
        for i in range(k):
            tok, q, c = self._draw(feed, sampling, generator)
            tokens.append(tok)
            probs.append(q)
            conf.append(c)
            if i + 1 < k:
                feed = tok.view(1, 1)
        self._context = ids.shape[1]
        self._fed_drafts = k - 1  # the last draft token was never fed
        self._valid = self._context  # until accept() says how many drafts to keep
        self._pending = True
        return Proposal(
            tokens=torch.stack(tokens),
            probs=None if sampling.greedy else torch.stack(probs),
            confidence=torch.stack(conf),
        )

    def _draw(
        self, feed: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Feed ``feed [1, n]`` and draw the next token: ``(token, q [V] or None, confidence)``."""
        if self._rows is None:
            out = self.model(input_ids=feed, cache=self._cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1]
            tok, q = choose(logits, sampling, generator)
            return tok, q, confidence(logits, q)
        hidden = self.model.get_decoder()(input_ids=feed, cache=self._cache, use_cache=True)
        logits = F.linear(hidden.last_hidden_state[0, -1], self._rows)  # [N]
        tok, q = choose(logits, sampling, generator)
        conf = confidence(logits, q)
        if q is not None:  # q over the target vocabulary: zero outside the draft vocabulary
            q = q.new_zeros(self.vocab_size).index_copy_(0, self.vocab_ids, q)
        return self.vocab_ids[tok], q, conf

    def accept(self, num_accepted: int, features: Features | None) -> None:
        """Keep the accepted draft tokens' cache entries; the rest is cropped at the next step.

        Steps without a proposal (the loop chose a draft length of 0) change nothing: every
        cached position is still part of the accepted sequence.
        """
        if self._pending:
            self._valid = self._context + min(num_accepted, self._fed_drafts)
            self._pending = False


def layer_pruned_copy(model: PreTrainedModel, layers: list[int]) -> PreTrainedModel:
    """A smaller LM made from a subset of the target's decoder layers.

    The copy shares no storage with the original: its embeddings, the chosen layers in the given
    order, the final norm and the lm_head are fresh trainable parameters holding the target's
    values (gradients enabled even if the target is frozen). A target with tied embeddings gives a
    draft with tied embeddings (one tensor; training updates both roles together, as in the
    target). It is the cheapest draft initialisation that already speaks the target's vocabulary
    (the distillation recipe starts from it; see ``docs/distill.md``).

    Args:
        model: a decoder-only HF causal LM with ``model.model.layers``.
        layers: indices of the layers to keep, e.g. ``[0, 10, 20, 29]``; no repeats.

    Returns:
        A new model of the same class with ``num_hidden_layers = len(layers)``, in eval mode, with
        the target's generation config (EOS ids, pad id).

    Raises:
        ValueError: ``layers`` is empty, out of range or repeats an index.
    """
    n_layers = model.config.num_hidden_layers
    bad = [i for i in layers if not 0 <= i < n_layers]
    if not layers or bad:
        raise ValueError(
            f"layers must be a non-empty list of indices in [0, {n_layers}); got {layers}"
        )
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers must not repeat an index; got {layers}")
    layers = [int(i) for i in layers]
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [model.config.layer_types[i] for i in layers]
    draft = type(model)(config)
    state = model.state_dict()
    new_state = {}
    for name, tensor in state.items():
        if ".layers." in name:
            prefix, rest = name.split(".layers.", 1)
            idx, tail = rest.split(".", 1)
            if int(idx) not in layers:
                continue
            name = f"{prefix}.layers.{layers.index(int(idx))}.{tail}"
        new_state[name] = tensor
    # load_state_dict copies values into the draft's own parameters: no storage is shared.
    missing, unexpected = draft.load_state_dict(new_state, strict=False)
    # Tied lm_head weights may not appear in the state dict; anything else missing is a bug.
    missing = [m for m in missing if not m.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"pruned copy: missing {missing}, unexpected {unexpected}")
    for i, layer in enumerate(draft.model.layers):
        if hasattr(layer, "self_attn") and hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = i
    out_w, in_w = draft.get_output_embeddings().weight, draft.get_input_embeddings().weight
    if getattr(config, "tie_word_embeddings", False) and out_w is not in_w:
        raise RuntimeError("pruned copy: the target ties its embeddings but the copy does not")
    if not torch.equal(out_w, model.get_output_embeddings().weight):
        raise RuntimeError("pruned copy: lm_head differs from the target's")
    draft.generation_config = copy.deepcopy(model.generation_config)
    draft.requires_grad_(True)
    return draft.to(next(model.parameters()).dtype).eval()


def load_draft_model(path: str | None, options: BuildOptions) -> tuple[PreTrainedModel, str]:
    """The draft LM a ``draft-lm`` or ``hf-assisted`` spec asks for, in the drafter's dtype.

    Args:
        path: the spec's model dir (or ``.gguf``); None = ``options.draft_model``, and without
            that an untrained layer-pruned copy of the target (``options.draft_layers``).
        options: the run's options (``load_model`` loads a path).

    Returns:
        ``(model, source)``: source says where it came from, for the method's name.
    """
    source = path or options.draft_model
    if source:
        if options.load_model is None:
            raise ValueError(f"draft model {source}: no model loader given (BuildOptions)")
        return options.load_model(source, options.draft_dtype), source
    n = options.target.config.num_hidden_layers
    # Default: first, two evenly spaced middle layers and the last one.
    layers = options.draft_layers or [0, n // 3, 2 * n // 3, n - 1]
    model = layer_pruned_copy(options.target, layers).to(options.draft_dtype)
    return model, f"pruned {options.draft_layers or 'default'}"


def build_draft_lm(path: str | None, options: BuildOptions) -> DraftLM:
    """``draft-lm[=DIR]``: a draft LM run by our loop (see :func:`load_draft_model`)."""
    model, source = load_draft_model(path, options)
    vocab = options.target.get_output_embeddings().weight.shape[0]
    directory = path or options.draft_model
    ids = load_draft_vocab(directory, vocab) if directory and Path(directory).is_dir() else None
    name = f"draft-lm[{source}]" if ids is None else f"draft-lm[{source}, {len(ids)} tokens]"
    return DraftLM(model, target_vocab_size=vocab, name=name, vocab_ids=ids)


DRAFT_LM = DrafterKind(
    build_draft_lm,
    path="optional",
    help="a draft LM with the target's vocabulary; without DIR: draft_model, else an untrained "
    "layer-pruned copy of the target, draft_layers",
    uses=("draft_model", "draft_layers"),
)
