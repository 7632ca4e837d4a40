"""recipes/medusa.py end to end on a tiny target: Medusa-1 (online/offline), Medusa-2, 2 processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from draftsmith.heads.medusa import load_accuracy, load_medusa, medusa_proposer, medusa_target_dir
from draftsmith.recipes.medusa import MedusaConfig
from draftsmith.recipes.medusa import main as train_medusa
from draftsmith.train.config import ConfigError, load_config
from draftsmith.train.decoding.speculative import generate
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
    """Chat records with repetitive answers (learnable in a few steps)."""
    with open(path, "w") as f:
        for i in range(n):
            answer = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(12))
            msgs = [
                {"role": "user", "content": f"say {i}"},
                {"role": "assistant", "content": answer},
            ]
            f.write(json.dumps({"id": i, "messages": msgs}) + "\n")
    return path


def args(tmp_path, target_dir, **over) -> list[str]:
    values = {
        "target": target_dir,
        "data": write_records(tmp_path / "data.jsonl"),
        "split": "all",
        "max_length": 96,
        "batch_size": 2,
        "grad_accum": 2,
        "max_steps": 4,
        "num_heads": 3,
        "val_samples": 4,
        "log_every": 2,
        "save_every": 2,
        "lr": 3e-3,
        "tree_nodes": 8,
        "output_dir": tmp_path / "run",
        "threads": 1,
        "progress": False,
    }
    values.update(over)
    argv = []
    for key, value in values.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            argv += [f"--{flag}", str(value)]
    return argv


def test_config_errors_name_every_field(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(
            MedusaConfig,
            overrides={
                "num_heads": "0",
                "lr": "-1",
                "head_decay": "1.5",
                "hidden_states": "offline",
                "stage": "medusa2",
                "warmup_ratio": "1",
                "lora_dropout": "1",
                "draft_vocab_size": "-1",
                "head_loss": "lk_hybrid",  # with the default hard labels: nothing to accept against
            },
        )
    fields = {f for f, _ in err.value.problems}
    assert fields == {
        "head_loss",
        "draft_vocab_size",
        "num_heads",
        "lr",
        "head_decay",
        "hidden_states_cache",
        "hidden_states",
        "warmup_ratio",
        "lora_dropout",
    }
    with pytest.raises(ConfigError) as err:
        load_config(MedusaConfig, overrides={"head_labels": "teacher", "stage": "medusa3"})
    assert {f for f, _ in err.value.problems} == {"head_labels", "stage", "data"}
    assert train_medusa(["--num-heads", "0", "--output-dir", str(tmp_path)]) == 2


def test_medusa1_trains_saves_resumes_and_proposes(tmp_path, tiny_target_dir, capsys):
    assert train_medusa(args(tmp_path, tiny_target_dir)) == 0
    run = tmp_path / "run"
    metrics = json.loads((run / "training_metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["resumed_from"] is None
    assert [e["step"] for e in metrics["train_log"]] == [2, 4]
    assert {f"train/head{k}_top5" for k in range(3)} <= metrics["train_log"][0].keys()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_4"]
    acc = json.loads((run / "heads" / "head_accuracy.json").read_text())
    assert len(acc["rank_accuracy"]) == 3 and acc["tree"]["nodes"] == 8
    assert acc["val_samples"] == 4 and all(n > 0 for n in acc["positions"])
    heads = load_medusa(run / "heads")
    assert heads.num_heads == 3 and medusa_target_dir(run / "heads") is None

    # Continue from step 4 to 6 (resume is the default); the result is a new final save.
    assert train_medusa(args(tmp_path, tiny_target_dir, max_steps=6)) == 0
    metrics = json.loads((run / "training_metrics.json").read_text())
    assert metrics["steps"] == 6 and metrics["resumed_from"] == 4
    assert [e["step"] for e in metrics["train_log"]] == [2, 4, 6]  # history kept over the resume
    assert not torch.equal(
        load_medusa(run / "heads").blocks[0].layers[0].weight, heads.blocks[0].layers[0].weight
    )
    # Without resume, a finished run is not overwritten by accident.
    assert train_medusa(args(tmp_path, tiny_target_dir, resume=False)) == 2
    assert "already holds a medusa run" in capsys.readouterr().err

    target, _ = load_target(tiny_target_dir)
    prompt = torch.tensor([[5, 6, 7, 8]])
    plain = generate(target, prompt, None, max_new_tokens=24)
    for tree in (False, True):
        proposer = medusa_proposer(run / "heads", target, tree=tree)
        assert (proposer.choices is not None) == tree
        assert generate(target, prompt, proposer, k=3, max_new_tokens=24).tokens == plain.tokens


def test_draft_vocab_trains_resumes_validates_and_proposes(tmp_path, tiny_target_dir, capsys):
    """draft_vocab_size: the heads predict over EAGLE-3's vocabulary of the run's data (the N most
    frequent supervised tokens, EOS in), saved with them and kept over a resume; the target's
    greedy output is unchanged, chain and tree. Offline without data, the cache's tokens give the
    same vocabulary."""
    from draftsmith.train.core.data import eos_ids, load_samples
    from draftsmith.train.data.vocab import coverage, draft_vocab, token_counts

    n = 12  # fewer than the data's distinct supervised tokens: some labels fall outside
    assert train_medusa(args(tmp_path, tiny_target_dir, draft_vocab_size=n)) == 0
    run = tmp_path / "run"
    heads = load_medusa(run / "heads")
    assert heads.draft_vocab_size == n and heads.lm_heads[0].weight.shape[0] == n
    target, tok = load_target(tiny_target_dir)
    tokens, _ = load_samples(tmp_path / "data.jsonl", tok, max_length=96, split="all")
    counts = token_counts(tokens, heads.vocab_size, max_length=96)
    d2t, t2d = draft_vocab(counts, n, always_include=eos_ids(tok, target))
    assert torch.equal(heads.d2t, d2t) and torch.equal(heads.t2d, t2d)
    metrics = json.loads((run / "training_metrics.json").read_text())
    assert metrics["draft_vocab_size"] == n
    assert metrics["draft_vocab_coverage"] == pytest.approx(coverage(counts, t2d))
    assert 0.5 < metrics["draft_vocab_coverage"] < 1.0
    assert all(n_ > 0 for n_ in metrics["final_validation"]["positions"])
    assert f"draft vocab: {n} of {heads.vocab_size} tokens" in capsys.readouterr().out

    assert train_medusa(args(tmp_path, tiny_target_dir, draft_vocab_size=n, max_steps=6)) == 0
    metrics = json.loads((run / "training_metrics.json").read_text())
    assert metrics["steps"] == 6 and metrics["resumed_from"] == 4
    resumed = load_medusa(run / "heads")
    assert torch.equal(resumed.d2t, d2t) and torch.equal(resumed.t2d, t2d)
    assert not torch.equal(resumed.lm_heads[0].weight, heads.lm_heads[0].weight)

    prompt = torch.tensor([[5, 6, 7, 8]])
    plain = generate(target, prompt, None, max_new_tokens=24)
    for tree in (False, True):
        proposer = medusa_proposer(run / "heads", target, tree=tree)
        assert generate(target, prompt, proposer, k=3, max_new_tokens=24).tokens == plain.tokens

    cache_final_layer(tmp_path, tiny_target_dir)
    offline = args(
        tmp_path,
        tiny_target_dir,
        draft_vocab_size=n,
        max_steps=2,
        save_every=0,
        hidden_states="offline",
        hidden_states_cache=tmp_path / "cache",
        output_dir=tmp_path / "off",
    )
    i = offline.index("--data")
    del offline[i : i + 2]  # the cache holds the tokens
    assert train_medusa(offline) == 0
    off = load_medusa(tmp_path / "off" / "heads")
    assert torch.equal(off.d2t, d2t) and torch.equal(off.t2d, t2d)

    too_big = args(tmp_path, tiny_target_dir, draft_vocab_size=10**6, output_dir=tmp_path / "big")
    assert train_medusa(too_big) == 2
    assert "draft_vocab_size: 1000000 is larger than the target's vocabulary" in (
        capsys.readouterr().err
    )


def cache_final_layer(tmp_path, target_dir, max_length: int | None = None) -> list[int]:
    """The tiny target's final hidden states of write_records' data, cached in tmp_path/cache;
    the samples' lengths before truncation to ``max_length``."""
    from draftsmith.train.core.data import load_samples
    from draftsmith.train.data.chat import template_fingerprint
    from draftsmith.train.features.cache_write import build_cache

    target, tokenizer = load_target(target_dir)
    data = write_records(tmp_path / "data.jsonl")
    tokens, _ = load_samples(data, tokenizer, max_length=96, split="all")
    build_cache(
        target,
        tokens,
        tmp_path / "cache",
        [4],
        dtype="fp32",
        max_length=max_length,
        template_fingerprint=template_fingerprint(tokenizer),
        progress=False,
    )
    return [len(ids) for ids in tokens["input_ids"]]


def test_offline_cache_gives_the_same_heads_as_online(tmp_path, tiny_target_dir):
    # The cache holds fp32 features: the online run's target computes in fp32 too (`auto` is bf16
    # on a CPU with AVX512-BF16, and bf16 features would train different heads).
    assert train_medusa(args(tmp_path, tiny_target_dir, save_every=0, target_dtype="fp32")) == 0
    cache_final_layer(tmp_path, tiny_target_dir)
    offline = args(
        tmp_path,
        tiny_target_dir,
        save_every=0,
        target_dtype="fp32",
        hidden_states="offline",
        hidden_states_cache=tmp_path / "cache",
        output_dir=tmp_path / "off",
    )
    assert train_medusa(offline) == 0
    on, off = load_medusa(tmp_path / "run" / "heads"), load_medusa(tmp_path / "off" / "heads")
    for (name, a), b in zip(on.state_dict().items(), off.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_offline_cache_of_truncated_samples_is_accepted(tmp_path, tiny_target_dir):
    """A cache built at max_length from longer samples matches the trainer's data (the
    fingerprint is taken over the samples as truncated to max_length, as the cache's is): the
    heads trained from it equal the heads trained online at that max_length."""
    lengths = cache_final_layer(tmp_path, tiny_target_dir, max_length=40)
    assert max(lengths) > 40  # some samples are truncated
    common = dict(save_every=0, max_length=40, target_dtype="fp32")  # fp32: the cache's features
    assert train_medusa(args(tmp_path, tiny_target_dir, **common)) == 0
    offline = dict(hidden_states="offline", hidden_states_cache=tmp_path / "cache")
    off_argv = args(tmp_path, tiny_target_dir, **common, **offline, output_dir=tmp_path / "off")
    assert train_medusa(off_argv) == 0
    on, off = load_medusa(tmp_path / "run" / "heads"), load_medusa(tmp_path / "off" / "heads")
    for (name, a), b in zip(on.state_dict().items(), off.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_medusa2_writes_the_merged_target(tmp_path, tiny_target_dir):
    argv = args(
        tmp_path,
        tiny_target_dir,
        stage="medusa2",
        max_steps=5,
        heads_warmup_steps=2,
        lora_r=4,
        lr=1e-2,
        save_every=0,
    )
    assert train_medusa(argv) == 0
    run = tmp_path / "run"
    metrics = json.loads((run / "training_metrics.json").read_text())
    assert metrics["train_log"][0]["train/target_loss"] == 0.0  # steps 1-2: heads only
    assert metrics["train_log"][-1]["train/target_loss"] > 0.0
    merged_dir = medusa_target_dir(run / "heads")
    assert merged_dir == (run / "target").resolve()
    merged, _ = load_target(merged_dir)
    original, _ = load_target(tiny_target_dir)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[q], original.state_dict()[q])
    # The heads go with the fine-tuned target; the original is refused.
    with pytest.raises(ValueError, match="evaluate them with that target"):
        medusa_proposer(run / "heads", original)
    prompt = torch.tensor([[9, 10, 11]])
    plain = generate(merged, prompt, None, max_new_tokens=20)
    proposer = medusa_proposer(run / "heads", merged, tree=True)
    assert generate(merged, prompt, proposer, k=3, max_new_tokens=20).tokens == plain.tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(*argv: str, config: str = "cpu_2proc.yaml") -> subprocess.CompletedProcess:
    accelerate = shutil.which("accelerate") or "accelerate"
    return subprocess.run(
        [
            accelerate,
            "launch",
            "--config_file",
            str(REPO / "recipes/accelerate" / config),
            "--main_process_port",
            str(_free_port()),
            str(REPO / "recipes/medusa.py"),
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _train_and_extend(tmp_path: Path, target_dir: Path, launch: str) -> dict:
    """2 CPU processes: train 4 steps, then resume the run to 6; its metrics."""
    config = {"ddp": "cpu_2proc.yaml", "fsdp": "fsdp_cpu_2proc.yaml"}[launch]
    over = {"output_dir": tmp_path / launch, "val_samples": 5}
    proc = _launch(*args(tmp_path, target_dir, report_to="wandb", **over), config=config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((tmp_path / launch / "training_metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["steps"] == 4
    proc = _launch(*args(tmp_path, target_dir, max_steps=6, **over), config=config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    return json.loads((tmp_path / launch / "training_metrics.json").read_text())


@pytest.mark.integration
def test_two_cpu_processes_train_and_resume_ddp_and_fsdp(tmp_path, tiny_target_dir, monkeypatch):
    """Medusa-1 on 2 CPU processes, DDP and FSDP (target and heads sharded, online features):
    each trains, is resumed to more steps, and both train the same numbers. 5 validation
    samples: ranks get 3 and 2, yet under FSDP every rank joins every sharded target forward."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    runs = {
        launch: _train_and_extend(tmp_path, tiny_target_dir, launch) for launch in ("ddp", "fsdp")
    }
    for launch, metrics in runs.items():
        assert metrics["distributed"] == launch
        assert metrics["steps"] == 6 and metrics["resumed_from"] == 4 and metrics["processes"] == 2
        # Validation counts were summed over both processes (each took its share of samples).
        assert sum(metrics["final_validation"]["positions"]) > 0
        assert list((tmp_path / launch).glob("wandb/offline-run-*")), "W&B offline run missing"
    a, b = runs["ddp"], runs["fsdp"]
    # Every validation position counted once, none from the padding batch FSDP adds.
    assert a["final_validation"]["positions"] == b["final_validation"]["positions"]
    la = [e["train/loss"] for e in a["train_log"]]
    lb = [e["train/loss"] for e in b["train_log"]]
    assert len(la) == len(lb) == 3
    # Equal up to the gradient summation order (tests/test_fsdp.py says why 1e-4).
    assert max(abs(x - y) / abs(y) for x, y in zip(la, lb, strict=True)) < 1e-4, (la, lb)
    ta, tb = a["final_validation"]["top1"], b["final_validation"]["top1"]
    assert max(abs(x - y) for x, y in zip(ta, tb, strict=True)) < 1e-3, (ta, tb)


@pytest.mark.parametrize("stage", ["medusa1", "medusa2"])
def test_val_data_chooses_best_and_the_tree(tmp_path, tiny_target_dir, stage):
    """val_data's records are validated beside the split: their τ chooses best/ and the tree."""
    held = tmp_path / "held.jsonl"
    with open(held, "w") as f:
        for i in range(5):
            msgs = [  # answers the heads never saw
                {"role": "user", "content": f"tell {i}"},
                {"role": "assistant", "content": " ".join(reversed(WORDS))},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    over = {"stage": stage, "lora_r": 4, "save_every": 0} if stage == "medusa2" else {}
    argv = args(tmp_path, tiny_target_dir, val_data=held, eval_every=2, **over)
    assert train_medusa(argv) == 0
    metrics = json.loads((tmp_path / "run" / "training_metrics.json").read_text())
    assert [v["step"] for v in metrics["validation"]] == [2, 4]
    for entry in metrics["validation"]:
        split, tau = entry["val_split/sim_tau"], entry["val/sim_tau"]
        assert entry["val/sim_tau_gap"] == pytest.approx(split / tau - 1)
    final, last = metrics["final_validation"], metrics["validation"][-1]
    assert final["val_data_samples"] == 5 and final["split"]["val_samples"] == 4
    # val/* (which choose best/) are val_data's figures, val_split/* the training records'; the
    # final report, and with it the automatic tree, is val_data's.
    assert last["val/head0_top1"] == pytest.approx(final["top1"][0])
    assert last["val_split/head0_top1"] == pytest.approx(final["split"]["top1"][0])
    assert last["val/tree_expected_tau"] == pytest.approx(
        final["tree"]["expected_acceptance_length"]
    )
    best = tmp_path / "run" / "best"
    if stage == "medusa2":  # its heads need the target of their own step: no best/
        assert not best.exists()
        return
    # best/ is usable like heads/: the validation's accuracies (the automatic tree's input) and
    # the config extras beside the weights.
    chosen = max(metrics["validation"], key=lambda e: e["val/sim_tau"])
    assert metrics["best"]["step"] == chosen["step"]
    accuracy = json.loads((best / "head_accuracy.json").read_text())
    assert accuracy["top1"][0] == pytest.approx(chosen["val/head0_top1"])
    assert accuracy["val_data_samples"] == 5
    assert json.loads((best / "config.json").read_text())["stage"] == "medusa1"
    assert load_accuracy(best)["top1"] == accuracy["top1"]
