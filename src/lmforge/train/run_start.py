"""How a run starts in its run directory: fresh, resumed, extended, or already finished.

The same command must always be safe to run again. What it finds decides what it does:

| run directory holds                                  | the command                                   |
|------------------------------------------------------|-----------------------------------------------|
| nothing lmforge wrote                                | starts fresh                                  |
| records but no usable checkpoint (an early crash)    | moves them to previous/<time>/, starts fresh  |
| a checkpoint that loads                              | resumes from the newest one                   |
| final/ for the same steps                            | reports the finished run, trains nothing      |
| final/ and a config asking for more steps            | continues from the last checkpoint (recorded) |
| anything, with run.overwrite=true                    | deletes what lmforge wrote, starts fresh      |

`train.resume: never` refuses a directory with checkpoints or final/ (run.overwrite=true replaces
it); `train.resume: PATH` resumes from that checkpoint or fails.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lmforge.ckpt.atomic import CheckpointStatus, check_checkpoint, list_step_dirs
from lmforge.ckpt.resumable import resume_problem
from lmforge.config.schema import TrainConfig
from lmforge.errors import UserInputError
from lmforge.run_layout import RunPaths, holds_training_run, read_finished
from lmforge.train.rundir import start_fresh

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunStart:
    resume: CheckpointStatus | None = None
    finished: dict[str, Any] | None = None  # set when the run is already done: nothing to train
    extends: int | None = None  # the step a finished run ended at, when this run continues it
    set_aside: Path | None = None  # where an early-crashed attempt's records went


def decide_start(train: TrainConfig, paths: RunPaths, *, overwrite: bool, act: bool) -> RunStart:
    """What this run does with what `paths` holds (the table above). `act`: this process may move
    and delete (rank 0); the other ranks decide from what rank 0 left."""
    if overwrite and act and holds_training_run(paths):
        start_fresh(paths, keep_aside=False)
        log.info("run.overwrite: removed the earlier run's files from %s", paths.root)
    if train.resume not in ("auto", "never"):
        return RunStart(resume=_explicit_checkpoint(train.resume))
    latest, rejected = latest_resumable(paths.checkpoints)
    for bad in rejected:
        log.warning("not resuming from %s: %s", bad.path, bad.problem)
    finished = read_finished(paths)
    if train.resume == "never" and (latest is not None or finished is not None):
        raise UserInputError(
            f"run directory {paths.root} already holds a run (train.resume=never); choose another run.name, "
            "or set run.overwrite=true to replace it"
        )
    if finished is not None:
        return _finished_or_extended(train, finished, latest, paths, rejected)
    if latest is not None:
        return RunStart(resume=latest)
    if rejected:  # checkpoints exist, none can be resumed: starting over silently would discard them
        raise UserInputError(
            f"no checkpoint in {paths.checkpoints} can be resumed: "
            + "; ".join(f"{bad.path.name}: {bad.problem}" for bad in rejected)
            + ". Set train.resume to the path of a checkpoint you trust, or run.overwrite=true to delete "
            "them and start the run over"
        )
    if holds_training_run(paths):  # records of an attempt that died before its first checkpoint
        aside = start_fresh(paths, keep_aside=True) if act else None
        if aside is not None:
            log.warning(
                "%s held an attempt that ended before its first checkpoint; its records were moved to %s "
                "and the run starts from scratch",
                paths.root,
                aside,
            )
        return RunStart(set_aside=aside)
    return RunStart()


def latest_resumable(checkpoints: Path) -> tuple[CheckpointStatus | None, list[CheckpointStatus]]:
    """The newest checkpoint that is sealed, intact and loadable; every newer one with its reason."""
    rejected: list[CheckpointStatus] = []
    for directory in list_step_dirs(checkpoints):
        status = check_checkpoint(directory)
        problem = resume_problem(directory, status.step) if status.complete else status.problem
        if problem is None:
            return status, rejected
        rejected.append(replace(status, complete=False, problem=problem))
    return None, rejected


def _explicit_checkpoint(setting: str) -> CheckpointStatus:
    status = check_checkpoint(Path(setting))
    problem = resume_problem(status.path, status.step) if status.complete else status.problem
    if problem is not None:
        raise UserInputError(f"train.resume: {setting} is not a checkpoint that can be resumed: {problem}")
    return status


def _finished_or_extended(
    train: TrainConfig,
    finished: dict[str, Any],
    latest: CheckpointStatus | None,
    paths: RunPaths,
    rejected: list[CheckpointStatus],
) -> RunStart:
    """A finished run asked again: the same length is done; a longer one continues it, explicitly."""
    done, target = finished["step"], finished.get("target", {})
    asked = {"max_steps": train.max_steps, "epochs": train.epochs}
    same_steps = train.max_steps == target.get("max_steps")
    if same_steps and (train.max_steps is not None or train.epochs == target.get("epochs")):
        return RunStart(finished=finished)
    if train.max_steps is not None:
        longer = train.max_steps > done
    else:
        longer = target.get("max_steps") is None and train.epochs > float(target.get("epochs") or 0)
    if not longer:
        raise UserInputError(
            f"run {paths.root} finished at step {done} ({_describe(target)}); the config now asks for "
            f"{_describe(asked)}, which is not longer. Choose another run.name for a new run, or set "
            "run.overwrite=true to replace this one"
        )
    if latest is None or latest.step < done:
        raise UserInputError(_no_checkpoint_to_extend(done, latest, paths, rejected))
    return RunStart(resume=latest, extends=done)


def _no_checkpoint_to_extend(
    done: int, latest: CheckpointStatus | None, paths: RunPaths, rejected: list[CheckpointStatus]
) -> str:
    """Why a finished run cannot continue from step `done`, and the ways on that exist."""
    refused = [bad for bad in rejected if bad.step >= done]
    if refused:
        why = (
            "its checkpoint of that step cannot be resumed ("
            + "; ".join(f"{bad.path.name}: {bad.problem}" for bad in refused)
            + ")"
        )
    else:
        why = "it keeps no checkpoint of that step (set train.save_every)"
    ways = "choose another run.name, or run.overwrite=true to start over"
    if latest is not None:
        ways = (
            f"set train.resume={latest.path} to continue from the newest usable checkpoint (steps "
            f"{latest.step + 1}-{done} are trained again), " + ways
        )
    return f"run {paths.root} finished at step {done}, but {why}; {ways}"


def _describe(target: dict[str, Any]) -> str:
    if target.get("max_steps"):
        return f"train.max_steps={target['max_steps']}"
    return f"train.epochs={target.get('epochs')}"
