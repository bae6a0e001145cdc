"""Rows from a Hugging Face hub dataset, when a network exists: `hf://owner/name`, or a bare
`owner/name` that is not a local path. Streamed with `datasets` (nothing downloaded whole)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmforge.data.examples import Origin
from lmforge.errors import UserInputError

HUB_PREFIX = "hf://"
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_source(path: str) -> bool:
    """`hf://owner/name`, or `owner/name` with no such local file or directory and no file suffix."""
    if path.startswith(HUB_PREFIX):
        return True
    return bool(_HUB_NAME.match(path)) and not Path(path).exists() and not Path(path).suffix


def open_hub_dataset(path: str) -> Any:
    """The train split of hub dataset `path` as a `datasets` streaming IterableDataset (nothing
    downloaded whole); UserInputError saying how to work offline when it cannot be reached."""
    try:
        from datasets import load_dataset

        return load_dataset(path.removeprefix(HUB_PREFIX), split="train", streaming=True)
    except (OSError, ValueError, ConnectionError) as err:
        raise hub_unreachable(path, err) from None


def hub_unreachable(path: str, err: Exception) -> UserInputError:
    """The error for a hub source that could not be streamed, with the offline fix."""
    name = path.removeprefix(HUB_PREFIX)
    return UserInputError(
        f"data source {path!r}: could not stream it from the Hugging Face hub ({type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else 'no detail'}). lmforge needs no network: download it "
        f"where one exists (`huggingface-cli download {name} --repo-type dataset --local-dir DIR`) and set "
        "the source path to the files in DIR."
    )


def iter_hub_rows(path: str) -> Iterator[tuple[Origin, Any]]:
    """(origin, row dict) for each row of the dataset's train split, in order."""
    rows = open_hub_dataset(path)
    origin = f"{HUB_PREFIX}{path.removeprefix(HUB_PREFIX)}"
    try:
        for index, row in enumerate(rows, start=1):
            yield Origin(origin, index), row
    except (OSError, ValueError, ConnectionError) as err:
        raise hub_unreachable(path, err) from None
