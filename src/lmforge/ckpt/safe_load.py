"""Reading checkpoints without running code from them.

A checkpoint directory can be edited by anyone who can write the run directory, and its hash
manifest proves integrity, not origin: a pickle planted there and re-hashed passes every check.
Two upstream readers unpickle in full during a resume: torch DCP's `FileSystemReader.
read_metadata` (`pickle.load` of `.metadata`, used by accelerate for FSDP) and DeepSpeed's
checkpoint engines (`torch.load(weights_only=False)` of the model and optimizer states).
`no_code_from_checkpoints()` replaces both for the length of a training run:

- DCP metadata goes through the allow-list unpickler that `ckpt consolidate` uses;
- every `torch.load` runs with `weights_only=True`, with DeepSpeed's few inert classes
  (a stage enum, loss-scaler numbers, slice addresses) allowed, whatever its caller asked.

A file that holds anything else is refused with `UnsafeCheckpoint`, naming the file and what it
holds; the message never suggests loading it in full.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import UserInputError


class UnsafeCheckpoint(UserInputError):
    """A checkpoint file holds a pickled object that is not data; it was not loaded."""


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)", re.IGNORECASE)


def refused_pickle_reason(err: BaseException) -> str:
    """What a weights-only unpickler refused, without torch's advice to retry with weights_only=False."""
    text = str(err)
    found = _GLOBAL.search(text)
    if found:
        return f"the global {found.group(1)}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    useful = [line for line in lines if "weights_only" not in line and "torch.load" not in line]
    return useful[0] if useful else type(err).__name__


# A training checkpoint's directory (sealed `step-N`, or HF's `checkpoint-N` while it is written).
_CHECKPOINT_DIR = re.compile(r"^(step|checkpoint)-\d+$")


def refusal_message(path: Any, err: BaseException) -> str:
    """Why the file at `path` was not loaded, and the way on: another checkpoint for a file of a
    run's checkpoint, trusted safetensors weights for any other file (a `model.path`, a base model)."""
    if any(_CHECKPOINT_DIR.match(part) for part in Path(os.fspath(path)).parts[:-1]):
        way_on = "delete this checkpoint and resume from an earlier one"
    else:
        way_on = (
            "do not use these weights; get the model as safetensors (model.safetensors) from a source you "
            "trust, and keep model.allow_bin_weights off"
        )
    return (
        f"{path}: refused to load: it holds {refused_pickle_reason(err)}, which is not tensor data "
        "(a weights file may hold only tensors and plain values). It was not unpickled; the file "
        f"may have been tampered with: {way_on}"
    )


def checkpoint_data_classes() -> list[Any]:
    """The classes engines and optimizers pickle into checkpoint states, all plain data holders
    (attributes only, no `__reduce__` / `__setstate__`): DeepSpeed's model and optimizer states,
    and GaLore's projector (rank, gap, scale, its orthogonal matrix) in `optimizer.pt`."""
    classes: list[Any] = []
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        classes += [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
    except ImportError:
        pass
    try:
        from galore_torch.galore_projector import GaLoreProjector

        classes.append(GaLoreProjector)
    except ImportError:
        pass
    return classes


def weights_only_load(original: Any) -> Any:
    """`torch.load` that always unpickles weights-only (the engines' data classes allowed)."""

    def load(f: Any, map_location: Any = None, pickle_module: Any = None, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True  # whatever the caller asked for
        with torch.serialization.safe_globals(checkpoint_data_classes()):
            try:
                return original(f, map_location=map_location, **kwargs)
            except pickle.UnpicklingError as err:
                name = os.fspath(f) if isinstance(f, str | os.PathLike) else "a checkpoint file"
                raise UnsafeCheckpoint(refusal_message(name, err)) from None

    return load


def _read_dcp_metadata_safely(self: Any, *args: Any, **kwargs: Any) -> Any:
    """FileSystemReader.read_metadata, with the allow-list unpickler instead of `pickle.load`."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    from lmforge.ckpt.dcp_checkpoint import MetadataUnpickler

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as stream:
        try:
            metadata = MetadataUnpickler(stream).load()
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpoint(refusal_message(path, err)) from None
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


@contextmanager
def no_code_from_checkpoints() -> Iterator[None]:
    """While open, no checkpoint read in this process unpickles anything but data (see the module)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    original_load, original_metadata = torch.load, FileSystemReader.read_metadata
    torch.load = weights_only_load(original_load)  # type: ignore[assignment]
    FileSystemReader.read_metadata = _read_dcp_metadata_safely  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.load = original_load  # type: ignore[assignment]
        FileSystemReader.read_metadata = original_metadata  # type: ignore[method-assign]
