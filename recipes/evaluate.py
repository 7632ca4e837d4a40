r"""Evaluate a drafter: plain decoding vs. speculative decoding on the same target and prompts.

Launch::

    draftsmith evaluate --drafter ngram --k 5 --max-new-tokens 128 --out results.json
    python recipes/evaluate.py --drafter draft-lm --draft-layers 0 1 2 29 --k 4
    python recipes/evaluate.py --config recipes/configs/evaluate.yaml --report-to wandb
    draftsmith evaluate --prompts my_prompts.jsonl --split heldout \
        --drafter eagle=runs/eagle1_smollm2/drafter eagle=runs/eagle3_smollm2/drafter \
        eagle-tree=runs/eagle3_smollm2/drafter --out results/eagle.json

When the machine was busy before or after the timed runs (other work's load of at least half
the cores, docs/metrics.md), the table is followed by a warning naming the busy processes, and
the JSON's ``machine_load`` holds ``busy: true`` and ``busy_processes``.

Several drafters in one run share one plain-decoding baseline, measured prompt by prompt between
them. The ``--drafter`` kinds are those of ``heads/registry.py`` (built through it, named by the
drafters themselves): adding a drafter changes nothing here.

For each prompt the target decodes alone (the baseline) and with each drafter, in the same
process, so the speedup compares like with like; which runs first alternates prompt by prompt. Greedy runs check that the speculative output is
the target's own output token for token. Writes a results JSON (``--out``) with the command, the
versions and every metric (see ``docs/metrics.md`` for definitions), prints a table, and logs to
W&B with ``--report-to wandb`` (offline when no API key is configured).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: resolve the imports below (PEP 366)
    __package__ = "draftsmith.recipes"

import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..heads import registry
from ..heads.auto import AutoDrafter, sampling_key
from ..heads.base import BuildOptions, runs_own_loop
from ..heads.sampling import SamplingParams, sampling_problems
from ..train.config import ConfigError, as_list, cfg_field, config_to_dict, parse_config
from ..train.core.stop import StopSignals
from ..train.data.prompts import PromptFileError, load_prompts, render_prompt
from ..train.decoding import calibration
from ..train.decoding.draft_length import AdaptiveDraftLength, load_cost_profile
from ..train.decoding.metrics import category_table, results_table
from ..train.decoding.partial import PartialRun
from ..train.decoding.results import (
    annotate,
    counters,
    divergence,
    identity,
    merge_results,
    prompt_entry,
    summarize_entries,
)
from ..train.decoding.speculative import generate
from ..train.decoding.verify_cost import probe_verify_costs
from ..train.device import (
    DEVICE_HELP,
    DeviceTimer,
    device_problem,
    is_cpu,
    make_generator,
    resolve_device,
)
from ..train.errors import UsageError
from ..train.runinfo import (
    busy_warning,
    load_record,
    machine_load,
    run_info,
    sibling_load,
    wandb_mode,
)
from ..train.staged import write_json_atomic
from ..train.target_model.kernels import fast_cpu_linears
from ..train.target_model.load import TargetError, load_target


@dataclass
class EvalConfig:
    """Settings of one evaluation run."""

    target: str | None = cfg_field(
        None,
        help="target: a local HF model dir, a .gguf file, a Hugging Face Hub id (org/name), or "
        "None for SmolLM2-135M-Instruct",
    )
    cache_dir: Path | None = cfg_field(None, help="draftsmith cache root (converted targets)")
    device: str = cfg_field("auto", help=DEVICE_HELP)
    dtype: str = cfg_field(
        "float32",
        help="weights and activations of the target and every drafter (bfloat16: CPUs with "
        "AVX512-BF16/AMX verify several tokens for about the cost of one)",
        choices=["float32", "bfloat16"],
    )
    draft_dtype: str = cfg_field(
        "same",
        help="EAGLE and draft-LM drafters: same = the target's dtype; float32 can draft faster "
        "beside a bf16 target on CPUs, whose small width-1 matmuls are quicker in fp32",
        choices=["same", "float32", "bfloat16"],
    )
    reference_plain: bool = cfg_field(
        True,
        help="also time plain decoding in the other dtype, interleaved, and report each "
        "drafter's speedup over the fastest plain decoding measured",
    )
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
    shard: str | None = cfg_field(
        None,
        help="I/N: evaluate every N-th prompt starting at I (0-based), e.g. to run N processes on "
        "N cores; merge their JSONs with `draftsmith evaluate --merge A.json B.json --out C.json`",
    )
    warmup_prompts: int | None = cfg_field(
        None,
        help="untimed full-length decodes of the first N prompts by every method before the "
        "timed ones. None: 2 on a GPU, where decoding a small target is launch-bound and kept "
        "speeding up over the first prompts (16 -> 53 tok/s on an H200), else 0 (one 8-token "
        "run per method, enough on a CPU)",
        ge=0,
    )
    max_minutes: float | None = cfg_field(
        None,
        help="start no new prompt after this many minutes; results cover the prompts done and "
        "the same command continues the run",
    )
    resume: bool = cfg_field(
        True,
        help="continue a stopped run (Ctrl-C, max_minutes, a kill) from OUT.partial.jsonl, "
        "skipping its finished prompts; --no-resume starts over",
    )
    merge: list[Path] | None = cfg_field(
        None, help="merge these results JSONs (shards of one run) into --out; runs nothing"
    )
    drafter: list[str] = cfg_field(
        ["ngram"],
        help="drafter(s) to compare against the same baseline, each KIND or KIND=PATH: "
        + registry.kinds_help(),
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
    tree_topk: int = cfg_field(4, help="eagle-tree: children expanded per node")
    tree_total_tokens: int = cfg_field(
        24, help="eagle-tree / medusa-tree: draft tokens verified per step (tree size)"
    )
    adaptive_k: bool = cfg_field(
        False,
        help="pick each step's draft length (<= k) from measured acceptance and costs (our "
        "drafters; hf-assisted keeps its own schedule, see hf_assistant)",
    )
    cost_profile: Path | None = cfg_field(
        None,
        help="adaptive_k: verify costs measured by scripts/bench_forward.py (JSON) to start from",
    )
    auto_k: int | None = cfg_field(
        None,
        help="auto:KIND drafters: most tokens drafted per step (chain length / tree depth); "
        "None: k",
        ge=1,
    )
    auto_nodes: int | None = cfg_field(
        None,
        help="auto:KIND drafters wrapping a tree kind: the candidate tree's size, of which each "
        "step verifies what pays; None: tree_total_tokens",
        ge=1,
    )
    calibration_prompts: Path | None = cfg_field(
        None,
        help="auto:KIND drafters: prompts whose decoding calibrates the drafter's confidences "
        "(never the evaluated ones); default: the shipped prompt set's train split",
    )
    calibration_limit: int = cfg_field(
        16, help="auto:KIND drafters: calibrate on at most this many prompts", ge=1
    )
    recalibrate: bool = cfg_field(
        False,
        help="auto:KIND drafters: fit the calibration again even when DIR/calibration.json "
        "holds a current one for these sampling settings",
    )
    hf_assistant: str = cfg_field(
        "constant",
        help="hf-assisted draft length: constant = k tokens every step (like our chain); "
        "transformers = transformers' own heuristics (up to 20 tokens, confidence threshold)",
        choices=["constant", "transformers"],
    )
    baseline: bool = cfg_field(True, help="also run plain decoding (needed for the speedup)")
    threads: int | None = cfg_field(
        None, help="torch CPU threads (default: torch's choice; ignored on a GPU)"
    )
    out: Path | None = cfg_field(None, help="write the results JSON here")
    report_to: str = cfg_field("none", help="experiment tracker", choices=["none", "wandb"])
    wandb_project: str = cfg_field("draftsmith", help="W&B project")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if problem := device_problem(self.device):
            problems.append(("device", problem))
        if self.k < 1:
            problems.append(("k", f"must be >= 1, got {self.k}"))
        if self.max_new_tokens < 1:
            problems.append(("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}"))
        problems += sampling_problems(self.temperature, self.top_k, self.top_p)
        if self.shard is not None and _parse_shard(self.shard) is None:
            problems.append(("shard", f"must be I/N with 0 <= I < N, got {self.shard!r}"))
        if self.max_minutes is not None and self.max_minutes <= 0:
            problems.append(("max_minutes", f"must be > 0, got {self.max_minutes}"))
        if self.merge is not None and self.out is None:
            problems.append(("out", "merge needs --out"))
        if self.limit is not None and self.limit < 1:
            problems.append(("limit", f"must be >= 1, got {self.limit}"))
        if not 1 <= self.ngram_min <= self.ngram_max:
            problems.append(("ngram_min", "need 1 <= ngram_min <= ngram_max"))
        if self.draft_model and self.draft_layers:
            problems.append(("draft_layers", "give draft_model or draft_layers, not both"))
        problems += [("drafter", p) for p in map(registry.spec_problem, self.drafter) if p]
        specs = [registry.parse_spec(spec)[0] for spec in self.drafter]
        if not self.drafter:
            problems.append(("drafter", "name at least one drafter (or none)"))
        if "none" in specs and len(specs) > 1:
            problems.append(
                ("drafter", "none runs plain decoding only; do not list other drafters")
            )
        # e.g. draft_layers without a draft-LM drafter: each kind declares what it reads.
        problems += [("drafter", p) for p in registry.unused_settings(specs, vars(self))]
        if specs == ["none"] and not self.baseline:
            problems.append(("baseline", "drafter none with baseline off measures nothing"))
        if self.tree_topk < 1:
            problems.append(("tree_topk", f"must be >= 1, got {self.tree_topk}"))
        if self.tree_total_tokens < 1:
            problems.append(("tree_total_tokens", f"must be >= 1, got {self.tree_total_tokens}"))
        return problems


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def drafter_training(path: str | None) -> dict[str, Any] | None:
    """How the drafter at ``path`` was trained, from its run's ``training_metrics.json`` (in the
    directory or the run directory above ``best/``/``drafter/``): the minutes and steps it
    trained, its recipe and commit. None for a drafter without one (n-gram, an export)."""
    if not path:
        return None
    here = Path(path).expanduser()
    for run in (here, here.parent):
        metrics = run / "training_metrics.json"
        if not metrics.is_file():
            continue
        try:
            data = json.loads(metrics.read_text())
        except (OSError, ValueError):
            return None
        seconds = data.get("train_seconds")
        return {
            "run": str(run),
            "recipe": data.get("recipe"),
            "training_minutes": None if seconds is None else round(seconds / 60, 2),
            "steps": data.get("steps"),
            "stop_reason": data.get("stop_reason"),
            "git_commit": data.get("git_commit"),
        }
    return None


def build_options(cfg: EvalConfig, target) -> BuildOptions:
    """What the drafter builders (``heads/registry.py``) need: the run's settings, the drafter's
    dtype, our model loader (on the target's device), the CPU kernel-path patch and the device's
    timer."""
    device = target.device

    def load_model(path: str, dtype: torch.dtype):
        return load_target(path, cache_dir=cfg.cache_dir, dtype=dtype, device=device)[0]

    return BuildOptions(
        target=target,
        dtype=target.dtype if cfg.draft_dtype == "same" else DTYPES[cfg.draft_dtype],
        ngram_max=cfg.ngram_max,
        ngram_min=cfg.ngram_min,
        draft_model=cfg.draft_model,
        draft_layers=cfg.draft_layers,
        tree_topk=cfg.tree_topk,
        tree_total_tokens=cfg.tree_total_tokens,
        hf_assistant=cfg.hf_assistant,
        load_model=load_model,
        fast_linears=fast_cpu_linears,
        clock=DeviceTimer(device).now,
    )


def main(argv: list[str] | None = None) -> int:
    # --- config -------------------------------------------------------------------------------
    try:
        cfg = parse_config(EvalConfig, argv, prog="draftsmith evaluate", description=__doc__)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.merge:
        try:
            out = merge_results(cfg.merge)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        write_json_atomic(cfg.out, out)
        console = _console()
        console.print(results_table(out.get("methods", [out]), title="merged results"))
        if (per_category := category_table(out.get("methods", [out]))) is not None:
            console.print(per_category)
        warning = busy_warning(out.get("machine_load"))
        if warning:
            console.print(
                warning, style="bold yellow", markup=False, highlight=False, soft_wrap=True
            )
        print(f"results of {len(cfg.merge)} files written to {cfg.out}")
        return 0
    try:
        device = resolve_device(cfg.device)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.threads and is_cpu(device):  # thread settings are for CPU runs only
        torch.set_num_threads(cfg.threads)
    # The other shards of a --shard run (one process per core by design) are expected load.
    siblings = sibling_load(_parse_shard(cfg.shard)[1], torch.get_num_threads()) if cfg.shard else 0
    sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    info = run_info(device)  # taken at the start: the code, versions and device that ran

    # --- target, drafter, prompts -------------------------------------------------------------
    # Inputs are checked before the (slow) model load, so a typo fails in a second.
    split = {"auto": None if cfg.prompts else "heldout", "all": None}.get(cfg.split, cfg.split)
    try:
        records = load_prompts(cfg.prompts, split=split, limit=cfg.limit)
        places = {str(r.id): i for i, r in enumerate(records)}  # before a --shard takes its part
        if cfg.shard:
            index, count = _parse_shard(cfg.shard)
            records = records[index::count]
        target, tokenizer = load_target(
            cfg.target, cache_dir=cfg.cache_dir, dtype=DTYPES[cfg.dtype], device=device
        )
        # Plain decoding in the other dtype: a speedup must not come from a slow baseline.
        other = "bfloat16" if cfg.dtype == "float32" else "float32"
        reference = None
        if cfg.reference_plain and cfg.baseline:
            reference, _ = load_target(
                cfg.target, cache_dir=cfg.cache_dir, dtype=DTYPES[other], device=device
            )
        options = build_options(cfg, target)
        probe = None
        if any(map(registry.is_auto, cfg.drafter)):
            # What each verify shape costs here: the per-step decision's price list.
            options.verify_costs, probe = probe_verify_costs(target)
            print(_costs_line(probe), flush=True)
        auto_options = replace(options, tree_total_tokens=cfg.auto_nodes or cfg.tree_total_tokens)
        drafters = [
            registry.build(spec, auto_options if registry.is_auto(spec) else options)
            for spec in cfg.drafter
        ]
        prompts = [render_prompt(tokenizer, r) for r in records]
        eos = {tokenizer.eos_token_id, *as_list(target.generation_config.eos_token_id)} - {None}
        decisions = {
            i: _calibrate(cfg, spec, drafters[i], target, tokenizer, sampling, eos)
            for i, spec in enumerate(cfg.drafter)
            if registry.is_auto(spec)
        }
    except (PromptFileError, TargetError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = ["plain" if d is None else d.name for d in drafters]
    # Finished prompts of an earlier, stopped run of the same command (train/decoding/partial.py).
    partial, done = None, {}
    if cfg.out:
        partial = PartialRun(cfg.out, config_to_dict(cfg), names)
        try:
            done = partial.load(cfg.resume)
        except UsageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if done:
            print(
                f"resuming: {len(done)} of {len(records)} prompts already done in "
                f"{partial.path} (--no-resume starts over)"
            )
    common = dict(k=cfg.k, max_new_tokens=cfg.max_new_tokens, sampling=sampling, eos_token_id=eos)
    # One policy per drafter for the whole run: what it learns carries across prompts.
    costs = None
    if cfg.cost_profile is not None:
        try:
            costs = load_cost_profile(
                cfg.cost_profile, cfg.dtype, torch.get_num_threads(), device.type
            )
        except (OSError, ValueError) as exc:
            print(f"error: cost_profile: {exc}", file=sys.stderr)
            return 2
    policies = [
        AdaptiveDraftLength(cfg.k, cost_profile=costs)
        if cfg.adaptive_k and d is not None and not runs_own_loop(d)  # e.g. HF: own schedule
        else None
        for d in drafters
    ]

    # --- loop: the baseline and each drafter, prompt by prompt --------------------------------
    # One short untimed run first: the first forwards of a process pay one-off allocation costs.
    def run(drafter, ids, **kwargs):
        # A reference drafter with its own loop (transformers' generate) runs that; others ours.
        if runs_own_loop(drafter):
            return drafter.generate(target, ids, **{**common, **kwargs})
        if isinstance(drafter, AutoDrafter):  # its own depth: it verifies only what pays
            kwargs = {"k": method_k(drafter), **kwargs}
        return generate(target, ids, drafter, **{**common, **kwargs})

    def method_k(drafter) -> int:
        return cfg.auto_k or cfg.k if isinstance(drafter, AutoDrafter) else cfg.k

    warm = cfg.warmup_prompts
    if warm is None:
        warm = 0 if is_cpu(device) else 2
    # A GPU keeps speeding up over the first full-length decodes (new shapes, allocator growth).
    for ids in prompts[:warm] or prompts[:1]:
        length = {} if warm else {"max_new_tokens": 8}
        for drafter in [None, *drafters] if warm and cfg.baseline else drafters:
            run(drafter, ids, **length)
        if reference is not None:
            generate(reference, ids, None, **{**common, **length})
    load_before = machine_load(sibling_load=siblings)
    stopped_early = False
    base_runs: list = []
    ref_runs: list = []
    spec_runs: list[list] = [[] for _ in drafters]
    new_entries: dict[str, list[dict]] = {}  # record id -> this segment's entries per method
    todo = [(r, ids) for r, ids in zip(records, prompts, strict=True) if str(r.id) not in done]
    from ..train.progress import is_terminal, progress

    # A background run (SIGINT ignored) or a scheduler's SIGTERM stops it like Ctrl-C: the
    # finished prompts stay in the partial file.
    signals = StopSignals(interrupt=True).install()
    # Off a terminal the per-prompt lines below are the progress (with each prompt's speed).
    bar = progress(
        total=len(prompts),
        initial=len(prompts) - len(todo),
        desc="evaluating",
        unit="prompt",
        disable=not is_terminal(),
    )
    start = time.perf_counter()
    try:
        for record, ids in todo:
            # Each segment measures at least one prompt, so reruns always make progress.
            elapsed = time.perf_counter() - start
            if cfg.max_minutes and new_entries and elapsed > 60 * cfg.max_minutes:
                stopped_early = True
                break
            # Same seed for every run of a prompt: sampled outputs are comparable run to run.
            # Interleaved per prompt, so a machine slowing down hurts every method alike. The
            # generator lives on the device whose tensors it samples (reproducible per device).
            # Which runs first alternates prompt by prompt (by the prompt's place in the file,
            # so a resumed or sharded run keeps the order): plain decoding first on even
            # places, the drafters first on odd ones. A method that always ran second would
            # inherit warm caches (or a machine's slow spell) the first one paid for.
            base, specs = None, []
            plain_first = places[str(record.id)] % 2 == 0
            for phase in ("plain", "drafters") if plain_first else ("drafters", "plain"):
                if phase == "plain" and cfg.baseline:
                    base = run(None, ids, generator=make_generator(device, cfg.seed))
                    base_runs.append(base)
                    if reference is not None:
                        gen = make_generator(device, cfg.seed)
                        ref_runs.append(generate(reference, ids, None, **common, generator=gen))
                elif phase == "drafters":
                    for drafter, policy in zip(drafters, policies, strict=True):
                        gen = make_generator(device, cfg.seed)
                        specs.append(
                            None
                            if drafter is None
                            else run(drafter, ids, generator=gen, draft_length=policy)
                        )
            entries = []
            for i, spec in enumerate(specs):
                spec = base if spec is None else spec  # drafter none: plain decoding itself
                spec_runs[i].append(spec)
                entry = prompt_entry(record, ids, spec, base, tokenizer)
                if ref_runs:
                    ref = ref_runs[-1]
                    entry["reference_counters"] = {**counters(ref), "new_tokens": len(ref.tokens)}
                if entry.get("identical_to_target") is False and sampling.greedy:
                    entry["divergence"] = divergence(target, ids, base.tokens, spec.tokens)
                entries.append(entry)
            new_entries[str(record.id)] = entries
            if partial is not None:
                partial.add(str(record.id), entries)
            bar.update(1)
            if not sys.stderr.isatty():  # logs of background runs still show how it goes
                finished = len(done) + len(new_entries)
                line = f"[{finished}/{len(prompts)}] prompt {record.id}:"
                if base is not None:
                    line += f" plain {len(base.tokens) / base.wall_time:.1f} tok/s"
                for name, runs in zip(names, spec_runs, strict=True):
                    run_ = runs[-1]
                    line += (
                        f" | {name} τ {run_.acceptance_length:.2f}"
                        f" {len(run_.tokens) / run_.wall_time:.1f} tok/s"
                    )
                print(line, file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        bar.close()
        if partial is None:
            print("\ninterrupted (no --out: nothing kept)", file=sys.stderr)
            return 130
        partial.stop(
            len(new_entries), load_record(load_before, machine_load(sibling_load=siblings))
        )
        print(
            f"\ninterrupted: {len(done) + len(new_entries)} of {len(records)} prompts done and "
            f"kept in {partial.path}; the same command continues",
            file=sys.stderr,
        )
        return 130
    finally:
        bar.close()
        signals.restore()

    # --- results ------------------------------------------------------------------------------
    # Every figure from the per-prompt entries (this segment's and any earlier one's), in the
    # prompt file's order, exactly as `--merge` recomputes shards.
    finished = [done.get(str(r.id)) or new_entries.get(str(r.id)) for r in records]
    finished = [e for e in finished if e is not None]
    load = load_record(load_before, machine_load(sibling_load=siblings))
    if partial is not None and partial.segments:  # earlier segments ran under their own load
        segments = [s["machine_load"] for s in partial.segments] + [load]
        load = {"segments": segments, "busy": any(s.get("busy") for s in segments)}
    results = []
    for i, name in enumerate(names):
        per_prompt = [entries[i] for entries in finished]
        k = cfg.k if drafters[i] is None else method_k(drafters[i])
        result = {"method": name, "k": k, "temperature": cfg.temperature}
        result["adaptive_k"] = cfg.adaptive_k
        if policies[i] is not None:
            chosen = policies[i].chosen  # this segment's choices (a resumed policy starts anew)
            result["mean_draft_length"] = sum(chosen) / max(len(chosen), 1)
        result["dtype"] = cfg.dtype
        result["draft_dtype"] = cfg.dtype if cfg.draft_dtype == "same" else cfg.draft_dtype
        training = drafter_training(registry.parse_spec(cfg.drafter[i])[1])
        if training:
            result["drafter_training"] = training
        result.update(summarize_entries(per_prompt, k, cfg.dtype, other if reference else None))
        # Sampled outputs are compared in distribution, not per sample.
        result.update(identity(per_prompt, compared=cfg.baseline and sampling.greedy))
        if i in decisions:  # what the per-step decision did (this segment's steps)
            result["decision"] = {**decisions[i], "stats": dict(drafters[i].stats)}
        result["per_prompt"] = per_prompt
        results.append(result)
    annotate(results)
    # One drafter: its result is the file (the historic layout). Several: one entry each under
    # "methods", sharing the baseline measured in the same run.
    out = dict(results[0]) if len(results) == 1 else {"methods": results}
    out["config"] = config_to_dict(cfg)
    out["prompts_evaluated"] = len(finished)
    out["prompts_selected"] = len(records)
    if done:
        out["resumed_prompts"] = len(done)
    out["machine_load"] = load
    if probe is not None:
        out["verify_costs"] = probe
    if stopped_early:
        print(
            f"max_minutes={cfg.max_minutes} reached: {out['prompts_evaluated']} of "
            f"{len(records)} prompts evaluated; the same command continues the run"
        )
        if partial is not None:
            partial.stop(
                len(new_entries), load_record(load_before, machine_load(sibling_load=siblings))
            )
    out.update(info)

    console = _console()
    console.print(results_table(results, title=f"target: {cfg.target or 'SmolLM2-135M-Instruct'}"))
    if (per_category := category_table(results)) is not None:
        console.print(per_category)
    warning = busy_warning(out["machine_load"])
    if warning:
        console.print(warning, style="bold yellow", markup=False, highlight=False, soft_wrap=True)
    if cfg.out:
        write_json_atomic(cfg.out, out)
        print(f"results written to {cfg.out}")
        if partial is not None and not stopped_early:
            partial.finish()
    if cfg.report_to == "wandb":
        for result in results:
            busy = out["machine_load"]["busy"]
            _log_wandb(cfg, {**result, "config": out["config"], "machine_busy": busy})
    code = 0
    for result in results:
        if result["identical_to_target"] is False:
            ties = result["near_ties"]
            bad = [d["id"] for d in ties if not d["near_tie"]]
            if cfg.dtype == "float32" or bad:
                print(
                    f"error: {result['method']}: speculative output differs from plain greedy "
                    f"for prompts {bad or [d['id'] for d in ties]}",
                    file=sys.stderr,
                )
                code = 1
            else:
                gaps = ", ".join(f"{d['id']}: {d['logit_gap']:.3f}" for d in ties)
                print(
                    f"{result['method']}: {len(ties)} of {result['num_prompts']} outputs differ "
                    f"from plain {cfg.dtype} decoding, each at a near-tie (top-2 logit gap at "
                    f"the first differing token: {gaps})"
                )
    return code


def _costs_line(probe: dict) -> str:
    """One line on the verify costs the per-step decision will use."""
    med = probe["median_ms"]
    chain = " ".join(f"{w}:{ms:.0f}" for w, ms in med["chain"].items())
    tree = " ".join(f"{n}:{ms:.0f}" for n, ms in med["tree"].items())
    return f"verify costs, ms by chain width: {chain}; by tree nodes: {tree}"


def _calibrate(cfg: EvalConfig, spec: str, auto, target, tokenizer, sampling, eos) -> dict:
    """Load or fit an ``auto:KIND[=DIR]`` drafter's calibration (train/decoding/calibration.py)
    and set it on the drafter; returns what the results record of it."""
    path = registry.parse_spec(spec)[1]
    stored = None
    if path and not cfg.recalibrate:
        stored = calibration.load(path, sampling)
    if stored is not None:
        auto.calibration, report = stored
        print(f"{auto.name}: calibration from {Path(path) / calibration.FILE}")
        return {"calibration": {"file": str(Path(path) / calibration.FILE), **report}}
    split = None if cfg.calibration_prompts else "train"
    records = load_prompts(cfg.calibration_prompts, split=split, limit=cfg.calibration_limit)
    prompts = [render_prompt(tokenizer, r) for r in records]
    started = time.perf_counter()
    print(f"{auto.name}: calibrating on {len(prompts)} prompts", flush=True)
    per_prompt = calibration.record_prompts(
        target,
        auto.learned,
        auto.lookups,
        prompts,
        costs=auto.costs,
        k=cfg.auto_k or cfg.k,
        max_new_tokens=cfg.max_new_tokens,
        sampling=sampling,
        eos_token_id=eos,
        seed=cfg.seed,
    )
    auto.calibration, report = calibration.calibrate(per_prompt, sampling_key(sampling))
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["prompt_file"] = str(cfg.calibration_prompts or "shipped prompts, train split")
    record = {"calibration": report}
    if path:
        try:
            record["calibration"]["file"] = str(
                calibration.save(path, sampling, auto.calibration, report)
            )
        except OSError as exc:  # a read-only checkpoint: the fit still serves this run
            print(f"warning: calibration not saved beside {path}: {exc}", file=sys.stderr)
    raw, fitted = report["heldout_ece_raw"], report["heldout_ece_calibrated"]
    print(
        f"{auto.name}: calibrated on {report['learned_nodes']} learned and "
        f"{report['lookup_nodes']} lookup nodes in {report['seconds']} s (held-out ECE "
        f"{_fmt(raw)} raw, {_fmt(fitted)} calibrated)",
        flush=True,
    )
    return record


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _parse_shard(text: str) -> tuple[int, int] | None:
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit():
        return None
    index, count = int(index), int(count)
    return (index, count) if 0 <= index < count else None


def _console():
    """A console wide enough for the results table even when stdout is not a terminal."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=150)


def _log_wandb(cfg: EvalConfig, result: dict) -> None:
    """Log the summary metrics, α per position and per-prompt τ to W&B.

    Scalars go to the summary and as ``eval/<name>`` (τ is ``eval/acceptance_length``); α per
    position also as scalars ``eval/alpha_<i>`` (1-based) beside its bar chart; the printed
    results table's row as the table ``eval/results``; ``machine_busy`` says whether the
    machine was busy (docs/metrics.md).
    """
    import wandb

    mode = wandb_mode()
    if mode == "offline":
        print("W&B: no API key configured, logging offline (sync later with `wandb sync`)")
    run = wandb.init(
        mode=mode,
        project=cfg.wandb_project,
        job_type="evaluate",
        config=result["config"],
        name=f"eval-{result['method']}-k{cfg.k}-{int(time.time())}",
    )
    scalars = {k: v for k, v in result.items() if isinstance(v, (int, float)) and k != "k"}
    alphas = result["acceptance_rate_per_position"]
    scalars.update({f"alpha_{i + 1}": a for i, a in enumerate(alphas)})
    run.summary.update(scalars)
    columns = ["method", "k", "prompts", "new_tokens", "tau", "alpha_per_position"]
    columns += ["tokens_per_second", "baseline_tokens_per_second", "speedup", "identical"]
    row = [result["method"], result["k"], result["num_prompts"], result["new_tokens"]]
    row += [result["acceptance_length"], " ".join(f"{a:.3f}" for a in alphas)]
    row += [result.get(key) for key in columns[6:9]]
    row.append(result.get("identical_to_target"))
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
            "eval/results": wandb.Table(columns=columns, data=[row]),
        }
    )
    run.finish()


if __name__ == "__main__":
    sys.exit(main())
