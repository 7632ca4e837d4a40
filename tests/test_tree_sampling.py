"""Sampled tree verification is lossless: multi-candidate speculative sampling (SpecInfer §4.2).

Through the whole loop (``generate``), the first three emitted tokens of many seeded runs are
compared with the target's own sampling distribution by a Pearson χ² test: the first token comes
from the prefill, the second from the walk over the root's children, the third from the walk one
level down (or from the next step when the walk stopped at the root). The same check rejects a
rule that forgets to renormalise the residual between siblings, or to take rejected candidates
out of it, so it demonstrably can fail.
"""

from __future__ import annotations

import pytest
import torch

from draftsmith.heads.base import Proposal
from draftsmith.heads.eagle import EagleConfig, build_drafter
from draftsmith.heads.eagle_proposer import EagleProposer
from draftsmith.heads.medusa import MedusaHeads, MedusaProposer
from draftsmith.heads.sampling import SamplingParams, logits_to_probs, sample
from draftsmith.train.data.vocab import draft_vocab
from draftsmith.train.decoding import speculative
from draftsmith.train.decoding.speculative import generate
from tests.conftest import tiny_llama
from tests.test_speculative import (
    OracleTreeDrafter,
    chi2_quantile,
    chi2_stat,
    reference_greedy,
)

VOCAB = 8
PROMPT = [1, 4, 2, 7]
K, MAX_NEW = 2, 4  # the first step drafts trees of depth 2 (the budget leaves k = 2)
# 2,000 runs, 1 - Phi(z = 3.72) = 1e-4 per check: a false failure about once in 10,000 runs.
DRAWS = 2000
Z = 3.72


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=VOCAB, layers=2, seed=11, init_std=0.3)


def exact_joint3(model, prompt: list[int], sampling: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) under the target's own processed sampling distribution, ``[V, V, V]``."""
    v = VOCAB
    with torch.no_grad():
        p1 = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], sampling)
        two = torch.tensor([[*prompt, a] for a in range(v)])
        p2 = logits_to_probs(model(two).logits[:, -1], sampling)
        three = torch.tensor([[*prompt, a, b] for a in range(v) for b in range(v)])
        p3 = logits_to_probs(model(three).logits[:, -1], sampling).view(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi2_check(
    model, drafter, sampling: SamplingParams, draws: int = DRAWS
) -> tuple[float, float, list[int]]:
    """The first three tokens of ``draws`` seeded runs against the target's distribution.

    Returns:
        ``(statistic, critical value, accepted draft tokens per depth summed over the runs)``.
    """
    exact = exact_joint3(model, PROMPT, sampling)
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    accepted = [0] * K
    gen = torch.Generator().manual_seed(1234)
    for _ in range(draws):
        out = generate(
            model, PROMPT, drafter, k=K, max_new_tokens=MAX_NEW, sampling=sampling, generator=gen
        )
        a, b, c = out.tokens[:3]
        counts[a, b, c] += 1
        accepted = [x + y for x, y in zip(accepted, out.accepted_per_position, strict=True)]
    assert counts[exact == 0].sum() == 0, "a token the target cannot produce was emitted"
    stat, df = chi2_stat(counts, exact)
    return stat, chi2_quantile(df, Z), accepted


class TreeDrafter:
    """A fixed-shape tree whose nodes depend only on the accepted prefix and their own path.

    Args:
        parents: the tree's shape; nodes deeper than the step's k are left out.
        mode: ``"topk"``: deterministic candidates (no probs: q one-hot), ``table[parent token]``
            in order -- the first two siblings always equal, many tokens the target gives little
            or no probability; ``"iid"``: siblings drawn i.i.d. from ``q[parent token]`` (rows
            identical, duplicates possible); ``"worep"``: siblings drawn without replacement
            (row i = q with the earlier siblings zeroed, renormalised).
        seed: draws the table and q (peaked, zero on a third of the vocabulary, unlike p).
    """

    feature_layers = ()

    def __init__(self, parents: list[int], mode: str, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.parents, self.mode = parents, mode
        width = max(parents.count(p) for p in set(parents))
        self.table = torch.randint(0, VOCAB, (VOCAB, width), generator=g)
        if width > 1:
            self.table[:, 1] = self.table[:, 0]  # duplicate siblings
        q = torch.softmax(3.0 * torch.randn(VOCAB, VOCAB, generator=g), dim=-1)
        q[:, torch.randperm(VOCAB, generator=g)[: VOCAB // 3]] = 0.0
        self.q = q / q.sum(-1, keepdim=True)

    def start(self, prompt_ids, features):
        pass

    def accept(self, num_accepted, features):
        pass

    def propose(self, ids, k, sampling, generator):
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        parents: list[int] = []
        index: dict[int, int] = {}  # node of self.parents -> node of the proposal
        depth: dict[int, int] = {-1: 0}
        for j, parent in enumerate(self.parents):
            depth[j] = depth[parent] + 1
            if depth[j] > k:
                continue
            new_parent = index[parent] if parent != -1 else -1
            parent_tok = (int(ids[0, -1]) if parent == -1 else tokens[index[parent]]) % VOCAB
            earlier = [tokens[i] for i, p in enumerate(parents) if p == new_parent]
            if self.mode == "topk":
                tok, row = int(self.table[parent_tok, len(earlier)]), None
            else:
                row = self.q[parent_tok].clone()
                if self.mode == "worep":
                    row[earlier] = 0.0
                    row /= row.sum()
                tok = int(torch.multinomial(row, 1, generator=generator))
            index[j] = len(tokens)
            tokens.append(tok)
            rows.append(row)
            parents.append(new_parent)
        probs = None if self.mode == "topk" else torch.stack(rows)
        return Proposal(torch.tensor(tokens), probs, torch.tensor(parents))


WIDE = [-1] * 6
DEEP = [-1, 0, 0, 1, 3]  # chain-like: one path of depth 4 with a sibling at depth 2
MIXED = [-1, -1, -1, 0, 0, 1, 3, 3, 2]

CASES = {
    "wide-topk-dupes-t1": (WIDE, "topk", SamplingParams(temperature=1.0)),
    "deep-iid-t1": (DEEP, "iid", SamplingParams(temperature=1.0)),
    "mixed-worep-t0.7-topk4-topp0.9": (
        MIXED,
        "worep",
        SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
    ),
    "mixed-topk-t1.3-topk3": (MIXED, "topk", SamplingParams(temperature=1.3, top_k=3)),
    "wide-iid-topp0.8": (WIDE, "iid", SamplingParams(temperature=1.0, top_p=0.8)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_tree_matches_target_distribution(model, case):
    parents, mode, sampling = CASES[case]
    stat, critical, accepted = chi2_check(model, TreeDrafter(parents, mode), sampling)
    assert stat < critical, f"{case}: chi2 {stat:.1f} >= {critical:.1f}"
    # Runs accepted root children, and (trees deeper than the root's children) their children.
    assert accepted[0] > 0 and (parents == WIDE or accepted[1] > 0), accepted


# --- the check has power: broken rules fail it -------------------------------------------------


def broken_rule(bug: str):
    """The sampled tree decision with one mistake (same inputs and output as the loop's)."""

    def decide(logits, proposal, kids, inner, depth, sampling, generator):
        p = logits_to_probs(logits, sampling)
        u = torch.rand(p.shape[0], generator=generator)
        toks = [0, *proposal.tokens.tolist()]
        first, rows = [], []
        for v in range(p.shape[0]):
            r, chosen = p[v].clone(), 0
            for c in [c for c in kids[v].tolist() if c]:
                x = toks[c]
                q = torch.zeros_like(r)
                q[x] = 1.0
                if proposal.probs is not None:
                    q = proposal.probs[c - 1]
                if u[c] * q[x] < r[x]:
                    chosen = c
                    break
                if bug == "no-residual":  # every sibling tested against the untouched p
                    continue
                r = (r - q).clamp_min(0.0)
                if bug != "no-renormalise":
                    r = r / r.sum()
            first.append(chosen)
            rows.append(r)
        last = speculative._tree_path(first)[-1:] or [0]
        return torch.cat([torch.tensor(first), sample(rows[last[0]], generator)[None]])

    return decide


class TargetTopDrafter:
    """Deterministic root candidates: the target's three most likely tokens (big sibling mass)."""

    feature_layers = ()

    def __init__(self, model, sampling):
        self.model, self.sampling = model, sampling

    def start(self, prompt_ids, features):
        pass

    def accept(self, num_accepted, features):
        pass

    def propose(self, ids, k, sampling, generator):
        with torch.no_grad():
            p = logits_to_probs(self.model(ids).logits[0, -1], self.sampling)
        return Proposal(p.topk(3).indices, None, torch.tensor([-1, -1, -1]))


@pytest.mark.parametrize("bug", [None, "no-renormalise", "no-residual"])
def test_check_rejects_broken_rules(model, monkeypatch, bug):
    """The loop's rule passes; a variant that does not renormalise the residual across siblings,
    or never takes a rejected candidate out of it, fails the same χ² check."""
    sampling = SamplingParams(temperature=1.0)
    if bug is not None:
        monkeypatch.setattr(speculative, "_accept_tree_sampled", broken_rule(bug))
    stat, critical, _ = chi2_check(model, TargetTopDrafter(model, sampling), sampling, DRAWS // 2)
    if bug is None:
        assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"
    else:
        assert stat > critical, f"{bug}: chi2 {stat:.1f} < {critical:.1f}, not rejected"


def test_each_node_emits_its_own_target_distribution():
    """The decision function alone, many draws: the first emitted token follows p at the root
    and, when the walk entered the root's first child, the next one follows p at that child --
    for deterministic candidates (q one-hot: duplicates, a token p rules out), siblings drawn
    i.i.d. from a q unlike p, and siblings drawn without replacement."""
    v, draws = 6, 4000
    g = torch.Generator().manual_seed(3)
    logits = 2.0 * torch.randn(5, v, generator=g)  # the root and four nodes
    sampling = SamplingParams(temperature=1.0, top_k=5)
    p = logits_to_probs(logits, sampling)
    par = [-1, -1, -1, 0]  # three children of the root; node 3 is a child of node 0 (row 1)
    kids = speculative._tree_children(par, torch.device("cpu"))
    top, ruled_out = int(p[0].argmax()), int(p[0].argmin())
    assert float(p[0, ruled_out]) == 0.0
    q0 = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])
    q1 = q0.roll(3)

    def candidates(mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if mode == "one-hot":
            return torch.tensor([top, top, ruled_out, 2]), None
        rows, toks, row = [], [], q0.clone()
        for i in range(3):
            if i and mode == "worep":
                row = row.index_fill(0, toks[-1], 0.0)
                row = row / row.sum()
            rows.append(row)
            toks.append(torch.multinomial(row, 1, generator=g))
        rows.append(q1)
        toks.append(torch.multinomial(q1, 1, generator=g))
        return torch.cat(toks), torch.stack(rows)

    for mode in ("one-hot", "iid", "worep"):
        first, second = torch.zeros(v), torch.zeros(v)
        for _ in range(draws):
            tokens, probs = candidates(mode)
            prop = Proposal(tokens, probs, torch.tensor(par))
            out = speculative._accept_tree_sampled(logits, prop, *kids, 2, sampling, g).tolist()
            path, nxt = speculative._tree_path(out[:5]), out[5]
            emitted = [int(tokens[r - 1]) for r in path] + [nxt]
            first[emitted[0]] += 1
            if path[:1] == [1]:
                second[emitted[1]] += 1
        for counts, want in ((first, p[0]), (second, p[1])):
            assert counts.sum() > 100 and counts[want == 0].sum() == 0, mode
            stat, df = chi2_stat(counts, want)
            assert stat < chi2_quantile(df, Z), f"{mode}: chi2 {stat:.1f} on {df} df"


# --- real tree drafters at T > 0 ---------------------------------------------------------------


def _medusa(model) -> MedusaProposer:
    heads = MedusaHeads.from_target(model, num_heads=3, num_layers=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    choices = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    return MedusaProposer(heads, model.config.num_hidden_layers, choices)


def _eagle(model) -> EagleProposer:
    n = model.config.num_hidden_layers
    cfg = EagleConfig.from_target(model.config, 3, feature_layers=[0, n // 2, n])
    return EagleProposer(build_drafter(model, cfg, seed=0), tree=True, topk=3, total_tokens=12)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_tree_drafters_stay_lossless_at_temperature(model, kind):
    drafter = _medusa(model) if kind == "medusa" else _eagle(model)
    sampling = SamplingParams(temperature=0.8, top_k=5)
    stat, critical, _ = chi2_check(model, drafter, sampling)
    assert stat < critical, f"{kind}: chi2 {stat:.1f} >= {critical:.1f}"


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_tree_drafters_draft_trees_at_temperature(target, kind):
    """EAGLE-2 and Medusa propose trees (parents set, no probs) when sampling, and the loop's
    output stays inside the target's processed support (top-2 here) at every position."""
    drafter = _medusa(target) if kind == "medusa" else _eagle(target)
    sampling = SamplingParams(temperature=1.0, top_k=2)
    seen: list[Proposal] = []
    propose = drafter.propose

    def spy(*args):
        seen.append(propose(*args))
        return seen[-1]

    drafter.propose = spy
    gen = torch.Generator().manual_seed(0)
    prompt = [3, 17, 42, 5, 9]
    out = generate(
        target, prompt, drafter, k=3, max_new_tokens=30, sampling=sampling, generator=gen
    )
    assert len(out.tokens) == 30 and out.draft_steps == len(seen)
    assert all(s.parents is not None and s.probs is None for s in seen)
    assert any(len(s) > int((s.parents == -1).sum()) for s in seen)  # deeper than one level
    if kind == "eagle":  # the processed draft distribution rules out all but 2 children
        for s in seen:
            assert all(int((s.parents == j).sum()) <= 2 for j in range(-1, len(s)))
    with torch.no_grad():
        logits = target(torch.tensor([prompt + out.tokens])).logits[0]
    p = logits_to_probs(logits[len(prompt) - 1 : -1], sampling)
    assert bool((p[torch.arange(30), torch.tensor(out.tokens)] > 0).all())


# --- Medusa over a draft vocabulary (FR-Spec / EAGLE-3's d2t) ---------------------------------

DRAFT_IDS = [1, 3, 4, 6]  # not the first ids: d2t must be applied


def _medusa_reduced(model, tree: bool) -> MedusaProposer:
    """Medusa heads over 4 of the 8 tokens (random residual blocks), chain or tree."""
    counts = torch.zeros(VOCAB, dtype=torch.long)
    counts[DRAFT_IDS] = 10
    d2t, t2d = draft_vocab(counts, len(DRAFT_IDS))
    heads = MedusaHeads.from_target(model, num_heads=3, num_layers=1, d2t=d2t, t2d=t2d)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    choices = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)] if tree else None
    return MedusaProposer(heads, model.config.num_hidden_layers, choices)


class MisplacedQ:
    """A reduced-vocabulary chain whose q sits at the first N ids instead of the draft tokens'
    (an indexing slip that keeps the tokens right): the χ² check must reject it."""

    def __init__(self, proposer: MedusaProposer):
        self.inner, self.feature_layers = proposer, proposer.feature_layers
        self.start, self.accept = proposer.start, proposer.accept

    def propose(self, ids, k, sampling, generator):
        p = self.inner.propose(ids, k, sampling, generator)
        wrong = torch.zeros_like(p.probs)
        wrong[:, : len(DRAFT_IDS)] = p.probs[:, DRAFT_IDS]
        return Proposal(p.tokens, wrong, p.parents)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_medusa_draft_vocab_stays_lossless_at_temperature(model, tree):
    """Sampled chain (q over the target vocabulary, zero outside the draft vocabulary) and
    sampled tree (top-k candidates mapped to target ids) keep the target's distribution."""
    sampling = SamplingParams(temperature=0.8, top_k=6)
    stat, critical, accepted = chi2_check(model, _medusa_reduced(model, tree), sampling, 500)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"
    assert accepted[0] > 0, accepted


def test_medusa_draft_vocab_check_rejects_a_misplaced_q(model):
    sampling = SamplingParams(temperature=0.8, top_k=6)
    stat, critical, _ = chi2_check(model, MisplacedQ(_medusa_reduced(model, False)), sampling, 300)
    assert stat > critical, f"misplaced q not rejected: chi2 {stat:.1f} < {critical:.1f}"


# --- greedy trees are unchanged ----------------------------------------------------------------


def test_greedy_trees_unchanged_and_draw_nothing(target):
    """At temperature 0 a tree is still accepted by argmax match (the output is the target's
    greedy one) and the loop draws no random numbers."""
    prompt = [5, 1, 60, 33, 2, 7]
    ref = reference_greedy(target, prompt, 20)
    for drafter in (
        OracleTreeDrafter(len(prompt), ref, vocab=64),
        TreeDrafter(MIXED, "topk"),
        _medusa(target),
        _eagle(target),
    ):
        gen = torch.Generator().manual_seed(7)
        state = gen.get_state()
        out = generate(target, prompt, drafter, k=3, max_new_tokens=20, generator=gen)
        assert out.tokens == ref, type(drafter).__name__
        assert torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("seed", range(4))
def test_one_hot_shortcut_decides_as_the_full_residual_rule(seed):
    """Deterministic candidates take a shortcut (acceptance from p gathered at the candidates,
    one residual row at the end); given the same randomness it makes the same decisions and
    draws the same token as the general rule fed explicit one-hot q rows, duplicates included."""
    v = 7
    g = torch.Generator().manual_seed(seed)
    par = [-1, -1, -1, 0, 0, 1, 3, 3, -1]
    n = len(par)
    logits = 2.0 * torch.randn(n + 1, v, generator=g)
    sampling = SamplingParams(temperature=1.0, top_k=6)
    kids = speculative._tree_children(par, torch.device("cpu"))
    depth = int(speculative._tree_inputs(par, 0, torch.device("cpu"))[2].max())
    for trial in range(50):
        tokens = torch.randint(0, v, (n,), generator=g)
        tokens[1] = tokens[0]  # a repeated root candidate
        one_hot = torch.nn.functional.one_hot(tokens, v).float()
        outs = []
        for probs in (None, one_hot):
            prop = Proposal(tokens, probs, torch.tensor(par))
            rng = torch.Generator().manual_seed(100 * seed + trial)
            outs.append(
                speculative._accept_tree_sampled(logits, prop, *kids, depth, sampling, rng).tolist()
            )
        assert outs[0] == outs[1], (trial, outs)
