"""HF Trainer callbacks: side effects only (writing metrics records, sealing checkpoints, drills).
What a record holds is computed in train/step.py."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import (
    EarlyStoppingCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from lmforge.ckpt.atomic import MANIFEST_NAME, commit_checkpoint, read_best, rotate_checkpoints, write_best
from lmforge.config.schema import EarlyStoppingConfig, lower_is_better
from lmforge.distributed.ranks import wait_for_everyone
from lmforge.distributed.strategy import write_writer
from lmforge.errors import UserInputError
from lmforge.monitor.events import EventLog
from lmforge.monitor.metrics import MetricsLog, read_metrics, stage_metrics
from lmforge.train.drills import Drills
from lmforge.train.numerics import ThroughputMeter
from lmforge.train.step import eval_record, group_learning_rates

log = logging.getLogger(__name__)

# HF log keys renamed to metrics.jsonl's names (README.md, "The run directory").
_RENAMED = {"learning_rate": "lr"}
# Only the end-of-training summary carries train_loss (every step's log has train_runtime
# when token counting is on); the summary is kept out of the per-step records.
_SUMMARY_MARKER = "train_loss"


class MetricsCallback(TrainerCallback):
    """Writes metrics.jsonl: one record per logged step, eval results merged into their step's record."""

    def __init__(
        self,
        metrics: MetricsLog,
        *,
        step_record: Callable[[dict[str, float], dict[str, float]], dict[str, Any]],
        language_model_loss: bool = True,
        stage_metric_prefixes: tuple[str, ...] = (),
        listeners: list[Callable[[dict[str, Any]], None]] | None = None,
    ) -> None:
        self.metrics = metrics
        # The step's own fields for a logged step, given HF's logs and the throughput window.
        self.step_record = step_record
        self.listeners = list(listeners or [])  # sinks that get every record metrics.jsonl gets
        self.language_model_loss = language_model_loss
        self.stage_metric_prefixes = stage_metric_prefixes  # the stage's own metrics kept from HF's logs
        self.meter = ThroughputMeter()
        self.pending: dict[str, Any] | None = None
        self.summary: dict[str, float] = {}
        self.group_lrs: dict[str, float] = {}

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.meter.step_started(state.num_input_tokens_seen)

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        # The rates this update used: HF reads `learning_rate` here too, before the scheduler steps.
        self.group_lrs = group_learning_rates(kw.get("optimizer"))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.meter.step_ended(state.num_input_tokens_seen)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kw: Any,
    ) -> None:
        if not state.is_world_process_zero or not logs:
            return
        if _SUMMARY_MARKER in logs:
            self.summary.update(logs)
            return
        step = state.global_step
        if self.pending is not None and self.pending["step"] != step:
            self.flush()
        record = self.pending or {"step": step}
        if "eval_loss" in logs:
            record.update(eval_record(logs, language_model_loss=self.language_model_loss))
            record.update(stage_metrics(logs, self.stage_metric_prefixes, evaluation=True))
        if "loss" in logs:
            record.update(stage_metrics(logs, self.stage_metric_prefixes, evaluation=False))
            for key in ("loss", "learning_rate", "grad_norm", "epoch"):
                if key in logs:
                    record[_RENAMED.get(key, key)] = logs[key]
            record.update(self.group_lrs)
            record["tokens_seen"] = state.num_input_tokens_seen
            record.update(self.step_record(logs, self.meter.take_window()))
        self.pending = record

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.flush()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.flush()

    def add_to_step(self, step: int, values: dict[str, float]) -> None:
        """Merge `values` into `step`'s record (a callback's figures for the step just evaluated);
        the record is written when the step's other figures are."""
        if self.pending is not None and self.pending["step"] != step:
            self.flush()
        self.pending = {**(self.pending or {"step": step}), **values}

    def flush(self) -> None:
        if self.pending is not None:
            self.metrics.write(self.pending)
            for listener in self.listeners:
                listener(self.pending)
            self.pending = None


class CheckpointCommitCallback(TrainerCallback):
    """Seals each checkpoint HF Trainer wrote into staging and renames it to `checkpoints/step-N`.

    Keeps the newest `keep_last`, and with `best_metric` also the checkpoint whose evaluation
    at its own step scored best, recorded in checkpoints/best.json (which survives resumes).
    """

    def __init__(
        self,
        staging: Path,
        checkpoints: Path,
        keep_last: int,
        *,
        best_metric: str | None = None,
        writer: dict[str, Any] | None = None,
        drills: Drills | None = None,
    ) -> None:
        self.writer = writer  # the engine and world size, recorded in each checkpoint for resumes
        self.drills = drills or Drills()  # disk_full: a save fails as on a full disk
        self.staging = staging
        self.checkpoints = checkpoints
        self.keep_last = keep_last
        self.best_metric = best_metric
        self.last_eval: tuple[int, float] | None = None  # (step, value of best_metric)
        self.best = read_best(checkpoints) if best_metric else None

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kw: Any,
    ) -> None:
        if self.best_metric and metrics:
            if self.best_metric not in metrics:
                raise UserInputError(
                    f"train.best_metric: {self.best_metric!r} is not among the eval metrics "
                    f"{sorted(metrics)}; pick one of them"
                )
            self.last_eval = (state.global_step, float(metrics[self.best_metric]))

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        # Every rank writes its shard and RNG state: seal only once all of them are on disk, and
        # let no rank go on (a rollback reads the checkpoint back) before it is sealed.
        wait_for_everyone()
        if state.is_world_process_zero:
            self._seal(state)
        wait_for_everyone()

    def _seal(self, state: TrainerState) -> None:
        step = state.global_step
        written = self.staging / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        if self.writer is not None:
            write_writer(written, self.writer)
        # training_args.bin is a pickle of TrainingArguments; lmforge resumes from config.yaml
        # and never needs it, so it is not kept where a user might unpickle it.
        (written / "training_args.bin").unlink(missing_ok=True)
        if self.drills.due("disk_full", step) is not None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(written / MANIFEST_NAME))
        final = commit_checkpoint(written, self.checkpoints / f"step-{step}", step=step)
        self._update_best(step)
        keep = {f"step-{self.best['step']}"} if self.best else set()
        for old in rotate_checkpoints(self.checkpoints, self.keep_last, keep=keep):
            log.info("removed old checkpoint %s (keep_last=%d)", old.name, self.keep_last)
        log.info("checkpoint sealed: %s", final)

    def _update_best(self, step: int) -> None:
        if self.best_metric is None or self.last_eval is None or self.last_eval[0] != step:
            return
        value = self.last_eval[1]
        lower = lower_is_better(self.best_metric)
        if self.best is not None:
            previous = self.best["value"]
            if (value >= previous) if lower else (value <= previous):
                return
        self.best = {"step": step, "metric": self.best_metric, "value": value, "path": f"step-{step}"}
        write_best(self.checkpoints, self.best)
        log.info("best checkpoint so far: step-%d (%s=%.4g)", step, self.best_metric, value)


class EarlyStopping(EarlyStoppingCallback):
    """HF's early stopping (TrainingArguments.metric_for_best_model names the metric), plus what a
    user needs to trust it: an `early_stopped` event naming the metric, the best value and where the
    best checkpoint is; and a patience count that survives a resume (replayed from metrics.jsonl,
    since lmforge does not restore HF's callback states)."""

    def __init__(
        self,
        settings: EarlyStoppingConfig,
        events: EventLog | None,
        metrics_path: Path,
        kept_best: Path | None,
    ) -> None:
        super().__init__(
            early_stopping_patience=settings.patience, early_stopping_threshold=settings.min_delta
        )
        self.settings = settings
        self.events = events
        self.metrics_path = metrics_path
        self.kept_best = kept_best  # the checkpoints directory when its best.json is kept, else None
        self.stopped = False

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        super().on_train_begin(args, state, control, **kw)
        if state.global_step > 0:
            self._replay(args, control, state.global_step)

    def _replay(self, args: TrainingArguments, control: TrainerControl, resumed_at: int) -> None:
        """The count of evaluations without improvement up to the resumed step, by HF's own rule."""
        metric = self.settings.metric
        # The evaluation at step 0 (eval_on_start) is not one HF's callback judges.
        history = [
            float(r[metric])
            for r in read_metrics(self.metrics_path)
            if metric in r and 0 < r["step"] <= resumed_at
        ]
        replay = TrainerState()
        self.early_stopping_patience_counter = 0
        for value in history:
            self.check_metric_value(args, replay, control, value)
            better = replay.best_metric is None or (
                value > replay.best_metric if args.greater_is_better else value < replay.best_metric
            )
            if better:
                replay.best_metric = value

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kw: Any,
    ) -> None:
        metric = self.settings.metric
        if metrics is not None and metric not in metrics:
            raise UserInputError(
                f"train.early_stopping.metric: {metric!r} is not among the eval metrics {sorted(metrics)}; "
                "pick one of them"
            )
        super().on_evaluate(args, state, control, metrics, **kw)
        self.stopped = control.should_training_stop

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        # Told here, after the stopping step's checkpoint was sealed: it may be the new best.
        if self.stopped and state.is_world_process_zero and self.events is not None:
            self.events.emit("early_stopped", state.global_step, self._why(state))

    def _why(self, state: TrainerState) -> str:
        best, best_step = state.best_metric, state.best_global_step
        where = f"{best:.6g} at step {best_step}" if best is not None else "none"
        record = read_best(self.kept_best) if self.kept_best is not None else None
        kept = (
            f"; the best checkpoint is checkpoints/{record['path']} (checkpoints/best.json)" if record else ""
        )
        return (
            f"early stopping: {self.settings.metric} did not improve by more than {self.settings.min_delta:g} "
            f"in {self.settings.patience} evaluations in a row (best {where}){kept}"
        )


class KillDrillCallback(TrainerCallback):
    """`debug.crash_at_step`: SIGKILL the process right after step N and its checkpoint, as a real
    crash would (the drill itself is train/drills.py's)."""

    def __init__(self, drills: Drills) -> None:
        self.drills = drills

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if not control.should_save:  # else after the save
            self.drills.kill_if_due(state.global_step)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.drills.kill_if_due(state.global_step)


class NothingLeftToTrain(Exception):
    """Raised by StopAtTheEnd: the resumed state is already at the last step."""


class StopAtTheEnd(TrainerCallback):
    """A run resumed from its last step's checkpoint (a crash between that save and final/) must not
    train on: HF Trainer would run one more step before checking `max_steps`. Everything is loaded
    when on_train_begin runs, so stopping there leaves the checkpoint's state in the model, ready
    for final/. Listed first, before any callback starts work that on_train_end would undo."""

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            raise NothingLeftToTrain


class ShardReport(TrainerCallback):
    """Logs, on every rank, how many parameter elements it holds once the engine has wrapped the
    model: the direct evidence that FSDP / ZeRO-3 shard (each rank holds 1/N) and DDP replicates.

    Both numbers are counted then, on the same model: TRL's preference and online RL trainers add a
    frozen copy of a LoRA adapter (`ref`) while they are built, so a total counted before held
    fewer elements than the rank did (103.6%). `pipeline` (the parallel state's) holds the whole
    model's count when each rank holds one stage."""

    def __init__(self, engine: str, pipeline: Any = None) -> None:
        self.engine = engine
        self.pipeline = pipeline

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        from lmforge.distributed.fsdp import local_parameter_numel
        from lmforge.distributed.pipeline_parallel import whole_parameter_count

        model = kw.get("model")
        if model is None:
            return
        held, total = local_parameter_numel(model), whole_parameter_count(model, self.pipeline)
        log.info(
            "rank %d holds %s of %s parameter elements (%.1f%%, %s)",
            args.process_index,
            f"{held:,}",
            f"{total:,}",
            100 * held / max(total, 1),
            self.engine,
        )


class EngineStartup(TrainerCallback):
    """From the end of the Trainer's construction to the first step the engine starts (DeepSpeed
    JIT-compiles ops there): say what it is doing meanwhile (rank 0), and once it has started,
    record the DeepSpeed config exactly as the engine received it (HF fills the last "auto"s,
    like the step count, only then) in deepspeed_config.json. `is_main`: this worker speaks."""

    def __init__(self, engine: str, *, is_main: bool, deepspeed_record: Path | None) -> None:
        from lmforge.distributed.startup_progress import StartupHeartbeat

        self.heartbeat = StartupHeartbeat(engine) if is_main else None
        self.deepspeed_record = deepspeed_record if is_main else None

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.heartbeat is not None:
            self.heartbeat.start()

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        started = getattr(args, "hf_deepspeed_config", None)
        if self.deepspeed_record is not None and started is not None:
            from lmforge.distributed.deepspeed_config import write_resolved

            write_resolved(started.config, self.deepspeed_record)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()  # a run that ends before its first step (nothing left to train)
