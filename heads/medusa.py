"""Medusa heads: extra decoding heads on the target's last hidden state (Cai et al. 2024).

Head k (0-based) reads the target's final normed hidden state ``h_t`` at position t -- the state
whose lm_head logits give token t+1 -- and predicts token t+k+2 (Medusa §2.1.1: "the k-th head
predicts the token at position t+k+1" with 1-based heads). Each head is L residual blocks
``x + SiLU(W x + b)`` followed by a vocabulary projection initialised from the target's lm_head.

The blocks start at W = 0, b = 0, so each head starts as exactly the target's own lm_head
(SiLU(0) = 0). The reference zeroes only W and leaves PyTorch's random bias, a small constant
shift; zeroing the bias as well makes the start an exact identity, which the tests check.

Parameter names follow vLLM's Medusa model (``vllm/model_executor/models/medusa.py``), so the
vLLM export is a plain copy: ``blocks.{h}.layers.{l}.weight`` / ``.bias`` for the residual
layers and ``lm_heads.{h}.weight`` for the projections, or one ``lm_head.weight`` when every
head shares the target's projection (vLLM's ``original_lm_head``).

Draft vocabulary (FR-Spec; EAGLE-3's d2t/t2d): with ``draft_vocab_size`` N < V every head's
projection has N rows, the N most frequent supervised tokens of the training data
(:func:`draftsmith.train.data.vocab.draft_vocab`, as for EAGLE-3), so drafting multiplies
N x H instead of V x H per head. The heads keep ``d2t`` (``target_id = i + d2t[i]``) and ``t2d``
as buffers (saved with the weights); the proposer maps draft ids to target ids, and when
sampling spreads each head's logits over the target vocabulary with ``-inf`` outside the draft
vocabulary (:mod:`draftsmith.heads.vocab_maps`), so q is zero there and the loop's rejection
sampling stays lossless. The default (``draft_vocab_size`` None) is the full vocabulary.

Proposing (:class:`MedusaProposer`):

* chain: the top-1 token of each head (greedy), or a sample from each head's processed
  distribution (sampling, lossless through the loop's rejection sampling: head k's q depends
  only on the accepted prefix, never on the target's randomness);
* tree: candidates from each head's top-k combined into a tree, verified in one target forward
  with a tree attention mask (Medusa §2.1.2). The tree is a ``medusa_choices`` list in the
  reference's format -- each node a tuple of top-k ranks, one per depth, e.g. ``(0, 2)`` = head
  0's best token then head 1's third best -- or built by :func:`build_tree` from per-head rank
  accuracies measured on validation data. The same tree at every temperature: temperature,
  top-k and top-p keep the order of the logits, so the processed distribution's top-k are the
  logits' top-k. The nodes are top-k candidates, a function of the accepted prefix, so the
  proposal has no probs (q one-hot) and with sampling the loop verifies each node's children by
  multi-candidate speculative sampling (SpecInfer §4.2 / Alg. 2), lossless.

Medusa's *typical acceptance* is not offered: it accepts tokens the target would not have
produced, so its output is not the target's, and it would need changes to the shared loop.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .base import BuildOptions, DrafterKind, Features, Proposal
from .sampling import SamplingParams, choose, confidence, greedy_ids
from .vocab_maps import check_vocab_maps, spread_logits, vocab_target_ids

__all__ = [
    "ACCURACY_FILE",
    "CONFIG_FILE",
    "FORMAT",
    "MEDUSA",
    "MEDUSA_TREE",
    "WEIGHTS_FILE",
    "MedusaHeads",
    "MedusaProposer",
    "ResidualBlock",
    "build_tree",
    "check_choices",
    "expected_acceptance_length",
    "load_accuracy",
    "load_medusa",
    "medusa_proposer",
    "medusa_target_dir",
    "tree_order",
]

FORMAT = "draftsmith-medusa"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: Per-head validation accuracies written by the recipe (read by the automatic tree).
ACCURACY_FILE = "head_accuracy.json"
#: Where a Medusa-2 run stores the merged (fine-tuned) target inside its output directory.
TARGET_SUBDIR = "target"

Choices = list[tuple[int, ...]]


class ResidualBlock(nn.Module):
    """L residual layers ``x <- x + SiLU(W_l x + b_l)``, each layer its own ``nn.Linear``.

    Args:
        hidden_size: H.
        num_layers: L >= 1.
    """

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
        self.act = nn.SiLU()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W = 0 and b = 0: the block is the identity (Medusa §2.1.1 zero-initialises W)."""
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., H] -> [..., H]``."""
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHeads(nn.Module):
    """K Medusa heads on the target's final normed hidden state.

    Args:
        num_heads: K, heads (head k predicts the token k+2 positions after the hidden state's).
        num_layers: L, residual layers per head.
        hidden_size: H, the target's hidden size.
        vocab_size: V, the target's vocabulary size.
        share_lm_head: one frozen projection for every head (the target's own lm_head, vLLM's
            ``original_lm_head``) instead of K trainable copies. Far fewer parameters (a
            49k-token vocabulary makes each copy 28M parameters on SmolLM2), only the residual
            blocks learn.
        draft_vocab_size: N, rows of each projection: the draft vocabulary (see the module
            docstring; install its maps with :meth:`set_vocab`). None or ``vocab_size``: the
            full vocabulary, no maps (the state dict is then that of heads without one).
    """

    def __init__(
        self,
        num_heads: int,
        num_layers: int,
        hidden_size: int,
        vocab_size: int,
        *,
        share_lm_head: bool = False,
        draft_vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError(
                f"need num_heads >= 1 and num_layers >= 1, got {num_heads} and {num_layers}"
            )
        n = vocab_size if draft_vocab_size is None else int(draft_vocab_size)
        if not 1 <= n <= vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {n}")
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.draft_vocab_size = n
        self.share_lm_head = share_lm_head
        self.blocks = nn.ModuleList(
            ResidualBlock(hidden_size, num_layers) for _ in range(num_heads)
        )
        if share_lm_head:
            self.lm_head = nn.Linear(hidden_size, n, bias=False)
            self.lm_head.requires_grad_(False)
        else:
            self.lm_heads = nn.ModuleList(
                nn.Linear(hidden_size, n, bias=False) for _ in range(num_heads)
            )
        if self.reduced:
            # Until set_vocab: the first N target ids (d2t = 0), as EAGLE-3's drafter starts.
            self.register_buffer("d2t", torch.zeros(n, dtype=torch.long))
            t2d = torch.zeros(vocab_size, dtype=torch.bool)
            t2d[:n] = True
            self.register_buffer("t2d", t2d)

    @classmethod
    def from_target(
        cls,
        target: nn.Module,
        num_heads: int = 4,
        num_layers: int = 1,
        *,
        share_lm_head: bool = False,
        d2t: torch.Tensor | None = None,
        t2d: torch.Tensor | None = None,
    ) -> MedusaHeads:
        """Heads for ``target``, each projection initialised from its lm_head (Medusa §2.1.1).

        With a draft vocabulary (``d2t``, ``t2d`` from
        :func:`draftsmith.train.data.vocab.draft_vocab`) each projection starts as the lm_head's
        rows of those tokens, so a head still starts as the target's own lm_head on them.
        The heads get the lm_head's dtype and device.
        """
        if (d2t is None) != (t2d is None):
            raise ValueError("pass both d2t and t2d, or neither")
        weight = target.get_output_embeddings().weight.detach()
        vocab, hidden = weight.shape
        n = None if d2t is None else int(d2t.shape[0])
        heads = cls(
            num_heads, num_layers, hidden, vocab, share_lm_head=share_lm_head, draft_vocab_size=n
        )
        if heads.reduced:
            heads.set_vocab(d2t, t2d)
        heads.to(device=weight.device, dtype=weight.dtype)
        rows = weight
        if heads.reduced:
            rows = weight[vocab_target_ids(heads.d2t).to(weight.device)]
        with torch.no_grad():
            for proj in heads.projections():
                proj.weight.copy_(rows)
        return heads

    @property
    def reduced(self) -> bool:
        """Whether the heads predict over a draft vocabulary smaller than the target's."""
        return self.draft_vocab_size < self.vocab_size

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary's maps (:func:`draftsmith.train.data.vocab.draft_vocab`).

        Raises:
            ValueError: If the maps do not describe a draft vocabulary of these heads' sizes,
                or the heads predict over the full vocabulary.
        """
        if not self.reduced:
            raise ValueError("these heads predict over the full vocabulary: no d2t/t2d")
        check_vocab_maps(d2t, t2d, self.draft_vocab_size, self.vocab_size)
        self.d2t.copy_(d2t.to(self.d2t.device))
        self.t2d.copy_(t2d.to(self.t2d.device))

    def vocab_ids(self) -> torch.Tensor:
        """The draft vocabulary as target ids, in draft order ``[N]`` (``arange(V)`` if full)."""
        if not self.reduced:
            return torch.arange(self.vocab_size, device=self.device)
        return vocab_target_ids(self.d2t)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids (``i + d2t[i]``; identity for the full vocabulary)."""
        if not self.reduced:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., N]`` spread over the target vocabulary ``[..., V]``, ``-inf``
        outside the draft vocabulary (q = 0 there). Identity for the full vocabulary."""
        if not self.reduced:
            return draft_logits
        return spread_logits(draft_logits, self.d2t, self.vocab_size)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def projections(self) -> list[nn.Linear]:
        """The K vocabulary projections (the same module K times when shared)."""
        if self.share_lm_head:
            return [self.lm_head] * self.num_heads
        return list(self.lm_heads)

    def config(self) -> dict[str, Any]:
        """Constructor arguments (what :func:`load_medusa` needs besides the weights)."""
        return {
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "share_lm_head": self.share_lm_head,
        }

    def head_hidden(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head k's residual blocks: ``[..., H] -> [..., H]``."""
        return self.blocks[k](hidden)

    def head_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head k's logits for the token k+2 positions ahead: ``[..., H] -> [..., N]``, over
        the draft vocabulary (N = V without one; :meth:`target_ids` maps the ids back)."""
        return self.projections()[k](self.blocks[k](hidden))

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits of the first ``num_heads`` heads (default all).

        Args:
            hidden: ``[..., H]`` final normed target hidden states.
            num_heads: how many heads to run (the chain/tree depth actually needed).

        Returns:
            ``[K', ..., N]`` over the draft vocabulary (N = V without one); row k predicts the
            token k+2 positions after each input position.
        """
        n = self.num_heads if num_heads is None else min(num_heads, self.num_heads)
        return torch.stack([self.head_logits(k, hidden) for k in range(n)])

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (our layout) into directory ``path``.

        Args:
            path: output directory (created).
            extra: more config entries (e.g. the target it was trained for).
        """
        from safetensors.torch import save_file

        path = Path(path)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        _check_finite(tensors, "heads to save")
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        config = {"format": FORMAT, "version": FORMAT_VERSION, **self.config(), **(extra or {})}
        config["dtype"] = str(_float_dtype(tensors)).removeprefix("torch.")
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return path


def load_medusa(path: str | Path, *, device: str | torch.device = "cpu") -> MedusaHeads:
    """Load heads saved by :meth:`MedusaHeads.save` (our layout).

    Raises:
        FileNotFoundError: If the directory lacks ``config.json`` or ``model.safetensors``.
        ValueError: If the config is not a draftsmith Medusa config.
    """
    from safetensors.torch import load_file

    path = Path(path)
    config = _read_config(path)
    if config.get("format") != FORMAT:
        raise ValueError(
            f"{path / CONFIG_FILE}: format {config.get('format')!r} is not {FORMAT!r} "
            "(for vLLM or original Medusa exports use draftsmith.train.export.medusa."
            "load_medusa_export)"
        )
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found")
    state = load_file(str(weights), device=str(device))
    _check_finite(state, str(weights))
    heads = MedusaHeads(
        config["num_heads"],
        config["num_layers"],
        config["hidden_size"],
        config["vocab_size"],
        share_lm_head=config.get("share_lm_head", False),
        draft_vocab_size=config.get("draft_vocab_size"),  # absent before draft vocabularies
    )
    heads.load_state_dict(state)
    if heads.reduced:
        try:
            check_vocab_maps(heads.d2t, heads.t2d, heads.draft_vocab_size, heads.vocab_size)
        except ValueError as exc:
            raise ValueError(f"{weights}: {exc}") from None
    return heads.to(device=device, dtype=_float_dtype(state)).eval()


def _float_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The weights' dtype (the vocabulary maps are integer and boolean buffers)."""
    return next(t.dtype for t in tensors.values() if t.is_floating_point())


def _check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Refuse NaN/inf weights: a NaN head ranks every token first and "validates" at top-1 = 1."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{what}: tensor {name} holds NaN or inf (a diverged run?)")


def _read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: not a Medusa heads directory")
    return json.loads(file.read_text())


def medusa_target_dir(path: str | Path) -> Path | None:
    """The merged fine-tuned target of a Medusa-2 output directory, None for Medusa-1.

    Medusa-2 changes the target (LoRA, merged): its heads must be evaluated and served with
    that target, and outputs are lossless with respect to it, not to the original target.
    """
    config = _read_config(Path(path))
    sub = config.get("target_dir")  # relative to the heads directory
    return (Path(path) / sub).resolve() if sub else None


def load_accuracy(path: str | Path) -> dict[str, Any]:
    """The per-head validation accuracies a training run wrote (``head_accuracy.json``).

    Raises:
        FileNotFoundError: If the run wrote none (e.g. heads exported without it).
    """
    file = Path(path) / ACCURACY_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} not found: the automatic tree needs the per-head accuracies the training "
            "recipe measures; pass medusa_choices instead"
        )
    return json.loads(file.read_text())


# --------------------------------------------------------------------------------------------
# Trees
# --------------------------------------------------------------------------------------------


def check_choices(choices: Sequence[Sequence[int]], num_heads: int | None = None) -> Choices:
    """Validate a ``medusa_choices`` tree and return it sorted parents-first.

    A tree is a list of nodes; node ``(r_0, ..., r_d)`` is head d's rank-``r_d`` token, below
    node ``(r_0, ..., r_{d-1})``. The root (the last accepted token) is implicit.

    Raises:
        ValueError: naming the first bad node: empty, negative rank, deeper than the heads,
            duplicated, or missing its parent.
    """
    nodes = [tuple(int(r) for r in c) for c in choices]
    seen: set[tuple[int, ...]] = set()
    for node in nodes:
        if not node:
            raise ValueError("medusa_choices: empty node (the root is implicit)")
        if min(node) < 0:
            raise ValueError(f"medusa_choices: node {node} has a negative rank")
        if num_heads is not None and len(node) > num_heads:
            raise ValueError(
                f"medusa_choices: node {node} is {len(node)} deep but there are {num_heads} heads"
            )
        if node in seen:
            raise ValueError(f"medusa_choices: node {node} appears twice")
        seen.add(node)
    for node in nodes:
        if len(node) > 1 and node[:-1] not in seen:
            raise ValueError(f"medusa_choices: node {node} lacks its parent {node[:-1]}")
    return sorted(nodes, key=lambda n: (len(n), n))


def build_tree(
    rank_accuracy: Sequence[Sequence[float]], budget: int, max_depth: int | None = None
) -> Choices:
    """The tree of at most ``budget`` nodes with the largest expected accepted length.

    Medusa §3.3.1 ("optimized tree construction"): with ``a[d][r]`` = probability that head d's
    rank-r token is the target's next token there, and heads treated as independent, a node
    ``(r_0..r_d)`` is on the accepted path with probability ``prod_i a[i][r_i]``, and the
    expected number of accepted tokens is the sum of that over the tree's nodes. Every factor is
    <= 1, so a node is never worth more than its parent and the best tree of n nodes is the n
    most valuable nodes; growing it from the root, always adding the most valuable node on the
    frontier (a child of a chosen node), finds them while keeping every node's parent.

    Args:
        rank_accuracy: ``[K][R]`` per-head, per-rank accuracies (rows need not sum to 1).
        budget: most nodes (tokens verified per step besides the root).
        max_depth: deepest level (<= K); default K.

    Returns:
        The nodes, parents first (a valid ``medusa_choices``).
    """
    depth = len(rank_accuracy) if max_depth is None else min(max_depth, len(rank_accuracy))
    if budget < 1 or depth < 1:
        return []
    # Max-heap by value; ties broken by the node tuple so the tree is deterministic.
    frontier: list[tuple[float, tuple[int, ...]]] = [
        (-float(a), (r,)) for r, a in enumerate(rank_accuracy[0])
    ]
    heapq.heapify(frontier)
    chosen: Choices = []
    while frontier and len(chosen) < budget:
        neg, node = heapq.heappop(frontier)
        chosen.append(node)
        if len(node) < depth:
            for r, a in enumerate(rank_accuracy[len(node)]):
                heapq.heappush(frontier, (neg * float(a), (*node, r)))
    return sorted(chosen, key=lambda n: (len(n), n))


def tree_order(
    choices: Sequence[Sequence[int]], rank_accuracy: Sequence[Sequence[float]]
) -> Choices:
    """A tree's nodes best first, by :func:`build_tree`'s value (ties: the node tuple).

    The order :func:`build_tree` chose them in: a node is worth no more than its parent and a
    parent's tuple sorts before its children's, so the first m nodes always form a tree. When a
    head's accuracies do not fall with rank, a best-m tree can keep a later sibling without an
    earlier one; its predicted acceptance is then exact when greedy only.
    """

    def value(node: Sequence[int]) -> float:
        p = 1.0
        for d, r in enumerate(node):
            row = rank_accuracy[d]
            p *= float(row[r]) if r < len(row) else 0.0
        return p

    nodes = [tuple(int(r) for r in c) for c in choices]
    return sorted(nodes, key=lambda n: (-value(n), n))


def expected_acceptance_length(
    choices: Sequence[Sequence[int]], rank_accuracy: Sequence[Sequence[float]]
) -> float:
    """Predicted τ of a tree: 1 (the target's own token) + Σ_nodes Π_d a[d][r_d]."""
    total = 1.0
    for node in choices:
        p = 1.0
        for d, r in enumerate(node):
            row = rank_accuracy[d]
            p *= float(row[r]) if r < len(row) else 0.0
        total += p
    return total


# --------------------------------------------------------------------------------------------
# Proposing
# --------------------------------------------------------------------------------------------


class MedusaProposer:
    """Medusa heads as a drafter for :func:`draftsmith.train.decoding.speculative.generate`.

    The heads read the target's final normed hidden state at the last kept position -- the
    state that produced the newest token ``ids[-1]`` -- so head 0 guesses the token after
    ``ids[-1]``, head 1 the one after that, and so on; no extra target or draft forward.

    Args:
        heads: the trained heads (moved to the target's device/dtype by the caller).
        num_target_layers: the target's ``num_hidden_layers``; the feature layer is the final
            normed output, index ``num_target_layers`` in HF's ``hidden_states``.
        medusa_choices: tree nodes (see :func:`check_choices`); None drafts a chain.
        name: how reports call it; default ``medusa-chain`` or ``medusa-tree``.
        node_order: the tree's nodes best first, such that the first m of them form a tree for
            every m (:func:`build_tree`'s choice order, :func:`tree_order`). Proposals then
            carry it as ``Proposal.priority``, and the loop counts what each smaller tree would
            have accepted (the bench's tree-size prediction). None: no order.

    A tree is drafted at every temperature (top-k candidates, no probs: see the module
    docstring). ``k`` caps the chain length and the tree depth; nodes deeper than k are left out
    of that step's tree.
    """

    def __init__(
        self,
        heads: MedusaHeads,
        num_target_layers: int,
        medusa_choices: Sequence[Sequence[int]] | None = None,
        name: str | None = None,
        node_order: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.heads = heads.eval()
        self.feature_layers: tuple[int, ...] = (int(num_target_layers),)
        self.choices = (
            None if medusa_choices is None else check_choices(medusa_choices, heads.num_heads)
        )
        if self.choices is not None:
            # A draft vocabulary of N tokens has no rank >= N (nor have the nodes below one).
            self.choices = [n for n in self.choices if max(n) < heads.draft_vocab_size]
        self._order = (
            None if node_order is None else {tuple(n): i for i, n in enumerate(node_order)}
        )
        self._trees: dict[int, tuple[Choices, list[int], list[int]]] = {}
        self._hidden: torch.Tensor | None = None  # [H] at the last kept position
        self.name = name or f"medusa-{self.mode}"

    @property
    def mode(self) -> str:
        return "chain" if self.choices is None else "tree"

    def start(self, prompt_ids: torch.Tensor, features: Features | None) -> None:
        """Keep the hidden state of the prompt's last position."""
        self._hidden = self._last(features)

    def accept(self, num_accepted: int, features: Features | None) -> None:
        """Keep the hidden state of the last kept position (the newest token's producer)."""
        self._hidden = self._last(features)

    def _last(self, features: Features | None) -> torch.Tensor:
        layer = self.feature_layers[0]
        if features is None or layer not in features:
            raise RuntimeError(
                f"MedusaProposer needs the target's hidden states of layer {layer}; the loop "
                "passes them when feature_layers is declared"
            )
        return features[layer][0, -1]

    @torch.inference_mode()
    def propose(
        self,
        ids: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Chain: one token per head (up to k). Tree: the choices up to depth k."""
        if self._hidden is None:
            raise RuntimeError("MedusaProposer.propose called before start()")
        depth = min(k, self.heads.num_heads)
        device = ids.device
        heads = self.heads
        if self.choices is None:
            tokens, probs, conf = [], [], []
            for d in range(depth):
                logits = heads.head_logits(d, self._hidden)  # [N], the draft vocabulary
                if sampling.greedy:  # argmax over the draft vocabulary, as a target id
                    tok, q = heads.target_ids(greedy_ids(logits)), None
                else:  # q over the target vocabulary, zero outside the draft vocabulary
                    tok, q = choose(heads.target_logits(logits), sampling, generator)
                tokens.append(tok)
                probs.append(q)
                conf.append(confidence(logits, q))
            return Proposal(
                tokens=torch.stack(tokens).to(device),
                probs=None if sampling.greedy else torch.stack(probs),
                confidence=torch.stack(conf).to(device),
            )
        nodes, parents, ranks_needed = self._tree(depth)
        if not nodes:
            return Proposal(tokens=torch.empty(0, dtype=torch.long, device=device))
        top, top_p = [], []
        for d in range(len(ranks_needed)):
            logits = heads.head_logits(d, self._hidden).float()
            best = logits.topk(ranks_needed[d])
            top.append(heads.target_ids(best.indices))
            # Each head's probabilities of its top candidates (the heads draft independently:
            # a node's confidence given its path is its own head's).
            top_p.append(torch.exp(best.values - torch.logsumexp(logits, dim=-1)))
        tokens = torch.stack([top[len(node) - 1][node[-1]] for node in nodes])
        conf = torch.stack([top_p[len(node) - 1][node[-1]] for node in nodes])
        return Proposal(
            tokens=tokens.to(device),
            parents=torch.tensor(parents, dtype=torch.long, device=device),
            priority=self._priority(depth),
            confidence=conf.to(device),
        )

    def _priority(self, depth: int) -> torch.Tensor | None:
        """Each node's rank in ``node_order`` among the nodes up to ``depth`` (host tensor)."""
        if self._order is None:
            return None
        nodes = self._tree(depth)[0]
        ranked = sorted(range(len(nodes)), key=lambda i: self._order.get(nodes[i], len(nodes)))
        rank = [0] * len(nodes)
        for r, i in enumerate(ranked):
            rank[i] = r
        return torch.tensor(rank, dtype=torch.long)

    def _tree(self, depth: int) -> tuple[Choices, list[int], list[int]]:
        """Nodes up to ``depth``, their parent indices and the top-k needed per depth (cached)."""
        if depth not in self._trees:
            nodes = [n for n in self.choices or [] if len(n) <= depth]
            index = {n: i for i, n in enumerate(nodes)}
            parents = [index[n[:-1]] if len(n) > 1 else -1 for n in nodes]
            needed = [0] * max((len(n) for n in nodes), default=0)
            for n in nodes:
                needed[len(n) - 1] = max(needed[len(n) - 1], n[-1] + 1)
            self._trees[depth] = (nodes, parents, needed)
        return self._trees[depth]


def medusa_proposer(
    path: str | Path,
    target: nn.Module,
    *,
    tree: bool = False,
    total_tokens: int | None = None,
    medusa_choices: Sequence[Sequence[int]] | None = None,
) -> MedusaProposer:
    """A :class:`MedusaProposer` from a training run's ``heads/`` directory, ready for ``generate``.

    Args:
        path: the heads directory (``config.json``, ``model.safetensors``, ``head_accuracy.json``).
        target: the target it drafts for -- for Medusa-2 heads the merged fine-tuned target in
            :func:`medusa_target_dir` (checked); the heads move to its device and dtype.
        tree: False drafts a chain (top-1 of each head); True a tree: ``medusa_choices`` when
            given, else the automatic tree of ``total_tokens`` nodes built from the per-head
            accuracies the run measured (:func:`build_tree`).
        total_tokens: node budget of the automatic tree; default: the size the run recorded.
        medusa_choices: an explicit tree (the reference's format) for ``tree=True``.

    Returns:
        The proposer, named ``medusa-chain[PATH]`` or ``medusa-tree[PATH]``.

    Raises:
        ValueError: If the heads do not fit the target (hidden or vocabulary size), or Medusa-2
            heads are given another target than their fine-tuned one.
    """
    name = f"medusa-{'tree' if tree else 'chain'}[{path}]"
    path = Path(path)
    heads = load_medusa(path)
    weight = target.get_output_embeddings().weight
    if (heads.vocab_size, heads.hidden_size) != tuple(weight.shape):
        raise ValueError(
            f"{path}: heads have vocab {heads.vocab_size} x hidden {heads.hidden_size} but the "
            f"target's lm_head is {tuple(weight.shape)}: trained for another target?"
        )
    _check_medusa2_target(path, target)
    heads.to(device=weight.device, dtype=weight.dtype)
    choices = order = None
    if tree:
        if medusa_choices is not None:
            choices = check_choices(medusa_choices, heads.num_heads)
        else:
            acc = load_accuracy(path)
            budget = total_tokens if total_tokens is not None else acc["tree"]["nodes"]
            choices = build_tree(acc["rank_accuracy"], budget)
            order = tree_order(choices, acc["rank_accuracy"])
    return MedusaProposer(
        heads, int(target.config.num_hidden_layers), choices, name=name, node_order=order
    )


def build_medusa(path: str | None, options: BuildOptions, tree: bool = False) -> MedusaProposer:
    """``medusa=DIR`` / ``medusa-tree=DIR``: the heads of a training run, chain or tree."""
    proposer = medusa_proposer(
        path, options.target, tree=tree, total_tokens=options.tree_total_tokens
    )
    options.fast_linears(proposer)
    return proposer


MEDUSA = DrafterKind(
    build_medusa,
    path="required",
    help="Medusa heads, chain",
)
MEDUSA_TREE = DrafterKind(
    lambda path, options: build_medusa(path, options, tree=True),
    path="required",
    help="Medusa heads, tree of tree_total_tokens nodes",
)


def _check_medusa2_target(path: Path, target: nn.Module) -> None:
    """Refuse Medusa-2 heads with a target other than their merged fine-tuned one.

    Compares the first decoder layer's weights (LoRA adapts every layer) with the saved target's,
    exactly, after casting the saved ones to the loaded target's dtype.
    """
    target_dir = medusa_target_dir(path)
    if target_dir is None:
        return
    from safetensors import safe_open

    state = target.state_dict()
    for file in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if ".layers.0." not in key or key not in state:
                    continue
                mine = state[key].detach().cpu()
                if not torch.equal(f.get_tensor(key).to(mine.dtype), mine):
                    raise ValueError(
                        f"{path} holds Medusa-2 heads, trained jointly with a fine-tuned target: "
                        f"evaluate them with that target ({target_dir}), not another one (its "
                        "outputs are lossless w.r.t. the fine-tuned target, not the original)"
                    )
