"""EAGLE exports (train/export/eagle*.py): name mappings, config fields, round trips, atomicity."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.heads.eagle import EagleConfig, build_drafter, save_drafter
from draftsmith.recipes.cli import main as cli
from draftsmith.train.data.vocab import draft_vocab
from draftsmith.train.export import eagle as ex
from draftsmith.train.export.command import export_target
from draftsmith.train.export.eagle_card import INFO_FILE
from draftsmith.train.export.eagle_config import export_format
from tests.conftest import tiny_llama

V, N = 64, 4  # tiny target: vocab, layers


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_llama(vocab_size=V, layers=N, seed=0, init_std=0.1)


def _drafter(
    target, version: int, *, draft_vocab_size=None, aux=None, nbr=False, eagle31=False, seed=1
):
    cfg = EagleConfig.from_target(
        target.config,
        version,
        draft_vocab_size=draft_vocab_size,
        feature_layers=aux,
        norm_before_residual=nbr,
        fc_norm=eagle31,
        norm_output=eagle31,
    )
    d2t = t2d = None
    if version == 3 and cfg.draft_vocab_size < V:
        # A non-trivial vocab map: the draft vocab is the most frequent tokens of a skewed count.
        counts = torch.arange(V, 0, -1).float().roll(7)
        d2t, t2d = draft_vocab(counts, cfg.draft_vocab_size)
    drafter = build_drafter(target, cfg, d2t, t2d, seed=seed, init_std=0.2)
    # Random norms (not ones), so a norm exported under the wrong name changes the logits.
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return drafter


def _logits(drafter, target):
    """Drafter outputs for fixed inputs: a target-feature step and an own-output step."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (1, 6), generator=g)
    h = target.config.hidden_size
    width = 3 * h if drafter.config.version == 3 else h
    feats = torch.randn(1, 6, width, generator=g)
    pos = torch.arange(6)[None]
    with torch.no_grad():
        hidden, logits = drafter(drafter.embed(ids), feats, pos, return_logits=True)
        _, logits2 = drafter(drafter.embed(ids), hidden, pos, return_logits=True)
    return drafter.target_logits(logits), drafter.target_logits(logits2)


def _save(tmp_path, drafter, name="src"):
    return save_drafter(drafter, tmp_path / name)


CASES = [
    ("speculators", 3, {"draft_vocab_size": 40}),
    ("speculators", 3, {"draft_vocab_size": 40, "nbr": True}),
    ("speculators", 3, {"draft_vocab_size": 40, "eagle31": True}),  # fc_norm + norm_output
    ("speculators", 3, {}),  # full draft vocab: no d2t/t2d in the export
    ("eagle3", 3, {"draft_vocab_size": 40}),
    ("eagle3", 3, {"draft_vocab_size": 40, "aux": [1, 2, 4]}),  # non-default layers
    ("eagle", 1, {}),
]


def _export(fmt, src, out, **kw):
    if fmt == "speculators":
        return ex.export_speculators(src, out, verifier_name_or_path="tiny/target", **kw)
    if fmt == "eagle3":
        return ex.export_eagle3(src, out, **kw)
    return ex.export_eagle(src, out, **kw)


@pytest.mark.parametrize(("fmt", "version", "kw"), CASES)
def test_round_trip_logits_exact(tmp_path, tiny_target, fmt, version, kw):
    drafter = _drafter(tiny_target, version, **kw)
    src = _save(tmp_path, drafter)
    out = _export(fmt, src, tmp_path / "export")
    assert export_format(json.loads((out / "config.json").read_text())) == fmt
    reloaded = ex.load_export(out, tiny_target)
    assert reloaded.config == drafter.config
    for a, b in zip(_logits(drafter, tiny_target), _logits(reloaded, tiny_target), strict=True):
        assert torch.equal(a, b)
    if version == 3:
        assert torch.equal(reloaded.d2t, drafter.d2t)
        assert torch.equal(reloaded.t2d, drafter.t2d)


def test_speculators_config_and_tensors(tmp_path, tiny_target):
    drafter = _drafter(tiny_target, 3, draft_vocab_size=40)
    out = ex.export_speculators(
        _save(tmp_path, drafter),
        tmp_path / "spec",
        verifier_name_or_path="org/target",
        verifier_architectures=["LlamaForCausalLM"],
        speculative_tokens=5,
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["draft_vocab_size"] == 40
    assert cfg["target_hidden_size"] == tiny_target.config.hidden_size
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, N // 2, N - 3]  # same numbering
    assert cfg["norm_before_residual"] is False
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["vocab_size"] == V  # the target vocab (speculators' target_vocab_size)
    assert layer["tie_word_embeddings"] is False
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3"
    assert spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0] == {
        "proposal_type": "greedy",
        "speculative_tokens": 5,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    assert spec["verifier"] == {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}
    assert cfg["speculators_version"]

    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(drafter.state_dict())  # speculators names == ours
    assert "embed_tokens.weight" not in tensors  # the server shares the target's
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["lm_head.weight"].shape == (40, tiny_target.config.hidden_size)
    # target id = i + d2t[i] lists exactly the t2d tokens.
    ids = torch.arange(40) + tensors["d2t"]
    assert torch.equal(ids, tensors["t2d"].nonzero().flatten())


def test_speculators_full_vocab_omits_maps(tmp_path, tiny_target):
    out = ex.export_speculators(
        _save(tmp_path, _drafter(tiny_target, 3)), tmp_path / "o", verifier_name_or_path="t"
    )
    tensors = load_file(str(out / "model.safetensors"))
    assert "d2t" not in tensors and "t2d" not in tensors


def test_eagle3_layout(tmp_path, tiny_target):
    drafter = _drafter(tiny_target, 3, draft_vocab_size=40)
    out = ex.export_eagle3(_save(tmp_path, drafter), tmp_path / "e3")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 40 and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False
    assert "eagle_config" not in cfg  # default layers: both servers pick them without it
    names = set(load_file(str(out / "model.safetensors")))
    assert not any(k.startswith("layers.") for k in names)
    assert {
        "midlayer.self_attn.q_proj.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.input_layernorm.weight",
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    } <= names


def test_eagle3_custom_layers_use_sglang_numbering(tmp_path, tiny_target):
    drafter = _drafter(tiny_target, 3, draft_vocab_size=40, aux=[1, 2, 4])
    out = ex.export_eagle3(_save(tmp_path, drafter), tmp_path / "e3")
    cfg = json.loads((out / "config.json").read_text())
    # SGLang adds 1 to these (its ids count layer outputs): outputs of layers 0, 1, 3.
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]


def test_eagle3_refuses_norm_before_residual(tmp_path, tiny_target):
    src = _save(tmp_path, _drafter(tiny_target, 3, nbr=True))
    with pytest.raises(ValueError, match="norm_before_residual"):
        ex.export_eagle3(src, tmp_path / "e3")
    assert not (tmp_path / "e3").exists()


def test_eagle1_layout(tmp_path, tiny_target):
    drafter = _drafter(tiny_target, 1)
    out = ex.export_eagle(_save(tmp_path, drafter), tmp_path / "e1")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    tensors = load_file(str(out / "model.safetensors"))
    h = tiny_target.config.hidden_size
    assert tensors["fc.weight"].shape == (h, 2 * h)
    assert "fc.bias" not in tensors
    assert "layers.0.input_layernorm.weight" not in tensors  # vLLM: Identity
    assert not {"lm_head.weight", "embed_tokens.weight", "norm.weight"} & set(tensors)


@pytest.mark.parametrize(("fmt", "version"), [("speculators", 1), ("eagle3", 1), ("eagle", 3)])
def test_wrong_version_is_refused(tmp_path, tiny_target, fmt, version):
    src = _save(tmp_path, _drafter(tiny_target, version))
    with pytest.raises(ValueError, match="EAGLE-"):
        _export(fmt, src, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_dtype_cast_keeps_vocab_maps(tmp_path, tiny_target):
    drafter = _drafter(tiny_target, 3, draft_vocab_size=40)
    out = ex.export_speculators(
        _save(tmp_path, drafter), tmp_path / "bf16", verifier_name_or_path="t", dtype="bfloat16"
    )
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["transformer_layer_config"]["torch_dtype"] == "bfloat16"
    assert cfg["transformer_layer_config"]["dtype"] == "bfloat16"
    reloaded = ex.load_export(out, tiny_target)
    assert reloaded.dtype == torch.bfloat16
    assert torch.equal(reloaded.fc.weight, drafter.fc.weight.to(torch.bfloat16))


def test_failure_mid_export_leaves_nothing(tmp_path, tiny_target, monkeypatch):
    src = _save(tmp_path, _drafter(tiny_target, 3, draft_vocab_size=40))
    out = tmp_path / "exports" / "spec"

    def boom(*a, **k):
        raise RuntimeError("disk full")

    # The weights are already written when the model card fails.
    monkeypatch.setattr(ex, "model_card", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        ex.export_speculators(src, out, verifier_name_or_path="t")
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # no temp directory left behind


def test_failed_overwrite_keeps_the_old_export(tmp_path, tiny_target, monkeypatch):
    src = _save(tmp_path, _drafter(tiny_target, 3, draft_vocab_size=40))
    out = ex.export_speculators(src, tmp_path / "spec", verifier_name_or_path="old")
    with pytest.raises(FileExistsError):
        ex.export_speculators(src, out, verifier_name_or_path="new")
    monkeypatch.setattr(ex, "model_card", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ex.export_speculators(src, out, verifier_name_or_path="new", overwrite=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "old"
    monkeypatch.undo()
    ex.export_speculators(src, out, verifier_name_or_path="new", overwrite=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec", "src"]


def test_model_card_reports_tau_or_not_measured(tmp_path, tiny_target):
    run = tmp_path / "run"
    save_drafter(_drafter(tiny_target, 3, draft_vocab_size=40), run / "drafter")
    (run / "training_metrics.json").write_text(
        json.dumps({"data": "distilled.jsonl", "steps": 12, "config": {"target": "org/t"}})
    )
    out = ex.export_speculators(run, tmp_path / "a", verifier_name_or_path="org/t")
    card = (out / "README.md").read_text()
    assert "not measured" in card and "distilled.jsonl" in card and "org/t" in card

    (run / "eval_eagle3.json").write_text(
        json.dumps(
            {
                "method": "eagle3",
                "k": 4,
                "temperature": 0.0,
                "num_prompts": 200,
                "acceptance_length": 3.456,
                "acceptance_rate_per_position": [0.9, 0.7, 0.5, 0.3],
                "speedup": 2.1,
            }
        )
    )
    out = ex.export_speculators(run, tmp_path / "b", verifier_name_or_path="org/t")
    card = (out / "README.md").read_text()
    assert "3.456" in card and "not measured" not in card and "eval_eagle3.json" in card
    info = json.loads((out / INFO_FILE).read_text())
    assert info["evaluation"]["acceptance_length"] == 3.456
    assert info["drafter_config"]["draft_vocab_size"] == 40


def test_load_export_refuses_unknown_variants(tmp_path, tiny_target):
    out = ex.export_speculators(
        _save(tmp_path, _drafter(tiny_target, 3, draft_vocab_size=40)),
        tmp_path / "s",
        verifier_name_or_path="t",
    )
    cfg = json.loads((out / "config.json").read_text())
    del cfg["norm_before_residual"]  # vLLM and speculators default it differently
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="norm_before_residual"):
        ex.load_export(out, tiny_target)
    cfg["norm_before_residual"] = False
    cfg["norm_before_fc"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="norm_before_fc"):
        ex.load_export(out, tiny_target)


def test_eagle31_config_tensors_and_sglang_refusal(tmp_path, tiny_target):
    """EAGLE-3.1: vLLM's fields and tensor names; the SGLang layout is not written for it."""
    src = _save(tmp_path, _drafter(tiny_target, 3, draft_vocab_size=40, eagle31=True))
    out = ex.export_speculators(src, tmp_path / "s", verifier_name_or_path="t")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and not cfg["norm_before_fc"]
    names = set(load_file(str(out / "model.safetensors")))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= names
    assert "README.md" in {p.name for p in out.iterdir()}
    assert "EAGLE-3.1" in (out / "README.md").read_text()
    with pytest.raises(ValueError, match=r"EAGLE-3\.1"):
        ex.export_eagle3(src, tmp_path / "sglang")


def test_cli(tmp_path, tiny_target, capsys):
    """The EAGLE formats through the one export command, ``draftsmith export``."""
    src = _save(tmp_path, _drafter(tiny_target, 1))
    argv = ["export", "--format", "eagle", "--checkpoint", str(src), "--out", str(tmp_path / "e1")]
    assert cli(argv) == 0
    assert (tmp_path / "e1" / "README.md").is_file()
    # Exists already, no --overwrite: a clear error, exit 2.
    assert cli(argv) == 2
    assert "exists" in capsys.readouterr().err
    # Without --target the speculators verifier is never missing: the target the training run
    # recorded, else the default target, as describe_target names it.
    src3 = _save(tmp_path, _drafter(tiny_target, 3), name="src3")
    out = tmp_path / "s_default"
    assert (
        cli(["export", "--format", "speculators", "--checkpoint", str(src3), "--out", str(out)])
        == 0
    )
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == export_target(None, src3)
    # --target and --speculative-tokens reach the speculators config.
    args = [
        "export",
        "--format",
        "speculators",
        "--checkpoint",
        str(src3),
        "--out",
        str(tmp_path / "s"),
        "--target",
        "org/t",
        "--speculative-tokens",
        "4",
    ]
    assert cli(args) == 0
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/t"
