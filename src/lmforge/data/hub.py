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


def iter_hub_rows(path: str) -> Iterator[tuple[Origin, Any]]:
    """(origin, row dict) for each row of the dataset's train split, in order."""
    name = path.removeprefix(HUB_PREFIX)
    try:
        from datasets import load_dataset

        rows = load_dataset(name, split="train", streaming=True)
        for index, row in enumerate(rows, start=1):
            yield Origin(f"{HUB_PREFIX}{name}", index), row
    except (OSError, ValueError, ConnectionError) as err:
        raise UserInputError(
            f"data source {path!r}: could not stream it from the Hugging Face hub ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'no detail'}). lmforge needs no network: download it "
            f"where one exists (`huggingface-cli download {name} --repo-type dataset --local-dir DIR`) and set "
            "the source path to the files in DIR."
        ) from None
