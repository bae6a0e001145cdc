"""Fine-tuning sources -> a lazy stream of examples and bad rows, and weighted mixing of sources.

The per-format readers live in `row_formats` (alpaca, preference, kto) and
`conversation_formats` (sharegpt, messages), format detection in `format_detection`; files
are read by `rows`; LLaMA-Factory's dataset_info.json is resolved by `llamafactory`. This
module ties them together.

`iter_source_examples` resolves a LLaMA-Factory dataset_info entry, the source's files,
the format (detected from the first well-formed row when `format: auto`), and reads each
row; feed its output through `BadRowPolicy.filter`, then `mix_weights`.

Weights: a source with weight w contributes each of its rows floor(w) times, plus once
more with probability frac(w). The extra copy is decided by a hash of (seed, source index,
row index), so the mix is deterministic for a seed, needs no look-ahead (streamable) and
does not depend on how the stream is consumed. w = 0.5 keeps about half the rows, w = 2.5
repeats each row 2 or 3 times. Bad rows pass through exactly once so counts stay true.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import TypeVar

from lmforge.config.schema import SourceConfig
from lmforge.data.bad_rows import BadRowPolicy
from lmforge.data.examples import BadRow, Example
from lmforge.data.format_detection import RowFormat, build_row_format, detect_format
from lmforge.data.hub import is_remote_source, iter_hub_rows
from lmforge.data.llamafactory import is_dataset_info_source, resolve_dataset_info
from lmforge.data.row_formats import read_row
from lmforge.data.rows import RawRow, iter_raw_rows, resolve_row_files

T = TypeVar("T")  # Example | BadRow in the pipeline; any item in tests

__all__ = [
    "RowFormat",
    "build_row_format",
    "detect_format",
    "iter_source_examples",
    "mix_weights",
    "read_row",
    "repeat_count",
    "source_row_format",
]
_FIRST_ROWS_SCANNED = 1000  # rows looked at to find a well-formed one for format detection


def iter_source_examples(source: SourceConfig, *, memory_budget_mb: int) -> Iterator[Example | BadRow]:
    """Yield each row of a fine-tuning source as an Example or a BadRow, in file order.

    Stops after `source.max_documents` examples. Raises UserInputError for an unusable
    source (missing files, ambiguous format, unknown columns, a plain-text source).
    """
    if is_dataset_info_source(source):
        source = resolve_dataset_info(source)
    if is_remote_source(source.path):
        yield from _hub_examples(source)
        return
    files = resolve_row_files(source.path)
    row_format = source_row_format(source, files, memory_budget_mb=memory_budget_mb)
    kept = 0
    for file in files:
        for raw in iter_raw_rows(file, memory_budget_mb=memory_budget_mb):
            item = raw if isinstance(raw, BadRow) else _read(raw, row_format)
            yield item
            if not isinstance(item, BadRow):
                kept += 1
                if kept == source.max_documents:
                    return


def _hub_examples(source: SourceConfig) -> Iterator[Example | BadRow]:
    """A hub dataset's rows; its format comes from the first row, like a local file's."""
    row_format: RowFormat | None = None
    for kept, (origin, data) in enumerate(iter_hub_rows(source.path), start=1):
        if row_format is None:
            row_format = build_row_format(source.format, source.columns, tuple(data), origin.file)
        yield read_row(data, origin, row_format)
        if kept == source.max_documents:
            return


def _read(raw: RawRow, row_format: RowFormat | None) -> Example | BadRow:
    if row_format is None:  # no well-formed row to detect from: every row is bad anyway
        return read_row(raw.data, raw.origin, _ANY_FORMAT, raw.text)
    return read_row(raw.data, raw.origin, row_format, raw.text)


_ANY_FORMAT = RowFormat("alpaca", "sft", build_row_format("alpaca", {}, (), "").columns)


def source_row_format(
    source: SourceConfig, files: Sequence[Path], *, memory_budget_mb: int
) -> RowFormat | None:
    """The RowFormat of a (resolved) source, from its settings and its first well-formed row.

    None when no row among the first ones is a JSON object (then every row reads as bad).
    """
    first = _first_object_row(files, memory_budget_mb)
    if first is None:
        if source.format in ("alpaca", "sharegpt", "messages"):
            return build_row_format(source.format, source.columns, (), str(files[0]))
        return None
    return build_row_format(source.format, source.columns, tuple(first.data), first.origin.file)


def _first_object_row(files: Sequence[Path], memory_budget_mb: int) -> RawRow | None:
    for file in files:
        rows = iter_raw_rows(file, memory_budget_mb=memory_budget_mb)
        try:
            for raw in islice(rows, _FIRST_ROWS_SCANNED):
                if isinstance(raw, RawRow) and isinstance(raw.data, dict):
                    return raw
        finally:
            rows.close()  # type: ignore[attr-defined]
    return None


def repeat_count(weight: float, *, seed: int, source_index: int, row_index: int) -> int:
    """How many times a row appears in the mix: floor(weight) + Bernoulli(frac(weight)).

    The Bernoulli draw comes from sha256(seed, source_index, row_index): deterministic and
    independent of Python's hash seed and of the order rows are read in.
    """
    whole = math.floor(weight)
    fraction = weight - whole
    if fraction == 0:
        return whole
    key = f"{seed}:{source_index}:{row_index}".encode()
    draw = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64
    return whole + (1 if draw < fraction else 0)


def mix_weights(streams: Sequence[Iterable[T]], weights: Sequence[float], *, seed: int) -> Iterator[T]:
    """The rows of several sources, source after source, each example repeated per its weight.

    See the module docstring for the weight semantics. Shuffling across sources is the
    job of a later stage; this keeps the stream lazy.
    """
    if len(streams) != len(weights):
        raise ValueError(f"{len(streams)} streams but {len(weights)} weights")
    for source_index, (stream, weight) in enumerate(zip(streams, weights, strict=True)):
        for row_index, item in enumerate(stream):
            if isinstance(item, BadRow):
                yield item
                continue
            for _ in range(repeat_count(weight, seed=seed, source_index=source_index, row_index=row_index)):
                yield item


def valid_examples(
    sources: Sequence[SourceConfig], policy: BadRowPolicy, *, memory_budget_mb: int, seed: int
) -> Iterator[Example]:
    """Every source's valid rows in order, each repeated per its mixing weight (seeded, streamable).

    The bad-row policy sees the rows as read, before weighting, so its counts are the file's."""
    streams = [policy.filter(iter_source_examples(s, memory_budget_mb=memory_budget_mb)) for s in sources]
    return mix_weights(streams, [source.weight for source in sources], seed=seed)
