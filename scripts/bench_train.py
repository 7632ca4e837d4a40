"""Training throughput of the EAGLE-3 step: today's recipe vs faster variants, interleaved.

Every variant trains its own copy of the same freshly initialised drafter on the same batches
(same samples, same order) with the shipped model settings (1 decoder layer, draft vocab 8,192,
micro-batch 4, AdamW). Variants run round-robin — a few optimizer steps of each per round — so a
machine that slows down mid-run slows every variant alike; the report gives each variant's
tokens/s and optimizer steps/min and its ratio to the first variant ("today").

Variants (name: what changes against today):

* ``today``: online target features (fp32 target forward inside the step), fp32 drafter, 7 TTT
  steps, the target's distribution at every position.
* ``labels``: the target's distribution only at supervised positions.
* ``bf16``: + bf16 autocast of the drafter forward and backward (what ``mixed_precision: bf16``
  does), + a bf16 target for the online features.
* ``offline``: + features read from a hidden-state cache (``draftsmith data cache``) instead of
  the target forward.
* ``offline-ttt3``: + 3 TTT steps instead of 7 (vLLM speculators' and ModelOpt's default).

Run::

    python scripts/bench_train.py --data ~/.cache/draftsmith/data/<distilled>.jsonl \\
        --samples 48 --rounds 3 --out bench/training/train_throughput.json

Writes the JSON (command, versions, machine, per-variant figures) and a PNG bar chart beside it.

``--recipe-step-time`` instead times the real recipes (``recipes/eagle.py``,
``recipes/distill.py``) of this tree against those of a reference source tree (``--ref-src``,
e.g. a worktree of the last release): each round runs every recipe once from each tree, in
alternating order, for ``--steps`` optimizer steps on the recipe's config (``--eagle-config``,
``--distill-config``) without validation or checkpoints, in a fresh output dir. Seconds per
optimizer step come from the run's own train log (``train/minutes`` between its first and last
logged step), so loading and the first, warm-up steps are left out. The JSON holds each round's
figure of both trees and their ratio (this tree / reference: above 1 is slower)::

    python scripts/bench_train.py --recipe-step-time --ref-src /tmp/base --rounds 3 \\
        --steps 30 --out bench/training/recipe_step_time.json

``--tiny`` runs it on a tiny random target and data made in a temp dir (seconds; a check that
it works, not a measurement).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Variant:
    name: str
    offline: bool
    bf16: bool
    ttt_steps: int
    supervised_labels_only: bool


VARIANTS = [
    Variant("today", offline=False, bf16=False, ttt_steps=7, supervised_labels_only=False),
    Variant("labels", offline=False, bf16=False, ttt_steps=7, supervised_labels_only=True),
    Variant("bf16", offline=False, bf16=True, ttt_steps=7, supervised_labels_only=True),
    Variant("offline", offline=True, bf16=True, ttt_steps=7, supervised_labels_only=True),
    Variant("offline-ttt3", offline=True, bf16=True, ttt_steps=3, supervised_labels_only=True),
]


REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("train", "heads", "recipes")  # draftsmith.<name> = <tree>/<name>
RECIPE_CONFIGS = {
    "eagle": "recipes/configs/eagle3_smollm2.yaml",
    "distill": "recipes/configs/distill_smollm2.yaml",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="distilled conversations (JSONL); the variants' mode")
    parser.add_argument("--samples", type=int, default=48, help="training samples used")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="round-robin rounds")
    parser.add_argument("--steps-per-round", type=int, default=3, help="optimizer steps each")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--variants", nargs="+", default=[v.name for v in VARIANTS])
    parser.add_argument("--out", default=None, help="default: bench/training/train_throughput.json")
    recipe_mode = parser.add_argument_group("--recipe-step-time: the recipes of two trees")
    recipe_mode.add_argument("--recipe-step-time", action="store_true")
    recipe_mode.add_argument("--ref-src", type=Path, help="the reference source tree")
    recipe_mode.add_argument(
        "--ref-pythonpath",
        type=Path,
        help="a dir holding draftsmith/{train,heads,recipes} of --ref-src (default: made)",
    )
    recipe_mode.add_argument("--recipes", nargs="+", default=list(RECIPE_CONFIGS))
    recipe_mode.add_argument("--eagle-config", default=RECIPE_CONFIGS["eagle"])
    recipe_mode.add_argument("--distill-config", default=RECIPE_CONFIGS["distill"])
    recipe_mode.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    recipe_mode.add_argument(
        "--log-every", type=int, default=None, help="default: steps // 3 (timed: the rest)"
    )
    recipe_mode.add_argument(
        "--recipe-args", default="", help="more recipe flags for both trees (one string)"
    )
    recipe_mode.add_argument("--tiny", action="store_true", help="tiny random target and data")
    args = parser.parse_args(argv)
    if args.recipe_step_time:
        if args.ref_src is None:
            parser.error("--recipe-step-time needs --ref-src")
        return recipe_step_time(args)
    if args.data is None:
        parser.error("--data is required (or give --recipe-step-time)")
    args.out = args.out or "bench/training/train_throughput.json"
    if args.threads:
        torch.set_num_threads(args.threads)

    from draftsmith.heads.eagle import EagleConfig, build_drafter
    from draftsmith.train.data.tokenize import build_dataset
    from draftsmith.train.data.vocab import draft_vocab, token_counts
    from draftsmith.train.features.cache_write import build_cache
    from draftsmith.train.features.source import feature_source
    from draftsmith.train.objectives.eagle_ttt import eagle3_ttt_loss
    from draftsmith.train.runinfo import run_info
    from draftsmith.train.staged import write_json_atomic
    from draftsmith.train.target_model.load import load_target

    info = run_info()
    load_before = os.getloadavg()
    target, tok = load_target(dtype=torch.float32)
    target_bf16, _ = load_target(dtype=torch.bfloat16)
    data, summary = build_dataset(args.data, tok, max_length=args.max_length, split=None)
    data = data.select(range(min(args.samples, len(data))))
    eagle_cfg = EagleConfig.from_target(target.config, 3, draft_vocab_size=8192)
    layers = list(eagle_cfg.train_layers)
    counts = token_counts(data, target.config.vocab_size, max_length=args.max_length)
    d2t, t2d = draft_vocab(counts, 8192, always_include=[tok.eos_token_id])
    base = build_drafter(target, eagle_cfg, d2t=d2t, t2d=t2d)

    # The offline cache of exactly these samples (not timed: built once, read every epoch).
    cache_dir = Path(tempfile.mkdtemp(prefix="bench_train_cache_"))
    t0 = time.perf_counter()
    build_cache(
        target, data, cache_dir, layers, dtype="bf16", max_length=args.max_length, progress=False
    )
    cache_seconds = time.perf_counter() - t0
    offline = feature_source(
        "offline", layers=layers, cache=cache_dir, max_length=args.max_length, dtype=torch.float32
    )
    order = list(range(len(data)))
    batches = [order[i : i + args.batch_size] for i in range(0, len(order), args.batch_size)]
    lm_head = target.get_output_embeddings()

    # Online features are cast to bf16 like the cache stores them: both paths feed the drafter the
    # same precision, so only the cost differs.
    online = {
        bf16: feature_source(
            "online",
            layers=layers,
            data=data,
            target=model,
            max_length=args.max_length,
            dtype=torch.bfloat16,
        )
        for bf16, model in ((False, target), (True, target_bf16))
    }

    def online_batch(idx: list[int], bf16: bool) -> dict:
        src = online[bf16]
        return src.complete(src.collate([src.dataset[i] for i in idx]))

    def offline_batch(idx: list[int]) -> dict:
        return offline.complete(offline.collate([offline.dataset[i] for i in idx]))

    chosen = [v for v in VARIANTS if v.name in args.variants]
    state = {}
    for v in chosen:
        drafter = copy.deepcopy(base).train()
        if v.bf16:  # what accelerate's mixed_precision="bf16" does to the prepared model
            drafter.forward = torch.autocast("cpu", dtype=torch.bfloat16)(drafter.forward)
        params = [p for p in drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=5e-4)
        state[v.name] = {
            "drafter": drafter,
            "opt": opt,
            "params": params,
            "seconds": 0.0,
            "tokens": 0,
            "steps": 0,
            "losses": [],
            "cursor": 0,
        }

    def step(v: Variant) -> None:
        s = state[v.name]
        idx = batches[s["cursor"] % len(batches)]
        s["cursor"] += 1
        t = time.perf_counter()
        batch = offline_batch(idx) if v.offline else online_batch(idx, v.bf16)
        loss, _ = eagle3_ttt_loss(
            s["drafter"],
            batch,
            lm_head,
            steps=v.ttt_steps,
            supervised_labels_only=v.supervised_labels_only,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(s["params"], 0.5)
        s["opt"].step()
        s["opt"].zero_grad()
        s["seconds"] += time.perf_counter() - t
        s["tokens"] += int(batch["attention_mask"].sum())
        s["steps"] += 1
        s["losses"].append(float(loss))

    for v in chosen:  # warm-up step each, untimed
        step(v)
        state[v.name].update(seconds=0.0, tokens=0, steps=0)
    for r in range(args.rounds):
        for v in chosen:
            for _ in range(args.steps_per_round):
                step(v)
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(
                f"{v.name} {state[v.name]['tokens'] / state[v.name]['seconds']:.0f} tok/s"
                for v in chosen
            ),
            flush=True,
        )

    ref = state[chosen[0].name]
    ref_tps = ref["tokens"] / ref["seconds"]
    rows = []
    for v in chosen:
        s = state[v.name]
        tps = s["tokens"] / s["seconds"]
        rows.append(
            {
                **v.__dict__,
                "tokens_per_s": tps,
                "steps_per_min": 60 * s["steps"] / s["seconds"],
                "speedup_vs_today": tps / ref_tps,
                "steps": s["steps"],
                "tokens": s["tokens"],
                "mean_loss": sum(s["losses"]) / len(s["losses"]),
            }
        )
    result = {
        "benchmark": "EAGLE-3 training step throughput (micro-batch, one optimizer step each)",
        "data": str(args.data),
        "samples": len(data),
        "data_summary": str(summary),
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "rounds": args.rounds,
        "steps_per_round": args.steps_per_round,
        "cache_build_seconds": cache_seconds,
        "variants": rows,
        "machine_load": {"before": load_before, "after": os.getloadavg()},
        **info,
    }
    out = Path(args.out)
    write_json_atomic(out, result)
    _plot(rows, out.with_suffix(".png"))
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(
            f"{r['name']:<{width}}  {r['tokens_per_s']:7.0f} tok/s  "
            f"{r['steps_per_min']:6.1f} steps/min  {r['speedup_vs_today']:.2f}x"
        )
    print(f"written {out} and {out.with_suffix('.png')}")
    return 0


# --- --recipe-step-time ------------------------------------------------------------------------


def recipe_step_time(args: argparse.Namespace) -> int:
    """Seconds per optimizer step of the real recipes, this tree vs ``--ref-src``, interleaved."""
    from draftsmith.train.runinfo import run_info
    from draftsmith.train.staged import write_json_atomic

    info = run_info()
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench_recipe_step_time_"))
    ref_src = args.ref_src.resolve()
    trees = {
        "current": {"src": REPO, "pythonpath": _package_dir(REPO, work / "pkg_current")},
        "reference": {
            "src": ref_src,
            "pythonpath": (args.ref_pythonpath or _package_dir(ref_src, work / "pkg_reference")),
        },
    }
    for tree in trees.values():
        tree["imports"] = _check_imports(tree["src"], tree["pythonpath"])
        tree["git"] = _git_state(tree["src"])
    log_every = args.log_every or max(1, args.steps // 3)
    if args.steps - log_every < 1:
        raise SystemExit("--steps must leave at least one timed step after the first log")
    common = [
        *("--max-steps", str(args.steps), "--log-every", str(log_every)),
        *("--eval-every", "0", "--save-every", "0", "--val-samples", "0"),
        *("--max-minutes", "None", "--report-to", "none", "--no-progress"),
    ]
    if args.threads:
        common += ["--threads", str(args.threads)]
    configs = {"eagle": args.eagle_config, "distill": args.distill_config}
    tiny = _tiny_inputs(work / "tiny") if args.tiny else None
    extra = shlex.split(args.recipe_args)

    def command(recipe: str, side: str, out_dir: Path) -> list[str]:
        src = trees[side]["src"]
        config = Path(configs[recipe])
        config = config if config.is_absolute() else REPO / config  # the same config for both
        argv = [sys.executable, str(src / "recipes" / f"{recipe}.py"), "--config", str(config)]
        argv += [*common, *(_tiny_flags(recipe, tiny) if tiny else []), *extra]
        return [*argv, "--output-dir", str(out_dir)]

    results: dict[str, dict] = {
        r: {"config": configs[r], "current": [], "reference": []} for r in args.recipes
    }
    for r in range(args.rounds):
        for recipe in args.recipes:
            # ABBA: which tree goes first alternates, so a machine that speeds up or slows down
            # during the bench favours neither.
            sides = ["current", "reference"] if (r % 2 == 0) else ["reference", "current"]
            for side in sides:
                out_dir = work / f"{recipe}_{side}_{r}"
                argv = command(recipe, side, out_dir)
                results[recipe].setdefault("commands", {})[side] = _display(argv, trees[side])
                seconds = _run_recipe(argv, trees[side]["pythonpath"], out_dir)
                results[recipe][side].append(seconds)
                print(
                    f"round {r + 1}/{args.rounds} {recipe} {side}: {seconds:.3f} s/step",
                    flush=True,
                )
    for row in results.values():
        cur, ref = statistics.median(row["current"]), statistics.median(row["reference"])
        row.update(
            current_median_s_per_step=cur,
            reference_median_s_per_step=ref,
            ratio=cur / ref,  # > 1: this tree is slower per optimizer step
            ratio_per_round=[c / f for c, f in zip(row["current"], row["reference"], strict=True)],
        )
    result = {
        "benchmark": "seconds per optimizer step of the training recipes: this tree vs a "
        "reference tree, same config and data, rounds interleaved (ABBA)",
        "rounds": args.rounds,
        "steps": args.steps,
        "log_every": log_every,
        "timed_steps": args.steps - log_every,
        "tiny": bool(args.tiny),
        "recipe_args": extra,
        "trees": {
            side: {k: str(v) if isinstance(v, Path) else v for k, v in tree.items()}
            for side, tree in trees.items()
        },
        "recipes": results,
        "machine_load": {"before": load_before, "after": os.getloadavg()},
        **info,
    }
    shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out or "bench/training/recipe_step_time.json")
    write_json_atomic(out, result)
    for recipe, row in results.items():
        print(
            f"{recipe}: this tree {row['current_median_s_per_step']:.3f} s/step, reference "
            f"{row['reference_median_s_per_step']:.3f} s/step, ratio {row['ratio']:.3f}"
        )
    print(f"written {out}")
    return 0


def _package_dir(src: Path, where: Path) -> Path:
    """A dir to put on PYTHONPATH so that ``draftsmith.<pkg>`` imports ``src/<pkg>``."""
    (where / "draftsmith").mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        (where / "draftsmith" / name).symlink_to(src / name, target_is_directory=True)
    return where


def _check_imports(src: Path, pythonpath: Path) -> dict[str, str]:
    """Where each package is imported from with this PYTHONPATH; it must be inside ``src``."""
    code = (
        "import json, importlib, os; print(json.dumps({n: os.path.realpath(importlib.import_"
        f"module('draftsmith.' + n).__file__) for n in {list(PACKAGES)!r}}}))"
    )
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    found = json.loads(
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
    )
    for name, path in found.items():
        if not Path(path).is_relative_to(src.resolve()):
            raise SystemExit(f"draftsmith.{name} imports from {path}, not from {src}")
    return found


def _git_state(src: Path) -> dict[str, object]:
    def git(*cmd: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(src), *cmd], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "--short", "HEAD"), "modified": bool(status)}


def _display(argv: list[str], tree: dict) -> str:
    return f"PYTHONPATH={tree['pythonpath']} " + shlex.join(argv)


def _run_recipe(argv: list[str], pythonpath: Path, out_dir: Path) -> float:
    """Run one recipe; its seconds per optimizer step after the first logged step."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"{shlex.join(argv)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    log = json.loads((out_dir / "training_metrics.json").read_text())["train_log"]
    shutil.rmtree(out_dir, ignore_errors=True)  # the trained drafter is not needed
    if len(log) < 2:
        raise SystemExit(f"{out_dir}: fewer than 2 logged steps; raise --steps")
    first, last = log[0], log[-1]
    return 60 * (last["train/minutes"] - first["train/minutes"]) / (last["step"] - first["step"])


def _tiny_inputs(root: Path) -> dict[str, Path]:
    """A tiny random Llama target (byte tokenizer, chat template) and chat records."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|pad|>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.1,
        tie_word_embeddings=False,
        eos_token_id=fast.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "target")
    fast.save_pretrained(root / "target")
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "to", "the"]
    words += ["red", "barn", "where", "a", "dog", "slept"]
    data = root / "records.jsonl"
    with open(data, "w") as f:
        for i in range(48):
            answer = " ".join(words[(i + j) % len(words)] for j in range(12))
            f.write(json.dumps({"id": i, "instruction": f"say {i}", "output": answer}) + "\n")
    return {"target": root / "target", "data": data}


def _tiny_flags(recipe: str, tiny: dict[str, Path]) -> list[str]:
    """The tiny target and data instead of the config's, with sizes that fit them."""
    flags = ["--target", str(tiny["target"]), "--data", str(tiny["data"]), "--split", "train"]
    flags += ["--max-length", "96", "--batch-size", "2"]
    if recipe == "eagle":  # online features: a tiny run has no hidden-state cache
        flags += ["--hidden-states", "online", "--draft-vocab-size", "64"]
    return flags


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["name"] for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    bars = ax.barh(names[::-1], values[::-1], color="#4c72b0")
    for bar, r in zip(bars, rows[::-1], strict=True):
        ax.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {r['speedup_vs_today']:.2f}x",
            va="center",
        )
    ax.set_xlabel("training tokens / s (EAGLE-3, SmolLM2-135M target, CPU)")
    ax.set_xlim(0, max(values) * 1.2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
