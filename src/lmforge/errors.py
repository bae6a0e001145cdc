"""Errors the CLI turns into exit code 2: the user's input is wrong, nothing ran yet.

Raise `UserInputError` for bad config, bad data or bad usage; its message must say
where (file, line or key), what is wrong and how to fix it.
"""

from __future__ import annotations


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


class WorkFailed(Exception):
    """A failure during work that lmforge can explain (a full disk, an unwritable file): the message
    says what and where, without a traceback (exit code 1)."""


_DISK_FULL = ("No space left on device", "Disk quota exceeded", "file write failed")


def explain_write_failure(err: BaseException) -> WorkFailed | None:
    """A WorkFailed saying which path could not be written and why, when `err` (or an error it
    was raised from) is a full disk or an unwritable file; None for any other error."""
    import errno

    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return WorkFailed(
                f"the disk is full: could not write {seen.filename or 'a file'} ({seen.strerror}). The partial "
                "save was removed and the newest complete checkpoint is unchanged; free some space and run "
                "the same command again to resume"
            )
        if isinstance(seen, OSError) and seen.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return WorkFailed(f"cannot write {seen.filename or 'a file'}: {seen.strerror}")
        if isinstance(seen, RuntimeError) and any(text in str(seen) for text in _DISK_FULL):
            return WorkFailed(
                f"writing a file failed ({str(seen).splitlines()[0]}), most likely a full disk. The partial "
                "save was removed; free some space and run the same command again to resume"
            )
        seen = seen.__cause__ or seen.__context__
    return None
