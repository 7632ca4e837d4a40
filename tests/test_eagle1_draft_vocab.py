"""EAGLE-1 with a draft vocabulary (issue 25 item 2): it drafts with N rows of the target's head.

Greedy output stays the target's, sampling stays lossless (q is exactly zero outside the draft
vocabulary), the maps survive save/load, the vLLM export is the full-vocabulary equivalent, and
the recipe builds the maps from its training data.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama
from safetensors.torch import load_file
from test_speculative import VOCAB, _empirical, chi2_quantile, chi2_stat, exact_joint

from draftsmith.heads.eagle import EagleConfig, build_drafter, load_drafter, save_drafter
from draftsmith.heads.eagle_proposer import EagleProposer
from draftsmith.heads.sampling import SamplingParams
from draftsmith.train.data.vocab import draft_vocab
from draftsmith.train.decoding.speculative import generate
from draftsmith.train.export.eagle import export_drafter, load_export
from draftsmith.train.objectives.eagle_ttt import eagle1_loss

N = 40  # draft vocabulary of the 64-token tiny target


@pytest.fixture(scope="module")
def tgt():
    return tiny_llama(seed=0, init_std=0.1)


def _maps(seed: int = 0, n: int = N, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.randint(0, 100, (vocab,), generator=torch.Generator().manual_seed(seed))
    return draft_vocab(counts, n)


def _drafter(tgt, seed: int = 2):
    cfg = EagleConfig.from_target(tgt.config, 1, draft_vocab_size=N)
    d2t, t2d = _maps()
    return build_drafter(tgt, cfg, d2t, t2d, seed=seed).eval(), t2d


def _inputs(drafter, tgt, length: int = 9):
    ids = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = dict(enumerate(tgt(ids, output_hidden_states=True).hidden_states))
    return drafter.embed(ids), drafter.feature_tensor(hs), torch.arange(length)[None]


def test_logits_are_the_target_heads_rows_of_the_draft_vocabulary(tgt):
    drafter, t2d = _drafter(tgt)
    assert drafter.config.reduced_vocab and drafter.has_vocab_maps
    assert not any(n.startswith("lm_head") for n in drafter.state_dict())  # the head is shared
    assert {"d2t", "t2d"} <= set(drafter.state_dict())
    with torch.no_grad():
        hidden, logits = drafter(*_inputs(drafter, tgt), return_logits=True)
        full = tgt.lm_head(hidden)
    assert logits.shape[-1] == N
    assert torch.allclose(logits, full[..., t2d], atol=1e-6)
    spread = drafter.target_logits(logits)
    assert torch.isinf(spread[..., ~t2d]).all() and torch.equal(spread[..., t2d], logits)
    # The rows are gathered once, and again after the maps change in place.
    first = drafter.shared.head_rows(drafter.d2t)
    assert drafter.shared.head_rows(drafter.d2t) is first
    d2t, t2d2 = _maps(seed=5)
    drafter.set_vocab(d2t, t2d2)
    with torch.no_grad():
        _, logits2 = drafter(*_inputs(drafter, tgt), return_logits=True)
    assert torch.allclose(logits2, full[..., t2d2], atol=1e-6)


def test_greedy_equals_plain_and_drafts_stay_in_the_vocabulary(tgt):
    drafter, t2d = _drafter(tgt)
    drafted: list[int] = []

    class Spy(EagleProposer):
        def propose(self, ids, k, sampling, generator):
            proposal = super().propose(ids, k, sampling, generator)
            drafted.extend(proposal.tokens.flatten().tolist())
            return proposal

    g = torch.Generator().manual_seed(100)
    for n in (8, 11):
        prompt = torch.randint(0, 64, (n,), generator=g)
        ref = generate(tgt, prompt, None, max_new_tokens=24).tokens
        for k in (1, 4):
            out = generate(tgt, prompt, Spy(drafter), k=k, max_new_tokens=24)
            assert out.tokens == ref, k
    assert drafted and all(t2d[t] for t in drafted)


def test_sampling_matches_target_distribution():
    """χ² through the loop: q is zero outside the draft vocabulary, and the target still decides."""
    model = tiny_llama(vocab_size=VOCAB, layers=2, seed=11, init_std=0.3)
    cfg = EagleConfig.from_target(model.config, 1, draft_vocab_size=5)
    d2t, t2d = draft_vocab(torch.tensor([9, 1, 8, 7, 2, 6, 5, 3]), 5)
    drafter = build_drafter(model, cfg, d2t, t2d, seed=3, init_std=0.3).eval()
    prompt = [1, 4, 2, 7]
    for sampling in (SamplingParams(temperature=1.0), SamplingParams(0.7, top_k=5, top_p=0.9)):
        exact = exact_joint(model, prompt, sampling)
        counts = _empirical(model, prompt, EagleProposer(drafter), sampling, k=2)
        assert counts[exact == 0].sum() == 0
        stat, df = chi2_stat(counts, exact)
        assert stat < chi2_quantile(df, 3.72), (sampling, stat, df)


def test_save_load_and_full_vocabulary_export(tgt, tmp_path):
    drafter, t2d = _drafter(tgt)
    saved = save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(saved, tgt)
    assert loaded.config == drafter.config
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    args = _inputs(drafter, tgt)
    with torch.no_grad():
        ours = drafter(*args, return_logits=True)[1]
        assert torch.equal(loaded(*args, return_logits=True)[1], ours)

    out = export_drafter("eagle", saved, tmp_path / "export")
    tensors = load_file(str(out / "model.safetensors"))
    assert "d2t" not in tensors and "t2d" not in tensors  # vLLM's EAGLE-1 has no maps
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 64
    served = load_export(out, tgt)
    assert not served.has_vocab_maps and served.config.draft_vocab_size == 64
    with torch.no_grad():
        full = served(*args, return_logits=True)[1]
    # The full-vocabulary equivalent: the same rows where the draft vocabulary has them.
    assert torch.allclose(full[..., t2d], ours, atol=1e-6)


def test_full_vocabulary_drafter_takes_no_maps(tgt):
    drafter = build_drafter(tgt, EagleConfig.from_target(tgt.config, 1), seed=0)
    assert not drafter.has_vocab_maps and "d2t" not in drafter.state_dict()
    with pytest.raises(ValueError, match="full target vocabulary"):
        drafter.set_vocab(*_maps())


def test_loss_accuracy_counts_the_token_drafted_from_the_vocabulary(tgt):
    """acc (and the simulated τ validation reads from it) is the restricted argmax's."""
    drafter, t2d = _drafter(tgt)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hs = dict(enumerate(tgt(ids, output_hidden_states=True).hidden_states))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
        "hidden_states": hs,
    }
    feats = hs[tgt.config.num_hidden_layers]
    # A drafter that predicts the target's next feature exactly drafts the target's argmax
    # whenever that token is in the vocabulary: acc is the share of such positions.
    with torch.no_grad():
        target_arg = tgt.lm_head(feats[:, 1:]).argmax(-1)[:, :-1]  # x_{t+2} for t in [0, T-3]
    in_vocab = t2d[target_arg].float().mean()
    perfect = type(drafter).forward

    def oracle(self, inputs_embeds, features, position_ids, attention_mask=None, **kw):
        hidden = feats[:, 1:].to(features.dtype)
        return hidden, None

    type(drafter).forward = oracle
    try:
        _, metrics = eagle1_loss(drafter, batch, noise=0.0)
    finally:
        type(drafter).forward = perfect
    assert torch.isclose(metrics["acc"], in_vocab, atol=1e-6), (metrics["acc"], in_vocab)
    assert metrics["acc"] < 1.0  # some target tokens lie outside the 40-token vocabulary


def test_recipe_builds_the_maps_from_its_training_data(tmp_path, tiny_target_dir):
    from test_eagle_recipe import base_args

    from draftsmith.recipes.eagle import main as train_eagle
    from draftsmith.train.target_model.load import load_target

    args = base_args(tmp_path, tiny_target_dir, 1, draft_vocab_size=40, max_steps=2)
    assert train_eagle(args) == 0
    metrics = json.loads((tmp_path / "run" / "training_metrics.json").read_text())
    assert 0.5 < metrics["draft_vocab_coverage"] <= 1
    target, _ = load_target(str(tiny_target_dir))
    drafter = load_drafter(tmp_path / "run" / "drafter", target)
    assert drafter.config.version == 1 and drafter.config.draft_vocab_size == 40
    assert int(drafter.t2d.sum()) == 40
    assert 0 <= metrics["final_validation"]["val/acc"] <= 1
