"""One process per run directory: an OS file lock held for the run's whole life.

Two `lmforge train` on one run directory would interleave metrics.jsonl, overwrite each other's
config and delete each other's staging directories. The lock is `fcntl.flock` on
`<run>/.lock`: the kernel releases it when the holder dies, however it dies, so a lock file left
by a crashed run never blocks the next one. The file names its holder (pid, host, start time)
for the message the second process prints; a clean exit empties it, so a non-empty file found
on taking the lock is the record of a holder that died, reported as taken over.

A flock belongs to the open file, which a forked child shares: the DataLoader's workers (and any
other fork of the training process) would keep the run "in use" after a SIGKILL of the run, until
they notice their parent is gone, and a supervisor restarting at once would get exit 2. So every
child forked while a lock is held points its copy of the descriptor at /dev/null at fork time:
only the run's own process holds the run.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

from lmforge.errors import UserInputError

log = logging.getLogger(__name__)
LOCK_NAME = ".lock"
_HELD: set[int] = set()  # descriptors of the run locks this process holds


def _drop_inherited_locks() -> None:
    """In a forked child: let go of the parent's locks without unlocking them (LOCK_UN on a shared
    open file would release the parent's lock too). dup2 over the descriptor closes the child's
    reference and leaves a harmless /dev/null under the same number for the file object."""
    if not _HELD:
        return
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in _HELD:
            os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


class RunLock:
    """Hold `<run_dir>/.lock`; `acquire` raises UserInputError naming the process that holds it."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self._handle: IO[str] | None = None

    def acquire(self) -> None:
        handle = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held until release()
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_holder(handle))
            handle.close()
            raise UserInputError(
                f"run directory {self.path.parent} is in use by {holder}; wait for that run to end, stop it, "
                "or choose another run.name"
            ) from None
        previous = _read_holder(handle)
        if previous and previous.get("pid") != os.getpid():
            log.warning("took over the lock of %s, which is no longer running", _describe(previous))
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_me()))
        handle.flush()
        self._handle = handle
        _HELD.add(handle.fileno())

    def release(self) -> None:
        if self._handle is None:
            return
        if self._handle.fileno() not in _HELD:  # a forked child's copy (now /dev/null): not ours to end
            self._handle.close()
            self._handle = None
            return
        _HELD.discard(self._handle.fileno())
        self._handle.seek(0)
        self._handle.truncate()  # empty: a clean end, nothing to take over
        self._handle.flush()
        fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
        self._handle.close()
        self._handle = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _read_holder(handle: IO[str]) -> dict[str, Any]:
    handle.seek(0)
    try:
        holder = json.loads(handle.read() or "{}")
    except json.JSONDecodeError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process"
    return f"pid {holder.get('pid')} on host {holder.get('host')} (started {holder.get('started')})"
