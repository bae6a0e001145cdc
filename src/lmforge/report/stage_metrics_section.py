"""The report's sections for metrics that only some stages record: online RL (reward, KL,
entropy, completion lengths, clip fractions; TRL's GRPO / RLOO names) and Mixture-of-Experts
(router losses, expert load). A run whose metrics.jsonl holds none of them shows neither.

The families are matched by key prefix, so a stage that logs a new metric of its family is
charted without a change here.
"""

from __future__ import annotations

from lmforge.monitor.metrics import RL_METRIC_PREFIXES
from lmforge.report.html import esc
from lmforge.report.load import RunSummary
from lmforge.report.moe_section import expert_load_section
from lmforge.report.plots import PALETTE, Chart, Line, render_chart

MOE_TITLE = "Mixture of experts"
# (section title, key prefixes); a key belongs to the first family whose prefix it starts with.
# The per-layer, per-expert counts (moe/layer{i}/...) are tables after the MoE charts, not charts.
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Reinforcement learning", RL_METRIC_PREFIXES),
    (MOE_TITLE, ("moe_", "aux_loss", "router_", "expert_")),
)
MAX_CHARTS = 16  # per family: a page stays readable whatever a stage logs


def stage_metric_keys(run: RunSummary, prefixes: tuple[str, ...]) -> list[str]:
    """The run's metric keys of one family (eval_ variants included), sorted."""
    return sorted(
        key
        for key in run.series
        if key.removeprefix("eval_").startswith(prefixes) and len(run.series[key].steps)
    )


def stage_metrics_sections(run: RunSummary) -> str:
    """One <h2> section per family the run recorded, with one chart per metric; "" for none."""
    parts = []
    for title, prefixes in FAMILIES:
        keys = stage_metric_keys(run, prefixes)
        tables = expert_load_section(run) if title == MOE_TITLE else ""
        if not keys and not tables:
            continue
        charts = [
            render_chart(
                Chart(
                    key,
                    f"stage_{key}",
                    [Line(key, run.series[key].steps, run.series[key].values, PALETTE[0])],
                    log_ok=False,
                )
            )
            for key in keys[:MAX_CHARTS]
        ]
        more = len(keys) - MAX_CHARTS
        note = f'<p class="missing">{more} more in metrics.jsonl</p>' if more > 0 else ""
        parts.append(f'<h2>{esc(title)}</h2><div class="charts">{"".join(charts)}</div>{note}{tables}')
    return "".join(parts)
