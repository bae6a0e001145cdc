"""`lmforge ckpt convert --to safetensors`: re-shard, re-dtype, or rescue legacy .bin weights.

Tensors stream one at a time through `write_sharded`: from safetensors shards through
`SafetensorsReader`, from pytorch_model*.bin files through `torch.load(weights_only=True,
mmap=True)` one file at a time (the mapping keeps only the tensor being written resident).
A tensor whose dtype does not change is written with its exact bytes.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from lmforge.ckpt.atomic import check_out_path
from lmforge.ckpt.convert import Conversion
from lmforge.ckpt.safe_load import refused_pickle_reason
from lmforge.ckpt.safetensors_stream import (
    CODES,
    DTYPES,
    INDEX_NAME,
    Entry,
    SafetensorsReader,
    TensorSpec,
    parse_size,
    write_sharded,
)
from lmforge.errors import UserInputError

BIN_INDEX = "pytorch_model.bin.index.json"
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
        tensors = BinSource(_bin_files(source, allow_bin))
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


def model_shards(source: Path) -> list[Path]:
    """The model's safetensors files, from the index when there is one (never adapter files)."""
    index = source / INDEX_NAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (source / n).is_file()]
        if missing:
            raise UserInputError(f"{index}: names shards that are missing: {missing[:5]}; copy them back")
        return [source / n for n in names]
    return [source / "model.safetensors"] if (source / "model.safetensors").is_file() else []


def copy_side_files(source: Path, out: Path) -> list[Path]:
    copied = []
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
            copied.append(out / name)
    return copied


class TensorSource:
    """Tensors in a fixed order, read one at a time by name (in that order)."""

    kind = ""
    specs: list[TensorSpec]
    dropped: list[str]

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        """Release whatever file is open."""


class SafetensorsSource(TensorSource):
    kind = "safetensors"

    def __init__(self, shards: list[Path]) -> None:
        self.where: dict[str, Path] = {}
        self.specs, self.dropped = [], []
        for shard in shards:
            with SafetensorsReader(shard) as reader:
                for entry in reader.entries:
                    self.specs.append(TensorSpec(entry.name, entry.dtype, entry.shape))
                    self.where[entry.name] = shard
        self.reader: SafetensorsReader | None = None
        self.entries: dict[str, Entry] = {}

    def tensor(self, name: str) -> torch.Tensor:
        shard = self.where[name]
        if self.reader is None or self.reader.path != shard:
            self.close()
            self.reader = SafetensorsReader(shard)
            self.entries = {entry.name: entry for entry in self.reader.entries}
        return self.reader.tensor(self.entries[name])

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader, self.entries = None, {}


def _bin_files(source: Path, allow_bin: bool) -> list[Path]:
    index = source / BIN_INDEX
    if index.is_file():
        files = [source / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files = sorted(source.glob("pytorch_model*.bin"))
    if not files:
        raise UserInputError(
            f"{source}: no model.safetensors, {INDEX_NAME} or pytorch_model*.bin; "
            "point it at an HF model directory"
        )
    if not allow_bin:
        raise UserInputError(
            f"{source}: holds only legacy .bin weights ({', '.join(f.name for f in files[:3])}); .bin files are "
            "Python pickles, which can run code when loaded, so they are refused by default. If you trust "
            "where they came from, pass --allow-bin (they are then read with torch.load(weights_only=True), "
            "which refuses anything but tensors)"
        )
    return files


class BinSource(TensorSource):
    """pytorch_model*.bin state dicts, each memory-mapped and loaded with weights_only=True."""

    kind = "bin"

    def __init__(self, files: list[Path]) -> None:
        self.where: dict[str, Path] = {}
        self.specs, self.dropped = [], []
        for file in files:
            for name, tensor in self._shared_dropped(file, self._load(file)).items():
                self.specs.append(TensorSpec(name, _code(file, name, tensor), tuple(tensor.shape)))
                self.where[name] = file
        self.file: Path | None = None
        self.state: dict[str, torch.Tensor] = {}

    def tensor(self, name: str) -> torch.Tensor:
        file = self.where[name]
        if file != self.file:
            self.close()  # drop the previous file's mapping before opening the next
            self.file, self.state = file, self._load(file)
        return self.state[name]

    def close(self) -> None:
        self.file, self.state = None, {}

    @staticmethod
    def _load(file: Path) -> dict[str, torch.Tensor]:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as err:
            raise UserInputError(
                f"{file}: refused: it holds Python objects other than tensors ({refused_pickle_reason(err)}). "
                "lmforge never unpickles those; re-save the weights as a plain state dict or as safetensors "
                "with the code that wrote them"
            ) from None
        except RuntimeError as err:
            raise UserInputError(
                f"{file}: cannot memory-map it ({str(err).splitlines()[0]}); re-save it with a torch "
                "newer than 1.6 (zip format) or as safetensors"
            ) from None
        if not isinstance(state, dict):
            raise UserInputError(f"{file}: holds a {type(state).__name__}, not a state dict of tensors")
        bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise UserInputError(f"{file}: entries {bad[:5]} are not tensors; this is not a model state dict")
        return state

    def _shared_dropped(self, file: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state dict without the second name of a tensor stored twice (tied embedding and head).

        safetensors cannot hold shared storage; like save_pretrained, keep one name, preferring
        the input side so that tie_word_embeddings restores the head."""
        kept: dict[tuple[Any, ...], str] = {}
        for name in sorted(state, key=lambda n: n.startswith("lm_head")):
            tensor = state[name]
            key = (
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tensor.shape,
                tensor.stride(),
            )
            if tensor.numel() and key in kept:
                self.dropped.append(name)
            else:
                kept[key] = name
        return {name: t for name, t in state.items() if name not in self.dropped}


def _code(file: Path, name: str, tensor: torch.Tensor) -> str:
    if tensor.dtype not in CODES:
        raise UserInputError(
            f"{file}: {name} has dtype {tensor.dtype}, which lmforge's safetensors writer does not "
            f"handle ({', '.join(DTYPES)})"
        )
    return CODES[tensor.dtype]
