"""The verification loop: lossless greedy and sampled output, cache rollback, stops, bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.heads.base import Proposal
from draftsmith.heads.draft_lm import DraftLM, layer_pruned_copy
from draftsmith.heads.ngram import NGramDrafter
from draftsmith.heads.sampling import SamplingParams, logits_to_probs
from draftsmith.train.decoding.speculative import _keep_cache, generate
from tests.conftest import tiny_llama


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Target greedy output by full recomputation (no cache, no speculation)."""
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(ids).logits[0, -1].argmax())
            out.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out


class OracleDrafter:
    """Knows the target's greedy continuation: proposes it, or (wrong=True) always something else."""

    feature_layers = ()

    def __init__(self, prompt_len: int, reference: list[int], wrong: bool = False, vocab: int = 64):
        self.prompt_len, self.reference, self.wrong, self.vocab = (
            prompt_len,
            reference,
            wrong,
            vocab,
        )

    def start(self, prompt_ids, features):
        assert prompt_ids.shape[1] == self.prompt_len

    def propose(self, ids, k, sampling, generator):
        done = ids.shape[1] - self.prompt_len
        guess = torch.tensor(self.reference[done : done + k], dtype=torch.long)
        if self.wrong:
            guess = (guess + 1) % self.vocab
        return Proposal(tokens=guess)

    def accept(self, num_accepted, features):
        if self.wrong:
            assert num_accepted == 0


class RandomDrafter:
    """Proposes uniformly random tokens (q uniform), chain or tree."""

    feature_layers = ()

    def __init__(self, vocab: int, seed: int, tree: bool = False):
        self.vocab, self.tree = vocab, tree
        self.gen = torch.Generator().manual_seed(seed)

    def start(self, prompt_ids, features):
        pass

    def propose(self, ids, k, sampling, generator):
        n = int(torch.randint(0, k + 1, (1,), generator=self.gen))
        tokens = torch.randint(0, self.vocab, (n,), generator=self.gen)
        probs = None if sampling.greedy else torch.full((n, self.vocab), 1.0 / self.vocab)
        parents = None
        if self.tree and n:
            parents = torch.tensor(
                [int(torch.randint(-1, j, (1,), generator=self.gen)) for j in range(n)]
            )
            probs = None
        return Proposal(tokens=tokens, probs=probs, parents=parents)

    def accept(self, num_accepted, features):
        pass


class OracleTreeDrafter(OracleDrafter):
    """A tree holding the right path among distractor branches, in scrambled sibling order."""

    def propose(self, ids, k, sampling, generator):
        done = ids.shape[1] - self.prompt_len
        right = self.reference[done : done + k]
        tokens, parents = [], []
        parent = -1
        for depth, tok in enumerate(right):
            # A wrong sibling first (so the right child is not always index 0), then the right one.
            tokens.append((tok + 3 + depth) % self.vocab)
            parents.append(parent)
            tokens.append(tok)
            parents.append(parent)
            parent = len(tokens) - 1
            # A dead-end child under the wrong sibling.
            tokens.append((tok + 7) % self.vocab)
            parents.append(len(tokens) - 3)
        return Proposal(tokens=torch.tensor(tokens), parents=torch.tensor(parents))


def _prompt(seed: int, length: int = 12, vocab: int = 64) -> list[int]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_identical_for_every_drafter(target, k, seed):
    prompt = _prompt(seed)
    ref = reference_greedy(target, prompt, 30)
    small = tiny_llama(seed=100 + seed, layers=2, init_std=0.1)  # a real, untrained small LM
    drafters = {
        "none": None,
        "oracle": OracleDrafter(len(prompt), ref),
        "always-wrong": OracleDrafter(len(prompt), ref, wrong=True),
        "random": RandomDrafter(64, seed),
        "random-tree": RandomDrafter(64, seed, tree=True),
        "oracle-tree": OracleTreeDrafter(len(prompt), ref),
        "ngram": NGramDrafter(max_ngram=3, min_ngram=1),
        "small-lm": DraftLM(small, target_vocab_size=64),
        "pruned-lm": DraftLM(layer_pruned_copy(target, [0, 3]), target_vocab_size=64),
    }
    for name, drafter in drafters.items():
        out = generate(target, prompt, drafter, k=k, max_new_tokens=30)
        assert out.tokens == ref, f"{name} drafter changed the greedy output (k={k})"
        assert out.stop_reason == "length"


def test_oracle_accepts_everything_and_wrong_drafter_nothing(target):
    prompt = _prompt(3)
    ref = reference_greedy(target, prompt, 25)
    k = 4
    out = generate(target, prompt, OracleDrafter(len(prompt), ref), k=k, max_new_tokens=25)
    # 1 token from prefill, then steps of k accepted + 1 bonus = 5 tokens: 1 + 5*4 + (4 left -> 3+1).
    assert out.tokens == ref
    assert out.target_forwards == 1 + 5
    assert out.accepted == out.proposed
    assert out.acceptance_length == pytest.approx(25 / 6)
    wrong = generate(
        target, prompt, OracleDrafter(len(prompt), ref, wrong=True), k=k, max_new_tokens=25
    )
    assert wrong.tokens == ref
    assert wrong.accepted == 0 and wrong.target_forwards == 25
    assert wrong.accepted_per_position == [0] * k
    tree = generate(target, prompt, OracleTreeDrafter(len(prompt), ref), k=k, max_new_tokens=25)
    assert tree.tokens == ref and tree.target_forwards == 6
    # the last step has budget for 3 drafts only (4 tokens left)
    assert tree.accepted_per_position == [5, 5, 5, 4]


def test_plain_decoding_is_one_token_per_forward(target):
    out = generate(target, _prompt(4), None, max_new_tokens=17)
    assert len(out.tokens) == 17 and out.target_forwards == 17 and out.acceptance_length == 1.0
    assert out.draft_steps == 0 and out.draft_time == 0.0


class CountingTarget(torch.nn.Module):
    """Wraps a model and records the length of every forward's input (detects re-prefill)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.lengths = model, model.config, []

    def forward(self, **kwargs):
        self.lengths.append(kwargs["input_ids"].shape[1])
        return self.model(**kwargs)


def test_kv_cache_is_reused_not_reprefilled(target):
    prompt = _prompt(5, length=20)
    ref = reference_greedy(target, prompt, 24)
    wrapped = CountingTarget(target)
    drafter = RandomDrafter(64, seed=5)
    out = generate(wrapped, prompt, drafter, k=4, max_new_tokens=24)
    assert out.tokens == ref
    assert wrapped.lengths[0] == 20  # the one prefill
    assert all(n <= 5 for n in wrapped.lengths[1:])  # each step feeds last token + <= k drafts


def test_keep_cache_rolls_back_and_selects_tree_paths(target):
    from transformers import DynamicCache

    ids = torch.tensor([_prompt(6, length=10)])
    with torch.no_grad():
        cache = DynamicCache(config=target.config)
        target(input_ids=ids, cache=cache)
        keys = [layer.keys.clone() for layer in cache.layers]
        _keep_cache(cache, 7)
        assert cache.get_seq_length() == 7
        assert all(
            torch.equal(layer.keys, k[..., :7, :])
            for layer, k in zip(cache.layers, keys, strict=True)
        )
        cache = DynamicCache(config=target.config)
        target(input_ids=ids, cache=cache)
        _keep_cache(cache, 4, torch.tensor([6, 9]))
        assert cache.get_seq_length() == 6
        for layer, k in zip(cache.layers, keys, strict=True):
            assert torch.equal(layer.keys, k[..., [0, 1, 2, 3, 6, 9], :])


def test_draft_lm_cache_matches_fresh_prefill(target):
    """After rejections the draft's rolled-back cache gives the same logits as a fresh run."""
    prompt = _prompt(7)
    small = tiny_llama(seed=7, layers=2, init_std=0.1)
    drafter = DraftLM(small, target_vocab_size=64)
    out = generate(target, prompt, drafter, k=3, max_new_tokens=20)
    assert out.proposed > out.accepted  # some rejections happened
    ids = torch.tensor([prompt + out.tokens])
    proposal = drafter.propose(ids, 1, SamplingParams(), None)
    fresh = int(small(ids).logits[0, -1].argmax())
    assert int(proposal.tokens[0]) == fresh


def test_eos_inside_accepted_run_stops_where_plain_decoding_would(target):
    prompt = _prompt(8)
    ref = reference_greedy(target, prompt, 30)
    eos = ref[6]
    cut = ref.index(eos) + 1
    for k in (1, 4, 8):
        out = generate(
            target,
            prompt,
            OracleDrafter(len(prompt), ref),
            k=k,
            max_new_tokens=30,
            eos_token_id=eos,
        )
        assert out.tokens == ref[:cut] and out.stop_reason == "eos"
    plain = generate(target, prompt, None, max_new_tokens=30, eos_token_id=[999, eos])
    assert plain.tokens == ref[:cut]


def test_max_new_tokens_in_the_middle_of_a_run(target):
    prompt = _prompt(9)
    ref = reference_greedy(target, prompt, 12)
    for n in (1, 2, 6, 7, 11):
        out = generate(target, prompt, OracleDrafter(len(prompt), ref), k=5, max_new_tokens=n)
        assert out.tokens == ref[:n] and out.stop_reason == "length"
        # Never drafts past the budget: a step emits accepted + 1 tokens.
        assert out.proposed <= max(n - 1, 0)


def test_ngram_drafter_finds_most_recent_longest_match():
    d = NGramDrafter(max_ngram=3, min_ngram=1)
    ids = torch.tensor([[5, 1, 2, 3, 9, 9, 1, 2, 3, 4, 7, 1, 2, 3]])
    # suffix [1,2,3] occurs at 1 and 6; the most recent (6) continues with 4, 7, 1
    assert d.propose(ids, 3, SamplingParams(), None).tokens.tolist() == [4, 7, 1]
    assert d.propose(ids, 10, SamplingParams(), None).tokens.tolist() == [4, 7, 1, 2, 3]
    assert len(d.propose(torch.tensor([[1, 2, 3, 4]]), 3, SamplingParams(), None)) == 0
    with pytest.raises(ValueError, match="min_ngram"):
        NGramDrafter(max_ngram=1, min_ngram=2)


def test_bad_inputs_are_named(target):
    with pytest.raises(ValueError, match=r"draft model vocab size 32 != target vocab size 64"):
        DraftLM(tiny_llama(vocab_size=32, layers=1), target_vocab_size=64)
    with pytest.raises(ValueError, match="k must be >= 1"):
        generate(target, [1, 2, 3], NGramDrafter(), k=0)
    with pytest.raises(ValueError, match="batch size 2 is not supported"):
        generate(target, torch.ones(2, 4, dtype=torch.long), None)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate(target, [], None)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(target, [1, 2], None, max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)


# --- sampling is lossless: a statistical test ------------------------------------------------

VOCAB = 8
STEPS = 2  # compare the joint distribution of the first two generated tokens (64 outcomes)


def exact_joint(model, prompt: list[int], sampling: SamplingParams) -> torch.Tensor:
    """P(t1, t2) under the target's own processed sampling distribution, [V, V]."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        p1 = logits_to_probs(model(ids).logits[0, -1], sampling)
        seconds = torch.tensor([[*prompt, t] for t in range(VOCAB)])
        p2 = logits_to_probs(model(seconds).logits[:, -1], sampling)
    return p1[:, None] * p2


def chi2_quantile(df: int, z: float) -> float:
    """Upper quantile of chi-square by the Wilson-Hilferty approximation (z = normal quantile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square after pooling cells whose expected count is < 5."""
    n = counts.sum()
    expected = probs.flatten() * n
    counts = counts.flatten().double()
    order = torch.argsort(expected)
    stat, cells, pool_e, pool_c = 0.0, 0, 0.0, 0.0
    for i in order.tolist():
        pool_e += float(expected[i])
        pool_c += float(counts[i])
        if pool_e >= 5:
            stat += (pool_c - pool_e) ** 2 / pool_e
            cells += 1
            pool_e = pool_c = 0.0
    if pool_e > 0:
        stat += (pool_c - pool_e) ** 2 / pool_e
        cells += 1
    # Outcomes with probability 0 must never occur.
    return stat, cells - 1


class SkewedDrafter:
    """Samples from a fixed q whose support differs from the target's (q=0 where p>0 and back)."""

    feature_layers = ()

    def __init__(self, q: torch.Tensor):
        self.q = q

    def start(self, prompt_ids, features):
        pass

    def propose(self, ids, k, sampling, generator):
        probs = self.q.expand(k, -1).clone()
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
        return Proposal(tokens=tokens, probs=probs)

    def accept(self, num_accepted, features):
        pass


# 2,000 draws, 1 - Phi(z = 3.72) = 1e-4 per check: a false failure about once in 10,000 runs.
DRAWS = 2000
Z = 3.72


def _empirical(model, prompt, drafter, sampling, k):
    counts = torch.zeros(VOCAB, VOCAB)
    gen = torch.Generator().manual_seed(1234)
    for _ in range(DRAWS):
        out = generate(
            model, prompt, drafter, k=k, max_new_tokens=STEPS, sampling=sampling, generator=gen
        )
        counts[out.tokens[0], out.tokens[1]] += 1
    return counts


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)],
    ids=["t1", "t0.7-topk5-topp0.9"],
)
def test_speculative_sampling_matches_target_distribution(sampling):
    model = tiny_llama(vocab_size=VOCAB, layers=2, seed=11, init_std=0.3)
    prompt = [1, 4, 2, 7]
    exact = exact_joint(model, prompt, sampling)
    q = torch.tensor([0.4, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0])  # support differs from p's
    drafters = {
        "skewed-q": SkewedDrafter(q),
        "ngram (one-hot q)": NGramDrafter(max_ngram=2, min_ngram=1),
        "small-lm": DraftLM(tiny_llama(vocab_size=VOCAB, layers=1, seed=12, init_std=0.3), VOCAB),
    }
    for name, drafter in drafters.items():
        counts = _empirical(model, prompt, drafter, sampling, k=2)
        assert counts[exact == 0].sum() == 0, f"{name}: produced a token the target cannot"
        stat, df = chi2_stat(counts, exact)
        assert stat < chi2_quantile(df, Z), f"{name}: chi2 {stat:.1f} on {df} df"


def test_statistical_check_has_power():
    """The same check rejects a sampler that skips the correction (returns the draft's tokens)."""
    sampling = SamplingParams(temperature=1.0)
    model = tiny_llama(vocab_size=VOCAB, layers=2, seed=11, init_std=0.3)
    prompt = [1, 4, 2, 7]
    exact = exact_joint(model, prompt, sampling)
    q = torch.tensor([0.4, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0])
    counts = torch.zeros(VOCAB, VOCAB)
    gen = torch.Generator().manual_seed(1)
    for _ in range(DRAWS):
        a, b = torch.multinomial(q, 2, replacement=True, generator=gen).tolist()
        counts[a, b] += 1
    stat, df = chi2_stat(counts, exact)
    assert stat > chi2_quantile(df, Z)


class FeatureSpy(OracleDrafter):
    """Declares layers; records the features the loop hands over at start and after each step."""

    def __init__(self, *args, layers=(0, 2, 4), tree=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.feature_layers = layers
        self.tree = tree
        self.received: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}

    def start(self, prompt_ids, features):
        super().start(prompt_ids, features)
        for layer, h in features.items():
            self.received[layer].append(h)

    def propose(self, ids, k, sampling, generator):
        if self.tree:
            return OracleTreeDrafter.propose(self, ids, k, sampling, generator)
        # right for the first half of k, then wrong: exercises partial acceptance
        guess = super().propose(ids, k, sampling, generator).tokens
        cut = max(1, len(guess) // 2)
        guess[cut:] = (guess[cut:] + 1) % self.vocab
        return Proposal(tokens=guess)

    def accept(self, num_accepted, features):
        for layer, h in features.items():
            assert h.shape[1] == num_accepted + 1
            self.received[layer].append(h)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_drafter_receives_target_features_of_accepted_positions(target, tree):
    """Features handed to the drafter equal a full forward's hidden states at those positions."""
    prompt = _prompt(10)
    ref = reference_greedy(target, prompt, 20)
    spy = FeatureSpy(len(prompt), ref, tree=tree)
    out = generate(target, prompt, spy, k=4, max_new_tokens=20)
    assert out.tokens == ref
    with torch.no_grad():
        full = target(torch.tensor([prompt + ref]), output_hidden_states=True).hidden_states
    for layer in spy.feature_layers:
        got = torch.cat(spy.received[layer], dim=1)[0]  # positions 0 .. covered-1, in order
        covered = got.shape[0]
        assert covered >= len(prompt) + out.accepted  # prompt + every kept step
        torch.testing.assert_close(got, full[layer][0, :covered], atol=1e-5, rtol=1e-4)


def test_draft_lm_accept_without_propose_on_a_new_sequence(target):
    """A step with no proposal (draft length 0) right after start must not corrupt the cache."""
    small = tiny_llama(seed=8, layers=2, init_std=0.1)
    drafter = DraftLM(small, target_vocab_size=64)
    long_prompt, short_prompt = _prompt(11, length=30), _prompt(12, length=8)
    generate(target, long_prompt, drafter, k=4, max_new_tokens=10)
    drafter.start(torch.tensor([short_prompt]), None)
    drafter.accept(0, None)  # plain step: nothing was proposed
    ids = torch.tensor([[*short_prompt, 5]])
    proposal = drafter.propose(ids, 1, SamplingParams(), None)
    assert int(proposal.tokens[0]) == int(small(ids).logits[0, -1].argmax())
