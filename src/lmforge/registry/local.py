"""A registry in a directory: DIR/<name>/<version>/ with the model, README.md and lineage.json.

Versions are 1, 2, 3, ... and never change once written. A version is staged beside its final
place, sealed with the checkpoints' hash manifest and completion marker (`ckpt/atomic.py`) and
renamed into place in one step, under a lock on DIR/<name>/ so two pushes never take one number:
an interrupted push leaves no version at all, and `list` / `show` count sealed versions only.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from lmforge.ckpt.atomic import MARKER_NAME, check_checkpoint, commit_checkpoint, holding_lock, remove_within
from lmforge.errors import UserInputError
from lmforge.export.integrity import added_since_sealing
from lmforge.registry.bundle import finish_bundle, stage_model
from lmforge.registry.lineage import LINEAGE_NAME, LineageFor, ModelFiles, hash_files, read_lineage
from lmforge.registry.records import ModelRow, PushResult, VersionInfo, row_for
from lmforge.registry.targets import LocalTarget

LOCK_NAME = ".lock"
STAGING_PREFIX = ".staging-"


def check_name(name: str, *, given_as: str = "--name") -> str:
    """A registry name is one directory level: no separators, no '..', nothing hidden. `given_as`:
    how the user passed it (`--name` to push, the positional NAME[:VERSION] to show)."""
    if not name or name.startswith(".") or any(sep in name for sep in ("/", "\\", "\0", ":")):
        fix = (
            "for example --name tiny-chat"
            if given_as == "--name"
            else "pass NAME or NAME:VERSION (VERSION a number or 'latest'), for example tiny-chat:2"
        )
        raise UserInputError(
            f"{given_as} {name!r}: a registry name is a plain name (no '/', '\\', ':' or leading '.'); {fix}"
        )
    return name


def push_local(
    model: ModelFiles,
    lineage_for: LineageFor,
    target: LocalTarget,
    name: str,
    *,
    extra_secrets: tuple[str, ...] = (),
) -> PushResult:
    """Push `model` as the next version of `name`; `lineage_for(hashes, push)` builds its lineage."""
    model_dir = target.root / check_name(name)
    try:
        model_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserInputError(
            f"--to {target.root}: cannot create {model_dir}: {err.strerror or err}"
        ) from None
    staging = model_dir / f"{STAGING_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir()
        stage_model(model, staging, link=False)  # the slow part, outside the lock
        hashes = hash_files({n: staging / n for n in model.files})
        with holding_lock(model_dir / LOCK_NAME):  # one version number per push
            version = next_version(model_dir)
            final = model_dir / str(version)
            lineage = lineage_for(hashes, {"registry": "local", "version": str(version)})
            finish_bundle(staging, lineage, load_from=str(final.resolve()), extra_secrets=extra_secrets)
            commit_checkpoint(staging, final, step=version)
    finally:
        if staging.exists():  # an error or Ctrl-C before the rename: no half version is left
            remove_within(staging, model_dir)
    return PushResult(
        registry=target.display,
        name=name,
        version=str(version),
        location=str(final),
        files=len(hashes),
        bytes=sum(int(entry["bytes"]) for entry in hashes.values()),
    )


def next_version(model_dir: Path) -> int:
    return 1 + max((int(p.name) for p in model_dir.iterdir() if p.name.isdigit()), default=0)


def sealed_versions(model_dir: Path) -> list[str]:
    """Versions whose completion marker is there, oldest first."""
    found = [p for p in model_dir.iterdir() if p.name.isdigit() and (p / MARKER_NAME).is_file()]
    return [p.name for p in sorted(found, key=lambda p: int(p.name))]


def list_local(root: Path) -> list[ModelRow]:
    """Every model in the registry directory `root`, by name."""
    _check_registry(root)
    rows = []
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        versions = sealed_versions(model_dir)
        if not versions:
            continue
        latest = model_dir / versions[-1]
        lineage = _lineage_or_none(latest / LINEAGE_NAME)
        created = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(latest.stat().st_mtime))
        rows.append(row_for(model_dir.name, versions, lineage, created))
    return rows


def show_local(root: Path, name: str, version: str | None, *, verify: bool) -> VersionInfo:
    """One version (the latest when `version` is None) with its lineage; `verify` re-hashes every file."""
    _check_registry(root)
    model_dir = root / check_name(name, given_as="NAME[:VERSION]")
    versions = sealed_versions(model_dir) if model_dir.is_dir() else []
    if not versions:
        raise UserInputError(
            f"{root}: no model named {name!r}; `lmforge registry list --registry {root}` lists them"
        )
    chosen = version or versions[-1]
    if chosen not in versions:
        raise UserInputError(f"{name}:{chosen}: no such version in {root}; versions: {', '.join(versions)}")
    directory = model_dir / chosen
    status = check_checkpoint(directory, verify_hashes=verify)
    added = added_since_sealing(directory) if verify else []
    problem = status.problem or (f"{added[0]} was added after the push" if added else "")
    integrity = problem or ("ok (every file re-hashed)" if verify else "sealed")
    lineage = read_lineage(directory / LINEAGE_NAME)
    return VersionInfo(
        str(root), name, chosen, str(directory), lineage.get("created"), integrity, lineage, not problem
    )


def _check_registry(root: Path) -> None:
    if not root.is_dir():
        raise UserInputError(
            f"--registry {root}: no such directory; pass the directory `lmforge push --to` wrote"
        )


def _lineage_or_none(path: Path) -> dict[str, Any] | None:
    try:
        return read_lineage(path)
    except UserInputError:
        return None
