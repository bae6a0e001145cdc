"""What a failed training worker left behind, and how `lmforge launch` reports it.

Workers record their uncaught error through `record_worker_errors` (on `lmforge train`);
when torchrun's agent raises `ChildFailedError`, `failure_lines` names each failed rank with
the last line of its error, root cause first, and `failure_exit_code` picks the exit code.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

# A worker whose collective failed because a peer died says so; it is a consequence, not the cause.
_PEER_LOST = ("closed by peer", "reset by peer", "remote worker")


def _order(err: Any) -> list[tuple[int, Any]]:
    """Failures, root cause first: errors that only report a lost peer go last, the rest by time
    (an error file's mtime is finer than the whole seconds torch records)."""

    def key(item: tuple[int, Any]) -> tuple[bool, float]:
        failure = item[1]
        try:
            when = os.stat(failure.error_file).st_mtime
        except OSError:
            when = float(failure.timestamp)
        return any(marker in _message(failure) for marker in _PEER_LOST), when

    return sorted(err.failures.items(), key=key)


def failure_exit_code(err: Any) -> int:
    """The first failed worker's exit code; 128+N for a worker killed by signal N (as a shell reports it)."""
    exitcode = int(_order(err)[0][1].exitcode)
    if exitcode < 0:
        return 128 - exitcode
    return exitcode or 1


def failure_lines(err: Any) -> list[str]:
    """`rank R (local L) failed with exit code X: <last line of its error>` per failed worker."""
    return [
        f"rank {rank} (local {failure.local_rank}) failed with exit code {_exit_text(failure.exitcode)}: "
        f"{_last_line(failure)}"
        for rank, failure in _order(err)
    ]


def _exit_text(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"{exitcode} (killed by {signal.Signals(-exitcode).name})"
        except ValueError:
            return f"{exitcode} (killed by signal {-exitcode})"
    return str(exitcode)


def _message(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message") or message.get("extraInfo", {}).get("py_callstack", "")
    return str(message)


def _last_line(failure: Any) -> str:
    lines = [line.strip() for line in _message(failure).splitlines() if line.strip()]
    if "At:" in lines[:-1]:
        # torch appends the Python frames of an error raised in a C++ callback after "At:"
        # (a future's callback, as comm timing's): the error itself is the line before them.
        lines = lines[: len(lines) - 1 - lines[::-1].index("At:")]
    if not lines or "elastic/errors.html" in lines[-1]:
        return "no error recorded; see the worker's output above"
    return lines[-1]


def record_worker_errors(fn: Callable[_P, _R]) -> Callable[_P, _R | None]:
    """Under a torchrun agent (`lmforge launch`), write `fn`'s uncaught error to the worker's error file
    (TORCHELASTIC_ERROR_FILE) so the launcher can name it; re-raises. Does nothing elsewhere."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            return fn(*args, **kwargs)
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

        try:
            return record(fn)(*args, **kwargs)
        except (SystemExit, KeyboardInterrupt, GeneratorExit):
            raise
        except Exception:
            raise  # `record` wrote it
        except BaseException as err:
            # `record` writes Exceptions only; torch DCP's CheckpointException (a failed load or save on
            # any rank) derives from BaseException, and the launcher said "no error recorded" for it.
            ErrorHandler().record_exception(err)
            raise

    return wrapper
