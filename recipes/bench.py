"""``draftsmith bench``: every drafter on one prompt set, one interleaved plain baseline, a report.

Launch::

    draftsmith bench --drafter ngram eagle=runs/eagle3_smollm2/best \
        eagle-tree=runs/eagle3_smollm2/best hf-prompt-lookup --k 3 --out results/bench/smollm2
    draftsmith bench --drafter ngram draft-lm --draft-layers 0 10 20 29 --temperatures 0 0.7 \
        --prompts ../shared/data/alpaca_2k.jsonl --split heldout --limit 200 --shard 0/2 \
        --out results/bench/s0          # one process per core, then:
    draftsmith bench --merge results/bench/s0.json results/bench/s1.json \
        --out results/bench/smollm2 --training-logs runs/eagle3_smollm2

A thin layer over ``draftsmith evaluate`` (called through the CLI dispatch, as the quickstart
does): one evaluate run per temperature (greedy, then sampled at 0.7 by default) with every
``--drafter`` given, so all drafters share one plain-decoding baseline measured prompt by prompt
between them. Flags the bench does not know are passed to evaluate as they are (``--target``,
``--prompts``, ``--split``, ``--limit``, ``--draft-dtype``, ``--max-new-tokens``, ``--seed``,
``--draft-layers``, ``--tree-total-tokens``, ``--report-to wandb``, ...).

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

**Recommendation** (:func:`recommend`): for each chain drafter (ours: n-gram, draft LM, EAGLE,
Medusa, and any kind added later whose name does not end in ``-tree``), the speedup predicted at
k = 1..``max_k`` by :func:`~draftsmith.train.decoding.draft_length.predicted_speedups` from its measured
α, its measured drafting seconds per drafted token and the verify cost per width of
``scripts/bench_forward.py``'s profile (``--cost-profile``, default ``bench/forward_cost.json``).
α beyond the measured k is extrapolated (the last conditional acceptance rate held constant) and
flagged as such. Trees and HF's loops are reported as measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.train.config import (
    ConfigError,
    add_config_arguments,
    cfg_field,
    config_from_args,
    config_to_dict,
)
from draftsmith.train.decoding.draft_length import load_cost_profile, predicted_speedups
from draftsmith.train.decoding.metrics import identical_text
from draftsmith.train.errors import UsageError, cli_main
from draftsmith.train.runinfo import run_info, write_json_atomic

__all__ = [
    "BenchConfig",
    "default_cost_profile",
    "extend_alpha",
    "main",
    "read_training_log",
    "recommend",
]

#: Where the verify-cost profile is looked for when ``--cost-profile`` is not given: the working
#: directory first (a checkout), then the checkout this package is installed from (editable).
DEFAULT_COST_PROFILES = (
    Path("bench/forward_cost.json"),
    Path(__file__).resolve().parents[1] / "bench" / "forward_cost.json",
)

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
    "--config": "the bench's own flags (evaluate's YAML cannot be passed through)",
    "--no-baseline": "nothing: the bench needs the plain baseline for every speedup",
}

PLOTS = ("alpha_by_position.png", "speedup_vs_k.png", "tau_vs_training.png")


@dataclass
class BenchConfig:
    """Settings of ``draftsmith bench`` (any other flag goes to ``draftsmith evaluate``)."""

    drafter: list[str] = cfg_field(
        ["ngram"],
        help="drafters, each KIND or KIND=PATH as `draftsmith evaluate --drafter` takes them: "
        "ngram, draft-lm[=DIR], eagle=DIR, eagle-tree=DIR, medusa=DIR, medusa-tree=DIR, and the "
        "references hf-prompt-lookup, hf-assisted[=DIR] (transformers' own loops)",
    )
    k: int = cfg_field(5, help="draft tokens per verification step of the measured run", ge=1)
    temperatures: list[float] = cfg_field(
        [0.0, 0.7],
        help="one evaluate run per temperature: 0 = greedy (checked token for token), > 0 "
        "sampled (τ and α reported; lossless in distribution)",
        ge=0,
    )
    dtype: str = cfg_field(
        "float32",
        help="target dtype (evaluate's --dtype); also selects the cost profile's entry",
        choices=["float32", "bfloat16"],
    )
    threads: int | None = cfg_field(
        None, help="torch CPU threads (evaluate's --threads; the cost profile's entry)", ge=1
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
        "bench/forward_cost.json",
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
    evaluate_args: list[str] = cfg_field(
        [],
        help="more `draftsmith evaluate` flags (for YAML configs; on the command line just give "
        "them: flags the bench does not know are added here)",
    )

    def validate(self) -> list[tuple[str, str]]:
        problems = []
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
        for arg in self.evaluate_args:
            flag = arg.split("=", 1)[0]
            if flag in _OWN_FLAGS:
                problems.append(
                    ("evaluate_args", f"{flag} is set by the bench; use {_OWN_FLAGS[flag]}")
                )
        return problems


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def default_cost_profile() -> Path:
    """The verify-cost profile to use when none is given.

    Raises:
        UsageError: none of :data:`DEFAULT_COST_PROFILES` exists (names the file and the command
            that makes it).
    """
    for path in DEFAULT_COST_PROFILES:
        if path.is_file():
            return path
    raise UsageError(
        f"no verify-cost profile: {DEFAULT_COST_PROFILES[0]} not found; make it with "
        f"`python scripts/bench_forward.py --out {DEFAULT_COST_PROFILES[0]}` or pass "
        "--cost-profile FILE"
    )


def _load_costs(path: Path, dtype: str, threads: int) -> dict[int, float]:
    """``load_cost_profile`` with its failures turned into one-line usage errors."""
    try:
        return load_cost_profile(path, dtype, threads)
    except OSError as exc:
        raise UsageError(
            f"cost profile {path}: cannot read it ({exc.strerror or exc}); "
            "scripts/bench_forward.py makes one"
        ) from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"cost profile {path}: not JSON ({exc})") from None
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        # ValueError: no profile for the dtype (its message names the file); the rest: a JSON
        # that is not bench_forward.py's layout.
        text = (
            str(exc) if isinstance(exc, ValueError) else f"not a bench_forward.py profile ({exc!r})"
        )
        raise UsageError(text if str(path) in text else f"cost profile {path}: {text}") from None


def read_training_log(path: str | Path) -> dict[str, Any]:
    """One training run's validation curve, from its ``training_metrics.json``.

    Args:
        path: a training ``output_dir`` (holding ``training_metrics.json``) or the file itself.

    Returns:
        ``{"run", "path", "dir", "recipe", "kind", "minutes": [n], "sim_tau": [n], "best"}``,
        the validations in order (``val/minutes``, ``val/sim_tau``).

    Raises:
        UsageError: no such file, not JSON, or no validation with both values.
    """
    path = Path(path)
    file = path / "training_metrics.json" if path.is_dir() else path
    if not file.is_file():
        raise UsageError(
            f"training log {path}: no training_metrics.json there (give a training output_dir "
            "or its training_metrics.json)"
        )
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"training log {file}: not JSON ({exc})") from None
    points = []
    for entry in (data.get("validation") or []) if isinstance(data, dict) else []:
        minutes, tau = entry.get("val/minutes"), entry.get("val/sim_tau")
        if _finite(minutes) and _finite(tau):
            points.append((float(minutes), float(tau), entry.get("step")))
    if not points:
        raise UsageError(
            f"training log {file}: no validation entries with val/minutes and val/sim_tau"
        )
    return {
        "run": file.parent.name,
        "path": str(file),
        "dir": str(file.parent),
        "recipe": data.get("recipe"),
        "kind": data.get("kind"),
        "minutes": [m for m, _, _ in points],
        "sim_tau": [t for _, t, _ in points],
        "steps": [step for _, _, step in points],
        "best": data.get("best"),
    }


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# --------------------------------------------------------------------------------------------
# The recommendation
# --------------------------------------------------------------------------------------------


def extend_alpha(alpha: list[float], n: int) -> list[float]:
    """α per position for ``n`` positions: the measured ones, then an extrapolated tail.

    Past the measured k the conditional acceptance rate of the last measured position
    (α_k / α_{k-1}; α_1 when k = 1) is held constant: a chain position is accepted only when
    every earlier one is, and deeper conditional rates change slowly. Exact for the measured
    positions (a prefix of a longer chain is accepted exactly as often).

    Args:
        alpha: ``[k]`` measured α_i (unconditional, vLLM's definition).
        n: positions wanted.

    Returns:
        ``[n]`` α_i; the first ``min(k, n)`` are ``alpha``'s.
    """
    out = [float(a) for a in alpha[:n]]
    if len(out) >= n:
        return out
    if not alpha or alpha[-1] <= 0:
        ratio = 0.0
    elif len(alpha) >= 2 and alpha[-2] > 0:
        ratio = min(1.0, alpha[-1] / alpha[-2])
    else:
        ratio = min(1.0, float(alpha[-1]))
    while len(out) < n:
        out.append(out[-1] * ratio if out else 0.0)
    return out


def draft_seconds_per_token(result: dict[str, Any]) -> float:
    """D: the drafter's seconds (start, propose, accept) per drafted token over the run."""
    proposed = result.get("proposed_tokens") or 0
    if not proposed:
        return 0.0
    return result["draft_time_fraction"] * result["wall_time_s"] / proposed


def recommend(result: dict[str, Any], costs: dict[int, float], max_k: int) -> dict[str, Any]:
    """The chain length predicted fastest for one measured chain drafter.

    Args:
        result: one method's evaluate result (``acceptance_rate_per_position``, ``k``,
            ``speedup``, ``draft_time_fraction``, ``wall_time_s``, ``proposed_tokens``).
        costs: seconds per target forward by width (:func:`load_cost_profile`).
        max_k: longest chain considered (the run's k is always included).

    Returns:
        ``predicted`` ``{k: speedup}``, ``best_k``, ``best_predicted_speedup``, the measured
        speedup and the prediction at the run's k beside it, ``alpha_used`` (``[n]``: measured,
        then extrapolated past ``measured_positions``), ``draft_seconds_per_token`` and
        ``plain_is_faster`` (no k predicted above 1x).
    """
    alpha = list(result["acceptance_rate_per_position"])
    run_k = int(result["k"])
    n = max(max_k, run_k)
    used = extend_alpha(alpha, n)
    d = draft_seconds_per_token(result)
    # A drafter that drafts only on some steps (n-gram lookup finds no match elsewhere) has its
    # α per drafted step; the prediction mixes those steps with the plain ones by their share.
    verify_steps = result.get("target_forwards", 0) - result.get("num_prompts", 0)
    drafted = result.get("draft_steps", 0)
    share = min(1.0, drafted / verify_steps) if verify_steps > 0 else 1.0
    predicted = predicted_speedups(used, costs, d, drafted_share=share)
    best_k = max(predicted, key=lambda k: (predicted[k], -k))  # ties: the shorter chain
    rec = {
        "method": result["method"],
        "temperature": result.get("temperature", 0.0),
        "run_k": run_k,
        "measured_speedup": result.get("speedup"),
        "measured_speedup_vs_fastest_plain": result.get("speedup_vs_fastest_plain"),
        "predicted_at_run_k": predicted[run_k],
        "best_k": best_k,
        "best_predicted_speedup": predicted[best_k],
        "best_is_extrapolated": best_k > len(alpha),
        "plain_is_faster": predicted[best_k] <= 1.0,
        "predicted": predicted,
        "alpha_used": used,
        "measured_positions": len(alpha),
        "draft_seconds_per_token": d,
    }
    rec["drafted_step_share"] = share
    notes = []
    if not drafted:
        notes.append("never drafted: nothing to predict from")
    elif share < 0.8:
        notes.append(f"drafted on {100 * share:.0f}% of steps (assumed the same share at every k)")
    if result.get("adaptive_k"):
        notes.append("measured with --adaptive-k: its α are of shorter drafts")
    if notes:
        rec["note"] = "; ".join(notes)
    return rec


def _family(spec: str) -> str:
    """``chain``, ``tree`` or ``hf`` (transformers' own loop) for a ``--drafter`` spec."""
    kind = spec.partition("=")[0]
    if kind.startswith("hf-"):
        return "hf"
    return "tree" if kind.endswith("-tree") else "chain"


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _stem(out: Path) -> Path:
    """``--out`` without a ``.json``/``.md`` suffix the user may have typed."""
    return out.with_suffix("") if out.suffix in (".json", ".md") else out


def _raw_path(stem: Path, temperature: float) -> Path:
    return stem.with_name(f"{stem.name}.t{temperature:g}.json")


def _machine_load() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        return {}
    return {"loadavg_1m": load[0], "loadavg_5m": load[1], "cpu_count": os.cpu_count()}


def _evaluate_argv(cfg: BenchConfig, temperature: float, out: Path) -> list[str]:
    argv = ["evaluate", "--drafter", *cfg.drafter, "--k", str(cfg.k), "--dtype", cfg.dtype]
    if cfg.threads:
        argv += ["--threads", str(cfg.threads)]
    if cfg.shard:
        argv += ["--shard", cfg.shard]
    return [*argv, *cfg.evaluate_args, "--temperature", f"{temperature:g}", "--out", str(out)]


def _call(argv: list[str]) -> int:
    """``draftsmith ARGV`` in this process (the CLI dispatch, as the quickstart's stages)."""
    from draftsmith.recipes import cli

    print(f"[bench] $ {shlex.join(['draftsmith', *argv])}", flush=True)
    try:
        return cli.main(argv)
    finally:
        gc.collect()  # each evaluate run loads its own target: free the last one first


def run(cfg: BenchConfig) -> int:
    """Run (or merge) the bench and write its outputs; the exit code of the worst run."""
    info = run_info()  # at the start: the code and versions that actually ran
    load_before = _machine_load()
    stem = _stem(cfg.out)
    profile = cfg.cost_profile or default_cost_profile()
    # Every input is checked before the first (long) evaluate run.
    training = [read_training_log(p) for p in cfg.training_logs or []]
    code = 0
    if cfg.merge:
        runs, merged_from = _merge(cfg, stem), [str(p) for p in cfg.merge]
    else:
        import torch

        _load_costs(profile, cfg.dtype, cfg.threads or torch.get_num_threads())
        runs, merged_from = [], None
        for t in cfg.temperatures:
            raw = _raw_path(stem, t)
            argv = _evaluate_argv(cfg, t, raw)
            rc = _call(argv)
            if rc == 2 or not raw.is_file():
                print(
                    f"error: bench: evaluate at temperature {t:g} failed (exit {rc}; its error "
                    "is above)",
                    file=sys.stderr,
                )
                return rc or 1
            code = max(code, rc)  # 1: an output differed from plain greedy (reported, kept)
            runs.append((t, raw, shlex.join(["draftsmith", *argv])))
    report = build_report(runs, stem, profile, cfg.max_k, training)
    report["bench"].update(shard=cfg.shard, merged_from=merged_from)
    report["config"] = config_to_dict(cfg)
    report["machine_load"] = {"before": load_before, "after": _machine_load()}
    report.update(info)
    outputs = write_outputs(report, stem)
    _print_summary(report, outputs)
    if cfg.shard:
        print(
            f"shard {cfg.shard} done; when every shard is: draftsmith bench --merge "
            f"<each shard's .json> --out OUT"
        )
    return code if not cfg.merge else _differs(report)


def _differs(report: dict[str, Any]) -> int:
    """1 when a greedy output differs from plain decoding beyond a bf16 near-tie (evaluate's
    rule), else 0: a merge must fail where its shards did."""
    for entry in report["runs"]:
        for m in entry["methods"]:
            if m.get("identical_to_target") is False:
                ties = m.get("near_ties") or []
                if m.get("dtype") == "float32" or not all(t.get("near_tie") for t in ties):
                    return 1
    return 0


def _merge(cfg: BenchConfig, stem: Path) -> list[tuple[float, Path, str]]:
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
        rc = _call(argv)
        if rc:
            raise UsageError(f"merge: evaluate --merge at temperature {t:g} failed (exit {rc})")
        runs.append((t, out, shlex.join(["draftsmith", *argv])))
    return runs


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


def build_report(
    runs: list[tuple[float, Path, str]],
    stem: Path,
    profile: Path,
    max_k: int,
    training: list[dict[str, Any]],
) -> dict[str, Any]:
    """The bench JSON (without run info) from evaluate's results, one file per temperature.

    Args:
        runs: ``(temperature, evaluate results JSON, the command that wrote it)``, in run
            order.
        stem: the output stem (results files are recorded relative to its folder).
        profile: the verify-cost profile.
        max_k: longest chain the recommendation considers.
        training: :func:`read_training_log` curves.
    """
    entries, recs, trees = [], [], []
    costs_info: dict[str, Any] = {"path": str(profile)}
    first: dict[str, Any] = {}
    for t, raw, command in runs:
        data = json.loads(raw.read_text())
        first = first or data
        config = data["config"]
        methods = data.get("methods", [data])
        specs = config["drafter"]
        threads = (data.get("machine") or {}).get("torch_threads") or 1
        dtype = methods[0].get("dtype", config.get("dtype", "float32"))
        costs = _load_costs(profile, dtype, threads)
        costs_info.update(dtype=dtype, threads=threads, seconds_per_width=costs)
        summaries = []
        for spec, m in zip(specs, methods, strict=True):
            summary = {key: v for key, v in m.items() if key != "per_prompt"}
            summary["spec"], summary["family"] = spec, _family(spec)
            summary["temperature"] = t
            summaries.append(summary)
            if summary["family"] == "chain":
                recs.append({"spec": spec, **recommend(summary, costs, max_k)})
            elif summary["family"] == "tree":
                trees.append(
                    {
                        "method": m["method"],
                        "spec": spec,
                        "temperature": t,
                        "tree_total_tokens": config.get("tree_total_tokens"),
                        "tree_topk": config.get("tree_topk"),
                        # With sampling the EAGLE and Medusa proposers draft chains (docs/design.md).
                        "drafts": "tree" if t == 0 else f"chain of k={m['k']} (sampled)",
                        **{
                            key: m.get(key)
                            for key in (
                                "acceptance_length",
                                "speedup",
                                "speedup_vs_fastest_plain",
                                "tokens_per_second",
                                "identical_to_target",
                            )
                        },
                    }
                )
        entries.append(
            {
                "temperature": t,
                "results_file": os.path.relpath(raw, stem.parent),
                "prompts_evaluated": data.get("prompts_evaluated"),
                "prompts_selected": data.get("prompts_selected"),
                "machine_load": data.get("machine_load"),
                "evaluate_command": command,  # evaluate's own `command` is the bench's argv
                "evaluate_machine": data.get("machine"),
                "evaluate_config": config,
                "methods": summaries,
            }
        )
    config = first.get("config", {})
    return {
        "bench": {
            "temperatures": [t for t, _, _ in runs],
            "drafters": config.get("drafter"),
            "k": config.get("k"),
            "max_k": max_k,
            "dtype": config.get("dtype"),
            "draft_dtype": config.get("draft_dtype", "same"),
            "target": config.get("target"),
            "prompts": config.get("prompts"),
            "split": config.get("split"),
            "max_new_tokens": config.get("max_new_tokens"),
        },
        "seed": config.get("seed"),
        "runs": entries,
        "cost_profile": costs_info,
        "recommendations": recs,
        "trees": trees,
        "training": [_with_measured(tr, entries) for tr in training],
    }


def _with_measured(training: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The training curve plus the measured τ of every drafter benched from that run's dir."""
    run_dir = Path(training["dir"]).resolve()
    # `best/` holds the drafter of the best validation, anything else the last one.
    best_step = (training.get("best") or {}).get("step")
    at_best = next(
        (m for m, s in zip(training["minutes"], training["steps"], strict=True) if s == best_step),
        training["minutes"][-1],
    )
    measured = []
    for entry in entries:
        for m in entry["methods"]:
            _, _, path = m["spec"].partition("=")
            if path and Path(path).resolve().is_relative_to(run_dir):
                measured.append(
                    {
                        "method": m["method"],
                        "temperature": entry["temperature"],
                        "k": m["k"],
                        "acceptance_length": m["acceptance_length"],
                        "training_minutes": at_best
                        if "best" in Path(path).parts
                        else training["minutes"][-1],
                    }
                )
    return {**training, "measured": measured}


def write_outputs(report: dict[str, Any], stem: Path) -> dict[str, Any]:
    """Write ``OUT.json``, ``OUT.md`` and the plots; returns their paths (also in the JSON)."""
    plots_dir = stem.with_name(stem.name + "_plots")
    plots = write_plots(report, plots_dir)
    outputs = {
        "json": str(stem.with_name(stem.name + ".json")),
        "markdown": str(stem.with_name(stem.name + ".md")),
        "plots": [str(p) for p in plots],
        "results_files": [str(stem.parent / e["results_file"]) for e in report["runs"]],
    }
    report["outputs"] = outputs
    write_json_atomic(outputs["json"], report)
    md = markdown(report, [os.path.relpath(p, stem.parent) for p in plots])
    Path(outputs["markdown"]).write_text(md)
    return outputs


# --- markdown ---------------------------------------------------------------------------------


def _x(value: Any, fmt: str = ".2f", suffix: str = "") -> str:
    return f"{value:{fmt}}{suffix}" if _finite(value) else "-"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|")


def results_rows(report: dict[str, Any]) -> list[list[str]]:
    """The main table's rows: one per method and temperature, in run order."""
    rows = []
    for entry in report["runs"]:
        for m in entry["methods"]:
            vs = (
                f"{m['speedup_vs_fastest_plain']:.2f}x ({m['fastest_plain_dtype']})"
                if "speedup_vs_fastest_plain" in m
                else "-"
            )
            rows.append(
                [
                    m["method"],
                    f"{entry['temperature']:g}",
                    str(m["k"]),
                    str(m["num_prompts"]),
                    _x(m["acceptance_length"]),
                    " ".join(f"{a:.2f}" for a in m["acceptance_rate_per_position"]),
                    _x(m["tokens_per_second"], ".1f"),
                    _x(m.get("baseline_tokens_per_second"), ".1f"),
                    _x(m.get("speedup"), ".2f", "x"),
                    vs,
                    _x(100 * m["draft_time_fraction"], ".0f", "%"),
                    identical_text(m, sampled="- (sampled)", gaps=True),
                ]
            )
    return rows


RESULT_COLUMNS = [
    "method",
    "T",
    "k",
    "prompts",
    "τ",
    "α per position",
    "tok/s",
    "plain tok/s",
    "speedup",
    "vs fastest plain",
    "draft share",
    "identical",
]


def _table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def recommendation_text(rec: dict[str, Any]) -> str:
    """One line: the best k and its predicted speedup beside the measured one."""
    measured = _x(rec["measured_speedup"], ".2f", "x")
    line = (
        f"{rec['method']} (T={rec['temperature']:g}): measured {measured} at k={rec['run_k']} "
        f"(predicted {rec['predicted_at_run_k']:.2f}x); best k={rec['best_k']}: predicted "
        f"{rec['best_predicted_speedup']:.2f}x"
    )
    if rec.get("note"):
        line += f" ({rec['note']})"
    if rec["best_is_extrapolated"]:
        line += f" (α extrapolated past k={rec['measured_positions']}: measure it with --k)"
    if rec["plain_is_faster"]:
        line += " -- plain decoding is predicted faster at every k"
    return line


def markdown(report: dict[str, Any], plots: list[str]) -> str:
    """The bench report as markdown (tables, recommendation, plots, provenance)."""
    b = report["bench"]
    lines = [
        "# draftsmith bench",
        "",
        f"Target {b['target'] or 'SmolLM2-135M-Instruct'}, prompts "
        f"{b['prompts'] or 'shipped set'} (split {b['split']}), {b['max_new_tokens']} new tokens "
        f"per prompt, dtype {b['dtype']} (drafters {b['draft_dtype']}), k={b['k']}, seed "
        f"{report['seed']}. Every drafter of one run shares one plain-decoding baseline, "
        "measured prompt by prompt between them.",
        "",
    ]
    for entry in report["runs"]:
        t = entry["temperature"]
        lines.append(
            f"- T={t:g} ({'greedy' if t == 0 else 'sampled'}): {entry['prompts_evaluated']} "
            f"prompts; results `{entry['results_file']}`"
        )
    lines += ["", "## Results", "", _table(RESULT_COLUMNS, results_rows(report)), ""]
    lines += [
        "τ = tokens per target forward; α per position as vLLM counts it; speedup over plain "
        "decoding in the same dtype, and over the fastest plain decoding measured "
        "(docs/metrics.md). Sampled runs (T > 0) have no token-for-token check: the loop's "
        "rejection sampling keeps the target's distribution (tested in "
        "tests/test_speculative.py).",
        "",
    ]
    cp = report["cost_profile"]
    if report["recommendations"]:
        lines += [
            "## Recommended draft length",
            "",
            f"Predicted from each chain drafter's measured α, its measured drafting time per "
            f"token and the verify cost per width in `{cp['path']}` ({cp.get('dtype')}, "
            f"{cp.get('threads')} thread(s)): speedup(k) = τ(k)·V(1) / (V(k+1) + k·D), mixed "
            "with plain 1-token steps by the share s of steps that drafted (n-gram lookup "
            "drafts only on a match). Prefill and loop overhead are left out, so predictions run a little high; α past "
            "the measured k is extrapolated.",
            "",
        ]
        rows = [
            [
                r["method"],
                f"{r['temperature']:g}",
                str(r["run_k"]),
                _x(r["measured_speedup"], ".2f", "x"),
                f"{r['predicted_at_run_k']:.2f}x",
                str(r["best_k"]) + (" (extrapolated)" if r["best_is_extrapolated"] else ""),
                f"{r['best_predicted_speedup']:.2f}x",
                f"{1000 * r['draft_seconds_per_token']:.2f}",
            ]
            for r in report["recommendations"]
        ]
        cols = [
            "method",
            "T",
            "run k",
            "measured",
            "predicted at run k",
            "best k",
            "predicted at best k",
            "draft ms/token",
        ]
        lines += [_table(cols, rows), ""]
    if report["trees"]:
        lines += ["## Trees (measured)", ""]
        rows = [
            [
                r["method"],
                f"{r['temperature']:g}",
                f"{r['tree_total_tokens']} nodes, top-{r['tree_topk']}",
                r["drafts"],
                _x(r["acceptance_length"]),
                _x(r["speedup"], ".2f", "x"),
                _x(r["speedup_vs_fastest_plain"], ".2f", "x"),
            ]
            for r in report["trees"]
        ]
        cols = ["method", "T", "tree", "drafts", "τ", "speedup", "vs fastest plain"]
        lines += [_table(cols, rows), ""]
    if report["training"]:
        lines += ["## Training", ""]
        rows = []
        for tr in report["training"]:
            measured = ", ".join(
                f"{m['acceptance_length']:.2f} (k={m['k']}, T={m['temperature']:g})"
                for m in tr["measured"]
            )
            rows.append(
                [
                    tr["run"],
                    str(len(tr["minutes"])),
                    f"{tr['minutes'][-1]:.1f}",
                    f"{tr['sim_tau'][-1]:.2f}",
                    f"{max(tr['sim_tau']):.2f}",
                    measured or "-",
                ]
            )
        cols = ["run", "validations", "minutes", "last sim τ", "best sim τ", "measured τ"]
        lines += [_table(cols, rows), ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    lines += [
        "## Provenance",
        "",
        f"- command: `{report.get('command', '')}`",
        f"- versions: {json.dumps(report.get('versions'))}",
        f"- git commit: {report.get('git_commit')}; date {report.get('date')}",
        f"- machine: {json.dumps(report.get('machine'))}",
        f"- machine load: {json.dumps(report.get('machine_load'))}",
        "",
    ]
    return "\n".join(lines)


# --- plots ------------------------------------------------------------------------------------


def write_plots(report: dict[str, Any], folder: Path) -> list[Path]:
    """``alpha_by_position.png``, ``speedup_vs_k.png`` and (with training logs)
    ``tau_vs_training.png`` in ``folder``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    folder.mkdir(parents=True, exist_ok=True)
    runs = report["runs"]
    written = []

    # α per position: one line per drafter, one panel per temperature.
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, entry in zip(axes[0], runs, strict=True):
        for m in entry["methods"]:
            alpha = m["acceptance_rate_per_position"]
            ax.plot(range(1, len(alpha) + 1), alpha, marker="o", label=m["method"])
        ax.set_title(f"T={entry['temperature']:g}")
        ax.set_xlabel("draft position i")
        ax.set_ylabel("α_i (accepted at i / drafted steps)")
        ax.set_ylim(-0.02, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("acceptance rate by draft position")
    _save(fig, folder / PLOTS[0], written)

    # Speedup vs draft tokens per step: chains predicted over k (solid where α was measured,
    # dashed where extrapolated) with the measured point; trees and HF loops as measured.
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, entry in zip(axes[0], runs, strict=True):
        t = entry["temperature"]
        chains = [r for r in report["recommendations"] if r["temperature"] == t]
        ticks: set[int] = set()
        for i, rec in enumerate(chains):
            color = f"C{i % 10}"
            ks = sorted(rec["predicted"], key=int)
            ys = [rec["predicted"][k] for k in ks]
            xs = [int(k) for k in ks]
            ticks.update(xs)
            n = rec["measured_positions"]
            ax.plot(xs[:n], ys[:n], "-", color=color, label=f"{rec['method']} (predicted)")
            if len(xs) > n:
                ax.plot(xs[n - 1 :], ys[n - 1 :], "--", color=color, alpha=0.7)
            if _finite(rec["measured_speedup"]):
                ax.plot([rec["run_k"]], [rec["measured_speedup"]], "*", color=color, ms=12)
            ax.plot([rec["best_k"]], [rec["best_predicted_speedup"]], "o", mfc="none", color=color)
        others = [m for m in entry["methods"] if m["family"] != "chain"]
        for j, m in enumerate(others):
            if not _finite(m.get("speedup")):
                continue
            tree = m["family"] == "tree" and t == 0
            x = int(entry["evaluate_config"].get("tree_total_tokens") if tree else m["k"])
            ticks.add(x)
            ax.plot(
                [x],
                [m["speedup"]],
                "D" if tree else "x",
                color=f"C{(len(chains) + j) % 10}",
                ms=8,
                label=f"{m['method']} (measured)",
            )
        ax.axhline(1.0, color="grey", lw=0.8)
        if any(m["family"] == "tree" for m in others) and t == 0:
            ax.set_xscale("log", base=2)  # tree sizes (8-64) beside chain lengths (1-8)
        if ticks:
            ax.set_xticks(sorted(ticks), [str(x) for x in sorted(ticks)])
        ax.set_title(f"T={t:g}: ★ measured, ○ best predicted")
        ax.set_xlabel("draft tokens verified per step (chain: k; tree: nodes)")
        ax.set_ylabel("speedup over plain decoding")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("speedup vs k (verify costs: " + Path(report["cost_profile"]["path"]).name + ")")
    _save(fig, folder / PLOTS[1], written)

    if report["training"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, tr in enumerate(report["training"]):
            color = f"C{i % 10}"
            ax.plot(
                tr["minutes"],
                tr["sim_tau"],
                "o-",
                color=color,
                label=f"{tr['run']}: validation simulated τ",
            )
            for j, m in enumerate(tr["measured"]):
                ax.plot(
                    [m["training_minutes"]],
                    [m["acceptance_length"]],
                    "*PXD^s"[j % 6],
                    color=color,
                    ms=12,
                    label=f"{m['method']}: measured τ (k={m['k']}, T={m['temperature']:g})",
                )
        ax.set_xlabel("training minutes")
        ax.set_ylabel("τ (tokens per target forward)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title("τ vs training time")
        _save(fig, folder / PLOTS[2], written)
    return written


def _save(fig, path: Path, written: list[Path]) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _print_summary(report: dict[str, Any], outputs: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    console = console if console.is_terminal else Console(width=160, highlight=False)
    table = Table(title="draftsmith bench")
    for col in RESULT_COLUMNS:
        table.add_column(col, justify="left" if col in ("method", "α per position") else "right")
    for row in results_rows(report):
        table.add_row(*map(escape, row))
    console.print(table)
    for rec in report["recommendations"]:
        print("recommend: " + recommendation_text(rec))
    for tree in report["trees"]:
        shape = f"{tree['tree_total_tokens']} nodes" if tree["drafts"] == "tree" else tree["drafts"]
        print(
            f"tree: {tree['method']} (T={tree['temperature']:g}, {shape}): "
            f"τ {_x(tree['acceptance_length'])}, measured {_x(tree['speedup'], '.2f', 'x')}"
        )
    print(f"bench results: {outputs['json']}")
    print(f"report: {outputs['markdown']}")
    for path in outputs["plots"]:
        print(f"plot: {path}")


_EPILOG = """\
Any other flag is passed to `draftsmith evaluate` as it is: --target, --prompts, --split, --limit,
--draft-dtype, --max-new-tokens, --seed, --top-p, --draft-layers, --draft-model, --tree-topk,
--tree-total-tokens, --ngram-max, --max-minutes, --no-reference-plain, --report-to wandb, ...

examples:
  draftsmith bench --drafter ngram eagle=runs/eagle3_smollm2/best hf-prompt-lookup --k 3
  draftsmith bench ... --shard 0/2 --out results/bench/s0 &   # one process per core
  draftsmith bench ... --shard 1/2 --out results/bench/s1
  draftsmith bench --merge results/bench/s0.json results/bench/s1.json --out results/bench/all

docs/bench.md describes the outputs and how to read the plots."""


def parse(argv: list[str]) -> BenchConfig:
    """The bench's config from its command line; unknown flags go to ``evaluate_args``."""
    parser = argparse.ArgumentParser(
        prog="draftsmith bench",
        description="Every drafter on one prompt set against one interleaved plain baseline, "
        "greedy and sampled: tables, plots and the recommended draft length.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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


def main(argv: list[str] | None = None) -> int:
    """CLI entry: 0 done, 2 bad input, 1 a greedy output differed from plain decoding."""
    return cli_main(lambda a: run(parse(a)), argv)


if __name__ == "__main__":
    sys.exit(main())
