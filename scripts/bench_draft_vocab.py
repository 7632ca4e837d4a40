"""What a draft vocabulary saves a drafter per draft token (issue 25 item 2).

Medusa heads end in a projection over the vocabulary, EAGLE-1 drafts through the target's
lm_head and a draft LM through its own: SmolLM2's 49,152 rows each, or the ``draft_vocab_size``
most frequent tokens with a draft vocabulary (EAGLE-3's d2t/t2d, FR-Spec). For each
``--drafters`` family this benchmark times one greedy draft step as evaluate runs it, with
modules shaped as the real target's (the cost does not depend on training), for the full
vocabulary and each ``--draft-vocab`` size, in each ``--dtypes``, interleaved per repetition
(median of ``--reps``), and writes JSON with the command, versions and machine:

- ``medusa``: K heads' residual blocks and projections over the last verified hidden state;
- ``eagle1``: one EAGLE-1 drafter forward over one position and its head (the target's rows);
- ``draft-lm``: one token of a 1-layer pruned draft LM with a KV cache of ``--context`` tokens;
- ``dflash``: one block of ``--block`` (the anchor + B - 1 draft tokens) of a 2-layer DFlash
  drafter over ``--context`` cached context positions, and its head over the B - 1 slots (a
  DFlash step drafts B - 1 tokens: its ms are per step, not per token).

Run::

    python scripts/bench_draft_vocab.py --out bench/cpu_costs/draft_vocab_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", nargs="+", default=["medusa", "eagle1", "draft-lm"])
    parser.add_argument("--heads", type=int, default=4, help="medusa: heads")
    parser.add_argument("--context", type=int, default=128, help="draft-lm, dflash: context")
    parser.add_argument("--block", type=int, default=8, help="dflash: block size B")
    parser.add_argument("--draft-vocab", type=int, nargs="+", default=[8192, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--target", default=None)
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--out", default="bench/cpu_costs/draft_vocab_cpu.json")
    args = parser.parse_args(argv)

    from draftsmith.heads.dflash import DFlashConfig, DFlashProposer
    from draftsmith.heads.dflash import build_drafter as build_dflash
    from draftsmith.heads.draft_lm import DraftLM, layer_pruned_copy
    from draftsmith.heads.eagle import EagleConfig, build_drafter
    from draftsmith.heads.medusa import MedusaHeads
    from draftsmith.heads.sampling import SamplingParams
    from draftsmith.train.device import DeviceTimer, is_cpu, make_generator, resolve_device
    from draftsmith.train.runinfo import run_info
    from draftsmith.train.staged import write_json_atomic
    from draftsmith.train.target_model.kernels import fast_cpu_linears
    from draftsmith.train.target_model.load import load_target

    device = resolve_device(args.device)
    if is_cpu(device):
        torch.set_num_threads(args.threads)
    info = run_info(device)
    clock = DeviceTimer(device).now
    load_before = os.getloadavg()
    targets = {
        d: load_target(args.target, dtype=getattr(torch, d), device=device)[0] for d in args.dtypes
    }
    first = next(iter(targets.values()))
    vocab, width = first.config.vocab_size, first.config.hidden_size
    gen = make_generator(device, 0)
    greedy = SamplingParams(temperature=0.0)

    def maps(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randperm(vocab, generator=gen, device=device)[:n].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool, device=device)
        t2d[ids] = True
        return ids - torch.arange(n, device=device), t2d

    def medusa(target, dtype, n):
        d2t, t2d = maps(n) if n else (None, None)
        heads = MedusaHeads.from_target(target, num_heads=args.heads, d2t=d2t, t2d=t2d)
        heads = heads.to(dtype).eval()
        fast_cpu_linears(heads)  # as evaluate runs drafters (the bf16 CPU kernel path)
        x = torch.randn(1, 1, width, generator=gen, device=device).to(dtype)
        return lambda: heads.target_ids(heads(x).argmax(-1)).tolist()

    def eagle1(target, dtype, n):
        cfg = EagleConfig.from_target(target.config, 1, draft_vocab_size=n or None)
        d2t, t2d = maps(n) if n else (None, None)
        drafter = build_drafter(target, cfg, d2t, t2d, dtype=dtype, seed=0).eval()
        fast_cpu_linears(drafter)
        ids = torch.randint(0, vocab, (1, 1), generator=gen, device=device)
        emb = drafter.embed(ids)
        feat = torch.randn(1, 1, width, generator=gen, device=device).to(dtype)
        pos = torch.zeros(1, 1, dtype=torch.long, device=device)

        def step():
            _, logits = drafter(emb, feat, pos, return_logits=True)
            drafter.target_ids(logits[0, -1].argmax(-1)).tolist()

        return step

    def draft_lm(target, dtype, n):
        ids = maps(n)[1].nonzero().flatten() if n else None
        model = layer_pruned_copy(target, [0]).to(dtype)
        fast_cpu_linears(model)
        draft = DraftLM(model, target_vocab_size=vocab, vocab_ids=ids)
        prompt = torch.randint(0, vocab, (1, args.context), generator=gen, device=device)
        draft.start(prompt, None)
        feed = prompt[:, -1:]

        def step():
            tok, _ = draft._draw(feed, greedy, None)
            tok.tolist()
            draft._cache.crop(-1)  # back to the same cached context every repetition

        return step

    def dflash(target, dtype, n):
        cfg = DFlashConfig.from_target(
            target.config, mask_token_id=0, block_size=args.block, draft_vocab_size=n
        )
        d2t, t2d = maps(n) if n else (None, None)
        drafter = build_dflash(target, cfg, dtype=dtype, seed=0, d2t=d2t, t2d=t2d).eval()
        fast_cpu_linears(drafter)
        proposer = DFlashProposer(drafter)
        ids = torch.randint(0, vocab, (1, args.context + 1), generator=gen, device=device)
        feats = {
            i: torch.randn(1, args.context, width, generator=gen, device=device).to(dtype)
            for i in cfg.feature_layers
        }
        proposer.start(ids[:, :-1], feats)  # the context K/V are projected on the first step

        def step():
            proposer.propose(ids, args.block - 1, greedy, None).tokens.tolist()

        return step

    makers = {"medusa": medusa, "eagle1": eagle1, "draft-lm": draft_lm, "dflash": dflash}
    unknown = sorted(set(args.drafters) - set(makers))
    if unknown:
        parser.error(f"--drafters: unknown {unknown}; choose from {sorted(makers)}")
    variants = {}
    for family in args.drafters:
        for dtype_name, target in targets.items():
            for n in [None, *args.draft_vocab]:
                step = makers[family](target, getattr(torch, dtype_name), n)
                variants[(family, dtype_name, n or vocab)] = step

    def timed(step) -> float:
        t = clock()
        step()  # each step reads its draft token on the host: the loop's one sync
        return clock() - t

    samples: dict = {key: [] for key in variants}
    with torch.inference_mode():
        for step in variants.values():  # warm-up
            timed(step)
        for _ in range(args.reps):
            for key, step in variants.items():
                samples[key].append(timed(step))
    results = {}
    for (family, dtype_name, n), values in samples.items():
        ms = statistics.median(values) * 1e3
        full = statistics.median(samples[(family, dtype_name, vocab)]) * 1e3
        results.setdefault(family, {}).setdefault(dtype_name, {})[str(n)] = {
            "ms": ms,
            "fraction_of_full": ms / full,
        }
        print(
            f"{family:>8} {dtype_name} vocab {n:>6}: {ms:.2f} ms per draft step "
            f"({ms / full:.2f} of full)"
        )
    result = {
        "benchmark": "one greedy draft step per drafter family, by draft vocabulary",
        "drafters": args.drafters,
        "context": args.context,
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "heads": args.heads,
        "target_vocab": vocab,
        "threads": args.threads if is_cpu(device) else None,
        "reps": args.reps,
        "block": args.block,
        "unit": "ms per draft step (median; medusa: all K heads; dflash: one block of B - 1)",
        "results": results,
        "machine_load": {"before": load_before, "after": os.getloadavg()},
        **info,
    }
    write_json_atomic(Path(args.out), result)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
