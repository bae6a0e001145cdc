"""A pretraining source as a stream reads it: its size in bytes (for the mixture's shares) and
its documents from a saved position, for local files and built-in corpora or a hub dataset.

Positions are JSON-safe dicts: a local source's is `documents.Position`'s; a hub source's is
its epoch and the `datasets` IterableDataset.state_dict() taken before the document.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from lmforge.config.schema import SourceConfig
from lmforge.data.hub import hub_unreachable, is_remote_source, open_remote_dataset
from lmforge.data.source_paths import resolve_files
from lmforge.data.streaming.documents import Position, read_documents
from lmforge.data.streaming.parts import StreamPart, plan_files
from lmforge.errors import UserInputError

# (where the document starts, where the next one starts, its text)
Document = tuple[dict[str, Any], dict[str, Any], str]


class StreamInput(Protocol):
    """One source of a stream: what the stream needs to know of it before and while reading."""

    size_in_bytes: int
    files: int

    def documents(self, part: StreamPart, start: dict[str, Any] | None) -> Iterator[Document]: ...


def open_input(source: SourceConfig, key: str) -> StreamInput:
    """The source, checked now (a glob matching nothing, a missing file or an unreachable hub
    dataset raises UserInputError here, before training, not at the first batch)."""
    if is_remote_source(source.path):
        return HubInput(source, key)
    return LocalInput(source, key)


class LocalInput:
    """Local files, a glob, a directory, or a built-in corpus (`data.source_paths` resolves it)."""

    def __init__(self, source: SourceConfig, key: str) -> None:
        self.source, self.key = source, key
        self.paths: list[Path] = resolve_files(source, key=key)
        self.files = len(self.paths)
        self.size_in_bytes = sum(path.stat().st_size for path in self.paths)

    def documents(self, part: StreamPart, start: dict[str, Any] | None) -> Iterator[Document]:
        # max_documents counts a source's documents in reading order over all parts, which
        # only parts that see every file can do: it reads documents interleaved.
        plan = plan_files(self.paths, part, whole_files=self.source.max_documents is None)
        position = Position.from_dict(start) if start else Position()
        for document in read_documents(self.source, plan, position, self.key):
            yield document.start.as_dict(), document.end.as_dict(), document.text


class HubInput:
    """A hub dataset streamed with `datasets` (`load_dataset(..., streaming=True)`), each part
    its share through `split_dataset_by_node`, resumed through the dataset's own state_dict."""

    def __init__(self, source: SourceConfig, key: str) -> None:
        self.source, self.key = source, key
        self.dataset = open_remote_dataset(source.path)
        self.files = int(getattr(self.dataset, "num_shards", 1) or 1)
        info = self.dataset.info
        self.size_in_bytes = int(info.dataset_size or info.size_in_bytes or 0)

    def documents(self, part: StreamPart, start: dict[str, Any] | None) -> Iterator[Document]:
        from datasets.distributed import split_dataset_by_node

        epoch = int(start["epoch"]) if start else 0
        saved = start.get("dataset") if start else None
        while True:
            rows = split_dataset_by_node(self.dataset, rank=part.index, world_size=part.count)
            fresh_start = saved is None
            if saved is not None:
                rows.load_state_dict(saved)
                saved = None
            iterator = iter(rows)
            read = 0
            while True:
                before = {"epoch": epoch, "dataset": rows.state_dict()}
                try:
                    row = next(iterator, None)
                except (OSError, ConnectionError) as err:
                    raise hub_unreachable(self.source.path, err) from None
                if row is None:
                    break
                read += 1
                yield before, {"epoch": epoch, "dataset": rows.state_dict()}, self._text(row)
            if fresh_start and read == 0:
                raise UserInputError(
                    f"{self.key}: hub dataset {self.source.path!r} gives this reader no row in a whole pass. "
                    "Fix: use fewer ranks or dataloader workers than it has rows."
                )
            epoch += 1

    def _text(self, row: dict[str, Any]) -> str:
        value = row.get(self.source.text_field)
        if not isinstance(value, str):
            raise UserInputError(
                f"{self.key}: hub dataset {self.source.path!r} has no string field "
                f"{self.source.text_field!r} (fields: {', '.join(sorted(row))}). Fix: set text_field "
                "on this source to the field that holds the text."
            )
        return value
