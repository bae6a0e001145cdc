"""torch DCP (FSDP) checkpoints: metadata read under an allow-list, model keys, lazy tensor reads.

torch's own FileSystemReader unpickles the .metadata file with a plain `pickle.load`; here it is
unpickled by MetadataUnpickler, which admits only torch's metadata dataclasses, and the reader
is handed that result. Tensors are then loaded one at a time, so memory stays near the largest.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lmforge.ckpt.tensor_source import TensorSource
from lmforge.errors import UserInputError


def _safe_layout(name: str) -> torch.layout:
    layout = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return layout


class MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle of torch's own metadata dataclasses: allow those and nothing else."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.serialization" and name == "_get_layout":
            return _safe_layout
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in self._ALLOWED.get(module, set()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def read_dcp_metadata(path: Path) -> Any:
    """The Metadata of a DCP directory, unpickled under an allow-list."""
    try:
        return MetadataUnpickler(io.BytesIO((path / ".metadata").read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
        raise UserInputError(f"{path / '.metadata'}: not DCP metadata lmforge can read ({err})") from None


def dcp_world_size(metadata: Any) -> tuple[int, list[str]]:
    """Ranks that wrote the checkpoint (from the __RANK_N.distcp file names) and the files it needs."""
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    ranks = {int(m.group(1)) for f in files if (m := re.match(r"__(\d+)_", f))}
    return (max(ranks) + 1 if ranks else 1), files


# Top-level entries that training loops (torchtitan, torchtune, hand-written FSDP loops) save next
# to the model.
_NOT_MODEL = {"optim", "optimizer", "optimizers", "lr_scheduler", "lr_schedulers", "scheduler", "dataloader"}


def _dcp_model_keys(metadata: Any, fqns: list[str]) -> tuple[dict[str, str], list[str]]:
    """Model tensor name for each DCP key that is one, and the keys that are not.

    planner_data keeps each key's path in the saved nested dict. With a "model" entry
    (`dcp.save({"model": ..., "optim": ...})`, or torch's AppState recipe `{"app": {"model": ...}}`)
    the model is what lies under it; without one (torchtitan saves the model's keys flat) it is
    everything but the optimizer and friends."""
    planner = metadata.planner_data or {}
    paths = {fqn: tuple(str(part) for part in planner.get(fqn, (fqn,))) for fqn in fqns}
    under = {fqn: _model_entry(parts) for fqn, parts in paths.items()}
    nested = any(index is not None for index in under.values())
    names, skipped = {}, []
    for fqn, parts in paths.items():
        index = under[fqn]
        if nested and index is not None:
            names[fqn] = ".".join(parts[index + 1 :])
        elif not nested and parts[0] not in _NOT_MODEL:
            names[fqn] = fqn
        else:
            skipped.append(fqn)
    return names, skipped


def _model_entry(parts: tuple[str, ...]) -> int | None:
    """Where a "model" container sits in a key's path (not under an optimizer entry), if it does."""
    for index, part in enumerate(parts[:-1]):
        if part in _NOT_MODEL:
            return None
        if part == "model":
            return index
    return None


def dcp_sources(path: Path) -> tuple[dict[str, TensorSource], list[str], int]:
    """The model tensors of the DCP directory `path`, each read on demand; the keys that are not
    model weights; and the world size that wrote it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(path)
    world_size, files = dcp_world_size(metadata)
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise UserInputError(
            f"{path}: incomplete DCP checkpoint of {world_size} ranks: missing {', '.join(missing)}; a rank "
            "did not finish saving. Use an earlier complete checkpoint"
        )
    read = partial(_read_one, _allow_listed_reader(path, metadata))
    entries = {k: e for k, e in metadata.state_dict_metadata.items() if isinstance(e, TensorStorageMetadata)}
    names, skipped = _dcp_model_keys(metadata, list(entries))
    sources = {
        name: TensorSource(
            tuple(entries[fqn].size), entries[fqn].properties.dtype, partial(read, fqn, entries[fqn])
        )
        for fqn, name in names.items()
    }
    return sources, skipped, world_size


def _allow_listed_reader(path: Path, metadata: Any) -> Any:
    """A FileSystemReader that returns `metadata` (already read safely) instead of unpickling it again."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _read_one(reader: Any, fqn: str, entry: Any) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    # One tensor per load: the planner reads only the chunks of the keys asked for.
    one = {fqn: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)}
    with warnings.catch_warnings():  # "torch.distributed is disabled": intended, no process group
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(one, storage_reader=reader, no_dist=True)
    return one[fqn]
