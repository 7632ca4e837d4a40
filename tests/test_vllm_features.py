"""``draftsmith data cache --backend vllm``: the subprocess protocol, and vLLM against HF.

Default suite: the whole vLLM-backend path (config, child process, protocol, the stand-in
target, the cache it writes, errors, resume) with a stand-in extractor: a script that runs
``train/features/vllm_extract.py``'s own protocol loop (``main(make_extractor=...)``) around an
HF forward in this venv (so its numbers can be compared with the HF backend's), or around
synthetic features (no transformers import: a faster child).

``@pytest.mark.vllm`` (deselected by default): the real extractor in the vLLM venv
(``DRAFTSMITH_VLLM_PYTHON``, default ``scripts/setup_vllm_venv.sh``'s venv in the draftsmith cache) on the real target
(SmolLM2-135M-Instruct), compared with the HF backend. It takes ``/tmp/vllm.lock`` (one vLLM
process per machine) and ~2-3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import fcntl
import importlib.util
import inspect
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from draftsmith.train.datagen.vllm_server import default_vllm_python
from draftsmith.train.features import vllm_backend
from draftsmith.train.features.cache_command import main_cache
from draftsmith.train.features.cache_read import HiddenStateCache
from tests.conftest import missing, tiny_model_dir

FEATURES = Path(vllm_backend.__file__).resolve().parent

# The stand-in: vllm_extract's protocol loop around an HF forward of the target, one sample at a
# time (as vLLM runs one request per sample). FAKE_* variables steer failures and the dtype.
FAKE = """
import json, os, sys
sys.path.insert(0, {features!r})
import torch
import vllm_extract


class Extractor:
    def __init__(self, args):
        if os.environ.get("FAKE_FAIL_START"):
            raise RuntimeError("engine boom")
        with open(os.path.join(args.target, "config.json")) as f:
            config = json.load(f)
        self.num_layers, self.hidden = config["num_hidden_layers"], config["hidden_size"]
        self.layers, self.args, self.calls, self.model = args.layers, args, 0, None
        self.dtype = vllm_extract.DTYPES[os.environ.get("FAKE_DTYPE", "float32")]
        if not os.environ.get("FAKE_SYNTHETIC"):  # else synthetic(): no transformers import
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)

    def ready_info(self):
        a = self.args
        return {{
            "dtype": str(self.dtype).removeprefix("torch."),
            "num_layers": self.num_layers,
            "hidden_size": self.hidden,
            "layers": self.layers,
            "versions": {{"vllm": "stand-in"}},
            "platform": "cpu",
            "engine_args": {{"max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs,
                            "max_num_batched_tokens": a.max_num_batched_tokens}},
        }}

    def extract(self, samples):
        self.calls += 1
        if self.calls == int(os.environ.get("FAKE_DIE_AT", "0")):
            os._exit(3)
        out = []
        for ids in samples:
            if self.model is None:
                h = torch.stack([{synthetic}(torch.tensor(ids), x, self.hidden)
                                 for x in self.layers], 1)
            else:
                with torch.no_grad():
                    hs = self.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
                h = torch.stack([hs[x][0] for x in self.layers], 1)
            out.append(h.to(self.dtype))
        return out

    def close(self):
        pass


{synthetic_src}

sys.exit(vllm_extract.main(make_extractor=Extractor))
"""


def synthetic(ids: torch.Tensor, layer: int, hidden: int) -> torch.Tensor:
    """Stand-in features ``[T, H]``: small integers, exact in bf16."""
    return ((ids[:, None] * 3 + 5 * layer + torch.arange(hidden)) % 64).float()


LAYERS = ["4", "0", "2"]  # unsorted on purpose: the cache keeps the requested order


def make_samples(n: int = 12, vocab: int = 256, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 30, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "loss_mask": [i % 2] * length, "id": f"s{i}"})
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target dir, 12 samples as JSONL, the stand-in script and the HF-built cache."""
    root = tmp_path_factory.mktemp("vllm_features")
    target = tiny_model_dir(root / "target")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(s) + "\n" for s in make_samples()))
    fake = root / "fake_extract.py"
    src = inspect.getsource(synthetic)
    fake.write_text(FAKE.format(features=str(FEATURES), synthetic="synthetic", synthetic_src=src))
    hf = root / "hf"
    assert main_cache([*base_argv(target, data, hf), "--backend", "hf"]) == 0
    return {"root": root, "target": target, "data": data, "fake": fake, "hf": hf}


def base_argv(target: Path, data: Path, out: Path) -> list[str]:
    # Small batches and shards: several forwards with padding, several shards.
    return [
        "--data", str(data), "--out", str(out), "--target", str(target),
        "--layers", *LAYERS, "--dtype", "fp32", "--target-dtype", "fp32",
        "--batch-tokens", "64", "--shard-mb", "0.004", "--no-progress",
    ]  # fmt: skip


def vllm_argv(setup: dict, out: Path, *extra: str) -> list[str]:
    return [
        *base_argv(setup["target"], setup["data"], out),
        "--backend", "vllm", "--vllm-python", sys.executable, *extra,
    ]  # fmt: skip


@pytest.fixture
def fake_script(setup, monkeypatch):
    monkeypatch.setattr(vllm_backend, "EXTRACT_SCRIPT", setup["fake"])
    for var in ("FAKE_FAIL_START", "FAKE_DIE_AT", "FAKE_DTYPE", "FAKE_SYNTHETIC"):
        monkeypatch.delenv(var, raising=False)
    return setup["fake"]


def assert_same_features(a: HiddenStateCache, b: HiddenStateCache, **tol) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x["id"] == y["id"]
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["loss_mask"], y["loss_mask"])
        for layer in a.layers:
            torch.testing.assert_close(
                x["hidden_states"][layer].float(), y["hidden_states"][layer].float(), **tol
            )


def test_vllm_backend_protocol_builds_the_same_cache(setup, fake_script, tmp_path):
    out = tmp_path / "v"
    assert main_cache(vllm_argv(setup, out)) == 0
    hf, vl = HiddenStateCache(setup["hf"]), HiddenStateCache(out)
    # Batched padded HF forwards vs one unpadded forward per sample: float rounding only.
    assert_same_features(hf, vl, rtol=1e-5, atol=1e-5)
    assert vl.cached_layers == [4, 0, 2]
    m, h = vl.manifest, hf.manifest
    for key in ("layers", "dataset_fingerprint", "template_fingerprint", "num_tokens", "target"):
        assert m[key] == h[key], key
    assert len(m["shards"]) > 1
    # The backend is recorded and keeps the two plans apart (a resume never mixes them).
    assert h["backend"] == {"name": "hf"}
    assert m["backend"]["name"] == "vllm" and m["backend"]["versions"] == {"vllm": "stand-in"}
    engine = m["backend"]["engine"]["engine_args"]
    assert engine["max_model_len"] == max(len(s["input_ids"]) for s in make_samples()) + 1
    assert engine["max_num_batched_tokens"] == 64 and engine["max_num_seqs"] == 64
    assert m["plan"] != h["plan"]
    vl.verify(target_hash=h["target"]["hash"], layers=[4, 0, 2])
    # The same directory, built by the HF backend, is another plan: refused, not mixed.
    code = main_cache([*base_argv(setup["target"], setup["data"], out), "--backend", "hf"])
    assert code == 2


def test_extractor_death_keeps_shards_and_resume_finishes(
    setup, fake_script, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "v"
    monkeypatch.setenv("FAKE_SYNTHETIC", "1")
    monkeypatch.setenv("FAKE_DTYPE", "bfloat16")  # the engine's dtype travels as such
    monkeypatch.setenv("FAKE_DIE_AT", "3")  # the stand-in dies at its 3rd batch
    assert main_cache([*vllm_argv(setup, out), "--dtype", "bf16"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: the vLLM extractor failed while extracting: exited with status 3")
    assert f"python: {sys.executable}" in err
    Path(err.rsplit("log: ", 1)[1].rstrip(")")).unlink()  # kept for the user
    assert list(out.glob("shard-*.safetensors")) and not (out / "manifest.json").exists()
    monkeypatch.delenv("FAKE_DIE_AT")
    assert main_cache([*vllm_argv(setup, out), "--dtype", "bf16"]) == 0
    cache = HiddenStateCache(out)
    assert cache.manifest["target"]["compute_dtype"] == "bfloat16"
    assert cache.manifest["num_samples"] == len(make_samples())
    hidden = cache.manifest["hidden_size"]
    for i in range(len(cache)):
        item = cache[i]
        for layer in cache.layers:
            want = synthetic(item["input_ids"], layer, hidden).to(torch.bfloat16)
            assert torch.equal(item["hidden_states"][layer], want), (i, layer)


def test_extractor_start_failure_is_one_line(setup, fake_script, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL_START", "1")
    assert main_cache(vllm_argv(setup, tmp_path / "v")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        "error: the vLLM extractor failed while starting: RuntimeError: engine boom"
    )
    log = Path(err.rsplit("log: ", 1)[1].rstrip(")\n"))
    assert "engine boom" in log.read_text()  # the traceback is kept for the user
    log.unlink()
    assert not (tmp_path / "v").exists()  # nothing written before the engine is up


def test_vllm_backend_usage_errors(setup, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(vllm_backend.VLLM_PYTHON_ENV, raising=False)
    t, d, out = setup["target"], setup["data"], tmp_path / "v"
    vllm = ["--backend", "vllm", "--vllm-python", sys.executable]
    # Settings that do not go with the vLLM backend: the config error names each field.
    capsys.readouterr()
    bad = [*vllm, "--device-map", "auto", "--threads", "1", "--vllm-engine-args", "[1]"]
    assert main_cache([*base_argv(t, d, out), *bad]) == 2
    err = capsys.readouterr().err
    assert "3 problems" in err
    for field in ("device_map: is for --backend hf", "threads: is for", "vllm_engine_args:"):
        assert field in err, err
    # One-line errors naming the setting.
    cases = {
        "vllm_python: no python at /nonexistent/python": [
            "--backend", "vllm", "--vllm-python", "/nonexistent/python",
        ],
    }  # fmt: skip
    if importlib.util.find_spec("vllm") is None:  # draftsmith's own venv has none
        cases["vllm_python: --backend vllm runs vLLM from its own environment"] = [
            "--backend",
            "vllm",
        ]
        # The real extractor in this venv: it starts, and fails importing vllm.
        cases[f"vllm_python: {sys.executable} has no vllm"] = vllm
    for expected, extra in cases.items():
        assert main_cache([*base_argv(t, d, out), *extra]) == 2, expected
        err = capsys.readouterr().err
        assert err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# The real thing (vLLM venv, SmolLM2-135M-Instruct)

VLLM_PYTHON = default_vllm_python()
REAL_TARGET = Path(
    os.path.expanduser(
        os.environ.get("DRAFTSMITH_TARGET_DIR", "~/.cache/draftsmith/targets/smollm2-135m-instruct")
    )
)
CONVERSATIONS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Write a haiku about rain.", "Soft rain on the roof,\nthe garden drinks in silence,\nclouds"),
    ("Add 17 and 25.", "17 + 25 = 42."),
    ("Name three primary colors.", "Red, yellow and blue are the three primary colors."),
]
# vLLM's CPU kernels (oneDNN GEMMs, its own attention and fused add+RMSNorm) against PyTorch's:
# the same fp32 maths summed in another order. Measured on this machine: see docs/scaling.md.
REL_TOL = 1e-4  # max |vLLM - HF| / max |HF| per sample and layer
COS_TOL = 0.99999  # per-token cosine similarity, minimum


@pytest.mark.vllm
def test_vllm_features_match_hf_on_the_real_target(tmp_path):
    if not VLLM_PYTHON.exists():
        missing(f"no vLLM venv python at {VLLM_PYTHON}")
    if not (REAL_TARGET / "config.json").is_file():
        missing(f"real target not prepared at {REAL_TARGET}")
    from draftsmith.train.data.chat import tokenize_conversation
    from draftsmith.train.target_model.load import load_tokenizer

    tok = load_tokenizer(REAL_TARGET)
    rows = []
    for i, (user, answer) in enumerate(CONVERSATIONS):
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        rows.append({**tokenize_conversation(tok, msgs, max_length=None), "id": f"c{i}"})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # 0 = embeddings, 30 = final normed output (vLLM's aux 30 is pre-norm: the worker extension
    # swaps in the model's output), unsorted to check the order mapping.
    common = [
        "--data", str(data), "--target", str(REAL_TARGET), "--layers", "30", "0", "2", "15",
        "27", "--dtype", "fp32", "--target-dtype", "fp32", "--no-progress",
    ]  # fmt: skip
    assert main_cache([*common, "--out", str(tmp_path / "hf")]) == 0
    with open("/tmp/vllm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one vLLM process per machine
        argv = [*common, "--out", str(tmp_path / "vllm"), "--backend", "vllm"]
        assert main_cache([*argv, "--vllm-python", str(VLLM_PYTHON)]) == 0
    hf, vl = HiddenStateCache(tmp_path / "hf"), HiddenStateCache(tmp_path / "vllm")
    assert vl.manifest["backend"]["name"] == "vllm"
    assert vl.manifest["backend"]["versions"]["vllm"]
    assert vl.manifest["target"]["hash"] == hf.manifest["target"]["hash"]
    worst: dict[int, tuple[float, float]] = {}
    for i in range(len(hf)):
        a, b = hf[i], vl[i]
        assert torch.equal(a["input_ids"], b["input_ids"])
        for layer in hf.layers:
            x, y = a["hidden_states"][layer].float(), b["hidden_states"][layer].float()
            rel = float((x - y).abs().max() / x.abs().max())
            cos = float(torch.nn.functional.cosine_similarity(x, y, dim=-1).min())
            r0, c0 = worst.get(layer, (0.0, 1.0))
            worst[layer] = (max(r0, rel), min(c0, cos))
    print("worst per layer (relative max error, min cosine):", worst)
    for layer, (rel, cos) in worst.items():
        assert rel <= REL_TOL and cos >= COS_TOL, (layer, rel, cos)
