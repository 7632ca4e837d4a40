"""Give a DFlash drafter trained over the full vocabulary a draft vocabulary, without training.

A DFlash drafter scores its block with the target's *frozen* head, so drafting over the N most
frequent supervised tokens only (FR-Spec) uses the same trained weights: the new drafter's
logits are the old ones restricted to those N rows. (A drafter trained with
``draft_vocab_size`` also trains its softmax over those rows; this one was trained over all.)
Used to measure what the draft vocabulary saves a trained drafter at equal training.

    python bench/parallel/dflash_vocab/add_draft_vocab.py SRC_DRAFTER CACHE_DIR OUT_DIR --size 8192
"""

from __future__ import annotations

import argparse
import dataclasses

from draftsmith.heads.dflash import build_drafter, load_drafter, save_drafter
from draftsmith.train.core.data import eos_ids
from draftsmith.train.data.vocab import coverage, draft_vocab, token_counts
from draftsmith.train.features.cache_read import HiddenStateCache
from draftsmith.train.target_model.load import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("cache", help="the hidden-state cache it was trained on (its tokens)")
    parser.add_argument("out")
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--target", default=None)
    args = parser.parse_args()
    target, tokenizer = load_target(args.target)
    old = load_drafter(args.src, target)
    counts = token_counts(HiddenStateCache(args.cache).token_view(), target.config.vocab_size)
    d2t, t2d = draft_vocab(counts, args.size, always_include=eos_ids(tokenizer, target))
    cfg = dataclasses.replace(old.config, draft_vocab_size=args.size)
    new = build_drafter(target, cfg, d2t=d2t, t2d=t2d)
    missing, unexpected = new.load_state_dict(old.state_dict(), strict=False)
    assert sorted(missing) == ["d2t", "t2d"] and not unexpected, (missing, unexpected)
    save_drafter(new, args.out)
    print(f"{args.out}: {args.size} tokens cover {coverage(counts, t2d):.2%} of the cache's tokens")


if __name__ == "__main__":
    main()
