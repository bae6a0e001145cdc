"""metrics.jsonl: one JSON object per logged step, steps strictly increasing across resumes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def stage_metrics(logs: dict[str, Any], prefixes: tuple[str, ...], *, evaluation: bool) -> dict[str, float]:
    """The numbers of `logs` whose names start with one of `prefixes` (after `eval_` in an
    evaluation's logs); None values (a metric with nothing to average) are left out."""
    found = {}
    for key, value in logs.items():
        name = key.removeprefix("eval_") if evaluation else key
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and key.startswith("eval_") == evaluation and name.startswith(prefixes):
            found[key] = float(value)
    return found


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.last_step = self._last_step_on_disk()

    def truncate_after(self, step: int) -> int:
        """Drop records logged after `step` (a resume from step-N repeats them); returns how many."""
        dropped = drop_records_after(self.path, step)
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


def drop_records_after(path: Path, step: int) -> int:
    """Keep the lines of a per-step JSON-lines file up to `step` (a resume from step-N repeats
    the steps after it); torn lines go too. Returns how many lines were dropped."""
    if not path.exists():
        return 0
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash mid-write
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
    if len(kept) < len(lines):
        path.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    return len(lines) - len(kept)


def read_step_records(path: Path) -> list[dict[str, Any]]:
    """The records of a per-step JSON-lines file (metrics.jsonl, eval_samples.jsonl,
    histograms.jsonl) that carry an integer step, in file order; torn or foreign lines are
    skipped, so a reader never fails on a file a crash cut short."""
    return [r for r in read_metrics(path) if isinstance(r, dict) and isinstance(r.get("step"), int)]


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """NaN and inf are kept visible as strings (JSON has no literal for them): a NaN is never hidden."""
    safe = {}
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            safe[key] = str(value)
        else:
            safe[key] = value
    return safe
