"""What smaller trees would accept, counted from one tree's steps, and the size it recommends.

An EAGLE-2 tree ranks its nodes (``Proposal.priority``); the loop counts, for every m, what the
step's best m nodes alone would have accepted (``GenerationOutput.accepted_by_tree_size``). The
tests run one tree step, then prune the very same proposal to its best m nodes and run that step
again: greedy, the pruned step accepts exactly the count; sampled, the same on average.
"""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.heads.base import Proposal
from draftsmith.heads.eagle import EagleConfig, build_drafter
from draftsmith.heads.eagle_proposer import EagleProposer
from draftsmith.heads.sampling import SamplingParams
from draftsmith.train.decoding.metrics import summarize, tree_sizes_sum
from draftsmith.train.decoding.speculative import _count_pruned, generate
from draftsmith.train.report.recommend import recommend_tree
from tests.conftest import tiny_llama

VOCAB = 8
DEPTH, TOPK, NODES = 3, 3, 9


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=VOCAB, layers=2, seed=5, init_std=0.3)


class OneStep:
    """Proposes the wrapped tree drafter's first tree, pruned to its best ``keep`` nodes (all
    when None), then nothing: the run has exactly one tree step."""

    def __init__(self, inner: EagleProposer, keep: int | None = None):
        self.inner, self.keep = inner, keep
        self.feature_layers = inner.feature_layers
        self.first: Proposal | None = None

    def start(self, prompt_ids, features):
        self.inner.start(prompt_ids, features)
        self.first, self.done = None, False

    def accept(self, num_accepted, features):
        self.inner.accept(num_accepted, features)

    def propose(self, ids, k, sampling, generator):
        if self.done:
            return Proposal(tokens=torch.empty(0, dtype=torch.long))
        self.done = True
        self.first = p = self.inner.propose(ids, k, sampling, generator)
        if self.keep is None:
            return p
        kept = [j for j in range(len(p)) if int(p.priority[j]) < self.keep]
        index = {j: i for i, j in enumerate(kept)}
        parents = [index[int(p.parents[j])] if int(p.parents[j]) >= 0 else -1 for j in kept]
        return Proposal(
            tokens=p.tokens[kept],
            parents=torch.tensor(parents, dtype=torch.long),
            priority=p.priority[kept],
        )


def _proposer(model) -> EagleProposer:
    n = model.config.num_hidden_layers
    cfg = EagleConfig.from_target(model.config, 3, feature_layers=[0, n // 2, n])
    return EagleProposer(
        build_drafter(model, cfg, seed=0), tree=True, topk=TOPK, total_tokens=NODES
    )


def _run(model, drafter, prompt, sampling, seed):
    gen = torch.Generator().manual_seed(seed)
    return generate(
        model, prompt, drafter, k=DEPTH, max_new_tokens=8, sampling=sampling, generator=gen
    )


def test_count_pruned_grows_with_the_largest_tree():
    sums: list[int] = []
    # A 6-node tree whose path is nodes 0, 3, 4 (rows 1, 4, 5), ranked 0, 2, 5.
    _count_pruned(sums, torch.tensor([0, 1, 3, 2, 5, 4]), [1, 4, 5], 6)
    assert sums == [1, 1, 2, 2, 2, 3]
    # A larger tree, path node 1 ranked 1: sizes 7-8 start from size 6's sum.
    _count_pruned(sums, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]), [2], 8)
    assert sums == [1, 2, 3, 3, 3, 4, 4, 4]
    # A smaller tree (the budget's end): every size accepts its whole 2-node path.
    _count_pruned(sums, torch.tensor([0, 1]), [1, 2], 2)
    assert sums == [2, 4, 5, 5, 5, 6, 6, 6]
    assert tree_sizes_sum([[1, 2], [3], []]) == [4, 5]


def test_priority_is_eagle2_reranking_order(model):
    drafter = OneStep(_proposer(model))
    _run(model, drafter, [1, 4, 2, 7], SamplingParams(), 0)
    p = drafter.first
    assert sorted(p.priority.tolist()) == list(range(len(p)))
    for m in range(1, len(p) + 1):  # every best-m set holds its nodes' parents
        best = {j for j in range(len(p)) if int(p.priority[j]) < m}
        assert all(int(p.parents[j]) in best | {-1} for j in best)


def test_greedy_counts_equal_the_pruned_trees_steps(model):
    seen = set()
    proposer = _proposer(model)
    for seed in range(12):
        prompt = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(seed))
        full = OneStep(proposer)
        out = _run(model, full, prompt.tolist(), SamplingParams(), 0)
        n = len(full.first)
        assert len(out.accepted_by_tree_size) == n
        assert out.accepted_by_tree_size[-1] == out.accepted
        for m in range(1, n + 1):
            pruned = _run(model, OneStep(proposer, keep=m), prompt.tolist(), SamplingParams(), 0)
            assert pruned.accepted == out.accepted_by_tree_size[m - 1], (seed, m)
        seen.add(tuple(out.accepted_by_tree_size))
    assert len(seen) > 3, "too few distinct outcomes to test anything"


def test_sampled_counts_match_the_pruned_trees_on_average(model):
    sampling = SamplingParams(temperature=1.0)
    prompt = [3, 1, 6, 2]
    runs = 300
    full_sums = [0.0] * NODES
    proposer = _proposer(model)
    for seed in range(runs):
        out = _run(model, OneStep(proposer), prompt, sampling, seed)
        for m, a in enumerate(out.accepted_by_tree_size):
            full_sums[m] += a
    for m in (1, 3, 6):
        accepted = [
            _run(model, OneStep(proposer, keep=m), prompt, sampling, 10_000 + seed).accepted
            for seed in range(runs)
        ]
        mean = sum(accepted) / runs
        var = sum((a - mean) ** 2 for a in accepted) / (runs - 1)
        # Two independent means of `runs` draws each; 4.5 standard errors of their difference.
        bound = 4.5 * math.sqrt(2 * var / runs) + 1e-9
        assert abs(full_sums[m - 1] / runs - mean) <= bound, (m, full_sums[m - 1] / runs, mean)
    assert full_sums[0] < full_sums[-1], "the test needs trees whose extra nodes get accepted"


def test_summary_and_recommendation():
    from draftsmith.heads.base import GenerationOutput

    runs = [
        GenerationOutput(
            tokens=[0] * 10,
            target_forwards=5,
            draft_steps=4,
            proposed=32,
            accepted=6,
            accepted_per_position=[3, 2, 1],
            accepted_by_tree_size=[2, 3, 4, 4, 5, 5, 6, 6],
            wall_time=1.0,
            draft_time=0.2,
        ),
    ]
    summary = summarize(runs, 3)
    assert summary["acceptance_length_by_tree_size"] == [1.5, 1.75, 2.0, 2.0, 2.25, 2.25, 2.5, 2.5]
    summary.update(method="tree", speedup=1.2, speedup_vs_fastest_plain=1.1)
    # Verify cost grows with width: the 8-node tree pays V(9) = 2 s, a 5-node tree V(6) = 1.5 s.
    costs = {1: 1.0, 6: 1.5, 9: 2.0}
    rec = recommend_tree(summary, costs)
    d = 0.2 / 4
    assert rec["measured_nodes"] == 8
    assert rec["predicted"][7] == pytest.approx(1.2)
    want5 = 1.2 * (2.25 / 2.5) * (2.0 + d) / (1.5 + d)
    assert rec["predicted"][4] == pytest.approx(want5)
    assert rec["best_nodes"] == max(range(1, 9), key=lambda m: (rec["predicted"][m - 1], -m))
    assert rec["best_predicted_speedup_vs_fastest_plain"] == pytest.approx(
        1.1 * rec["best_predicted_speedup"] / 1.2
    )
    assert rec["extrapolated_widths"] == []
    assert recommend_tree({"method": "chain", "speedup": 1.1}, costs) is None


def test_medusa_tree_order_is_build_trees_choice_order():
    from draftsmith.heads.medusa import build_tree, tree_order

    g = torch.Generator().manual_seed(3)
    acc = torch.rand(3, 5, generator=g).sort(dim=-1, descending=True).values.tolist()
    order = tree_order(build_tree(acc, 20), acc)
    for m in range(1, 21):  # the best m of the 20-node tree are the best tree of m nodes
        assert set(order[:m]) == set(build_tree(acc, m))
        assert all(len(n) == 1 or n[:-1] in order[:m] for n in order[:m])


def test_tree_costs_are_keyed_by_verify_width(tmp_path):
    import json

    from draftsmith.train.decoding.draft_length import load_cost_profile

    path = tmp_path / "profile.json"
    entry = {"chain": {"1": 10.0, "4": 12.0}, "tree": {"8": 15.0, "16": 20.0}}
    path.write_text(json.dumps({"profile": {"bfloat16": {"1": entry}}}))
    assert load_cost_profile(path, "bfloat16", 1) == {1: 0.010, 4: 0.012}
    assert load_cost_profile(path, "bfloat16", 1, kind="tree") == {9: 0.015, 17: 0.020}
    del entry["tree"]
    path.write_text(json.dumps({"profile": {"bfloat16": {"1": entry}}}))
    assert load_cost_profile(path, "bfloat16", 1, kind="tree") == {}
