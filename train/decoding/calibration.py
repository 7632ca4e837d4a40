"""Calibration: how often a draft node of a given confidence is accepted, fitted on validation data.

The per-step decision (``heads/auto.py``) needs, for every candidate node, the probability that
the target accepts it given that its parent was accepted. The drafter's own probability is a
good *ranking* (EAGLE-2 builds its trees from it, §3) but not a probability of acceptance: a
drafter trained for minutes is over-confident where the target is uncertain and the other way
round. So it is mapped through a curve fitted on prompts that are neither trained on nor
evaluated (the quickstart's validation prompts):

1. **Labelled candidates.** The validation prompts are decoded with an
   :class:`~draftsmith.heads.auto.AutoDrafter` in record mode: every candidate of the learned
   drafter and of the lookups is verified every step, and kept with its confidence. A node is
   labelled when its parent is on the text the target produced (the root, or an accepted node;
   pruned or rejected branches are labelled too, as long as their parent was accepted). Its
   label is its acceptance probability under the run's sampling: greedy, 1 when its token is
   the target's greedy token there, else 0; sampled, ``p(x)`` for a deterministic candidate
   (one-hot q) and ``min(1, p(x)/q(x))`` for a node drawn from q, with p the target's processed
   distribution there (one teacher-forced forward over the text gives every row).
2. **Fit.** The learned nodes' (confidence, label) pairs by isotonic regression (pool adjacent
   violators), kept as at most :data:`MAX_KNOTS` knots at equal-count quantiles, interpolated
   linearly; the lookup nodes' rate per source, match length and depth (Laplace-smoothed).
3. **Checked.** The fit on half of the prompts predicts the other half: the expected
   calibration error (ECE, 10 bins) of the raw confidences and of the fitted map, and the
   reliability curve (plotted beside the file).

The result is stored beside the checkpoint, ``DIR/calibration.json``, under the sampling
settings it was fitted at, with a stamp of the drafter's weight files: a retrained drafter is
recalibrated, a rerun reuses it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...heads.auto import AutoDrafter, Calibration, VerifyCosts, sampling_key
from ...heads.sampling import SamplingParams, logits_to_probs
from ..staged import write_json_atomic
from .speculative import generate

FILE = "calibration.json"
MAX_KNOTS = 24
BINS = 10
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


# --- labelled candidates -------------------------------------------------------------------------


def record_prompts(
    target: Any,
    learned: Any,
    lookups: Sequence[Any],
    prompts: Sequence[list[int]],
    *,
    costs: VerifyCosts,
    k: int,
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_token_id: Any = None,
    seed: int = 0,
    progress: Any = None,
) -> list[list[dict[str, Any]]]:
    """Every candidate of every step of every prompt, labelled (module doc, step 1).

    Returns:
        Per prompt, its labelled nodes: ``{"kind": "learned"|"lookup", "key", "conf",
        "label", "depth"}``.
    """
    from ..device import make_generator

    auto = AutoDrafter(learned, lookups, costs, record=True)
    out = []
    for ids in prompts:
        auto.records = []
        gen = make_generator(target.device, seed)
        run = generate(
            target,
            ids,
            auto,
            k=k,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            eos_token_id=eos_token_id,
            generator=gen,
        )
        out.append(label_nodes(target, list(ids), run.tokens, auto.records, sampling))
        if progress is not None:
            progress()
    return out


@torch.inference_mode()
def label_nodes(
    target: Any,
    prompt: list[int],
    output: list[int],
    records: list[dict[str, Any]],
    sampling: SamplingParams,
) -> list[dict[str, Any]]:
    """Label one prompt's recorded candidates from the text the target produced."""
    text = [*prompt, *output]
    probs = None
    if not sampling.greedy:  # one teacher-forced forward: p at every position of the text
        ids = torch.tensor([text], device=target.device)
        probs = logits_to_probs(target(input_ids=ids).logits[0].float(), sampling)
    nodes = []
    for rec in records:
        root, cands, qx = rec["root"], rec["cands"], rec["qx"]
        on_text: dict[int, bool] = {-1: True}  # node -> its token is the text's there
        for j in range(len(cands)):
            parent = cands.parents[j]
            depth = cands.depth(j)
            at = root + depth  # the text position this node predicts
            if not on_text.get(parent, False) or at >= len(text):
                on_text[j] = False
                continue
            tok = cands.tokens[j]
            on_text[j] = text[at] == tok
            if probs is None:
                label = float(text[at] == tok)
            else:
                p = float(probs[at - 1, tok])
                label = min(1.0, p / qx[j]) if cands.sampled[j] else p
            if cands.learned[j] >= 0:
                conf = cands.confidence[j]
                nodes.append({"kind": "learned", "conf": conf, "label": label, "depth": depth})
            if cands.lookup[j]:
                source, length = cands.lookup[j].split(":")[:2]
                nodes.append(
                    {
                        "kind": "lookup",
                        "key": Calibration.lookup_key(source, int(length), depth),
                        "label": label,
                        "depth": depth,
                    }
                )
    return nodes


# --- the fit -------------------------------------------------------------------------------------


def isotonic(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    """Pool adjacent violators: the non-decreasing fit of ys (sorted by xs) in least squares.

    Args:
        xs: ascending inputs; ys: their labels.

    Returns:
        The fitted value at each input.
    """
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    fitted: list[float] = []
    for s, c in blocks:
        fitted += [s / c] * int(c)
    return fitted


def fit(nodes: Sequence[dict[str, Any]], sampling: str = "0/0/1") -> Calibration:
    """The calibration of labelled nodes (module doc, step 2)."""
    pairs = sorted((n["conf"], n["label"]) for n in nodes if n["kind"] == "learned")
    knots: list[tuple[float, float]] = [(0.0, 0.0), (1.0, 1.0)]
    if pairs:
        xs, ys = zip(*pairs, strict=True)
        fitted = isotonic(xs, ys)
        step = max(1, len(pairs) // MAX_KNOTS)
        picks = sorted({*range(step // 2, len(pairs), step), len(pairs) - 1})
        knots = []
        for i in picks:
            x, y = float(xs[i]), float(fitted[i])
            if knots and x <= knots[-1][0]:
                knots[-1] = (knots[-1][0], max(knots[-1][1], y))
            else:
                knots.append((x, y))
    lookup: dict[str, float] = {}
    sums: dict[str, list[float]] = {}
    for n in nodes:
        if n["kind"] != "lookup":
            continue
        key = n["key"]
        for k in (key, key.rsplit(":", 1)[0]):  # per depth, and per match length
            s = sums.setdefault(k, [0.0, 0.0])
            s[0] += n["label"]
            s[1] += 1
    for key, (hits, count) in sums.items():
        lookup[key] = (hits + 1.0) / (count + 2.0)
    return Calibration(knots=knots, lookup=lookup, sampling=sampling)


def reliability(
    nodes: Sequence[dict[str, Any]], calibration: Calibration | None = None
) -> list[dict[str, float]]:
    """Per confidence bin (10 equal widths) of the learned nodes: count, mean confidence, the
    mean of ``calibration``'s prediction (None: the raw confidence) and the mean label."""
    bins = [[0, 0.0, 0.0, 0.0] for _ in range(BINS)]
    for n in nodes:
        if n["kind"] != "learned":
            continue
        b = bins[min(int(n["conf"] * BINS), BINS - 1)]
        pred = n["conf"] if calibration is None else calibration.learned_rate(n["conf"])
        b[0] += 1
        b[1] += n["conf"]
        b[2] += pred
        b[3] += n["label"]
    return [
        {
            "bin": [i / BINS, (i + 1) / BINS],
            "count": c,
            "confidence": s_conf / c,
            "predicted": s_pred / c,
            "accepted": s_label / c,
        }
        for i, (c, s_conf, s_pred, s_label) in enumerate(bins)
        if c
    ]


def ece(curve: Sequence[dict[str, float]]) -> float | None:
    """Expected calibration error of a :func:`reliability` curve: Σ count · |pred − label| / N."""
    total = sum(b["count"] for b in curve)
    if not total:
        return None
    return sum(b["count"] * abs(b["predicted"] - b["accepted"]) for b in curve) / total


def calibrate(
    per_prompt: Sequence[Sequence[dict[str, Any]]], sampling: str
) -> tuple[Calibration, dict[str, Any]]:
    """Fit on every prompt; check a fit on the even prompts against the odd ones (module doc).

    Returns:
        ``(calibration, report)``: the report holds the node counts, the held-out ECE of the
        raw confidences and of the fitted map, the full-data reliability curve and the lookup
        rates.
    """
    every = [n for nodes in per_prompt for n in nodes]
    train = [n for i, nodes in enumerate(per_prompt) if i % 2 == 0 for n in nodes]
    held = [n for i, nodes in enumerate(per_prompt) if i % 2 == 1 for n in nodes]
    calibration = fit(every, sampling)
    half = fit(train, sampling)
    learned = sum(1 for n in every if n["kind"] == "learned")
    report = {
        "prompts": len(per_prompt),
        "learned_nodes": learned,
        "lookup_nodes": len(every) - learned,
        "heldout_ece_raw": ece(reliability(held)),
        "heldout_ece_calibrated": ece(reliability(held, half)),
        "reliability": reliability(every, calibration),
        "knots": [list(k) for k in calibration.knots],
        "lookup_rates": dict(sorted(calibration.lookup.items())),
    }
    return calibration, report


# --- the file beside the checkpoint --------------------------------------------------------------


def drafter_stamp(directory: str | Path) -> str:
    """A digest of a checkpoint's weight files (names, sizes, contents): changes on retraining."""
    h = hashlib.sha256()
    root = Path(directory)
    for path in sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES):
        h.update(path.name.encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def load(directory: str | Path, sampling: SamplingParams) -> tuple[Calibration, dict] | None:
    """The stored calibration of a checkpoint for these sampling settings, if it is current.

    Raises:
        ValueError: naming the file when it is not a calibration this code wrote.
    """
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        entry = data["fits"].get(sampling_key(sampling))
        if entry is None or data.get("stamp") != drafter_stamp(directory):
            return None
        return Calibration.from_dict(entry, sampling_key(sampling)), entry["report"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a calibration file ({exc}); delete it to refit") from exc


def save(
    directory: str | Path, sampling: SamplingParams, calibration: Calibration, report: dict
) -> Path:
    """Store a fit beside the checkpoint (other sampling settings' fits of the same weights are
    kept) and draw its reliability curve; returns the file."""
    path = Path(directory) / FILE
    stamp = drafter_stamp(directory)
    data: dict[str, Any] = {"format": 1, "stamp": stamp, "fits": {}}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            if old.get("stamp") == stamp:
                data["fits"] = dict(old.get("fits") or {})
        except (ValueError, AttributeError):
            pass
    key = sampling_key(sampling)
    data["fits"][key] = {**calibration.to_dict(), "report": report}
    write_json_atomic(path, data)
    plot_reliability(report, path.with_name(f"calibration_{_slug(key)}.png"), key)
    return path


def _slug(key: str) -> str:
    t, top_k, top_p = key.split("/")
    return (
        f"t{t}"
        + (f"_topk{top_k}" if top_k != "0" else "")
        + (f"_topp{top_p}" if top_p != "1" else "")
    )


def plot_reliability(report: dict, path: Path, key: str) -> Path | None:
    """The reliability curve: the drafter's confidence and the calibrated prediction against
    the measured acceptance, per confidence bin (marker area ∝ nodes)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return None
    curve = report["reliability"]
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.plot([0, 1], [0, 1], ":", color="grey", label="perfectly calibrated")
    size = [max(8.0, 300.0 * b["count"] / max(c["count"] for c in curve)) for b in curve]
    ax.scatter(
        [b["confidence"] for b in curve],
        [b["accepted"] for b in curve],
        s=size,
        label="raw confidence",
    )
    ax.plot(
        [b["predicted"] for b in curve],
        [b["accepted"] for b in curve],
        "o-",
        ms=4,
        label="calibrated",
    )
    ax.set_xlabel("predicted acceptance given the parent")
    ax.set_ylabel("measured acceptance")
    raw, cal = report["heldout_ece_raw"], report["heldout_ece_calibrated"]
    title = f"calibration ({key}), {report['learned_nodes']} nodes"
    if raw is not None and cal is not None and not math.isnan(raw):
        title += f"\nheld-out ECE {raw:.3f} raw, {cal:.3f} calibrated"
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
