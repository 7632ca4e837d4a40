"""Data helpers every recipe shares: the split, the training loader (workers, length-grouped
batches), the data position, EOS ids, the data checks."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UsageError

# The command that turns prompts into training data (the answers the target gives).
DISTILL_HINT = "draftsmith data distill --input <prompts.jsonl> --output <data.jsonl>"

# Where a user finds the exact commands that make a shipped config's inputs.
HEADERS_HINT = "the header of each recipes/configs/*.yaml lists the exact commands"
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def _shown(path: Path) -> str:
    """``path`` as a user would type it: ``~/...`` under the home directory, shell-quoted."""
    with contextlib.suppress(ValueError, RuntimeError):
        rest = path.relative_to(Path.home()).as_posix()
        if shlex.quote(rest) == rest:  # "~/'a b'" would not expand
            return f"~/{rest}"
    return shlex.quote(str(path))


def _make_hint(field: str, path: Path) -> str:
    """How the input of config field ``field`` at ``path`` is made (empty: not ours to make)."""
    shown = _shown(path)
    if field == "data" and path.suffix in _DATA_SUFFIXES:
        return f"make it with `draftsmith data distill --input PROMPTS --output {shown}`"
    if field == "data":  # a directory: tokenized data (or a folder of record files)
        return (
            "make it with `draftsmith data distill --input PROMPTS --output ANSWERS.jsonl` "
            f"then `draftsmith data tokenize --input ANSWERS.jsonl --output {shown}`"
        )
    if field == "val_data":
        return (
            "make it with `draftsmith data distill --input HELD_OUT_PROMPTS --split all "
            f"--output {shown}`"
        )
    if field == "hidden_states_cache":
        return (
            f"make it with `draftsmith data cache --data TOKENIZED --out {shown}` on the "
            "answers of `draftsmith data distill` tokenized by `draftsmith data tokenize`"
        )
    return ""


def check_inputs(inputs: dict[str, Path | None]) -> None:
    """Refuse a run whose input files or directories do not exist, before anything loads.

    Every recipe gets this through :class:`~draftsmith.train.core.run.TrainRun`, which checks
    its config's :meth:`~draftsmith.train.core.config.TrainConfig.input_paths`.

    Args:
        inputs: the paths the run will read, by config field (``None``: not set, not read).

    Raises:
        UsageError: the first missing one, naming the field, the path and the command that
            makes it, e.g. ``data: ~/x.jsonl: file not found; make it with `draftsmith data
            distill --input PROMPTS --output ~/x.jsonl` (the header of ...)``.
    """
    for field, path in inputs.items():
        if path is None:
            continue
        path = Path(path).expanduser()
        if path.exists():
            continue
        what = "file not found" if path.suffix in _DATA_SUFFIXES else "not found"
        hint = _make_hint(field, path)
        hint = f"; {hint} ({HEADERS_HINT})" if hint else ""
        raise UsageError(f"{field}: {_shown(path)}: {what}{hint}")


def _is_tokenized(path: Path) -> bool:
    """A ``save_to_disk`` directory, or a JSON Lines file whose records carry ``input_ids``."""
    if path.is_dir():
        return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
    if path.suffix in (".jsonl", ".json") and path.is_file():
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        return "input_ids" in json.loads(line)
                    except (json.JSONDecodeError, TypeError):
                        return False
    return False


def load_samples(
    path: str | Path,
    tokenizer: Any,
    *,
    max_length: int,
    split: str | None,
    limit: int | None = None,
) -> tuple[Any, Any]:
    """The training samples as a ``datasets.Dataset`` (``input_ids``, ``loss_mask``, ``id``).

    ``path`` holds conversations (tokenized here with the target's chat template, see
    :func:`draftsmith.train.data.tokenize.build_dataset`) or samples already tokenized by ``draftsmith
    data tokenize`` (a ``save_to_disk`` dir, or JSONL with ``input_ids``; used as they are,
    truncated to ``max_length``, samples without a supervised token dropped).

    Args:
        path: the data file or directory.
        tokenizer: the target's tokenizer.
        max_length: truncate samples to this many tokens.
        split: keep only records of this split (conversations; ``None``/``"all"``: every one).
        limit: keep the first N samples only.

    Returns:
        ``(dataset, summary)``; ``summary`` is the tokenization's ``DataSummary`` (what was
        dropped and why), None for tokenized data.
    """
    from ..data.tokenize import build_dataset
    from ..data.tokens import load_token_data

    path = Path(path)
    summary = None
    if _is_tokenized(path):
        try:
            dataset = load_token_data(path)
        except ValueError as exc:
            raise UsageError(f"data: {exc}") from exc
        # keep_in_memory: no cache files written into the user's dataset directory.
        dataset = dataset.map(
            lambda row: {k: row[k][:max_length] for k in ("input_ids", "loss_mask")},
            keep_in_memory=True,
        ).filter(lambda row: sum(row["loss_mask"][1:]) > 0, keep_in_memory=True)
    else:
        split = None if split == "all" else split
        dataset, summary = build_dataset(path, tokenizer, max_length=max_length, split=split)
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return dataset, summary


def first_records(dataset: Any, limit: int | None) -> Any:
    """The first ``limit`` samples of a map-style dataset (all when None): ``limit`` for data
    read from a hidden-state cache, as :func:`load_samples` applies it to records (before the
    validation split, so both modes hold back their validation samples from the same N)."""
    if limit is None or limit >= len(dataset):
        return dataset
    return torch.utils.data.Subset(dataset, range(limit))


def split_indices(n: int, val_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """Seeded split of ``n`` sample indices into ``(train, validation)``, both sorted.

    The same permutation in every process and on every resume, so a resumed run validates on
    the same samples and never trains on them. At least one sample is left to train on.
    """
    n_val = min(val_samples, max(0, n - 1))
    order = torch.randperm(n, generator=torch.Generator(device="cpu").manual_seed(seed)).tolist()
    return sorted(order[n_val:]), sorted(order[:n_val])


def rank_batches(
    n: int, rank: int, world: int, batch_size: int, even: bool = False
) -> list[tuple[list[int], bool]]:
    """This rank's validation batches: indices of every ``world``-th of ``n`` items from ``rank``.

    Args:
        n: items to share out.
        rank: this process's index.
        world: number of processes.
        batch_size: items per batch.
        even: give every rank the same number of batches (the most any rank has), the extra ones
            repeating this rank's first items. Needed when each batch runs a sharded (FSDP)
            model: its forward is a collective that every rank must join.

    Returns:
        ``(indices, counted)`` per batch; an extra batch has ``counted`` False and its results
        must be dropped.
    """
    mine = list(range(rank, n, world))
    batches = [(mine[i : i + batch_size], True) for i in range(0, len(mine), batch_size)]
    if even:
        most = math.ceil(math.ceil(n / world) / batch_size) if n else 0
        filler = mine[:batch_size] or list(range(min(n, batch_size)))
        batches += [(filler, False)] * (most - len(batches)) if filler else []
    return batches


def total_steps(
    max_steps: int | None, epochs: float, batches_per_epoch: int, grad_accum: int
) -> int:
    """Optimizer steps of the run: ``max_steps``, or ``epochs`` passes of the loader.

    accelerate makes an optimizer step at the end of every epoch even when the epoch's
    micro-batches are not a multiple of ``grad_accum`` (the last, shorter accumulation), so an
    epoch has ``ceil(batches / grad_accum)`` steps and no batch is left out.
    """
    per_epoch = max(1, math.ceil(batches_per_epoch / grad_accum))
    return max_steps or max(1, math.ceil(epochs * per_epoch))


# Length grouping sorts samples within windows of this many batches (of every process): a
# window is long enough that a batch finds samples of its length, short enough that the order
# stays random (HF transformers' LengthGroupedSampler uses 50 too).
MEGA_BATCHES = 50
# DataLoader workers per training process on a GPU when num_workers is left unset; measured by
# scripts/bench_input_pipeline.py (docs/scaling.md, "Input pipeline").
GPU_WORKERS = 2


def sample_lengths(dataset: Any) -> np.ndarray:
    """``[N]`` tokens per sample of a training set, read without its features.

    A :class:`~torch.utils.data.Subset` (the split, ``limit``) takes its parent's lengths at its
    indices; a dataset with ``lengths`` (:class:`~draftsmith.train.features.cache_read.
    HiddenStateCache`, :class:`~draftsmith.train.data.batching.TokenDataset`) says them; any
    other map-style dataset is read item by item (``input_ids``).
    """
    if isinstance(dataset, torch.utils.data.Subset):
        return sample_lengths(dataset.dataset)[np.asarray(dataset.indices, dtype=np.int64)]
    lengths = getattr(dataset, "lengths", None)
    if lengths is not None:
        return np.asarray(lengths, dtype=np.int64)
    return np.array([len(dataset[i]["input_ids"]) for i in range(len(dataset))], dtype=np.int64)


class LengthGroupedBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of samples of similar length, in a random order fixed by the seed and the epoch.

    Right-padded batches (our TTT attention relies on right padding; no packing) cost the
    longest sample's length for every sample: random batches of a long-tailed length mix are
    mostly padding. Each epoch:

    1. shuffle all samples (seeded by ``seed`` and the epoch);
    2. cut the order into windows of ``mega_batches x batch_size x processes`` samples and sort
       each window by length, longest first;
    3. cut the result into batches of ``batch_size`` (only the epoch's last one may be shorter)
       and those into steps of ``processes`` consecutive batches (one batch per process:
       accelerate's :class:`~accelerate.data_loader.BatchSamplerShard` deals batch ``i`` to
       process ``i % processes``, so the processes of one step get batches of one length and
       none waits for a longer one at the gradient all-reduce);
    4. shuffle the whole steps, the step holding the longest sample first (a batch that does
       not fit in memory fails at the first step, not hours in), the short tail last.

    Every sample is in exactly one batch per epoch; the order is the same in every process and
    for every resume (:class:`DataPosition` skips the batches already seen).

    Args:
        lengths: ``[N]`` tokens per sample (:func:`sample_lengths`).
        batch_size: samples per batch (per process).
        seed: the run's seed.
        processes: the processes the batches are dealt to (1: one process).
        mega_batches: batches (per process) per sorted window.
    """

    drop_last = False  # read by accelerate's BatchSamplerShard: the last batch may be short

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        batch_size: int,
        *,
        seed: int,
        processes: int = 1,
        mega_batches: int = MEGA_BATCHES,
    ) -> None:
        if batch_size < 1 or processes < 1 or mega_batches < 1:
            raise ValueError(
                f"batch_size, processes and mega_batches must be >= 1, got {batch_size}, "
                f"{processes} and {mega_batches}"
            )
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size = batch_size
        self.seed = seed
        self.processes = processes
        self.mega_batches = mega_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the order of epoch ``epoch`` next (:class:`DataPosition` sets it every epoch)."""
        self.epoch = int(epoch)

    @property
    def sampler(self) -> LengthGroupedBatchSampler:
        """Itself: accelerate's ``DataLoaderShard.set_epoch`` reaches a batch sampler wrapped
        in its ``BatchSamplerShard`` or ``SkipBatchSampler`` (several processes, a resumed
        epoch) as ``wrapper.batch_sampler.sampler``."""
        return self

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches(self.epoch)

    def batches(self, epoch: int) -> list[list[int]]:
        """Epoch ``epoch``'s batches of sample indices, in order (what ``__iter__`` yields)."""
        n, size = len(self.lengths), self.batch_size
        # A generator of its own, seeded by (seed, epoch): the order depends on nothing else
        # (no global RNG state), so every process and every resume draws the same one.
        rng = np.random.default_rng([self.seed % 2**63, int(epoch)])
        order = rng.permutation(n)
        window = self.mega_batches * size * self.processes  # a multiple of a step's samples
        for start in range(0, n, window):
            part = order[start : start + window]
            # Longest first; stable, so equal lengths keep their random order.
            order[start : start + window] = part[np.argsort(-self.lengths[part], kind="stable")]
        batches = [order[i : i + size].tolist() for i in range(0, n, size)]
        steps = [batches[i : i + self.processes] for i in range(0, len(batches), self.processes)]
        tail = []
        if steps and (len(steps[-1]) < self.processes or len(steps[-1][-1]) < size):
            tail = steps.pop()  # the short step: last, as accelerate expects it
        steps = [steps[i] for i in rng.permutation(len(steps))]
        if steps:
            longest = max(range(len(steps)), key=lambda k: self._longest(steps[k]))
            if self._longest(steps[longest]) >= self._longest(tail):
                steps.insert(0, steps.pop(longest))
        return [batch for step in [*steps, tail] for batch in step]

    def _longest(self, step: list[list[int]]) -> int:
        return max((int(self.lengths[i]) for batch in step for i in batch), default=0)


def resolve_num_workers(num_workers: int | None, device: torch.device | str) -> int:
    """DataLoader workers per training process: ``num_workers``, or the default for ``device``.

    Unset: none on a CPU (the training step computes on every core; a worker would take one
    from it), on a GPU :data:`GPU_WORKERS`, at most the cores this process's share of the node
    leaves beside itself (``LOCAL_WORLD_SIZE`` processes on the node share its cores).
    """
    if num_workers is not None:
        return num_workers
    if torch.device(device).type == "cpu":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    per_process = (cores or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(0, min(GPU_WORKERS, per_process - 1))


def train_loader(
    dataset: torch.utils.data.Dataset,
    cfg: Any,
    collate: Callable[[Sequence[Any]], Any],
    *,
    device: torch.device | str,
    processes: int = 1,
    pin_memory: bool = False,
) -> torch.utils.data.DataLoader:
    """The training DataLoader of every recipe (before ``accelerator.prepare``).

    Batches of ``cfg.batch_size`` samples: random (``shuffle``; accelerate makes its sampler
    seedable) or, with ``cfg.group_by_length``, of similar lengths
    (:class:`LengthGroupedBatchSampler`). With workers (``cfg.num_workers``,
    :func:`resolve_num_workers`) samples are read and padded in worker processes, each
    ``cfg.prefetch_factor`` batches ahead of the step, and the workers live as long as the
    loader (no restart each epoch). Workers only read and collate: the dataset and collate
    must not hold the target (online features are computed in the step, on the device).

    Args:
        dataset: the training samples (a map-style dataset).
        cfg: the run's :class:`~draftsmith.train.core.config.TrainConfig`.
        collate: pads samples into a batch (picklable: workers may be spawned).
        device: the run's device (``accelerator.device``), for the default number of workers.
        processes: the processes the batches are dealt to (``accelerator.num_processes``).
        pin_memory: ``TrainRun.pin_memory`` (on a GPU: copies without waiting for the device).
    """
    workers = resolve_num_workers(cfg.num_workers, device)
    kwargs: dict[str, Any] = {"collate_fn": collate, "pin_memory": pin_memory}
    if workers:
        kwargs |= {
            "num_workers": workers,
            "prefetch_factor": cfg.prefetch_factor,
            "persistent_workers": True,
        }
    if cfg.group_by_length:
        sampler = LengthGroupedBatchSampler(
            sample_lengths(dataset), cfg.batch_size, seed=cfg.seed, processes=processes
        )
        return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **kwargs)
    return torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, **kwargs)


@dataclass
class DataPosition:
    """Where the loop stands in the data: epoch and micro-batches of it consumed (per process).

    Saved in every checkpoint; a resumed run skips exactly the consumed batches of that epoch
    (the seeded sampler, random or :class:`LengthGroupedBatchSampler`, gives each epoch the same
    order again), so no sample is skipped or seen twice whatever ``grad_accum``, batch size,
    epoch length or number of DataLoader workers (they read what the sampler chose, in order).
    """

    epoch: int = 0
    batches: int = 0

    def batches_of_epoch(self, accelerator: Any, loader: Any) -> Iterator[Any]:
        """Yield the rest of the current epoch's batches, counting them; then the next epoch.

        Args:
            accelerator: the run's ``Accelerator``.
            loader: the prepared training ``DataLoader`` (seedable sampler).
        """
        if self.batches >= len(loader):  # the checkpoint was taken at an epoch's last batch
            self.epoch, self.batches = self.epoch + 1, 0
        loader.set_epoch(self.epoch)
        batches = accelerator.skip_first_batches(loader, self.batches) if self.batches else loader
        for batch in batches:
            self.batches += 1
            yield batch
        self.epoch, self.batches = self.epoch + 1, 0


def eos_ids(tokenizer: Any, model: Any) -> list[int]:
    """Every id that ends a turn: the tokenizer's EOS and the model's generation-config EOS ids."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, (list, tuple, set)) else {eos}
    return sorted(i for i in ids if i is not None)


def run_draft_vocab(
    count_source: Any,
    size: int,
    tokenizer: Any,
    target: Any,
    max_length: int,
    say: Any,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """A run's draft vocabulary (EAGLE-3 §3, FR-Spec): the ``size`` most frequent supervised
    tokens of its training data, EOS always in; the coverage is said and returned for the
    run's metrics.

    Args:
        count_source: the training samples (records or a cache's token view), as
            :func:`~draftsmith.train.data.vocab.token_counts` reads them.
        size: N, the draft vocabulary's size (< the target's vocabulary).
        tokenizer, target: for the EOS ids.
        max_length: count only the tokens training reads.
        say: the run's console line writer.

    Returns:
        ``(d2t [N], t2d [V], {"draft_vocab_coverage": fraction})``.
    """
    from ..data.vocab import coverage, draft_vocab, token_counts

    counts = token_counts(count_source, target.config.vocab_size, max_length=max_length)
    d2t, t2d = draft_vocab(counts, size, always_include=eos_ids(tokenizer, target))
    note = {"draft_vocab_coverage": coverage(counts, t2d)}
    say(f"draft vocab: {size} tokens cover {note['draft_vocab_coverage']:.2%} of supervised tokens")
    return d2t, t2d, note


def default_mask_token(tokenizer: Any, vocab_size: int) -> int:
    """The placeholder token of parallel drafters (P-EAGLE, DFlash) when the config names none.

    A special token that is neither BOS, EOS nor padding, the lowest such id (z-lab and
    speculators use a dedicated, otherwise unseen token; SmolLM2's ``<|endoftext|>``, id 0,
    never appears in chat data); else the unknown token, else the padding token. Its embedding
    (the target's, frozen) marks "a position still to draft".

    Raises:
        UsageError: the tokenizer has none of these inside the target's vocabulary.
    """
    skip = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special |= {int(i) for i, tok in decoder.items() if getattr(tok, "special", False)}
    candidates = sorted(i for i in special if i not in skip and 0 <= i < vocab_size)
    if candidates:
        return candidates[0]
    for fallback in (tokenizer.unk_token_id, tokenizer.pad_token_id):
        if fallback is not None and 0 <= fallback < vocab_size:
            return int(fallback)
    raise UsageError(
        "mask_token_id: the tokenizer has no special token to use as the placeholder of "
        "parallel drafting; set mask_token_id to a token id the data does not use"
    )


def check_enough_data(
    n_samples: int,
    n_train: int,
    *,
    source: str,
    summary: Any = None,
    min_train_samples: int,
    allow: bool,
) -> None:
    """Refuse data that leaves too little to train on, saying what was dropped and why.

    Args:
        n_samples: samples with a supervised token (before the validation split).
        n_train: samples left to train on after the split.
        source: the data file or cache (named in the message).
        summary: the :class:`~draftsmith.train.data.tokenize.DataSummary` of the tokenization, if any
            (its ``dropped`` counts say why records were left out).
        min_train_samples: fewer training samples than this are refused.
        allow: the user's ``allow_little_data``: only an empty data set is refused.

    Raises:
        UsageError: no supervised sample at all, or (unless ``allow``) most records dropped or
            fewer than ``min_train_samples`` to train on.
    """
    dropped = dict(getattr(summary, "dropped", None) or {})
    n_dropped = sum(dropped.values())
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items(), key=lambda x: -x[1]))
    prompts_only = any("assistant" in reason for reason in dropped)
    hint = (
        f"; records without answers are prompts, not training data: make training data with "
        f"`{DISTILL_HINT}`"
        if prompts_only or n_samples == 0
        else ""
    )
    if n_samples == 0:
        detail = f" ({n_dropped} records dropped: {why})" if n_dropped else ""
        raise UsageError(f"data: {source} has no sample with a supervised token{detail}{hint}")
    if allow:
        return
    mostly_dropped = n_dropped > n_samples
    if mostly_dropped or n_train < min_train_samples:
        what = (
            f"{n_dropped} of {n_samples + n_dropped} records dropped ({why}), " if n_dropped else ""
        )
        raise UsageError(
            f"data: {source}: {what}{n_train} samples left to train on (min_train_samples "
            f"{min_train_samples}){hint}; set allow_little_data: true (--allow-little-data) to "
            "train anyway"
        )


@contextlib.contextmanager
def input_errors() -> Iterator[None]:
    """Turn the errors of reading a run's inputs into :class:`UsageError` (one line, exit 2).

    The loaders name the file, record or field in their messages (a missing or malformed data
    file, a chat-template problem, a target that cannot be loaded, a cache that does not match);
    they are the user's to fix, not a bug to show a traceback for.
    """
    from ..errors import RunError

    # The loaders' own errors (DataFileError, TemplateError, CacheError, TokenDataError, ...)
    # are UsageErrors already, TargetError a RunError: they pass through as they are. A file
    # a loader did not name as missing becomes one line too.
    try:
        yield
    except (UsageError, RunError):
        raise
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from exc
