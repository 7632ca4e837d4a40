"""The fast CPU linears (flattened inputs, packed bf16 weights): same values, applied once, state
dicts unchanged; the GQA switch; greedy ids."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from draftsmith.train.target_model.kernels import PACKED_ENV, fast_cpu_linears, packing_supported


def test_patched_linear_matches_and_keeps_state_dict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False)).bfloat16()
    ref = copy.deepcopy(model)
    assert fast_cpu_linears(model) == 2
    assert fast_cpu_linears(model) == 0  # idempotent
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
    assert fast_cpu_linears(p, None) == 1
    assert "forward" in vars(p.drafter)


def test_bf16_strided_view_goes_through_a_2d_matmul(monkeypatch):
    lin = nn.Linear(8, 4).bfloat16()
    fast_cpu_linears(lin)
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
    assert fast_cpu_linears(fp32, on_meta) == 0
    assert "forward" not in vars(fp32) and "forward" not in vars(on_meta)
    assert fast_cpu_linears(nn.Linear(8, 4, dtype=torch.bfloat16)) == 1


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


def test_greedy_ids_upcasts_half_logits_on_a_cpu_and_keeps_the_index(monkeypatch):
    from draftsmith.heads import sampling

    torch.manual_seed(0)
    logits = torch.randn(7, 4096).bfloat16()
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index wins
    want = logits.float().argmax(-1)
    assert want[3] == 10
    seen = []
    real_argmax = torch.Tensor.argmax
    monkeypatch.setattr(
        torch.Tensor,
        "argmax",
        lambda self, *a, **kw: seen.append(self.dtype) or real_argmax(self, *a, **kw),
    )
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        seen.clear()
        got = sampling.greedy_ids(logits.to(dtype))
        assert torch.equal(got, want), dtype
        assert seen == [torch.float32], dtype  # the reduction always runs in fp32 on a CPU
    tokens, probs = sampling.choose(logits, sampling.SamplingParams())
    assert probs is None and torch.equal(tokens, want)


needs_packing = pytest.mark.skipif(
    not packing_supported(),
    reason="this CPU has no native bf16 math (AVX512-BF16/AMX), where bf16 weights are never "
    "packed: NOT covered here is the oneDNN packed linear that plain and speculative bf16 "
    "decoding use on such CPUs (its logits, repacking after a weight change, copies, autograd "
    "falling back to torch); run these tests on an AVX512-BF16 or AMX CPU",
)


@needs_packing
def test_packed_bf16_linear_matches_torch_and_follows_weight_changes():
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True).bfloat16()
    ref = copy.deepcopy(lin)
    assert fast_cpu_linears(lin) == 1
    holder = vars(lin)["_packed_weight"]
    x = torch.randn(1, 7, 64).bfloat16()
    with torch.inference_mode():
        for rows in (x[:, -1:], x, x[0], torch.randn(300, 64).bfloat16()):
            assert torch.equal(lin(rows), ref(rows))
    assert holder.packed is not None
    first = holder.packed
    with torch.no_grad():  # an optimizer step or load_state_dict changes the weight in place
        lin.weight.mul_(-1)
        ref.weight.mul_(-1)
        assert torch.equal(lin(x), ref(x))
    assert holder.packed is not first  # repacked
    lin.weight = nn.Parameter(torch.randn(96, 64).bfloat16())  # a new tensor
    ref.weight = nn.Parameter(lin.weight.detach().clone())
    with torch.no_grad():
        assert torch.equal(lin(x), ref(x))


@needs_packing
def test_packed_linear_leaves_autograd_to_torch_and_copies_pack_their_own():
    lin = nn.Linear(16, 8, bias=False).bfloat16()
    fast_cpu_linears(lin)
    holder = vars(lin)["_packed_weight"]
    x = torch.randn(3, 16).bfloat16()
    lin(x).float().sum().backward()  # trainable weight under autograd: torch's own kernel
    assert lin.weight.grad is not None and holder.packed is None
    copied = copy.deepcopy(lin)  # an opaque oneDNN tensor cannot be copied: copies start empty
    with torch.no_grad():
        lin(x)
        assert holder.packed is not None
        assert vars(copied)["_packed_weight"].packed is None
        copied.weight.zero_()
        assert torch.equal(copied(x), torch.zeros(3, 8).bfloat16())
        assert not torch.equal(lin(x), copied(x))


def test_packing_is_off_for_fp16_fp32_and_when_disabled(monkeypatch):
    half = nn.Linear(8, 4).half()
    fp32 = nn.Linear(8, 4)
    fast_cpu_linears(half, fp32)
    assert "_packed_weight" not in vars(half) and "forward" in vars(half)
    assert "forward" not in vars(fp32)
    monkeypatch.setenv(PACKED_ENV, "0")
    assert not packing_supported()
    off = nn.Linear(8, 4).bfloat16()
    assert fast_cpu_linears(off) == 1 and "_packed_weight" not in vars(off)


def test_no_packing_where_onednn_is_capped_below_bf16(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 (an AVX2-only machine rehearsed on a newer one): oneDNN refuses to
    pack bf16 weights, so nothing may try; the linears keep torch's own bf16 path."""
    from draftsmith.train import device

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    device._cpu_native_bf16.cache_clear()
    try:
        assert not packing_supported()
        capped = nn.Linear(8, 4).bfloat16()
        fast_cpu_linears(capped)
        assert "_packed_weight" not in vars(capped)
        x = torch.randn(3, 8, dtype=torch.bfloat16)
        assert capped(x).shape == (3, 4)
    finally:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
        device._cpu_native_bf16.cache_clear()


@needs_packing
def test_loaded_target_decodes_with_packed_weights_to_the_same_logits(tiny_target_dir, monkeypatch):
    """The loaded target's linears are packed, and a cached decode (one row per forward, as the
    loop runs) gives the logits of PyTorch's own kernel up to bf16 rounding: oneDNN's packed
    kernel may round a product differently (one bf16 ulp was seen in the tiny model's 64 -> 32
    projection; SmolLM2's shapes and the 8-prompt decode of bench/cpu_costs/packed_linear_cpu.json matched
    exactly)."""
    from transformers import DynamicCache

    from draftsmith.train.target_model.load import load_target

    packed, _ = load_target(tiny_target_dir, dtype=torch.bfloat16)
    monkeypatch.setenv(PACKED_ENV, "0")
    stock, _ = load_target(tiny_target_dir, dtype=torch.bfloat16)
    linears = [m for m in packed.modules() if type(m) is nn.Linear]
    assert all("_packed_weight" in vars(m) for m in linears)
    assert not any("_packed_weight" in vars(m) for m in stock.modules())
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, packed.config.vocab_size, (1, 24), generator=gen)
    caches = {
        "packed": DynamicCache(config=packed.config),
        "stock": DynamicCache(config=stock.config),
    }
    with torch.inference_mode():
        for t in range(12, 25):  # a 12-token prefill, then one token per forward
            rows = tokens[:, :t] if t == 12 else tokens[:, t - 1 : t]
            a = packed(input_ids=rows, cache=caches["packed"], use_cache=True).logits
            b = stock(input_ids=rows, cache=caches["stock"], use_cache=True).logits
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert all(vars(m)["_packed_weight"].packed is not None for m in linears)
