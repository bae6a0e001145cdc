"""The gate in front of every push: final/ must be exactly what training sealed.

Training seals final/ like a checkpoint (`train/final.py`, `ckpt/atomic.py`): a sha256 manifest of
every file and a completion marker holding the manifest's hash. A push checks the seal before it
touches the registry (no file added, missing, resized or changed outside the model files), then
checks that the staged copies of the model files have the sealed hashes, so the hashes lineage.json
records are the ones training wrote. Any difference stops the push (WorkFailed, exit 1), naming the
file.

A final/ without any seal was written by an lmforge that did not seal it yet (or lost its seal):
its files cannot be checked, so it is refused unless the push says `allow_unsealed`
(--allow-unsealed), and then its lineage records `model.sealed: false`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.ckpt.atomic import MANIFEST_NAME, MARKER_NAME, check_checkpoint, sha256_file
from lmforge.errors import UserInputError, WorkFailed
from lmforge.export.integrity import added_since_sealing
from lmforge.registry.lineage import ModelFiles

log = logging.getLogger(__name__)

_RESTORE = (
    "nothing was pushed. The registry records only the model training produced: restore final/ "
    "(from a copy, or by training again: `lmforge train CONFIG run.overwrite=true`), then push again"
)


@dataclass(frozen=True)
class FinalSeal:
    """final/'s hash manifest entries ({path in final/: {sha256, bytes}}), or None when unsealed."""

    final: Path
    files: dict[str, dict[str, Any]] | None

    @property
    def sealed(self) -> bool:
        return self.files is not None


def check_final_seal(final: Path, model: ModelFiles, *, allow_unsealed: bool = False) -> FinalSeal:
    """The seal of `final`, checked everywhere but in the model files (hashed once, as staged, by
    `check_staged`). WorkFailed naming the file when final/ changed after sealing; UserInputError for
    a final/ with no seal at all unless `allow_unsealed`."""
    if not (final / MANIFEST_NAME).exists() and not (final / MARKER_NAME).exists():
        if not allow_unsealed:
            raise UserInputError(
                f"{final}: no hash manifest ({MANIFEST_NAME}): final/ was written by an older lmforge "
                "that did not seal it, or its seal was removed, so its files cannot be checked against "
                "what training wrote. Check them yourself (`lmforge ckpt verify` checks their structure), "
                "then push with --allow-unsealed (lineage.json records model.sealed: false), or re-train "
                "for a sealed final/"
            )
        log.warning("%s has no hash manifest: pushed unchecked (lineage records model.sealed: false)", final)
        return FinalSeal(final, None)
    status = check_checkpoint(final, verify_hashes=False)
    if not status.complete:
        raise WorkFailed(
            f"{final}: {status.problem}: final/ was changed after training sealed it; {_RESTORE}"
        )
    added = added_since_sealing(final)
    if added:
        raise WorkFailed(f"{final / added[0]}: added to final/ after training sealed it; {_RESTORE}")
    sealed: dict[str, dict[str, Any]] = json.loads((final / MANIFEST_NAME).read_text()).get("files") or {}
    pushed = {_in_final(final, source) for source in model.files.values()}
    for rel, entry in sealed.items():
        path = final / rel
        if not path.is_file():
            raise WorkFailed(f"{path}: missing (final/ was sealed with it); {_RESTORE}")
        changed = path.stat().st_size != entry["bytes"]
        if changed or (rel not in pushed and sha256_file(path) != entry["sha256"]):
            raise WorkFailed(f"{path}: hash mismatch: changed after training sealed final/; {_RESTORE}")
    return FinalSeal(final, sealed)


def check_staged(seal: FinalSeal, model: ModelFiles, hashes: dict[str, dict[str, Any]]) -> None:
    """WorkFailed naming the first staged model file whose sha256 is not the sealed one."""
    if seal.files is None:
        return
    for name, source in model.files.items():
        rel = _in_final(seal.final, source)
        if hashes[name]["sha256"] != seal.files[rel]["sha256"]:
            raise WorkFailed(
                f"{seal.final / rel}: hash mismatch: changed after training sealed final/; {_RESTORE}"
            )


def _in_final(final: Path, source: Path) -> str:
    return source.relative_to(final).as_posix()
