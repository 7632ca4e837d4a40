"""Loading the target under FSDP shard by shard (issue 50, finding 4).

Each process builds the target's decoder layers on the meta device, shards them and reads only
its own rows of each weight from the safetensors files; the embedding, final norm and head are
read whole. A machine then holds about one copy of the target instead of one per process, and
the processes wait for each other after loading with their own time-out
(``load_timeout_minutes``), named in the error when it fires.

The 2-process tests launch ``tests/fsdp_load_worker.py`` with ``accelerate launch`` and
``recipes/accelerate/fsdp_cpu_2proc.yaml``, as the recipes are launched; training under FSDP
with this loading (losses equal DDP's, resume) is ``tests/test_fsdp.py`` and the Medusa and
distill recipe tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.train.core.config import TrainConfig
from draftsmith.train.core.dist import materialize_meta
from draftsmith.train.core.run import TrainRun
from draftsmith.train.target_model.load import (
    fill_target_shards,
    load_target,
    load_target_meta,
)
from draftsmith.train.target_model.sharded import NotShardable, SafetensorsWeights
from tests.conftest import byte_tokenizer, tiny_llama, tiny_model_dir
from tests.test_eagle_recipe import REPO, _free_port

FSDP_CONFIG = REPO / "recipes/accelerate/fsdp_cpu_2proc.yaml"
WORKER = REPO / "tests/fsdp_load_worker.py"


# --- the row reader ---------------------------------------------------------------------------


def test_reader_reads_the_rows_safe_open_reads(tmp_path):
    """Rows of every dtype and shape (0-d, 1-d, empty slices), read straight into a tensor of
    the file's dtype or converted into another, equal what safetensors' own reader gives."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w_f32": torch.randn(7, 5, generator=g),
        "w_bf16": torch.randn(9, 3, 2, generator=g).to(torch.bfloat16),
        "w_f16": torch.randn(4, 6, generator=g).to(torch.float16),
        "norm": torch.randn(11, generator=g),
        "ids": torch.arange(10, dtype=torch.int64),
        "mask": torch.rand(5, 2, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    weights = SafetensorsWeights.of_dir(tmp_path)
    assert sorted(weights.names()) == sorted(tensors)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        for name, full in tensors.items():
            n = full.shape[0] if full.dim() else 1
            cuts = [None] if full.dim() == 0 else [None, slice(0, n), slice(1, n - 1), slice(n, n)]
            for rows in cuts:
                want = f.get_tensor(name) if rows is None else f.get_slice(name)[rows]
                same = torch.empty_like(want)
                weights.read_into(name, same, rows)
                assert torch.equal(same, want), (name, rows)
                if full.is_floating_point():  # converted on the way: what .to() gives
                    other = torch.float64 if full.dtype != torch.float64 else torch.float32
                    conv = torch.empty(want.shape, dtype=other)
                    weights.read_into(name, conv, rows)
                    assert torch.equal(conv, want.to(other)), (name, rows)
    with pytest.raises(ValueError, match="reading shape"):
        weights.read_into("w_f32", torch.empty(3, 5), slice(0, 2))


def test_reader_indexes_sharded_files_and_refuses_pickles(tmp_path):
    """A model saved in several files (an index) is read across them; a directory with only a
    pickled ``pytorch_model.bin`` cannot be read by rows."""
    model = tiny_llama(layers=2)
    model.save_pretrained(tmp_path / "split", max_shard_size="20KB")
    assert len(list((tmp_path / "split").glob("*.safetensors"))) > 2
    weights = SafetensorsWeights.of_dir(tmp_path / "split")
    for name, value in model.state_dict().items():
        got = torch.empty_like(value)
        weights.read_into(name, got)
        assert torch.equal(got, value), name
    (tmp_path / "pickled").mkdir()
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(NotShardable, match="no safetensors weights"):
        SafetensorsWeights.of_dir(tmp_path / "pickled")


# --- meta loading, one process ------------------------------------------------------------------


def _model_dir(path: Path, *, tied: bool, shards: bool) -> Path:
    tok = byte_tokenizer()
    model = tiny_llama(vocab_size=len(tok), layers=3, seed=1, init_std=0.1)
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, 7]
    model.save_pretrained(path, max_shard_size="40KB" if shards else "5GB")
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("tied", "shards", "dtype"),
    [(False, False, torch.float32), (True, True, torch.bfloat16), (False, True, torch.bfloat16)],
)
def test_meta_load_then_fill_equals_load_target(tmp_path, tied, shards, dtype):
    """``load_target_meta`` leaves the decoder layers on the meta device and reads the rest;
    made real and filled, the model is ``load_target``'s: class, config, generation config,
    every weight and buffer (dtype and value), tied weights tied, frozen, the same logits.
    (fp32 files read as fp32 or converted to bf16; one file or several with an index.)"""
    path = _model_dir(tmp_path / "target", tied=tied, shards=shards)
    ref, ref_tok = load_target(path, dtype=dtype)
    model, tok = load_target_meta(path, dtype=dtype)
    assert type(model) is type(ref) and tok.get_vocab() == ref_tok.get_vocab()
    layers = model.model.layers
    assert all(p.is_meta for p in layers.parameters())
    assert not any(p.is_meta for n, p in model.named_parameters() if ".layers." not in n)
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    empty = materialize_meta(model, torch.device("cpu"))
    assert empty == [n for n, _ in model.named_parameters() if ".layers." in n]
    assert fill_target_shards(model, empty) > 0
    assert model.config.to_dict() == ref.config.to_dict()
    assert model.generation_config.to_dict() == ref.generation_config.to_dict()
    assert model.config.name_or_path == ref.config.name_or_path == str(path)
    mine, theirs = model.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        assert mine[name].dtype == value.dtype and torch.equal(mine[name], value), name
    assert [(n, b.dtype) for n, b in model.named_buffers()] == [
        (n, b.dtype) for n, b in ref.named_buffers()
    ]
    for (name, a), (_, b) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    ids = torch.arange(20).reshape(2, 10)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_meta_load_whole_layers_and_refusals(tmp_path):
    """``whole_layers`` are read whole at once (a pruned draft copies them); a checkpoint
    missing a weight, or with another shape, cannot be read shard by shard (NotShardable,
    naming the tensor): the caller loads it whole instead."""
    path = tiny_model_dir(tmp_path / "target", layers=3)
    ref, _ = load_target(path)
    model, _ = load_target_meta(path, whole_layers=[2])
    assert all(p.is_meta for p in model.model.layers[0].parameters())
    for name, p in model.model.layers[2].named_parameters():
        assert torch.equal(p, ref.model.layers[2].get_parameter(name)), name

    from safetensors.torch import load_file

    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NotShardable, match=r"no tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_target_meta(path)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NotShardable, match=r"up_proj\.weight is \(3, 3\) in its files"):
        load_target_meta(path)


def _fsdp_env(monkeypatch) -> None:
    """One process in a gloo group of one, with the variables ``accelerate launch`` sets for an
    FSDP config (as tests/test_fsdp.py does for Medusa-2)."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env |= {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "OMP_NUM_THREADS": "1"}
    env |= {"FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_train_run_loads_sharded_or_falls_back_with_a_note(tmp_path, monkeypatch, capsys):
    """Under an FSDP launch ``TrainRun.load_target`` builds the decoder layers on the meta
    device and ``place_target`` shards and fills them (here one process: its shard is all);
    a target without safetensors files is loaded whole as before, with one note line."""
    path = tiny_model_dir(tmp_path / "target")
    ref, _ = load_target(path)
    pickled = tmp_path / "pickled"
    shutil.copytree(path, pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(ref.state_dict(), pickled / "pytorch_model.bin")
    _fsdp_env(monkeypatch)
    cfg = TrainConfig(output_dir=tmp_path / "run", device="cpu")
    ids = torch.arange(20).reshape(2, 10)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    with TrainRun(cfg, recipe="eagle", kind="eagle3", outputs=["drafter"], fsdp=True) as run:
        assert run.fsdp
        target, _ = run.load_target(str(path))
        assert all(p.is_meta for p in target.model.layers.parameters())
        target = run.place_target(target)
        assert type(target.model.layers[0].mlp.up_proj.weight).__name__ == "DTensor"
        with torch.no_grad():
            assert torch.equal(target(input_ids=ids).logits, want)
        assert "note:" not in capsys.readouterr().out

        whole, _ = run.load_target(str(pickled))
        out = capsys.readouterr().out
        assert not any(p.is_meta for p in whole.parameters())
        notes = [line for line in out.splitlines() if line.startswith("note:")]
        assert notes == [
            "note: every process loads the whole target before sharding it "
            f"({pickled} has no safetensors weights (only pickled .bin files))"
        ]
        whole = run.place_target(whole)
        with torch.no_grad():
            assert torch.equal(whole(input_ids=ids).logits, want)
    assert not torch.distributed.is_initialized()


# --- 2 processes --------------------------------------------------------------------------------


def _launch(out: Path, target: Path, mode: str, **env: str) -> subprocess.CompletedProcess:
    """The worker on 2 CPU processes under the FSDP accelerate config (one thread each)."""
    command = [
        shutil.which("accelerate") or "accelerate",
        "launch",
        "--config_file",
        str(FSDP_CONFIG),
        "--main_process_port",
        str(_free_port()),
        str(WORKER),
        str(out),
        str(target),
        mode,
    ]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=environ)


@pytest.fixture(scope="module")
def big_target_dir(tmp_path_factory) -> Path:
    """A random Llama of ~220 MB in fp32 (24 layers of width 512), built on the fly. The MLP
    width 1001 is odd: its weights split 501/500 rows over 2 ranks (the last rank fewer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("big_target")
    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=512,
        intermediate_size=1001,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _rank_results(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.integration
def test_two_ranks_read_their_own_rows_and_hold_one_copy(tmp_path, big_target_dir):
    """2 CPU processes under FSDP: each rank's shards are exactly its rows of the saved weights
    (501/500 of an odd dimension), embedding and head whole, rotary buffers as the model makes
    them, the sharded forward gives the unsharded target's logits -- and the two processes
    together grew by about ONE copy of the target while loading, where every rank loading the
    whole target first (the path before, run here for comparison) grows each by a copy."""
    proc = _launch(tmp_path / "sharded", big_target_dir, "sharded")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = _rank_results(tmp_path / "sharded")

    full, _ = load_target(big_target_dir)
    state = dict(full.named_parameters())
    one_copy = sum(p.numel() * p.element_size() for p in full.parameters())
    outside = sum(p.numel() * p.element_size() for n, p in state.items() if ".layers." not in n)
    assert one_copy > 200e6 and outside < 0.01 * one_copy
    ids = torch.arange(24).reshape(2, 12) % full.config.vocab_size
    with torch.no_grad():
        logits = full(input_ids=ids).logits
    uneven = "model.layers.0.mlp.up_proj.weight"
    assert [r["tensors"][uneven][0] for r in ranks] == [(0, 501), (501, 1001)]
    for rank, got in enumerate(ranks):
        assert got["tensors"].keys() == state.keys()
        for name, (rows, local) in got["tensors"].items():
            want = state[name] if rows is None else state[name][rows[0] : rows[1]]
            assert (rows is None) == (".layers." not in name and name != "model.norm.weight")
            assert torch.equal(local, want), (rank, name)
        for name, buffer in full.named_buffers():
            assert torch.equal(got["buffers"][name], buffer), name
        torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)
        assert got["name_or_path"] == str(big_target_dir)
        # Held tensors: after load_target only what lies outside the layers (whole, ~0.4 MB);
        # after placing, that plus this rank's shards.
        assert got["held_after_load"] <= outside
    held = sum(max(r["held_after_load"], r["held_after_place"]) for r in ranks)
    norm = full.model.norm.weight.numel() * full.model.norm.weight.element_size()
    assert held == one_copy + (outside - norm)  # the embedding and head once more, no more

    # Resident memory: the peak grew by about one copy in both processes together.
    growth = [1024 * (r["peak_kib_after"] - r["peak_kib_before"]) for r in ranks]
    assert sum(growth) < 1.25 * one_copy, (growth, one_copy)
    assert all(g < 0.7 * one_copy for g in growth), (growth, one_copy)

    # The path before: every rank loads the whole target, then shards it.
    proc = _launch(tmp_path / "whole", big_target_dir, "whole")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    before = _rank_results(tmp_path / "whole")
    assert [r["held_after_load"] for r in before] == [one_copy, one_copy]
    growth_before = [1024 * (r["peak_kib_after"] - r["peak_kib_before"]) for r in before]
    assert all(g > 0.95 * one_copy for g in growth_before), (growth_before, one_copy)


@pytest.mark.integration
def test_a_late_rank_ends_the_run_naming_load_timeout_minutes(tmp_path, tiny_target_dir):
    """Rank 1 sleeps 10 s before it places the target; with load_timeout_minutes 0.02 (1.2 s)
    rank 0 stops waiting at the load barrier and the run ends with one error line naming the
    phase, the late rank and the setting to raise (not a collective time-out 10 minutes on);
    rank 1, arriving later, says the others stopped waiting for it."""
    env = {"SLEEP_RANK": "1", "SLEEP_S": "10", "LOAD_TIMEOUT_MINUTES": "0.02"}
    proc = _launch(tmp_path / "late", tiny_target_dir, "sharded", **env)
    assert proc.returncode != 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert (
        "error: loading the target: rank(s) 1 of 2 had not finished after this rank (0) "
        "waited 0.02 minutes (load_timeout_minutes); raise load_timeout_minutes if that rank "
        "is only slower (a slower disk), else see its own error"
    ) in errors, proc.stderr[-3000:]
    # The late rank, when it arrives (the launcher lets it finish: it has a 30 s grace period).
    assert (
        "error: loading the target: this rank (1) finished after the others had waited "
        "load_timeout_minutes (0.02 minutes) for it; raise load_timeout_minutes if it is only "
        "slower"
    ) in errors, proc.stderr[-3000:]
    assert not (tmp_path / "late" / "rank0.pt").exists()
