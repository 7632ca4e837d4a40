"""The flattened-linear patch: same values, faster path, applied once, state dicts unchanged."""

from __future__ import annotations

import copy

import torch
from torch import nn

from draftsmith.train.target.kernels import flatten_linear_inputs


def test_patched_linear_matches_and_keeps_state_dict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    ref = copy.deepcopy(model)
    assert flatten_linear_inputs(model) == 2
    assert flatten_linear_inputs(model) == 0  # idempotent
    big = torch.randn(1, 7, 16)
    for x in (big[:, -1:], big, big[0], big.transpose(0, 1)):  # strided views, 2-D, 3-D
        torch.testing.assert_close(model(x), ref(x))
    assert model.state_dict().keys() == ref.state_dict().keys()
    copied = copy.deepcopy(model)  # the bound patch follows the copy, not the original
    copied[0].weight.data.zero_()
    assert not torch.equal(copied(big), model(big))


def test_proposer_objects_are_searched_one_level():
    class Proposer:
        def __init__(self):
            self.drafter = nn.Linear(4, 4)
            self.k = 3

    p = Proposer()
    assert flatten_linear_inputs(p, None) == 1
    assert "forward" in vars(p.drafter)


def test_bf16_strided_view_goes_through_a_2d_matmul(monkeypatch):
    lin = nn.Linear(8, 4).bfloat16()
    flatten_linear_inputs(lin)
    seen = []
    real = torch.nn.functional.linear

    def spy(x, w, b=None):
        seen.append(x.dim())
        return real(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    view = torch.randn(1, 5, 8).bfloat16()[:, -1:]
    out = lin(view)
    assert out.shape == (1, 1, 4) and seen == [2]
