"""DeepSpeed ZeRO-1/2/3 rank files: safe loading and layout description.

Rank files are opened with `torch.load(weights_only=True, mmap=True)`: unpickling creates only
tensors, plain containers and the few inert DeepSpeed classes listed in ZERO_SAFE_GLOBALS, and
no tensor data is read until a slice of it is copied. Each parameter is assembled from its rank
slices exactly as DeepSpeed's zero_to_fp32 does in `lmforge.export.zero_assembly`.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmforge.ckpt.safe_load import refused_pickle_reason
from lmforge.errors import UserInputError


class _Inert:
    """Stand-in for a DeepSpeed class in a checkpoint: unpickling only fills its __dict__."""


class _ZeroStage(int):
    """Stand-in for deepspeed's ZeroStageEnum, an int enum pickled as ZeroStageEnum(stage)."""


# What DeepSpeed's rank files hold besides tensors, containers and numbers. Each name maps to an
# inert lmforge stand-in (never the DeepSpeed class), so unpickling runs no DeepSpeed code.
ZERO_SAFE_GLOBALS: list[Any] = [
    # optimizer_state_dict.zero_stage: the stage number.
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    # optimizer_state_dict.loss_scaler: loss-scale numbers (fp16 / static).
    (_Inert, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Inert, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    # optimizer_state_dict.param_slice_mappings (ZeRO-1/2): (numel, start) of each parameter slice.
    (_Inert, "deepspeed.utils.tensor_fragment.fragment_address"),
]
_RANK_FILE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_(model|optim)_states\.pt")


def load_rank_file(path: Path) -> dict[str, Any]:
    """A DeepSpeed rank file, unpickled with weights_only and memory-mapped (no tensor data read)."""
    with torch.serialization.safe_globals(ZERO_SAFE_GLOBALS):
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as err:
            raise UserInputError(
                f"{path}: holds an object lmforge does not unpickle ({refused_pickle_reason(err)}); it is not "
                "a DeepSpeed rank file lmforge knows. Convert it with DeepSpeed's zero_to_fp32.py only if "
                "you trust its origin"
            ) from None
        except RuntimeError as err:
            raise UserInputError(
                f"{path}: unreadable ({err}); the file is damaged or not a torch file"
            ) from None
    if not isinstance(loaded, dict):
        raise UserInputError(f"{path}: not a DeepSpeed rank file (holds a {type(loaded).__name__})")
    return loaded


def find_zero_dir(path: Path) -> Path | None:
    """The DeepSpeed tag directory (global_stepN) of `path`, or None when `path` is not one."""
    if path.is_dir() and (path / "latest").is_file():
        tag = (path / "latest").read_text().strip()
        if not (path / tag).is_dir():
            raise UserInputError(
                f"{path / 'latest'}: names {tag!r} but {path / tag} does not exist; the checkpoint is "
                "incomplete (give the global_stepN directory that exists instead)"
            )
        return path / tag
    if path.is_dir() and any(_RANK_FILE.fullmatch(p.name) for p in path.glob("*_states.pt")):
        return path
    return None


@dataclass
class ZeroInfo:
    stage: int
    world_size: int
    step: int | None
    ds_version: str | None
    model_files: list[Path]
    optim_files: list[Path]
    missing: list[str]
    unexpected: list[str]  # rank files beyond the world size (an older, larger save left behind)


def describe_zero(zero_dir: Path) -> ZeroInfo:
    """Stage, world size, step and completeness of a ZeRO tag directory, from the small pickles only."""
    files = {p.name: _RANK_FILE.fullmatch(p.name) for p in zero_dir.glob("*_states.pt")}
    matched = {name: m for name, m in files.items() if m}
    if any(m.group(2) != "00" for m in matched.values()) or list(zero_dir.glob("layer_*")):
        raise UserInputError(
            f"{zero_dir}: a tensor- or pipeline-parallel DeepSpeed checkpoint; lmforge consolidates "
            "data-parallel ZeRO checkpoints only (use DeepSpeed's ds_to_universal.py for this one)"
        )
    optim = sorted((n for n, m in matched.items() if m.group(3) == "optim"), key=_rank_of)
    model = sorted((n for n, m in matched.items() if m.group(3) == "model"), key=_rank_of)
    if not model and not optim:
        raise UserInputError(f"{zero_dir}: no DeepSpeed *_model_states.pt or *_optim_states.pt files")
    model_state = load_rank_file(zero_dir / model[0]) if model else {}
    stage3 = any(matched[n].group(1) is not None for n in model)
    stage, world_size = None, model_state.get("dp_world_size")
    if optim:
        optim_state = load_rank_file(zero_dir / optim[0]).get("optimizer_state_dict", {})
        stage = int(optim_state["zero_stage"]) if "zero_stage" in optim_state else None
        partitions = optim_state.get("partition_count")
        world_size = max(partitions) if isinstance(partitions, list) else partitions or world_size
    if stage is None:
        stage = 3 if stage3 else 2  # stage 1 and 2 files look alike; only the optimizer file says which
    if not isinstance(world_size, int):
        raise UserInputError(
            f"{zero_dir}: the rank files do not say the world size; the checkpoint is damaged"
        )
    expected = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size)]
    if stage == 3:
        expected += [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)]
    else:
        expected.append("mp_rank_00_model_states.pt")
    return ZeroInfo(
        stage=stage,
        world_size=world_size,
        step=model_state.get("global_steps"),
        ds_version=model_state.get("ds_version"),
        model_files=[zero_dir / n for n in model if n in expected],
        optim_files=[zero_dir / n for n in optim if n in expected],
        missing=[name for name in expected if name not in files],
        unexpected=sorted(name for name in matched if name not in expected),
    )


def _rank_of(name: str) -> int:
    match = _RANK_FILE.fullmatch(name)
    return int(match.group(1) or 0) if match else 0
