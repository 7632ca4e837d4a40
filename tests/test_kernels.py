"""The flattened-linear patch: same values, faster path, applied once, state dicts unchanged."""

from __future__ import annotations

import copy

import torch
from torch import nn

from draftsmith.train.target_model.kernels import flatten_linear_inputs


def test_patched_linear_matches_and_keeps_state_dict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False)).bfloat16()
    ref = copy.deepcopy(model)
    assert flatten_linear_inputs(model) == 2
    assert flatten_linear_inputs(model) == 0  # idempotent
    big = torch.randn(1, 7, 16).bfloat16()
    for x in (big[:, -1:], big, big[0], big.transpose(0, 1)):  # strided views, 2-D, 3-D
        torch.testing.assert_close(model(x), ref(x))
    assert model.state_dict().keys() == ref.state_dict().keys()
    copied = copy.deepcopy(model)  # the bound patch follows the copy, not the original
    copied[0].weight.data.zero_()
    assert not torch.equal(copied(big), model(big))


def test_proposer_objects_are_searched_one_level():
    class Proposer:
        def __init__(self):
            self.drafter = nn.Linear(4, 4).bfloat16()
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


def test_only_cpu_bf16_layers_are_patched():
    """The workaround is for a CPU bf16 kernel path: fp32 layers and layers on another device
    (the meta device stands in for a GPU) keep their own forward."""
    fp32 = nn.Linear(8, 4)
    on_meta = nn.Linear(8, 4, device="meta", dtype=torch.bfloat16)
    assert flatten_linear_inputs(fp32, on_meta) == 0
    assert "forward" not in vars(fp32) and "forward" not in vars(on_meta)
    assert flatten_linear_inputs(nn.Linear(8, 4, dtype=torch.bfloat16)) == 1


def test_load_target_patches_only_on_cpu_in_bf16(tiny_target_dir):
    from draftsmith.train.target_model.load import load_target

    bf16, _ = load_target(tiny_target_dir, dtype=torch.bfloat16)
    fp32, _ = load_target(tiny_target_dir, dtype=torch.float32)
    patched = [m for m in bf16.modules() if type(m) is nn.Linear and "forward" in vars(m)]
    assert patched and len(patched) == sum(type(m) is nn.Linear for m in bf16.modules())
    assert not any("forward" in vars(m) for m in fp32.modules() if type(m) is nn.Linear)
