"""Hidden-state cache (offline), online features, manifest checks, resume, multi-process."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from collections import Counter, namedtuple
from pathlib import Path

import pytest
import torch

from draftsmith.heads.families import cache_layers
from draftsmith.train.data.batching import TokenDataset, collate_hidden_states
from draftsmith.train.data.chat import template_fingerprint
from draftsmith.train.data.vocab import draft_vocab, load_vocab_stats
from draftsmith.train.features.cache_command import main_cache
from draftsmith.train.features.cache_format import (
    DTYPES,
    CacheError,
    CacheMismatchError,
    DiskSpaceError,
)
from draftsmith.train.features.cache_read import HiddenStateCache
from draftsmith.train.features.cache_shards import make_plan
from draftsmith.train.features.cache_write import build_cache
from draftsmith.train.features.source import (
    compute_hidden_states,
    dataset_fingerprint,
    feature_source,
    target_weights_hash,
)
from draftsmith.train.features.vocab_command import main_vocab
from tests.conftest import tiny_llama, tiny_model_dir

LAYERS = [0, 2, 4]  # embeddings, a middle layer, the final normed output of the 4-layer target
REPO = Path(__file__).resolve().parents[1]


def make_samples(n: int = 24, vocab: int = 64, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 40, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        mask = [0] * (length // 3) + [1] * (length - length // 3)
        out.append({"input_ids": ids, "loss_mask": mask, "id": f"s{i}"})
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny forwards on 1 thread: with 2 threads on a busy 2-core machine each forward waits on
    OpenMP barriers (0.3 s instead of 5 ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, init_std=0.1)


@pytest.fixture(scope="module")
def samples():
    return make_samples()


def reference(model, sample, layers=LAYERS) -> dict[int, torch.Tensor]:
    """Unbatched, unpadded forward of one sample."""
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([sample["input_ids"]]),
            output_hidden_states=True,
            use_cache=False,
        )
    return {layer: out.hidden_states[layer][0] for layer in layers}


def build(model, samples, out, **kw):
    kw = {"dtype": "fp32", "batch_tokens": 160, "shard_mb": 0.02, "progress": False, **kw}
    return build_cache(model, samples, out, LAYERS, **kw)


def files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_cache_presets_are_the_families_layers():
    assert cache_layers("eagle3", 30) == [2, 15, 27, 30]
    assert cache_layers("eagle1", 30) == cache_layers("medusa", 30) == [30]
    with pytest.raises(ValueError, match="unknown preset 'hydra'; expected one of eagle3"):
        cache_layers("hydra", 30)


def test_cache_matches_unbatched_forward(model, samples, tmp_path):
    summary = build(model, samples, tmp_path / "c")
    assert summary["num_shards"] > 2 and summary["num_samples"] == len(samples)
    cache = HiddenStateCache(tmp_path / "c")
    assert len(cache) == len(samples) and cache.cached_layers == LAYERS
    # Length-sorted batches of up to 160 padded tokens: most samples were padded in a batch.
    for i, s in enumerate(samples):
        item = cache[i]
        assert item["input_ids"].tolist() == s["input_ids"]
        assert item["loss_mask"].tolist() == s["loss_mask"]
        assert item["id"] == s["id"] and item["index"] == i
        ref = reference(model, s)
        for layer in LAYERS:
            got = item["hidden_states"][layer]
            assert got.dtype == torch.float32 and got.shape == ref[layer].shape
            torch.testing.assert_close(got, ref[layer], atol=1e-5, rtol=1e-5)
    m = cache.manifest
    assert m["num_tokens"] == sum(len(s["input_ids"]) for s in samples)
    assert m["num_supervised_tokens"] == sum(sum(s["loss_mask"]) for s in samples)
    assert m["dataset_fingerprint"] == dataset_fingerprint(samples)
    assert cache.ids == [s["id"] for s in samples]
    assert cache.lengths.tolist() == [len(s["input_ids"]) for s in samples]
    clone = pickle.loads(pickle.dumps(cache))  # spawned DataLoader workers get a pickled copy
    assert torch.equal(clone[3]["hidden_states"][4], cache[3]["hidden_states"][4])


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_storage_dtypes(model, samples, tmp_path, dtype):
    out = tmp_path / dtype
    summary = build(model, samples[:8], out, dtype=dtype, shard_mb=512)
    cache = HiddenStateCache(out)
    assert cache.dtype == DTYPES[dtype] and cache.manifest["dtype"] == dtype
    tol = {"bf16": 1e-2, "fp16": 1e-3, "fp32": 1e-5}[dtype]
    for i in range(8):
        got = cache[i]["hidden_states"][4]
        assert got.dtype == DTYPES[dtype]
        torch.testing.assert_close(got.float(), reference(model, samples[i])[4], atol=tol, rtol=tol)
    shard = out / "shard-00000.safetensors"
    ntok = summary["num_tokens"]
    payload = ntok * len(LAYERS) * 32 * DTYPES[dtype].itemsize
    assert summary["estimate_bytes"] == payload + 9 * ntok
    assert 0 < shard.stat().st_size - summary["estimate_bytes"] < 4096  # header + offsets


def test_resume_is_byte_identical(model, samples, tmp_path):
    build(model, samples, tmp_path / "full")

    class Killed(Exception):
        pass

    seen: list[int] = []

    def die_after_two(k: int) -> None:
        seen.append(k)
        if len(seen) == 2:
            raise Killed

    with pytest.raises(Killed):
        build(model, samples, tmp_path / "resumed", on_shard_written=die_after_two)
    assert not (tmp_path / "resumed" / "manifest.json").exists()
    with pytest.raises(CacheError, match="did not finish; rerun"):
        HiddenStateCache(tmp_path / "resumed")
    summary = build(model, samples, tmp_path / "resumed")
    assert summary["skipped"] == [0, 1] and summary["written"][0] == 2
    assert files(tmp_path / "resumed") == files(tmp_path / "full")
    again = build(model, samples, tmp_path / "resumed")  # complete: nothing to do
    assert again["written"] == [] and files(tmp_path / "resumed") == files(tmp_path / "full")


def test_out_of_vocab_ids_refused_before_any_forward(model, tmp_path):
    bad = [
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
        {"input_ids": [4, 99], "loss_mask": [1, 1]},
    ]
    with pytest.raises(CacheError, match=r"sample 1: token id 99 is outside .* \[0, 64\)"):
        build(model, bad, tmp_path / "c")
    assert not list((tmp_path / "c").glob("shard-*"))


def test_other_settings_refused_unless_overwrite(model, samples, tmp_path):
    build(model, samples[:6], tmp_path / "c")
    with pytest.raises(CacheError, match="built with other data or settings"):
        build(model, samples[:6], tmp_path / "c", dtype="bf16")
    build(model, samples[:6], tmp_path / "c", dtype="bf16", overwrite=True)
    assert HiddenStateCache(tmp_path / "c").manifest["dtype"] == "bf16"


def test_disk_estimate_refusal(model, samples, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(DiskSpaceError) as err:
        build(model, samples, tmp_path / "c")
    need = sum(len(s["input_ids"]) for s in samples) * (3 * 32 * 4 + 9)
    msg = str(err.value)
    assert f"needs {need} bytes" in msg and "only 1000 bytes" in msg
    assert "× 3 layers × 32 hidden × 4 bytes" in msg
    assert not list((tmp_path / "c").glob("shard-*"))


def test_manifest_mismatch_errors_name_field_and_both_values(model, samples, tmp_path):
    build(model, samples[:4], tmp_path / "c", template_fingerprint="tpl-A", target_hash="hash-A")
    cache = HiddenStateCache(tmp_path / "c")
    cache.verify(
        layers=[4],
        target_hash="hash-A",
        template_fingerprint="tpl-A",
        hidden_size=32,
        dtype=torch.float32,
        vocab_size=64,
        num_layers=4,
        dataset_fingerprint=dataset_fingerprint(samples[:4]),
    )
    cases = {
        "target_hash": ("hash-B", "hash-A"),
        "template_fingerprint": ("tpl-B", "tpl-A"),
        "hidden_size": (64, 32),
        "dtype": ("bf16", "fp32"),
        "vocab_size": (128, 64),
        "num_layers": (30, 4),
        "dataset_fingerprint": ("data-B", dataset_fingerprint(samples[:4])),
        "max_length": (128, None),
    }
    for field, (want, have) in cases.items():
        with pytest.raises(CacheMismatchError) as err:
            cache.verify(**{field: want})
        assert err.value.mismatches == [(field, want, have)]
        assert f"{field}: trainer expects {want!r}, cache has {have!r}" in str(err.value)
    with pytest.raises(CacheMismatchError) as err:
        cache.verify(layers=[2, 3, 4], target_hash="hash-B")
    assert [m[0] for m in err.value.mismatches] == ["layers (missing [3])", "target_hash"]
    assert "trainer expects [2, 3, 4], cache has [0, 2, 4]" in str(err.value)
    with pytest.raises(CacheMismatchError, match="target_path: trainer expects"):
        cache.verify(target_path=tmp_path / "elsewhere")
    with pytest.raises(TypeError, match="unknown field 'hiden_size'"):
        cache.verify(hiden_size=32)
    with pytest.raises(CacheMismatchError, match="missing \\[1\\]"):
        HiddenStateCache(tmp_path / "c", layers=[1, 4])


def test_collate_pads_right_with_zeros():
    a = {
        "input_ids": torch.tensor([5, 6, 7]),
        "loss_mask": torch.tensor([0, 1, 1]),
        "id": "a",
        "index": 0,
        "hidden_states": {4: torch.ones(3, 2)},
    }
    b = {
        "input_ids": torch.tensor([8]),
        "loss_mask": torch.tensor([1]),
        "id": "b",
        "index": 1,
        "hidden_states": {4: torch.full((1, 2), 2.0)},
    }
    batch = collate_hidden_states([a, b], pad_token_id=9)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["hidden_states"][4].shape == (2, 3, 2)
    assert batch["hidden_states"][4][1].tolist() == [[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]
    assert batch["ids"] == ["a", "b"] and batch["index"].tolist() == [0, 1]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_online_and_offline_give_the_same_batches(model, samples, tmp_path, dtype):
    import datasets

    store = "fp32" if dtype is None else "bf16"
    build(model, samples, tmp_path / "c", dtype=store)
    data = datasets.Dataset.from_list(samples)
    off = feature_source(
        "offline",
        layers=[2, 4],
        cache=tmp_path / "c",
        dtype=dtype,
        expect={"dataset_fingerprint": dataset_fingerprint(data)},
    )
    on = feature_source("online", layers=[2, 4], data=data, target=model, dtype=dtype)
    loaders = [
        torch.utils.data.DataLoader(s.dataset, batch_size=5, collate_fn=s.collate)
        for s in (off, on)
    ]
    for b_off, b_on in zip(*loaders, strict=True):
        b_off, b_on = off.complete(b_off), on.complete(b_on)
        assert b_off.keys() == b_on.keys()
        for key in ("input_ids", "attention_mask", "loss_mask", "index"):
            assert torch.equal(b_off[key], b_on[key]), key
        assert b_off["ids"] == b_on["ids"]
        for layer in (2, 4):
            x, y = b_off["hidden_states"][layer], b_on["hidden_states"][layer]
            assert x.dtype == y.dtype == (dtype or torch.float32)
            if dtype is None:
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
            else:  # bf16 rounding of values equal to ~1e-6 can land one ulp apart
                torch.testing.assert_close(x.float(), y.float(), atol=2e-2, rtol=1e-2)
            pad = b_on["attention_mask"] == 0
            assert (y[pad] == 0).all() and (x[pad] == 0).all()


def test_online_features_can_feed_a_trained_layer(model, samples):
    batch = collate_hidden_states([TokenDataset(samples)[i] for i in range(3)])
    feats = compute_hidden_states(model, batch, [2, 4])
    head = torch.nn.Linear(32, 8)
    loss = head(torch.cat([feats[2], feats[4]], dim=1)).square().mean()
    loss.backward()  # inference-mode tensors could not be saved for backward
    assert head.weight.grad is not None and feats[4].requires_grad is False
    with pytest.raises(CacheError, match=r"valid feature layers are 0\.\.4"):
        compute_hidden_states(model, batch, [5])


def test_cache_of_shallow_layers_runs_neither_deeper_layers_nor_the_head(samples, tmp_path):
    """The cache's forwards keep only the cached layers and stop after the deepest one (issue
    50, item 3): caching layers 0 and 1 of a 4-layer target runs layer 0 only."""
    model = tiny_llama(seed=0, init_std=0.1)
    ran = Counter()
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda *_, i=i: ran.update([i]))
    model.model.norm.register_forward_hook(lambda *_: ran.update(["norm"]))
    model.lm_head.register_forward_hook(lambda *_: ran.update(["head"]))
    summary = build_cache(
        model, samples, tmp_path / "c", [0, 1], dtype="fp32", batch_tokens=160, progress=False
    )
    assert summary["num_samples"] == len(samples)
    assert set(ran) == {0} and ran[0] > 1  # one call per forward, of layer 0 only
    cache = HiddenStateCache(tmp_path / "c")
    for i in (0, 7, 23):
        ref = reference(model, samples[i], [0, 1])
        for layer in (0, 1):
            got = cache[i]["hidden_states"][layer]
            torch.testing.assert_close(got, ref[layer], atol=1e-5, rtol=1e-5)


def test_feature_source_errors(samples, tmp_path):
    with pytest.raises(ValueError, match="'online' or 'offline'"):
        feature_source("cached", layers=[4])
    with pytest.raises(ValueError, match="online needs"):
        feature_source("online", layers=[4], data=samples)


def test_dataset_fingerprint_is_container_independent(samples):
    import datasets

    fp = dataset_fingerprint(samples)
    assert fp == dataset_fingerprint(datasets.Dataset.from_list(samples))
    changed = [dict(s) for s in samples]
    changed[3] = {**changed[3], "loss_mask": [1] * len(changed[3]["loss_mask"])}
    assert dataset_fingerprint(changed) != fp
    assert dataset_fingerprint(samples, max_length=8) != fp


def test_target_weights_hash_sees_weight_changes(tmp_path):
    a = tiny_model_dir(tmp_path / "a", seed=0)
    b = tiny_model_dir(tmp_path / "b", seed=0)
    c = tiny_model_dir(tmp_path / "c", seed=1)
    assert target_weights_hash(a) == target_weights_hash(b) != target_weights_hash(c)
    with pytest.raises(CacheError, match="not a model directory"):
        target_weights_hash(tmp_path)


def test_cli_cache_and_vocab(tmp_path, capsys):
    import datasets
    from transformers import AutoTokenizer

    model_dir = tiny_model_dir(tmp_path / "target")
    samples = make_samples(10, vocab=256)
    datasets.Dataset.from_list(samples).save_to_disk(str(tmp_path / "data"))
    argv = [
        "--data",
        str(tmp_path / "data"),
        "--out",
        str(tmp_path / "c"),
        "--target",
        str(model_dir),
        "--preset",
        "eagle1",
        "--dtype",
        "bf16",
        "--draft-vocab-size",
        "16",
        "--no-progress",
    ]
    assert main_cache(argv) == 0
    cache = HiddenStateCache(tmp_path / "c")
    m = cache.manifest
    assert m["layers"] == [4] and m["dtype"] == "bf16" and len(cache) == 10
    assert m["target"]["hash"] == target_weights_hash(model_dir)
    assert m["target"]["path"] == str(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert m["template_fingerprint"] == template_fingerprint(tok)
    tensors, meta = load_vocab_stats(tmp_path / "c")
    eos = tok.eos_token_id  # forced into the draft vocab
    assert meta["always_include"] == [eos] and tensors["t2d"][eos]
    assert torch.equal(tensors["d2t"], draft_vocab(tensors["counts"], 16, [eos])[0])
    # Standalone: recount from the cache's own shards into another file.
    out = tmp_path / "v.safetensors"
    vargv = [
        "--data",
        str(tmp_path / "c"),
        "--out",
        str(out),
        "--draft-vocab-size",
        "8",
        "--no-include-eos",
    ]
    assert main_vocab(vargv) == 0
    assert torch.equal(load_vocab_stats(out)[0]["counts"], tensors["counts"])
    # device_map (model parallelism for big targets; everything lands on the CPU here).
    dm = [*argv[:3], str(tmp_path / "dm"), *argv[4:], "--device-map", "auto"]
    assert main_cache(dm) == 0
    cache_dm = HiddenStateCache(tmp_path / "dm")
    assert torch.equal(cache_dm[5]["hidden_states"][4], cache[5]["hidden_states"][4])
    # Bad input (a usage error): one line naming the path and what makes it, exit code 2.
    capsys.readouterr()  # progress bars of the runs above
    assert main_cache(["--data", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: tokenized data not found") and "draftsmith data tokenize" in err
    assert err.count("\n") == 1


def test_make_plan_respects_batch_tokens():
    import numpy as np

    lengths = np.array([5, 40, 12, 12, 3, 40, 7, 200])
    plan = make_plan(lengths, batch_tokens=64, max_batch_size=3, shard_bytes=100, bytes_per_token=1)
    batches = [b for shard in plan.shards for b in shard]
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert batches[0] == [7]  # longest first, alone (longer than the budget)
    for b in batches:
        assert len(b) <= 3 and (len(b) == 1 or len(b) * lengths[b].max() <= 64)
    assert plan.shard_tokens == [int(sum(lengths[b].sum() for b in s)) for s in plan.shards]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(script: Path, *args: str) -> subprocess.CompletedProcess:
    """``accelerate launch`` with our 2-CPU-process config on a free port."""
    accelerate = shutil.which("accelerate") or "accelerate"
    config = REPO / "recipes/accelerate/cpu_2proc.yaml"
    return subprocess.run(
        [
            accelerate,
            "launch",
            "--config_file",
            str(config),
            "--main_process_port",
            str(_free_port()),
            str(script),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        # PYTHONPATH: the scripts import the shared test fixtures (tests.conftest).
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )


RANK_SCRIPT = """
import json, os, sys
from draftsmith.train.config import parse_config
from draftsmith.train.features.cache_command import CacheConfig, run_cache
s = run_cache(parse_config(CacheConfig, sys.argv[1:]))
# One file per rank: two ranks printing to one pipe can interleave their lines.
path = os.path.join(os.environ["SUMMARY_DIR"], f"rank{s['process_index']}.json")
with open(path, "w") as f:
    json.dump({k: s[k] for k in ("process_index", "num_processes", "written")}, f)
"""


@pytest.mark.integration
def test_two_cpu_processes_equal_one(tmp_path, monkeypatch):
    """accelerate launch, 2 CPU processes: the merged cache equals a 1-process build."""
    monkeypatch.setenv("SUMMARY_DIR", str(tmp_path))
    model_dir = tiny_model_dir(tmp_path / "target")
    with open(tmp_path / "data.jsonl", "w") as f:
        for s in make_samples(20, vocab=256, seed=1):
            f.write(json.dumps(s) + "\n")
    script = tmp_path / "run.py"
    script.write_text(RANK_SCRIPT)
    args = [
        "--data",
        str(tmp_path / "data.jsonl"),
        "--target",
        str(model_dir),
        "--layers",
        "1",
        "3",
        "4",
        "--dtype",
        "fp32",
        "--batch-tokens",
        "128",
        "--shard-mb",
        "0.02",
        "--no-progress",
        "--threads",
        "1",
    ]
    proc = _launch(script, "--out", str(tmp_path / "two"), *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = sorted(
        (json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")),
        key=lambda r: r["process_index"],
    )
    # Really two processes in one group, each writing its own round-robin slice of the shards.
    assert [(r["process_index"], r["num_processes"]) for r in ranks] == [(0, 2), (1, 2)]
    assert main_cache(["--out", str(tmp_path / "one"), *args]) == 0  # --threads 1, as the ranks
    one, two = HiddenStateCache(tmp_path / "one"), HiddenStateCache(tmp_path / "two")
    num_shards = len(one.manifest["shards"])
    assert num_shards >= 4
    assert ranks[0]["written"] == list(range(0, num_shards, 2))
    assert ranks[1]["written"] == list(range(1, num_shards, 2))
    assert one.manifest["shards"] == two.manifest["shards"]
    for i in range(len(one)):
        a, b = one[i], two[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and a["id"] == b["id"]
        for layer in (1, 3, 4):
            torch.testing.assert_close(
                a["hidden_states"][layer], b["hidden_states"][layer], atol=1e-6, rtol=1e-6
            )
    # Same plan, same thread count, same CPU: the files are byte-identical, not just close.
    assert files(tmp_path / "one") == files(tmp_path / "two")


FSDP_SCRIPT = """
import sys, torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from draftsmith.train.core.dist import process_state
from draftsmith.train.data.batching import TokenDataset, collate_hidden_states
from draftsmith.train.features.cache_format import CacheError
from draftsmith.train.features.cache_write import build_cache
from draftsmith.train.features.source import compute_hidden_states
from tests.conftest import tiny_llama
from tests.test_hidden_states import make_samples

torch.set_num_threads(1)
state = process_state()
assert state.num_processes == 2, state
ref, model = tiny_llama(seed=0, init_std=0.1), tiny_llama(seed=0, init_std=0.1)
# FSDP2 full shard (what accelerate's FSDP plugin with fsdp_version 2 applies): each rank keeps
# half of every weight and all-gathers one decoder layer at a time.
mesh = init_device_mesh("cpu", (2,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
w = model.model.layers[0].self_attn.q_proj.weight
assert w.to_local().shape[0] * 2 == w.shape[0]
ds, r = TokenDataset(make_samples(8)), state.process_index
batch = collate_hidden_states([ds[i] for i in range(4 * r, 4 * r + 4)])
feats = compute_hidden_states(model, batch, [2, 4])
with torch.no_grad():
    out = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
              output_hidden_states=True)
keep = batch["attention_mask"].bool()
for layer in (2, 4):
    torch.testing.assert_close(feats[layer][keep], out.hidden_states[layer][keep])
# Shallow layers under FSDP: the forward runs to its end (stopping it half way would leave
# FSDP's forward state half done), the capture hooks go away, and the next forward is whole.
hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
shallow = compute_hidden_states(model, batch, [0, 1])
# FSDP2's own bookkeeping (private; skipped if it moves): the root's forward has completed.
state = getattr(model, "_get_fsdp_state", lambda: None)()
if hasattr(state, "_training_state"):
    assert state._training_state.name == "IDLE", state._training_state
again = compute_hidden_states(model, batch, [2, 4])
assert hooks == [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
for layer in (0, 1):
    torch.testing.assert_close(shallow[layer][keep], out.hidden_states[layer][keep])
for layer in (2, 4):
    assert torch.equal(again[layer], feats[layer])
head = torch.nn.Linear(32, 8)
head(feats[4]).square().mean().backward()  # the drafter trains on the sharded target's features
try:
    build_cache(model, make_samples(8), sys.argv[1], [4], progress=False)
    raise SystemExit("offline caching with an FSDP target should refuse")
except CacheError as exc:
    assert "FSDP" in str(exc)
print(f"RANK {r} OK", flush=True)
"""


@pytest.mark.integration
def test_online_features_under_fsdp2_two_cpu_processes(tmp_path):
    """Online features from a target fully sharded over 2 CPU processes equal the unsharded ones."""
    script = tmp_path / "fsdp.py"
    script.write_text(FSDP_SCRIPT)
    proc = _launch(script, str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RANK 0 OK" in proc.stdout and "RANK 1 OK" in proc.stdout
