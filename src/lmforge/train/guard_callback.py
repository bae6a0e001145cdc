"""GuardCallback: turns StepGuard's decisions into events, checkpoints and stops, runs the stall
watchdog and the stop signals, and measures what metrics.jsonl needs beyond HF's logs.

Side effects only: the decision maths is in monitor/guard.py, the measuring in train/guarded.py.
The runner reads `rollback_from`, `stop_reason` and `signal_stop` after `trainer.train()`.
"""

from __future__ import annotations

import logging
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from lmforge.ckpt.atomic import find_latest_complete
from lmforge.config import LmforgeConfig
from lmforge.errors import TrainingStopped
from lmforge.monitor.events import EventLog
from lmforge.monitor.guard import Guardrails
from lmforge.monitor.metrics import MetricsLog
from lmforge.monitor.watchdog import StallWatchdog, StopSignals
from lmforge.train.guarded import StepGuard
from lmforge.train.numerics import flops_per_token, memory_metrics, mfu, peak_flops

log = logging.getLogger(__name__)
DATA_BOUND_SHARE = 0.5  # more than half of the wall time waiting for batches


class GuardCallback(TrainerCallback):
    def __init__(
        self,
        guard: StepGuard,
        events: EventLog,
        *,
        stacks_dir: Path,
        stall_seconds: float | None,
        flops_per_token: float,
        peak_flops: float,
        update_in_backward: bool = False,
    ) -> None:
        # DeepSpeed applies the update inside backward: a bad step is already in the weights
        # when it is judged, so a stop must not checkpoint the current state.
        self.update_in_backward = update_in_backward
        self.guard = guard
        self.events = events
        self.stacks_dir = stacks_dir
        self.stall_seconds = stall_seconds
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.global_batch = 0  # set by attach()
        self.lr_scale = 1.0  # cumulative, after rollbacks
        self.rollback_from: int | None = None
        self.stop_reason: str | None = None
        self.signal_stop: str | None = None
        self.signals = StopSignals()
        self.watchdog: StallWatchdog | None = None
        self._data_bound = False
        self._step = 0  # the last finished step, for events raised outside a step's callbacks
        self._step_started = 0.0
        self._step_seconds: list[float] = []
        self._rank_stats: dict[str, float] = {}

    def attach(self, trainer: Any) -> None:
        """Give the trainer its StepGuard; rank, world size and global batch come from its arguments."""
        args = trainer.args
        self.guard.rank, self.guard.world_size = args.process_index, args.world_size
        self.global_batch = (
            args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        )
        trainer.step_guard = self.guard

    # -- lifecycle -----------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.lr_scale != 1.0:
            _scale_learning_rate(kw.get("optimizer"), kw.get("lr_scheduler"), self.lr_scale)
        if self.stall_seconds and self.watchdog is None:
            self.watchdog = StallWatchdog(
                self.stall_seconds, self.stacks_dir, self.guard.rank, self._on_stall
            )
            self.watchdog.start()
        self.signals.install()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
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
        self.guard.measure_ratio()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._beat()
        self._step = state.global_step
        self._step_seconds.append(time.perf_counter() - self._step_started)
        self._act_on_verdicts(state, control)
        for kind, message in self.guard.notices:
            self.events.emit(kind, state.global_step, message, rank=self.guard.rank)
        self.guard.notices.clear()
        if self.signals.received is not None and self.signal_stop is None:
            name = signal.Signals(self.signals.received).name
            self.signal_stop = name
            control.should_save = True
            control.should_training_stop = True
            if state.is_world_process_zero:
                self.events.emit(
                    "signal", state.global_step, f"{name}: checkpoint at step {state.global_step}, then exit"
                )
        if control.should_log:
            self._rank_stats = self._gather_rank_stats()

    def _act_on_verdicts(self, state: TrainerState, control: TrainerControl) -> None:
        for step, verdict in self.guard.verdicts:
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
        self.guard.verdicts.clear()

    def _on_stall(self, idle: float, stacks: Path) -> None:
        self.events.emit(
            "stall",
            self._step + 1,  # the step that is not finishing
            f"no training progress for {idle:.0f} s on rank {self.guard.rank}; every thread's stack is in {stacks}",
            rank=self.guard.rank,
            stacks=str(stacks),
        )

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        # Runs before CheckpointCommitCallback seals the directory, so the state is in its manifest.
        if state.is_world_process_zero:
            written = Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            if written.is_dir():
                self.guard.guardrails.save(written)

    # -- metrics ---------------------------------------------------------------------------
    def extra_metrics(self, window: dict[str, float]) -> dict[str, Any]:
        """Fields for this logged step's metrics record (MetricsCallback's `extra`)."""
        record: dict[str, Any] = dict(self.guard.guardrails.counters())
        window_s = window.get("window_s")
        if window_s:
            record["samples_per_s"] = window.get("window_steps", 0) * self.global_batch / window_s
            record["data_wait_share"] = min(self.guard.data_wait_s / window_s, 1.0)
            if "tokens_per_s" in window:
                record["mfu"] = mfu(
                    window["tokens_per_s"], self.flops_per_token, self.peak_flops, self.guard.world_size
                )
        self.guard.data_wait_s = 0.0
        if self.guard.update_ratio is not None:
            record["update_ratio"] = self.guard.update_ratio
            self.guard.update_ratio = None
        if self.guard.splits > 1:
            record["oom_splits"] = self.guard.splits
        record.update(memory_metrics())
        record.update(self._rank_stats)
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

    def _gather_rank_stats(self) -> dict[str, float]:
        """Loss mean/max across ranks and a straggler score (slowest rank's step time / median)."""
        mine = statistics.fmean(self._step_seconds) if self._step_seconds else 0.0
        self._step_seconds.clear()
        if self.guard.world_size == 1 or not dist.is_initialized():
            return {}
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        times = [torch.zeros(1, device=device) for _ in range(self.guard.world_size)]
        dist.all_gather(times, torch.tensor([mine], device=device))
        values = [float(t) for t in times]
        median = statistics.median(values) or 1e-9
        return {
            "loss_rank_mean": self.guard.loss_mean,
            "loss_rank_max": self.guard.loss_max,
            "straggler": max(values) / median,
            "slowest_rank": values.index(max(values)),
        }


def _scale_learning_rate(optimizer: Any, scheduler: Any, scale: float) -> None:
    """After a rollback: lower the schedule (its base rates) and the current rates alike."""
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * scale for lr in scheduler.base_lrs]
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["lr"] *= scale
    log.warning("learning rate scaled by %.3g after rollback", scale)


def train_with_rollbacks(
    trainer: Any,
    callback: GuardCallback,
    metrics: MetricsLog,
    checkpoints: Path,
    resume: str | None,
    lr_scale: float,
) -> None:
    """trainer.train(), again from the last complete checkpoint each time a guardrail rolls back."""
    while True:
        trainer.train(resume_from_checkpoint=resume)
        bad = callback.rollback_from
        if bad is None:
            return
        callback.rollback_from = None
        latest, _ = find_latest_complete(checkpoints)
        if latest is None:
            raise TrainingStopped(
                f"step {bad}: a guardrail asked for a rollback but no complete checkpoint exists yet; set "
                "train.save_every, or use monitor.guard.nonfinite=skip / monitor.guard.spike=skip"
            )
        callback.guard.guardrails.rewind(latest.path, bad)
        if trainer.is_world_process_zero():
            metrics.truncate_after(latest.step)  # the replayed steps are logged again, once
        callback.lr_scale *= lr_scale
        trainer.args.eval_on_start = False  # step-N's evaluation is already on record
        if trainer.is_world_process_zero():
            callback.events.emit(
                "rollback",
                bad,
                f"rolled back to {latest.path.name}; the batches of step {bad} are skipped on the replay"
                + (f", learning rate x{callback.lr_scale:.3g}" if callback.lr_scale != 1 else ""),
                checkpoint=str(latest.path),
            )
        resume = str(latest.path)


def build_guard_callback(
    cfg: LmforgeConfig,
    model: Any,
    events: EventLog,
    stacks_dir: Path,
    resume: Path | None,
    *,
    update_in_backward: bool = False,
) -> GuardCallback:
    """The run's guardrails (state restored from `resume`), drills and extra metrics.

    `update_in_backward`: the engine applies each update inside backward (DeepSpeed), before
    the guard sees the step's gradient norm, so a bad step can be neither skipped nor rolled
    back in the process (the engine cannot be re-initialised): the run stops, and the newest
    complete checkpoint is the last good state; the same launch command resumes from it."""
    settings = cfg.monitor.guard
    if update_in_backward:
        acting = {
            key: "stop" for key in ("nonfinite", "spike") if getattr(settings, key) in ("skip", "rollback")
        }
        if acting:
            log.warning(
                "monitor.guard: DeepSpeed applies each update inside backward, before a bad step can be "
                "dropped; %s act as stop (resume from the newest checkpoint: set train.save_every)",
                " and ".join(f"{key}={getattr(settings, key)}" for key in acting),
            )
            settings = settings.model_copy(update=acting)
    guard = StepGuard(Guardrails(settings), faults=list(cfg.debug.faults), oom_backoff=settings.oom_backoff)
    if resume is not None:
        guard.guardrails.load(resume)
    text = model.config.get_text_config()
    per_token = flops_per_token(
        sum(p.numel() for p in model.parameters()),
        text.num_hidden_layers,
        text.hidden_size,
        cfg.data.max_length,
    )
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return GuardCallback(
        guard,
        events,
        stacks_dir=stacks_dir,
        stall_seconds=settings.stall_seconds,
        flops_per_token=per_token,
        peak_flops=peak_flops(device),
        update_in_backward=update_in_backward,
    )
