"""LK losses (train/objectives/acceptance.py): values, gradients, and that they raise α."""

from __future__ import annotations

import pytest
import torch

from draftsmith.train.objectives.acceptance import DRAFT_LOSSES, draft_head_loss, draft_loss
from draftsmith.train.objectives.distill import expected_acceptance


def _case(seed: int = 0, b: int = 2, t: int = 5, v: int = 11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, requires_grad=True)
    p = torch.softmax(2 * torch.randn(b, t, v, generator=g), -1)
    mask = torch.rand(b, t, generator=g) > 0.3
    return logits, p, mask


def test_values_match_their_definitions():
    logits, p, mask = _case()
    q = torch.softmax(logits, -1)
    ce = (-(p * torch.log_softmax(logits, -1)).sum(-1))[mask].mean()
    alpha = torch.minimum(p, q).sum(-1)[mask].mean()
    # α is the acceptance rate the distillation metrics compute from logits.
    assert alpha.item() == pytest.approx(
        expected_acceptance(p.log(), logits.detach(), mask).item(), abs=1e-6
    )
    for kind, want in [
        ("kl", ce),
        ("tv", 1 - alpha),
        ("nla", (-torch.log(torch.minimum(p, q).sum(-1)))[mask].mean()),
        ("lk_hybrid", torch.exp(-3 * alpha) * ce + (1 - torch.exp(-3 * alpha)) * (1 - alpha)),
    ]:
        loss, ce_out, alpha_out = draft_loss(kind, logits, p, mask)
        assert loss.item() == pytest.approx(want.item(), rel=1e-5), kind
        assert ce_out.item() == pytest.approx(ce.item(), rel=1e-5)
        assert alpha_out.item() == pytest.approx(alpha.item(), rel=1e-5)
        assert not ce_out.requires_grad and not alpha_out.requires_grad


def test_lk_hybrid_blend_weight_is_detached():
    """λ = exp(-η ᾱ) is a constant of the step: with η = 0 the hybrid is KL, gradient included,
    and its gradient is λ ∇KL + (1 - λ) ∇TV, not one through λ."""
    logits, p, mask = _case(1)
    (g_kl,) = torch.autograd.grad(draft_loss("kl", logits, p, mask)[0], logits)
    (g_h0,) = torch.autograd.grad(draft_loss("lk_hybrid", logits, p, mask, eta=0.0)[0], logits)
    torch.testing.assert_close(g_h0, g_kl)
    (g_tv,) = torch.autograd.grad(draft_loss("tv", logits, p, mask)[0], logits)
    loss, _, alpha = draft_loss("lk_hybrid", logits, p, mask, eta=3.0)
    (g_h,) = torch.autograd.grad(loss, logits)
    lam = torch.exp(-3.0 * alpha)
    torch.testing.assert_close(g_h, lam * g_kl + (1 - lam) * g_tv)


def test_masked_positions_get_no_gradient_and_unknown_kind_is_refused():
    logits, p, mask = _case(2)
    for kind in DRAFT_LOSSES:
        (grad,) = torch.autograd.grad(draft_loss(kind, logits, p, mask)[0], logits)
        assert torch.all(grad[~mask] == 0), kind
    with pytest.raises(ValueError, match="loss must be one of"):
        draft_loss("fkl", logits, p, mask)


# At α ≈ 0.3 the hybrid still gives KL the weight exp(-0.9) = 0.41, so it gains less.
@pytest.mark.parametrize(("kind", "margin"), [("tv", 0.01), ("nla", 0.01), ("lk_hybrid", 0.002)])
def test_lk_losses_reach_a_higher_acceptance_than_kl_under_limited_capacity(kind, margin):
    """A drafter that cannot match p (q = softmax(W x), rank 2 over 12 tokens, for 64 contexts)
    trained to convergence on KL and on an LK loss: the LK loss ends at a higher mean α, the
    paper's point (§3: the KL-best reachable q is not the α-best)."""
    g = torch.Generator().manual_seed(0)
    n, v, r = 64, 12, 2
    x = torch.randn(n, r, generator=g)
    p = torch.softmax(3 * torch.randn(n, v, generator=g), -1)
    mask = torch.ones(1, n, dtype=torch.bool)

    def train(loss_kind: str) -> float:
        w = torch.zeros(r, v)
        w.normal_(generator=torch.Generator().manual_seed(1))
        w.requires_grad_(True)
        opt = torch.optim.Adam([w], lr=0.05)
        for _ in range(600):
            loss, _, _ = draft_loss(loss_kind, (x @ w)[None], p[None], mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return draft_loss("tv", (x @ w)[None], p[None], mask)[2].item()

    kl_alpha, lk_alpha = train("kl"), train(kind)
    assert lk_alpha > kl_alpha + margin, (kind, lk_alpha, kl_alpha)


@pytest.mark.parametrize("kind", DRAFT_LOSSES)
def test_the_chunked_head_loss_is_draft_loss_of_the_heads_logits(kind):
    """draft_head_loss(hidden, W) = draft_loss(hidden @ W.T): value, metrics, gradients, and
    masked positions still get no gradient (tests/test_chunked_loss.py has the full sweep)."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 5, 4, generator=g, requires_grad=True)
    weight = torch.randn(11, 4, generator=g, requires_grad=True)
    _, p, mask = _case(3)
    loss, ce, alpha, _ = draft_head_loss(kind, hidden, weight, mask, p=p, chunk_rows=3)
    want = draft_loss(kind, hidden @ weight.T, p, mask)
    for got, ref in zip((loss, ce, alpha), want, strict=True):
        torch.testing.assert_close(got, ref)
    (grad,) = torch.autograd.grad(loss, hidden, retain_graph=True)
    assert torch.all(grad[~mask] == 0) and grad[mask].abs().sum() > 0
    torch.testing.assert_close(grad, torch.autograd.grad(want[0], hidden)[0])
