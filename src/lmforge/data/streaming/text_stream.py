"""Pretraining text read lazily while training: `TextStream`, an IterableDataset of blocks.

Each source is cut into blocks on its own (a block never straddles two sources, so weights can
apply) and the sources are interleaved block by block by `data.mixture.MixtureDealer`, each
source's share its weight times its size in bytes, a source that ends starting its next epoch.
The stream is endless (training stops at train.max_steps) unless every source has a
`max_tokens` budget. Every data-parallel rank and dataloader worker reads its own part of every
source (`streaming.parts`) and runs its own dealer, so all parts deal the same order of sources.

With one source, one rank and one worker, the blocks are the cache's (`data.text`) in the same
order; with more parts, together they are the same blocks as the parts' files would give read
one after another (the same multiset when whole files are dealt; order differs by design).

The stream saves and loads its position through torchdata's Stateful protocol (`state_dict` /
`load_state_dict`, JSON-safe), which `StatefulDataLoader` calls in each worker.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import SourceConfig
from lmforge.data.mixture import MixtureDealer, stream_shares
from lmforge.data.streaming.blocks import SourceBlocks
from lmforge.data.streaming.inputs import StreamInput, open_input
from lmforge.data.streaming.parts import StreamPart, current_part
from lmforge.data.streaming.state import check_saved_part, part_state
from lmforge.data.text import eos_id
from lmforge.data.tokenizer import batch_encoder
from lmforge.errors import UserInputError

STATE_KIND = "text-stream"


class TextStream(torch.utils.data.IterableDataset):
    """Blocks of `max_length` tokens from `sources`, each sample {"input_ids", "labels" (int64,
    the same ids), "mix_source" (the source's index, for the achieved mix)}.

    `rank` / `world_size` are the data-parallel group's; the dataloader worker is found at
    iteration. `seed` (run.seed) is recorded in the state: the interleave needs no random draw.
    Sources are checked when the stream is built: a missing file, a glob matching nothing or an
    unreachable hub dataset raises UserInputError here, not at the first batch. Memory per
    reader: one tokenizer batch (`blocks.BATCH_CHARS` characters) and the carried remainder per
    source. Iterating the stream (a first look at its head, say) makes `state_dict` describe that
    iteration until the next one starts.
    """

    def __init__(
        self,
        sources: Sequence[SourceConfig],
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_length: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        split: str = "train",
    ) -> None:
        self.sources = list(sources)
        self.keys = [f"data.{split}.{index}.path" for index in range(len(self.sources))]
        self.inputs: list[StreamInput] = [
            open_input(s, k) for s, k in zip(self.sources, self.keys, strict=True)
        ]
        self.tokenizer, self.max_length, self.seed = tokenizer, max_length, seed
        self.rank, self.world_size = rank, world_size
        self.eos_id = eos_id(tokenizer)
        self.shares = stream_shares([s.weight for s in self.sources], self._sizes())
        self._saved: dict[str, Any] | None = None
        self._live: _LiveStream | None = None

    def _sizes(self) -> list[int]:
        sizes = [source.size_in_bytes for source in self.inputs]
        unknown = [key for key, size in zip(self.keys, sizes, strict=True) if size <= 0]
        if unknown and len(sizes) > 1:
            raise UserInputError(
                f"{unknown[0]}: the size of this source is unknown, so its share of the mixture cannot "
                "be set from its weight. Fix: download it and point the path at its files."
            )
        return sizes

    def budgets(self, part: StreamPart) -> list[int | None]:
        """Each source's `max_tokens` in blocks, this part's share of it (the parts together
        deal the whole budget)."""
        budgets: list[int | None] = []
        for source in self.sources:
            if source.max_tokens is None:
                budgets.append(None)
                continue
            blocks = source.max_tokens // self.max_length
            budgets.append(blocks // part.count + (part.index < blocks % part.count))
        return budgets

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        live = _LiveStream(self, current_part(self.rank, self.world_size), self._saved)
        self._live, self._saved = live, None
        while (index := live.dealer.next_source()) is not None:
            ids = torch.from_numpy(live.blocks[index].next_block().astype(np.int64))
            yield {"input_ids": ids, "labels": ids.clone(), "mix_source": torch.tensor(index)}

    def state_dict(self) -> dict[str, Any]:
        """This reader's position (every source's next token, the dealer) and report counters."""
        if self._live is not None:
            return self._live.state_dict()
        if self._saved is not None:
            return copy.deepcopy(self._saved)
        return _LiveStream(self, current_part(self.rank, self.world_size), None).state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state` on the next iteration. ValueError (with the reason) when it was saved
        by another part layout (world size, rank, workers) or for other sources or block length."""
        part = current_part(self.rank, self.world_size)
        check_saved_part(state, STATE_KIND, part)
        if [s["path"] for s in state["sources"]] != [s.path for s in self.sources]:
            raise ValueError("the saved stream read other sources than this config's data.train")
        if int(state["block_length"]) != self.max_length:
            raise ValueError(
                f"the saved stream cut blocks of {state['block_length']} tokens, this config {self.max_length}"
            )
        self._saved, self._live = copy.deepcopy(state), None


class _LiveStream:
    """One iteration's readers of every source, and its dealer."""

    def __init__(self, stream: TextStream, part: StreamPart, saved: dict[str, Any] | None) -> None:
        self.stream, self.part = stream, part
        self.dealer = MixtureDealer(stream.shares, stream.budgets(part))
        encode = batch_encoder(stream.tokenizer)
        saved_sources: list[dict[str, Any] | None] = (
            list(saved["sources"]) if saved else [None] * len(stream.inputs)
        )
        if saved:
            self.dealer.load_state_dict(saved["dealer"])
        self.blocks = [
            SourceBlocks(
                functools.partial(source.documents, part),
                encode,
                stream.eos_id,
                stream.max_length,
                saved_source,
            )
            for source, saved_source in zip(stream.inputs, saved_sources, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        sources = [
            {"path": source.path, "files": source_input.files, "epochs": blocks.epoch, **blocks.state_dict()}
            for source, source_input, blocks in zip(
                self.stream.sources, self.stream.inputs, self.blocks, strict=True
            )
        ]
        return {
            **part_state(STATE_KIND, self.part),
            "block_length": self.stream.max_length,
            "eos_token_id": self.stream.eos_id,
            "seed": self.stream.seed,
            "weights": [source.weight for source in self.stream.sources],
            "dealer": self.dealer.state_dict(),
            "sources": sources,
        }
