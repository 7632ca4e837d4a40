"""Where a user message begins, from the chat template: what Magpie generation starts from.

An instruction-tuned model, fed its chat template up to the start of a *user* turn, continues
with a plausible user message (Magpie: Xu et al. 2024, "Magpie: Alignment Data Synthesis from
Scratch by Prompting Aligned LLMs with Nothing"). The prefix is derived from the tokenizer's own
chat template: a conversation with a sentinel user message (after an optional system prompt) is
rendered and cut at the sentinel, so no role strings live in this code. The message is sampled
until the end-of-turn token (the tokenizer's EOS, the model's generation-config EOS ids, and the
special token the template puts right after a user message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..data.chat import TemplateError

__all__ = ["UserPrefix", "user_turn_prefix"]

# An alphanumeric sentinel: templates that trim or escape content leave it alone.
_SENTINEL = "magpieSentinel7f3a9c"

# Chat-format markers of common templates. A prompt containing one is the model writing a whole
# dialogue (or template glue), not a user message.
_KNOWN_MARKERS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|end|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "[INST]",
    "[/INST]",
    "<<SYS>>",
    "</s>",
    "### Instruction:",
    "### Response:",
)


@dataclass
class UserPrefix:
    """What generation starts from, derived from the chat template.

    Attributes:
        text: The rendered template up to where a user message's content begins.
        ids: ``text`` tokenized (special tokens parsed, none added).
        stop_ids: Tokens that end a user message: the tokenizer's EOS, plus the special token
            the template writes right after a user message (when it is one).
        markers: Strings that must not appear in a generated prompt: the tokenizer's special
            tokens, common chat markers, and the template's own role headers when they contain
            punctuation (``"User:"`` yes, a bare ``"user"`` no).
        token_prefix: Whether ``ids`` is a token prefix of the full rendering; when False a BPE
            merge crosses the boundary and the model starts from a tokenization it rarely saw.
    """

    text: str
    ids: list[int]
    stop_ids: set[int]
    markers: tuple[str, ...]
    token_prefix: bool


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(
            "the tokenizer has no chat template (Magpie needs the chat/instruct variant of the "
            "model, or set tokenizer.chat_template)"
        )
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )
    except Exception as exc:  # jinja errors, raise_exception() in templates
        raise TemplateError(f"the chat template failed: {exc}") from exc


def _encode(tokenizer: Any, text: str) -> list[int]:
    # The rendered text already holds the template's BOS and markers as text: parse them as
    # special tokens, add nothing.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _special_strings(tokenizer: Any) -> set[str]:
    out = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            out.add(str(tok.content))
    return {s for s in out if s}


def user_turn_prefix(tokenizer: Any, system: str | None = None) -> UserPrefix:
    """The chat template rendered up to the start of a user message's content.

    A conversation ``[system?, user=<sentinel>]`` is rendered without a generation prompt and cut
    at the sentinel. A template that injects a default system prompt (SmolLM2's) keeps it, as it
    would in a real conversation.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template.
        system: Optional system prompt rendered before the user turn.

    Returns:
        The prefix text and ids, the user turn's stop tokens and the forbidden markers.

    Raises:
        TemplateError: No chat template, the template failed, or it does not show the user's
            message verbatim exactly once.
    """
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": _SENTINEL})
    full = _render(tokenizer, messages, False)
    if full.count(_SENTINEL) != 1:
        raise TemplateError(
            "the chat template does not render a user message verbatim exactly once, so the "
            "start of a user turn cannot be found"
        )
    text, after = full.split(_SENTINEL)
    ids = _encode(tokenizer, text)
    token_prefix = _encode(tokenizer, full)[: len(ids)] == ids

    specials = _special_strings(tokenizer)
    stop_ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    after_ids = _encode(tokenizer, after)
    if after_ids and tokenizer.convert_ids_to_tokens(after_ids[0]) in specials:
        stop_ids.add(int(after_ids[0]))  # e.g. Llama 3's <|eot_id|>, ChatML's <|im_end|>

    # Role headers: the last line of the user prefix, and what the generation prompt adds.
    with_gen = _render(tokenizer, messages, True)
    headers = [text.rstrip("\n").rsplit("\n", 1)[-1], with_gen[len(full) :]]
    derived = {
        h.strip()
        for h in headers
        if h.strip() and any(not (c.isalnum() or c.isspace()) for c in h.strip())
    }
    markers = tuple(sorted(specials | set(_KNOWN_MARKERS) | derived))
    return UserPrefix(text, ids, stop_ids, markers, token_prefix)
