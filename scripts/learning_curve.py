"""Learning curve of an EAGLE run: evaluated τ of its checkpoints vs training minutes and samples.

Each finished checkpoint of the run (``checkpoints/step_N``, accelerate state) is turned back
into a drafter and decodes the same held-out prompts greedily with the verification loop, so its
acceptance length τ is measured, not simulated (τ counts tokens per target forward: it does not
depend on how busy the machine is). The validation's simulated τ of the same run is drawn beside
it. Training minutes come from each checkpoint's trainer state (resumes included), samples from
steps × batch × accumulation × processes.

Run::

    python scripts/learning_curve.py --run runs/eagle3_smollm2 --limit 16 \\
        --out bench/training/learning_curve_eagle3.json

Writes the JSON (command, versions, machine, per-checkpoint τ) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="output_dir of an EAGLE training run")
    parser.add_argument(
        "--prompts",
        default=None,
        help="prompt file (default: the shipped held-out prompts, chat_prompts.jsonl)",
    )
    parser.add_argument("--split", default="heldout")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="bench/training/learning_curve_eagle3.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from safetensors.torch import load_file

    from draftsmith.heads.eagle import load_drafter
    from draftsmith.heads.eagle_proposer import EagleProposer
    from draftsmith.train.core.checkpoint import TrainerState, finished_checkpoints
    from draftsmith.train.data.prompts import load_prompts, render_prompt
    from draftsmith.train.decoding.speculative import generate
    from draftsmith.train.runinfo import run_info
    from draftsmith.train.staged import write_json_atomic
    from draftsmith.train.target_model.kernels import fast_cpu_linears
    from draftsmith.train.target_model.load import load_target

    info = run_info()
    run = Path(args.run)
    metrics = json.loads((run / "training_metrics.json").read_text())
    cfg = metrics["config"]
    per_step = cfg["batch_size"] * cfg["grad_accum"] * metrics.get("processes", 1)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    target, tok = load_target(cfg.get("target"), dtype=dtype)
    records = load_prompts(args.prompts, split=args.split, limit=args.limit)
    prompts = [render_prompt(tok, r) for r in records]
    eos = tok.eos_token_id

    points = []
    sources = [(step, path, path / "model.safetensors") for step, path in finished_checkpoints(run)]
    if not sources or sources[-1][0] != metrics["steps"]:  # the last checkpoint may be the end
        sources.append((metrics["steps"], run / "drafter", None))
    for step, path, weights in sources:
        drafter = load_drafter(run / "drafter", target, dtype=dtype)
        if weights is not None:
            state = load_file(str(weights))
            drafter.load_state_dict(
                {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            )
            seconds = TrainerState.read(path).extra.get("train_seconds")
        else:
            seconds = metrics["train_seconds"]
        fast_cpu_linears(drafter)
        tokens = forwards = 0
        for ids in prompts:
            out = generate(
                target,
                ids,
                EagleProposer(drafter),
                k=args.k,
                max_new_tokens=args.max_new_tokens,
                eos_token_id=eos,
            )
            tokens += len(out.tokens)
            forwards += out.target_forwards
        val = next((v for v in metrics["validation"] if v["step"] == step), None)
        point = {
            "step": step,
            "minutes": None if seconds is None else seconds / 60,
            "samples": step * per_step,
            "tau": tokens / forwards,
            "sim_tau": None if val is None else val.get("val/sim_tau"),
            "source": str(path),
        }
        points.append(point)
        print(
            f"step {step}: {point['minutes'] or 0:.1f} min, τ {point['tau']:.3f}"
            + (f", sim τ {point['sim_tau']:.3f}" if point["sim_tau"] else ""),
            flush=True,
        )
    result = {
        "benchmark": f"evaluated τ (chain k={args.k}, greedy, {args.dtype}) per checkpoint",
        "run": str(run),
        "prompts": f"{args.prompts or 'shipped chat_prompts.jsonl'} split={args.split} "
        f"first {len(prompts)}",
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "points": points,
        "validation": [
            {"step": v["step"], "minutes": v.get("val/minutes"), "sim_tau": v.get("val/sim_tau")}
            for v in metrics["validation"]
        ],
        **info,
    }
    out = Path(args.out)
    write_json_atomic(out, result)
    _plot(result, per_step, out.with_suffix(".png"))
    print(f"written {out} and {out.with_suffix('.png')}")
    return 0


def _plot(result: dict, per_step: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    pts = [p for p in result["points"] if p["minutes"] is not None]
    val = [v for v in result["validation"] if v["sim_tau"] is not None]
    for ax, key, label in (
        (axes[0], "minutes", "training minutes (2 CPU cores)"),
        (axes[1], "samples", "training samples seen"),
    ):
        ax.plot(
            [p[key] for p in pts],
            [p["tau"] for p in pts],
            "o-",
            label=f"evaluated τ (k={result['k']})",
        )
        if key == "minutes":
            xs = [v["minutes"] for v in val if v["minutes"] is not None]
            ys = [v["sim_tau"] for v in val if v["minutes"] is not None]
        else:
            xs = [v["step"] * per_step for v in val]
            ys = [v["sim_tau"] for v in val]
        ax.plot(xs, ys, "s--", alpha=0.7, label="validation simulated τ")
        ax.set_xlabel(label)
        ax.set_ylabel("acceptance length τ")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"EAGLE-3 on SmolLM2-135M: {result['prompts']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
