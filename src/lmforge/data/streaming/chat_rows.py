"""One fine-tuning source's samples for one reader: rows read lazily, judged by the bad-row
policy, repeated per weight, rendered and tokenized as the cached SFT path does.

A reader owns every `count`-th row of the source (rows read in file order, bad ones included),
so each row belongs to exactly one rank and worker. A row's weight repeats follow
`formats.repeat_count` of its index among the source's valid rows, the cached path's meaning.
Its position is the row of the last sample given and how many of its copies were given; a row
is counted (rows read, kept, bad) when it is read, so a resumed reader that reads that row again
does not count it twice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import DataConfig, SourceConfig
from lmforge.data.bad_rows import BadRowPolicy
from lmforge.data.chat import TokenizedSample, tokenize_conversations
from lmforge.data.examples import BadRow, Example
from lmforge.data.formats import iter_source_examples, repeat_count
from lmforge.data.sft import IGNORE_INDEX
from lmforge.data.sft_tokenize import as_conversation
from lmforge.data.stats import LengthHistogram
from lmforge.data.streaming.parts import StreamPart
from lmforge.errors import UserInputError

# The bad-row share is judged once this many rows were read: a handful of rows says too little.
MIN_ROWS_JUDGED = 100


@dataclass(frozen=True)
class _Row:
    epoch: int
    raw: int  # index among the source's rows of the epoch, bad ones and other readers' included
    valid: int  # index among the source's valid rows of the epoch (what repeat_count is seeded by)
    item: Example | BadRow


@dataclass
class ReaderCounts:
    """What one reader did with its rows, over all its sources (one bad-row policy, as cached)."""

    policy: BadRowPolicy
    dropped: Counter[str]
    truncated: int
    lengths: LengthHistogram


class SourceRows:
    """The samples of source `index` for one reader, from a saved position on."""

    def __init__(
        self,
        index: int,
        source: SourceConfig,
        key: str,
        settings: tuple[DataConfig, PreTrainedTokenizerBase, str, int],
        part: StreamPart,
        counts: ReaderCounts,
        saved: dict[str, Any] | None,
    ) -> None:
        self.index, self.source, self.key, self.part, self.counts = index, source, key, part, counts
        self.cfg, self.tokenizer, self.template, self.seed = settings
        position = (saved or {}).get("position", {"epoch": 0, "raw": 0, "copies": 0})
        self.epoch, self.raw, self.copies = (
            int(position["epoch"]),
            int(position["raw"]),
            int(position["copies"]),
        )
        self.totals = {
            name: int((saved or {}).get(name, 0)) for name in ("samples", "tokens", "supervised_tokens")
        }
        self.last_sample_epoch = self.epoch
        self.rows = self._owned_rows(self.epoch, self.raw)
        self.current: dict[str, list[int]] | None = None
        self.repeats = 0
        self.truncated = False  # whether the current row's sample was cut to data.max_length
        if self.copies:  # resuming inside a row's copies: read that row again, uncounted
            row = next(self.rows)
            sample = self._tokenized(row)
            if sample is None:
                raise ValueError(f"{key}: the saved stream position points at a row that gives no sample now")
            self.current, self.repeats = sample, self._repeats(row)

    def next_sample(self) -> dict[str, list[int]]:
        """The next sample: {"input_ids", "labels"} lists, as `ragged.SampleDataset` gives them."""
        if self.current is None or self.copies >= self.repeats:
            self._next_row()
        assert self.current is not None
        self.copies += 1
        self._count_sample(self.current)
        # Fresh lists per copy, as SampleDataset gives: a collator may keep or change what it gets.
        return {name: list(values) for name, values in self.current.items()}

    def state_dict(self) -> dict[str, Any]:
        position = {"epoch": self.epoch, "raw": self.raw, "copies": self.copies}
        return {"path": self.source.path, "position": position, "epochs": self.epoch, **self.totals}

    def _next_row(self) -> None:
        """Read rows up to the next one that gives a sample; position past the others."""
        if self.current is not None:
            self.raw, self.copies, self.current = self.raw + 1, 0, None
        while True:
            row = next(self.rows)
            self.epoch, self.raw = row.epoch, row.raw
            if row.epoch >= self.last_sample_epoch + 2:
                raise UserInputError(
                    f"{self.key}: data source {self.source.path!r} gave this reader (rank {self.part.rank}, "
                    f"worker {self.part.worker}) no sample in a whole pass. Fix: check its rows (see the "
                    "data report's bad rows and dropped counts), or use fewer ranks or dataloader workers."
                )
            self._judge(row.item)
            repeats = self._repeats(row)
            sample = self._tokenized(row, count_as=repeats) if repeats else None
            if sample is not None:
                self.current, self.repeats, self.last_sample_epoch = sample, repeats, row.epoch
                return
            self.raw += 1

    def _owned_rows(self, epoch: int, first_raw: int) -> Iterator[_Row]:
        """This reader's rows from row `first_raw` of `epoch` on, epoch after epoch."""
        while True:
            valid = owned = 0
            for raw, item in enumerate(
                iter_source_examples(self.source, memory_budget_mb=self.cfg.memory_budget_mb)
            ):
                if raw >= first_raw and raw % self.part.count == self.part.index:
                    owned += 1
                    yield _Row(epoch, raw, valid, item)
                valid += not isinstance(item, BadRow)
            if first_raw == 0 and owned == 0:
                raise UserInputError(
                    f"{self.key}: data source {self.source.path!r} has no row for this reader: it has fewer "
                    f"rows than the {self.part.count} readers (ranks x dataloader workers). Fix: add rows, "
                    "or use fewer ranks or dataloader workers."
                )
            epoch, first_raw = epoch + 1, 0

    def _judge(self, item: Example | BadRow) -> None:
        """The bad-row policy's verdict on a row as read: raise, or quarantine and count."""
        policy = self.counts.policy
        list(policy.filter([item]))
        if policy.rows_read >= MIN_ROWS_JUDGED and (
            isinstance(item, BadRow) or policy.rows_read == MIN_ROWS_JUDGED
        ):
            policy.finish()  # raises the cached path's error when too large a share is bad

    def _repeats(self, row: _Row) -> int:
        if isinstance(row.item, BadRow):
            return 0
        return repeat_count(self.source.weight, seed=self.seed, source_index=self.index, row_index=row.valid)

    def _tokenized(self, row: _Row, count_as: int = 0) -> dict[str, list[int]] | None:
        """The row's sample, or None when the length policy drops it (counted `count_as` times,
        as often as the cached path, which tokenizes each copy, would count it)."""
        (result,) = tokenize_conversations(
            [as_conversation(row.item)],
            self.tokenizer,
            template=self.template,
            train_on=self.cfg.train_on,
            max_length=self.cfg.max_length,
            over_length=self.cfg.over_length,
        )
        if not isinstance(result, TokenizedSample):
            self.counts.dropped[f"train: {result.reason}"] += count_as
            return None
        self.truncated = result.truncated
        return {"input_ids": result.input_ids.tolist(), "labels": result.labels.tolist()}

    def _count_sample(self, sample: dict[str, list[int]]) -> None:
        length = len(sample["input_ids"])
        self.totals["samples"] += 1
        self.totals["tokens"] += length
        self.totals["supervised_tokens"] += int((np.asarray(sample["labels"]) != IGNORE_INDEX).sum())
        self.counts.truncated += self.truncated
        self.counts.lengths.add(np.array([length]))
