"""Streaming access to safetensors files: one tensor at a time in, one tensor at a time out.

`safetensors.torch.save_file` needs every tensor of a file in memory (and copies each to
bytes), and `safe_open` maps the input so that every tensor read stays resident until the
file is closed. Tools that rewrite large checkpoints keep peak memory near one tensor by
reading and writing the documented format directly: an 8-byte little-endian header length,
a JSON header of {name: {dtype, shape, data_offsets}} plus `__metadata__`, then the data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import IO, Any

import torch

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
