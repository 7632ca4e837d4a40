"""Hugging Face assisted generation, measured with the same counters as our verification loop.

``target.generate(assistant_model=draft)`` is what most users reach for first when they have a
draft LM (transformers' "assisted generation", Leviathan et al. 2023 with greedy verification).
To compare it with our verification loop (``draftsmith.train.decoding.speculative.generate``) like
for like, this module runs it on one prompt and fills the loop's result type,
:class:`~draftsmith.heads.base.GenerationOutput`:

* ``target_forwards`` counts calls of the target's ``forward`` (a forward pre-hook), prefill
  included, exactly as our loop counts them, so τ means the same thing;
* accepted draft tokens per step come from the target's KV-cache length at consecutive calls:
  between two verification forwards the cache grows by (accepted + 1);
* ``draft_time`` is the time spent inside the draft's ``forward`` (forward hooks).

The draft proposes a constant ``k`` tokens per step (``num_assistant_tokens_schedule="constant"``,
``assistant_confidence_threshold=0``), the same chain length our loop uses; transformers' defaults
(20 tokens, a confidence threshold that early-stops drafting) would compare a different algorithm.

transformers' prompt lookup (``generate(prompt_lookup_num_tokens=k)``, no draft model) is counted
the same way: the reference for our n-gram drafter.

Both are ``--drafter`` kinds (:data:`HF_ASSISTED`, :data:`HF_PROMPT_LOOKUP`) that run their own
loop: :meth:`HFAssisted.generate` takes the verification loop's arguments and is called in its
place (:func:`~draftsmith.heads.base.runs_own_loop`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Collection

import torch
from transformers import PreTrainedModel

from .base import BuildOptions, DrafterKind, GenerationOutput
from .draft_lm import check_vocab_compatible, load_draft_model
from .sampling import SamplingParams


class HFAssisted:
    """A draft LM run through transformers' ``generate(assistant_model=...)``, or its prompt lookup.

    Not a :class:`~draftsmith.heads.base.Drafter`: HF's own loop drafts and verifies, so the
    evaluation calls :meth:`generate` instead of our loop (it has the loop's arguments).

    Args:
        draft: HF causal LM sharing the target's vocabulary (eval mode).
        schedule: ``"constant"`` drafts exactly ``k`` tokens a step (confidence threshold off), the
            same chain our loop drafts; ``"transformers"`` keeps transformers' own draft-length
            heuristics from the draft's generation config (5.24 defaults: up to 20 tokens, stop
            drafting below a confidence of 0.4, the threshold tuned as the run goes).
        lookup_ngram: with ``draft=None``: transformers' prompt lookup instead
            (``generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=lookup_ngram)``,
            which matches the longest suffix of up to ``lookup_ngram`` tokens, down to 1). It
            runs no model, so its ``draft_time`` is 0 (the lookup's time is in the wall time).
        name: how reports call it; default ``hf-assisted``, or ``hf-prompt-lookup[1-N]``.
    """

    def __init__(
        self,
        draft: PreTrainedModel | None,
        schedule: str = "constant",
        lookup_ngram: int | None = None,
        name: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if schedule not in ("constant", "transformers"):
            raise ValueError(f"schedule must be 'constant' or 'transformers', got {schedule!r}")
        if (draft is None) == (lookup_ngram is None):
            raise ValueError("give a draft model or lookup_ngram (prompt lookup), not both")
        self.draft = draft.eval() if draft is not None else None
        self.schedule = schedule
        self.lookup_ngram = lookup_ngram
        # HF's prompt lookup matches suffixes down to 1 token, whatever the longest.
        default = "hf-assisted" if draft is not None else f"hf-prompt-lookup[1-{lookup_ngram}]"
        self.name = name or default
        # Seconds after the device's queued work (evaluate injects a synchronizing timer).
        self.clock = clock

    @torch.no_grad()
    def generate(
        self,
        target: PreTrainedModel,
        prompt_ids: torch.Tensor | list[int],
        *,
        k: int = 5,
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        eos_token_id: int | Collection[int] | None = None,
        generator: torch.Generator | None = None,
        draft_length=None,
    ) -> GenerationOutput:
        """Generate one sequence with HF assisted generation and count what happened.

        Args:
            target: HF causal LM (eval mode).
            prompt_ids: ``[T]`` or ``[1, T]`` prompt tokens (batch 1).
            k: draft tokens per step (constant schedule).
            max_new_tokens: generation budget.
            sampling: greedy by default; temperature/top-k/top-p are passed to HF.
            eos_token_id: token(s) that end generation (kept in the output).
            generator: seeds torch's global RNG when sampling (HF has no generator argument).
            draft_length: ignored: HF has its own schedule (see ``schedule``).

        Returns:
            Tokens and counters; ``accepted_per_position[i]`` (i < k) counts steps that accepted
            more than ``i`` draft tokens, as our loop does for chains.
        """
        if draft_length is not None:
            raise ValueError(
                "hf-assisted drafts a constant k tokens; adaptive draft length is ours"
            )
        sampling = sampling or SamplingParams()
        ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=target.device)
        ids = ids[None] if ids.dim() == 1 else ids
        eos = sorted({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ()))

        draft = self.draft
        if draft is not None:
            gen_cfg = copy.deepcopy(draft.generation_config)
            if self.schedule == "constant":
                gen_cfg.num_assistant_tokens = k
                gen_cfg.num_assistant_tokens_schedule = "constant"
                gen_cfg.assistant_confidence_threshold = 0.0
            saved, draft.generation_config = draft.generation_config, gen_cfg
            candidates = dict(assistant_model=draft)
        else:
            candidates = dict(prompt_lookup_num_tokens=k, max_matching_ngram_size=self.lookup_ngram)

        cache_lengths: list[int] = []  # target KV-cache length at the start of each forward
        fed_lengths: list[int] = []  # tokens fed to each forward
        draft_time = [0.0, 0.0]  # total, start of the current call

        def count_target(_module, args, kwargs):
            fed = kwargs.get("input_ids", args[0] if args else None)
            positions = kwargs.get("position_ids")
            # transformers 5 passes the KV cache as `cache` (4.x: `past_key_values`); the first
            # fed token's position is the cache length either way.
            past = kwargs.get("cache", kwargs.get("past_key_values"))
            if positions is not None:
                cache_lengths.append(int(positions.reshape(-1)[0]))
            else:
                cache_lengths.append(past.get_seq_length() if past is not None else 0)
            fed_lengths.append(fed.shape[1] if fed is not None else 0)

        def draft_start(_module, _args):
            draft_time[1] = self.clock()

        def draft_end(_module, _args, _out):
            draft_time[0] += self.clock() - draft_time[1]

        hooks = [target.register_forward_pre_hook(count_target, with_kwargs=True)]
        if draft is not None:
            hooks += [
                draft.register_forward_pre_hook(draft_start),
                draft.register_forward_hook(draft_end),
            ]
        kwargs = dict(do_sample=False)
        if not sampling.greedy:
            kwargs = dict(
                do_sample=True,
                temperature=sampling.temperature,
                top_k=sampling.top_k or None,
                top_p=sampling.top_p,
            )
            if generator is not None:
                torch.manual_seed(int(generator.initial_seed()))
        try:
            start = self.clock()
            out = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **candidates,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos or None,
                pad_token_id=eos[0] if eos else None,
                **kwargs,
            )
            wall = self.clock() - start
        finally:
            for hook in hooks:
                hook.remove()
            if draft is not None:
                draft.generation_config = saved

        tokens = out[0, ids.shape[1] :].tolist()
        steps = _verification_steps(cache_lengths, fed_lengths, ids.shape[1], len(tokens))
        per_position = [sum(n > i for _, n in steps) for i in range(k)]
        stop = "eos" if tokens and tokens[-1] in eos else "length"
        return GenerationOutput(
            tokens=tokens,
            target_forwards=len(cache_lengths),
            draft_steps=len(steps),
            proposed=sum(c for c, _ in steps),
            accepted=sum(n for _, n in steps),
            accepted_per_position=per_position,
            stop_reason=stop,
            wall_time=wall,
            draft_time=draft_time[0],
        )


def _verification_steps(
    cache_lengths: list[int], fed_lengths: list[int], prompt_len: int, new_tokens: int
) -> list[tuple[int, int]]:
    """(drafted, accepted) per target forward that verified draft tokens.

    Before forward i the sequence holds Q_i tokens: Q_0 = the prompt, and afterwards everything but
    the last emitted token is in the cache, so Q_i = cache_i + 1. Forward i is fed
    ``fed_i = Q_i - cache_i + drafted_i`` tokens and emits ``Q_{i+1} - Q_i = accepted_i + 1``;
    the last forward emits what is left of the output.

    Args:
        cache_lengths: target cache length at the start of each forward.
        fed_lengths: tokens fed to each forward.
        prompt_len: prompt tokens.
        new_tokens: generated tokens.

    Returns:
        One ``(drafted, accepted)`` pair per forward with ``drafted > 0``.
    """
    seq = [prompt_len] + [c + 1 for c in cache_lengths[1:]] + [prompt_len + new_tokens]
    steps = []
    for i, (cache, fed) in enumerate(zip(cache_lengths, fed_lengths, strict=True)):
        drafted = fed - (seq[i] - cache)
        if drafted > 0:
            steps.append((drafted, max(0, min(drafted, seq[i + 1] - seq[i] - 1))))
    return steps


def build_hf_assisted(path: str | None, options: BuildOptions) -> HFAssisted:
    """``hf-assisted[=DIR]``: the draft LM ``draft-lm`` would run, through transformers' loop."""
    model, source = load_draft_model(path, options)
    # Same check DraftLM makes: HF would fail deep inside generate() otherwise.
    check_vocab_compatible(
        model.get_output_embeddings().weight.shape[0],
        options.target.get_output_embeddings().weight.shape[0],
    )
    # transformers' own schedule is another algorithm than a constant k: named apart.
    kind = "hf-assisted-default" if options.hf_assistant == "transformers" else "hf-assisted"
    return HFAssisted(
        model, schedule=options.hf_assistant, name=f"{kind}[{source}]", clock=options.clock
    )


def build_hf_prompt_lookup(path: str | None, options: BuildOptions) -> HFAssisted:
    """``hf-prompt-lookup``: transformers' prompt lookup, suffixes of up to ``ngram_max`` tokens."""
    return HFAssisted(None, lookup_ngram=options.ngram_max, clock=options.clock)


HF_ASSISTED = DrafterKind(
    build_hf_assisted,
    path="optional",
    help="the same draft LM through transformers' generate(assistant_model=...), for comparison",
    uses=("draft_model", "draft_layers"),
)
HF_PROMPT_LOOKUP = DrafterKind(
    build_hf_prompt_lookup,
    help="transformers' prompt lookup, suffixes of up to ngram_max tokens",
)
