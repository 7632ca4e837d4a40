"""``draftsmith plan``: the fake-tensor step simulation, the per-device sum, the command (issue 50,
finding 7: nobody could tell in advance what fits).

The predictions are checked against measured peaks by ``scripts/check_plan_cpu.py`` (a benchmark:
real 8B widths take minutes a step here); these tests check the pieces and the command.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from transformers import LlamaConfig

from draftsmith.recipes.cli import main as cli
from draftsmith.recipes.plan import resolve_target_config
from draftsmith.train.plan.memory import Launch, parameter_counts, plan
from draftsmith.train.plan.simulate import (
    MemoryTracker,
    StepSpec,
    build_step,
    run_step,
    simulate_step,
)

REPO = Path(__file__).resolve().parents[1]


def _config(**kw) -> LlamaConfig:
    base = dict(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    return LlamaConfig(**{**base, **kw})


def _spec(**kw) -> StepSpec:
    base = dict(
        target_config=_config(),
        feature_layers=(1, 2, 3),
        draft_vocab_size=500,
        ttt_steps=3,
        seq_len=128,
        target_dtype=torch.bfloat16,
        autocast=True,
        foreach=False,
        device="cpu",
    )
    return StepSpec(**{**base, **kw})


def test_tracker_counts_what_is_alive_and_the_peak():
    tracker = MemoryTracker()
    with tracker:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        b = torch.empty(500, dtype=torch.float32)  # 2000
        v = a.view(10, 100)  # a view allocates nothing
        assert tracker.live == 6000
        del a, v
        c = torch.empty(250, dtype=torch.float32)  # 1000: peak stays 6000
        assert tracker.live == 3000
        assert tracker.peak == 6000
        del b, c
        assert tracker.live == 0
    assert tracker.peak == 6000


def test_simulated_step_equals_the_real_step_saved_for_backward():
    """The simulation runs the step's own code: what a real step keeps after its forward (the
    activations the backward reads) is what the fake one counts, on a small shape."""
    spec = _spec(online=False, autocast=False, target_dtype=torch.float32)
    sim = simulate_step(spec)
    tracker = MemoryTracker()
    models = build_step(spec)
    with tracker:
        seen = run_step(spec, models, tracker)
    assert seen["after_forward"] == sim.after_forward
    assert seen["forward_peak"] == sim.forward_peak
    assert tracker.peak == sim.peak


def test_activations_grow_linearly_with_tokens():
    """No T x T term is left: doubling the tokens at most doubles the step's peak (the constant
    part, the weights' gradients while they are made, makes it less)."""
    peaks = {t: simulate_step(_spec(seq_len=t)).peak for t in (256, 512, 1024)}
    assert peaks[512] < 2 * peaks[256] and peaks[1024] < 2 * peaks[512]
    slope1 = peaks[512] - peaks[256]
    slope2 = (peaks[1024] - peaks[512]) / 2
    assert abs(slope2 / slope1 - 1) < 0.1, peaks
    batch = simulate_step(_spec(seq_len=256, micro_batch=2)).peak
    assert abs(batch - peaks[512]) / peaks[512] < 0.1


def test_sharding_divides_what_it_shards():
    spec = _spec(online=True)
    counts = parameter_counts(spec)
    step = simulate_step(spec)
    one = plan(spec, Launch(gpus=8, gpu_memory_gib=24, strategy="ddp"), counts=counts, step=step)
    sharded = plan(
        spec, Launch(gpus=8, gpu_memory_gib=24, strategy="fsdp"), counts=counts, step=step
    )
    assert sharded.parts["AdamW state (fp32)"] * 7 < one.parts["AdamW state (fp32)"]
    assert sharded.parts["target weights"] < one.parts["target weights"]
    assert "DDP gradient buckets" in one.parts and "DDP gradient buckets" not in sharded.parts
    assert one.parts["activations (peak of the step)"] == step.peak
    d = counts["drafter"]
    assert one.parts["drafter weights (fp32)"] == 4 * d
    assert one.total == sum(one.parts.values())


def test_offline_keeps_only_the_embedding_and_head():
    spec = _spec(online=False)
    counts = parameter_counts(spec)
    p = plan(spec, Launch(gpus=1), counts=counts, step=simulate_step(spec))
    assert p.parts["target embedding and head"] == counts["target_embed_head"] * 2  # bf16
    assert "target weights" not in p.parts


def test_every_shipped_architecture_resolves():
    arch = sorted((REPO / "recipes" / "architectures").glob("*/*/config.json"))
    assert arch, "no shipped architecture"
    for path in arch:
        hub_id = str(path.parent.relative_to(REPO / "recipes" / "architectures"))
        assert resolve_target_config(hub_id).hidden_size > 0


def test_plan_command_for_an_8b_config(capsys, tmp_path):
    """The shipped 8B config on one 80 GB GPU fits; on one 16 GB GPU it does not (exit 3), and
    the JSON holds each part."""
    config = REPO / "recipes" / "configs" / "eagle3_llama31_8b.yaml"
    out = tmp_path / "plan.json"
    code = cli(["plan", "--train-config", str(config), "--no-alternatives", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "fits" in text and "Llama-3.1-8B" in text
    data = json.loads(out.read_text())
    assert data["plan"]["fits"] and data["plan"]["total"] == sum(data["plan"]["parts"].values())
    code = cli(
        ["plan", "--train-config", str(config), "--gpu-memory-gib", "16", "--no-alternatives"]
    )
    assert code == 3
    assert "does NOT fit" in capsys.readouterr().out


def test_every_shipped_scale_config_plans(capsys):
    """Each shipped 8B/70B config goes through the planner (exit 0: fits, 3: does not), never an
    error: Qwen3's per-layer ``layer_types`` must be cut with the depth of the simulated target
    (it was not: transformers refused the config)."""
    configs = sorted((REPO / "recipes" / "configs").glob("eagle3_*b*.yaml"))
    assert len(configs) >= 3
    for config in configs:
        code = cli(["plan", "--train-config", str(config), "--seq-len", "256", "--no-alternatives"])
        out = capsys.readouterr()
        assert code in (0, 3), f"{config.name}: {out.err}"
        assert "GiB" in out.out


def test_plan_command_names_a_bad_target(capsys):
    assert cli(["plan", "--target", "nobody/NoSuchModel", "--no-alternatives"]) == 2
    err = capsys.readouterr().err
    assert "target" in err and "NoSuchModel" in err and len(err.strip().splitlines()) == 1


def test_alternatives_say_what_fits():
    """On a GPU too small for the asked length, the planner finds a shorter length and a smaller
    micro-batch that fit, and each answer is consistent with a plan of its own."""
    from draftsmith.train.plan.memory import what_fits

    spec = _spec(seq_len=4096, micro_batch=4)
    counts = parameter_counts(spec)
    base = plan(spec, Launch(gpus=1, gpu_memory_gib=1.0, runtime_bytes=0), counts=counts)
    launch = Launch(gpus=1, gpu_memory_gib=base.total / 2**30 * 0.7, runtime_bytes=0)
    alt = what_fits(spec, launch, counts)
    mb = alt["largest_micro_batch"]
    assert mb is not None and 1 <= mb < 4
    assert plan(dataclasses.replace(spec, micro_batch=mb), launch, counts=counts).fits
    assert not plan(dataclasses.replace(spec, micro_batch=mb + 1), launch, counts=counts).fits
    t = alt["largest_seq_len_at_micro_batch_1"]
    assert t is not None and t > 4096
