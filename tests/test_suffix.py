"""The suffix drafter, added through the registry alone: proposals, losslessness, evaluate."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.heads.base import Drafter
from draftsmith.heads.ngram import NGramDrafter
from draftsmith.heads.registry import DRAFTERS
from draftsmith.heads.sampling import SamplingParams
from draftsmith.heads.suffix import SuffixDrafter
from draftsmith.recipes.evaluate import main as evaluate
from draftsmith.train.decoding.speculative import generate
from tests.test_speculative import reference_greedy


def _propose(drafter, seq: list[int], k: int) -> list[int]:
    return drafter.propose(torch.tensor([seq]), k, SamplingParams(), None).tokens.tolist()


def test_longest_match_is_continued():
    # "5 6 7" occurred before (followed by 8 1 2 3); so did "6 7" and "7" alone, the same place.
    assert _propose(SuffixDrafter(), [5, 6, 7, 8, 1, 2, 3, 9, 5, 6, 7], 4) == [8, 1, 2, 3]
    # The longest match wins over a more recent shorter one: "3 1 2" at 0..2, "1 2" also at 4..5.
    assert _propose(SuffixDrafter(), [3, 1, 2, 9, 1, 2, 8, 3, 1, 2], 2) == [9, 1]


def test_most_frequent_continuation_not_the_most_recent():
    # "1 2" occurs three times before the end: followed by 3, 3, then 4 (most recent). Only "1 2"
    # matches (5 never preceded it). The vote says 3; after "1 2 3" the two occurrences go on
    # with 11 and 12, a tie the most recent (12) breaks; then 1 2 4 from that occurrence alone.
    seq = [10, 1, 2, 3, 11, 1, 2, 3, 12, 1, 2, 4, 5, 1, 2]
    assert _propose(SuffixDrafter(), seq, 5) == [3, 12, 1, 2, 4]
    assert _propose(NGramDrafter(), seq, 5) == [4, 5, 1, 2]  # n-gram lookup copies the latest


def test_no_proposal_without_a_long_enough_match():
    assert _propose(SuffixDrafter(), [1, 2, 3, 4], 4) == []
    assert _propose(SuffixDrafter(), [7], 4) == []
    # Only the last token (9) occurred before: shorter than min_match = 2.
    assert _propose(SuffixDrafter(), [9, 1, 2, 9], 3) == []
    assert _propose(SuffixDrafter(min_match=1), [9, 1, 2, 9], 3) == [1, 2, 9]
    # Proposals stop at the end of the sequence and at k.
    assert _propose(SuffixDrafter(), [1, 2, 1, 2, 1, 2], 4) == [1, 2]
    assert _propose(SuffixDrafter(), [5, 6, 7, 8, 1, 2, 3, 9, 5, 6, 7], 1) == [8]
    with pytest.raises(ValueError, match="min_match"):
        SuffixDrafter(min_match=3, max_match=2)


def test_follows_the_drafter_contract_and_is_registered():
    drafter = SuffixDrafter()
    assert isinstance(drafter, Drafter) and drafter.feature_layers == ()
    assert DRAFTERS["suffix"].path == "none"
    assert DRAFTERS["suffix"].build(None, None).name == "suffix[2-32]"


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_is_the_targets(target, k):
    # A prompt that repeats itself, so the drafter finds matches to propose.
    prompt = [3, 9, 14, 2, 7, 3, 9, 14, 2, 7, 3, 9]
    expected = reference_greedy(target, prompt, 40)
    out = generate(target, prompt, SuffixDrafter(), k=k, max_new_tokens=40)
    assert out.tokens == expected
    assert out.draft_steps > 0 and out.proposed > 0


def test_evaluate_runs_it_by_name(tmp_path, tiny_target_dir):
    out = tmp_path / "results.json"
    args = ["--target", tiny_target_dir, "--drafter", "suffix", "--k", 3]
    args += ["--max-new-tokens", 16, "--limit", 2, "--out", out]
    assert evaluate(list(map(str, args))) == 0
    res = json.loads(out.read_text())
    assert res["method"] == "suffix[2-32]"
    assert res["identical_to_target"] is True and res["num_prompts"] == 2
