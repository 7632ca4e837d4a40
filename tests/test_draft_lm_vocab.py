"""A draft LM with a draft vocabulary (issue 25 item 2): it drafts with N rows of its own head.

Greedy output stays the target's and sampling stays lossless; the distillation recipe builds the
vocabulary from its training data and saves it beside the draft (``draft_vocab.json``), evaluate
drafts with it, and the HF export is the full-vocabulary model.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama
from test_distill_recipe import base_args
from test_speculative import VOCAB, _empirical, chi2_quantile, chi2_stat, exact_joint

from draftsmith.heads.draft_lm import (
    DRAFT_VOCAB_FILE,
    DraftLM,
    draft_vocab_text,
    layer_pruned_copy,
    load_draft_vocab,
)
from draftsmith.heads.sampling import SamplingParams
from draftsmith.recipes.distill import main as distill
from draftsmith.recipes.evaluate import main as evaluate
from draftsmith.train.data.vocab import draft_vocab
from draftsmith.train.decoding.speculative import generate
from draftsmith.train.export.hf import export_hf


def _ids(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    counts = torch.randint(0, 100, (vocab,), generator=torch.Generator().manual_seed(seed))
    _, t2d = draft_vocab(counts, n)
    return torch.nonzero(t2d).flatten()


def test_drafts_stay_in_the_vocabulary_and_greedy_equals_plain():
    target = tiny_llama(seed=0, init_std=0.1)
    ids = _ids(64, 40)
    drafted: list[int] = []

    class Spy(DraftLM):
        def propose(self, ids_, k, sampling, generator):
            proposal = super().propose(ids_, k, sampling, generator)
            drafted.extend(proposal.tokens.tolist())
            return proposal

    g = torch.Generator().manual_seed(100)
    for n in (8, 11):
        prompt = torch.randint(0, 64, (n,), generator=g)
        ref = generate(target, prompt, None, max_new_tokens=24).tokens
        for k in (1, 4):
            draft = Spy(layer_pruned_copy(target, [0]), target_vocab_size=64, vocab_ids=ids)
            assert generate(target, prompt, draft, k=k, max_new_tokens=24).tokens == ref, k
    allowed = set(ids.tolist())
    assert drafted and all(t in allowed for t in drafted)


def test_greedy_draft_is_the_argmax_over_the_vocabulary():
    target = tiny_llama(seed=0, init_std=0.1)
    model = layer_pruned_copy(target, [0, 1])
    ids = _ids(64, 10, seed=3)
    draft = DraftLM(model, target_vocab_size=64, vocab_ids=ids)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    draft.start(prompt[:, :-1], None)
    proposal = draft.propose(prompt, 1, SamplingParams(temperature=0.0), None)
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]
    assert proposal.tokens.tolist() == [int(ids[logits[ids].argmax()])]


def test_sampling_matches_target_distribution():
    """χ² through the loop: q is zero outside the vocabulary, and the target still decides."""
    model = tiny_llama(vocab_size=VOCAB, layers=2, seed=11, init_std=0.3)
    ids = torch.tensor([0, 2, 3, 5, 6])
    prompt = [1, 4, 2, 7]
    for sampling in (SamplingParams(temperature=1.0), SamplingParams(0.7, top_k=5, top_p=0.9)):
        draft = DraftLM(layer_pruned_copy(model, [0]), target_vocab_size=VOCAB, vocab_ids=ids)
        exact = exact_joint(model, prompt, sampling)
        counts = _empirical(model, prompt, draft, sampling, k=2)
        assert counts[exact == 0].sum() == 0
        stat, df = chi2_stat(counts, exact)
        assert stat < chi2_quantile(df, 3.72), (sampling, stat, df)


def test_vocabulary_file_round_trip_and_errors(tmp_path):
    _, t2d = draft_vocab(torch.arange(64), 12)
    (tmp_path / DRAFT_VOCAB_FILE).write_text(draft_vocab_text(t2d, coverage=0.5))
    assert torch.equal(load_draft_vocab(tmp_path, 64), torch.nonzero(t2d).flatten())
    assert load_draft_vocab(tmp_path / "absent", 64) is None
    with pytest.raises(ValueError, match=f"{DRAFT_VOCAB_FILE}: vocab_size is 64"):
        load_draft_vocab(tmp_path, 65)
    (tmp_path / DRAFT_VOCAB_FILE).write_text(json.dumps({"vocab_size": 64, "token_ids": [3, 3]}))
    with pytest.raises(ValueError, match="distinct increasing"):
        load_draft_vocab(tmp_path, 64)


def test_recipe_saves_the_vocabulary_and_evaluate_and_export_use_it(tmp_path, tiny_target_dir):
    argv = base_args(tmp_path, tiny_target_dir, "run", "--max-steps", "2", "--eval-every", "2")
    assert distill([*argv, "--draft-vocab-size", "30"]) == 0
    out = tmp_path / "run"
    metrics = json.loads((out / "training_metrics.json").read_text())
    assert 0.5 < metrics["draft_vocab_coverage"] <= 1
    for kept in ("draft", "best"):
        ids = load_draft_vocab(out / kept, _rows(out / kept))
        assert ids is not None and len(ids) == 30, kept

    res_path = tmp_path / "eval.json"
    argv = ["--target", str(tiny_target_dir), "--drafter", f"draft-lm={out / 'draft'}"]
    argv += ["--k", "3", "--max-new-tokens", "12", "--limit", "2", "--out", str(res_path)]
    assert evaluate(argv) == 0
    method = json.loads(res_path.read_text())  # one drafter: its result is the file
    assert method["method"].endswith(", 30 tokens]") and method["identical_to_target"]

    exported = export_hf(out / "draft", tmp_path / "export", device="cpu")
    assert not (exported / DRAFT_VOCAB_FILE).exists()  # the full-vocabulary equivalent
    assert "30 tokens in draftsmith's loop" in (exported / "README.md").read_text()

    # A vocabulary larger than the target's is refused (exit 2, naming the field).
    bad = base_args(tmp_path, tiny_target_dir, "run2", "--max-steps", "1", "--draft-vocab-size")
    assert distill([*bad, "100000"]) == 2


def _rows(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]
