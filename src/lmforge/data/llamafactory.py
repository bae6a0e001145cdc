"""LLaMA-Factory `dataset_info.json` support: a named entry -> a plain lmforge source.

A source `{path: data/dataset_info.json, dataset: my_set}` (or `path: data/` holding a
dataset_info.json) becomes `{path: data/<file_name>, format: ..., columns: ...}`:

- `file_name` is relative to the json's directory (a file or a directory of files);
- `formatting: alpaca | sharegpt` (default alpaca) gives the layout; `ranking: true` makes it
  a preference source, a `columns.kto_tag` a kto source;
- `columns` and, for sharegpt, `tags` (role_tag, content_tag, user_tag, ...) become the
  source's `columns`; the source's own `columns` and a non-auto `format` win over the entry.

Entries with only `hf_hub_url` / `ms_hub_url` / `om_hub_url` / `script_url` need a network
download, which lmforge does not do for dataset_info entries: they are refused with the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmforge.config.schema import SourceConfig
from lmforge.data.conversation_formats import SHAREGPT_TAGS
from lmforge.errors import UserInputError

DATASET_INFO = "dataset_info.json"
_HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url")
_MEDIA_COLUMNS = ("images", "videos", "audios")


def is_dataset_info_source(source: SourceConfig) -> bool:
    """Whether this source names a dataset in a LLaMA-Factory dataset_info.json."""
    return source.dataset is not None


def resolve_dataset_info(source: SourceConfig) -> SourceConfig:
    """The plain source (data file path, format, columns) that `source.dataset` names.

    Raises UserInputError for a missing json, an unknown name (listing the available ones),
    a hub-only entry, an unsupported formatting or media columns.
    """
    assert source.dataset is not None
    info_file = _dataset_info_file(source.path)
    entries = _load_entries(info_file)
    if source.dataset not in entries:
        names = ", ".join(sorted(entries)) or "none"
        raise UserInputError(
            f"{info_file}: no dataset named {source.dataset!r}; available: {names}. "
            "Fix: set `dataset:` on this source to one of those names."
        )
    entry = entries[source.dataset]
    where = f"{info_file}: dataset {source.dataset!r}"
    if not isinstance(entry, dict):
        raise UserInputError(f"{where} is {type(entry).__name__}, expected an object. Fix: repair the entry.")
    data_path = _local_data_path(entry, info_file, where)
    format_name, columns = _format_and_columns(entry, where)
    return source.model_copy(
        update={
            "path": str(data_path),
            "dataset": None,
            "format": source.format if source.format != "auto" else format_name,
            "columns": {**columns, **source.columns},
        }
    )


def _dataset_info_file(path: str) -> Path:
    candidate = Path(path).expanduser()
    if candidate.is_dir():
        candidate = candidate / DATASET_INFO
    if not candidate.is_file():
        raise UserInputError(
            f"data source {path!r}: `dataset:` is set but {candidate} does not exist. Fix: point `path` "
            f"at a LLaMA-Factory {DATASET_INFO} (or its directory), or remove `dataset:`."
        )
    if candidate.suffix.lower() != ".json":
        raise UserInputError(
            f"data source {path!r}: `dataset:` needs `path` to be a {DATASET_INFO}, not {candidate.name}. "
            "Fix: point `path` at the dataset_info.json, or remove `dataset:` to read the file directly."
        )
    return candidate


def _load_entries(info_file: Path) -> dict[str, Any]:
    try:
        entries = json.loads(info_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UserInputError(
            f"{info_file}:{err.lineno}: malformed JSON ({err.msg} at column {err.colno}). Fix: repair the file."
        ) from None
    except UnicodeDecodeError as err:
        raise UserInputError(f"{info_file}: not valid UTF-8 ({err.reason}). Fix: save it as UTF-8.") from None
    if not isinstance(entries, dict):
        raise UserInputError(
            f"{info_file}: expected a JSON object of dataset entries, got {type(entries).__name__}. "
            "Fix: use LLaMA-Factory's layout {name: {file_name: ..., formatting: ...}}."
        )
    return entries


def _local_data_path(entry: dict[str, Any], info_file: Path, where: str) -> Path:
    file_name = entry.get("file_name")
    if not file_name:
        hub = [f"{key}={entry[key]!r}" for key in _HUB_KEYS if entry.get(key)]
        if hub:
            raise UserInputError(
                f"{where} has no local file, only {', '.join(hub)}; reading it would need a network "
                "download, which lmforge does not do for dataset_info entries. Fix: download the data, "
                "add `file_name` to the entry, or use the hub name as the source path when online."
            )
        raise UserInputError(f"{where} has no `file_name`. Fix: add the data file's name to the entry.")
    data_path = info_file.parent / str(file_name)
    if not data_path.exists():
        raise UserInputError(
            f"{where}: file_name {file_name!r} does not exist (resolved to {data_path}). "
            f"Fix: place the file next to {info_file.name} or correct `file_name`."
        )
    return data_path


def _format_and_columns(entry: dict[str, Any], where: str) -> tuple[str, dict[str, str]]:
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise UserInputError(
            f"{where}: formatting {formatting!r} is not supported. Fix: use alpaca or sharegpt, or read "
            "the file directly with a `format:` of text, alpaca, sharegpt, messages, preference, kto."
        )
    columns = _string_map(entry.get("columns"), f"{where}: columns")
    media = [c for c in _MEDIA_COLUMNS if c in columns]
    if media:
        raise UserInputError(
            f"{where}: multimodal columns ({', '.join(media)}) are not supported; lmforge trains on text. "
            "Fix: use a text-only dataset."
        )
    if formatting == "sharegpt":
        # Explicit tags mark the layout as sharegpt even for preference/kto sources.
        columns = {**SHAREGPT_TAGS, **columns, **_string_map(entry.get("tags"), f"{where}: tags")}
    elif entry.get("tags"):
        raise UserInputError(f"{where}: `tags` only apply to formatting sharegpt. Fix: remove them.")
    if entry.get("ranking"):
        return "preference", columns
    if "kto_tag" in columns:
        return "kto", columns
    return formatting, columns


def _string_map(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserInputError(f"{where} is {type(value).__name__}, expected an object. Fix: repair the entry.")
    # LLaMA-Factory entries often carry null columns to mean "not used".
    return {str(key): str(column) for key, column in value.items() if column is not None}
