"""The step axis every metric sink shares, and where a resume finds it again.

`StepAxisSink` logs each (key, step) pair at most once and never goes back a step, so the
steps a resumed run replays after its checkpoint are not logged twice. Each sink's run id and
last logged step live in run_dir/sinks.json (`STATE_FILE`). The sinks themselves are in
`lmforge.monitor.sinks`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STATE_FILE = "sinks.json"


class _SinkState:
    """run_dir/sinks.json: each sink's run id and last logged step, rewritten atomically."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / STATE_FILE

    def get(self, sink: str) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return {}
        entry = data.get(sink) if isinstance(data, dict) else None
        return entry if isinstance(entry, dict) else {}

    def put(self, sink: str, entry: dict[str, Any]) -> None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            data = {}
        data[sink] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
        os.replace(tmp, self.path)


class StepAxisSink:
    """The step guard shared by every sink: (key, step) at most once, steps never backwards."""

    name = "sink"

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        self._state = _SinkState(run_dir)
        saved = self._state.get(self.name)
        floor = saved.get("last_step")
        if resume_step is not None:
            floor = max(int(floor), resume_step) if floor is not None else resume_step
        self._floor: int | None = (
            int(floor) if floor is not None else None
        )  # steps <= floor were logged before
        self._step: int | None = None  # the step being logged in this process
        self._keys_at_step: set[str] = set()
        self.run_id: str | None = saved.get("run_id")
        self.skipped = 0  # records (or parts) refused by the guard
        self._closed = False

    def log(self, record: dict[str, Any]) -> None:
        """Log the numeric values of one metrics record at record["step"]."""
        if self._closed:
            return
        step = int(record["step"])
        if (self._floor is not None and step <= self._floor) or (
            self._step is not None and step < self._step
        ):
            self.skipped += 1
            return
        if step != self._step:
            self._step, self._keys_at_step = step, set()
        values = {k: v for k, v in _numeric(record).items() if k not in self._keys_at_step}
        if len(values) < len(_numeric(record)):
            self.skipped += 1
        if not values:
            return
        durable = self._write(step, values)
        self._keys_at_step.update(values)
        if durable:  # the step a resume skips up to is one the sink really holds
            self._save_last_step()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._finish()
            self._save_last_step()

    def _save_last_step(self) -> None:
        if self._step is not None:
            self._state.put(self.name, {"run_id": self.run_id, "last_step": self._step})

    def _write(self, step: int, values: dict[str, float]) -> bool:
        """Log `values` at `step`; True when they are stored (not only buffered) on return."""
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


def _numeric(record: dict[str, Any]) -> dict[str, float]:
    """The loggable values of a record: numbers, bools, and the "nan"/"inf" strings of metrics.jsonl."""
    values: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        number = _as_float(value)
        if number is not None:
            values[key] = number
    return values


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool | int | float):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf"):
        return float(value)
    return None
