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
see :mod:`draftsmith.train.objectives.eagle_ttt`) and predicts over a reduced draft vocabulary with its own
norm and head.

Alignment (both versions), with ``ids`` of length L (tokens 0..L-1) and target features known for
positions 0..L-2: drafter position t takes ``(f_t, embed(x_{t+1}))`` and outputs ``h_t``, its guess
of ``f_{t+1}``; ``logits(h_t)`` is the distribution of ``x_{t+2}``. So the first draft token comes
from position L-2 and each further draft step feeds ``(h, embed(draft token))`` one position on.

Parameter names follow vllm-project/speculators' Eagle3 layout and vLLM's EAGLE loaders, so an
export is a rename-free copy:

===============================================  =========================================
``fc.weight``                                    EAGLE-1 ``[H, 2H]`` over concat(embed, f);
                                                 EAGLE-3 ``[H, 3H]`` over concat(aux feats)
``layers.0.self_attn.{q,k,v,o}_proj.weight``     q/k/v take H (EAGLE-1) or 2H (EAGLE-3)
``layers.0.mlp.{gate,up,down}_proj.weight``      Llama MLP
``layers.0.input_layernorm.weight``              EAGLE-3 only (EAGLE-1's first layer has none)
``layers.0.hidden_norm.weight``                  EAGLE-3 only
``layers.0.post_attention_layernorm.weight``     both
``norm.weight``, ``lm_head.weight``              EAGLE-3 only (``lm_head``: ``[V_draft, H]``)
``d2t`` (int64 ``[V_draft]``), ``t2d`` (bool)    EAGLE-3 only buffers (saved)
===============================================  =========================================

No linear layer has a bias: vLLM's EAGLE-1 Llama model builds ``fc`` with ``bias=False`` and skips
checkpoint tensors it has no parameter for, so a trained ``fc.bias`` (the original SafeAILab
EAGLE-1 code has one) would be dropped silently at serving time.

The target's token embedding (both versions) and, for EAGLE-1, its lm_head are *shared and
frozen*: they are held in a plain attribute (``drafter.shared``, not a submodule), so they are not
parameters of the drafter, not in its ``state_dict`` and not moved by ``drafter.to()`` -- they stay
wherever the target lives. Pass them in (``build_drafter``/``load_drafter`` take them from the
target).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from draftsmith.heads.base import Features, Proposal
from draftsmith.heads.sampling import SamplingParams, choose

__all__ = [
    "DRAFTER_FORMAT",
    "EagleCache",
    "EagleConfig",
    "EagleDrafter",
    "EagleProposer",
    "build_drafter",
    "causal_mask",
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
        aux_layers: EAGLE-3's fused layers, in fusion order. Default ``[2, N//2, N-3]``: the
            *inputs to* layers 2, N//2 and N-3 (= outputs of layers 1, N//2-1, N-4), the
            convention of SafeAILab EAGLE-3 and vLLM's ``eagle_aux_hidden_state_layer_ids``
            (which index layer inputs). Beware: SpecForge configs and some papers count "output
            of layer i", which is index ``i + 1`` here. Empty for EAGLE-1.
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
    aux_layers: list[int] = field(default_factory=list)
    norm_before_residual: bool = False
    rope_scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.aux_layers = [int(i) for i in self.aux_layers]
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
            if self.aux_layers:
                out.append(
                    f"EAGLE-1 reads the final feature only; aux_layers must be empty, "
                    f"got {self.aux_layers}"
                )
        if self.version == 3:
            if len(self.aux_layers) != 3:
                out.append(f"EAGLE-3 fuses exactly 3 aux layers, got {self.aux_layers}")
            bad = [i for i in self.aux_layers if not 0 <= i <= n]
            if bad:
                out.append(f"aux_layers {bad} outside the hidden-state indices [0, {n}]")
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
        aux_layers: list[int] | None = None,
        norm_before_residual: bool = False,
    ) -> EagleConfig:
        """A drafter config shaped like one decoder layer of the target.

        Args:
            target_config: the target's HF config (Llama-style fields).
            version: 1 or 3.
            draft_vocab_size: EAGLE-3 draft vocab size (default: the full vocab); must be None
                or equal to the vocab size for EAGLE-1.
            aux_layers: EAGLE-3 fused layers (default ``[2, N//2, N-3]``).
            norm_before_residual: see the class docstring.
        """
        c = target_config
        n = int(c.num_hidden_layers)
        theta, scaling = _rope_from_target(c)
        heads = int(c.num_attention_heads)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        if version == 3 and aux_layers is None:
            aux_layers = [2, n // 2, n - 3]
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
            aux_layers=list(aux_layers or []),
            norm_before_residual=norm_before_residual,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (inverse of :meth:`from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EagleConfig:
        """Build from :meth:`to_dict` output; unknown keys are an error, naming them."""
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
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers the drafter needs at inference: ``(N,)`` or the 3 aux layers."""
        if self.version == 1:
            return (self.target_num_layers,)
        return tuple(self.aux_layers)

    @property
    def train_layers(self) -> tuple[int, ...]:
        """Layers training needs: the feature layers plus N (target logits via the target head).

        Sorted and unique, ready for :func:`draftsmith.train.data.hidden_states.feature_source`.
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
# Building blocks
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Llama RMSNorm (computed in float32, like HF's ``LlamaRMSNorm``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Rotary:
    """RoPE tables as in the target (HF's rope init functions), kept in float32.

    A plain object, not a module: ``drafter.to(torch.bfloat16)`` must not round the inverse
    frequencies (long positions would drift from the target's RoPE).
    """

    def __init__(self, config: EagleConfig) -> None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = LlamaRotaryEmbedding(config.llama_config())
        if rope.rope_type == "dynamic" or "longrope" in rope.rope_type:
            raise ValueError(f"rope_type {rope.rope_type!r} (position-dependent) is not supported")
        self.inv_freq = rope.inv_freq.detach().float().clone()
        self.scaling = float(rope.attention_scaling)

    def __call__(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``[B, 1, T, head_dim]``."""
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.scaling).to(dtype)[:, None]
        sin = (emb.sin() * self.scaling).to(dtype)[:, None]
        return cos, sin


class EagleCache:
    """The drafter's key/value cache (one decoder layer): keys/values ``[B, kv_heads, S, D]``.

    Keys are stored after RoPE, so entries can be cropped or reordered freely.
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[-2])

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new entries; returns all keys and values (old then new)."""
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=-2)
            self.values = torch.cat([self.values, v], dim=-2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        """Keep the first ``length`` entries."""
        if self.keys is not None and length < len(self):
            self.keys = self.keys[..., :length, :]
            self.values = self.values[..., :length, :]

    def keep(self, index: torch.Tensor) -> None:
        """Keep the entries at ``index`` (``[n]`` long), in that order."""
        if self.keys is not None:
            self.keys = self.keys.index_select(-2, index)
            self.values = self.values.index_select(-2, index)


def causal_mask(new: int, past: int, device: torch.device | None = None) -> torch.Tensor:
    """Bool mask ``[1, 1, new, past + new]``: every cached key plus the causal new keys.

    True = may attend (SDPA's boolean convention).
    """
    old = torch.ones(new, past, dtype=torch.bool, device=device)
    tri = torch.ones(new, new, dtype=torch.bool, device=device).tril()
    return torch.cat([old, tri], dim=1)[None, None]


class _Attention(nn.Module):
    def __init__(self, config: EagleConfig, in_features: int) -> None:
        super().__init__()
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(in_features, h * d, bias=False)
        self.k_proj = nn.Linear(in_features, kv * d, bias=False)
        self.v_proj = nn.Linear(in_features, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: EagleCache | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.append(k, v)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    """Llama decoder layer, EAGLE-style.

    EAGLE-1: the input is ``fc(concat(embed, f))`` and there is no input norm (SafeAILab EAGLE
    skips ``input_layernorm`` on its first layer; vLLM replaces it with Identity).
    EAGLE-3: attention reads ``concat(input_layernorm(embed), hidden_norm(g))`` (2H) where g is
    the fused feature (or the previous step's output); the residual is g (see
    ``norm_before_residual``).
    """

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.v3 = config.version == 3
        self.norm_before_residual = config.norm_before_residual
        h = config.hidden_size
        self.self_attn = _Attention(config, 2 * h if self.v3 else h)
        self.mlp = _MLP(config)
        if self.v3:
            self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: EagleCache | None,
    ) -> torch.Tensor:
        if self.v3:
            if self.norm_before_residual:
                hidden = self.hidden_norm(hidden)
                residual, normed = hidden, hidden
            else:
                residual, normed = hidden, self.hidden_norm(hidden)
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual, x = hidden, hidden
        hidden = residual + self.self_attn(x, rope, mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class SharedTarget:
    """Frozen modules borrowed from the target (never parameters of the drafter).

    Attributes:
        embed_tokens: the target's input embedding (``[V, H]``).
        lm_head: the target's output head; used by EAGLE-1 (None for EAGLE-3).
    """

    embed_tokens: nn.Module
    lm_head: nn.Module | None = None

    def __deepcopy__(self, memo: dict) -> SharedTarget:
        # Copies of a drafter (EMA, snapshots) keep sharing the target, never duplicate it.
        return self


# --------------------------------------------------------------------------------------------
# The drafter module
# --------------------------------------------------------------------------------------------


class EagleDrafter(nn.Module):
    """EAGLE-1 / EAGLE-3 drafter: fc + one Llama-style decoder layer (+ EAGLE-3's norm and head).

    Args:
        config: shapes and version.
        embed_tokens: the target's input embedding (shared, frozen; see the module docstring).
        lm_head: the target's output head, required for EAGLE-1 (shared, frozen).
    """

    def __init__(
        self, config: EagleConfig, embed_tokens: nn.Module, lm_head: nn.Module | None = None
    ) -> None:
        super().__init__()
        if config.version == 1 and lm_head is None:
            raise ValueError("EAGLE-1 needs the target's lm_head (pass lm_head=...)")
        self.config = config
        h = config.hidden_size
        n_in = 3 * h if config.version == 3 else 2 * h
        self.fc = nn.Linear(n_in, h, bias=False)
        self.layers = nn.ModuleList([_DecoderLayer(config)])
        if config.version == 3:
            self.norm = RMSNorm(h, config.rms_norm_eps)
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[: config.draft_vocab_size] = True
            self.register_buffer("t2d", t2d)
        # Plain attribute (not a submodule): kept out of parameters() and state_dict().
        self.shared = SharedTarget(embed_tokens, lm_head if config.version == 1 else None)
        self._rope = _Rotary(config)

    # -- helpers ---------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target embedding of ``ids`` ``[B, T]`` -> ``[B, T, H]`` in the drafter's dtype."""
        emb = self.shared.embed_tokens
        with torch.no_grad():
            return emb(ids.to(emb.weight.device)).to(device=self.device, dtype=self.dtype)

    def feature_tensor(self, features: Features) -> torch.Tensor:
        """The drafter's feature input from target hidden states.

        Args:
            features: ``{layer: [B, T, H]}`` holding at least :attr:`EagleConfig.feature_layers`.

        Returns:
            EAGLE-1: ``features[N]`` ``[B, T, H]``; EAGLE-3: the aux layers concatenated in
            ``aux_layers`` order, ``[B, T, 3H]`` (``fc`` fuses them inside :meth:`forward`).
        """
        missing = [i for i in self.config.feature_layers if i not in features]
        if missing:
            raise KeyError(
                f"features lack layer(s) {missing}; the drafter needs "
                f"{list(self.config.feature_layers)} (have {sorted(features)})"
            )
        parts = [features[i] for i in self.config.feature_layers]
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return x.to(device=self.device, dtype=self.dtype)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: EagleCache | None = None,
        return_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One drafter pass over T positions (training and drafting alike).

        Args:
            inputs_embeds: ``[B, T, H]`` embeddings of the tokens one step ahead (x_{t+1}).
            features: ``[B, T, F]``: EAGLE-3 accepts target aux features (F = 3H, fused by
                ``fc``) or the drafter's own previous outputs (F = H, used as they are);
                EAGLE-1 takes F = H (target final features or its own predictions).
            position_ids: ``[B, T]`` RoPE positions (position t for the input pairing f_t with
                x_{t+1}).
            attention_mask: bool ``[B or 1, 1, T, len(cache) + T]`` over (cached keys, new keys),
                True = attend. None: all cached keys plus causal over the new ones.
            cache: if given, the new keys/values are appended to it (in place) and attention
                covers the cached entries too.
            return_logits: also compute :meth:`logits` of the output (keeps every parameter
                use inside ``forward``, which DDP wrappers prefer).

        Returns:
            ``(hidden [B, T, H], logits [B, T, V_draft] or None)``. ``hidden`` is pre-norm: it
            is the next step's feature input.
        """
        h = self.config.hidden_size
        features = features.to(self.dtype)
        inputs_embeds = inputs_embeds.to(self.dtype)
        if self.config.version == 3:
            if features.shape[-1] == 3 * h:
                hidden = self.fc(features)
            elif features.shape[-1] == h:
                hidden = features
            else:
                raise ValueError(
                    f"EAGLE-3 features must have {3 * h} (target aux) or {h} (own output) "
                    f"channels, got {features.shape[-1]}"
                )
        else:
            if features.shape[-1] != h:
                raise ValueError(
                    f"EAGLE-1 features must have {h} channels, got {features.shape[-1]}"
                )
            hidden = self.fc(torch.cat([inputs_embeds, features], dim=-1))
        t = hidden.shape[1]
        past = 0 if cache is None else len(cache)
        if attention_mask is None:
            attention_mask = causal_mask(t, past, hidden.device)
        rope = self._rope(position_ids.to(hidden.device), hidden.dtype)
        for layer in self.layers:
            hidden = layer(inputs_embeds, hidden, rope, attention_mask, cache)
        return hidden, (self.logits(hidden) if return_logits else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits of drafter outputs.

        EAGLE-3: ``lm_head(norm(hidden))`` over the draft vocabulary ``[..., V_draft]``.
        EAGLE-1: the target's head applied to the predicted feature directly (the feature it
        imitates is already the target's final *normed* output), ``[..., V]``.
        """
        if self.config.version == 3:
            return self.lm_head(self.norm(hidden))
        head = self.shared.lm_head
        return head(hidden.to(device=head.weight.device, dtype=head.weight.dtype))

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids (``i + d2t[i]``; identity for EAGLE-1)."""
        if self.config.version == 1:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., V_draft]`` spread over the target vocab ``[..., V]``.

        Tokens outside the draft vocab get ``-inf`` (probability 0), so ``choose`` and
        ``logits_to_probs`` give the draft distribution in target ids. Identity for EAGLE-1.
        """
        if self.config.version == 1:
            return draft_logits
        out = draft_logits.new_full(
            (*draft_logits.shape[:-1], self.config.vocab_size), float("-inf")
        )
        index = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
        out[..., index] = draft_logits
        return out

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install EAGLE-3's vocab maps (see :func:`draftsmith.train.data.vocab.draft_vocab`)."""
        if self.config.version != 3:
            raise ValueError("EAGLE-1 predicts over the full target vocabulary; no d2t/t2d")
        _check_vocab_maps(d2t, t2d, self.config)
        self.d2t.copy_(d2t.to(self.d2t.device))
        self.t2d.copy_(t2d.to(self.t2d.device))


def _check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, cfg: EagleConfig) -> None:
    if tuple(d2t.shape) != (cfg.draft_vocab_size,):
        raise ValueError(f"d2t has shape {tuple(d2t.shape)}, expected ({cfg.draft_vocab_size},)")
    if tuple(t2d.shape) != (cfg.vocab_size,):
        raise ValueError(f"t2d has shape {tuple(t2d.shape)}, expected ({cfg.vocab_size},)")
    chosen = torch.arange(cfg.draft_vocab_size) + d2t.cpu().long()
    if not torch.equal(chosen, torch.nonzero(t2d.cpu()).flatten()):
        raise ValueError(
            "d2t and t2d disagree: arange(N) + d2t must list the target ids where t2d is True, "
            "in increasing order"
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

    Linear weights ~ N(0, init_std), norms = 1. EAGLE-3's ``lm_head`` starts as the target head's rows of the draft vocabulary
    (the drafter imitates the target's last feature, so the target's head is the natural start).

    Args:
        target: the frozen target (its embedding, and EAGLE-1's head, are shared).
        cfg: drafter config (e.g. :meth:`EagleConfig.from_target`).
        d2t, t2d: EAGLE-3 vocab maps (:func:`draftsmith.train.data.vocab.draft_vocab`); default: the
            first ``draft_vocab_size`` target ids (identity when the draft vocab is full).
        dtype: parameter dtype (float32 master weights are the usual choice for training).
        seed: seed for the random init (None: the global RNG).
        init_std: std of the random init (HF's usual 0.02).
    """
    _check_target(cfg, target.config)
    embed, head = _shared_from_target(target, cfg.version)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
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

    drafter = _unwrap(drafter)
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


def _unwrap(model: nn.Module) -> Any:
    """The drafter inside DDP/accelerate wrappers (``.module``), or the model itself."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


# --------------------------------------------------------------------------------------------
# Drafting (the Drafter protocol)
# --------------------------------------------------------------------------------------------


class EagleProposer:
    """Speculative-decoding drafter around an :class:`EagleDrafter` (chain or EAGLE-2 tree).

    State between steps: the drafter's KV cache holds only positions whose feature came from
    the target (verified); draft-step entries are appended during :meth:`propose` and cropped
    away at :meth:`accept`, whose true features of the kept positions are queued and run at the
    next :meth:`propose` (EAGLE §3: target features replace the drafter's own). Running them
    lazily is what lets one code path serve chains and trees: the loop only reports how many
    tokens were accepted, and the kept tokens themselves appear at the end of ``ids`` next time.

    Args:
        drafter: a trained (or fresh) drafter (no dropout: train/eval mode does not matter).
        tree: draft an EAGLE-2 dynamic tree (Li et al. 2024b, §4) instead of a chain. Trees are
            verified greedily only: with sampling (temperature > 0) the proposer drafts a chain.
        topk: tree branching: children per expanded node and nodes expanded per depth
            (EAGLE-2 uses 10 on GPU; 4 suits CPU).
        total_tokens: most tree nodes returned, the best by cumulative draft log-probability
            (EAGLE-2 uses 60; default 24).
    """

    def __init__(
        self,
        drafter: EagleDrafter,
        *,
        tree: bool = False,
        topk: int = 4,
        total_tokens: int = 24,
    ) -> None:
        if topk < 1 or total_tokens < 1:
            raise ValueError(f"topk and total_tokens must be >= 1, got {topk}, {total_tokens}")
        self.drafter = _unwrap(drafter)
        self.tree = tree
        self.topk = topk
        self.total_tokens = total_tokens
        self.feature_layers: tuple[int, ...] = self.drafter.config.feature_layers
        self._cache = EagleCache()
        self._pending: list[torch.Tensor] = []  # target features not yet run, [1, n, F] each
        self._real = 0  # cache entries (= positions) that came from target features
        #: Tree mode: cumulative draft log-probabilities of the last returned tree's nodes.
        self.last_scores: torch.Tensor | None = None

    def start(self, prompt_ids: torch.Tensor, features: Features | None) -> None:
        """Queue the prompt's features (run at the first propose, when x_T is known)."""
        if features is None:
            raise ValueError("EagleProposer needs target features (feature_layers)")
        self._cache = EagleCache()
        self._real = 0
        self._pending = [self.drafter.feature_tensor(features)]

    def accept(self, num_accepted: int, features: Features | None) -> None:
        """Drop the draft entries from the cache and queue the kept positions' features."""
        if features is None:
            raise ValueError("EagleProposer needs target features (feature_layers)")
        self._cache.crop(self._real)
        self._pending.append(self.drafter.feature_tensor(features))

    @torch.inference_mode()
    def _catch_up(self, ids: torch.Tensor) -> torch.Tensor:
        """Run the queued target features; return the output hidden at the last position.

        Returns:
            ``[1, 1, H]``: the drafter's guess of the feature at position L-1, whose logits give
            the first draft token (position L).
        """
        self._cache.crop(self._real)
        if not self._pending:
            raise RuntimeError("EagleProposer.propose called twice without accept()")
        feats = torch.cat(self._pending, dim=1)  # [1, P, F]
        p = feats.shape[1]
        start = self._real
        if start + p + 1 != ids.shape[1]:
            raise RuntimeError(
                f"EagleProposer out of step: {start} cached + {p} queued positions + 1 "
                f"!= {ids.shape[1]} tokens"
            )
        d = self.drafter
        tokens = ids[:, start + 1 :].to(d.device)  # x_{t+1} for each queued position t
        pos = torch.arange(start, start + p, device=d.device)[None]
        hidden, _ = d(d.embed(tokens), feats, pos, cache=self._cache)
        self._real += p
        self._pending = []
        return hidden[:, -1:]

    @torch.inference_mode()
    def propose(
        self,
        ids: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Draft k tokens (chain) or a tree of depth <= k after ``ids``."""
        last = self._catch_up(ids)
        if self.tree and sampling.greedy:
            return self._propose_tree(last, k)
        return self._propose_chain(last, k, sampling, generator)

    def _propose_chain(
        self,
        hidden: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        d = self.drafter
        pos = self._real - 1  # position of the output `hidden` came from (L-2)
        tokens, probs = [], []
        for i in range(k):
            logits = d.target_logits(d.logits(hidden)[0, -1].float())  # [V]
            tok, q = choose(logits, sampling, generator)
            tokens.append(tok)
            probs.append(q)
            if i + 1 < k:
                # Next input: (own predicted feature, embedding of the token just drafted).
                step_pos = torch.tensor([[pos + 1 + i]], device=d.device)
                hidden, _ = d(d.embed(tok.view(1, 1)), hidden, step_pos, cache=self._cache)
        return Proposal(
            tokens=torch.stack(tokens),
            probs=None if sampling.greedy else torch.stack(probs),
        )

    def _propose_tree(self, hidden: torch.Tensor, depth: int) -> Proposal:
        """EAGLE-2 dynamic tree (Li et al. 2024b, §4.1 expansion, §4.2 reranking).

        Expansion: at each depth, the ``topk`` nodes of the newest layer with the highest
        cumulative log-probability (the "frontier") are run through the drafter together, under
        a tree mask over the drafter's cache, and each gets ``topk`` children. Reranking: the
        ``total_tokens`` nodes with the best cumulative log-prob are kept. Log-probs are <= 0,
        so a child never outscores its parent; ties are broken by creation order (parents are
        created first), hence the kept set always contains every kept node's ancestors.
        """
        d = self.drafter
        dev = d.device
        topk = self.topk
        # Node arrays, in creation order (parents before children).
        tok_list: list[int] = []
        parent_list: list[int] = []
        score_list: list[float] = []

        def children(h: torch.Tensor, parents: list[int], base: list[float]) -> list[int]:
            """Add the topk children of each row of h; return the new node indices."""
            logp = torch.log_softmax(d.logits(h)[0].float(), dim=-1)  # [m, V_draft]
            val, idx = logp.topk(min(topk, logp.shape[-1]), dim=-1)
            vals, tids = val.tolist(), d.target_ids(idx).tolist()  # one device sync
            new = []
            for r, parent in enumerate(parents):
                for c in range(len(vals[r])):
                    new.append(len(tok_list))
                    tok_list.append(tids[r][c])
                    parent_list.append(parent)
                    score_list.append(base[r] + vals[r][c])
            return new

        layer = children(hidden, [-1], [0.0])
        node_hidden = {n: 0 for n in layer}  # node -> row in `feat` of its parent's output
        feat = hidden  # [1, m, H] outputs whose rows feed the next level
        slot: dict[int, int] = {}  # node -> index of its entry in the drafter cache
        base_pos = self._real - 1  # position of the root's output (L-2)
        for level in range(1, depth):
            frontier = sorted(layer, key=lambda n: (-score_list[n], n))[:topk]
            m = len(frontier)
            past = len(self._cache)
            mask = torch.zeros(m, past + m, dtype=torch.bool)
            mask[:, : self._real] = True
            for r, n in enumerate(frontier):
                a = parent_list[n]
                while a != -1:  # ancestors fed at earlier levels
                    mask[r, slot[a]] = True
                    a = parent_list[a]
                mask[r, past + r] = True
            for r, n in enumerate(frontier):
                slot[n] = past + r
            emb = d.embed(torch.tensor([[tok_list[n] for n in frontier]], device=dev))
            inp = feat[:, [node_hidden[n] for n in frontier]]
            pos = torch.full((1, m), base_pos + level, device=dev)
            out, _ = d(emb, inp, pos, attention_mask=mask[None, None].to(dev), cache=self._cache)
            layer = []
            for r, n in enumerate(frontier):
                kids = children(out[:, r : r + 1], [n], [score_list[n]])
                layer.extend(kids)
                for kid in kids:
                    node_hidden[kid] = r
            feat = out
        keep = sorted(range(len(tok_list)), key=lambda n: (-score_list[n], n))
        keep = sorted(keep[: self.total_tokens])
        new_index = {n: i for i, n in enumerate(keep)}
        parents = [new_index[parent_list[n]] if parent_list[n] != -1 else -1 for n in keep]
        self.last_scores = torch.tensor([score_list[n] for n in keep])
        return Proposal(
            tokens=torch.tensor([tok_list[n] for n in keep], dtype=torch.long, device=dev),
            parents=torch.tensor(parents, dtype=torch.long, device=dev),
        )
