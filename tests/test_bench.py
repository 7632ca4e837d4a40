"""``draftsmith bench`` end to end on a tiny target: outputs, recommendation, shards, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_model_dir

from draftsmith.recipes.cli import main as cli
from draftsmith.train.decoding.draft_length import load_cost_profile, predicted_speedups
from draftsmith.train.report import recommend
from draftsmith.train.report.bench import results_rows
from draftsmith.train.report.plots import PLOTS

DRAFTERS = ["ngram", "draft-lm", "eagle", "eagle-tree", "hf-prompt-lookup"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, an EAGLE-3 drafter inside a fake training run, a cost profile."""
    from draftsmith.heads.eagle import EagleConfig, build_drafter, save_drafter
    from draftsmith.train.target.load import load_target

    root = tmp_path_factory.mktemp("bench")
    target_dir = tiny_model_dir(root / "target")
    target, _ = load_target(str(target_dir))
    run_dir = root / "eagle_run"
    drafter = build_drafter(target, EagleConfig.from_target(target.config, 3), seed=0)
    save_drafter(drafter, run_dir / "best")
    # What TrainRun writes: every validation with its simulated τ and training minutes.
    validation = [
        {"step": 10 * i, "val/sim_tau": 1.0 + 0.1 * i, "val/minutes": 0.5 * i} for i in (1, 2, 3)
    ]
    (run_dir / "training_metrics.json").write_text(
        json.dumps(
            {
                "recipe": "eagle",
                "kind": "eagle3",
                "validation": validation,
                "best": {"step": 20, "sim_tau": 1.2},  # best/ is the drafter of step 20
            }
        )
    )
    # scripts/bench_forward.py's layout: ms per forward by dtype, threads, chain width.
    chain = {str(w): 10.0 + 1.5 * (w - 1) for w in (1, 2, 3, 4, 6, 8, 12)}
    profile = root / "cost.json"
    profile.write_text(
        json.dumps({"unit": "ms", "profile": {"float32": {"1": {"chain": chain, "tree": {}}}}})
    )
    eagle = str(run_dir / "best")
    argv = [
        "--target",
        str(target_dir),
        "--drafter",
        "ngram",
        "draft-lm",
        f"eagle={eagle}",
        f"eagle-tree={eagle}",
        "hf-prompt-lookup",
        "--draft-layers",  # passed through to evaluate
        "0",
        "3",
        "--k",
        "3",
        "--max-k",
        "5",
        "--temperatures",
        "0",
        "0.7",
        "--max-new-tokens",
        "12",
        "--limit",
        "4",
        "--no-reference-plain",
        "--cost-profile",
        str(profile),
    ]
    out = root / "full" / "bench"
    code = cli(["bench", *argv, "--out", str(out), "--training-logs", str(run_dir)])
    return {
        "root": root,
        "argv": argv,
        "code": code,
        "out": out,
        "report": json.loads(out.with_suffix(".json").read_text()),
        "profile": profile,
        "run_dir": run_dir,
    }


def test_bench_writes_json_markdown_and_plots(setup):
    assert setup["code"] == 0
    report, out = setup["report"], setup["out"]
    for key in (
        "bench",
        "seed",
        "runs",
        "recommendations",
        "trees",
        "training",
        "cost_profile",
        "config",
        "command",
        "versions",
        "machine",
        "machine_load",
        "git_commit",
        "date",
        "outputs",
    ):
        assert key in report, key
    assert report["seed"] == 0
    assert report["bench"]["temperatures"] == [0.0, 0.7]
    greedy, sampled = report["runs"]
    names = [m["method"] for m in greedy["methods"]]
    assert names[0] == "ngram[2-4]" and names[-1] == "hf-prompt-lookup[1-4]"
    assert [m["family"] for m in greedy["methods"]] == ["chain", "chain", "chain", "tree", "hf"]
    # One baseline per run, shared by every drafter; greedy outputs are the target's own.
    assert len({m["baseline_tokens_per_second"] for m in greedy["methods"]}) == 1
    assert all(m["identical_to_target"] is True for m in greedy["methods"])
    assert all(m["identical_to_target"] is None for m in sampled["methods"])
    assert all(m["temperature"] == 0.7 and m["acceptance_length"] >= 1 for m in sampled["methods"])
    assert all("per_prompt" not in m for m in greedy["methods"])  # kept in the results files
    # transformers' prompt lookup, counted like our loop: each forward emits its accepted drafts
    # plus one token of its own; no model drafts.
    hf = greedy["methods"][-1]
    assert hf["new_tokens"] == hf["target_forwards"] + hf["accepted_tokens"]
    assert hf["accepted_tokens"] > 0 and hf["draft_time_fraction"] == 0
    raw = json.loads((out.parent / greedy["results_file"]).read_text())
    assert len(raw["methods"][0]["per_prompt"]) == 4
    # Recommendations for the three chain drafters at both temperatures; trees as measured.
    assert len(report["recommendations"]) == 6
    assert [t["temperature"] for t in report["trees"]] == [0.0, 0.7]
    assert report["trees"][0]["tree_total_tokens"] == 24
    # The training curve, with the measured τ of the drafter benched from that run.
    (training,) = report["training"]
    assert training["minutes"] == [0.5, 1.0, 1.5]
    assert {m["method"] for m in training["measured"]} == {names[2], names[3]}
    assert {m["training_minutes"] for m in training["measured"]} == {1.0}  # step 20's

    md = out.with_suffix(".md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    for entry in report["runs"]:
        for m in entry["methods"]:
            method = m["method"].replace("|", "\\|")
            assert any(
                r.startswith(f"| {method} | {entry['temperature']:g} | 3 | 4 |") for r in rows
            ), m["method"]
    assert "## Recommended draft length" in md and "## Trees (measured)" in md
    assert "## Training" in md

    from PIL import Image

    plots = [Path(p) for p in report["outputs"]["plots"]]
    assert [p.name for p in plots] == list(PLOTS)
    for path in plots:
        assert path.read_bytes()[:8] == PNG_MAGIC, path
        with Image.open(path) as image:
            image.verify()
            assert image.size[0] > 100 and image.size[1] > 100
        assert f"({path.parent.name}/{path.name})" in md


def _alpha_tail(alpha: list[float], n: int) -> list[float]:
    """The recommendation's extrapolation, written out again: the last conditional rate held."""
    out = list(alpha)
    ratio = alpha[-1] / alpha[-2] if len(alpha) > 1 and alpha[-2] > 0 else alpha[-1]
    while len(out) < n:
        out.append(out[-1] * min(ratio, 1.0))
    return out


def test_recommendation_is_predicted_speedups_of_the_measured_alpha(setup):
    report = setup["report"]
    costs = load_cost_profile(setup["profile"], "float32", 1)
    summaries = {(m["method"], e["temperature"]): m for e in report["runs"] for m in e["methods"]}
    extrapolated = 0
    for rec in report["recommendations"]:
        m = summaries[(rec["method"], rec["temperature"])]
        alpha = m["acceptance_rate_per_position"]
        # D: drafting seconds per drafted token (none drafted: no cost to charge).
        proposed = m["proposed_tokens"]
        draft_s = m["draft_time_fraction"] * m["wall_time_s"] / proposed if proposed else 0.0
        assert rec["draft_seconds_per_token"] == pytest.approx(draft_s)
        assert rec["alpha_used"][:3] == pytest.approx(alpha)
        # s: the share of verification steps that carried a draft (n-gram: only on a match).
        share = m["draft_steps"] / (m["target_forwards"] - m["num_prompts"])
        assert rec["drafted_step_share"] == pytest.approx(min(1.0, share))
        expected = predicted_speedups(_alpha_tail(alpha, 5), costs, draft_s, min(1.0, share))
        got = {int(k): v for k, v in rec["predicted"].items()}
        assert got == pytest.approx(expected)
        # Up to the measured k the prediction needs no extrapolation at all.
        assert got[3] == pytest.approx(predicted_speedups(alpha, costs, draft_s, share)[3])
        assert rec["predicted_at_run_k"] == pytest.approx(expected[3])
        best = max(expected, key=lambda k: (expected[k], -k))
        assert rec["best_k"] == best
        assert rec["best_predicted_speedup"] == pytest.approx(expected[best])
        assert rec["measured_speedup"] == pytest.approx(m["speedup"])
        extrapolated += rec["alpha_used"][3] > 0
    assert extrapolated  # some drafter's tail past k = 3 was actually extrapolated


def test_shards_merge_into_the_rows_of_one_run(setup):
    root, argv = setup["root"], setup["argv"]
    parts = []
    for shard in ("0/2", "1/2"):
        out = root / "shards" / f"s{shard[0]}"
        assert cli(["bench", *argv, "--shard", shard, "--out", str(out)]) == 0
        parts.append(out.with_suffix(".json"))
    merged = root / "merged" / "bench"
    assert cli(["bench", "--merge", *map(str, parts), "--out", str(merged), "--max-k", "5"]) == 0
    report = json.loads(merged.with_suffix(".json").read_text())
    assert report["bench"]["merged_from"] == [str(p) for p in parts]

    def counts(rows):  # every column but the timings: method, T, k, prompts, τ, α, identical
        return [[*r[:6], r[11]] for r in rows]

    full = setup["report"]
    assert counts(results_rows(report)) == counts(results_rows(full))
    for a, b in zip(report["recommendations"], full["recommendations"], strict=True):
        assert a["alpha_used"] == pytest.approx(b["alpha_used"])
    # The merged evaluate results hold every prompt, from both shards.
    raw = json.loads(merged.with_name("bench.t0.json").read_text())
    assert sorted(p["id"] for p in raw["methods"][0]["per_prompt"]) == sorted(
        p["id"]
        for p in json.loads(setup["out"].with_name("bench.t0.json").read_text())["methods"][0][
            "per_prompt"
        ]
    )


def test_bad_inputs_are_one_line_errors(tmp_path, setup, monkeypatch, capsys):
    profile, out = str(setup["profile"]), str(tmp_path / "b")

    def error(argv: list[str]) -> str:
        assert cli(["bench", *argv, "--out", out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") or err[0].startswith("error: "), err
        return "\n".join(err)

    missing = tmp_path / "nope" / "forward_cost.json"
    monkeypatch.setattr(recommend, "DEFAULT_COST_PROFILES", (missing,))
    assert str(missing) in error(["--drafter", "ngram"])
    assert "no cost profile for dtype bfloat16" in error(
        ["--cost-profile", profile, "--dtype", "bfloat16"]
    )
    assert "no training_metrics.json" in error(
        ["--cost-profile", profile, "--training-logs", str(tmp_path)]
    )
    assert "--temperature is set by the bench" in error(
        ["--cost-profile", profile, "--temperature", "0.5"]
    )
    assert "temperatures" in error(["--cost-profile", profile, "--temperatures", "0", "0"])
    # evaluate's own checks come back as its exit code (its error line is above).
    assert "kind must be one of" in error(["--cost-profile", profile, "--drafter", "bogus"])
    assert "hf-prompt-lookup takes no path" in error(
        ["--cost-profile", profile, "--drafter", "hf-prompt-lookup=/x"]
    )
    assert "not a bench JSON" in error(["--merge", profile, "--cost-profile", profile])
    assert not list(tmp_path.glob("b*"))  # nothing written
