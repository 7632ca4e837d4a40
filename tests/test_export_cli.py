"""`draftsmith export`: every format goes through the one command and reloads identically."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.heads.eagle import EagleConfig, build_drafter, save_drafter
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.recipes.cli import main as cli
from draftsmith.train.data.vocab import draft_vocab as draft_vocab_maps
from draftsmith.train.export import eagle as export_eagle
from draftsmith.train.export.hf import save_draft
from draftsmith.train.export.medusa import load_medusa_export
from draftsmith.train.objectives.draft_init import pruned_draft
from draftsmith.train.target_model.load import load_target


@pytest.fixture
def tiny(tiny_target_dir):
    target, tok = load_target(str(tiny_target_dir))
    return tiny_target_dir, target, tok


def _export(*args) -> int:
    return cli(["export", *map(str, args)])


@pytest.mark.parametrize(("fmt", "version"), [("speculators", 3), ("eagle3", 3), ("eagle", 1)])
def test_eagle_formats_round_trip(tmp_path, tiny, fmt, version):
    target_dir, target, _ = tiny
    cfg = EagleConfig.from_target(
        target.config, version, feature_layers=[1, 2, 3] if version == 3 else None
    )
    drafter = build_drafter(target, cfg, seed=1, init_std=0.2)
    src = save_drafter(drafter, tmp_path / "drafter")
    out = tmp_path / fmt
    assert _export("--format", fmt, "--checkpoint", src, "--out", out, "--target", target_dir) == 0
    back = export_eagle.load_export(out, target)
    ids = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    width = 3 * cfg.hidden_size if version == 3 else cfg.hidden_size
    feats = torch.randn(1, 5, width, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(5)[None]
    with torch.no_grad():
        a = drafter(drafter.embed(ids), feats, pos, return_logits=True)[1]
        b = back(back.embed(ids), feats, pos, return_logits=True)[1]
    assert torch.equal(a, b)
    assert (out / "README.md").is_file()
    # A second export to the same place needs --overwrite (exit 2 names the problem).
    assert _export("--format", fmt, "--checkpoint", src, "--out", out, "--target", target_dir) == 2


@pytest.mark.parametrize("draft_vocab", [False, True], ids=["full", "draft-vocab"])
@pytest.mark.parametrize("fmt", ["medusa-vllm", "medusa"])
def test_medusa_formats_round_trip(tmp_path, tiny, fmt, draft_vocab):
    target_dir, target, _ = tiny
    d2t = t2d = None
    if draft_vocab:  # 40 of the tiny target's tokens; written as full-vocabulary heads
        counts = torch.randint(0, 100, (target.config.vocab_size,), generator=torch.Generator())
        d2t, t2d = draft_vocab_maps(counts, 40)
    heads = MedusaHeads.from_target(target, 2, 1, d2t=d2t, t2d=t2d)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    heads.save(tmp_path / "heads", extra={"target_name_or_path": str(target_dir)})
    out = tmp_path / fmt
    assert (
        _export(
            "--format",
            fmt,
            "--checkpoint",
            tmp_path / "heads",
            "--out",
            out,
            "--target",
            target_dir,
        )
        == 0
    )
    back = load_medusa_export(out)
    h = torch.randn(4, target.config.hidden_size)
    if not draft_vocab:
        assert torch.equal(back(h), heads(h))
        return
    full, ours = back(h), heads(h)
    assert full.shape[-1] == target.config.vocab_size and ours.shape[-1] == 40
    assert torch.equal(full[..., heads.vocab_ids()], ours)
    assert torch.equal(full.argmax(-1), heads.target_ids(ours.argmax(-1)))


def test_hf_format_round_trip(tmp_path, tiny):
    from transformers import AutoModelForCausalLM

    target_dir, target, tok = tiny
    draft = pruned_draft(target, [0, 3]).eval()
    save_draft(draft, tok, tmp_path / "run" / "draft", info={"target": str(target_dir)})
    out = tmp_path / "hf"
    assert _export("--format", "hf", "--checkpoint", tmp_path / "run" / "draft", "--out", out) == 0
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, draft(ids).logits)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def test_bad_arguments_are_named(tmp_path, capsys):
    assert (
        _export(
            "--format",
            "speculators",
            "--checkpoint",
            tmp_path / "nope",
            "--out",
            tmp_path / "o",
            "--speculative-tokens",
            "0",
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "checkpoint" in err and "speculative_tokens" in err
