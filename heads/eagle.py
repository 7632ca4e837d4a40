"""EAGLE drafters: one decoder layer that extrapolates the target's features (EAGLE-1 and EAGLE-3).

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty")
drafts at the feature level: the drafter sees the target's hidden state ``f_t`` at position t and
the embedding of the token ``x_{t+1}`` that followed it (§3.1: the token "one step ahead" removes
the sampling uncertainty), and predicts the next feature ``f_{t+1}``; a head turns a feature into
the distribution of the token after it. Drafting runs this autoregressively on its own predicted
features; after each verification the target's true features of the kept positions replace them.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test") fuses a low, a middle and a high target layer instead of the final one
(§3.2), trains with "training-time test" (the drafter consumes its own outputs during training,
see :mod:`draftsmith.train.objectives.eagle_ttt`) and predicts over a reduced draft vocabulary
with its own norm and head.

Alignment (both versions), with ``ids`` of length L (tokens 0..L-1) and target features known for
positions 0..L-2: drafter position t takes ``(f_t, embed(x_{t+1}))`` and outputs ``h_t``, its guess
of ``f_{t+1}``; ``logits(h_t)`` is the distribution of ``x_{t+2}``. So the first draft token comes
from position L-2 and each further draft step feeds ``(h, embed(draft token))`` one position on.

This module holds building, saving and loading a drafter for a target, and its ``--drafter`` kinds.
The config (:class:`~draftsmith.heads.eagle_config.EagleConfig`, whose ``feature_layers`` are the
target hidden states the drafter reads) is in :mod:`draftsmith.heads.eagle_config`, and importable
from here too. The network (:class:`~draftsmith.heads.eagle_model.EagleDrafter`, its parameter names
and the target embedding/head it shares) is in :mod:`draftsmith.heads.eagle_model`; drafting with it
(chain or EAGLE-2 tree) is :class:`~draftsmith.heads.eagle_proposer.EagleProposer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .base import BuildOptions, DrafterKind, unwrap_model
from .eagle_config import EagleConfig
from .eagle_model import EagleDrafter
from .eagle_proposer import EagleProposer

__all__ = [
    "DRAFTER_FORMAT",
    "EagleConfig",
    "build_drafter",
    "load_drafter",
    "save_drafter",
]

#: ``config.json`` marker of a saved drafter (:func:`save_drafter`).
DRAFTER_FORMAT = "eagle-drafter"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


# --------------------------------------------------------------------------------------------
# Building, saving, loading
# --------------------------------------------------------------------------------------------


def _shared_from_target(target: nn.Module, version: int) -> tuple[nn.Module, nn.Module | None]:
    embed = target.get_input_embeddings()
    head = target.get_output_embeddings() if version == 1 else None
    return embed, head


@torch.no_grad()
def build_drafter(
    target: nn.Module,
    cfg: EagleConfig,
    d2t: torch.Tensor | None = None,
    t2d: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
    init_std: float = 0.02,
) -> EagleDrafter:
    """A freshly initialised drafter for ``target``.

    Linear weights ~ N(0, init_std), norms = 1. EAGLE-3's ``lm_head`` starts as the target
    head's rows of the draft vocabulary (the drafter imitates the target's last feature, so the
    target's head is the natural start).

    Args:
        target: the frozen target (its embedding, and EAGLE-1's head, are shared).
        cfg: drafter config (e.g. :meth:`EagleConfig.from_target`).
        d2t, t2d: the draft vocabulary's maps (:func:`draftsmith.train.data.vocab.draft_vocab`)
            for EAGLE-3, or EAGLE-1 with ``draft_vocab_size < vocab_size``; default: the first
            ``draft_vocab_size`` target ids (identity when the draft vocab is full).
        dtype: parameter dtype (float32 master weights are the usual choice for training).
        seed: seed for the random init (None: the global RNG).
        init_std: std of the random init (HF's usual 0.02).
    """
    _check_target(cfg, target.config)
    embed, head = _shared_from_target(target, cfg.version)
    # The init is drawn on the CPU (then moved), so a seed gives the same drafter on any device.
    gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    drafter = EagleDrafter(cfg, embed, head)
    for module in drafter.modules():
        if isinstance(module, nn.Linear):
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * init_std)
    if cfg.parallel:
        # Unit-scale like speculators' P-EAGLE init: a zero feature would sit where RMSNorm's
        # gain is 1/sqrt(eps) and blow up its first gradients.
        drafter.mask_hidden.copy_(torch.randn(drafter.mask_hidden.shape, generator=gen))
    if (d2t is None) != (t2d is None):
        raise ValueError("pass both d2t and t2d, or neither")
    if d2t is not None:
        drafter.set_vocab(d2t, t2d)  # refuses maps for a full-vocabulary EAGLE-1 drafter
    if cfg.version == 3:
        rows = drafter.target_ids(torch.arange(cfg.draft_vocab_size))
        target_head = target.get_output_embeddings().weight
        drafter.lm_head.weight.copy_(target_head[rows.to(target_head.device)].float().cpu())
    device = embed.weight.device
    return drafter.to(device=device, dtype=dtype)


def _check_target(cfg: EagleConfig, target_config: Any, where: str = "drafter config") -> None:
    """Raise when the drafter cannot run on this target (names the mismatching field)."""
    want = {
        "hidden_size": int(target_config.hidden_size),
        "vocab_size": int(target_config.vocab_size),
        "target_num_layers": int(target_config.num_hidden_layers),
    }
    bad = [
        f"{name} = {getattr(cfg, name)} but the target has {value}"
        for name, value in want.items()
        if getattr(cfg, name) != value
    ]
    if bad:
        raise ValueError(f"{where} does not match the target: " + "; ".join(bad))


def save_drafter(drafter: EagleDrafter, out_dir: str | Path) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (our own layout, see :func:`load_drafter`).

    ``config.json`` holds :meth:`EagleConfig.to_dict` plus ``"draftsmith_format":
    "eagle-drafter"``. The shared target embedding/head are not saved.

    Returns:
        The output directory.
    """
    from safetensors.torch import save_file

    drafter = unwrap_model(drafter)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"draftsmith_format": DRAFTER_FORMAT, **drafter.config.to_dict()}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_drafter(
    path: str | Path, target: nn.Module, *, dtype: torch.dtype | None = None
) -> EagleDrafter:
    """Load a drafter saved by :func:`save_drafter` and attach it to ``target``.

    Args:
        path: the directory (or its ``config.json``).
        target: the target it was trained for (checked: hidden size, vocab, layer count).
        dtype: cast parameters to this dtype (default: as saved).

    Raises:
        FileNotFoundError / ValueError: naming the file and field that is missing or wrong.
    """
    from safetensors.torch import load_file

    root = Path(path)
    if root.name == CONFIG_FILE:
        root = root.parent
    cfg_path, w_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise FileNotFoundError(f"EAGLE drafter: {p} not found")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from e
    fmt = raw.pop("draftsmith_format", None)
    if fmt != DRAFTER_FORMAT:
        raise ValueError(
            f"{cfg_path}: field 'draftsmith_format' is {fmt!r}, expected {DRAFTER_FORMAT!r} "
            "(not a draftsmith EAGLE drafter directory)"
        )
    try:
        cfg = EagleConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{cfg_path}: {e}") from e
    _check_target(cfg, target.config, where=str(cfg_path))
    state = load_file(str(w_path))
    embed, head = _shared_from_target(target, cfg.version)
    drafter = EagleDrafter(cfg, embed, head)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [
        f"{k}: {tuple(state[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            f"{w_path}: tensors do not match {cfg_path}: missing {missing}, "
            f"unexpected {unexpected}, wrong shape {shapes}"
        )
    saved_dtype = state["fc.weight"].dtype
    drafter = drafter.to(saved_dtype)
    drafter.load_state_dict(state)
    return drafter.to(device=embed.weight.device, dtype=dtype or saved_dtype).eval()


# --------------------------------------------------------------------------------------------
# The --drafter kinds (heads/registry.py)
# --------------------------------------------------------------------------------------------


def build_proposer(path: str | None, options: BuildOptions, tree: bool = False) -> EagleProposer:
    """``eagle=DIR`` / ``eagle-tree=DIR``: a saved drafter as a chain or EAGLE-2 tree proposer.

    Named ``eagle{version}-chain[DIR]`` or ``eagle{version}-tree[DIR]`` (the checkpoint says
    which EAGLE it is).
    """
    drafter = load_drafter(path, options.target, dtype=options.draft_dtype)
    if drafter.config.parallel:
        raise ValueError(
            f"{path} is a P-EAGLE drafter (trained to draft in parallel): use --drafter "
            f"peagle={path}"
        )
    options.fast_linears(drafter)
    proposer = EagleProposer(
        drafter, tree=tree, topk=options.tree_topk, total_tokens=options.tree_total_tokens
    )
    proposer.name = f"eagle{drafter.config.version}-{'tree' if tree else 'chain'}[{path}]"
    return proposer


def build_parallel_proposer(path: str | None, options: BuildOptions) -> EagleProposer:
    """``peagle=DIR``: a saved P-EAGLE drafter, all k draft positions in one forward."""
    drafter = load_drafter(path, options.target, dtype=options.draft_dtype)
    if not drafter.config.parallel:
        raise ValueError(
            f"{path} is an EAGLE-{drafter.config.version} drafter, not trained to draft in "
            f"parallel (its config has no mask_token_id): use --drafter eagle={path}"
        )
    options.fast_linears(drafter)
    proposer = EagleProposer(drafter, parallel=True)
    proposer.name = f"peagle[{path}]"
    return proposer


EAGLE = DrafterKind(
    build_proposer,
    path="required",
    help="EAGLE-1 or EAGLE-3 drafter, chain",
)
EAGLE_TREE = DrafterKind(
    lambda path, options: build_proposer(path, options, tree=True),
    path="required",
    help="EAGLE-2 dynamic tree",
)
PEAGLE = DrafterKind(
    build_parallel_proposer,
    path="required",
    help="P-EAGLE drafter, all k positions in one forward",
)
