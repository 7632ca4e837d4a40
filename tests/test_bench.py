"""``draftsmith bench`` end to end on a tiny target: outputs, recommendation, shards, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import tiny_model_dir

from draftsmith.recipes.cli import main as cli
from draftsmith.train.decoding.draft_length import load_cost_profile, predicted_speedups
from draftsmith.train.report import recommend
from draftsmith.train.report.bench import RESULT_COLUMNS, results_rows
from draftsmith.train.report.plots import PLOTS

DRAFTERS = ["ngram", "draft-lm", "eagle", "eagle-tree", "hf-prompt-lookup"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, an EAGLE-3 drafter inside a fake training run, a cost profile."""
    from draftsmith.heads.eagle import EagleConfig, build_drafter, save_drafter
    from draftsmith.train.target_model.load import load_target

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
    # The family declaration's columns (heads/families.py); the EAGLE family from its checkpoint.
    assert [m["family"] for m in greedy["methods"]] == [
        "ngram",
        "draft-lm",
        "eagle3",
        "eagle3",
        "ngram",
    ]
    assert [m["shape"] for m in greedy["methods"]] == ["chain", "chain", "chain", "tree", "chain"]
    assert [m["loop"] for m in greedy["methods"]][-1] == "transformers"
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
            family = f"{m['family']} | {m['shape']}" + (" (hf loop)" if m["loop"] != "ours" else "")
            assert any(
                r.startswith(f"| {method} | {family} | {entry['temperature']:g} | 3 | 4 |")
                for r in rows
            ), m["method"]
    assert "## Recommended draft length" in md and "## Trees (measured)" in md
    assert "## Training" in md

    from PIL import Image

    plots = [Path(p) for p in report["outputs"]["plots"]]
    assert [p.name for p in plots] == list(PLOTS[:3])  # served_vs_concurrency: with vLLM only
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
        # Anchored: the best k's prediction times the measured / predicted gap at the run's k.
        assert rec["best_anchored_speedup"] == pytest.approx(
            expected[best] * m["speedup"] / expected[3]
        )
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
    # The merge times nothing: its load record is the shards' own, not a snapshot taken when
    # they have just finished (which would count them as outside load).
    shard_loads = [json.loads(p.read_text())["machine_load"] for p in parts]
    assert report["machine_load"]["shards"] == shard_loads

    def counts(rows):  # every column but the timings: method ... α per position, identical
        first = RESULT_COLUMNS.index("α per position") + 1
        return [[*r[:first], r[RESULT_COLUMNS.index("identical")]] for r in rows]

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


def test_rerun_keeps_finished_temperatures_and_continues_a_stopped_one(setup, capsys):
    """A bench stopped by --max-minutes exits 3 and keeps its prompts; the same command
    continues it, and a rerun of a finished bench measures nothing again."""
    from draftsmith.train.decoding.partial import partial_path

    root, argv = setup["root"], setup["argv"]
    out = root / "resumed" / "bench"
    # Budget of ~0: evaluate measures the first prompt of greedy, then stops.
    assert cli(["bench", *argv, "--out", str(out), "--max-minutes", "1e-9"]) == 3
    assert "the same command continues" in capsys.readouterr().out
    greedy = out.with_name("bench.t0.json")
    assert partial_path(greedy).is_file()
    assert not out.with_name("bench.t0.7.json").exists()  # the bench stopped before T=0.7
    assert cli(["bench", *argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "resuming:" in text and not partial_path(greedy).exists()
    full = json.loads(out.with_suffix(".json").read_text())
    ref = setup["report"]
    first = RESULT_COLUMNS.index("α per position") + 1
    assert [r[:first] for r in results_rows(full)] == [r[:first] for r in results_rows(ref)]
    stamp = greedy.stat().st_mtime_ns
    assert cli(["bench", *argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("already measured") == 2 and greedy.stat().st_mtime_ns == stamp


def test_sampled_limit_measures_sampled_temperatures_on_the_first_prompts(setup, tmp_path, capsys):
    """--sampled-limit N: greedy keeps every prompt (kept, not measured again), the sampled run
    takes the first N; never more than --limit gives."""
    for raw in setup["out"].parent.glob("bench.t*.json"):
        shutil.copy(raw, tmp_path / raw.name)
    out = tmp_path / "bench"
    argv = [*setup["argv"], "--out", str(out)]
    assert cli(["bench", *argv, "--sampled-limit", "2"]) == 0
    assert capsys.readouterr().out.count("already measured") == 1  # greedy only
    report = json.loads(out.with_suffix(".json").read_text())
    assert {r["temperature"]: r["prompts_evaluated"] for r in report["runs"]} == {0.0: 4, 0.7: 2}
    sampled = json.loads(out.with_name("bench.t0.7.json").read_text())
    full = json.loads(setup["out"].with_name("bench.t0.7.json").read_text())
    ids = [p["id"] for p in full["methods"][0]["per_prompt"]]
    assert [p["id"] for p in sampled["methods"][0]["per_prompt"]] == ids[:2]
    # Over --limit: the 4 prompts --limit gives, which the first run measured.
    shutil.copy(setup["out"].with_name("bench.t0.7.json"), out.with_name("bench.t0.7.json"))
    assert cli(["bench", *argv, "--sampled-limit", "10"]) == 0
    assert capsys.readouterr().out.count("already measured") == 2


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


# --------------------------------------------------------------------------------------------
# Served figures (train/report/served.py) against fake OpenAI-compatible servers
# --------------------------------------------------------------------------------------------


class FakeVLLM:
    """An OpenAI-compatible server with vLLM's ``/metrics``: answers ``answer(prompt_ids)``
    and counts ``drafts`` / ``accepted`` (per position) speculative counters per request."""

    def __init__(self, answer, *, drafts=0, per_pos=(), delay=0.0):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.answer, self.drafts, self.per_pos, self.delay = answer, drafts, list(per_pos), delay
        self.counts = {"drafts": 0, "accepted": [0] * len(self.per_pos)}
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, body, ctype="application/json"):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(200, {"data": [{"id": "tiny", "max_model_len": 512}]})
                if self.path == "/metrics":
                    with fake.lock:
                        c = fake.counts
                        lines = [
                            "# TYPE vllm:spec_decode_num_drafts_total counter",
                            f'vllm:spec_decode_num_drafts_total{{engine="0"}} {c["drafts"]}.0',
                            "vllm:spec_decode_num_accepted_tokens_total"
                            f'{{engine="0"}} {sum(c["accepted"])}.0',
                        ]
                        lines += [
                            "vllm:spec_decode_num_accepted_tokens_per_pos_total"
                            f'{{engine="0",position="{i}"}} {a}.0'
                            for i, a in enumerate(c["accepted"])
                        ]
                    return self._send(200, "\n".join(lines) + "\n", "text/plain")
                self._send(404, {"error": {"message": "no route"}})

            def do_POST(self):
                import time

                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                time.sleep(fake.delay)
                tokens = fake.answer(body["prompt"])[: body["max_tokens"]]
                with fake.lock:
                    fake.in_flight -= 1
                    if body["max_tokens"] > 8:  # not the warm-up request
                        fake.counts["drafts"] += fake.drafts
                        fake.counts["accepted"] = [
                            a + p
                            for a, p in zip(fake.counts["accepted"], fake.per_pos, strict=True)
                        ]
                choice = {"index": 0, "text": "", "token_ids": tokens, "finish_reason": "length"}
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(tokens)}
                self._send(200, {"choices": [choice], "usage": usage})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_spec_metrics_are_summed_over_engines_and_positions():
    from draftsmith.train.report.served import parse_spec_metrics

    text = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 45.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 6.0
vllm:generation_tokens_total{engine="0",model_name="m"} 99.0
"""
    assert parse_spec_metrics(text) == {
        "drafts": 15,
        "draft_tokens": 45,
        "accepted": 9,
        "accepted_per_pos": [6, 3],
    }
    assert parse_spec_metrics("")["accepted_per_pos"] == []


def test_measure_holds_c_requests_in_flight_and_reads_tau_from_the_counters():
    from draftsmith.train.datagen.endpoint import EndpointClient
    from draftsmith.train.report.served import measure, read_spec_metrics

    prompts = [[1, 2, i] for i in range(8)]
    with FakeVLLM(lambda p: [5] * 10, drafts=4, per_pos=(3, 1), delay=0.05) as srv:
        client = EndpointClient(srv.url)
        level = measure(
            client,
            "tiny",
            prompts,
            max_new_tokens=10,
            stop_token_ids=[0],
            concurrency=4,
            metrics=lambda: read_spec_metrics(srv.url),
        )
        assert srv.max_in_flight == 4
    assert level["requests"] == 8 and level["new_tokens"] == 80
    assert level["spec_decode"]["drafts"] == 32 and level["spec_decode"]["accepted"] == 32
    # Every forward emits its accepted tokens + 1: 80 tokens, 32 accepted -> 48 forwards.
    assert level["acceptance_length"] == pytest.approx(80 / 48)
    assert level["acceptance_rate_per_position"] == [0.75, 0.25]
    assert 0.05 <= level["latency_p50_s"] <= level["latency_p95_s"]
    assert level["tokens_per_second"] == pytest.approx(80 / level["wall_s"])


def test_bench_serves_urls_and_flags_a_tau_gap(setup, capsys):
    """--vllm-url plain=... ngram=...: the finished bench is kept, the servers are measured at
    each concurrency, the n-gram server's τ is compared with ours and its gap flagged."""
    import shutil

    argv = setup["argv"]
    # A copy of the finished bench: both temperatures are kept, not measured again.
    shutil.copytree(setup["out"].parent, setup["root"] / "served")
    out = setup["root"] / "served" / setup["out"].name
    greedy = json.loads(out.with_name("bench.t0.json").read_text())
    ours = greedy["methods"][0]  # ngram
    served_ids = [p["id"] for p in ours["per_prompt"]][:3]

    def answer(prompt):  # the same 12 tokens for both servers: outputs identical
        return list(range(3, 15))

    with (
        FakeVLLM(answer, delay=0.02) as plain,
        FakeVLLM(answer, drafts=6, per_pos=(5, 4, 0), delay=0.01) as spec,
    ):
        code = cli(
            [
                "bench",
                *argv,
                "--out",
                str(out),
                "--vllm-url",
                f"plain={plain.url}",
                f"ngram={spec.url}",
                "--served-concurrency",
                "1",
                "2",
                "--served-limit",
                "3",
            ]
        )
    text = capsys.readouterr().out
    assert code == 0 and text.count("already measured") == 2
    report = json.loads(out.with_suffix(".json").read_text())
    served = report["served"]
    assert served["prompt_ids"] == [str(i) for i in served_ids]
    assert [r["label"] for r in served["rows"]] == ["plain", "ngram"]
    levels = served["rows"][1]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    for lv in levels:
        assert lv["identical_to_plain"] == 3 and lv["speedup"] > 0
        # 12 tokens and 9 accepted per request: 3 forwards each, τ = 4 (ours is far lower).
        assert lv["acceptance_length"] == pytest.approx(4.0)
        assert lv["acceptance_rate_per_position"] == pytest.approx([5 / 6, 4 / 6, 0.0])
        assert lv["tau_ours"] < 3.6 and lv["tau_gap_flag"] is True and "outputs" not in lv
    md = out.with_suffix(".md").read_text()
    assert "## Served by vLLM" in md and "over 10%" in md
    plot = out.with_name("bench_plots") / "served_vs_concurrency.png"
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert "served: ngram c=2" in text


def test_serving_flags_are_checked(setup, tmp_path, capsys):
    profile = str(setup["profile"])
    out = str(tmp_path / "b")
    argv = ["bench", "--cost-profile", profile, "--out", out]
    assert cli([*argv, "--shard", "0/2", "--vllm-url", "http://127.0.0.1:1"]) == 2
    assert "serve once, after merging" in capsys.readouterr().err
    assert cli([*argv, "--vllm-python", str(tmp_path / "nope" / "python")]) == 2
    assert "nope/python not found" in capsys.readouterr().err


def test_evaluate_runs_through_the_dispatch_the_cli_hands_in(tmp_path, setup, capsys):
    """The recipe never imports the CLI: ``draftsmith bench`` hands its dispatch in (every
    evaluate run goes through it), and without one the bench stops on a usage error naming the
    command, before it runs or writes anything."""
    from draftsmith.recipes import bench

    calls = []

    def dispatch(argv: list[str]) -> int:
        calls.append(argv)
        return 130

    assert bench.main([*setup["argv"], "--out", str(tmp_path / "a" / "b")], call=dispatch) == 130
    assert [a[0] for a in calls] == ["evaluate"]
    assert bench.main([*setup["argv"], "--out", str(tmp_path / "c" / "b")]) == 2
    assert "`draftsmith bench ...`" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_bench_reports_auto_as_its_own_shape(setup, tmp_path):
    """``auto:KIND=DIR`` runs through the bench (flags passed to evaluate), greedy and sampled:
    its shape is ``auto`` (no chain recommendation), with the decision's record."""
    argv = setup["argv"]
    target = argv[argv.index("--target") + 1]
    eagle = str(setup["run_dir"] / "best")
    out = tmp_path / "auto"
    code = cli(
        [
            "bench", "--target", target, "--drafter", "ngram", f"auto:eagle-tree={eagle}",
            "--k", "3", "--temperatures", "0", "0.7", "--max-new-tokens", "8", "--limit", "2",
            "--no-reference-plain", "--calibration-limit", "2", "--cost-profile",
            str(setup["profile"]), "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.with_suffix(".json").read_text())
    for run in report["runs"]:
        auto = run["methods"][1]
        assert auto["method"].startswith("auto[") and auto["shape"] == "auto"
    assert all(r["method"].startswith("ngram") for r in report["recommendations"])
    assert out.with_suffix(".md").is_file()
