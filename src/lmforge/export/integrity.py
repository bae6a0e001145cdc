"""Is an artifact intact? The integrity half of `lmforge ckpt verify`.

With a hash manifest (lmforge seals checkpoints and exports) every file's sha256 is checked;
without one, the file structure: safetensors headers against file sizes, GGUF and ONNX parse.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmforge.ckpt.atomic import MANIFEST_NAME, MARKER_NAME, check_checkpoint
from lmforge.errors import UserInputError
from lmforge.export.runtimes import gguf_file
from lmforge.export.safetensors_stream import INDEX_NAME, SafetensorsReader


def check_integrity(path: Path) -> dict[str, Any]:
    """{"status": "ok" | "failed", "checked": what was checked, "problem": why it failed}."""
    base = path if path.is_dir() else path.parent
    try:
        if (base / MANIFEST_NAME).is_file():
            status = check_checkpoint(base)
            added = added_since_sealing(base)
            if not status.complete or added:
                problem = status.problem or f"{added[0]} is not in the hash manifest (added after sealing)"
                return {"status": "failed", "checked": "hash manifest", "problem": problem}
            return {"status": "ok", "checked": "hash manifest (every file's sha256)"}
        return {"status": "ok", "checked": f"structure only (no {MANIFEST_NAME}): " + _check_structure(path)}
    except UserInputError as err:
        return {"status": "failed", "checked": "structure", "problem": str(err)}


def added_since_sealing(directory: Path) -> list[str]:
    """Files under a sealed `directory` that its hash manifest does not list (relative, sorted):
    `check_checkpoint` checks the listed files only."""
    try:
        listed = json.loads((directory / MANIFEST_NAME).read_text()).get("files") or {}
    except (OSError, ValueError, AttributeError):
        return []  # no readable manifest: check_checkpoint says so
    present = (p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    return sorted(rel for rel in present if rel not in listed and rel not in (MANIFEST_NAME, MARKER_NAME))


def _check_structure(path: Path) -> str:
    gguf = gguf_file(path)
    if gguf is not None:
        from gguf import GGUFReader

        try:
            reader = GGUFReader(gguf)
        except (ValueError, OSError) as err:
            raise UserInputError(f"{gguf}: not a readable GGUF file: {err}") from None
        return f"GGUF parsed ({len(reader.tensors)} tensors)"
    if path.is_dir() and (path / "model.onnx").is_file():
        import onnx

        try:
            onnx.checker.check_model(str(path / "model.onnx"))
        except (onnx.checker.ValidationError, OSError) as err:
            raise UserInputError(f"{path / 'model.onnx'}: fails the ONNX checker: {err}") from None
        return "ONNX checker passed"
    shards = _safetensors_files(path)
    for shard in shards:
        _check_safetensors(shard)
    return f"{len(shards)} safetensors file(s) complete"


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    for home in (path, path / "adapter"):
        index = home / INDEX_NAME
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [n for n in names if not (home / n).is_file()]
            if missing:
                raise UserInputError(f"{home}: shards named in {INDEX_NAME} are missing: {missing}")
            return [home / n for n in names]
        found = sorted(home.glob("*.safetensors"))
        if found:
            return found
    raise UserInputError(f"{path}: no safetensors, GGUF or ONNX model found")


def _check_safetensors(shard: Path) -> None:
    try:
        with SafetensorsReader(shard) as reader:
            end = max((e.end for e in reader.entries), default=0)
            expected = reader.data_start + end
    except (ValueError, OSError, UnicodeDecodeError) as err:
        raise UserInputError(f"{shard}: unreadable safetensors header: {err}") from None
    actual = shard.stat().st_size
    if actual != expected:
        raise UserInputError(
            f"{shard}: {actual} bytes, but its header describes {expected} (truncated or padded)"
        )
