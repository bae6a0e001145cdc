"""Which part of a source one rank's dataloader worker reads.

Every data-parallel rank and every dataloader worker of it reads its own part of each source, so
that together they read each document exactly once per epoch. The parts follow the rule of
`datasets.distributed.split_dataset_by_node`: whole files dealt round-robin when a source has at
least as many files as parts (no file is opened twice), else every `count`-th document of the
files read in order (each part opens every file, and skips the documents of the others).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class StreamPart:
    """Part `index` of `count` = ranks x workers: rank r's worker w is part r * workers + w."""

    rank: int
    world_size: int
    worker: int
    workers: int

    @property
    def index(self) -> int:
        return self.rank * self.workers + self.worker

    @property
    def count(self) -> int:
        return self.world_size * self.workers


def current_part(rank: int, world_size: int) -> StreamPart:
    """The part this process reads: its data-parallel rank and, inside a DataLoader worker, the
    worker's id (`torch.utils.data.get_worker_info`); the main process is worker 0 of 1."""
    info = torch.utils.data.get_worker_info()
    if info is None:
        return StreamPart(rank, world_size, 0, 1)
    return StreamPart(rank, world_size, int(info.id), int(info.num_workers))


@dataclass(frozen=True)
class FilePlan:
    """The files one part opens, and whether it keeps all their documents or every `step`-th."""

    files: tuple[Path, ...]
    step: int  # 1: every document of `files` is this part's; else raw document i is when i % step == offset
    offset: int

    def owns(self, raw_index: int) -> bool:
        """Whether the `raw_index`-th document of an epoch (empty ones counted) is this part's."""
        return raw_index % self.step == self.offset


def plan_files(files: Sequence[Path], part: StreamPart, *, whole_files: bool = True) -> FilePlan:
    """Whole files round-robin when there are enough of them (and `whole_files`), else every
    `part.count`-th document of all files."""
    if whole_files and len(files) >= part.count:
        return FilePlan(tuple(files[part.index :: part.count]), 1, 0)
    return FilePlan(tuple(files), part.count, part.index)
