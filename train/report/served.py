"""Served figures: the bench's drafters exported, served by vLLM, measured at batch 1 and under load.

``draftsmith bench --vllm-python PY`` (the python of a separate vLLM venv, docs/serving.md) or
``--vllm-url [LABEL=]URL`` (servers already running) adds what a user's serving engine makes
of the drafters the bench measured in our loop:

* **plans** (:func:`served_plans`): each ``--drafter`` spec whose family declares how vLLM serves
  it (:func:`~draftsmith.heads.families.vllm_serving`: its vLLM export format and vLLM's
  ``speculative_config`` method) is exported with ``draftsmith export`` and served beside a
  plain server of the same target; trees and HF's own loops are listed as not served;
* **measurement** (:func:`measure`): the first ``limit`` prompts of the bench, token ids sent
  to ``/v1/completions`` (the server never re-templates), greedy, at each concurrency level:
  every prompt submitted through a pool of ``c`` client threads, so ``c`` requests are in
  flight at once. Per level: aggregate tokens/s (all new tokens / wall time), per-request
  latency p50/p95 and mean per-request tokens/s, and vLLM's own speculative counters from
  ``GET /metrics`` before and after (Prometheus ``vllm:spec_decode_*_total``), from which
  τ = new tokens / (new tokens - accepted) (each forward emits its accepted tokens + 1), α_i =
  accepted at position i / drafts, as in ``scripts/vllm_check.py`` and docs/metrics.md;
* **comparison** (:func:`compare_with_ours`): the speedup over the plain server at the same
  concurrency, whether outputs equal the plain server's, and our τ for the same drafter on the
  same prompts (from the greedy evaluate results); a gap over :data:`TAU_GAP` is flagged;
* **schedule** (:func:`~draftsmith.train.report.schedule.recommend_schedule`): for each drafter
  served with a ``speculative_config``, the draft length per batch size its measurements advise
  (k where it beat the plain server by more than the noise margin, else 0), as vLLM's
  ``num_speculative_tokens_per_batch_size``; with ``served_schedule`` that config is served and
  measured at every level too, each level checked against the best of plain and fixed k.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import statistics
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...heads import families, registry
from ...heads.sampling import SamplingParams
from ..decoding.results import summarize_entries
from ..errors import RunError, UsageError
from .schedule import NOISE, recommend_schedule

__all__ = [
    "TAU_GAP",
    "ServedPlan",
    "compare_with_ours",
    "config_arg",
    "measure",
    "parse_urls",
    "read_spec_metrics",
    "served_plans",
]

#: Relative gap between vLLM's τ and ours above which the report flags the pair.
TAU_GAP = 0.10

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')


@dataclass
class ServedPlan:
    """One server to measure.

    Attributes:
        label: ``plain`` or the bench's drafter spec (``eagle=runs/x/best``).
        method: vLLM's speculative method (``eagle3``, ``medusa``, ...), None for plain.
        export_format: ``draftsmith export --format`` to write before serving, or None.
        checkpoint: what to export (the spec's path).
        url: a server already running (``--vllm-url``), else None (started by the bench).
        speculative_config: filled in once the export exists.
    """

    label: str
    method: str | None = None
    export_format: str | None = None
    checkpoint: str | None = None
    url: str | None = None
    speculative_config: dict[str, Any] | None = field(default=None)


def parse_urls(urls: Sequence[str], drafters: Sequence[str]) -> list[ServedPlan]:
    """``--vllm-url`` values, each ``URL`` or ``LABEL=URL``, as plans.

    ``LABEL`` is ``plain`` (the baseline for speedups) or one of the bench's ``--drafter`` specs
    (then our τ is compared with the server's); an unlabelled URL is ``served-<i>``.

    Raises:
        UsageError: a label given twice.
    """
    plans, seen = [], set()
    for i, text in enumerate(urls):
        label, sep, url = text.rpartition("=") if "=http" in text else ("", "", text)
        label = label if sep else f"served-{i + 1}"
        if label in seen:
            raise UsageError(f"vllm_url: label {label!r} given twice")
        seen.add(label)
        plans.append(ServedPlan(label=label, url=url))  # measured as it serves
    return plans


def served_plans(
    drafters: Sequence[str], k: int, ngram_min: int, ngram_max: int
) -> tuple[list[ServedPlan], list[dict[str, str]]]:
    """A plain server plus one per servable drafter; and the drafters vLLM does not serve.

    Args:
        drafters: the bench's ``--drafter`` specs.
        k: draft tokens per step (``num_speculative_tokens``).
        ngram_min, ngram_max: the n-gram drafter's settings (vLLM's prompt lookup bounds).

    Returns:
        ``(plans, skipped)``; ``skipped`` holds ``{"drafter": spec, "reason": ...}``.
    """
    plans, skipped = [ServedPlan(label="plain")], []
    for spec in drafters:
        kind, path = registry.parse_spec(spec)
        plan = families.vllm_serving(kind, path)
        if isinstance(plan, str):
            skipped.append({"drafter": spec, "reason": plan})
            continue
        export_format, method = plan
        served = ServedPlan(label=spec, method=method, export_format=export_format, checkpoint=path)
        served.speculative_config = {"method": method, "num_speculative_tokens": k}
        if export_format is not None:  # e.g. P-EAGLE's parallel_drafting
            fmt = families.export_formats()[export_format][1]
            served.speculative_config.update(dict(fmt.speculative_config))
        if method == "ngram":
            served.speculative_config.update(
                prompt_lookup_min=ngram_min, prompt_lookup_max=ngram_max
            )
        plans.append(served)
    return plans, skipped


def read_spec_metrics(url: str, timeout: float = 30.0) -> dict[str, Any]:
    """vLLM's speculative counters from ``GET <url>/metrics``, summed over engines.

    Returns:
        ``{"drafts", "draft_tokens", "accepted", "accepted_per_pos": [...]}`` (zeros for a
        server without speculative decoding).
    """
    base = url.rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(base + "/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    return parse_spec_metrics(text)


def parse_spec_metrics(text: str) -> dict[str, Any]:
    """:func:`read_spec_metrics` on the Prometheus text itself."""
    names = {
        "vllm:spec_decode_num_drafts_total": "drafts",
        "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens_total": "accepted",
    }
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in names:
            out[names[name]] += int(value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = _POSITION.search(labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0) + int(value)
    out["accepted_per_pos"] = [per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1)]
    return out


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    n = max(len(after["accepted_per_pos"]), len(before["accepted_per_pos"]))

    def at(v: list[int], i: int) -> int:
        return v[i] if i < len(v) else 0

    out = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
    out["accepted_per_pos"] = [
        at(after["accepted_per_pos"], i) - at(before["accepted_per_pos"], i) for i in range(n)
    ]
    return out


def _percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation, as numpy's default."""
    xs = sorted(values)
    if not xs:
        return 0.0
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _settled(
    metrics: Callable[[], dict[str, Any]], pause: float = 0.5, limit: float = 10.0
) -> dict[str, Any]:
    """The counters once two reads ``pause`` seconds apart agree: vLLM publishes an engine
    step's stats a little after the responses it produced have gone out."""
    last = metrics()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(pause)
        now = metrics()
        if now == last:
            break
        last = now
    return last


def measure(
    client: Any,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    concurrency: int,
    metrics: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Send every prompt with ``concurrency`` requests in flight; timings, outputs, τ.

    Args:
        client: an :class:`~draftsmith.train.datagen.endpoint.EndpointClient` of the server.
        model: the served model name.
        prompts: token ids per prompt (chat template applied).
        max_new_tokens: ``max_tokens`` of each request.
        stop_token_ids: end-of-turn ids.
        concurrency: client threads (requests in flight).
        metrics: reads the server's speculative counters (None: τ not reported).

    Returns:
        A JSON-safe dict: ``concurrency``, ``requests``, ``new_tokens``, ``wall_s``,
        ``tokens_per_second``, ``latency_p50_s``, ``latency_p95_s``,
        ``request_tokens_per_second_mean``, ``outputs`` (token ids per prompt) and, with
        ``metrics``, the speculative counters and τ / α.
    """
    greedy = SamplingParams(0.0, 0, 1.0)

    def one(ids: Sequence[int]) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        answer = client.complete(
            model,
            ids,
            max_new_tokens=max_new_tokens,
            sampling=greedy,
            stop_token_ids=stop_token_ids,
            seed=None,
        )
        return time.perf_counter() - t0, list(answer.token_ids or [])

    before = _settled(metrics) if metrics else None
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        done = list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    after = _settled(metrics) if metrics else None
    latencies = [t for t, _ in done]
    outputs = [ids for _, ids in done]
    tokens = sum(len(ids) for ids in outputs)
    out: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": len(prompts),
        "new_tokens": tokens,
        "wall_s": wall,
        "tokens_per_second": tokens / wall if wall else 0.0,
        "latency_p50_s": _percentile(latencies, 0.5),
        "latency_p95_s": _percentile(latencies, 0.95),
        "request_tokens_per_second_mean": statistics.fmean(len(ids) / t for t, ids in done if t > 0)
        if done
        else 0.0,
        "outputs": outputs,
    }
    if before is not None and after is not None:
        spec = _delta(after, before)
        out["spec_decode"] = spec
        if spec["drafts"]:
            forwards = max(tokens - spec["accepted"], 1)
            out["acceptance_length"] = tokens / forwards
            out["acceptance_length_per_draft"] = 1.0 + spec["accepted"] / spec["drafts"]
            out["acceptance_rate_per_position"] = [
                a / spec["drafts"] for a in spec["accepted_per_pos"]
            ]
    return out


def compare_with_ours(
    levels: list[dict[str, Any]],
    plain: dict[int, dict[str, Any]] | None,
    ours: dict[str, Any] | None,
    k: int,
    dtype: str,
) -> None:
    """Add speedups over the plain server, identity with it and our τ to each level (in place).

    Args:
        levels: one server's :func:`measure` results.
        plain: the plain server's results by concurrency (None: no plain server).
        ours: our greedy evaluate result for the same drafter, its ``per_prompt`` restricted
            to the served prompts (None: not measured by us).
        k: draft tokens per step.
        dtype: the target's dtype in our run.
    """
    our_tau = None
    if ours is not None and ours.get("per_prompt"):
        our_tau = summarize_entries(ours["per_prompt"], k, dtype)["acceptance_length"]
    for level in levels:
        base = (plain or {}).get(level["concurrency"])
        if base is not None:
            level["plain_tokens_per_second"] = base["tokens_per_second"]
            level["speedup"] = (
                level["tokens_per_second"] / base["tokens_per_second"]
                if base["tokens_per_second"]
                else None
            )
            same = [a == b for a, b in zip(level["outputs"], base["outputs"], strict=True)]
            level["identical_to_plain"] = sum(same)
        if our_tau is not None and level.get("acceptance_length"):
            gap = level["acceptance_length"] / our_tau - 1.0
            level["tau_ours"] = our_tau
            level["tau_gap"] = gap
            level["tau_gap_flag"] = abs(gap) > TAU_GAP


@contextlib.contextmanager
def serving(plan: ServedPlan, target: str, *, python: str | None, dtype: str, max_num_seqs: int):
    """The server of ``plan`` for the body of a ``with``: its URL (started when the plan has
    none, and stopped after)."""
    if plan.url is not None:
        yield plan.url
        return
    from ..datagen.vllm_server import local_vllm_server

    extra = ["--enforce-eager", "--max-num-seqs", str(max_num_seqs), "--seed", "0"]
    if plan.speculative_config is not None:
        extra += ["--speculative-config", config_arg(plan.speculative_config)]
    with local_vllm_server(target, python=python, dtype=dtype, extra_args=extra) as url:
        yield url


def vllm_version(python: str | Path) -> str | None:
    """The vLLM version of a venv's python (None when it cannot say)."""
    import subprocess

    try:
        out = subprocess.run(
            [str(python), "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout else None


# --------------------------------------------------------------------------------------------
# The bench's served stage
# --------------------------------------------------------------------------------------------


def _export_k(export: Path) -> int:
    """The ``num_speculative_tokens`` a speculators-format export declares."""
    config = json.loads((Path(export) / "config.json").read_text())
    return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "drafter"


def _our_result(report_runs: list, ecfg: dict[str, Any], spec: str) -> dict[str, Any] | None:
    """Our greedy evaluate result for ``spec`` (None when the bench has no greedy run of it)."""
    for t, raw, _ in report_runs:
        if t != 0 or spec not in ecfg["drafter"]:
            continue
        data = json.loads(Path(raw).read_text())
        methods = data.get("methods", [data])
        return methods[ecfg["drafter"].index(spec)]
    return None


def config_arg(config: dict[str, Any]) -> str:
    """The ``--speculative-config`` value the bench passes to ``vllm serve`` for ``config``."""
    return json.dumps(config)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _measure_levels(
    plan: ServedPlan,
    target: str,
    *,
    python: str | Path | None,
    dtype: str,
    concurrency: Sequence[int],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
) -> list[dict[str, Any]]:
    """Serve ``plan`` (:func:`serving`) and :func:`measure` it at each concurrency level.

    Raises:
        RunError, UsageError, OSError: the server did not start or stopped answering.
    """
    from ..datagen.endpoint import EndpointClient

    print(f"[served] {plan.label}: starting vLLM ...", flush=True)
    with serving(plan, target, python=python, dtype=dtype, max_num_seqs=max(concurrency)) as url:
        client = EndpointClient(url, max_retries=2)
        model = client.connect(None).model  # the one model it serves
        # One short request first: the first request pays one-off costs.
        measure(
            client,
            model,
            prompts[:1],
            max_new_tokens=8,
            stop_token_ids=stop_token_ids,
            concurrency=1,
        )
        levels = []
        for c in concurrency:
            level = measure(
                client,
                model,
                prompts,
                max_new_tokens=max_new_tokens,
                stop_token_ids=stop_token_ids,
                concurrency=c,
                metrics=lambda url=url: read_spec_metrics(url),
            )
            levels.append(level)
            tau = level.get("acceptance_length")
            print(
                f"[served] {plan.label} c={c}: {level['tokens_per_second']:.1f} tok/s, "
                f"p50 {level['latency_p50_s']:.2f} s, p95 {level['latency_p95_s']:.2f} s"
                + (f", τ {tau:.2f}" if tau else ""),
                flush=True,
            )
    return levels


def _serve_schedule(
    plan: ServedPlan,
    levels: list[dict[str, Any]],
    plain: dict[int, dict[str, Any]] | None,
    target: str,
    cfg: Any,
    setting: dict[str, Any],
) -> dict[str, Any]:
    """The drafter's recommended draft length per batch size and, with ``cfg.served_schedule``,
    its own server measured at every level against the best of plain and fixed k.

    Args:
        plan: the drafter's plan (its fixed-k ``speculative_config`` complete, export included).
        levels: its fixed-k measurements.
        plain: the plain server's by concurrency (None: not measured, then no schedule).
        target: the served target.
        cfg: the bench's config (``served_schedule``).
        setting: :func:`_measure_levels`'s keyword arguments.

    Returns:
        The drafter's ``schedule`` entry: :meth:`Schedule.to_json` plus ``speculative_config``
        and ``speculative_config_json`` (the exact ``--speculative-config``; both None when the
        advice is not to speculate) and, when served, ``levels`` (each with
        ``best_tokens_per_second``, ``best_of`` and ``schedule_ok``) or ``error``; or, when
        the schedule is the fixed k at every load, ``same_as_fixed`` (the fixed config, not
        served again).
    """
    if plain is None:
        return {"entries": None, "summary": "no schedule: the plain server was not measured"}
    k = int(plan.speculative_config.get("num_speculative_tokens") or 0)
    try:
        schedule = recommend_schedule(levels, plain, k, max_num_seqs=max(setting["concurrency"]))
    except ValueError as exc:
        return {"entries": None, "summary": f"no schedule: {exc}"}
    out = schedule.to_json()
    config = schedule.speculative_config(plan.speculative_config)
    out["speculative_config"] = config
    out["speculative_config_json"] = None if config is None else config_arg(config)
    print(f"[served] {plan.label}: schedule: {schedule.summary()}", flush=True)
    if config is not None and {entry[2] for entry in schedule.entries} == {k}:
        # The fixed k at every load is the fixed-k server measured above: its figures are the
        # schedule's, its config the flag to serve (no per-batch-size list needed), and a
        # server of the same drafter and k is not started again to measure the same thing.
        out["speculative_config"] = dict(plan.speculative_config)
        out["speculative_config_json"] = config_arg(out["speculative_config"])
        out["same_as_fixed"] = True
        print(
            f"[served] {plan.label} schedule: k={k} at every load, the fixed-k server above",
            flush=True,
        )
        return out
    if config is None or not cfg.served_schedule:
        return out
    sched = ServedPlan(
        label=f"{plan.label} schedule", method=plan.method, speculative_config=config
    )
    try:
        measured = _measure_levels(sched, target, **setting)
    except (RunError, UsageError, OSError) as exc:
        out["error"] = f"serving failed: {_first_line(exc)}"
        print(f"[served] {sched.label}: failed: {_first_line(exc)}", flush=True)
        return out
    fixed = {level["concurrency"]: level for level in levels}
    for level in measured:
        c = level["concurrency"]
        rivals = {
            name: server[c]["tokens_per_second"]
            for name, server in (("plain", plain), ("fixed", fixed))
            if c in server
        }
        best_of = max(rivals, key=rivals.__getitem__)  # plain first: a tie names plain
        level["best_of"] = best_of
        level["best_tokens_per_second"] = rivals[best_of]
        # Within the noise margin counts as a match: the schedule is measured once, like them.
        level["schedule_ok"] = level["tokens_per_second"] >= rivals[best_of] * (1 - schedule.noise)
    out["levels"] = measured
    # Where it stops drafting (k = 0) vLLM still runs the drafter's forward, to keep its KV
    # cache in sync (v1/spec_decode/llm_base_proposer.py, propose): a cost only a server with no
    # drafter avoids. Recorded where it shows beyond the noise.
    off = {c for c, chosen in schedule.per_level.items() if chosen["k"] == 0}
    out["k0_cost"] = [
        {"concurrency": lv["concurrency"], "below_plain": 1 - lv["tokens_per_second"] / p}
        for lv in measured
        if lv["concurrency"] in off
        and lv["concurrency"] in plain
        and (p := plain[lv["concurrency"]]["tokens_per_second"]) > 0
        and lv["tokens_per_second"] < p * (1 - schedule.noise)
    ]
    return out


def serve(cfg: Any, report: dict[str, Any], runs: list, stem: Path) -> dict[str, Any]:
    """The bench's served stage: plan, export, serve and measure; the report's ``served``.

    Each drafter served with a ``speculative_config`` also gets its recommended draft length
    per batch size (its row's ``schedule``, :func:`_serve_schedule`), served and measured at
    every level too when ``cfg.served_schedule`` is on.

    Args:
        cfg: the bench's config (``vllm_python``, ``vllm_url``, ``served_concurrency``,
            ``served_limit``, ``served_schedule``).
        report: the bench report (our figures), for the target, prompts and dtype.
        runs: ``(temperature, results file, command)`` of the bench's evaluate runs.
        stem: the bench's output stem; exports go to ``<stem>_served/``.
    """
    from ..data.prompts import load_prompts, render_prompt
    from ..export.command import main as export_main
    from ..target_model.load import load_tokenizer, prepare_target

    ecfg = json.loads(Path(runs[0][1]).read_text())["config"]
    split = {"auto": None if ecfg.get("prompts") else "heldout", "all": None}.get(
        ecfg["split"], ecfg["split"]
    )
    records = load_prompts(ecfg.get("prompts"), split=split, limit=ecfg.get("limit"))
    records = records[: cfg.served_limit]
    target = prepare_target(ecfg.get("target"), cache_dir=ecfg.get("cache_dir"), quiet=True)
    tokenizer = load_tokenizer(target)
    prompts = [render_prompt(tokenizer, r) for r in records]
    from transformers import GenerationConfig

    eos = {tokenizer.eos_token_id}
    with contextlib.suppress(OSError):
        gen_eos = GenerationConfig.from_pretrained(target).eos_token_id
        eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    eos.discard(None)
    dtype = ecfg.get("dtype", "float32")
    k = ecfg["k"]
    if cfg.vllm_url:
        plans, skipped = parse_urls(cfg.vllm_url, ecfg["drafter"]), []
    else:
        plans, skipped = served_plans(ecfg["drafter"], k, ecfg["ngram_min"], ecfg["ngram_max"])
    folder = stem.with_name(stem.name + "_served")
    served: dict[str, Any] = {
        "engine": "vllm",
        "vllm_version": vllm_version(cfg.vllm_python) if cfg.vllm_python else None,
        "python": str(cfg.vllm_python) if cfg.vllm_python else None,
        "target": str(target),
        "dtype": dtype,
        "prompts": len(prompts),
        "prompt_ids": [str(r.id) for r in records],
        "max_new_tokens": ecfg["max_new_tokens"],
        "concurrency": list(cfg.served_concurrency),
        "tau_gap_threshold": TAU_GAP,
        "schedule_noise": NOISE,
        "served_schedule": bool(cfg.served_schedule),
        "rows": [],
        "skipped": skipped,
    }
    plain: dict[int, dict[str, Any]] | None = None
    setting = {
        "python": cfg.vllm_python,
        "dtype": dtype,
        "concurrency": list(cfg.served_concurrency),
        "prompts": prompts,
        "max_new_tokens": ecfg["max_new_tokens"],
        "stop_token_ids": sorted(eos),
    }
    for plan in plans:
        row: dict[str, Any] = {"label": plan.label, "method": plan.method}
        if plan.export_format is not None:
            out = folder / "exports" / _slug(plan.label)
            argv = ["export", "--format", plan.export_format, "--checkpoint", plan.checkpoint]
            code = export_main([*argv[1:], "--out", str(out), "--overwrite"])
            if code != 0:
                skipped.append({"drafter": plan.label, "reason": f"export failed (exit {code})"})
                continue
            plan.speculative_config["model"] = str(out)
            row["export"] = str(out)
            if families.export_formats()[plan.export_format][1].k_from_export:
                fixed = _export_k(out)
                if fixed != plan.speculative_config["num_speculative_tokens"]:
                    row["note"] = (
                        f"served at k = {fixed}, the export's own "
                        f"(asked {plan.speculative_config['num_speculative_tokens']})"
                    )
                plan.speculative_config["num_speculative_tokens"] = fixed
        row["speculative_config"] = plan.speculative_config
        try:
            levels = _measure_levels(plan, str(target), **setting)
        except (RunError, UsageError, OSError) as exc:
            first = _first_line(exc)
            skipped.append({"drafter": plan.label, "reason": f"serving failed: {first}"})
            print(f"[served] {plan.label}: failed: {first}", flush=True)
            continue
        if plan.label == "plain":
            plain = {level["concurrency"]: level for level in levels}
        row["levels"] = levels
        if plan.speculative_config is not None:
            row["schedule"] = _serve_schedule(plan, levels, plain, str(target), cfg, setting)
        served["rows"].append(row)
    ids = set(served["prompt_ids"])
    for row in served["rows"]:
        ours = None
        if row["label"] != "plain":
            ours = _our_result(runs, ecfg, row["label"])
            if ours is not None:
                subset = [p for p in ours["per_prompt"] if str(p["id"]) in ids]
                ours = {**ours, "per_prompt": subset} if len(subset) == len(ids) else None
        compare_with_ours(row["levels"], plain, ours, k, dtype)
        if row["label"] == "plain":
            for level in row["levels"]:
                level.pop("identical_to_plain", None)
        if (row.get("schedule") or {}).get("levels"):
            # The schedule server drafts too: its speedup, identity and τ read as the fixed one's.
            compare_with_ours(row["schedule"]["levels"], plain, ours, k, dtype)
            # Where the schedule chose k = 0 it barely drafts (only while fewer requests are in
            # flight), so its τ (~1) is no check of the export against ours: no gap there.
            off = {
                entry["concurrency"]
                for entry in row["schedule"].get("per_level", [])
                if entry.get("k") == 0
            }
            for level in row["schedule"]["levels"]:
                if level["concurrency"] in off:
                    level.pop("tau_gap", None)
                    level.pop("tau_gap_flag", None)
    for row in served["rows"]:
        for level in [*row["levels"], *(row.get("schedule") or {}).get("levels", [])]:
            level.pop("outputs", None)
    return served


def _cells(label: str, level: dict[str, Any], schedule: str) -> list[str]:
    """One row of the served table (:data:`SERVED_COLUMNS`)."""
    from .text import fmt_number

    gap = level.get("tau_gap")
    return [
        label,
        str(level["concurrency"]),
        fmt_number(level["tokens_per_second"], ".1f"),
        fmt_number(level.get("speedup"), ".2f", "x"),
        f"{level['latency_p50_s']:.2f} / {level['latency_p95_s']:.2f}",
        fmt_number(level.get("acceptance_length")),
        fmt_number(level.get("tau_ours")),
        "-"
        if gap is None
        else f"{100 * gap:+.0f}%" + (" **over 10%**" if level["tau_gap_flag"] else ""),
        "-"
        if "identical_to_plain" not in level
        else f"{level['identical_to_plain']}/{level['requests']}",
        schedule,
    ]


def served_rows(served: dict[str, Any] | None) -> list[list[str]]:
    """The served table's rows: one per server and concurrency.

    A drafter's fixed-k rows name the draft length its schedule chose at that level (``k=K`` or
    ``off``); the schedule server's rows (``LABEL schedule``) whether it matched the best of
    the plain and fixed-k servers there.
    """
    rows = []
    for row in (served or {}).get("rows", []):
        schedule = row.get("schedule") or {}
        chosen = {lv["concurrency"]: lv["k"] for lv in schedule.get("per_level", [])}
        for level in row["levels"]:
            k = chosen.get(level["concurrency"])
            choice = "-" if k is None else (f"k={k}" if k else "off")
            rows.append(_cells(row["label"], level, choice))
        for level in schedule.get("levels", []):
            verdict = "ok" if level["schedule_ok"] else "**below**"
            best = f"{level['best_of']} {level['best_tokens_per_second']:.1f}"
            rows.append(_cells(f"{row['label']} schedule", level, f"{verdict} ({best})"))
    return rows


def _schedules(served: dict[str, Any] | None):
    """Each drafter's schedule: ``(label, schedule, arg)``, arg the shell-quoted
    ``--speculative-config VALUE`` (None when the drafter should not speculate)."""
    for row in (served or {}).get("rows", []):
        schedule = row.get("schedule")
        if schedule:
            config = schedule.get("speculative_config_json")
            arg = shlex.join(["--speculative-config", config]) if config else None
            yield row["label"], schedule, arg


SAME_AS_FIXED = "the same k at every load: the fixed-k server measured above (not served again)"


def schedule_markdown(served: dict[str, Any] | None) -> list[str]:
    """The report's load-schedule lines: per drafter, the recommendation from the served
    levels and the exact ``--speculative-config`` to give ``vllm serve`` (none when the
    drafter should not speculate at any measured load)."""
    lines = []
    for label, schedule, arg in _schedules(served):
        lines.append(f"- `{label}`: {schedule['summary']}")
        if arg:
            lines.append(f"  - serve with `{arg}`")
        if schedule.get("same_as_fixed"):
            lines.append(f"  - {SAME_AS_FIXED}")
        if schedule.get("error"):
            lines.append(f"  - the schedule server failed: {schedule['error']}")
        cost = schedule.get("k0_cost") or []
        if cost:
            where = ", ".join(
                f"{100 * c['below_plain']:.0f} % below plain at {c['concurrency']} in flight"
                for c in cost
            )
            lines.append(
                f"  - where it stops drafting it still ran {where}: at k = 0 vLLM still runs "
                "the drafter's forward to keep its KV cache in sync, so under a load that stays "
                f"at {min(c['concurrency'] for c in cost)} or more in flight a server without "
                "a drafter is faster"
            )
    if lines:
        lines = [
            "### Load schedule",
            "",
            "The draft length per load that vLLM's `num_speculative_tokens_per_batch_size` "
            "should follow, from the measured levels above (k = 0, plain decoding, where "
            "speculation loses):",
            "",
            *lines,
            "",
        ]
    return lines


SERVED_COLUMNS = [
    "server",
    "concurrent",
    "tok/s",
    "speedup",
    "latency p50 / p95 (s)",
    "τ vLLM",
    "τ ours",
    "τ gap",
    "identical to plain",
    "schedule",
]


def served_lines(served: dict[str, Any] | None) -> list[str]:
    """Console lines: each server's figures per concurrency, each drafter's schedule (the exact
    ``--speculative-config`` and, when served, each level against the best of plain and fixed
    k), skipped drafters."""
    if not served:
        return []
    lines = []
    for row in served["rows"]:
        for level in row["levels"]:
            label, c, tps, speedup, lat, tau, ours, gap, same, _ = _cells(row["label"], level, "")
            lines.append(
                f"served: {label} c={c}: {tps} tok/s ({speedup}), latency p50/p95 {lat} s, "
                f"τ {tau} (ours {ours}, gap {gap}), identical {same}"
            )
    for label, schedule, arg in _schedules(served):
        lines.append(f"schedule: {label}: {schedule['summary']}")
        if arg:
            lines.append(f"schedule: {label}: {arg}")
        if schedule.get("same_as_fixed"):
            lines.append(f"schedule: {label}: {SAME_AS_FIXED}")
        if schedule.get("error"):
            lines.append(f"schedule: {label}: {schedule['error']}")
        for level in schedule.get("levels", []):
            lines.append(
                f"schedule: {label} c={level['concurrency']}: schedule "
                f"{level['tokens_per_second']:.1f} tok/s vs best of plain/fixed "
                f"{level['best_tokens_per_second']:.1f} ({'ok' if level['schedule_ok'] else 'below'})"
            )
    for skip in served["skipped"]:
        lines.append(f"not served: {skip['drafter']}: {skip['reason']}")
    return lines
