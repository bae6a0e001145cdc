"""GuardCallback: turns the step's verdicts (train/step.py) into events, checkpoints and stops,
runs the stall watchdog and the stop signals, and hands MetricsCallback the step's record.

Side effects only: what a step measures and decides is in train/step.py and monitor/guard.py.
The runner reads `rollback_from`, `stop_reason` and `signal_stop` after `trainer.train()`.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from lmforge.distributed.devices import control_group
from lmforge.monitor.events import EventLog
from lmforge.monitor.watchdog import StallWatchdog, StopSignals
from lmforge.train.step import TrainStep, scale_learning_rate

log = logging.getLogger(__name__)
DATA_BOUND_SHARE = 0.5  # more than half of the wall time waiting for batches


class GuardCallback(TrainerCallback):
    def __init__(
        self,
        step: TrainStep,
        events: EventLog,
        *,
        stacks_dir: Path,
        stall_seconds: float | None,
        update_in_backward: bool = False,
    ) -> None:
        # DeepSpeed applies the update inside backward: a bad step is already in the weights
        # when it is judged, so a stop must not checkpoint the current state.
        self.update_in_backward = update_in_backward
        self.step = step
        self.events = events
        self.stacks_dir = stacks_dir
        self.stall_seconds = stall_seconds
        self.lr_scale = 1.0  # cumulative, after rollbacks
        self.rollback_from: int | None = None
        self.stop_reason: str | None = None
        self.signal_stop: str | None = None
        self.signals = StopSignals()
        self.watchdog: StallWatchdog | None = None
        self._data_bound = False
        self._step = 0  # the last finished step, for events raised outside a step's callbacks
        self._step_started = 0.0

    # -- lifecycle -----------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.lr_scale != 1.0:
            scale_learning_rate(kw.get("optimizer"), kw.get("lr_scheduler"), self.lr_scale)
            log.warning("learning rate scaled by %.3g after rollback", self.lr_scale)
        if self.stall_seconds and self.watchdog is None:
            self.watchdog = StallWatchdog(self.stall_seconds, self.stacks_dir, self.step.rank, self._on_stall)
            self.watchdog.start()
        self.signals.install()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.step.settle(state)
        self._act_on_verdicts(state, control)
        self.signals.restore()

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    # -- progress ------------------------------------------------------------------------
    def _beat(self) -> None:
        if self.watchdog is not None:
            self.watchdog.beat()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._beat()
        self._step_started = time.perf_counter()

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._beat()

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._beat()

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.step.measure_update_ratio()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._beat()
        self._step = state.global_step
        self.step.step_seconds.append(time.perf_counter() - self._step_started)
        received = self._signal_any_rank_received()
        if received is not None and self.signal_stop is None:
            name = signal.Signals(received).name
            self.signal_stop = name
            control.should_save = True
            control.should_training_stop = True
            if state.is_world_process_zero:
                self.events.emit(
                    "signal", state.global_step, f"{name}: checkpoint at step {state.global_step}, then exit"
                )
        # A step judged on the device is read here only when something reads its numbers now (a log,
        # a checkpoint, an evaluation, the end); otherwise at the next step's close, when the device
        # has long finished it. A verdict found then is acted on one step later: a rollback returns to
        # the same checkpoint; a stop keeps the next step's update if that step was healthy.
        while self.step.verdicts or (self.step.unsettled and _reads_this_step(control)):
            self.step.settle(state)
            self._act_on_verdicts(state, control)
        for kind, message in self.step.notices:
            self.events.emit(kind, state.global_step, message, rank=self.step.rank)
        self.step.notices.clear()
        if control.should_log:
            self.step.gather_rank_stats()  # a collective: on every rank, at every logged step

    def _signal_any_rank_received(self) -> int | None:
        """The stop signal this rank or any other received by the end of this step. The ranks must
        agree: a signal reaches each rank at its own moment (or rank 0 alone, from `kill PID` or
        the UI's Stop), and a rank that stopped a step before the others left them waiting in the
        next step's collective for ever. One all-reduce of an int on the CPU per step."""
        mine = self.signals.received or 0
        if self.step.world_size == 1 or not dist.is_initialized():
            return mine or None
        flag = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control_group())
        return int(flag.item()) or None

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        """Act at once on the guardrails' verdict on a training log's RL metrics (monitor/guard.py
        `Guardrails.judge_log`, stage grpo / rloo).

        HF logs in `_maybe_log_save_evaluate`, after on_step_end and before the step's save: a stop
        still checkpoints this step, a rollback still prevents it. TRL's RL metrics are gathered
        over ranks, so every rank reaches the same verdict and they stop together."""
        if self.step.guardrails is None:
            return
        verdict = self.step.guardrails.judge_log(state.global_step, logs)
        if verdict is not None:
            self.step.verdicts.append((state.global_step, verdict))
            self._act_on_verdicts(state, control)

    def _act_on_verdicts(self, state: TrainerState, control: TrainerControl) -> None:
        # Every verdict is an event; "alert" (RL signals) is nothing more, its update stands.
        for step, verdict in self.step.verdicts:
            action = verdict.action
            if state.is_world_process_zero:
                kind = "skip" if verdict.kind == "replayed" else verdict.kind
                self.events.emit(kind, step, verdict.message, action=action)
            if action == "rollback" and self.rollback_from is None:
                self.rollback_from = step
                control.should_save = False  # the checkpoint to return to is an earlier one
                control.should_training_stop = True
            elif action == "stop" and self.stop_reason is None:
                self.stop_reason = verdict.message
                # Unless the engine already applied it, the bad update was dropped: this is the last good state.
                control.should_save = not self.update_in_backward
                control.should_training_stop = True
        self.step.verdicts.clear()

    def _on_stall(self, idle: float, stacks: Path) -> None:
        self.events.emit(
            "stall",
            self._step + 1,  # the step that is not finishing
            f"no training progress for {idle:.0f} s on rank {self.step.rank}; every thread's stack is in {stacks}",
            rank=self.step.rank,
            stacks=str(stacks),
        )

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        # Runs before CheckpointCommitCallback seals the directory, so the state is in its manifest.
        if state.is_world_process_zero:
            written = Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            if written.is_dir() and self.step.guardrails is not None:
                self.step.guardrails.save(written)

    # -- metrics ---------------------------------------------------------------------------
    def extra_metrics(self, logs: dict[str, float], window: dict[str, float]) -> dict[str, Any]:
        """The step's fields for this logged step's record (MetricsCallback's `extra`)."""
        record = self.step.record(logs, window, guarded=True)
        self._note_data_bound(record.get("data_wait_share"))
        return record

    def _note_data_bound(self, share: float | None) -> None:
        if share is None:
            return
        if share > DATA_BOUND_SHARE and not self._data_bound:
            self.events.emit(
                "data_bound",
                self._step,
                f"{share:.0%} of the wall time went to waiting for batches; raise train.dataloader_workers "
                "or prepare/pack the data ahead (lmforge prepare)",
                data_wait_share=share,
            )
        self._data_bound = share > DATA_BOUND_SHARE


def _reads_this_step(control: TrainerControl) -> bool:
    """Whether HF logs, evaluates, saves or stops after this step: each reads the step's numbers
    (the record, the best checkpoint's metric, the guard state and token count a checkpoint keeps)."""
    return bool(
        control.should_log or control.should_evaluate or control.should_save or control.should_training_stop
    )
