"""Fine-tuning conversations read lazily while training: `ChatStream`, an IterableDataset.

Rows are read, judged (bad-row policy), rendered and tokenized one at a time by the cached SFT
path's own code (`formats`, `bad_rows`, `chat`), so a streamed sample equals the cached one;
weights keep their cached meaning (`formats.repeat_count`). The sources are interleaved sample
by sample by `data.mixture.MixtureDealer`, each source's share its weight times its size in bytes,
a source that ends starting its next epoch; the stream is endless (train.max_steps ends it).
Each data-parallel rank and dataloader worker reads every (ranks x workers)-th row of each source.

Samples are what `ragged.SampleDataset` gives ({"input_ids", "labels"} lists), so the padded and
padding-free collators work unchanged. With data.packing, samples are best-fit packed within a
bounded buffer of `PACK_BUFFER` samples (not over the whole data set as the cache packs: a stream
has no end to wait for), into `ragged.PackedDataset`'s rows for `PackedCollator`.

Bad rows are judged on the rows read so far once `MIN_ROWS_JUDGED` were read, raising the cached
path's error. With more than one reader, each quarantines its bad rows to its own file
(bad_rows.rank<R>.worker<W>.jsonl next to the given path); a resumed reader appends to it, and
rows it had read past the saved position may appear there twice.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import DataConfig, SourceConfig
from lmforge.data.bad_rows import BadRowPolicy
from lmforge.data.chat import adopt_template
from lmforge.data.hub import is_remote_source, open_remote_dataset
from lmforge.data.llamafactory import is_dataset_info_source, resolve_dataset_info
from lmforge.data.mixture import MixtureDealer, stream_shares
from lmforge.data.packing import best_fit_pack
from lmforge.data.rows import resolve_row_files
from lmforge.data.stats import LengthHistogram
from lmforge.data.streaming.chat_rows import ReaderCounts, SourceRows
from lmforge.data.streaming.parts import StreamPart, current_part
from lmforge.data.streaming.state import check_saved_part, part_state
from lmforge.errors import UserInputError

STATE_KIND = "chat-stream"
PACK_BUFFER = 256  # samples best-fit packed together; memory holds one such buffer
# The counters of a reader's state that the data report sums (the rest is its position).
REPORTED = ("sources", "rows", "dropped", "truncated", "length_counts")


class ChatStream(torch.utils.data.IterableDataset):
    """The SFT samples (or, with `cfg.packing`, packed rows) of `cfg.train`, read while training.

    `rank` / `world_size` are the data-parallel group's; `quarantine_path` is where bad rows go
    (data.on_bad_row: skip). Sources are checked when the stream is built: missing files, a glob
    matching nothing, an unreachable hub dataset raise UserInputError here.
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        quarantine_path: Path | None = None,
    ) -> None:
        self.cfg, self.tokenizer, self.seed = cfg, tokenizer, seed
        self.rank, self.world_size, self.quarantine_path = rank, world_size, quarantine_path
        self.template = adopt_template(tokenizer, cfg.chat_template)
        self.keys = [f"data.train.{index}.path" for index in range(len(cfg.train))]
        sizes = [_size_in_bytes(source) for source in cfg.train]
        if len(sizes) > 1 and min(sizes) <= 0:
            raise UserInputError(
                f"{self.keys[sizes.index(min(sizes))]}: the size of this source is unknown, so its share of "
                "the mixture cannot be set from its weight. Fix: download it and point the path at its files."
            )
        self.shares = stream_shares([source.weight for source in cfg.train], sizes)
        self._saved: dict[str, Any] | None = None
        self._live: _LiveChat | None = None
        self._packed_rows_done = 0
        self._buffer_start: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        part = current_part(self.rank, self.world_size)
        saved, self._saved = self._saved, None
        live = _LiveChat(self, part, saved)
        self._live = live
        if not self.cfg.packing:
            while True:
                yield live.next_sample()
        skip = int(saved.get("packed_rows_done", 0)) if saved else 0
        while True:
            self._buffer_start, self._packed_rows_done = live.state_dict(), skip
            buffer = [live.next_sample() for _ in range(PACK_BUFFER)]
            lengths = np.array([len(sample["input_ids"]) for sample in buffer])
            for number, members in enumerate(best_fit_pack(lengths, self.cfg.max_length)):
                if number < skip:
                    continue
                self._packed_rows_done = number + 1
                yield {
                    "input_ids": [buffer[i]["input_ids"] for i in members],
                    "labels": [buffer[i]["labels"] for i in members],
                }
            skip = 0

    def state_dict(self) -> dict[str, Any]:
        """This reader's position (each source's row, the dealer; with packing, the start of the
        packing buffer and the rows of it already given) and report counters. JSON-safe."""
        if self._live is None:
            if self._saved is not None:
                return copy.deepcopy(self._saved)
            return _LiveChat(self, current_part(self.rank, self.world_size), None).state_dict()
        if self.cfg.packing and self._buffer_start is not None:
            # A resume reads the packing buffer again: the position (and the counts restored with
            # it) is the buffer's start. The report counts what has been read ("read": the buffer too).
            read = {key: value for key, value in self._live.state_dict().items() if key in REPORTED}
            return {**self._buffer_start, "packed_rows_done": self._packed_rows_done, "read": read}
        return self._live.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state` on the next iteration; ValueError with the reason when it was saved by
        another reader layout (world size, workers), for other sources or another packing setting."""
        check_saved_part(state, STATE_KIND, current_part(self.rank, self.world_size))
        if [s["path"] for s in state["sources"]] != [s.path for s in self.cfg.train]:
            raise ValueError("the saved stream read other sources than this config's data.train")
        if bool(state["packing"]) != self.cfg.packing:
            raise ValueError(f"the saved stream was read with data.packing={state['packing']}")
        self._saved, self._live = copy.deepcopy(state), None


class _LiveChat:
    """One iteration's readers of every source, their shared counts, and the dealer."""

    def __init__(self, stream: ChatStream, part: StreamPart, saved: dict[str, Any] | None) -> None:
        self.stream, self.part = stream, part
        cfg = stream.cfg
        self.counts = ReaderCounts(
            BadRowPolicy(
                cfg.on_bad_row, cfg.max_bad_fraction, _quarantine_file(stream.quarantine_path, part)
            ),
            Counter(),
            0,
            LengthHistogram(),
        )
        self.dealer = MixtureDealer(stream.shares, [None] * len(cfg.train))
        if saved:
            self._restore(saved)
        settings = (cfg, stream.tokenizer, stream.template, stream.seed)
        saved_sources = saved["sources"] if saved else [None] * len(cfg.train)
        self.sources = [
            SourceRows(index, source, key, settings, part, self.counts, saved_source)
            for index, (source, key, saved_source) in enumerate(
                zip(cfg.train, stream.keys, saved_sources, strict=True)
            )
        ]

    def _restore(self, saved: dict[str, Any]) -> None:
        policy = self.counts.policy
        rows = saved["rows"]
        policy.rows_read, policy.rows_kept = int(rows["rows_read"]), int(rows["rows_kept"])
        policy.bad_by_reason = Counter({k: int(v) for k, v in rows["bad_by_reason"].items()})
        policy._quarantine_started = True  # append: the rows quarantined before the save stay
        self.counts.dropped = Counter({k: int(v) for k, v in saved["dropped"].items()})
        self.counts.truncated = int(saved["truncated"])
        counts = saved["length_counts"]
        self.counts.lengths.counts[: len(counts)] = counts
        self.dealer.load_state_dict(saved["dealer"])

    def next_sample(self) -> dict[str, list[int]]:
        index = self.dealer.next_source()
        assert index is not None  # no budgets: some source always has a next sample
        return self.sources[index].next_sample()

    def state_dict(self) -> dict[str, Any]:
        histogram = self.counts.lengths.counts
        used = np.flatnonzero(histogram)
        return {
            **part_state(STATE_KIND, self.part),
            "packing": self.stream.cfg.packing,
            "max_length": self.stream.cfg.max_length,
            "chat_template": self.stream.cfg.chat_template or "tokenizer",
            "train_on": self.stream.cfg.train_on,
            "weights": [source.weight for source in self.stream.cfg.train],
            "dealer": self.dealer.state_dict(),
            "sources": [source.state_dict() for source in self.sources],
            "rows": self.counts.policy.counts(),
            "dropped": dict(self.counts.dropped),
            "truncated": self.counts.truncated,
            "length_counts": histogram[: int(used[-1]) + 1 if used.size else 0].tolist(),
            "packed_rows_done": 0,
        }


def _size_in_bytes(source: SourceConfig) -> int:
    """A fine-tuning source's size for its mixture share; resolving it raises UserInputError for a
    missing file, a glob matching nothing or an unreachable hub dataset."""
    if is_dataset_info_source(source):
        source = resolve_dataset_info(source)
    if is_remote_source(source.path):
        info = open_remote_dataset(source.path).info
        return int(info.dataset_size or info.size_in_bytes or 0)
    return sum(file.stat().st_size for file in resolve_row_files(source.path))


def _quarantine_file(path: Path | None, part: StreamPart) -> Path | None:
    """The reader's own quarantine file: `path` itself when it is the only reader."""
    if path is None or part.count == 1:
        return path
    return path.with_name(f"{path.stem}.rank{part.rank}.worker{part.worker}{path.suffix}")
