"""The expert-load tables of the report's Mixture-of-Experts section: for each MoE layer, the share
of routed tokens each expert took (summed over the logged steps, and at the last one), shaded by
how far it is from an even share, with the layer's max/mean and coefficient of variation.

Read from metrics.jsonl's `moe/layer{i}/expert{j}_tokens` (train/moe_metrics.py writes them).
"""

from __future__ import annotations

import re
import statistics

import numpy as np

from lmforge.report.html import Raw, esc, fmt_number, table
from lmforge.report.load import RunSummary

EXPERT_KEY = re.compile(r"^moe/layer(\d+)/expert(\d+)_tokens$")
DROPPED_KEY = "moe_dropped_tokens"  # only a family with a capacity factor could record it


def expert_load_section(run: RunSummary) -> str:
    """The tables and the routing note; "" when the run recorded no per-expert counts."""
    cells: dict[int, dict[int, np.ndarray]] = {}
    for key, series in run.series.items():
        match = EXPERT_KEY.match(key)
        if match and len(series.values):
            cells.setdefault(int(match.group(1)), {})[int(match.group(2))] = series.values
    if not cells:
        return ""
    steps = max(len(row) for layer in cells.values() for row in layer.values())
    parts = [
        "<h3>Expert load: share of routed tokens per expert</h3>",
        f"<p>Each token counts once per expert it is routed to (top-k), real tokens only. Summed over "
        f"the {esc(steps)} logged steps:</p>",
        _load_table(
            {layer: {e: float(np.nansum(v)) for e, v in row.items()} for layer, row in cells.items()}
        ),
        "<p>At the last logged step:</p>",
        _load_table({layer: {e: float(v[-1]) for e, v in row.items()} for layer, row in cells.items()}),
        _dropped_note(run),
    ]
    return "".join(parts)


def _load_table(loads: dict[int, dict[int, float]]) -> str:
    experts = sorted({e for row in loads.values() for e in row})
    rows = []
    for layer in sorted(loads):
        counts = [loads[layer].get(e, 0.0) for e in experts]
        total, mean = sum(counts), statistics.fmean(counts)
        shares = [_share_cell(c, total, len(experts)) for c in counts]
        imbalance = [max(counts) / mean, statistics.pstdev(counts) / mean] if mean > 0 else ["", ""]
        rows.append([f"layer {layer}", *shares, *imbalance, int(total)])
    return table(["", *(f"expert {e}" for e in experts), "max/mean", "CV", "tokens x top-k"], rows, css="moe")


def _share_cell(count: float, total: float, experts: int) -> Raw:
    """The expert's share, red above the even share 1/experts, blue below (full colour at 2x / 0x)."""
    if total <= 0:
        return Raw('<span class="missing">0</span>')
    share = count / total
    skew = max(-1.0, min(1.0, share * experts - 1.0))
    colour = f"rgba(176,32,32,{skew:.2f})" if skew > 0 else f"rgba(74,111,165,{-skew:.2f})"
    return Raw(
        f'<span style="display:block;background:{colour}" title="{esc(fmt_number(int(count)))} tokens">'
        f"{share:.1%}</span>"
    )


def _dropped_note(run: RunSummary) -> str:
    dropped = run.last_finite(DROPPED_KEY)
    if dropped is not None:
        return (
            f"<p>Tokens dropped past expert capacity at step {dropped[0]}: {esc(fmt_number(dropped[1]))}</p>"
        )
    return (
        '<p class="missing">No dropped tokens recorded: this model routes dropless (no capacity factor), '
        "so every token reaches its top-k experts.</p>"
    )
