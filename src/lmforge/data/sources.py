"""Reading raw documents from the data sources of a config.

A source is a file, a glob, a directory (searched recursively) or a built-in corpus.
Supported files: `.txt`/`.md` (split per `source.split`), `.jsonl`, `.json` (a list of
objects or strings) and `.parquet`. Every problem in a file is reported with the file,
the line (or row) and a fix; empty documents are skipped and counted, never dropped silently.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.config.schema import SourceConfig
from lmforge.data.corpus import builtin_files, builtin_version, is_builtin, iter_builtin_documents
from lmforge.errors import UserInputError

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = frozenset({".txt", ".md"})
SUPPORTED_SUFFIXES = TEXT_SUFFIXES | {".jsonl", ".json", ".parquet"}
_GLOB_CHARS = re.compile(r"[*?\[]")
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


def resolve_files(source: SourceConfig) -> list[Path]:
    """The files of a pretraining text source, sorted; a built-in corpus gives its own files."""
    if is_builtin(source.path):
        return builtin_files(source.path)
    return resolve_paths(source.path, SUPPORTED_SUFFIXES)


def resolve_paths(
    source_path: str, suffixes: frozenset[str], *, skip_names: frozenset[str] = frozenset()
) -> list[Path]:
    """The files a source path names, sorted: the file itself, a glob's matches, or a directory's
    files with one of `suffixes`, found recursively (other files there are skipped with a
    warning; `skip_names` silently). Shared by text sources and fine-tuning row sources.

    Raises UserInputError when nothing matches or a named file has an unsupported type.
    """
    path = Path(source_path).expanduser()
    if _GLOB_CHARS.search(source_path):
        matches = [Path(p) for p in glob.glob(str(path), recursive=True)]
        files = sorted(p for p in matches if p.is_file())
        searched = f"the glob {source_path!r}" + ("" if path.is_absolute() else f" from {Path.cwd()}")
    elif path.is_dir():
        files = _supported_files_in(path, suffixes, skip_names)
        searched = f"directory {path} recursively for {', '.join(sorted(suffixes))} files"
    elif path.is_file():
        files = [path]
        searched = str(path)
    else:
        raise UserInputError(
            f"data source {source_path!r}: no such file or directory (resolved to {path.resolve()}). "
            "Fix: correct the path, or use a glob like 'data/*.jsonl' or a built-in corpus like "
            "'builtin:python-stdlib'."
        )
    if not files:
        raise UserInputError(
            f"data source {source_path!r}: no files found; searched {searched}. "
            "Fix: point the path at existing data files."
        )
    for file in files:
        if file.suffix.lower() not in suffixes:
            raise UserInputError(
                f"data source {source_path!r}: {file} has unsupported type {file.suffix or '(no suffix)'!r}. "
                f"Fix: use one of {', '.join(sorted(suffixes))}, or narrow the glob."
            )
    return files


def _supported_files_in(directory: Path, suffixes: frozenset[str], skip_names: frozenset[str]) -> list[Path]:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in skip_names)
    supported = [p for p in files if p.suffix.lower() in suffixes]
    ignored = len(files) - len(supported)
    if ignored:
        # Directories often hold READMEs or indexes; say what was ignored instead of failing.
        examples = ", ".join(str(p) for p in files if p.suffix.lower() not in suffixes)[:300]
        logger.warning(
            "data source %s: ignored %d file(s) of unsupported type: %s", directory, ignored, examples
        )
    return supported


def iter_documents(source: SourceConfig, stats: SourceStats | None = None) -> Iterator[str]:
    """Yield the non-empty documents of a source in file order, at most `source.max_documents`.

    Empty or whitespace-only documents are skipped and counted in `stats`. Kept documents
    are yielded unchanged (no stripping: whitespace matters in code and poetry).
    """
    stats = stats if stats is not None else SourceStats(source.path)
    if is_builtin(source.path):
        stats.files = len(builtin_files(source.path))
        yield from _limit_and_count(iter_builtin_documents(source.path), source, stats)
        return
    files = resolve_files(source)
    stats.files = len(files)
    yield from _limit_and_count(_documents_of_files(files, source), source, stats)


def _limit_and_count(documents: Iterator[str], source: SourceConfig, stats: SourceStats) -> Iterator[str]:
    for text in documents:
        if not text or text.isspace():
            stats.empty_documents_skipped += 1
            continue
        stats.documents += 1
        yield text
        if stats.documents == source.max_documents:
            return  # before reading further: the next document may be a whole file


def _documents_of_files(files: list[Path], source: SourceConfig) -> Iterator[str]:
    for file in files:
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


def _read_parquet(file: Path, field: str) -> Iterator[str]:
    parquet = pq.ParquetFile(file)
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
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[field]):
        column = batch.column(0)
        if column.null_count:
            first_null = row + column.is_null().to_pylist().index(True)
            raise UserInputError(
                f"{file}: row {first_null}: column {field!r} is null. Fix: drop the row or store an empty string."
            )
        yield from column.to_pylist()
        row += len(column)


def _hash_file(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sources_fingerprint(sources: Sequence[SourceConfig]) -> str:
    """sha256 over each source's settings and each of its files' path, size and content hash.

    A built-in corpus contributes its name and Python version instead of its content.
    """
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.model_dump_json().encode())
        if is_builtin(source.path):
            digest.update(builtin_version(source.path).encode())
            continue
        for file in resolve_files(source):
            entry = f"{file.resolve()}|{file.stat().st_size}|{_hash_file(file)}\n"
            digest.update(entry.encode())
    return digest.hexdigest()
