"""P-EAGLE: an EAGLE-3 drafter that drafts all k positions in one forward (parallel drafting).

Covers the placeholder objective (a deep position never sees the tokens it stands in front of),
one drafter forward per verification step, lossless greedy and sampled output through the loop,
the recipe (train, resume, best/), and the ``peagle`` export's round trip.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama
from test_eagle import PROMPT_LEN, _batch, _prompts
from test_eagle_recipe import base_args
from test_speculative import VOCAB, _empirical, chi2_quantile, chi2_stat, exact_joint

from draftsmith.heads.eagle import EagleConfig, build_drafter, load_drafter
from draftsmith.heads.eagle_proposer import EagleProposer
from draftsmith.heads.sampling import SamplingParams
from draftsmith.recipes.eagle import main as train_eagle
from draftsmith.recipes.evaluate import main as evaluate
from draftsmith.train.decoding.speculative import generate
from draftsmith.train.export.eagle import export_drafter, load_export
from draftsmith.train.objectives.eagle_ttt import eagle3_ttt_loss

MASK = 5


def _config(target, mask: int | None = MASK) -> EagleConfig:
    return EagleConfig.from_target(target.config, 3, feature_layers=[1, 2, 3], mask_token_id=mask)


@pytest.fixture(scope="module")
def tgt():
    return tiny_llama(seed=0, init_std=0.1)


@pytest.fixture(scope="module")
def data(tgt):
    return _batch(tgt)


@pytest.fixture(scope="module")
def trained(tgt, data):
    drafter = build_drafter(tgt, _config(tgt), seed=0)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(60):
        loss, _ = eagle3_ttt_loss(drafter, data, tgt.lm_head, steps=4)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def test_config_and_parameters(tgt):
    drafter = build_drafter(tgt, _config(tgt), seed=0)
    h = tgt.config.hidden_size
    assert tuple(drafter.mask_hidden.shape) == (1, 3 * h)
    assert drafter.mask_hidden.requires_grad
    assert "mask_hidden" not in build_drafter(tgt, _config(tgt, None), seed=0).state_dict()
    with pytest.raises(ValueError, match="mask_token_id"):
        _config(tgt, tgt.config.vocab_size)
    with pytest.raises(ValueError, match="P-EAGLE"):
        EagleConfig.from_target(tgt.config, 1, mask_token_id=MASK)


def test_deep_positions_never_see_the_tokens_they_stand_for(tgt, data):
    """Depth j >= 1 at position t predicts x_{t+2+j} from the context up to x_{t+1} only."""
    drafter = build_drafter(tgt, _config(tgt), seed=1).eval()
    t = 20
    logits = {}

    def capture(batch):
        out = {}
        original = drafter.forward

        def spy(*args, **kwargs):
            loss_fn = kwargs.get("head_fn")
            if loss_fn is None:
                hidden, lg = original(*args, **kwargs)
                out.setdefault("steps", []).append(lg)
                return hidden, lg

            def head_fn(head_in, weight):  # the step's logits, as the loss's head makes them
                out.setdefault("steps", []).append(head_in @ weight.T)
                return loss_fn(head_in, weight)

            return original(*args, **{**kwargs, "head_fn": head_fn})

        drafter.forward = spy
        try:
            with torch.no_grad():
                eagle3_ttt_loss(drafter, batch, tgt.lm_head, steps=4)
        finally:
            del drafter.forward
        return out["steps"]

    logits["a"] = capture(data)
    changed = dict(data)
    ids = data["input_ids"].clone()
    ids[:, t + 2 :] = (ids[:, t + 2 :] + 7) % 64  # every token a depth >= 1 at t stands for
    changed["input_ids"] = ids
    feats = {k: v.clone() for k, v in data["hidden_states"].items()}
    for v in feats.values():
        v[:, t + 1 :] += 1.0  # and the target features there
    changed["hidden_states"] = feats
    logits["b"] = capture(changed)
    for j in range(4):
        assert torch.allclose(logits["a"][j][:, t], logits["b"][j][:, t], atol=1e-5), j
    # The check has power: the same edit changes a position that does see those tokens.
    assert not torch.allclose(logits["a"][0][:, t + 2], logits["b"][0][:, t + 2])


class _Counting(EagleProposer):
    def __init__(self, drafter):
        super().__init__(drafter, parallel=True)
        self.forwards = 0
        self.proposals = 0
        core = self.drafter
        original = core.forward

        def counted(*args, **kwargs):
            self.forwards += 1
            return original(*args, **kwargs)

        core.forward = counted

    def propose(self, ids, k, sampling, generator):
        self.proposals += 1
        return super().propose(ids, k, sampling, generator)


def test_one_drafter_forward_per_step_and_greedy_identical(tgt, data, trained):
    accepted = 0
    for prompt in [*data["input_ids"][:2, :PROMPT_LEN], *_prompts(2)]:
        ref = generate(tgt, prompt, None, max_new_tokens=40).tokens
        for k in (1, 3, 5):
            proposer = _Counting(trained)
            try:
                out = generate(tgt, prompt, proposer, k=k, max_new_tokens=40)
            finally:
                del trained.forward
            assert out.tokens == ref, k
            assert proposer.forwards == proposer.proposals  # one forward per drafted step
            accepted += out.accepted
    assert accepted > 0  # partial acceptance and rollback were exercised


def test_parallel_draft_equals_recomputation(tgt, data, trained):
    """The cached, incremental draft equals one forward over everything from scratch."""
    prompt = data["input_ids"][0, :PROMPT_LEN]
    proposer = EagleProposer(trained, parallel=True)
    out = generate(tgt, prompt, proposer, k=3, max_new_tokens=12)
    ids = torch.cat([prompt, torch.tensor(out.tokens)])[None]
    with torch.no_grad():
        hs = tgt(ids, output_hidden_states=True).hidden_states
    feats = {i: h[:, :-1] for i, h in enumerate(hs)}
    fresh = EagleProposer(trained, parallel=True)
    fresh.start(ids[:, :-1], feats)
    got = fresh.propose(ids, 4, SamplingParams(), None).tokens

    d = trained
    f = d.feature_tensor(feats)
    emb = d.embed(ids[:, 1:])
    mask_emb, mask_feats = d.placeholders(1, 3)
    n = f.shape[1]
    with torch.no_grad():
        hidden, _ = d(
            torch.cat([emb, mask_emb], 1),
            torch.cat([f, mask_feats], 1),
            torch.arange(n + 3)[None],
        )
        want = d.target_ids(d.logits(hidden[:, n - 1 :])[0].argmax(-1))
    assert got.tolist() == want.tolist()


def test_sampling_matches_target_distribution():
    """χ² through the loop: each position is drawn from its own q, accepted losslessly."""
    model = tiny_llama(vocab_size=VOCAB, layers=2, seed=11, init_std=0.3)
    cfg = EagleConfig.from_target(model.config, 3, feature_layers=[0, 1, 2], mask_token_id=3)
    drafter = build_drafter(model, cfg, seed=3, init_std=0.3).eval()
    prompt = [1, 4, 2, 7]
    for sampling in (SamplingParams(temperature=1.0), SamplingParams(0.7, top_k=5, top_p=0.9)):
        exact = exact_joint(model, prompt, sampling)
        counts = _empirical(model, prompt, EagleProposer(drafter, parallel=True), sampling, k=2)
        assert counts[exact == 0].sum() == 0
        stat, df = chi2_stat(counts, exact)
        assert stat < chi2_quantile(df, 3.72), (sampling, stat, df)


def test_kinds_refuse_the_other_drafter(tgt, tmp_path):
    from draftsmith.heads.base import BuildOptions
    from draftsmith.heads.eagle import EAGLE, PEAGLE, save_drafter

    save_drafter(build_drafter(tgt, _config(tgt), seed=0), tmp_path / "p")
    save_drafter(build_drafter(tgt, _config(tgt, None), seed=0), tmp_path / "e")
    options = BuildOptions(target=tgt)
    assert PEAGLE.build(str(tmp_path / "p"), options).parallel
    with pytest.raises(ValueError, match="peagle="):
        EAGLE.build(str(tmp_path / "p"), options)
    with pytest.raises(ValueError, match="eagle="):
        PEAGLE.build(str(tmp_path / "e"), options)


def test_export_round_trip(tgt, trained, tmp_path):
    from draftsmith.heads.eagle import save_drafter

    save_drafter(trained, tmp_path / "drafter")
    out = export_drafter(
        "peagle",
        tmp_path / "drafter",
        tmp_path / "export",
        target_name_or_path="org/target",
        verifier_architectures=["LlamaForCausalLM"],
        speculative_tokens=4,
    )
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle"
    assert config["architectures"] == ["PEagleSpeculator"]
    assert config["mask_token_id"] == MASK
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    from safetensors.torch import load_file

    assert tuple(load_file(str(out / "model.safetensors"))["mask_hidden"].shape) == (
        1,
        1,
        3 * tgt.config.hidden_size,
    )
    back = load_export(out, tgt)
    assert back.config == trained.config
    prompt = _prompts(1)[0]
    a = generate(tgt, prompt, EagleProposer(trained, parallel=True), k=4, max_new_tokens=16)
    b = generate(tgt, prompt, EagleProposer(back, parallel=True), k=4, max_new_tokens=16)
    assert (a.tokens, a.accepted) == (b.tokens, b.accepted)
    for name, value in trained.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    # The EAGLE-3 formats refuse a P-EAGLE drafter, naming the one to use.
    with pytest.raises(Exception, match="--format peagle"):
        export_drafter("speculators", tmp_path / "drafter", tmp_path / "x", target_name_or_path="t")


def test_recipe_trains_resumes_and_validates(tmp_path, tiny_target_dir):
    args = [*base_args(tmp_path, tiny_target_dir, 3, ttt_steps=4), "--parallel-drafting"]
    assert train_eagle(args) == 0
    run = tmp_path / "run"
    metrics = json.loads((run / "training_metrics.json").read_text())
    assert metrics["parallel_drafting"] is True
    assert metrics["mask_token_id"] is not None
    val = metrics["final_validation"]
    assert {"val/acc_0", "val/acc_3"} <= set(val)
    drafter = load_drafter(run / "best", _target(tiny_target_dir))
    assert drafter.config.parallel and drafter.config.mask_token_id == metrics["mask_token_id"]
    # Resume: more steps continue from step 6.
    more = base_args(tmp_path, tiny_target_dir, 3, ttt_steps=4, max_steps=8)
    assert train_eagle([*more, "--parallel-drafting"]) == 0
    resumed = json.loads((run / "training_metrics.json").read_text())
    assert resumed["steps"] == 8 and resumed["resumed_from"] == 6
    # evaluate runs it as the peagle kind; greedy output stays the target's own.
    out = tmp_path / "eval.json"
    args = ["--target", str(tiny_target_dir), "--drafter", f"peagle={run / 'best'}"]
    args += ["--k", "3", "--limit", "2", "--max-new-tokens", "12", "--out", str(out)]
    assert evaluate(args) == 0
    result = json.loads(out.read_text())
    assert all(m["identical_to_target"] for m in result.get("methods", [result]))
    # A config that asks for it on EAGLE-1 is refused, naming the field.
    (tmp_path / "bad").mkdir()
    bad = [*base_args(tmp_path / "bad", tiny_target_dir, 1), "--parallel-drafting"]
    assert train_eagle(bad) == 2


def _target(path):
    from draftsmith.train.target_model.load import load_target

    return load_target(str(path))[0]
