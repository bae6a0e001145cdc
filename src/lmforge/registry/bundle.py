"""One folder every registry receives: the model files, README.md (the model card), lineage.json.

Staged the same way for every target, then moved (local registry), logged (MLflow) or uploaded
(Hub). Before it leaves, every file is searched for secret values (credential-named environment
variables such as HF_TOKEN, and the secret values of configs loaded in this process): a push that
would carry one stops, naming the file, never the value. Files are searched up to SCAN_BYTES: all of
every text file, and the header of every weight file (safetensors and GGUF keep their metadata
strings first; the tensor data after it holds numbers only).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.config.redact import secret_env_values
from lmforge.errors import WorkFailed
from lmforge.registry.lineage import LINEAGE_NAME, ModelFiles
from lmforge.registry.model_card import render_model_card

CARD_NAME = "README.md"
_CHUNK = 1 << 20
SCAN_BYTES = 64 << 20


@dataclass(frozen=True)
class Bundle:
    folder: Path
    lineage: dict[str, Any]


def stage_model(model: ModelFiles, folder: Path, *, link: bool) -> None:
    """Place the model files in `folder`. `link` hard-links where the filesystem allows (a staging
    folder that is only read, then deleted); a registry version always gets its own copies."""
    for name, source in model.files.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if link:
            try:
                os.link(source, target)
                continue
            except OSError:
                pass  # another filesystem, or links not allowed: copy
        shutil.copyfile(source, target)


def finish_bundle(
    folder: Path, lineage: dict[str, Any], *, load_from: str, extra_secrets: Iterable[str] = ()
) -> Bundle:
    """Write README.md and lineage.json into `folder` (the model is already there), then check that no
    file holds a secret; WorkFailed, with nothing pushed, if one does."""
    (folder / LINEAGE_NAME).write_text(json.dumps(lineage, indent=2, default=str) + "\n", encoding="utf-8")
    (folder / CARD_NAME).write_text(render_model_card(lineage, load_from=load_from), encoding="utf-8")
    refuse_secrets(folder, secret_env_values() | {s for s in extra_secrets if s})
    return Bundle(folder, lineage)


def refuse_secrets(folder: Path, secrets: set[str]) -> None:
    """WorkFailed naming the first file under `folder` that contains one of `secrets`."""
    needles = [s.encode() for s in secrets if len(s) >= 6]
    if not needles:
        return
    longest = max(len(n) for n in needles)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if _contains_any(path, needles, longest):
            raise WorkFailed(
                f"{path.relative_to(folder)} would carry the value of a secret (an environment variable or "
                "config key named like a credential); nothing was pushed. Remove the secret from the run's "
                "files, or unset the variable, and push again"
            )


def _contains_any(path: Path, needles: list[bytes], longest: int) -> bool:
    tail = b""
    with open(path, "rb") as handle:
        while handle.tell() < SCAN_BYTES and (chunk := handle.read(_CHUNK)):
            window = tail + chunk
            if any(n in window for n in needles):
                return True
            tail = window[-(longest - 1) :] if longest > 1 else b""
    return False
