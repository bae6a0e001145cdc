"""Which files a data source names: a file, a glob's matches, or a directory's data files.

Shared by pretraining text sources (`data.sources`) and fine-tuning row sources
(`data.rows`). A directory is searched recursively for data files; its `.md` files and
README/LICENSE files are documentation (name them, or a glob, to train on them). Every
error names the source's config key (data.train.N.path) when known, and always its path.
"""

from __future__ import annotations

import glob
import logging
import re
from pathlib import Path

from lmforge.config.schema import SourceConfig
from lmforge.data.corpus import builtin_files, is_builtin
from lmforge.errors import UserInputError

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = frozenset({".txt", ".md"})
SUPPORTED_SUFFIXES = TEXT_SUFFIXES | {".jsonl", ".json", ".parquet"}
# What sits next to data in a directory without being data: read only when named explicitly.
_DOC_SUFFIXES = frozenset({".md"})
_DOC_STEMS = frozenset({"readme", "license", "licence"})
_GLOB_CHARS = re.compile(r"[*?\[]")


def resolve_files(source: SourceConfig, *, key: str | None = None) -> list[Path]:
    """The files of a pretraining text source, sorted; a built-in corpus gives its own files.

    `key` (like "data.train.0.path") names the source in errors.
    """
    if is_builtin(source.path):
        return builtin_files(source.path)
    return resolve_paths(source.path, SUPPORTED_SUFFIXES, key=key)


def source_label(source_path: str, key: str | None) -> str:
    """How errors name a source: its config key when known, and always its path."""
    return f"{key}: data source {source_path!r}" if key else f"data source {source_path!r}"


def resolve_paths(
    source_path: str,
    suffixes: frozenset[str],
    *,
    skip_names: frozenset[str] = frozenset(),
    key: str | None = None,
) -> list[Path]:
    """The files a source path names, sorted: the file itself, a glob's matches, or a directory's
    data files with one of `suffixes`, found recursively (documentation such as README.md and
    files of other types are skipped with a warning; `skip_names` silently). Shared by text
    sources and fine-tuning row sources; `key` names the source's config key in errors.

    Raises UserInputError when nothing matches, the path is no regular file or directory,
    or a named file has an unsupported type.
    """
    label = source_label(source_path, key)
    path = Path(source_path).expanduser()
    if _GLOB_CHARS.search(source_path):
        matches = [Path(p) for p in glob.glob(str(path), recursive=True)]
        files = sorted(p for p in matches if p.is_file())
        if not files:
            where = "" if path.is_absolute() else f" from {Path.cwd()}"
            raise UserInputError(
                f"{label}: no files found; searched the glob {source_path!r}{where}. "
                "Fix: point the path at existing data files."
            )
    elif path.is_dir():
        files, ignored = _data_files_in(path, suffixes, skip_names)
        if not files:
            raise _empty_directory_error(label, path, suffixes, ignored)
    elif path.is_file():
        files = [path]
    elif path.exists():
        # /dev/null, a FIFO or a socket: reading one would hang or silently give nothing.
        raise UserInputError(
            f"{label}: {path} is not a regular file (it is a device, pipe or socket). "
            "Fix: point the path at a data file, a directory of data files or a glob."
        )
    else:
        raise UserInputError(
            f"{label}: no such file or directory (resolved to {path.resolve()}). "
            "Fix: correct the path, or use a glob like 'data/*.jsonl' or a built-in corpus like "
            "'builtin:python-stdlib'."
        )
    for file in files:
        if file.suffix.lower() not in suffixes:
            raise UserInputError(
                f"{label}: {file} has unsupported type {file.suffix or '(no suffix)'!r}. "
                f"Fix: use one of {', '.join(sorted(suffixes))}, or narrow the glob."
            )
    return files


def _is_data_file(file: Path, suffixes: frozenset[str]) -> bool:
    suffix = file.suffix.lower()
    return suffix in suffixes and suffix not in _DOC_SUFFIXES and file.stem.lower() not in _DOC_STEMS


def _data_files_in(
    directory: Path, suffixes: frozenset[str], skip_names: frozenset[str]
) -> tuple[list[Path], list[Path]]:
    """(data files, ignored files) under `directory`, both sorted."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in skip_names)
    supported = [p for p in files if _is_data_file(p, suffixes)]
    ignored = [p for p in files if not _is_data_file(p, suffixes)]
    if ignored and supported:
        # Directories often hold READMEs or indexes; say what was ignored instead of failing.
        examples = ", ".join(str(p) for p in ignored)[:300]
        logger.warning(
            "data source %s: ignored %d file(s) that are not data: %s", directory, len(ignored), examples
        )
    return supported, ignored


def _empty_directory_error(
    label: str, directory: Path, suffixes: frozenset[str], ignored: list[Path]
) -> UserInputError:
    kinds = ", ".join(sorted(suffixes - _DOC_SUFFIXES))
    skipped = ""
    if ignored:
        names = ", ".join(p.relative_to(directory).as_posix() for p in ignored[:5])
        more = f" and {len(ignored) - 5} more" if len(ignored) > 5 else ""
        skipped = f"; ignored as not data: {names}{more}"
        if any(p.suffix.lower() in _DOC_SUFFIXES for p in ignored):
            skipped += f" (to train on .md files, name them with a glob like '{directory}/**/*.md')"
    return UserInputError(
        f"{label}: directory {directory} holds no rows: no data files ({kinds}) in it or below "
        f"it{skipped}. Fix: put data files there, or point the path at the data."
    )


def files_text(files: list[Path]) -> str:
    """How messages name a source's files: 'file a.jsonl' or '3 files (a.jsonl, b.jsonl, ...)'."""
    if len(files) == 1:
        return f"file {files[0]}"
    shown = ", ".join(str(f) for f in files[:3]) + (", ..." if len(files) > 3 else "")
    return f"{len(files)} files ({shown})"
