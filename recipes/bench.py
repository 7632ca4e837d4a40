r"""``draftsmith bench``: every drafter on one prompt set, one interleaved plain baseline, a report.

Launch::

    draftsmith bench --drafter ngram eagle=runs/eagle3_smollm2/best \
        eagle-tree=runs/eagle3_smollm2/best hf-prompt-lookup --k 3 --out results/bench/smollm2
    draftsmith bench --drafter ngram draft-lm --draft-layers 0 10 20 29 --temperatures 0 0.7 \
        --prompts my_prompts.jsonl --split heldout --limit 200 --shard 0/2 \
        --out results/bench/s0          # one process per core, then:
    draftsmith bench --merge results/bench/s0.json results/bench/s1.json \
        --out results/bench/smollm2 --training-logs runs/eagle3_smollm2

With a vLLM venv (``--vllm-python``) or running servers (``--vllm-url``), each chain drafter is
also exported, served and measured at 1, 4 and 16 requests in flight
(``draftsmith.train.report.served``). A stopped bench (Ctrl-C, ``--max-minutes``, a kill)
continues when the same command runs again: finished temperatures are kept and evaluate
resumes after its last finished prompt.

A thin layer over ``draftsmith evaluate`` (called through the CLI dispatch, which the CLI hands in,
as the quickstart's stages are): one evaluate run per temperature (greedy, then sampled at 0.7 by
default) with every ``--drafter`` given, so all drafters share one plain-decoding baseline measured
prompt by prompt between them, all on one ``--device`` (checked once, before the first run, and
passed to every evaluate run; ``OUT.json`` records it). Flags the bench does not know are passed to
evaluate as they are (``--target``, ``--prompts``, ``--split``, ``--limit``, ``--draft-dtype``,
``--max-new-tokens``, ``--seed``, ``--draft-layers``, ``--tree-total-tokens``, ``--report-to
wandb``, ...).

Outputs, for ``--out OUT``:

* ``OUT.t<T>.json`` -- evaluate's own results per temperature (every prompt; what ``--merge``
  merges);
* ``OUT.json`` -- those results without the per-prompt entries, plus the bench's: command,
  versions, machine, seed, machine load, the recommendation per chain drafter, the tree
  results, the training curves;
* ``OUT.md`` -- the tables (τ, α per position, tok/s, speedup, vs fastest plain, draft share,
  identical / near-ties), the recommendation and the plots;
* ``OUT_plots/`` -- ``alpha_by_position.png``, ``speedup_vs_k.png`` and, with
  ``--training-logs``, ``tau_vs_training.png``.

**Recommendation** (``draftsmith.train.report.recommend``): for each chain drafter (ours:
n-gram, draft LM, EAGLE, Medusa, and any kind added later whose name does not end in ``-tree``),
the speedup predicted at k = 1..``max_k`` from its measured α, its measured drafting seconds per
drafted token and the verify cost per width of ``scripts/bench_forward.py``'s profile
(``--cost-profile``, default ``bench/cpu_costs/forward_cost.json``). α beyond the measured k is
extrapolated (the last conditional acceptance rate held constant) and flagged as such. Trees and
HF's loops are reported as measured. The report itself (JSON, markdown, plots) is built by
``draftsmith.train.report.bench`` and ``draftsmith.train.report.plots``.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: resolve the imports below (PEP 366)
    __package__ = "draftsmith.recipes"

import argparse
import gc
import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..heads.registry import kinds_help
from ..train.config import (
    ConfigError,
    HelpFormatter,
    add_config_arguments,
    cfg_field,
    config_from_args,
    config_to_dict,
)
from ..train.device import DEVICE_HELP, device_facts, device_problem, resolve_device
from ..train.errors import UsageError, cli_main
from ..train.report.bench import (
    RESULT_COLUMNS,
    build_report,
    busy_warnings,
    differs_from_plain,
    read_training_log,
    recommendation_text,
    results_rows,
    write_outputs,
)
from ..train.report.recommend import default_cost_profile, load_costs
from ..train.report.served import serve, served_lines
from ..train.report.text import console, fmt_number
from ..train.runinfo import load_record, machine_load, run_info, sibling_load

__all__ = ["BenchConfig", "main", "parse", "run"]

#: evaluate flags the bench sets itself; passing them through would contradict the bench's own.
_OWN_FLAGS = {
    "--temperature": "--temperatures",
    "--out": "--out",
    "--merge": "--merge",
    "--shard": "--shard",
    "--drafter": "--drafter",
    "--k": "--k",
    "--dtype": "--dtype",
    "--threads": "--threads",
    "--device": "--device",
    "--config": "the bench's own flags (evaluate's YAML cannot be passed through)",
    "--no-baseline": "nothing: the bench needs the plain baseline for every speedup",
}


@dataclass
class BenchConfig:
    """Settings of ``draftsmith bench`` (any other flag goes to ``draftsmith evaluate``)."""

    drafter: list[str] = cfg_field(
        ["ngram"],
        help="drafters, each KIND or KIND=PATH as `draftsmith evaluate --drafter` takes them: "
        + kinds_help(),
    )
    k: int = cfg_field(5, help="draft tokens per verification step of the measured run", ge=1)
    temperatures: list[float] = cfg_field(
        [0.0, 0.7],
        help="one evaluate run per temperature: 0 = greedy (checked token for token), > 0 "
        "sampled (τ and α reported; lossless in distribution)",
        ge=0,
    )
    sampled_limit: int | None = cfg_field(
        None,
        help="sampled temperatures (> 0) evaluate only the first N prompts (of --limit's, each "
        "shard its share): greedy carries the speed figures and the token-for-token check; a "
        "sampled run's τ and lossless check need fewer prompts. None: all, as greedy",
        ge=1,
    )
    dtype: str = cfg_field(
        "float32",
        help="target dtype (evaluate's --dtype); also selects the cost profile's entry",
        choices=["float32", "bfloat16"],
    )
    threads: int | None = cfg_field(
        None, help="torch CPU threads (evaluate's --threads; the cost profile's entry)", ge=1
    )
    device: str = cfg_field(
        "auto", help=DEVICE_HELP + "; every evaluate run of the bench runs there"
    )
    shard: str | None = cfg_field(
        None,
        help="I/N: evaluate every N-th prompt from I (one process per core); then "
        "`draftsmith bench --merge A.json B.json --out C`",
    )
    merge: list[Path] | None = cfg_field(
        None, help="merge these bench JSONs (shards of one bench) into --out; runs nothing"
    )
    out: Path = cfg_field(
        Path("results/bench/bench"),
        help="output stem: OUT.json, OUT.md, OUT_plots/*.png, OUT.t<T>.json (evaluate's)",
    )
    cost_profile: Path | None = cfg_field(
        None,
        help="verify cost per width, as scripts/bench_forward.py writes it; None: "
        "bench/cpu_costs/forward_cost.json",
    )
    max_k: int = cfg_field(
        8,
        help="recommend a chain length among k = 1..max_k (α past the run's k extrapolated)",
        ge=1,
    )
    training_logs: list[Path] | None = cfg_field(
        None,
        help="training output dirs (or their training_metrics.json): plot validation simulated "
        "τ against training minutes",
    )
    vllm_python: Path | None = cfg_field(
        None,
        help="python of a separate vLLM venv (docs/serving.md): export each chain drafter, "
        "serve it and the plain target there, and report vLLM's τ, tokens/s and latency at "
        "each served_concurrency next to ours",
    )
    vllm_url: list[str] | None = cfg_field(
        None,
        help="[LABEL=]URL of running OpenAI-compatible vLLM servers of the same target to "
        "measure instead; LABEL plain (the baseline) or one of --drafter's specs (compared "
        "with our τ)",
    )
    served_concurrency: list[int] = cfg_field(
        [1, 4, 16], help="requests in flight at once, one served measurement each", ge=1
    )
    served_limit: int = cfg_field(
        16,
        help="serve the first N prompts of the bench (a level of c requests needs >= c)",
        ge=1,
    )
    served_schedule: bool = cfg_field(
        True,
        help="also serve each drafter with the recommended num_speculative_tokens_per_batch_size "
        "schedule and measure it at every load",
    )
    evaluate_args: list[str] = cfg_field(
        [],
        help="more `draftsmith evaluate` flags (for YAML configs; on the command line just give "
        "them: flags the bench does not know are added here)",
    )

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        problem = device_problem(self.device)
        if problem:
            problems.append(("device", problem))
        if not self.temperatures:
            problems.append(("temperatures", "give at least one (0 = greedy)"))
        elif len(set(self.temperatures)) != len(self.temperatures):
            problems.append(("temperatures", f"listed twice: {self.temperatures}"))
        if not self.drafter:
            problems.append(("drafter", "name at least one drafter"))
        elif "none" in self.drafter:
            problems.append(("drafter", "none measures no drafter; name the drafters to bench"))
        if self.merge is not None and self.shard is not None:
            problems.append(("merge", "merge combines finished shards; do not give shard too"))
        if self.vllm_python is not None and self.vllm_url:
            problems.append(("vllm_url", "give vllm_python (servers started) or vllm_url"))
        if self.shard is not None and (self.vllm_python is not None or self.vllm_url):
            problems.append(
                (
                    "vllm_python",
                    "serve once, after merging: draftsmith bench --merge ... --vllm-python PY",
                )
            )
        if self.vllm_python is not None and not Path(self.vllm_python).exists():
            problems.append(
                (
                    "vllm_python",
                    f"{self.vllm_python} not found (scripts/setup_vllm_venv.sh makes one)",
                )
            )
        for arg in self.evaluate_args:
            flag = arg.split("=", 1)[0]
            if flag in _OWN_FLAGS:
                problems.append(
                    ("evaluate_args", f"{flag} is set by the bench; use {_OWN_FLAGS[flag]}")
                )
        return problems


# --------------------------------------------------------------------------------------------
# The runs: one evaluate per temperature (or evaluate --merge of finished shards)
# --------------------------------------------------------------------------------------------


def _stem(out: Path) -> Path:
    """``--out`` without a ``.json``/``.md`` suffix the user may have typed."""
    return out.with_suffix("") if out.suffix in (".json", ".md") else out


def _raw_path(stem: Path, temperature: float) -> Path:
    return stem.with_name(f"{stem.name}.t{temperature:g}.json")


def _evaluate_argv(cfg: BenchConfig, temperature: float, out: Path) -> list[str]:
    argv = ["evaluate", "--drafter", *cfg.drafter, "--k", str(cfg.k), "--dtype", cfg.dtype]
    if cfg.device != "auto":  # auto is evaluate's own default: the command lines stay as before
        argv += ["--device", cfg.device]
    if cfg.threads:
        argv += ["--threads", str(cfg.threads)]
    if cfg.shard:
        argv += ["--shard", cfg.shard]
    argv += [*cfg.evaluate_args, "--temperature", f"{temperature:g}", "--out", str(out)]
    if temperature > 0 and cfg.sampled_limit is not None:
        # After evaluate_args: the last --limit is the one evaluate takes.
        limit = _given_limit(cfg.evaluate_args)
        argv += ["--limit", str(min(cfg.sampled_limit, limit or cfg.sampled_limit))]
    return argv


def _given_limit(args: list[str]) -> int | None:
    """The last ``--limit N`` / ``--limit=N`` among evaluate's flags (None: every prompt)."""
    limit = None
    for i, arg in enumerate(args):
        if arg == "--limit" and i + 1 < len(args):
            limit = args[i + 1]
        elif arg.startswith("--limit="):
            limit = arg.split("=", 1)[1]
    try:
        return int(limit) if limit is not None else None
    except ValueError:
        return None  # evaluate names the bad value itself


def _finished(raw: Path, argv: list[str]) -> bool:
    """Whether ``raw`` holds a complete evaluate run of exactly these settings (a rerun of a
    stopped bench keeps it instead of measuring it again)."""
    from ..train.config import parse_config
    from ..train.decoding.partial import RESULT_IRRELEVANT, partial_path
    from .evaluate import EvalConfig

    if not raw.is_file() or partial_path(raw).exists():
        return False
    try:
        done = json.loads(raw.read_text())
        wanted = config_to_dict(parse_config(EvalConfig, argv[1:]))
    except (OSError, ValueError, ConfigError):
        return False
    if "--no-resume" in argv or done.get("prompts_evaluated") != done.get("prompts_selected"):
        return False
    saved = done.get("config") or {}
    relevant = (wanted.keys() | saved.keys()) - RESULT_IRRELEVANT
    same = [
        json.dumps(saved.get(k), default=str) == json.dumps(wanted.get(k), default=str)
        for k in relevant
    ]
    return all(same)


def _call(call: Callable[[list[str]], int], argv: list[str]) -> int:
    """``draftsmith ARGV`` in this process, through ``call`` (the CLI's dispatch, as the
    quickstart's stages)."""
    print(f"[bench] $ {shlex.join(['draftsmith', *argv])}", flush=True)
    try:
        return call(argv)
    finally:
        gc.collect()  # each evaluate run loads its own target: free the last one first


def run(cfg: BenchConfig, call: Callable[[list[str]], int]) -> int:
    """Run (or merge) the bench and write its outputs; the exit code of the worst run.

    Args:
        cfg: the bench's settings.
        call: runs ``draftsmith ARGV`` in this process and returns its exit code (the CLI's
            dispatch, handed in by ``draftsmith bench``); every evaluate run goes through it.
    """
    # A GPU that is not there fails now, in one line, before any evaluate run; a merge runs
    # nothing (each shard's JSON records its own device).
    device = None if cfg.merge else resolve_device(cfg.device)
    info = run_info(device)  # at the start: the code, versions and device that ran
    # The other shards of a --shard run (one process per core by design) are expected load.
    siblings = 0.0
    shards = (cfg.shard or "").partition("/")[2]
    if shards.isdigit():  # a malformed --shard is named by evaluate's own check
        import torch

        siblings = sibling_load(int(shards), cfg.threads or torch.get_num_threads())
    load_before = machine_load(sibling_load=siblings)
    stem = _stem(cfg.out)
    profile = cfg.cost_profile or default_cost_profile()
    # Every input is checked before the first (long) evaluate run.
    training = [read_training_log(p) for p in cfg.training_logs or []]
    code = 0
    if cfg.merge:
        runs, merged_from = _merge(cfg, stem, call), [str(p) for p in cfg.merge]
    else:
        import torch

        # A profile measured on another kind of device says nothing about this one: refused now.
        load_costs(profile, cfg.dtype, cfg.threads or torch.get_num_threads(), device.type)
        runs, merged_from = [], None
        for t in cfg.temperatures:
            raw = _raw_path(stem, t)
            argv = _evaluate_argv(cfg, t, raw)
            if _finished(raw, argv):
                print(f"[bench] temperature {t:g} already measured: {raw} (kept)", flush=True)
                runs.append((t, raw, shlex.join(["draftsmith", *argv])))
                continue
            rc = _call(call, argv)
            if rc == 130:
                print(
                    "bench interrupted; the finished prompts are kept: the same command continues",
                    file=sys.stderr,
                )
                return 130
            if rc == 2 or not raw.is_file():
                print(
                    f"error: bench: evaluate at temperature {t:g} failed (exit {rc}; its error "
                    "is above)",
                    file=sys.stderr,
                )
                return rc or 1
            code = max(code, rc)  # 1: an output differed from plain greedy (reported, kept)
            done = json.loads(raw.read_text())
            if done["prompts_evaluated"] < done["prompts_selected"]:  # evaluate's max_minutes
                print(
                    f"bench stopped at temperature {t:g} after {done['prompts_evaluated']} of "
                    f"{done['prompts_selected']} prompts (max_minutes): the same command "
                    "continues (finished temperatures and prompts are kept)"
                )
                return 3
            runs.append((t, raw, shlex.join(["draftsmith", *argv])))
    report = build_report(runs, stem, profile, cfg.max_k, training)
    report["bench"].update(shard=cfg.shard, merged_from=merged_from)
    report["config"] = config_to_dict(cfg)
    if cfg.merge:
        # A merge times nothing: the load that matters is each shard's own (measured with its
        # siblings allowed for). Measured now it would be the just-finished shards' load.
        loads = [json.loads(Path(p).read_text()).get("machine_load") for p in cfg.merge]
        loads = [ld for ld in loads if ld]
        report["machine_load"] = {"shards": loads, "busy": any(ld.get("busy") for ld in loads)}
    else:
        report["machine_load"] = load_record(load_before, machine_load(sibling_load=siblings))
    report.update(info)
    if device is not None:
        report["device"] = device_facts(device)
    outputs = write_outputs(report, stem)
    if cfg.vllm_python is not None or cfg.vllm_url:
        # Our figures are on disk first: a serving failure loses none of them.
        report["served"] = serve(cfg, report, runs, stem)
        outputs = write_outputs(report, stem)
    _print_summary(report, outputs)
    if cfg.shard:
        print(
            f"shard {cfg.shard} done; when every shard is: draftsmith bench --merge "
            f"<each shard's .json> --out OUT"
        )
    return code if not cfg.merge else int(differs_from_plain(report))


def _merge(
    cfg: BenchConfig, stem: Path, call: Callable[[list[str]], int]
) -> list[tuple[float, Path, str]]:
    """Merge each temperature's evaluate results of the shard benches with evaluate --merge."""
    shards = []
    for path in cfg.merge or []:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise UsageError(f"merge: {path} not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"merge: {path} is not JSON ({exc})") from None
        if not isinstance(data, dict) or "bench" not in data:
            raise UsageError(f"merge: {path} is not a bench JSON (written by draftsmith bench)")
        shards.append((Path(path), data))
    temps = [r["temperature"] for r in shards[0][1]["runs"]]
    for path, data in shards[1:]:
        if [r["temperature"] for r in data["runs"]] != temps:
            raise UsageError(f"merge: {path} ran temperatures other than {shards[0][0]}'s {temps}")
    runs = []
    for i, t in enumerate(temps):
        # Raw files are named relative to their bench JSON, so shard folders can be moved.
        raws = [path.parent / data["runs"][i]["results_file"] for path, data in shards]
        missing = [str(r) for r in raws if not r.is_file()]
        if missing:
            raise UsageError(f"merge: evaluate results {', '.join(missing)} not found")
        out = _raw_path(stem, t)
        argv = ["evaluate", "--merge", *map(str, raws), "--out", str(out)]
        rc = _call(call, argv)
        if rc:
            raise UsageError(f"merge: evaluate --merge at temperature {t:g} failed (exit {rc})")
        runs.append((t, out, shlex.join(["draftsmith", *argv])))
    return runs


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


def _print_summary(report: dict[str, Any], outputs: dict[str, Any]) -> None:
    """The results table, the recommendations, the trees and where the outputs are."""
    from rich.markup import escape
    from rich.table import Table

    out = console(width=160)
    table = Table(title="draftsmith bench")
    for col in RESULT_COLUMNS:
        table.add_column(col, justify="left" if col in ("method", "α per position") else "right")
    for row in results_rows(report):
        table.add_row(*map(escape, row))
    out.print(table)
    for text in busy_warnings(report):
        out.print(text, style="bold yellow", markup=False, highlight=False, soft_wrap=True)
    for rec in report["recommendations"]:
        print("recommend: " + recommendation_text(rec))
    for tree in report["trees"]:
        shape = f"{tree['tree_total_tokens']} nodes" if tree["drafts"] == "tree" else tree["drafts"]
        tau, speedup = tree["acceptance_length"], tree["speedup"]
        print(
            f"tree: {tree['method']} (T={tree['temperature']:g}, {shape}): "
            f"τ {fmt_number(tau)}, measured {fmt_number(speedup, '.2f', 'x')}"
        )
    for line in served_lines(report.get("served")):
        print(line)
    print(f"bench results: {outputs['json']}")
    print(f"report: {outputs['markdown']}")
    for path in outputs["plots"]:
        print(f"plot: {path}")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


_EPILOG = """\
Any other flag is passed to `draftsmith evaluate` as it is: --target, --prompts, --split, --limit,
--draft-dtype, --max-new-tokens, --seed, --top-p, --draft-layers, --draft-model, --tree-topk,
--tree-total-tokens, --ngram-max, --max-minutes, --no-reference-plain, --report-to wandb, ...

examples:
  draftsmith bench --drafter ngram eagle=runs/eagle3_smollm2/best hf-prompt-lookup --k 3
  draftsmith bench ... --shard 0/2 --out results/bench/s0 &   # one process per core
  draftsmith bench ... --shard 1/2 --out results/bench/s1
  draftsmith bench --merge results/bench/s0.json results/bench/s1.json --out results/bench/all
  draftsmith bench --merge ... --out results/bench/all --vllm-python ~/.cache/draftsmith/vllm-venv/bin/python

docs/bench.md describes the outputs and how to read the plots."""


def parse(argv: list[str]) -> BenchConfig:
    """The bench's config from its command line; unknown flags go to ``evaluate_args``."""
    parser = argparse.ArgumentParser(
        prog="draftsmith bench",
        description="Every drafter on one prompt set against one interleaved plain baseline, "
        "greedy and sampled: tables, plots and the recommended draft length; with a vLLM venv "
        "(--vllm-python) or servers (--vllm-url), vLLM's τ, tokens/s and latency under load "
        "too. A stopped bench continues when the same command runs again.",
        epilog=_EPILOG,
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # an evaluate flag must never be taken for a prefix of the bench's
    )
    add_config_arguments(parser, BenchConfig)
    args, rest = parser.parse_known_args(argv)
    cfg = config_from_args(BenchConfig, args)
    if rest:
        # Added after loading, so a YAML's evaluate_args are kept; checked like the rest.
        cfg.evaluate_args = [*cfg.evaluate_args, *rest]
        problems = cfg.validate()
        if problems:
            raise ConfigError(problems)
    return cfg


def main(argv: list[str] | None = None, *, call: Callable[[list[str]], int] | None = None) -> int:
    """CLI entry: 0 done, 1 a greedy output differed from plain decoding, 2 bad input, 3 stopped
    by ``--max-minutes`` before the end (rerun to continue), 130 interrupted.

    Args:
        argv: the flags after ``draftsmith bench`` (default: ``sys.argv[1:]``).
        call: runs ``draftsmith ARGV`` in this process and returns its exit code: the CLI's
            dispatch, which ``draftsmith bench`` hands in (this recipe never imports the CLI).
            Without it the bench cannot run evaluate: after the flags are checked, a usage
            error names ``draftsmith bench``.
    """
    return cli_main(lambda args: run(parse(args), _handed(call)), argv)


def _handed(call: Callable[[list[str]], int] | None) -> Callable[[list[str]], int]:
    """The dispatch :func:`main` was handed, or a usage error when it was handed none."""
    if call is None:
        raise UsageError(
            "the bench runs evaluate as a draftsmith command: start it as `draftsmith bench ...`"
        )
    return call


if __name__ == "__main__":
    sys.exit(main())
