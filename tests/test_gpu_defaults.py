"""GPU defaults (issue 50, item 6): bf16 target and bf16 autocast unless asked otherwise, TF32 on
for CUDA training runs and recorded, nothing changed on the CPU.

The defaults are ``auto`` (:func:`draftsmith.train.device.auto_dtype`): bf16 where the device
computes it natively (every CUDA GPU with bf16; CPUs with AVX512-BF16, AMX or Arm BF16), fp32 and
no autocast elsewhere. This machine has no GPU: the CUDA branches are reached by asking for a
``cuda`` device type (TF32's flags are plain settings, set without a GPU) or by standing in for
the two ``torch.cuda`` queries the resolution makes.
"""

from __future__ import annotations

import types

import pytest
import torch

from draftsmith.recipes.dflash import DFlashTrainConfig
from draftsmith.recipes.distill import DistillConfig
from draftsmith.recipes.eagle import EagleTrainConfig
from draftsmith.recipes.medusa import MedusaConfig
from draftsmith.train import device as device_mod
from draftsmith.train.core import run as run_mod
from draftsmith.train.core.config import TrainConfig
from draftsmith.train.core.run import TrainRun
from draftsmith.train.device import allow_tf32, auto_dtype, device_facts, restore_tf32

CUDA = torch.device("cuda", 0)


@pytest.fixture
def tf32_flags():
    """The TF32 flags as they were, put back after the test whatever it set."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False  # a known start (cuDNN's default is True)
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.fixture
def gpu_with_bf16(monkeypatch):
    """``torch.cuda`` answering as an A100/H100 would: bf16 natively."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)


def _run(out) -> TrainRun:
    return TrainRun(TrainConfig(output_dir=out), recipe="eagle", kind="eagle3", outputs=["drafter"])


# --- dtype defaults ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls",
    [EagleTrainConfig, DFlashTrainConfig, DistillConfig, MedusaConfig],
    ids=lambda c: c.__name__,
)
def test_every_recipe_defaults_to_auto(cls):
    cfg = cls()
    assert (cfg.target_dtype, cfg.mixed_precision) == ("auto", "auto")
    assert TrainConfig().mixed_precision == "auto"


def test_auto_is_bf16_on_a_gpu_and_fp32_on_a_cpu_without_it(gpu_with_bf16, monkeypatch):
    # What the recipes (target_dtype) and TrainRun (mixed_precision) resolve the defaults to.
    assert auto_dtype("auto", CUDA, fast="bf16", slow="fp32") == "bf16"
    assert auto_dtype("auto", CUDA, fast="bf16", slow="no") == "bf16"
    monkeypatch.setattr(device_mod, "_cpu_native_bf16", lambda: False)  # an AVX2-only CPU
    assert auto_dtype("auto", "cpu", fast="bf16", slow="fp32") == "fp32"
    assert auto_dtype("auto", "cpu", fast="bf16", slow="no") == "no"
    assert auto_dtype("fp32", CUDA, fast="bf16", slow="fp32") == "fp32"  # asked for: kept


@pytest.mark.parametrize(
    "cap, native",
    [("AVX2", False), ("avx512_core", False), ("AVX512_CORE_BF16", None), ("ALL", None)],
)
def test_onednn_capped_below_bf16_emulates_it_whatever_the_cpu(cap, native, monkeypatch):
    """ONEDNN_MAX_CPU_ISA below oneDNN's bf16 ISAs makes torch's bf16 matmuls emulated even
    on a CPU with AVX512-BF16 (how an AVX2-only machine is rehearsed on one)."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    device_mod._cpu_native_bf16.cache_clear()
    try:
        got = device_mod._cpu_native_bf16()
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
        device_mod._cpu_native_bf16.cache_clear()
        uncapped = device_mod._cpu_native_bf16()
        assert got == (uncapped if native is None else native)
    finally:
        device_mod._cpu_native_bf16.cache_clear()


@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "no")])
def test_the_default_config_resolves_and_records_mixed_precision(
    native, expected, tmp_path, monkeypatch
):
    """TrainRun resolves the default before the Accelerator is made, so the dumped config says
    what ran: here, on this CPU, whatever its bf16 support says."""
    monkeypatch.setattr(device_mod, "_cpu_native_bf16", lambda: native)
    with _run(tmp_path / "run") as run:
        assert run.accelerator.mixed_precision == expected
        assert run.summary(0, 1)["config"]["mixed_precision"] == expected


# --- TF32 --------------------------------------------------------------------------------------


def test_tf32_is_set_for_cuda_only_and_restored(tf32_flags):
    assert allow_tf32("cpu") is None and allow_tf32(torch.device("meta")) is None
    assert _flags() == (False, False)  # a CPU run changes nothing
    previous = allow_tf32(CUDA)
    assert previous == (False, False) and _flags() == (True, True)
    assert allow_tf32("cuda") == (True, True)  # the spelling without an index too
    restore_tf32(previous)
    assert _flags() == (False, False)
    restore_tf32(None)  # what a CPU run hands back: nothing to do
    assert _flags() == (False, False)


def _cuda_run(monkeypatch):
    """TrainRun's TF32 step as on a CUDA process (accelerate itself stays on the CPU)."""
    monkeypatch.setattr(run_mod, "allow_tf32", lambda device: allow_tf32(CUDA))


def test_a_training_run_turns_tf32_on_for_its_length_and_records_it(
    tmp_path, tf32_flags, monkeypatch
):
    with _run(tmp_path / "cpu") as run:
        assert _flags() == (False, False) and run.summary(0, 1)["tf32"] is False
    _cuda_run(monkeypatch)
    with _run(tmp_path / "gpu") as run:
        assert _flags() == (True, True)
        assert run.summary(0, 1)["tf32"] is True
    assert _flags() == (False, False)  # put back: evaluation after it is exact fp32 again


def test_tf32_is_restored_after_a_failed_run(tmp_path, tf32_flags, monkeypatch):
    _cuda_run(monkeypatch)
    with pytest.raises(RuntimeError, match="boom"), _run(tmp_path / "gpu"):
        assert _flags() == (True, True)
        raise RuntimeError("boom")
    assert _flags() == (False, False)


def test_gpu_results_record_tf32(tf32_flags, monkeypatch):
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_facts(CUDA)["tf32"] is False
    allow_tf32(CUDA)
    facts = device_facts(CUDA)
    assert facts["tf32"] is True and facts["gpu_name"] == props.name
    assert "tf32" not in device_facts("cpu")
