"""`lmforge ckpt prune`: a slimmer copy of an HF safetensors model.

Four cuts, combinable: fewer positions (config and any learned position table), a subset of
decoder layers (renumbered contiguously, per-layer config lists kept in step), no adapter
files next to a full model, another floating dtype. Tensors stream one at a time through
`write_sharded`; the copy is sealed with a hash manifest and renamed into place, so `out`
is either absent or complete.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmforge.ckpt.atomic import commit_checkpoint
from lmforge.errors import UserInputError
from lmforge.export.prune_cuts import PrunePlan, cap_generation_length, cut_layers, cut_positions
from lmforge.export.safetensors_stream import TensorSpec, write_sharded
from lmforge.export.to_safetensors import (
    CONFIG_DTYPE_NAMES,
    cast_spec,
    cast_tensor,
    check_output,
    copy_side_files,
    parse_dtype,
    set_config_dtype,
    shard_bytes,
)
from lmforge.export.weight_sources import SafetensorsSource, model_shards

_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


@dataclass
class PruneReport:
    out: Path
    parameters_before: int
    parameters_after: int
    bytes_before: int  # tensor data, all shards
    bytes_after: int
    changes: list[str] = field(default_factory=list)


def prune_checkpoint(
    source: Path,
    out: Path,
    *,
    max_positions: int | None = None,
    keep_layers: str | None = None,
    drop_adapters: bool = False,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
) -> PruneReport:
    """Write a pruned copy of the HF model in `source` to `out` and say what changed."""
    target = parse_dtype(dtype, option="--dtype")
    max_bytes = shard_bytes(max_shard_size)
    if max_positions is None and keep_layers is None and not drop_adapters and target is None:
        raise UserInputError(
            "nothing to prune: pass --max-positions, --keep-layers, --drop-adapters or --dtype"
        )
    check_output(source, out)
    shards = model_shards(source)
    if not shards:
        raise UserInputError(
            f"{source}: no model.safetensors or model.safetensors.index.json; prune needs a full HF model "
            "(merge an adapter-only final/ with `lmforge ckpt merge-lora`, convert .bin with "
            "`lmforge ckpt convert --to safetensors --allow-bin`)"
        )
    config = json.loads((source / "config.json").read_text())
    tensors = SafetensorsSource(shards)
    plan = PrunePlan(list(tensors.specs), {s.name: s.name for s in tensors.specs}, {})
    changes: list[str] = []
    if keep_layers is not None:
        changes += cut_layers(plan, config, keep_layers)
    if max_positions is not None:
        changes += cut_positions(plan, config, max_positions)
    if target is not None:
        plan.specs = [cast_spec(spec, target) for spec in plan.specs]
        changes.append(f"dtype -> {CONFIG_DTYPE_NAMES[target]} (floating tensors)")
    adapters = [source / n for n in ("adapter", *_ADAPTER_FILES) if (source / n).exists()]
    if adapters and not drop_adapters and keep_layers is not None:
        raise UserInputError(
            f"{source}: holds an adapter ({adapters[0].name}) trained on all the model's layers; pass "
            "--drop-adapters, or merge it first with `lmforge ckpt merge-lora` and prune the merged model"
        )
    if drop_adapters:
        changes.append(
            f"dropped {', '.join(a.name for a in adapters)}" if adapters else "no adapter found to drop"
        )

    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _write(plan, tensors, staging, target, max_bytes)
        copy_side_files(source, staging)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if target is not None:
            set_config_dtype(staging / "config.json", target)
        if max_positions is not None:
            changes += cap_generation_length(staging / "generation_config.json", max_positions)
        if not drop_adapters:
            _copy_adapters(adapters, staging)
        commit_checkpoint(staging, out, step=0)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return PruneReport(
        out,
        _parameters(tensors.specs),
        _parameters(plan.specs),
        sum(s.nbytes for s in tensors.specs),
        sum(s.nbytes for s in plan.specs),
        changes,
    )


def _write(
    plan: PrunePlan, tensors: SafetensorsSource, out: Path, target: torch.dtype | None, max_bytes: int
) -> None:
    def tensor_for(spec: TensorSpec) -> torch.Tensor:
        tensor = tensors.tensor(plan.sources[spec.name])
        if spec.name in plan.transforms:
            tensor = plan.transforms[spec.name](tensor)
        return cast_tensor(tensor, target)

    try:
        write_sharded(out, plan.specs, tensor_for, max_shard_bytes=max_bytes, desc="write pruned")
    finally:
        tensors.close()


def _copy_adapters(adapters: list[Path], out: Path) -> None:
    for path in adapters:
        if path.is_dir():
            shutil.copytree(path, out / path.name)
        else:
            shutil.copy2(path, out / path.name)


def _parameters(specs: list[TensorSpec]) -> int:
    total = 0
    for spec in specs:
        count = 1
        for size in spec.shape:
            count *= size
        total += count
    return total
