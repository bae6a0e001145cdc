"""Cutting one source's documents into blocks, carrying the remainder across documents and
tokenizer batches, with a position that resumes at the exact next token.

Documents are tokenized a batch at a time; each non-empty one is followed by EOS (empty ones
are skipped and counted, as the cache does). The pending documents are the ones a block has not
yet used up; the first of them, and how many of its tokens were already used, is the position a
resumed stream starts from: it reads that document again (the ones before it are skipped
without tokenizing) and drops the used tokens. Counters count a document once it is used up,
so a resumed stream never counts one twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lmforge.data.encoding import BatchEncoder, encode_documents
from lmforge.data.sources import is_empty_document
from lmforge.data.stats import LengthHistogram
from lmforge.data.streaming.inputs import Document

# Characters per tokenizer call: enough for the Rust backend to be efficient, small enough that a
# dataloader worker holds little (memory is one such batch plus the remainder carried over).
BATCH_CHARS = 200_000


@dataclass
class SourceCounters:
    """What one reader used of one source (JSON-safe through asdict)."""

    documents: int = 0
    empty_documents_skipped: int = 0
    tokens: int = 0  # of the used-up documents, EOS not counted
    blocks: int = 0
    length_counts: list[int] = field(default_factory=list)  # LengthHistogram.counts of document lengths


@dataclass
class _Pending:
    start: dict[str, Any]
    end: dict[str, Any]
    ids: np.ndarray  # with its EOS; empty for an empty document


class SourceBlocks:
    """The blocks of one source for one reader, from a saved position on."""

    def __init__(
        self,
        read: Callable[[dict[str, Any] | None], Iterator[Document]],
        encode: BatchEncoder,
        eos_id: int,
        block_length: int,
        saved: dict[str, Any] | None = None,
    ) -> None:
        self.read, self.encode, self.eos_id, self.block_length = read, encode, eos_id, block_length
        saved = saved or {}
        self.resume_at: dict[str, Any] | None = saved.get("position")
        self.offset = int(saved.get("offset", 0))
        self.counters = SourceCounters(**saved.get("counters", {}))
        self.histogram = LengthHistogram()
        if self.counters.length_counts:
            self.histogram.counts[: len(self.counters.length_counts)] = self.counters.length_counts
        self.pending: deque[_Pending] = deque()
        self.pending_tokens = 0
        self.documents: Iterator[Document] | None = None

    def next_block(self) -> np.ndarray:
        """The next `block_length` tokens (int32)."""
        while self.pending_tokens - self.offset < self.block_length:
            self._read_batch()
        block = np.empty(self.block_length, dtype=np.int32)
        filled, offset = 0, self.offset
        for entry in self.pending:
            piece = entry.ids[offset : offset + self.block_length - filled]
            block[filled : filled + piece.size] = piece
            filled, offset = filled + piece.size, 0
            if filled == self.block_length:
                break
        self.offset += self.block_length
        self.counters.blocks += 1
        self._drop_used_up()
        return block

    def state_dict(self) -> dict[str, Any]:
        """Where the next unused token is, and the counters; JSON-safe."""
        position = self.pending[0].start if self.pending else self.resume_at
        counters = asdict(self.counters)
        counters["length_counts"] = self.histogram.counts[: _used_bins(self.histogram)].tolist()
        return {"position": position, "offset": self.offset, "counters": counters}

    @property
    def epoch(self) -> int:
        """Passes over the source this reader has completed."""
        position = self.pending[0].start if self.pending else self.resume_at
        return int(position["epoch"]) if position else 0

    def _read_batch(self) -> None:
        if self.documents is None:
            self.documents = self.read(self.resume_at)
        batch: list[tuple[dict[str, Any], dict[str, Any], str]] = []
        chars = 0
        while chars < BATCH_CHARS:
            start, end, text = next(self.documents)  # the reader cycles epochs: it never ends
            batch.append((start, end, text))
            chars += len(text)
        texts = [text for _, _, text in batch if not is_empty_document(text)]
        flat, lengths = encode_documents(self.encode, texts)
        cuts = iter(np.split(flat, np.cumsum(lengths)[:-1]) if texts else [])
        eos = np.array([self.eos_id], dtype=np.int32)
        for start, end, text in batch:
            ids = np.empty(0, np.int32) if is_empty_document(text) else np.concatenate([next(cuts), eos])
            self.pending.append(_Pending(start, end, ids))
            self.pending_tokens += ids.size

    def _drop_used_up(self) -> None:
        while self.pending and self.offset >= self.pending[0].ids.size:
            entry = self.pending.popleft()
            self.offset -= entry.ids.size
            self.pending_tokens -= entry.ids.size
            self.resume_at = entry.end
            if entry.ids.size:
                self.counters.documents += 1
                self.counters.tokens += entry.ids.size - 1
                self.histogram.add(np.array([entry.ids.size - 1]))
            else:
                self.counters.empty_documents_skipped += 1


def _used_bins(histogram: LengthHistogram) -> int:
    used = np.flatnonzero(histogram.counts)
    return int(used[-1]) + 1 if used.size else 0
