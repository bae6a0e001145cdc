"""Online RL's sample completions with their rewards, in every sink and in <run>/rl_samples.jsonl.

TRL keeps the latest generation batch's prompts, completions and per-function rewards on the
trainer (`_logs`, filled by training and evaluation alike). At each evaluation, or at each logged
step when the run has no eval data, the last `train.rl.log_completions` of them go to the sinks
as a table (TensorBoard text, W&B table, MLflow table) with their weighted total reward.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lmforge.monitor.metrics import drop_records_after
from lmforge.monitor.run_artifacts import Sample
from lmforge.monitor.run_monitor import RunMonitor
from lmforge.train.eval_generations import append_samples
from lmforge.train.rewards import REFERENCE_COLUMN, completion_text

log = logging.getLogger(__name__)


class RlSamples(TrainerCallback):
    """Sends the newest `count` completions with their rewards at each eval (or logged) step."""

    def __init__(self, count: int, monitor: RunMonitor, path: Path, *, at_eval: bool) -> None:
        self.count, self.monitor, self.path, self.at_eval = count, monitor, path, at_eval
        self.trainer: Any = None
        self.weights: list[float] = []

    def watch(self, trainer: Any) -> None:
        """Read the completions of `trainer` (a TRL GRPO / RLOO trainer) and its reward weights."""
        self.trainer = trainer
        self.weights = [float(w) for w in trainer.reward_weights.tolist()]

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.is_world_process_zero:  # a resume replays the steps after its checkpoint
            drop_records_after(self.path, state.global_step)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.at_eval:
            self._send(state)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        if not self.at_eval and logs and "loss" in logs:
            self._send(state)

    def _send(self, state: TrainerState) -> None:
        if not state.is_world_process_zero or self.trainer is None:
            return
        samples = latest_samples(getattr(self.trainer, "_logs", None), self.count, self.weights)
        if not samples:
            return
        append_samples(self.path, state.global_step, samples)
        self.monitor.log_samples(state.global_step, samples)  # never raises


def latest_samples(logs: dict[str, Any] | None, count: int, weights: list[float]) -> list[Sample]:
    """The newest `count` (prompt, completion, reference answer, total reward) of TRL's completion
    log. The reference is the row's answer, which the first reward function logs as an extra column
    (train/rewards.py); None for data without reference answers."""
    if not logs or not logs.get("prompt"):
        return []
    prompts, completions = list(logs["prompt"]), list(logs["completion"])
    rewards = [list(values) for values in logs["rewards"].values()]
    references = list((logs.get("extra") or {}).get(REFERENCE_COLUMN, []))
    if len(references) != len(prompts):  # not logged for every completion: none rather than misaligned
        references = [None] * len(prompts)
    start = max(len(prompts) - count, 0)
    return [
        Sample(
            prompt=_prompt_text(prompts[i]),
            completion=completion_text(completions[i]),
            reference=references[i],
            reward=_total(i, rewards, weights),
        )
        for i in range(start, len(prompts))
    ]


def _prompt_text(prompt: Any) -> str:
    """The last user turn of a conversational prompt (the question), or the prompt string."""
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1]) if users else str(prompt)
    return str(prompt)


def _total(index: int, rewards: list[list[float]], weights: list[float]) -> float | None:
    values = [r[index] for r in rewards if index < len(r)]
    if not values or len(values) != len(weights):
        return None
    total = sum(w * v for w, v in zip(weights, values, strict=True))
    return total if math.isfinite(total) else None
