"""metrics.jsonl: one JSON object per logged step, steps strictly increasing across resumes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.last_step = self._last_step_on_disk()

    def truncate_after(self, step: int) -> int:
        """Drop records logged after `step` (a resume from step-N repeats them); returns how many."""
        if not self.path.exists():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a line torn by a crash mid-write
                continue
            if record.get("step", 0) <= step:
                kept.append(line)
            else:
                dropped += 1
        self.path.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        self.last_step = self._last_step_on_disk()
        return dropped

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"metrics step {step} would not advance past {self.last_step}")
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(_json_safe(record)) + "\n")
        self.last_step = step

    def _last_step_on_disk(self) -> int | None:
        if not self.path.exists():
            return None
        last = None
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                last = int(json.loads(line)["step"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
        return last


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl (torn lines skipped)."""
    records = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """NaN and inf are kept visible as strings (JSON has no literal for them): a NaN is never hidden."""
    safe = {}
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            safe[key] = str(value)
        else:
            safe[key] = value
    return safe
