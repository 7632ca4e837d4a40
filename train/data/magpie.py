"""Training prompts the project can always make itself: the target writes them ("Magpie").

Launch::

    draftsmith data prompts --output prompts.jsonl --num 2000 --include-shipped
    python -m draftsmith.train.data.magpie --output p.jsonl --num 500 --input mine.jsonl \\
        --exclude ../shared/data/alpaca_2k.jsonl

An instruction-tuned model, fed its chat template up to the start of a *user* turn, continues
with a plausible user message (Magpie: Xu et al. 2024, "Magpie: Alignment Data Synthesis from
Scratch by Prompting Aligned LLMs with Nothing"). The prefix is derived from the tokenizer's own
chat template: a conversation with a sentinel user message (after an optional system prompt) is
rendered and cut at the sentinel, so no role strings live in this code. The message is sampled
until the end-of-turn token (the tokenizer's EOS, the model's generation-config EOS ids, and the
special token the template puts right after a user message).

Generation reuses :func:`draftsmith.train.data.self_distill.generate_batch` (one KV cache per batch;
every row has the same prefix, so there is no padding). Candidate ``i`` is sampled with its own
generator seeded from ``(seed, i)``, so its text does not depend on its batch. Candidates are then
filtered and deduplicated in index order (see :func:`check_text` and :class:`PromptIndex`), which
makes the output a function of the settings alone.

The output is JSON Lines in the ``prompt`` shape that ``draftsmith data distill --input`` reads:
first the prompts of the other sources (the project's shipped training prompts, user files),
deduplicated, then the Magpie prompts::

    {"id": "shipped-0", "prompt": "...", "source": "shipped", "split": "train"}
    {"id": "magpie-0-17", "prompt": "...", "source": "magpie", "seed": 0, "index": 17,
     "split": "train"}

Every record carries ``"split": "train"`` (ids are strings, so the integer-id split rule never
applies), so self-distillation answers all of them.

Resumable like self-distillation: the run holds ``<output>.lock``; each batch's kept prompts are
appended as complete lines and fsync'd, then ``<output>.meta`` records the checkpoint (next
candidate index, per-range filter counts). On restart a half-written last line is cut, and
generation restarts at the batch holding the last Magpie record in the file (or at the meta
checkpoint when the file matches it), so a killed run finishes byte-identical to an
uninterrupted one. Settings that change the prompts are stored in the meta file and a resume with
other values is refused, naming them; ``--num``, ``--batch-size`` and ``--max-attempts`` may
change (a larger ``--num`` extends a run).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from draftsmith.heads.sampling import SamplingParams
from draftsmith.train.config import cfg_field, parse_config
from draftsmith.train.data.prompts import DEFAULT_PROMPTS
from draftsmith.train.data.self_distill import (
    _append,
    _as_list,
    _device_problems,
    _resolve_split,
    _write_meta,
    generate_batch,
)
from draftsmith.train.data.self_distill import (
    _check_meta as _check_distill_meta,
)
from draftsmith.train.data.tokenize import (
    SHAPES,
    Conversation,
    DataFileError,
    TemplateError,
    load_records,
    select_split,
    template_fingerprint,
)
from draftsmith.train.errors import RunError, UsageError, cli_main
from draftsmith.train.runinfo import output_lock
from draftsmith.train.safety import DiskSpaceError, disk_full, ensure_free_space

__all__ = [
    "DEFAULT_SAMPLING",
    "FilterRules",
    "MagpieError",
    "PromptIndex",
    "PromptStats",
    "PromptsConfig",
    "SeedPrompt",
    "UserPrefix",
    "check_text",
    "load_exclusions",
    "load_seed_prompts",
    "main_prompts",
    "make_prompts",
    "normalize",
    "user_turn_prefix",
]

DEFAULT_SAMPLING = SamplingParams(temperature=1.0, top_p=0.95)
"""Magpie samples at temperature 1 (the paper's setting); top-p 0.95 trims the far tail, where a
small model's nonsense lives. Not tuned by measurement here."""

# An alphanumeric sentinel: templates that trim or escape content leave it alone.
_SENTINEL = "magpieSentinel7f3a9c"

# Settings that change which prompts are made: a resumed run must use the same ones. num,
# batch_size and max_attempts may change (batch_size only loses byte-identity with one run).
_STRICT_SETTINGS = (
    "seed",
    "system",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "rules",
    "sources",
    "exclude",
    "model",
    "dtype",
    "template",
)

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


class MagpieError(UsageError):
    """The output cannot be resumed (other settings, a foreign file) or an input is unusable."""


# --------------------------------------------------------------------------------------------
# The user-turn prefix
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Filters and deduplication
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FilterRules:
    """When a generated prompt is dropped. See :func:`check_text` for the order of the checks.

    Attributes:
        min_words: Fewer whitespace-separated words is "too short".
        max_words: More words is "too long".
        min_letter_share: Letters (any script) among non-space characters below this is
            "degenerate: few letters" (symbol soup, numbers only, broken bytes).
        repeat_ngram: ``n`` of the word n-gram repetition check.
        max_repeat_share: Word n-grams that occur at least 3 times covering at least this share
            of the words is "degenerate: repetition" (a looping text).
        near_duplicate: Jaccard similarity of word-trigram sets (normalised text) at or above
            which two prompts are near-duplicates.
    """

    min_words: int = 3
    max_words: int = 200
    min_letter_share: float = 0.5
    repeat_ngram: int = 3
    max_repeat_share: float = 0.5
    near_duplicate: float = 0.7


_WS = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Text for duplicate checks: NFKC, case-folded, punctuation as spaces, spaces collapsed.

    >>> normalize("  What's   the TIME?! ")
    'what s the time'
    """
    text = unicodedata.normalize("NFKC", text).casefold()
    text = "".join(" " if unicodedata.category(c).startswith("P") else c for c in text)
    return _WS.sub(" ", text).strip()


def _repeat_share(words: Sequence[str], n: int) -> float:
    """Share of the words inside a word n-gram that occurs at least 3 times in the text.

    A loop of any period repeats all of its n-grams, so a text that is mostly one looping
    sentence scores near 1; a phrase said twice, or thrice in a long text, scores low.
    """
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    counts = Counter(grams)
    covered = [False] * len(words)
    for i, g in enumerate(grams):
        if counts[g] >= 3:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(words) if words else 0.0


def check_text(text: str, rules: FilterRules, markers: Iterable[str] = ()) -> str | None:
    """Why a finished generated prompt is dropped, or None to keep it.

    Checks, first failing one wins: a marker or special token in the text ("degenerate:
    template marker"); U+FFFD from invalid UTF-8 ("degenerate: broken text"); word count
    ("too short" / "too long"); letter share ("degenerate: few letters"); a repeated word
    n-gram ("degenerate: repetition", on normalised words).

    Args:
        text: The generated user message, end-of-turn token excluded.
        rules: Thresholds.
        markers: Strings that must not occur (see :class:`UserPrefix`).

    Returns:
        The reason, or None.
    """
    if any(m in text for m in markers):
        return "degenerate: template marker"
    if "\ufffd" in text:
        return "degenerate: broken text"
    words = text.split()
    if len(words) < rules.min_words:
        return "too short"
    if len(words) > rules.max_words:
        return "too long"
    chars = [c for c in text if not c.isspace()]
    if sum(c.isalpha() for c in chars) < rules.min_letter_share * len(chars):
        return "degenerate: few letters"
    if _repeat_share(normalize(text).split(), rules.repeat_ngram) >= rules.max_repeat_share:
        return "degenerate: repetition"
    return None


def _shingles(norm: str) -> frozenset[tuple[str, ...]]:
    words = norm.split()
    if len(words) < 3:
        return frozenset([tuple(words)])
    return frozenset(tuple(words[i : i + 3]) for i in range(len(words) - 2))


class PromptIndex:
    """Exact (normalised) and near-duplicate lookup over a growing set of prompts.

    Near-duplicates: the Jaccard similarity of the two prompts' sets of word trigrams, taken on
    :func:`normalize`'d text, is at least ``threshold`` (0.7: roughly, at most one word in ten
    differs; prompts under three words compare as one shingle, i.e. exactly). Candidates are found
    through an inverted index from trigram to prompts, so a check costs the postings of its
    trigrams, not a pass over every prompt.

    Args:
        threshold: Near-duplicate Jaccard threshold in (0, 1]; 1 keeps only the exact check.
    """

    def __init__(self, threshold: float = 0.7) -> None:
        self.threshold = threshold
        self._exact: dict[str, str] = {}
        self._sets: list[frozenset] = []
        self._keys: list[str] = []
        self._postings: dict[tuple[str, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, text: str) -> tuple[str, str] | None:
        """``("duplicate" | "near-duplicate", key of the match)``, or None."""
        norm = normalize(text)
        if norm in self._exact:
            return "duplicate", self._exact[norm]
        if self.threshold >= 1.0:
            return None
        mine = _shingles(norm)
        overlap = Counter(j for s in mine for j in self._postings.get(s, ()))
        for j, common in overlap.items():
            if common / (len(mine) + len(self._sets[j]) - common) >= self.threshold:
                return "near-duplicate", self._keys[j]
        return None

    def add(self, text: str, key: str) -> None:
        """Index ``text`` under ``key`` (no check; call :meth:`match` first)."""
        norm = normalize(text)
        self._exact.setdefault(norm, key)
        sh = _shingles(norm)
        j = len(self._keys)
        self._keys.append(key)
        self._sets.append(sh)
        for s in sh:
            self._postings.setdefault(s, []).append(j)


# --------------------------------------------------------------------------------------------
# Other sources
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeedPrompt:
    """A prompt from another source, written before the Magpie prompts.

    Attributes:
        id: Output id, unique across sources (``"shipped-3"``, ``"input0-17"``).
        prompt: The user message.
        source: ``"shipped"`` or ``"input:<path>"``.
        system: The record's system prompt, if any.
    """

    id: str
    prompt: str
    source: str
    system: str | None = None


def _first_user(conv: Conversation) -> tuple[str, str | None]:
    if conv.text is not None or not conv.messages:
        raise DataFileError(conv.source, f"a {conv.shape!r} record has no user message")
    system = conv.messages[0]["content"] if conv.messages[0]["role"] == "system" else None
    user = next(m["content"] for m in conv.messages if m["role"] == "user")
    return user, system


def load_seed_prompts(
    path: str | Path,
    *,
    id_prefix: str,
    source: str,
    shape: str = "auto",
    skip_invalid: bool = False,
) -> list[SeedPrompt]:
    """The training prompts of a file: its ``train`` split when the records carry one, else all.

    A multi-turn record contributes its first user message (and its system prompt): the output
    is one-turn prompts. Held-out records (``split: heldout`` or integer ids ``% 10 == 9``) are
    never included.

    Args:
        path: Any file or directory :func:`~draftsmith.train.data.tokenize.load_records` reads.
        id_prefix: Prefix of the output ids (``"shipped"``, ``"input0"``).
        source: The records' ``source`` field.
        shape: Record shape, or ``"auto"``.
        skip_invalid: Skip malformed records instead of failing.

    Raises:
        DataFileError: The file is missing or malformed (file, line and field named), or a
            record has no user message.
    """
    convs, _ = load_records(path, shape=shape, skip_invalid=skip_invalid)
    split, _ = _resolve_split(convs, "auto")
    out = []
    for conv in select_split(convs, split):
        user, system = _first_user(conv)
        out.append(SeedPrompt(f"{id_prefix}-{conv.id}", user, source, system))
    return out


def load_exclusions(path: str | Path) -> list[str]:
    """The held-out prompts of a file: split ``heldout`` when the records carry one, else all.

    Every user message of a record counts (a multi-turn evaluation record leaks through any).

    Raises:
        DataFileError: The file is missing or malformed.
    """
    convs, _ = load_records(path)
    if all(c.split is not None for c in convs):
        convs = select_split(convs, "heldout")
    texts = []
    for conv in convs:
        if conv.text is not None:
            texts.append(conv.text)
        texts += [m["content"] for m in conv.messages if m["role"] == "user"]
    return texts


def _fingerprint(items: Any) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------------
# The resumable run
# --------------------------------------------------------------------------------------------


@dataclass
class PromptStats:
    """What one :func:`make_prompts` call did.

    Attributes:
        requested: Magpie prompts asked for (``num``).
        made: Magpie prompts in the output now.
        already_done: Magpie prompts found in the output at start (resume).
        written: Magpie prompts written by this call.
        seeds: Prompts of the other sources in the output.
        seed_dropped: Prompts of the other sources dropped, per reason (duplicates, held-out).
        candidates: Candidates generated by this call.
        generated_tokens: Tokens generated by this call.
        seconds: Wall time of the generation loop.
        counts: Verdicts on every candidate of the run so far, all calls (``"kept"`` and the
            filter reasons).
        counts_complete: False when an earlier call's counts were not recoverable (an output
            cut back behind its meta file); ``counts`` then covers fewer candidates.
        discarded_partial_line: Whether a half-written last line was cut from the output.
        exhausted: The run stopped at ``max_attempts`` before making ``num`` prompts.
    """

    requested: int = 0
    made: int = 0
    already_done: int = 0
    written: int = 0
    seeds: int = 0
    seed_dropped: Counter = field(default_factory=Counter)
    candidates: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    counts: Counter = field(default_factory=Counter)
    counts_complete: bool = True
    discarded_partial_line: bool = False
    exhausted: bool = False

    def summary(self) -> str:
        """A few lines for the terminal."""
        tried = sum(self.counts.values())
        kept = self.counts.get("kept", 0)
        lines = [
            f"magpie prompts: {self.made} of {self.requested} made ({self.written} now, "
            f"{self.already_done} already there); {self.seeds} prompts from other sources",
            f"candidates: {tried} judged, {kept} kept ({100 * kept / max(tried, 1):.1f} %)"
            + ("" if self.counts_complete else " (an earlier run's counts were lost)"),
        ]
        rejected = [(r, n) for r, n in self.counts.most_common() if r != "kept"]
        if rejected:
            lines.append("dropped: " + ", ".join(f"{r}: {n}" for r, n in rejected))
        if self.seed_dropped:
            lines.append(
                "other sources dropped: "
                + ", ".join(f"{r}: {n}" for r, n in self.seed_dropped.most_common())
            )
        if self.seconds > 0:
            lines.append(
                f"generated {self.generated_tokens} tokens for {self.candidates} candidates in "
                f"{self.seconds:.1f} s ({self.generated_tokens / self.seconds:.1f} tok/s)"
            )
        if self.discarded_partial_line:
            lines.append("a half-written last line from an interrupted run was discarded")
        return "\n".join(lines)


def _candidate_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """A generator whose stream depends only on (seed, candidate index)."""
    digest = hashlib.sha256(f"magpie\0{seed}\0{index}".encode()).digest()
    gen = torch.Generator(device=device)
    return gen.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _seed_lines(
    seeds: Sequence[SeedPrompt], excluded: PromptIndex, kept: PromptIndex, dropped: Counter
) -> list[str]:
    """Output lines of the other sources, deduplicated in order; fills ``kept`` and ``dropped``."""
    lines = []
    for s in seeds:
        if excluded.match(s.prompt):
            dropped["held-out"] += 1
            continue
        hit = kept.match(s.prompt)
        if hit:
            dropped[hit[0]] += 1
            continue
        kept.add(s.prompt, s.id)
        record: dict[str, Any] = {"id": s.id, "prompt": s.prompt, "source": s.source}
        if s.system:
            record["system"] = s.system
        record["split"] = "train"
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    return lines


def _read_output(path: Path) -> tuple[list[bytes], bool]:
    """The complete lines of ``path`` (newline kept), cutting a half-written or damaged end."""
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    lines = data[:keep].splitlines(keepends=True)
    if lines:
        try:
            ok = isinstance(json.loads(lines[-1]), dict)
        except (json.JSONDecodeError, UnicodeDecodeError):
            ok = False
        if not ok:  # a damaged last line with its newline: a kill mid-write, too
            keep -= len(lines.pop())
    partial = keep < len(data)
    if partial:
        os.truncate(path, keep)
    return lines, partial


def _parse_magpie(path: Path, lines: Sequence[bytes], first: int) -> list[dict]:
    records = []
    for n, line in enumerate(lines, start=first + 1):
        try:
            rec = json.loads(line)
            ok = (
                isinstance(rec, dict)
                and rec.get("source") == "magpie"
                and isinstance(rec.get("index"), int)
                and isinstance(rec.get("prompt"), str)
            )
        except (json.JSONDecodeError, UnicodeDecodeError):
            ok = False
        if not ok:
            raise MagpieError(
                f"{path}:{n}: not a Magpie prompt record written by draftsmith data prompts; "
                "move the file away or pass --overwrite"
            )
        records.append(rec)
    return records


def _check_meta(meta_path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The stored meta, after checking that its strict settings equal ``settings``'."""
    return _check_distill_meta(meta_path, settings, _STRICT_SETTINGS, MagpieError)


def _progress(enabled: bool, total: int, initial: int) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=min(initial, total),
        unit="prompt",
        desc="magpie prompts",
        dynamic_ncols=True,
    )


def make_prompts(
    model: PreTrainedModel,
    tokenizer: Any,
    output: str | Path,
    *,
    num: int,
    seeds: Sequence[SeedPrompt] = (),
    exclude: Sequence[str] = (),
    system: str | None = None,
    max_new_tokens: int = 96,
    batch_size: int = 32,
    sampling: SamplingParams = DEFAULT_SAMPLING,
    seed: int = 0,
    rules: FilterRules | None = None,
    max_attempts: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    meta: dict[str, Any] | None = None,
    on_batch: Callable[[int], None] | None = None,
    lock: bool = True,
) -> PromptStats:
    """Write ``seeds`` (deduplicated) and then ``num`` filtered Magpie prompts to ``output``.

    Args:
        model: The target (eval mode); it writes the prompts.
        tokenizer: Its tokenizer (chat template, EOS).
        output: JSON Lines output; resumed when it exists (see the module docstring).
        num: Magpie prompts to make (kept after filtering and deduplication); 0 writes only
            the seeds.
        seeds: Prompts of other sources, written first, in order, deduplicated.
        exclude: Held-out prompts: seeds and candidates equal or near-equal to one are dropped.
        system: System prompt rendered before the user turn; written into each Magpie record.
        max_new_tokens: Token budget of one prompt; a prompt without its end-of-turn token by
            then is "unfinished".
        batch_size: Candidates decoded together.
        sampling: Temperature / top-k / top-p (must not be greedy: every candidate would be
            the same).
        seed: Seed of the per-candidate generators.
        rules: Filter thresholds (default :class:`FilterRules`).
        max_attempts: Most candidate indices to use (default ``20 * num + batch_size``).
        overwrite: Start again even when ``output`` exists.
        progress: Show a progress bar (prompts kept, candidates, ETA) on stderr.
        meta: Extra settings stored in ``<output>.meta`` (strict keys among them are checked).
        on_batch: Called with the number of batches done by this call, after each batch is on
            disk (tests use it to simulate a kill).
        lock: Hold ``<output>.lock`` while writing; pass False when the caller holds it.

    Returns:
        Counters of the run.

    Raises:
        MagpieError: The output cannot be resumed (other settings, foreign content).
        TemplateError: The chat template has no usable user turn.
        OutputLockedError: Another process writes ``output`` (its PID is named).
        DiskSpaceError: A batch does not fit on the disk (the output stays resumable).
    """
    if num < 0 or batch_size < 1 or max_new_tokens < 1:
        raise ValueError("num must be >= 0, batch_size and max_new_tokens >= 1")
    if sampling.greedy:
        raise ValueError("Magpie needs sampling (temperature > 0): greedy repeats one prompt")
    rules = rules or FilterRules()
    max_attempts = 20 * num + batch_size if max_attempts is None else max_attempts
    output = Path(output)
    meta_path = output.with_name(output.name + ".meta")
    prefix = user_turn_prefix(tokenizer, system)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and len(prefix.ids) + max_new_tokens > max_pos:
        raise MagpieError(
            f"max_new_tokens: {max_new_tokens} plus the {len(prefix.ids)}-token prefix exceeds "
            f"the model's {max_pos} positions"
        )
    settings = {
        **_settings(seed, system, max_new_tokens, sampling, rules, seeds, exclude),
        "model": str(getattr(model.config, "_name_or_path", "")),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "template": template_fingerprint(tokenizer),
        "num": num,
        "batch_size": batch_size,
        "max_attempts": max_attempts,
        **(meta or {}),
    }
    stats = PromptStats(requested=num)

    guard = output_lock(output, "prompts run") if lock else contextlib.nullcontext()
    with guard:
        # --- what the output holds -------------------------------------------------------------
        if overwrite:
            output.unlink(missing_ok=True)
        checkpoint: dict[str, Any] = {}
        lines: list[bytes] = []
        if output.exists():
            if not meta_path.exists():
                raise MagpieError(
                    f"{output} exists but has no {meta_path.name} (not written by draftsmith "
                    "data prompts?); move it away or pass --overwrite"
                )
            checkpoint = _check_meta(meta_path, settings).get("progress") or {}
            lines, stats.discarded_partial_line = _read_output(output)
        output.parent.mkdir(parents=True, exist_ok=True)

        excluded, kept = PromptIndex(rules.near_duplicate), PromptIndex(rules.near_duplicate)
        for text in exclude:
            excluded.add(text, "held-out")
        seed_lines = [x.encode() for x in _seed_lines(seeds, excluded, kept, stats.seed_dropped)]
        stats.seeds = len(seed_lines)
        n_seeds_there = min(len(lines), len(seed_lines))
        if lines[:n_seeds_there] != seed_lines[:n_seeds_there]:
            raise MagpieError(
                f"{output} does not start with the prompts of the given sources; move it away "
                "or pass --overwrite"
            )
        magpie = _parse_magpie(output, lines[len(seed_lines) :], len(seed_lines))
        for rec in magpie:
            kept.add(rec["prompt"], rec["id"])
        in_file = {rec["index"] for rec in magpie}
        last_written = max(in_file, default=-1)
        stats.already_done = len(magpie)

        # --- where to start --------------------------------------------------------------------
        # At the checkpoint when the file matches it; else at the batch holding the last Magpie
        # record, regenerated whole so that its candidates see the batch they saw before (the
        # file may be ahead of the checkpoint, or cut behind it).
        ranges = checkpoint.get("ranges", [])
        if (
            checkpoint.get("last_written") == last_written
            and checkpoint.get("next_index", 0) > last_written
        ):
            start = int(checkpoint["next_index"])
        else:
            start = max(last_written, 0) // batch_size * batch_size
        ranges = [r for r in ranges if r[1] <= start]
        stats.counts_complete = sum(r[1] - r[0] for r in ranges) == start
        for r in ranges:
            stats.counts.update(r[2])
        stats.made = sum(1 for i in in_file if i < start)
        resumed_last = last_written

        def save_checkpoint(next_index: int, complete: bool) -> None:
            state = {"next_index": next_index, "last_written": last_written, "ranges": ranges}
            _write_meta(meta_path, {"settings": settings, "complete": complete, "progress": state})

        save_checkpoint(start, False)
        device = next(model.parameters()).device
        eos = prefix.stop_ids | {int(e) for e in _as_list(model.generation_config.eos_token_id)}
        if not eos:
            raise MagpieError(
                "the tokenizer and the model define no end-of-turn token, so a user message "
                "never ends; Magpie needs a chat model whose template closes turns with one"
            )
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        bar = _progress(progress, num, stats.made)
        t0 = time.perf_counter()
        index, batches = start, 0
        try:
            fd = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                missing = b"".join(seed_lines[n_seeds_there:])
                if missing:  # the sources' block, whole, before any Magpie prompt
                    ensure_free_space(output.parent, len(missing))
                    _write_synced(fd, missing, output)
                while stats.made < num and index < max_attempts:
                    n = min(batch_size, max_attempts - index)
                    # Checked before generating, so a full disk costs no generation time.
                    ensure_free_space(output.parent, n * (max_new_tokens * 16 + 256))
                    outs = generate_batch(
                        model,
                        [prefix.ids] * n,
                        max_new_tokens=max_new_tokens,
                        sampling=sampling,
                        eos_token_id=eos,
                        pad_token_id=pad,
                        generators=[
                            _candidate_generator(seed, index + j, device) for j in range(n)
                        ],
                    )
                    verdicts: Counter = Counter()
                    new_lines = []
                    end = index
                    for j, out in enumerate(outs):
                        if stats.made >= num:
                            break  # the rest of this batch stays unjudged (a later --num may)
                        i = index + j
                        end = i + 1
                        stats.candidates += 1
                        stats.generated_tokens += len(out.tokens)
                        reason, text = _judge(out, tokenizer, prefix, rules, excluded, kept)
                        # Candidates judged before the interruption keep their verdict: the
                        # file already says which were kept.
                        if i in in_file:
                            reason = None
                        elif i <= resumed_last:
                            reason = reason or "not reproduced on resume"
                        if reason:
                            verdicts[reason] += 1
                            continue
                        verdicts["kept"] += 1
                        stats.made += 1
                        if i in in_file:
                            continue
                        rid = f"magpie-{seed}-{i}"
                        kept.add(text, rid)
                        record: dict[str, Any] = {
                            "id": rid,
                            "prompt": text,
                            "source": "magpie",
                            "seed": seed,
                            "index": i,
                        }
                        if system:
                            record["system"] = system
                        record["split"] = "train"
                        new_lines.append(json.dumps(record, ensure_ascii=False) + "\n")
                        last_written = i
                    _write_synced(fd, "".join(new_lines).encode(), output)
                    stats.written += len(new_lines)
                    stats.counts.update(verdicts)
                    ranges.append([index, end, dict(verdicts)])
                    index = end
                    save_checkpoint(index, stats.made >= num)
                    batches += 1
                    if bar is not None:
                        bar.update(verdicts["kept"])
                        tried = sum(stats.counts.values())
                        share = 100 * stats.counts.get("kept", 0) / max(tried, 1)
                        bar.set_postfix_str(f"{tried} tried, {share:.0f} % kept")
                    if on_batch is not None:
                        on_batch(batches)
            finally:
                os.close(fd)
        finally:
            stats.seconds = time.perf_counter() - t0
            if bar is not None:
                bar.close()
        stats.exhausted = stats.made < num
        save_checkpoint(index, not stats.exhausted)
        return stats


def _settings(
    seed: int,
    system: str | None,
    max_new_tokens: int,
    sampling: SamplingParams,
    rules: FilterRules,
    seeds: Sequence[SeedPrompt],
    exclude: Sequence[str],
) -> dict[str, Any]:
    """The strict settings that do not need the model (the CLI checks them before loading it)."""
    return {
        "seed": seed,
        "system": system,
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "rules": asdict(rules),
        "sources": _fingerprint([asdict(s) for s in seeds]),
        "exclude": _fingerprint(sorted(exclude)),
    }


def _write_synced(fd: int, data: bytes, output: Path) -> None:
    """Append ``data`` and fsync; on failure cut back to where it started (stays resumable)."""
    if not data:
        return
    pos = os.lseek(fd, 0, os.SEEK_END)
    try:
        _append(fd, data)
        os.fsync(fd)
    except OSError as exc:
        os.ftruncate(fd, pos)
        if disk_full(exc):
            raise DiskSpaceError(output.parent, len(data)) from exc
        raise


def _judge(
    out: Any,
    tokenizer: Any,
    prefix: UserPrefix,
    rules: FilterRules,
    excluded: PromptIndex,
    kept: PromptIndex,
) -> tuple[str | None, str]:
    """``(reason to drop or None, the prompt text)`` for one generated candidate."""
    if out.stop_reason != "eos":
        return "unfinished", ""
    # Special tokens kept, so a generated <|im_start|> is seen by the marker check.
    raw = tokenizer.decode(
        out.tokens[:-1], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    text = raw.strip()
    reason = check_text(text, rules, prefix.markers)
    if reason:
        return reason, text
    if excluded.match(text):
        return "held-out", text
    hit = kept.match(text)
    return (hit[0] if hit else None), text


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


@dataclass
class PromptsConfig:
    """Settings of a prompt-making run (``draftsmith data prompts``)."""

    output: Path = cfg_field(help="output JSON Lines file of prompt records (resumed if it exists)")
    num: int = cfg_field(
        1000, help="Magpie prompts to make, after filters and dedupe (0: only combine)", ge=0
    )
    include_shipped: bool = cfg_field(
        False, help="add the project's shipped training prompts (train split of chat_prompts)"
    )
    input: list[Path] | None = cfg_field(
        None, help="your prompt files to add (train split when the records carry one)"
    )
    exclude: list[Path] | None = cfg_field(
        None,
        help="held-out files: prompts equal or near-equal to theirs are dropped (their heldout "
        "split when they carry one); the shipped held-out prompts are always excluded",
    )
    shape: str = cfg_field("auto", help="record shape of --input files", choices=["auto", *SHAPES])
    skip_invalid: bool = cfg_field(False, help="skip malformed --input records (counted)")
    system: str | None = cfg_field(
        None, help="system prompt before the user turn (steers topics; kept in the records)"
    )
    target: str | None = cfg_field(
        None, help="target: a local HF model dir, a .gguf file, or None for SmolLM2-135M-Instruct"
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    dtype: str = cfg_field(
        "float32", help="weights dtype", choices=["float32", "bfloat16", "float16"]
    )
    device: str = cfg_field("auto", help="cpu, cuda, cuda:1, ...; auto = cuda when available")
    max_new_tokens: int = cfg_field(96, help="token budget of one prompt", ge=1)
    batch_size: int = cfg_field(32, help="candidates decoded together", ge=1)
    temperature: float = cfg_field(
        DEFAULT_SAMPLING.temperature, help="sampling temperature (> 0)", gt=0
    )
    top_k: int = cfg_field(0, help="top-k sampling (0 = off)", ge=0)
    top_p: float = cfg_field(DEFAULT_SAMPLING.top_p, help="nucleus sampling mass", gt=0, le=1)
    seed: int = cfg_field(0, help="seed of the per-candidate sampling generators")
    min_words: int = cfg_field(FilterRules.min_words, help="drop prompts with fewer words", ge=1)
    max_words: int = cfg_field(FilterRules.max_words, help="drop prompts with more words", ge=1)
    max_attempts: int | None = cfg_field(
        None, help="stop after this many candidates; none = 20 x num + batch size", ge=1
    )
    overwrite: bool = cfg_field(False, help="start again even when the output exists")
    threads: int | None = cfg_field(None, help="torch CPU threads; none = torch's choice")
    progress: bool = cfg_field(True, help="show a progress bar")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.max_words < self.min_words:
            problems.append(
                ("max_words", f"must be >= min_words ({self.min_words}), got {self.max_words}")
            )
        if self.shape == "text":
            problems.append(("shape", "text records have no user message"))
        problems += _device_problems(self.device)
        return problems


def main_prompts(argv: list[str] | None = None) -> int:
    """CLI entry point: ``draftsmith data prompts --output OUT [--num N] [options]``.

    Args:
        argv: Arguments without the program/subcommand name; ``None`` means ``sys.argv[1:]``.

    Returns:
        Exit code: 0 done; 2 bad config, input or output state; 1 the run failed (target,
        another process writing the output, disk full, ``max_attempts`` reached first).
    """
    return cli_main(_main_prompts, argv)


def _main_prompts(argv: list[str]) -> int:
    from draftsmith.train.target.load import load_target

    cfg = parse_config(
        PromptsConfig,
        argv,
        prog="draftsmith data prompts",
        description="Make training prompts: the target writes user messages (Magpie), plus the "
        "shipped prompts and your files, deduplicated.",
    )
    # Sources are read before the (slow) model load, so a typo fails in a second.
    seeds: list[SeedPrompt] = []
    if cfg.include_shipped:
        seeds += load_seed_prompts(DEFAULT_PROMPTS, id_prefix="shipped", source="shipped")
    for j, path in enumerate(cfg.input or []):
        seeds += load_seed_prompts(
            path,
            id_prefix=f"input{j}",
            source=f"input:{path}",
            shape=cfg.shape,
            skip_invalid=cfg.skip_invalid,
        )
    exclude = load_exclusions(DEFAULT_PROMPTS)
    for path in cfg.exclude or []:
        exclude += load_exclusions(path)
    if cfg.num == 0 and not seeds:
        raise UsageError("num: 0 and no other source (--include-shipped, --input): nothing to do")

    rules = FilterRules(min_words=cfg.min_words, max_words=cfg.max_words)
    sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    # Taken before the model load: a second run into this output is refused at once.
    with output_lock(cfg.output, "prompts run"):
        # A resume with other settings fails here, before the model load (make_prompts checks
        # the model, dtype and template too).
        meta_path = cfg.output.with_name(cfg.output.name + ".meta")
        if cfg.output.exists() and not cfg.overwrite and meta_path.exists():
            early = _settings(
                cfg.seed, cfg.system, cfg.max_new_tokens, sampling, rules, seeds, exclude
            )
            _check_meta(meta_path, early)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device = cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model, tokenizer = load_target(
            cfg.target, cache_dir=cfg.cache_dir, dtype=getattr(torch, cfg.dtype), device=device
        )
        stats = make_prompts(
            model,
            tokenizer,
            cfg.output,
            num=cfg.num,
            seeds=seeds,
            exclude=exclude,
            system=cfg.system,
            max_new_tokens=cfg.max_new_tokens,
            batch_size=cfg.batch_size,
            sampling=sampling,
            seed=cfg.seed,
            rules=rules,
            max_attempts=cfg.max_attempts,
            overwrite=cfg.overwrite,
            progress=cfg.progress,
            meta={"target": cfg.target},
            lock=False,
        )
    print(stats.summary())
    if stats.exhausted:
        raise RunError(
            f"made {stats.made} of {stats.requested} Magpie prompts before max_attempts "
            f"({cfg.max_attempts or 20 * cfg.num + cfg.batch_size} candidates); the output is "
            f"valid and resumable: rerun with a larger --max-attempts, looser --min-words/"
            f"--max-words, or a smaller --num"
        )
    print(
        f"{cfg.output}: {stats.seeds + stats.made} prompts; answer them with: "
        f"draftsmith data distill --input {cfg.output} --output <answers.jsonl>"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main_prompts())
