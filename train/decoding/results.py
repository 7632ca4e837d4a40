"""The results of an evaluation: per-prompt entries, raw counters, divergences, shard merging.

``draftsmith evaluate`` writes one entry per prompt and method (:func:`prompt_entry`) holding the
raw counters of its runs, so every summary figure (:func:`~draftsmith.train.decoding.metrics.
summarize`) can be recomputed from the file: :func:`merge_results` merges the files of shards of
one run exactly (keeping each shard's ``machine_load`` under ``shards``, busy if any was). A
greedy output that differs from plain decoding is explained by the target's logit gap where
they part (:func:`divergence`): a near-tie in bf16, or a bug.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ...heads.base import GenerationOutput
from .metrics import summarize

#: Largest gap between the two competing tokens' logits that counts as a numerical near-tie
#: in bf16: logits of magnitude 16-32 are spaced 0.125 apart in bf16, and a forward of another
#: width (a verify of k+1 tokens vs one) may round each of them differently.
NEAR_TIE_LOGIT_GAP = 0.5

#: The :class:`GenerationOutput` fields stored per run: enough to recompute every metric.
COUNTERS = (
    "target_forwards",
    "draft_steps",
    "proposed",
    "accepted",
    "accepted_per_position",
    "wall_time",
    "draft_time",
    "prefill_time",
    "accepted_by_tree_size",
)


def counters(run: GenerationOutput) -> dict:
    """The raw counters of one run (token ids are stored apart, or not at all)."""
    return {name: getattr(run, name) for name in COUNTERS}


def from_counters(stored: dict) -> GenerationOutput:
    """A plain run rebuilt from its stored counters (token ids are not stored: only counts)."""
    # Results written before a counter existed lack it: the dataclass default stands.
    kept = {c: stored[c] for c in COUNTERS if c in stored}
    return GenerationOutput(tokens=[0] * stored["new_tokens"], **kept)


def prompt_entry(record, ids, spec: GenerationOutput, base: GenerationOutput | None, tokenizer):
    """One prompt's entry in a method's ``per_prompt`` list.

    Args:
        record: the prompt record (its ``id`` names the entry).
        ids: the prompt's token ids.
        spec: the method's run.
        base: the plain-decoding run of the same prompt, if measured.
        tokenizer: decodes the output text.
    """
    entry = {
        "id": record.id,
        "category": getattr(record, "category", None),
        "prompt_tokens": len(ids),
        "new_tokens": len(spec.tokens),
        "acceptance_length": spec.acceptance_length,
        "tokens_per_second": len(spec.tokens) / spec.wall_time,
        "stop_reason": spec.stop_reason,
        "output_ids": spec.tokens,
        "output_text": tokenizer.decode(spec.tokens, skip_special_tokens=True),
        # Raw counters: enough to recompute every summary metric (see merge_results).
        "counters": counters(spec),
    }
    if base is not None:
        entry["baseline_tokens_per_second"] = len(base.tokens) / base.wall_time
        entry["baseline_counters"] = {**counters(base), "new_tokens": len(base.tokens)}
        entry["identical_to_target"] = base.tokens == spec.tokens
        if base.tokens != spec.tokens:
            entry["baseline_output_ids"] = base.tokens
    return entry


def identity(entries: list[dict], compared: bool) -> dict[str, Any]:
    """Whether a method's outputs equal plain decoding's, from its per-prompt entries.

    Args:
        entries: the method's per-prompt entries.
        compared: False for sampled runs (compared in distribution, not per sample) or runs
            without a baseline: ``identical_to_target`` is then None.

    Returns:
        ``identical_to_target``, and when compared also ``identical_rate`` and ``near_ties``
        (each differing prompt's :func:`divergence`).
    """
    if not compared:
        return {"identical_to_target": None}
    flags = [p["identical_to_target"] for p in entries]
    return {
        "identical_to_target": all(flags),
        "identical_rate": sum(flags) / max(len(flags), 1),
        "near_ties": [{"id": p["id"], **p["divergence"]} for p in entries if "divergence" in p],
    }


@torch.inference_mode()
def divergence(target, prompt_ids, plain: list[int], spec: list[int]) -> dict:
    """Where and why a speculative output left the plain one: the target's logit gap there.

    The target re-reads prompt + the common prefix in one forward and compares its logits for
    the plain and the speculative token at the first differing position. A gap within
    :data:`NEAR_TIE_LOGIT_GAP` is a rounding-level tie that the verify forward's width can
    flip in bf16, not a loop bug (a bug shows as a token the target does not rank near the top).
    """
    d = next(i for i, (a, b) in enumerate(zip(plain, spec, strict=False)) if a != b)
    ids = torch.as_tensor([*torch.as_tensor(prompt_ids).flatten().tolist(), *plain[:d]])[None]
    logits = target(input_ids=ids.to(target.device), logits_to_keep=1).logits[0, -1].float()
    top2 = torch.topk(logits, 2).values
    gap = float(logits[plain[d]] - logits[spec[d]])
    return {
        "position": d,
        "plain_token": plain[d],
        "spec_token": spec[d],
        "logit_gap": gap,
        "top2_gap": float(top2[0] - top2[1]),
        "near_tie": abs(gap) <= NEAR_TIE_LOGIT_GAP,
    }


def fastest_plain(result: dict, ref_runs: list, dtype: str, other: str) -> dict:
    """The speedup over the fastest plain decoding measured in this run, whichever dtype."""
    tokens = sum(len(r.tokens) for r in ref_runs)
    wall = sum(r.wall_time for r in ref_runs)
    ref_tps = tokens / wall if wall else 0.0
    base_tps = result.get("baseline_tokens_per_second", 0.0)
    fastest, fastest_tps = (dtype, base_tps) if base_tps >= ref_tps else (other, ref_tps)
    return {
        "reference_plain": {"dtype": other, "tokens_per_second": ref_tps},
        "fastest_plain_dtype": fastest,
        "fastest_plain_tokens_per_second": fastest_tps,
        "speedup_vs_fastest_plain": result["tokens_per_second"] / fastest_tps
        if fastest_tps
        else 0.0,
    }


def summarize_entries(
    entries: list[dict], k: int, dtype: str, other_dtype: str | None = None
) -> dict[str, Any]:
    """One method's summary metrics recomputed from its per-prompt entries (raw counters).

    Args:
        entries: the method's :func:`prompt_entry` dicts (from one run, shards or segments).
        k: draft tokens per step.
        dtype: the target's dtype in the run.
        other_dtype: the dtype of the interleaved plain reference, when every entry has one.

    Returns:
        :func:`~draftsmith.train.decoding.metrics.summarize`'s figures, plus
        :func:`fastest_plain`'s when the reference was measured.
    """
    runs = [GenerationOutput(tokens=p["output_ids"], **p["counters"]) for p in entries]
    base = None
    if entries and all("baseline_counters" in p for p in entries):
        base = [from_counters(p["baseline_counters"]) for p in entries]
    out = summarize(runs, k, base)
    if other_dtype and entries and all("reference_counters" in p for p in entries):
        refs = [from_counters(p["reference_counters"]) for p in entries]
        out.update(fastest_plain(out, refs, dtype, other_dtype))
    return out


def merge_results(paths: list[Path]) -> dict:
    """Merge results JSONs of shards of one evaluation into one, recomputing every metric.

    The files must come from the same settings (drafters, k, tokens, sampling, target) on
    disjoint prompts; the merged file holds every prompt and the summed counters.

    Args:
        paths: results JSONs written by ``draftsmith evaluate --out``.

    Returns:
        The merged results dict (same layout as one run's).

    Raises:
        ValueError: naming the file whose settings or methods differ, or a prompt seen twice.
    """
    loaded = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a results JSON ({exc})") from exc
        loaded.append((path, data, data.get("methods", [data])))
    ignore = {"shard", "max_minutes", "out", "merge", "threads", "limit", "report_to"}
    first_path, first, first_methods = loaded[0]
    same = {k: v for k, v in first["config"].items() if k not in ignore}
    names = [m["method"] for m in first_methods]
    for path, data, methods in loaded[1:]:
        other = {k: v for k, v in data["config"].items() if k not in ignore}
        diff = sorted(k for k in same.keys() | other.keys() if same.get(k) != other.get(k))
        if diff:
            raise ValueError(f"{path}: settings differ from {first_path}: {', '.join(diff)}")
        if [m["method"] for m in methods] != names:
            raise ValueError(f"{path}: methods differ from {first_path}")
    results = []
    for i, name in enumerate(names):
        entries = [p for _, _, methods in loaded for p in methods[i]["per_prompt"]]
        ids = [p["id"] for p in entries]
        if len(set(ids)) != len(ids):
            raise ValueError(
                f"{name}: a prompt appears in more than one file; shards must be disjoint"
            )
        missing = [p["id"] for p in entries if "counters" not in p]
        if missing:
            raise ValueError(f"{name}: prompts {missing[:5]} have no counters (old results file)")
        template = first_methods[i]
        result = {key: template[key] for key in ("method", "k", "temperature", "adaptive_k")}
        result["dtype"] = template.get("dtype", "float32")
        other = (template.get("reference_plain") or {}).get("dtype")
        result.update(summarize_entries(entries, template["k"], result["dtype"], other))
        # Sampled runs compare in distribution, not per sample (as one run reports them).
        greedy = first["config"].get("temperature", 0.0) == 0
        flags = [p.get("identical_to_target") for p in entries]
        result.update(identity(entries, compared=greedy and None not in flags))
        decisions = [methods[i]["decision"] for _, _, methods in loaded if "decision" in methods[i]]
        if decisions:
            result["decision"] = merge_decisions(decisions)
        result["per_prompt"] = entries
        results.append(result)
    annotate(results)
    out = dict(results[0]) if len(results) == 1 and "methods" not in first else {"methods": results}
    out["config"] = first["config"]
    out["merged_from"] = [str(p) for p in paths]
    out["prompts_evaluated"] = len(results[0]["per_prompt"])
    for key in ("command", "versions", "git_commit", "git_dirty", "machine"):
        if key in first:
            out[key] = first[key]
    probes = [data["verify_costs"] for _, data, _ in loaded if data.get("verify_costs")]
    if probes:
        out["verify_costs"] = probes[0] if len(probes) == 1 else {"shards": probes}
    # Each shard's load record: a busy shard makes the merged timings unreliable too.
    loads = [data["machine_load"] for _, data, _ in loaded if data.get("machine_load")]
    if loads:
        out["machine_load"] = {"shards": loads, "busy": any(ld.get("busy") for ld in loads)}
    return out


# --- per category, and one method against another ------------------------------------------------

#: Two-sided 95 % quantiles of Student's t by degrees of freedom (1..30); 1.96 beyond.
_T975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


def _t975(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


def category_of(entry: dict) -> str:
    """A per-prompt entry's category (``uncategorised`` for prompts without one)."""
    return entry.get("category") or "uncategorised"


def by_category(entries: list[dict]) -> dict[str, dict[str, Any]]:
    """One method's figures per prompt category, from its per-prompt entries.

    Each category: prompts, τ (tokens per target forward), tokens/s, the speedup over plain
    decoding in the run's dtype and, where the other dtype was timed too, over the faster of
    the two plain decodings on this category's prompts (``speedup_vs_fastest_plain``).
    """
    groups: dict[str, list[dict]] = {}
    for e in entries:
        groups.setdefault(category_of(e), []).append(e)
    out = {}
    for name, group in sorted(groups.items()):
        tokens = sum(e["new_tokens"] for e in group)
        wall = sum(e["counters"]["wall_time"] for e in group)
        forwards = sum(e["counters"]["target_forwards"] for e in group)
        row: dict[str, Any] = {
            "prompts": len(group),
            "acceptance_length": tokens / max(forwards, 1),
            "tokens_per_second": tokens / wall if wall else 0.0,
        }
        plain = []
        for key in ("baseline_counters", "reference_counters"):
            if all(key in e for e in group):
                t = sum(e[key]["new_tokens"] for e in group)
                w = sum(e[key]["wall_time"] for e in group)
                plain.append(t / w if w else 0.0)
        if plain:
            row["speedup"] = row["tokens_per_second"] / plain[0] if plain[0] else 0.0
        if len(plain) == 2 and max(plain):
            row["speedup_vs_fastest_plain"] = row["tokens_per_second"] / max(plain)
        out[name] = row
    return out


def paired_ratio(a: list[dict], b: list[dict]) -> dict[str, Any] | None:
    """Method a against method b on the same prompts: the geometric mean of the per-prompt
    tokens/s ratios a/b and its 95 % t-interval (from the log ratios), None without prompts."""
    speeds = {e["id"]: e["tokens_per_second"] for e in b}
    logs = [
        math.log(e["tokens_per_second"] / speeds[e["id"]])
        for e in a
        if e["id"] in speeds and e["tokens_per_second"] > 0 and speeds[e["id"]] > 0
    ]
    if not logs:
        return None
    n = len(logs)
    mean = sum(logs) / n
    if n == 1:  # one pair: no interval
        return {"prompts": 1, "ratio": math.exp(mean), "low": None, "high": None}
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = _t975(n - 1) * sd / math.sqrt(n)
    return {
        "prompts": n,
        "ratio": math.exp(mean),
        "low": math.exp(mean - half),
        "high": math.exp(mean + half),
    }


def versus(results: list[dict], method: str) -> list[dict[str, Any]]:
    """``method`` against every other method of one run, paired per prompt, overall and per
    category (:func:`paired_ratio`): the evidence for "at least as fast as the others".
    """
    mine = next(r for r in results if r["method"] == method)["per_prompt"]
    rows = []
    for other in results:
        if other["method"] == method:
            continue
        theirs = other["per_prompt"]
        row = {"against": other["method"], "overall": paired_ratio(mine, theirs)}
        cats: dict[str, Any] = {}
        for name in sorted({category_of(e) for e in mine}):
            cats[name] = paired_ratio(
                [e for e in mine if category_of(e) == name],
                [e for e in theirs if category_of(e) == name],
            )
        row["by_category"] = cats
        rows.append(row)
    return rows


def annotate(results: list[dict]) -> None:
    """Add each method's ``by_category`` and, for every ``auto[...]`` method, its ``versus``
    every other method (one run's results, or merged shards), in place."""
    for result in results:
        result["by_category"] = by_category(result["per_prompt"])
    if len(results) > 1:
        for result in results:
            if str(result["method"]).startswith("auto["):
                result["versus"] = versus(results, result["method"])


def merge_decisions(decisions: list[dict]) -> dict[str, Any]:
    """Shards' ``decision`` records of one auto method: counters summed, the rest of the first
    shard's kept (each shard's calibration and probe are its own: kept under ``shards``)."""
    first = dict(decisions[0])
    stats: dict[str, Any] = {}
    for d in decisions:
        for key, value in (d.get("stats") or {}).items():
            stats[key] = stats.get(key, 0) + value
    first["stats"] = stats
    first["shards"] = [{k: v for k, v in d.items() if k != "stats"} for d in decisions]
    return first
