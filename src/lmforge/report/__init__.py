"""Reports people look at: report.html for a run, a comparison page, and the run registry.

    write_report(run_dir)                 -> run_dir/report.html
    write_comparison([run_a, run_b], out) -> one page, curves overlaid, config differences
    list_runs(directory)                  -> one RunRow per run directory under `directory`

Each page is one self-contained HTML file: plots are inline SVG, no script, nothing fetched.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lmforge.report.compare import config_differences, render_comparison
from lmforge.report.load import RunSummary, is_run_dir, load_run
from lmforge.report.registry import RunRow, find_runs, list_runs
from lmforge.report.run_page import render_run

REPORT_NAME = "report.html"
log = logging.getLogger(__name__)


def write_report(run_dir: Path, out: Path | None = None, *, verify_hashes: bool = True) -> Path:
    """Write the run's report (default run_dir/report.html); returns its path.

    `verify_hashes=False` skips re-hashing checkpoint files (marker and manifest are still
    checked): right after training, when the checkpoints were sealed moments ago."""
    run = load_run(Path(run_dir), verify_hashes=verify_hashes)
    target = Path(out) if out is not None else Path(run_dir) / REPORT_NAME
    _write_atomic(target, render_run(run))
    return target


def report_after_run(run_dir: Path) -> None:
    """report.html for whatever state a run just ended in (finished, stopped or failed): a
    report never fails the run, so a problem writing it is only logged."""
    try:
        # Checkpoints were hashed when they were sealed; `lmforge report` re-hashes on demand.
        log.info("report: %s", write_report(run_dir, verify_hashes=False))
    except Exception as err:
        log.warning("could not write report.html: %s", err)


def write_comparison(run_dirs: list[Path], out: Path) -> Path:
    """Write one page comparing `run_dirs`; returns its path."""
    runs = [load_run(Path(d), verify_hashes=False) for d in run_dirs]
    _write_atomic(Path(out), render_comparison(runs))
    return Path(out)


def _write_atomic(path: Path, text: str) -> None:
    """A browser open on the old report never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)


__all__ = [
    "REPORT_NAME",
    "RunRow",
    "RunSummary",
    "config_differences",
    "find_runs",
    "is_run_dir",
    "list_runs",
    "load_run",
    "report_after_run",
    "write_comparison",
    "write_report",
]
