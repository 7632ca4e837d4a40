"""recipes/eagle.py end to end on a tiny target: train, save, resume, evaluate; 2 processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from draftsmith.heads.eagle import load_drafter
from draftsmith.recipes.eagle import main as train_eagle
from draftsmith.recipes.evaluate import main as evaluate
from draftsmith.train.target_model.load import load_target

REPO = Path(__file__).resolve().parents[1]

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "then",
    "it",
    "ran",
    "to",
    "the",
    "red",
    "barn",
    "where",
    "a",
    "dog",
    "slept",
]


def write_records(path: Path, n: int = 24) -> Path:
    """Alpaca-shape chat records with repetitive answers (learnable in a few steps)."""
    with open(path, "w") as f:
        for i in range(n):
            answer = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(12))
            f.write(json.dumps({"id": i, "instruction": f"say {i}", "output": answer}) + "\n")
    return path


def base_args(tmp_path, target_dir, version: int, **over) -> list[str]:
    args = {
        "version": version,
        "target": target_dir,
        "data": write_records(tmp_path / "data.jsonl"),
        "split": "train",
        "max_length": 96,
        "batch_size": 2,
        "grad_accum": 2,
        "max_steps": 6,
        "draft_vocab_size": 64,
        "ttt_steps": 3,
        "val_samples": 4,
        "eval_every": 3,
        "log_every": 2,
        "save_every": 3,
        "lr": 3e-3,
        "output_dir": tmp_path / "run",
        "threads": 1,
    }
    args.update(over)
    return [x for k, v in args.items() for x in (f"--{k.replace('_', '-')}", str(v))]


@pytest.mark.parametrize("version", [1, 3])
def test_recipe_trains_saves_and_resumes(tmp_path, tiny_target_dir, version):
    assert train_eagle(base_args(tmp_path, tiny_target_dir, version)) == 0
    run = tmp_path / "run"
    metrics = json.loads((run / "training_metrics.json").read_text())
    assert metrics["steps"] == 6 and metrics["stop_reason"] == "done"
    assert metrics["train_samples"] == 22 - 4  # 24 records; split train drops ids 9 and 19
    val = metrics["final_validation"]
    acc = val["val/acc_0"] if version == 3 else val["val/acc"]  # EAGLE-1 has one step
    assert val["val/loss"] > 0 and 0 <= acc <= 1
    target, _ = load_target(str(tiny_target_dir))
    drafter = load_drafter(run / "drafter", target)
    assert drafter.config.version == version
    # Run metadata: the layers the drafter reads, and those training took from the target.
    assert metrics["feature_layers"] == list(drafter.config.feature_layers)
    last = target.config.num_hidden_layers
    assert metrics["train_layers"] == sorted({*drafter.config.feature_layers, last})
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_3", "step_6"]

    # Resume: ask for more steps; the run continues from step 6, not from scratch.
    assert train_eagle(base_args(tmp_path, tiny_target_dir, version, max_steps=8)) == 0
    resumed = json.loads((run / "training_metrics.json").read_text())
    assert resumed["steps"] == 8 and resumed["resumed_from"] == 6
    # The history before the resume is kept: one log entry per logged step, none twice.
    assert [e["step"] for e in resumed["train_log"]] == [2, 4, 6, 8]
    assert [v["step"] for v in resumed["validation"]] == [3, 6, 8]
    steps = 3 if version == 3 else 1
    assert all(1 <= v["val/sim_tau"] <= 1 + steps for v in resumed["validation"])
    assert resumed["best"]["step"] in (3, 6, 8) and (run / "best" / "config.json").is_file()

    # The trained drafter plugs into the evaluation; greedy output stays the target's own.
    out = tmp_path / "eval.json"
    spec = "eagle=" + str(run / "drafter")
    assert (
        evaluate(
            [
                "--target",
                str(tiny_target_dir),
                "--drafter",
                spec,
                "eagle-tree=" + str(run / "drafter"),
                "--k",
                "3",
                "--max-new-tokens",
                "12",
                "--limit",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert all(m["identical_to_target"] for m in res["methods"])


def test_recipe_config_errors_name_every_field(tmp_path, tiny_target_dir, capsys):
    args = base_args(tmp_path, tiny_target_dir, 3, batch_size=0, ttt_decay=1.5)
    assert train_eagle(args) == 2
    err = capsys.readouterr().err
    assert "batch_size" in err and "ttt_decay" in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_eagle(config: Path, args: list[str]) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file CONFIG recipes/eagle.py ARGS`` (one thread per process)."""
    return subprocess.run(
        [
            shutil.which("accelerate") or "accelerate",
            "launch",
            "--config_file",
            str(config),
            "--main_process_port",
            str(_free_port()),
            str(REPO / "recipes/eagle.py"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.integration
def test_two_cpu_processes_train_and_resume(tmp_path, tiny_target_dir):
    """accelerate launch with 2 CPU processes: the run completes, then resumes from its checkpoint."""
    config = REPO / "recipes/accelerate/cpu_2proc.yaml"

    def launch(**over):
        return launch_eagle(config, base_args(tmp_path, tiny_target_dir, 3, **over))

    proc = launch(max_steps=4, save_every=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "training_metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["steps"] == 4
    proc = launch(max_steps=6, save_every=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    metrics = json.loads((tmp_path / "run" / "training_metrics.json").read_text())
    assert metrics["steps"] == 6 and metrics["resumed_from"] == 4
    assert [e["step"] for e in metrics["train_log"]] == [2, 4, 6]


def test_bf16_target_and_autocast_train_an_fp32_drafter(tmp_path, tiny_target_dir):
    """The shipped EAGLE-3 settings: bf16 target features and labels, bf16 autocast; the drafter
    keeps fp32 master weights, the loss falls and training minutes are logged."""
    args = base_args(
        tmp_path, tiny_target_dir, 3, target_dtype="bf16", mixed_precision="bf16", max_steps=8
    )
    assert train_eagle(args) == 0
    run = tmp_path / "run"
    metrics = json.loads((run / "training_metrics.json").read_text())
    log = metrics["train_log"]
    assert log[-1]["train/loss"] < log[0]["train/loss"]
    assert all(entry["train/minutes"] >= 0 for entry in log)
    assert [e["train/minutes"] for e in log] == sorted(e["train/minutes"] for e in log)
    assert all("val/minutes" in v and "val/sim_tau" in v for v in metrics["validation"])
    target, _ = load_target(tiny_target_dir)
    drafter = load_drafter(run / "drafter", target)
    assert all(p.dtype.is_floating_point and p.dtype.itemsize == 4 for p in drafter.parameters())


def test_val_data_validates_like_the_evaluation_and_chooses_best(tmp_path, tiny_target_dir):
    """val_data: its simulated τ is val/sim_tau and chooses best/; the held-back training
    records are logged as val_split/* with the gap. Given exactly the held-back records as
    val_data, both figures agree: the held-out path computes what the split path does."""
    from draftsmith.train.core.data import split_indices

    records = [json.loads(line) for line in write_records(tmp_path / "data.jsonl").open()]
    train_records = [r for r in records if r["id"] % 10 != 9]  # split: train
    _, val_idx = split_indices(len(train_records), 4, 0)
    same = tmp_path / "same_as_split.jsonl"
    same.write_text("".join(json.dumps(train_records[i]) + "\n" for i in val_idx))
    args = base_args(tmp_path, tiny_target_dir, 3, val_data=same, max_steps=6)
    assert train_eagle(args) == 0
    metrics = json.loads((tmp_path / "run" / "training_metrics.json").read_text())
    assert metrics["val_data"] == str(same)
    for v in metrics["validation"]:
        assert v["val/sim_tau"] == pytest.approx(v["val_split/sim_tau"], abs=1e-5)
        assert v["val/acc_0"] == pytest.approx(v["val_split/acc_0"], abs=1e-5)
        assert v["val/sim_tau_gap"] == pytest.approx(0.0, abs=1e-5)

    # Other records: the figures differ, the gap is split τ / held-out τ - 1, and best/ is the
    # step of the highest held-out τ.
    other = tmp_path / "other.jsonl"
    with open(other, "w") as f:
        for i in range(5):
            answer = " ".join(reversed(WORDS[i : i + 10]))
            f.write(json.dumps({"instruction": f"reverse {i}", "output": answer}) + "\n")
    args = base_args(
        tmp_path, tiny_target_dir, 3, val_data=other, output_dir=tmp_path / "run2", max_steps=6
    )
    assert train_eagle(args) == 0
    metrics = json.loads((tmp_path / "run2" / "training_metrics.json").read_text())
    vals = metrics["validation"]
    assert [v["step"] for v in vals] == [3, 6]
    for v in vals:
        assert v["val/sim_tau_gap"] == pytest.approx(
            v["val_split/sim_tau"] / v["val/sim_tau"] - 1, abs=1e-6
        )
    assert any(v["val/sim_tau"] != pytest.approx(v["val_split/sim_tau"]) for v in vals)
    best = max(vals, key=lambda v: v["val/sim_tau"])
    assert metrics["best"] == {"step": best["step"], "sim_tau": best["val/sim_tau"]}


def test_missing_val_data_is_named(tmp_path, tiny_target_dir, capsys):
    args = base_args(tmp_path, tiny_target_dir, 3, val_data=tmp_path / "nope.jsonl")
    assert train_eagle(args) == 2
    err = capsys.readouterr().err
    assert "val_data:" in err and "nope.jsonl" in err and "draftsmith data distill" in err


def test_lk_loss_trains_and_reports_acceptance(tmp_path, tiny_target_dir, capsys):
    """loss: lk_hybrid trains EAGLE-3 (loss falls) and every step logs α; EAGLE-1 refuses it."""
    args = base_args(tmp_path, tiny_target_dir, 3, loss="lk_hybrid", max_steps=8, eval_every=4)
    assert train_eagle(args) == 0
    metrics = json.loads((tmp_path / "run" / "training_metrics.json").read_text())
    log = metrics["train_log"]
    assert log[-1]["train/loss"] < log[0]["train/loss"]
    assert all(0 <= e[f"train/alpha_{j}"] <= 1 for e in log for j in range(3))
    assert all(0 <= v["val/alpha_0"] <= 1 for v in metrics["validation"])
    assert train_eagle(base_args(tmp_path, tiny_target_dir, 1, loss="tv")) == 2
    assert "loss: EAGLE-1" in capsys.readouterr().err


def test_limit_keeps_the_caches_first_records(tmp_path, tiny_target_dir):
    """limit reads the first N records of a hidden-state cache, as it does of online records:
    the same samples train, and the draft vocabulary is counted on those N only."""
    from draftsmith.train.core.data import load_samples
    from draftsmith.train.data.chat import template_fingerprint
    from draftsmith.train.features.cache_write import build_cache

    target, tokenizer = load_target(str(tiny_target_dir))
    data = write_records(tmp_path / "data.jsonl")
    tokens, _ = load_samples(data, tokenizer, max_length=96, split="all")
    n = target.config.num_hidden_layers
    build_cache(
        target,
        tokens,
        tmp_path / "cache",
        list(range(n + 1)),
        dtype="fp32",
        template_fingerprint=template_fingerprint(tokenizer),
        progress=False,
    )
    common = {"split": "all", "limit": 14, "max_steps": 2, "draft_vocab_size": 40}
    assert train_eagle(base_args(tmp_path, tiny_target_dir, 3, **common)) == 0
    offline = base_args(
        tmp_path,
        tiny_target_dir,
        3,
        hidden_states="offline",
        hidden_states_cache=tmp_path / "cache",
        output_dir=tmp_path / "off",
        **common,
    )
    assert train_eagle(offline) == 0
    on = json.loads((tmp_path / "run" / "training_metrics.json").read_text())
    off = json.loads((tmp_path / "off" / "training_metrics.json").read_text())
    assert on["train_samples"] == off["train_samples"] == 14 - 4
    assert on["draft_vocab_coverage"] == off["draft_vocab_coverage"]
    d_on = load_drafter(tmp_path / "run" / "drafter", target)
    d_off = load_drafter(tmp_path / "off" / "drafter", target)
    assert (d_on.d2t == d_off.d2t).all()
