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

This module holds the drafter's config (:class:`EagleConfig`, whose ``feature_layers`` are the
target hidden states the drafter reads) and building, saving and loading a drafter for a target.
The network (:class:`~draftsmith.heads.eagle_model.EagleDrafter`, its parameter names and the
target embedding/head it shares) is in :mod:`draftsmith.heads.eagle_model`; drafting with it
(chain or EAGLE-2 tree) is :class:`~draftsmith.heads.eagle_proposer.EagleProposer`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.heads.base import BuildOptions, DrafterKind, unwrap_model
from draftsmith.heads.eagle_model import EagleDrafter
from draftsmith.heads.eagle_proposer import EagleProposer

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
# Configuration
# --------------------------------------------------------------------------------------------


def _rope_from_target(cfg: Any) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of an HF config, transformers v5 or v4 style."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        if rest.get("rope_type", "default") == "default":
            return theta, None
        return theta, rest
    theta = float(getattr(cfg, "rope_theta", 10000.0))
    scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, dict(scaling) if scaling else None


@dataclass
class EagleConfig:
    """Shape and wiring of an EAGLE drafter.

    Feature layers use HF's ``output_hidden_states`` indices (see
    :data:`draftsmith.heads.base.Features`): index i is the *input* to decoder layer i, index N the
    final output after the target's last norm.

    Attributes:
        version: 1 (EAGLE-1: final feature, target head) or 3 (EAGLE-3: fused aux features, own
            head over a draft vocabulary).
        hidden_size: H, the target's hidden size (the drafter reads the target's embedding).
        intermediate_size: MLP width of the drafter's decoder layer.
        num_attention_heads: attention heads.
        num_key_value_heads: key/value heads (GQA).
        head_dim: per-head size.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: extra RoPE parameters as an HF ``rope_scaling`` dict (``rope_type`` etc.),
            None for default RoPE.
        max_position_embeddings: longest position the RoPE setup is meant for.
        hidden_act: MLP activation (HF name, e.g. ``silu``).
        vocab_size: the target's vocabulary size V.
        draft_vocab_size: EAGLE-3's draft vocabulary size (== ``vocab_size`` for EAGLE-1).
        target_num_layers: N, the target's decoder layer count.
        feature_layers: the target hidden states the drafter reads, in order (what
            :class:`~draftsmith.heads.eagle_proposer.EagleProposer` declares to the loop).
            EAGLE-1: ``(N,)``, the final normed output. EAGLE-3: the 3 fused layers, in fusion
            order; default ``(2, N//2, N-3)``: the *inputs to* layers 2, N//2 and N-3 (= outputs
            of layers 1, N//2-1, N-4), the convention of SafeAILab EAGLE-3 and vLLM's
            ``eagle_aux_hidden_state_layer_ids`` (which index layer inputs). Beware: SpecForge
            configs and some papers count "output of layer i", which is index ``i + 1`` here.
            Training needs N besides (:attr:`train_layers`).
        norm_before_residual: EAGLE-3 layer: False (EAGLE-3's actual behaviour, and speculators'/
            vLLM's default) keeps the *un-normed* fused feature as the attention residual and
            feeds ``hidden_norm(feature)`` to attention; True applies ``hidden_norm`` first and
            uses the normed feature for both. Ignored by EAGLE-1.
    """

    version: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    hidden_act: str
    vocab_size: int
    draft_vocab_size: int
    target_num_layers: int
    feature_layers: tuple[int, ...]
    norm_before_residual: bool = False
    rope_scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.feature_layers = tuple(int(i) for i in self.feature_layers)
        problems = self.problems()
        if problems:
            raise ValueError("invalid EagleConfig: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every inconsistency in the config (empty when valid)."""
        out = []
        n = self.target_num_layers
        if self.version not in (1, 3):
            out.append(f"version must be 1 or 3, got {self.version}")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            out.append(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.version == 1:
            if self.draft_vocab_size != self.vocab_size:
                out.append(
                    f"EAGLE-1 uses the target head: draft_vocab_size ({self.draft_vocab_size}) "
                    f"must equal vocab_size ({self.vocab_size})"
                )
            if self.feature_layers != (n,):
                out.append(
                    f"EAGLE-1 reads the final feature only; feature_layers must be [{n}], "
                    f"got {list(self.feature_layers)}"
                )
        if self.version == 3:
            if len(self.feature_layers) != 3:
                out.append(
                    f"EAGLE-3 fuses exactly 3 feature layers, got {list(self.feature_layers)}"
                )
            bad = [i for i in self.feature_layers if not 0 <= i <= n]
            if bad:
                out.append(f"feature_layers {bad} outside the hidden-state indices [0, {n}]")
            if not 1 <= self.draft_vocab_size <= self.vocab_size:
                out.append(
                    f"draft_vocab_size must be in [1, {self.vocab_size}], "
                    f"got {self.draft_vocab_size}"
                )
        return out

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        version: int,
        *,
        draft_vocab_size: int | None = None,
        feature_layers: Sequence[int] | None = None,
        norm_before_residual: bool = False,
    ) -> EagleConfig:
        """A drafter config shaped like one decoder layer of the target.

        Args:
            target_config: the target's HF config (Llama-style fields).
            version: 1 or 3.
            draft_vocab_size: EAGLE-3 draft vocab size (default: the full vocab); must be None
                or equal to the vocab size for EAGLE-1.
            feature_layers: target layers the drafter reads (default: ``[N]`` for EAGLE-1,
                ``[2, N//2, N-3]`` for EAGLE-3).
            norm_before_residual: see the class docstring.
        """
        c = target_config
        n = int(c.num_hidden_layers)
        theta, scaling = _rope_from_target(c)
        heads = int(c.num_attention_heads)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        if feature_layers is None:
            feature_layers = [2, n // 2, n - 3] if version == 3 else [n]
        return cls(
            version=version,
            hidden_size=int(c.hidden_size),
            intermediate_size=int(c.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(c.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(c.max_position_embeddings),
            hidden_act=str(c.hidden_act),
            vocab_size=int(c.vocab_size),
            draft_vocab_size=int(draft_vocab_size or c.vocab_size),
            target_num_layers=n,
            feature_layers=tuple(feature_layers),
            norm_before_residual=norm_before_residual,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (inverse of :meth:`from_dict`)."""
        return {**asdict(self), "feature_layers": list(self.feature_layers)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EagleConfig:
        """Build from :meth:`to_dict` output; unknown keys are an error, naming them.

        Also reads drafters saved before the layers had one name: their ``aux_layers`` held
        EAGLE-3's fused layers and was empty for EAGLE-1 (which reads N).
        """
        if "aux_layers" in d and "feature_layers" not in d:
            d = dict(d)
            aux = d.pop("aux_layers")
            if aux or d.get("version") != 1:
                d["feature_layers"] = aux
            elif "target_num_layers" in d:
                d["feature_layers"] = [d["target_num_layers"]]
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown EagleConfig field(s): {unknown}")
        missing = sorted(
            f.name
            for f in fields(cls)
            if f.name not in d and f.default is MISSING and f.default_factory is MISSING
        )
        if missing:
            raise ValueError(f"EagleConfig is missing field(s): {missing}")
        return cls(**d)

    @property
    def train_layers(self) -> tuple[int, ...]:
        """Layers training needs: the feature layers plus N (target logits via the target head).

        Sorted and unique, ready for :func:`draftsmith.train.features.source.feature_source`.
        """
        return tuple(sorted({*self.feature_layers, self.target_num_layers}))

    def rope_parameters(self) -> dict[str, Any]:
        """RoPE parameters in transformers v5's ``rope_parameters`` form."""
        return {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}

    def llama_config(self) -> Any:
        """A one-layer ``LlamaConfig`` with the drafter's shapes (RoPE setup, exports)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=self.rope_parameters(),
            tie_word_embeddings=False,
        )


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
        d2t, t2d: EAGLE-3 vocab maps (:func:`draftsmith.train.data.vocab.draft_vocab`);
            default: the first ``draft_vocab_size`` target ids (identity when the draft vocab is
            full).
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
    if cfg.version == 3:
        if (d2t is None) != (t2d is None):
            raise ValueError("pass both d2t and t2d, or neither")
        if d2t is not None:
            drafter.set_vocab(d2t, t2d)
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
    options.fast_linears(drafter)
    proposer = EagleProposer(
        drafter, tree=tree, topk=options.tree_topk, total_tokens=options.tree_total_tokens
    )
    proposer.name = f"eagle{drafter.config.version}-{'tree' if tree else 'chain'}[{path}]"
    return proposer


def vllm_serving(path: str | None) -> tuple[str, str] | str:
    """How vLLM serves a saved drafter: EAGLE-3 in the speculators format, EAGLE-1 as ``eagle``."""
    try:
        version = json.loads((Path(path or "") / CONFIG_FILE).read_text()).get("version")
    except (OSError, json.JSONDecodeError) as exc:
        return f"cannot read the drafter's {CONFIG_FILE} ({exc})"
    return ("speculators", "eagle3") if version == 3 else ("eagle", "eagle")


EAGLE = DrafterKind(
    build_proposer,
    path="required",
    help="EAGLE-1 or EAGLE-3 drafter, chain",
    vllm=vllm_serving,
)
EAGLE_TREE = DrafterKind(
    lambda path, options: build_proposer(path, options, tree=True),
    path="required",
    help="EAGLE-2 dynamic tree",
    vllm=lambda path: "the bench serves chains; serve eagle=DIR for this drafter",
)
