"""Online features by hooks (issue 50, item 3): the target's forward keeps only the requested
hidden states, stops after the deepest one and never runs the LM head; the values are the very
ones ``output_hidden_states=True`` returns."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from draftsmith.train.features import source
from draftsmith.train.features.cache_format import CacheError
from draftsmith.train.features.source import (
    _input_device,
    check_layers,
    compute_hidden_states,
    run_target,
)

VOCAB = 64


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny forwards on 1 thread (see tests/test_hidden_states.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------
# The reference: today's path before the hooks, kept here verbatim in behaviour
# --------------------------------------------------------------------------------------------


def old_run_target(target, input_ids, attention_mask):
    """All ``num_layers + 1`` hidden states from ``output_hidden_states=True`` (the old path)."""
    device = _input_device(target)
    out = target(
        input_ids=input_ids.to(device),
        attention_mask=None if attention_mask is None else attention_mask.to(device),
        output_hidden_states=True,
        use_cache=False,
        **source._forward_kwargs(target),
    )
    return out.hidden_states


def old_compute_hidden_states(target, batch, layers, *, dtype=None):
    mask = batch.get("attention_mask")
    with torch.no_grad():
        hs = old_run_target(target, batch["input_ids"], mask)
        layers = check_layers(layers, len(hs) - 1)
        keep = None if mask is None else mask.to(hs[0].device).bool().unsqueeze(-1)
        out = {}
        for layer in layers:
            t = hs[layer] if dtype is None else hs[layer].to(dtype)
            out[layer] = t if keep is None else t.masked_fill(~keep, 0)
    return out


# --------------------------------------------------------------------------------------------
# Tiny targets of several architectures
# --------------------------------------------------------------------------------------------

_COMMON = {
    "vocab_size": VOCAB,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def tiny(arch: str, layers: int = 4, hidden: int = 32, dtype=torch.float32, **extra):
    """A tiny random causal LM of ``arch`` (no download), frozen, in eval mode."""
    inter = 2 * hidden
    if arch == "llama":
        model_cls, config = LlamaForCausalLM, LlamaConfig
        kw = {**_COMMON, "intermediate_size": inter}
    elif arch == "qwen2":
        model_cls, config = Qwen2ForCausalLM, Qwen2Config
        kw = {**_COMMON, "intermediate_size": inter}
    elif arch == "qwen3":
        model_cls, config = Qwen3ForCausalLM, Qwen3Config
        kw = {**_COMMON, "intermediate_size": inter, "head_dim": hidden // 4}
    elif arch == "gemma":  # scales the embeddings by sqrt(hidden) before layer 0
        model_cls, config = GemmaForCausalLM, GemmaConfig
        kw = {**_COMMON, "intermediate_size": inter, "head_dim": hidden // 4}
    elif arch == "gpt2":  # another layout: transformer.h, ln_f, learned positions
        model_cls, config = GPT2LMHeadModel, GPT2Config
        kw = {"vocab_size": VOCAB, "n_head": 4, "n_positions": 512, "n_embd": hidden}
        kw["n_layer"] = layers
    else:
        raise ValueError(arch)
    if arch != "gpt2":
        kw.update(hidden_size=hidden, num_hidden_layers=layers)
    torch.manual_seed(0)
    model = model_cls(config(**kw, **extra)).to(dtype).eval()
    model.requires_grad_(False)
    return model


def padded_batch(b: int = 3, t: int = 11, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows of lengths t, t-4, 3 (row 0 full)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    for row, n in enumerate([t, t - 4, 3][:b]):
        mask[row, n:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


ARCHS = ["llama", "qwen2", "qwen3", "gemma", "gpt2"]
LAYER_SETS = [[0], [1], [2], [3], [4], [0, 4], [1, 2, 4], [0, 1, 2, 3, 4], [4, 2, 0]]


# --------------------------------------------------------------------------------------------
# Bit-identical to the old path
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_features_bit_identical_to_output_hidden_states(arch, dtype, padded):
    model = tiny(arch, dtype=dtype)
    batch = padded_batch()
    if not padded:
        batch = {"input_ids": batch["input_ids"]}
    for layers in LAYER_SETS:
        want = old_compute_hidden_states(model, batch, layers)
        got = compute_hidden_states(model, batch, layers)
        assert list(got) == [int(x) for x in layers]
        for layer in layers:
            assert got[layer].dtype == dtype and got[layer].shape == want[layer].shape
            assert torch.equal(got[layer], want[layer]), (arch, layers, layer)
    # The cast for a cache's storage dtype is the same cast.
    got = compute_hidden_states(model, batch, [1, 4], dtype=torch.float16)
    want = old_compute_hidden_states(model, batch, [1, 4], dtype=torch.float16)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == torch.float16 for k in (1, 4))


def test_run_target_keeps_only_the_requested_entries():
    model = tiny("llama", layers=6)
    ids = padded_batch()["input_ids"]
    with torch.no_grad():
        old = old_run_target(model, ids, None)
        every = run_target(model, ids, None)
        some = run_target(model, ids, None, [5, 1])
    assert len(every) == len(old) == 7
    assert all(torch.equal(a, b) for a, b in zip(every, old, strict=True))
    assert [i for i, h in enumerate(some) if h is not None] == [1, 5] and len(some) == 7
    assert torch.equal(some[1], old[1]) and torch.equal(some[5], old[5])


def test_layer_errors_come_before_the_forward():
    model = tiny("llama")
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda *a: calls.append(1))
    batch = padded_batch()
    with pytest.raises(CacheError, match=r"layers \[5\] out of range: the target has 4 layers"):
        compute_hidden_states(model, batch, [2, 5])
    with pytest.raises(CacheError, match="duplicates"):
        compute_hidden_states(model, batch, [2, 2])
    with pytest.raises(CacheError, match="no layers requested"):
        compute_hidden_states(model, batch, [])
    assert calls == []


def test_untied_last_hidden_state_is_the_last_layers_output():
    """A config with ``tie_last_hidden_states=False`` has 🤗 return the last layer's output (before
    the final norm) as the last entry: the hooks read the same."""
    model = tiny("llama", tie_last_hidden_states=False)
    batch = padded_batch()
    want = old_compute_hidden_states(model, batch, [2, 4])
    got = compute_hidden_states(model, batch, [2, 4])
    assert torch.equal(got[2], want[2]) and torch.equal(got[4], want[4])
    normed = model.model.norm(want[4])
    assert not torch.equal(got[4], normed)


def test_through_a_module_wrapper():
    """DDP/accelerate wrappers (``.module``) are called as they are; the hooks sit inside."""

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kwargs):
            return self.module(**kwargs)

    model = tiny("qwen3")
    batch = padded_batch()
    want = old_compute_hidden_states(model, batch, [0, 2, 4])
    got = compute_hidden_states(Wrapper(model), batch, [0, 2, 4])
    assert all(torch.equal(got[k], want[k]) for k in (0, 2, 4))


# --------------------------------------------------------------------------------------------
# Early stop: layers below the deepest requested one and the LM head never run
# --------------------------------------------------------------------------------------------


def _count_calls(model):
    """Counters of completed forwards of each decoder layer, the final norm and the LM head.

    Forward (post) hooks registered before run_target's own: they fire once a module's forward
    has returned, before run_target's hook on that module can stop the forward.
    """
    calls = {"layers": [0] * len(model.model.layers), "norm": 0, "head": 0}

    def bump(i):
        def hook(*_):
            calls["layers"][i] += 1

        return hook

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(bump(i))
    model.model.norm.register_forward_hook(lambda *_: calls.__setitem__("norm", calls["norm"] + 1))
    model.lm_head.register_forward_hook(lambda *_: calls.__setitem__("head", calls["head"] + 1))
    return calls


@pytest.mark.parametrize(
    ("layers", "ran", "norm"),
    [
        ([0], [0, 0, 0, 0, 0, 0], 0),  # the embeddings only: no decoder layer runs
        ([1], [1, 0, 0, 0, 0, 0], 0),
        ([0, 3], [1, 1, 1, 0, 0, 0], 0),
        ([2, 5], [1, 1, 1, 1, 1, 0], 0),
        ([1, 6], [1, 1, 1, 1, 1, 1], 1),  # the final normed output: every layer, no head
    ],
)
def test_forward_stops_after_the_deepest_requested_layer(layers, ran, norm):
    model = tiny("llama", layers=6)
    calls = _count_calls(model)
    batch = padded_batch()
    got = compute_hidden_states(model, batch, layers)
    assert calls == {"layers": ran, "norm": norm, "head": 0}
    want = old_compute_hidden_states(model, batch, layers)  # runs everything, head included
    assert calls["head"] == 1 and calls["layers"] == [x + 1 for x in ran]
    assert all(torch.equal(got[k], want[k]) for k in layers)


def test_hooks_are_removed_even_if_the_forward_raises():
    model = tiny("llama")
    modules = [model, model.model, *model.model.layers, model.model.norm, model.lm_head]

    def hook_counts():
        return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules]

    before = hook_counts()
    batch = padded_batch()
    compute_hidden_states(model, batch, [0, 2])  # stopped early
    compute_hidden_states(model, batch, [1, 4])  # stopped after the final norm
    assert hook_counts() == before

    def boom(*_):
        raise ValueError("boom in layer 1")

    handle = model.model.layers[1].register_forward_hook(boom)
    before = hook_counts()
    with pytest.raises(ValueError, match="boom in layer 1"):
        compute_hidden_states(model, batch, [0, 3, 4])
    assert hook_counts() == before
    handle.remove()
    # And the model still serves features afterwards.
    want = old_compute_hidden_states(model, batch, [3])
    assert torch.equal(compute_hidden_states(model, batch, [3])[3], want[3])


def test_a_forward_in_another_thread_neither_fills_nor_stops_this_one():
    """The hooks sit on shared modules: a second thread running the same target in the middle of
    this forward must not have its tensors taken for this one's, nor be stopped by its hooks."""
    import threading

    model = tiny("llama", layers=4)
    outer, inner = padded_batch(seed=1), padded_batch(seed=2)
    results = {}

    def run_inner() -> None:
        try:
            results["inner"] = compute_hidden_states(model, inner, [3])
        except Exception as exc:  # reported below, in the test's thread
            results["inner"] = exc

    def once(*_):
        if "started" not in results:
            results["started"] = True
            thread = threading.Thread(target=run_inner)
            thread.start()
            thread.join()

    model.model.layers[0].register_forward_hook(once)
    got = compute_hidden_states(model, outer, [2])
    assert not isinstance(results["inner"], Exception), results["inner"]
    assert torch.equal(got[2], old_compute_hidden_states(model, outer, [2])[2])
    assert torch.equal(results["inner"][3], old_compute_hidden_states(model, inner, [3])[3])


# --------------------------------------------------------------------------------------------
# Fallbacks: targets whose decoder layers are not found
# --------------------------------------------------------------------------------------------


def test_a_target_that_is_not_a_transformers_model_serves_its_own_hidden_states():
    """E.g. the vLLM-backed target: called with ``output_hidden_states=True``, as before."""
    inner = tiny("llama")

    class Served(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner
            self.seen = {}

        def forward(self, input_ids, attention_mask=None, **kwargs):
            self.seen = kwargs
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    target = Served()
    batch = padded_batch()
    assert source._decoder_parts(target) == "not a transformers model"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: serving its own states is its contract
        got = compute_hidden_states(target, batch, [0, 4])
    assert target.seen["output_hidden_states"] is True
    want = old_compute_hidden_states(inner, batch, [0, 4])
    assert torch.equal(got[0], want[0]) and torch.equal(got[4], want[4])
    with torch.no_grad():
        some = run_target(target, batch["input_ids"], None, [2])
    assert [i for i, h in enumerate(some) if h is not None] == [2] and len(some) == 5


def test_a_transformers_model_without_a_layer_list_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(source, "_LAYER_LISTS", ("decoder_blocks",))
    monkeypatch.setattr(source, "_warned_fallback", set())
    model = tiny("qwen2")
    batch = padded_batch()
    with pytest.warns(UserWarning, match=r"^Qwen2ForCausalLM: no list of decoder layers") as rec:
        got = compute_hidden_states(model, batch, [1, 4])
    assert len(rec) == 1 and "\n" not in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class
        compute_hidden_states(model, batch, [1, 4])
    want = old_compute_hidden_states(model, batch, [1, 4])
    assert torch.equal(got[1], want[1]) and torch.equal(got[4], want[4])


def test_decoder_parts_of_each_layout():
    for arch, body_cls in [("llama", "LlamaModel"), ("gemma", "GemmaModel"), ("gpt2", "GPT2Model")]:
        model = tiny(arch, layers=3)
        body, blocks = source._decoder_parts(model)
        assert type(body).__name__ == body_cls and len(blocks) == 3


# --------------------------------------------------------------------------------------------
# Memory: the forward's peak does not grow with the number of layers
# --------------------------------------------------------------------------------------------


def forward_peak_bytes(tmp_path, fn, *args) -> int:
    """Peak bytes the CPU allocator holds while ``fn(*args)`` runs (and its result is dropped),
    above what was allocated before: the profiler's allocation and free events, summed in order."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args)
        del out
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()
    live = peak = 0
    for event in events:
        if event.get("name") == "[memory]":
            live += int(event["args"]["Bytes"])
            peak = max(peak, live)
    return peak


def test_forward_peak_memory_does_not_grow_with_depth(tmp_path):
    """Two features ([1, N]) from a 2-layer and a 12-layer target of the same widths.

    With every hidden state kept (``output_hidden_states=True``), the 12-layer forward peaks 10
    ``[B, T, H]`` tensors higher (all 13 are alive when the head runs). With hooks it peaks at
    most one higher: in the 2-layer target layer 1's output is also the last layer's input, so
    the peak there holds one tensor fewer; everything else is the same layer's temporaries.
    """
    t, hidden = 128, 256
    ids = torch.randint(0, VOCAB, (1, t), generator=torch.Generator().manual_seed(0))
    one = t * hidden * 4  # bytes of one fp32 [1, T, H] hidden state
    peaks = {}
    for n in (2, 12):
        model = tiny("llama", layers=n, hidden=hidden)
        peaks["new", n] = forward_peak_bytes(tmp_path, run_target, model, ids, None, [1, n])
        peaks["old", n] = forward_peak_bytes(tmp_path, old_run_target, model, ids, None)
    old_growth = peaks["old", 12] - peaks["old", 2]
    new_growth = peaks["new", 12] - peaks["new", 2]
    assert old_growth >= 9.5 * one, peaks  # the measure sees the old path's growth
    assert new_growth <= one, (new_growth / one, peaks)
    assert peaks["new", 12] < peaks["old", 12] - 8 * one, peaks
