"""Inline SVG line charts: no JavaScript, no library, render in any browser offline.

Large runs are downsampled for drawing (`downsample`): each bucket keeps its minimum and
maximum, and every NaN/inf point and every event's step are always kept, so a spike or a
bad step never disappears from the picture.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape

import numpy as np

MAX_BUCKETS = 1500  # per series: at most ~2 points per bucket are drawn
WIDTH, HEIGHT = 640, 230
LEFT, RIGHT, TOP, BOTTOM = 64, 14, 30, 30
LOG_RATIO = 200.0  # a positive series spanning more than this ratio is drawn on a log axis
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
EVENT_COLORS = {
    "nonfinite": "#d62728",
    "spike": "#ff7f0e",
    "skip": "#bcbd22",
    "rollback": "#9467bd",
    "oom_backoff": "#8c564b",
    "oom_ladder": "#5a3427",
    "stall": "#7f7f7f",
    "data_bound": "#17becf",
    "signal": "#1f77b4",
    "alert_sent": "#e377c2",
    "failed": "#a00000",
    "stopped": "#a00000",
}
NONFINITE_COLOR = "#d62728"


@dataclass
class Line:
    label: str
    steps: np.ndarray
    values: np.ndarray
    color: str
    dots: bool = False  # sparse series (eval): draw each point


@dataclass
class Marker:
    step: int
    kind: str
    text: str


@dataclass
class Chart:
    title: str
    metric: str  # data-metric attribute (tests and in-page measurement find charts by it)
    lines: list[Line]
    markers: list[Marker] = field(default_factory=list)
    log_ok: bool = True  # False for shares and fractions, which read best on a linear axis


def downsample(steps: np.ndarray, values: np.ndarray, keep_steps: np.ndarray | None = None) -> np.ndarray:
    """Indices to draw: per bucket the min and max, plus first/last, non-finite points and `keep_steps`."""
    n = len(values)
    if n <= 2 * MAX_BUCKETS:
        return np.arange(n)
    bucket = np.arange(n) * MAX_BUCKETS // n
    finite = np.isfinite(values)
    low = np.where(finite, values, np.inf)
    order = np.lexsort((low, bucket))  # by bucket, then value: the first of a bucket is its minimum
    starts = np.flatnonzero(np.r_[True, bucket[order][1:] != bucket[order][:-1]])
    ends = np.r_[starts[1:], n] - 1
    high = np.where(finite, values, -np.inf)
    order_high = np.lexsort((high, bucket))  # the last of a bucket is its maximum
    keep = [order[starts], order_high[ends], np.flatnonzero(~finite), np.array([0, n - 1])]
    if keep_steps is not None and len(keep_steps):
        keep.append(np.flatnonzero(np.isin(steps, keep_steps)))
    return np.unique(np.concatenate(keep))


def render_chart(chart: Chart) -> str:
    """One <svg class="plot"> with axes, lines, NaN/inf marks and event markers."""
    lines = [line for line in chart.lines if len(line.steps)]
    if not lines:
        return f'<p class="missing">{escape(chart.title)}: not recorded in metrics.jsonl</p>'
    keep = np.asarray(sorted({m.step for m in chart.markers}), dtype=np.int64)
    drawn = []
    for line in lines:
        idx = downsample(line.steps, line.values, keep)
        drawn.append(Line(line.label, line.steps[idx], line.values[idx], line.color, line.dots))
    all_steps = np.concatenate([d.steps for d in drawn])
    x0, x1 = float(all_steps.min()), float(all_steps.max())
    if x1 <= x0:
        x1 = x0 + 1.0
    finite = np.concatenate([d.values[np.isfinite(d.values)] for d in drawn])
    scale = _YScale(finite, chart.log_ok)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x_of(step: float) -> float:
        return LEFT + (step - x0) / (x1 - x0) * plot_w

    parts = _frame(chart.metric, chart.title, " (log scale)" if scale.log else "")
    parts += _axes(x0, x1, scale, x_of, plot_h)
    parts += _event_markers(chart.markers, x0, x1, x_of)
    for line in drawn:
        parts += _line(line, x_of, scale, plot_h)
    parts += _legend(drawn)
    parts.append("</svg>")
    return "".join(parts)


class _YScale:
    def __init__(self, finite: np.ndarray, log_ok: bool) -> None:
        lo, hi = (float(finite.min()), float(finite.max())) if len(finite) else (0.0, 1.0)
        self.log = log_ok and lo > 0 and hi / lo > LOG_RATIO
        if self.log:
            lo, hi = math.log10(lo), math.log10(hi)
        if hi <= lo:
            pad = abs(lo) * 0.05 or 0.5
            lo, hi = lo - pad, hi + pad
        pad = (hi - lo) * 0.04
        self.lo, self.hi = lo - pad, hi + pad

    def frac(self, value: float) -> float:
        v = math.log10(value) if self.log else value
        return (v - self.lo) / (self.hi - self.lo)

    def ticks(self) -> list[float]:
        if self.log:
            return [10.0**e for e in range(math.ceil(self.lo), math.floor(self.hi) + 1)]
        return _nice_ticks(self.lo, self.hi)


def _axes(x0: float, x1: float, scale: _YScale, x_of: Callable[[float], float], plot_h: int) -> list[str]:
    parts = []
    for tick in _nice_ticks(x0, x1):
        x = x_of(tick)
        parts.append(
            f'<line x1="{x:.1f}" y1="{TOP + plot_h}" x2="{x:.1f}" y2="{TOP + plot_h + 4}" stroke="#888"/>'
            f'<text x="{x:.1f}" y="{TOP + plot_h + 16}" class="tx">{_fmt(tick)}</text>'
        )
    for tick in scale.ticks():
        y = TOP + plot_h * (1 - scale.frac(tick))
        parts.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#eee"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" class="ty">{_fmt(tick)}</text>'
        )
    parts.append(f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 2}" class="ty">step</text>')
    return parts


def _line(line: Line, x_of: Callable[[float], float], scale: _YScale, plot_h: int) -> list[str]:
    """The polyline (broken at NaN/inf, which get a mark at the top edge), dots for sparse series."""
    segments: list[list[str]] = [[]]
    marks, dots = [], []
    for step, value in zip(line.steps.tolist(), line.values.tolist(), strict=True):
        x = x_of(step)
        if not math.isfinite(value) or (scale.log and value <= 0):
            segments.append([])
            marks.append(
                f'<path class="nonfinite" d="M{x:.1f} {TOP + 1} l-4 9 h8 z" fill="{NONFINITE_COLOR}">'
                f"<title>step {step}: {escape(line.label)} = {value}</title></path>"
            )
            continue
        y = TOP + plot_h * (1 - scale.frac(value))
        segments[-1].append(f"{x:.1f},{y:.1f}")
        if line.dots:
            dots.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{line.color}">'
                f"<title>step {step}: {escape(line.label)} = {_fmt(value)}</title></circle>"
            )
    parts = [
        f'<polyline class="series" fill="none" stroke="{line.color}" stroke-width="1.3" points="{" ".join(seg)}"/>'
        for seg in segments
        if seg
    ]
    return parts + dots + marks


def _event_markers(markers: list[Marker], x0: float, x1: float, x_of: Callable[[float], float]) -> list[str]:
    """A dashed vertical line per event; events on the same pixel column and kind share one line."""
    grouped: dict[tuple[int, str], list[Marker]] = {}
    for marker in markers:
        if x0 <= marker.step <= x1:
            grouped.setdefault((round(x_of(marker.step)), marker.kind), []).append(marker)
    parts: list[str] = []
    stacked = dict.fromkeys((x for x, _ in grouped), 0)
    for (x, kind), group in sorted(grouped.items()):
        level = stacked[x]  # kinds at the same step stack their squares upwards
        stacked[x] += 1
        color = EVENT_COLORS.get(kind, "#333")
        first = group[0]
        label = f"step {first.step} {kind}: {first.text}"
        if len(group) > 1:
            label = f"{len(group)} {kind} events, steps {first.step}-{group[-1].step}; first: {first.text}"
        parts.append(
            f'<g class="event" data-kind="{escape(kind)}" data-step="{first.step}">'
            f'<line x1="{x}" y1="{TOP}" x2="{x}" y2="{HEIGHT - BOTTOM}" stroke="{color}" stroke-dasharray="4 3"/>'
            f'<rect x="{x - 3}" y="{HEIGHT - BOTTOM - 7 - 8 * level}" width="7" height="7" fill="{color}"/>'
            f"<title>{escape(label)}</title></g>"
        )
    return parts


def _legend(lines: list[Line]) -> list[str]:
    parts, x = [], WIDTH - RIGHT
    for line in reversed(lines):
        text = escape(line.label)
        width = 7 * len(line.label) + 18
        x -= width
        parts.append(
            f'<rect x="{x}" y="9" width="10" height="3" fill="{line.color}"/>'
            f'<text x="{x + 14}" y="15" class="lg">{text}</text>'
        )
    return parts


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    span = hi - lo
    if span <= 0 or not math.isfinite(span):
        return [lo]
    raw = span / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e5 or abs(value) < 1e-3:
        return f"{value:.2g}"
    return f"{value:.4g}"


def _frame(metric: str, title: str, suffix: str = "") -> list[str]:
    """The opening of every chart: the <svg> element, the plot area and the title."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    return [
        f'<svg class="plot" data-metric="{escape(metric)}" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="#fff" stroke="#ccc"/>',
        f'<text x="{LEFT}" y="16" class="ct">{escape(title)}{suffix}</text>',
    ]


def render_histogram(title: str, metric: str, edges: list[float], counts: list[float]) -> str:
    """A bar chart of `counts` over the bins `edges` (len(edges) == len(counts) + 1)."""
    if len(counts) == 0 or len(edges) != len(counts) + 1:
        return f'<p class="missing">{escape(title)}: no histogram recorded</p>'
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top = max(max(counts), 1)
    x0, x1 = float(edges[0]), float(edges[-1]) if edges[-1] > edges[0] else float(edges[0]) + 1

    def x_of(value: float) -> float:
        return LEFT + (value - x0) / (x1 - x0) * plot_w

    parts = _frame(metric, title)
    for lo, hi, count in zip(edges[:-1], edges[1:], counts, strict=True):
        height = plot_h * count / top
        parts.append(
            f'<rect class="bar" x="{x_of(lo):.1f}" y="{TOP + plot_h - height:.1f}" '
            f'width="{max(x_of(hi) - x_of(lo) - 1, 1):.1f}" height="{height:.1f}" fill="{PALETTE[0]}">'
            f"<title>{_fmt(lo)}-{_fmt(hi)}: {int(count)}</title></rect>"
        )
    for tick in _nice_ticks(x0, x1):
        parts.append(f'<text x="{x_of(tick):.1f}" y="{TOP + plot_h + 16}" class="tx">{_fmt(tick)}</text>')
    parts.append(f'<text x="{LEFT - 6}" y="{TOP + 10}" class="ty">{int(top)}</text>')
    parts.append(f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 2}" class="ty">tokens</text></svg>')
    return "".join(parts)
