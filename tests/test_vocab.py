"""Draft vocabulary statistics: supervised-token counts, d2t/t2d, storage."""

from __future__ import annotations

import pytest
import torch

from draftsmith.train.data.tokens import iter_token_chunks
from draftsmith.train.data.vocab import (
    coverage,
    draft_vocab,
    load_vocab_stats,
    save_vocab_stats,
    t2d_index,
    token_counts,
)

SAMPLES = [
    {"input_ids": [1, 2, 3, 2, 7], "loss_mask": [0, 1, 1, 1, 0], "id": "a"},
    {"input_ids": [7, 7, 2, 5], "loss_mask": [1, 1, 0, 1], "id": "b"},
    {"input_ids": [4], "loss_mask": [0], "id": "c"},
]


def test_draft_vocab_hand_built_counts():
    #                  id: 0  1  2  3  4  5  6  7
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 3, 7])
    d2t, t2d = draft_vocab(counts, 4)
    # Top 4 by count: 2 and 3 (9 each), 7 (7), 0 (5); draft ids sorted by target id.
    assert d2t.dtype == torch.int64 and d2t.tolist() == [0, 1, 1, 4]
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 3, 7]  # target_id = i + d2t[i]
    assert t2d.dtype == torch.bool and t2d.tolist() == [1, 0, 1, 1, 0, 0, 0, 1]
    assert t2d_index(t2d).tolist() == [0, -1, 1, 2, -1, -1, -1, 3]
    assert coverage(counts, t2d) == pytest.approx(30 / 34)


def test_draft_vocab_ties_by_lower_id_and_padding_with_zero_counts():
    counts = torch.tensor([0, 2, 0, 2, 0, 0])
    d2t, _ = draft_vocab(counts, 3)
    # 1 and 3 (count 2) then the lowest zero-count id (0): SpecForge's padding rule.
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 3]
    d2t, _ = draft_vocab(torch.zeros(5, dtype=torch.long), 3)
    assert d2t.tolist() == [0, 0, 0]


def test_draft_vocab_always_include_forces_tokens():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 3, 7])
    d2t, t2d = draft_vocab(counts, 4, always_include=[5])
    assert (torch.arange(4) + d2t).tolist() == [2, 3, 5, 7]  # 0 (count 5) made room for 5
    assert t2d[5]
    d2t, _ = draft_vocab(counts, 8, always_include=[5])  # N = V: everything
    assert (torch.arange(8) + d2t).tolist() == list(range(8))


@pytest.mark.parametrize(
    ("n", "forced", "match"),
    [
        (0, (), "in \\[1, 8\\]"),
        (9, (), "in \\[1, 8\\]"),
        (1, (1, 2), "more than N"),
        (2, (8,), "outside"),
    ],
)
def test_draft_vocab_errors(n, forced, match):
    with pytest.raises(ValueError, match=match):
        draft_vocab(torch.ones(8, dtype=torch.long), n, always_include=forced)


def test_token_counts_only_supervised_and_container_independent():
    import datasets

    expected = torch.zeros(10, dtype=torch.long)
    for s in SAMPLES:
        for t, m in zip(s["input_ids"], s["loss_mask"], strict=True):
            expected[t] += m
    got = token_counts(SAMPLES, 10)
    assert got.tolist() == expected.tolist() == [0, 0, 2, 1, 0, 1, 0, 2, 0, 0]
    assert token_counts(datasets.Dataset.from_list(SAMPLES), 10).tolist() == got.tolist()
    # Truncation: only the first 2 tokens of each sample count.
    assert token_counts(SAMPLES, 10, max_length=2).tolist() == [0, 0, 1, 0, 0, 0, 0, 2, 0, 0]


def test_iter_token_chunks_same_for_both_containers():
    import datasets

    a = list(iter_token_chunks(SAMPLES, chunk_size=2))
    b = list(iter_token_chunks(datasets.Dataset.from_list(SAMPLES), chunk_size=2))
    assert [c.start for c in a] == [c.start for c in b] == [0, 2]
    for x, y in zip(a, b, strict=True):
        assert x.lengths.tolist() == y.lengths.tolist()
        assert x.input_ids.tolist() == y.input_ids.tolist()
        assert x.loss_mask.tolist() == y.loss_mask.tolist()


def test_token_counts_errors_name_the_sample():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_counts(SAMPLES, 6)  # id 7 is supervised
    bad = [{"input_ids": [1, 2], "loss_mask": [1]}]
    with pytest.raises(ValueError, match="sample 0: input_ids has 2 tokens but loss_mask has 1"):
        token_counts(bad, 6)


def test_vocab_stats_roundtrip(tmp_path):
    counts = token_counts(SAMPLES, 10)
    meta = save_vocab_stats(tmp_path / "v.safetensors", counts, n=3, always_include=[9])
    tensors, loaded = load_vocab_stats(tmp_path / "v.safetensors")
    assert tensors["counts"].tolist() == counts.tolist()
    d2t, t2d = draft_vocab(counts, 3, always_include=[9])
    assert torch.equal(tensors["d2t"], d2t) and torch.equal(tensors["t2d"], t2d)
    assert loaded["draft_vocab_size"] == 3 and loaded["always_include"] == [9]
    assert loaded["supervised_tokens"] == 6 and loaded == meta
    save_vocab_stats(tmp_path / "c.safetensors", counts)  # counts only
    assert set(load_vocab_stats(tmp_path / "c.safetensors")[0]) == {"counts"}
