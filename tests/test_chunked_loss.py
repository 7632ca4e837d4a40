"""The chunked head + loss (train/objectives/chunked_loss.py) and the recipes' losses built on it.

Values and gradients equal those of the dense formulas the recipes used before (written out
again here as references), and autograd keeps no ``[T, V]`` tensor for the backward.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from draftsmith.heads.eagle import build_drafter
from draftsmith.train.objectives import dflash as dflash_mod
from draftsmith.train.objectives import eagle_ttt
from draftsmith.train.objectives.acceptance import DRAFT_LOSSES, draft_head_loss
from draftsmith.train.objectives.chunked_loss import (
    METRICS,
    TERMS,
    chunk_rows_for,
    head_argmax,
    head_rows,
)
from draftsmith.train.objectives.eagle_ttt import eagle1_loss, eagle3_ttt_loss
from tests.conftest import tiny_llama
from tests.test_eagle import _batch, _config, _vocab

# --------------------------------------------------------------------------------------------
# References: the dense formulas (the recipes' code before the chunked loss)
# --------------------------------------------------------------------------------------------


def _kl(log_a, log_b):
    a = log_a.exp()
    return (a * torch.where(a > 0, log_a - log_b, torch.zeros_like(a))).sum(-1)


def dense_rows(
    z, name, *, p=None, p_logits=None, labels=None, temperature=1.0, beta=0.5
) -> torch.Tensor:
    """One per-row term or metric from full logits ``z [..., V]`` (distill.py / acceptance.py)."""
    log_q = F.log_softmax(z.float() / temperature, dim=-1)
    q = log_q.exp()
    log_p = None
    if p_logits is not None:
        log_p = F.log_softmax(p_logits.float() / temperature, dim=-1)
        p = log_p.exp()
    if name == "ce":
        return -(p * log_q).sum(-1)
    if name == "alpha":
        return torch.minimum(p, q).sum(-1)
    if name == "fkl":
        return _kl(log_p, log_q)
    if name == "rkl":
        return _kl(log_q, log_p)
    if name == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    if name == "jsd":
        log_m = torch.logsumexp(
            torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0
        )
        return beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)
    if name == "nll":
        log_q1 = F.log_softmax(z.float(), dim=-1)
        nll = -log_q1.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
        return torch.where(labels >= 0, nll, torch.zeros_like(nll))
    if name == "accept":
        p1 = F.log_softmax(p_logits.float(), -1).exp() if p_logits is not None else p
        return torch.minimum(p1, F.log_softmax(z.float(), -1).exp()).sum(-1)
    if name == "p_entropy":
        return -(p * p.clamp_min(1e-30).log()).sum(-1)
    raise AssertionError(name)


def old_draft_loss(kind, logits, p, mask, eta=3.0):
    """acceptance.draft_loss as it was (dense log-softmax), copied."""

    def masked_mean(x, m):
        return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp_min(1)

    p = p.float()
    log_q = torch.log_softmax(logits.float(), dim=-1)
    ce = masked_mean(-(p * log_q).sum(-1), mask)
    if kind == "kl":
        with torch.no_grad():
            alpha = torch.minimum(p, log_q.detach().exp()).sum(-1)
    else:
        alpha = torch.minimum(p, log_q.exp()).sum(-1)
    mean_alpha = masked_mean(alpha, mask)
    if kind == "kl":
        loss = ce
    elif kind == "tv":
        loss = 1.0 - mean_alpha
    elif kind == "nla":
        loss = masked_mean(-torch.log(alpha.clamp_min(1e-6)), mask)
    else:
        lam = torch.exp(-eta * mean_alpha.detach())
        loss = lam * ce + (1.0 - lam) * (1.0 - mean_alpha)
    return loss, ce.detach(), mean_alpha.detach()


def _grads(out, inputs):
    return torch.autograd.grad(out, inputs, allow_unused=True, retain_graph=True)


def _close(a, b, **kw):
    torch.testing.assert_close(a, b, rtol=kw.get("rtol", 2e-5), atol=kw.get("atol", 2e-6))


# --------------------------------------------------------------------------------------------
# head_rows: every term and metric, against the dense formulas
# --------------------------------------------------------------------------------------------


def _case(seed=0, b=2, t=7, h=6, v=13, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g).requires_grad_(True)
    weight = torch.randn(v, h, generator=g).requires_grad_(True)
    bias_t = torch.randn(v, generator=g).requires_grad_(True) if bias else None
    p_hidden = torch.randn(b, t, h, generator=g)
    p_weight = 1.5 * torch.randn(v + 3, h, generator=g)  # the label head has a wider vocab
    p_cols = torch.randperm(v + 3, generator=g)[:v].sort().values
    labels = torch.randint(-1, v, (b, t), generator=g)
    return hidden, weight, bias_t, p_hidden, p_weight, p_cols, labels


@pytest.mark.parametrize("chunk", [1, 3, 7, None])  # 3 does not divide T = 7; None: default
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("frozen", [False, True])  # a frozen head: its input's gradient ahead
def test_every_term_matches_the_dense_formula_values_and_gradients(
    chunk, temperature, bias, frozen
):
    hidden, weight, bias_t, p_hidden, p_weight, p_cols, labels = _case(bias=bias)
    inputs = [hidden, weight] + ([bias_t] if bias else [])
    if frozen:
        inputs = [hidden]
        weight.requires_grad_(False)
        if bias:
            bias_t.requires_grad_(False)
    z = F.linear(hidden, weight, bias_t)
    p_logits = (p_hidden @ p_weight.T)[..., p_cols]
    g = torch.Generator().manual_seed(1)
    for name in TERMS:
        rows = head_rows(
            hidden,
            weight,
            bias=bias_t,
            p_hidden=p_hidden,
            p_head=lambda x: x @ p_weight.T,
            p_cols=p_cols,
            labels=labels,
            terms=(name,),
            temperature=temperature,
            beta=0.3,
            chunk_rows=chunk,
        )
        want = dense_rows(
            z, name, p_logits=p_logits, labels=labels, temperature=temperature, beta=0.3
        )
        _close(rows[name], want)
        # Any upstream gradient of the per-row values, e.g. a masked, weighted mean.
        c = torch.randn(want.shape, generator=g) * (torch.rand(want.shape, generator=g) > 0.3)
        for got, ref in zip(
            _grads((rows[name] * c).sum(), inputs), _grads((want * c).sum(), inputs), strict=True
        ):
            _close(got, ref, rtol=1e-4, atol=1e-5)


def test_metrics_argmax_topk_and_label_outputs():
    hidden, weight, _, p_hidden, p_weight, p_cols, labels = _case(3, b=1, t=9)
    z = hidden @ weight.T
    full = p_hidden @ p_weight.T
    cols = torch.tensor([0, 4, 5, 11])
    rows = head_rows(
        hidden[0],  # [T, H]: 2-D input, [T] outputs
        weight,
        p_hidden=p_hidden[0],
        p_head=lambda x: x @ p_weight.T,
        p_cols=p_cols,
        labels=labels[0],
        terms=(),
        metrics=tuple(METRICS),
        temperature=2.0,
        argmax=True,
        argmax_cols=cols,
        topk=4,
        p_argmax=True,
        chunk_rows=2,
    )
    for name in METRICS:
        want = dense_rows(z, name, p_logits=full[..., p_cols], labels=labels, temperature=2.0)[0]
        _close(rows[name], want)
        assert not rows[name].requires_grad
    assert torch.equal(rows["argmax"], cols[z[0][:, cols].argmax(-1)])
    assert torch.equal(rows["topk"], z[0].topk(4).indices)
    assert torch.equal(rows["p_argmax"], full[0].argmax(-1))  # over the label's full vocab
    assert torch.equal(
        head_argmax(p_hidden, lambda x: x @ p_weight.T, chunk_rows=4), full.argmax(-1)
    )


def test_dense_label_and_refusals():
    hidden, weight, *_ = _case(4)
    p = torch.softmax(torch.randn(2, 7, 13), -1)
    p[0, 2] = 0  # an unsupervised position's all-zero label row
    rows = head_rows(hidden, weight, p=p, terms=("ce", "alpha"), chunk_rows=5)
    z = hidden @ weight.T
    for name in ("ce", "alpha"):
        _close(rows[name], dense_rows(z, name, p=p))
    with pytest.raises(ValueError, match="unknown"):
        head_rows(hidden, weight, p=p, terms=("kl",))
    with pytest.raises(ValueError, match="label's logits"):
        head_rows(hidden, weight, p=p, terms=("fkl",))
    with pytest.raises(ValueError, match="label's logits"):
        head_rows(hidden, weight, p=p, temperature=2.0)
    with pytest.raises(ValueError, match="need a label"):
        head_rows(hidden, weight, terms=("ce",))
    with pytest.raises(ValueError, match="nll needs labels"):
        head_rows(hidden, weight, terms=("nll",))
    with pytest.raises(ValueError, match="rows"):
        head_rows(hidden, weight, p=p[:, :5])
    assert chunk_rows_for(32_000) == 524 and chunk_rows_for(10**9) == 1


def test_bf16_autocast_uses_the_autocast_matmul_like_the_dense_head():
    """Under autocast the head runs in bf16 as F.linear would (the logits round alike); the
    backward's matmuls too, each chunk's weight gradient summed in fp32."""
    hidden, weight, _, p_hidden, p_weight, p_cols, _ = _case(5, t=16, v=40)
    p = torch.softmax(torch.randn(2, 16, 40), -1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows = head_rows(hidden, weight, p=p, terms=("ce",), metrics=("alpha",), chunk_rows=5)
        z = F.linear(hidden, weight)
        assert z.dtype == torch.bfloat16
        want = dense_rows(z, "ce", p=p)
    _close(rows["ce"], want, rtol=1e-5, atol=1e-5)
    _close(rows["alpha"], dense_rows(z, "alpha", p=p))
    got = _grads(rows["ce"].sum(), [hidden, weight])
    ref = _grads(want.sum(), [hidden, weight])
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # bf16 rounding of dz
    # A p_head label is recomputed in the backward under the forward's autocast state.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows = head_rows(
            hidden,
            weight,
            p_hidden=p_hidden,
            p_head=lambda x: F.linear(x, p_weight),
            p_cols=p_cols,
            terms=("fkl",),
        )
        want = dense_rows(
            F.linear(hidden, weight), "fkl", p_logits=F.linear(p_hidden, p_weight)[..., p_cols]
        )
    _close(rows["fkl"], want, rtol=1e-5, atol=1e-5)
    for a, b in zip(_grads(rows["fkl"].sum(), [hidden]), _grads(want.sum(), [hidden]), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------------------------
# The LK / soft-CE draft loss of EAGLE-3, P-EAGLE and Medusa (acceptance.draft_head_loss)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DRAFT_LOSSES)
@pytest.mark.parametrize("masked", ["none", "some", "all"])
@pytest.mark.parametrize("chunk", [2, 5, None])
def test_draft_head_loss_equals_the_dense_draft_loss(kind, masked, chunk):
    hidden, weight, *_ = _case(6, t=5, v=11)
    p = torch.softmax(2 * torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(7)), -1)
    mask = {
        "none": torch.zeros(2, 5, dtype=torch.bool),
        "some": torch.rand(2, 5, generator=torch.Generator().manual_seed(8)) > 0.4,
        "all": torch.ones(2, 5, dtype=torch.bool),
    }[masked]
    loss, ce, alpha, rows = draft_head_loss(
        kind, hidden, weight, mask, eta=2.0, p=p, argmax=True, chunk_rows=chunk
    )
    z = hidden @ weight.T
    want, want_ce, want_alpha = old_draft_loss(kind, z, p, mask, eta=2.0)
    _close(loss, want)
    _close(ce, want_ce)
    _close(alpha, want_alpha)
    assert torch.equal(rows["argmax"], z.argmax(-1))
    for got, ref in zip(
        _grads(loss, [hidden, weight]), _grads(want, [hidden, weight]), strict=True
    ):
        _close(got, ref, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------
# The recipes' losses: EAGLE-3 / P-EAGLE per TTT step, EAGLE-1, DFlash
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tgt():
    return tiny_llama(seed=0, init_std=0.1)


@pytest.fixture(scope="module")
def data(tgt):
    batch = _batch(tgt, num=3)
    batch["attention_mask"][1, -4:] = 0  # padding
    batch["loss_mask"][1, -4:] = 0
    batch["loss_mask"][2] = 0  # a row with nothing supervised
    return batch


def _dense_ttt_head_loss(kind, n, p, mask, eta):
    """_ttt_head_loss as it was: the full logits, then draft_loss's dense formulas."""

    def head_fn(head_in, weight):
        logits = (head_in @ weight.T)[:, :n]
        loss, ce, alpha = old_draft_loss(kind, logits, p, mask, eta)
        return loss, ce, alpha, {"argmax": logits.argmax(-1)}

    return head_fn


def _param_grads(loss, model):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("kind", DRAFT_LOSSES)
@pytest.mark.parametrize("parallel", [False, True])
def test_eagle3_ttt_loss_equals_the_dense_loss_per_step(tgt, data, kind, parallel, monkeypatch):
    """Every step's loss and metrics (acc_j, kl_j, alpha_j) and the drafter's gradients."""
    cfg = _config(tgt, 3, draft_vocab_size=40)
    if parallel:
        cfg.mask_token_id = 0
    drafter = build_drafter(tgt, cfg, seed=1)
    d2t, t2d = _vocab(40)
    drafter.set_vocab(d2t, t2d)

    def run():
        loss, metrics = eagle3_ttt_loss(drafter, data, tgt.lm_head, steps=3, loss=kind, lk_eta=2.0)
        return loss, metrics, _param_grads(loss, drafter)

    loss, metrics, grads = run()
    monkeypatch.setattr(eagle_ttt, "_ttt_head_loss", _dense_ttt_head_loss)
    want, want_metrics, want_grads = run()
    _close(loss, want)
    assert metrics.keys() == want_metrics.keys()
    for key in want_metrics:
        _close(metrics[key].float(), want_metrics[key].float())
    for g, w in zip(grads, want_grads, strict=True):
        if w is None:
            assert g is None or not g.any()
        else:
            _close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_eagle1_loss_equals_the_dense_loss(tgt, data, draft_vocab):
    """Feature SmoothL1 + token soft CE over the full vocabulary + its metrics, as before:
    the dense label ``softmax(head(f_{t+1}))`` and ``log_softmax(head(pred))``."""
    drafter = build_drafter(tgt, _config(tgt, 1, draft_vocab_size=draft_vocab), seed=2)
    if draft_vocab:
        drafter.set_vocab(*_vocab(draft_vocab))
    seen = []
    hook = drafter.register_forward_hook(lambda m, a, out: seen.append(out[0]))
    loss, metrics = eagle1_loss(drafter, data, noise=0.0, token_weight=0.3)
    hook.remove()
    (pred,) = seen

    # The reference, from the same forward's prediction: eagle1_loss's former lines.
    head = drafter.shared.lm_head
    attn, loss_mask = data["attention_mask"], data["loss_mask"]
    target_feat = data["hidden_states"][drafter.config.target_num_layers][:, 1:]
    mask = eagle_ttt.shift_left(loss_mask * attn, 2)[:, :-1] > 0

    def masked_mean(x):
        return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1)

    feature = masked_mean(F.smooth_l1_loss(pred, target_feat, reduction="none").mean(-1))
    target_p, target_arg = eagle_ttt.target_distribution(target_feat, head)
    draft_logits = head(pred)
    token = masked_mean(-(target_p * torch.log_softmax(draft_logits.float(), -1)).sum(-1))
    want = feature + 0.3 * token
    if draft_vocab:
        vids = eagle_ttt.vocab_target_ids(drafter.d2t)
        drafted = vids[draft_logits[..., vids].argmax(-1)]
    else:
        drafted = draft_logits.argmax(-1)
    entropy = -(target_p * target_p.clamp_min(1e-30).log()).sum(-1)
    _close(loss, want)
    _close(metrics["token_loss"], token.detach())
    _close(metrics["token_kl"], (token - masked_mean(entropy)).detach())
    _close(metrics["acc"], masked_mean((drafted == target_arg).float()))
    params = [p for p in drafter.parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    ref = torch.autograd.grad(want, params, allow_unused=True)
    for g, w in zip(got, ref, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            _close(g, w, rtol=1e-4, atol=1e-6)


def _dense_head_rows(hidden, weight, *, bias=None, p=None, terms=(), argmax=False, **_):
    """head_rows' dense stand-in for DFlash's call: its former lines (logits, _soft_ce, argmax)."""
    logits = F.linear(hidden, weight, bias)
    out = {"ce": -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)}
    if argmax:
        out["argmax"] = logits.argmax(-1)
    return out


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_dflash_slot_loss_equals_the_dense_loss(tgt, data, draft_vocab, monkeypatch):
    from draftsmith.heads.dflash import DFlashConfig
    from draftsmith.heads.dflash import build_drafter as build_dflash

    cfg = DFlashConfig.from_target(
        tgt.config,
        mask_token_id=63,
        feature_layers=(1, 2, 3),
        block_size=4,
        num_layers=1,
        draft_vocab_size=draft_vocab,
    )
    maps = _vocab(draft_vocab) if draft_vocab else (None, None)
    drafter = build_dflash(tgt, cfg, seed=0, init_std=0.1, d2t=maps[0], t2d=maps[1])

    def run():
        gen = torch.Generator().manual_seed(0)
        loss, metrics = dflash_mod.dflash_loss(drafter, data, tgt.lm_head, generator=gen)
        return loss, metrics, _param_grads(loss, drafter)

    loss, metrics, grads = run()
    monkeypatch.setattr(dflash_mod, "head_rows", _dense_head_rows)
    want, want_metrics, want_grads = run()
    _close(loss, want)
    for key in want_metrics:
        _close(metrics[key].float(), want_metrics[key].float())
    for g, w in zip(grads, want_grads, strict=True):
        if w is not None:
            _close(g, w, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------
# What autograd keeps: no [T, V] tensor (the test that fails on the dense losses)
# --------------------------------------------------------------------------------------------


@contextmanager
def saved_tensors():
    """Every tensor autograd saves for the backward inside the block (shape, storage)."""
    saved: list[tuple[torch.Size, int]] = []

    def pack(t):
        saved.append((t.shape, t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def _big(saved, rows, vocab, exempt=()):
    """Saved tensors of at least rows x vocab elements, storages in ``exempt`` aside."""
    return [s for s, ptr in saved if s.numel() >= rows * vocab and ptr not in exempt]


# T = 40 positions and V = 1000 tokens against hidden 16: a [T, V] tensor has >= 38,000
# elements, more than any weight (V x H = 16,000) or attention block (4 heads x T x 2T).
WIDE_V, WIDE_H, WIDE_T = 1000, 16, 40


@pytest.fixture(scope="module")
def wide():
    target = tiny_llama(vocab_size=WIDE_V, hidden_size=WIDE_H, layers=4, seed=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, WIDE_V, (1, WIDE_T), generator=g)
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
        "hidden_states": dict(enumerate(hs)),
    }
    return target, batch


def test_a_ttt_step_keeps_no_t_by_v_tensor_but_the_batch_label(wide, monkeypatch):
    target, batch = wide
    drafter = build_drafter(target, _config(target, 3), seed=0)
    labels = []
    real = eagle_ttt.target_distribution

    def recording(*a, **k):
        out = real(*a, **k)
        labels.append(out[0].untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(eagle_ttt, "target_distribution", recording)
    for kind in ("kl", "lk_hybrid"):
        with saved_tensors() as saved:
            loss, _ = eagle3_ttt_loss(drafter, batch, target.lm_head, steps=2, loss=kind)
        assert saved, "nothing recorded"
        # The one [B, T, V_draft] label (views of it) is all: no logits or log-probabilities.
        assert _big(saved, WIDE_T - 3, WIDE_V, exempt=labels) == [], kind
        loss.backward()
    # The detector's control: the dense loss of one step keeps its log-softmax.
    z = torch.randn(1, WIDE_T, WIDE_V, requires_grad=True)
    p = torch.softmax(torch.randn(1, WIDE_T, WIDE_V), -1)
    with saved_tensors() as saved:
        old_draft_loss("kl", z, p, torch.ones(1, WIDE_T, dtype=torch.bool))
    assert _big(saved, WIDE_T - 3, WIDE_V, exempt=[p.untyped_storage().data_ptr()])


def test_an_eagle1_loss_keeps_no_t_by_v_tensor(wide):
    target, batch = wide
    drafter = build_drafter(target, _config(target, 1), seed=0)
    with saved_tensors() as saved:
        loss, _ = eagle1_loss(drafter, batch, noise=0.0)
    assert saved and _big(saved, WIDE_T - 3, WIDE_V) == []
    loss.backward()
