"""The launcher's side of a stall: ending a launch whose workers stopped making progress.

Each worker's stall watchdog (monitor/watchdog.py) dumps its own stacks after `stall_seconds`
without a step. That alone never ended a launch: the ranks that noticed wait in a collective for
the one that stalled (up to the process group's timeout, HF's `ddp_timeout`, 30 minutes), and a
stopped rank (SIGSTOP, a frozen node) notices nothing. `StallWatch` runs in the launcher next to
torchrun's agent. When a worker reported a stall, or a worker has been stopped for `stall_seconds`,
it asks every rank that saved no stacks yet for them (the watchdog's `REQUEST_SIGNAL`, then SIGCONT
to a stopped one), waits up to `DUMP_WAIT_S` for them, and kills the workers: the agent sees them
end, and the launch exits 1 naming the stalled rank(s) and the stacks. Bound: `stall_seconds` +
the watchdog's poll (at most 5 s) + `POLL_S` + `DUMP_WAIT_S`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

POLL_S = 1.0
DUMP_WAIT_S = 10.0
_STALL_FILE = re.compile(r"^stall-rank(\d+)-")
# The launcher's request for a rank's stacks, which each rank's StallWatchdog registers with
# faulthandler: its C handler writes them when the signal arrives, whatever the main thread is doing
# (delivered on SIGCONT to a stopped process).
REQUEST_SIGNAL = signal.SIGUSR1


def requested_stacks_file(stacks_dir: Path, rank: int) -> Path:
    """Where a rank's stacks go when the launcher asks for them (the watchdog keeps it open for that)."""
    return stacks_dir / f"requested-rank{rank}.txt"


@dataclass
class StallVerdict:
    """Which ranks stalled, and how: the lines the launch ends with."""

    stalled: list[int]
    stopped: list[int]
    stacks_dir: Path
    idle_s: float

    def lines(self) -> list[str]:
        ranks = ", ".join(str(r) for r in self.stalled)
        how = " (stopped: SIGSTOP or a frozen process)" if self.stopped else ""
        return [
            f"error: rank {ranks} stalled{how}: no training progress for {self.idle_s:.0f} s "
            "(monitor.guard.stall_seconds); the launch stopped every worker",
            f"  every rank's stacks are in {self.stacks_dir}",
        ]


@dataclass
class StallWatch:
    """A daemon thread in the launcher; `verdict` is set when it ended the launch for a stall."""

    stall_seconds: float
    stacks_dir: Path
    verdict: StallVerdict | None = None
    _started: float = field(default_factory=time.time)
    _stop: threading.Event = field(default_factory=threading.Event)
    _stopped_since: dict[int, float] = field(default_factory=dict)

    def start(self) -> None:
        self._started = time.time()
        threading.Thread(target=self._watch, name="lmforge-stall-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            workers = worker_processes()
            reported = self._reported()
            stopped = self._stopped_long(workers)
            if workers and (reported or stopped):
                self._end(workers, reported, stopped)
                return

    def _reported(self) -> set[int]:
        """Ranks whose watchdog dumped its stacks for a stall during this launch."""
        if not self.stacks_dir.is_dir():
            return set()
        ranks = set()
        for path in self.stacks_dir.iterdir():
            match = _STALL_FILE.match(path.name)
            if match and path.stat().st_mtime >= self._started:
                ranks.add(int(match.group(1)))
        return ranks

    def _stopped_long(self, workers: dict[int, psutil.Process]) -> set[int]:
        now = time.monotonic()
        for rank, process in workers.items():
            if _is_stopped(process):
                self._stopped_since.setdefault(rank, now)
            else:
                self._stopped_since.pop(rank, None)
        return {r for r, since in self._stopped_since.items() if now - since >= self.stall_seconds}

    def _end(self, workers: dict[int, psutil.Process], reported: set[int], stopped: set[int]) -> None:
        stopped |= {rank for rank, process in workers.items() if _is_stopped(process)}
        asked = {rank: process for rank, process in workers.items() if rank not in reported}
        for rank, process in asked.items():
            _request_stacks(process, self.stacks_dir, rank)
        deadline = time.monotonic() + DUMP_WAIT_S
        while asked and time.monotonic() < deadline:
            asked = {r: p for r, p in asked.items() if not _dumped(self.stacks_dir, r)}
            time.sleep(0.2)
        saved = [_seal_requested(self.stacks_dir, rank) for rank in workers if rank not in reported]
        log.debug("stacks saved on request: %s", saved)
        # The stalled ranks: the stopped ones; else those that noticed nothing themselves (the others
        # wait for them in a collective); else every rank that reported.
        silent = sorted(set(workers) - reported)
        stalled = sorted(stopped) or (silent if reported and silent else sorted(reported))
        self.verdict = StallVerdict(stalled, sorted(stopped), self.stacks_dir, self.stall_seconds)
        for process in workers.values():  # stuck in a collective: a SIGTERM would wait for a step
            with contextlib.suppress(psutil.Error):
                process.kill()
        for rank in workers:  # the files the killed watchdogs kept open for a request that never came
            with contextlib.suppress(OSError):
                if requested_stacks_file(self.stacks_dir, rank).stat().st_size == 0:
                    requested_stacks_file(self.stacks_dir, rank).unlink()


def worker_processes() -> dict[int, psutil.Process]:
    """This launcher's torchrun workers by global rank (their RANK variable)."""
    workers: dict[int, psutil.Process] = {}
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            rank = child.environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None and rank.isdigit():
            workers.setdefault(int(rank), child)
    return workers


def _is_stopped(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _request_stacks(process: psutil.Process, stacks_dir: Path, rank: int) -> None:
    """The watchdog's dump signal (only to a rank whose watchdog registered it: the signal's default
    action would end the process), then SIGCONT, which delivers it to a stopped process."""
    if not requested_stacks_file(stacks_dir, rank).is_file():
        return
    with contextlib.suppress(psutil.Error):
        process.send_signal(REQUEST_SIGNAL)
        process.send_signal(signal.SIGCONT)


def _dumped(stacks_dir: Path, rank: int) -> bool:
    path = requested_stacks_file(stacks_dir, rank)
    return path.is_file() and path.stat().st_size > 0


def _seal_requested(stacks_dir: Path, rank: int) -> Path | None:
    """The requested dump under a stall file's name, with a header saying why it was taken."""
    path = requested_stacks_file(stacks_dir, rank)
    if not _dumped(stacks_dir, rank):
        return None
    target = stacks_dir / f"stall-rank{rank}-{time.strftime('%Y%m%d-%H%M%S')}-requested.txt"
    header = f"# rank {rank}: stacks dumped at the launcher's request, after a stall\n"
    target.write_text(header + path.read_text(encoding="utf-8", errors="replace"), encoding="utf-8")
    path.unlink()
    return target
