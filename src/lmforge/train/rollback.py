"""The rollback loop: train, and each time a guardrail asks for a rollback, train again from the
newest complete checkpoint, skipping the bad step's batches and (optionally) lowering the lr."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.ckpt.atomic import find_latest_complete
from lmforge.errors import TrainingStopped
from lmforge.monitor.metrics import MetricsLog
from lmforge.train.guard_callback import GuardCallback


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
        assert callback.step.guardrails is not None  # only guardrails ask for rollbacks
        callback.step.guardrails.rewind(latest.path, bad)
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
