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


def test_gqa_switch_drops_the_kv_copies_and_keeps_the_logits(monkeypatch):
    """With the switch, a tree-masked verify forward reads the grouped K/V heads directly
    (no repeat_kv) and gives the logits of the copying path."""
    import transformers.integrations.sdpa_attention as sdpa
    from conftest import tiny_llama
    from transformers import DynamicCache

    from draftsmith.train.decoding.speculative import _tree_inputs
    from draftsmith.train.target_model.kernels import FORCE_GQA_ENV

    model = tiny_llama(layers=2)  # 4 query heads, 2 K/V heads
    model.set_attn_implementation("sdpa")
    calls = []
    real = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda h, n: calls.append(n) or real(h, n))
    prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    tree = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    mask, pos, _ = _tree_inputs([-1, -1, -1, -1, 0, 1], prompt.shape[1], torch.device("cpu"))
    logits = {}
    with torch.inference_mode():
        for switch in ("0", "1"):
            monkeypatch.setenv(FORCE_GQA_ENV, switch)
            calls.clear()
            cache = DynamicCache(config=model.config)
            model(input_ids=prompt, cache=cache, use_cache=True)
            out = model(
                input_ids=tree, cache=cache, use_cache=True, attention_mask=mask, position_ids=pos
            )
            logits[switch] = out.logits
            assert bool(calls) == (switch == "0"), switch  # 2 layers x (keys, values) copied
    torch.testing.assert_close(logits["1"], logits["0"])


def test_gqa_switch_is_set_while_decoding_on_a_cpu_only(monkeypatch):
    import os

    from conftest import tiny_llama

    from draftsmith.train.decoding.speculative import generate
    from draftsmith.train.target_model import kernels

    monkeypatch.delenv(kernels.FORCE_GQA_ENV, raising=False)
    with kernels.grouped_kv_attention(torch.device("meta")):
        assert kernels.FORCE_GQA_ENV not in os.environ
    with kernels.grouped_kv_attention(torch.device("cpu")):
        assert os.environ[kernels.FORCE_GQA_ENV] == "1"
    assert kernels.FORCE_GQA_ENV not in os.environ  # removed after the block
    monkeypatch.setenv(kernels.FORCE_GQA_ENV, "0")  # a user's own setting is kept
    with kernels.grouped_kv_attention(torch.device("cpu")):
        assert os.environ[kernels.FORCE_GQA_ENV] == "0"
    # The decoding loop runs under it, and leaves the process as it found it.
    monkeypatch.delenv(kernels.FORCE_GQA_ENV)
    seen = []
    model = tiny_llama(layers=1)
    real = model.forward
    monkeypatch.setattr(
        model,
        "forward",
        lambda *a, **k: seen.append(os.environ.get(kernels.FORCE_GQA_ENV)) or real(*a, **k),
    )
    generate(model, [1, 2, 3], None, max_new_tokens=3)
    assert seen == ["1"] * 3 and kernels.FORCE_GQA_ENV not in os.environ
