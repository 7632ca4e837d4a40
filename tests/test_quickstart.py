"""``draftsmith quickstart`` end to end on a tiny target: every stage, rerun, resume, failures.

One job runs once per module (about 15 s on one thread); the tests then rerun it, cut a stage
short, or change a setting, and check what is skipped and what is redone.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftsmith.recipes.cli import main as cli
from draftsmith.recipes.quickstart import STATE_FILE, QuickstartConfig
from draftsmith.train.jobs.budget import RATES, make_plan
from draftsmith.train.report.quickstart import vllm_serve_command
from tests.conftest import byte_tokenizer, tiny_llama

STAGES = ["prepare", "prompts", "distill", "tokenize", "cache", "train", "evaluate", "export"]
# float32 evaluation: greedy output must then be the target's own, token for token (in bf16 a
# verify forward may round a near-tie differently; tests/test_evaluate.py covers that path).
SMALL = [
    "--num-prompts",
    "3",
    "--eval-prompts",
    "2",
    "--max-new-tokens",
    "8",
    "--train-steps",
    "4",
    "--dtype",
    "float32",
    "--threads",
    "1",
    "--device",  # passed to every stage that runs a model
    "cpu",
    "--no-progress",
]


def writer_target(path: Path) -> Path:
    """A tiny target that writes usable Magpie prompts: its lm_head rows outside a-p, space and
    EOS point away from the user-turn prefix's mean hidden state, and the EOS row is zero, so a
    turn of letters and spaces ends every few dozen tokens (as in tests/test_magpie.py). Each of
    those rows gets its own small noise: equal rows would tie exactly wherever the hidden state
    points the other way, and an exact tie's argmax may differ between forwards of two widths."""
    from draftsmith.train.datagen.user_turn import user_turn_prefix

    tok = byte_tokenizer()
    model = tiny_llama(vocab_size=len(tok), init_std=0.1)
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    allowed = {tok.convert_tokens_to_ids(c) for c in "abcdefghijklmnop"}
    allowed.add(tok.convert_tokens_to_ids("Ġ"))
    with torch.no_grad():
        prefix = user_turn_prefix(tok).ids
        mean = model.model(torch.tensor([prefix])).last_hidden_state[0].mean(0)
        away = -30 * mean / mean.norm() ** 2
        gen = torch.Generator().manual_seed(0)
        for t in range(len(tok)):
            if t not in allowed:
                model.lm_head.weight[t] = away + 0.05 * torch.randn(away.shape, generator=gen)
        model.lm_head.weight[tok.eos_token_id] = 0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run_job(argv: list[str]) -> tuple[int, str]:
    """Run ``draftsmith ARGV`` in-process; return the exit code and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli([str(a) for a in argv])
    return code, out.getvalue()


def state(out: Path) -> dict:
    return json.loads((out / STATE_FILE).read_text())


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("quickstart")
    target = writer_target(root / "target")
    mine = root / "mine.jsonl"
    mine.write_text(
        json.dumps({"prompt": "Name three colours of the sea at dusk."})
        + "\n"
        + json.dumps({"prompt": "Write a haiku about a lighthouse."})
        + "\n"
    )
    out = root / "out"
    argv = ["quickstart", "--target", target, "--prompts", mine, "--out-dir", out, *SMALL]
    code, printed = run_job(argv)
    return SimpleNamespace(root=root, target=target, out=out, argv=argv, code=code, printed=printed)


def test_main_job_runs_every_stage(job):
    from draftsmith.train.export.eagle import load_export
    from draftsmith.train.target_model.load import load_target

    assert job.code == 0, job.printed
    out = job.out
    st = state(out)
    assert list(st["stages"]) == STAGES
    assert all(s["status"] == "done" and s["runs"] == 1 for s in st["stages"].values())
    assert all(
        s["seconds"] >= 0 and s["command"].startswith("draftsmith ") for s in st["stages"].values()
    )
    assert st["versions"]["torch"] and st["machine"]["cpu_count"] >= 1 and st["command"]
    # One device for the job: every stage that runs a model was given it, and the plan was sized
    # by rates the probe measured there on the target (the tiny one: far faster than SmolLM2).
    for name in ("prompts", "distill", "cache", "train", "evaluate", "export"):
        assert " --device cpu" in st["stages"][name]["command"], name
    assert st["device"]["device"] == "cpu"
    probe = st["plan"]["probe"]
    assert probe["probed"] is True and probe["device"]["device"] == "cpu"
    assert probe["dtype"] == "float32" and probe["batch_size"] == 64
    assert st["plan"]["rates"] == probe["rates"]
    assert probe["rates"]["cache_tokens_per_s"] > 10 * RATES.cache_tokens_per_s
    assert "rates measured on cpu" in job.printed

    # Prompts: the shipped train split, the user's file, then prompts the target wrote.
    prompts = [json.loads(x) for x in (out / "data/prompts.jsonl").read_text().splitlines()]
    sources = [p["source"] for p in prompts]
    assert (
        sources.count("shipped") == 32
        and sources[32:34] == ["input:" + str(job.root / "mine.jsonl")] * 2
    )
    assert sources[34:] == ["magpie"] * 3
    answers = (out / "data/answers.jsonl").read_text().splitlines()
    assert len(answers) == 37
    held_out = {r.messages[-1]["content"] for r in _heldout()}
    assert not held_out & {p["prompt"] for p in prompts}  # never train on held-out prompts
    for path in (
        "data/tokenized/dataset_info.json",
        "data/cache/manifest.json",
        "eagle3/drafter/config.json",
        "eagle3/training_metrics.json",
        "export/config.json",
        "plots/training.png",
        "plots/evaluation.png",
        "summary.md",
    ):
        assert (out / path).is_file(), path
    metrics = json.loads((out / "eagle3/training_metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["config"]["hidden_states"] == "offline"
    assert metrics["config"]["mixed_precision"] == "bf16" and metrics["config"]["ttt_steps"] == 3

    # The evaluation: τ >= 1, lossless (bf16: any difference is a near-tie), on held-out prompts.
    res = json.loads((out / "eval.json").read_text())
    assert res["acceptance_length"] >= 1.0 and res["num_prompts"] == 2
    assert res["config"]["dtype"] == "float32" and res["config"]["split"] == "auto"
    assert res["identical_to_target"] is True
    assert {p["id"] for p in res["per_prompt"]} <= {r.id for r in _heldout()}

    # The export reloads as the drafter it came from and advertises k.
    target, _ = load_target(str(job.target))
    drafter = load_export(out / "export", target)
    assert drafter.config.version == 3
    config = json.loads((out / "export/config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3

    # The summary names the results, the paths and the serve command.
    serve = vllm_serve_command(Path(job.target).resolve(), (out / "export").resolve(), 3)
    assert serve in job.printed and serve in (out / "summary.md").read_text()
    assert st["summary"]["vllm_serve"] == serve
    spec = json.loads(shlex.split(serve)[-1])
    assert spec == {
        "method": "eagle3",
        "num_speculative_tokens": 3,
        "model": str((out / "export").resolve()),
    }
    for word in (
        "[1/8] prepare target",
        "[3/8] self-distil 37 prompts",
        "[8/8] export",
        "eval.json",
        "evaluation.png",
        "τ",
    ):
        assert word in job.printed, word


def _heldout():
    from draftsmith.train.data.prompts import load_prompts

    return load_prompts(split="heldout")


def test_rerun_skips_finished_stages(job):
    before = state(job.out)["plan"]
    code, printed = run_job(job.argv)
    assert code == 0
    assert printed.count("done before, skipped") == len(STAGES)
    st = state(job.out)
    # The job's probe is kept: the same command makes the same plan.
    assert st["plan"] == before and "earlier probe, kept" in printed
    assert all(s["runs"] == 1 for s in st["stages"].values())
    assert len(st["invocations"]) >= 2
    assert "vllm serve" in printed  # the summary again


def test_stage_cut_short_resumes(job):
    """A self-distillation killed mid-file and a training run killed before its final save are
    redone from where they stopped; the stages after them, whose inputs come out the same, are
    skipped."""
    out = job.out
    answers = out / "data/answers.jsonl"
    whole = answers.read_bytes()
    lines = whole.splitlines(keepends=True)
    answers.write_bytes(b"".join(lines[:10]) + lines[10][:20])  # killed mid-line
    meta = json.loads((out / "data/answers.jsonl.meta").read_text())
    (out / "data/answers.jsonl.meta").write_text(json.dumps({**meta, "complete": False}))
    st = state(out)
    st["stages"]["distill"]["status"] = "running"
    (out / STATE_FILE).write_text(json.dumps(st))

    code, printed = run_job(job.argv)
    assert code == 0, printed
    assert answers.read_bytes() == whole  # resumed: the same file as one uninterrupted run
    after = state(out)["stages"]
    assert after["distill"]["runs"] == 2
    assert all(after[s]["runs"] == 1 for s in STAGES if s != "distill")

    # Training killed between its last checkpoint and its final save: the recipe resumes.
    import shutil

    shutil.rmtree(out / "eagle3/drafter")
    code, printed = run_job(job.argv)
    assert code == 0, printed
    metrics = json.loads((out / "eagle3/training_metrics.json").read_text())
    assert metrics["resumed_from"] == 4 and metrics["steps"] == 4
    after = state(out)["stages"]
    assert after["train"]["runs"] == 2 and after["evaluate"]["runs"] == 1


def test_changed_setting_reruns_that_stage_and_later_ones(job):
    before = {name: s["runs"] for name, s in state(job.out)["stages"].items()}
    code, printed = run_job([*job.argv, "--k", "2"])
    assert code == 0, printed
    runs = {name: s["runs"] for name, s in state(job.out)["stages"].items()}
    assert {n for n in STAGES if runs[n] != before[n]} == {"evaluate", "export"}
    assert json.loads((job.out / "eval.json").read_text())["k"] == 2
    assert '"num_speculative_tokens": 2' in printed
    # Back to the module's settings, so the job is as the other tests expect it.
    assert run_job(job.argv)[0] == 0


def test_failing_stage_names_stage_and_command(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    code = cli(["quickstart", "--target", str(missing), "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1
    assert "stage [1/8] prepare target" in err
    assert f"draftsmith prepare-target {missing}" in err
    assert state(tmp_path / "out")["stages"]["prepare"]["status"] == "failed"


def test_bad_inputs_fail_before_any_stage(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    code = cli(["quickstart", "--prompts", str(bad), "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "bad.jsonl:2" in err
    assert not (tmp_path / "out" / STATE_FILE).exists()
    assert cli(["quickstart", "--eval-prompts", "40"]) == 2
    assert "eval_prompts" in capsys.readouterr().err
    # --overwrite deletes only a quickstart's outputs: a directory without its state is refused.
    (tmp_path / "other" / "data").mkdir(parents=True)
    (tmp_path / "other" / "data" / "prompts.jsonl").write_text("mine\n")
    assert cli(["quickstart", "--out-dir", str(tmp_path / "other"), "--overwrite"]) == 2
    assert "not a quickstart's" in capsys.readouterr().err
    assert (tmp_path / "other" / "data" / "prompts.jsonl").read_text() == "mine\n"


def test_default_commands_use_the_shipped_fast_settings(tmp_path):
    """Without flags: bf16 target and autocast, offline cache, 3 TTT steps, bf16 evaluation
    with plain decoding timed in both dtypes (evaluate's default), answers of 128 tokens."""
    from draftsmith.recipes.quickstart import Quickstart

    qs = Quickstart(QuickstartConfig(out_dir=tmp_path), [])
    qs._load_state()
    qs.plan = make_plan(qs.cfg, seeds=32)

    def value(argv, flag):
        return argv[argv.index(flag) + 1]

    prompts = qs._prompts("x").argv
    assert "--include-shipped" in prompts and value(prompts, "--num") == str(qs.plan.magpie)
    assert value(prompts, "--dtype") == "bfloat16" and "--target" not in prompts
    distill = qs._distill().argv
    assert value(distill, "--max-new-tokens") == "128" and value(distill, "--dtype") == "bfloat16"
    cache = qs._cache().argv
    assert value(cache, "--target-dtype") == "bf16" and value(cache, "--preset") == "eagle3"
    train = qs._train().argv
    for flag, want in (
        ("--hidden-states", "offline"),
        ("--target-dtype", "bf16"),
        ("--mixed-precision", "bf16"),
        ("--ttt-steps", "3"),
        ("--lr", "0.0006"),
        ("--draft-vocab-size", "8192"),
    ):
        assert value(train, flag) == want, flag
    assert "--epochs" in train and "--max-minutes" in train
    evaluate = qs._evaluate().argv
    assert value(evaluate, "--dtype") == "bfloat16" and value(evaluate, "--k") == "3"
    assert value(evaluate, "--limit") == str(qs.plan.eval_prompts) and "--prompts" not in evaluate
    assert "--no-reference-plain" not in evaluate


def test_help_shows_an_example(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["quickstart", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "--budget-minutes" in text and "draftsmith quickstart --budget-minutes 120" in text


def test_default_plan_fits_the_budget():
    for minutes in (10, 30, 120):
        plan = make_plan(QuickstartConfig(budget_minutes=minutes), seeds=32)
        assert plan.total_s <= 60 * minutes
        assert 4 <= plan.eval_prompts <= 16
    plan = make_plan(QuickstartConfig(), seeds=32)
    assert 250 <= plan.records <= 400  # ~300 prompts × 128 tokens distil in ~7 min
    assert plan.estimates["train"] >= 5 * 60 and plan.estimates["distill"] <= 9 * 60


def test_ctrl_c_keeps_the_stage_resumable(tmp_path, capsys, job):
    from draftsmith.recipes import quickstart

    def interrupted(argv):
        raise KeyboardInterrupt

    out = tmp_path / "out"
    argv = ["--target", str(job.target), "--out-dir", str(out), *SMALL]
    code = quickstart.main(argv, call=interrupted)  # the dispatch the CLI hands in
    assert code == 130
    assert state(out)["stages"]["prepare"]["status"] == "interrupted"
    assert "resumes: draftsmith quickstart --target" in capsys.readouterr().err


def test_a_command_that_catches_ctrl_c_itself_marks_the_stage_interrupted(tmp_path, capsys, job):
    """evaluate catches Ctrl-C/SIGTERM, keeps its finished prompts and exits 130: the stage is
    interrupted (resumable), not failed."""
    from draftsmith.recipes import quickstart

    out = tmp_path / "out"
    argv = ["--target", str(job.target), "--out-dir", str(out), *SMALL]
    code = quickstart.main(argv, call=lambda argv: 130)
    assert code == 130
    assert state(out)["stages"]["prepare"]["status"] == "interrupted"
    assert "failed" not in capsys.readouterr().err


def test_the_stages_run_through_the_dispatch_the_cli_hands_in(tmp_path, capsys, job):
    """The recipe never imports the CLI: ``draftsmith quickstart`` hands its dispatch in, and
    without one the job stops on a usage error naming the command, before writing anything."""
    from draftsmith.recipes import quickstart

    def argv(out):
        return ["--target", str(job.target), "--out-dir", str(out), *SMALL]

    calls = []

    def dispatch(argv):
        calls.append(argv)
        return 130

    assert quickstart.main(argv(tmp_path / "out"), call=dispatch) == 130
    assert calls and calls[0][0] == "prepare-target"
    assert quickstart.main(argv(tmp_path / "other")) == 2
    assert "`draftsmith quickstart ...`" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_more_prompts_extend_the_data_and_retrain(job):
    """Runs last (it changes the module's job): a larger --num-prompts extends the prompts and
    answers already made, then redoes every later stage from scratch."""
    out = job.out
    prompts_before = (out / "data/prompts.jsonl").read_bytes()
    answers_before = (out / "data/answers.jsonl").read_bytes()
    argv = list(job.argv)
    argv[argv.index("--num-prompts") + 1] = "5"
    before = {name: s["runs"] for name, s in state(out)["stages"].items()}
    code, printed = run_job(argv)
    assert code == 0, printed
    runs = {name: s["runs"] for name, s in state(out)["stages"].items()}
    assert {n for n in STAGES if runs[n] != before[n]} == set(STAGES[1:])
    assert (out / "data/prompts.jsonl").read_bytes().startswith(prompts_before)
    assert (out / "data/answers.jsonl").read_bytes().startswith(answers_before)
    assert len((out / "data/answers.jsonl").read_text().splitlines()) == 39
    metrics = json.loads((out / "eagle3/training_metrics.json").read_text())
    assert metrics["resumed_from"] is None and metrics["steps"] == 4  # trained anew
