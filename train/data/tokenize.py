"""Training data: tokenize conversations into a masked dataset, and ``draftsmith data tokenize``.

The one path data takes (see ``docs/design.md``)::

    files / records  --load_records-->  [Conversation]  --build_dataset-->  datasets.Dataset
                                                                            (input_ids, loss_mask, id)

Reading and validating records is :mod:`draftsmith.train.data.records` (shapes and rules);
rendering them with the target's chat template and the loss mask convention is
:mod:`draftsmith.train.data.chat`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import cfg_field
from .chat import (
    TemplateError,
    end_of_turn_ids,
    tokenize_chat,
    tokenize_text,
)
from .files import DataFileError, input_name
from .records import Conversation, LoadSummary, load_records, select_split

__all__ = [
    "DataSummary",
    "TokenizeConfig",
    "build_dataset",
    "main_tokenize",
]


@dataclass
class DataSummary:
    """What :func:`build_dataset` made.

    Attributes:
        load: The :class:`LoadSummary` (``None`` when conversations were passed in).
        samples: Samples in the dataset.
        tokens: Tokens in the dataset (after truncation).
        supervised_tokens: Tokens with ``loss_mask == 1``.
        truncated: Samples cut to ``max_length``.
        dropped: Samples dropped, per reason (``"no assistant turn"``,
            ``"no supervised token after truncation"``).
    """

    load: LoadSummary | None = None
    samples: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)

    def __str__(self) -> str:
        text = (
            f"{self.samples} samples, {self.tokens} tokens ({self.supervised_tokens} supervised), "
            f"{self.truncated} truncated"
        )
        if self.dropped:
            text += "; dropped: " + ", ".join(f"{r}: {n}" for r, n in self.dropped.most_common())
        return f"{self.load}\n{text}" if self.load is not None else text


def _tokenize_row(
    row: dict[str, Any], tokenizer: Any, max_length: int | None, eos: list[int]
) -> dict[str, Any]:
    """datasets.map function: one conversation -> tokens, mask and bookkeeping columns."""
    if row["text"] is not None:
        sample = tokenize_text(tokenizer, row["text"], max_length=None)
        length = len(sample["input_ids"]) if sample else 0
        if sample and max_length is not None:
            sample = {k: v[:max_length] for k, v in sample.items()}
        reason = None if sample else "empty text"
    else:
        sample, reason, length = tokenize_chat(
            tokenizer, row["messages"], max_length, set(eos), bool(row.get("truncated"))
        )
    if sample is None:
        return {"input_ids": [], "loss_mask": [], "_drop": reason, "_length": length}
    return {**sample, "_drop": "", "_length": length}


def build_dataset(
    path_or_records: str | Path | Sequence[Conversation] | Any,
    tokenizer: Any,
    *,
    max_length: int | None = 2048,
    shape: str = "auto",
    skip_invalid: bool = False,
    split: str | None = None,
    eos_token_ids: Iterable[int] | None = None,
    num_proc: int = 1,
) -> tuple[Any, DataSummary]:
    """Load, tokenize and mask a data set for drafter training.

    Args:
        path_or_records: A file / directory / list of those / ``datasets.Dataset`` / list of
            dicts (read with :func:`load_records`), or a list of :class:`Conversation` (used as
            they are).
        tokenizer: The target's tokenizer (its chat template defines the tokens and masks).
        max_length: Truncate samples to this many tokens (``None``: no limit).
        shape: Record shape, see :func:`load_records`.
        skip_invalid: Skip and count malformed records instead of raising.
        split: Keep only this split (``"train"`` for training on the Alpaca file).
        eos_token_ids: Extra end-of-turn ids, see :func:`tokenize_conversation`.
        num_proc: Worker processes for tokenization (``datasets.map``).

    Returns:
        ``(dataset, summary)``: a ``datasets.Dataset`` with columns ``input_ids``
        (list of int), ``loss_mask`` (list of 0/1 int, same length) and ``id`` (str), in input
        order, samples without a supervised token dropped (counted in the summary).

    Raises:
        DataFileError: See :func:`load_records`; also when no sample is left (e.g. every record
            is a prompt without an answer), naming the reasons and what to run.
        TemplateError: See :func:`tokenize_conversation`; the message names the record.
    """
    import datasets

    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
    if (
        isinstance(path_or_records, Sequence)
        and not isinstance(path_or_records, (str, Path))
        and all(isinstance(c, Conversation) for c in path_or_records)
    ):
        conversations, load = list(path_or_records), None
        if split is not None:
            conversations = select_split(conversations, split)
    else:
        conversations, load = load_records(
            path_or_records, shape=shape, skip_invalid=skip_invalid, split=split
        )
    eos = sorted(end_of_turn_ids(tokenizer, eos_token_ids))
    rows = {
        "id": [c.id for c in conversations],
        "messages": [c.messages if c.text is None else None for c in conversations],
        "text": [c.text for c in conversations],
        "truncated": [c.truncated for c in conversations],
    }
    # Tokenize once in this process first when num_proc == 1: no arrow round trip, and a
    # template error names its record.
    summary = DataSummary(load=load)
    fn_kwargs = {"tokenizer": tokenizer, "max_length": max_length, "eos": eos}
    if num_proc <= 1:
        out_cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "id": []}
        for conv, rid, messages, text in zip(
            conversations, rows["id"], rows["messages"], rows["text"], strict=True
        ):
            row = {"messages": messages, "text": text, "truncated": conv.truncated}
            try:
                res = _tokenize_row(row, **fn_kwargs)
            except TemplateError as exc:
                raise TemplateError(f"{conv.source}: {exc}") from exc
            _account(summary, res, max_length)
            if not res["_drop"]:
                out_cols["input_ids"].append(res["input_ids"])
                out_cols["loss_mask"].append(res["loss_mask"])
                out_cols["id"].append(rid)
        if not summary.samples:
            raise _no_samples_error(input_name(path_or_records), summary)
        features = _features()
        return datasets.Dataset.from_dict(out_cols, features=features), summary

    ds = datasets.Dataset.from_dict(rows)
    ds = ds.map(
        _tokenize_row,
        fn_kwargs=fn_kwargs,
        num_proc=num_proc,
        remove_columns=["messages", "text", "truncated"],
        desc="tokenizing",
    )
    for drop, length, mask in zip(ds["_drop"], ds["_length"], ds["loss_mask"], strict=True):
        _account(summary, {"_drop": drop, "_length": length, "loss_mask": mask}, max_length)
    if not summary.samples:
        raise _no_samples_error(input_name(path_or_records), summary)
    ds = ds.filter(lambda d: not d, input_columns="_drop", num_proc=num_proc)
    ds = ds.remove_columns(["_drop", "_length"]).select_columns(["input_ids", "loss_mask", "id"])
    return ds.cast(_features()), summary


def _no_samples_error(where: str, summary: DataSummary) -> DataFileError:
    """Nothing to train on: say why every record was dropped and what to do.

    An empty dataset would otherwise surface much later as a training loop with no batches
    (torch's ``num_samples=0``) or an empty saved dataset with exit code 0.
    """
    reasons = ", ".join(f"{r}: {n}" for r, n in summary.dropped.most_common()) or "no records"
    hint = ""
    if summary.dropped.get("no assistant turn"):
        hint = (
            "; these records are prompts without answers: answer them first with `draftsmith "
            "data distill --input <file> --output <answers.jsonl>`, then use that output"
        )
    elif summary.dropped.get("no supervised token after truncation"):
        hint = "; raise max_length (--max-length) so the answers survive truncation"
    return DataFileError(
        where, f"no sample left to train on (dropped: {reasons}){hint}", reason="no samples"
    )


def _features() -> Any:
    import datasets

    return datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int64")),
            "loss_mask": datasets.List(datasets.Value("int8")),
            "id": datasets.Value("string"),
        }
    )


def _account(summary: DataSummary, res: dict[str, Any], max_length: int | None) -> None:
    if res["_drop"]:
        summary.dropped[res["_drop"]] += 1
        return
    summary.samples += 1
    summary.tokens += len(res["loss_mask"])
    summary.supervised_tokens += sum(res["loss_mask"])
    if max_length is not None and res["_length"] > max_length:
        summary.truncated += 1


# --------------------------------------------------------------------------------------------
# Command line: draftsmith data tokenize
# --------------------------------------------------------------------------------------------


@dataclass
class TokenizeConfig:
    """Settings of ``draftsmith data tokenize``."""

    input: list[Path] = cfg_field(
        help="conversations: files or directories (JSONL/JSON/parquet), read in order; ids must "
        "be unique across them"
    )
    output: Path = cfg_field(help="where to save the tokenized dataset (datasets.save_to_disk)")
    target: str | None = cfg_field(
        None, help="target whose tokenizer/chat template to use (default: SmolLM2-135M-Instruct)"
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    max_length: int | None = cfg_field(2048, help="truncate samples to this many tokens")
    shape: str = cfg_field(
        "auto",
        help="record shape",
        choices=["auto", "messages", "sharegpt", "alpaca", "text", "prompt"],
    )
    split: str | None = cfg_field(None, help="keep only this split (train/heldout)")
    skip_invalid: bool = cfg_field(False, help="skip and count malformed records")
    num_proc: int = cfg_field(1, help="tokenization worker processes")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.max_length is not None and self.max_length < 2:
            problems.append(("max_length", f"must be >= 2, got {self.max_length}"))
        if self.num_proc < 1:
            problems.append(("num_proc", f"must be >= 1, got {self.num_proc}"))
        return problems


def main_tokenize(argv: list[str] | None = None) -> int:
    """``draftsmith data tokenize``: conversations -> input_ids + assistant-only loss_mask.

    Returns:
        Exit code: 0 saved; 2 bad config, data or template (or nothing left to train on);
        1 the target cannot be loaded, another process writes the output, or the disk is full.
    """
    from ..errors import cli_main

    return cli_main(_main_tokenize, argv)


# A saved dataset directory holds one of these; any other existing directory is not replaced.
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _main_tokenize(argv: list[str]) -> int:
    from transformers import AutoTokenizer

    from ..config import parse_config
    from ..runinfo import output_lock
    from ..staged import OutputExistsError, staged_dir
    from ..target_model.load import prepare_target

    cfg = parse_config(TokenizeConfig, argv, prog="draftsmith data tokenize")
    out = Path(cfg.output)
    # A re-tokenization replaces its earlier output; anything else under that name is the
    # user's and is never deleted.
    if out.exists() and not (out.is_dir() and any((out / m).is_file() for m in _DATASET_MARKERS)):
        raise OutputExistsError(
            f"output: {out} exists and is not a tokenized dataset; choose another --output"
        )
    tokenizer = AutoTokenizer.from_pretrained(prepare_target(cfg.target, cache_dir=cfg.cache_dir))
    dataset, summary = build_dataset(
        cfg.input,
        tokenizer,
        max_length=cfg.max_length,
        shape=cfg.shape,
        skip_invalid=cfg.skip_invalid,
        split=cfg.split,
        num_proc=cfg.num_proc,
    )
    # Arrow stores int64 ids and int8 mask per token, plus offsets and the ids column.
    need = summary.tokens * 9 + summary.samples * 64 + (1 << 20)
    with (
        output_lock(out, "tokenize run"),
        staged_dir(out, overwrite=True, need_bytes=need) as tmp,
    ):
        dataset.save_to_disk(str(tmp))
    print(summary)
    print(f"saved to {out}")
    return 0
