"""``draftsmith data prompts``: make training prompts with the target (Magpie), plus other sources.

Launch::

    draftsmith data prompts --output prompts.jsonl --num 2000 --include-shipped
    python -m draftsmith.train.datagen.prompts_command --output p.jsonl --num 500 --input mine.jsonl \\
        --exclude my_heldout.jsonl

The sources (``--include-shipped``, ``--input``, ``--exclude``; the shipped held-out prompts are
always excluded) are read before the target is loaded, so a typo fails in a second; the run
itself, its output and how it resumes are :mod:`~draftsmith.train.datagen.magpie`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ...heads.sampling import SamplingParams
from ..config import cfg_field, parse_config
from ..data.prompts import DEFAULT_PROMPTS
from ..data.records import SHAPES
from ..device import (
    DEVICE_HELP,
    DTYPE_AUTO_HELP,
    auto_dtype,
    device_problem,
    is_cpu,
    resolve_device,
)
from ..errors import RunError, UsageError, cli_main
from ..runinfo import output_lock
from .magpie import (
    DEFAULT_SAMPLING,
    check_meta,
    make_prompts,
    prompt_settings,
)
from .prompt_filters import FilterRules
from .prompt_sources import SeedPrompt, load_exclusions, load_seed_prompts
from .resumable import meta_file

__all__ = ["PromptsConfig", "main_prompts"]


@dataclass
class PromptsConfig:
    """Settings of a prompt-making run (``draftsmith data prompts``)."""

    output: Path = cfg_field(help="output JSON Lines file of prompt records (resumed if it exists)")
    num: int = cfg_field(
        1000, help="Magpie prompts to make, after filters and dedupe (0: only combine)", ge=0
    )
    include_shipped: bool = cfg_field(
        False, help="add the project's shipped training prompts (train split of chat_prompts)"
    )
    input: list[Path] | None = cfg_field(
        None, help="your prompt files to add (train split when the records carry one)"
    )
    exclude: list[Path] | None = cfg_field(
        None,
        help="held-out files: prompts equal or near-equal to theirs are dropped (their heldout "
        "split when they carry one); the shipped held-out prompts are always excluded",
    )
    shape: str = cfg_field("auto", help="record shape of --input files", choices=["auto", *SHAPES])
    skip_invalid: bool = cfg_field(False, help="skip malformed --input records (counted)")
    system: str | None = cfg_field(
        None, help="system prompt before the user turn (steers topics; kept in the records)"
    )
    target: str | None = cfg_field(
        None,
        help="target: a Hugging Face Hub id, a local HF model dir, a .gguf file, or None for SmolLM2-135M-Instruct",
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    dtype: str = cfg_field(
        "float32",
        help="weights dtype (" + DTYPE_AUTO_HELP + ")",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    device: str = cfg_field("auto", help=DEVICE_HELP)
    max_new_tokens: int = cfg_field(96, help="token budget of one prompt", ge=1)
    batch_size: int = cfg_field(32, help="candidates decoded together", ge=1)
    temperature: float = cfg_field(
        DEFAULT_SAMPLING.temperature, help="sampling temperature (> 0)", gt=0
    )
    top_k: int = cfg_field(0, help="top-k sampling (0 = off)", ge=0)
    top_p: float = cfg_field(DEFAULT_SAMPLING.top_p, help="nucleus sampling mass", gt=0, le=1)
    seed: int = cfg_field(0, help="seed of the per-candidate sampling generators")
    min_words: int = cfg_field(FilterRules.min_words, help="drop prompts with fewer words", ge=1)
    max_words: int = cfg_field(FilterRules.max_words, help="drop prompts with more words", ge=1)
    max_attempts: int | None = cfg_field(
        None, help="stop after this many candidates; none = 20 x num + batch size", ge=1
    )
    max_minutes: float | None = cfg_field(
        None,
        help="stop after the batch that ends past this many minutes of generation, with the "
        "prompts made so far (exit 0; the output is resumable: rerun to make the rest)",
        gt=0,
    )
    overwrite: bool = cfg_field(False, help="start again even when the output exists")
    threads: int | None = cfg_field(
        None, help="torch CPU threads when the device is the CPU; none = torch's choice"
    )
    progress: bool = cfg_field(True, help="show a progress bar")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.max_words < self.min_words:
            problems.append(
                ("max_words", f"must be >= min_words ({self.min_words}), got {self.max_words}")
            )
        if self.shape == "text":
            problems.append(("shape", "text records have no user message"))
        problem = device_problem(self.device)
        if problem:
            problems.append(("device", problem))
        return problems


def main_prompts(argv: list[str] | None = None) -> int:
    """CLI entry point: ``draftsmith data prompts --output OUT [--num N] [options]``.

    Args:
        argv: Arguments without the program/subcommand name; ``None`` means ``sys.argv[1:]``.

    Returns:
        Exit code: 0 done (or stopped at ``max_minutes``); 2 bad config, input or output state; 1 the run failed (target,
        another process writing the output, disk full, ``max_attempts`` reached first).
    """
    return cli_main(_main_prompts, argv)


def _main_prompts(argv: list[str]) -> int:
    from ..target_model.load import load_target

    cfg = parse_config(
        PromptsConfig,
        argv,
        prog="draftsmith data prompts",
        description="Make training prompts: the target writes user messages (Magpie), plus the "
        "shipped prompts and your files, deduplicated.",
    )
    device = resolve_device(cfg.device)  # a GPU that is not there fails now, in one line
    # Sources are read before the (slow) model load, so a typo fails in a second.
    seeds: list[SeedPrompt] = []
    if cfg.include_shipped:
        seeds += load_seed_prompts(DEFAULT_PROMPTS, id_prefix="shipped", source="shipped")
    for j, path in enumerate(cfg.input or []):
        seeds += load_seed_prompts(
            path,
            id_prefix=f"input{j}",
            source=f"input:{path}",
            shape=cfg.shape,
            skip_invalid=cfg.skip_invalid,
        )
    exclude = load_exclusions(DEFAULT_PROMPTS)
    for path in cfg.exclude or []:
        exclude += load_exclusions(path)
    if cfg.num == 0 and not seeds:
        raise UsageError("num: 0 and no other source (--include-shipped, --input): nothing to do")

    rules = FilterRules(min_words=cfg.min_words, max_words=cfg.max_words)
    sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    # Taken before the model load: a second run into this output is refused at once.
    with output_lock(cfg.output, "prompts run"):
        # A resume with other settings fails here, before the model load (make_prompts checks
        # the model, dtype and template too).
        meta_path = meta_file(cfg.output)
        if cfg.output.exists() and not cfg.overwrite and meta_path.exists():
            early = prompt_settings(
                cfg.seed, cfg.system, cfg.max_new_tokens, sampling, rules, seeds, exclude
            )
            check_meta(meta_path, early)
        if cfg.threads and is_cpu(device):
            torch.set_num_threads(cfg.threads)
        model, tokenizer = load_target(
            cfg.target,
            cache_dir=cfg.cache_dir,
            dtype=getattr(torch, auto_dtype(cfg.dtype, device, fast="bfloat16", slow="float32")),
            device=device,
        )
        stats = make_prompts(
            model,
            tokenizer,
            cfg.output,
            num=cfg.num,
            seeds=seeds,
            exclude=exclude,
            system=cfg.system,
            max_new_tokens=cfg.max_new_tokens,
            batch_size=cfg.batch_size,
            sampling=sampling,
            seed=cfg.seed,
            rules=rules,
            max_attempts=cfg.max_attempts,
            overwrite=cfg.overwrite,
            progress=cfg.progress,
            meta={"target": cfg.target},
            lock=False,
            max_seconds=None if cfg.max_minutes is None else 60 * cfg.max_minutes,
        )
    print(stats.summary())
    if stats.time_limited:
        print(
            f"stopped at --max-minutes {cfg.max_minutes:g} with {stats.made} of {stats.requested} "
            f"Magpie prompts; rerun the same command without it to make the rest"
        )
    if stats.exhausted:
        raise RunError(
            f"made {stats.made} of {stats.requested} Magpie prompts before max_attempts "
            f"({cfg.max_attempts or 20 * cfg.num + cfg.batch_size} candidates); the output is "
            f"valid and resumable: rerun with a larger --max-attempts, looser --min-words/"
            f"--max-words, or a smaller --num"
        )
    print(
        f"{cfg.output}: {stats.seeds + stats.made} prompts; answer them with: "
        f"draftsmith data distill --input {cfg.output} --output <answers.jsonl>"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main_prompts())
