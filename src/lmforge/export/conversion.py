"""The result record every format converter returns.

Kept apart from `lmforge.export.convert` (the dispatcher) so that the converters in
`to_safetensors`, `to_gguf` and `to_onnx` can build it without importing the dispatcher
that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Conversion:
    """What a converter wrote."""

    format: str
    out: Path
    files: list[Path]
    details: dict[str, Any] = field(default_factory=dict)
