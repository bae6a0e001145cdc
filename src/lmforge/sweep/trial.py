"""One sweep trial: `lmforge train CONFIG overrides` in a child process, its own run directory
under the sweep directory, and its eval metric reported to the study as it trains.

The child learns which trial it is from LMFORGE_SWEEP_TRIAL (storage URL, study, trial id,
metric); `sweep/pruning.py` is its side. This side, the sweep's process, never imports the training
stack. A pruned trial stops like an early-stopped run (final/ written, a `pruned` event saying why)
and the parent marks it pruned. The objective of a finished trial is its last evaluation of the metric.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.monitor.metrics import read_metrics
from lmforge.run_layout import RunPaths

ENV = "LMFORGE_SWEEP_TRIAL"
USER_ERROR_EXIT = 2  # `lmforge train` refused its config: every trial would be refused too


@dataclass(frozen=True)
class TrialSpec:
    storage: str
    study: str
    trial_id: int
    metric: str
    run_dir: str
    pruner: str  # the pruner lives in the sweep process only: the trial builds the same one
    prune_after: int

    def to_env(self) -> str:
        return json.dumps(self.__dict__)


@dataclass
class TrialResult:
    status: str  # complete | pruned | failed | interrupted | refused
    value: float | None = None
    step: int | None = None
    message: str = ""


# The trials this sweep process runs now: a signal to the sweep is passed on to them once.
_RUNNING: dict[int, subprocess.Popen[bytes]] = {}
_STOPPED: set[int] = set()  # pids already sent their SIGTERM
_STOP_WAIT_SECONDS = 300  # a trial asked to stop finishes its step and writes its checkpoint


def run_trial(command: list[str], spec: TrialSpec, log_path: Path, threads: int | None) -> TrialResult:
    """Run one trial's `lmforge train` to its end and say how it ended.

    The trial runs in its own session: a signal to the sweep's process group (Ctrl-C, `kill -- -PGID`,
    a scheduler) reaches the sweep only, which passes one SIGTERM on (`stop_running_trials`). Two
    signals would stop the trial at once without a checkpoint, as lmforge's second signal does."""
    env = {**os.environ, ENV: spec.to_env()}
    if threads is not None:  # K trials at once share the cores instead of oversubscribing them
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_stop_with_parent,
        )
        _RUNNING[process.pid] = process
        try:
            code = process.wait()
        except BaseException:
            # The sweep was interrupted: the trial checkpoints and exits (its checkpoint is sealed
            # before the sweep records the trial as interrupted, and before a re-run retries it).
            _stop(process)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=_STOP_WAIT_SECONDS)
            raise
        finally:
            _RUNNING.pop(process.pid, None)
            _STOPPED.discard(process.pid)
    return _result(code, Path(spec.run_dir), spec.metric, log_path)


def stop_running_trials() -> None:
    """Ask every trial of this process to checkpoint and exit (SIGTERM, once each); safe in a signal
    handler: no lock, each trial's own thread waits for it."""
    for process in list(_RUNNING.values()):
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None and process.pid not in _STOPPED:
        _STOPPED.add(process.pid)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)


def _stop_with_parent() -> None:
    """Linux: the trial gets SIGTERM (checkpoint, then exit) when the sweep process dies, even by SIGKILL."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _result(code: int, run_dir: Path, metric: str, log_path: Path) -> TrialResult:
    events = _events(run_dir)
    kinds = [e["kind"] for e in events]
    if code == USER_ERROR_EXIT:
        return TrialResult("refused", message=_tail(log_path))
    if kinds[-1:] == ["signal"] or code < 0:  # stopped at a checkpoint, or killed by a signal
        return TrialResult("interrupted", message=f"stopped by a signal (see {log_path})")
    if code != 0 or "finished" not in kinds:
        last = events[-1]["message"] if events else _tail(log_path)
        return TrialResult("failed", message=f"exit code {code}: {last}")
    values = [(r["step"], float(r[metric])) for r in read_metrics(RunPaths(run_dir).metrics) if metric in r]
    pruned = [e for e in events if e["kind"] == "pruned"]
    if pruned:
        return TrialResult(
            "pruned", values[-1][1] if values else None, pruned[-1]["step"], pruned[-1]["message"]
        )
    if not values:
        return TrialResult("failed", message=f"the run logged no {metric}; is there eval data?")
    step, value = values[-1]
    return TrialResult("complete", value, step)


def _events(run_dir: Path) -> list[dict[str, Any]]:
    files = sorted(RunPaths(run_dir).events.glob("*.jsonl")) if RunPaths(run_dir).events.is_dir() else []
    events = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: e["time"])


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def train_command(config: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "lmforge.cli.main", "train", str(config), *overrides]
