"""A part's documents of one local source (files, globs, directories, built-in corpora), read
lazily from a saved position, epoch after epoch.

A position names the next document to read: the epoch, the file (an index into the part's
files), how many documents of that file came before it (empty ones included), and two counts
over the whole epoch that the document-interleaved parts and `max_documents` need. Resuming
from a position reads the file up to it without tokenizing anything.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from lmforge.config.schema import SourceConfig
from lmforge.data.sources import documents_of_file, is_empty_document
from lmforge.data.streaming.parts import FilePlan
from lmforge.errors import DataSourceLost, UserInputError


@dataclass(frozen=True)
class Position:
    """Where reading a source resumes (JSON-safe through `as_dict` / `from_dict`)."""

    epoch: int = 0
    file: int = 0  # index into the part's files
    doc: int = 0  # documents of that file before this one, empty ones included
    raw: int = 0  # documents of the epoch before this one, all parts' and empty ones included
    kept: int = 0  # non-empty documents of the epoch before this one, all parts' (for max_documents)

    def after(self, text: str) -> Position:
        """The position of the document that follows `text` in its file."""
        kept = self.kept + (not is_empty_document(text))
        return replace(self, doc=self.doc + 1, raw=self.raw + 1, kept=kept)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> Position:
        return cls(**{name: int(value) for name, value in state.items()})


@dataclass(frozen=True)
class ReadDocument:
    """One of the part's documents: where it starts, where the next one starts, its text."""

    start: Position
    end: Position
    text: str


def read_documents(source: SourceConfig, plan: FilePlan, start: Position, key: str) -> Iterator[ReadDocument]:
    """The part's documents from `start` on, epoch after epoch, forever. Raises UserInputError
    when a whole epoch gives this part no non-empty document (it could never fill a block)."""
    position = start
    while True:
        fresh_epoch = position.file == 0 and position.doc == 0
        kept_here = 0
        for document in _one_epoch(source, plan, position):
            kept_here += not is_empty_document(document.text)
            yield document
        if fresh_epoch and kept_here == 0:
            raise UserInputError(
                f"{key}: data source {source.path!r} gives this reader (one rank's dataloader worker) "
                f"no non-empty document in a whole pass over its {len(plan.files)} file(s). Fix: add "
                "data to it, or use fewer ranks or dataloader workers than it has documents."
            )
        position = Position(epoch=position.epoch + 1)


def _one_epoch(source: SourceConfig, plan: FilePlan, start: Position) -> Iterator[ReadDocument]:
    position = start
    for file_index in range(start.file, len(plan.files)):
        if file_index != start.file:
            position = replace(position, file=file_index, doc=0)
        for text in itertools.islice(_file_documents(plan.files[file_index], source), position.doc, None):
            if source.max_documents is not None and position.kept >= source.max_documents:
                return
            following = position.after(text)
            if plan.owns(position.raw):
                yield ReadDocument(position, following, text)
            position = following


def _file_documents(file: Path, source: SourceConfig) -> Iterator[str]:
    """`documents_of_file`, with a file gone or unreadable mid-run turned into DataSourceLost."""
    try:
        yield from documents_of_file(file, source)
    except (OSError, UserInputError) as err:
        if isinstance(err, OSError) or not file.is_file() or not os.access(file, os.R_OK):
            raise lost_file(file, err) from err
        raise


def lost_file(file: Path | str, err: BaseException) -> DataSourceLost:
    """The error for a file a stream was reading that is gone or unreadable now."""
    detail = str(err).strip().splitlines()[0] if str(err).strip() else "no detail"
    return DataSourceLost(
        f"data file {file} disappeared or became unreadable while streaming ({type(err).__name__}: "
        f"{detail}). Fix: restore the file, then resume the run from its last checkpoint.",
        Path(file),
    )
