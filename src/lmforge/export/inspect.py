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
from lmforge.errors import UserInputError
from lmforge.export.safetensors_stream import SafetensorsReader

ADAPTER_CONFIG = "adapter_config.json"


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    """A JSON-ready description of the checkpoint at `path`."""
    if not path.exists():
        raise UserInputError(f"{path}: no such file or directory")
    if path.is_file():
        return _inspect_file(path)
    info: dict[str, Any] = {"path": str(path)}
    from lmforge.ckpt.zero_checkpoint import find_zero_dir

    zero_dir = find_zero_dir(path)
    if zero_dir is not None:
        info.update(_deepspeed_zero(zero_dir))
    elif (path / ADAPTER_CONFIG).is_file():
        info.update(_adapter(path))
    elif (path / "config.json").is_file() and list(path.glob("*.safetensors")):
        info.update(_hf_model(path))
    elif (path / ".metadata").is_file() and list(path.glob("*.distcp")):
        info.update(_torch_dcp(path))
    elif len(ggufs := sorted(path.glob("*.gguf"))) == 1:  # an export directory (with its Modelfile)
        info.update({"file": ggufs[0].name, **_gguf(ggufs[0])})
    elif (path / "model.onnx").is_file():
        info.update(_onnx(path / "model.onnx"))
    elif (path / "adapter" / ADAPTER_CONFIG).is_file():  # final/ of an adapter run, merge_lora off
        base = json.loads((path / "adapter" / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        info.update(
            {
                "format": "lmforge-final-adapter",
                "note": f"final/ of an adapter run: the PEFT adapter in adapter/ (over {base}) and the "
                "tokenizer; `lmforge ckpt merge-lora --base BASE --adapter adapter/` makes a full model",
            }
        )
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
    from lmforge.ckpt.zero_checkpoint import describe_zero

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
    from lmforge.ckpt.dcp_checkpoint import dcp_world_size, read_dcp_metadata

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
        return {"path": str(path), **_gguf(path)}
    if path.suffix == ".onnx":
        return {"path": str(path), **_onnx(path)}
    raise UserInputError(f"{path}: unknown checkpoint file type {path.suffix!r} (.safetensors, .gguf, .onnx)")


def _gguf(path: Path) -> dict[str, Any]:
    """Architecture, weight types, parameters and tokenizer from the GGUF header (tensors stay on disk)."""
    from gguf import GGUFReader

    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise UserInputError(f"{path}: a .gguf file without the GGUF magic bytes; the file is damaged")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as err:
        raise UserInputError(f"{path}: unreadable GGUF ({err}); the file is damaged or truncated") from None

    def field(name: str) -> Any:
        entry = reader.get_field(name)
        return entry.contents() if entry is not None else None

    return {
        "format": "gguf",
        "architecture": field("general.architecture"),
        "parameters": sum(int(t.n_elements) for t in reader.tensors),
        "tensors": len(reader.tensors),
        "dtypes": dict(Counter(t.tensor_type.name for t in reader.tensors)),
        "context_length": field(f"{field('general.architecture')}.context_length"),
        "tokenizer": field("tokenizer.ggml.model"),
        "chat_template": field("tokenizer.chat_template") is not None,
        "bytes": path.stat().st_size,
    }


def _onnx(path: Path) -> dict[str, Any]:
    """Graph inputs/outputs, opset, initializer dtypes and parameters, without loading external data."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # onnx raises DecodeError and friends for damaged files
        raise UserInputError(f"{path}: unreadable ONNX model ({err})") from None
    inits = model.graph.initializer
    external = sorted({e.value for i in inits for e in i.external_data if e.key == "location"})
    return {
        "format": "onnx",
        "opset": max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=None),
        "inputs": [i.name for i in model.graph.input],
        "outputs": [o.name for o in model.graph.output],
        "parameters": sum(_numel(i.dims) for i in inits),
        "dtypes": dict(Counter(onnx.TensorProto.DataType.Name(i.data_type) for i in inits)),
        "external_data": external,
        "bytes": path.stat().st_size
        + sum((path.parent / f).stat().st_size for f in external if (path.parent / f).is_file()),
    }


def _numel(dims: Any) -> int:
    count = 1
    for size in dims:
        count *= int(size)
    return count


def _hf_model(path: Path) -> dict[str, Any]:
    config = json.loads((path / "config.json").read_text())
    shards = _shards(path)
    return {
        "format": "hf",
        "architecture": (config.get("architectures") or [None])[0],
        "model_type": config.get("model_type"),
        "tie_word_embeddings": config.get("tie_word_embeddings"),
        **_quantization(config),
        **_tensor_summary(shards),
    }


def _quantization(config: dict[str, Any]) -> dict[str, Any]:
    """A quantized checkpoint's method and, for compressed-tensors, each group's weight scheme."""
    quantization = config.get("quantization_config")
    if not quantization:
        return {}
    method = quantization.get("quant_method")
    schemes = [
        f"{w['type']}{w['num_bits']} per {w['strategy']}"
        + (f" {w['group_size']}" if w.get("group_size") else "")
        for group in (quantization.get("config_groups") or {}).values()
        if (w := group.get("weights"))
    ]
    return {
        "quantization": {"method": method, "weights": schemes, "not_quantized": quantization.get("ignore")}
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
