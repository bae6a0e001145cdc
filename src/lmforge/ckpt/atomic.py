"""Crash-safe checkpoints: a checkpoint exists completely or not at all.

Writing: files go to a staging directory; a sha256 manifest of every file is written,
then the completion marker, everything is fsynced, and one `rename` moves the
directory to `checkpoints/step-N`. Reading: a directory counts only when its marker
and manifest are present and every hash matches; anything else is reported, never used.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.errors import UserInputError

MANIFEST_NAME = "lmforge_manifest.json"
MARKER_NAME = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_hash_manifest(directory: Path, *, step: int) -> dict:
    """Hash every file under `directory` into its manifest (the marker is written separately, last)."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel in (MANIFEST_NAME, MARKER_NAME):
            continue
        files[rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    manifest = {"step": step, "created": time.time(), "files": files}
    _write_synced(directory / MANIFEST_NAME, json.dumps(manifest, indent=1))
    return manifest


def remove_within(path: Path, root: Path) -> None:
    """Delete `path` (a file or a directory tree), only if it lies strictly inside `root`.

    Every delete lmforge does goes through here, so that no name, symlink or `..` can turn a
    clean-up into the loss of a user's files elsewhere. A symlink is removed, never followed."""
    anchor = root.resolve()
    parent = path.parent.resolve()  # the link itself, not what it points to, is the entry deleted
    if parent != anchor and anchor not in parent.parents:
        raise RuntimeError(f"refusing to delete {path}: it is not inside {root}")
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def require_writable(directory: Path, *, what: str, fix: str) -> None:
    """Create `directory` (with its parents) and write a probe file in it, before any work: an
    unwritable output (read-only filesystem, no permission, a file in the way) is bad input
    (exit 2), named as `what` with `fix`, not a traceback once the work is done."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".lmforge-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        reason = (
            "a file, not a directory, is in the way" if isinstance(err, FileExistsError) else err.strerror
        )
        raise UserInputError(f"cannot write {what} {directory}: {reason or err}; {fix}") from None


def check_out_path(out: Path, *inputs: Path) -> None:
    """Refuse an output directory that is, contains or lies inside an input: writing it
    (staging, then replacing `out`) would destroy the input."""
    target = out.resolve()
    for source in inputs:
        origin = source.resolve()
        if target == origin or origin in target.parents or target in origin.parents:
            raise UserInputError(
                f"--out {out}: must not be {source}, inside it or around it (writing it would replace the input); "
                "pick a new directory"
            )


def seal_directory(directory: Path, *, step: int) -> None:
    """Seal `directory` in place: the sha256 manifest of every file, then the completion marker that
    holds the manifest's own hash (`check_checkpoint` checks both). Checkpoints, exports, registry
    versions and a run's final/ are sealed this way."""
    write_hash_manifest(directory, step=step)
    manifest_hash = sha256_file(directory / MANIFEST_NAME)
    _write_synced(directory / MARKER_NAME, json.dumps({"step": step, "manifest_sha256": manifest_hash}))


def commit_checkpoint(staging: Path, final: Path, *, step: int, durable: bool = True) -> Path:
    """Seal `staging` (manifest, then marker) and rename it to `final` in one atomic step.

    `durable` fsyncs every file before the rename, so a power cut cannot leave a renamed
    directory with unwritten data: what a resume needs. Exports skip it (they are rebuilt from
    final/ in seconds, and their hash manifest still exposes any damage to `ckpt verify`)."""
    seal_directory(staging, step=step)
    for path in staging.rglob("*") if durable else ():
        if path.is_file():
            _fsync_path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        # Re-saving a step (after a resume) replaces the old copy; move it aside first so
        # the new one still appears with a single rename.
        trash = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, trash)
        remove_within(trash, final.parent)
    os.rename(staging, final)
    _fsync_path(final.parent)
    return final


@dataclass(frozen=True)
class CheckpointStatus:
    path: Path
    step: int
    complete: bool
    problem: str = ""


def check_checkpoint(directory: Path, *, verify_hashes: bool = True) -> CheckpointStatus:
    """Whether `directory` is a complete checkpoint, and if not, why."""
    match = STEP_DIR.match(directory.name)
    step = int(match.group(1)) if match else -1
    marker, manifest_path = directory / MARKER_NAME, directory / MANIFEST_NAME
    if not marker.is_file():
        return CheckpointStatus(directory, step, False, "no completion marker (the save was interrupted)")
    if not manifest_path.is_file():
        return CheckpointStatus(directory, step, False, "no hash manifest")
    try:
        manifest = json.loads(manifest_path.read_text())
        sealed = json.loads(marker.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return CheckpointStatus(directory, step, False, "unreadable manifest or marker")
    if sealed.get("manifest_sha256") != sha256_file(manifest_path):
        return CheckpointStatus(directory, step, False, "hash manifest was modified after sealing")
    if verify_hashes:
        for rel, entry in manifest["files"].items():
            path = directory / rel
            if not path.is_file():
                return CheckpointStatus(directory, step, False, f"missing file {rel}")
            if path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
                return CheckpointStatus(directory, step, False, f"hash mismatch in {rel}")
    return CheckpointStatus(directory, step, True)


def list_step_dirs(checkpoints_dir: Path) -> list[Path]:
    """`step-N` directories, newest first (other names are never checkpoints)."""
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)), reverse=True)  # type: ignore[union-attr]


def find_latest_complete(checkpoints_dir: Path) -> tuple[CheckpointStatus | None, list[CheckpointStatus]]:
    """The newest complete checkpoint, and every newer one that was rejected (with its reason)."""
    rejected: list[CheckpointStatus] = []
    for directory in list_step_dirs(checkpoints_dir):
        status = check_checkpoint(directory)
        if status.complete:
            return status, rejected
        rejected.append(status)
    return None, rejected


def rotate_checkpoints(checkpoints_dir: Path, keep_last: int, keep: set[str] | None = None) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last`, sparing the names in `keep`
    (the best one); returns what was deleted."""
    complete = [d for d in list_step_dirs(checkpoints_dir) if (d / MARKER_NAME).is_file()]
    doomed = [d for d in complete[keep_last:] if d.name not in (keep or set())]
    for directory in doomed:
        remove_within(directory, checkpoints_dir)
    return doomed


BEST_NAME = "best.json"


def read_best(checkpoints_dir: Path) -> dict[str, Any] | None:
    """checkpoints/best.json: {step, metric, value, path} of the best checkpoint, if recorded."""
    path = checkpoints_dir / BEST_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def write_best(checkpoints_dir: Path, best: dict[str, Any]) -> None:
    """Replace best.json atomically (written aside, fsynced, renamed)."""
    partial = checkpoints_dir / (BEST_NAME + ".partial")
    _write_synced(partial, json.dumps(best, indent=2))
    os.replace(partial, checkpoints_dir / BEST_NAME)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """A directory written aside (`<out>.partial`, yielded) and moved to `out` only when the block
    ends without an error: `out` is the old directory or the complete new one, never half written,
    and a failed or interrupted write leaves no partial directory behind."""
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


@contextmanager
def holding_lock(path: Path) -> Iterator[None]:
    """An exclusive OS lock on the file `path` (created if missing) for the block: processes on this
    machine that take it run the block one at a time; a process that dies releases it."""
    with open(path, "a+", encoding="utf-8") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
