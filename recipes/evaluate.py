"""Evaluate a drafter: plain decoding vs. speculative decoding on the same target and prompts.

Launch::

    draftsmith evaluate --drafter ngram --k 5 --max-new-tokens 128 --out results.json
    python recipes/evaluate.py --drafter draft-lm --draft-layers 0 1 2 29 --k 4
    python recipes/evaluate.py --config recipes/configs/evaluate.yaml --report-to wandb

For each prompt the target first decodes alone (the baseline), then with the drafter, in the same
process, so the speedup compares like with like. Greedy runs check that the speculative output is
the target's own output token for token. Writes a results JSON (``--out``) with the command, the
versions and every metric (see ``docs/metrics.md`` for definitions), prints a table, and logs to
W&B with ``--report-to wandb`` (offline when no API key is configured).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.heads.draft_lm import DraftLM, layer_pruned_copy
from draftsmith.heads.ngram import NGramDrafter
from draftsmith.train.config import ConfigError, cfg_field, config_to_dict, parse_config
from draftsmith.train.draft_length import AdaptiveDraftLength
from draftsmith.train.metrics import results_table, summarize
from draftsmith.train.prompts import PromptFileError, load_prompts, render_prompt
from draftsmith.train.runinfo import run_info, write_json_atomic
from draftsmith.train.sampling import SamplingParams, sampling_problems
from draftsmith.train.speculative import generate
from draftsmith.train.target import TargetError, load_target


@dataclass
class EvalConfig:
    """Settings of one evaluation run."""

    target: str | None = cfg_field(
        None, help="target: a local HF model dir, a .gguf file, or None for SmolLM2-135M-Instruct"
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    prompts: Path | None = cfg_field(
        None, help="prompt JSONL file (prompt / messages / Alpaca / ShareGPT); default: ours"
    )
    split: str = cfg_field(
        "auto",
        help="records to keep: train, heldout, all; auto = heldout for the default prompt set, "
        "all for a user file",
        choices=["auto", "train", "heldout", "all"],
    )
    limit: int | None = cfg_field(None, help="evaluate the first N prompts only")
    drafter: str = cfg_field(
        "ngram",
        help="ngram (prompt lookup), draft-lm, or none",
        choices=["ngram", "draft-lm", "none"],
    )
    k: int = cfg_field(5, help="draft tokens per verification step")
    max_new_tokens: int = cfg_field(128, help="tokens to generate per prompt")
    temperature: float = cfg_field(0.0, help="0 = greedy; > 0 samples")
    top_k: int = cfg_field(0, help="top-k sampling (0 = off)")
    top_p: float = cfg_field(1.0, help="nucleus sampling mass (1 = off)")
    seed: int = cfg_field(0, help="random seed for sampling")
    ngram_max: int = cfg_field(4, help="n-gram drafter: longest suffix to match")
    ngram_min: int = cfg_field(2, help="n-gram drafter: shortest suffix to match")
    draft_model: str | None = cfg_field(
        None, help="draft-lm: a local HF model dir (or .gguf) sharing the target's vocabulary"
    )
    draft_layers: list[int] | None = cfg_field(
        None, help="draft-lm: build an untrained layer-pruned copy of the target with these layers"
    )
    adaptive_k: bool = cfg_field(
        False, help="pick each step's draft length (<= k) from measured acceptance and costs"
    )
    baseline: bool = cfg_field(True, help="also run plain decoding (needed for the speedup)")
    threads: int | None = cfg_field(None, help="torch CPU threads (default: torch's choice)")
    out: Path | None = cfg_field(None, help="write the results JSON here")
    report_to: str = cfg_field("none", help="experiment tracker", choices=["none", "wandb"])
    wandb_project: str = cfg_field("draftsmith", help="W&B project")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.k < 1:
            problems.append(("k", f"must be >= 1, got {self.k}"))
        if self.max_new_tokens < 1:
            problems.append(("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}"))
        problems += sampling_problems(self.temperature, self.top_k, self.top_p)
        if self.limit is not None and self.limit < 1:
            problems.append(("limit", f"must be >= 1, got {self.limit}"))
        if not 1 <= self.ngram_min <= self.ngram_max:
            problems.append(("ngram_min", "need 1 <= ngram_min <= ngram_max"))
        if self.draft_model and self.draft_layers:
            problems.append(("draft_layers", "give draft_model or draft_layers, not both"))
        if self.drafter != "draft-lm" and (self.draft_model or self.draft_layers):
            problems.append(("drafter", "draft_model/draft_layers need drafter: draft-lm"))
        if self.drafter == "none" and not self.baseline:
            problems.append(("baseline", "drafter none with baseline off measures nothing"))
        return problems


def build_drafter(cfg: EvalConfig, target):
    """The drafter the config asks for (None for plain decoding)."""
    if cfg.drafter == "ngram":
        return NGramDrafter(max_ngram=cfg.ngram_max, min_ngram=cfg.ngram_min)
    if cfg.drafter == "draft-lm":
        if cfg.draft_model:
            model, _ = load_target(cfg.draft_model, cache_dir=cfg.cache_dir)
        else:
            n = target.config.num_hidden_layers
            # Default: first, two evenly spaced middle layers and the last one.
            layers = cfg.draft_layers or [0, n // 3, 2 * n // 3, n - 1]
            model = layer_pruned_copy(target, layers)
        return DraftLM(model, target_vocab_size=target.get_output_embeddings().weight.shape[0])
    return None


def method_name(cfg: EvalConfig) -> str:
    if cfg.drafter == "ngram":
        return f"ngram[{cfg.ngram_min}-{cfg.ngram_max}]"
    if cfg.drafter == "draft-lm":
        what = cfg.draft_model or f"pruned {cfg.draft_layers or 'default'}"
        return f"draft-lm[{what}]"
    return "plain"


def main(argv: list[str] | None = None) -> int:
    # --- config -------------------------------------------------------------------------------
    try:
        cfg = parse_config(EvalConfig, argv, prog="draftsmith evaluate", description=__doc__)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    info = run_info()  # taken at the start: the code and versions that actually ran

    # --- target, drafter, prompts -------------------------------------------------------------
    # Inputs are checked before the (slow) model load, so a typo fails in a second.
    split = {"auto": None if cfg.prompts else "heldout", "all": None}.get(cfg.split, cfg.split)
    try:
        records = load_prompts(cfg.prompts, split=split, limit=cfg.limit)
        target, tokenizer = load_target(cfg.target, cache_dir=cfg.cache_dir)
        drafter = build_drafter(cfg, target)
        prompts = [render_prompt(tokenizer, r) for r in records]
    except (PromptFileError, TargetError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    eos = {tokenizer.eos_token_id, *_as_list(target.generation_config.eos_token_id)} - {None}
    common = dict(k=cfg.k, max_new_tokens=cfg.max_new_tokens, sampling=sampling, eos_token_id=eos)
    # One policy for the whole run: what it learns about the drafter carries across prompts.
    policy = AdaptiveDraftLength(cfg.k) if cfg.adaptive_k and drafter is not None else None

    # --- loop: baseline then speculative, prompt by prompt ------------------------------------
    # One short untimed run first: the first forwards of a process pay one-off allocation costs.
    generate(target, prompts[0], drafter, **{**common, "max_new_tokens": 8})
    base_runs, spec_runs, per_prompt = [], [], []
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    columns = [
        *Progress.get_default_columns()[:2],
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, transient=not sys.stderr.isatty()) as progress:
        task = progress.add_task("evaluating", total=len(prompts))
        for record, ids in zip(records, prompts, strict=True):
            # Same seed for both runs of a prompt: sampled outputs are then comparable run to run.
            base = None
            if cfg.baseline:
                gen = torch.Generator().manual_seed(cfg.seed)
                base = generate(target, ids, None, **common, generator=gen)
                base_runs.append(base)
            spec = base
            if drafter is not None:
                gen = torch.Generator().manual_seed(cfg.seed)
                spec = generate(target, ids, drafter, **common, generator=gen, draft_length=policy)
            spec_runs.append(spec)
            entry = {
                "id": record.id,
                "prompt_tokens": len(ids),
                "new_tokens": len(spec.tokens),
                "acceptance_length": spec.acceptance_length,
                "tokens_per_second": len(spec.tokens) / spec.wall_time,
                "stop_reason": spec.stop_reason,
                "output_ids": spec.tokens,
                "output_text": tokenizer.decode(spec.tokens, skip_special_tokens=True),
            }
            if base is not None:
                entry["baseline_tokens_per_second"] = len(base.tokens) / base.wall_time
                entry["identical_to_target"] = base.tokens == spec.tokens
                if base.tokens != spec.tokens:
                    entry["baseline_output_ids"] = base.tokens
            per_prompt.append(entry)
            progress.advance(task)

    # --- results ------------------------------------------------------------------------------
    result = {"method": method_name(cfg), "k": cfg.k, "temperature": cfg.temperature}
    result["adaptive_k"] = cfg.adaptive_k
    if policy is not None:
        result["mean_draft_length"] = sum(policy.chosen) / max(len(policy.chosen), 1)
    result.update(summarize(spec_runs, cfg.k, base_runs if cfg.baseline else None))
    if cfg.baseline and sampling.greedy:
        result["identical_to_target"] = all(p["identical_to_target"] for p in per_prompt)
    else:
        result["identical_to_target"] = None  # sampled outputs are compared in distribution only
    result["per_prompt"] = per_prompt
    result["config"] = config_to_dict(cfg)
    result.update(info)

    _console().print(
        results_table([result], title=f"target: {cfg.target or 'SmolLM2-135M-Instruct'}")
    )
    if cfg.out:
        write_json_atomic(cfg.out, result)
        print(f"results written to {cfg.out}")
    if cfg.report_to == "wandb":
        _log_wandb(cfg, result)
    if result["identical_to_target"] is False:
        bad = [p["id"] for p in per_prompt if not p["identical_to_target"]]
        print(
            f"error: speculative output differs from plain greedy for prompts {bad}",
            file=sys.stderr,
        )
        return 1
    return 0


def _console():
    """A console wide enough for the results table even when stdout is not a terminal."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=150)


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple, set)) else [x]


def _log_wandb(cfg: EvalConfig, result: dict) -> None:
    """Log the summary metrics, α per position and per-prompt τ to W&B."""
    import wandb

    if "WANDB_MODE" not in os.environ and not wandb.api.api_key:
        os.environ["WANDB_MODE"] = "offline"  # no key configured: keep the run on disk
        print("W&B: no API key configured, logging offline (sync later with `wandb sync`)")
    run = wandb.init(
        project=cfg.wandb_project,
        job_type="evaluate",
        config=result["config"],
        name=f"eval-{result['method']}-k{cfg.k}-{int(time.time())}",
    )
    scalars = {k: v for k, v in result.items() if isinstance(v, (int, float)) and k != "k"}
    run.summary.update(scalars)
    alpha = wandb.Table(
        columns=["position", "acceptance_rate"],
        data=[[i + 1, a] for i, a in enumerate(result["acceptance_rate_per_position"])],
    )
    taus = wandb.Table(
        columns=["prompt", "acceptance_length"],
        data=[[p["id"], p["acceptance_length"]] for p in result["per_prompt"]],
    )
    run.log(
        {
            **{f"eval/{k}": v for k, v in scalars.items()},
            "eval/acceptance_rate_per_position": wandb.plot.bar(
                alpha, "position", "acceptance_rate"
            ),
            "eval/acceptance_length_per_prompt": wandb.plot.histogram(taus, "acceptance_length"),
        }
    )
    run.finish()


if __name__ == "__main__":
    sys.exit(main())
