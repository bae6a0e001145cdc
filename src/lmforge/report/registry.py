"""`lmforge runs [DIR]`: the run directories under DIR, one row each."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmforge.report.load import RunSummary, is_run_dir, load_run

SEARCH_DEPTH = 2  # runs/<name>, and one level more (quickstart writes <out>/pretrain, <out>/finetune)


@dataclass
class RunRow:
    name: str
    path: str
    stage: str
    status: str
    steps: int | None
    best_eval_metric: str | None
    best_eval_value: float | None
    started: float | None
    duration_s: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def find_runs(directory: Path) -> list[Path]:
    """Run directories at or under `directory` (never inside a run), sorted by path."""
    if is_run_dir(directory):
        return [directory]
    found: list[Path] = []
    frontier = [directory]
    for _ in range(SEARCH_DEPTH):
        children = [c for d in frontier if d.is_dir() for c in sorted(d.iterdir()) if c.is_dir()]
        found += [c for c in children if is_run_dir(c)]
        frontier = [c for c in children if not is_run_dir(c) and not c.name.startswith(".")]
    return sorted(found)


def run_row(run: RunSummary) -> RunRow:
    best = run.best_eval()
    return RunRow(
        name=run.name,
        path=str(run.root),
        stage=run.stage,
        status=run.status,
        steps=run.last_step,
        best_eval_metric=best[0] if best else None,
        best_eval_value=best[1] if best else None,
        started=run.started,
        duration_s=run.duration_s,
    )


def list_runs(directory: Path) -> list[RunRow]:
    """One row per run under `directory`, oldest first (checkpoint hashes are not read: fast)."""
    rows = [run_row(load_run(path, verify_hashes=False)) for path in find_runs(directory)]
    return sorted(rows, key=lambda r: (r.started is None, r.started or 0.0, r.path))
