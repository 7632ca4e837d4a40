"""recipes/distill.py end to end on a tiny target: train, validate, checkpoint, resume, save."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.recipes.distill import DistillConfig, is_on_policy_step, main, on_policy_batch
from draftsmith.train.core.checkpoint import finished_checkpoints
from draftsmith.train.data.batching import collate_hidden_states
from tests.conftest import byte_tokenizer

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
    "see",
    "dog",
    "who",
    "was",
    "red",
    "blue",
    "tall",
]


def write_chat(path: Path, n: int = 24) -> Path:
    """``n`` short chat records (messages shape, integer ids: id % 10 == 9 is held out)."""
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for i in range(n):
            pick = torch.randint(0, len(WORDS), (14,), generator=g).tolist()
            user = " ".join(WORDS[j] for j in pick[:5])
            answer = " ".join(WORDS[j] for j in pick[5:])
            msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"id": i, "messages": msgs}) + "\n")
    return path


def tied_target_dir(path: Path) -> Path:
    """A tiny target whose lm_head is its input embedding (as in SmolLM2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def base_args(tmp_path: Path, target_dir: Path, out: str, *extra: str) -> list[str]:
    return [
        "--target",
        str(target_dir),
        "--data",
        str(write_chat(tmp_path / "chat.jsonl")),
        "--output-dir",
        str(tmp_path / out),
        "--draft-layers",
        "0",
        "--batch-size",
        "4",
        "--lr",
        "1e-2",
        "--warmup-ratio",
        "0",
        "--val-samples",
        "4",
        "--log-every",
        "1",
        "--no-progress",
        "--threads",
        "1",
        "--seed",
        "3",
        *extra,
    ]


@pytest.mark.parametrize("loss", ["tvd", "lk_hybrid"])
def test_recipe_trains_validates_and_saves(tmp_path, tiny_target_dir, loss):
    from transformers import AutoModelForCausalLM

    argv = base_args(
        tmp_path,
        tiny_target_dir,
        "run",
        "--max-steps",
        "8",
        "--eval-every",
        "4",
        "--save-every",
        "4",
        "--keep-checkpoints",
        "1",
        "--loss",
        loss,
    )
    assert main(argv) == 0
    out = tmp_path / "run"
    metrics = json.loads((out / "training_metrics.json").read_text())
    before, after = metrics["validation_before"], metrics["final_validation"]
    assert metrics["steps"] == 8 and metrics["val_records"] == 4
    assert after["expected_acceptance"] > before["expected_acceptance"]
    assert [h["step"] for h in metrics["validation"]] == [4, 8]
    # The training loss is in the metrics, one entry per logged step.
    assert [e["step"] for e in metrics["train_log"]] == list(range(1, 9))
    assert all(e["train/loss"] > 0 for e in metrics["train_log"])
    assert 0 < metrics["compute_ratio"] < 1
    # Only the newest checkpoint is kept; the draft loads as a plain HF model with tokenizer.
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_8"]
    draft = AutoModelForCausalLM.from_pretrained(out / "draft")
    assert draft.config.num_hidden_layers == 1
    assert (out / "draft" / "tokenizer.json").is_file()
    card = (out / "draft" / "README.md").read_text()
    assert str(tiny_target_dir) in card and f"{after['expected_acceptance']:.4f}" in card


def test_val_data_validates_like_the_evaluation(tmp_path, tiny_target_dir):
    """val_data: given exactly the held-back training records, its simulated τ equals the
    split's and chooses best/; the split's figures are logged as val_split/* with the gap."""
    from draftsmith.train.core.data import split_indices

    records = [json.loads(line) for line in write_chat(tmp_path / "chat.jsonl").open()]
    train_records = [r for r in records if r["id"] % 10 != 9]  # split: train
    _, val_idx = split_indices(len(train_records), 4, 3)  # base_args: --seed 3
    same = tmp_path / "same_as_split.jsonl"
    same.write_text("".join(json.dumps(train_records[i]) + "\n" for i in val_idx))
    argv = base_args(
        tmp_path,
        tiny_target_dir,
        "run",
        "--max-steps",
        "4",
        "--eval-every",
        "2",
        "--val-data",
        str(same),
    )
    assert main(argv) == 0
    metrics = json.loads((tmp_path / "run" / "training_metrics.json").read_text())
    assert [v["step"] for v in metrics["validation"]] == [2, 4]
    for v in metrics["validation"]:
        assert v["val/sim_tau"] == pytest.approx(v["val_split/sim_tau"], abs=1e-6)
        assert v["val/greedy_agreement"] == pytest.approx(v["val_split/greedy_agreement"])
        assert v["val/sim_tau_gap"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["final_validation"]["sim_tau_gap"] == pytest.approx(0.0, abs=1e-6)


def test_resume_continues_exactly_where_it_paused(tmp_path):
    from transformers import AutoModelForCausalLM

    # A tied target (like SmolLM2): checkpoints and the saved draft must keep the tie.
    tiny_target_dir = tied_target_dir(tmp_path / "tied")
    # 2 epochs of 5 batches + gradient accumulation 2: the pause lands mid-epoch.
    common = ["--max-steps", "6", "--grad-accum", "2", "--save-every", "0", "--eval-every", "0"]
    assert main(base_args(tmp_path, tiny_target_dir, "straight", *common, "--no-resume")) == 0
    paused = base_args(tmp_path, tiny_target_dir, "paused", *common)
    assert main([*paused, "--stop-after-steps", "4"]) == 0
    assert [s for s, _ in finished_checkpoints(tmp_path / "paused")] == [4]
    assert not (tmp_path / "paused" / "draft").exists()  # paused: no final draft yet
    assert main(paused) == 0
    a = load_file(tmp_path / "straight" / "draft" / "model.safetensors")
    b = load_file(tmp_path / "paused" / "draft" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert json.loads((tmp_path / "paused" / "training_metrics.json").read_text())["steps"] == 6
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "paused" / "draft")
    assert draft.lm_head.weight is draft.model.embed_tokens.weight


def test_on_policy_schedule_and_batch(tiny_target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    assert [is_on_policy_step(s, 0.25) for s in range(8)] == [False, False, False, True] * 2
    assert not any(is_on_policy_step(s, 0.0) for s in range(10))
    assert all(is_on_policy_step(s, 1.0) for s in range(10))
    draft = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    samples = [
        {"input_ids": torch.tensor([5, 6, 7, 8, 9]), "loss_mask": torch.tensor([0, 0, 1, 1, 1])},
        {"input_ids": torch.tensor([1, 2, 3, 4]), "loss_mask": torch.tensor([0, 0, 0, 1])},
    ]
    batch = collate_hidden_states(samples, pad_token_id=0)
    cfg = DistillConfig(data="x", on_policy_max_new_tokens=6, on_policy_temperature=0.0)
    new = on_policy_batch(draft, batch, cfg, pad_id=0, eos_ids=[])
    # Prompts kept (up to the first supervised token), then 6 greedy draft tokens, supervised.
    assert new["input_ids"][0, :2].tolist() == [5, 6]
    assert new["input_ids"][1, :3].tolist() == [1, 2, 3]
    assert new["loss_mask"][0].tolist() == [0, 0] + [1] * 6 + [0]
    assert new["loss_mask"][1].tolist() == [0, 0, 0] + [1] * 6
    greedy = draft.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False)
    assert new["input_ids"][1].tolist() == greedy[0].tolist()
    # A whole run with half of the steps on-policy.
    argv = base_args(
        tmp_path,
        tiny_target_dir,
        "op",
        "--max-steps",
        "2",
        "--on-policy-fraction",
        "0.5",
        "--on-policy-max-new-tokens",
        "8",
        "--save-every",
        "0",
    )
    assert main(argv) == 0
    assert (tmp_path / "op" / "draft" / "model.safetensors").is_file()


def test_bad_inputs_exit_2(tmp_path, tiny_target_dir, capsys):
    assert (
        main(
            [
                "--data",
                str(tmp_path / "nope.jsonl"),
                "--target",
                str(tiny_target_dir),
                "--output-dir",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "nope.jsonl" in capsys.readouterr().err
    assert main(["--lr", "0"]) == 2
    err = capsys.readouterr().err
    assert "lr: must be > 0" in err and "data: required" in err
    argv = base_args(tmp_path, tiny_target_dir, "o2", "--draft-layers", "7")
    assert main(argv) == 2
    assert "indices in [0, 4)" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(*args: str, cwd: Path, config: str = "cpu_2proc.yaml") -> subprocess.CompletedProcess:
    accelerate = shutil.which("accelerate") or "accelerate"
    try:
        return subprocess.run(
            [
                accelerate,
                "launch",
                "--config_file",
                str(REPO / "recipes/accelerate" / config),
                "--main_process_port",
                str(_free_port()),
                str(REPO / "recipes/distill.py"),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=cwd,
            env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"},
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"")[-3000:], (exc.stderr or b"")[-3000:]
        pytest.fail(f"accelerate launch timed out after 300 s; output tail: {out}")


def _pause_and_resume(tmp_path: Path, target_dir: Path, launch: str) -> dict:
    """accelerate launch on 2 CPU processes: pause at step 2, resume to 4; the run's metrics."""
    argv = base_args(
        tmp_path,
        target_dir,
        launch,
        "--max-steps",
        "4",
        "--save-every",
        "2",
        "--eval-every",
        "2",
        "--val-samples",
        "5",
        "--on-policy-fraction",
        "0.5",
        "--report-to",
        "wandb",
        "--target-dtype",  # fp32: the 1e-4 below is fp32's summation-order difference
        "fp32",
        "--mixed-precision",
        "no",
    )
    config = {"ddp": "cpu_2proc.yaml", "fsdp": "fsdp_cpu_2proc.yaml"}[launch]
    first = _launch(*argv, "--stop-after-steps", "2", cwd=tmp_path, config=config)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert [s for s, _ in finished_checkpoints(tmp_path / launch)] == [2]
    second = _launch(*argv, cwd=tmp_path, config=config)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step_2" in second.stdout
    assert (tmp_path / launch / "draft" / "model.safetensors").is_file()
    return json.loads((tmp_path / launch / "training_metrics.json").read_text())


@pytest.mark.integration
def test_two_cpu_processes_complete_and_resume_ddp_and_fsdp(tmp_path, tiny_target_dir):
    """2 CPU processes, DDP and FSDP (target and draft sharded): each pauses at a checkpoint,
    resumes, finishes and saves once, and the two train the same numbers. On-policy steps (the
    draft samples) and an odd number of validation samples (ranks get 3 and 2) are in it: under
    FSDP every rank must still join every sharded forward of the other."""
    runs = {
        launch: _pause_and_resume(tmp_path, tiny_target_dir, launch) for launch in ("ddp", "fsdp")
    }
    for launch, metrics in runs.items():
        assert metrics["distributed"] == launch
        assert metrics["processes"] == 2 and metrics["steps"] == 4
        before, after = metrics["validation_before"], metrics["final_validation"]
        assert after["expected_acceptance"] > before["expected_acceptance"]
        assert after["tokens"] == before["tokens"] > 0  # no padding batch counted

    def losses(metrics):
        train = [e["train/loss"] for e in metrics["train_log"]]
        return train + [v["val/loss"] for v in metrics["validation"]]

    # Same batches, same draft, same samples (seeded per step): equal up to the gradient
    # summation order (tests/test_fsdp.py says why 1e-4 separates that from a real difference).
    a, b = losses(runs["ddp"]), losses(runs["fsdp"])
    assert len(a) == len(b) == 6
    assert max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)) < 1e-4, (a, b)


def test_pretokenized_data_dir(tmp_path, tiny_target_dir):
    """A directory saved by `draftsmith data tokenize` trains like the conversations it came from."""
    from draftsmith.train.data.tokenize import main_tokenize

    chat = write_chat(tmp_path / "chat.jsonl")
    tokenized = tmp_path / "tok"
    assert (
        main_tokenize(
            [
                "--input",
                str(chat),
                "--output",
                str(tokenized),
                "--target",
                str(tiny_target_dir),
                "--split",
                "train",
            ]
        )
        == 0
    )
    argv = base_args(tmp_path, tiny_target_dir, "tok_run", "--max-steps", "2", "--save-every", "0")
    argv[argv.index("--data") + 1] = str(tokenized)
    assert main(argv) == 0
    metrics = json.loads((tmp_path / "tok_run" / "training_metrics.json").read_text())
    assert metrics["train_records"] + metrics["val_records"] == 22  # the 22 train-split records


def test_time_budget_ends_training_with_a_saved_draft(tmp_path, tiny_target_dir):
    argv = base_args(
        tmp_path,
        tiny_target_dir,
        "budget",
        "--max-steps",
        "50",
        "--max-minutes",
        "1e-6",
        "--save-every",
        "0",
    )
    assert main(argv) == 0
    metrics = json.loads((tmp_path / "budget" / "training_metrics.json").read_text())
    assert metrics["steps"] == 1 and metrics["total_steps"] == 50
    assert (tmp_path / "budget" / "draft" / "model.safetensors").is_file()


def test_offline_cache_trains_the_same_draft_as_online(
    tmp_path, tiny_target_dir, capsys, monkeypatch
):
    """hidden_states: offline reads the target's final layer from a `data cache` directory and
    gets p through its lm_head, without a target forward: the same draft (and draft vocabulary)
    as the online run, in fp32; the cache of another target is refused, naming the field."""
    from draftsmith.train.core.data import load_samples
    from draftsmith.train.data.chat import template_fingerprint
    from draftsmith.train.features.cache_write import build_cache
    from draftsmith.train.target_model.load import load_target

    common = ["--max-steps", "4", "--save-every", "0", "--eval-every", "2"]
    common += ["--draft-vocab-size", "40", "--target-dtype", "fp32"]
    assert main(base_args(tmp_path, tiny_target_dir, "online", *common)) == 0

    target, tokenizer = load_target(tiny_target_dir)
    tokens, _ = load_samples(tmp_path / "chat.jsonl", tokenizer, max_length=1024, split="train")
    build_cache(
        target,
        tokens,
        tmp_path / "cache",
        [target.config.num_hidden_layers],
        dtype="fp32",
        template_fingerprint=template_fingerprint(tokenizer),
        progress=False,
    )
    offline = base_args(tmp_path, tiny_target_dir, "offline", *common)
    i = offline.index("--data")
    offline[i : i + 2] = [
        "--hidden-states",
        "offline",
        "--hidden-states-cache",
        str(tmp_path / "cache"),
    ]
    from transformers.models.llama import modeling_llama

    forward, depths = modeling_llama.LlamaModel.forward, []

    def counted(self, *args, **kwargs):
        depths.append(len(self.layers))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", counted)
    assert main(offline) == 0
    assert depths and set(depths) == {1}  # only the 1-layer draft ran: no target forward
    monkeypatch.undo()
    on = json.loads((tmp_path / "online" / "training_metrics.json").read_text())
    off = json.loads((tmp_path / "offline" / "training_metrics.json").read_text())
    assert off["train_records"] == on["train_records"] and off["steps"] == 4
    assert off["draft_vocab_coverage"] == pytest.approx(on["draft_vocab_coverage"])
    for a, b in zip(on["validation"], off["validation"], strict=True):
        assert b["val/loss"] == pytest.approx(a["val/loss"], rel=1e-4)
    assert (tmp_path / "offline" / "draft" / "draft_vocab.json").read_text() == (
        tmp_path / "online" / "draft" / "draft_vocab.json"
    ).read_text()
    a = load_file(tmp_path / "online" / "draft" / "model.safetensors")
    b = load_file(tmp_path / "offline" / "draft" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4, msg=name)

    other = tied_target_dir(tmp_path / "tied")  # same shapes, other weights
    offline[offline.index("--target") + 1] = str(other)
    offline[offline.index("--output-dir") + 1] = str(tmp_path / "other")
    assert main(offline) == 2
    assert "target_hash" in capsys.readouterr().err
