"""Fault drills (`debug:` in the config), one mechanism for all of them.

Every place a drill can strike asks the one `Drills` object of the run whether a fault of its
kind is due at this step on this rank: the training step (nan, spike, oom, hang, crash,
slow_data), the checkpoint sealer (disk_full) and the kill after a step (`debug.crash_at_step`,
the `kill` kind here).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field

from lmforge.config.schema import DebugConfig, FaultConfig

log = logging.getLogger(__name__)
# Drills that strike once per process: a replay after a rollback does not re-run them.
_ONE_OFF = {"oom", "hang", "slow_data"}


@dataclass
class Drills:
    faults: list[FaultConfig] = field(default_factory=list)
    kill_at_step: int | None = None
    rank: int = 0
    # The run took a rung of the OOM ladder (train/oom_ladder.py): an oom drill models memory that
    # the rung freed, so it no longer fires and the restarted attempt runs through.
    oom_ladder_climbed: bool = False
    _fired: set[tuple[str, int]] = field(default_factory=set)

    @classmethod
    def from_config(cls, debug: DebugConfig, *, oom_ladder_climbed: bool = False) -> Drills:
        return cls(
            faults=list(debug.faults), kill_at_step=debug.crash_at_step, oom_ladder_climbed=oom_ladder_climbed
        )

    def due(self, kind: str, step: int) -> FaultConfig | None:
        """The drill of `kind` due at optimizer step `step` (1-based) on this rank, if any."""
        if kind == "oom" and self.oom_ladder_climbed:
            return None
        for fault in self.faults:
            if fault.kind == kind and fault.step == step and fault.rank in (None, self.rank):
                if kind in _ONE_OFF and (kind, step) in self._fired:
                    return None
                self._fired.add((kind, step))
                return fault
        return None

    def kill_if_due(self, step: int) -> None:
        """`debug.crash_at_step`: SIGKILL this process, as a real crash would (no clean-up runs)."""
        if self.kill_at_step is not None and step == self.kill_at_step:
            log.warning("debug.crash_at_step=%d: killing this process with SIGKILL", step)
            os.kill(os.getpid(), signal.SIGKILL)
