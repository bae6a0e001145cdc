"""Where an HF model directory keeps its weights, and reading them one tensor at a time.

`model_shards` finds the safetensors files and `legacy_bin_files` the pytorch_model*.bin ones
(refused unless allowed: they are pickles). `SafetensorsSource` and `BinSource` then hand out
tensors by name in a fixed order, keeping only one file open or mapped at a time. Used by
`ckpt convert` (safetensors, onnx) and `ckpt prune`.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch

from lmforge.ckpt.safe_load import refused_pickle_reason
from lmforge.errors import UserInputError
from lmforge.export.safetensors_stream import CODES, DTYPES, INDEX_NAME, Entry, SafetensorsReader, TensorSpec

BIN_INDEX = "pytorch_model.bin.index.json"


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


def legacy_bin_files(source: Path, allow_bin: bool) -> list[Path]:
    """The model's pytorch_model*.bin files; a UserInputError unless `allow_bin` (they are pickles)."""
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
