"""Two things that watch a run from outside its step loop: a stall watchdog and the stop signals.

StallWatchdog: a daemon thread; when no `beat()` came for `stall_seconds`, every thread's
stack goes to <run>/stacks/stall-rank<R>-<time>.txt (faulthandler: works even when the main
thread is stuck in C code) and `on_stall` is called once per stall. It also lets the launcher ask
for the stacks (`REQUEST_SIGNAL`, into `requested_stacks_file`): a rank that cannot notice its own
stall (stopped, or its watchdog thread starved) still gets its stacks saved before the launch ends
it (distributed/stall_watch.py).

StopSignals: the first SIGTERM/SIGINT asks for a checkpoint at the next step boundary and a
clean exit; a second one exits at once.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from lmforge.distributed.stall_watch import REQUEST_SIGNAL, requested_stacks_file

log = logging.getLogger(__name__)


class StallWatchdog:
    def __init__(
        self, stall_seconds: float, stacks_dir: Path, rank: int, on_stall: Callable[[float, Path], None]
    ) -> None:
        self.stall_seconds = stall_seconds
        self.stacks_dir = stacks_dir
        self.rank = rank
        self.on_stall = on_stall
        self._last = time.monotonic()
        self._reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lmforge-stall-watchdog", daemon=True)
        self._requested: Any = None  # the open file faulthandler writes a requested dump to

    def start(self) -> None:
        self._thread.start()
        if threading.current_thread() is threading.main_thread():
            self.stacks_dir.mkdir(parents=True, exist_ok=True)
            self._requested = requested_stacks_file(self.stacks_dir, self.rank).open("w")
            faulthandler.register(REQUEST_SIGNAL, file=self._requested, all_threads=True)

    def beat(self) -> None:
        self._last = time.monotonic()
        self._reported = False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._requested is not None:
            faulthandler.unregister(REQUEST_SIGNAL)
            self._requested.close()
            path = Path(self._requested.name)
            self._requested = None
            if path.stat().st_size == 0:  # nobody asked: leave no file (and no empty stacks/) behind
                path.unlink()
                with contextlib.suppress(OSError):
                    self.stacks_dir.rmdir()

    def _watch(self) -> None:
        poll = min(max(self.stall_seconds / 10, 0.05), 5.0)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if idle >= self.stall_seconds and not self._reported:
                self._reported = True
                self.on_stall(idle, self.dump_stacks())

    def dump_stacks(self) -> Path:
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        path = self.stacks_dir / f"stall-rank{self.rank}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        with path.open("w") as handle:
            handle.write(
                f"# no training progress for {self.stall_seconds:.0f}+ s on rank {self.rank} (pid {os.getpid()})\n"
            )
            handle.flush()
            faulthandler.dump_traceback(file=handle, all_threads=True)
        return path


class StopSignals:
    """SIGTERM / SIGINT handlers for the training process (main thread only)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            log.error("second %s: exiting now, without a checkpoint", signal.Signals(signum).name)
            os._exit(128 + signum)
        self.received = signum
        log.warning(
            "%s received: saving a checkpoint at the end of this step, then exiting (send it again to exit now)",
            signal.Signals(signum).name,
        )
