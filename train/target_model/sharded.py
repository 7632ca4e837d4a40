"""Read a target's weights by rows: each process of an FSDP run reads only its own shards.

A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor
(dtype, shape, byte range) and the tensors' bytes, each row-major and contiguous. FSDP2 shards a
parameter by rows (dim 0, ``torch.chunk`` order over the mesh), so a rank's shard of a weight is
one contiguous byte range of the file: :class:`SafetensorsWeights` reads exactly that range with
plain file reads, straight into the shard when dtype and device allow (else through one buffer
of the shard's size).

Why plain reads and not ``safe_open(...).get_slice``: ``safe_open`` maps the whole file, and
the pages a process touched through a mapping count in its resident size until the mapping
closes. Plain reads go through the page cache, which the processes of a machine share, so what
a process holds is its shards alone (``tests/test_fsdp_loading.py`` measures the peak resident
size; the reader is checked against ``safe_open`` there too).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["NotShardable", "SafetensorsWeights", "local_rows"]

#: safetensors dtype names -> torch dtypes (the float8 ones where this torch has them).
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


class NotShardable(Exception):
    """A target that cannot be loaded shard by shard; the message says why (one line)."""


@dataclass(frozen=True)
class _Entry:
    """Where one tensor lies: its file, dtype, shape and the offset of its first byte."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


class SafetensorsWeights:
    """The tensors of a model directory's safetensors files, readable by rows.

    Args:
        entries: tensor name -> where it lies (see :meth:`of_dir`).
    """

    def __init__(self, entries: dict[str, _Entry]) -> None:
        self._entries = entries

    @classmethod
    def of_dir(cls, path: str | Path) -> SafetensorsWeights:
        """Index ``model.safetensors`` or the files of ``model.safetensors.index.json``.

        Raises:
            NotShardable: the directory has no safetensors weights (``pytorch_model.bin``), or a
                file is not valid safetensors or holds a dtype torch lacks.
        """
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                raise NotShardable(f"{index} has no readable weight_map ({exc})") from exc
        elif (path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise NotShardable(f"{path} has no safetensors weights (only pickled .bin files)")
        entries: dict[str, _Entry] = {}
        for name in files:
            entries.update(_read_header(path / name))
        return cls(entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def read_into(self, name: str, out: torch.Tensor, rows: slice | None = None) -> int:
        """Copy tensor ``name`` (or its rows ``rows``) into ``out``, converting the dtype.

        Args:
            name: the tensor's name in the files.
            out: where it goes, of the shape read (rows x the other dims), any dtype and device.
            rows: ``start:stop`` of dim 0 (step 1); None: the whole tensor.

        Returns:
            The bytes read from the file.
        """
        entry = self._entries[name]
        shape = entry.shape
        start, stop = (0, shape[0] if shape else 1) if rows is None else (rows.start, rows.stop)
        width = math.prod(shape[1:]) if shape else 1
        item = torch.empty((), dtype=entry.dtype).element_size()
        read_shape = ((stop - start), *shape[1:]) if shape else ()
        if tuple(out.shape) != read_shape:
            raise ValueError(f"{name}: reading shape {read_shape} into a tensor of {out.shape}")
        direct = out.device.type == "cpu" and out.dtype == entry.dtype and out.is_contiguous()
        buffer = out if direct else torch.empty(read_shape, dtype=entry.dtype)
        length = (stop - start) * width * item
        if length:
            view = memoryview(buffer.reshape(-1).view(torch.uint8).numpy())
            with open(entry.file, "rb", buffering=0) as f:
                f.seek(entry.offset + start * width * item)
                got = 0
                while got < length:
                    n = f.readinto(view[got:length])
                    if not n:
                        raise OSError(f"{entry.file}: file ends inside tensor {name}")
                    got += n
        if not direct:
            with torch.no_grad():
                out.copy_(buffer)
        return length


def _read_header(file: Path) -> dict[str, _Entry]:
    """The tensors of one safetensors file (its JSON header)."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise NotShardable(f"{file} is not a readable safetensors file ({exc})") from exc
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise NotShardable(f"{file}: tensor {name} has dtype {info['dtype']}")
        begin = info["data_offsets"][0]
        entries[name] = _Entry(file, dtype, tuple(info["shape"]), 8 + size + begin)
    return entries


def local_rows(tensor: torch.Tensor) -> slice | None:
    """The rows (dim 0) of the full tensor that this rank's shard of ``tensor`` holds.

    ``tensor`` is an FSDP2 parameter (a DTensor sharded on dim 0 over one or more mesh dims,
    replicated over the others); FSDP2 cuts rows like ``torch.chunk``: ``ceil(n / size)`` rows
    per rank, the last ranks fewer or none. A plain tensor is all rows (None).

    Raises:
        NotShardable: a placement other than rows (dim 0) or replication, or a shard whose
            size is not what row chunking gives (a layout this reader does not know).
    """
    if not hasattr(tensor, "to_local"):
        return None
    mesh, local = tensor.device_mesh, tensor.to_local()
    coordinate = mesh.get_coordinate()
    start, length = 0, tensor.shape[0]
    for dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            continue
        if not (
            placement.is_shard() and placement.dim == 0 and type(placement).__name__ == "Shard"
        ):
            raise NotShardable(f"a parameter is sharded as {placement}, not by rows")
        size, index = mesh.size(dim), coordinate[dim]
        chunk = -(-length // size)
        offset = min(index * chunk, length)
        start, length = start + offset, min(chunk, length - offset)
    if tuple(local.shape) != (length, *tensor.shape[1:]):
        raise NotShardable(
            f"a shard of shape {tuple(local.shape)} is not rows {start}:{start + length} of "
            f"{tuple(tensor.shape)}"
        )
    return slice(start, start + length)
