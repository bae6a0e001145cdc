"""Whether a sealed checkpoint can really be resumed, beyond its hash manifest.

A manifest that is consistent with itself proves the files were not changed after it was
written, not that they load: random bytes with a recomputed manifest, or a manifest that lists
no files at all, pass `check_checkpoint`. Before a resume picks a checkpoint, this reads what
the engine that wrote it will need, cheaply and without running code from it: the trainer
state as JSON, safetensors headers, torch files weights-only and memory-mapped (no tensor data
read), DCP metadata through the allow-list unpickler. Any problem names the file.

The model weights are also read in full and must be finite: a run that diverged can seal a
checkpoint whose weights are NaN, and resuming it trains on garbage and ends in a NaN final/.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch

from lmforge.ckpt.safe_load import UnsafeCheckpoint, checkpoint_data_classes, refused_pickle_reason
from lmforge.errors import UserInputError

TRAINER_STATE = "trainer_state.json"
_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")


def resume_problem(directory: Path, step: int) -> str | None:
    """Why the checkpoint `directory` (sealed at `step`) cannot be resumed, or None when it can."""
    try:
        _check_trainer_state(directory, step)
        dcp = sorted(p.parent for p in directory.glob("*/.metadata"))
        zero = sorted(p for p in directory.glob("global_step*") if p.is_dir())
        if dcp:
            _check_dcp(dcp)
        elif zero:
            _check_zero(zero[-1])
        else:
            _check_model_files(directory)
            _check_torch_file(directory / "optimizer.pt", required=False)
        for extra in sorted(directory.glob("rng_state*.pth")) + [directory / "scheduler.pt"]:
            _check_torch_file(extra, required=False)
    except _Unusable as problem:
        return str(problem)
    return None


class _Unusable(Exception):
    pass


def _check_trainer_state(directory: Path, step: int) -> None:
    path = directory / TRAINER_STATE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _Unusable(f"missing {TRAINER_STATE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _Unusable(f"{TRAINER_STATE} is not readable JSON ({err})") from None
    if not isinstance(state, dict) or state.get("global_step") != step:
        found = state.get("global_step") if isinstance(state, dict) else None
        raise _Unusable(f"{TRAINER_STATE} records step {found}, not {step}")


def _check_model_files(directory: Path) -> None:
    present = [directory / name for name in _MODEL_FILES if (directory / name).is_file()]
    if not present:
        raise _Unusable(f"no model weights ({', '.join(_MODEL_FILES)})")
    for path in present:
        if path.name.endswith(".index.json"):
            _check_index(path)
        else:
            _check_safetensors(path)


def _check_index(path: Path) -> None:
    try:
        shards = set(json.loads(path.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, AttributeError) as err:
        raise _Unusable(f"{path.name} is not a readable shard index ({err})") from None
    for shard in sorted(shards):
        _check_safetensors(path.parent / shard)


def _check_safetensors(path: Path) -> None:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise _Unusable(f"missing {path.name}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
        bad, total = nonfinite_tensors(path)
    except (SafetensorError, OSError) as err:
        raise _Unusable(f"{path.name} is not a readable safetensors file ({err})") from None
    if bad:
        raise _Unusable(_nonfinite_problem(path.name, bad, total))


def nonfinite_tensors(path: Path) -> tuple[list[str], int]:
    """The floating-point tensors of the safetensors file `path` that hold NaN or inf (by name),
    and how many tensors it holds. Reads every tensor, one at a time."""
    from safetensors import safe_open

    bad = []
    with safe_open(str(path), framework="pt") as handle:
        names = list(handle.keys())
        for name in names:
            if not _all_finite(handle.get_tensor(name)):
                bad.append(name)
    return bad, len(names)


def _all_finite(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())


def _nonfinite_problem(name: str, bad: list[str], total: int) -> str:
    return (
        f"{name}: {len(bad)} of {total} weight tensors hold NaN or inf (first: {bad[0]}); the run had "
        "diverged before this save"
    )


def _check_torch_file(path: Path, *, required: bool) -> Any:
    """The file's content, loaded weights-only and memory-mapped; None when it is absent."""
    if not path.is_file():
        if required:
            raise _Unusable(f"missing {path.name}")
        return None
    # HF Trainer's own allow-list (numpy's RNG state in rng_state*.pth), as it loads these files.
    from transformers.trainer_pt_utils import safe_globals as numpy_rng_globals

    with numpy_rng_globals(), torch.serialization.safe_globals(checkpoint_data_classes()):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, UnsafeCheckpoint) as err:  # the latter: under the resume guard
            raise _Unusable(
                f"{path.relative_to(path.parents[1])} holds {refused_pickle_reason(err)}, which is not "
                "tensor data; it was not unpickled (the file may have been tampered with)"
            ) from None
        except (RuntimeError, OSError, EOFError, ValueError) as err:
            raise _Unusable(
                f"{path.name} is not a readable torch file ({str(err).splitlines()[0]})"
            ) from None


def _check_dcp(directories: list[Path]) -> None:
    from lmforge.ckpt.dcp_checkpoint import dcp_world_size, read_dcp_metadata

    for directory in directories:
        try:
            _, files = dcp_world_size(read_dcp_metadata(directory))
        except UserInputError as err:
            raise _Unusable(str(err).split(": ", 1)[-1] + f" ({directory.name}/.metadata)") from None
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise _Unusable(f"{directory.name}: missing {', '.join(missing)}")


def _check_zero(tag: Path) -> None:
    files = sorted(tag.glob("*_states.pt"))
    if not any(f.name.endswith("_model_states.pt") for f in files):
        raise _Unusable(f"{tag.name} holds no *_model_states.pt")
    for path in files:
        content = _check_torch_file(path, required=True)
        module = content.get("module") if isinstance(content, dict) else None
        if path.name.endswith("_model_states.pt") and isinstance(module, dict):
            weights = {k: v for k, v in module.items() if isinstance(v, torch.Tensor)}
            bad = [name for name, tensor in weights.items() if not _all_finite(tensor)]
            if bad:
                raise _Unusable(_nonfinite_problem(f"{tag.name}/{path.name}", bad, len(weights)))
