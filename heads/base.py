"""The contract between drafters and the speculative verification loop.

The loop (``draftsmith.train.decoding.speculative``) owns the target, its KV cache, sampling and
acceptance. A drafter only proposes tokens and keeps its own state in step with what was accepted.
The loop never asks which kind of drafter it runs; adding a drafter never changes the loop.

Call order for one sequence::

    drafter.start(prompt_ids, features)             # once; features of the prompt positions
    loop:
        proposal = drafter.propose(ids, k, sampling, generator)
        ... target verifies proposal in one forward ...
        drafter.accept(num_accepted, features)     # features of the newly verified, kept positions

``ids`` always holds the accepted sequence: the prompt followed by every emitted token. Its last
token is the one the target has just produced (the target has not yet run on it). ``features`` are
the target's hidden states at every position of ``ids`` except that last one, delivered
incrementally: the prompt's at ``start`` and, after each verification, those of the positions the
step kept (the previous last token plus the accepted draft tokens). They come from the verification
forward itself -- no extra target pass (EAGLE §3; Medusa §2.1 use the same hidden states).

Building and naming (``heads/registry.py``): each drafter module declares the ``--drafter`` kinds
it serves as :class:`DrafterKind` values -- a builder taking the spec's path and the run's
:class:`BuildOptions`, and whether a path is required -- and every object a builder returns
carries a ``name`` (how reports call the method). A reference drafter that decodes in its own loop
instead of proposing to ours (transformers' assisted generation) has a ``generate`` method taking
the loop's keyword arguments and returning a :class:`GenerationOutput`, used in place of the loop
(:func:`runs_own_loop`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from .sampling import SamplingParams

# Target hidden states keyed by layer index in HF's ``output_hidden_states`` convention:
# 0 = embedding output (input to layer 0), i = output of layer i-1 (= input to layer i),
# num_layers = final output after the model's last norm. Each tensor is ``[1, n, H]``.
Features = dict[int, torch.Tensor]


@dataclass
class Proposal:
    """Tokens a drafter proposes for one verification step.

    Attributes:
        tokens: ``[n]`` long, ``0 <= n <= k``. n = 0 means "no guess": the step becomes a plain
            decoding step.
        probs: ``[n, V]`` float, the processed draft distribution q each token was sampled from
            (row i is q for ``tokens[i]``), given everything drawn before it: for a chain, the
            tokens before it; for a tree, its path and its earlier siblings. Siblings drawn
            i.i.d. (with replacement) share one row; siblings drawn without replacement carry q
            with the earlier siblings' tokens zeroed and renormalised. The loop's acceptance is
            lossless only if each row is the distribution its token was really drawn from. None
            means the drafter is deterministic (q is one-hot on each token: its candidates are a
            function of ``ids`` alone), as for n-gram lookup, greedy drafting or top-k trees.
        parents: ``[n]`` long, tree drafts only: index of each node's parent in ``tokens``, -1 for
            children of the root (the last accepted token). Parents come before children. None
            means a chain (node i's parent is i-1).
        priority: ``[n]`` long, optional, tree drafts only: each node's rank in the drafter's
            own order of confidence (0 = most confident), such that the best m nodes of every m
            contain each other's parents, as EAGLE-2's reranking keeps them (§4.2). The loop
            then also counts what each smaller tree of the best m nodes would have accepted
            (``GenerationOutput.accepted_by_tree_size``), from which the bench predicts the best
            tree size. None: no such order (a static tree).
        confidence: ``[n]`` float, optional: the drafter's own probability of each node given
            its path (its parent accepted), on its processed distribution: for a node chosen by
            argmax or top-k, the probability of that token; for a node *sampled* from ``probs``,
            the row's largest probability, which is known before the draw (a choice of what to
            verify that read the drawn token's own q would bias the output: docs/design.md,
            "What to verify, per step"). The per-step decision (:mod:`.auto`) maps it to an
            acceptance probability through a calibration. None: the drafter gives none.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    priority: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@runtime_checkable
class Drafter(Protocol):
    """What the verification loop needs from a drafter."""

    #: Target hidden-state layers this drafter needs (see :data:`Features`); empty for none.
    feature_layers: tuple[int, ...]

    def start(self, prompt_ids: torch.Tensor, features: Features | None) -> None:
        """Begin a new sequence.

        Args:
            prompt_ids: ``[1, T]`` prompt tokens (without the first generated token).
            features: target hidden states over the T prompt positions, or None if not requested.
        """
        ...

    def propose(
        self,
        ids: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Propose up to k tokens to follow ``ids``.

        Args:
            ids: ``[1, T]`` accepted sequence (prompt + emitted tokens).
            k: most tokens to propose (chain length, or tree depth for tree drafters).
            sampling: the run's sampling parameters; a sampling drafter samples from its processed
                distribution and returns it as ``probs``.
            generator: randomness shared with the loop, for reproducible runs.
        """
        ...

    def accept(self, num_accepted: int, features: Features | None) -> None:
        """Learn the outcome of the last verification.

        Called after every target forward, also after steps where ``propose`` was not called
        (the budget or an adaptive draft length allowed no draft); ``num_accepted`` is then 0 and
        ``features`` cover just the one position the step verified.

        Args:
            num_accepted: how many proposed tokens the target accepted (for a tree: the length
                of the accepted path). The token the target emitted after them arrives as the
                last element of ``ids`` at the next ``propose``.
            features: target hidden states at the kept positions: ``[1, num_accepted + 1, H]``
                per layer (the previous last token, then the accepted draft tokens).
        """
        ...


@dataclass
class GenerationOutput:
    """Tokens and counters of one generated sequence (the loop's and own-loop drafters' result).

    Attributes:
        tokens: generated token ids (prompt excluded), at most ``max_new_tokens``.
        target_forwards: target forward passes, prefill included (plain decoding: one per token).
        draft_steps: verification steps in which the drafter proposed at least one token.
        proposed: draft tokens proposed in total.
        accepted: draft tokens accepted in total.
        accepted_per_position: ``[k]`` accepted tokens at draft position i (depth i for trees).
        stop_reason: "eos" or "length".
        wall_time: seconds for the whole sequence (prefill included).
        draft_time: seconds spent inside the drafter.
        prefill_time: seconds of the prompt forward (and the drafter's start).
        accepted_by_tree_size: ``[m]``, tree drafters that rank their nodes
            (``Proposal.priority``) only: entry j sums, over the tree steps, the path length the
            step would have accepted had its tree kept only its best j + 1 nodes (the last
            entry: every node of the largest tree). Exact for greedy decoding; for sampling,
            what the same sibling tests would decide (SpecInfer's rule tests siblings in order,
            and a pruned tree keeps a prefix of each node's children). Empty otherwise.
    """

    tokens: list[int]
    target_forwards: int = 0
    draft_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    stop_reason: str = "length"
    wall_time: float = 0.0
    draft_time: float = 0.0
    prefill_time: float = 0.0
    accepted_by_tree_size: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """τ: tokens emitted per target forward (bonus token included; plain decoding = 1)."""
        return len(self.tokens) / max(self.target_forwards, 1)


def runs_own_loop(drafter: object) -> bool:
    """Whether ``drafter`` decodes in its own loop (it has ``generate``) instead of proposing.

    Such a drafter's ``generate(target, prompt_ids, **loop_kwargs)`` takes the verification
    loop's keyword arguments (``k``, ``max_new_tokens``, ``sampling``, ``eos_token_id``,
    ``generator``, ``draft_length``) and returns a :class:`GenerationOutput`.
    """
    return callable(getattr(drafter, "generate", None))


def _leave_as_is(*modules: object) -> None:
    """The default :attr:`BuildOptions.fast_linears`: no kernel-path patch."""


@dataclass
class BuildOptions:
    """What a builder may need beyond its spec's path: the target, the run's drafter settings,
    and the callables the caller injects (``heads/`` imports nothing from ``train/``).

    Field names are the evaluation config's (``EvalConfig``).

    Attributes:
        target: the HF causal LM the drafter proposes for.
        dtype: the drafter's dtype (weights and activations); None = the target's.
        ngram_max: n-gram lookup: longest suffix to match.
        ngram_min: n-gram lookup: shortest suffix to match.
        draft_model: draft-LM kinds: the model to load when the spec gives no path.
        draft_layers: draft-LM kinds: the target layers an untrained layer-pruned copy keeps.
        tree_topk: EAGLE trees: children expanded per node.
        tree_total_tokens: tree kinds: draft tokens verified per step.
        hf_assistant: transformers' assisted generation: ``"constant"`` or ``"transformers"``
            draft-length schedule.
        load_model: ``load_model(path, dtype) -> model``: loads a causal LM from a local HF
            directory or ``.gguf`` file; kinds that load a draft LM need it.
        fast_linears: ``fast_linears(*modules)`` patches a built drafter's linear layers for
            faster CPU kernels (evaluate injects ``fast_cpu_linears``, which patches only
            CPU bf16 layers); default: nothing.
        clock: seconds for timing the drafter's own work; on a GPU it must synchronize the
            device before reading (evaluate injects ``DeviceTimer(device).now``); default:
            ``time.perf_counter``.
        verify_costs: ``auto:KIND`` kinds: the target's verify costs on this device
            (:class:`~draftsmith.heads.auto.VerifyCosts`; evaluate probes them).
    """

    target: Any
    dtype: torch.dtype | None = None
    ngram_max: int = 4
    ngram_min: int = 2
    draft_model: str | None = None
    draft_layers: list[int] | None = None
    tree_topk: int = 4
    tree_total_tokens: int = 24
    hf_assistant: str = "constant"
    load_model: Callable[[str, torch.dtype], Any] | None = None
    fast_linears: Callable[..., object] = _leave_as_is
    clock: Callable[[], float] = time.perf_counter
    verify_costs: Any = None

    @property
    def draft_dtype(self) -> torch.dtype:
        """The drafter's dtype: :attr:`dtype`, else the target's."""
        return self.dtype if self.dtype is not None else self.target.dtype


@dataclass(frozen=True)
class DrafterKind:
    """How one ``--drafter`` kind (a spec ``KIND`` or ``KIND=PATH``) is built.

    Attributes:
        build: ``build(path, options)`` -> the drafter (a :class:`Drafter`, or an own-loop
            drafter, see :func:`runs_own_loop`; None = plain decoding), with a ``name`` for
            reports. ``path`` is the spec's path, None when it has none.
        path: ``"required"`` (only ``KIND=PATH``), ``"optional"`` (both) or ``"none"`` (only
            ``KIND``).
        help: a few words for ``--help`` after the kind's name.
        uses: :class:`BuildOptions` fields that only this kind (and others listing them)
            reads; a run that sets one without such a kind is refused.

    How vLLM serves a kind is its family's (:func:`draftsmith.heads.families.vllm_serving`).
    """

    build: Callable[[str | None, BuildOptions], Any]
    path: Literal["required", "optional", "none"] = "none"
    help: str = ""
    uses: tuple[str, ...] = ()


def unwrap_model(model: torch.nn.Module) -> Any:
    """The module inside DDP/FSDP1/accelerate wrappers (``.module``), or the model itself.

    FSDP2 (``fully_shard``) keeps the model's class, so for it this is a no-op.
    """
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model
