"""Prepared-data cache directories, written so that a reader never sees a half-built one.

Every data stage (pretraining blocks, SFT samples, preference rows) caches its output in
`<cache_dir>/<name>/` with a `meta.json` holding the fingerprint and the data report. The
directory is built under a temporary name beside it, fsynced, and renamed into place whole;
`meta.json` present means complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

META_NAME = "meta.json"


def is_built(final: Path) -> bool:
    return (final / META_NAME).is_file()


def read_meta(final: Path) -> dict[str, Any]:
    return dict(json.loads((final / META_NAME).read_text()))


def build_atomically(
    final: Path, fingerprint: str, build: Callable[[Path], dict[str, Any]], **meta: Any
) -> None:
    """`build(workdir)` writes the data files and returns the report; meta.json (fingerprint,
    report and `meta`) is written last, then the directory is renamed to `final`. A stale,
    incomplete `final` is replaced; one that another process completed meanwhile is kept."""
    final.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name[:24]}-", dir=final.parent))
    try:
        report = {**build(workdir), "fingerprint": fingerprint}
        (workdir / META_NAME).write_text(
            json.dumps({"fingerprint": fingerprint, **meta, "report": report}, indent=2)
        )
        _publish(workdir, final)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _publish(workdir: Path, final: Path) -> None:
    for file in workdir.rglob("*"):  # the data must be on disk before the rename makes it visible
        if file.is_file():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
    if final.exists() and not is_built(final):
        shutil.rmtree(final)
    try:
        os.rename(workdir, final)
    except OSError:
        if not is_built(final):
            raise
