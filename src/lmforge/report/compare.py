"""`lmforge runs compare`: several runs on one page, curves overlaid, config differences side by side."""

from __future__ import annotations

import json
from typing import Any

from lmforge.config.dotted import flatten
from lmforge.report.html import (
    Raw,
    esc,
    fmt_duration,
    fmt_number,
    fmt_time,
    page,
    status_badge,
    table,
)
from lmforge.report.load import RunSummary
from lmforge.report.plots import PALETTE, Chart, Line, render_chart

COMPARED = (
    ("Train loss", "loss"),
    ("Eval loss", "eval_loss"),
    ("Learning rate", "lr"),
    ("Gradient norm", "grad_norm"),
    ("Throughput, tokens/s", "tokens_per_s"),
    ("Model FLOPs utilisation", "mfu"),
    ("Share of wall time waiting for data", "data_wait_share"),
)
# Keys that differ between any two runs and say nothing about the experiment.
IGNORED_KEYS = ("run.name", "run.output_dir")
MISSING = "(absent)"


def config_differences(runs: list[RunSummary]) -> list[tuple[str, list[Any]]]:
    """(dotted key, value per run) for every key whose values are not all equal."""
    flat = [flatten(run.config.as_dict()) for run in runs]
    keys = sorted(set().union(*flat))
    rows = []
    for key in keys:
        values = [f.get(key, MISSING) for f in flat]
        if key not in IGNORED_KEYS and any(v != values[0] for v in values[1:]):
            rows.append((key, values))
    return rows


def render_comparison(runs: list[RunSummary]) -> str:
    labels = _labels(runs)
    summary = [
        [
            Raw(_swatch(i) + esc(labels[i])),
            status_badge(run.status),
            run.stage,
            run.last_step,
            _best(run),
            fmt_time(run.started),
            fmt_duration(run.duration_s),
            str(run.root),
        ]
        for i, run in enumerate(runs)
    ]
    charts = []
    for title, key in COMPARED:
        lines = [
            Line(labels[i], run.series[key].steps, run.series[key].values, _color(i), dots=key == "eval_loss")
            for i, run in enumerate(runs)
            if key in run.series
        ]
        charts.append(render_chart(Chart(title, f"compare_{key}", lines)))
    differences = config_differences(runs)
    diff_table = (
        table(
            ["config key", *labels], [[key, *map(_show, values)] for key, values in differences], css="diff"
        )
        if differences
        else '<p class="missing">the resolved configs are identical (apart from run.name / run.output_dir)</p>'
    )
    body = [
        f"<h1>Comparison of {len(runs)} runs</h1>",
        "<h2>Runs</h2>",
        table(["run", "status", "stage", "steps", "best eval", "started", "duration", "directory"], summary),
        "<h2>Curves</h2>",
        '<div class="charts">' + "".join(charts) + "</div>",
        "<h2>Config differences</h2>",
        diff_table,
    ]
    return page("lmforge comparison: " + " vs ".join(labels), body)


def _labels(runs: list[RunSummary]) -> list[str]:
    """Run names, made unique with their parent directory where two runs share a name."""
    names = [run.name for run in runs]
    return [
        name if names.count(name) == 1 else f"{run.root.parent.name}/{run.root.name}"
        for name, run in zip(names, runs, strict=True)
    ]


def _best(run: RunSummary) -> str:
    best = run.best_eval()
    return f"{best[0]} {fmt_number(best[1])} @ {best[2]}" if best else ""


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def _swatch(i: int) -> str:
    return f'<span class="key" style="background:{_color(i)}"></span>'
