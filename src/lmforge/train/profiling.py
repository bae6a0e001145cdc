"""ProfileCallback: torch.profiler over a window of optimizer steps (`monitor.profile`).

The window runs from the first micro-batch of step `start_step` to the end of step
`start_step + steps - 1`, so it includes the data loading and logging between its steps; each
step is a `ProfilerStep#<step>` range in the trace (the name the TensorBoard plugin reads steps
from). CPU activity always, CUDA kernels and copies when a GPU is used; tensor allocations,
shapes and Python stacks as configured. Communication shows as c10d / NCCL / Gloo ops.

When the window closes it writes, under the run directory:
    profile/trace-rank<r>.json                 Chrome trace: https://ui.perfetto.dev or chrome://tracing
    tb/profile/rank<r>.<start>.pt.trace.json   the same file where the torch-tb-profiler plugin finds it
                                               (`tensorboard --logdir <run>/tb`, run "profile")
    profile/top_ops.json                       rank 0: the ops that took the most time (the report's table)
and a `profile` event saying where. Rank 0 only unless `all_ranks`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lmforge.config.schema import ProfileConfig
from lmforge.monitor.events import EventLog
from lmforge.run_layout import RunPaths

log = logging.getLogger(__name__)
TOP_OPS_FILE = "top_ops.json"
TENSORBOARD_PROFILE_DIR = "profile"  # under tb/: the torch-tb-profiler plugin names the run after it
TOP_OPS = 20
# Substrings of the op names of collectives (c10d's record_param_comms, NCCL kernels, Gloo).
COMM_MARKERS = (
    "all_reduce",
    "allreduce",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "c10d",
    "nccl",
    "gloo",
    "record_param_comms",
)
_STEP_RANGE = "ProfilerStep#"


class ProfileCallback(TrainerCallback):
    def __init__(self, cfg: ProfileConfig, paths: RunPaths, events: EventLog) -> None:
        self.cfg = cfg
        self.paths = paths
        self.events = events
        self._profiler: profile | None = None
        self._step_range: record_function | None = None
        self._first = 0  # the first step recorded
        self._started = 0.0  # when the current step began
        self._step_ms: dict[int, float] = {}  # each recorded step's wall time (CPU side)

    @property
    def last_step(self) -> int:
        return self.cfg.start_step + self.cfg.steps - 1

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step >= self.cfg.start_step and state.is_world_process_zero:
            log.warning(
                "monitor.profile: this run resumes at step %d, past monitor.profile.start_step %d; "
                "nothing is profiled (set a later start_step to profile the rest of the run)",
                state.global_step,
                self.cfg.start_step,
            )

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        step = state.global_step + 1
        mine = self.cfg.all_ranks or state.is_world_process_zero
        if self._profiler is None and step == self.cfg.start_step and mine:
            self._start(step)
        if self._profiler is not None:
            self._step_range = record_function(f"{_STEP_RANGE}{step}")
            self._step_range.__enter__()
            self._started = time.perf_counter()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._profiler is None:
            return
        if torch.cuda.is_available():  # the step's kernels finished: its wall time is the device's too
            torch.cuda.synchronize()
        self._step_ms[state.global_step] = (time.perf_counter() - self._started) * 1000
        self._close_step_range()
        if state.global_step >= self.last_step:
            self._stop(state.global_step, args.process_index)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._profiler is not None:  # training stopped inside the window: keep what was recorded
            self._close_step_range()
            self._stop(state.global_step, args.process_index)

    def _start(self, step: int) -> None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(
            activities=activities,
            profile_memory=self.cfg.memory,
            record_shapes=self.cfg.record_shapes,
            with_stack=self.cfg.with_stack,
        )
        self._first, self._step_ms = step, {}
        log.info("torch.profiler: recording steps %d-%d", step, self.last_step)
        self._profiler.start()

    def _close_step_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _stop(self, last: int, rank: int) -> None:
        profiler, self._profiler = self._profiler, None
        assert profiler is not None
        profiler.stop()
        trace = self.paths.profile / f"trace-rank{rank}.json"
        try:
            self._write(profiler, trace, last, rank)
        except OSError as err:  # a full disk loses the trace, never the run
            log.warning(
                "torch.profiler: could not write the trace of steps %d-%d: %s", self._first, last, err
            )
            return
        self.events.emit(
            "profile",
            last,
            f"torch.profiler trace of steps {self._first}-{last} on rank {rank} in {trace} (open it in "
            f"https://ui.perfetto.dev or chrome://tracing; `tensorboard --logdir {self.paths.tensorboard}` "
            "with torch-tb-profiler installed shows it too)",
            rank=rank,
            trace=str(trace),
        )

    def _write(self, profiler: profile, trace: Path, last: int, rank: int) -> None:
        self.paths.profile.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace))
        board = self.paths.tensorboard / TENSORBOARD_PROFILE_DIR / f"rank{rank}.{self._first}.pt.trace.json"
        _link_or_copy(trace, board)
        if rank != 0:
            return
        summary = top_ops(profiler, list(range(self._first, last + 1)), self._step_ms)
        summary.update(
            rank=rank,
            trace=str(trace.relative_to(self.paths.root)),
            tensorboard_trace=str(board.relative_to(self.paths.root)),
        )
        (self.paths.profile / TOP_OPS_FILE).write_text(json.dumps(summary, indent=1), encoding="utf-8")


def top_ops(profiler: profile, steps: list[int], step_ms: dict[int, float]) -> dict[str, Any]:
    """The top ops of a finished profile by self CPU time (and by self device time when kernels
    ran), the communication ops apart, and each step's wall time; times in milliseconds."""
    # The step ranges (merged into one "ProfilerStep*" entry by torch) are no op.
    ops = [e for e in profiler.key_averages() if not e.key.startswith("ProfilerStep")]
    on_device = any(e.self_device_time_total > 0 for e in ops)
    by_cpu = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPS]
    comm = [e for e in ops if _is_communication(e.key)]
    summary: dict[str, Any] = {
        "steps": steps,
        "step_ms": {str(step): round(ms, 3) for step, ms in sorted(step_ms.items())},
        "device": "cuda" if on_device else "cpu",
        "top_cpu": [_op_row(e) for e in by_cpu],
        "communication": [_op_row(e) for e in sorted(comm, key=_total_time, reverse=True)[:TOP_OPS]],
    }
    if on_device:
        by_device = sorted(ops, key=lambda e: e.self_device_time_total, reverse=True)[:TOP_OPS]
        summary["top_device"] = [_op_row(e) for e in by_device if e.self_device_time_total > 0]
    return summary


def _op_row(event: Any) -> dict[str, Any]:
    return {
        "name": event.key,
        "count": event.count,
        "self_cpu_ms": round(event.self_cpu_time_total / 1000, 4),
        "cpu_total_ms": round(event.cpu_time_total / 1000, 4),
        "self_device_ms": round(event.self_device_time_total / 1000, 4),
        "device_total_ms": round(event.device_time_total / 1000, 4),
        "self_cpu_memory_mb": round(event.self_cpu_memory_usage / 2**20, 4),
        "self_device_memory_mb": round(event.self_device_memory_usage / 2**20, 4),
    }


def _total_time(event: Any) -> float:
    return float(event.cpu_time_total + event.device_time_total)


def _is_communication(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in COMM_MARKERS)


def _link_or_copy(source: Path, target: Path) -> None:
    """`target` holds `source`'s content: a hard link (no second copy on disk) where possible."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
