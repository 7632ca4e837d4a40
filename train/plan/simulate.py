"""A training step run on fake tensors, with every byte it allocates counted.

:func:`simulate_step` builds the drafter (and, for online features, a target of the same layer
shapes) under PyTorch's ``FakeTensorMode`` -- tensors with shapes, dtypes and devices but no
storage -- and runs one training step of the EAGLE recipe's own code: the target's forward
(:func:`~draftsmith.train.features.source.compute_hidden_states`), the drafter's loss
(:func:`~draftsmith.train.objectives.eagle_ttt.eagle3_ttt_loss` or ``eagle1_loss``) under bf16
autocast when the run uses it, the backward and the AdamW step. A dispatch mode under the fake
mode sees every operation's outputs; each new storage is counted from its creation until it is
freed (a weak reference to the storage tells), so the maximum of the live total is the step's
peak as the code allocates it: what autograd keeps for the backward, the transient tensors of
the loss's chunks and of the backward, the optimizer's temporaries. Nothing is computed, so a
step of an 8B drafter at 8k tokens takes seconds on any machine.

What the step does not allocate (weights, gradients, AdamW's state, which exist before it) is
counted from parameter counts by :mod:`.memory`, as are what FSDP and DDP add.

The target's forward runs on a target of 4 layers shaped like the real one: a frozen forward
keeps only the layers the drafter reads (hooks), so its memory does not depend on depth, only on
one layer's width; the drafter and its loss are the real sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MemoryTracker", "StepMemory", "StepSpec", "simulate_step"]


class MemoryTracker(TorchDispatchMode):
    """Bytes of the storages created while it is active: live now, and the peak so far.

    A storage counts from the operation that creates it until it is freed. Outputs that alias an
    input (views) create nothing. The live total is recomputed (dead storages dropped) only when
    the running total, which may still hold dead ones, would set a new peak: it is an upper bound
    of the true total, so no peak is missed.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[Any, int]] = {}
        self._total = 0
        self.peak = 0
        self.ops = 0

    def _prune(self) -> None:
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for k in dead:
            self._total -= self._live.pop(k)[1]

    @property
    def live(self) -> int:
        """Bytes alive now (created under this tracker)."""
        self._prune()
        return self._total

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        self.ops += 1
        inputs = {
            t.untyped_storage()._cdata
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        grew = False
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._live:
                continue
            size = storage.nbytes()
            self._live[key] = (StorageWeakRef(storage), size)
            self._total += size
            grew = True
        if grew and self._total > self.peak:
            self._prune()
            self.peak = max(self.peak, self._total)
        return out


@dataclass(frozen=True)
class StepSpec:
    """One EAGLE training step, as the recipe's config and the launch shape it.

    Attributes:
        target_config: the target's Hugging Face config (full size).
        version: EAGLE 1 or 3.
        parallel: P-EAGLE (parallel drafting, version 3).
        feature_layers: EAGLE-3's fused layers (None: the family's default).
        draft_vocab_size: the draft vocabulary (None: the target's).
        ttt_steps: EAGLE-3 unroll steps.
        loss: EAGLE-3's per-step loss kind.
        fc_norm: EAGLE-3.1's feature norms.
        norm_output: EAGLE-3.1's post-norm output.
        seq_len: tokens per sample (the recipe's ``max_length``; samples padded to it).
        micro_batch: samples per process per micro-batch (``batch_size``).
        online: the target computes the features in the step (else an offline cache).
        target_dtype: the target's weights (``torch.bfloat16`` or ``torch.float32``).
        autocast: bf16 autocast of the drafter (``mixed_precision: bf16``).
        foreach: AdamW's multi-tensor path (PyTorch's default on CUDA, not on the CPU).
        device: the device type the plan is for (``cuda`` or ``cpu``); the fake tensors are
            CPU tensors either way (the kernels' shapes are the same).
    """

    target_config: Any
    version: int = 3
    parallel: bool = False
    feature_layers: tuple[int, ...] | None = None
    draft_vocab_size: int | None = None
    ttt_steps: int = 7
    loss: str = "kl"
    fc_norm: bool = False
    norm_output: bool = False
    seq_len: int = 2048
    micro_batch: int = 1
    online: bool = False
    target_dtype: torch.dtype = torch.bfloat16
    autocast: bool = True
    foreach: bool = True
    device: str = "cuda"


@dataclass
class StepMemory:
    """What one simulated step allocated (bytes), beyond what existed before it.

    Attributes:
        peak: the most bytes alive at once during the step (forward, backward, optimizer).
        forward_peak: the most during the forward (target and drafter).
        after_forward: alive when the forward returns (what the backward will read).
        features: the batch's hidden states (online: computed by the target; offline: read).
        ops: operations run.
    """

    peak: int
    forward_peak: int
    after_forward: int
    features: int
    ops: int
    phases: dict[str, int] = field(default_factory=dict)


def eagle_config(spec: StepSpec) -> Any:
    """The drafter's :class:`~draftsmith.heads.eagle_config.EagleConfig` for ``spec``."""
    from ...heads.eagle_config import EagleConfig

    return EagleConfig.from_target(
        spec.target_config,
        spec.version,
        feature_layers=spec.feature_layers,
        draft_vocab_size=spec.draft_vocab_size,
        mask_token_id=0 if spec.parallel else None,
        fc_norm=spec.fc_norm,
        norm_output=spec.norm_output,
    )


def target_config_with_layers(config: Any, layers: int) -> Any:
    """``config`` with ``layers`` decoder layers, every other field as it is.

    Per-layer lists (``layer_types``: Qwen3, Gemma; any list as long as the layer count) are cut
    to the new depth before the config is rebuilt: transformers validates their length.
    """
    data = config.to_dict()
    n = data.get("num_hidden_layers")
    for key, value in data.items():
        if isinstance(value, list) and n is not None and len(value) == n and key != "architectures":
            data[key] = value[:layers]
    return type(config).from_dict({**data, "num_hidden_layers": layers})


@contextlib.contextmanager
def _fake_mode() -> Iterator[Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        yield mode


def mixed_precision_forward(module: torch.nn.Module, device_type: str) -> None:
    """Wrap ``module.forward`` the way accelerate does for ``mixed_precision: bf16``.

    bf16 autocast around the forward only (what runs outside it -- the labels' head -- does not
    autocast), then every bf16 tensor of the output converted to fp32 (accelerate's
    ``convert_outputs_to_fp32``), so the step allocates what a prepared model allocates.
    """
    from types import MethodType

    from accelerate.utils import convert_outputs_to_fp32

    forward = torch.autocast(device_type, dtype=torch.bfloat16)(type(module).forward)
    module.forward = MethodType(convert_outputs_to_fp32(forward), module)


def build_step(spec: StepSpec, target: torch.nn.Module | None = None) -> dict[str, Any]:
    """The models of one step: the target (a stand-in of the layers' shapes unless given), the
    drafter (mixed precision as accelerate wraps it) and its AdamW, with gradients and AdamW's
    state already allocated (they exist before any step of a run).

    Returns:
        ``{"target", "head", "drafter", "optimizer", "layers"}``: ``layers`` maps the drafter's
        feature layers (and N) to the given target's hidden-state indices.
    """
    from transformers import AutoModelForCausalLM

    from ...heads.eagle_model import EagleDrafter

    if spec.version not in (1, 3):
        raise ValueError(f"version must be 1 or 3, got {spec.version}")
    cfg = eagle_config(spec)
    wanted = sorted({*cfg.feature_layers, cfg.target_num_layers})
    if target is None:
        # The embedding and head at full size; for online features, one layer of the real
        # shape per hidden state kept, which is all a hooked frozen forward holds at once.
        depth = len(wanted) if spec.online else 1
        small = target_config_with_layers(spec.target_config, depth)
        target = AutoModelForCausalLM.from_config(small, dtype=spec.target_dtype)
        layers = {real: i + 1 for i, real in enumerate(wanted)}
    else:
        layers = {real: real for real in wanted}
    target.requires_grad_(False).eval()
    head = target.get_output_embeddings()
    drafter = EagleDrafter(cfg, target.get_input_embeddings(), head).train()
    if spec.autocast:
        mixed_precision_forward(
            drafter, "cpu" if drafter.device.type in ("cpu", "meta") else drafter.device.type
        )
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=spec.foreach)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return {
        "target": target,
        "head": head,
        "drafter": drafter,
        "optimizer": optimizer,
        "layers": layers,
    }


def run_step(
    spec: StepSpec,
    models: dict[str, Any],
    tracker: MemoryTracker | None = None,
    *,
    input_ids: torch.Tensor | None = None,
    losses: list[torch.Tensor] | None = None,
) -> dict[str, int]:
    """One training step of ``spec`` on ``models`` (:func:`build_step`): features (the target's
    forward, or an offline batch cast to fp32), the loss, its backward, the AdamW step.

    Args:
        spec: the step's shapes and settings.
        models: :func:`build_step`'s models.
        tracker: a :class:`MemoryTracker` active around the call, to read its bytes.
        input_ids: ``[micro_batch, seq_len]`` token ids on the drafter's device (None: zeros,
            which is all the memory count needs; a measured run on real hardware passes random
            ids, so that the target's features and labels differ between positions).
        losses: when given, the step's loss is appended to it, detached and on the device
            (reading it is the caller's host sync, once for many steps).

    Returns:
        With a ``tracker`` active around the call: its peak after the forward, its live bytes
        then, after the backward, and after the optimizer step; the features' bytes.
    """
    from ..features.source import compute_hidden_states
    from ..objectives.eagle_ttt import eagle1_loss, eagle3_ttt_loss

    b, t = spec.micro_batch, spec.seq_len
    drafter, head, optimizer = models["drafter"], models["head"], models["optimizer"]
    dev = drafter.device
    if input_ids is None:
        ids = torch.zeros(b, t, dtype=torch.long, device=dev)
    else:
        if tuple(input_ids.shape) != (b, t):
            raise ValueError(f"input_ids must be [{b}, {t}], got {list(input_ids.shape)}")
        ids = input_ids
    ones = torch.ones(b, t, dtype=torch.long, device=dev)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}
    if spec.online:
        index = models["layers"]
        got = compute_hidden_states(models["target"], batch, sorted(set(index.values())))
        hidden = {real: got[i] for real, i in index.items()}
    else:
        # An offline batch: the cache's layers, cast to fp32 when the batch is completed.
        h = drafter.config.hidden_size
        hidden = {real: torch.zeros(b, t, h, device=dev) for real in models["layers"]}
    out: dict[str, int] = {}
    if tracker is not None:
        out["features"] = tracker.live
    batch["hidden_states"] = hidden
    # The recipe's region: bf16 autocast around the whole loss (recipes/eagle.py), so the
    # weights' bf16 copies are cast once for every TTT step.
    region = torch.autocast("cpu" if dev.type == "meta" else dev.type, dtype=torch.bfloat16)
    with region if spec.autocast else contextlib.nullcontext():
        if spec.version == 1:
            loss, _ = eagle1_loss(drafter, batch, head, noise=0.0)
        else:
            loss, _ = eagle3_ttt_loss(
                drafter,
                batch,
                head,
                steps=spec.ttt_steps,
                loss=spec.loss,
                # Every position is supervised here; selecting the label rows would read the
                # mask's values, which fake tensors do not have (the same rows either way).
                supervised_labels_only=False,
            )
    if tracker is not None:
        out["forward_peak"], out["after_forward"] = tracker.peak, tracker.live
    loss.backward()
    if losses is not None:
        losses.append(loss.detach())
    if tracker is not None:
        out["backward_peak"] = tracker.peak
    del loss, batch, hidden
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated, as between steps
    return out


def simulate_step(spec: StepSpec) -> StepMemory:
    """Run one training step of ``spec`` on fake tensors and count its bytes (module docstring).

    Raises:
        ValueError: a version other than 1 or 3.
    """
    tracker = MemoryTracker()
    with _fake_mode():
        models = build_step(spec)
        with tracker:
            seen = run_step(spec, models, tracker)
    return StepMemory(
        peak=tracker.peak,
        forward_peak=seen["forward_peak"],
        after_forward=seen["after_forward"],
        features=seen["features"],
        ops=tracker.ops,
        phases={
            "forward": seen["forward_peak"],
            "backward": seen["backward_peak"],
            "optimizer": tracker.peak,
        },
    )


def scaled(spec: StepSpec, **changes: Any) -> StepSpec:
    """``spec`` with some fields changed (a dataclass ``replace``)."""
    return replace(spec, **changes)
