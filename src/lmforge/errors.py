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
