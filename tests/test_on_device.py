"""The device-parametrized tests: the loop, the drafters, a training step and the commands on
``--device`` (default cpu; ``scripts/gpu_check.sh`` runs this file with ``--device cuda``).

Each test builds its models and tensors on the device under test, so on a GPU they catch what
the CPU cannot: a tensor or generator left on the CPU, a host-side assumption, a dtype a kernel
lacks.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama

from draftsmith.heads.eagle import EagleConfig, build_drafter
from draftsmith.heads.eagle_proposer import EagleProposer
from draftsmith.heads.ngram import NGramDrafter
from draftsmith.heads.sampling import SamplingParams
from draftsmith.train.decoding.speculative import generate
from draftsmith.train.device import DeviceTimer, IntervalTimer, make_generator
from draftsmith.train.objectives.eagle_ttt import eagle3_ttt_loss


@pytest.fixture
def tgt(device):
    return tiny_llama(seed=0).to(device).eval()


def _prompts(device, n: int = 3) -> list[torch.Tensor]:
    g = make_generator("cpu", 0)  # the same prompts on every device
    return [torch.randint(0, 64, (6 + i,), generator=g).to(device) for i in range(n)]


def _eagle3(tgt, device):
    cfg = EagleConfig.from_target(tgt.config, 3, feature_layers=[1, 2, 3])
    return build_drafter(tgt, cfg, seed=1).to(device).eval()


@pytest.mark.parametrize("kind", ["ngram", "eagle3", "eagle3-tree"])
def test_greedy_is_the_targets_own_output(tgt, device, kind):
    drafter = _eagle3(tgt, device) if kind.startswith("eagle") else None
    for prompt in _prompts(device):
        plain = generate(tgt, prompt, None, max_new_tokens=20)
        if drafter is None:
            proposer = NGramDrafter()
        else:
            proposer = EagleProposer(drafter, tree=kind.endswith("tree"))
        spec = generate(tgt, prompt, proposer, k=3, max_new_tokens=20)
        assert spec.tokens == plain.tokens
        assert spec.target_forwards <= plain.target_forwards


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampling_with_a_device_generator_is_reproducible(tgt, device, tree):
    """A generator on the device the target's tensors live on (a CPU one fails on CUDA); a
    sampled tree's decisions are drawn on the device too."""
    sampling = SamplingParams(temperature=0.9, top_k=20)
    drafter = EagleProposer(_eagle3(tgt, device), tree=tree)
    prompt = _prompts(device, 1)[0]
    outs = [
        generate(
            tgt,
            prompt,
            drafter,
            k=3,
            max_new_tokens=16,
            sampling=sampling,
            generator=make_generator(device, 5),
        ).tokens
        for _ in range(2)
    ]
    assert outs[0] == outs[1] and len(outs[0]) == 16


def test_sampled_loop_follows_the_target_distribution(tgt, device):
    """The first two sampled tokens, drafted by an untrained EAGLE-3 drafter (its q is far from
    p, so acceptance and residual resampling both run), against the target's own p (χ²)."""
    prompt = _prompts(device, 1)[0]
    drafter = _eagle3(tgt, device)
    sampling = SamplingParams(temperature=1.0, top_k=4)
    with torch.no_grad():
        logits = tgt(prompt[None]).logits[0, -1].float()
    top = logits.topk(4)
    p = torch.softmax(top.values, -1).cpu()
    gen = make_generator(device, 11)
    counts = torch.zeros(4)
    n = 400
    for _ in range(n):
        proposer = EagleProposer(drafter)
        out = generate(
            tgt, prompt, proposer, k=2, max_new_tokens=2, sampling=sampling, generator=gen
        )
        hit = (top.indices.cpu() == out.tokens[0]).nonzero()
        assert hit.numel() == 1  # never outside the target's top-k
        counts[hit[0, 0]] += 1
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected.clamp_min(1e-9)).sum())
    assert chi2 < 16.3  # χ²(3) at p = 0.001


def test_eagle3_training_step_on_device(tgt, device):
    """One TTT forward/backward on the device, bf16 autocast where the device has it."""
    drafter = _eagle3(tgt, device).train()
    ids = torch.stack(_prompts(device, 1) * 2)[:, :6]
    with torch.no_grad():
        hidden = tgt(ids, output_hidden_states=True).hidden_states
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
        "hidden_states": dict(enumerate(hidden)),
    }
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        loss, metrics = eagle3_ttt_loss(drafter, batch, tgt.lm_head, steps=2)
    loss.backward()
    grads = [p.grad for p in drafter.parameters() if p.requires_grad]
    assert all(g is not None and g.device.type == device.type for g in grads)
    assert torch.isfinite(loss) and metrics["acc_0"].device.type == device.type


def test_timer_measures_device_work(device):
    """The loop's interval timer (device events, one synchronize) reads what a synchronized wall
    clock reads around the same work, and an interval without work reads about nothing."""
    timer = DeviceTimer(device)
    x = torch.randn(512, 512, device=device)
    x = x @ x  # warm: the first matmul pays one-off costs
    intervals = IntervalTimer(device)
    t0 = timer.now()
    mark = intervals.start()
    for _ in range(20):
        x = x @ x / 512
    intervals.stop(mark)
    wall = timer.now() - t0
    idle = intervals.start()
    intervals.stop(idle)
    measured = intervals.total()
    assert wall > 0 and 0.5 * wall <= measured <= 1.2 * wall + 1e-3, (measured, wall)


def test_evaluate_runs_on_the_device(tiny_target_dir, tmp_path, device):
    from draftsmith.recipes import evaluate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "more words here"}\n')
    out = tmp_path / "r.json"
    argv = ["--target", str(tiny_target_dir), "--prompts", str(prompts), "--device", str(device)]
    argv += ["--drafter", "ngram", "--k", "3", "--max-new-tokens", "16", "--out", str(out)]
    assert evaluate.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["identical_to_target"] is True
    assert result["machine"]["device_type"] == device.type
