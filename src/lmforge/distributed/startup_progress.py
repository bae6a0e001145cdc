"""Progress while an engine starts: DeepSpeed JIT-compiles its C++ ops (shared-memory all-reduce on
CPU, CPU Adam for offload) the first time a machine uses them, which took 0.5-4.5 minutes here
with nothing on the console. A heartbeat says what is being built and for how long, until the
first step begins.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

# First word after this many seconds (a warm start says nothing), then one line per interval.
FIRST_NOTICE_S = 10.0
INTERVAL_S = 20.0


def torch_extensions_root() -> Path:
    """Where torch's JIT builds extensions (TORCH_EXTENSIONS_DIR, else its default root)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def ops_being_built(root: Path) -> list[str]:
    """Extensions under `root` whose build holds torch's lock file (`<root>/<py-tag>/<name>/lock`)."""
    if not root.is_dir():
        return []
    locks = [*root.glob("*/lock"), *root.glob("*/*/lock")]
    return sorted({lock.parent.name for lock in locks})


class StartupHeartbeat:
    """A daemon thread that logs, from FIRST_NOTICE_S on, what the engine is doing until `stop()`."""

    def __init__(
        self, engine: str, *, first_notice_s: float = FIRST_NOTICE_S, interval_s: float = INTERVAL_S
    ) -> None:
        self.engine = engine
        self.first_notice_s = first_notice_s
        self.interval_s = interval_s
        self.root = torch_extensions_root()
        self._stopped = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="lmforge-startup", daemon=True)
        self.notices = 0

    def start(self) -> StartupHeartbeat:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.notices:
            log.info("%s started in %.0f s", self.engine, time.monotonic() - self._started)

    def _run(self) -> None:
        wait = self.first_notice_s
        while not self._stopped.wait(wait):
            log.info("%s", self.describe())
            self.notices += 1
            wait = self.interval_s

    def describe(self) -> str:
        elapsed = time.monotonic() - self._started
        building = ops_being_built(self.root)
        if building:
            doing = f"compiling its op(s) {', '.join(building)} (once per machine; cached in {self.root})"
        else:
            doing = "setting up the engine and its process group"
        return f"{self.engine} is starting: {doing}, {elapsed:.0f} s so far"
