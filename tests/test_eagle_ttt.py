"""EAGLE training-time test: the TTT attention masks and the EAGLE-1/EAGLE-3 losses."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from test_eagle import _batch, _config, _train, _vocab

from draftsmith.heads.eagle import build_drafter
from draftsmith.heads.eagle_model import EagleCache
from draftsmith.train.objectives.eagle_ttt import (
    eagle1_loss,
    eagle3_ttt_loss,
    shift_left,
    target_distribution,
    ttt_attention_mask,
)


@pytest.fixture(scope="module")
def tgt():
    return tiny_llama(seed=0, init_std=0.1)


@pytest.fixture(scope="module")
def data(tgt):
    return _batch(tgt)


def test_ttt_mask_pattern():
    t = 6
    attn = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    for j in range(4):
        mask = ttt_attention_mask(t, j, attn)
        assert mask.shape == (2, 1, t, (j + 1) * t)
        for b in range(2):
            for q in range(t):
                for block in range(j + 1):
                    for s in range(t):
                        seen = bool(mask[b, 0, q, block * t + s])
                        if not attn[b, s]:
                            want = False  # padding keys are never visible
                        elif block == 0:
                            want = s <= q
                        else:
                            want = s == q
                        assert seen == want, (j, b, q, block, s)
    # A query with no visible key (left padding) still attends to something: no NaN.
    left = ttt_attention_mask(4, 2, torch.tensor([[0, 0, 1, 1]]))
    assert left[0, 0].any(dim=-1).all()
    assert ttt_attention_mask(3, 1).shape == (1, 1, 3, 6)


def test_ttt_matches_sequential_drafting(tgt, data):
    """Step j of the unrolled training forward = drafting j steps from position t at inference.

    At inference, drafting from a context ending at position t caches the target-feature
    entries 0..t, then feeds (own output, next token) one position further per step. The TTT
    forward must produce the same hidden states (same tokens, positions and visible keys).
    """
    torch.manual_seed(0)
    drafter = build_drafter(tgt, _config(tgt, 3), seed=1).eval()
    ids = data["input_ids"][:1, :12]
    feats = drafter.feature_tensor({k: v[:1, :12] for k, v in data["hidden_states"].items()})
    steps, t_len = 3, ids.shape[1]
    with torch.no_grad():
        cache, h, ttt = EagleCache(), feats, []
        for j in range(steps):
            emb = drafter.embed(shift_left(ids, 1 + j))
            pos = torch.arange(t_len)[None] + j
            h, _ = drafter(emb, h, pos, ttt_attention_mask(t_len, j), cache)
            ttt.append(h)
        for t in (0, 4, 7):
            cache = EagleCache()
            emb = drafter.embed(ids[:, 1 : t + 2])
            h, _ = drafter(emb, feats[:, : t + 1], torch.arange(t + 1)[None], cache=cache)
            h = h[:, -1:]
            torch.testing.assert_close(h[0, 0], ttt[0][0, t])
            for j in range(1, steps):
                emb = drafter.embed(ids[:, t + 1 + j : t + 2 + j])
                h, _ = drafter(emb, h, torch.tensor([[t + j]]), cache=cache)
                torch.testing.assert_close(h[0, 0], ttt[j][0, t], atol=1e-5, rtol=1e-5)


def test_eagle1_loss_alignment_by_hand(tgt):
    """Only position t = i - 2 is supervised when loss_mask has a single 1 at token i."""
    torch.manual_seed(0)
    drafter = build_drafter(tgt, _config(tgt, 1), seed=0)
    t_len, i = 10, 6
    ids = torch.randint(0, 64, (1, t_len))
    with torch.no_grad():
        hs = tgt(ids, output_hidden_states=True).hidden_states
    feats = hs[4]
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, i] = 1
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": loss_mask,
        "hidden_states": {4: feats},
    }
    loss, m = eagle1_loss(drafter, batch, noise=0.0)
    assert int(m["tokens"]) == 1

    # By hand: position t = i - 2 reads (f_{i-2}, x_{i-1}) and must predict f_{i-1}.
    t = i - 2
    with torch.no_grad():
        pred, _ = drafter(drafter.embed(ids[:, 1:]), feats[:, :-1], torch.arange(t_len - 1)[None])
    p_t, f_next = pred[0, t], feats[0, t + 1]
    v = torch.nn.functional.smooth_l1_loss(p_t, f_next)
    target_p = torch.softmax(tgt.lm_head(f_next), -1)
    ce = -(target_p * torch.log_softmax(tgt.lm_head(p_t), -1)).sum()
    torch.testing.assert_close(loss.detach(), v + 0.1 * ce)

    # Features after position i-1 cannot matter (causal and unsupervised) ...
    late = {**batch, "hidden_states": {4: feats.clone()}}
    late["hidden_states"][4][0, i:] += 5.0
    torch.testing.assert_close(eagle1_loss(drafter, late, noise=0.0)[0], loss)
    # ... the supervised target f_{i-1} does.
    moved = {**batch, "hidden_states": {4: feats.clone()}}
    moved["hidden_states"][4][0, i - 1] += 1.0
    assert not torch.allclose(eagle1_loss(drafter, moved, noise=0.0)[0], loss)
    # Padding: the same example padded on the right gives the same loss.
    pad = {
        "input_ids": torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1),
        "attention_mask": torch.cat([torch.ones_like(ids), torch.zeros(1, 3, dtype=torch.long)], 1),
        "loss_mask": torch.cat([loss_mask, torch.zeros(1, 3, dtype=torch.long)], 1),
        "hidden_states": {4: torch.cat([feats, torch.zeros(1, 3, feats.shape[-1])], 1)},
    }
    torch.testing.assert_close(eagle1_loss(drafter, pad, noise=0.0)[0], loss)


def test_eagle3_loss_step_alignment(tgt):
    """Step j at position t predicts token t + 2 + j: supervised iff that token is, and scored
    against the target's distribution at position t + 1 + j restricted to the draft vocab."""
    d2t, t2d = _vocab(48)
    drafter = build_drafter(tgt, _config(tgt, 3, 48), d2t, t2d, seed=0)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hs = dict(enumerate(tgt(ids, output_hidden_states=True).hidden_states))

    def run(tokens: list[int], steps: int = 4):
        loss_mask = torch.zeros_like(ids)
        loss_mask[0, tokens] = 1
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "loss_mask": loss_mask,
            "hidden_states": hs,
        }
        return eagle3_ttt_loss(drafter, batch, tgt.lm_head, steps=steps)[1]

    m = run(list(range(2, 10)))  # tokens 2..9: positions t = 0 .. 7 - j
    assert [int(m[f"tokens_{j}"]) for j in range(4)] == [8, 7, 6, 5]
    m = run([4])  # t = 2 - j
    assert [int(m[f"tokens_{j}"]) for j in range(4)] == [1, 1, 1, 0]

    # By hand for one supervised token i: steps 0 and 1 at t = i - 2 - j.
    i = 6
    m = run([i], steps=2)
    with torch.no_grad():
        cache, h = EagleCache(), drafter.feature_tensor(hs)
        for j in range(2):
            emb = drafter.embed(shift_left(ids, 1 + j))
            h, logits = drafter(
                emb,
                h,
                torch.arange(10)[None] + j,
                ttt_attention_mask(10, j),
                cache,
                return_logits=True,
            )
            t = i - 2 - j
            p = torch.softmax(tgt.lm_head(hs[4][0, t + 1 + j])[t2d], -1)
            ce = -(p * torch.log_softmax(logits[0, t], -1)).sum()
            torch.testing.assert_close(m[f"loss_{j}"], ce)
    torch.testing.assert_close(m["loss"], m["loss_0"] + 0.8 * m["loss_1"])

    # Right padding changes nothing: padded keys are hidden and padded positions unsupervised.
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 3:] = 1
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": loss_mask,
        "hidden_states": hs,
    }
    z = torch.zeros(1, 3, dtype=torch.long)
    padded = {
        "input_ids": torch.cat([ids, z + 7], 1),
        "attention_mask": torch.cat([torch.ones_like(ids), z], 1),
        "loss_mask": torch.cat([loss_mask, z], 1),
        "hidden_states": {
            k: torch.cat([v, torch.randn(1, 3, v.shape[-1])], 1) for k, v in hs.items()
        },
    }
    a = eagle3_ttt_loss(drafter, batch, tgt.lm_head, steps=3)
    b = eagle3_ttt_loss(drafter, padded, tgt.lm_head, steps=3)
    torch.testing.assert_close(a[0], b[0])
    assert all(torch.equal(a[1][f"tokens_{j}"], b[1][f"tokens_{j}"]) for j in range(3))
    # Sequences too short for the later steps give them no tokens, not an error.
    short = {
        k: (v[:, :3] if torch.is_tensor(v) else {i: h[:, :3] for i, h in v.items()})
        for k, v in batch.items()
    }
    short["loss_mask"] = torch.ones_like(short["loss_mask"])
    m = eagle3_ttt_loss(drafter, short, tgt.lm_head, steps=3)[1]
    assert [int(m[f"tokens_{j}"]) for j in range(3)] == [1, 0, 0]


def test_eagle3_labels_at_supervised_positions_only_change_nothing(tgt, data):
    """Computing the target's distribution only where a step reads it gives the same loss,
    metrics and gradients as computing it everywhere."""
    d2t, t2d = _vocab(48)
    drafter = build_drafter(tgt, _config(tgt, 3, 48), d2t, t2d, seed=0)
    batch = dict(data)
    batch["loss_mask"] = batch["loss_mask"].clone()
    batch["loss_mask"][:, :5] = 0  # a prompt: unsupervised positions the fast path skips
    results = []
    for only in (True, False):
        drafter.zero_grad()
        loss, metrics = eagle3_ttt_loss(
            drafter, batch, tgt.lm_head, steps=3, supervised_labels_only=only
        )
        loss.backward()
        grads = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
        results.append((loss.detach(), metrics, grads))
    (la, ma, ga), (lb, mb, gb) = results
    torch.testing.assert_close(la, lb)
    assert ma.keys() == mb.keys()
    for key in ma:
        torch.testing.assert_close(ma[key], mb[key])
    for a, b in zip(ga, gb, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_distribution_over_a_draft_vocab_matches_the_full_head(dtype):
    """The draft vocabulary's labels are the full head's logits at those ids, renormalised;
    the greedy token is the full vocab's where it lies inside the draft vocab and -1 where a
    token outside scores higher (no draft can match it)."""
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 64, bias=False).to(dtype)
    head.weight.data = torch.randn(64, 16, generator=gen).to(dtype)
    hidden = torch.randn(2, 9, 16, generator=gen).to(dtype)
    ids = torch.arange(0, 64, 2)  # the even ids, ascending (draft order)
    probs, arg = target_distribution(hidden, head, vocab_ids=ids)
    logits = head(hidden).float()
    torch.testing.assert_close(probs, torch.softmax(logits[..., ids], dim=-1))
    full = logits.argmax(-1)
    inside = full % 2 == 0
    assert inside.any() and (~inside).any()  # the seed gives both cases
    assert torch.equal(arg[inside], full[inside])
    assert (arg[~inside] == -1).all()
    # Selected rows only: the same values there, nothing elsewhere.
    rows = torch.zeros(2, 9, dtype=torch.bool)
    rows[:, 3:] = True
    p_rows, a_rows = target_distribution(hidden, head, rows=rows, vocab_ids=ids)
    torch.testing.assert_close(p_rows[rows], probs[rows])
    assert torch.equal(a_rows[rows], arg[rows])
    assert (p_rows[~rows] == 0).all() and (a_rows[~rows] == -1).all()


def _metrics(tgt, drafter, data) -> dict:
    with torch.no_grad():
        if drafter.config.version == 1:
            return eagle1_loss(drafter, data, noise=0.0)[1]
        return eagle3_ttt_loss(drafter, data, tgt.lm_head, steps=3)[1]


@pytest.mark.parametrize("version", [1, 3])
def test_losses_decrease(tgt, data, version):
    """50 Adam steps on one batch: the loss falls, the drafter moves toward the target's
    distribution (KL = soft CE minus the target's entropy) and its top-1 accuracy rises."""
    d2t_t2d = _vocab(48) if version == 3 else (None, None)
    drafter = build_drafter(
        tgt, _config(tgt, version, 48 if version == 3 else None), *d2t_t2d, seed=0
    )
    kl, acc = ("token_kl", "acc") if version == 1 else ("kl_0", "acc_0")
    before = _metrics(tgt, drafter, data)
    losses = _train(tgt, drafter, data, 50)
    after = _metrics(tgt, drafter, data)
    assert losses[-1] < losses[0] and float(after["loss"]) < float(before["loss"])
    assert float(after[kl]) < 0.5 * float(before[kl]), (before, after)
    assert float(after[acc]) > float(before[acc]) + 0.2, (before, after)
    if version == 3:  # every unrolled step learns, not just step 0
        for j in (1, 2):
            assert float(after[f"kl_{j}"]) < 0.5 * float(before[f"kl_{j}"])


def test_eagle1_noise_changes_loss_only_when_on(tgt, data):
    drafter = build_drafter(tgt, _config(tgt, 1), seed=0)
    a = eagle1_loss(drafter, data, noise=0.0)[0]
    b = eagle1_loss(drafter, data, noise=0.0)[0]
    c = eagle1_loss(drafter, data, noise=0.5, generator=torch.Generator().manual_seed(0))[0]
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)
