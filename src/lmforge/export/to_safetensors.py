"""`lmforge ckpt convert --to safetensors`: re-shard, re-dtype, or rescue legacy .bin weights.

Tensors stream one at a time through `write_sharded`: from safetensors shards through
`SafetensorsReader`, from pytorch_model*.bin files through `torch.load(weights_only=True,
mmap=True)` one file at a time (the mapping keeps only the tensor being written resident).
A tensor whose dtype does not change is written with its exact bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from lmforge.ckpt.atomic import check_out_path
from lmforge.errors import UserInputError
from lmforge.export.conversion import Conversion
from lmforge.export.safetensors_stream import CODES, INDEX_NAME, TensorSpec, parse_size, write_sharded
from lmforge.export.weight_sources import (
    BinSource,
    SafetensorsSource,
    TensorSource,
    legacy_bin_files,
    model_shards,
)

# Files that belong next to the weights: config, generation settings and the tokenizer.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    # A vision-language model's image processor and processor settings (AutoProcessor reads them).
    "preprocessor_config.json",
    "processor_config.json",
)
FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
CONFIG_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_FLOAT_CODES = {"F64", "F32", "F16", "BF16"}


def convert_to_safetensors(
    source: Path, out: Path, *, dtype: str | None, max_shard_size: str, allow_bin: bool
) -> Conversion:
    """Write the model in `source` (safetensors, or .bin with allow_bin) as HF safetensors shards in `out`.

    Floating tensors are cast to `dtype` (f32|f16|bf16) when given, and config.json says so."""
    target = parse_dtype(dtype, option="--dtype")
    max_bytes = shard_bytes(max_shard_size)
    check_output(source, out)
    shards = model_shards(source)
    if shards:
        tensors: TensorSource = SafetensorsSource(shards)
    else:
        tensors = BinSource(legacy_bin_files(source, allow_bin))
    specs = [cast_spec(spec, target) for spec in tensors.specs]
    try:
        files = write_sharded(
            out,
            specs,
            lambda spec: cast_tensor(tensors.tensor(spec.name), target),
            max_shard_bytes=max_bytes,
            desc="write safetensors",
        )
    finally:
        tensors.close()
    shard_count = len(files)
    if (out / INDEX_NAME).is_file():
        files.append(out / INDEX_NAME)
    files += copy_side_files(source, out)
    if target is not None:
        set_config_dtype(out / "config.json", target)
    return Conversion(
        "safetensors",
        out,
        files,
        {
            "source_format": tensors.kind,
            "tensors": len(specs),
            "shards": shard_count,
            "bytes": sum(spec.nbytes for spec in specs),
            "dtype": CONFIG_DTYPE_NAMES[target] if target is not None else "unchanged",
            "dropped_shared": tensors.dropped,
        },
    )


def parse_dtype(dtype: str | None, *, option: str) -> torch.dtype | None:
    """The torch dtype named by f32|f16|bf16, or None for "keep"."""
    if dtype is None:
        return None
    if dtype not in FLOAT_DTYPES:
        raise UserInputError(f"{option} {dtype!r}: choose one of {', '.join(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[dtype]


def cast_spec(spec: TensorSpec, target: torch.dtype | None) -> TensorSpec:
    if target is None or spec.dtype not in _FLOAT_CODES:
        return spec
    return TensorSpec(spec.name, CODES[target], spec.shape)


def cast_tensor(tensor: torch.Tensor, target: torch.dtype | None) -> torch.Tensor:
    """Floating tensors cast to target; everything else, and a target of None, left as it is."""
    if target is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(target)


def set_config_dtype(config_path: Path, target: torch.dtype) -> None:
    """config.json's dtype ("dtype" in transformers 5, "torch_dtype" before) set to target."""
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    for section in (config, config.get("text_config")):
        if isinstance(section, dict):
            section["dtype"] = CONFIG_DTYPE_NAMES[target]
            if "torch_dtype" in section:
                section["torch_dtype"] = CONFIG_DTYPE_NAMES[target]
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def shard_bytes(max_shard_size: str) -> int:
    """--max-shard-size in bytes."""
    try:
        size = parse_size(max_shard_size)
    except UserInputError as err:
        raise UserInputError(f"--max-shard-size: {err}") from None
    if size <= 0:
        raise UserInputError(f"--max-shard-size {max_shard_size!r}: must be larger than zero")
    return size


def check_output(source: Path, out: Path) -> None:
    if not (source / "config.json").is_file():
        raise UserInputError(
            f"{source}: no config.json; point it at an HF model directory (config.json and weights)"
        )
    check_out_path(out, source)


def copy_side_files(source: Path, out: Path) -> list[Path]:
    copied = []
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
            copied.append(out / name)
    return copied
