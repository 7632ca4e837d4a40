"""Training-time-test attention with memory linear in T x steps (issue 50, finding 1).

The TTT unroll used to attend over ``(j + 1) T`` concatenated keys under a dense ``[T, (j + 1) T]``
mask with grouped heads: on CUDA such a call runs the math kernel, which keeps every probability
for the backward. ``heads/attention.py`` computes the same attention from a fused causal kernel
and one score per earlier step. Here: the same values and gradients as the dense layout (for the
kernel path and the exact chunked path, with GQA, right padding, EAGLE-1, EAGLE-3 and P-EAGLE), no
SDPA call with both a mask and grouped heads, nothing of T x T size saved for the backward, and
the inference tree attention over a visible context equal to the dense one.
"""

from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama
from test_eagle import _batch, _config, _vocab

from draftsmith.heads import attention
from draftsmith.heads.attention import TTTKeys, prefix_attention, ttt_attention
from draftsmith.heads.eagle import EagleConfig, build_drafter
from draftsmith.heads.eagle_model import EagleCache, _Attention, _rotate_half
from draftsmith.train.objectives.eagle_ttt import (
    eagle1_loss,
    eagle3_ttt_loss,
    ttt_attention_mask,
)


@pytest.fixture(scope="module")
def tgt():
    return tiny_llama(seed=0, init_std=0.1)


@pytest.fixture(scope="module")
def data(tgt):
    return _batch(tgt, num=4)


@pytest.fixture
def chunked(monkeypatch):
    """Force the exact chunked path (what a device without a fused kernel runs)."""
    monkeypatch.setattr(attention, "_kernel_name", lambda q: None)


@pytest.fixture
def kernel(monkeypatch):
    """Force the fused-kernel path also for these short test sequences (which would otherwise
    take the chunked path as one chunk)."""
    monkeypatch.setattr(attention, "SHORT_ROWS", 0)


def _dense(q, k0, v0, diag, attn=None):
    """The old layout: every step's keys concatenated, one SDPA call under the dense mask."""
    t = q.shape[2]
    keys = torch.cat([k0] + [k for k, _ in diag], dim=2)
    values = torch.cat([v0] + [v for _, v in diag], dim=2)
    mask = ttt_attention_mask(t, len(diag), attn)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, enable_gqa=k0.shape[1] != q.shape[1]
    )


def _inputs(b, h, kv, t, d, steps, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g, dtype=dtype)
    kvs = [torch.randn(b, kv, t, d, generator=g, dtype=dtype) for _ in range(2 * steps)]
    return [q, *kvs]


def _split(ts):
    q, k0, v0, *rest = ts
    return q, k0, v0, [(rest[2 * i], rest[2 * i + 1]) for i in range(len(rest) // 2)]


@pytest.mark.parametrize("path", ["kernel", "chunked"])
@pytest.mark.parametrize(("heads", "kv"), [(4, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("step", [0, 1, 3])
def test_ttt_attention_equals_the_dense_layout(request, path, heads, kv, step):
    """Outputs and the gradients of q and every step's keys and values, to fp32 precision."""
    request.getfixturevalue(path)
    ts = _inputs(2, heads, kv, 37, 16, step + 1, seed=step)
    fast_in = [x.clone().requires_grad_() for x in ts]
    ref_in = [x.clone().requires_grad_() for x in ts]
    q, k0, v0, diag = _split(fast_in)
    out = ttt_attention(q, k0, v0, diag)
    ref = _dense(*_split(ref_in))
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    grad = torch.randn_like(ref)
    for a, b in zip(
        torch.autograd.grad(out, fast_in, grad),
        torch.autograd.grad(ref, ref_in, grad),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5)


def test_ttt_attention_in_bf16_is_close_to_fp32(kernel):
    """bf16 inputs (autocast's dtype): the merge runs in fp32, so only bf16 rounding remains."""
    ts = _inputs(1, 4, 2, 64, 16, 3)
    ref = ttt_attention(*_split(ts)[:3], _split(ts)[3])
    low = ttt_attention(
        *_split([x.bfloat16() for x in ts])[:3], _split([x.bfloat16() for x in ts])[3]
    )
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=3e-2, rtol=3e-2)


def test_a_failing_kernel_falls_back_to_the_chunked_path(monkeypatch, kernel):
    """A kernel that fails its one-time check (or is missing) is replaced, with a warning."""
    monkeypatch.setattr(attention, "_CHECKED", {})

    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(attention, "_kernel_forward", broken)
    ts = _inputs(1, 4, 2, 20, 16, 2)
    with pytest.warns(UserWarning, match="chunked path"):
        assert attention.ttt_attention_path(ts[0]) == "chunked"
    out = ttt_attention(*_split(ts)[:3], _split(ts)[3])
    torch.testing.assert_close(out, _dense(*_split(ts)), atol=2e-6, rtol=1e-5)

    # A kernel that runs but disagrees is refused too.
    monkeypatch.setattr(attention, "_CHECKED", {})
    real = attention._kernel_backward

    def wrong(*args, **kwargs):
        dq, dk, dv = real(*args, **kwargs)
        return dq * 2, dk, dv

    monkeypatch.undo()
    monkeypatch.setattr(attention, "_CHECKED", {})
    monkeypatch.setattr(attention, "_kernel_backward", wrong)
    with pytest.warns(UserWarning, match="disagrees"):
        assert attention.ttt_attention_path(ts[0]) == "chunked"


def test_the_kernel_check_passes_when_first_asked_in_inference_mode(monkeypatch, recwarn):
    """evaluate and bench decode under ``torch.inference_mode``: the one-time check must still
    run its backward there (it failed, and the fused kernel was off for the whole process)."""
    monkeypatch.setattr(attention, "_CHECKED", {})
    q = torch.zeros(1, 4, 8, 16)
    with torch.inference_mode():
        assert attention.ttt_attention_path(q) == "cpu_flash"
    assert not [w for w in recwarn if "chunked path" in str(w.message)]


# --------------------------------------------------------------------------------------------
# The drafter's unroll: the losses and gradients of the old dense path
# --------------------------------------------------------------------------------------------


def _old_attention_forward(self, x, rope, mask, cache, mask_offset=0):
    """``_Attention.forward`` before issue 50: one SDPA call over the concatenated keys."""
    b, t, _ = x.shape
    q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
    k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
    v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
    cos, sin = rope
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    if isinstance(cache, TTTKeys):  # the unroll, laid out as before: keys concatenated by step
        step = len(cache)
        cache.diag.append((k, v))
        k = torch.cat([kk for kk, _ in cache.diag], dim=2)
        v = torch.cat([vv for _, vv in cache.diag], dim=2)
        attn = None if cache.attn is None else cache.attn[:, :t]  # EAGLE-1: the first T - 1
        mask = ttt_attention_mask(t, step, attn)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads
    )
    return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def _old_way(monkeypatch, batch):
    """Run the next loss the old way: patch the attention and hand it the batch's padding."""
    monkeypatch.setattr(_Attention, "forward", _old_attention_forward)
    init = TTTKeys.__init__

    def with_padding(self):
        init(self)
        self.attn = batch["attention_mask"]

    monkeypatch.setattr(TTTKeys, "__init__", with_padding)
    monkeypatch.setattr(TTTKeys, "__len__", lambda self: len(self.diag))


def _padded(batch, cut: int) -> dict:
    """The batch with its second row shortened by ``cut`` tokens of right padding."""
    out = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in batch.items()}
    out["hidden_states"] = {k: v.clone() for k, v in batch["hidden_states"].items()}
    t = out["input_ids"].shape[1]
    out["attention_mask"][1, t - cut :] = 0
    out["loss_mask"][1, t - cut :] = 0
    out["input_ids"][1, t - cut :] = 0
    for v in out["hidden_states"].values():
        v[1, t - cut :] = 0
    return out


def _grads(drafter):
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["eagle1", "eagle3", "peagle"])
@pytest.mark.parametrize("path", ["kernel", "chunked"])
def test_unrolled_losses_and_gradients_equal_the_dense_path(
    request, monkeypatch, tgt, data, family, path
):
    request.getfixturevalue(path)
    batch = _padded(data, cut=9)
    version = 1 if family == "eagle1" else 3
    d2t, t2d = _vocab(48)
    cfg = _config(tgt, version, 48 if version == 3 else None)
    if family == "peagle":
        cfg = EagleConfig.from_target(
            tgt.config, 3, draft_vocab_size=48, feature_layers=[1, 2, 3], mask_token_id=5
        )
    drafter = build_drafter(tgt, cfg, *((d2t, t2d) if version == 3 else ()), seed=2)

    def loss():
        drafter.zero_grad()
        if version == 1:
            value, metrics = eagle1_loss(drafter, batch, noise=0.0)
        else:
            value, metrics = eagle3_ttt_loss(drafter, batch, tgt.lm_head, steps=4)
        value.backward()
        return value.detach(), metrics, _grads(drafter)

    new = loss()
    with monkeypatch.context() as m:
        _old_way(m, batch)
        old = loss()
    torch.testing.assert_close(new[0], old[0], atol=1e-6, rtol=1e-5)
    for key in old[1]:
        torch.testing.assert_close(new[1][key], old[1][key], atol=1e-6, rtol=1e-5)
    assert new[2].keys() == old[2].keys() and new[2]
    for name in old[2]:
        torch.testing.assert_close(new[2][name], old[2][name], atol=1e-6, rtol=1e-4, msg=name)


def _record_sdpa(monkeypatch) -> list[tuple[bool, bool]]:
    """Every SDPA call made by draftsmith's drafters as ``(has a mask, grouped heads)`` (the
    target's own attention, transformers' code, is not ours to change)."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("draftsmith."):
            grouped = k.shape[-3] != q.shape[-3] or bool(kwargs.get("enable_gqa", False))
            calls.append((attn_mask is not None, grouped))
        return real(q, k, v, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_no_sdpa_call_has_both_a_mask_and_grouped_heads(monkeypatch, kernel, tgt, data):
    """What sends CUDA to the math kernel (a T x T probability tensor per head kept for the
    backward): never done, in training (EAGLE-1, EAGLE-3 unroll) nor in drafting (chain, tree)."""
    from draftsmith.heads.eagle_proposer import EagleProposer
    from draftsmith.train.decoding.speculative import generate

    assert tgt.config.num_key_value_heads < tgt.config.num_attention_heads  # grouped heads
    calls = _record_sdpa(monkeypatch)
    d2t, t2d = _vocab(48)
    e3 = build_drafter(tgt, _config(tgt, 3, 48), d2t, t2d, seed=0)
    loss, _ = eagle3_ttt_loss(e3, data, tgt.lm_head, steps=4)
    loss.backward()
    e1 = build_drafter(tgt, _config(tgt, 1), seed=0)
    eagle1_loss(e1, data, noise=0.0)[0].backward()
    prompt = data["input_ids"][0, :8]
    for tree in (False, True):
        drafter = EagleProposer(e3, tree=tree, topk=3, total_tokens=8)
        generate(tgt, prompt, drafter, k=3, max_new_tokens=12)
    assert calls, "the spy saw no SDPA call"
    assert not [c for c in calls if c[0] and c[1]], calls


def _full_batch(tgt, t: int) -> dict:
    """One random sample of ``t`` tokens, every position supervised, with the target's hidden
    states (the shape a TTT unroll reads)."""
    ids = torch.randint(0, 64, (1, t), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = dict(enumerate(tgt(ids, output_hidden_states=True).hidden_states))
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
        "hidden_states": hs,
    }


def test_nothing_of_t_by_t_size_is_kept_for_the_backward(tgt):
    """One unroll of 4 steps at T = 200: every tensor autograd saves is linear in T."""
    t = 200
    batch = _full_batch(tgt, t)
    d2t, t2d = _vocab(48)
    drafter = build_drafter(tgt, _config(tgt, 3, 48), d2t, t2d, seed=0)
    sizes = []

    def pack(x):
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        eagle3_ttt_loss(drafter, batch, tgt.lm_head, steps=4)
    # The largest linear tensors: [T, V_draft] labels and logits (48), [T, H or 3H] activations.
    assert max(sizes) < t * t, max(sizes)


# --------------------------------------------------------------------------------------------
# Inference: the tree's visible context through the kernel
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [0, 1, 30])
def test_prefix_attention_equals_the_dense_mask(prefix):
    g = torch.Generator().manual_seed(prefix)
    n, tail = 5, 9
    q = torch.randn(1, 4, n, 16, generator=g)
    k = torch.randn(1, 2, prefix + tail, 16, generator=g)
    v = torch.randn(1, 2, prefix + tail, 16, generator=g)
    tail_mask = torch.rand(n, tail, generator=g) < 0.5
    tail_mask[:, -1] = True  # every query sees something
    mask = torch.cat([torch.ones(n, prefix, dtype=torch.bool), tail_mask], dim=1)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)
    with torch.no_grad():
        out = prefix_attention(q, k, v, prefix, tail_mask)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    # With grad on, the exact path (differentiable) gives the same.
    qg = q.clone().requires_grad_()
    torch.testing.assert_close(
        prefix_attention(qg, k, v, prefix, tail_mask), ref, atol=2e-6, rtol=1e-5
    )


def test_drafter_with_a_mask_offset_equals_the_full_mask(tgt, data):
    """``mask_offset``: keys before it visible to all, the mask over the rest only."""
    d2t, t2d = _vocab(48)
    drafter = build_drafter(tgt, _config(tgt, 3, 48), d2t, t2d, seed=0).eval()
    feats = drafter.feature_tensor({k: v[:1, :20] for k, v in data["hidden_states"].items()})
    ids = data["input_ids"][:1, :21]
    with torch.no_grad():
        a, b = EagleCache(), EagleCache()
        for cache in (a, b):
            drafter(drafter.embed(ids[:, 1:17]), feats[:, :16], torch.arange(16)[None], cache=cache)
        emb = drafter.embed(ids[:, 17:21])
        pos = torch.arange(16, 20)[None]
        tail = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]]).bool()
        full = torch.cat([torch.ones(4, 16, dtype=torch.bool), tail], dim=1)
        x, _ = drafter(emb, feats[:, 16:20], pos, attention_mask=full[None, None], cache=a)
        y, _ = drafter(
            emb, feats[:, 16:20], pos, attention_mask=tail[None, None], cache=b, mask_offset=16
        )
    torch.testing.assert_close(x, y, atol=2e-6, rtol=1e-5)
    assert math.isfinite(float(y.abs().sum()))


def test_unroll_refuses_a_mask(tgt, data):
    drafter = build_drafter(tgt, _config(tgt, 1), seed=0)
    feats = data["hidden_states"][4][:1, :5]
    with pytest.raises(ValueError, match="no attention_mask"), warnings.catch_warnings():
        drafter(
            drafter.embed(data["input_ids"][:1, 1:6]),
            feats,
            torch.arange(5)[None],
            attention_mask=torch.ones(1, 1, 5, 5, dtype=torch.bool),
            cache=TTTKeys(),
        )


# --------------------------------------------------------------------------------------------
# DFlash: blocks side by side, a chunk at a time
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_queries", [4, 8, 12, 1000])
def test_block_attention_equals_the_dense_block_mask(chunk_queries):
    """Values and gradients of the chunked block attention = one SDPA call under
    ``dflash_attention_mask`` (with right padding and invalid trailing anchors)."""
    from draftsmith.heads.attention import BlockLayout, block_attention
    from draftsmith.train.objectives.dflash import dflash_attention_mask

    g = torch.Generator().manual_seed(chunk_queries)
    b, h, kv, t, d, s = 2, 4, 2, 30, 16, 4
    anchors = torch.tensor([[2, 5, 9, 20, 25], [1, 3, 4, 6, 6]])
    attn = torch.ones(b, t, dtype=torch.long)
    attn[1, 12:] = 0
    a = anchors.shape[1]
    ts = [
        torch.randn(b, h, a * s, d, generator=g),
        torch.randn(b, kv, t, d, generator=g),
        torch.randn(b, kv, t, d, generator=g),
        torch.randn(b, kv, a * s, d, generator=g),
        torch.randn(b, kv, a * s, d, generator=g),
    ]
    new_in = [x.clone().requires_grad_() for x in ts]
    ref_in = [x.clone().requires_grad_() for x in ts]
    out = block_attention(*new_in, BlockLayout(anchors, attn > 0, s), chunk_queries=chunk_queries)
    q, kc, vc, kb, vb = ref_in
    mask = dflash_attention_mask(anchors, attn, s)
    ref = F.scaled_dot_product_attention(
        q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), attn_mask=mask, enable_gqa=True
    )
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    grad = torch.randn_like(ref)
    for x, y in zip(
        torch.autograd.grad(out, new_in, grad), torch.autograd.grad(ref, ref_in, grad), strict=True
    ):
        torch.testing.assert_close(x, y, atol=5e-6, rtol=1e-5)


def test_dflash_loss_keeps_no_all_blocks_mask_for_the_backward(tgt):
    """128 anchors of 8 slots over T = 300: nothing of size A S x (T + A S) is saved (the
    blocks go 64 at a time, each chunk recomputed in the backward)."""
    from draftsmith.heads.dflash import DFlashConfig
    from draftsmith.heads.dflash import build_drafter as build_dflash
    from draftsmith.train.objectives.dflash import dflash_loss

    t = 300
    batch = _full_batch(tgt, t)
    cfg = DFlashConfig.from_target(
        tgt.config, block_size=8, num_layers=1, mask_token_id=5, feature_layers=[1, 2, 3]
    )
    drafter = build_dflash(tgt, cfg, seed=0)
    sizes = []

    def pack(x):
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        dflash_loss(drafter, batch, tgt.lm_head, max_anchors=128)
    assert max(sizes) < 128 * 8 * (t + 128 * 8), max(sizes)
