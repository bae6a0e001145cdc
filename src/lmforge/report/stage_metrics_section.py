"""The report's sections for metrics that only some stages record: online RL (reward, KL,
entropy, completion lengths, clip fractions; TRL's GRPO / RLOO names), a reward model's pairwise
accuracy and margin (TRL's RewardTrainer), and Mixture-of-Experts (router losses, expert load). A run whose metrics.jsonl holds none of them shows neither.

The families are matched by key prefix, so a stage that logs a new metric of its family is
charted without a change here.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import numpy as np

from lmforge.config.stages import RL_METRIC_PREFIXES, RM_METRIC_PREFIXES
from lmforge.report.html import esc
from lmforge.report.load import RunSummary
from lmforge.report.moe_section import expert_load_section
from lmforge.report.plots import PALETTE, Chart, Line, render_chart

MOE_TITLE = "Mixture of experts"
RL_TITLE = "Reinforcement learning"
RM_TITLE = "Reward model: pairwise accuracy and margin"
# (section title, key prefixes); a key belongs to the first family whose prefix it starts with.
# The per-layer, per-expert counts (moe/layer{i}/...) are tables after the MoE charts, not charts.
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (RL_TITLE, RL_METRIC_PREFIXES),
    (RM_TITLE, RM_METRIC_PREFIXES),
    (MOE_TITLE, ("moe_", "aux_loss", "router_", "expert_")),
)
MAX_CHARTS = 16  # per family: a page stays readable whatever a stage logs
# The RL charts in the order a reader asks: is the reward rising (total, then each reward), is it
# still learning (spread, groups without signal), how far from the start (KL, entropy), then the
# completions and the clip fractions. Metrics matching none come after; flat series come last.
RL_ORDER = (
    "reward",
    "rewards/*/mean",
    "reward_std",
    "rewards/*/std",
    "frac_reward_zero_std",
    "kl",
    "entropy",
    "completions/mean_length",
    "completions/*",
    "clip_ratio*",
)


def stage_metric_keys(run: RunSummary, prefixes: tuple[str, ...]) -> list[str]:
    """The run's metric keys of one family (eval_ variants included), sorted."""
    return sorted(
        key
        for key in run.series
        if key.removeprefix("eval_").startswith(prefixes) and len(run.series[key].steps)
    )


def rl_chart_order(run: RunSummary, keys: list[str]) -> list[str]:
    """`keys` in RL_ORDER, each metric's train series before its eval_ series; series that never
    change (a clip ratio that stays 0) after every other."""

    def rank(key: str) -> tuple[bool, int, str, bool]:
        name = key.removeprefix("eval_")
        place = next((i for i, pattern in enumerate(RL_ORDER) if fnmatchcase(name, pattern)), len(RL_ORDER))
        return (_flat(run, key), place, name, key.startswith("eval_"))

    return sorted(keys, key=rank)


def rm_chart_order(keys: list[str]) -> list[str]:
    """The held-out pairs' figures first (whether the model ranks pairs it never saw), each in
    RM_METRIC_PREFIXES' order: accuracy, margin, then the scores."""

    def rank(key: str) -> tuple[bool, int]:
        name = key.removeprefix("eval_")
        return (
            not key.startswith("eval_"),
            next(i for i, p in enumerate(RM_METRIC_PREFIXES) if name.startswith(p)),
        )

    return sorted(keys, key=rank)


def _flat(run: RunSummary, key: str) -> bool:
    values = run.series[key].finite()
    return len(values) > 1 and bool(np.all(values == values[0]))


def stage_metrics_sections(run: RunSummary) -> str:
    """One <h2> section per family the run recorded, with one chart per metric; "" for none."""
    parts = []
    for title, prefixes in FAMILIES:
        keys = stage_metric_keys(run, prefixes)
        if title == RL_TITLE:
            keys = rl_chart_order(run, keys)
        if title == RM_TITLE:
            keys = rm_chart_order(keys)
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
        more = keys[MAX_CHARTS:]
        note = (
            f'<p class="missing">{len(more)} more in metrics.jsonl: {esc(", ".join(more))}</p>'
            if more
            else ""
        )
        parts.append(f'<h2>{esc(title)}</h2><div class="charts">{"".join(charts)}</div>{note}{tables}')
    return "".join(parts)
