"""Time in collective communication per optimizer step (monitor.comm_metrics): all-reduce,
reduce-scatter and all-gather, and the share of the step they take.

Each engine is timed through its own extension point, nothing patched:
- DDP: a communication hook (`register_comm_hook`) that averages each gradient bucket as torch's
  default all-reduce hook does and notes when the all-reduce was launched and when it completed.
- FSDP2: `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter` with FSDP2's default
  collectives wrapped, so every all-gather and reduce-scatter is timed from launch to completion.
- DeepSpeed: its comms logger (the `comms_logger` block of the DeepSpeed config, see
  deepspeed_config.add_comms_logger), read and reset at every step boundary.

What a value means: a collective counts from its launch to its completion, queueing behind an
earlier collective included. `comm_<kind>_s` is the wall time within the step during which at
least one collective of that kind was in flight, `comm_s` the same for any collective, and
`comm_share` = comm_s / step time: overlapping (async, bucketed) collectives are counted once,
so the share is at most 1. Values are means over the log window, like step_time_s, and are rank
0's view (every rank registers the same hooks, so all ranks run the same collectives, but only
rank 0 writes records). Collectives outside a step (evaluation, checkpoint gathers) and
lmforge's own small ones (the loss / token gather) are not counted.

Cost: no synchronisation is added. Each collective costs two clock reads (CPU) or two timing
events recorded on its streams (CUDA; read once they have completed, `Event.query`, never waited
for). Under DDP a Python hook replaces DDP's built-in C++ all-reduce: a Python call and a future
callback per gradient bucket (25 MB by default), and on gloo the division is a pass of its own
(DDP fuses it into the copy into the bucket; NCCL averages inside the all-reduce instead).
DeepSpeed's comms logger synchronises the device after every collective: deepspeed_config.py
turns it on by itself on CPU only. On CPU it times an async DeepSpeed collective (ZeRO-3's
prefetching all-gathers) up to its launch only.

The callback that installs these and marks the steps is train/comm_callback.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

KINDS = ("all_reduce", "reduce_scatter", "all_gather")
# The kinds each engine runs (its records always carry these, 0 in a step without one).
ENGINE_KINDS = {"ddp": ("all_reduce",), "fsdp": ("all_gather", "reduce_scatter"), "deepspeed": KINDS}
_PENDING_STEPS = 64  # CUDA: steps whose events have not all completed yet, kept at most


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: time covered by at least one of them."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


@dataclass
class _Op:
    kind: str
    start: Any  # perf_counter seconds, or a torch.cuda.Event
    end: Any = None


@dataclass
class _Step:
    start: Any  # as _Op.start: the step's start on the same clock
    began: float  # host clock
    seconds: float = 0.0  # host wall time of the step
    ops: list[_Op] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)  # measured elsewhere (DeepSpeed)


class CommTimer:
    """Collectives of the running step -> per-kind seconds, summed over a window of steps."""

    def __init__(self, kinds: tuple[str, ...], clock: Callable[[], float] = time.perf_counter) -> None:
        self.kinds = kinds
        self.clock = clock
        self.cuda = False  # set before the first step when the engine's collectives run on CUDA
        self._lock = threading.Lock()  # completions arrive on the backend's threads
        self._step: _Step | None = None
        self._pending: list[_Step] = []
        self._kind_s = dict.fromkeys(kinds, 0.0)
        self._comm_s = self._step_s = 0.0
        self._steps = 0

    # -- the hot path: every collective of a step --------------------------------------
    def _now(self) -> Any:
        if not self.cuda:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: where the collective is enqueued / completes
        return event

    def launched(self, kind: str) -> _Op | None:
        """A collective of `kind` starts now; None outside a step or on a rank that records nothing."""
        step = self._step
        if step is None:
            return None
        op = _Op(kind, self._now())
        with self._lock:
            step.ops.append(op)
        return op

    def completed(self, op: _Op | None) -> None:
        if op is not None:
            op.end = self._now()

    def completed_with(self, op: _Op | None, work: Any) -> None:
        """`work` None: the call was synchronous and has completed; else when its future does."""
        if op is None:
            return
        if work is None:
            self.completed(op)
        else:
            work.get_future().then(lambda _: self.completed(op))

    def add_seconds(self, kind: str, seconds: float) -> None:
        """Time in `kind` this step measured by the engine itself (no intervals: summed)."""
        if self._step is not None:
            self._step.durations[kind] = self._step.durations.get(kind, 0.0) + seconds

    # -- step boundaries ---------------------------------------------------------------------
    def step_started(self) -> None:
        self._step = _Step(self._now(), self.clock())

    def step_ended(self) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        step.seconds = self.clock() - step.began
        self._pending.append(step)
        while self._pending and self._resolve(self._pending[0]):
            self._pending.pop(0)
        if len(self._pending) > _PENDING_STEPS:  # events that never complete: give up on the oldest
            self._pending.pop(0)

    def _resolve(self, step: _Step) -> bool:
        """Fold a finished step into the window; False while a CUDA event has not completed."""
        with self._lock:
            ops = list(step.ops)
        if self.cuda and not (
            step.start.query() and all(op.end is not None and op.end.query() for op in ops)
        ):
            return False
        spans: dict[str, list[tuple[float, float]]] = {}
        for op in ops:
            if self.cuda:
                start, end = step.start.elapsed_time(op.start) / 1e3, step.start.elapsed_time(op.end) / 1e3
            else:  # still in flight at the step's end (none should be): counted up to the end
                start = op.start - step.start
                end = op.end - step.start if op.end is not None else step.seconds
            spans.setdefault(op.kind, []).append((start, end))
        for kind, seconds in [(k, union_seconds(s)) for k, s in spans.items()] + list(step.durations.items()):
            if kind in self._kind_s:
                self._kind_s[kind] += seconds
        in_flight = union_seconds([span for kind_spans in spans.values() for span in kind_spans])
        self._comm_s += in_flight + sum(step.durations.values())
        self._step_s += step.seconds
        self._steps += 1
        return True

    def take_window(self) -> dict[str, float]:
        """comm_<kind>_s, comm_s (per step, means over the steps since the last call) and comm_share."""
        while self._pending and self._resolve(self._pending[0]):
            self._pending.pop(0)
        if self._steps == 0:
            return {}
        record = {f"comm_{kind}_s": seconds / self._steps for kind, seconds in self._kind_s.items()}
        record["comm_s"] = self._comm_s / self._steps
        record["comm_share"] = min(self._comm_s / self._step_s, 1.0) if self._step_s > 0 else 0.0
        self._kind_s = dict.fromkeys(self.kinds, 0.0)
        self._comm_s = self._step_s = 0.0
        self._steps = 0
        return record


# -- DDP -------------------------------------------------------------------------------------
def hook_ddp(model: Any, timer: CommTimer) -> bool:
    """Time the gradient all-reduces of `model` (a DistributedDataParallel). The hook averages each
    bucket as torch's default all-reduce hook does (`default_hooks.allreduce_hook`: divide, sum),
    and notes the launch, and the completion in the one completion callback that hook has too.
    False when the model has a communication hook already (DDP takes one)."""
    import torch.distributed as dist

    group = model.process_group or dist.group.WORLD
    # Without a hook DDP divides while copying gradients into the bucket; a hook cannot, and a
    # separate division is one more pass over every gradient: NCCL averages inside the all-reduce.
    nccl = "nccl" in str(dist.get_backend(group))  # "nccl", or "cpu:gloo,cuda:nccl"

    def timed_allreduce(group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        tensor = bucket.buffer()
        average = nccl and tensor.is_cuda
        if not average:
            tensor.div_(group.size())
        op = timer.launched("all_reduce")
        reduce_op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        work = dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True)

        def finished(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            timer.completed(op)
            return done.value()[0]

        return work.get_future().then(finished)

    # DDP compares the hook's annotations with the objects; under `from __future__ import
    # annotations` they are strings, which it refuses.
    timed_allreduce.__annotations__ = {
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    try:
        model.register_comm_hook(group, timed_allreduce)
    except RuntimeError as err:
        log.info(
            "monitor.comm_metrics: DDP has a communication hook already; all-reduce is not timed (%s)", err
        )
        return False
    return True


# -- FSDP2 -----------------------------------------------------------------------------------
def hook_fsdp(model: torch.nn.Module, timer: CommTimer) -> bool:
    """Time the all-gathers and reduce-scatters of every FSDP2 module in `model`."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class TimedAllGather(AllGather):
        inner = DefaultAllGather()

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
        ) -> Any:
            op = timer.launched("all_gather")
            work = self.inner(
                output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op
            )
            timer.completed_with(op, work)
            return work

    class TimedReduceScatter(ReduceScatter):
        inner = DefaultReduceScatter()

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: Any,
            op: Any,
            async_op: bool = False,
        ) -> Any:
            timed = timer.launched("reduce_scatter")
            work = self.inner(
                output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op, async_op=async_op
            )
            timer.completed_with(timed, work)
            return work

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    try:
        for unit in units:
            unit.set_custom_all_gather(TimedAllGather())
            unit.set_custom_reduce_scatter(TimedReduceScatter())
    except ValueError as err:  # several parameter groups in one module: FSDP2 takes no custom comm
        log.info("monitor.comm_metrics: FSDP2 collectives are not timed (%s)", err)
        return False
    return bool(units)


# -- DeepSpeed -------------------------------------------------------------------------------
def deepspeed_kind(name: str) -> str:
    """The kind of a DeepSpeed comms-logger record name (all_reduce, allgather_fn, ...)."""
    name = name.lower().replace("allgather", "all_gather").replace("allreduce", "all_reduce")
    return next((kind for kind in ("reduce_scatter", "all_gather", "all_reduce") if kind in name), "other")


class DeepSpeedComms:
    """Each step's time per collective from DeepSpeed's comms logger, which is reset at every step
    boundary (on every rank: its records and timers otherwise grow for the whole run).

    DeepSpeed 0.19 logs, for each op name, the op's timer total since the timer was last reset,
    not each op's own time (`timers(name).elapsed(reset=False)`): after a reset the newest
    record of a name is the step's total for it (tests/test_comm_metrics.py checks this)."""

    def __init__(self) -> None:
        from deepspeed.comm import comm

        self.logger, self.timers = comm.comms_logger, comm.timers

    @property
    def enabled(self) -> bool:
        return bool(self.logger.enabled)

    def reset(self) -> None:
        self.logger.reset_data()
        for timer in self.timers.get_timers().values():
            timer.reset()

    def step_seconds(self) -> dict[str, float]:
        """Seconds per kind since the last reset (latencies are logged in ms)."""
        seconds: dict[str, float] = {}
        for name, by_size in self.logger.get_raw_data().items():
            total_ms = max((records[1][-1] for records in by_size.values() if records[1]), default=0.0)
            kind = deepspeed_kind(name)
            seconds[kind] = seconds.get(kind, 0.0) + total_ms / 1e3
        return seconds
