"""Cost-aware draft length: the choice follows measured acceptance and costs; output unchanged."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from draftsmith.heads.ngram import NGramDrafter
from draftsmith.train.decoding.draft_length import AdaptiveDraftLength
from draftsmith.train.decoding.speculative import generate
from tests.test_speculative import OracleDrafter, RandomDrafter, _prompt, reference_greedy

# Costs shaped like SmolLM2 on 2 CPU cores: 55 ms for 1 token, ~+9 ms per extra token.
COST = {m: 0.055 + 0.009 * (m - 1) for m in range(1, 10)}


def _feed(policy, steps, accept_fn, draft_s_per_token=0.0):
    for _ in range(steps):
        n = policy.choose(policy.k)
        a = accept_fn(n)
        policy.update(n, a, COST[n + 1], n * draft_s_per_token)


def test_good_drafter_gets_full_length():
    policy = AdaptiveDraftLength(k=5)
    _feed(policy, 50, lambda n: n)  # every draft token accepted
    assert policy.choose(5) == 5
    assert policy.choose(3) == 3  # budget limit respected


def test_useless_drafter_falls_back_to_plain_steps_but_keeps_exploring():
    policy = AdaptiveDraftLength(k=5, explore_every=8)
    _feed(policy, 80, lambda n: 0)  # nothing ever accepted
    recent = policy.chosen[-40:]
    assert recent.count(0) >= 35  # mostly plain decoding
    probes = [i for i, n in enumerate(policy.chosen) if n > 0]
    assert probes and all(policy.chosen[i] == 1 for i in probes[3:])  # cheap one-token probes
    gaps = [b - a for a, b in itertools.pairwise(probes[2:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # failed probes back off


def _accept_each_with(p: float, seed: int = 0):
    rng = random.Random(seed)

    def accept(n: int) -> int:
        a = 0
        while a < n and rng.random() < p:
            a += 1
        return a

    return accept


def test_expensive_drafter_gets_shorter_drafts():
    """Same acceptance (0.7 per position), a costly drafter: fewer tokens are worth drafting."""
    cheap, costly = AdaptiveDraftLength(k=6), AdaptiveDraftLength(k=6)
    _feed(cheap, 200, _accept_each_with(0.7), draft_s_per_token=0.0)
    _feed(costly, 200, _accept_each_with(0.7), draft_s_per_token=0.04)
    assert statistics.median(cheap.chosen[-50:]) >= 3
    assert statistics.median(costly.chosen[-50:]) <= 1


def test_bad_k_rejected():
    with pytest.raises(ValueError, match="k must be >= 1"):
        AdaptiveDraftLength(k=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_adaptive_length_keeps_greedy_output_identical(target, seed):
    prompt = _prompt(20 + seed)
    ref = reference_greedy(target, prompt, 40)
    for drafter in (
        OracleDrafter(len(prompt), ref),
        OracleDrafter(len(prompt), ref, wrong=True),
        RandomDrafter(64, seed),
        NGramDrafter(max_ngram=3, min_ngram=1),
    ):
        policy = AdaptiveDraftLength(k=6)
        for _ in range(2):  # the policy carries over between sequences
            out = generate(target, prompt, drafter, k=6, max_new_tokens=40, draft_length=policy)
            assert out.tokens == ref


def test_cost_profile_seeds_verify_costs(tmp_path):
    import json

    import pytest

    from draftsmith.train.decoding.draft_length import AdaptiveDraftLength, load_cost_profile

    path = tmp_path / "forward_cost.json"
    chain = {"1": 50.0, "2": 51.0, "4": 52.0, "6": 54.0}
    path.write_text(json.dumps({"profile": {"bfloat16": {"1": {"chain": chain}, "2": {}}}}))
    costs = load_cost_profile(path, "bfloat16", threads=1)
    assert costs == {1: 0.05, 2: 0.051, 4: 0.052, 6: 0.054}
    with pytest.raises(ValueError, match="float32"):
        load_cost_profile(path, "float32", threads=1)
    # Nearly flat verify cost: with a confident drafter, the first choice is already the full k.
    policy = AdaptiveDraftLength(5, prior_accept=0.8, cost_profile=costs)
    assert policy.choose(5) == 5
    # A steep profile (fp32-like: 2 tokens cost 1.7x one) makes the same drafter draft less.
    steep = AdaptiveDraftLength(5, prior_accept=0.3, cost_profile={1: 0.06, 2: 0.1, 6: 0.11})
    flat = AdaptiveDraftLength(5, prior_accept=0.3, cost_profile={1: 0.06, 2: 0.06, 6: 0.066})
    assert steep.choose(5) < flat.choose(5)


def test_predicted_speedups_by_hand():
    import pytest

    from draftsmith.train.decoding.draft_length import predicted_speedups

    costs = {1: 0.050, 2: 0.052, 4: 0.056, 6: 0.060}
    got = predicted_speedups([0.5, 0.25, 0.1], costs, draft_seconds_per_token=0.004)
    # k=1: τ 1.5, verify(2) 52 ms + 4 ms drafting; k=3: τ 1.85, verify(4) 56 + 12 ms.
    assert got[1] == pytest.approx(1.5 * 0.050 / (0.052 + 0.004))
    assert got[2] == pytest.approx(1.75 * 0.050 / (0.054 + 0.008))  # width 3 interpolated
    assert got[3] == pytest.approx(1.85 * 0.050 / (0.056 + 0.012))
    assert max(got, key=got.get) == 2
    # Drafting on 40 % of steps: the other 60 % are plain 1-token forwards (1 token, 50 ms).
    mixed = predicted_speedups([0.5, 0.25, 0.1], costs, 0.004, drafted_share=0.4)
    assert mixed[1] == pytest.approx((0.4 * 1.5 + 0.6) * 0.050 / (0.4 * 0.056 + 0.6 * 0.050))
    assert 1.0 < mixed[1] < got[1]


def test_parallel_drafter_pays_its_draft_once_per_step():
    """P-EAGLE / DFlash: one drafter forward per step, whatever k (``per_round``)."""
    import pytest

    from draftsmith.train.decoding.draft_length import predicted_speedups

    costs = {1: 0.050, 2: 0.052, 4: 0.056, 6: 0.060}
    got = predicted_speedups([0.5, 0.25, 0.1], costs, 0.006, per_round=True)
    assert got[1] == pytest.approx(1.5 * 0.050 / (0.052 + 0.006))
    assert got[3] == pytest.approx(1.85 * 0.050 / (0.056 + 0.006))  # not 3 x 6 ms
    chain = predicted_speedups([0.5, 0.25, 0.1], costs, 0.006)
    assert got[3] > chain[3] and got[1] == pytest.approx(chain[1])
