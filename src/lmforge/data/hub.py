"""Rows from a Hugging Face hub dataset, when a network exists: `hf://owner/name`, or a bare
`owner/name` that is not a local path; or from remote files named by a URL (`s3://`, `gs://`,
`https://`, `file://`: fsspec's protocols, `.jsonl` / `.json` / `.parquet` / `.txt` / `.csv`).
Streamed with `datasets` (nothing downloaded whole)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmforge.data.examples import Origin
from lmforge.errors import UserInputError

HUB_PREFIX = "hf://"
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://")
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}


def is_remote_source(path: str) -> bool:
    """A hub dataset (`hf://owner/name`, or `owner/name` with no such local file or directory and
    no file suffix) or remote files named by a URL: what `datasets` streams for lmforge."""
    if path.startswith(HUB_PREFIX) or _URL.match(path):
        return True
    return bool(_HUB_NAME.match(path)) and not Path(path).exists() and not Path(path).suffix


def open_remote_dataset(path: str) -> Any:
    """The train split of hub dataset or remote files `path` as a `datasets` streaming
    IterableDataset (nothing downloaded whole); UserInputError saying how to work offline when it
    cannot be reached."""
    try:
        from datasets import load_dataset

        if _URL.match(path) and not path.startswith(HUB_PREFIX):
            return load_dataset(_builder(path), data_files=path, split="train", streaming=True)
        return load_dataset(path.removeprefix(HUB_PREFIX), split="train", streaming=True)
    except (OSError, ValueError, ConnectionError, ImportError) as err:
        raise hub_unreachable(path, err) from None


def _builder(url: str) -> str:
    """The `datasets` builder of remote files, from their suffix (a glob's included)."""
    suffix = Path(url.split("?", 1)[0]).suffix.lower()
    if suffix not in _BUILDERS:
        raise UserInputError(
            f"data source {url!r}: remote files are read by their suffix ({', '.join(sorted(_BUILDERS))}), and "
            f"{suffix or 'no suffix'} is none of them. Fix: name the files with their format's suffix."
        )
    return _BUILDERS[suffix]


def hub_unreachable(path: str, err: Exception) -> UserInputError:
    """The error for a hub dataset or remote files that could not be streamed, with the offline fix."""
    detail = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no detail'}"
    if _URL.match(path) and not path.startswith(HUB_PREFIX):
        return UserInputError(
            f"data source {path!r}: could not stream these remote files ({detail}). Fix: check the URL and "
            "that its filesystem package is installed (s3fs for s3://, gcsfs for gs://), or copy the files "
            "to local or network-mounted storage and set the source path to them."
        )
    name = path.removeprefix(HUB_PREFIX)
    return UserInputError(
        f"data source {path!r}: could not stream it from the Hugging Face hub ({detail}). lmforge needs no "
        f"network: download it where one exists (`hf download {name} --repo-type dataset "
        "--local-dir DIR`) and set the source path to the files in DIR."
    )


def iter_hub_rows(path: str) -> Iterator[tuple[Origin, Any]]:
    """(origin, row dict) for each row of the dataset's train split, in order."""
    rows = open_remote_dataset(path)
    origin = f"{HUB_PREFIX}{path.removeprefix(HUB_PREFIX)}"
    try:
        for index, row in enumerate(rows, start=1):
            yield Origin(origin, index), row
    except (OSError, ValueError, ConnectionError) as err:
        raise hub_unreachable(path, err) from None
