"""The sweep trial's side, in the `lmforge train` process: at each evaluation the eval metric goes
to the Optuna study and the pruner is asked whether to stop (`sweep/trial.py` is the sweep's side)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lmforge.monitor.events import EventLog
from lmforge.run_layout import RunPaths
from lmforge.sweep.trial import ENV, TrialSpec

log = logging.getLogger(__name__)


class PruningReport(TrainerCallback):
    """In the trial's process: the eval metric to the study at each evaluation; stop when pruned."""

    def __init__(self, spec: TrialSpec) -> None:
        # Optuna is imported by trials alone: a plain `lmforge train` never loads the study engine.
        import optuna

        from lmforge.sweep.study import make_pruner, open_storage

        self.spec = spec
        study = optuna.load_study(
            study_name=spec.study,
            storage=open_storage(spec.storage),
            pruner=make_pruner(spec.pruner, spec.prune_after),  # type: ignore[arg-type]
        )
        self.trial = optuna.Trial(study, spec.trial_id)
        self.events = EventLog(RunPaths(Path(spec.run_dir)).events)

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kw: Any,
    ) -> None:
        # Step 0 (eval_on_start) is the same for every trial of one seed: nothing to compare.
        if not state.is_world_process_zero or state.global_step == 0 or not metrics:
            return
        if self.spec.metric not in metrics:
            return  # the parent fails the trial, naming the metrics there are
        import optuna

        try:
            self.trial.report(float(metrics[self.spec.metric]), state.global_step)
        except optuna.exceptions.UpdateFinishedTrialError:
            # The study already ended this trial: its sweep died (this process got SIGTERM with it and
            # stops at this step) and a re-run failed the trial to queue it again. The retry resumes
            # this run's checkpoint: save it whatever the study says, never crash before it is sealed.
            log.warning(
                "trial %d is no longer running in the study (its sweep was stopped): checkpoint at step %d",
                self.trial.number,
                state.global_step,
            )
            control.should_save = True
            return
        if self.trial.should_prune():
            control.should_training_stop = True
            self.events.emit(
                "pruned",
                state.global_step,
                f"sweep pruner: {self.spec.metric}={metrics[self.spec.metric]:.6g} at step {state.global_step} "
                "is worse than the other trials at this step",
            )


def callbacks_from_env() -> list[TrainerCallback]:
    """The pruning report when this process is a sweep trial, else nothing."""
    raw = os.environ.get(ENV)
    return [PruningReport(TrialSpec(**json.loads(raw)))] if raw else []
