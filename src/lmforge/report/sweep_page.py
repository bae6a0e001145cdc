"""The page of a hyperparameter sweep: an Optuna study whose trials are training runs.

    write_sweep_page(study, out, metric=..., trial_dirs=...) -> out
    sweep_summary_rows(study, trial_dirs)                    -> one dict per trial (console table, CSV)

Self-contained like report.html (inline SVG, no script, nothing fetched; every name, parameter
value and path is escaped): the counts and the best trial, the optimisation history, each
trial's intermediate values, parameter importances, parallel coordinates and the trial table.
Pruned trials are marked wherever they are drawn; failed trials and non-finite values become
marks, never an error.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.importance import PedAnovaImportanceEvaluator
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from lmforge.report.html import Raw, esc, fmt_duration, fmt_number, key_values, page, table
from lmforge.report.plots import BOTTOM, HEIGHT, LEFT, LOG_RATIO, PALETTE, RIGHT, TOP, WIDTH, downsample

# lmforge.report.REPORT_NAME, spelled out: the package __init__ may come to import this module.
REPORT_NAME = "report.html"
STATE_NAMES = {
    TrialState.COMPLETE: "complete",
    TrialState.PRUNED: "pruned",
    TrialState.FAIL: "failed",
    TrialState.RUNNING: "running",
    TrialState.WAITING: "waiting",
}
STATE_CSS = {"complete": "ok", "pruned": "warn", "failed": "bad", "running": "info", "waiting": "info"}
PRUNED_COLOR, FAILED_COLOR, BEST_COLOR, NONFINITE_COLOR = "#ff7f0e", "#d62728", "#2ca02c", "#d62728"
# Parallel coordinates, best trial to worst: dark to light (viridis, stopped before pale yellow).
RAMP = ((0x44, 0x01, 0x54), (0x31, 0x68, 0x8E), (0x35, 0xB7, 0x79), (0xB5, 0xDE, 0x2B))
AXIS_GAP, PAR_TOP, LABEL_CHARS = 150, 52, 22
HALO = 'stroke="#fff" stroke-width="3" paint-order="stroke"'  # tick labels stay legible over lines
MISSING = object()  # a conditional parameter the trial did not sample (None can be a choice)
Place = Callable[[float], float | None]  # value -> pixel, None where it cannot be placed


def write_sweep_page(study: optuna.Study, out: Path, *, metric: str, trial_dirs: dict[int, Path]) -> Path:
    """Write the sweep's page to `out` (links to run directories are relative to it); returns `out`."""
    out = Path(out)
    text = render_sweep(study, metric=metric, trial_dirs=trial_dirs, page_dir=out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")  # a browser open on the old page never sees half
    partial.write_text(text, encoding="utf-8")
    partial.replace(out)
    return out


def sweep_summary_rows(study: optuna.Study, trial_dirs: dict[int, Path]) -> list[dict[str, Any]]:
    """One dict per trial, by trial number: number, state (complete / pruned / failed / running /
    waiting), value (what Optuna recorded: a pruned trial's is its last intermediate value, or
    None), params, last_step and last_intermediate (where a pruned trial stopped), duration_s,
    run_dir (str, None when `trial_dirs` has no entry) and best (the study's best trial)."""
    _check_single_objective(study)
    best = _best_trial(study)
    rows = []
    for trial in study.get_trials(deepcopy=False):
        run_dir = trial_dirs.get(trial.number)
        rows.append(
            {
                "number": trial.number,
                "state": _state(trial),
                "value": trial.values[0] if trial.values else None,
                "params": dict(trial.params),
                "last_step": trial.last_step,
                "last_intermediate": _last_intermediate(trial),
                "duration_s": trial.duration.total_seconds() if trial.duration is not None else None,
                "run_dir": None if run_dir is None else str(run_dir),
                "best": best is not None and trial.number == best.number,
            }
        )
    return rows


def render_sweep(study: optuna.Study, *, metric: str, trial_dirs: dict[int, Path], page_dir: Path) -> str:
    _check_single_objective(study)
    trials = study.get_trials(deepcopy=False)
    minimize = study.direction == StudyDirection.MINIMIZE
    best = _best_trial(study)
    importances, importance_html = importance_section(study)
    body = [
        f"<h1>Sweep: {esc(study.study_name)}</h1>",
        header(trials, metric, minimize),
        "<h2>Best trial</h2>",
        best_section(best, trial_dirs, page_dir),
        "<h2>Optimisation history</h2>",
        history_chart(trials, best, metric, minimize),
        "<h2>Intermediate values</h2>",
        intermediate_chart(trials, metric),
        "<h2>Parameter importances</h2>",
        importance_html,
        "<h2>Parallel coordinates</h2>",
        parallel_chart(trials, list(importances), metric, minimize),
        "<h2>Trials</h2>",
        trials_table(study, metric, trial_dirs, page_dir),
    ]
    return page(f"lmforge sweep: {study.study_name}", body)


def header(trials: Sequence[FrozenTrial], metric: str, minimize: bool) -> str:
    counts = Counter(_state(t) for t in trials)
    order = [*STATE_CSS, *sorted(set(counts) - set(STATE_CSS))]
    badges = " ".join(_state_badge(state, f"{state} {counts[state]}") for state in order if counts[state])
    goal = "minimize, lower is better" if minimize else "maximize, higher is better"
    return f"<p>objective <b>{esc(metric)}</b> ({goal}); {len(trials)} trials: {badges or 'none yet'}</p>"


def best_section(best: FrozenTrial | None, trial_dirs: dict[int, Path], page_dir: Path) -> str:
    if best is None:
        return '<p class="missing">no complete trial yet</p>'
    rows = [
        ("trial", best.number),
        ("value", best.value),
        *((f"param {name}", _show_param(value)) for name, value in best.params.items()),
        ("run", _run_links(trial_dirs.get(best.number), page_dir)),
    ]
    return f'<div class="best" data-trial="{best.number}">{key_values(rows)}</div>'


def trials_table(study: optuna.Study, metric: str, trial_dirs: dict[int, Path], page_dir: Path) -> str:
    rows = []
    for row in sweep_summary_rows(study, trial_dirs):
        number = Raw(f'{row["number"]} <span class="pass">best</span>') if row["best"] else row["number"]
        state = row["state"]
        params = ", ".join(f"{k}={_show_param(v)}" for k, v in row["params"].items())
        run_dir = trial_dirs.get(row["number"])
        rows.append(
            [
                number,
                Raw(_state_badge(state, state)),
                row["value"],
                row["last_step"],
                params,
                fmt_duration(row["duration_s"]),
                _run_links(run_dir, page_dir),
            ]
        )
    headers = ["trial", "state", metric, "last step", "params", "duration", "run"]
    return table(headers, rows, css="trials")


# ---------------------------------------------------------------------------- plots


def history_chart(
    trials: Sequence[FrozenTrial], best: FrozenTrial | None, metric: str, minimize: bool
) -> str:
    """Objective per trial number: complete trials as dots, pruned ones as crosses at their last
    intermediate value, failed ones as triangles on the axis, and the best-so-far step line."""
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    if not complete and not pruned:
        return '<p class="missing">no complete or pruned trial to draw yet</p>'
    drawn = [_value(t) for t in complete] + [_stop_value(t) for t in pruned]
    xs = _Scale([t.number for t in trials])
    ys = _Scale([v for v in drawn if v is not None], log=_wants_log(drawn))
    x_of, y_of = _mapper(xs, LEFT, WIDTH - RIGHT), _mapper(ys, HEIGHT - BOTTOM, TOP)
    parts = _frame("sweep_history", f"{metric} per trial", WIDTH, HEIGHT, log=ys.log)
    parts += _axes(xs, ys, x_of, y_of, "trial", integer_x=True)
    parts += _best_so_far(complete, x_of, y_of, minimize)
    for trial in complete:
        is_best = best is not None and trial.number == best.number
        parts.append(_mark("best" if is_best else "complete", trial, _value(trial), x_of, y_of))
    parts += [_mark("pruned", t, _stop_value(t), x_of, y_of) for t in pruned]
    parts += [_mark("failed", t, None, x_of, y_of) for t in trials if t.state == TrialState.FAIL]
    parts.append(
        _legend(
            [
                ("complete", PALETTE[0]),
                ("best so far", BEST_COLOR),
                ("pruned", PRUNED_COLOR),
                ("failed", FAILED_COLOR),
            ]
        )
    )
    return "".join(parts) + "</svg>"


def intermediate_chart(trials: Sequence[FrozenTrial], metric: str) -> str:
    """Each trial's reported values against step; a pruned trial's curve is dashed and ends in a cross."""
    curves = [t for t in trials if t.intermediate_values]
    if not curves:
        return '<p class="missing">no intermediate values (no trial reported its metric during training)</p>'
    values = [v for t in curves for v in t.intermediate_values.values()]
    xs = _Scale([s for t in curves for s in t.intermediate_values], pad=0.0)
    ys = _Scale(values, log=_wants_log(values))
    x_of, y_of = _mapper(xs, LEFT, WIDTH - RIGHT), _mapper(ys, HEIGHT - BOTTOM, TOP)
    parts = _frame("sweep_intermediate", f"{metric} during each trial", WIDTH, HEIGHT, log=ys.log)
    parts += _axes(xs, ys, x_of, y_of, "step")
    for i, trial in enumerate(curves):
        steps = np.asarray(sorted(trial.intermediate_values), dtype=np.int64)
        vals = np.asarray([trial.intermediate_values[s] for s in steps.tolist()], dtype=np.float64)
        keep = downsample(steps, vals)
        points = list(zip(steps[keep].tolist(), vals[keep].tolist(), strict=True))
        parts += _curve(trial, points, PALETTE[i % len(PALETTE)], x_of, y_of)
    note = '<p class="missing">one line per trial; pruned trials dashed, ending in a cross where they were stopped</p>'
    return note + "".join(parts) + "</svg>"


def importance_section(study: optuna.Study) -> tuple[dict[str, float], str]:
    """(importances, html). PED-ANOVA, Optuna 5's default evaluator, named here because fANOVA
    and mean-decrease-impurity need scikit-learn, which lmforge does not install."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    finite = [t for t in complete if _value(t) is not None]
    params = sorted({name for t in finite for name in t.distributions})
    if len(finite) < 2:
        note = f"needs at least 2 complete trials with a finite objective; this study has {len(finite)}"
        return {}, f'<p class="missing">parameter importances: {esc(note)}</p>'
    if len(params) < 2:
        note = f"only one parameter was searched ({', '.join(params) or 'none'}): there is nothing to rank it against"
        return {}, f'<p class="missing">parameter importances: {esc(note)}</p>'
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            importances = optuna.importance.get_param_importances(
                study, evaluator=PedAnovaImportanceEvaluator(), params=params
            )
        except Exception as err:  # a page never fails on its statistics: say why it is absent
            return {}, f'<p class="fail">parameter importances could not be computed: {esc(err)}</p>'
    notes = "".join(f'<p class="missing">{esc(m)}</p>' for m in dict.fromkeys(str(w.message) for w in caught))
    intro = f"<p>PED-ANOVA importance of each parameter for reaching the top 10% of {len(finite)} complete trials</p>"
    return importances, intro + _importance_bars(importances) + notes


def parallel_chart(trials: Sequence[FrozenTrial], order: list[str], metric: str, minimize: bool) -> str:
    """One vertical axis per parameter (most important first) and the objective's last; a line per
    complete trial coloured from best (dark) to worst (light), pruned trials faint and dashed."""
    drawn = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    names = sorted({name for t in drawn for name in t.distributions})
    if not drawn or not names:
        return '<p class="missing">no complete or pruned trial with parameters to draw yet</p>'
    names = [n for n in order if n in names] + [n for n in names if n not in order]
    objective = [_value(t) if t.state == TrialState.COMPLETE else _stop_value(t) for t in drawn]
    axes = [_ParAxis.for_param(name, drawn) for name in names]
    axes.append(_ParAxis(metric, _Scale([v for v in objective if v is not None], log=_wants_log(objective))))
    width = max(WIDTH, 2 * LEFT + AXIS_GAP * (len(axes) - 1))
    xs = [LEFT + i * (width - 2 * LEFT) / max(len(axes) - 1, 1) for i in range(len(axes))]
    parts = _frame("sweep_parallel", f"parameters and {metric}", width, HEIGHT + 40)
    # Colour spans the complete trials only: pruned ones (grey) would squeeze it otherwise.
    finished = [
        v for t, v in zip(drawn, objective, strict=True) if t.state == TrialState.COMPLETE and v is not None
    ]
    colour = _Scale(finished, log=_wants_log(finished), pad=0.0)

    def badness(trial: FrozenTrial, value: float | None) -> float | None:
        frac = None if value is None or trial.state != TrialState.COMPLETE else colour.frac(value)
        return None if frac is None else (frac if minimize else 1 - frac)

    lines = sorted(zip(drawn, objective, strict=True), key=lambda tv: _draw_order(tv[0], badness(*tv)))
    bottom = HEIGHT + 40 - BOTTOM
    for trial, value in lines:
        ys = [axis.y(axis.value_of(trial, value), PAR_TOP, bottom) for axis in axes]
        points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        parts.append(_parallel_line(trial, value, points, badness(trial, value), metric))
    # Axes last, over the lines: their labels stay readable however many trials cross them.
    parts += [axis.render(x, PAR_TOP, bottom) for axis, x in zip(axes, xs, strict=True)]
    return _colour_key(finished, minimize) + "".join(parts) + "</svg>"


def _parallel_line(
    trial: FrozenTrial, value: float | None, points: list[tuple[float, float]], bad: float | None, metric: str
) -> str:
    pruned = trial.state == TrialState.PRUNED
    color = "#999" if bad is None else _ramp(bad)
    style = ' stroke-opacity="0.35" stroke-dasharray="4 3"' if pruned else ""
    recorded = trial.values[0] if trial.values else value
    tip = f"trial {trial.number} ({_state(trial)}): {metric}={_show_param(recorded)}; " + ", ".join(
        f"{k}={_show_param(v)}" for k, v in trial.params.items()
    )
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return (
        f'<polyline class="trial {_state(trial)}" data-trial="{trial.number}" fill="none" '
        f'stroke="{color}" stroke-width="1.5"{style} points="{coords}"><title>{esc(tip)}</title></polyline>'
    )


def _colour_key(values: list[float], minimize: bool) -> str:
    if not values:
        return '<p class="missing">no complete trial with a finite objective: every line is grey</p>'
    best, worst = (min(values), max(values)) if minimize else (max(values), min(values))
    key = "".join(f'<span class="key" style="background:{_ramp(i / 4)}"></span>' for i in range(5))
    return (
        f"<p>line colour: best ({esc(fmt_number(best))}) {key} worst ({esc(fmt_number(worst))}); "
        "pruned trials grey and dashed; failed trials not drawn; a non-finite objective is grey, "
        "its line stopping before the last axis</p>"
    )


# ---------------------------------------------------------------------------- drawing helpers


class _Scale:
    """A value range mapped onto [0, 1], on log10 when asked. Values it cannot place map to None:
    NaN, inf, non-positive on a log scale, and beyond +-1e300 (where a span would overflow)."""

    def __init__(self, values: Iterable[float], *, log: bool = False, pad: float = 0.04) -> None:
        finite = [float(v) for v in values if abs(v) < 1e300 and (v > 0 or not log)]
        self.log = log and bool(finite)
        points = [math.log10(v) for v in finite] if self.log else finite
        lo, hi = (min(points), max(points)) if points else (0.0, 1.0)
        if hi <= lo:
            spread = abs(lo) * 0.05 or 0.5
            lo, hi = lo - spread, hi + spread
        self.lo, self.hi = lo - (hi - lo) * pad, hi + (hi - lo) * pad

    def frac(self, value: float) -> float | None:
        if not abs(value) < 1e300 or (self.log and value <= 0):  # `not <`: NaN too
            return None
        return ((math.log10(value) if self.log else value) - self.lo) / (self.hi - self.lo)

    def ticks(self) -> list[float]:
        if self.log:
            powers = [10.0**e for e in range(math.ceil(self.lo), math.floor(self.hi) + 1)]
            return powers if len(powers) >= 2 else [10**self.lo, 10**self.hi]
        raw = (self.hi - self.lo) / 5
        unit = 10 ** math.floor(math.log10(raw))
        step = next(m * unit for m in (1, 2, 2.5, 5, 10) if m * unit >= raw)
        first = math.ceil(self.lo / step) * step
        return [first + i * step for i in range(int((self.hi - first) / step) + 1)]


@dataclass
class _ParAxis:
    """One axis of the parallel-coordinates plot: numeric (`scale`) or categorical (`choices`)."""

    name: str
    scale: _Scale | None = None
    choices: tuple[Any, ...] = ()
    param: str | None = None  # None: the objective axis

    @classmethod
    def for_param(cls, name: str, trials: Sequence[FrozenTrial]) -> _ParAxis:
        dists: list[BaseDistribution] = [t.distributions[name] for t in trials if name in t.distributions]
        if any(isinstance(d, CategoricalDistribution) for d in dists):
            declared = [c for d in dists if isinstance(d, CategoricalDistribution) for c in d.choices]
            seen = [t.params[name] for t in trials if name in t.params]
            return cls(name, choices=tuple(_unique(declared + seen)), param=name)
        # The search space's bounds, not the sampled range: the plot shows where the sweep looked.
        bounds = [
            float(b) for d in dists for b in (getattr(d, "low", math.nan), getattr(d, "high", math.nan))
        ]
        log = any(getattr(d, "log", False) for d in dists)
        return cls(name, scale=_Scale(bounds, log=log, pad=0.0), param=name)

    def value_of(self, trial: FrozenTrial, objective: float | None) -> Any:
        """The trial's value on this axis; MISSING where the trial never sampled the parameter."""
        return objective if self.param is None else trial.params.get(self.param, MISSING)

    def y(self, value: Any, top: float, bottom: float) -> float | None:
        if value is MISSING:
            return None
        if self.scale is None:  # categorical: None is a choice like any other
            index = _index(self.choices, value)
            frac = (
                None if index is None else (index / (len(self.choices) - 1) if len(self.choices) > 1 else 0.5)
            )
        elif isinstance(value, bool) or not isinstance(value, int | float):
            frac = None
        else:
            frac = self.scale.frac(float(value))
        return None if frac is None else bottom - frac * (bottom - top)

    def render(self, x: float, top: float, bottom: float) -> str:
        if self.scale is None:
            ticks = [(c, _shorten(_show_param(c), 14)) for c in self.choices]
        else:
            ticks = [(t, _tick(t)) for t in self.scale.ticks()]
        labels = "".join(
            f'<text x="{x - 5:.1f}" y="{y + 4:.1f}" class="ty" {HALO}>{esc(text)}</text>'
            for value, text in ticks
            if (y := self.y(value, top, bottom)) is not None
        )
        kind = "categorical" if self.scale is None else ("log" if self.scale.log else "linear")
        title = f"{self.name} ({kind})"
        return (
            f'<g class="axis {kind}" data-param="{esc(self.name)}">'
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#555"/>{labels}'
            f'<text x="{x:.1f}" y="{top - 12}" class="tx">{esc(_shorten(self.name, LABEL_CHARS))}'
            f"{' (log)' if kind == 'log' else ''}<title>{esc(title)}</title></text></g>"
        )


def _frame(metric: str, title: str, width: int, height: int, *, log: bool = False) -> list[str]:
    return [
        f'<svg class="plot" data-metric="{esc(metric)}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{esc(title)}">',
        f'<text x="{LEFT}" y="16" class="ct">{esc(title)}{" (log scale)" if log else ""}</text>',
    ]


def _mapper(scale: _Scale, start: float, end: float) -> Place:
    """value -> pixel along one axis (None for a value the scale cannot place)."""

    def place(value: float) -> float | None:
        frac = scale.frac(value)
        return None if frac is None else start + frac * (end - start)

    return place


def _axes(
    xs: _Scale, ys: _Scale, x_of: Place, y_of: Place, x_label: str, *, integer_x: bool = False
) -> list[str]:
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="#fff" stroke="#ccc"/>']
    for tick in xs.ticks():
        if (x := x_of(tick)) is not None and (not integer_x or tick == int(tick)):
            parts.append(f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" class="tx">{_tick(tick)}</text>')
    for tick in ys.ticks():
        if (y := y_of(tick)) is not None:
            parts.append(
                f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#eee"/>'
                f'<text x="{LEFT - 6}" y="{y + 4:.1f}" class="ty">{_tick(tick)}</text>'
            )
    parts.append(f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 2}" class="ty">{esc(x_label)}</text>')
    return parts


def _best_so_far(complete: list[FrozenTrial], x_of: Place, y_of: Place, minimize: bool) -> list[str]:
    """A step line through the best objective seen up to each complete trial."""
    points: list[str] = []
    best: float | None = None
    for trial in complete:
        value = trial.values[0] if trial.values else math.nan
        if math.isnan(value):
            continue
        if best is None or (value < best if minimize else value > best):
            best = value
        x, y = x_of(trial.number), y_of(best)
        if x is None or y is None:
            continue  # an infinite best: the line stops; the mark at the edge says why
        if points:
            points.append(f"{x:.1f},{points[-1].split(',')[1]}")
        points.append(f"{x:.1f},{y:.1f}")
    if not points:
        return []
    return [
        f'<polyline class="best-so-far" fill="none" stroke="{BEST_COLOR}" stroke-width="1.5" '
        f'points="{" ".join(points)}"><title>best so far</title></polyline>'
    ]


def _mark(kind: str, trial: FrozenTrial, value: float | None, x_of: Place, y_of: Place) -> str:
    """A trial on the history plot: a dot, a cross where a pruned trial stopped, a triangle on the
    bottom edge for a failed trial and on the top edge for a value that cannot be placed (NaN, inf)."""
    x, y = x_of(trial.number), None if value is None else y_of(value)
    if x is None:  # trial numbers are finite: never, but the type says it could be
        return ""
    recorded = trial.values[0] if trial.values else value
    tip = f"trial {trial.number} {_state(trial)}: {_show_param(recorded)}"
    if kind == "failed":
        tip = f"trial {trial.number} failed"
    if kind == "pruned":
        tip = f"trial {trial.number} pruned at step {trial.last_step}: {_show_param(value)}"
    head = f'class="trial {kind}" data-trial="{trial.number}"'
    title = f"<title>{esc(tip)}</title>"
    if kind == "failed":
        return f'<path {head} d="M{x:.1f} {HEIGHT - BOTTOM} l-4 -9 h8 z" fill="{FAILED_COLOR}">{title}</path>'
    if y is None:
        color = PRUNED_COLOR if kind == "pruned" else NONFINITE_COLOR
        return f'<path {head} d="M{x:.1f} {TOP + 1} l-4 9 h8 z" fill="{color}">{title}</path>'
    if kind == "pruned":
        cross = f"M{x - 4:.1f} {y - 4:.1f} l8 8 m0 -8 l-8 8"
        return f'<path {head} d="{cross}" stroke="{PRUNED_COLOR}" stroke-width="2">{title}</path>'
    color, radius = (BEST_COLOR, 5) if kind == "best" else (PALETTE[0], 3)
    return f'<circle {head} cx="{x:.1f}" cy="{y:.1f}" r="{radius}" fill="{color}">{title}</circle>'


def _curve(
    trial: FrozenTrial, points: list[tuple[int, float]], color: str, x_of: Place, y_of: Place
) -> list[str]:
    state, pruned = _state(trial), trial.state == TrialState.PRUNED
    segments: list[list[str]] = [[]]
    parts = []
    for step, value in points:
        x, y = x_of(step), y_of(value)
        if y is None:  # NaN/inf: break the line, mark the step on the top edge
            segments.append([])
            parts.append(
                f'<path class="nonfinite" d="M{x:.1f} {TOP + 1} l-4 9 h8 z" fill="{NONFINITE_COLOR}">'
                f"<title>{esc(f'trial {trial.number} step {step}: {value}')}</title></path>"
            )
        else:
            segments[-1].append(f"{x:.1f},{y:.1f}")
    dash = ' stroke-dasharray="5 3"' if pruned else ""
    title = f"<title>{esc(f'trial {trial.number} ({state})')}</title>"
    lines = [
        f'<polyline class="curve {state}" data-trial="{trial.number}" fill="none" stroke="{color}" '
        f'stroke-width="1.3"{dash} points="{" ".join(seg)}">{title}</polyline>'
        for seg in segments
        if seg
    ]
    for seg in segments:  # a point with no neighbour draws no line: a dot instead
        if len(seg) == 1:
            x, y = (float(c) for c in seg[0].split(","))
            lines.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}">{title}</circle>')
    if pruned and segments[-1]:
        x, y = (float(c) for c in segments[-1][-1].split(","))
        tip = esc(f"trial {trial.number} pruned at step {trial.last_step}")
        lines.append(
            f'<path class="pruned-end" data-trial="{trial.number}" d="M{x - 4:.1f} {y - 4:.1f} l8 8 m0 -8 l-8 8" '
            f'stroke="{PRUNED_COLOR}" stroke-width="2"><title>{tip}</title></path>'
        )
    return lines + parts


def _importance_bars(importances: dict[str, float]) -> str:
    label_w, row_h = 180, 22
    height = TOP + row_h * len(importances) + 10
    bar_w = WIDTH - label_w - RIGHT - 50
    top = max(importances.values(), default=0.0) or 1.0
    parts = _frame("sweep_importance", "parameter importance (PED-ANOVA, sums to 1)", WIDTH, height)
    for i, (name, value) in enumerate(importances.items()):
        y = TOP + i * row_h
        width = bar_w * value / top if math.isfinite(value) else 0.0
        parts.append(
            f'<g class="importance" data-param="{esc(name)}">'
            f'<text x="{label_w - 6}" y="{y + 14}" class="ty">{esc(_shorten(name, LABEL_CHARS))}</text>'
            f'<rect x="{label_w}" y="{y + 3}" width="{width:.1f}" height="{row_h - 6}" fill="{PALETTE[0]}"/>'
            f'<text x="{label_w + width + 4:.1f}" y="{y + 14}">{esc(fmt_number(value))}</text>'
            f"<title>{esc(f'{name}: {value}')}</title></g>"
        )
    return "".join(parts) + "</svg>"


def _legend(entries: list[tuple[str, str]], y: int = 11) -> str:
    """Colour keys along the top right of a WIDTH-wide chart."""
    parts, x = [], WIDTH - RIGHT
    for label, color in reversed(entries):
        x -= 7 * len(label) + 18
        parts.append(
            f'<rect x="{x}" y="{y - 2}" width="10" height="3" fill="{color}"/>'
            f'<text x="{x + 14}" y="{y + 4}">{esc(label)}</text>'
        )
    return "".join(parts)


# ---------------------------------------------------------------------------- small pieces


def _check_single_objective(study: optuna.Study) -> None:
    if len(study.directions) != 1:
        raise ValueError(
            f"the sweep page draws one objective; study {study.study_name!r} has {len(study.directions)}"
        )


def _best_trial(study: optuna.Study) -> FrozenTrial | None:
    try:
        return study.best_trial
    except ValueError:  # no complete trial yet
        return None


def _state_badge(state: str, text: str) -> str:
    return f'<span class="status {STATE_CSS.get(state, "warn")}" data-state="{esc(state)}">{esc(text)}</span>'


def _state(trial: FrozenTrial) -> str:
    return STATE_NAMES.get(trial.state, trial.state.name.lower())


def _value(trial: FrozenTrial) -> float | None:
    """A complete trial's objective when it is finite."""
    value = trial.values[0] if trial.values else None
    return value if value is not None and math.isfinite(value) else None


def _last_intermediate(trial: FrozenTrial) -> float | None:
    step = trial.last_step
    return None if step is None else trial.intermediate_values[step]


def _stop_value(trial: FrozenTrial) -> float | None:
    """Where a pruned trial stopped: its last intermediate value, else what Optuna recorded."""
    for value in (_last_intermediate(trial), trial.values[0] if trial.values else None):
        if value is not None and math.isfinite(value):
            return value
    return None


def _wants_log(values: Iterable[float | None]) -> bool:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) / min(finite) > LOG_RATIO


def _draw_order(trial: FrozenTrial, badness: float | None) -> tuple[int, float]:
    """Pruned first (underneath), then complete from worst to best: the best line is on top."""
    if trial.state == TrialState.PRUNED:
        return (0, 0.0)
    return (1, -(badness if badness is not None else 2.0))


def _ramp(frac: float) -> str:
    position = min(max(frac, 0.0), 1.0) * (len(RAMP) - 1)
    i = min(int(position), len(RAMP) - 2)
    t = position - i
    rgb = (round(a + (b - a) * t) for a, b in zip(RAMP[i], RAMP[i + 1], strict=True))
    return "#" + "".join(f"{c:02x}" for c in rgb)


def _index(choices: tuple[Any, ...], value: Any) -> int | None:
    """Position of `value` among categorical choices; 1 and True are different choices."""
    for i, choice in enumerate(choices):
        if type(choice) is type(value) and choice == value:
            return i
    return None


def _unique(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for value in values:
        if _index(tuple(out), value) is None:
            out.append(value)
    return out


def _show_param(value: Any) -> str:
    return fmt_number(value) if isinstance(value, float) else str(value)


def _tick(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value:.2g}" if abs(value) >= 1e5 or abs(value) < 1e-3 else f"{value:.4g}"


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _run_links(run_dir: Path | None, page_dir: Path) -> Raw:
    """The trial's run directory and its report.html, linked relative to the page."""
    if run_dir is None:
        return Raw('<span class="missing">no run directory</span>')
    href = _relative_href(Path(run_dir), page_dir)
    link = f'<a href="{esc(href)}/">{esc(run_dir)}</a>'
    if (Path(run_dir) / REPORT_NAME).is_file():
        link += f' (<a href="{esc(href)}/{REPORT_NAME}">report</a>)'
    return Raw(link)


def _relative_href(target: Path, start: Path) -> str:
    try:
        relative = os.path.relpath(os.path.abspath(target), os.path.abspath(start))
    except ValueError:  # another drive (Windows): no relative path exists
        return target.resolve().as_uri()
    return quote(Path(relative).as_posix())  # quoted: a ':' in a name never reads as a scheme
