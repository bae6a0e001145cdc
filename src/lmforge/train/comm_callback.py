"""CommTiming: installs the engine's communication timing when training begins (the DDP hook,
FSDP2's timed collectives, DeepSpeed's comms logger: distributed/comm_timing.py), marks each
optimizer step's start and end, and hands the logged step's comm_* fields to the metrics record.
Side effects only: what is measured and how is in distributed/comm_timing.py."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lmforge.config.schema import MonitorConfig
from lmforge.distributed.comm_timing import ENGINE_KINDS, CommTimer, DeepSpeedComms, hook_ddp, hook_fsdp

log = logging.getLogger(__name__)


class CommTiming(TrainerCallback):
    """Hooks the engine's collectives when training begins and marks each step's boundaries;
    `take_window()` gives the logged step's comm_* fields (rank 0)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.timer = CommTimer(ENGINE_KINDS[engine])
        self.trainer: Any = None  # set by watch(): the wrapped model exists once training begins
        self.deepspeed: DeepSpeedComms | None = None
        self._hooked: set[int] = set()
        self._recording = False

    def watch(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.timer.cuda = args.device.type == "cuda"
        model = self.trainer.model_wrapped if self.trainer is not None else None
        if model is None or id(model) in self._hooked:  # a rollback trains the same wrapped model again
            return
        self._hooked.add(id(model))
        if not self._install(model):
            log.info(
                "monitor.comm_metrics: the %s engine's collectives are not timed; no comm_* metrics",
                self.engine,
            )

    def _install(self, model: Any) -> bool:
        if self.engine == "ddp":
            return hasattr(model, "register_comm_hook") and hook_ddp(model, self.timer)
        if self.engine == "fsdp":
            return hook_fsdp(model, self.timer)
        deepspeed = DeepSpeedComms()
        if not deepspeed.enabled:  # e.g. "comms_logger": {"enabled": false} in the user's JSON
            return False
        self.deepspeed = deepspeed
        return True

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.deepspeed is not None:
            self.deepspeed.reset()  # drop what ran between steps (evaluation, checkpoint saves)
        self._recording = state.is_world_process_zero
        if self._recording:
            self.timer.step_started()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.deepspeed is not None and self._recording:
            for kind, seconds in self.deepspeed.step_seconds().items():
                self.timer.add_seconds(kind, seconds)
        if self._recording:
            self.timer.step_ended()

    def take_window(self) -> dict[str, float]:
        return self.timer.take_window()


def comm_timing(monitor: MonitorConfig, engine: str, world_size: int) -> CommTiming | None:
    """The run's communication timer: distributed runs with monitoring and comm_metrics on."""
    if not (monitor.enabled and monitor.comm_metrics) or world_size < 2 or engine not in ENGINE_KINDS:
        return None
    return CommTiming(engine)
