"""The per-step draft decision (``heads/auto.py``): what it chooses, and that it stays lossless.

Choice: under a dear verify nothing pays, under a free one every node does, a non-monotone cost
curve is followed, a cheap tree beats the chain and a dear one keeps it. Greedy identity for
every family that drafts with confidences, merged with n-gram lookup, under flat, steep and
non-monotone costs. Sampling: a sampled chain merged with lookup matches the target's
distribution (χ²), and a decision that reads the drawn token's own q fails the same check.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from draftsmith.heads.auto import AutoDrafter, Calibration, Candidates, VerifyCosts, choose_nodes
from draftsmith.heads.base import Proposal
from draftsmith.heads.dflash import DFlashConfig, DFlashProposer
from draftsmith.heads.dflash import build_drafter as build_dflash
from draftsmith.heads.draft_lm import DraftLM
from draftsmith.heads.eagle import EagleConfig, build_drafter
from draftsmith.heads.eagle_proposer import EagleProposer
from draftsmith.heads.medusa import MedusaHeads, MedusaProposer
from draftsmith.heads.ngram import NGramDrafter
from draftsmith.heads.sampling import SamplingParams
from draftsmith.train.decoding.speculative import generate
from tests.conftest import tiny_llama
from tests.test_speculative import OracleDrafter, reference_greedy
from tests.test_tree_sampling import VOCAB, chi2_check

FLAT = VerifyCosts(chain={1: 1.0, 9: 1.0}, tree={1: 1.0, 32: 1.0})
STEEP = VerifyCosts(chain={1: 1.0, 2: 1.7, 3: 2.4, 9: 6.0}, tree={1: 1.7, 32: 20.0})
# Non-monotone, as fp32 on the AVX2 kind: 4 tokens cheaper than 3 (docs/performance.md).
BUMPY = VerifyCosts(chain={1: 1.0, 2: 1.5, 3: 2.0, 4: 1.6, 9: 2.5}, tree={1: 1.5, 8: 2.0, 32: 4})
COSTS = {"flat": FLAT, "steep": STEEP, "bumpy": BUMPY}


def _chain(accepts: list[float]) -> Candidates:
    c = Candidates()
    for i, a in enumerate(accepts):
        c.add(10 + i, i - 1, a)
    return c


# --- the choice ----------------------------------------------------------------------------------


def test_nothing_pays_when_verification_is_dear():
    chosen, value = choose_nodes(_chain([0.3, 0.3]), STEEP, rate=1.0)
    assert chosen == [] and value == pytest.approx(0.0)


def test_free_verification_takes_every_node():
    cands = _chain([0.3, 0.2, 0.1])
    cands.add(50, -1, 0.2)  # a sibling at the root: a tree of 4
    chosen, _ = choose_nodes(cands, FLAT, rate=1.0)
    assert chosen == [0, 1, 2, 3]


def test_non_monotone_curve_is_followed():
    # Width 4 (3 drafts) costs less than width 3 (2 drafts): the third draft is free.
    chosen, _ = choose_nodes(_chain([0.9, 0.9, 0.2]), BUMPY, rate=1.0)
    assert chosen == [0, 1, 2]
    # A smooth curve at the same width-4 price but a dear width 3... picks by value too.
    smooth = VerifyCosts(chain={1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5})
    assert choose_nodes(_chain([0.9, 0.9, 0.2]), smooth, rate=1.0)[0] == [0, 1]


def test_cheap_tree_beats_the_chain_and_dear_one_keeps_it():
    cands = _chain([0.6, 0.5])
    cands.add(40, -1, 0.35)  # a strong sibling of the first node
    cheap = VerifyCosts(chain={1: 1.0, 2: 1.2, 3: 1.4}, tree={1: 1.2, 3: 1.5})
    dear = VerifyCosts(chain={1: 1.0, 2: 1.2, 3: 1.4}, tree={1: 1.2, 3: 3.0})
    assert choose_nodes(cands, cheap, rate=1.0)[0] == [0, 1, 2]
    assert choose_nodes(cands, dear, rate=1.0)[0] == [0, 1]


def test_allowed_nodes_are_respected_and_siblings_are_exclusive():
    cands = _chain([0.6, 0.5])
    cands.add(40, -1, 0.9)  # siblings summing past 1 are scaled to 1
    r = cands.reach()
    assert r[0] + r[2] == pytest.approx(1.0)
    chosen, _ = choose_nodes(cands, FLAT, rate=1.0, allowed=[2])
    assert chosen == [2]


def test_calibration_interpolates_and_rejects_a_broken_map():
    cal = Calibration(knots=[(0.1, 0.05), (0.5, 0.3), (0.9, 0.8)], lookup={"ngram:3:1": 0.7})
    assert cal.learned_rate(0.0) == 0.05 and cal.learned_rate(1.0) == 0.8
    assert cal.learned_rate(0.7) == pytest.approx(0.55)
    assert cal.lookup_rate("ngram", 3, 1) == 0.7
    assert cal.lookup_rate("ngram", 3, 2) == 0.5  # no evidence: the prior
    with pytest.raises(ValueError, match="ascending"):
        Calibration.from_dict({"knots": [[0.1, 0.5], [0.5, 0.2]], "lookup": {}})


# --- greedy identity, every family -------------------------------------------------------------


@pytest.fixture(scope="module")
def big():
    return tiny_llama(seed=0, init_std=0.1)


def _eagle(t, **kw):
    n = t.config.num_hidden_layers
    cfg = EagleConfig.from_target(t.config, 3, feature_layers=[0, n // 2, n], **kw.pop("cfg", {}))
    return EagleProposer(build_drafter(t, cfg, seed=0, init_std=0.1), **kw)


def _medusa(t, tree: bool):
    heads = MedusaHeads.from_target(t, num_heads=3, num_layers=1)
    choices = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)] if tree else None
    return MedusaProposer(heads, t.config.num_hidden_layers, choices)


def _dflash(t):
    cfg = DFlashConfig.from_target(
        t.config, mask_token_id=63, feature_layers=(1, 2, 3), block_size=4
    )
    return DFlashProposer(build_dflash(t, cfg, seed=0, init_std=0.1))


FAMILIES = {
    "eagle-chain": lambda t: _eagle(t),
    "eagle-tree": lambda t: _eagle(t, tree=True, topk=3, total_tokens=10),
    "p-eagle": lambda t: _eagle(t, parallel=True, cfg={"mask_token_id": 5}),
    "dflash": _dflash,
    "medusa-chain": lambda t: _medusa(t, tree=False),
    "medusa-tree": lambda t: _medusa(t, tree=True),
    "draft-lm": lambda t: DraftLM(tiny_llama(seed=3, layers=1, init_std=0.1), 64),
}


def _repetitive_prompt(seed: int) -> list[int]:
    """A prompt with repeats, so the n-gram lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    part = torch.randint(0, 64, (6,), generator=g).tolist()
    return part + part[:4] + torch.randint(0, 64, (3,), generator=g).tolist() + part


@pytest.mark.parametrize(("family", "costs"), list(itertools.product(FAMILIES, COSTS)))
def test_greedy_identity_for_every_family_with_lookup(big, family, costs):
    learned = FAMILIES[family](big)
    auto = AutoDrafter(learned, [NGramDrafter(4, 1)], COSTS[costs])
    for seed in range(2):
        prompt = _repetitive_prompt(seed)
        ref = reference_greedy(big, prompt, 24)
        out = generate(big, prompt, auto, k=3, max_new_tokens=24)
        assert out.tokens == ref, (family, costs, seed)
    s = auto.stats
    assert s["steps"] > 0 and s["learned_drafts"] + s["learned_sat_out"] > 0
    if costs == "flat":  # free verification: a step verifies nothing only with no candidate
        assert s["verified_nothing"] <= s["learned_sat_out"]


class ConfidentOracle(OracleDrafter):
    """The target's own greedy continuation, with a stated confidence per node."""

    def __init__(self, *args, conf: float = 0.95, **kwargs):
        super().__init__(*args, **kwargs)
        self.conf = conf

    def propose(self, ids, k, sampling, generator):
        p = super().propose(ids, k, sampling, generator)
        return Proposal(tokens=p.tokens, confidence=torch.full((len(p),), self.conf))

    def accept(self, num_accepted, features):
        pass


def test_a_confident_oracle_is_verified_and_accepted(big):
    prompt = _repetitive_prompt(5)
    ref = reference_greedy(big, prompt, 30)
    auto = AutoDrafter(ConfidentOracle(len(prompt), ref), [], STEEP)
    out = generate(big, prompt, auto, k=3, max_new_tokens=30)
    assert out.tokens == ref
    assert out.acceptance_length > 2.0  # it verified the oracle's tokens and they held


def test_a_losing_drafter_sits_out_and_eagle_stays_in_step(big):
    """A drafter whose confident guesses never hold, with a dear draft clock: it sits out (the
    loop then verifies with no propose between accepts), and EAGLE's state stays in step."""
    ticks = itertools.count()
    learned = _eagle(big)  # random weights: its guesses rarely hold
    cal = Calibration(knots=[(0.0, 0.0), (1.0, 0.05)])
    auto = AutoDrafter(learned, [NGramDrafter(4, 1)], STEEP, cal, clock=lambda: next(ticks))
    for seed in range(3):
        prompt = _repetitive_prompt(seed)
        out = generate(big, prompt, auto, k=3, max_new_tokens=30)
        assert out.tokens == reference_greedy(big, prompt, 30)
    assert auto.stats["learned_sat_out"] > 0
    assert auto.stats["learned_drafts"] > 0


def test_draft_lm_keeps_only_its_own_accepted_tokens(big):
    """When the lookup's branch is accepted, the draft LM is told none of its tokens were:
    its cache then matches a fresh prefill of the accepted sequence."""
    small = tiny_llama(seed=3, layers=1, init_std=0.1)
    auto = AutoDrafter(DraftLM(small, 64), [NGramDrafter(4, 1)], FLAT)
    prompt = _repetitive_prompt(7)
    out = generate(big, prompt, auto, k=3, max_new_tokens=20)
    assert out.tokens == reference_greedy(big, prompt, 20)
    ids = torch.tensor([[*prompt, *out.tokens[:-1]]])
    lm = auto.learned
    proposal = lm.propose(ids, 1, SamplingParams(), None)
    with torch.no_grad():
        expected = int(small(ids).logits[0, -1].argmax())
    assert int(proposal.tokens[0]) == expected


# --- sampling: lossless, and the check has power -----------------------------------------------


class SampledChain:
    """Draws a chain from a fixed q per parent token (peaked, unlike p), with row-max
    confidences, as the sampled families give them."""

    feature_layers = ()

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        q = torch.softmax(2.5 * torch.randn(VOCAB, VOCAB, generator=g), dim=-1)
        self.q = q

    def start(self, prompt_ids, features):
        pass

    def accept(self, num_accepted, features):
        pass

    def propose(self, ids, k, sampling, generator):
        tok = int(ids[0, -1])
        tokens, rows = [], []
        for _ in range(k):
            row = self.q[tok % VOCAB]
            tok = int(torch.multinomial(row, 1, generator=generator))
            tokens.append(tok)
            rows.append(row)
        probs = torch.stack(rows)
        return Proposal(torch.tensor(tokens), probs, confidence=probs.max(-1).values)


class PeekingAuto(AutoDrafter):
    """The mutation: keeps the first sampled node only when the drawn token's own q is high
    (a decision that reads the draw), else verifies nothing of the learned chain."""

    def _choose_sampled(self, cands, lookup_nodes, rate):
        first = next(j for j in range(len(cands)) if cands.learned[j] == 0)
        if cands.confidence[first] < 0:  # never: confidences are row maxima
            return []
        q_x = float(self._rows[0, cands.tokens[first]])
        return [first] if q_x > 0.3 else []

    def propose(self, ids, k, sampling, generator):
        self._rows = None
        return super().propose(ids, k, sampling, generator)


class _RowSpy(SampledChain):
    def __init__(self, owner, seed: int = 0):
        super().__init__(seed)
        self.owner = owner

    def propose(self, ids, k, sampling, generator):
        p = super().propose(ids, k, sampling, generator)
        self.owner._rows = p.probs
        return p


@pytest.fixture(scope="module")
def small_model():
    return tiny_llama(vocab_size=VOCAB, layers=2, seed=11, init_std=0.3)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)],
    ids=["t1", "t0.7-topk4-topp0.9"],
)
def test_sampled_hybrid_matches_target_distribution(small_model, sampling):
    # Costs that make the choice depend on the confidences: some steps cut, some keep.
    costs = VerifyCosts(chain={1: 1.0, 2: 1.3, 3: 1.7}, tree={1: 1.3, 4: 2.0})
    auto = AutoDrafter(SampledChain(), [NGramDrafter(2, 1)], costs)
    stat, critical, accepted = chi2_check(small_model, auto, sampling)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"
    assert accepted[0] > 0
    s = auto.stats
    assert s["learned_nodes_verified"] > 0 and s["lookup_nodes_verified"] > 0
    assert s["verified_nothing"] > 0 or s["nodes_verified"] < 2 * s["steps"]


def test_a_decision_that_reads_the_draw_fails_the_check(small_model):
    costs = VerifyCosts(chain={1: 1.0, 2: 1.3, 3: 1.7})
    auto = PeekingAuto(None, [], costs)
    auto.learned = _RowSpy(auto)
    auto.feature_layers = ()
    stat, critical, _ = chi2_check(small_model, auto, SamplingParams(temperature=1.0))
    assert stat > critical, f"the mutation passed: chi2 {stat:.1f} < {critical:.1f}"


# --- through draftsmith evaluate ----------------------------------------------------------------


def test_evaluate_auto_calibrates_probes_and_reports(tmp_path, tiny_target_dir):
    """``auto:eagle-tree=DIR`` beside the fixed shapes and n-gram: probed costs, a calibration
    fitted on the train split and stored beside the checkpoint (reused by the next run), the
    decision's counters, per-category figures and the paired comparison; lossless."""
    import json

    from draftsmith.recipes.evaluate import main as evaluate
    from draftsmith.train.target_model.load import load_target

    target, _ = load_target(str(tiny_target_dir))
    n = target.config.num_hidden_layers
    cfg = EagleConfig.from_target(target.config, 3, feature_layers=[0, n // 2, n])
    ckpt = tmp_path / "eagle3"
    from draftsmith.heads.eagle import save_drafter

    save_drafter(build_drafter(target, cfg, seed=0), ckpt)
    out = tmp_path / "r.json"
    args = [
        "--target", str(tiny_target_dir), "--drafter", f"eagle={ckpt}", f"eagle-tree={ckpt}",
        "ngram", f"auto:eagle-tree={ckpt}", "--k", "3", "--tree-total-tokens", "8",
        "--max-new-tokens", "16", "--limit", "4", "--calibration-limit", "4", "--out", str(out),
    ]  # fmt: skip
    assert evaluate(args) == 0
    res = json.loads(out.read_text())
    methods = {m["method"].split("[")[0]: m for m in res["methods"]}
    auto = methods["auto"]
    assert auto["identical_to_target"] is True
    assert set(res["verify_costs"]["median_ms"]) == {"chain", "tree"}
    assert len(res["verify_costs"]["chain"]["1"]) == res["verify_costs"]["reps"]
    report = auto["decision"]["calibration"]
    assert report["prompts"] == 4 and report["learned_nodes"] > 0
    assert (ckpt / "calibration.json").is_file() and (ckpt / "calibration_t0.png").is_file()
    stats = auto["decision"]["stats"]
    assert (
        stats["steps"] > 0
        and stats["steps"] == stats["verified_nothing"] + stats["chain_steps"] + stats["tree_steps"]
    )
    # Per category (the shipped held-out prompts carry them) and paired against the others.
    assert sum(c["prompts"] for c in auto["by_category"].values()) == 4
    assert all("speedup_vs_fastest_plain" in c for c in auto["by_category"].values())
    assert [v["against"] for v in auto["versus"]] == [
        m["method"] for m in res["methods"] if m is not auto
    ]
    assert all(v["overall"]["low"] <= v["overall"]["ratio"] <= v["overall"]["high"]
               for v in auto["versus"])  # fmt: skip
    # A second run reuses the stored calibration.
    assert evaluate([*args[:-2], "--out", str(tmp_path / "r2.json")]) == 0
    res2 = json.loads((tmp_path / "r2.json").read_text())
    auto2 = next(m for m in res2["methods"] if m["method"].startswith("auto"))
    assert auto2["decision"]["calibration"]["file"].endswith("calibration.json")


def test_auto_spec_errors_name_the_kind(tmp_path, tiny_target_dir, capsys):
    from draftsmith.recipes.evaluate import main as evaluate

    code = evaluate(["--target", str(tiny_target_dir), "--drafter", "auto:ngram"])
    assert code == 2
    assert "auto wraps one of" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["draft-lm", "eagle-tree"])
def test_real_families_under_auto_match_the_target_distribution(small_model, family):
    """A sampled draft LM chain (q rows, causal cut) and EAGLE's top-k tree (deterministic
    candidates, any cut) merged with lookup, at T = 0.7 with top-k and top-p."""
    if family == "draft-lm":
        learned = DraftLM(tiny_llama(vocab_size=VOCAB, layers=1, seed=12, init_std=0.3), VOCAB)
    else:
        n = small_model.config.num_hidden_layers
        cfg = EagleConfig.from_target(small_model.config, 3, feature_layers=[0, n // 2, n])
        learned = EagleProposer(
            build_drafter(small_model, cfg, seed=0, init_std=0.3), tree=True, topk=3,
            total_tokens=8,
        )  # fmt: skip
    costs = VerifyCosts(chain={1: 1.0, 2: 1.2, 3: 1.5}, tree={1: 1.2, 4: 1.6, 8: 2.5})
    auto = AutoDrafter(learned, [NGramDrafter(2, 1)], costs)
    sampling = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    stat, critical, accepted = chi2_check(small_model, auto, sampling)
    assert stat < critical, f"{family}: chi2 {stat:.1f} >= {critical:.1f}"
    assert accepted[0] > 0 and auto.stats["learned_nodes_verified"] > 0


def test_cost_curve_keeps_real_dips_and_smooths_noise():
    from draftsmith.train.decoding.verify_cost import smooth

    # A dip of 12 % with tight repetitions (fp32 on the AVX2 kind: 4 tokens cheaper than 3).
    real = [[100, 101, 99, 100, 100], [120, 121, 119, 120, 122], [160, 161, 159, 160, 158],
            [140, 141, 139, 140, 142], [150, 151, 149, 150, 152]]  # fmt: skip
    assert smooth(real)[3] == 140
    # A dip within the repetitions' spread is noise: the curve is made non-decreasing there.
    noisy = [[47, 36, 50, 49, 37], [46, 36, 47, 45, 38], [40, 50, 35, 46, 48], [45, 44, 47, 46, 44]]
    out = smooth(noisy)
    assert all(b >= a for a, b in itertools.pairwise(out))
