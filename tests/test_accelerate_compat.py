"""train/core/accelerate_compat.py: every accelerate internal it relies on still exists and works.

An accelerate upgrade that renames one of them fails here, naming it, instead of deep inside a
training run or a stage of the main job.
"""

from __future__ import annotations

import pytest

from draftsmith.train.core import accelerate_compat as compat


@pytest.mark.parametrize("name", sorted(compat.PRIVATE))
def test_each_private_accelerate_attribute_still_exists(name):
    # The failure message is the one a run would print: it names the attribute and the version.
    compat.private(name)


def test_a_missing_private_attribute_is_named(monkeypatch):
    from accelerate.state import AcceleratorState

    monkeypatch.delattr(AcceleratorState, "_reset_state")
    with pytest.raises(compat.AccelerateCompatError) as err:
        compat.reset_accelerate_state()
    message = str(err.value)
    assert "accelerate.state.AcceleratorState._reset_state" in message
    assert "accelerate_compat.py" in message


def test_reset_lets_a_differently_configured_accelerator_start():
    from accelerate import Accelerator

    Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=3)
    with pytest.raises(ValueError):  # accelerate keeps its state for the life of the process
        Accelerator(cpu=True, mixed_precision="bf16")
    compat.reset_accelerate_state()
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=1)
    assert accelerator.mixed_precision == "bf16"
    assert accelerator.gradient_accumulation_steps == 1


def test_set_distributed_type_reaches_both_states():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type == DistributedType.NO
    compat.set_distributed_type(accelerator.state, DistributedType.MULTI_CPU)
    assert AcceleratorState().distributed_type == DistributedType.MULTI_CPU
    assert PartialState().distributed_type == DistributedType.MULTI_CPU
    assert accelerator.distributed_type == DistributedType.MULTI_CPU
