"""The training input pipeline's parts: the length-grouped batch sampler, sample lengths, the
training loader (workers, accelerate, resume) and padded batches (issue 50, item 5)."""

from __future__ import annotations

import math
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from draftsmith.train.core.data import (
    GPU_WORKERS,
    DataPosition,
    LengthGroupedBatchSampler,
    resolve_num_workers,
    sample_lengths,
    train_loader,
)
from draftsmith.train.data.batching import Collate, TokenDataset, collate_hidden_states

# A fixed long-tailed length list (log-normal, median ~300, clipped to 16..2048).
LENGTHS = np.clip(np.exp(np.random.default_rng(7).normal(np.log(300), 0.9, 403)), 16, 2048).astype(
    int
)


def spread(batches: list[list[int]], lengths: np.ndarray) -> float:
    """Mean over batches of (longest - shortest) / longest."""
    return float(np.mean([1 - lengths[b].min() / lengths[b].max() for b in batches]))


def padding_share(batches: list[list[int]], lengths: np.ndarray) -> float:
    """Padded positions / all positions of right-padded batches."""
    real = sum(int(lengths[b].sum()) for b in batches)
    return 1 - real / sum(len(b) * int(lengths[b].max()) for b in batches)


def random_batches(n: int, size: int, seed: int) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(n)
    return [order[i : i + size].tolist() for i in range(0, n, size)]


@pytest.mark.parametrize(
    "n, size, processes", [(403, 8, 1), (403, 8, 2), (64, 4, 2), (5, 8, 1), (17, 4, 3), (1, 1, 1)]
)
def test_every_sample_once_per_epoch_only_the_last_batch_short(n, size, processes):
    sampler = LengthGroupedBatchSampler(LENGTHS[:n], size, seed=3, processes=processes)
    for epoch in range(3):
        batches = sampler.batches(epoch)
        assert sorted(i for b in batches for i in b) == list(range(n))
        assert len(batches) == len(sampler) == math.ceil(n / size)
        assert all(len(b) == size for b in batches[:-1]) and 1 <= len(batches[-1]) <= size


def test_grouped_batches_hold_samples_of_similar_length():
    """On the fixed long-tailed list, batch 8: the length spread inside a batch and the padding
    are a fraction of random batches'."""
    sampler = LengthGroupedBatchSampler(LENGTHS, 8, seed=0)
    grouped = sampler.batches(0)
    shuffled = random_batches(len(LENGTHS), 8, seed=0)
    assert spread(grouped, LENGTHS) < 0.2 * spread(shuffled, LENGTHS)
    assert padding_share(shuffled, LENGTHS) > 0.4  # random batches: mostly padding
    assert padding_share(grouped, LENGTHS) < 0.05
    # Small windows (mega_batches 2: 16 samples sorted together) pad less than random batches,
    # more than the default window: a long sample rarely finds another to share its batch.
    small = LengthGroupedBatchSampler(LENGTHS, 8, seed=0, mega_batches=2).batches(0)
    pads = [padding_share(b, LENGTHS) for b in (grouped, small, shuffled)]
    assert pads == sorted(pads) and pads[1] < pads[2] - 0.1


def test_order_is_fixed_by_seed_and_epoch_and_random_across_them():
    a = LengthGroupedBatchSampler(LENGTHS, 8, seed=0)
    b = LengthGroupedBatchSampler(LENGTHS.tolist(), 8, seed=0)  # another object, same inputs
    assert a.batches(0) == b.batches(0) and a.batches(5) == b.batches(5)
    assert a.batches(0) != a.batches(1)  # another epoch, another order
    assert a.batches(0) != LengthGroupedBatchSampler(LENGTHS, 8, seed=1).batches(0)
    # The batches themselves change, not only their order (another shuffle before sorting).
    assert {tuple(sorted(x)) for x in a.batches(0)} != {tuple(sorted(x)) for x in a.batches(1)}
    # __iter__ yields the epoch set last.
    a.set_epoch(4)
    assert list(a) == a.batches(4)


def test_the_longest_sample_is_in_the_first_step():
    """A batch that does not fit in memory fails at the first step, not hours in."""
    for processes in (1, 2):
        sampler = LengthGroupedBatchSampler(LENGTHS, 4, seed=0, processes=processes)
        for epoch in range(3):
            first_step = sampler.batches(epoch)[:processes]
            assert max(LENGTHS[i] for b in first_step for i in b) == LENGTHS.max()


def test_two_processes_share_every_sample_once_in_length_matched_steps():
    """accelerate deals batch i to process i % 2 (BatchSamplerShard, as prepare wraps a batch
    sampler): the two shares cover every sample exactly once, and the batches of one step have
    similar lengths (no process waits for a much longer one at the all-reduce)."""
    from accelerate.data_loader import BatchSamplerShard

    n = 400  # 50 steps of 2 x 4 samples: no short tail
    lengths = LENGTHS[:n]
    sampler = LengthGroupedBatchSampler(lengths, 4, seed=0, processes=2)
    shares = [list(BatchSamplerShard(sampler, 2, rank)) for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == 50
    assert sorted(i for share in shares for b in share for i in b) == list(range(n))
    step_gap = [
        abs(int(lengths[b0].max()) - int(lengths[b1].max())) / max(lengths[b0].max(), 1)
        for b0, b1 in zip(*shares, strict=True)
    ]
    shuffled = random_batches(n, 4, seed=0)
    random_gap = [
        abs(int(lengths[b0].max()) - int(lengths[b1].max())) / max(lengths[b0].max(), 1)
        for b0, b1 in zip(shuffled[::2], shuffled[1::2], strict=True)
    ]
    assert np.mean(step_gap) < 0.25 * np.mean(random_gap)

    # A short tail (403 samples): every sample at least once; the only repeats are the
    # samples accelerate adds to even out the last step (the epoch's first ones).
    sampler = LengthGroupedBatchSampler(LENGTHS, 4, seed=0, processes=2)
    shares = [list(BatchSamplerShard(sampler, 2, rank)) for rank in (0, 1)]
    seen = [i for share in shares for b in share for i in b]
    assert set(seen) == set(range(len(LENGTHS)))
    assert len(shares[0]) == len(shares[1]) == math.ceil(math.ceil(403 / 4) / 2)
    first = [i for b in sampler.batches(0)[:2] for i in b]
    repeats = [i for i in set(seen) if seen.count(i) > 1]
    assert all(i in first for i in repeats) and len(seen) - len(LENGTHS) == len(repeats)


def test_sample_lengths_reads_subsets_token_datasets_and_caps_at_max_length():
    import datasets

    rows = {
        "input_ids": [[1] * k for k in (5, 9, 2, 30)],
        "loss_mask": [[1] * k for k in (5, 9, 2, 30)],
    }
    table = datasets.Dataset.from_dict(rows)
    filtered = table.filter(lambda r: len(r["input_ids"]) > 2, keep_in_memory=True)  # 5, 9, 30
    tokens = TokenDataset(filtered, max_length=20)
    assert tokens.lengths.tolist() == [5, 9, 20]
    assert [len(tokens[i]["input_ids"]) for i in range(3)] == [5, 9, 20]
    listed = TokenDataset([{k: v[i] for k, v in rows.items()} for i in range(4)])
    assert listed.lengths.tolist() == [5, 9, 2, 30]
    nested = torch.utils.data.Subset(torch.utils.data.Subset(listed, [3, 1, 0]), [2, 0])
    assert sample_lengths(nested).tolist() == [5, 30]

    class Plain(torch.utils.data.Dataset):  # no lengths: read item by item
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return {"input_ids": torch.zeros(3 + i)}

    assert sample_lengths(Plain()).tolist() == [3, 4]


def test_default_workers_none_on_a_cpu_a_few_on_a_gpu(monkeypatch):
    import os

    assert resolve_num_workers(None, "cpu") == 0
    assert resolve_num_workers(3, "cpu") == 3  # an explicit count is kept
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_num_workers(None, "cuda:0") == GPU_WORKERS
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 2 cores a process: one for the step
    assert resolve_num_workers(None, "cuda:0") == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert resolve_num_workers(None, "cuda:0") == 0


def test_collate_zeroes_the_padding_of_features_and_tokens():
    """The batch is made uninitialised (no second pass to zero it): padding is written 0."""
    samples = [
        {
            "input_ids": torch.arange(1, n + 1),
            "loss_mask": torch.ones(n, dtype=torch.long),
            "hidden_states": {3: torch.full((n, 5), float(n))},
        }
        for n in (2, 6, 4)
    ]
    for _ in range(3):  # fresh allocations may reuse freed, non-zero memory
        torch.full((3, 6, 5), 7.0)  # leave non-zero memory behind
        batch = collate_hidden_states(samples, pad_token_id=9)
        hidden = batch["hidden_states"][3]
        for i, n in enumerate((2, 6, 4)):
            assert (hidden[i, :n] == n).all() and (hidden[i, n:] == 0).all()
            assert (batch["input_ids"][i, n:] == 9).all() and (batch["loss_mask"][i, n:] == 0).all()


def _cfg(**over):
    values = {
        "batch_size": 4,
        "group_by_length": True,
        "num_workers": 0,
        "prefetch_factor": 2,
        "seed": 0,
    }
    return SimpleNamespace(**{**values, **over})


def _accelerator():
    from accelerate import Accelerator, DataLoaderConfiguration

    return Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )


class Lengths(torch.utils.data.Dataset):
    """Samples of the fixed lengths, ``input_ids`` = the index."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        n = int(self.lengths[i])
        return {
            "input_ids": torch.full((n,), i),
            "loss_mask": torch.ones(n, dtype=torch.long),
            "index": i,
        }


@pytest.mark.parametrize("workers", [0, 1])
def test_prepared_loader_follows_the_sampler_and_resumes_exactly(workers):
    """Through accelerate (as the recipes prepare it): each epoch's batches are the sampler's,
    and a run paused mid-epoch and resumed (DataPosition, skip_first_batches) sees exactly the
    batches of an unbroken run, with or without a worker."""
    data = Lengths(LENGTHS[:50])
    sampler = LengthGroupedBatchSampler(data.lengths, 4, seed=0)

    def run(position: DataPosition, batches: int) -> list[list[int]]:
        acc = _accelerator()
        loader = acc.prepare(
            train_loader(data, _cfg(num_workers=workers), Collate(0), device="cpu")
        )
        seen: list[list[int]] = []
        while len(seen) < batches:
            for batch in position.batches_of_epoch(acc, loader):
                seen.append(batch["index"].tolist())
                if len(seen) == batches:
                    break
        return seen

    per_epoch = len(sampler)
    straight = run(DataPosition(), 3 * per_epoch)
    assert straight == [b for e in range(3) for b in sampler.batches(e)]
    paused_at = DataPosition()
    first = run(paused_at, per_epoch + 5)
    from draftsmith.train.core.accelerate_compat import reset_accelerate_state

    reset_accelerate_state()
    rest = run(DataPosition(paused_at.epoch, paused_at.batches), 2 * per_epoch - 5)
    assert first + rest == straight


def test_random_batches_when_grouping_is_off():
    data = Lengths(LENGTHS[:40])
    loader = train_loader(data, _cfg(group_by_length=False), Collate(0), device="cpu")
    assert isinstance(loader.sampler, torch.utils.data.RandomSampler)
    grouped = train_loader(data, _cfg(), Collate(0), device="cpu")
    assert isinstance(grouped.batch_sampler, LengthGroupedBatchSampler)
    assert grouped.num_workers == 0


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A real hidden-state cache of a tiny target over samples of mixed lengths."""
    from draftsmith.train.features.cache_write import build_cache
    from draftsmith.train.target_model.load import load_target
    from tests.conftest import tiny_model_dir

    root = tmp_path_factory.mktemp("pipeline_cache")
    target, _ = load_target(str(tiny_model_dir(root / "target")))
    rng = np.random.default_rng(0)
    rows = []
    for i in range(23):
        n = int(rng.integers(3, 40))
        ids = rng.integers(0, 60, n).tolist()
        rows.append({"input_ids": ids, "loss_mask": [0] + [1] * (n - 1), "id": f"s{i}"})
    build_cache(  # forwards of <= 64 tokens, shards of ~10 KB: several shards
        target,
        rows,
        root / "cache",
        [0, 2, 4],
        dtype="fp32",
        progress=False,
        batch_tokens=64,
        max_batch_size=4,
        shard_mb=0.01,
    )
    return root / "cache"


def _all_batches(loader, epoch: int) -> list[dict]:
    loader.set_epoch(epoch)
    return list(loader)


@pytest.mark.parametrize("grouped", [True, False])
def test_workers_read_the_same_batches_from_a_cache(cache_dir, grouped):
    """Two worker processes with prefetch deliver exactly the batches the training thread reads
    itself (features, tokens, masks, ids; two epochs), from a cache of several shards."""
    from draftsmith.train.features.cache_read import HiddenStateCache

    cache = HiddenStateCache(cache_dir, layers=[2, 4])
    assert len(cache.manifest["shards"]) > 1
    train = torch.utils.data.Subset(cache, list(range(1, 23)))
    acc, loaders = _accelerator(), {}
    for workers in (0, 2):
        cfg = _cfg(num_workers=workers, group_by_length=grouped, batch_size=3)
        loaders[workers] = acc.prepare(train_loader(train, cfg, Collate(0), device="cpu"))
    assert loaders[2].num_workers == 2 and loaders[2].prefetch_factor == 2
    for epoch in (0, 1):
        main, workers = (_all_batches(loaders[w], epoch) for w in (0, 2))
        assert len(main) == len(workers) == math.ceil(22 / 3)
        for a, b in zip(main, workers, strict=True):
            assert a["ids"] == b["ids"]
            for key in ("input_ids", "attention_mask", "loss_mask", "index"):
                assert torch.equal(a[key], b[key])
            assert a["hidden_states"].keys() == b["hidden_states"].keys() == {2, 4}
            for layer in (2, 4):
                assert torch.equal(a["hidden_states"][layer], b["hidden_states"][layer])
    seen = sorted(i for batch in main for i in batch["index"].tolist())
    assert seen == list(range(1, 23))


def test_cache_reads_after_pickling_as_a_spawned_worker_gets_it(cache_dir):
    """A cache with open shard handles pickles without them (a spawned worker reopens its own)
    and reads the same samples."""
    from draftsmith.train.features.cache_read import HiddenStateCache

    cache = HiddenStateCache(cache_dir)
    before = cache[5]
    assert cache._handles  # a shard is open
    copy = pickle.loads(pickle.dumps(cache))
    assert copy._handles == {}
    after = copy[5]
    assert torch.equal(before["input_ids"], after["input_ids"])
    for layer in before["hidden_states"]:
        assert torch.equal(before["hidden_states"][layer], after["hidden_states"][layer])
    assert cache.lengths.tolist() == [len(cache[i]["input_ids"]) for i in range(len(cache))]


def test_each_process_of_two_reads_its_share_of_each_epoch_and_of_a_resumed_one():
    """Prepared for 2 processes (accelerate's prepare_data_loader, as for a 2-process run):
    set_epoch reaches the sampler through accelerate's wrappers, so every epoch's shares, and
    a resumed epoch's rest (skip_first_batches), are that epoch's batches dealt in turn."""
    from accelerate.data_loader import prepare_data_loader, skip_first_batches

    data = Lengths(LENGTHS[:64])
    sampler = LengthGroupedBatchSampler(data.lengths, 4, seed=0, processes=2)
    for rank in (0, 1):
        loader = prepare_data_loader(
            train_loader(data, _cfg(), Collate(0), device="cpu", processes=2),
            num_processes=2,
            process_index=rank,
            use_seedable_sampler=True,
        )
        for epoch in (0, 3, 1):
            expected = sampler.batches(epoch)[rank::2]
            loader.set_epoch(epoch)
            assert [b["index"].tolist() for b in loader] == expected
            loader.set_epoch(epoch)
            rest = skip_first_batches(loader, 3)
            assert [b["index"].tolist() for b in rest] == expected[3:]
