"""The EAGLE drafter module: :class:`EagleDrafter`, one Llama-style decoder layer and its parts.

The design (EAGLE-1 and EAGLE-3) and the position alignment are in :mod:`draftsmith.heads.eagle`,
beside building, saving and loading a drafter; the config
(:class:`~draftsmith.heads.eagle_config.EagleConfig`) is in :mod:`draftsmith.heads.eagle_config`;
drafting with one is :class:`~draftsmith.heads.eagle_proposer.EagleProposer`.

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
``d2t`` (int64 ``[V_draft]``), ``t2d`` (bool)    buffers (saved): EAGLE-3, and EAGLE-1 with a
                                                 draft vocabulary (``V_draft < V``)
``mask_hidden`` ``[1, 3H]``                      P-EAGLE only: the placeholder feature
``fc_norm.{0,1,2}.weight``                       EAGLE-3.1 (``fc_norm``) only: one RMSNorm per
                                                 fused feature, before ``fc``
===============================================  =========================================

EAGLE-3.1 (``fc_norm`` and ``norm_output`` in the config, vLLM's and speculators' names) adds
no tensor for ``norm_output``: the final ``norm`` moves from the head into the step, so the
drafter's output (the next step's feature and the head's input) is the post-norm state.

P-EAGLE (parallel drafting) is an EAGLE-3 drafter whose config names a ``mask_token_id``: draft
positions after the first read ``(fc(mask_hidden), embed(mask_token_id))`` instead of the
drafter's own previous output and the previous draft token, so all k positions are drafted in
one causal forward (vLLM's ``parallel_drafting``: ``combine_hidden_states(mask_hidden)`` paired
with the mask token for the k-1 extra slots).

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .attention import TTTKeys, causal_attention, prefix_attention
from .base import Features
from .vocab_maps import check_vocab_maps, spread_logits, vocab_target_ids

if TYPE_CHECKING:
    from .eagle_config import EagleConfig

__all__ = ["EagleCache", "EagleDrafter", "RMSNorm", "SharedTarget", "TTTKeys"]


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


class _RMSNormFunction(torch.autograd.Function):
    """``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``, keeping only ``x``
    and the ``[..., 1]`` inverse RMS for the backward.

    Autograd on the plain expression keeps the fp32 upcast of ``x`` and the normalised tensor
    too: two ``[T, H]`` fp32 tensors per norm, four norms per EAGLE-3 training-time-test step.
    The backward recomputes the normalised tensor and applies the same chain rule.
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xf = x.float()
        normed = (xf * rstd).to(x.dtype)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * normed).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (g - x rstd^2 mean(g x)), in fp32.
            # The gradient reaches the normalised tensor in its dtype (x's), as autograd's would.
            g = (grad * weight).to(x.dtype).float()
            mean_gx = (g * xf).mean(-1, keepdim=True)
            grad_x = (rstd * (g - xf * rstd.pow(2) * mean_gx)).to(x.dtype)
        return grad_x, grad_w, None


class RMSNorm(nn.Module):
    """Llama RMSNorm (computed in float32, like HF's ``LlamaRMSNorm``).

    With grad on, the backward is :class:`_RMSNormFunction`'s (the same values, half the memory
    kept per norm); without, the plain expression.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's dtype where autocast is on (else as it is), cast once.

    Several projections of the same input (q/k/v; gate/up) would each save their own autocast
    copy of it for the backward: one cast shared by all keeps one.
    """
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(device))
    return x


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up``, keeping only ``gate`` and ``up`` for the backward.

    Autograd on the plain expression also keeps ``silu(gate)``: a third ``[T, intermediate]``
    tensor per layer and step (the largest activations of a drafter). The backward recomputes it
    (silu's derivative: ``s (1 + x (1 - s))``, ``s = sigmoid(x)``).
    """

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        grad_gate = None
        if ctx.needs_input_grad[0]:
            s = torch.sigmoid(gate.float())
            d_act = (grad * up).float()  # autograd's mul backward, in the inputs' dtype
            grad_gate = (d_act * s * (1 + gate.float() * (1 - s))).to(gate.dtype)
        return grad_gate, grad_up


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
        mask: torch.Tensor | None,
        cache: EagleCache | TTTKeys | None,
        mask_offset: int = 0,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        x = _autocast_input(x)
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if isinstance(cache, TTTKeys):
            # Training-time test: causal over step 0's keys, diagonal over later steps' (no
            # mask, memory linear in T x steps; heads/attention.py).
            if mask is not None:
                raise ValueError("a TTT unroll attends by its own layout: pass no attention_mask")
            out = cache.attend(q, k, v)
        else:
            past = 0 if cache is None else len(cache)
            if cache is not None:
                k, v = cache.append(k, v)
            if mask is None and past == 0:
                out = causal_attention(q, k, v)
            else:
                # The cached context (every new query sees it) by a fused kernel, the new keys
                # under their small mask (causal, or the tree's), merged exactly.
                prefix = past if mask is None else mask_offset
                if mask is None:
                    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
                out = prefix_attention(q, k, v, prefix, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _autocast_input(x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.silu and torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return self.down_proj(_SwiGLU.apply(gate, up))
        return self.down_proj(self.act(gate) * up)


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
        mask: torch.Tensor | None,
        cache: EagleCache | TTTKeys | None,
        mask_offset: int = 0,
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
        hidden = residual + self.self_attn(x, rope, mask, cache, mask_offset)
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
    # EAGLE-1's draft-vocabulary rows of ``lm_head``: (the d2t, its in-place version, rows).
    rows: tuple[torch.Tensor, int, torch.Tensor] | None = None

    def head_rows(self, d2t: torch.Tensor) -> torch.Tensor:
        """The target head's rows of a draft vocabulary ``[N, H]`` (EAGLE-1), gathered once.

        Gathered again when the head moves or changes dtype, or for other maps (another
        ``d2t`` tensor, or the same one changed in place).
        """
        w = self.lm_head.weight
        if self.rows is not None:
            made_for, version, rows = self.rows
            if (
                made_for is d2t
                and version == d2t._version
                and rows.device == w.device
                and rows.dtype == w.dtype
            ):
                return rows
        with torch.no_grad():
            rows = w[vocab_target_ids(d2t).to(w.device)].detach()
        self.rows = (d2t, d2t._version, rows)
        return rows

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
        self.has_vocab_maps = config.version == 3 or config.reduced_vocab
        if self.has_vocab_maps:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[: config.draft_vocab_size] = True
            self.register_buffer("t2d", t2d)
        if config.fc_norm:
            # EAGLE-3.1: each target feature normed on its own before fusing (vLLM applies
            # them to the 3 equal chunks of the concatenated aux hidden states).
            self.fc_norm = nn.ModuleList(RMSNorm(h, config.rms_norm_eps) for _ in range(3))
        if config.parallel:
            # P-EAGLE's placeholder feature, in the fused-feature space (3H) so that ``fc`` maps
            # it like a target feature, as vLLM does once at load.
            self.mask_hidden = nn.Parameter(torch.zeros(1, n_in))
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
            EAGLE-1: ``features[N]`` ``[B, T, H]``; EAGLE-3: the 3 feature layers concatenated
            in ``feature_layers`` order, ``[B, T, 3H]`` (``fc`` fuses them inside :meth:`forward`).
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
        cache: EagleCache | TTTKeys | None = None,
        return_logits: bool = False,
        head_fn: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        mask_offset: int = 0,
    ) -> tuple[torch.Tensor, Any]:
        """One drafter pass over T positions (training and drafting alike).

        Args:
            inputs_embeds: ``[B, T, H]`` embeddings of the tokens one step ahead (x_{t+1}).
            features: ``[B, T, F]``: EAGLE-3 accepts target aux features (F = 3H, fused by
                ``fc``) or the drafter's own previous outputs (F = H, used as they are);
                EAGLE-1 takes F = H (target final features or its own predictions).
            position_ids: ``[B, T]`` RoPE positions (position t for the input pairing f_t with
                x_{t+1}).
            attention_mask: bool ``[B or 1, 1, T, len(cache) + T - mask_offset]`` over the
                (cached, new) keys from ``mask_offset`` on, True = attend; keys before
                ``mask_offset`` are visible to every query (the verified context of an EAGLE-2
                tree). None: all cached keys plus causal over the new ones.
            cache: an :class:`EagleCache` (drafting): the new keys/values are appended to it (in
                place) and attention covers the cached entries too. A
                :class:`~draftsmith.heads.attention.TTTKeys` (training): the unroll's steps, in
                order; step 0 attends causally, later steps to step 0's keys causally and to
                their own position in each earlier step (EAGLE-3 §3.3), with no mask (right
                padding: see :mod:`draftsmith.heads.attention`).
            mask_offset: see ``attention_mask``.
            return_logits: also compute :meth:`logits` of the output (keeps every parameter
                use inside ``forward``, which DDP wrappers prefer).
            head_fn: EAGLE-3 only, instead of ``return_logits``: ``head_fn(head_input [B, T, H],
                lm_head.weight [V_draft, H])`` is returned in place of the logits, so a loss can
                apply the head chunk by chunk (never holding ``[B, T, V_draft]``) while the
                head's weight is still used inside ``forward`` (FSDP gathers it only there).

        Returns:
            ``(hidden [B, T, H], logits [B, T, V_draft] or None)``. ``hidden`` is the next
            step's feature input: pre-norm, or post-norm with ``norm_output`` (EAGLE-3.1).
        """
        h = self.config.hidden_size
        features = features.to(self.dtype)
        inputs_embeds = inputs_embeds.to(self.dtype)
        if self.config.version == 3:
            if features.shape[-1] == 3 * h:
                if self.config.fc_norm:
                    parts = features.split(h, dim=-1)
                    features = torch.cat(
                        [n(f) for n, f in zip(self.fc_norm, parts, strict=True)], dim=-1
                    )
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
        rope = self._rope(position_ids.to(hidden.device), hidden.dtype)
        for layer in self.layers:
            hidden = layer(inputs_embeds, hidden, rope, attention_mask, cache, mask_offset)
        if self.config.norm_output:
            hidden = self.norm(hidden)  # EAGLE-3.1: the post-norm state goes on (and to the head)
        if head_fn is not None:
            if self.config.version != 3:
                raise ValueError("head_fn is for EAGLE-3's own head; EAGLE-1 uses the target's")
            head_in = hidden if self.config.norm_output else self.norm(hidden)
            return hidden, head_fn(head_in, self.lm_head.weight)
        return hidden, (self.logits(hidden) if return_logits else None)

    def placeholders(self, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """P-EAGLE's inputs for draft positions after the first.

        Returns:
            ``(embeds [batch, length, H], features [batch, length, 3H])``: the mask token's
            embedding and ``mask_hidden``, to be passed to :meth:`forward` (which fuses the
            features with ``fc``, keeping every parameter use inside ``forward``).
        """
        if not self.config.parallel:
            raise ValueError("this drafter drafts one position per forward (no mask_token_id)")
        ids = torch.full((batch, length), self.config.mask_token_id, device=self.device)
        feats = self.mask_hidden.to(self.dtype).view(1, 1, -1).expand(batch, length, -1)
        return self.embed(ids), feats

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits of drafter outputs.

        EAGLE-3: ``lm_head(norm(hidden))`` over the draft vocabulary ``[..., V_draft]``;
        ``lm_head(hidden)`` with ``norm_output`` (EAGLE-3.1: :meth:`forward` has normed it).
        EAGLE-1: the target's head applied to the predicted feature directly (the feature it
        imitates is already the target's final *normed* output), ``[..., V]``.
        """
        if self.config.version == 3:
            return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))
        head = self.shared.lm_head
        hidden = hidden.to(device=head.weight.device, dtype=head.weight.dtype)
        if not self.has_vocab_maps:
            return head(hidden)
        # A draft vocabulary (FR-Spec): only its rows of the target head are computed, which is
        # most of EAGLE-1's drafting cost (49,152 x 576 MACs a token for SmolLM2 against ~4M in
        # the decoder layer). The frozen rows are gathered once and kept beside the shared head.
        return F.linear(hidden, self.shared.head_rows(self.d2t))

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids (``i + d2t[i]``; identity without vocab maps)."""
        if not self.has_vocab_maps:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., V_draft]`` spread over the target vocab ``[..., V]``.

        Tokens outside the draft vocab get ``-inf`` (probability 0), so ``choose`` and
        ``logits_to_probs`` give the draft distribution in target ids. Identity for EAGLE-1.
        """
        if not self.has_vocab_maps:
            return draft_logits
        return spread_logits(draft_logits, self.d2t, self.config.vocab_size)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the vocab maps (see :func:`draftsmith.train.data.vocab.draft_vocab`)."""
        if not self.has_vocab_maps:
            raise ValueError(
                "this EAGLE-1 drafter predicts over the full target vocabulary "
                "(draft_vocab_size == vocab_size): no d2t/t2d"
            )
        check_vocab_maps(d2t, t2d, self.config.draft_vocab_size, self.config.vocab_size)
        self.d2t.copy_(d2t.to(self.d2t.device))
        self.t2d.copy_(t2d.to(self.t2d.device))
        self.shared.rows = None
