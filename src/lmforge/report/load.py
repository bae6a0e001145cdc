"""Read a run directory (README.md, "The run directory") into one typed `RunSummary` for the report.

Only reads: every file is optional (a run that crashed early has few), and a torn or
unreadable file is reported as missing rather than stopping the report.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lmforge.ckpt.atomic import CheckpointStatus, check_checkpoint, list_step_dirs, read_best
from lmforge.config.recorded import RecordedConfig, recorded_config_from
from lmforge.errors import UserInputError
from lmforge.monitor.events import read_events
from lmforge.run_layout import RunPaths

# Event kinds that end a run, and the status each one means.
END_KINDS = {"finished": "finished", "failed": "failed", "stopped": "stopped", "signal": "interrupted"}
RUNNING_WINDOW_S = 600.0  # no end event but metrics written this recently: still running
EXPORT_SUMMARY = "export.json"


@dataclass
class Series:
    """One metric over steps: the records that carry it, in step order (NaN/inf kept)."""

    steps: np.ndarray
    values: np.ndarray

    def finite(self) -> np.ndarray:
        return self.values[np.isfinite(self.values)]


@dataclass
class RunSummary:
    root: Path
    name: str
    config: RecordedConfig  # config.yaml through the schema (repairs noted in `problems`)
    config_text: str
    manifest: dict[str, Any]
    records: int
    series: dict[str, Series]
    events: list[dict[str, Any]]
    data_report: dict[str, Any] | None
    checkpoints: list[CheckpointStatus]
    best: dict[str, Any] | None
    export: dict[str, Any] | None
    has_final: bool
    status: str
    started: float | None
    ended: float | None
    problems: list[str] = field(default_factory=list)

    @property
    def stage(self) -> str:
        return self.config.train.stage if "train" in self.config.sections else "?"

    @property
    def last_step(self) -> int | None:
        steps = [int(s.steps[-1]) for s in self.series.values() if len(s.steps)]
        return max(steps) if steps else None

    @property
    def duration_s(self) -> float | None:
        if self.started is None or self.ended is None:
            return None
        return max(self.ended - self.started, 0.0)

    def best_eval(self) -> tuple[str, float, int] | None:
        """(metric, value, step): checkpoints/best.json when recorded, else the lowest eval_loss."""
        if self.best and isinstance(self.best.get("value"), int | float):
            return (
                str(self.best.get("metric", "best")),
                float(self.best["value"]),
                int(self.best.get("step", -1)),
            )
        series = self.series.get("eval_loss")
        if series is None or not len(series.finite()):
            return None
        masked = np.where(np.isfinite(series.values), series.values, np.inf)
        at = int(np.argmin(masked))
        return "eval_loss", float(series.values[at]), int(series.steps[at])

    def last_finite(self, key: str) -> tuple[int, float] | None:
        series = self.series.get(key)
        if series is None:
            return None
        ok = np.flatnonzero(np.isfinite(series.values))
        return (int(series.steps[ok[-1]]), float(series.values[ok[-1]])) if len(ok) else None


def is_run_dir(path: Path) -> bool:
    """A directory lmforge wrote a run into (training, or at least the data stage)."""
    paths = RunPaths(path)
    return (
        path.is_dir()
        and (paths.config.is_file() or paths.metrics.is_file())
        and (paths.metrics.is_file() or paths.manifest.is_file() or paths.data_report.is_file())
    )


def load_run(root: Path, *, verify_hashes: bool = True) -> RunSummary:
    """Everything the report shows about the run in `root`."""
    if not is_run_dir(root):
        raise UserInputError(
            f"{root}: not a run directory (no config.yaml with metrics.jsonl, manifest.json or "
            "data_report.json); pass runs/<name> as written by `lmforge train`"
        )
    paths = RunPaths(root)
    problems: list[str] = []
    config_text = paths.config.read_text(encoding="utf-8") if paths.config.is_file() else ""
    config = _recorded_config(config_text, problems)
    manifest = _json_file(paths.manifest, problems) or {}
    records, series = read_metric_series(paths.metrics)
    events = sorted(read_events(paths.events), key=lambda e: float(e.get("time") or 0.0))
    statuses = [check_checkpoint(d, verify_hashes=verify_hashes) for d in list_step_dirs(paths.checkpoints)]
    best = _safe(lambda: read_best(paths.checkpoints), problems, "checkpoints/best.json")
    export = _json_file(paths.export / EXPORT_SUMMARY, problems)
    has_final = paths.final.is_dir() and any(paths.final.iterdir())
    started = _parse_time(manifest.get("created"))
    ended = _end_time(paths, events)
    name = config.run.name if "run" in config.sections else root.name
    return RunSummary(
        root=root,
        name=name,
        config=config,
        config_text=config_text,
        manifest=manifest,
        records=records,
        series=series,
        events=events,
        data_report=_json_file(paths.data_report, problems),
        checkpoints=statuses,
        best=best if isinstance(best, dict) else None,
        export=export,
        has_final=has_final,
        status=run_status(events, has_final=has_final, has_metrics=records > 0, last_write=ended),
        started=started,
        ended=ended,
        problems=problems,
    )


def read_metric_series(path: Path) -> tuple[int, dict[str, Series]]:
    """(records read, a column per numeric metric) from metrics.jsonl, streamed line by line (a
    100k-step file never sits in memory as dicts); "nan"/"inf" strings become floats; torn lines
    are skipped, as monitor.metrics.read_metrics does."""
    columns: dict[str, tuple[list[int], list[float]]] = {}
    count = 0
    if not path.is_file():
        return 0, {}
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int):
                count += 1
                _add_record(columns, step, record)
    series = {
        key: Series(np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64))
        for key, (steps, values) in columns.items()
    }
    return count, series


def _add_record(columns: dict[str, tuple[list[int], list[float]]], step: int, record: dict[str, Any]) -> None:
    for key, value in record.items():
        number = as_number(value)
        if key == "step" or number is None:
            continue
        steps, values = columns.setdefault(key, ([], []))
        steps.append(step)
        values.append(number)


def as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)
    return None


def run_status(
    events: list[dict[str, Any]], *, has_final: bool, has_metrics: bool, last_write: float | None
) -> str:
    """finished / failed / stopped / interrupted from the last end event; else running / incomplete."""
    ends = [e for e in events if e.get("kind") in END_KINDS]
    if ends:
        status = END_KINDS[str(ends[-1]["kind"])]
        return "finished (no final/)" if status == "finished" and not has_final else status
    if not has_metrics:
        return "finished" if has_final else "prepared"
    if last_write is not None and time.time() - last_write < RUNNING_WINDOW_S:
        return "running"
    return "finished" if has_final else "incomplete"


def estimated_step(event: dict[str, Any], events: list[dict[str, Any]], last_step: int | None) -> int | None:
    """The step of an event logged without one (step -1: stall, data_bound), from the times of
    the events around it that have a step; None when nothing anchors it."""
    step = event.get("step")
    if isinstance(step, int) and step >= 0:
        return step
    when = event.get("time")
    anchors = sorted(
        (float(e["time"]), int(e["step"]))
        for e in events
        if isinstance(e.get("step"), int) and e["step"] >= 0 and isinstance(e.get("time"), int | float)
    )
    if not isinstance(when, int | float) or not anchors:
        return last_step
    times = [t for t, _ in anchors]
    steps = [s for _, s in anchors]
    return int(round(float(np.interp(float(when), times, steps))))


def _end_time(paths: RunPaths, events: list[dict[str, Any]]) -> float | None:
    times = [float(e["time"]) for e in events if isinstance(e.get("time"), int | float)]
    if paths.metrics.is_file():
        times.append(paths.metrics.stat().st_mtime)
    return max(times) if times else None


def _parse_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S"):
        try:
            return datetime.strptime(text, fmt).timestamp()
        except ValueError:
            continue
    return None


def _recorded_config(text: str, problems: list[str]) -> RecordedConfig:
    """config.yaml's text through the schema; what could not be read as written is a problem."""
    try:
        loaded = yaml.safe_load(text) if text else {}
    except yaml.YAMLError as err:
        problems.append(f"config.yaml is not valid YAML: {err}")
        return RecordedConfig()
    recorded = recorded_config_from(loaded) if isinstance(loaded, dict) else RecordedConfig()
    problems.extend(recorded.notes)
    return recorded


def _json_file(path: Path, problems: list[str]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        problems.append(f"{path.name} is unreadable: {err}")
        return None
    return loaded if isinstance(loaded, dict) else None


def _safe(read: Any, problems: list[str], what: str) -> Any:
    try:
        return read()
    except (OSError, ValueError) as err:
        problems.append(f"{what} is unreadable: {err}")
        return None
