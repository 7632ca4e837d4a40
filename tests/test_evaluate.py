"""The evaluation recipe end to end on a tiny model: JSON fields, losslessness, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.recipes.cli import main as cli
from draftsmith.recipes.evaluate import main as evaluate

ROOT = Path(__file__).resolve().parents[1]


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


def test_wandb_offline_logging(tmp_path, tiny_target_dir, monkeypatch, fresh_wandb):
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
    assert cli(["train", "eagel"]) == 2
    assert "unknown recipe 'eagel' (did you mean 'eagle'?)" in capsys.readouterr().err


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


def test_settings_of_drafters_not_run_are_refused(tmp_path, tiny_target_dir, capsys):
    """Each drafter kind declares the settings only it reads (heads/registry.py)."""
    code, _ = _run(tmp_path, "--target", tiny_target_dir, "--drafter", "ngram", "--draft-layers", 0)
    assert code == 2
    assert "draft_model/draft_layers need drafter: draft-lm or hf-assisted" in (
        capsys.readouterr().err
    )


def test_hf_assisted_matches_our_loop_with_the_same_draft(tmp_path, tiny_target_dir):
    """transformers' assisted generation runs beside our loop, with counters that add up."""
    code, res = _run(
        tmp_path,
        "--target",
        tiny_target_dir,
        "--drafter",
        "draft-lm",
        "hf-assisted",
        "--draft-layers",
        "0",
        "3",
        "--k",
        3,
        "--max-new-tokens",
        20,
        "--limit",
        3,
    )
    assert code == 0
    ours, hf = res["methods"]
    assert hf["method"] == "hf-assisted[pruned [0, 3]]"
    assert ours["identical_to_target"] is True and hf["identical_to_target"] is True
    for m in (ours, hf):
        # Every target forward emits its accepted drafts plus one token of its own.
        assert m["new_tokens"] == m["target_forwards"] + m["accepted_tokens"], m["method"]
        assert sum(a * m["draft_steps"] for a in m["acceptance_rate_per_position"]) == (
            pytest.approx(m["accepted_tokens"])
        )
        assert 0 < m["draft_time_fraction"] < 1
    # HF verifies its first draft together with the prompt (no separate prefill forward), so its
    # drafts start one token earlier than ours and the counts need not match; both draft k a step.
    # k drafts a step, fewer only where the token budget ends (at most once per prompt).
    assert 3 * (hf["draft_steps"] - 3) <= hf["proposed_tokens"] <= 3 * hf["draft_steps"]
    assert hf["target_forwards"] >= hf["draft_steps"] >= hf["target_forwards"] - 3


def test_hf_assisted_step_accounting():
    from draftsmith.heads.hf_assisted import _verification_steps

    # Prompt of 10; forward 0 verifies 3 drafts with the prompt and accepts 2 (emits 3, the cache
    # keeps 12); forward 1 is fed 1 + 3 tokens and accepts 0 (emits 1, cache 13); forward 2
    # accepts all 3 and emits 4, which ends the output: 3 + 1 + 4 = 8 new tokens.
    steps = _verification_steps([0, 12, 13], [13, 4, 4], prompt_len=10, new_tokens=8)
    assert steps == [(3, 2), (3, 0), (3, 3)]
    # A plain prefill first (nothing drafted) is not a drafting step.
    assert _verification_steps([0, 10], [10, 4], prompt_len=10, new_tokens=3) == [(3, 1)]


def test_shards_merge_into_the_whole_run(tmp_path, tiny_target_dir):
    common = [
        "--target",
        tiny_target_dir,
        "--drafter",
        "ngram",
        "draft-lm",
        "--draft-layers",
        "0",
        "--k",
        2,
        "--max-new-tokens",
        12,
        "--limit",
        5,
    ]
    parts = []
    for shard in ("0/2", "1/2"):
        out = tmp_path / f"shard{shard[0]}.json"
        assert evaluate([*map(str, common), "--shard", shard, "--out", str(out)]) == 0
        parts.append(out)
    shard0 = json.loads(parts[0].read_text())
    assert shard0["prompts_evaluated"] == 3  # prompts 0, 2, 4 of 5
    merged_path = tmp_path / "merged.json"
    assert evaluate(["--merge", *map(str, parts), "--out", str(merged_path)]) == 0
    merged = json.loads(merged_path.read_text())
    for i, m in enumerate(merged["methods"]):
        a, b = (json.loads(p.read_text())["methods"][i] for p in parts)
        assert m["num_prompts"] == 5
        assert m["new_tokens"] == a["new_tokens"] + b["new_tokens"]
        assert m["target_forwards"] == a["target_forwards"] + b["target_forwards"]
        assert m["wall_time_s"] == pytest.approx(a["wall_time_s"] + b["wall_time_s"])
        assert m["baseline_wall_time_s"] == pytest.approx(
            a["baseline_wall_time_s"] + b["baseline_wall_time_s"]
        )
        assert m["identical_to_target"] is True
    # Merging one file reproduces its own metrics exactly.
    one = tmp_path / "one.json"
    assert evaluate(["--merge", str(parts[0]), "--out", str(one)]) == 0
    again = json.loads(one.read_text())
    for m, orig in zip(again["methods"], shard0["methods"], strict=True):
        for key in ("acceptance_length", "acceptance_rate_per_position", "speedup", "new_tokens"):
            assert m[key] == pytest.approx(orig[key]), key
    # Overlapping shards and different settings are refused, naming the problem.
    with pytest.raises(ValueError, match="more than one file"):
        from draftsmith.train.decoding.results import merge_results

        merge_results([parts[0], parts[0]])
    other = tmp_path / "other.json"
    assert evaluate([*map(str, common), "--k", "3", "--shard", "1/2", "--out", str(other)]) == 0
    with pytest.raises(ValueError, match=r"settings differ.*k"):
        merge_results([parts[0], other])


def test_max_minutes_stops_starting_prompts(tmp_path, tiny_target_dir):
    code, res = _run(
        tmp_path,
        "--target",
        tiny_target_dir,
        "--drafter",
        "ngram",
        "--max-new-tokens",
        8,
        "--limit",
        4,
        "--max-minutes",
        1e-9,
    )
    assert code == 0
    # The first prompt always runs (the clock is read before each prompt after the first).
    assert res["prompts_evaluated"] == res["num_prompts"] < 4


@pytest.mark.parametrize("warmup", [None, 1])
def test_warmup_prompts_decode_untimed_before_the_timed_ones(
    tmp_path, tiny_target_dir, monkeypatch, warmup
):
    """On a CPU by default one 8-token run per method; --warmup-prompts N: N full-length decodes
    of every method, plain included, none of them in the results."""
    from draftsmith.recipes import evaluate as module

    calls = []
    real = module.generate

    def counted(target, ids, drafter, **kwargs):
        calls.append((drafter is None, kwargs["max_new_tokens"]))
        return real(target, ids, drafter, **kwargs)

    monkeypatch.setattr(module, "generate", counted)
    extra = [] if warmup is None else ["--warmup-prompts", warmup]
    args = ["--target", tiny_target_dir, "--drafter", "ngram", "--max-new-tokens", 10]
    code, res = _run(tmp_path, *args, "--limit", 2, *extra)
    assert code == 0 and res["prompts_evaluated"] == 2
    # Prompt by prompt, the order alternating: the first prompt plain, plain in the other dtype
    # (the reference), then n-gram; the second n-gram first.
    timed = [(True, 10), (True, 10), (False, 10), (False, 10), (True, 10), (True, 10)]
    if warmup is None:
        assert calls == [(False, 8), (True, 8), *timed]
    else:  # full length, plain included
        assert calls == [(True, 10), (False, 10), (True, 10), *timed]


def test_bad_shard_is_named(tmp_path, tiny_target_dir, capsys):
    code, _ = _run(tmp_path, "--target", tiny_target_dir, "--shard", "2/2")
    assert code == 2
    assert "shard" in capsys.readouterr().err


def test_hf_assisted_default_schedule_beside_adaptive_ours(tmp_path, tiny_target_dir):
    """transformers' own draft-length heuristics against our cost-aware draft length."""
    code, res = _run(
        tmp_path,
        "--target",
        tiny_target_dir,
        "--drafter",
        "draft-lm",
        "hf-assisted",
        "--draft-layers",
        "0",
        "3",
        "--adaptive-k",
        "--hf-assistant",
        "transformers",
        "--max-new-tokens",
        12,
        "--limit",
        2,
    )
    assert code == 0
    ours, hf = res["methods"]
    assert hf["method"] == "hf-assisted-default[pruned [0, 3]]"
    assert "mean_draft_length" in ours and "mean_draft_length" not in hf
    assert ours["identical_to_target"] is True and hf["identical_to_target"] is True
    assert hf["new_tokens"] == hf["target_forwards"] + hf["accepted_tokens"]


def test_evaluate_bf16_reports_same_dtype_and_fastest_plain(tmp_path, tiny_target_dir):
    code, res = _run(
        tmp_path,
        "--target",
        tiny_target_dir,
        "--drafter",
        "ngram",
        "--dtype",
        "bfloat16",
        "--max-new-tokens",
        16,
        "--limit",
        3,
    )
    assert code == 0
    assert res["dtype"] == "bfloat16"
    assert res["reference_plain"]["dtype"] == "float32"
    assert all("reference_counters" in p for p in res["per_prompt"])
    fastest = max(res["baseline_tokens_per_second"], res["reference_plain"]["tokens_per_second"])
    assert res["fastest_plain_tokens_per_second"] == pytest.approx(fastest)
    assert res["speedup_vs_fastest_plain"] == pytest.approx(res["tokens_per_second"] / fastest)
    assert res["speedup_vs_fastest_plain"] <= res["speedup"] + 1e-9
    assert 0.0 <= res["identical_rate"] <= 1.0
    assert res["machine_load"]["before"]["cpu_count"] >= 1


def test_divergence_measures_the_logit_gap(target):
    import torch

    from draftsmith.train.decoding.results import NEAR_TIE_LOGIT_GAP, divergence

    prompt = torch.tensor([1, 2, 3, 4])
    logits = target(input_ids=prompt[None]).logits[0, -1]
    best, second = torch.topk(logits, 2).indices.tolist()
    worst = int(logits.argmin())
    # Same first token, then the plain run takes the argmax and the other run a different token.
    tie = divergence(target, prompt, [best], [second])
    assert tie["position"] == 0 and tie["plain_token"] == best
    assert tie["logit_gap"] == pytest.approx(float(logits[best] - logits[second]), abs=1e-5)
    far = divergence(target, prompt, [best], [worst])
    assert far["logit_gap"] > NEAR_TIE_LOGIT_GAP and not far["near_tie"]


def test_fp32_drafters_beside_a_bf16_target_stay_lossless(tmp_path, tiny_target_dir):
    """``--draft-dtype float32``: the EAGLE-3 drafter and the draft LM run in fp32 while the target
    verifies in bf16; features cross the dtype boundary and the run stays lossless."""
    import torch

    from draftsmith.heads.eagle import EagleConfig, build_drafter, save_drafter
    from draftsmith.train.target_model.load import load_target

    target, _ = load_target(str(tiny_target_dir))
    drafter = build_drafter(target, EagleConfig.from_target(target.config, 3), seed=0)
    save_drafter(drafter.to(torch.bfloat16), tmp_path / "eagle3")  # saved like a bf16 run
    code, res = _run(
        tmp_path,
        "--target",
        tiny_target_dir,
        "--drafter",
        f"eagle={tmp_path / 'eagle3'}",
        f"eagle-tree={tmp_path / 'eagle3'}",
        "draft-lm",
        "--draft-layers",
        "0",
        "3",
        "--dtype",
        "bfloat16",
        "--draft-dtype",
        "float32",
        "--no-reference-plain",
        "--max-new-tokens",
        12,
        "--limit",
        2,
    )
    assert code == 0
    assert [m["draft_dtype"] for m in res["methods"]] == ["float32"] * 3
    assert all(m["dtype"] == "bfloat16" for m in res["methods"])
    # bf16 verification may flip exact ties; exit 0 says every difference was a near-tie.
    assert all(m["identical_rate"] >= 0 for m in res["methods"])


@pytest.mark.parametrize("gap, code", [(0.1, 0), (5.0, 1)])
def test_differing_outputs_are_reported_by_prompt_id(
    tmp_path, tiny_target_dir, monkeypatch, capsys, gap, code
):
    """An output that differs from plain decoding is judged by its logit gap: in bf16 a near-tie
    is reported (exit 0), a real difference names the prompt ids (exit 1) — never a crash."""
    import draftsmith.recipes.evaluate as ev

    real_generate = ev.generate

    def wrong_last_token(target, ids, drafter, **kwargs):
        out = real_generate(target, ids, drafter, **kwargs)
        if drafter is not None:  # the speculative run ends on a different token
            out.tokens = [*out.tokens[:-1], (out.tokens[-1] + 1) % 64]
        return out

    def fixed_gap(target, prompt, plain, spec):
        return {"position": len(plain) - 1, "logit_gap": gap, "near_tie": gap <= 0.5}

    monkeypatch.setattr(ev, "generate", wrong_last_token)
    monkeypatch.setattr(ev, "divergence", fixed_gap)
    result_code, res = _run(
        tmp_path,
        "--target",
        tiny_target_dir,
        "--drafter",
        "ngram",
        "--dtype",
        "bfloat16",
        "--no-reference-plain",
        "--max-new-tokens",
        8,
        "--limit",
        2,
    )
    assert result_code == code
    assert res["identical_rate"] == 0.0
    assert [t["id"] for t in res["near_ties"]] == [p["id"] for p in res["per_prompt"]]
    err = capsys.readouterr()
    if code:
        assert "differs from plain greedy for prompts" in err.err
    else:
        assert "each at a near-tie" in err.out


def test_stopped_run_resumes_where_it_stopped(tmp_path, tiny_target_dir, monkeypatch, capsys):
    """Ctrl-C keeps the finished prompts; the same command measures only the rest and its
    results equal an uninterrupted run's (every counter but the clock)."""
    import draftsmith.recipes.evaluate as ev
    from draftsmith.train.decoding.partial import partial_path

    common = [
        "--target",
        str(tiny_target_dir),
        "--drafter",
        "ngram",
        "draft-lm",
        "--draft-layers",
        "0",
        "--k",
        "2",
        "--max-new-tokens",
        "10",
        "--limit",
        "5",
    ]
    whole = tmp_path / "whole.json"
    assert evaluate([*common, "--out", str(whole)]) == 0
    assert not partial_path(whole).exists()  # removed once the results are written

    out = tmp_path / "resumed.json"
    real, calls = ev.generate, []

    def interrupted(*args, **kwargs):  # Ctrl-C in the third prompt's plain run
        if kwargs["max_new_tokens"] == 10:  # not a warm-up run
            calls.append(1)  # 4 runs per prompt: plain, the fp32/bf16 reference, 2 drafters
            if len(calls) == 2 * 4 + 1:
                raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ev, "generate", interrupted)
    assert evaluate([*common, "--out", str(out)]) == 130
    assert "2 of 5 prompts done" in capsys.readouterr().err
    assert not out.exists() and partial_path(out).is_file()
    lines = partial_path(out).read_text().splitlines()
    assert len(lines) == 1 + 2 + 1  # header, two prompts, the stopped segment

    monkeypatch.setattr(ev, "generate", real)
    assert evaluate([*common, "--threads", "1", "--out", str(out)]) == 0  # threads may change
    assert "resuming: 2 of 5 prompts already done" in capsys.readouterr().out
    a, b = json.loads(whole.read_text()), json.loads(out.read_text())
    assert b["prompts_evaluated"] == 5 and b["resumed_prompts"] == 2
    assert len(b["machine_load"]["segments"]) == 2
    for ma, mb in zip(a["methods"], b["methods"], strict=True):
        assert [p["id"] for p in mb["per_prompt"]] == [p["id"] for p in ma["per_prompt"]]
        for key in ("new_tokens", "target_forwards", "acceptance_length", "draft_steps"):
            assert mb[key] == ma[key], key
        assert mb["acceptance_rate_per_position"] == ma["acceptance_rate_per_position"]
        assert mb["identical_to_target"] is True
    assert not partial_path(out).exists()


def test_resume_refuses_other_settings_and_no_resume_starts_over(tmp_path, tiny_target_dir, capsys):
    from draftsmith.train.decoding.partial import partial_path

    common = ["--target", str(tiny_target_dir), "--max-new-tokens", "8", "--limit", "3"]
    out = tmp_path / "r.json"
    assert evaluate([*common, "--max-minutes", "1e-9", "--out", str(out)]) == 0
    assert partial_path(out).is_file()  # stopped by the budget: kept for the rerun
    capsys.readouterr()
    assert evaluate([*common, "--k", "3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "other settings (k)" in err and "--no-resume" in err
    assert evaluate([*common, "--k", "3", "--no-resume", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["prompts_evaluated"] == 3
    assert "resumed_prompts" not in json.loads(out.read_text())
    assert not partial_path(out).exists()


def test_partial_file_drops_a_line_cut_by_a_kill(tmp_path):
    from draftsmith.train.decoding.partial import PartialRun

    out = tmp_path / "r.json"
    run = PartialRun(out, {"k": 2, "threads": 1}, ["plain", "ngram"])
    assert run.load(resume=True) == {}
    run.add("a", [{"x": 1}, {"x": 2}])
    with open(run.path, "a") as f:
        f.write('{"id": "b", "entries": [{"x"')  # killed mid-write
    again = PartialRun(out, {"k": 2, "threads": 2}, ["plain", "ngram"])
    assert again.load(resume=True) == {"a": [{"x": 1}, {"x": 2}]}
    again.add("b", [{"x": 3}, {"x": 4}])
    third = PartialRun(out, {"k": 2}, ["plain", "ngram"])
    assert set(third.load(resume=True)) == {"a", "b"}
    other = PartialRun(out, {"k": 2}, ["plain", "suffix"])
    with pytest.raises(Exception, match="other settings"):
        other.load(resume=True)


def test_sigterm_keeps_the_finished_prompts_and_exits_130(tiny_target_dir, tmp_path):
    """A real SIGTERM (a scheduler's, or `kill` of a background run) stops evaluate like Ctrl-C,
    through the one stop mechanism (train/core/stop.py): finished prompts stay in the partial
    file and the same command continues."""
    import signal
    import subprocess
    import sys

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {i} " * 8}) + "\n" for i in range(40)))
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "recipes" / "evaluate.py"), "--target", str(tiny_target_dir)]
    cmd += ["--prompts", str(prompts), "--drafter", "ngram", "--max-new-tokens", "48"]
    cmd += ["--threads", "1", "--out", str(out)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in proc.stderr:  # one line per finished prompt when stderr is not a terminal
        if line.startswith("[1/40]"):
            proc.send_signal(signal.SIGTERM)
            break
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "the same command continues" in err
    kept = Path(f"{out}.partial.jsonl").read_text().splitlines()
    finished = [x for x in kept if json.loads(x).get("entries")]
    assert 1 <= len(finished) < 40
    assert not out.exists()


def test_results_name_how_long_each_drafter_trained(tmp_path):
    """A drafter evaluated from a training run's best/ (or drafter/) carries the run's training
    minutes, steps and commit into the results; a drafter without a run carries none."""
    from draftsmith.recipes.evaluate import drafter_training

    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    metrics = {"recipe": "eagle", "train_seconds": 745.8, "steps": 660, "git_commit": "d260927"}
    (run / "training_metrics.json").write_text(json.dumps({**metrics, "stop_reason": "done"}))
    got = drafter_training(str(run / "best"))
    assert got == {
        "run": str(run),
        "recipe": "eagle",
        "training_minutes": 12.43,
        "steps": 660,
        "stop_reason": "done",
        "git_commit": "d260927",
    }
    assert drafter_training(str(run)) == got
    assert drafter_training(str(tmp_path / "export")) is None and drafter_training(None) is None
