"""``draftsmith quickstart`` end to end on a tiny target: every stage, rerun, resume, failures.

One job runs once per module (about 15 s on one thread); the tests then rerun it, cut a stage
short, or change a setting, and check what is skipped and what is redone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftsmith.recipes.cli import main as cli
from draftsmith.recipes.quickstart import STATE_FILE, QuickstartConfig
from draftsmith.train.jobs.budget import (
    RATES,
    TARGET_EPOCHS,
    generation_factor,
    grow_plan,
    make_plan,
    shrink_records,
)
from draftsmith.train.report.quickstart import vllm_serve_command
from tests.conftest import byte_tokenizer, tiny_llama

STAGES = [
    "prepare",
    "prompts",
    "distill",
    "sampled",
    "validation",
    "tokenize",
    "cache",
    "train",
    "evaluate",
    "export",
]
#: The stages the module job runs: with --num-prompts its sampled answers have nothing to do.
RAN = [s for s in STAGES if s != "sampled"]
#: The module job's --prompts file: 12 prompts, so the default slice (a tenth) holds out one.
MINE = [
    "Name three colours of the sea at dusk.",
    "Write a haiku about a lighthouse.",
    "Explain why bread goes stale.",
    "List four uses for a paperclip.",
    "Describe a quiet morning in a small harbour town.",
    "Suggest a name for a grey kitten.",
    "What is the difference between weather and climate?",
    "Give two tips for learning to juggle.",
    "Summarise the plot of a fairy tale in one sentence.",
    "Why do onions make people cry?",
    "Write a limerick about a forgetful robot.",
    "How do bees find their way home?",
]
# float32 in every stage (explicit, so the job is the same on every CPU): greedy evaluation output
# must then be the target's own, token for token (in bf16 a verify forward may round a near-tie
# differently; tests/test_evaluate.py covers that path).
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
    mine.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in MINE))
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
    # --num-prompts fixes the sizes: no sampled answers, so stage 4 is marked done unrun.
    assert st["stages"]["sampled"]["skipped"].startswith("none")
    assert "[4/10] sampled answers: none" in job.printed
    ran = {n: s for n, s in st["stages"].items() if not s.get("skipped")}
    assert all(s["status"] == "done" for s in st["stages"].values())
    assert all(s["runs"] == 1 for s in ran.values())
    assert all(s["seconds"] >= 0 and s["command"].startswith("draftsmith ") for s in ran.values())
    assert st["versions"]["torch"] and st["machine"]["cpu_count"] >= 1 and st["command"]
    # One device for the job: every stage that runs a model was given it, and the plan was sized
    # by rates the probe measured there on the target (the tiny one: far faster than SmolLM2).
    for name in ("prompts", "distill", "validation", "cache", "train", "evaluate", "export"):
        assert " --device cpu" in st["stages"][name]["command"], name
    assert st["device"]["device"] == "cpu"
    probe = st["plan"]["probe"]
    assert probe["probed"] is True and probe["device"]["device"] == "cpu"
    assert probe["dtype"] == probe["target_dtype"] == "float32" and probe["batch_size"] == 64
    assert st["plan"]["dtype"] == "float32" and "plan (float32):" in job.printed
    assert st["plan"]["rates"] == probe["rates"]
    # Far faster (~20x alone; 3.6x measured with three other jobs on the 2 cores).
    assert probe["rates"]["cache_tokens_per_s"] > 2 * RATES.cache_tokens_per_s
    assert "rates measured on cpu" in job.printed

    # Training prompts: the user's file less its validation slice, then prompts the target wrote.
    prompts = [json.loads(x) for x in (out / "data/prompts.jsonl").read_text().splitlines()]
    sources = [p["source"] for p in prompts]
    assert sources == ["input:" + str(job.root / "mine.jsonl")] * 11 + ["magpie"] * 3
    answers = [json.loads(x) for x in (out / "data/answers.jsonl").read_text().splitlines()]
    assert len(answers) == 14
    held_out = {r.messages[-1]["content"] for r in _heldout()}
    assert not held_out & {p["prompt"] for p in prompts}  # never train on held-out prompts

    # Validation like the evaluation: the 32 shipped train prompts (whole records: system
    # prompts and earlier turns too) and one of the user's 12 (a tenth, drawn by --seed),
    # answered by the target, in no training record.
    shipped = [r.messages for r in _heldout("train")]
    val_records = [json.loads(x) for x in (out / "data/val_prompts.jsonl").read_text().splitlines()]
    assert len(shipped) == 32 and [r["messages"] for r in val_records[:32]] == shipped
    assert any(len(m) > 2 for m in shipped)  # a multi-turn record is validated as it is
    assert len(val_records) == 33 and val_records[32]["messages"][0]["content"] in MINE
    val_answers = [json.loads(x) for x in (out / "data/val_answers.jsonl").read_text().splitlines()]
    assert sorted(a["id"] for a in val_answers) == sorted(r["id"] for r in val_records)
    assert all(a["messages"][-1]["role"] == "assistant" for a in val_answers)

    def user_turns(records):  # of prompt records (training) or messages records (validation)
        turns = [r.get("messages") or [{"role": "user", "content": r["prompt"]}] for r in records]
        return {m["content"] for t in turns for m in t if m["role"] == "user"}

    validated = user_turns(val_records)
    assert len(user_turns(answers)) == 14 and not user_turns(answers) & validated
    assert not {p["prompt"] for p in prompts} & validated
    assert "validation: the 32 shipped train prompts + 1 of your 12 (drawn by --seed 0)" in (
        job.printed
    )
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
    assert metrics["config"]["ttt_steps"] == 2  # the TTT unroll is the job's k
    # The train stage validates on the answers to the validation prompts (they choose best/) and
    # on held-back training records (val_split/*, and the gap between the two).
    assert value(shlex.split(st["stages"]["train"]["command"]), "--val-data") == str(
        out / "data/val_answers.jsonl"
    )
    assert metrics["val_data"] == str(out / "data/val_answers.jsonl")
    assert {"val/sim_tau", "val_split/sim_tau", "val/sim_tau_gap"} <= set(metrics["validation"][0])
    # --dtype float32: the target in fp32 and no autocast; the cache stored in bf16 all the same.
    assert metrics["config"]["target_dtype"] == "fp32"
    assert metrics["config"]["mixed_precision"] == "no"
    assert " --target-dtype fp32 --dtype bf16 " in st["stages"]["cache"]["command"]
    for name in ("prompts", "distill", "evaluate"):
        assert " --dtype float32" in st["stages"][name]["command"], name

    # The evaluation: the chain and the 6-node tree of depth k = 2 on one plain baseline, each
    # τ >= 1 and lossless, on held-out prompts.
    evaluation = json.loads((out / "eval.json").read_text())
    chain, tree, ngram, auto = evaluation["methods"]
    assert chain["method"].startswith("eagle3-chain[") and tree["method"].startswith("eagle3-tree[")
    assert ngram["method"].startswith("ngram[") and auto["method"].startswith("auto[eagle3-tree[")
    config = evaluation["config"]
    assert config["k"] == 2 and config["tree_total_tokens"] == 5 and config["tree_topk"] == 4
    assert config["auto_k"] == 4 and config["auto_nodes"] == 16
    assert config["dtype"] == "float32" and config["split"] == "auto"
    shapes = (chain, tree, ngram, auto)
    for res in shapes:
        assert res["acceptance_length"] >= 1.0 and res["num_prompts"] == 2
        assert res["identical_to_target"] is True
        assert {p["id"] for p in res["per_prompt"]} <= {r.id for r in _heldout()}
        assert sum(c["prompts"] for c in res["by_category"].values()) == 2
    # auto: calibrated on the job's validation prompts (never the held-out ones), the verify
    # costs probed, paired against every other shape.
    calibration = auto["decision"]["calibration"]
    assert calibration["prompt_file"] == str(out / "data/val_prompts.jsonl")
    assert calibration["prompts"] == 16 and calibration["learned_nodes"] > 0
    assert (out / "eagle3/best/calibration.json").is_file()
    assert evaluation["verify_costs"]["median_ms"]["chain"]["1"] > 0
    assert [v["against"] for v in auto["versus"]] == [r["method"] for r in shapes[:3]]
    # The job reports the fastest shape (the first on a tie) and shows every one.
    fastest = max(r["speedup_vs_fastest_plain"] for r in shapes)
    reported = next(r for r in shapes if r["speedup_vs_fastest_plain"] == fastest)
    summary = state(out)["summary"]
    assert summary["acceptance_length"] == reported["acceptance_length"]
    assert summary["speedup_vs_fastest_plain"] == fastest
    labels = [
        "chain, k = 2",
        "tree of 5 nodes, depth 2",
        "n-gram lookup, k = 2",
        "auto (tree of up to 16 nodes, depth 4, with lookup)",
    ]
    assert [s["shape"] for s in summary["shapes"]] == labels
    assert summary["shape"] == labels[shapes.index(reported)]
    assert f"{summary['shape']}: τ (tokens per target forward): " in job.printed
    assert "reported: the fastest; vLLM serves the chain" in job.printed
    # summary.md: every shape per category of the held-out prompts.
    markdown = (out / "summary.md").read_text()
    assert "Per category of the held-out prompts" in markdown
    for cat in auto["by_category"]:
        assert f"| {cat} | " in markdown
    # The export's card says what an engine serves of these shapes.
    card = (out / "export/README.md").read_text()
    assert "## What an engine serves of the measurements" in card
    assert "draftsmith's loop's figure" in card and '"method": "ngram"' in card
    # Said exactly when auto was not the fastest.
    assert ("auto was not the fastest shape here" in job.printed) == (reported is not auto)
    assert (
        f"| {labels[0]}{' (reported)' * (reported is chain)} |" in (out / "summary.md").read_text()
    )
    res = chain  # what validation simulates

    # The export reloads as the drafter it came from and advertises k.
    target, _ = load_target(str(job.target))
    drafter = load_export(out / "export", target)
    assert drafter.config.version == 3
    config = json.loads((out / "export/config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2

    # The summary names the results, the paths and the serve command.
    serve = vllm_serve_command(Path(job.target).resolve(), (out / "export").resolve(), 2)
    assert serve in job.printed and serve in (out / "summary.md").read_text()
    assert st["summary"]["vllm_serve"] == serve
    spec = json.loads(shlex.split(serve)[-1])
    assert spec == {
        "method": "eagle3",
        "num_speculative_tokens": 2,
        "model": str((out / "export").resolve()),
    }
    for word in (
        "[1/10] prepare target",
        "[3/10] self-distil 14 prompts",
        "[5/10] answer 33 validation prompts",
        "validated on 33 held-out prompts",
        "[10/10] export",
        "eval.json",
        "evaluation.png",
        "τ",
    ):
        assert word in job.printed, word

    # The summary: the best validation's simulated τ on the validation prompts and on the
    # training records, the evaluated τ and the gap, in the console, summary.md and the state.
    best = next(e for e in metrics["validation"] if e["step"] == metrics["best"]["step"])
    figures = st["summary"]["validation"]
    assert figures["step"] == best["step"] and figures["drafter"] == "best"
    assert figures["sim_tau"] == best["val/sim_tau"] == metrics["best"]["sim_tau"]
    assert figures["split_sim_tau"] == best["val_split/sim_tau"]
    assert figures["evaluated_tau"] == res["acceptance_length"] and figures["prompts"] == 33
    assert figures["gap"] == pytest.approx(best["val/sim_tau"] / res["acceptance_length"] - 1)
    gap = f"{100 * figures['gap']:+.0f} %"
    line = (
        f"validation (best/, step {best['step']}): simulated τ {best['val/sim_tau']:.2f} on the "
        f"33 held-out validation prompts, {best['val_split/sim_tau']:.2f} on held-back training "
        f"records; evaluated τ {res['acceptance_length']:.2f}; gap {gap}"
    )
    assert line in job.printed
    md = (out / "summary.md").read_text()
    assert f"| {best['val/sim_tau']:.2f} |" in md and f"| {best['val_split/sim_tau']:.2f} |" in md
    assert f"| gap, validation vs evaluated τ | {gap} (training records: " in md
    assert f"| τ (tokens per target forward) | {reported['acceptance_length']:.2f} |" in md


def _heldout(split="heldout"):
    from draftsmith.train.data.prompts import load_prompts

    return load_prompts(split=split)


def test_rerun_skips_finished_stages(job):
    before = state(job.out)["plan"]
    code, printed = run_job(job.argv)
    assert code == 0
    # Every stage but the sampled answers, which has nothing to do and says so again.
    assert printed.count("done before, skipped") == len(STAGES) - 1
    assert "sampled answers: none" in printed
    st = state(job.out)
    # The job's probe is kept: the same command makes the same plan.
    assert st["plan"] == before and "earlier probe, kept" in printed
    assert all(s.get("skipped") or s["runs"] == 1 for s in st["stages"].values())
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
    assert all(after[s]["runs"] == 1 for s in RAN if s != "distill")

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
    before = {name: s.get("runs", 0) for name, s in state(job.out)["stages"].items()}
    code, printed = run_job([*job.argv, "--k", "3", "--tree-nodes", "0", "--no-auto"])
    assert code == 0, printed
    runs = {name: s.get("runs", 0) for name, s in state(job.out)["stages"].items()}
    # k is the training's TTT unroll too: training reruns, the data stages do not.
    assert {n for n in RAN if runs[n] != before[n]} == {"train", "evaluate", "export"}
    metrics = json.loads((job.out / "eagle3/training_metrics.json").read_text())
    assert metrics["config"]["ttt_steps"] == 3
    # The chain alone: its result is the file, and the job reports it.
    res = json.loads((job.out / "eval.json").read_text())
    assert res["k"] == 3 and "methods" not in res
    assert state(job.out)["summary"]["shape"] == "chain, k = 3"
    assert "shapes (" not in printed
    assert '"num_speculative_tokens": 3' in printed
    # Back to the module's settings, so the job is as the other tests expect it.
    assert run_job(job.argv)[0] == 0


def test_failing_stage_names_stage_and_command(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    code = cli(["quickstart", "--target", str(missing), "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1
    assert "stage [1/10] prepare target" in err
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
    # The validation slice is of your prompts, and leaves some to train on.
    assert cli(["quickstart", "--val-prompts", "3", "--out-dir", str(tmp_path / "out")]) == 2
    assert "val_prompts: holds out some of --prompts" in capsys.readouterr().err
    two = tmp_path / "two.jsonl"
    two.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    argv = ["quickstart", "--prompts", str(two), "--val-prompts", "2"]
    assert cli([*argv, "--out-dir", str(tmp_path / "out")]) == 2
    assert "val_prompts: 2 of your 2 prompts would leave none" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # --overwrite deletes only a quickstart's outputs: a directory without its state is refused.
    (tmp_path / "other" / "data").mkdir(parents=True)
    (tmp_path / "other" / "data" / "prompts.jsonl").write_text("mine\n")
    assert cli(["quickstart", "--out-dir", str(tmp_path / "other"), "--overwrite"]) == 2
    assert "not a quickstart's" in capsys.readouterr().err
    assert (tmp_path / "other" / "data" / "prompts.jsonl").read_text() == "mine\n"


def planned(tmp_path, monkeypatch, native: bool, **settings):
    """A quickstart planned (``--no-probe``: no model loads) on the CPU, whose bf16 is native or
    not as ``native`` says (patched where ``auto`` is resolved)."""
    from draftsmith.recipes.quickstart import Quickstart
    from draftsmith.train import device

    monkeypatch.setattr(device, "native_bf16", lambda d: native)
    qs = Quickstart(QuickstartConfig(out_dir=tmp_path, probe=False, **settings), [])
    qs._load_state()
    qs._make_plan(32, torch.device("cpu"))
    return qs


def value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_default_commands_use_the_shipped_fast_settings(tmp_path, monkeypatch):
    """Without flags, where bf16 is native: bf16 target and autocast, offline cache, 3 TTT
    steps, bf16 evaluation with plain decoding timed in both dtypes (evaluate's default),
    answers of 128 tokens."""
    qs = planned(tmp_path, monkeypatch, native=True)

    prompts = qs._prompts("x").argv
    assert value(prompts, "--num") == str(qs.plan.magpie)
    # The shipped train prompts are the validation set: excluded from the training prompts.
    assert "--include-shipped" not in prompts
    assert value(prompts, "--exclude") == str(tmp_path / "data/val_prompts.jsonl")
    assert value(prompts, "--dtype") == "bfloat16" and "--target" not in prompts
    distill = qs._distill().argv
    assert value(distill, "--max-new-tokens") == "128" and value(distill, "--dtype") == "bfloat16"
    cache = qs._cache().argv
    assert value(cache, "--target-dtype") == "bf16" and value(cache, "--preset") == "eagle3"
    assert value(cache, "--dtype") == "bf16"
    train = qs._train().argv
    for flag, want in (
        ("--hidden-states", "offline"),
        ("--target-dtype", "bf16"),
        ("--mixed-precision", "bf16"),
        ("--ttt-steps", "2"),  # --k's default: the unroll drafts as deep as the job does
        ("--lr", "0.0006"),
        ("--draft-vocab-size", "8192"),
    ):
        assert value(train, flag) == want, flag
    assert "--epochs" in train and "--max-minutes" in train and "--fit-schedule" in train
    assert value(train, "--val-data") == str(tmp_path / "data/val_answers.jsonl")
    validation = qs._validation().argv
    assert validation[:2] == ["data", "distill"] and value(validation, "--split") == "all"
    assert value(validation, "--input") == str(tmp_path / "data/val_prompts.jsonl")
    assert value(validation, "--output") == str(tmp_path / "data/val_answers.jsonl")
    assert value(validation, "--max-new-tokens") == "128"
    evaluate = qs._evaluate().argv
    assert value(evaluate, "--dtype") == "bfloat16" and value(evaluate, "--k") == "2"
    eagle = f"eagle={tmp_path / 'eagle3/drafter'}"
    assert (
        value(evaluate, "--drafter") == eagle
        and f"eagle-tree={tmp_path / 'eagle3/drafter'}" in evaluate
    )
    assert value(evaluate, "--tree-topk") == "4" and value(evaluate, "--tree-total-tokens") == "5"
    assert value(evaluate, "--limit") == str(qs.plan.eval_prompts) and "--prompts" not in evaluate
    assert "--no-reference-plain" not in evaluate


def stage_dtypes(qs) -> dict[str, tuple[str, ...]]:
    """The dtype flags of every stage that runs the target."""
    cache, train = qs._cache().argv, qs._train().argv
    return {
        "prompts": (value(qs._prompts("x").argv, "--dtype"),),
        "distill": (value(qs._distill().argv, "--dtype"),),
        "validation": (value(qs._validation().argv, "--dtype"),),
        "cache": (value(cache, "--target-dtype"), value(cache, "--dtype")),
        "train": (value(train, "--target-dtype"), value(train, "--mixed-precision")),
        "evaluate": (value(qs._evaluate().argv, "--dtype"),),
    }


FP32 = {
    "prompts": ("float32",),
    "distill": ("float32",),
    "validation": ("float32",),
    "cache": ("fp32", "bf16"),  # the target in fp32, the cache stored in bf16
    "train": ("fp32", "no"),
    "evaluate": ("float32",),
}
BF16 = {
    "prompts": ("bfloat16",),
    "distill": ("bfloat16",),
    "validation": ("bfloat16",),
    "cache": ("bf16", "bf16"),
    "train": ("bf16", "bf16"),
    "evaluate": ("bfloat16",),
}


@pytest.mark.parametrize(
    ("native", "dtype", "want"),
    [
        (False, "auto", FP32),  # an AVX2-only CPU: bf16 is emulated, ~7x slower than fp32
        (True, "auto", BF16),  # AVX512-BF16/AMX, a GPU
        (True, "float32", FP32),  # explicit wins over auto
        (False, "bfloat16", BF16),
    ],
)
def test_the_dtype_is_resolved_once_for_every_stage(tmp_path, monkeypatch, native, dtype, want):
    from draftsmith.train.jobs.budget import plan_lines

    qs = planned(tmp_path, monkeypatch, native, dtype=dtype)
    resolved = want["evaluate"][0]
    assert qs.plan.dtype == resolved and stage_dtypes(qs) == want
    assert json.loads((tmp_path / STATE_FILE).read_text())["plan"]["dtype"] == resolved
    lines = [text for text, _ in plan_lines(qs.plan, qs.cfg, "out")]
    shown = f"{resolved} by auto" if dtype == "auto" else resolved
    assert lines[1].startswith(f"plan ({shown}): ")
    # --no-probe plans with the bf16 reference rates: an fp32 plan says they are not its own.
    assert any("none were measured in float32" in x for x in lines) == (resolved == "float32")


def test_auto_keys_the_stages_as_the_dtype_it_resolves_to(tmp_path, monkeypatch):
    """A rerun where auto resolves as before changes no stage's settings (nothing reruns); they
    are those of the explicit dtype, and in bf16 those of the jobs made when bf16 was fixed."""

    def identities(qs):
        stages = [
            qs._prompts("x"),
            qs._distill(),
            qs._validation(),
            qs._cache(),
            qs._train(),
            qs._evaluate(),
        ]
        return [(s.identity, s.strict, s.argv) for s in stages]

    for native, explicit in ((False, "float32"), (True, "bfloat16")):
        auto = identities(planned(tmp_path, monkeypatch, native))
        assert auto == identities(planned(tmp_path, monkeypatch, native))  # the rerun
        assert auto == identities(planned(tmp_path, monkeypatch, not native, dtype=explicit))
    # bf16: the Magpie stage's key leaves the dtype out, as before it was a setting.
    assert "dtype" not in planned(tmp_path, monkeypatch, True)._prompts("x").strict
    assert planned(tmp_path, monkeypatch, False)._prompts("x").strict["dtype"] == "float32"


def probed(tmp_path, monkeypatch, decode: dict[str, float], **settings):
    """A quickstart planned on a CPU without native bf16 (``auto``: fp32) with a fake probe
    whose plain single-stream decoding ran at ``decode`` tokens/s per dtype when it compared
    them; the calls to the probe in ``.calls``."""
    from draftsmith.recipes.quickstart import Quickstart
    from draftsmith.train import device
    from draftsmith.train.jobs import budget

    calls = []

    def fake_probe(target, dev, *, dtype, eval_dtype, compare_eval_dtypes=False, **kwargs):
        calls.append(compare_eval_dtypes)
        by_dtype = decode if compare_eval_dtypes else {}
        chosen = str(eval_dtype).removeprefix("torch.")
        if by_dtype:
            chosen = max(by_dtype, key=by_dtype.get)
        measured = {**budget.PROBE_REFERENCE, "eval_tokens_per_s": decode[chosen]}
        return budget.Probe(
            budget.scaled_rates(measured),
            measured,
            2.0,
            {"device": "cpu", "device_type": "cpu"},
            chosen,
            64,
            target_dtype=str(dtype).removeprefix("torch."),
            eval_measured=by_dtype,
        )

    monkeypatch.setattr(budget, "probe_rates", fake_probe)
    monkeypatch.setattr(device, "native_bf16", lambda d: False)
    qs = Quickstart(QuickstartConfig(out_dir=tmp_path, **settings), [])
    qs._load_state()
    qs._make_plan(32, torch.device("cpu"))
    qs.calls = calls
    return qs


def test_auto_evaluates_in_the_dtype_the_probe_decodes_faster_in(tmp_path, monkeypatch):
    """Batch-1 decoding is bound by reading the weights: where bf16 is emulated it can still
    decode one stream faster than fp32. Under auto the evaluation runs in the faster; every
    other stage keeps the dtype auto resolved to."""
    from draftsmith.train.jobs.budget import plan_lines

    bf16_faster = {"float32": 13.0, "bfloat16": 17.9}
    qs = probed(tmp_path / "a", monkeypatch, bf16_faster)
    assert qs.calls == [True]
    assert qs.plan.dtype == "float32" and qs.plan.eval_dtype == "bfloat16"
    assert stage_dtypes(qs) == {**FP32, "evaluate": ("bfloat16",)}
    assert qs._evaluate().identity["dtype"] == "bfloat16"
    # The plan's evaluation rate is bf16's: the rate the evaluation will run at.
    assert qs.rates.eval_tokens_per_s == pytest.approx(RATES.eval_tokens_per_s * 17.9 / 16.0)
    saved = json.loads((tmp_path / "a" / STATE_FILE).read_text())["plan"]
    assert saved["eval_dtype"] == "bfloat16" and saved["dtype"] == "float32"
    assert saved["probe"]["eval_tokens_per_s_by_dtype"] == bf16_faster
    line = [text for text, _ in plan_lines(qs.plan, qs.cfg, "out")][1]
    fast, slow = (RATES.eval_tokens_per_s * v / 16.0 for v in (17.9, 13.0))
    assert line.startswith(
        f"plan (float32 by auto; evaluation in bfloat16: plain decoding {fast:.1f} vs "
        f"{slow:.1f} tok/s): "
    )
    # A rerun keeps the job's probe, so the same choice, whatever a new probe would say.
    again = probed(tmp_path / "a", monkeypatch, {"float32": 20.0, "bfloat16": 10.0})
    assert again.calls == [] and again.plan == qs.plan
    assert again._evaluate().identity == qs._evaluate().identity
    # The same job with an explicit fp32 keeps that probe and ignores its comparison.
    explicit = probed(tmp_path / "a", monkeypatch, bf16_faster, dtype="float32")
    assert explicit.calls == [] and stage_dtypes(explicit) == FP32
    assert explicit.rates.eval_tokens_per_s == pytest.approx(slow)

    # fp32 decoding faster: everything in fp32, as without the comparison.
    qs = probed(tmp_path / "b", monkeypatch, {"float32": 20.0, "bfloat16": 10.0})
    assert qs.plan.eval_dtype == "float32" and stage_dtypes(qs) == FP32
    assert "; evaluation in float32: plain decoding" in plan_lines(qs.plan, qs.cfg, "o")[1][0]

    # An explicit dtype, or --no-probe: no comparison, the evaluation in the job's one dtype.
    qs = probed(tmp_path / "c", monkeypatch, bf16_faster, dtype="float32")
    assert qs.calls == [False] and qs.plan.eval_dtype == "float32" and stage_dtypes(qs) == FP32
    assert plan_lines(qs.plan, qs.cfg, "o")[1][0].startswith("plan (float32): ")
    qs = probed(tmp_path / "d", monkeypatch, bf16_faster, probe=False)
    assert qs.calls == [] and qs.plan.eval_dtype == "float32" and stage_dtypes(qs) == FP32


def test_help_shows_an_example(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["quickstart", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "--budget-minutes" in text and "draftsmith quickstart --budget-minutes 120" in text


def test_default_plan_fits_the_budget():
    for minutes in (10, 30, 120):
        plan = make_plan(QuickstartConfig(budget_minutes=minutes), seeds=0, validation=32)
        assert plan.total_s <= 60 * minutes
        assert 4 <= plan.eval_prompts <= 16
    plan = make_plan(QuickstartConfig(), seeds=0, validation=32)
    assert 450 <= plan.records <= 700  # ~570 prompts × 128 tokens distil in ~6 min
    assert plan.estimates["train"] >= 7 * 60 and plan.estimates["distill"] <= 7 * 60
    # The validation answers (32 shipped prompts, ~27 s) come out of the data's share.
    assert plan.validation == 32 and 15 <= plan.estimates["validation"] <= 45
    assert plan.records < make_plan(QuickstartConfig(), seeds=0).records


def _epochs(plan, cfg) -> float:
    """Epochs the plan's training time gives its records at the plan's rates."""
    tokens = RATES.prompt_tokens + RATES.answer_share * cfg.max_new_tokens
    return plan.estimates["train"] * RATES.train_tokens_per_s / (plan.records * tokens)


def test_data_made_faster_than_planned_buys_records_not_epochs():
    cfg = QuickstartConfig()
    plan = make_plan(cfg, seeds=0, validation=32)
    assert abs(_epochs(plan, cfg) - TARGET_EPOCHS) < 0.3  # what the plan bought data for

    def spent(factor):  # the probe and prepare as planned, the data stages `factor` faster
        data = plan.estimates["prompts"] + plan.estimates["distill"]
        return plan.estimates["prepare"] + data / factor

    for factor in (1.5, 2.7):
        grown = grow_plan(plan, cfg, RATES, spent_s=spent(factor), factor=factor)
        assert grown.records - plan.records == grown.magpie - plan.magpie >= plan.records * 0.15
        # Without growth the time saved would go to epochs over the same records.
        saved = plan.estimates["prompts"] + plan.estimates["distill"] + plan.estimates["prepare"]
        kept = dataclasses.replace(
            plan,
            estimates={**plan.estimates, "train": plan.estimates["train"] + saved - spent(factor)},
        )
        assert _epochs(kept, cfg) > TARGET_EPOCHS + 1
        assert abs(_epochs(grown, cfg) - TARGET_EPOCHS) < 0.3
        rest = sum(v for k, v in grown.estimates.items() if k != "prepare")
        assert spent(factor) + rest <= plan.budget_s  # still within the budget
    # As planned or slower, a small surplus, or sizes asked for: the plan stays.
    assert grow_plan(plan, cfg, RATES, spent_s=spent(1.0), factor=1.0) is None
    assert grow_plan(plan, cfg, RATES, spent_s=spent(1.02), factor=1.02) is None
    for asked in ({"num_prompts": 100}, {"records": 100}):
        fixed = QuickstartConfig(**asked)
        plan_fixed = make_plan(fixed, seeds=0, validation=32)
        assert grow_plan(plan_fixed, fixed, RATES, spent_s=60.0, factor=3.0) is None


def test_data_made_slower_than_planned_answers_what_fits():
    """The fresh-clone job whose probe said 532 generation tokens/s: its prompts stage decoded
    1856 candidates in 488 s for an estimated 277 (5 s of each the start); answering all 1447
    prompts then took 448 s of an estimated 318, leaving training 5 of its planned 11 minutes.
    At the rate the prompts came, the answers stage answers what its estimate fits."""
    kw = dict(planned_prompts=1447, estimate_s=276.8, load_s=5)
    records, share = shrink_records(1447, available=1447, candidates=1856, measured_s=487.7, **kw)
    assert share == pytest.approx(1856 / (1447 * 1.3) * 271.8 / 482.7)  # 0.556
    assert records == int(1447 * share) == 803
    # Stopped at its time limit (1.25 x the estimate) after 1320 candidates and 1030 prompts:
    # the same rate, and the answers stage's estimate (for 1447) fits 812 of them.
    records, share = shrink_records(1447, available=1030, candidates=1320, measured_s=344.8, **kw)
    assert share == pytest.approx(1320 / (1447 * 1.3) * 271.8 / 339.8) and records == 812
    # A low kept share is not a slow machine: 1880 candidates kept 500 prompts in the time
    # limit, a rate that fits all 500 answers.
    assert shrink_records(1447, available=500, candidates=1880, measured_s=344.8, **kw) is None
    # As planned, faster, or within the noise: the plan stays.
    for measured in (276.8, 200.0, 290.0):
        assert (
            shrink_records(1447, available=1447, candidates=1881, measured_s=measured, **kw) is None
        )
    kw["planned_prompts"] = 0  # only your prompts: no rate measured
    assert shrink_records(800, available=800, candidates=0, measured_s=9, **kw) is None


def test_more_user_prompts_than_the_budget_buys_are_cut_to_what_fits():
    """A --prompts file larger than the budget answers and trains on: the plan takes the first
    that fit (epochs ~TARGET_EPOCHS) instead of answering them all and training a minute; a
    fast data stage then grows into the prompts left out before asking Magpie for more."""
    cfg = QuickstartConfig(budget_minutes=30)
    fits = make_plan(cfg, seeds=0, validation=32).records  # Magpie's prompts cost more
    plan = make_plan(cfg, seeds=5000, validation=32)
    assert fits <= plan.records < 5000 and plan.magpie == 0
    assert plan.total_s <= 60 * cfg.budget_minutes
    assert abs(_epochs(plan, cfg) - TARGET_EPOCHS) < 0.3
    # A file that fits is answered whole, Magpie filling the rest.
    small = make_plan(cfg, seeds=50, validation=32)
    assert small.records == 50 + small.magpie and small.magpie > 0
    # ... after the answers it samples to them, which cost no prompt writing.
    assert small.sampled == cfg.sampled_answers * 50

    data = plan.estimates["prompts"] + plan.estimates["distill"]
    spent = plan.estimates["prepare"] + data / 2.0
    grown = grow_plan(plan, cfg, RATES, spent_s=spent, factor=2.0)
    assert grown.records > plan.records and grown.magpie == 0  # the user's prompts first
    assert grown.estimates["prompts"] <= RATES.load_s  # nothing for Magpie to write
    assert abs(_epochs(grown, cfg) - TARGET_EPOCHS) < 0.3
    # A file nearly used up: its last prompts, then Magpie's.
    near = make_plan(cfg, seeds=plan.records + 10, validation=32)
    near = dataclasses.replace(near, records=plan.records, magpie=0)
    # Without sampled answers, Magpie's prompts come next.
    plain = dataclasses.replace(cfg, sampled_answers=0)
    both = grow_plan(near, plain, RATES, spent_s=spent, factor=2.0)
    assert both.records > plan.records + 10 and both.magpie == both.records - (plan.records + 10)
    # With them (the default), answers sampled to the user's prompts come before Magpie's.
    sampled = grow_plan(near, cfg, RATES, spent_s=spent, factor=2.0)
    assert sampled.records == plan.records + 10 and sampled.magpie == 0
    assert 0 < sampled.sampled <= cfg.sampled_answers * (plan.records + 10)


def test_the_generation_factor_reads_whole_stage_runs_only():
    load = RATES.load_s
    stages = [
        {"estimate_s": 100 + load, "last_seconds": 40 + load, "runs": 1},
        {"estimate_s": 200 + load, "last_seconds": 80 + load, "runs": 1},
    ]
    assert generation_factor(stages, RATES) == pytest.approx(2.5)
    assert generation_factor([{**stages[0], "runs": 2}, stages[1]], RATES) is None  # resumed
    assert generation_factor([{**stages[0], "last_seconds": None}], RATES) is None
    slow = [{"estimate_s": 10 + load, "last_seconds": 1000 + load, "runs": 1}]
    assert generation_factor(slow, RATES) == pytest.approx(1 / 8)  # clamped


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


def test_the_validation_slice_of_your_prompts_is_seeded_and_stated():
    from draftsmith.recipes.quickstart import held_out
    from draftsmith.train.errors import UsageError

    prompts = list(range(50))
    val, train = held_out(prompts, None, seed=0)
    assert len(val) == 5 and sorted(val + train) == prompts  # a tenth, none lost
    assert val == sorted(val) and train == sorted(train)  # file order
    assert held_out(prompts, None, seed=0) == (val, train)  # the same settings, the same slice
    assert held_out(prompts, None, seed=1)[0] != val
    assert len(held_out(list(range(1000)), None, seed=0)[0]) == 32  # at most 32
    assert held_out(prompts[:9], None, seed=0) == ([], prompts[:9])  # too few: none
    assert held_out(prompts, 0, seed=0) == ([], prompts)
    assert len(held_out(prompts, 49, seed=0)[1]) == 1
    with pytest.raises(UsageError, match="leave none to train on"):
        held_out(prompts, 50, seed=0)


def test_validation_settings_key_the_stages_that_depend_on_them(tmp_path, monkeypatch):
    """The validation set keys the training prompts (they exclude it) and the validation answers;
    the answers' key does not chain through the earlier stages: more training prompts leave
    them done (the module job's last test runs that)."""
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in MINE))

    from draftsmith.recipes.quickstart import Quickstart
    from draftsmith.train import device

    monkeypatch.setattr(device, "native_bf16", lambda d: False)  # --dtype auto: float32

    def keys(**settings):
        qs = Quickstart(
            QuickstartConfig(out_dir=tmp_path / "out", probe=False, prompts=mine, **settings), []
        )
        qs._load_state()
        _, seeds = qs._check_inputs()
        qs._make_plan(seeds, torch.device("cpu"))
        stage = qs._validation()
        assert stage.chained is False and qs.plan.validation == len(qs.validation)
        return qs._prompts("x").strict, stage.identity, len(qs.validation)

    base = keys()
    assert base[2] == 33 and keys() == base
    for other in ({"val_prompts": 3}, {"seed": 1}):
        prompts, validation, _ = keys(**other)
        assert prompts != base[0] and validation != base[1], other
    # The answers' length and dtype key the validation answers.
    assert keys(max_new_tokens=64)[1] != base[1] and keys(dtype="bfloat16")[1] != base[1]
    assert keys(num_prompts=50)[1] == base[1]


def test_a_stage_keyed_on_its_own_inputs(tmp_path):
    """``chained=False``: a change before the stage leaves it done; a change in it reruns it
    and every later stage."""
    from rich.console import Console

    from draftsmith.train.jobs.stages import Stage, StageJob

    ran = []

    def run(a, b):
        job = StageJob(
            tmp_path,
            name="job",
            command="job",
            call=lambda argv: ran.append(argv[0]) or 0,
            stage_names=["a", "b", "c"],
            state_file="state.json",
            state_format="job",
            state_version=1,
            console=Console(file=io.StringIO()),
        )
        job._load_state()
        ran.clear()
        for i, (name, identity, chained) in enumerate(
            [("a", a, True), ("b", b, False), ("c", 0, True)], 1
        ):
            stage = Stage(
                name=name,
                title=name,
                argv=[name],
                output=tmp_path,
                complete=lambda: True,
                identity={"x": identity},
                chained=chained,
            )
            job.run_stage(i, stage)
        job._save_state()
        return list(ran)

    assert run(1, 1) == ["a", "b", "c"]
    assert run(1, 1) == []
    assert run(2, 1) == ["a", "c"]  # b depends on nothing before it
    assert run(2, 2) == ["b", "c"]


def test_the_summary_reports_the_best_validation_not_the_last():
    from draftsmith.train.report.quickstart import validation_figures, validation_line

    entries = [
        {"step": 4, "val/sim_tau": 1.4, "val_split/sim_tau": 1.8},
        {"step": 8, "val/sim_tau": 1.3, "val_split/sim_tau": 1.9},
    ]
    training = {
        "validation": entries,
        "best": {"step": 4, "sim_tau": 1.4},
        "final_validation": entries[-1],
        "val_data": "data/val_answers.jsonl",
    }
    figures = validation_figures(training, {"acceptance_length": 1.25}, prompts=33)
    assert figures["step"] == 4 and figures["drafter"] == "best"
    assert figures["sim_tau"] == 1.4 and figures["split_sim_tau"] == 1.8
    assert figures["gap"] == pytest.approx(0.12) and figures["split_gap"] == pytest.approx(0.44)
    line = validation_line(figures)
    assert "(best/, step 4): simulated τ 1.40 on the 33 held-out" in line
    assert "evaluated τ 1.25; gap +12 % (training records: +44 %)" in line
    # No best/ kept: the last validation (drafter/ is what was evaluated).
    last = validation_figures({**training, "best": None}, {"acceptance_length": 1.25})
    assert last["step"] == 8 and last["drafter"] == "drafter"
    # A run without val_data: its val/sim_tau is the training records'.
    old = validation_figures({"final_validation": {"step": 2, "val/sim_tau": 1.6}}, {})
    assert old["sim_tau"] is None and old["split_sim_tau"] == 1.6 and old["gap"] is None


def test_more_prompts_extend_the_data_and_retrain(job):
    """Runs last (it changes the module's job): a larger --num-prompts extends the prompts and
    answers already made, then redoes every later stage from scratch, except the validation
    answers, which depend on none of them."""
    out = job.out
    prompts_before = (out / "data/prompts.jsonl").read_bytes()
    answers_before = (out / "data/answers.jsonl").read_bytes()
    argv = list(job.argv)
    argv[argv.index("--num-prompts") + 1] = "5"
    before = {name: s.get("runs", 0) for name, s in state(out)["stages"].items()}
    code, printed = run_job(argv)
    assert code == 0, printed
    runs = {name: s.get("runs", 0) for name, s in state(out)["stages"].items()}
    assert {n for n in RAN if runs[n] != before[n]} == set(RAN[1:]) - {"validation"}
    assert (out / "data/prompts.jsonl").read_bytes().startswith(prompts_before)
    assert (out / "data/answers.jsonl").read_bytes().startswith(answers_before)
    assert len((out / "data/answers.jsonl").read_text().splitlines()) == 16
    metrics = json.loads((out / "eagle3/training_metrics.json").read_text())
    assert metrics["resumed_from"] is None and metrics["steps"] == 4  # trained anew


def _job_elsewhere(job, out: Path) -> tuple[Path, list, int, str]:
    """The module job's command with its output in ``out``, run: ``(out, argv, code, printed)``."""
    argv = [*job.argv]
    argv[argv.index("--out-dir") + 1] = out
    code, printed = run_job(argv)
    return out, argv, code, printed


def test_grown_data_extends_the_data_stages_before_the_rest_runs(tmp_path, monkeypatch, job):
    """When the plan grows after the data stages (faked here: the tiny job's sizes are asked
    for), the prompts and answers are extended, not redone, and every later stage runs once."""
    from draftsmith.recipes import quickstart

    def grow(plan, cfg, rates, *, spent_s, factor):
        assert spent_s > 0 and factor > 0
        magpie = plan.magpie + 2
        return dataclasses.replace(plan, magpie=magpie, records=plan.seeds + magpie)

    monkeypatch.setattr(quickstart, "grow_plan", grow)
    out, argv, code, printed = _job_elsewhere(job, tmp_path / "out")
    assert code == 0, printed
    assert "came out" in printed and "more (" in printed
    assert "data: 16 records made; grown from the plan's 14" in printed
    runs = {name: s.get("runs", 0) for name, s in state(out)["stages"].items()}
    assert runs == {**dict.fromkeys(RAN, 1), "sampled": 0, "prompts": 2, "distill": 2}
    answers = (out / "data/answers.jsonl").read_text().splitlines()
    assert len(answers) == 16  # 11 of yours + 3 + 2 by the target
    assert state(out)["plan"]["grown"]["magpie_prompts"] == 5
    # One run made all of it: its time "in this run" counts both legs of the data stages.
    ran = sum(s["seconds"] for s in state(out)["stages"].values())
    assert state(out)["summary"]["seconds_this_run"] == pytest.approx(ran, abs=0.5)
    # A rerun keeps the grown sizes: nothing is redone.
    code, printed = run_job(argv)
    assert code == 0 and {s["runs"] for s in state(out)["stages"].values()} <= {0, 1, 2}
    assert runs == {name: s["runs"] for name, s in state(out)["stages"].items()}


def test_slow_prompts_shrink_the_answers_and_a_rerun_keeps_them(tmp_path, monkeypatch, job):
    """When the prompts came out slower than planned (faked here: shrink_records answers 2
    fewer), the answers stage answers fewer, the summary says why, and a rerun redoes nothing.
    The prompts stage runs under its time limit (--max-minutes, not part of its identity)."""
    from draftsmith.recipes import quickstart

    seen = {}

    def shrink(planned, **kw):
        seen.update(kw, planned=planned)
        return kw["available"] - 2, 0.5

    monkeypatch.setattr(quickstart, "shrink_records", shrink)
    out, argv, code, printed = _job_elsewhere(job, tmp_path / "out")
    assert code == 0, printed
    st = state(out)
    assert "--max-minutes " in printed.split("[2/10]")[1].split("[3/10]")[0]
    assert seen["planned_prompts"] == 3 and seen["candidates"] >= 3
    assert seen["estimate_s"] == st["stages"]["prompts"]["estimate_s"]
    answered = len((out / "data/answers.jsonl").read_text().splitlines())
    assert answered == seen["available"] - 2 == st["plan"]["shrunk"]["records"]
    assert f"came out at 0.50x the planned rate: answering {answered} of the" in printed
    assert f"{answered} of the planned {seen['planned']} answered" in printed
    runs = {name: s.get("runs", 0) for name, s in st["stages"].items()}
    assert runs == {**dict.fromkeys(RAN, 1), "sampled": 0}
    # A rerun keeps the shrunk sizes (no new decision: this run's prompts stage did not run).
    monkeypatch.setattr(quickstart, "shrink_records", None)
    code, printed = run_job(argv)
    assert code == 0, printed
    assert runs == {name: s["runs"] for name, s in state(out)["stages"].items()}


def test_the_budget_buys_sampled_answers_to_your_prompts_before_magpies(tmp_path, job):
    """Sized by the budget (no --num-prompts), the job answers each of your prompts greedily,
    then samples more answers to them (stage 4, ids #s1, #s2), then has the target write
    prompts; all of it is tokenized and trained on."""
    out = tmp_path / "out"
    argv = ["quickstart", "--target", job.target, "--prompts", job.root / "mine.jsonl"]
    argv += ["--out-dir", out, "--budget-minutes", "4", "--no-probe", "--tree-nodes", "0"]
    argv += [a for a in SMALL if a not in ("--num-prompts", "3")]
    code, printed = run_job(argv)
    assert code == 0, printed
    plan = state(out)["plan"]
    yours = plan["seed_prompts"]
    assert plan["sampled_answers"] == 2 * yours  # --sampled-answers 2, all of them bought
    assert plan["magpie_prompts"] > 0
    lines = [json.loads(x) for x in (out / "data/sampled_answers.jsonl").read_text().splitlines()]
    ids = [r["id"] for r in lines]
    assert len(ids) == len(set(ids)) == 2 * yours
    assert sum(i.endswith("#s1") for i in ids) == sum(i.endswith("#s2") for i in ids) == yours
    assert all(r["source"].startswith("input:") for r in lines)  # yours, not Magpie's
    greedy = {r["id"]: r for r in map(json.loads, (out / "data/answers.jsonl").open())}
    assert all(i.rsplit("#", 1)[0] in greedy for i in ids)
    st = state(out)
    assert st["stages"]["sampled"]["runs"] == 1
    command = st["stages"]["sampled"]["command"]
    assert "--samples 2" in command and "--temperature 0.7" in command
    made = len(greedy) + len(ids)
    assert f"[6/10] tokenize {made} conversations" in printed
    assert f"data: {made} records made ({2 * yours} of them answers sampled" in printed
