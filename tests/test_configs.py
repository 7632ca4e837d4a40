"""Every shipped YAML config loads into its recipe's config class without a problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.recipes.distill import DistillConfig
from draftsmith.recipes.eagle import EagleTrainConfig
from draftsmith.recipes.evaluate import EvalConfig
from draftsmith.recipes.medusa import MedusaConfig
from draftsmith.train.config import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"
CLASSES = {
    "evaluate": EvalConfig,
    "eagle": EagleTrainConfig,
    "medusa": MedusaConfig,
    "distill": DistillConfig,
}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_config_loads(path):
    recipe = next((name for name in CLASSES if path.stem.startswith(name)), None)
    assert recipe is not None, f"{path.name}: no config class registered for it in this test"
    cfg = load_config(CLASSES[recipe], path)
    assert cfg is not None
