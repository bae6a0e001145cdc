"""`lmforge ckpt convert`: one entry point over the format converters.

Each converter reads an HF-format model directory and writes a self-contained directory:
the artifact, the config and tokenizer files that belong with it, and nothing unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.errors import UserInputError

FORMATS = ("safetensors", "gguf", "onnx")


@dataclass
class Conversion:
    """What a converter wrote."""

    format: str
    out: Path
    files: list[Path]
    details: dict[str, Any] = field(default_factory=dict)


def convert(
    source: Path,
    to: str,
    out: Path,
    *,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    allow_bin: bool = False,
) -> Conversion:
    """Convert the model at `source` to format `to` under directory `out`."""
    if not source.exists():
        raise UserInputError(f"{source}: no such file or directory")
    if to == "gguf":
        from lmforge.ckpt.to_gguf import convert_to_gguf

        return convert_to_gguf(source, out, dtype=dtype or "f16")
    if to == "onnx":
        from lmforge.ckpt.to_onnx import convert_to_onnx

        return convert_to_onnx(source, out, dtype=dtype or "f32")
    if to == "safetensors":
        from lmforge.ckpt.to_safetensors import convert_to_safetensors

        return convert_to_safetensors(
            source, out, dtype=dtype, max_shard_size=max_shard_size, allow_bin=allow_bin
        )
    raise UserInputError(f"--to {to!r}: choose one of {', '.join(FORMATS)}")
