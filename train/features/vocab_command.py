"""``draftsmith data vocab``: supervised-token frequencies and EAGLE-3's draft vocabulary, from
a hidden-state cache or tokenized data.

The counting and the vocabulary are :mod:`draftsmith.train.data.vocab`'s; this command lives
beside the cache because it also reads a cache directory (its tokens, its manifest's target) and
writes its statistics next to it by default, and tokenized data sits below feature caches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import cfg_field
from ..data.tokens import TokenDataError, load_token_data
from ..data.vocab import VOCAB_STATS_FILE, VocabError, save_vocab_stats, token_counts
from ..errors import UsageError, cli_main

__all__ = ["VocabConfig", "main_vocab"]


@dataclass
class VocabConfig:
    """Settings of ``draftsmith data vocab``."""

    data: Path = cfg_field(
        help="a hidden-state cache dir, a datasets.save_to_disk dir or a JSONL of input_ids/loss_mask"
    )
    out: Path | None = cfg_field(
        None, help="output file (default: <data>/vocab_stats.safetensors for a cache dir)"
    )
    draft_vocab_size: int | None = cfg_field(
        None, help="N: also store d2t/t2d for the top-N tokens"
    )
    vocab_size: int | None = cfg_field(
        None, help="target vocab size V; None = from the cache manifest or the target config"
    )
    target: str | None = cfg_field(
        None, help="target (HF dir / .gguf / None = SmolLM2) for V and the EOS id(s)"
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    include_eos: bool = cfg_field(
        True, help="force the tokenizer's EOS token(s) into the draft vocab"
    )

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            problems.append(("draft_vocab_size", f"must be >= 1, got {self.draft_vocab_size}"))
        if self.vocab_size is not None and self.vocab_size < 1:
            problems.append(("vocab_size", f"must be >= 1, got {self.vocab_size}"))
        return problems


def main_vocab(argv: list[str] | None = None) -> int:
    """CLI entry point for ``draftsmith data vocab``: count supervised tokens, build d2t/t2d.

    Args:
        argv: Arguments without the program/subcommand name; ``None`` means ``sys.argv[1:]``.

    Returns:
        Exit code: 0 on success; 2 on a config or data error (missing or malformed data, a
        draft vocab larger than the vocab); 1 when the target cannot be read or the disk is full.
    """
    return cli_main(_main_vocab, argv)


def _main_vocab(argv: list[str]) -> int:
    from ..config import parse_config

    cfg = parse_config(
        VocabConfig,
        argv,
        prog="draftsmith data vocab",
        description="Supervised-token frequencies and EAGLE-3's reduced draft vocabulary.",
    )
    summary = _run_vocab(cfg)
    for key, value in summary.items():
        print(f"  {key}: {value}")
    return 0


def _run_vocab(cfg: VocabConfig) -> dict[str, Any]:
    data_path = Path(cfg.data)
    # Everything about the input is checked before a target is looked up (which may download).
    if not data_path.exists():
        raise TokenDataError(
            f"data: {data_path} not found (a hidden-state cache from `draftsmith data cache`, or "
            "tokenized data from `draftsmith data tokenize`)"
        )
    manifest = _read_manifest(data_path)
    out = cfg.out or (data_path / VOCAB_STATS_FILE if manifest else None)
    if out is None:
        raise UsageError("out: give --out (the data is not a hidden-state cache directory)")
    vocab_size = cfg.vocab_size or (manifest or {}).get("target", {}).get("vocab_size")
    eos: list[int] = []
    if vocab_size is None or (cfg.include_eos and cfg.draft_vocab_size):
        from transformers import AutoConfig, AutoTokenizer

        from ..target_model.load import prepare_target

        tpath = (manifest or {}).get("target", {}).get("path") if cfg.target is None else None
        tpath = tpath if tpath and Path(tpath).is_dir() else None
        path = tpath or prepare_target(cfg.target, cache_dir=cfg.cache_dir, quiet=True)
        tconf = AutoConfig.from_pretrained(path)
        vocab_size = vocab_size or int(tconf.vocab_size)
        if cfg.include_eos:
            tok = AutoTokenizer.from_pretrained(path)
            eos = _eos_ids(tok, tconf)
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > int(vocab_size):
        raise VocabError(
            f"draft_vocab_size {cfg.draft_vocab_size} is larger than the target's vocabulary "
            f"({vocab_size} tokens); use at most {vocab_size}"
        )
    counts = token_counts(_open_any(data_path), int(vocab_size), source=str(data_path))
    meta = save_vocab_stats(
        out,
        counts,
        n=cfg.draft_vocab_size,
        always_include=eos,
        metadata={"source": str(data_path)},
    )
    return {"written": str(out), **meta}


def _eos_ids(tokenizer: Any, config: Any) -> list[int]:
    """EOS id(s) of the tokenizer and the model config (which may list several)."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def _read_manifest(path: Path) -> dict[str, Any] | None:
    manifest = path / "manifest.json"
    if not (path.is_dir() and manifest.is_file()):
        return None
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise TokenDataError(f"{manifest}: cannot read the cache manifest ({exc})") from exc
    return data if isinstance(data, dict) else None


def _open_any(path: Path) -> Any:
    """A cache directory (read through its shards) or tokenized data."""
    if _read_manifest(path) is not None:
        from .cache_read import HiddenStateCache

        return HiddenStateCache(path).token_view()
    return load_token_data(path)
