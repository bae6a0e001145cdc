"""Report sections of the opt-in observability: the profiled window's top ops (profile/top_ops.json)
and the weight / gradient summary of the histogram steps (histograms.jsonl). Each returns its
whole section, heading included, or "" when the run has nothing for it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lmforge.monitor.metrics import read_step_records
from lmforge.report.html import esc, table
from lmforge.run_layout import RunPaths, read_json_object

TOP_OPS_FILE = "top_ops.json"  # written by train/profiling.py
SHOWN_OPS = 20
SHOWN_PARAMETERS = 20  # the tensors whose statistics changed most


def profile_section(root: Path) -> str:
    """'Profiler: top ops': where the traces are and how to open them, the time of each profiled
    step, and the ops that took the most time (CPU, device, communication)."""
    paths = RunPaths(root)
    summary = read_json_object(paths.profile / TOP_OPS_FILE)
    if not summary:
        return ""
    steps = [s for s in summary.get("steps") or [] if isinstance(s, int)]
    window = f"steps {steps[0]}-{steps[-1]}" if steps else "the profiled steps"
    traces = sorted(p.name for p in paths.profile.glob("trace-rank*.json"))
    parts = [
        "<h2>Profiler: top ops</h2>",
        f"<p>torch.profiler over {esc(window)} (rank {esc(summary.get('rank', 0))}, "
        f"{esc(summary.get('device', 'cpu'))}). Traces: {esc(', '.join(traces) or 'none left')} in "
        f"{esc(paths.profile)}: open one in https://ui.perfetto.dev or chrome://tracing; "
        f"<code>tensorboard --logdir {esc(paths.tensorboard)}</code> shows run "
        "<code>profile</code> with the torch-tb-profiler plugin installed.</p>",
    ]
    step_ms = summary.get("step_ms")
    if isinstance(step_ms, dict) and step_ms:
        parts.append(table(["step", "wall time ms"], [[k, _float(v)] for k, v in step_ms.items()]))
    device = summary.get("device") == "cuda"
    for title, key in (
        ("By self CPU time", "top_cpu"),
        ("By self device time", "top_device"),
        ("Communication", "communication"),
    ):
        rows = [op for op in summary.get(key) or [] if isinstance(op, dict)][:SHOWN_OPS]
        if rows or key == "communication":
            parts.append(f"<h3>{esc(title)}</h3>")
            parts.append(_ops_table(rows, device=device) if rows else _no_communication())
    return "".join(parts)


def _ops_table(ops: list[dict[str, Any]], *, device: bool) -> str:
    headers = ["op", "calls", "self CPU ms", "CPU total ms", "self CPU memory MB"]
    if device:
        headers += ["self device ms", "device total ms", "self device memory MB"]
    rows = []
    for op in ops:
        row = [op.get("name", "?"), op.get("count"), *(_float(op.get(k)) for k in _CPU_KEYS)]
        if device:
            row += [_float(op.get(k)) for k in _DEVICE_KEYS]
        rows.append(row)
    return table(headers, rows, css="ops")


_CPU_KEYS = ("self_cpu_ms", "cpu_total_ms", "self_cpu_memory_mb")
_DEVICE_KEYS = ("self_device_ms", "device_total_ms", "self_device_memory_mb")


def _no_communication() -> str:
    return '<p class="missing">no communication ops in the window (a single-process run)</p>'


def histograms_section(root: Path) -> str:
    """'Histograms summary': for the tensors whose statistics moved most between the first and the
    last histogram step, the std and abs max of the weights and of the gradients, first vs last."""
    records = read_histogram_summary(RunPaths(root).histograms)
    if not records:
        return ""
    first, last = records[0], records[-1]
    rows = []
    for name in last.get("weights", {}).keys() | last.get("grads", {}).keys():
        w0, w1 = _stats(first, "weights", name), _stats(last, "weights", name)
        g0, g1 = _stats(first, "grads", name), _stats(last, "grads", name)
        change = max(_relative_change(w0[1], w1[1]), _relative_change(w0[2], w1[2]))
        rows.append((change, [name, w0[1], w1[1], w0[2], w1[2], g0[1], g1[1], g0[2], g1[2]]))
    rows.sort(key=lambda row: row[0], reverse=True)
    headers = ["tensor", "weight std (first)", "weight std (last)", "weight |max| (first)"]
    headers += ["weight |max| (last)", "grad std (first)", "grad std (last)", "grad |max| (first)"]
    headers += ["grad |max| (last)"]
    shown = len(rows[:SHOWN_PARAMETERS])
    return (
        "<h2>Histograms summary</h2>"
        f"<p>{len(records)} histogram steps, {esc(first['step'])} to {esc(last['step'])}; the {shown} of "
        f"{len(rows)} tensors whose weight std or abs max changed most (whole tensors, rank 0's part of a "
        "sharded one). The histograms themselves are in TensorBoard (weights/..., grads/...).</p>"
        + table(headers, [row for _, row in rows[:SHOWN_PARAMETERS]], css="histograms")
    )


def read_histogram_summary(path: Path) -> list[dict[str, Any]]:
    """The lines of histograms.jsonl, in step order (torn or foreign lines skipped)."""
    records = read_step_records(path)
    return sorted(records, key=lambda r: r["step"])


def _stats(record: dict[str, Any], kind: str, name: str) -> list[float | None]:
    """[mean, std, abs max] of one tensor in one summary line; None where absent."""
    values = (record.get(kind) or {}).get(name)
    if not isinstance(values, list) or len(values) != 3:
        return [None, None, None]
    return [_float(v) for v in values]


def _relative_change(before: float | None, after: float | None) -> float:
    if before is None or after is None:  # listed last
        return -1.0
    if not (math.isfinite(before) and math.isfinite(after)):  # gone non-finite: listed first
        return math.inf
    return abs(after - before) / max(abs(before), 1e-12)


def _float(value: Any) -> float | None:
    """A number from a JSON file (metrics.jsonl writes non-finite values as strings)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None
