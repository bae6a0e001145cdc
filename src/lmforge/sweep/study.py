"""The Optuna study behind a sweep: its storage (a real database), sampler, pruner, and the
recovery of trials a killed sweep left behind.

The storage is SQLite in the sweep directory by default, or any SQLAlchemy URL (PostgreSQL,
MySQL), so several `lmforge sweep` processes, on one machine or many, work on one study. Each
trial records its owner (host, pid): a sweep started again on the same host fails the trials
of a dead owner at once and queues them again with the same parameters (the retry reuses the
trial's run directory, so lmforge resumes it from its last checkpoint). Trials of other hosts
are failed and queued by Optuna's heartbeat once they stop beating.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import optuna
import sqlalchemy
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from lmforge.ckpt.atomic import holding_lock
from lmforge.errors import UserInputError

# Optuna marks its heartbeat and retry API experimental; it is the documented way to recover
# trials, and the warnings are no action for a user. Optuna's own per-trial INFO lines repeat
# what the sweep prints.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
optuna.logging.set_verbosity(optuna.logging.WARNING)

Sampler = Literal["tpe", "random", "grid"]
Pruner = Literal["median", "hyperband", "none"]
HEARTBEAT_SECONDS = 30
GRACE_SECONDS = 120  # a trial whose owner has not beaten for this long is failed and retried
MAX_RETRIES = 3
OWNER = "owner"  # user attribute: {"host", "pid"} of the sweep process running the trial
INTERRUPTED = "interrupted"  # user attribute of a trial stopped by a signal (retried next time)


def default_storage(sweep_dir: Path) -> str:
    return f"sqlite:///{(sweep_dir / 'study.db').resolve()}"


def open_storage(url: str) -> RDBStorage:
    """The study database; SQLite waits for a writer instead of failing with 'database is locked'.

    Optuna creates a new database's tables when it opens it; two sweeps opening one new SQLite file
    at once would both create them, so the opening holds a lock beside the file. A server database
    (PostgreSQL, MySQL) opened by two machines at once: the one that loses the race opens it again."""
    try:
        if url.startswith("sqlite:///"):
            database = Path(url.removeprefix("sqlite:///"))
            with holding_lock(database.with_name(database.name + ".lock")):
                return _rdb_storage(url, {"connect_args": {"timeout": 60}})
        try:
            return _rdb_storage(url, {})
        except sqlalchemy.exc.DBAPIError:
            time.sleep(1.0)  # another process was creating the tables: they are there now
            return _rdb_storage(url, {})
    except (sqlalchemy.exc.DBAPIError, OSError) as err:  # unreachable server, unwritable directory
        raise UserInputError(f"--storage: cannot open {_without_password(url)}: {err}") from None


def _rdb_storage(url: str, engine_kwargs: dict[str, Any]) -> RDBStorage:
    try:
        return RDBStorage(
            url,
            engine_kwargs=engine_kwargs,
            heartbeat_interval=HEARTBEAT_SECONDS,
            grace_period=GRACE_SECONDS,
            heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES),
        )
    except sqlalchemy.exc.DBAPIError:
        raise
    except Exception as err:  # bad URL, missing driver, unreachable server
        raise UserInputError(f"--storage: cannot open {_without_password(url)}: {err}") from None


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" in rest and ":" in rest.split("@", 1)[0]:
        user = rest.split("@", 1)[0].split(":", 1)[0]
        return f"{scheme}{sep}{user}:***@{rest.split('@', 1)[1]}"
    return url


def make_sampler(
    name: Sampler, seed: int, grid: dict[str, list[object]] | None
) -> optuna.samplers.BaseSampler:
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        assert grid is not None
        return optuna.samplers.GridSampler(grid, seed=seed)  # type: ignore[arg-type]
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(name: Pruner, startup_trials: int) -> optuna.pruners.BasePruner:
    """Median: stop a trial whose eval metric is worse than the median of earlier trials at the same
    step (after `startup_trials` finished ones); Hyperband: successive halving over eval steps."""
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=0)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def open_study(
    storage: RDBStorage,
    name: str,
    *,
    direction: Literal["minimize", "maximize"],
    metric: str,
    space_keys: list[str],
    sampler: optuna.samplers.BaseSampler,
    pruner: optuna.pruners.BasePruner,
) -> optuna.Study:
    """Create the study, or join it when it exists (another process or an earlier, killed sweep);
    a study that optimises another metric or space is refused rather than mixed."""
    study = optuna.create_study(
        storage=storage,
        study_name=name,
        direction=direction,
        sampler=sampler,
        pruner=pruner,
        load_if_exists=True,
    )
    # Each attribute is its own write: a sweep starting beside the one that created the study may
    # see the metric recorded and the space not yet; what is missing is recorded, never compared.
    recorded = study.user_attrs
    wanted = {"metric": metric, "space": space_keys}
    for key, value in wanted.items():
        if key not in recorded:
            study.set_user_attr(key, value)
    if any(key in recorded and recorded[key] != value for key, value in wanted.items()):
        raise UserInputError(
            f"study {name!r} in this storage optimises {recorded.get('metric')} over {recorded.get('space')}, "
            f"not {metric} over {space_keys}; pass another --study-name (or --out) for a new sweep"
        )
    if study.direction.name.lower() != direction:
        raise UserInputError(
            f"study {name!r} {study.direction.name.lower()}s its metric; this sweep would {direction}"
        )
    return study


def owner_attr() -> dict[str, object]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def recover_interrupted(study: optuna.Study) -> list[int]:
    """Queue again, with the same parameters, every trial a stopped or killed sweep left unfinished:
    running trials whose owner process on this host is gone, and trials failed by a signal.
    Returns their numbers. Finished trials are never repeated."""
    retried = {RetryHeartbeatStaleTrialCallback.retried_trial_number(t) for t in study.trials}
    recovered: list[int] = []
    for trial in study.get_trials(deepcopy=False):
        if trial.number in retried:
            continue
        if trial.state == TrialState.RUNNING and _owner_is_gone(trial):
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        elif not (trial.state == TrialState.FAIL and trial.user_attrs.get(INTERRUPTED)):
            continue
        RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES)(study, study.trials[trial.number])
        recovered.append(trial.number)
    return recovered


def _owner_is_gone(trial: FrozenTrial) -> bool:
    owner = trial.user_attrs.get(OWNER) or {}
    if owner.get("host") != socket.gethostname():
        return False  # another machine's trial: Optuna's heartbeat decides
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError):
        return False
    return False


def original_number(trial: FrozenTrial) -> int:
    """The number of the first attempt of a retried trial (its run directory), else its own."""
    history = RetryHeartbeatStaleTrialCallback.retry_history(trial)
    return history[0] if history else trial.number


def finished_count(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
