"""The training recipes' input pipeline end to end (issue 50, item 5): length-grouped batches
pad less than random ones, a run with grouping and a DataLoader worker resumes exactly, and
``scripts/bench_input_pipeline.py`` runs (on a tiny width)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from draftsmith.recipes.eagle import main as eagle
from tests.test_eagle_recipe import WORDS, base_args

ROOT = Path(__file__).resolve().parents[1]


def mixed_records(path: Path, n: int = 26) -> Path:
    """Chat records whose answers run from 1 to ~40 words: lengths of a long-tailed mix."""
    with open(path, "w") as f:
        for i in range(n):
            words = 1 + (i * 7) % 13 if i % 5 else 30 + i % 11  # mostly short, every 5th long
            answer = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))
            f.write(json.dumps({"id": i, "instruction": f"say {i}", "output": answer}) + "\n")
    return path


def args(tmp_path, target_dir, group_by_length: bool = True, **over) -> list[str]:
    values = {
        "data": mixed_records(tmp_path / "mixed.jsonl"),
        "split": "all",
        "max_length": 256,
        "eval_every": 0,
        "save_every": 0,
        "log_every": 1,
        "val_samples": 2,
    }
    values.update(over)
    group = "--group-by-length" if group_by_length else "--no-group-by-length"
    return [*base_args(tmp_path, target_dir, 1, **values), group, "--no-progress"]


@pytest.fixture
def recorded(monkeypatch):
    """The training batches the EAGLE-1 loss sees: ``(ids, real tokens, padded positions)``."""
    import draftsmith.train.objectives.eagle_ttt as ttt

    seen: list[tuple[list[str], int, int]] = []
    real = ttt.eagle1_loss

    def recording_loss(drafter, batch, *a, **kw):
        if drafter.training:
            mask = batch["attention_mask"]
            seen.append((list(batch["ids"]), int(mask.sum()), mask.numel()))
        return real(drafter, batch, *a, **kw)

    monkeypatch.setattr(ttt, "eagle1_loss", recording_loss)
    return seen


def padding(seen) -> float:
    return 1 - sum(s[1] for s in seen) / sum(s[2] for s in seen)


def test_grouped_batches_pad_less_than_random_ones_in_the_recipe(
    tmp_path, tiny_target_dir, recorded
):
    """One epoch, batch 4, samples of mixed lengths: group_by_length trains on the same samples
    with a fraction of the padding of random batches."""
    common = {"max_steps": "None", "epochs": 1, "batch_size": 4, "grad_accum": 1}
    shares = {}
    for grouped in (False, True):
        recorded.clear()
        out = tmp_path / f"run_{grouped}"
        argv = args(tmp_path, tiny_target_dir, output_dir=out, group_by_length=grouped, **common)
        assert eagle(argv) == 0
        shares[grouped] = padding(recorded)
        ids = sorted(i for batch, _, _ in recorded for i in batch)
        assert len(ids) == len(set(ids)) == 24  # every training sample once
    assert shares[False] > 0.3
    assert shares[True] < 0.5 * shares[False]


def test_resume_with_grouping_and_a_worker_sees_the_unbroken_runs_batches(
    tmp_path, tiny_target_dir, recorded
):
    """group_by_length and one DataLoader worker, 3 epochs of 24 samples, batch 2, grad_accum 3
    (12 micro-batches an epoch): paused mid-epoch (step 6) and resumed, the run trains on the
    same batches in the same order as an unbroken one, every sample once an epoch."""
    common = {
        "max_steps": "None",
        "epochs": 3,
        "grad_accum": 3,
        "batch_size": 2,
        "num_workers": 1,
    }
    assert eagle(args(tmp_path, tiny_target_dir, **common)) == 0
    straight = [batch for batch, _, _ in recorded]
    flat = [i for batch in straight for i in batch]
    epochs = [flat[e * 24 : (e + 1) * 24] for e in range(3)]
    assert len(flat) == 72 and all(sorted(e) == sorted(epochs[0]) for e in epochs)
    assert len(set(epochs[0])) == 24
    assert straight[:12] != straight[12:24]  # another order each epoch

    recorded.clear()
    paused = args(tmp_path, tiny_target_dir, output_dir=tmp_path / "paused", **common)
    assert eagle([*paused, "--stop-after-steps", "6"]) == 0  # 18 micro-batches: mid-epoch 2
    assert eagle(paused) == 0
    assert [batch for batch, _, _ in recorded] == straight


def test_bench_input_pipeline_runs_and_reports_each_variant(tmp_path):
    """The benchmark on a tiny width: every variant's row, the same padding for the same
    batches, less padding when grouped, the run's facts."""
    spec = importlib.util.spec_from_file_location(
        "bench_input_pipeline", ROOT / "scripts" / "bench_input_pipeline.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "bench.json"
    argv = ["--samples", "30", "--hidden", "32", "--max-len", "600", "--batch-sizes", "4"]
    argv += ["--workers", "1", "--step-us-per-token", "1", "--out", str(out)]
    assert script.main(argv) == 0
    result = json.loads(out.read_text())
    rows = {(r["variant"], r["step_us_per_token"]): r for r in result["runs"]}
    names = ("before", "grouped", "workers", "after_w1")
    assert set(rows) == {(v, s) for v in names for s in (0, 1)}
    assert all(r["tokens"] == result["cache"]["tokens"] for r in result["runs"])
    pads = {v: rows[(v, 0)]["padding_share"] for v in names}
    assert pads["before"] == pads["workers"] > pads["grouped"] == pads["after_w1"]
    assert all(r["tokens_per_cpu_s"] > 0 for r in result["runs"])
    assert all(0 <= rows[(v, 1)]["wait_share"] <= 1 for v in names)
    assert result["git_commit"] and result["cpu_flags"] and "command" in result
