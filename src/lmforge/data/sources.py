"""Reading raw documents from the data sources of a config.

A source is a file, a glob, a directory (searched recursively) or a built-in corpus.
Supported files: `.txt`/`.md` (split per `source.split`), `.jsonl`, `.json` (a list of
objects or strings) and `.parquet`. A directory reads only data files: its `.md` files and
README/LICENSE files are documentation (name them, or a glob, to train on them). Every
problem in a file is reported with the file, the line (or row) and a fix; empty documents
are skipped and counted, never dropped silently, and a source with no document at all is an
error naming its config key (data.train.N.path). Which files a source names is
`data.source_paths`'s part.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.config.schema import SourceConfig
from lmforge.data.corpus import builtin_files, builtin_version, is_builtin, iter_builtin_documents
from lmforge.data.source_paths import TEXT_SUFFIXES, files_text, resolve_files, source_label
from lmforge.errors import UserInputError

_PARAGRAPH_BREAK = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")  # one or more blank lines
_HASH_CHUNK = 1 << 20  # hash files in 1 MiB reads: constant memory, near disk speed
_PARQUET_BATCH_ROWS = 4096


@dataclass
class SourceStats:
    """What reading one source produced; filled in while `iter_documents` runs."""

    path: str
    files: int = 0
    documents: int = 0
    empty_documents_skipped: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def iter_documents(
    source: SourceConfig, stats: SourceStats | None = None, *, key: str | None = None
) -> Iterator[str]:
    """Yield the non-empty documents of a source in file order, at most `source.max_documents`.

    Empty or whitespace-only documents are skipped and counted in `stats`. Kept documents
    are yielded unchanged (no stripping: whitespace matters in code and poetry). A source
    read to its end without one document raises UserInputError naming `key` (like
    "data.train.0.path") when given, and always the path.
    """
    stats = stats if stats is not None else SourceStats(source.path)
    if is_builtin(source.path):
        stats.files = len(builtin_files(source.path))
        yield from _limit_and_count(iter_builtin_documents(source.path), source, stats)
        return
    files = resolve_files(source, key=key)
    stats.files = len(files)
    yield from _limit_and_count(_documents_of_files(files, source), source, stats)
    if stats.documents == 0:
        # Without this the failure surfaces later and elsewhere ("no BPE merges", "0 tokens").
        raise UserInputError(
            f"{source_label(source.path, key)} holds no rows: its {files_text(files)} gave no "
            f"non-empty document ({stats.empty_documents_skipped} empty skipped). "
            f"Fix: put data there, or remove this source from {_list_key(key)}."
        )


def is_empty_document(text: str) -> bool:
    """Whether a document is skipped (and counted) rather than trained on: empty or whitespace only."""
    return not text or text.isspace()


def _limit_and_count(documents: Iterator[str], source: SourceConfig, stats: SourceStats) -> Iterator[str]:
    for text in documents:
        if is_empty_document(text):
            stats.empty_documents_skipped += 1
            continue
        stats.documents += 1
        yield text
        if stats.documents == source.max_documents:
            return  # before reading further: the next document may be a whole file


def _documents_of_files(files: list[Path], source: SourceConfig) -> Iterator[str]:
    for file in files:
        yield from documents_of_file(file, source)


def documents_of_file(file: Path, source: SourceConfig) -> Iterator[str]:
    """Every document of one file of `source`, empty ones included, as `iter_documents` reads it:
    the token store's tasks read their files one by one through this."""
    if is_builtin(source.path):
        # A built-in corpus is one document per file, undecodable bytes replaced (see corpus.py).
        yield file.read_text(encoding="utf-8", errors="replace")
        return
    suffix = file.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        yield from _read_text(file, source.split)
    elif suffix == ".jsonl":
        yield from _read_jsonl(file, source.text_field)
    elif suffix == ".json":
        yield from _read_json(file, source.text_field)
    else:
        yield from _read_parquet(file, source.text_field)


def _decode(data: bytes, file: Path, first_line: int = 1) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + data.count(b"\n", 0, err.start)
        raise UserInputError(
            f"{file}:{line}: not valid UTF-8 (byte {err.start} of the line/file: {err.reason}). "
            "Fix: convert the file to UTF-8 (for example with iconv)."
        ) from None


def _read_text(file: Path, split: str) -> Iterator[str]:
    if split == "file":
        yield _decode(file.read_bytes(), file)
        return
    if split == "line":
        with file.open("rb") as handle:
            for number, raw in enumerate(handle, start=1):
                yield _decode(raw, file, number).rstrip("\r\n")
        return
    yield from _PARAGRAPH_BREAK.split(_decode(file.read_bytes(), file))


def _text_from_record(record: Any, field: str, where: str) -> str:
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        raise UserInputError(
            f"{where}: expected a JSON object with a {field!r} field, got {type(record).__name__}. "
            'Fix: write one object per record, like {"' + field + '": "..."}.'
        )
    if field not in record:
        fields = ", ".join(sorted(record)) or "none"
        raise UserInputError(
            f"{where}: no field {field!r} (fields present: {fields}). "
            "Fix: set text_field on this data source to the field that holds the text."
        )
    value = record[field]
    if not isinstance(value, str):
        raise UserInputError(
            f"{where}: field {field!r} is {type(value).__name__}, expected a string. "
            "Fix: store the document text as a JSON string (empty strings are skipped and counted)."
        )
    return value


def _read_jsonl(file: Path, field: str) -> Iterator[str]:
    with file.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue  # a blank line is no record (a trailing newline is common)
            where = f"{file}:{number}"
            try:
                record = json.loads(_decode(raw, file, number))
            except json.JSONDecodeError as err:
                raise UserInputError(
                    f"{where}: invalid JSON ({err.msg} at column {err.colno}). "
                    "Fix: each line of a .jsonl file must be one complete JSON object."
                ) from None
            if isinstance(record, str):
                raise UserInputError(
                    f'{where}: expected a JSON object, got a string. Fix: write {{"{field}": ...}}.'
                )
            yield _text_from_record(record, field, where)


def _read_json(file: Path, field: str) -> Iterator[str]:
    try:
        data = json.loads(_decode(file.read_bytes(), file))
    except json.JSONDecodeError as err:
        raise UserInputError(
            f"{file}:{err.lineno}: invalid JSON ({err.msg} at column {err.colno}). Fix: repair the file."
        ) from None
    if not isinstance(data, list):
        raise UserInputError(
            f"{file}: top level is a JSON {type(data).__name__}; expected a list of objects or strings. "
            'Fix: write [{"' + field + '": "..."}, ...] or convert the file to .jsonl.'
        )
    for index, record in enumerate(data):
        yield _text_from_record(record, field, f"{file}: item {index}")


def open_parquet(file: Path, *, key: str | None = None) -> pq.ParquetFile:
    """The parquet file at `file`; UserInputError naming it (and `key`) when it is unreadable."""
    try:
        return pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as err:
        raise unreadable_parquet(file, err, key) from None


def unreadable_parquet(file: Path, err: Exception, key: str | None = None) -> UserInputError:
    """The error for a corrupt or truncated parquet file (pyarrow's own names no file)."""
    detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    where = f"{key}: " if key else ""
    return UserInputError(
        f"{where}{file}: not a readable parquet file ({detail}). Fix: re-export it (for example "
        "with pandas.DataFrame.to_parquet), or remove it from the data source."
    )


def parquet_batches(file: Path, parquet: pq.ParquetFile, **options: Any) -> Iterator[pa.RecordBatch]:
    """`parquet.iter_batches(**options)`, with an unreadable page reported naming `file`."""
    batches = parquet.iter_batches(**options)
    while True:
        try:  # a valid footer does not promise readable pages
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as err:
            raise unreadable_parquet(file, err) from None
        if batch is None:
            return
        yield batch


def _read_parquet(file: Path, field: str) -> Iterator[str]:
    parquet = open_parquet(file)
    names = parquet.schema_arrow.names
    if field not in names:
        raise UserInputError(
            f"{file}: no column {field!r} (columns: {', '.join(names)}). "
            "Fix: set text_field on this data source to the column that holds the text."
        )
    column_type = parquet.schema_arrow.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise UserInputError(
            f"{file}: column {field!r} has type {column_type}, expected string. Fix: store text."
        )
    row = 0
    for batch in parquet_batches(file, parquet, batch_size=_PARQUET_BATCH_ROWS, columns=[field]):
        column = batch.column(0)
        if column.null_count:
            first_null = row + column.is_null().to_pylist().index(True)
            raise UserInputError(
                f"{file}: row {first_null}: column {field!r} is null. Fix: drop the row or store an empty string."
            )
        yield from column.to_pylist()
        row += len(column)


def _hash_file(file: Path) -> tuple[str, bool]:
    """(sha256 of the file, whether it holds anything but whitespace)."""
    digest = hashlib.sha256()
    has_text = False
    with file.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
            has_text = has_text or not chunk.isspace()
    return digest.hexdigest(), has_text


def sources_fingerprint(sources: Sequence[SourceConfig], split: str = "train") -> str:
    """sha256 over each source's settings and each of its files' path, size and content hash.

    A built-in corpus contributes its name and Python version instead of its content.
    This is the first read of every source in a run (before any tokenizer is trained), so it
    also fails early, naming `data.<split>.N.path`, for a source that is missing, holds no
    rows (only empty files) or has an unreadable parquet file.
    """
    digest = hashlib.sha256()
    for index, source in enumerate(sources):
        digest.update(source.model_dump_json().encode())
        if is_builtin(source.path):
            digest.update(builtin_version(source.path).encode())
            continue
        key = f"data.{split}.{index}.path"
        files = resolve_files(source, key=key)
        holds_rows = False
        for file in files:
            file_hash, has_text = _hash_file(file)
            if file.suffix.lower() == ".parquet":
                with open_parquet(file, key=key) as parquet:
                    has_text = parquet.metadata.num_rows > 0
            holds_rows = holds_rows or has_text
            digest.update(f"{file.resolve()}|{file.stat().st_size}|{file_hash}\n".encode())
        if not holds_rows:
            raise UserInputError(
                f"{source_label(source.path, key)} holds no rows: {files_text(files)} "
                f"{'is' if len(files) == 1 else 'are all'} empty ({_emptiness(files)}). "
                f"Fix: put data there, or remove this source from data.{split}."
            )
    return digest.hexdigest()


def _emptiness(files: list[Path]) -> str:
    if len(files) > 1:
        return "no bytes, only whitespace, or 0 parquet rows"
    if files[0].stat().st_size == 0:
        return "0 bytes"
    return "0 parquet rows" if files[0].suffix.lower() == ".parquet" else "only whitespace"


def _list_key(key: str | None) -> str:
    """The list a source sits in: 'data.train' for 'data.train.0.path'."""
    return key.rsplit(".", 2)[0] if key and key.count(".") >= 3 else "the config"
