"""train/core pieces on their own: ranges, split, data position, checkpoints, simulated τ."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from draftsmith.train.config import ConfigError, cfg_field, load_config
from draftsmith.train.core.accelerate_compat import reset_accelerate_state
from draftsmith.train.core.checkpoint import (
    TrainerState,
    finished_checkpoints,
    load_latest,
    save_checkpoint,
)
from draftsmith.train.core.config import TrainConfig
from draftsmith.train.core.data import (
    DataPosition,
    check_enough_data,
    eos_ids,
    rank_batches,
    split_indices,
)
from draftsmith.train.decoding.metrics import simulated_tau
from draftsmith.train.errors import RunError, UsageError


@dataclass
class _Ranged:
    lr: float = cfg_field(1e-3, help="lr", gt=0)
    ratio: float = cfg_field(0.1, help="ratio", ge=0, lt=1)
    layers: list[int] = cfg_field([0], help="layers", ge=0)
    free: float = cfg_field(1.0, help="no bounds, but finite")


def test_ranges_and_finiteness_are_checked_by_the_loader():
    with pytest.raises(ConfigError) as err:
        load_config(
            _Ranged, overrides={"lr": "0", "ratio": "1", "layers": ["1", "-2"], "free": "nan"}
        )
    problems = dict(err.value.problems)
    assert problems == {
        "lr": "must be > 0, got 0.0",
        "ratio": "must be in [0, 1), got 1.0",
        "layers": "must be >= 0, got -2",
        "free": "must be a finite number, got nan",
    }
    for bad in ("nan", "inf", "-inf"):
        with pytest.raises(ConfigError, match="lr: must be a finite number"):
            load_config(TrainConfig, overrides={"lr": bad})
    assert load_config(_Ranged, overrides={"lr": "1e-4", "ratio": "0"}).lr == 1e-4


def test_resume_and_overwrite_together_are_refused():
    with pytest.raises(ConfigError, match="overwrite"):
        load_config(TrainConfig, overrides={"overwrite": "true"})
    assert load_config(TrainConfig, overrides={"overwrite": "true", "resume": "false"}).overwrite


def test_simulated_tau():
    assert simulated_tau([]) == 1.0
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0
    assert simulated_tau([0.0, 1.0]) == 1.0  # nothing after a rejected first draft counts
    assert math.isclose(simulated_tau([0.5, 0.5]), 1 + 0.5 + 0.25)
    assert math.isclose(simulated_tau([0.8, 0.6, 0.5]), 1 + 0.8 + 0.48 + 0.24)
    assert math.isnan(simulated_tau([0.5, float("nan")]))


def test_split_is_seeded_disjoint_and_leaves_training_data():
    train, val = split_indices(10, 3, seed=1)
    assert len(val) == 3 and sorted(train + val) == list(range(10))
    assert split_indices(10, 3, seed=1) == (train, val)
    assert split_indices(10, 3, seed=2) != (train, val)
    train, val = split_indices(2, 32, seed=0)
    assert len(train) == 1 and len(val) == 1


@pytest.mark.parametrize("n", [0, 1, 4, 5, 7, 9])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_rank_batches_share_every_item_once_and_even_pads_with_dropped_batches(n, world):
    batch_size = 2
    shares = [rank_batches(n, r, world, batch_size) for r in range(world)]
    counted = sorted(i for share in shares for idx, _ in share for i in idx)
    assert counted == list(range(n))  # each item on exactly one rank
    assert all(flag for share in shares for _, flag in share)
    even = [rank_batches(n, r, world, batch_size, even=True) for r in range(world)]
    assert len({len(share) for share in even}) == 1  # every rank: the same number of batches
    for plain, padded in zip(shares, even, strict=True):
        assert padded[: len(plain)] == plain  # the real batches first, unchanged
        assert all(not flag and idx for idx, flag in padded[len(plain) :])  # then dropped ones


def test_eos_ids_merge_tokenizer_and_generation_config():
    tok = SimpleNamespace(eos_token_id=2)
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 2]))
    assert eos_ids(tok, model) == [2, 7]
    assert eos_ids(SimpleNamespace(eos_token_id=None), SimpleNamespace()) == []


def test_too_little_data_names_what_was_dropped_and_how_to_fix_it():
    summary = SimpleNamespace(dropped=Counter({"no assistant turn": 30}))
    with pytest.raises(UsageError) as err:
        check_enough_data(2, 2, source="p.jsonl", summary=summary, min_train_samples=8, allow=False)
    msg = str(err.value)
    assert "30 of 32 records dropped" in msg and "no assistant turn" in msg
    assert "draftsmith data distill" in msg and "allow_little_data" in msg
    check_enough_data(2, 2, source="p.jsonl", summary=summary, min_train_samples=8, allow=True)
    with pytest.raises(UsageError, match="no sample with a supervised token"):
        check_enough_data(0, 0, source="p.jsonl", summary=summary, min_train_samples=1, allow=True)
    check_enough_data(20, 16, source="d.jsonl", min_train_samples=8, allow=False)


def _accelerator(grad_accum: int = 1):
    from accelerate import Accelerator, DataLoaderConfiguration

    return Accelerator(
        cpu=True,
        gradient_accumulation_steps=grad_accum,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )


@pytest.mark.parametrize("n, batch_size, grad_accum, pause", [(18, 2, 3, 4), (13, 4, 2, 1)])
def test_data_position_sees_every_sample_once_per_epoch(n, batch_size, grad_accum, pause):
    """The loop shape of the recipes over 3 epochs; paused at an optimizer step and resumed."""
    data = [{"id": torch.tensor(i)} for i in range(n)]

    def run(position: DataPosition, steps: int, seen: list[int]) -> DataPosition:
        acc = _accelerator(grad_accum)
        loader = acc.prepare(torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True))
        model = acc.prepare(torch.nn.Linear(1, 1))
        done = 0
        while done < steps:
            for batch in position.batches_of_epoch(acc, loader):
                with acc.accumulate(model):
                    seen += batch["id"].tolist()
                if acc.sync_gradients:
                    done += 1
                    if done == steps:
                        break
        return position

    per_epoch = math.ceil(math.ceil(n / batch_size) / grad_accum)
    straight: list[int] = []
    run(DataPosition(), 3 * per_epoch, straight)
    resumed: list[int] = []
    paused = run(DataPosition(), pause, resumed)
    reset_accelerate_state()
    run(DataPosition(paused.epoch, paused.batches), 3 * per_epoch - pause, resumed)
    for seen in (straight, resumed):
        epochs = [seen[i * n : (i + 1) * n] for i in range(3)]
        assert len(seen) == 3 * n
        assert all(sorted(e) == list(range(n)) for e in epochs), epochs
    assert resumed == straight  # exact resume: the same order as an unbroken run


def _model_run(tmp_path, value: float):
    acc = _accelerator()
    model = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(model.weight, value)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _save(acc, model, opt, path, state, keep):
    return save_checkpoint(acc, path, state, keep, models=[model], optimizers=[opt])


def test_checkpoints_rotate_fall_back_and_refuse_other_runs(tmp_path):
    acc, model, opt = _model_run(tmp_path, 1.0)
    state = TrainerState("eagle", "eagle3", train_log=[{"step": 1, "train/loss": float("nan")}])
    for step in (1, 2, 3):
        state.step = step
        with torch.no_grad():
            model.weight.fill_(float(step))
        _save(acc, model, opt, tmp_path, state, keep=2)
    assert [s for s, _ in finished_checkpoints(tmp_path)] == [2, 3]
    text = (tmp_path / "checkpoints" / "step_3" / "trainer_state.json").read_text()
    assert json.loads(text)["train_log"][0]["train/loss"] is None  # strict JSON, no NaN
    # Another run's checkpoint in the same dir is never rotated away by this run.
    other = TrainerState("eagle", "eagle3", step=9)
    _save(acc, model, opt, tmp_path, other, keep=1)
    assert [s for s, _ in finished_checkpoints(tmp_path)] == [2, 3, 9]

    # Newest truncated: a warning, then the previous good checkpoint is loaded.
    (tmp_path / "checkpoints" / "step_9" / "model.safetensors").write_bytes(b"\0" * 10)
    said: list[str] = []
    loaded, path = load_latest(acc, tmp_path, recipe="eagle", kind="eagle3", say=said.append)
    assert loaded.step == 3 and path.name == "step_3"
    assert float(model.weight[0, 0].detach()) == 3.0 and "step_9" in said[0]
    with pytest.raises(UsageError, match="medusa1 run"):
        load_latest(acc, tmp_path, recipe="medusa", kind="medusa1")
    with pytest.raises(UsageError, match="eagle1 run"):
        load_latest(acc, tmp_path, recipe="eagle", kind="eagle1")
    # Written by 2 processes: refused (the data position is per process).
    state_file = tmp_path / "checkpoints" / "step_3" / "trainer_state.json"
    state_file.write_text(
        state_file.read_text().replace('"num_processes": 1', '"num_processes": 2')
    )
    with pytest.raises(UsageError, match="written by 2 process"):
        load_latest(acc, tmp_path, recipe="eagle", kind="eagle3")
    # Nothing readable at all: a run error, not a silent fresh start.
    for _, p in finished_checkpoints(tmp_path):
        (p / "model.safetensors").write_bytes(b"")
        (p / "trainer_state.json").write_text(json.dumps({"step": 1, "recipe": "eagle"}))
    with pytest.raises(RunError, match=r"no checkpoint .* can be loaded"):
        load_latest(acc, tmp_path, recipe="eagle", kind="eagle3", say=said.append)


def test_a_nan_model_is_never_checkpointed(tmp_path):
    from draftsmith.train.core.stop import NonFiniteError

    acc, model, opt = _model_run(tmp_path, float("nan"))
    with pytest.raises(NonFiniteError, match="not finite"):
        _save(acc, model, opt, tmp_path, TrainerState("eagle", "eagle3", step=1), keep=1)
    assert finished_checkpoints(tmp_path) == []


def test_medusa_heads_refuse_non_finite_weights(tmp_path):
    from draftsmith.heads.medusa import MedusaHeads, load_medusa

    heads = MedusaHeads(2, 1, 8, 16)
    heads.save(tmp_path / "ok")
    assert load_medusa(tmp_path / "ok").num_heads == 2
    with torch.no_grad():
        next(heads.parameters()).fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN or inf"):
        heads.save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_validation_line_names_both_figures_and_the_gap():
    from draftsmith.train.core.run import held_out_validation, validation_line

    split = ({"val/loss": 2.0, "val/acc_0": 0.5, "val/acc_1": 0.25}, 1.625)
    held = ({"val/loss": 3.0, "val/acc_0": 0.4, "val/acc_1": 0.2, "val/alpha_0": 0.3}, 1.48)
    metrics, tau = held_out_validation(split, held)
    assert tau == 1.48 and metrics["val_split/acc_0"] == 0.5
    assert metrics["val/sim_tau_gap"] == pytest.approx(1.625 / 1.48 - 1)
    line = validation_line(40, metrics, tau)
    assert line == (
        "step 40: sim τ 1.480 (training records 1.625, +10%), loss 3.000, acc 0.40 0.20, α 0.30"
    )
    assert held_out_validation(split, None) == split
    with pytest.raises(ValueError, match="nothing was validated"):
        held_out_validation(None, None)
