"""The report's sections for metrics that only some stages record: online RL (reward, KL,
entropy, completion lengths, clip fractions; TRL's GRPO / RLOO names), offline preference
optimisation (DPO / KTO implicit rewards, pair accuracy and margin, log-probabilities), a reward
model's pairwise accuracy and margin (TRL's RewardTrainer), on-policy distillation (the student's
entropy and answer lengths), and Mixture-of-Experts (router losses, expert load). A run whose
metrics.jsonl holds none of them shows none.

The stage's own family is the run's stage spec's metric prefixes (config/stages.py: the names
lmforge keeps from the trainer's logs), so GRPO's and DPO's `rewards/...` land under their own
titles; a stage that logs a new metric of its family is charted without a change here.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import numpy as np

from lmforge.config.stages import RM_METRIC_PREFIXES, STAGE_SPECS
from lmforge.report.html import esc
from lmforge.report.load import RunSummary
from lmforge.report.moe_section import expert_load_section
from lmforge.report.plots import PALETTE, Chart, Line, render_chart

MOE_TITLE = "Mixture of experts"
MOE_PREFIXES = ("moe_", "aux_loss", "router_", "expert_")
RL_TITLE = "Reinforcement learning"
RM_TITLE = "Reward model: pairwise accuracy and margin"
PREFERENCE_TITLE = "Preference optimisation: pair accuracy, margin and implicit rewards"
DISTILL_TITLE = "Distillation: the student's answers"
# The stage families' titles, by train.stage.
STAGE_TITLES = {
    "grpo": RL_TITLE,
    "rloo": RL_TITLE,
    "dpo": PREFERENCE_TITLE,
    "kto": PREFERENCE_TITLE,
    "rm": RM_TITLE,
    "distill": DISTILL_TITLE,
}
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


# The pairwise charts in the order a reader asks: are pairs ranked right, by how much, then the
# parts of that margin (each answer's implicit reward), the KL estimate, then the raw log-probabilities.
RM_ORDER = tuple(f"{prefix}*" for prefix in RM_METRIC_PREFIXES)
PREFERENCE_ORDER = (
    "rewards/accuracies",
    "rewards/margins",
    "rewards/chosen*",
    "rewards/rejected*",
    "kl",
    "log_odds*",
    "nll_loss",
    "logps/*",
    "logits/*",
)


def held_out_first(keys: list[str], order: tuple[str, ...]) -> list[str]:
    """The held-out pairs' figures first (whether the model ranks pairs it never saw), each group in
    `order` (fnmatch patterns; a name matching none comes after them)."""

    def rank(key: str) -> tuple[bool, int, str]:
        name = key.removeprefix("eval_")
        place = next((i for i, pattern in enumerate(order) if fnmatchcase(name, pattern)), len(order))
        return (not key.startswith("eval_"), place, name)

    return sorted(keys, key=rank)


def _flat(run: RunSummary, key: str) -> bool:
    values = run.series[key].finite()
    return len(values) > 1 and bool(np.all(values == values[0]))


def _families(run: RunSummary) -> list[tuple[str, list[str]]]:
    """(title, chart keys in reading order) of the run's stage family, then Mixture-of-Experts."""
    families = []
    spec = STAGE_SPECS.get(run.stage)
    if spec is not None and spec.metric_prefixes:
        keys = stage_metric_keys(run, spec.metric_prefixes)
        title = STAGE_TITLES.get(run.stage, f"{run.stage} metrics")  # a stage added without a title
        if title == RL_TITLE:
            keys = rl_chart_order(run, keys)
        elif title == RM_TITLE:
            keys = held_out_first(keys, RM_ORDER)
        elif title == PREFERENCE_TITLE:
            keys = held_out_first(keys, PREFERENCE_ORDER)
        families.append((title, keys))
    taken = {key for _, keys in families for key in keys}
    families.append((MOE_TITLE, [key for key in stage_metric_keys(run, MOE_PREFIXES) if key not in taken]))
    return families


def stage_metrics_sections(run: RunSummary) -> str:
    """One <h2> section per family the run recorded, with one chart per metric; "" for none."""
    parts = []
    for title, keys in _families(run):
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
