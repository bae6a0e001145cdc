"""The training console: one rich progress bar for the stage, a compact metrics line every
`train.log_every` steps and one line per eval, with numbers formatted as numbers.

It replaces HF Trainer's tqdm bars (the eval bar nested inside the training bar) and its raw
log dicts (`{'loss': '8.362', 'grad_norm': '2.693', ...}`, values printed as strings); those
dicts still go to `<run>/train.log`, whole. `--verbose` keeps HF's own output instead.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lmforge.verbosity import FILE_ONLY

log = logging.getLogger(__name__)
# HF's raw log dicts, for train.log only (a name outside lmforge.*: upstream output).
raw_log = logging.getLogger("hf_trainer.logs")

# (record key, label, format) of the step line, in order; missing keys are left out.
STEP_FIELDS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("loss", "loss", lambda v: f"{v:.4f}"),
    ("lr", "lr", lambda v: f"{v:.2e}"),
    ("grad_norm", "grad", lambda v: f"{v:.3g}"),
    # Online RL (TRL's names): the mean total reward and KL to the reference.
    ("reward", "reward", lambda v: f"{v:.3f}"),
    ("kl", "kl", lambda v: f"{v:.3g}"),
    # Offline preference (TRL's DPO / ORPO names): the share of pairs ranked right, the mean margin.
    ("rewards/accuracies", "pair acc", lambda v: f"{v:.2f}"),
    ("rewards/margins", "margin", lambda v: f"{v:.3g}"),
    ("tokens_per_s", "tok/s", lambda v: f"{v:,.0f}"),
    ("mfu", "MFU", lambda v: f"{v:.1%}"),
)
# Eval keys shown with their own label; the other eval_* numbers follow under their names.
EVAL_LABELS = {
    "eval_loss": "loss",
    "eval_ppl": "ppl",
    "eval_rewards/accuracies": "pair acc",
    "eval_rewards/margins": "margin",
}
EVAL_HIDDEN = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}


def format_step_line(record: dict[str, Any], step: int, total: int, eta_s: float | None) -> str:
    parts = [f"step {step:>{len(str(total))}}/{total}"]
    for key, label, fmt in STEP_FIELDS:
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            parts.append(f"{label} {fmt(value) if math.isfinite(value) else value}")
    if record.get("mfu_peak_uncertain"):  # numerics.mfu: a window beat the measured CPU peak
        parts.append("MFU n/a (peak uncertain)")
    if eta_s is not None:
        parts.append(f"ETA {timedelta(seconds=round(eta_s))}")
    return "  ".join(parts)


def format_eval_line(record: dict[str, Any], step: int) -> str:
    parts = [f"eval at step {step}:"]
    for key, value in record.items():
        if not key.startswith("eval_") or key in EVAL_HIDDEN or not isinstance(value, int | float):
            continue
        if "/" in key and key not in EVAL_LABELS:  # a family's detail (online RL's per-reward and
            continue  # length figures, DPO's log-probabilities): metrics.jsonl
        label = EVAL_LABELS.get(key, key.removeprefix("eval_"))
        parts.append(f"{label} {value:.4g}")
    return "  ".join(parts)


class ConsoleProgress(TrainerCallback):
    """Rank 0's console while training. `current_record` returns the metrics record of the
    current step as MetricsCallback has built it (loss, lr, tokens/s, MFU, eval results).
    `show` False (--verbose, where HF prints its own output): HF's log dicts reach train.log
    and nothing is printed."""

    def __init__(
        self, stage: str, current_record: Callable[[], dict[str, Any] | None], *, show: bool = True
    ) -> None:
        self.stage = stage
        self.show = show
        self.current_record = current_record
        self.console = Console(stderr=True, soft_wrap=True)
        self.progress: Progress | None = None
        self.task: Any = None
        # (time, step) at the end of this process's first step: the ETA is timed from there, since
        # the first step carries the start-up (data loader workers, compilation, allocator warm-up).
        self.started: tuple[float, int] | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if not state.is_world_process_zero or not self.show:
            return
        self.started = None
        # Animated on a terminal only; in a pipe or CI log the metric lines say it all.
        self.progress = Progress(
            TextColumn(f"[bold]{self.stage}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
            transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task(self.stage, total=state.max_steps, completed=state.global_step)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step)
            if self.started is None:
                self.started = (time.monotonic(), state.global_step)

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
        raw_log.info("step %d: %s", state.global_step, logs, extra={FILE_ONLY: True})
        record = self.current_record()
        if self.show and "loss" in logs and record is not None:
            self._print(format_step_line(record, state.global_step, state.max_steps, self._eta(state)))

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        record = self.current_record()
        if self.show and state.is_world_process_zero and record is not None and "eval_loss" in record:
            self._print(format_eval_line(record, state.global_step))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def _eta(self, state: TrainerState) -> float | None:
        if self.started is None:
            return None
        began, first = self.started
        done = state.global_step - first
        if done <= 0:
            return None
        return (time.monotonic() - began) / done * (state.max_steps - state.global_step)

    def _print(self, line: str) -> None:
        # Through the progress console, so the line lands above a live bar.
        (self.progress.console if self.progress is not None else self.console).print(line, highlight=False)
