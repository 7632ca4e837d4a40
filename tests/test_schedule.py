"""Speculation that follows load (train/report/schedule.py) and the served stage's schedule server.

No vLLM runs here: the served stage's server start and measurement are replaced by fixed
tokens/s per server and concurrency.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_model_dir

from draftsmith.train.datagen.vllm_server import default_vllm_python
from draftsmith.train.report.schedule import (
    SCHEDULE_KEY,
    Schedule,
    recommend_schedule,
    validate_schedule,
)
from tests.conftest import missing


def _levels(tps: dict[int, float]) -> list[dict]:
    return [{"concurrency": c, "tokens_per_second": v} for c, v in tps.items()]


def _plain(tps: dict[int, float]) -> dict[int, dict]:
    return {c: {"concurrency": c, "tokens_per_second": v} for c, v in tps.items()}


PLAIN = _plain({1: 100.0, 4: 300.0, 16: 800.0})


# --------------------------------------------------------------------------------------------
# recommend_schedule / validate_schedule
# --------------------------------------------------------------------------------------------


def test_speculation_kept_where_it_wins_and_off_where_it_loses():
    schedule = recommend_schedule(_levels({1: 150.0, 4: 330.0, 16: 700.0}), PLAIN, 3)
    # Boundaries at the geometric midpoints: 1|4 -> 2, 4|16 -> 8; the last ends at 16.
    assert isinstance(schedule, Schedule) and schedule.entries == [(1, 8, 3), (9, 16, 0)]
    assert schedule.speculates
    assert schedule.per_level[1] == {
        "k": 3,
        "tokens_per_second": 150.0,
        "plain_tokens_per_second": 100.0,
        "gain": pytest.approx(0.5),
    }
    assert schedule.per_level[16]["k"] == 0
    assert schedule.per_level[16]["gain"] == pytest.approx(700 / 800 - 1)
    base = {"method": "eagle3", "model": "x", "num_speculative_tokens": 3}
    config = schedule.speculative_config(base)
    assert config == {**base, SCHEDULE_KEY: [[1, 8, 3], [9, 16, 0]]}
    assert SCHEDULE_KEY not in base  # a copy
    # The server's batch limit ends the last range.
    wider = recommend_schedule(_levels({1: 150.0, 4: 330.0, 16: 700.0}), PLAIN, 3, max_num_seqs=64)
    assert wider.entries == [(1, 8, 3), (9, 64, 0)]


def test_wins_everywhere_is_one_range_and_loses_everywhere_is_no_schedule():
    wins = recommend_schedule(_levels({1: 200.0, 4: 400.0, 16: 900.0}), PLAIN, 4)
    assert wins.entries == [(1, 16, 4)]
    assert wins.speculative_config({"num_speculative_tokens": 4})[SCHEDULE_KEY] == [[1, 16, 4]]
    loses = recommend_schedule(_levels({1: 90.0, 4: 200.0, 16: 500.0}), PLAIN, 4)
    assert loses.entries is None and not loses.speculates
    assert loses.speculative_config({"num_speculative_tokens": 4}) is None
    assert loses.summary().startswith("don't speculate")
    assert "c=1: -10.0%" in loses.summary()
    assert loses.to_json()["entries"] is None


def test_a_tie_within_the_noise_switches_speculation_off():
    # +2% at c=1 is inside the 3% margin; +4% at c=4 is outside it.
    schedule = recommend_schedule(_levels({1: 102.0, 4: 312.0, 16: 700.0}), PLAIN, 2)
    assert [schedule.per_level[c]["k"] for c in (1, 4, 16)] == [0, 2, 0]
    assert schedule.entries == [(1, 2, 0), (3, 8, 2), (9, 16, 0)]
    assert recommend_schedule(_levels({1: 102.0}), PLAIN, 2, noise=0.01).entries == [(1, 1, 2)]


def test_midpoints_between_close_and_unsorted_levels():
    plain = _plain({1: 10.0, 2: 10.0, 3: 10.0, 8: 10.0})
    schedule = recommend_schedule(_levels({8: 5.0, 3: 20.0, 1: 20.0, 2: 5.0}), plain, 5)
    # 1|2 -> 1, 2|3 -> 2, 3|8 -> 4.
    assert schedule.entries == [(1, 1, 5), (2, 2, 0), (3, 4, 5), (5, 8, 0)]
    # A first level above 1 still covers batch 1; a level the plain server lacks decides nothing.
    only = recommend_schedule(_levels({4: 400.0, 32: 1.0}), PLAIN, 3)
    assert only.entries == [(1, 4, 3)]
    with pytest.raises(ValueError, match="no concurrency level"):
        recommend_schedule(_levels({2: 1.0}), PLAIN, 3)
    with pytest.raises(ValueError, match="k must be >= 1"):
        recommend_schedule(_levels({1: 1.0}), PLAIN, 0)


def test_schedule_json_is_json_safe():
    schedule = recommend_schedule(_levels({1: 150.0, 4: 330.0, 16: 700.0}), PLAIN, 3)
    data = json.loads(json.dumps(schedule.to_json()))
    assert data["entries"] == [[1, 8, 3], [9, 16, 0]]
    assert [lv["concurrency"] for lv in data["per_level"]] == [1, 4, 16]
    assert data["summary"] == "batch 1-8: k=3, batch 9-16: k=0"


@pytest.mark.parametrize(
    ("entries", "problem"),
    [
        ([(1, 4, 3), (4, 8, 0)], "overlap"),
        ([(2, 4, 3)], "starts at 2, not 1"),
        ([(1, 4, -1)], "k must be >= 0"),
        ([(1, 4, 3), (6, 5, 0)], "start 6 > end 5"),
        ([(0, 4, 3)], "must be positive"),
        ([], "non-empty"),
        ([(1, 4)], "triple"),
        ([(1, "x", 3)], "integers"),
    ],
)
def test_validate_schedule_names_the_problem(entries, problem):
    with pytest.raises(ValueError, match=problem) as info:
        validate_schedule(entries)
    assert "\n" not in str(info.value)


def test_validate_schedule_sorts_and_allows_gaps_as_vllm_does():
    # vLLM sorts the entries itself and carries a range's k over a gap after it.
    assert validate_schedule([[5, 8, 1], [1, 2, 3]]) == [(1, 2, 3), (5, 8, 1)]


def _vllm_validator():
    """vLLM's own validate_and_normalize_dynamic_sd_schedule (a dependency-free file of the vLLM
    venv's package), or None without a vLLM venv."""
    python = default_vllm_python()
    if not python.exists():
        return None
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    path = Path(out.stdout.strip()) / "vllm/v1/spec_decode/dynamic/utils.py"
    if out.returncode or not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_vllm_dynamic_sd_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.validate_and_normalize_dynamic_sd_schedule


@pytest.mark.vllm
def test_validate_schedule_agrees_with_vllm():
    vllm = _vllm_validator()
    if vllm is None:
        missing("no vLLM venv to compare with")
    cases = [
        [[1, 8, 3], [9, 16, 0]],
        [[1, 16, 4]],
        [[5, 8, 1], [1, 2, 3]],
        [[1, 4, 3], [4, 8, 0]],
        [[2, 4, 3]],
        [[1, 4, -1]],
        [[1, 4, 3], [6, 5, 0]],
        [[0, 4, 3]],
        [],
        [[1, 4]],
    ]
    for entries in cases:
        try:
            theirs = vllm(entries)
        except ValueError:
            theirs = None
        try:
            ours = validate_schedule(entries)
        except ValueError:
            ours = None
        assert ours == theirs, entries
    # Every schedule recommend_schedule makes passes vLLM's check.
    for tps in ({1: 150.0, 4: 330.0, 16: 700.0}, {1: 90.0, 4: 400.0, 16: 900.0}):
        entries = recommend_schedule(_levels(tps), PLAIN, 3).entries
        assert vllm([list(e) for e in entries]) == entries


# --------------------------------------------------------------------------------------------
# The served stage (train/report/served.py) with the servers replaced
# --------------------------------------------------------------------------------------------

#: tokens/s by server and concurrency: the drafter wins at 1 and 4, loses at 16; the schedule
#: server matches the best at 1 and 4 and falls short of the plain server at 16.
TPS = {
    "plain": {1: 100.0, 4: 300.0, 16: 800.0},
    "fixed": {1: 150.0, 4: 330.0, 16: 700.0},
    "schedule": {1: 149.0, 4: 331.0, 16: 760.0},
}


@pytest.fixture
def served_stage(tmp_path, monkeypatch):
    """``serve(cfg, ...)`` of a bench with one n-gram drafter whose servers answer with
    :data:`TPS`; the plans each server was started with are in ``started``."""
    from draftsmith.recipes.bench import BenchConfig
    from draftsmith.train.report import served

    target = tiny_model_dir(tmp_path / "target")
    raw = tmp_path / "bench.t0.json"
    config = {
        "target": str(target),
        "prompts": None,
        "split": "auto",
        "limit": None,
        "cache_dir": None,
        "dtype": "float32",
        "k": 3,
        "drafter": ["ngram"],
        "ngram_min": 1,
        "ngram_max": 3,
        "max_new_tokens": 12,
    }
    raw.write_text(json.dumps({"config": config, "methods": [{"per_prompt": []}]}))
    started = []

    def fake_levels(plan, target, *, concurrency, prompts, **_):
        started.append(plan)
        spec = plan.speculative_config
        server = "plain" if spec is None else "schedule" if SCHEDULE_KEY in spec else "fixed"
        return [
            {
                "concurrency": c,
                "requests": len(prompts),
                "tokens_per_second": TPS[server][c],
                "latency_p50_s": 0.1,
                "latency_p95_s": 0.2,
                "outputs": [[7, 8]] * len(prompts),
            }
            for c in concurrency
        ]

    monkeypatch.setattr(served, "_measure_levels", fake_levels)
    monkeypatch.setattr(served, "vllm_version", lambda python: "0.32.0")

    def run(**overrides):
        started.clear()
        cfg = BenchConfig(
            vllm_python=Path(sys.executable),
            served_concurrency=[1, 4, 16],
            served_limit=3,
            **overrides,
        )
        return served.serve(cfg, {}, [(0.0, raw, "draftsmith evaluate ...")], tmp_path / "bench")

    return run, started


def test_served_stage_serves_the_recommended_schedule_and_checks_it(served_stage, capsys):
    from draftsmith.train.report.served import (
        SERVED_COLUMNS,
        schedule_markdown,
        served_lines,
        served_rows,
    )

    run, started = served_stage
    result = run()
    assert [p.label for p in started] == ["plain", "ngram", "ngram schedule"]
    fixed = started[1].speculative_config
    assert fixed["num_speculative_tokens"] == 3 and SCHEDULE_KEY not in fixed
    row = result["rows"][1]
    schedule = row["schedule"]
    want = {**fixed, SCHEDULE_KEY: [[1, 8, 3], [9, 16, 0]]}
    # The schedule server runs the schedule's config, which the report records exactly.
    assert started[2].speculative_config == want
    assert schedule["speculative_config"] == want
    assert json.loads(schedule["speculative_config_json"]) == want
    assert schedule["entries"] == [[1, 8, 3], [9, 16, 0]]
    assert [lv["k"] for lv in schedule["per_level"]] == [3, 3, 0]
    levels = {lv["concurrency"]: lv for lv in schedule["levels"]}
    assert [levels[c]["best_of"] for c in (1, 4, 16)] == ["fixed", "fixed", "plain"]
    assert [levels[c]["best_tokens_per_second"] for c in (1, 4, 16)] == [150.0, 330.0, 800.0]
    # 149 >= 150 * 0.97 and 331 >= 330: ok; 760 < 800 * 0.97: below.
    assert [levels[c]["schedule_ok"] for c in (1, 4, 16)] == [True, True, False]
    assert levels[4]["speedup"] == pytest.approx(331 / 300)  # compared like the fixed server
    assert levels[4]["identical_to_plain"] == 3 and "outputs" not in levels[4]
    json.dumps(result)  # JSON-safe

    lines = served_lines(result)
    arg = schedule["speculative_config_json"]
    assert f"schedule: ngram: --speculative-config '{arg}'" in lines
    assert "schedule: ngram: batch 1-8: k=3, batch 9-16: k=0" in lines
    assert "schedule: ngram c=4: schedule 331.0 tok/s vs best of plain/fixed 330.0 (ok)" in lines
    assert (
        "schedule: ngram c=16: schedule 760.0 tok/s vs best of plain/fixed 800.0 (below)" in lines
    )
    rows = served_rows(result)
    assert all(len(r) == len(SERVED_COLUMNS) for r in rows)
    by_server = {(r[0], r[1]): r[-1] for r in rows}
    assert by_server[("plain", "1")] == "-"
    assert by_server[("ngram", "1")] == "k=3" and by_server[("ngram", "16")] == "off"
    assert by_server[("ngram schedule", "16")] == "**below** (plain 800.0)"
    assert by_server[("ngram schedule", "1")] == "ok (fixed 150.0)"
    # The report's markdown names the schedule and the exact flag to serve it with.
    md = schedule_markdown(result)
    assert md[0] == "### Load schedule"
    assert "- `ngram`: batch 1-8: k=3, batch 9-16: k=0" in md
    assert f"  - serve with `--speculative-config '{arg}'`" in md
    # At c = 16 it stops drafting yet runs 5 % below plain: the k = 0 cost, named with its cause.
    assert schedule["k0_cost"] == [{"concurrency": 16, "below_plain": pytest.approx(0.05)}]
    (cost,) = [line for line in md if "stops drafting" in line]
    assert "5 % below plain at 16 in flight" in cost and "KV cache" in cost


def test_served_schedule_off_records_the_schedule_without_serving_it(served_stage):
    run, started = served_stage
    result = run(served_schedule=False)
    assert [p.label for p in started] == ["plain", "ngram"]
    schedule = result["rows"][1]["schedule"]
    assert schedule["entries"] == [[1, 8, 3], [9, 16, 0]] and "levels" not in schedule
    assert result["served_schedule"] is False


def test_no_schedule_server_when_speculation_never_wins(served_stage, monkeypatch):
    from draftsmith.train.report.served import schedule_markdown, served_lines

    monkeypatch.setitem(TPS, "fixed", {1: 90.0, 4: 250.0, 16: 600.0})
    run, started = served_stage
    result = run()
    assert [p.label for p in started] == ["plain", "ngram"]
    schedule = result["rows"][1]["schedule"]
    assert schedule["entries"] is None and schedule["speculative_config_json"] is None
    lines = served_lines(result)
    assert any(line.startswith("schedule: ngram: don't speculate") for line in lines)
    assert not any("--speculative-config" in line for line in lines)
    md = schedule_markdown(result)
    assert any(line.startswith("- `ngram`: don't speculate") for line in md)
    assert not any("--speculative-config" in line for line in md)


def test_no_tau_gap_where_the_schedule_stops_drafting(served_stage, monkeypatch):
    """A schedule server's τ is compared with ours only where it drafts: at a k = 0 level its τ
    is ~1 by design, and flagging that as an export mismatch would be wrong."""
    from draftsmith.train.data.prompts import load_prompts
    from draftsmith.train.report import served

    # Our greedy run on the served prompts (the fixture serves the first 3 held-out ones): τ 1.8.
    ids = [str(r.id) for r in load_prompts(None, split="heldout")[:3]]
    ours = {"per_prompt": [{"id": i} for i in ids]}
    monkeypatch.setattr(served, "_our_result", lambda runs, ecfg, label: ours)
    monkeypatch.setattr(served, "summarize_entries", lambda *a: {"acceptance_length": 1.8})
    real = served._measure_levels

    def with_tau(plan, target, **kwargs):
        levels = real(plan, target, **kwargs)
        spec = plan.speculative_config
        for level in levels:
            if spec is not None:  # the schedule drafts at c = 1 and 4, not at 16
                off = SCHEDULE_KEY in spec and level["concurrency"] == 16
                level["acceptance_length"] = 1.0 if off else 1.8
        return levels

    monkeypatch.setattr(served, "_measure_levels", with_tau)
    run, _ = served_stage
    row = run()["rows"][1]
    fixed = {lv["concurrency"]: lv for lv in row["levels"]}
    sched = {lv["concurrency"]: lv for lv in row["schedule"]["levels"]}
    assert fixed[16]["tau_gap"] == pytest.approx(0.0) and not fixed[16]["tau_gap_flag"]
    assert sched[1]["tau_gap"] == pytest.approx(0.0)
    assert "tau_gap" not in sched[16] and "tau_gap_flag" not in sched[16]
    assert sched[16]["acceptance_length"] == 1.0  # still reported, just not judged


def test_a_schedule_of_the_fixed_k_everywhere_is_not_served_again(served_stage, monkeypatch):
    """Speculation wins at every load: the schedule is the fixed-k server itself, so its config
    is the fixed one and no third server is started to measure it again."""
    from draftsmith.train.report.served import SAME_AS_FIXED, schedule_markdown, served_lines

    monkeypatch.setitem(TPS, "fixed", {1: 150.0, 4: 400.0, 16: 900.0})
    run, started = served_stage
    result = run()
    assert [p.label for p in started] == ["plain", "ngram"]
    fixed = started[1].speculative_config
    schedule = result["rows"][1]["schedule"]
    assert schedule["entries"] == [[1, 16, 3]] and schedule["same_as_fixed"] is True
    assert schedule["speculative_config"] == fixed and SCHEDULE_KEY not in fixed
    assert json.loads(schedule["speculative_config_json"]) == fixed
    assert "levels" not in schedule and "error" not in schedule
    assert f"schedule: ngram: {SAME_AS_FIXED}" in served_lines(result)
    assert f"  - {SAME_AS_FIXED}" in schedule_markdown(result)
