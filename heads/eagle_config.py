"""The EAGLE drafter's config: :class:`EagleConfig`, its shape and the target layers it reads.

One record for EAGLE-1 and EAGLE-3 (``version``): the decoder layer's shapes, taken from the
target's config by :meth:`EagleConfig.from_target`, the vocabularies, and ``feature_layers``, the
target hidden states the drafter reads. It is what a saved drafter's ``config.json`` holds
(:meth:`EagleConfig.to_dict` / :meth:`EagleConfig.from_dict`), and what the network
(:mod:`draftsmith.heads.eagle_model`), building, saving and loading
(:mod:`draftsmith.heads.eagle`) and the exports read. It imports nothing else of ours, so every
one of them can import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from .families import FAMILIES

__all__ = ["EagleConfig"]


def config_from_fields(cls: type, d: dict[str, Any]) -> Any:
    """``cls(**d)`` for a drafter config dataclass; unknown or missing keys are one error
    naming each (shared by :class:`EagleConfig` and DFlash's config)."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s): {unknown}")
    missing = sorted(
        f.name
        for f in fields(cls)
        if f.name not in d and f.default is MISSING and f.default_factory is MISSING
    )
    if missing:
        raise ValueError(f"{cls.__name__} is missing field(s): {missing}")
    return cls(**d)


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
        draft_vocab_size: the draft vocabulary's size (EAGLE-3 §3, FR-Spec): EAGLE-3's head has
            this many rows; EAGLE-1 drafts with these rows of the target's head (its
            ``d2t``/``t2d`` maps exist only when it is smaller than ``vocab_size``).
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
        mask_token_id: P-EAGLE (parallel drafting, EAGLE-3 only): the token whose embedding
            fills the input of every draft position after the first, paired with the learned
            feature ``mask_hidden``, so one forward drafts all k positions (vLLM's
            ``parallel_drafting``, which reads this id as the drafter's ``mask_token_id``).
            None: one position per forward (EAGLE-1 / EAGLE-3).
        fc_norm: EAGLE-3.1 (arXiv 2605.09992; vLLM's and speculators' ``fc_norm``): an RMSNorm
            on each of the 3 target features before ``fc``, ``fc(concat(norm_i(f_i)))``, so the
            layers weigh alike whatever their scale (SmolLM2's deep layers are ~10x the shallow
            ones). EAGLE-3 only.
        norm_output: EAGLE-3.1's other half (``norm_output``): the drafter's output is the
            *post*-final-norm state, fed to the next draft step and to ``lm_head`` as it is,
            which stops the magnitude drift of deep draft steps. EAGLE-3 only.
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
    mask_token_id: int | None = None
    fc_norm: bool = False
    norm_output: bool = False

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
            if self.mask_token_id is not None:
                out.append("parallel drafting (mask_token_id) is for EAGLE-3 drafters (P-EAGLE)")
            if self.fc_norm or self.norm_output:
                out.append("fc_norm and norm_output (EAGLE-3.1) are EAGLE-3 variants")
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
            if self.mask_token_id is not None and (self.fc_norm or self.norm_output):
                # vLLM 0.32's peagle config reader passes neither field on: a P-EAGLE drafter
                # trained with them would be served without them.
                out.append("fc_norm and norm_output (EAGLE-3.1) are not served for P-EAGLE")
            if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
                out.append(
                    f"mask_token_id must be a token id in [0, {self.vocab_size}), "
                    f"got {self.mask_token_id}"
                )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            out.append(
                f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}"
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
        mask_token_id: int | None = None,
        fc_norm: bool = False,
        norm_output: bool = False,
    ) -> EagleConfig:
        """A drafter config shaped like one decoder layer of the target.

        Args:
            target_config: the target's HF config (Llama-style fields).
            version: 1 or 3.
            draft_vocab_size: draft vocab size (default: the full vocab). EAGLE-3's own head
                has this many rows; EAGLE-1 drafts with these rows of the target's head.
            feature_layers: target layers the drafter reads (default: its family's
                :attr:`~draftsmith.heads.families.Family.feature_layers`, ``[N]`` for EAGLE-1,
                ``[2, N//2, N-3]`` for EAGLE-3).
            norm_before_residual: see the class docstring.
            mask_token_id: P-EAGLE: the placeholder token of parallel drafting (see the class
                docstring); None for a drafter that drafts one position per forward.
            fc_norm: EAGLE-3.1's per-feature norms before ``fc`` (class docstring).
            norm_output: EAGLE-3.1's post-norm output (class docstring).
        """
        c = target_config
        n = int(c.num_hidden_layers)
        theta, scaling = _rope_from_target(c)
        heads = int(c.num_attention_heads)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        if feature_layers is None:  # the family's rule (heads/families.py)
            feature_layers = FAMILIES[f"eagle{version}"].feature_layers(n)
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
            mask_token_id=mask_token_id,
            fc_norm=fc_norm,
            norm_output=norm_output,
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
        return config_from_fields(cls, d)

    @property
    def reduced_vocab(self) -> bool:
        """Whether the drafter drafts over fewer tokens than the target has (vocab maps)."""
        return self.draft_vocab_size < self.vocab_size

    @property
    def parallel(self) -> bool:
        """Whether the drafter drafts all positions in one forward (P-EAGLE)."""
        return self.mask_token_id is not None

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
