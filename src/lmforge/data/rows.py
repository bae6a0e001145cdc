"""Reading raw rows (one dict per record) from fine-tuning data files, lazily, with their origin.

Supported files: `.jsonl` (one JSON object per line, read line by line), `.json` (a list of
objects; loaded whole, so it must fit in the memory budget), `.csv` (a header row, then one
row per record; every value is a string), `.parquet` and `.arrow` (HF datasets cache files or
Arrow IPC files; read in record batches). A line that cannot be decoded becomes a `BadRow`
(invalid UTF-8, NUL byte, malformed JSON, line too long) instead of stopping the read.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from lmforge.data.bad_rows import (
    INVALID_UTF8,
    LINE_TOO_LONG,
    MALFORMED_JSON,
    MISSING_FIELD,
    NUL_BYTE,
    excerpt,
)
from lmforge.data.examples import BadRow, Origin
from lmforge.data.source_paths import resolve_paths
from lmforge.data.sources import open_parquet, parquet_batches
from lmforge.errors import UserInputError

ROW_SUFFIXES = frozenset({".jsonl", ".json", ".csv", ".parquet", ".arrow"})
BATCH_ROWS = 1024  # rows converted to Python objects at a time from parquet/arrow
_SHORT_EXCERPT = 200  # a bad line's excerpt in BadRow.raw: enough to find it, small for huge lines
_BOM = b"\xef\xbb\xbf"
# Metadata next to data in HF `save_to_disk` and LLaMA-Factory directories, never rows.
_METADATA_FILES = frozenset({"dataset_info.json", "state.json", "dataset_dict.json"})


@dataclass
class RawRow:
    """One record of a file: its parsed value (a dict for a well-formed row) and where it came from."""

    origin: Origin
    data: Any
    text: str = ""  # the source text of the row when it had one (jsonl line), for excerpts


def resolve_row_files(path: str) -> list[Path]:
    """The row files a source path names, sorted (see `source_paths.resolve_paths`); a directory
    saved by `datasets.save_to_disk` reads as data (its metadata files are skipped)."""
    return resolve_paths(path, ROW_SUFFIXES, skip_names=_METADATA_FILES)


def iter_raw_rows(file: Path, *, memory_budget_mb: int) -> Iterator[RawRow | BadRow]:
    """Yield the rows of one file in order; undecodable rows come out as `BadRow`s.

    Memory stays bounded by one line (jsonl, csv) or one batch (parquet, arrow); a `.json`
    file larger than `memory_budget_mb` is refused with a UserInputError (convert it to .jsonl).
    """
    budget_bytes = memory_budget_mb * (1 << 20)
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        yield from _iter_jsonl(file, budget_bytes)
    elif suffix == ".json":
        yield from _iter_json(file, budget_bytes)
    elif suffix == ".csv":
        yield from _iter_csv(file, budget_bytes)
    elif suffix == ".parquet":
        yield from _iter_batches(file, _parquet_batches(file))
    elif suffix == ".arrow":
        yield from _iter_batches(file, _arrow_batches(file))
    else:
        raise UserInputError(f"{file}: unsupported file type {suffix!r}; use one of {sorted(ROW_SUFFIXES)}.")


def _iter_jsonl(file: Path, budget_bytes: int) -> Iterator[RawRow | BadRow]:
    with file.open("rb") as handle:
        number = 0
        # readline with a limit: a line longer than the budget is never held whole.
        while line := handle.readline(budget_bytes + 1):
            number += 1
            origin = Origin(str(file), number)
            if number == 1 and line.startswith(_BOM):
                line = line[len(_BOM) :]
            if len(line) > budget_bytes and not line.endswith(b"\n"):
                size = len(line) + _skip_rest_of_line(handle, budget_bytes)
                yield BadRow(
                    origin,
                    LINE_TOO_LONG,
                    f"the line is {size} bytes, more than data.memory_budget_mb={budget_bytes >> 20}; "
                    "split the record or raise data.memory_budget_mb",
                    raw=_byte_excerpt(line),
                )
                continue
            if not line.strip():
                continue  # a blank line is no record (trailing newlines are common)
            yield _parse_json_line(line, origin)


def _skip_rest_of_line(handle: Any, chunk: int) -> int:
    skipped = 0
    while part := handle.readline(chunk):
        skipped += len(part)
        if part.endswith(b"\n"):
            break
    return skipped


def _byte_excerpt(line: bytes) -> str:
    return excerpt(line[: _SHORT_EXCERPT * 4].decode("utf-8", errors="replace"), _SHORT_EXCERPT)


def _parse_json_line(line: bytes, origin: Origin) -> RawRow | BadRow:
    nul = line.find(b"\x00")
    if nul >= 0:
        return BadRow(
            origin, NUL_BYTE, f"raw NUL byte at byte {nul + 1} of the line", raw=_byte_excerpt(line)
        )
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return BadRow(
            origin,
            INVALID_UTF8,
            f"byte {err.start + 1} of the line ({line[err.start : err.start + 1]!r}): {err.reason}",
            raw=_byte_excerpt(line),
        )
    text = text.rstrip("\r\n")  # so error columns and excerpts are those of the line itself
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        near = text[max(0, err.pos - 20) : err.pos + 20].strip()
        return BadRow(
            origin,
            MALFORMED_JSON,
            f"{err.msg} at column {err.colno} (near {near!r})",
            raw=excerpt(text, _SHORT_EXCERPT),
        )
    return RawRow(origin, data, text)


def _iter_json(file: Path, budget_bytes: int) -> Iterator[RawRow | BadRow]:
    size = file.stat().st_size
    if size > budget_bytes:
        raise UserInputError(
            f"{file}: a {size >> 20} MB JSON array is larger than data.memory_budget_mb="
            f"{budget_bytes >> 20} and a .json array cannot be streamed. Fix: convert it to .jsonl "
            "(one object per line), e.g. `jq -c '.[]' data.json > data.jsonl`, or raise data.memory_budget_mb."
        )
    raw = file.read_bytes()
    if raw.startswith(_BOM):
        raw = raw[len(_BOM) :]
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        line = 1 + raw.count(b"\n", 0, err.start)
        raise UserInputError(
            f"{file}:{line}: not valid UTF-8 ({err.reason}). Fix: convert the file to UTF-8 (e.g. with iconv)."
        ) from None
    except json.JSONDecodeError as err:
        raise UserInputError(
            f"{file}:{err.lineno}: malformed JSON ({err.msg} at column {err.colno}); a .json file must "
            "hold one JSON array. Fix: repair the file, or store one object per line in a .jsonl file "
            "so that one bad row does not stop the whole file."
        ) from None
    if not isinstance(data, list):
        raise UserInputError(
            f"{file}: the top level is a JSON {type(data).__name__}; expected a list of row objects. "
            + (
                "Fix: this looks like a LLaMA-Factory dataset_info.json; set `dataset:` on the source to "
                "the dataset name in it."
                if file.name == "dataset_info.json"
                else "Fix: write [{...}, {...}] or convert the file to .jsonl."
            )
        )
    for index, record in enumerate(data, start=1):
        yield RawRow(Origin(str(file), index), record)


def _iter_csv(file: Path, budget_bytes: int) -> Iterator[RawRow | BadRow]:
    # The csv module would raise mid-file on a bad byte; decode line by line instead and turn
    # each record that spans an undecodable line into a BadRow.
    csv.field_size_limit(max(csv.field_size_limit(), budget_bytes))
    problems: dict[int, tuple[str, str]] = {}
    with file.open("rb") as handle:
        reader = csv.reader(_decoded_lines(handle, problems))
        header = next(reader, None)
        if header is None:
            return
        header[0] = header[0].removeprefix("\ufeff")
        previous_line = reader.line_num
        for index, values in enumerate(reader, start=1):
            origin = Origin(str(file), index)
            spanned = [
                problems.pop(n) for n in range(previous_line + 1, reader.line_num + 1) if n in problems
            ]
            previous_line = reader.line_num
            if spanned:
                reason, detail = spanned[0]
                yield BadRow(origin, reason, f"{detail} (file line {previous_line})", raw=",".join(values))
            elif len(values) != len(header):
                yield _csv_width_bad_row(origin, header, values)
            else:
                yield RawRow(origin, dict(zip(header, values, strict=True)))


def _decoded_lines(handle: Iterable[bytes], problems: dict[int, tuple[str, str]]) -> Iterator[str]:
    for number, line in enumerate(handle, start=1):
        if b"\x00" in line:
            position = line.find(b"\x00") + 1
            problems[number] = (NUL_BYTE, f"raw NUL byte at byte {position} of the line")
            line = line.replace(b"\x00", b"")
        try:
            yield line.decode("utf-8")
        except UnicodeDecodeError as err:
            problems.setdefault(number, (INVALID_UTF8, f"byte {err.start + 1} of the line: {err.reason}"))
            yield line.decode("utf-8", errors="replace")


def _csv_width_bad_row(origin: Origin, header: list[str], values: list[str]) -> BadRow:
    return BadRow(
        origin,
        MISSING_FIELD,
        f"the row has {len(values)} values but the header has {len(header)} columns ({', '.join(header)})",
        raw=excerpt(",".join(values), _SHORT_EXCERPT),
    )


def _parquet_batches(file: Path) -> Iterator[pa.RecordBatch]:
    return parquet_batches(file, open_parquet(file), batch_size=BATCH_ROWS)


def _arrow_batches(file: Path) -> Iterator[pa.RecordBatch]:
    # HF datasets writes the Arrow *stream* format; pyarrow/feather write the *file* format.
    with pa.memory_map(str(file)) as source:
        try:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
            return
        except pa.ArrowInvalid:
            source.seek(0)
        try:
            stream = pa.ipc.open_stream(source)
        except pa.ArrowInvalid as err:
            raise UserInputError(
                f"{file}: not an Arrow IPC file or stream ({err}). Fix: point at a datasets "
                "cache file (data-*.arrow) or re-export the data."
            ) from None
        yield from stream


def _iter_batches(file: Path, batches: Iterator[pa.RecordBatch]) -> Iterator[RawRow]:
    index = 0
    for batch in batches:
        # Memory-mapped batches can be large; convert a slice at a time.
        for start in range(0, batch.num_rows, BATCH_ROWS):
            for record in batch.slice(start, BATCH_ROWS).to_pylist():
                index += 1
                yield RawRow(Origin(str(file), index), record)
