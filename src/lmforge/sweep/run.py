"""`lmforge sweep`: many trainings of one config, searched by Optuna.

Layout of a sweep directory (default <run.output_dir>/<run.name>-sweep):

    study.db          the Optuna study (SQLite; or --storage URL elsewhere)
    trial-0000/ ...   one lmforge run directory per trial (a retried trial reuses its own)
    logs/trial-N.log  each trial's console output
    best.yaml         the base config with the best trial's values: `lmforge train best.yaml`
    summary.csv       one row per trial
    sweep.html        the study page (history, importances, parallel coordinates)
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import optuna
import yaml
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.study import MaxTrialsCallback
from optuna.trial import TrialState

from lmforge.config import LmforgeConfig, load_config
from lmforge.config.load import apply_override
from lmforge.config.schema import lower_is_better
from lmforge.errors import UserInputError
from lmforge.sweep import study as studies
from lmforge.sweep.space import SearchSpace, load_space, override
from lmforge.sweep.trial import TrialResult, TrialSpec, run_trial, stop_running_trials, train_command

log = logging.getLogger(__name__)


@dataclass
class SweepOptions:
    trials: int = 10
    parallel: int = 1
    timeout_s: float | None = None
    sampler: studies.Sampler = "tpe"
    pruner: studies.Pruner = "median"
    prune_after: int = 2  # finished trials before the median pruner may stop one
    storage: str | None = None
    study_name: str | None = None
    metric: str | None = None
    out: Path | None = None


@dataclass
class SweepResult:
    directory: Path
    study: optuna.Study
    metric: str
    trial_dirs: dict[int, Path]
    best_config: Path | None
    page: Path | None
    recovered: list[int]


class SweepStopped(Exception):
    """A trial was refused as a config error: every other trial would be refused too."""


def run_sweep(
    config: Path,
    overrides: list[str],
    space_path: Path,
    options: SweepOptions,
    *,
    say: Callable[[str], None] = print,
) -> SweepResult:
    cfg = load_config(config, overrides)
    _check_sweepable(cfg, options)
    space = load_space(space_path, config, overrides)
    metric = options.metric or cfg.train.kept_best_metric or "eval_loss"
    direction: Literal["minimize", "maximize"] = "minimize" if lower_is_better(metric) else "maximize"
    directory = (options.out or cfg.run.output_dir / f"{cfg.run.name}-sweep").resolve()
    directory.mkdir(parents=True, exist_ok=True)
    url = options.storage or studies.default_storage(directory)
    grid = space.grid() if options.sampler == "grid" else None
    study = studies.open_study(
        studies.open_storage(url),
        options.study_name or cfg.run.name,
        direction=direction,
        metric=metric,
        space_keys=list(space.distributions),
        sampler=studies.make_sampler(options.sampler, cfg.run.seed, grid, list(space.distributions)),
        pruner=studies.make_pruner(options.pruner, options.prune_after),
    )
    recovered = studies.recover_interrupted(study, say)
    for number in recovered:
        say(f"trial {number} was interrupted: queued again with the same values (it resumes its checkpoint)")
    remaining = studies.trials_to_ask(study, options.trials)
    if remaining > 0:
        say(
            f"sweep {study.study_name}: {remaining} more trial(s) of {options.trials}, {options.parallel} at a time; "
            f"{direction} {metric}; study in {url if options.storage else directory / 'study.db'}"
        )
        objective = _Objective(config, overrides, space, directory, url, metric, options, say)
        with _signals_stop_trials():
            study.optimize(
                objective,
                n_trials=remaining,
                timeout=options.timeout_s,
                n_jobs=options.parallel,
                catch=(TrialFailed,),
                # Stops asking once the study holds --trials, counting other processes' running ones.
                callbacks=[MaxTrialsCallback(options.trials, states=studies.BUDGET)],
            )
        if objective.stopped is not None:
            raise objective.stopped
    else:
        running = len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)))
        say(
            f"sweep {study.study_name}: all {options.trials} trials are done"
            + (f" or running elsewhere ({running} running)" if running else "")
        )
    trial_dirs = {t.number: directory / trial_dir_name(studies.original_number(t)) for t in study.trials}
    best_config = _write_best_config(study, config, overrides, space, directory, cfg)
    _write_summary(study, trial_dirs, directory / "summary.csv")
    page = _write_page(study, directory, metric, trial_dirs)
    return SweepResult(directory, study, metric, trial_dirs, best_config, page, recovered)


@contextlib.contextmanager
def _signals_stop_trials() -> Iterator[None]:
    """SIGTERM and SIGINT to the sweep: each running trial is asked once to checkpoint and exit, and
    the sweep records it as interrupted once it has (a re-run resumes it). Main thread only."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        stop_running_trials()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _check_sweepable(cfg: LmforgeConfig, options: SweepOptions) -> None:
    if cfg.train.eval_every is None:
        raise UserInputError(
            "a sweep compares trials by an eval metric: set train.eval_every (and eval data, data.eval or "
            "data.eval_fraction) in the config"
        )
    if cfg.distributed.strategy not in ("auto", "none"):
        raise UserInputError(
            f"distributed.strategy={cfg.distributed.strategy}: sweep trials run as single processes; "
            "use --parallel to run several at once"
        )
    if options.trials < 1 or options.parallel < 1:
        raise UserInputError("--trials and --parallel must be at least 1")


def trial_dir_name(number: int) -> str:
    return f"trial-{number:04d}"


class TrialFailed(Exception):
    """A trial that ended without a result; Optuna records it as failed and the sweep goes on."""


class _Objective:
    def __init__(
        self,
        config: Path,
        overrides: list[str],
        space: SearchSpace,
        directory: Path,
        storage_url: str,
        metric: str,
        options: SweepOptions,
        say: Callable[[str], None],
    ) -> None:
        self.config, self.overrides, self.space = config, overrides, space
        self.directory, self.storage_url, self.metric = directory, storage_url, metric
        self.pruner, self.prune_after, self.trials = options.pruner, options.prune_after, options.trials
        parallel = options.parallel
        self.threads = max(1, (os.cpu_count() or 1) // parallel) if parallel > 1 else None
        self.say = say
        self.lock = threading.Lock()
        self.stopped: SweepStopped | None = None

    def __call__(self, trial: optuna.Trial) -> float:
        if studies.over_budget(trial.study, trial.number, self.trials):
            trial.set_user_attr(studies.OVER_BUDGET, True)
            trial.study.stop()
            raise TrialFailed(
                f"not run: the study already has its {self.trials} trials (another sweep asked at the same time)"
            )
        params = {key: _suggest(trial, key, dist) for key, dist in self.space.distributions.items()}
        trial.set_user_attr(studies.OWNER, studies.owner_attr())
        frozen = trial.study.get_trials(deepcopy=False)[trial.number]
        name = trial_dir_name(studies.original_number(frozen))
        run_dir = self.directory / name
        trial.set_user_attr("run_dir", str(run_dir))
        spec = TrialSpec(
            self.storage_url,
            trial.study.study_name,
            trial._trial_id,
            self.metric,
            str(run_dir),
            self.pruner,
            self.prune_after,
        )
        command = train_command(
            self.config,
            [
                *self.overrides,
                *self.space.overrides(params),
                override("run.output_dir", str(self.directory)),
                override("run.name", name),
            ],
        )
        log_path = self.directory / "logs" / f"{name}.log"
        with self.lock:  # a trial trains for minutes: say where to watch it
            self.say(f"trial {trial.number:>3}  started in {name} (console: {log_path})")
        started = time.monotonic()
        try:
            result = run_trial(command, spec, log_path, self.threads)
        except KeyboardInterrupt:
            trial.set_user_attr(studies.INTERRUPTED, True)  # queued again by the next sweep
            raise
        self._say(trial.number, params, result, time.monotonic() - started)
        return self._value(trial, result)

    def _value(self, trial: optuna.Trial, result: TrialResult) -> float:
        if result.status == "complete":
            assert result.value is not None
            return result.value
        if result.status == "pruned":
            raise optuna.TrialPruned(result.message)
        if result.status == "interrupted":
            trial.set_user_attr(studies.INTERRUPTED, True)
            raise KeyboardInterrupt(result.message)
        if result.status == "refused":
            with self.lock:
                self.stopped = SweepStopped(f"trial {trial.number} was refused:\n{result.message}")
            trial.study.stop()
        raise TrialFailed(result.message)

    def _say(self, number: int, params: dict[str, Any], result: TrialResult, seconds: float) -> None:
        values = ", ".join(f"{k}={_short(v)}" for k, v in params.items())
        outcome = {
            "complete": f"{self.metric} {result.value:.4f}" if result.value is not None else "",
            "pruned": f"pruned at step {result.step}",
        }.get(result.status, f"{result.status}: {result.message.splitlines()[-1] if result.message else ''}")
        with self.lock:
            self.say(f"trial {number:>3}  {values}  ->  {outcome}  ({seconds:.0f} s)")


def _suggest(trial: optuna.Trial, key: str, dist: BaseDistribution) -> Any:
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(key, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(key, dist.low, dist.high, step=dist.step, log=dist.log)
    assert isinstance(dist, FloatDistribution)
    return trial.suggest_float(key, dist.low, dist.high, step=dist.step, log=dist.log)


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return study.best_trial if complete else None


def _write_best_config(
    study: optuna.Study,
    config: Path,
    overrides: list[str],
    space: SearchSpace,
    directory: Path,
    cfg: LmforgeConfig,
) -> Path | None:
    """The user's YAML with their overrides and the best trial's values, under a new run name."""
    best = best_trial(study)
    if best is None:
        return None
    raw = yaml.safe_load(config.read_text()) or {}
    for item in [*overrides, *space.overrides(best.params), override("run.name", f"{cfg.run.name}-best")]:
        apply_override(raw, item)
    path = directory / "best.yaml"
    header = (
        f"# Best trial {best.number} of sweep {study.study_name}: {study.user_attrs.get('metric')} = {best.value:.6g}\n"
        f"# Run it: lmforge train {path}\n"
    )
    path.write_text(header + yaml.safe_dump(raw, sort_keys=False))
    load_config(path)  # what is written must load
    return path


def _write_summary(study: optuna.Study, trial_dirs: dict[int, Path], path: Path) -> None:
    from lmforge.report.sweep_page import sweep_summary_rows

    rows = sweep_summary_rows(study, trial_dirs)
    keys = list(study.user_attrs.get("space") or [])
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["number", "state", "value", *keys, "last_step", "duration_s", "run_dir"])
        for row in rows:
            params = row.get("params") or {}
            writer.writerow(
                [
                    row["number"],
                    row["state"],
                    row.get("value"),
                    *(params.get(k) for k in keys),
                    row.get("last_step"),
                    row.get("duration_s"),
                    row.get("run_dir"),
                ]
            )


def render_live_page(directory: Path) -> str:
    """The study page of the sweep in `directory` as its database holds it now, running trials
    included (sweep.html is written when the sweep ends)."""
    from lmforge.report.sweep_page import render_sweep

    storage = studies.open_storage(studies.default_storage(directory))
    names = optuna.get_all_study_names(storage)
    if len(names) != 1:
        raise UserInputError(f"{directory / 'study.db'}: {len(names)} studies; a sweep directory holds one")
    study = optuna.load_study(study_name=names[0], storage=storage)
    trial_dirs = {t.number: directory / trial_dir_name(studies.original_number(t)) for t in study.trials}
    metric = str(study.user_attrs.get("metric") or "value")
    return render_sweep(study, metric=metric, trial_dirs=trial_dirs, page_dir=directory)


def _write_page(study: optuna.Study, directory: Path, metric: str, trial_dirs: dict[int, Path]) -> Path:
    from lmforge.report.sweep_page import write_sweep_page

    return write_sweep_page(study, directory / "sweep.html", metric=metric, trial_dirs=trial_dirs)
