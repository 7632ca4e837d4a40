"""The family declaration (heads/families.py): every name in it resolves, and every list of
families (the CLI's recipes, evaluate's kinds, cache presets, export formats, vLLM serving, the
bench's family column) is read from it."""

from __future__ import annotations

import inspect
import json
from dataclasses import is_dataclass

import pytest

from draftsmith.heads import families, registry
from draftsmith.heads.base import DrafterKind
from draftsmith.heads.families import FAMILIES, RECIPES, Family, Kind, resolve


def test_every_name_in_the_declaration_resolves() -> None:
    for family in FAMILIES.values():
        for kind in family.kinds:
            assert isinstance(resolve(kind.builder), DrafterKind), kind
        for fmt in family.exports:
            writer = resolve(fmt.writer)
            assert list(inspect.signature(writer).parameters) == ["request"], fmt.name
        if family.recipe is not None:
            assert family.recipe in RECIPES, family.name
    for recipe in RECIPES.values():
        assert callable(resolve(f"{recipe.module}:main")), recipe.name
        assert is_dataclass(resolve(f"{recipe.module}:{recipe.config}")), recipe.name


def test_names_are_unique_and_a_shared_kind_is_told_apart_by_the_checkpoint() -> None:
    formats = [fmt.name for f in FAMILIES.values() for fmt in f.exports]
    assert len(formats) == len(set(formats))
    for name in families.kinds():
        owners = families.families_of_kind(name)
        assert owners, name
        if len(owners) > 1:  # EAGLE-1 and EAGLE-3 share `eagle`: a discriminator must decide
            marks = [f.checkpoint for f in owners]
            assert all(marks) and len(set(marks)) == len(marks), name
            assert (
                len({(k.shape, k.builder) for f in owners for k in f.kinds if k.name == name}) == 1
            )


def test_evaluate_kinds_are_the_declared_kinds() -> None:
    assert set(registry.DRAFTERS) == {*families.kinds(), families.PLAIN_KIND}
    assert registry.spec_problem("eagle=x") is None
    assert "kind must be one of" in (registry.spec_problem("hydra") or "")


def test_family_of_reads_the_eagle_version_from_the_checkpoint(tmp_path) -> None:
    for version in (1, 3):
        path = tmp_path / f"v{version}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"version": version}))
        assert families.family_of("eagle", str(path)).name == f"eagle{version}"
        assert families.family_of("eagle-tree", str(path)).name == f"eagle{version}"
    assert families.family_of("eagle", str(tmp_path / "missing")) is None
    assert families.family_of("medusa").name == "medusa"
    assert families.family_of("hf-prompt-lookup").name == "ngram"
    assert families.family_of("none") is None


def test_the_layer_rule_is_written_once() -> None:
    """The EAGLE config's default layers and the cache presets come from the same rule."""
    from types import SimpleNamespace

    from draftsmith.heads.eagle_config import EagleConfig

    target = SimpleNamespace(
        num_hidden_layers=30,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )
    for version in (1, 3):
        cfg = EagleConfig.from_target(target, version)
        family = FAMILIES[f"eagle{version}"]
        assert cfg.feature_layers == family.feature_layers(30)
        assert set(cfg.feature_layers) <= set(families.cache_layers(family.name, 30))
    assert families.cache_layers("eagle3", 30) == [2, 15, 27, 30]
    assert list(families.cache_presets()) == ["eagle3", "eagle1", "peagle", "dflash", "medusa"]
    assert (
        families.cache_layers("peagle", 30)
        == families.cache_layers("dflash", 30)
        == [2, 15, 27, 30]
    )


def test_every_consumer_reads_the_declaration(monkeypatch) -> None:
    """The CLI's recipes, the export CLI's formats, the cache presets and the served plans are
    the declaration's, and a new entry shows up where it should (read at call time)."""
    from draftsmith.recipes import cli
    from draftsmith.train.export import command
    from draftsmith.train.features.cache_command import CacheConfig

    assert cli.TRAIN_RECIPES is RECIPES
    assert set(cli.COMMAND_CONFIGS["train"]) == set(RECIPES)
    assert tuple(families.export_formats()) == command.FORMATS
    choices = {f.name: f.metadata.get("choices") for f in CacheConfig.__dataclass_fields__.values()}
    assert list(choices["preset"]) == list(families.cache_presets())

    toy = Family(
        "toy",
        "Toy",
        kinds=(Kind("toy", "heads.ngram:NGRAM"),),
        feature_layers=lambda n: (n - 1,),
        served_method="toy-method",
    )
    monkeypatch.setitem(FAMILIES, "toy", toy)
    assert "toy" in families.kinds()
    assert families.cache_layers("toy", 10) == [9, 10]
    assert families.vllm_serving("toy", None) == (None, "toy-method")


@pytest.mark.parametrize(
    ("spec_kind", "config", "expected"),
    [
        ("ngram", None, (None, "ngram")),
        ("medusa", None, ("medusa-vllm", "medusa")),
        ("eagle", {"version": 3}, ("speculators", "eagle3")),
        ("eagle", {"version": 1}, ("eagle", "eagle")),
        ("draft-lm", None, ("hf", "draft_model")),
    ],
)
def test_vllm_serving_follows_the_family(tmp_path, spec_kind, config, expected) -> None:
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert families.vllm_serving(spec_kind, str(tmp_path)) == expected


@pytest.mark.parametrize(
    ("spec_kind", "path", "reason"),
    [
        ("eagle-tree", "x", "the bench serves chains"),
        ("hf-assisted", None, "transformers' own loop"),
        ("suffix", None, "arctic-inference"),
        ("draft-lm", None, "an unsaved drafter cannot be served"),
        ("eagle", "/nonexistent", "cannot tell the family"),
    ],
)
def test_vllm_serving_says_why_not(spec_kind, path, reason) -> None:
    plan = families.vllm_serving(spec_kind, path)
    assert isinstance(plan, str) and reason in plan
