"""Distillation pieces: losses, draft initialisation, vocabulary checks, export, training signal."""

from __future__ import annotations

import json
import math

import pytest
import torch

from draftsmith.heads.draft_lm import (
    check_vocab_compatible,
    install_loss_head,
    layer_pruned_copy,
)
from draftsmith.recipes.cli import main as cli
from draftsmith.recipes.distill import DistillConfig, batch_logits, step_loss
from draftsmith.train.config import ConfigError, load_config, parse_config
from draftsmith.train.export.hf import export_hf, save_draft
from draftsmith.train.objectives.distill import (
    cross_entropy,
    distill_batch_loss,
    distill_head_loss,
    distill_loss,
    expected_acceptance,
    forward_kl,
    greedy_agreement,
    jsd,
    prediction_mask,
    reverse_kl,
    total_variation,
)
from draftsmith.train.objectives.draft_init import (
    check_draft_compatible,
    compute_ratio,
    fresh_draft,
    init_draft,
    load_draft,
    per_token_flops,
    pruned_draft,
)
from tests.conftest import byte_tokenizer, tiny_llama, tiny_model_dir

# --------------------------------------------------------------------------------------------
# Losses on a fixed pair of distributions, computed by hand
# --------------------------------------------------------------------------------------------
# p (target) = [1/2, 1/2], q (draft) = [1/4, 3/4]; logits = log-probabilities.
P = torch.log(torch.tensor([[0.5, 0.5]]))
Q = torch.log(torch.tensor([[0.25, 0.75]]))


def test_forward_kl_by_hand():
    # KL(p||q) = 1/2 ln(0.5/0.25) + 1/2 ln(0.5/0.75) = 1/2 (0.693147 - 0.405465) = 0.143841
    assert forward_kl(P, Q).item() == pytest.approx(0.143841, abs=1e-6)


def test_reverse_kl_by_hand():
    # KL(q||p) = 1/4 ln(0.25/0.5) + 3/4 ln(0.75/0.5) = 1/4 (-0.693147) + 3/4 (0.405465)
    #          = -0.173287 + 0.304099 = 0.130812
    assert reverse_kl(P, Q).item() == pytest.approx(0.130812, abs=1e-6)


def test_total_variation_and_acceptance_by_hand():
    # TVD = 1/2 (|0.5 - 0.25| + |0.5 - 0.75|) = 0.25; sum min(p, q) = 0.25 + 0.5 = 0.75 = 1 - TVD
    assert total_variation(P, Q).item() == pytest.approx(0.25, abs=1e-6)
    assert expected_acceptance(P, Q).item() == pytest.approx(0.75, abs=1e-6)
    assert greedy_agreement(P, Q).item() == 0.0  # argmax p = 0 (tie broken low), argmax q = 1


def test_jsd_by_hand():
    # beta = 1/2: m = [3/8, 5/8]
    #   KL(p||m) = 1/2 ln(0.5/0.375) + 1/2 ln(0.5/0.625) = 1/2 (0.287682 - 0.223144) = 0.032269
    #   KL(q||m) = 1/4 ln(0.25/0.375) + 3/4 ln(0.75/0.625) = -0.101366 + 0.136741 = 0.035375
    #   JSD = 1/2 (0.032269 + 0.035375) = 0.033822
    assert jsd(P, Q, beta=0.5).item() == pytest.approx(0.033822, abs=1e-6)
    # beta = 1/4: m = 1/4 p + 3/4 q = [0.3125, 0.6875]
    #   KL(p||m) = 1/2 ln(1.6) + 1/2 ln(0.727273) = 1/2 (0.470004 - 0.318454) = 0.075775
    #   KL(q||m) = 1/4 ln(0.8) + 3/4 ln(1.090909) = -0.055786 + 0.065258 = 0.009472
    #   JSD = 1/4 (0.075775) + 3/4 (0.009472) = 0.018944 + 0.007104 = 0.026048
    assert jsd(P, Q, beta=0.25).item() == pytest.approx(0.026048, abs=2e-6)


def test_temperature_and_cross_entropy_mix_by_hand():
    # T = 2: p stays [1/2, 1/2]; q -> [sqrt(.25), sqrt(.75)] / (0.5 + 0.866025) = [0.366025, 0.633975]
    # KL(p||q_T) = 1/2 ln(0.5/0.366025) + 1/2 ln(0.5/0.633975) = 1/2 (0.311919 - 0.237417) = 0.037252
    assert forward_kl(P, Q, temperature=2.0).item() == pytest.approx(0.037252, abs=2e-6)
    # CE on label 1: -ln 0.75 = 0.287682; half/half with forward KL: (0.143841 + 0.287682) / 2
    labels = torch.tensor([1])
    assert cross_entropy(Q, labels).item() == pytest.approx(0.287682, abs=1e-6)
    mixed = distill_loss("fkl", P, Q, labels=labels, ce_weight=0.5)
    assert mixed.item() == pytest.approx(0.215762, abs=1e-6)
    assert distill_loss("tvd", P, Q, labels=labels, ce_weight=1.0).item() == pytest.approx(
        0.287682, abs=1e-6
    )


def test_lk_hybrid_blends_kl_and_tv_by_the_acceptance():
    # The pair above: KL 0.143841, TV 0.25, acceptance 0.75. λ = exp(-η · 0.75).
    for eta in (0.0, 1.0, 3.0):
        lam = math.exp(-eta * 0.75)
        expected = lam * 0.143841 + (1 - lam) * 0.25
        assert distill_loss("lk_hybrid", P, Q, eta=eta).item() == pytest.approx(expected, abs=1e-6)
    # η = 0 is pure forward KL, gradient included (λ is detached, so it adds no gradient path).
    q1 = Q.clone().requires_grad_(True)
    q2 = Q.clone().requires_grad_(True)
    distill_loss("lk_hybrid", P, q1, eta=0.0).backward()
    forward_kl(P, q2).backward()
    assert torch.allclose(q1.grad, q2.grad)


def test_mask_selects_positions():
    # Position 0: the pair above; position 1: identical distributions (every loss 0, acceptance 1).
    p = torch.stack([P[0], P[0]])[None]  # [1, 2, 2]
    q = torch.stack([Q[0], P[0]])[None]
    only_first = torch.tensor([[1, 0]])
    assert forward_kl(p, q, only_first).item() == pytest.approx(0.143841, abs=1e-6)
    assert forward_kl(p, q).item() == pytest.approx(0.143841 / 2, abs=1e-6)  # mean of both
    assert expected_acceptance(p, q, torch.tensor([[0, 1]])).item() == pytest.approx(1.0)
    assert expected_acceptance(p, q).item() == pytest.approx((0.75 + 1.0) / 2)
    # Nothing selected: 0, and backward still works.
    q_param = q.clone().requires_grad_(True)
    loss = total_variation(p, q_param, torch.zeros(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(q_param.grad, torch.zeros_like(q))


def test_losses_are_zero_for_equal_distributions_and_differentiable():
    torch.manual_seed(0)
    p = torch.randn(3, 5, 11)
    for kind in ("fkl", "rkl", "tvd", "jsd", "lk_hybrid"):
        assert distill_loss(kind, p, p.clone()).item() == pytest.approx(0.0, abs=1e-6)
        q = torch.randn(3, 5, 11, requires_grad=True)
        loss = distill_loss(kind, p, q)
        loss.backward()
        assert loss.item() > 0 and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="unknown loss 'kl'"):
        distill_loss("kl", p, p)
    with pytest.raises(ValueError, match="ce_weight > 0 needs labels"):
        distill_loss("fkl", p, p, ce_weight=0.5)


def test_prediction_mask_shifts_to_the_predicting_position():
    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])  # row 2: last two are padding
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    keep, labels = prediction_mask(ids, loss_mask, attn)
    # Token 7 (index 2) is predicted at position 1, token 8 at position 2; row 2: tokens 2, 3.
    assert keep.tolist() == [[False, True, True, False, False], [True, True, False, False, False]]
    assert labels.tolist() == [7, 8, 2, 3]


# --------------------------------------------------------------------------------------------
# Draft initialisation
# --------------------------------------------------------------------------------------------


def _tied_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    return model


def _layer_state(model, i):
    return model.model.layers[i].state_dict()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_pruned_init_copies_embeddings_and_chosen_layers_exactly(tied):
    target = _tied_llama() if tied else tiny_llama(seed=0, init_std=0.1)
    draft = pruned_draft(target, [3, 1])  # any order: draft layer 0 = target layer 3
    assert draft.training and draft.config.num_hidden_layers == 2
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)
    assert torch.equal(draft.model.norm.weight, target.model.norm.weight)
    for d, t in ((0, 3), (1, 1)):
        for name, tensor in _layer_state(target, t).items():
            assert torch.equal(_layer_state(draft, d)[name], tensor), (d, name)
    # Independent, trainable weights (the target stays frozen and untouched).
    for pd, pt in zip(draft.parameters(), target.parameters(), strict=False):
        assert pd.requires_grad and pd.data_ptr() != pt.data_ptr()
    assert (draft.lm_head.weight is draft.model.embed_tokens.weight) == tied
    before = target.model.embed_tokens.weight.clone()
    with torch.no_grad():
        draft.model.embed_tokens.weight.add_(1.0)
    assert torch.equal(target.model.embed_tokens.weight, before)
    if tied:  # still one tensor after an update
        assert torch.equal(draft.lm_head.weight, draft.model.embed_tokens.weight)
    # The pruned copy computes what the target's own layers compute.
    ids = torch.tensor([[1, 2, 3, 4]])
    full = layer_pruned_copy(target, [0, 1, 2, 3])
    assert torch.equal(full(ids).logits, target(ids).logits)


def test_pruned_init_rejects_bad_layers(target):
    with pytest.raises(ValueError, match="indices in"):
        pruned_draft(target, [0, 4])
    with pytest.raises(ValueError, match="must not repeat"):
        pruned_draft(target, [1, 1])


def test_fresh_draft_from_config(target):
    draft = fresh_draft(target, num_layers=1, hidden_size=16, num_heads=2, intermediate_size=24)
    assert draft.training
    c = draft.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size) == (
        1,
        16,
        2,
        24,
    )
    assert c.num_key_value_heads == 2 and c.vocab_size == target.config.vocab_size
    check_draft_compatible(draft, target)
    assert draft(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64)
    same = fresh_draft(target, num_layers=1, copy_embeddings=True)
    assert torch.equal(same.model.embed_tokens.weight, target.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="num_heads 3 must divide hidden_size 16"):
        fresh_draft(target, num_layers=1, hidden_size=16, num_heads=3)
    with pytest.raises(ValueError, match="copy_embeddings needs the target's width 32"):
        fresh_draft(target, num_layers=1, hidden_size=16, num_heads=2, copy_embeddings=True)


def test_per_token_flops_counts_layers_lm_head_and_attention(target):
    # tiny Llama: per layer q 32x32 + k,v 2 x 32x16 + o 32x32 + MLP 3 x 32x64 = 9216 MACs;
    # lm_head 64x32 = 2048 MACs. 4 layers: 2 * (4 * 9216 + 2048) = 77824 FLOPs.
    assert per_token_flops(target) == 2 * (4 * 9216 + 2048)
    assert per_token_flops(target.config) == per_token_flops(target)  # meta-device config path
    # Attention over 10 cached tokens: 2 (QK, AV) * 4 heads * 8 dims * 10 per layer, 4 layers.
    assert per_token_flops(target, context=10) == per_token_flops(target) + 2 * 4 * (2 * 32 * 10)
    draft = pruned_draft(target, [0])
    assert compute_ratio(draft, target) == pytest.approx((9216 + 2048) / (4 * 9216 + 2048))
    # A 16-token draft vocabulary computes 16 of the head's 64 rows: 16 x 32 = 512 MACs.
    ratio = compute_ratio(draft, target, draft_head_rows=16)
    assert ratio == pytest.approx((9216 + 512) / (4 * 9216 + 2048))


def test_vocab_mismatch_error_names_sizes_and_first_differing_token(tmp_path):
    tok_a, tok_b = byte_tokenizer(), byte_tokenizer()
    tok_b.add_tokens(["<|tool|>"], special_tokens=True)
    draft = tiny_llama(vocab_size=len(tok_b))
    target = tiny_llama(vocab_size=len(tok_a))
    n = len(tok_a)
    with pytest.raises(ValueError) as err:
        check_draft_compatible(draft, target, tok_b, tok_a)
    text = str(err.value)
    assert f"draft model vocab size {n + 1} != target vocab size {n}" in text
    assert f"first differ at id {n}: draft '<|tool|>' vs target None" in text
    # Same size, a different token behind one id.
    tok_c, tok_d = byte_tokenizer(), byte_tokenizer()
    tok_c.add_tokens(["<|a|>"], special_tokens=True)
    tok_d.add_tokens(["<|b|>"], special_tokens=True)
    with pytest.raises(ValueError) as err:
        check_vocab_compatible(n + 1, n + 1, draft_tokenizer=tok_c, target_tokenizer=tok_d)
    assert f"vocab size are both {n + 1}" in str(err.value)
    assert f"id {n}: draft '<|a|>' vs target '<|b|>'" in str(err.value)
    check_vocab_compatible(n, n, draft_tokenizer=byte_tokenizer(), target_tokenizer=tok_a)
    # load_draft checks a local model dir's tokenizer against the target's.
    draft.save_pretrained(tmp_path / "d")
    tok_b.save_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match="first differ at id"):
        init_draft("path", target, tok_a, path=tmp_path / "d")


def test_load_draft_from_path(tmp_path):
    target_dir = tiny_model_dir(tmp_path / "t")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(target_dir)
    tok = AutoTokenizer.from_pretrained(target_dir)
    draft = load_draft(target_dir, target, tok)
    assert draft.training and all(p.requires_grad for p in draft.parameters())
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_draft(tmp_path / "nothing", target, tok)


# --------------------------------------------------------------------------------------------
# Training signal
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["fkl", "rkl", "tvd", "jsd", "lk_hybrid"])
def test_training_raises_expected_acceptance_on_a_fixed_batch(target, loss):
    cfg = DistillConfig(data="x", loss=loss)
    draft = pruned_draft(target, [0])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 16), generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.cat([torch.zeros(4, 4), torch.ones(4, 12)], 1).long(),
    }

    def acceptance():
        with torch.no_grad():
            p, q, _ = batch_logits(draft, target, batch)
        return expected_acceptance(p, q).item()

    before = acceptance()
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    for _ in range(15):
        p, q, labels = batch_logits(draft, target, batch)
        step_loss(cfg, p, q, labels).backward()
        opt.step()
        opt.zero_grad()
    after = acceptance()
    assert after > before + 0.05, (before, after)


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def test_export_reloads_identically_and_drives_hf_assisted_generation(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir = tiny_model_dir(tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    draft = pruned_draft(target, [0, 3]).eval()
    info = {
        "target": str(target_dir),
        "data": "chat.jsonl",
        "steps": 7,
        "validation": {
            "after": {"expected_acceptance": 0.5, "greedy_agreement": 0.25, "tokens": 99}
        },
    }
    save_draft(draft, None, tmp_path / "run" / "draft", info=info)  # no tokenizer: as a bare dir
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        export_hf(tmp_path / "run", tmp_path / "out")
    out = export_hf(tmp_path / "run", tmp_path / "out", tokenizer_src=target_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run", "target"]  # no temp left
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, len(tok), (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, draft(ids).logits)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tok.get_vocab()
    assert reloaded.generation_config.eos_token_id == tok.eos_token_id
    card = (out / "README.md").read_text()
    assert str(target_dir) in card and "0.5000" in card and "assistant_model=draft" in card
    assert json.loads((out / "draftsmith_draft.json").read_text())["steps"] == 7
    # HF assisted generation with the exported draft gives the target's greedy output.
    prompt = torch.tensor([tok.encode("hello there, draft")])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=24, min_new_tokens=24)
    assisted = target.generate(
        prompt, assistant_model=reloaded, do_sample=False, max_new_tokens=24, min_new_tokens=24
    )
    assert assisted.tolist() == plain.tolist()
    # Refuses to clobber unless asked; the CLI (`draftsmith export --format hf`) reports it with
    # exit code 2.
    with pytest.raises(FileExistsError):
        export_hf(tmp_path / "run", out, tokenizer_src=target_dir)
    argv = ["export", "--format", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]
    argv += ["--tokenizer", str(target_dir)]
    assert cli(argv) == 2
    assert cli([*argv, "--overwrite"]) == 0
    assert torch.equal(AutoModelForCausalLM.from_pretrained(out)(ids).logits, draft(ids).logits)


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def test_config_validation_names_every_bad_field():
    argv = [
        "--lr",
        "-1",
        "--batch-size",
        "0",
        "--val-samples",
        "-1",
        "--jsd-beta",
        "1",
        "--ce-weight",
        "2",
        "--draft-init",
        "path",
        "--on-policy-fraction",
        "2",
        "--temperature",
        "0",
        "--draft-layers",
        "1",
        "1",
        "--max-steps",
        "0",
    ]
    with pytest.raises(ConfigError) as err:
        parse_config(DistillConfig, argv)
    fields = {f for f, _ in err.value.problems}
    assert fields == {
        "lr",
        "batch_size",
        "val_samples",
        "jsd_beta",
        "ce_weight",
        "draft_model",
        "on_policy_fraction",
        "temperature",
        "max_steps",
        "data",
    }
    # draft_layers are only checked for a pruned draft; a pruned draft with repeats is refused.
    with pytest.raises(ConfigError, match="draft_layers: need distinct"):
        parse_config(DistillConfig, ["--data", "x", "--draft-layers", "2", "2"])
    with pytest.raises(ConfigError, match="loss: must be one of"):
        load_config(DistillConfig, overrides={"data": "x", "loss": "kl"})


def test_shipped_smollm2_config_loads_and_is_a_quarter_of_the_target():
    from pathlib import Path

    from transformers import LlamaConfig

    path = Path(__file__).resolve().parents[1] / "recipes/configs/distill_smollm2.yaml"
    cfg = load_config(DistillConfig, path)
    assert cfg.draft_init == "pruned"
    # SmolLM2-135M's shape (config.json of the converted target), on the meta device.
    smollm2 = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
    )
    draft = LlamaConfig(**{**smollm2.to_dict(), "num_hidden_layers": len(cfg.draft_layers)})
    for context in (0, 128, 512):
        assert compute_ratio(draft, smollm2, context) <= 0.25
    assert math.isclose(per_token_flops(smollm2) / 1e6, 268.96, rel_tol=1e-3)


# --------------------------------------------------------------------------------------------
# The chunked head + loss (distill_head_loss, distill_batch_loss): the same values and
# gradients as distill_loss on the logits, and no [N, V] tensor kept for the backward
# --------------------------------------------------------------------------------------------


def _rows_case(seed=0, n=11, h=8, v=29):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).requires_grad_(True)
    weight = torch.randn(v, h, generator=g).requires_grad_(True)
    p_hidden = torch.randn(n, h, generator=g)
    p_weight = 1.5 * torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, p_hidden, p_weight, labels


@pytest.mark.parametrize("kind", ["fkl", "rkl", "tvd", "jsd", "lk_hybrid"])
@pytest.mark.parametrize(("temperature", "ce_weight"), [(1.0, 0.0), (2.0, 0.3), (0.7, 1.0)])
@pytest.mark.parametrize("masked", ["all", "some", "none"])
def test_distill_head_loss_equals_distill_loss(kind, temperature, ce_weight, masked):
    hidden, weight, p_hidden, p_weight, labels = _rows_case()
    mask = {
        "all": None,
        "some": torch.rand(11, generator=torch.Generator().manual_seed(3)) > 0.4,
        "none": torch.zeros(11, dtype=torch.bool),
    }[masked]
    kw = {"labels": labels, "ce_weight": ce_weight, "temperature": temperature, "beta": 0.3}
    loss, metrics = distill_head_loss(
        kind, hidden, weight, p_hidden, lambda x: x @ p_weight.T, mask, chunk_rows=4, **kw
    )
    p_logits, q_logits = p_hidden @ p_weight.T, hidden @ weight.T
    want = distill_loss(kind, p_logits, q_logits, mask, eta=3.0, **kw)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(
        metrics["expected_acceptance"], expected_acceptance(p_logits, q_logits.detach(), mask)
    )
    torch.testing.assert_close(
        metrics["greedy_agreement"], greedy_agreement(p_logits, q_logits.detach(), mask)
    )
    if masked == "none":
        assert float(loss.detach()) == 0.0
    got = torch.autograd.grad(loss, [hidden, weight], retain_graph=True)
    for a, b in zip(got, torch.autograd.grad(want, [hidden, weight]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _distill_batch(seed=1, b=3, t=16, vocab=64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    attn = torch.ones_like(ids)
    if b > 1:
        attn[1, -5:] = 0  # right padding
    loss_mask = torch.cat([torch.zeros(b, 4), torch.ones(b, t - 4)], 1).long() * attn
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}


@pytest.mark.parametrize(("kind", "ce_weight"), [("fkl", 0.0), ("jsd", 0.2), ("lk_hybrid", 0.0)])
@pytest.mark.parametrize("offline", [False, True])
def test_distill_batch_loss_equals_the_recipes_dense_step(target, kind, ce_weight, offline):
    """The draft's head applied inside its forward (LossHead) gives what the recipe's
    batch_logits + step_loss gave: loss, expected acceptance, every draft gradient."""
    cfg = DistillConfig(data="x", loss=kind, ce_weight=ce_weight, temperature=1.5)
    draft = pruned_draft(target, [0, 2])
    batch = _distill_batch()
    if offline:
        with torch.no_grad():
            final = target(batch["input_ids"], output_hidden_states=True).hidden_states[-1]
        batch["hidden_states"] = {4: final}
    p, q, labels = batch_logits(draft, target, batch)
    want = step_loss(cfg, p, q, labels)
    params = [x for x in draft.parameters() if x.requires_grad]
    want_grads = torch.autograd.grad(want, params)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    head = install_loss_head(draft)
    assert install_loss_head(draft) is head  # idempotent
    assert draft.state_dict().keys() == before.keys()  # checkpoints and exports unchanged
    loss, metrics = distill_batch_loss(
        draft, target, batch, kind, ce_weight=ce_weight, temperature=1.5, chunk_rows=5
    )
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(metrics["expected_acceptance"], expected_acceptance(p, q.detach()))
    torch.testing.assert_close(metrics["greedy_agreement"], greedy_agreement(p, q.detach()))
    for a, b in zip(torch.autograd.grad(loss, params), want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # Outside distill_batch_loss the head is a plain lm_head again.
    with torch.no_grad():
        torch.testing.assert_close(batch_logits(draft, target, batch)[1], q.detach())


def batch_inputs(batch):
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def test_install_loss_head_keeps_a_tied_weight_tied_and_refuses_other_heads():
    model = tiny_llama(seed=4)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.lm_head.weight = model.model.embed_tokens.weight
    head = install_loss_head(model)
    assert head.weight is model.model.embed_tokens.weight
    assert model.get_output_embeddings() is head
    model.lm_head = torch.nn.Identity()
    with pytest.raises(TypeError, match=r"not an nn\.Linear"):
        install_loss_head(model)
    with pytest.raises(ValueError, match="install_loss_head"):
        distill_batch_loss(tiny_llama(), tiny_llama(), _distill_batch(), "fkl")


def test_a_distill_loss_keeps_no_t_by_v_tensor():
    """The distillation step's saved tensors: the dense loss on the logits keeps [N, V]
    log-probabilities (the recipe's path before), distill_batch_loss nothing of that size."""
    from tests.test_chunked_loss import WIDE_H, WIDE_T, WIDE_V, _big, saved_tensors

    target = tiny_llama(vocab_size=WIDE_V, hidden_size=WIDE_H, layers=2, seed=3)
    draft = pruned_draft(target, [0])
    batch = _distill_batch(b=1, t=WIDE_T, vocab=WIDE_V)
    batch["loss_mask"][:] = 1
    n = WIDE_T - 1
    with saved_tensors() as saved:
        p, q, _ = batch_logits(draft, target, batch)
        dense = distill_loss("lk_hybrid", p, q)
    assert _big(saved, n, WIDE_V)  # the control: the dense path keeps [N, V] tensors
    dense.backward()
    install_loss_head(draft)
    with saved_tensors() as saved:
        loss, _ = distill_batch_loss(draft, target, batch, "lk_hybrid", ce_weight=0.5)
    assert saved and _big(saved, n, WIDE_V) == []
    loss.backward()
