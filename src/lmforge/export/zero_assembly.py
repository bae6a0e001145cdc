"""Rebuilding full parameters from DeepSpeed ZeRO-1/2/3 rank slices, lazily.

`zero_sources` gives every tensor DeepSpeed's zero_to_fp32 would return, as a `TensorSource`
that assembles the parameter from its rank slices only when it is read, exactly as
zero_to_fp32 does; the bytes are read with pread (see _RankFiles). Loading and describing the
rank files is `lmforge.ckpt.zero_checkpoint`.
"""

from __future__ import annotations

import math
import os
import weakref
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lmforge.ckpt.tensor_source import TensorSource
from lmforge.ckpt.zero_checkpoint import ZeroInfo, describe_zero, load_rank_file
from lmforge.errors import UserInputError


def zero_sources(zero_dir: Path) -> tuple[dict[str, TensorSource], set[str], ZeroInfo]:
    """Every tensor zero_to_fp32 would return, in its order, each read lazily from the mmap'd rank
    files; the names that are copies of another tensor (a tied head); and the layout."""
    info = describe_zero(zero_dir)
    _check_complete(zero_dir, info)
    key = "fp32_flat_groups" if info.stage == 3 else "single_partition_of_fp32_groups"
    optim_states = [load_rank_file(f)["optimizer_state_dict"] for f in info.optim_files]
    flat = [state[key] for state in optim_states]  # [rank][group] -> 1-D fp32 tensor
    paddings = optim_states[0].get("param_alignment_paddings")
    models = [load_rank_file(f) for f in info.model_files]
    files = _RankFiles([*info.optim_files, *info.model_files])  # after loading: their mappings are live
    head = models[0]
    sources = _buffer_sources(head)
    shapes = [dict(group) for group in head["param_shapes"]]
    if info.stage == 3:
        _zero3_frozen(files, sources, models)
        _zero3_trainable(files, sources, shapes, flat, info.world_size)
    else:
        _zero2_frozen(files, sources, head)
        _zero2_trainable(files, sources, shapes, flat, paddings, info.world_size)
    shared = set()
    for name, origin in head["shared_params"].items():
        if origin in sources:
            sources[name] = sources[origin]
            shared.add(name)
    return sources, shared, info


def _check_complete(zero_dir: Path, info: ZeroInfo) -> None:
    if info.missing:
        raise UserInputError(
            f"{zero_dir}: incomplete ZeRO-{info.stage} checkpoint of world size {info.world_size}: missing "
            f"{', '.join(info.missing)}; a rank did not finish saving. Use an earlier complete checkpoint"
        )
    if info.unexpected:
        raise UserInputError(
            f"{zero_dir}: rank files of more ranks than the world size {info.world_size}: "
            f"{', '.join(info.unexpected)}; probably left by an earlier save. Remove them or use another checkpoint"
        )


def _buffer_sources(head: dict[str, Any]) -> dict[str, TensorSource]:
    """The model's buffers, which zero_to_fp32 restores to fp32 (they live whole in rank 0's file)."""
    sources: dict[str, TensorSource] = {}
    module = head["module"]
    for name in head["buffer_names"]:
        buffer = module[name]
        sources[name] = TensorSource(
            tuple(buffer.shape),
            torch.float32 if buffer.is_floating_point() else buffer.dtype,
            partial(_buffer, buffer),
        )
    return sources


def _span(parts: list[torch.Tensor], start: int, length: int) -> list[torch.Tensor]:
    """The views of `parts`, read as one concatenated vector, that cover [start, start + length)."""
    views, base = [], 0
    for part in parts:
        size = part.numel()
        lo, hi = max(start, base), min(start + length, base + size)
        if lo < hi:
            views.append(part[lo - base : hi - base])
        base += size
    return views


def _buffer(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.float() if buffer.is_floating_point() else buffer.clone()


def _zero2_trainable(
    files: _RankFiles,
    sources: dict[str, TensorSource],
    shapes: list[dict[str, torch.Size]],
    flat: list[list[torch.Tensor]],
    paddings: list[list[int]] | None,
    world_size: int,
) -> None:
    """ZeRO-1/2: group i is the concatenation of every rank's partition i; parameters lie in it in order."""
    align = 2 * world_size  # zero_to_fp32's sanity check: both ends are padded to 2 * world_size
    for group, group_shapes in enumerate(shapes):
        parts = [rank_groups[group] for rank_groups in flat]
        offset, available = 0, sum(p.numel() for p in parts)
        for index, (name, shape) in enumerate(group_shapes.items()):
            numel = math.prod(shape)
            sources[name] = TensorSource(
                tuple(shape),
                torch.float32,
                partial(files.gather, _span(parts, offset, numel), numel, tuple(shape)),
            )
            offset += numel + (paddings[group][index] if paddings is not None else 0)
        if align * math.ceil(offset / align) != align * math.ceil(available / align):
            raise UserInputError(
                f"ZeRO group {group}: used {offset} of {available} elements; the checkpoint is damaged"
            )


def _zero3_trainable(
    files: _RankFiles,
    sources: dict[str, TensorSource],
    shapes: list[dict[str, torch.Size]],
    flat: list[list[torch.Tensor]],
    world_size: int,
) -> None:
    """ZeRO-3: every parameter is split into world_size equal (padded) slices, one per rank, in order."""
    offset = 0
    for group_shapes in shapes:
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world_size)

            views = [view for rank in flat for view in _span(rank, offset, part)]
            sources[name] = TensorSource(
                tuple(shape), torch.float32, partial(files.gather, views, numel, tuple(shape))
            )
            offset += part
    available = sum(g.numel() for g in flat[0]) * world_size
    if offset * world_size != available:
        raise UserInputError(
            f"ZeRO-3: used {offset * world_size} of {available} elements; the checkpoint is damaged"
        )


def _zero2_frozen(files: _RankFiles, sources: dict[str, TensorSource], head: dict[str, Any]) -> None:
    """ZeRO-1/2: frozen parameters are saved whole in the model file."""
    for name, fragment in (head.get("frozen_param_fragments") or {}).items():
        sources[name] = TensorSource(
            tuple(fragment.shape),
            fragment.dtype,
            partial(files.gather, [fragment], fragment.numel(), tuple(fragment.shape)),
        )


def _zero3_frozen(files: _RankFiles, sources: dict[str, TensorSource], models: list[dict[str, Any]]) -> None:
    for name, shape in (models[0].get("frozen_param_shapes") or {}).items():
        fragments = [m["frozen_param_fragments"][name] for m in models]
        sources[name] = TensorSource(
            tuple(shape),
            fragments[0].dtype,
            partial(files.gather, fragments, math.prod(shape), tuple(shape)),
        )


class _RankFiles:
    """Reads the bytes behind tensors of mmap'd rank files with pread instead of through the mapping.

    Why not just copy from the mapping: every page of a memory-mapped file that is touched stays
    resident in this process, so after copying all slices peak RSS would be the whole checkpoint
    (and each 4 KiB page costs a page fault). Reading the same bytes with pread goes through the
    page cache, which the kernel can drop, so memory stays near the largest tensor.

    Why /proc/self/maps: pread needs each tensor's byte offset in its file, and torch offers no
    documented way to get it from `torch.load(mmap=True)` (the storages are slices of one private
    mapping; `UntypedStorage.filename` is None for them and the private `_checkpoint_offset` is set
    only for meta / fake-tensor loads). /proc/self/maps says where each rank file is mapped and
    from which file offset, so a tensor's data_ptr gives its file offset. Where that is not known
    (no /proc, a non-contiguous view) the tensor is copied through the mapping. Made after the
    files are loaded, while the loaded objects (and so their mappings) are alive."""

    def __init__(self, paths: list[Path]) -> None:
        self.maps: list[tuple[int, int, int, int]] = []  # (start, end, file offset, fd)
        fds: dict[str, int] = {}
        self._closer = weakref.finalize(self, _close_all, fds)
        maps = Path("/proc/self/maps")
        targets = {str(path.resolve()) for path in paths}
        for line in maps.read_text().splitlines() if maps.is_file() else []:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5] in targets:
                if fields[5] not in fds:
                    fds[fields[5]] = os.open(fields[5], os.O_RDONLY)
                start, end = (int(x, 16) for x in fields[0].split("-"))
                self.maps.append((start, end, int(fields[2], 16), fds[fields[5]]))

    def gather(self, views: list[torch.Tensor], numel: int, shape: tuple[int, ...]) -> torch.Tensor:
        """The first numel elements of the concatenated views (ZeRO pads slices), shaped."""
        result = torch.empty(sum(v.numel() for v in views), dtype=views[0].dtype)
        position = 0
        for view in views:
            self._copy(result[position : position + view.numel()], view.reshape(-1))
            position += view.numel()
        return result[:numel].view(shape)

    def _copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        size = src.numel() * src.element_size()
        found = self._file_position(src.data_ptr(), size)
        if found is None or not src.is_contiguous() or size == 0:
            dest.copy_(src)
            return
        fd, position = found
        buffer = dest.view(torch.uint8).numpy().data
        done = 0
        while done < size:
            count = os.preadv(fd, [buffer[done:]], position + done)
            if count <= 0:
                raise UserInputError(
                    f"a rank file ended early at byte {position + done}; the checkpoint is damaged"
                )
            done += count

    def _file_position(self, address: int, size: int) -> tuple[int, int] | None:
        """(fd, file offset) of the mapped bytes [address, address + size), or None if not mapped here."""
        return next(
            (
                (fd, offset + address - start)
                for start, end, offset, fd in self.maps
                if start <= address and address + size <= end
            ),
            None,
        )


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
