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

import fcntl
import math
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import optuna
import sqlalchemy
from optuna.distributions import BaseDistribution
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from lmforge.ckpt.atomic import holding_lock
from lmforge.errors import UserInputError
from lmforge.train.run_lock import LOCK_NAME

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
TRIAL_EXIT_SECONDS = 600  # how long a re-run waits for a killed sweep's trial to write its checkpoint
OWNER = "owner"  # user attribute: {"host", "pid"} of the sweep process running the trial
INTERRUPTED = "interrupted"  # user attribute of a trial stopped by a signal (retried next time)
OVER_BUDGET = "over_budget"  # user attribute of a trial asked for beyond --trials (failed, never trained)


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


# TPE models the finished trials only after this many; the trials before it (and every trial of
# the random sampler) take spread-out points instead (`SpreadStart`).
TPE_STARTUP_TRIALS = 10


def make_sampler(
    name: Sampler, seed: int, grid: dict[str, list[object]] | None, space_keys: Sequence[str] = ()
) -> optuna.samplers.BaseSampler:
    """The sweep's sampler. Random and TPE draw for each trial with its own seed (TrialSeededSampler),
    their first trials spread over the space `space_keys` span (SpreadStart).
    Grid: Optuna's GridSampler already gives grid point N to trial N, in every process; its order of
    the points comes from the seed, which must therefore be the same everywhere."""
    if name == "grid":
        assert grid is not None
        return optuna.samplers.GridSampler(grid, seed=seed)  # type: ignore[arg-type]
    spread = SpreadStart(space_keys, seed, None if name == "random" else TPE_STARTUP_TRIALS)
    if name == "random":
        return TrialSeededSampler(
            lambda trial_seed: optuna.samplers.RandomSampler(seed=trial_seed), seed, spread
        )
    return TrialSeededSampler(
        lambda trial_seed: optuna.samplers.TPESampler(seed=trial_seed, n_startup_trials=TPE_STARTUP_TRIALS),
        seed,
        spread,
    )


class TrialSeededSampler(optuna.samplers.BaseSampler):
    """An Optuna sampler whose random draws for trial N are seeded from (run.seed, N).

    One sampler seeded once with run.seed repeats itself in every process that opens the study: a
    killed sweep run again drew its first trial's values again, and two sweeps sharing a study drew
    the same values side by side. Trial numbers are handed out by the study's database, unique across
    processes and machines, so seeding each trial from its number never repeats a draw and keeps a
    sweep reproducible (the same seed and history give the same values). Everything else (TPE's model
    of the finished trials) is the wrapped Optuna sampler's own, one instance per trial."""

    def __init__(
        self, make: Callable[[int], optuna.samplers.BaseSampler], seed: int, spread: SpreadStart | None = None
    ) -> None:
        self._make, self._seed, self._spread = make, seed, spread
        self._by_trial: dict[int, optuna.samplers.BaseSampler] = {}
        self._lock = threading.Lock()  # --parallel: trials ask from several threads

    def _sampler(self, trial: FrozenTrial) -> optuna.samplers.BaseSampler:
        with self._lock:
            if trial.number not in self._by_trial:
                seed = int(np.random.SeedSequence([self._seed, trial.number]).generate_state(1)[0])
                self._by_trial[trial.number] = self._make(seed)
            return self._by_trial[trial.number]

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return self._sampler(trial).infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return self._sampler(trial).sample_relative(study, trial, search_space)

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        if self._spread is not None and self._spread.applies(study, param_name):
            return self._spread.value(trial, param_name, param_distribution)
        return self._sampler(trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._sampler(trial).before_trial(study, trial)

    def after_trial(
        self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None
    ) -> None:
        self._sampler(trial).after_trial(study, trial, state, values)
        with self._lock:
            self._by_trial.pop(trial.number, None)

    def reseed_rng(self) -> None:
        """Optuna reseeds a sampler per thread (--parallel) from the OS: each trial has its own seed."""


class SpreadStart:
    """The values of a sweep's first trials: trial N takes point N of a scrambled Halton sequence
    (scipy.stats.qmc) over the space, one dimension per key. Independent random draws cluster: with
    the default seed the first three trials of a learning-rate sweep all drew lr 8.4e-4 to 8.7e-4.
    Halton's first 2^k points fall one in each 1/2^k of the first key's range (log scale where the
    range is), so eight trials see eight different eighths. The point depends on the trial number
    and the seed only, so it never repeats across processes and stays reproducible."""

    def __init__(self, space_keys: Sequence[str], seed: int, trials: int | None) -> None:
        self.keys, self.seed, self.trials = list(space_keys), seed, trials

    def applies(self, study: optuna.Study, param_name: str) -> bool:
        """Whether `param_name` of the next trial is drawn here: a key of the space, while fewer than
        `trials` have finished (TPE's start-up; always for the random sampler)."""
        if param_name not in self.keys:
            return False
        if self.trials is None:
            return True
        finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        return len(finished) < self.trials

    def value(self, trial: FrozenTrial, param_name: str, distribution: BaseDistribution) -> Any:
        from scipy.stats import qmc

        point = (
            qmc.Halton(d=len(self.keys), scramble=True, seed=self.seed).fast_forward(trial.number).random(1)
        )
        return value_at(float(point[0, self.keys.index(param_name)]), distribution)


def value_at(u: float, distribution: BaseDistribution) -> Any:
    """The value at fraction `u` in [0, 1) of `distribution`'s range: categorical choices and
    stepped ranges in equal shares, a log range on its log scale."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(distribution, CategoricalDistribution):
        choices = distribution.choices
        return choices[min(int(u * len(choices)), len(choices) - 1)]
    assert isinstance(distribution, FloatDistribution | IntDistribution)
    low, high, step = distribution.low, distribution.high, distribution.step
    if distribution.log:
        # An integer log range: each integer gets the share of [n - 0.5, n + 0.5] on the log scale.
        pad = 0.5 if isinstance(distribution, IntDistribution) else 0.0
        value = math.exp(math.log(low - pad) + u * (math.log(high + pad) - math.log(low - pad)))
        return min(max(round(value), low), high) if pad else min(max(value, low), high)
    if step is not None:
        count = int(round((high - low) / step)) + 1
        value = low + min(int(u * count), count - 1) * step
        return int(value) if isinstance(distribution, IntDistribution) else float(value)
    return low + u * (high - low)


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


def recover_interrupted(study: optuna.Study, say: Callable[[str], None] = print) -> list[int]:
    """Queue again, with the same parameters, every trial a stopped or killed sweep left unfinished:
    running trials whose owner process on this host is gone, and trials failed by a signal.
    Returns their numbers. Finished trials are never repeated. A trial process still alive (its
    sweep died, it is writing its checkpoint) is waited for: the retry resumes that checkpoint."""
    retried = {RetryHeartbeatStaleTrialCallback.retried_trial_number(t) for t in study.trials}
    recovered: list[int] = []
    for trial in study.get_trials(deepcopy=False):
        if trial.number in retried:
            continue
        if trial.state == TrialState.RUNNING and _owner_is_gone(trial):
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        elif not (trial.state == TrialState.FAIL and trial.user_attrs.get(INTERRUPTED)):
            continue
        _wait_for_trial_process(trial, say)
        RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES)(study, study.trials[trial.number])
        recovered.append(trial.number)
    return recovered


def _wait_for_trial_process(trial: FrozenTrial, say: Callable[[str], None]) -> None:
    """Until the trial's `lmforge train` has let go of its run directory's lock (train/run_lock.py:
    held for the run's whole life, released by the kernel however it ends)."""
    run_dir = trial.user_attrs.get("run_dir")
    lock = Path(str(run_dir)) / LOCK_NAME if run_dir else None
    if lock is None or not lock.is_file():
        return
    with lock.open("a") as handle:
        deadline, told = time.monotonic() + TRIAL_EXIT_SECONDS, False
        while time.monotonic() < deadline:  # past it, the retry names the process holding the run
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                if not told:
                    say(f"trial {trial.number} is still writing its checkpoint in {run_dir}: waiting for it")
                    told = True
                time.sleep(0.5)
                continue
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            return


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


# What `--trials` counts: trials finished, running (in this process or another) or queued. A failed
# trial does not count: an interrupted one is queued again, another failure is replaced by a re-run.
BUDGET = (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED)


def trials_to_ask(study: optuna.Study, trials: int) -> int:
    """How many trials this sweep asks the study for: the ones missing from `--trials`, the study's
    total, plus the queued retries (asking is what runs them). Stale trials of dead machines are
    failed first (Optuna's heartbeat) so that they are queued again rather than counted."""
    optuna.storages.fail_stale_trials(study)
    started = (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED)
    return trials - len(study.get_trials(deepcopy=False, states=started))


def over_budget(study: optuna.Study, number: int, trials: int) -> bool:
    """Whether trial `number` is beyond the study's `trials`: two sweeps that each saw one trial
    missing both asked for it. The database numbers trials in the order they were asked for, so
    the earlier one runs and the later one is not trained."""
    ahead = [t for t in study.get_trials(deepcopy=False, states=BUDGET) if t.number < number]
    return len(ahead) >= trials
