"""Errors the CLI turns into exit code 2: the user's input is wrong, nothing ran yet.

Raise `UserInputError` for bad config, bad data or bad usage; its message must say
where (file, line or key), what is wrong and how to fix it.
"""

from __future__ import annotations

from pathlib import Path


class UserInputError(Exception):
    """Bad config, data or usage: reported without a traceback, exit code 2."""


class CheckpointError(Exception):
    """A checkpoint is incomplete, corrupted or unusable."""


class ExportVerificationFailed(Exception):
    """An export ran but does not behave like the trained model (exit code 1, with the numbers)."""


# Exit code of a run its guardrails stopped (repeated bad steps, or monitor.guard ... = stop).
GUARD_STOP_EXIT = 3


class TrainingStopped(Exception):
    """The guardrails stopped the run; a checkpoint of the last good state was saved (exit code 3)."""


class DataSourceLost(Exception):
    """A data file a stream was reading disappeared or became unreadable during the run: the
    trainer stops with a checkpoint, naming the file, instead of a traceback. The message alone
    rebuilds it (a DataLoader worker's exception is re-raised in the main process that way)."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path


class WorkFailed(Exception):
    """A failure during work that lmforge can explain (a full disk, an unwritable file): the message
    says what and where, without a traceback (exit code 1)."""


# How torch's zip writer (torch.save) reports a write the filesystem refused: no errno, no file name.
_DISK_FULL = (
    "No space left on device",
    "Disk quota exceeded",
    "file write failed",
    "unexpected pos",
    "iostream error",
)
_RESUME = (
    "The partial save was removed and the newest complete checkpoint is unchanged; free some space and "
    "run the same command again to resume"
)


def explain_write_failure(err: BaseException, writing: Path | None = None) -> WorkFailed | None:
    """A WorkFailed saying which path could not be written, why, and the free space there, when `err`
    (or an error it was raised from) is a full disk or an unwritable file; None for any other error.
    `writing`: the checkpoint (or other directory) being written, named when the error names no file."""
    import errno

    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            target = seen.filename or writing
            what = "a file size limit was reached" if seen.errno == errno.EFBIG else "the disk is full"
            return WorkFailed(
                f"{what}: could not write {target or 'a file'} ({seen.strerror}; {_free_space(target)}). {_RESUME}"
            )
        if isinstance(seen, OSError) and seen.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return WorkFailed(f"cannot write {seen.filename or writing or 'a file'}: {seen.strerror}")
        if isinstance(seen, RuntimeError) and any(text in str(seen) for text in _DISK_FULL):
            return WorkFailed(
                f"the disk is most likely full: writing {writing or 'a file'} failed "
                f"({str(seen).splitlines()[0]}; {_free_space(writing)}). {_RESUME}"
            )
        seen = seen.__cause__ or seen.__context__
    return None


def _free_space(path: str | Path | None) -> str:
    """'N MiB free on <dir>' for the filesystem that holds `path` (its nearest existing parent)."""
    import shutil

    if path is None:
        return "free space unknown"
    anchor = Path(path)
    while not anchor.exists() and anchor != anchor.parent:
        anchor = anchor.parent
    try:
        free = shutil.disk_usage(anchor).free
    except OSError:
        return "free space unknown"
    return f"{free / 2**20:,.1f} MiB free on {anchor}"
