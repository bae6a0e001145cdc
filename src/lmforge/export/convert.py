"""`lmforge ckpt convert`: one entry point over the format converters.

Each converter reads an HF-format model directory and writes a self-contained directory:
the artifact, the config and tokenizer files that belong with it, and nothing unpickled.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from lmforge.ckpt.atomic import check_out_path, commit_checkpoint, require_writable
from lmforge.errors import UserInputError
from lmforge.export.conversion import Conversion
from lmforge.export.vision_formats import refuse_vision_export

EXPORT_RECORD = "lmforge_export.json"  # {source, format, dtype, details}: lets verify find its reference

FORMATS = ("safetensors", "gguf", "onnx", "compressed-tensors", "tensorrt-llm")


def convert(
    source: Path,
    to: str,
    out: Path,
    *,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    allow_bin: bool = False,
    imatrix_data: Path | None = None,
    accept: Callable[[Path], None] | None = None,
) -> Conversion:
    """Convert the model at `source` to format `to` under directory `out` (`imatrix_data`: a GGUF
    k-quant with an importance matrix from those texts). `accept` sees the finished conversion
    before it takes `out`'s place; if it raises, nothing is left behind."""
    if not source.exists():
        raise UserInputError(f"{source}: no such file or directory")
    if to not in FORMATS:
        raise UserInputError(f"--to {to!r}: choose one of {', '.join(FORMATS)}")
    if imatrix_data is not None and to != "gguf":
        raise UserInputError(f"--imatrix-data: an importance matrix is for GGUF k-quants, not --to {to}")
    refuse_vision_export(source, to)  # a format that cannot hold the vision tower, before any work
    check_out_path(out, source)
    require_writable(out.parent, what=f"--out {out}: its directory", fix="pass a writable directory as --out")
    # Written aside and sealed with a hash manifest, then renamed into place: `out` is either
    # absent or complete, and `ckpt verify` can tell a tampered file from the original.
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        result = _convert(source, to, staging, dtype, max_shard_size, allow_bin, imatrix_data)
        record = {"source": str(source.resolve()), "format": to, "dtype": dtype, "details": result.details}
        (staging / EXPORT_RECORD).write_text(json.dumps(record, indent=2, default=str))
        if accept is not None:
            accept(staging)
        commit_checkpoint(staging, out, step=0, durable=False)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    result.out = out
    result.files = [out / f.relative_to(staging) for f in result.files]
    return result


def _convert(
    source: Path,
    to: str,
    out: Path,
    dtype: str | None,
    max_shard_size: str,
    allow_bin: bool,
    imatrix_data: Path | None,
) -> Conversion:
    if to == "gguf":
        from lmforge.export.to_gguf import convert_to_gguf

        return convert_to_gguf(source, out, dtype=dtype or "f16", imatrix_data=imatrix_data)
    if to == "onnx":
        from lmforge.export.to_onnx import convert_to_onnx

        return convert_to_onnx(source, out, dtype=dtype or "f32")
    if to == "compressed-tensors":
        from lmforge.export.to_compressed import convert_to_compressed

        return convert_to_compressed(source, out, dtype=dtype)
    if to == "tensorrt-llm":
        from lmforge.export.to_tensorrt_llm import convert_to_tensorrt_llm

        return convert_to_tensorrt_llm(source, out, dtype=dtype)
    if to == "safetensors":
        from lmforge.export.to_safetensors import convert_to_safetensors

        return convert_to_safetensors(
            source, out, dtype=dtype, max_shard_size=max_shard_size, allow_bin=allow_bin
        )
    raise AssertionError(to)
