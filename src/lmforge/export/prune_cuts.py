"""The cuts `lmforge ckpt prune` makes to a model: fewer decoder layers, fewer positions.

Each cut edits a `PrunePlan` (which source tensor becomes which output tensor, and how it is
sliced) and the model's config dict in place, and returns one line per change for the report.
Nothing here reads or writes tensor data; `lmforge.export.prune` streams the tensors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import UserInputError
from lmforge.export.safetensors_stream import TensorSpec

POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
# Learned position tables (gpt2 wpe, OPT/BART embed_positions with their 2-row offset, BERT-style).
_POSITION_TABLES = ("wpe.weight", "embed_positions.weight", "position_embeddings.weight")
_LAYER_NAME = re.compile(r"^(.*?\b(?:layers|layer|h|blocks|block))\.(\d+)\.(.+)$")

Transform = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class PrunePlan:
    """Which source tensor becomes which output tensor, and how."""

    specs: list[TensorSpec]
    sources: dict[str, str]  # output name -> source name
    transforms: dict[str, Transform]  # output name -> slice applied before the cast


def parse_layers(text: str, count: int) -> list[int]:
    """Sorted unique layer indices from "0-3,6"; every index must be below `count`."""
    indices: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None:
            raise UserInputError(
                f"--keep-layers {text!r}: {part.strip()!r} is not a layer index or range; "
                "write indices and ranges such as 0-3,6"
            )
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if high < low:
            raise UserInputError(
                f"--keep-layers {text!r}: the range {low}-{high} runs backwards; write {high}-{low}"
            )
        indices.update(range(low, high + 1))
    beyond = sorted(i for i in indices if i >= count)
    if beyond:
        raise UserInputError(
            f"--keep-layers {text!r}: layer(s) {beyond} do not exist; the model has {count} layers "
            f"(0-{count - 1})"
        )
    return sorted(indices)


def cut_layers(plan: PrunePlan, config: dict[str, Any], text: str) -> list[str]:
    """Keep the decoder layers named by `text` ("0-3,6"), renumbered 0..N-1, in plan and config."""
    key = next((k for k in LAYER_COUNT_KEYS if isinstance(config.get(k), int)), None)
    if key is None:
        raise UserInputError(f"--keep-layers: config.json has none of {', '.join(LAYER_COUNT_KEYS)}")
    count = int(config[key])
    keep = parse_layers(text, count)
    prefix = _decoder_prefix(plan.specs, count)
    renumber = {old: new for new, old in enumerate(keep)}
    specs, sources = [], {}
    for spec in plan.specs:
        match = _LAYER_NAME.match(spec.name)
        if match is None or match.group(1) != prefix:
            specs.append(spec)
            sources[spec.name] = plan.sources[spec.name]
            continue
        old = int(match.group(2))
        if old in renumber:
            name = f"{prefix}.{renumber[old]}.{match.group(3)}"
            specs.append(TensorSpec(name, spec.dtype, spec.shape))
            sources[name] = plan.sources[spec.name]
    plan.specs, plan.sources = specs, sources
    changes = [f"{key} {count} -> {len(keep)} (kept layers {_ranges(keep)}, renumbered 0-{len(keep) - 1})"]
    config[key] = len(keep)
    for name, value in list(config.items()):
        if isinstance(value, list) and len(value) == count and name != "architectures":
            config[name] = [value[i] for i in keep]
            changes.append(f"{name}: per-layer list cut to the kept layers")
    window = config.get("max_window_layers")  # qwen2: the first N layers use full attention
    if isinstance(window, int) and window < count:
        config["max_window_layers"] = sum(1 for i in keep if i < window)
        changes.append(f"max_window_layers {window} -> {config['max_window_layers']}")
    return changes


def _decoder_prefix(specs: list[TensorSpec], count: int) -> str:
    """The name prefix of the decoder's layer stack: the one numbered exactly 0..count-1."""
    found: dict[str, set[int]] = {}
    for spec in specs:
        match = _LAYER_NAME.match(spec.name)
        if match is not None:
            found.setdefault(match.group(1), set()).add(int(match.group(2)))
    stacks = [prefix for prefix, indices in found.items() if indices == set(range(count))]
    if len(stacks) != 1:
        raise UserInputError(
            f"--keep-layers: cannot tell the decoder's layers apart in this checkpoint (stacks of "
            f"{count} layers found: {stacks or 'none'}); prune it with transformers instead"
        )
    return stacks[0]


def cut_positions(plan: PrunePlan, config: dict[str, Any], limit: int) -> list[str]:
    """Shrink the context to `limit` positions: config keys and any learned position table."""
    keys = [k for k in POSITION_KEYS if isinstance(config.get(k), int)]
    if not keys:
        raise UserInputError(f"--max-positions: config.json has none of {', '.join(POSITION_KEYS)}")
    if limit < 1:
        raise UserInputError(f"--max-positions {limit}: must be at least 1")
    current = min(int(config[k]) for k in keys)
    if limit > current:
        raise UserInputError(
            f"--max-positions {limit}: larger than the model's {keys[0]}={current}; prune only shrinks "
            "(a longer context needs rope scaling or training, not a config edit)"
        )
    changes = [f"{k} {config[k]} -> {limit}" for k in keys]
    for key in keys:
        config[key] = limit
    tables = 0
    for i, spec in enumerate(plan.specs):
        offset = spec.shape[0] - current if spec.shape else -1
        if spec.name.endswith(_POSITION_TABLES) and offset in (0, 2):
            rows = limit + offset
            plan.specs[i] = TensorSpec(spec.name, spec.dtype, (rows, *spec.shape[1:]))
            plan.transforms[spec.name] = _first_rows(rows)
        elif spec.name.endswith(".attn.bias") and spec.shape[-2:] == (current, current):
            plan.specs[i] = TensorSpec(spec.name, spec.dtype, (*spec.shape[:-2], limit, limit))
            plan.transforms[spec.name] = _top_left(limit)
        else:
            continue
        tables += 1
        changes.append(f"{spec.name} {list(spec.shape)} -> {list(plan.specs[i].shape)}")
    if not tables:
        changes.append("no learned position table (rotary positions): config only")
    return changes


def _first_rows(rows: int) -> Transform:
    return lambda tensor: tensor[:rows]


def _top_left(size: int) -> Transform:
    return lambda tensor: tensor[..., :size, :size]


def cap_generation_length(path: Path, limit: int) -> list[str]:
    """Lower generation_config.json's max_length to `limit` when it is longer."""
    if not path.is_file():
        return []
    generation = json.loads(path.read_text())
    if not isinstance(generation.get("max_length"), int) or generation["max_length"] <= limit:
        return []
    change = f"generation_config max_length {generation['max_length']} -> {limit}"
    generation["max_length"] = limit
    path.write_text(json.dumps(generation, indent=2) + "\n")
    return [change]


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts: list[str] = []
    start = prev = indices[0]
    for index in [*indices[1:], None]:
        if index is not None and index == prev + 1:
            prev = index
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if index is not None:
            start = prev = index
    return ",".join(parts)
