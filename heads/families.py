"""Every drafter family, declared once: :data:`FAMILIES` (and the recipes that train them, :data:`RECIPES`).

A family is one record: its ``--drafter`` kinds and their shape (chain, tree or parallel), the
target layers it reads, the recipe and config class that train it, and the export formats with the
engine and method that serve each. Everything that lists families reads this module: the CLI's
``train`` table and command configs (``recipes/cli.py``), evaluate's kinds
(:data:`draftsmith.heads.registry.DRAFTERS`), the cache presets (``draftsmith data cache
--preset``), the bench's family and shape columns, the served stage's vLLM plans and export
dispatch (``draftsmith export --format``). A plain dict of frozen records, as SpecForge's
algorithm registry and speculators' config discriminators are: no plugin machinery.

Code is named, not imported (``"heads.eagle:EAGLE"``, relative to the package, resolved by
:func:`resolve`): the recipes and export writers sit above every module that reads the
declaration, so importing them here would close import circles (tests/test_imports.py), and
``draftsmith --help`` stays free of torch. tests/test_families.py resolves every name.

Adding a family: a drafter module in ``heads/`` (its ``DrafterKind``), an objective, a recipe,
export writers, and one :class:`Family` entry below (docs/design.md, "Adding a family").
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

PACKAGE = "draftsmith"

#: How a kind's drafts are shaped: one token per position drafted autoregressively (``chain``),
#: a tree of candidates verified in one target forward (``tree``), or all k positions drafted in
#: one drafter forward (``parallel``).
Shape = Literal["chain", "tree", "parallel"]


@dataclass(frozen=True)
class Kind:
    """One ``--drafter`` kind of ``draftsmith evaluate`` / ``bench``.

    Attributes:
        name: the spec's ``KIND``.
        builder: a :class:`~draftsmith.heads.base.DrafterKind` (how the kind is built), named
            ``module:attribute`` relative to the package.
        shape: what its drafts look like.
        loop: ``ours`` (the verification loop of ``train/decoding``) or ``transformers`` (a
            reference that runs ``generate`` itself; no recommendation, never served).
        serves: why the bench's served stage does not serve this kind, or None when it does
            (through the family's vLLM method).
    """

    name: str
    builder: str
    shape: Shape = "chain"
    loop: Literal["ours", "transformers"] = "ours"
    serves: str | None = None


@dataclass(frozen=True)
class ExportFormat:
    """One ``draftsmith export --format``.

    Attributes:
        name: the ``--format`` value.
        writer: ``writer(request) -> Path``, named ``module:function``; ``request`` is a
            :class:`~draftsmith.train.export.common.ExportRequest`.
        engine: what loads it: ``vllm``, ``sglang``, ``transformers`` or ``medusa``
            (FasterDecoding/Medusa's own code).
        method: the engine's name for the method: vLLM's ``speculative_config["method"]``,
            SGLang's ``--speculative-algorithm``; None where the engine has no such setting.
        title: the model card's title.
        speculative_config: further entries of vLLM's ``speculative_config`` the method needs
            (P-EAGLE: ``parallel_drafting``), as ``(key, value)`` pairs.
        k_from_export: the export fixes vLLM's ``num_speculative_tokens`` (DFlash: its block
            size - 1; a shorter block changes what its bidirectional attention computes), read
            from the export's ``speculators_config``; served at that k whatever the bench's.
    """

    name: str
    writer: str
    engine: Literal["vllm", "sglang", "transformers", "medusa"]
    method: str | None
    title: str
    speculative_config: tuple[tuple[str, Any], ...] = ()
    k_from_export: bool = False


@dataclass(frozen=True)
class Recipe:
    """One ``draftsmith train RECIPE`` (= ``python recipes/RECIPE.py``).

    Attributes:
        name: the recipe's name on the command line.
        module: the recipe module (``recipes.eagle``), which has ``main(argv)``.
        config: its config dataclass's name in that module.
        help: a line for ``draftsmith train --help``.
    """

    name: str
    module: str
    config: str
    help: str


@dataclass(frozen=True)
class Family:
    """One drafter family.

    Attributes:
        name: its name (``eagle3``); also the ``draftsmith data cache --preset`` of a family that
            reads target layers.
        title: how reports and model cards call it (``EAGLE-3``).
        kinds: its ``--drafter`` kinds.
        recipe: the :data:`RECIPES` entry that trains it; None for a drafter without training.
        feature_layers: ``feature_layers(num_hidden_layers)`` -> the target hidden states the
            drafter reads (:data:`~draftsmith.heads.base.Features` indices: 0 = embeddings,
            ``n`` = the final normed output); None for a drafter that reads none.
        exports: the formats its checkpoints export to, the engine's own first.
        served_method: vLLM's method for a family served without an export (``ngram``).
        checkpoint: ``(key, value)`` in a checkpoint's ``config.json`` that tells this family
            from another with the same kinds (EAGLE-1 and EAGLE-3 are both ``eagle``), as
            speculators' config classes are told apart by a discriminator field.
    """

    name: str
    title: str
    kinds: tuple[Kind, ...]
    recipe: str | None = None
    feature_layers: Callable[[int], tuple[int, ...]] | None = None
    exports: tuple[ExportFormat, ...] = ()
    served_method: str | None = None
    checkpoint: tuple[str, Any] | None = field(default=None)

    def cache_layers(self, num_layers: int) -> list[int]:
        """The hidden states its offline cache stores: the layers it reads plus the final normed
        output (training's labels and EAGLE-1's regression target), sorted."""
        if self.feature_layers is None:
            raise ValueError(f"the {self.name} family reads no target layers")
        return sorted({*self.feature_layers(num_layers), num_layers})

    def vllm_export(self) -> ExportFormat | None:
        """The export vLLM serves, or None."""
        return next((f for f in self.exports if f.engine == "vllm"), None)


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3 fuses a low, a middle and a high layer (Li et al. 2025, §3): the inputs to layers
    2, n/2 and n-3 (outputs of layers 1, n/2-1, n-4), as SpecForge and vLLM choose them."""
    return (2, num_layers // 2, num_layers - 3)


def final_layer(num_layers: int) -> tuple[int, ...]:
    """EAGLE-1 (Li et al. 2024, §3) and Medusa (Cai et al. 2024, §2.1) read the last feature."""
    return (num_layers,)


RECIPES: dict[str, Recipe] = {
    "eagle": Recipe(
        "eagle",
        "recipes.eagle",
        "EagleTrainConfig",
        "EAGLE-1 / EAGLE-3 / P-EAGLE drafter on the target's features",
    ),
    "dflash": Recipe(
        "dflash",
        "recipes.dflash",
        "DFlashTrainConfig",
        "DFlash block drafter (all block positions in one forward) on the target's features",
    ),
    "medusa": Recipe(
        "medusa", "recipes.medusa", "MedusaConfig", "Medusa-1 / Medusa-2 heads on the target"
    ),
    "distill": Recipe(
        "distill", "recipes.distill", "DistillConfig", "a small draft LM distilled from the target"
    ),
}

_TREES_NOT_SERVED = "the bench serves chains; serve the chain kind of this drafter"
_HF_LOOP = "transformers' own loop (a reference)"
#: EAGLE-1 and EAGLE-3 share their kinds; a checkpoint's ``version`` tells them apart.
_EAGLE_KINDS = (
    Kind("eagle", "heads.eagle:EAGLE"),
    Kind("eagle-tree", "heads.eagle:EAGLE_TREE", "tree", serves=_TREES_NOT_SERVED),
)

FAMILIES: dict[str, Family] = {
    "eagle3": Family(
        "eagle3",
        "EAGLE-3",
        kinds=_EAGLE_KINDS,
        recipe="eagle",
        feature_layers=eagle3_layers,
        exports=(
            ExportFormat(
                "speculators",
                "train.export.eagle:write",
                "vllm",
                "eagle3",
                "EAGLE-3 drafter (vLLM / speculators format)",
            ),
            ExportFormat(
                "eagle3",
                "train.export.eagle:write",
                "sglang",
                "EAGLE3",
                "EAGLE-3 drafter (SGLang / original EAGLE-3 format)",
            ),
        ),
        checkpoint=("version", 3),
    ),
    "eagle1": Family(
        "eagle1",
        "EAGLE-1",
        kinds=_EAGLE_KINDS,
        recipe="eagle",
        feature_layers=final_layer,
        exports=(
            ExportFormat(
                "eagle",
                "train.export.eagle:write",
                "vllm",
                "eagle",
                "EAGLE-1 drafter (vLLM `eagle` format)",
            ),
        ),
        checkpoint=("version", 1),
    ),
    "peagle": Family(
        "peagle",
        "P-EAGLE",
        kinds=(Kind("peagle", "heads.eagle:PEAGLE", "parallel"),),
        recipe="eagle",
        feature_layers=eagle3_layers,
        exports=(
            ExportFormat(
                "peagle",
                "train.export.eagle:write",
                "vllm",
                "eagle3",
                "P-EAGLE drafter (vLLM / speculators format, parallel drafting)",
                speculative_config=(("parallel_drafting", True),),
            ),
        ),
    ),
    "dflash": Family(
        "dflash",
        "DFlash",
        kinds=(Kind("dflash", "heads.dflash:DFLASH", "parallel"),),
        recipe="dflash",
        feature_layers=eagle3_layers,
        exports=(
            ExportFormat(
                "dflash",
                "train.export.dflash:write",
                "vllm",
                "dflash",
                "DFlash block drafter (vLLM / speculators format)",
                k_from_export=True,
            ),
        ),
    ),
    "medusa": Family(
        "medusa",
        "Medusa",
        kinds=(
            Kind("medusa", "heads.medusa:MEDUSA"),
            Kind("medusa-tree", "heads.medusa:MEDUSA_TREE", "tree", serves=_TREES_NOT_SERVED),
        ),
        recipe="medusa",
        feature_layers=final_layer,
        exports=(
            ExportFormat(
                "medusa-vllm",
                "train.export.medusa:write_vllm",
                "vllm",
                "medusa",
                "Medusa heads (vLLM format)",
            ),
            ExportFormat(
                "medusa",
                "train.export.medusa:write_original",
                "medusa",
                None,
                "Medusa heads (FasterDecoding/Medusa format)",
            ),
        ),
    ),
    "draft-lm": Family(
        "draft-lm",
        "draft LM",
        kinds=(
            Kind("draft-lm", "heads.draft_lm:DRAFT_LM"),
            Kind(
                "hf-assisted",
                "heads.hf_assisted:HF_ASSISTED",
                loop="transformers",
                serves=f"{_HF_LOOP}; serve draft-lm=DIR for the draft",
            ),
        ),
        recipe="distill",
        exports=(
            ExportFormat(
                "hf",
                "train.export.hf:write",
                "vllm",
                "draft_model",
                "distilled draft model (Hugging Face format)",
            ),
        ),
    ),
    "ngram": Family(
        "ngram",
        "n-gram lookup",
        kinds=(
            Kind("ngram", "heads.ngram:NGRAM"),
            Kind(
                "hf-prompt-lookup",
                "heads.hf_assisted:HF_PROMPT_LOOKUP",
                loop="transformers",
                serves=f"{_HF_LOOP}; vLLM's counterpart is ngram",
            ),
        ),
        served_method="ngram",
    ),
    "suffix": Family(
        "suffix",
        "suffix lookup",
        kinds=(
            Kind(
                "suffix",
                "heads.suffix:SUFFIX",
                serves="vLLM's suffix method needs arctic-inference, not in our vLLM venv",
            ),
        ),
        served_method="suffix",
    ),
}

#: ``--drafter none``: plain decoding only (no family).
PLAIN_KIND = "none"


# --------------------------------------------------------------------------------------------
# Reading the declaration
# --------------------------------------------------------------------------------------------


def resolve(ref: str) -> Any:
    """The object a ``module:attribute`` name (relative to the package) refers to."""
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(f"{PACKAGE}.{module}"), attribute)


def kinds() -> dict[str, Kind]:
    """Every ``--drafter`` kind, in declaration order (a kind shared by families once)."""
    out: dict[str, Kind] = {}
    for family in FAMILIES.values():
        for kind in family.kinds:
            out.setdefault(kind.name, kind)
    return out


#: The prefix of a ``--drafter`` spec whose steps are chosen per step (``heads/auto.py``):
#: ``auto:KIND[=DIR]`` wraps a trained kind with the lookups.
AUTO_PREFIX = "auto:"


def auto_kinds() -> list[str]:
    """The kinds ``auto:KIND`` can wrap: trained drafters that propose to our loop (their
    proposals carry confidences)."""
    return [
        name
        for name, kind in kinds().items()
        if kind.loop == "ours" and any(f.recipe for f in families_of_kind(name))
    ]


def families_of_kind(kind: str) -> list[Family]:
    """The families that declare ``kind`` (several when a checkpoint tells them apart)."""
    return [f for f in FAMILIES.values() if any(k.name == kind for k in f.kinds)]


def family_of(kind: str, path: str | Path | None = None) -> Family | None:
    """The family of a ``--drafter`` spec's kind and path.

    Where several families share the kind, the checkpoint's ``config.json`` decides (its
    :attr:`Family.checkpoint` field); None when it cannot be read or names none of them, or for
    ``none`` and unknown kinds.
    """
    candidates = families_of_kind(kind)
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    try:
        config = json.loads((Path(path or "") / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for family in candidates:
        if family.checkpoint and config.get(family.checkpoint[0]) == family.checkpoint[1]:
            return family
    return None


def export_formats() -> dict[str, tuple[Family, ExportFormat]]:
    """Every export format by its ``--format`` name, with its family."""
    return {fmt.name: (family, fmt) for family in FAMILIES.values() for fmt in family.exports}


def cache_presets() -> dict[str, Family]:
    """The families that read target layers, by name: ``draftsmith data cache --preset``."""
    return {name: f for name, f in FAMILIES.items() if f.feature_layers is not None}


def cache_layers(preset: str, num_layers: int) -> list[int]:
    """The layers ``draftsmith data cache --preset PRESET`` stores for an n-layer target.

    Raises:
        ValueError: an unknown preset (the message lists the known ones).
    """
    presets = cache_presets()
    if preset not in presets:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(presets)}")
    return presets[preset].cache_layers(num_layers)


def vllm_serving(spec_kind: str, path: str | None) -> tuple[str | None, str] | str:
    """How vLLM serves a ``--drafter`` spec: ``(export format or None, vLLM method)``, or why not.

    A trained family is served from its vLLM export (written from ``path``), a lookup family by
    its method alone.
    """
    if spec_kind.startswith(AUTO_PREFIX):
        return (
            "the per-step decision (auto) runs in draftsmith's loop only: no engine chooses what "
            "to verify per step from calibrated confidences; its export's card says which parts "
            "vLLM serves (the chain; the lookup alone as its ngram method)"
        )
    kind = kinds().get(spec_kind)
    if kind is None:
        return f"unknown kind {spec_kind!r}"
    if kind.serves is not None:
        return kind.serves
    family = family_of(spec_kind, path)
    if family is None:
        return f"cannot tell the family of {spec_kind}={path} from its config.json"
    if family.served_method is not None:
        return None, family.served_method
    export = family.vllm_export()
    if export is None or export.method is None:
        return f"vLLM serves no {family.title} drafters"
    if not path:
        return f"give {spec_kind}=DIR: an unsaved drafter cannot be served"
    return export.name, export.method
