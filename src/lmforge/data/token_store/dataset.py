"""Reading the token store while training: blocks cut per source over memory-mapped shards.

Each source's shards, in input-file order, are one token stream; it is cut into blocks of
`data.max_length` (a block may span two shards, the final partial block is dropped), exactly
as the cached path cuts its stream. Shards are mapped read-only on first use in each process
(a dataloader worker, a rank), never copied: the page cache holds what is being read.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.data.mixture import block_of_source
from lmforge.data.shuffle import PretrainingBlocks
from lmforge.data.token_store.shards import TOKEN_DTYPE
from lmforge.errors import DataSourceLost

_OPEN_MAPS = 256  # mapped shards per source and process; well under the usual 1024 descriptors


class SourceTokens:
    """One source's shards as a single token stream, cut into blocks of `block_length`."""

    def __init__(self, token_files: Sequence[Path], token_counts: Sequence[int], block_length: int) -> None:
        self.token_files = [str(path) for path in token_files]
        self.starts = np.concatenate([[0], np.cumsum(token_counts, dtype=np.int64)])
        self.block_length = block_length
        self.blocks = int(self.starts[-1]) // block_length
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()
        self._pid = os.getpid()

    def block(self, number: int) -> np.ndarray:
        """Tokens [number * L, (number + 1) * L) of the stream, int32 (a copy of L tokens)."""
        begin, end = number * self.block_length, (number + 1) * self.block_length
        shard = int(np.searchsorted(self.starts, begin, side="right")) - 1
        pieces = []
        while begin < end:
            offset = begin - int(self.starts[shard])
            take = min(end - begin, int(self.starts[shard + 1]) - begin)
            pieces.append(self._mapped(shard)[offset : offset + take])
            begin += take
            shard += 1
        return pieces[0].copy() if len(pieces) == 1 else np.concatenate(pieces)

    def _mapped(self, shard: int) -> np.ndarray:
        """Shard `shard` mapped read-only. Each process (a forked dataloader worker) maps its own;
        at most _OPEN_MAPS stay mapped, since each mapping holds a file descriptor."""
        if self._pid != os.getpid():
            self._maps, self._pid = OrderedDict(), os.getpid()
        if shard in self._maps:
            self._maps.move_to_end(shard)
            return self._maps[shard]
        if len(self._maps) >= _OPEN_MAPS:
            self._maps.popitem(last=False)
        self._maps[shard] = _map(self.token_files[shard])
        return self._maps[shard]

    def __getstate__(self) -> dict[str, Any]:
        # A spawned worker receives paths and offsets, never the mapped arrays.
        return {**self.__dict__, "_maps": OrderedDict(), "_pid": -1}


def _map(path: str) -> np.ndarray:
    try:
        if os.path.getsize(path) == 0:  # np.memmap refuses empty files
            return np.empty(0, dtype=TOKEN_DTYPE)
        return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    except OSError as err:
        # DataSourceLost: the trainer stops with a checkpoint (train/hf_trainer.py), saying how to go on.
        raise DataSourceLost(
            f"{path}: a shard of the token store could not be opened during the run ({err.strerror}); "
            "restore it, or rebuild the store with lmforge prepare",
            Path(path),
        ) from None


class StoreBlocks(PretrainingBlocks):
    """A map-style dataset of the mix: sample i is block `block_of_source(k, ...)` of the source
    whose range of the mix holds i. Samples are {"input_ids", "labels", "mix_source"}.

    `kept[s]` lists the blocks of source s this split may use (None: all of them; a hold-out
    removes the eval blocks); `planned[s]` is how many the mix takes (see data.mixture).
    """

    def __init__(
        self,
        sources: Sequence[SourceTokens],
        kept: Sequence[np.ndarray | None],
        planned: Sequence[int],
        seed: int,
    ) -> None:
        self.sources = list(sources)
        self.kept = list(kept)
        self.planned = list(planned)
        self.seed = seed
        self.offsets = np.concatenate([[0], np.cumsum(self.planned, dtype=np.int64)])

    def available(self, source: int) -> int:
        """Blocks of `source` this split may use (before its weight and budget apply)."""
        kept = self.kept[source]
        return self.sources[source].blocks if kept is None else len(kept)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} of a mix of {len(self)}")
        source = int(np.searchsorted(self.offsets, index, side="right")) - 1
        k = index - int(self.offsets[source])
        position = block_of_source(k, self.available(source), self.planned[source], self.seed)
        kept = self.kept[source]
        number = position if kept is None else int(kept[position])
        ids = torch.from_numpy(self.sources[source].block(number).astype(np.int64))
        return {"input_ids": ids, "labels": ids.clone(), "mix_source": torch.tensor(source)}
