"""The one JSON of ``scripts/gpu_check.sh``: every stage's exit code, time and figures, and "ok".

Run by the script as its last step::

    python scripts/gpu_check_summary.py WORK OUT DEVICE STARTED TRAIN_MINUTES EVAL_PROMPTS ARGS

``WORK`` holds what the stages left: ``<stage>.status`` (exit code and milliseconds),
``<stage>.log``, ``<stage>.skipped`` (why a stage did not run), ``tests.xml`` (the device tests'
JUnit report), ``eagle3/training_metrics.json`` and the evaluations' ``fp32.json``,
``greedy.json`` and ``t07.json``.

"ok" means what it says: every stage that ran exited 0, no device test failed or errored, and
every fp32 greedy output is identical to plain decoding's (the lossless claim, which holds
exactly in fp32). bf16 greedy outputs that differ at near-ties are reported with their logit
gaps (``eval_greedy``) and do not gate "ok"; a sampled run (``eval_t07``) differs by design.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

EVAL_KEYS = (
    "num_prompts",
    "acceptance_length",
    "acceptance_rate_per_position",
    "tokens_per_second",
    "baseline_tokens_per_second",
    "speedup",
    "speedup_vs_fastest_plain",
    "identical_to_target",
    "near_ties",
    "draft_share",
)
EVALS = (("eval_fp32", "fp32.json"), ("eval_greedy", "greedy.json"), ("eval_t07", "t07.json"))


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def stage_records(work: Path) -> dict[str, dict[str, Any]]:
    """Each stage's exit code, seconds, log tail and figures, read from ``work``."""
    stages: dict[str, dict[str, Any]] = {}
    for status in sorted(work.glob("*.status")):
        rc, millis = status.read_text().split()
        log_path = work / f"{status.stem}.log"
        log = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
        stages[status.stem] = {
            "exit_code": int(rc),
            "seconds": round(int(millis) / 1000, 1),
            "log_tail": log[-15:] if int(rc) else log[-3:],
        }
    if "facts" in stages and (work / "facts.log").exists():
        lines = (work / "facts.log").read_text().strip().splitlines()
        with contextlib.suppress(ValueError, IndexError):
            stages["facts"]["facts"] = json.loads(lines[-1])
    if "tests" in stages and (work / "tests.xml").exists():
        suite = ET.parse(work / "tests.xml").getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        keys = ("tests", "failures", "errors", "skipped")
        stages["tests"].update({k: int(suite.get(k, 0)) for k in keys})
    metrics = _load(work / "eagle3" / "training_metrics.json")
    if metrics and "train" in stages:
        tps = [e["train/tokens_per_s"] for e in metrics["train_log"] if "train/tokens_per_s" in e]
        stages["train"].update(
            steps=metrics["steps"],
            train_seconds=metrics["train_seconds"],
            tokens_per_s_last=tps[-1] if tps else None,
            tokens_per_s_mean=sum(tps) / len(tps) if tps else None,
            final_validation=metrics.get("final_validation"),
            device=metrics.get("machine", {}).get("device"),
        )
    for name, file in EVALS:
        r = _load(work / file)
        if not r or name not in stages:
            continue
        stages[name].update({k: r.get(k) for k in EVAL_KEYS if k in r})
        same = [p.get("identical_to_target") for p in r.get("per_prompt", [])]
        if name != "eval_t07" and same and None not in same:
            stages[name]["identical_rate"] = sum(same) / len(same)
        stages[name]["device"] = r.get("machine", {}).get("device")
    for skipped in sorted(work.glob("*.skipped")):
        stages[skipped.stem] = {"skipped": skipped.read_text().strip()}
    return stages


def problems_of(stages: dict[str, dict[str, Any]]) -> list[str]:
    """Why the check is not ok (empty: ok); a stage marked skipped is no problem."""
    ran = {n: s for n, s in stages.items() if "skipped" not in s}
    problems = [f"{n}: exit {s['exit_code']}" for n, s in ran.items() if s["exit_code"] != 0]
    tests = stages.get("tests", {})
    if tests.get("failures") or tests.get("errors"):
        problems.append(
            f"tests: {tests.get('failures', 0)} failed, {tests.get('errors', 0)} errors"
        )
    if "eval_fp32" not in ran:
        problems.append("eval_fp32: did not run (the lossless check in fp32 gates ok)")
    elif ran["eval_fp32"].get("identical_rate") != 1:
        rate = ran["eval_fp32"].get("identical_rate")
        problems.append(
            f"eval_fp32: greedy outputs identical to plain decoding: {rate} (must be 1)"
        )
    return problems


def main(argv: list[str]) -> int:
    work, out, device, started, train_minutes, eval_prompts, args = argv
    stages = stage_records(Path(work))
    problems = problems_of(stages)
    ok = not problems
    result: dict[str, Any] = {
        "check": "scripts/gpu_check.sh",
        "device": device,
        "ok": ok,
        "problems": problems,
        "train_minutes": float(train_minutes),
        "eval_prompts": int(eval_prompts),
        "wall_seconds": round(time.time() - float(started), 1),
        "stages": stages,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        from draftsmith.train.runinfo import git_facts, run_info

        result.update({k: v for k, v in run_info().items() if k != "command"})
        result.update(git_facts())  # the full hash, and where it came from
    except Exception as exc:
        result["run_info_error"] = f"{type(exc).__name__}: {exc}"
    result["command"] = f"bash scripts/gpu_check.sh {args}".strip()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"gpu_check: {'ok' if ok else 'FAILED'} in {result['wall_seconds']:.0f}s -> {path}")
    for name, s in stages.items():
        if "skipped" in s:
            print(f"  {name:12s} skipped: {s['skipped']}")
        else:
            print(f"  {name:12s} exit {s['exit_code']}  {s['seconds']:7.1f}s")
    for problem in problems:
        print(f"  not ok: {problem}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
