"""``scripts/bench_tree_shapes.py``: several chain and tree shapes of one drafter, one baseline.

Runs the script on a tiny target and an untrained EAGLE-3 drafter, in two shards, merges them,
and checks the merged figures are the sums of the shards'; bad ``--shapes`` entries are one-line
errors naming the entry.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "bench_tree_shapes", ROOT / "scripts" / "bench_tree_shapes.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_shapes_parse_and_bad_ones_are_named():
    script = _script()
    assert script.parse_shape("chain:2") == {"kind": "chain", "k": 2, "dtype": None}
    assert script.parse_shape("tree:3:4:8@bfloat16") == {
        "kind": "tree",
        "k": 3,
        "topk": 4,
        "nodes": 8,
        "dtype": "bfloat16",
    }
    for bad in ("tree:3:4", "chain:x", "tree:0:4:8", "star:2", "chain:2@fp8"):
        with pytest.raises(ValueError, match="--shapes"):
            script.parse_shape(bad)


def test_shards_run_and_merge(tmp_path):
    from draftsmith.heads.eagle import EagleConfig, build_drafter, save_drafter
    from draftsmith.train.target_model.load import load_target

    script = _script()
    target_dir = tiny_model_dir(tmp_path / "target")
    target, _ = load_target(str(target_dir))
    save_drafter(
        build_drafter(target, EagleConfig.from_target(target.config, 3), seed=0),
        tmp_path / "drafter",
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ("Name a colour.", "Count to three."))
    )
    shapes = ["chain:2", "tree:2:2:3", "tree:2:2:3@bfloat16"]
    common = [
        "--drafter",
        str(tmp_path / "drafter"),
        "--target",
        str(target_dir),
        "--prompts",
        str(prompts),
        "--split",
        "all",
        "--limit",
        "2",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0.7",
        "--shapes",
        *shapes,
    ]
    parts = []
    for i in range(2):
        out = tmp_path / f"s{i}.json"
        assert script.main([*common, "--shard", f"{i}/2", "--out", str(out)]) == 0
        parts.append(json.loads(out.read_text()))
    merged_path = tmp_path / "all.json"
    assert script.merge([str(tmp_path / "s0.json"), str(tmp_path / "s1.json")], merged_path) == 0
    merged = json.loads(merged_path.read_text())
    assert list(merged["results"]) == ["plain", *shapes]
    for name in merged["results"]:
        for key in ("tokens", "target_forwards", "prompts"):
            assert merged["counters"][name][key] == sum(p["counters"][name][key] for p in parts)
    assert merged["counters"]["plain"]["prompts"] == 2
    assert merged["results"]["plain"]["tau"] == 1.0
    assert merged["results"]["plain"]["speedup"] == pytest.approx(1.0)
    for name in shapes:
        r = merged["results"][name]
        assert 1.0 <= r["tau"] <= 3.0
        assert len(r["alpha"]) == 2
    assert "run_info" in merged and "command" in merged
