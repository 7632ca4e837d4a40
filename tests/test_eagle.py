"""EAGLE drafters: config, parameter layout, drafting through the loop, save and load.

The TTT masks and losses are in test_eagle_ttt.py (which shares this file's helpers).
"""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from conftest import tiny_llama
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.heads import eagle_model
from draftsmith.heads.base import Drafter
from draftsmith.heads.eagle import EagleConfig, build_drafter, load_drafter, save_drafter
from draftsmith.heads.eagle_model import EagleCache
from draftsmith.heads.eagle_proposer import EagleProposer
from draftsmith.heads.sampling import SamplingParams
from draftsmith.train.data.vocab import draft_vocab, t2d_index
from draftsmith.train.decoding.speculative import generate
from draftsmith.train.objectives.eagle_ttt import (
    eagle1_loss,
    eagle3_ttt_loss,
)

PROMPT_LEN, GEN_LEN = 8, 40


def _config(target, version: int, draft_vocab_size: int | None = None) -> EagleConfig:
    aux = [1, 2, 3] if version == 3 else None
    return EagleConfig.from_target(
        target.config, version, draft_vocab_size=draft_vocab_size, feature_layers=aux
    )


def _vocab(n: int, vocab: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.randint(0, 100, (vocab,), generator=torch.Generator().manual_seed(seed))
    return draft_vocab(counts, n)


def _batch(target, num: int = 16, seed: int = 0) -> dict:
    """Target greedy continuations of random prompts; loss on the generated part."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(num):
        prompt = torch.randint(0, 64, (PROMPT_LEN,), generator=g)
        out = generate(target, prompt, None, max_new_tokens=GEN_LEN)
        seqs.append(torch.cat([prompt, torch.tensor(out.tokens)]))
    ids = torch.stack(seqs)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, PROMPT_LEN:] = 1
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": loss_mask,
        "hidden_states": {i: h for i, h in enumerate(hs)},
    }


def _train(target, drafter, batch, steps: int, lr: float = 3e-3) -> list[float]:
    opt = torch.optim.Adam(drafter.parameters(), lr=lr)
    losses = []
    drafter.train()
    for _ in range(steps):
        if drafter.config.version == 1:
            loss, _ = eagle1_loss(drafter, batch, noise=0.0)
        else:
            loss, _ = eagle3_ttt_loss(drafter, batch, target.lm_head, steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.fixture(scope="module")
def tgt():
    return tiny_llama(seed=0, init_std=0.1)


@pytest.fixture(scope="module")
def data(tgt):
    return _batch(tgt)


@pytest.fixture(scope="module")
def trained(tgt, data):
    """Briefly trained EAGLE-1 and EAGLE-3 (reduced vocab) drafters: acceptance > 0."""
    d1 = build_drafter(tgt, _config(tgt, 1), seed=0)
    _train(tgt, d1, data, 60)
    counts = torch.bincount(data["input_ids"].flatten(), minlength=64)
    d2t, t2d = draft_vocab(counts, 56)  # the tokens the target actually emits
    d3 = build_drafter(tgt, _config(tgt, 3, 56), d2t, t2d, seed=0)
    _train(tgt, d3, data, 60)
    return {1: d1.eval(), 3: d3.eval()}


# --------------------------------------------------------------------------------------------
# Config and layout
# --------------------------------------------------------------------------------------------


def _smollm_like(**rope) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 100000.0},
    )


def test_config_from_target_llama():
    cfg = EagleConfig.from_target(_smollm_like(), 3, draft_vocab_size=32000)
    assert cfg.feature_layers == (2, 15, 27)
    assert cfg.train_layers == (2, 15, 27, 30)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (576, 9, 3)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.hidden_act) == (64, 1536, "silu")
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.target_num_layers) == (49152, 32000, 30)
    assert cfg.norm_before_residual is False
    assert EagleConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg

    c1 = EagleConfig.from_target(_smollm_like(), 1)
    assert c1.feature_layers == (30,) and c1.train_layers == (30,)
    assert c1.draft_vocab_size == 49152
    # Drafters saved before the layers had one name still load: their config.json held
    # EAGLE-3's fused layers as `aux_layers`, empty for EAGLE-1.
    for new, aux in ((cfg, [2, 15, 27]), (c1, [])):
        old = {k: v for k, v in new.to_dict().items() if k != "feature_layers"}
        assert EagleConfig.from_dict({**old, "aux_layers": aux}) == new

    # EAGLE-1 drafts over a draft vocabulary too (rows of the target head), never a larger one.
    assert EagleConfig.from_target(_smollm_like(), 1, draft_vocab_size=100).reduced_vocab
    for version in (1, 3):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            EagleConfig.from_target(_smollm_like(), version, draft_vocab_size=49153)
    with pytest.raises(ValueError, match="feature_layers"):
        EagleConfig.from_target(_smollm_like(), 3, feature_layers=[2, 15, 31])
    with pytest.raises(ValueError, match="unknown EagleConfig field"):
        EagleConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_rope_matches_target_including_scaled_rope():
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    for target_cfg in (_smollm_like(), _smollm_like(**llama3)):
        cfg = EagleConfig.from_target(target_cfg, 3)
        drafter_rope = eagle_model._Rotary(cfg)
        pos = torch.arange(0, 4000, 37)[None]
        cos, sin = drafter_rope(pos, torch.float32)
        ref_cos, ref_sin = LlamaRotaryEmbedding(target_cfg)(torch.zeros(1), pos)
        torch.testing.assert_close(cos[:, 0], ref_cos)
        torch.testing.assert_close(sin[:, 0], ref_sin)
    assert EagleConfig.from_target(_smollm_like(**llama3), 3).rope_scaling["factor"] == 8.0


def test_parameter_names_follow_speculators_layout(tgt):
    d1 = build_drafter(tgt, _config(tgt, 1))
    d3 = build_drafter(tgt, _config(tgt, 3, 40), *_vocab(40))
    layer = [f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
    layer += [f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    layer += ["layers.0.post_attention_layernorm.weight"]
    assert set(d1.state_dict()) == {"fc.weight", *layer}
    v3_only = ["layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight"]
    v3_only += ["norm.weight", "lm_head.weight", "d2t", "t2d"]
    assert set(d3.state_dict()) == {"fc.weight", *layer, *v3_only}
    h = tgt.config.hidden_size
    assert d1.fc.weight.shape == (h, 2 * h) and d1.fc.bias is None
    assert d3.fc.weight.shape == (h, 3 * h) and d3.fc.bias is None
    assert d1.layers[0].self_attn.q_proj.weight.shape[1] == h
    assert d3.layers[0].self_attn.q_proj.weight.shape[1] == 2 * h
    assert d3.lm_head.weight.shape == (40, h)
    assert d3.d2t.dtype == torch.long and d3.t2d.dtype == torch.bool
    # The target's embedding (and EAGLE-1's head) are shared, not drafter parameters.
    target_params = {id(p) for p in tgt.parameters()}
    assert not any(id(p) in target_params for p in d1.parameters())
    assert d1.shared.embed_tokens is tgt.get_input_embeddings()
    assert d1.shared.lm_head is tgt.get_output_embeddings()
    # EAGLE-3's head starts as the target head's rows of the draft vocabulary.
    rows = torch.arange(40) + d3.d2t
    torch.testing.assert_close(d3.lm_head.weight, tgt.lm_head.weight[rows])
    assert isinstance(EagleProposer(d3), Drafter)
    twin = copy.deepcopy(d1)  # e.g. an EMA copy: its own weights, the same shared target
    assert twin.shared.embed_tokens is tgt.get_input_embeddings()
    assert twin.fc.weight is not d1.fc.weight


# --------------------------------------------------------------------------------------------
# Drafting through the verification loop
# --------------------------------------------------------------------------------------------


def _prompts(n: int = 3, seed: int = 100) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (PROMPT_LEN + i,), generator=g) for i in range(n)]


CASES = [(1, False), (3, False), (3, True)]


@pytest.mark.parametrize(("version", "tree"), CASES)
def test_greedy_equals_plain_untrained(tgt, version, tree):
    drafter = build_drafter(tgt, _config(tgt, version), seed=2).eval()
    for prompt in _prompts(2):
        ref = generate(tgt, prompt, None, max_new_tokens=24).tokens
        for k in (1, 4):
            proposer = EagleProposer(drafter, tree=tree)
            out = generate(tgt, prompt, proposer, k=k, max_new_tokens=24)
            assert out.tokens == ref, (version, tree, k)


class _Recording(EagleProposer):
    """Records what each verification step accepted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list[tuple[int, int]] = []  # (proposed depth, accepted)
        self._depth = 0

    def propose(self, ids, k, sampling, generator):
        self._depth = k
        return super().propose(ids, k, sampling, generator)

    def accept(self, num_accepted, features):
        self.log.append((self._depth, num_accepted))
        self._depth = 0
        super().accept(num_accepted, features)


@pytest.mark.parametrize(("version", "tree"), CASES)
def test_greedy_equals_plain_trained(tgt, data, trained, version, tree):
    """A trained drafter gets tokens accepted, so partial acceptance and rollback are exercised.

    The prompts are training prompts: the drafter has fitted the target's continuations there.
    """
    drafter = trained[version]
    log = []
    for prompt in data["input_ids"][:3, :PROMPT_LEN]:
        ref = generate(tgt, prompt, None, max_new_tokens=GEN_LEN).tokens
        for k in (2, 3, 5):
            proposer = _Recording(drafter, tree=tree, topk=3, total_tokens=30)
            out = generate(tgt, prompt, proposer, k=k, max_new_tokens=GEN_LEN)
            assert out.tokens == ref, (version, tree, k)
            assert sum(a for _, a in proposer.log) == out.accepted
            log += proposer.log
    # Steps that kept some draft tokens and rolled back the rest, and steps that kept all.
    assert any(0 < a < depth for depth, a in log), log
    assert any(a == depth > 0 for depth, a in log), log
    assert max(a for _, a in log) >= 3  # deep paths (tree: depth >= 3) get accepted


def test_tree_proposal_is_a_valid_eagle2_tree(tgt, trained):
    drafter = trained[3]
    proposer = EagleProposer(drafter, tree=True, topk=3, total_tokens=30)
    prompt = _prompts(1)[0]
    with torch.no_grad():
        out = tgt(prompt[None], output_hidden_states=True)
    proposer.start(prompt[None], {i: out.hidden_states[i] for i in proposer.feature_layers})
    ids = torch.cat([prompt, out.logits[0, -1].argmax()[None]])[None]
    prop = proposer.propose(ids, 4, SamplingParams(), None)
    parents = prop.parents.tolist()
    assert 0 < len(prop) <= 30 and prop.probs is None
    depth = []
    for j, p in enumerate(parents):
        assert -1 <= p < j  # parents before children, so every ancestor is kept
        depth.append(1 if p == -1 else depth[p] + 1)
    assert 3 <= max(depth) <= 4 and depth.count(1) <= 3
    # Siblings are distinct tokens (top-k of one distribution).
    for p in set(parents):
        sib = [int(prop.tokens[j]) for j in range(len(parents)) if parents[j] == p]
        assert len(sib) == len(set(sib))
    # Draft tokens are target ids inside the draft vocabulary.
    assert bool(drafter.t2d[prop.tokens].all())
    drafter_index = t2d_index(drafter.t2d)
    # Each node's children are the top-k of the drafter's distribution after the path to that
    # node, drafted one token at a time: the tree mask gave every node exactly its ancestors.
    d = drafter
    with torch.no_grad():
        feats = d.feature_tensor({i: out.hidden_states[i] for i in proposer.feature_layers})
        n = ids.shape[1]
        for node in set(parents):
            path, a = [], node
            while a != -1:
                path.insert(0, int(prop.tokens[a]))
                a = parents[a]
            cache = EagleCache()
            h, _ = d(d.embed(ids[:, 1:]), feats, torch.arange(n - 1)[None], cache=cache)
            h = h[:, -1:]
            for depth_i, tok in enumerate(path):
                h, _ = d(
                    d.embed(torch.tensor([[tok]])),
                    h,
                    torch.tensor([[n - 1 + depth_i]]),
                    cache=cache,
                )
            logp = torch.log_softmax(d.logits(h)[0, 0].float(), -1)
            best = d.target_ids(logp.topk(3).indices).tolist()
            base = 0.0 if node == -1 else float(proposer.last_scores[node])
            for j in [j for j in range(len(parents)) if parents[j] == node]:
                tok = int(prop.tokens[j])
                assert tok in best, (node, path, tok, best)
                want = base + float(logp[int(drafter_index[tok])])
                assert abs(float(proposer.last_scores[j]) - want) < 1e-4, (node, path, tok)
    # Reranking kept the best nodes: scores of kept nodes never below a dropped candidate's
    # is not observable here, but kept scores never increase along a path.
    for j, p in enumerate(parents):
        if p != -1:
            assert proposer.last_scores[j] <= proposer.last_scores[p]


@pytest.mark.parametrize("version", [1, 3])
def test_sampled_chain_runs_with_sane_counters(tgt, trained, version):
    drafter = trained[version]
    sampling = SamplingParams(temperature=0.8, top_k=20)
    g = torch.Generator().manual_seed(0)
    for prompt in _prompts(2):
        out = generate(
            tgt,
            prompt,
            EagleProposer(drafter),
            k=3,
            max_new_tokens=30,
            sampling=sampling,
            generator=g,
        )
        assert len(out.tokens) == 30 and all(0 <= t < 64 for t in out.tokens)
        assert 0 <= out.accepted <= out.proposed <= 3 * out.draft_steps
        apos = out.accepted_per_position
        assert all(a >= b for a, b in itertools.pairwise(apos)) and sum(apos) == out.accepted
        assert out.acceptance_length >= 1.0
    # q is a distribution over the target vocab, zero outside the draft vocab (EAGLE-3).
    prompt = _prompts(1)[0]
    with torch.no_grad():
        o = tgt(prompt[None], output_hidden_states=True)
    prop = EagleProposer(drafter)
    prop.start(prompt[None], {i: o.hidden_states[i] for i in prop.feature_layers})
    ids = torch.cat([prompt, o.logits[0, -1].argmax()[None]])[None]
    p = prop.propose(ids, 3, sampling, torch.Generator().manual_seed(1))
    assert p.probs.shape == (3, 64)
    torch.testing.assert_close(p.probs.sum(-1), torch.ones(3))
    assert bool((p.probs[torch.arange(3), p.tokens] > 0).all())
    if version == 3:
        assert float(p.probs[:, ~drafter.t2d].sum()) == 0.0


def test_tree_with_sampling_drafts_a_tree(tgt, trained):
    """With sampling the proposer still drafts an EAGLE-2 tree (top-k candidates, no probs);
    the loop verifies it by multi-candidate speculative sampling (tests/test_tree_sampling.py)."""
    proposer = EagleProposer(trained[3], tree=True)
    drafted = []
    propose = proposer.propose

    def spy(*args):
        drafted.append(propose(*args))
        return drafted[-1]

    proposer.propose = spy
    out = generate(
        tgt,
        _prompts(1)[0],
        proposer,
        k=3,
        max_new_tokens=10,
        sampling=SamplingParams(temperature=1.0),
        generator=torch.Generator().manual_seed(0),
    )
    assert len(out.tokens) == 10
    assert drafted and all(p.parents is not None and p.probs is None for p in drafted)


# --------------------------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 3])
def test_save_load_round_trip(tgt, trained, tmp_path, version):
    drafter = trained[version]
    out = save_drafter(drafter, tmp_path / "d")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draftsmith_format"] == "eagle-drafter" and cfg["version"] == version
    loaded = load_drafter(out, tgt)
    assert loaded.config == drafter.config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = dict(enumerate(tgt(ids, output_hidden_states=True).hidden_states))
        args = (drafter.embed(ids), drafter.feature_tensor(hs), torch.arange(9)[None])
        a = drafter(*args, return_logits=True)[1]
        b = loaded(*args, return_logits=True)[1]
    assert torch.equal(a, b)


def test_load_errors_name_file_and_field(tgt, trained, tmp_path):
    out = save_drafter(trained[3], tmp_path / "d")
    cfg_path = out / "config.json"
    good = json.loads(cfg_path.read_text())

    cfg_path.write_text(json.dumps({**good, "draftsmith_format": "medusa"}))
    with pytest.raises(ValueError, match=r"config\.json.*draftsmith_format"):
        load_drafter(out, tgt)
    cfg_path.write_text(json.dumps({**good, "vocab_size": 128}))
    with pytest.raises(ValueError, match="vocab_size = 128"):
        load_drafter(out, tgt)
    cfg_path.write_text(json.dumps({**good, "draft_vocab_size": 40}))
    with pytest.raises(ValueError, match=r"model\.safetensors.*lm_head"):
        load_drafter(out, tgt)
    cfg_path.write_text(json.dumps(good))
    (out / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_drafter(out, tgt)


# --------------------------------------------------------------------------------------------
# EAGLE-3.1: fc_norm and norm_output
# --------------------------------------------------------------------------------------------


def test_eagle31_norms_each_feature_and_passes_the_post_norm_state(tgt, data):
    """fc_norm makes the fusion blind to each feature's scale; norm_output hands on the
    post-norm state; trained, the drafter learns and its greedy output stays the target's."""
    cfg = EagleConfig.from_target(
        tgt.config, 3, feature_layers=[1, 2, 3], fc_norm=True, norm_output=True
    )
    drafter = build_drafter(tgt, cfg, seed=0).eval()
    assert [n for n, _ in drafter.named_parameters() if n.startswith("fc_norm")] == [
        f"fc_norm.{i}.weight" for i in range(3)
    ]
    h = tgt.config.hidden_size
    g = torch.Generator().manual_seed(0)
    ids, feats = torch.randint(0, 64, (1, 5), generator=g), torch.randn(1, 5, 3 * h, generator=g)
    pos = torch.arange(5)[None]
    scaled = feats.clone()
    scaled[..., h : 2 * h] *= 30.0  # one layer 30x louder, as deep target layers are
    with torch.no_grad():
        out, logits = drafter(drafter.embed(ids), feats, pos, return_logits=True)
        out_scaled, _ = drafter(drafter.embed(ids), scaled, pos)
        plain = build_drafter(tgt, _config(tgt, 3), seed=0).eval()
        plain.load_state_dict(drafter.state_dict(), strict=False)
        ref, _ = plain(plain.embed(ids), feats, pos)
        ref_scaled, _ = plain(plain.embed(ids), scaled, pos)
    torch.testing.assert_close(out_scaled, out, rtol=1e-4, atol=1e-5)
    assert (ref_scaled - ref).abs().max() > 1e-2  # without fc_norm the scale matters
    # norm_output: the output is norm(pre-norm state) (unit RMS before the norm's gain), and
    # the head reads it as it is.
    torch.testing.assert_close(
        (out / drafter.norm.weight).pow(2).mean(-1), torch.ones(1, 5), rtol=1e-3, atol=1e-3
    )
    torch.testing.assert_close(logits, drafter.lm_head(out))

    losses = _train(tgt, drafter, data, 40)
    assert losses[-1] < losses[0] - 0.5  # soft CE of a random target: its entropy is ~9.8
    drafter.eval()
    for prompt in _prompts(2):
        ref_tokens = generate(tgt, prompt, None, max_new_tokens=24).tokens
        for tree in (False, True):
            out = generate(tgt, prompt, EagleProposer(drafter, tree=tree), k=3, max_new_tokens=24)
            assert out.tokens == ref_tokens, tree


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"version": 1, "fc_norm": True}, "EAGLE-3 variants"),
        ({"norm_output": True, "mask_token_id": 3}, "P-EAGLE"),
    ],
)
def test_eagle31_refused_where_it_is_not_served(tgt, kw, match):
    version = kw.pop("version", 3)
    with pytest.raises(ValueError, match=match):
        EagleConfig.from_target(tgt.config, version, **kw)
