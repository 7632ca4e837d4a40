"""``draftsmith data distill``: regenerate the assistant turns of a data set with the target.

Launch::

    draftsmith data distill --input my_prompts.jsonl --output data/my_sd.jsonl
    python -m draftsmith.train.datagen.distill_command --output out.jsonl --temperature 0.7 --seed 1
    draftsmith data distill --endpoint http://127.0.0.1:8000 --concurrency 16 --output sd.jsonl
    # two more answers per prompt, sampled, 2,767 in all (the quickstart's sampled answers)
    draftsmith data distill --input p.jsonl --output s.jsonl --temperature 0.7 --seed 1 \
        --limit 1768 --samples 2 --answers 2767

The records are read and their split chosen (``--split auto``: the ``train`` split when they
carry split information, else all) before the target is loaded, so a typo fails in a second; the
run itself, its output format and how it resumes are :mod:`~draftsmith.train.datagen.self_distill`.
With ``--endpoint`` the answers come from an OpenAI-compatible server instead
(:mod:`~draftsmith.train.datagen.endpoint_distill`); the server is checked (reachable, serving
``--model``) before anything else, and only the target's tokenizer is loaded (``--target``).
``--samples N`` answers each selected record N times (:func:`repeat_records`), ``--answers`` keeps
the first of those answers: several sampled answers per prompt, beside a greedy run's.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...heads.sampling import SamplingParams, sampling_problems
from ..config import as_list, cfg_field, parse_config
from ..data.files import DataFileError
from ..data.prompts import DEFAULT_PROMPTS
from ..data.records import SHAPES, Conversation, load_records, select_split
from ..device import (
    DEVICE_HELP,
    DTYPE_AUTO_HELP,
    auto_dtype,
    device_problem,
    is_cpu,
    resolve_device,
)
from ..errors import cli_main
from ..runinfo import output_lock
from .endpoint import EndpointClient, ServerInfo
from .endpoint_distill import TEMPLATE_MODES
from .resumable import meta_file
from .self_distill import (
    DistillStats,
    check_meta,
    resolve_split,
    self_distill,
)

__all__ = ["SelfDistillConfig", "main_distill"]


@dataclass
class SelfDistillConfig:
    """Settings of a self-distillation run (``draftsmith data distill``)."""

    output: Path = cfg_field(help="output JSON Lines file (resumed when it exists)")
    input: Path | None = cfg_field(
        None,
        help="prompt/conversation file or directory (JSONL, JSON, parquet; messages, ShareGPT, "
        "Alpaca or prompt records); default: the project's own prompt set",
    )
    shape: str = cfg_field("auto", help="record shape", choices=["auto", *SHAPES])
    split: str = cfg_field(
        "auto",
        help="records to answer: auto = train when the records carry a split (split field or "
        "integer ids, id % 10 == 9 held-out), else all",
        choices=["auto", "train", "heldout", "all"],
    )
    limit: int | None = cfg_field(None, help="answer only the first N selected records")
    samples: int = cfg_field(
        1,
        help="answers per record: more than 1 answers the records that many times over, pass by "
        "pass, ids suffixed #s1, #s2, ... (each id seeds its own generator; needs --temperature "
        "> 0: greedy answers would repeat)",
        ge=1,
    )
    answers: int | None = cfg_field(
        None,
        help="answers in all: the first N of the passes' records, in order (None: every record "
        "of every pass)",
        ge=1,
    )
    skip_invalid: bool = cfg_field(False, help="skip malformed input records (counted)")
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
    device: str = cfg_field("auto", help=DEVICE_HELP + "; with --endpoint the server decides")
    turns: str = cfg_field(
        "all",
        help="all = regenerate every assistant turn on the regenerated history; last = only "
        "the final answer",
        choices=["all", "last"],
    )
    max_new_tokens: int = cfg_field(256, help="most tokens per generated turn")
    batch_size: int = cfg_field(
        32, help="prompts decoded together (CPU, SmolLM2: 32 gives ~10x batch 1's tokens/s)"
    )
    temperature: float = cfg_field(0.0, help="0 = greedy; > 0 samples")
    top_k: int = cfg_field(0, help="top-k sampling (0 = off)")
    top_p: float = cfg_field(1.0, help="nucleus sampling mass (1 = off)")
    seed: int = cfg_field(0, help="seed of the per-record sampling generators")
    sort_by_length: bool = cfg_field(True, help="batch prompts of similar length together")
    overwrite: bool = cfg_field(False, help="start again even when the output exists")
    threads: int | None = cfg_field(
        None, help="torch CPU threads when the device is the CPU (default: torch's choice)"
    )
    progress: bool = cfg_field(True, help="show a progress bar")
    endpoint: str | None = cfg_field(
        None,
        help="answer through this OpenAI-compatible server (vLLM, SGLang, TGI), e.g. "
        "http://127.0.0.1:8000, instead of loading the target here (--dtype, --batch-size, "
        "--threads then do not apply and --device must stay auto; --target gives the "
        "tokenizer)",
    )
    model: str | None = cfg_field(
        None, help="the served model name (--endpoint); default: the one model the server lists"
    )
    concurrency: int = cfg_field(8, help="requests in flight at once (--endpoint)", ge=1)
    template: str = cfg_field(
        "ours",
        help="--endpoint prompts: ours = our chat template rendered to token ids "
        "(/v1/completions; vLLM, SGLang), server = messages to /v1/chat/completions",
        choices=list(TEMPLATE_MODES),
    )
    request_timeout: float = cfg_field(
        600.0, help="seconds one request may take (--endpoint)", gt=0
    )
    max_retries: int = cfg_field(
        5, help="retries of a request after a transient error (--endpoint)", ge=0
    )

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.max_new_tokens < 1:
            problems.append(("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}"))
        if self.batch_size < 1:
            problems.append(("batch_size", f"must be >= 1, got {self.batch_size}"))
        problems += sampling_problems(self.temperature, self.top_k, self.top_p)
        if self.limit is not None and self.limit < 1:
            problems.append(("limit", f"must be >= 1, got {self.limit}"))
        if self.samples > 1 and self.temperature == 0:
            problems.append(("samples", "more than 1 answer per record needs --temperature > 0"))
        if self.shape == "text":
            problems.append(("shape", "text records have no turns to answer"))
        problem = device_problem(self.device)
        if problem:
            problems.append(("device", problem))
        elif self.endpoint is not None and self.device != "auto":
            # No model runs here: a device asked for would silently not be used.
            problems.append(("device", "the server decides where --endpoint runs; leave auto"))
        if self.endpoint is None:
            if self.model is not None:
                problems.append(("model", "only with --endpoint (the served model name)"))
            if self.template != "ours":
                problems.append(("template", "only with --endpoint"))
        return problems


def repeat_records(conversations: Sequence[Conversation], samples: int) -> list[Conversation]:
    """The records ``samples`` times over, pass by pass (several sampled answers per prompt).

    Args:
        conversations: the selected records, in order.
        samples: passes; 1 returns the records as they are.

    Returns:
        With ``samples > 1``, pass ``j`` (1-based) holds every record with ``#s{j}`` appended to
        its id: ids stay unique across the data, and each id seeds its own sampling generator
        (:func:`~draftsmith.train.datagen.self_distill.self_distill`), so the passes' answers
        differ. Passes come whole and in order, so a prefix (``--answers``) is whole passes and
        then the first records of the next.
    """
    if samples == 1:
        return list(conversations)
    out = []
    for j in range(1, samples + 1):
        for c in conversations:
            new_id = f"{c.id}#s{j}"
            # The written record keeps its input's fields, id included: the new id goes there
            # too, and the split is spelled out (an integer id's id % 10 rule no longer applies).
            raw = {**c.raw, "id": new_id, **({"split": c.split} if c.split else {})}
            out.append(dataclasses.replace(c, id=new_id, raw=raw))
    return out


def main_distill(argv: list[str] | None = None) -> int:
    """CLI entry point: ``draftsmith data distill --output OUT [--input IN] [options]``.

    Args:
        argv: Arguments without the program/subcommand name; ``None`` means ``sys.argv[1:]``.

    Returns:
        Exit code: 0 done; 2 bad config, input or output state (another run's settings);
        1 the run failed (target, another process writing the output, disk full).
    """
    return cli_main(_main_distill, argv)


def _main_distill(argv: list[str]) -> int:
    from ..target_model.load import load_target

    cfg = parse_config(
        SelfDistillConfig,
        argv,
        prog="draftsmith data distill",
        description="Regenerate the assistant turns of a data set with the target itself.",
    )
    # A GPU that is not there fails now, in one line; the endpoint path runs no model here.
    device = resolve_device(cfg.device) if cfg.endpoint is None else None
    source = cfg.input or DEFAULT_PROMPTS

    # Inputs are checked before the (slow) model load, so a typo fails in a second.
    conversations, summary = load_records(source, shape=cfg.shape, skip_invalid=cfg.skip_invalid)
    split, why = resolve_split(conversations, cfg.split)
    conversations = select_split(conversations, split)
    if cfg.limit is not None:
        conversations = conversations[: cfg.limit]
    if not conversations:
        raise DataFileError(source, f"no records in split {split!r}")
    print(f"input: {summary}", file=sys.stderr)
    selected = len(conversations)
    conversations = repeat_records(conversations, cfg.samples)[: cfg.answers]
    passes = (
        f", {cfg.samples} answers each ({len(conversations)} in all)" if cfg.samples > 1 else ""
    )
    print(f"split: {split} ({why}): {selected} records to answer{passes}", file=sys.stderr)
    meta = {
        "input": str(Path(source).resolve()),
        "shape": cfg.shape,
        "split": split,
        "limit": cfg.limit,
        # Only when set: the meta of an output made before these options still resumes.
        **({"samples": cfg.samples} if cfg.samples > 1 else {}),
        **({"answers": cfg.answers} if cfg.answers is not None else {}),
        "target": cfg.target,
    }
    client = server = None
    if cfg.endpoint is not None:
        client = EndpointClient(
            cfg.endpoint, timeout=cfg.request_timeout, max_retries=cfg.max_retries
        )
        # Unreachable, or not serving --model: one line now, before anything is written.
        server = client.connect(cfg.model)
        context = f", context {server.max_model_len}" if server.max_model_len else ""
        print(
            f"endpoint: {server.url}, model {server.model!r}{context}, template {cfg.template}",
            file=sys.stderr,
        )
    # Taken before the model load: a second run into this output is refused at once.
    with output_lock(cfg.output, "distill run"):
        # A resume with other settings fails here, before the model load (self_distill checks
        # the model, dtype and template too).
        meta_path = meta_file(cfg.output)
        if cfg.output.exists() and not cfg.overwrite and meta_path.exists():
            early = {**meta, "turns": cfg.turns, "max_new_tokens": cfg.max_new_tokens}
            early.update(seed=cfg.seed, temperature=cfg.temperature, top_k=cfg.top_k)
            if server is not None:
                early.update(backend="endpoint", template_mode=cfg.template, model=server.model)
            check_meta(meta_path, {**early, "top_p": cfg.top_p})
        if server is not None:
            stats = _distill_endpoint(cfg, client, server, conversations, meta)
            _print_summary(cfg, stats, endpoint=True)
            return 0
        if cfg.threads and is_cpu(device):
            torch.set_num_threads(cfg.threads)
        model, tokenizer = load_target(
            cfg.target,
            cache_dir=cfg.cache_dir,
            dtype=getattr(torch, auto_dtype(cfg.dtype, device, fast="bfloat16", slow="float32")),
            device=device,
        )
        stats = self_distill(
            model,
            tokenizer,
            conversations,
            cfg.output,
            max_new_tokens=cfg.max_new_tokens,
            batch_size=cfg.batch_size,
            sampling=SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p),
            seed=cfg.seed,
            turns=cfg.turns,
            sort_by_length=cfg.sort_by_length,
            overwrite=cfg.overwrite,
            progress=cfg.progress,
            meta=meta,
            lock=False,
        )
    _print_summary(cfg, stats, endpoint=False)
    return 0


def _distill_endpoint(
    cfg: SelfDistillConfig,
    client: EndpointClient,
    server: ServerInfo,
    conversations: list[Conversation],
    meta: dict[str, Any],
) -> DistillStats:
    """The ``--endpoint`` run: our tokenizer and end-of-turn ids, the server's answers."""
    from ..target_model.load import load_tokenizer, prepare_target
    from .endpoint_distill import endpoint_distill

    path = prepare_target(cfg.target, cache_dir=cfg.cache_dir, quiet=True)
    tokenizer = load_tokenizer(path)
    return endpoint_distill(
        client,
        server,
        tokenizer,
        conversations,
        cfg.output,
        max_new_tokens=cfg.max_new_tokens,
        sampling=SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p),
        seed=cfg.seed,
        turns=cfg.turns,
        template=cfg.template,
        concurrency=cfg.concurrency,
        eos_token_ids=_generation_eos(path),
        overwrite=cfg.overwrite,
        progress=cfg.progress,
        meta=meta,
        lock=False,
    )


def _generation_eos(path: Path) -> list[int]:
    """The target's ``generation_config.eos_token_id`` (the HF path stops at these too)."""
    from transformers import GenerationConfig

    try:
        return [int(t) for t in as_list(GenerationConfig.from_pretrained(path).eos_token_id)]
    except (OSError, ValueError, TypeError):
        return []  # no generation config: the tokenizer's EOS only


def _print_summary(cfg: SelfDistillConfig, stats: DistillStats, *, endpoint: bool) -> None:
    total = stats.already_done + stats.written
    lines = [
        f"{cfg.output}: {total} of {stats.selected} records complete "
        f"({stats.written} written now, {stats.already_done} already there)",
        f"generated {stats.generated_tokens} tokens in {stats.seconds:.1f} s "
        f"({stats.tokens_per_second:.1f} tok/s) for prompts of {stats.prompt_tokens} tokens; "
        f"{stats.truncated} records hit max_new_tokens",
    ]
    if stats.regenerated:
        lines.append(
            f"{stats.regenerated} records already there were answered again and not written "
            "(they share the batch a kill cut short, which is regenerated whole)"
        )
    if endpoint:
        lines.append(
            f"{stats.token_mismatches} of {stats.checked_turns} generated turns did not "
            "re-tokenize to the server's prompt + answer ids"
        )
        if stats.unchecked_turns:
            lines.append(
                f"{stats.unchecked_turns} turns not checked: the server returns no token ids"
            )
        if stats.retries:
            lines.append(f"{stats.retries} requests retried after transient errors")
    if stats.discarded_partial_line:
        lines.append("a half-written last line from an interrupted run was discarded")
    if stats.empty_answers:
        lines.append(f"{stats.empty_answers} generated turns were empty")
    if stats.skipped:
        lines.append("not written: " + ", ".join(f"{r}: {n}" for r, n in stats.skipped.items()))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main_distill())
