"""Chat templates and loss masks: render a conversation with the target's template, mask it.

**Loss mask convention**: ``loss_mask[t] == 1`` means token ``t`` is a training target (the
model is trained to predict it from the tokens before it). For chat records exactly the tokens
the assistant produced are targets: each assistant turn's content and its end-of-turn token
(e.g. ``<|im_end|>``); never the turn header (``<|im_start|>assistant\\n``), never system or
user turns, never template glue after the end-of-turn token. How the span is derived from the
template is described in :func:`tokenize_conversation`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import UsageError

__all__ = [
    "TemplateError",
    "chat_token_ids",
    "end_of_turn_ids",
    "template_fingerprint",
    "tokenize_chat",
    "tokenize_conversation",
    "tokenize_text",
]


class TemplateError(UsageError):
    """The chat template cannot yield an assistant mask (or failed on a conversation): exit 2."""


def chat_token_ids(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]``.
        add_generation_prompt: Append the assistant turn header (for generation).

    Returns:
        A flat list of ids (transformers 5's BatchEncoding and 4.x's list both handled).

    Raises:
        TemplateError: No chat template, or the template raised.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(
            "the tokenizer has no chat template (use the chat/instruct variant of the model, "
            "or set tokenizer.chat_template)"
        )
    try:
        out = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=True
        )
    except Exception as exc:  # jinja errors, raise_exception() in templates, ...
        raise TemplateError(f"the chat template failed: {exc}") from exc
    return _token_ids(out)


def _token_ids(out: Any) -> list[int]:
    """Flat token ids from whatever ``apply_chat_template(tokenize=True)`` returned.

    transformers 5 returns a BatchEncoding by default; 4.x returns a list (or a tensor); either
    may hold a batch of one.
    """
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if len(out) == 1 and isinstance(out[0], (list, tuple)):  # a batch of one
        out = list(out[0])
    return [int(t) for t in out]


def _chat_text(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool
) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:
        raise TemplateError(f"the chat template failed: {exc}") from exc


_GEN_PROMPT_CACHE: dict[str, bool] = {}


def _has_generation_prompt(tokenizer: Any) -> bool:
    """Whether ``add_generation_prompt=True`` adds anything (cached per template)."""
    key = str(tokenizer.chat_template)
    if key not in _GEN_PROMPT_CACHE:
        probe = [{"role": "user", "content": "x"}]
        with_prompt = _chat_text(tokenizer, probe, add_generation_prompt=True)
        without = _chat_text(tokenizer, probe, add_generation_prompt=False)
        _GEN_PROMPT_CACHE[key] = with_prompt != without
    return _GEN_PROMPT_CACHE[key]


def end_of_turn_ids(tokenizer: Any, extra: Iterable[int] | None) -> set[int]:
    """The tokenizer's EOS id plus ``extra``: the tokens that end an assistant turn."""
    ids = {int(i) for i in (extra or ())}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _is_prefix(prefix: Sequence[int], full: Sequence[int]) -> bool:
    return len(prefix) <= len(full) and list(full[: len(prefix)]) == list(prefix)


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    *,
    max_length: int | None,
    eos_token_ids: Iterable[int] | None = None,
    open_ended: bool = False,
) -> dict[str, list[int]] | None:
    """Tokenize a conversation with its chat template and mask all but the assistant's tokens.

    How the mask is derived from the template itself (no header strings are hard-coded): for
    each assistant message ``i``, the conversation up to message ``i - 1`` is rendered with
    ``add_generation_prompt=True`` (ending in the assistant header) and up to message ``i``
    without it; the tokens between the two lengths are what the assistant turn added after its
    header. Both renderings must be token prefixes of the full conversation's rendering. The
    span is then cut after its last end-of-turn token (the tokenizer's EOS, plus
    ``eos_token_ids``), because what follows it -- e.g. ChatML's ``"\\n"`` -- is template glue
    that generation never produces. Without an EOS in the span the whole span is supervised.

    Fallbacks: when a prefix rendering is not a token prefix (a BPE merge across the header /
    content boundary), the span is taken in characters from the rendered texts and mapped to
    tokens with ``return_offsets_mapping`` (a token straddling the boundary belongs to the
    header). When the template ignores ``add_generation_prompt``, the content is located in
    the text of the turn.

    Args:
        tokenizer: A Hugging Face (fast) tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]`` (a record's
            :attr:`~draftsmith.train.data.records.Conversation.messages`).
        max_length: Keep at most this many tokens (the first ones); ``None`` keeps all.
        eos_token_ids: Extra end-of-turn token ids (e.g. the model's generation config EOS).
        open_ended: The assistant turns were cut off (a truncated self-distilled record): their
            end-of-turn token, which the template adds but the model never generated, is left
            unsupervised along with the glue after it.

    Returns:
        ``{"input_ids": [T] ints, "loss_mask": [T] 0/1 ints}``, or ``None`` when no supervised
        token is left (no assistant turn, or truncated away).

    Raises:
        TemplateError: The template failed, or renders a conversation prefix differently from
            the same messages inside the full conversation (the message says which).
    """
    result = tokenize_chat(
        tokenizer, messages, max_length, end_of_turn_ids(tokenizer, eos_token_ids), open_ended
    )
    return result[0]


def tokenize_text(
    tokenizer: Any, text: str, *, max_length: int | None
) -> dict[str, list[int]] | None:
    """Tokenize plain text; every token is supervised.

    The tokenizer's own special tokens are added (e.g. a BOS for tokenizers that add one); no
    EOS is appended.

    Args:
        tokenizer: A Hugging Face tokenizer.
        text: The text.
        max_length: Keep at most this many tokens; ``None`` keeps all.

    Returns:
        ``{"input_ids": [T], "loss_mask": [T] all 1}``, or ``None`` for no tokens.
    """
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if max_length is not None:
        ids = ids[:max_length]
    return {"input_ids": ids, "loss_mask": [1] * len(ids)} if ids else None


def tokenize_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    max_length: int | None,
    eos: set[int],
    open_ended: bool = False,
) -> tuple[dict[str, list[int]] | None, str | None, int]:
    """:func:`tokenize_conversation` with the bookkeeping a dataset build needs.

    Args:
        tokenizer: A Hugging Face (fast) tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]``.
        max_length: Keep at most this many tokens; ``None`` keeps all.
        eos: End-of-turn token ids (see :func:`end_of_turn_ids`).
        open_ended: The assistant turns were cut off (see :func:`tokenize_conversation`).

    Returns:
        ``(sample or None, drop reason or None, untruncated length)``; the reason is
        ``"no assistant turn"`` or ``"no supervised token after truncation"``.
    """
    full = chat_token_ids(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(full)
    gen_prompt = _has_generation_prompt(tokenizer)
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        span = None
        if gen_prompt:
            head = chat_token_ids(tokenizer, messages[:i], add_generation_prompt=True)
            upto = (
                full
                if i == last
                else chat_token_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
            )
            if _is_prefix(head, full) and _is_prefix(upto, full) and len(head) <= len(upto):
                span = (len(head), len(upto))
        if span is None:
            span = _char_span(tokenizer, messages, i, gen_prompt, len(full))
        start, end = span
        # Cut after the last end-of-turn token: the rest is glue the model never generates.
        # An open-ended (truncated) turn never produced its end-of-turn token: cut before it.
        for j in range(end - 1, start - 1, -1):
            if full[j] in eos:
                end = j if open_ended else j + 1
                break
        for j in range(start, end):
            mask[j] = 1
    length = len(full)
    if not any(mask):
        return None, "no assistant turn", length
    if max_length is not None and length > max_length:
        full, mask = full[:max_length], mask[:max_length]
        if not any(mask):
            return None, "no supervised token after truncation", length
    return {"input_ids": full, "loss_mask": mask}, None, length


def _char_span(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], i: int, gen_prompt: bool, n_full: int
) -> tuple[int, int]:
    """Assistant turn ``i``'s token span, from character offsets of the rendered text."""
    full_text = _chat_text(tokenizer, messages, add_generation_prompt=False)
    head_text = _chat_text(tokenizer, messages[:i], add_generation_prompt=gen_prompt)
    upto_text = _chat_text(tokenizer, messages[: i + 1], add_generation_prompt=False)
    for name, part in (("up to the turn before", head_text), ("up to and with", upto_text)):
        if not full_text.startswith(part):
            k = next(
                (j for j, (a, b) in enumerate(zip(part, full_text, strict=False)) if a != b),
                min(len(part), len(full_text)),
            )
            raise TemplateError(
                f"cannot derive the assistant mask: the chat template renders the conversation "
                f"{name} assistant message {i} differently from the same messages inside the "
                f"full conversation (first difference at character {k}: "
                f"{part[max(0, k - 20) : k + 20]!r} vs {full_text[max(0, k - 20) : k + 20]!r}). "
                "The template is not prefix-stable (it rewrites earlier turns depending on what "
                "follows), so masks derived from it would be wrong."
            )
    start_char, end_char = len(head_text), len(upto_text)
    if not gen_prompt:
        # The turn's text includes its header; the content starts where the content is found.
        content = str(messages[i]["content"]).strip()
        k = full_text.find(content, start_char, end_char) if content else -1
        if k < 0:
            raise TemplateError(
                "cannot derive the assistant mask: the chat template ignores "
                "add_generation_prompt (so the assistant header cannot be told from the "
                f"answer) and assistant message {i}'s content was not found in its rendering"
            )
        start_char = k
    try:
        enc = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as exc:  # slow tokenizers have no offsets
        raise TemplateError(
            "cannot derive the assistant mask: a conversation prefix is not a token prefix of "
            "the full conversation and the tokenizer gives no offsets (use a fast tokenizer)"
        ) from exc
    offsets = enc["offset_mapping"]
    if len(offsets) != n_full:
        raise TemplateError(
            "cannot derive the assistant mask: tokenizing the rendered text gives "
            f"{len(offsets)} tokens, apply_chat_template gives {n_full}"
        )
    # A token belongs to the turn when it starts inside the turn's characters; a token that
    # straddles the start (header merged with the first content characters) stays unsupervised.
    inside = [j for j, (s, _) in enumerate(offsets) if start_char <= s < end_char]
    if not inside:
        return (0, 0)
    return inside[0], inside[-1] + 1


def template_fingerprint(tokenizer: Any) -> str:
    """A hash identifying everything about a tokenizer that decides tokenized training data.

    sha256 over the chat template, the vocabulary size (``len(tokenizer)``, added tokens
    included) and the special tokens with their ids. Stored by the hidden-state cache and
    self-distillation so data made with another template or vocabulary is refused.

    Args:
        tokenizer: A Hugging Face tokenizer.

    Returns:
        64 hex characters.
    """
    specials = {}
    for tok in sorted(set(getattr(tokenizer, "all_special_tokens", []) or [])):
        specials[tok] = tokenizer.convert_tokens_to_ids(tok)
    payload = {
        "chat_template": getattr(tokenizer, "chat_template", None),
        "vocab_size": len(tokenizer),
        "special_tokens": specials,
        "eos_token_id": getattr(tokenizer, "eos_token_id", None),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
