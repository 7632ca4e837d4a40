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
    k = first["k"] if "k" in first else first_methods[0]["k"]
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
        result.update(summarize_entries(entries, k, result["dtype"], other))
        # Sampled runs compare in distribution, not per sample (as one run reports them).
        greedy = first["config"].get("temperature", 0.0) == 0
        flags = [p.get("identical_to_target") for p in entries]
        result.update(identity(entries, compared=greedy and None not in flags))
        result["per_prompt"] = entries
        results.append(result)
    out = dict(results[0]) if len(results) == 1 and "methods" not in first else {"methods": results}
    out["config"] = first["config"]
    out["merged_from"] = [str(p) for p in paths]
    out["prompts_evaluated"] = len(results[0]["per_prompt"])
    for key in ("command", "versions", "git_commit", "machine"):
        if key in first:
            out[key] = first[key]
    # Each shard's load record: a busy shard makes the merged timings unreliable too.
    loads = [data["machine_load"] for _, data, _ in loaded if data.get("machine_load")]
    if loads:
        out["machine_load"] = {"shards": loads, "busy": any(ld.get("busy") for ld in loads)}
    return out
