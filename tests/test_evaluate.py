"""The evaluation recipe end to end on a tiny model: JSON fields, losslessness, errors."""

from __future__ import annotations

import json

import pytest

from draftsmith.recipes.evaluate import main as evaluate
from draftsmith.train.cli import main as cli


def _run(tmp_path, *args):
    out = tmp_path / "results.json"
    code = evaluate([*map(str, args), "--out", str(out)])
    return code, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.parametrize("drafter", ["ngram", "draft-lm"])
def test_evaluate_greedy_writes_results(tmp_path, tiny_target_dir, drafter):
    extra = ["--draft-layers", "0", "3"] if drafter == "draft-lm" else []
    code, res = _run(
        tmp_path,
        "--target",
        tiny_target_dir,
        "--drafter",
        drafter,
        "--k",
        3,
        "--max-new-tokens",
        24,
        "--limit",
        4,
        *extra,
    )
    assert code == 0
    for key in (
        "method",
        "k",
        "num_prompts",
        "new_tokens",
        "acceptance_length",
        "acceptance_rate_per_position",
        "tokens_per_second",
        "baseline_tokens_per_second",
        "speedup",
        "draft_time_fraction",
        "identical_to_target",
        "per_prompt",
        "command",
        "versions",
    ):
        assert key in res, key
    assert res["k"] == 3 and res["num_prompts"] == 4
    assert len(res["acceptance_rate_per_position"]) == 3
    assert res["identical_to_target"] is True
    assert all(len(p["output_ids"]) <= 24 for p in res["per_prompt"])
    assert res["new_tokens"] == sum(len(p["output_ids"]) for p in res["per_prompt"])
    assert res["acceptance_length"] >= 1.0
    assert res["speedup"] == pytest.approx(
        res["tokens_per_second"] / res["baseline_tokens_per_second"]
    )


def test_evaluate_sampling_has_no_identity_claim(tmp_path, tiny_target_dir):
    code, res = _run(
        tmp_path,
        "--target",
        tiny_target_dir,
        "--temperature",
        0.8,
        "--top-p",
        0.9,
        "--max-new-tokens",
        8,
        "--limit",
        2,
        "--seed",
        3,
    )
    assert code == 0 and res["identical_to_target"] is None and res["temperature"] == 0.8


def test_cli_dispatches_evaluate(tmp_path, tiny_target_dir, capsys):
    out = tmp_path / "r.json"
    code = cli(
        [
            "evaluate",
            "--target",
            str(tiny_target_dir),
            "--max-new-tokens",
            "4",
            "--limit",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0 and json.loads(out.read_text())["num_prompts"] == 1
    assert cli(["evaluat"]) == 2
    assert "did you mean 'evaluate'" in capsys.readouterr().err


def test_bad_config_names_every_field(tmp_path, tiny_target_dir, capsys):
    code, _ = _run(tmp_path, "--target", tiny_target_dir, "--k", 0, "--max-new-tokens", 0)
    err = capsys.readouterr().err
    assert code == 2 and "k:" in err and "max_new_tokens:" in err


def test_bad_inputs_fail_with_named_file_or_path(tmp_path, tiny_target_dir, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert evaluate(["--target", str(tiny_target_dir), "--prompts", str(empty)]) == 2
    assert "empty.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"prompt": "oops"\n')
    assert evaluate(["--target", str(tiny_target_dir), "--prompts", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    missing = tmp_path / "no_such_model"
    assert evaluate(["--target", str(missing), "--limit", "1"]) == 2
    assert "no_such_model" in capsys.readouterr().err


def test_wandb_offline_logging(tmp_path, tiny_target_dir, monkeypatch):
    """--report-to wandb works with no network: the run is written offline to WANDB_DIR."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    code, _res = _run(
        tmp_path,
        "--target",
        tiny_target_dir,
        "--max-new-tokens",
        6,
        "--limit",
        2,
        "--report-to",
        "wandb",
    )
    assert code == 0
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


def test_cli_help_lists_commands(capsys):
    assert cli(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("quickstart", "prepare-target", "data", "evaluate"):
        assert name in out
    assert cli(["data", "--help"]) == 0
    assert "distill" in capsys.readouterr().out
    assert cli(["data", "nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_evaluate_several_drafters_share_one_baseline(tmp_path, tiny_target_dir):
    code, res = _run(
        tmp_path,
        "--target",
        tiny_target_dir,
        "--drafter",
        "ngram",
        "draft-lm",
        "--draft-layers",
        "0",
        "3",
        "--k",
        3,
        "--max-new-tokens",
        16,
        "--limit",
        3,
    )
    assert code == 0
    assert [m["method"] for m in res["methods"]] == ["ngram[2-4]", "draft-lm[pruned [0, 3]]"]
    ngram, dlm = res["methods"]
    # Same baseline for both: the same plain-decoding runs feed both speedups.
    assert ngram["baseline_tokens_per_second"] == dlm["baseline_tokens_per_second"]
    assert ngram["identical_to_target"] is True and dlm["identical_to_target"] is True
    assert [p["output_ids"] for p in ngram["per_prompt"]] == [
        p["output_ids"] for p in dlm["per_prompt"]
    ]
    assert "command" in res and "config" in res


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("eagle", "eagle needs a directory"),
        ("ngram=/x", "ngram takes no path"),
        ("bogus", "kind must be one of"),
    ],
)
def test_evaluate_rejects_bad_drafter_specs(tmp_path, tiny_target_dir, capsys, spec, problem):
    code, _ = _run(tmp_path, "--target", tiny_target_dir, "--drafter", spec)
    assert code == 2
    assert problem in capsys.readouterr().err
