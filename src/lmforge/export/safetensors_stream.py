"""Streaming access to safetensors files: one tensor at a time in, one tensor at a time out.

`safetensors.torch.save_file` needs every tensor of a file in memory (and copies each to
bytes), and `safe_open` maps the input so that every tensor read stays resident until the
file is closed. Tools that rewrite large checkpoints keep peak memory near one tensor by
reading and writing the documented format directly: an 8-byte little-endian header length,
a JSON header of {name: {dtype, shape, data_offsets}} plus `__metadata__`, then the data.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import IO, Any

import torch

from lmforge.errors import UserInputError
from lmforge.verbosity import progress_bar

DTYPES = {
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
_COPY_CHUNK = 64 << 20


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # safetensors dtype code, e.g. "F32"
    shape: tuple[int, ...]
    start: int  # byte offsets relative to the data section
    end: int


class SafetensorsReader:
    """The entries of a safetensors file, in data order, and their bytes on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle: BufferedReader = path.open("rb")
        (length,) = struct.unpack("<Q", self.handle.read(8))
        header = json.loads(self.handle.read(length))
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.data_start = 8 + length
        self.entries = sorted(
            (Entry(name, v["dtype"], tuple(v["shape"]), *v["data_offsets"]) for name, v in header.items()),
            key=lambda e: e.start,
        )

    def tensor(self, entry: Entry) -> torch.Tensor:
        self.handle.seek(self.data_start + entry.start)
        raw = bytearray(entry.end - entry.start)
        self.handle.readinto(raw)
        return torch.frombuffer(raw, dtype=DTYPES[entry.dtype]).reshape(entry.shape)

    def rows(self, entry: Entry, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of the tensor seen as 2-D (leading dimensions flattened; a 1-D tensor
        is one row): only those bytes are read."""
        width = entry.shape[-1] if entry.shape else 1
        dtype = DTYPES[entry.dtype]
        row_bytes = width * dtype.itemsize
        self.handle.seek(self.data_start + entry.start + start * row_bytes)
        raw = bytearray((stop - start) * row_bytes)
        self.handle.readinto(raw)
        return torch.frombuffer(raw, dtype=dtype).reshape(stop - start, width)

    def copy_bytes(self, entry: Entry, out: IO[bytes]) -> None:
        self.handle.seek(self.data_start + entry.start)
        left = entry.end - entry.start
        while left:
            chunk = self.handle.read(min(left, _COPY_CHUNK))
            out.write(chunk)
            left -= len(chunk)

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_header(
    out: IO[bytes], layout: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]
) -> None:
    """Write the header for tensors (name, dtype, shape, nbytes) whose data then follows in this order."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape, nbytes in layout:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    out.write(struct.pack("<Q", len(encoded)))
    out.write(encoded)


def write_tensor(out: IO[bytes], tensor: torch.Tensor) -> None:
    out.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)


CODES = {dtype: code for code, dtype in DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in a size such as "5GB", "500MB" or "2GiB" (decimal units as in HF's max_shard_size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not match or match.group(2) not in _SIZE_UNITS:
        raise UserInputError(f"size {text!r}: write it as a number and a unit, for example 5GB or 500MB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name, safetensors dtype code and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors, in order, into shards of at most max_shard_bytes (a larger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        if shards[-1] and used + spec.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += spec.nbytes
    return shards


def write_sharded(
    out_dir: Path,
    specs: list[TensorSpec],
    tensor_for: Callable[[TensorSpec], torch.Tensor],
    *,
    max_shard_bytes: int,
    metadata: dict[str, str] | None = None,
    desc: str = "write shards",
) -> list[Path]:
    """Write HF-layout safetensors (model.safetensors, or model-0000i-of-0000n.safetensors plus the
    index) pulling one tensor at a time from tensor_for; returns the files written."""
    shards = plan_shards(specs, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    with progress_bar(total=len(specs), desc=desc, unit="tensor") as progress:
        for name, shard in zip(names, shards, strict=True):
            with (out_dir / name).open("wb") as out:
                write_header(
                    out,
                    [(s.name, s.dtype, s.shape, s.nbytes) for s in shard],
                    {"format": "pt", **(metadata or {})},
                )
                for spec in shard:
                    tensor = tensor_for(spec)
                    if tuple(tensor.shape) != spec.shape or CODES[tensor.dtype] != spec.dtype:
                        raise ValueError(
                            f"{spec.name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {spec}"
                        )
                    write_tensor(out, tensor)
                    weight_map[spec.name] = name
                    progress.update()
    if len(shards) > 1:
        total = sum(spec.nbytes for spec in specs)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return [out_dir / name for name in names]
