"""`lmforge ckpt inspect`: what a checkpoint is, read from its metadata without loading weights.

Safetensors headers give tensor names, dtypes and shapes (parameter counts, dtypes, shards);
JSON files give the architecture and adapter settings; lmforge's hash manifest and completion
marker give completeness. DeepSpeed rank files are opened with weights_only + mmap (their small
pickles only, no tensor data) and torch DCP metadata under an allow-list; nothing is unpickled freely.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from lmforge.ckpt.atomic import MANIFEST_NAME, MARKER_NAME, check_checkpoint
from lmforge.ckpt.safetensors_stream import SafetensorsReader
from lmforge.errors import UserInputError

ADAPTER_CONFIG = "adapter_config.json"


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    """A JSON-ready description of the checkpoint at `path`."""
    if not path.exists():
        raise UserInputError(f"{path}: no such file or directory")
    if path.is_file():
        return _inspect_file(path)
    info: dict[str, Any] = {"path": str(path)}
    from lmforge.ckpt.consolidate import find_zero_dir

    zero_dir = find_zero_dir(path)
    if zero_dir is not None:
        info.update(_deepspeed_zero(zero_dir))
    elif (path / ADAPTER_CONFIG).is_file():
        info.update(_adapter(path))
    elif (path / "config.json").is_file() and list(path.glob("*.safetensors")):
        info.update(_hf_model(path))
    elif (path / ".metadata").is_file() and list(path.glob("*.distcp")):
        info.update(_torch_dcp(path))
    else:
        raise UserInputError(
            f"{path}: not a checkpoint lmforge recognises (an HF model directory with config.json and "
            "safetensors, a PEFT adapter directory, a DeepSpeed ZeRO checkpoint, a torch DCP directory, "
            "or a checkpoints/step-N directory)"
        )
    if (path / "adapter" / ADAPTER_CONFIG).is_file():  # lmforge's final/ of an adapter run
        info["adapter"] = _adapter(path / "adapter")
    if (path / MANIFEST_NAME).is_file() or (path / MARKER_NAME).exists():
        status = check_checkpoint(path)
        info["lmforge_checkpoint"] = {
            "step": status.step,
            "complete": status.complete,
            "problem": status.problem,
        }
    return info


def _deepspeed_zero(zero_dir: Path) -> dict[str, Any]:
    from lmforge.ckpt.consolidate import describe_zero

    zero = describe_zero(zero_dir)
    return {
        "format": "deepspeed-zero",
        "zero_stage": zero.stage,
        "world_size": zero.world_size,
        "global_step": zero.step,
        "tag": zero_dir.name,
        "deepspeed_version": zero.ds_version,
        "bytes": sum(f.stat().st_size for f in [*zero.model_files, *zero.optim_files]),
        "complete": not zero.missing and not zero.unexpected,
        **({"missing_files": zero.missing} if zero.missing else {}),
        **({"unexpected_files": zero.unexpected} if zero.unexpected else {}),
    }


def _torch_dcp(path: Path) -> dict[str, Any]:
    """World size from the rank numbers in the file names the metadata lists; no weights read."""
    from lmforge.ckpt.consolidate import dcp_world_size, read_dcp_metadata

    world_size, files = dcp_world_size(read_dcp_metadata(path))
    missing = [name for name in files if not (path / name).is_file()]
    # Complete checkpoints keep the short form; a missing rank file is spelled out.
    return {
        "format": "torch-dcp",
        "world_size": world_size,
        **({"complete": False, "missing_shards": missing} if missing else {}),
    }


def _inspect_file(path: Path) -> dict[str, Any]:
    if path.suffix == ".safetensors":
        return {"path": str(path), "format": "safetensors", **_tensor_summary([path])}
    if path.suffix == ".gguf":
        with path.open("rb") as handle:
            magic = handle.read(4)
        if magic != b"GGUF":
            raise UserInputError(f"{path}: a .gguf file without the GGUF magic bytes; the file is damaged")
        return {"path": str(path), "format": "gguf", "bytes": path.stat().st_size}
    if path.suffix == ".onnx":
        return {"path": str(path), "format": "onnx", "bytes": path.stat().st_size}
    raise UserInputError(f"{path}: unknown checkpoint file type {path.suffix!r} (.safetensors, .gguf, .onnx)")


def _hf_model(path: Path) -> dict[str, Any]:
    config = json.loads((path / "config.json").read_text())
    shards = _shards(path)
    return {
        "format": "hf",
        "architecture": (config.get("architectures") or [None])[0],
        "model_type": config.get("model_type"),
        "tie_word_embeddings": config.get("tie_word_embeddings"),
        **_tensor_summary(shards),
    }


def _adapter(path: Path) -> dict[str, Any]:
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    weights = path / "adapter_model.safetensors"
    summary = _tensor_summary([weights]) if weights.is_file() else {"shards": [], "complete": False}
    return {
        "format": "peft-adapter",
        "peft_type": config.get("peft_type"),
        "base_model": config.get("base_model_name_or_path"),
        "r": config.get("r"),
        "lora_alpha": config.get("lora_alpha"),
        "use_dora": config.get("use_dora", False),
        "target_modules": sorted(config.get("target_modules") or []),
        "modules_to_save": config.get("modules_to_save"),
        **summary,
    }


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(path.glob("*.safetensors"))


def _tensor_summary(shards: list[Path]) -> dict[str, Any]:
    """Parameter count, dtypes and shards from the safetensors headers alone."""
    parameters, dtypes, tensors, missing = 0, Counter[str](), 0, []
    for shard in shards:
        if not shard.is_file():
            missing.append(shard.name)
            continue
        with SafetensorsReader(shard) as reader:
            for entry in reader.entries:
                count = 1
                for size in entry.shape:
                    count *= size
                parameters += count
                dtypes[entry.dtype] += count
                tensors += 1
    return {
        "parameters": parameters,
        "tensors": tensors,
        "dtypes": dict(dtypes.most_common()),
        "shards": [s.name for s in shards],
        "bytes": sum(s.stat().st_size for s in shards if s.is_file()),
        "complete": not missing,
        **({"missing_shards": missing} if missing else {}),
    }
