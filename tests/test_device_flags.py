"""The one ``device`` setting on every command that runs a model, and the quickstart's probe.

Every command runs with ``--device cpu`` on a tiny target and records the device it used; a
misspelled device is a config error naming ``device`` (with any other bad field, in one error);
``--device cuda`` on a machine without a GPU is one line naming ``device``, before any model
loads or any output is written. The quickstart's plan is sized by rates measured on the device
(``train/jobs/budget.py``'s probe): a faster probe plans more data.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from draftsmith.recipes.cli import main as cli
from draftsmith.train.jobs import budget
from draftsmith.train.jobs.budget import PROBE_REFERENCE, RATES, Probe, make_plan, probe_rates
from tests.conftest import tiny_model_dir

HAS_GPU = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def restore_threads():
    """Commands given ``--threads`` set this process's torch threads: put them back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny target, a prompt file, tokenized data, an EAGLE-3 drafter and a draft LM."""
    import datasets

    from draftsmith.heads.eagle import EagleConfig, build_drafter, save_drafter
    from draftsmith.train.export.hf import save_draft
    from draftsmith.train.objectives.draft_init import pruned_draft
    from draftsmith.train.target_model.load import load_target

    root = tmp_path_factory.mktemp("device_flags")
    target_dir = tiny_model_dir(root / "target")
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ("Name a colour.", "Count to three."))
    )
    g = torch.Generator().manual_seed(0)
    samples = [
        {"input_ids": torch.randint(0, 256, (n,), generator=g).tolist(), "loss_mask": [1] * n}
        for n in (5, 9, 7)
    ]
    datasets.Dataset.from_list(samples).save_to_disk(str(root / "tokenized"))
    target, tok = load_target(str(target_dir))
    drafter = build_drafter(target, EagleConfig.from_target(target.config, 3), seed=0)
    save_drafter(drafter, root / "drafter")
    save_draft(pruned_draft(target, [0, 3]).eval(), tok, root / "draft", info={})
    profile = root / "cost.json"  # scripts/bench_forward.py's layout
    chain = {str(w): 10.0 + w for w in (1, 2, 3, 4, 6)}
    profile.write_text(
        json.dumps({"unit": "ms", "profile": {"float32": {"1": {"chain": chain, "tree": {}}}}})
    )
    return root


def _argv(command: str, files: Path, out: Path) -> list[str]:
    """The cheapest command line of each command that runs a model (without ``--device``)."""
    target = files / "target"
    line = {
        "distill": f"data distill --input {files / 'prompts.jsonl'} --output {out} "
        f"--target {target} --max-new-tokens 2 --no-progress",
        "prompts": f"data prompts --output {out} --target {target} --num 0 --include-shipped "
        "--no-progress",
        "cache": f"data cache --data {files / 'tokenized'} --out {out} --target {target} "
        "--preset eagle1 --no-progress",
        "export": f"export --format hf --checkpoint {files / 'draft'} --out {out}",
        "bench": f"bench --drafter ngram --temperatures 0 --target {target} --limit 1 "
        f"--max-new-tokens 4 --no-reference-plain --cost-profile {files / 'cost.json'} "
        f"--out {out}",
        "quickstart": f"quickstart --target {target} --out-dir {out} --no-progress",
    }[command]
    return line.split()  # pytest's temporary paths hold no spaces


COMMANDS = ["distill", "prompts", "cache", "export", "bench", "quickstart"]


def _run(argv: list, capsys) -> tuple[int, list[str]]:
    """Exit code and the stderr lines that are not progress bars."""
    capsys.readouterr()
    code = cli([str(a) for a in argv])
    err = capsys.readouterr().err.replace("\r", "\n")
    return code, [line for line in err.splitlines() if line.strip() and "it/s]" not in line]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_misspelled_device_is_a_config_error_naming_device(command, files, tmp_path, capsys):
    out = tmp_path / "out"
    code, lines = _run([*_argv(command, files, out), "--device", "gpu7"], capsys)
    assert code == 2, lines
    assert [line for line in lines if line.startswith("error")] == [lines[0]], lines
    assert lines[0].startswith("error: invalid ") and "1 problem" in lines[0], lines
    assert lines[1:] == ["  device: must be auto, cpu, cuda or cuda:N (N = 0, 1, ...), got 'gpu7'"]
    assert not out.exists()


def test_a_bad_device_is_reported_with_the_other_bad_fields(files, tmp_path, capsys):
    argv = _argv("distill", files, tmp_path / "o.jsonl")
    code, lines = _run([*argv, "--device", "cuda:x", "--batch-size", "0"], capsys)
    assert code == 2 and "2 problems" in lines[0]
    assert {line.split(":")[0].strip() for line in lines[1:]} == {"device", "batch_size"}


@pytest.mark.skipif(HAS_GPU, reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_a_gpu_that_is_not_there_is_one_line_before_anything_runs(
    command, spec, files, tmp_path, capsys
):
    out = tmp_path / "out"
    code, lines = _run([*_argv(command, files, out), "--device", spec], capsys)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith(f"error: device: {spec} asked for"), lines
    assert "no usable CUDA GPU" in lines[0] and "--device cpu" in lines[0]
    assert not out.exists() and not Path(f"{out}.t0.json").exists()


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--backend", "vllm"], "vLLM runs on its own platform"),
        (["--device-map", "auto"], "device_map spreads the target"),
    ],
)
def test_cache_refuses_a_device_where_something_else_places_the_target(
    extra, why, files, tmp_path, capsys
):
    argv = [*_argv("cache", files, tmp_path / "c"), *extra, "--device", "cpu"]
    code, lines = _run(argv, capsys)
    assert code == 2 and lines[1].startswith(f"  device: {why}"), lines


def test_distill_refuses_a_device_with_an_endpoint(files, tmp_path, capsys):
    argv = [*_argv("distill", files, tmp_path / "o.jsonl"), "--endpoint", "http://127.0.0.1:9"]
    code, lines = _run([*argv, "--device", "cpu"], capsys)
    assert code == 2 and lines[1].startswith("  device: the server decides"), lines


# --------------------------------------------------------------------------------------------
# --device cpu runs, and the outputs record the device
# --------------------------------------------------------------------------------------------


def _meta(path: Path) -> dict:
    return json.loads(path.with_name(path.name + ".meta").read_text())


def test_distill_runs_on_the_cpu_with_its_threads_and_records_it(files, tmp_path, capsys):
    out = tmp_path / "answers.jsonl"
    argv = [*_argv("distill", files, out), "--device", "cpu", "--threads", "2"]
    code, lines = _run(argv, capsys)
    assert code == 0, lines
    assert len(out.read_text().splitlines()) == 2
    assert torch.get_num_threads() == 2  # the thread setting applies: the device is the CPU
    device = _meta(out)["settings"]["device"]
    assert device["device"] == "cpu" and device["device_type"] == "cpu"


def test_prompts_run_on_the_cpu_and_record_it(files, tmp_path, capsys):
    out = tmp_path / "prompts.jsonl"
    code, lines = _run([*_argv("prompts", files, out), "--device", "cpu"], capsys)
    assert code == 0, lines
    assert out.read_text() and _meta(out)["settings"]["device"]["device"] == "cpu"


def test_cache_runs_on_the_cpu_and_records_it(files, tmp_path, capsys):
    out = tmp_path / "cache"
    code, lines = _run([*_argv("cache", files, out), "--device", "cpu"], capsys)
    assert code == 0, lines
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["device"]["device"] == "cpu" and manifest["num_samples"] == 3
    # auto on this machine is the CPU too, and builds the same cache.
    again = tmp_path / "auto"
    assert _run(_argv("cache", files, again), capsys)[0] == 0
    assert json.loads((again / "manifest.json").read_text())["plan"] == manifest["plan"]


def test_exports_run_their_checks_on_the_cpu(files, tmp_path, capsys):
    out = tmp_path / "hf"
    code, lines = _run([*_argv("export", files, out), "--device", "cpu"], capsys)
    assert code == 0, lines
    info = json.loads((out / "draftsmith_draft.json").read_text())
    assert info["checked_on"]["device"] == "cpu"  # where the logits were compared
    spec = ["export", "--format", "speculators", "--checkpoint", files / "drafter", "--target"]
    spec += [files / "target"]
    code, lines = _run([*spec, "--out", tmp_path / "e3", "--device", "cpu"], capsys)
    assert code == 0 and (tmp_path / "e3" / "config.json").is_file(), lines


def test_bench_passes_the_device_to_every_evaluate_run(files, tmp_path, capsys):
    out = tmp_path / "bench"
    argv = [*_argv("bench", files, out), "--device", "cpu", "--temperatures", "0", "0.7"]
    capsys.readouterr()
    code = cli([str(a) for a in argv])
    printed = capsys.readouterr().out
    assert code == 0, printed
    runs = [line for line in printed.splitlines() if line.startswith("[bench] $ draftsmith")]
    assert len(runs) == 2 and all("--device cpu" in line for line in runs), runs
    for t in ("0", "0.7"):
        assert json.loads(Path(f"{out}.t{t}.json").read_text())["config"]["device"] == "cpu"
    assert json.loads(out.with_suffix(".json").read_text())["device"]["device"] == "cpu"
    # A rerun keeps both runs: the device is part of what they were measured with.
    capsys.readouterr()
    assert cli([str(a) for a in argv]) == 0
    assert capsys.readouterr().out.count("already measured") == 2


# --------------------------------------------------------------------------------------------
# The quickstart's probe
# --------------------------------------------------------------------------------------------


def test_the_probe_measures_the_device_and_the_plan_uses_its_numbers(files):
    from draftsmith.recipes.quickstart import QuickstartConfig

    probe = probe_rates(files / "target", torch.device("cpu"), eval_dtype=torch.float32)
    assert probe.device["device"] == "cpu" and probe.dtype == "float32"
    assert probe.target_dtype == "bfloat16"  # the stages' dtype (default), evaluated in fp32
    assert probe.batch_size == 64 and 0 < probe.seconds < 60
    for key, reference in PROBE_REFERENCE.items():
        measured = probe.measured[key]
        assert measured > 0
        assert getattr(probe.rates, key) == pytest.approx(
            getattr(RATES, key) * measured / reference
        )
    # What is not measured stays the reference's.
    assert probe.rates.prompt_tokens == RATES.prompt_tokens and probe.rates.load_s >= RATES.load_s
    # The tiny target runs far faster than SmolLM2 on 2 cores: the same budget makes more data,
    # evaluates more prompts and trains the same share.
    cfg = QuickstartConfig()
    fast, reference = make_plan(cfg, 32, probe.rates), make_plan(cfg, 32)
    assert fast.records > reference.records and fast.magpie > reference.magpie
    assert fast.eval_prompts >= reference.eval_prompts
    assert Probe.from_record(json.loads(json.dumps(probe.record()))) == probe


def _scaled(factor: float) -> Probe:
    rates = dataclasses.replace(RATES, **{k: getattr(RATES, k) * factor for k in PROBE_REFERENCE})
    measured = {k: v * factor for k, v in PROBE_REFERENCE.items()}
    return Probe(rates, measured, 2.0, {"device": "cpu", "device_type": "cpu"}, "bfloat16", 64)


def test_quickstart_plans_with_the_probe_once_per_job(files, tmp_path, monkeypatch):
    from draftsmith.recipes.quickstart import Quickstart, QuickstartConfig
    from draftsmith.train import device as device_module

    calls = []

    def fake_probe(target, device, **kwargs):
        assert kwargs["dtype"] == kwargs["eval_dtype"]  # the job's one dtype
        calls.append((Path(target), device, kwargs["eval_dtype"]))
        return _scaled(2.0)

    monkeypatch.setattr(budget, "probe_rates", fake_probe)
    monkeypatch.setattr(device_module, "native_bf16", lambda d: True)  # --dtype auto: bf16

    def plan(**settings):
        qs = Quickstart(QuickstartConfig(out_dir=tmp_path, **settings), [])
        qs._load_state()
        qs.target_path = files / "target"
        qs._make_plan(32, torch.device("cpu"))
        return qs

    qs = plan()
    assert calls == [(files / "target", torch.device("cpu"), torch.bfloat16)]
    state = json.loads((tmp_path / "quickstart.json").read_text())
    assert state["plan"]["rates"] == state["plan"]["probe"]["rates"] == dataclasses.asdict(qs.rates)
    assert state["plan"]["probe"]["probed"] is True and state["device"]["device"] == "cpu"
    reference = make_plan(qs.cfg, 32)
    assert qs.plan.records > reference.records  # twice the reference's speed: more data
    assert qs.plan.estimates["prepare"] == RATES.prepare_s + 2.0  # the probe's own time counts

    # A rerun reuses the job's probe (the same command, the same plan); another dtype probes.
    again = plan()
    assert len(calls) == 1 and again.plan == qs.plan and again.rates == qs.rates
    plan(dtype="float32")
    assert len(calls) == 2 and calls[-1][2] == torch.float32
    # --no-probe: the 2-core-CPU reference, said so in the state.
    off = plan(probe=False)
    assert off.rates == RATES and off.plan.records == reference.records
    assert (
        json.loads((tmp_path / "quickstart.json").read_text())["plan"]["probe"]["probed"] is False
    )


def test_quickstart_passes_the_device_to_every_model_stage(tmp_path):
    from draftsmith.recipes.quickstart import Quickstart, QuickstartConfig

    def stages(device: str) -> dict[str, list[str]]:
        qs = Quickstart(QuickstartConfig(out_dir=tmp_path, device=device), [])
        qs._load_state()
        qs.plan = make_plan(qs.cfg, seeds=32)
        build = {
            "prompts": lambda: qs._prompts("x"),
            "distill": qs._distill,
            "cache": qs._cache,
            "train": qs._train,
            "evaluate": qs._evaluate,
            "export": qs._export,
        }
        return {name: make().argv for name, make in build.items()}

    for name, argv in stages("cuda:1").items():
        assert argv[argv.index("--device") + 1] == "cuda:1", name
    # auto is every command's default: the commands stay as they were.
    assert not any("--device" in argv for argv in stages("auto").values())


def test_a_job_planned_before_probes_keeps_its_plan(files, tmp_path, monkeypatch):
    """A quickstart.json written before the probe existed (its plan has rates, no probe): a rerun
    plans with those reference rates again, so none of its finished stages is redone."""
    from draftsmith.recipes.quickstart import Quickstart, QuickstartConfig
    from draftsmith.train import device as device_module

    monkeypatch.setattr(budget, "probe_rates", lambda *a, **k: pytest.fail("probed"))
    # Such a job ran in bf16: on a machine where --dtype auto resolves to bf16 nothing changes.
    monkeypatch.setattr(device_module, "native_bf16", lambda d: True)
    cfg = QuickstartConfig(out_dir=tmp_path)
    old = make_plan(cfg, 32)
    state = {"format": "draftsmith-quickstart", "plan": old.record(cfg.budget_minutes)}
    (tmp_path / "quickstart.json").write_text(json.dumps(state))
    for _ in range(2):
        qs = Quickstart(cfg, [])
        qs._load_state()
        qs.target_path = files / "target"
        qs._make_plan(32, torch.device("cpu"))
        assert qs.rates == RATES and qs.plan == old
    assert qs.state["plan"]["probe"]["legacy"] is True


def test_data_that_came_out_faster_grows_once_and_stays_grown(files, tmp_path, monkeypatch):
    """The prompts and answers took 1/2.5 of their estimates: the job plans more of them before
    it trains, extends those two stages, and a rerun keeps the grown sizes."""
    from draftsmith.recipes.quickstart import Quickstart, QuickstartConfig
    from draftsmith.train import device as device_module

    monkeypatch.setattr(budget, "probe_rates", lambda *a, **k: _scaled(1.0))
    monkeypatch.setattr(device_module, "native_bf16", lambda d: True)

    def job(**settings):
        qs = Quickstart(QuickstartConfig(out_dir=tmp_path, **settings), [])
        qs._load_state()
        qs.target_path = files / "target"
        qs._make_plan(0, torch.device("cpu"))
        return qs

    def made(qs, factor, runs=1):
        for name in ("prompts", "distill"):
            estimate = qs.plan.estimates[name]
            taken = RATES.load_s + (estimate - RATES.load_s) / factor
            qs.state["stages"][name] = {
                "estimate_s": estimate,
                "last_seconds": taken,
                "seconds": taken,
                "runs": runs,
                "status": "done",
            }
            qs.this_run[name] = "ran"

    qs = job()
    base = qs.plan
    made(qs, 1.0)
    assert not qs._grow_data() and qs.plan == base  # as planned: nothing grows
    resumed = job()
    made(resumed, 2.5, runs=2)
    assert not resumed._grow_data()  # a resumed stage's time is not a rate

    qs = job()
    made(qs, 2.5)
    assert qs._grow_data()
    grown = qs.plan
    assert grown.records > 1.25 * base.records and grown.magpie == grown.records
    assert qs.state["plan"]["grown"]["generation_factor"] == pytest.approx(2.5, rel=0.01)
    prompts, distill = qs._prompts("x").argv, qs._distill().argv
    assert prompts[prompts.index("--num") + 1] == str(grown.magpie)
    assert distill[distill.index("--limit") + 1] == str(grown.records)
    assert not qs._grow_data()  # once per job

    again = job()  # a rerun: the same probe, the same grown sizes
    assert (again.plan.records, again.plan.magpie) == (grown.records, grown.magpie)
    assert again.state["plan"]["records"] == base.records  # the plan it grew from
    other = job(dtype="float32")  # another plan: the growth does not carry over
    assert "grown" not in other.state["plan"] and other.plan.records == base.records


def test_a_probed_job_trains_at_the_probes_rate_not_the_caches(files, tmp_path, monkeypatch):
    """The cache stage ran 1.7x its planned rate: with a probe (which timed training steps) the
    training schedule keeps the probe's rate; without one, the cache's factor scales it."""
    from draftsmith.recipes import quickstart
    from draftsmith.train import device as device_module

    monkeypatch.setattr(budget, "probe_rates", lambda *a, **k: _scaled(1.0))
    monkeypatch.setattr(device_module, "native_bf16", lambda d: True)
    seen = {}

    def schedule(left_s, **kwargs):
        seen.update(kwargs)
        return budget.train_schedule(left_s, **kwargs)

    monkeypatch.setattr(quickstart, "train_schedule", schedule)
    cache = tmp_path / "data" / "cache"
    cache.mkdir(parents=True)
    (cache / "manifest.json").write_text(json.dumps({"num_samples": 300, "num_tokens": 60000}))
    for probe in (True, False):
        qs = quickstart.Quickstart(quickstart.QuickstartConfig(out_dir=tmp_path, probe=probe), [])
        qs._load_state()
        qs.target_path = files / "target"
        qs._make_plan(0, torch.device("cpu"))
        seconds = RATES.load_s + 60000 / (1.7 * qs.rates.cache_tokens_per_s)
        qs.state["stages"] = {"cache": {"last_seconds": seconds, "seconds": seconds, "runs": 1}}
        qs._train()
        assert seen["speed"] == pytest.approx(1.7, rel=0.01)
        assert seen["train_speed"] == (1.0 if probe else None)
    shape = {"samples": 300, "val_samples": 30, "tokens": 60000, "samples_per_step": 8}
    fast = budget.train_schedule(600, **shape, train_steps=None, speed=1.7)
    probed = budget.train_schedule(600, **shape, train_steps=None, speed=1.7, train_speed=1.0)
    assert fast["epochs"] == pytest.approx(1.7 * probed["epochs"], rel=0.02)
