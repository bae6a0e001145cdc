"""report.html of an online-RL run: the reward is the headline and the first charts, not the
policy loss (near zero by design) or the clip fractions that stay at 0."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from lmforge.report import write_report
from tests.test_report import build_run

# What TRL's GRPOTrainer logs each step (trl 1.16), reward function `exact`.
CLIP_RATIOS = ("clip_ratio/high_max", "clip_ratio/high_mean", "clip_ratio/low_mean", "clip_ratio/low_min")
COMPLETIONS = (
    "completions/clipped_ratio",
    "completions/max_length",
    "completions/max_terminated_length",
    "completions/mean_length",
    "completions/mean_terminated_length",
    "completions/min_length",
    "completions/min_terminated_length",
)


def grpo_run(root: Path) -> Path:
    run = build_run(root, name="grpo")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["train"]["stage"] = "grpo"
    config["data"].pop("packing")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        step = record["step"]
        record["loss"] = (2e-6 if step % 7 else 2.1e-5) * (-1) ** step  # the GRPO loss of issue 33
        record.update({"reward": 0.2 + 0.005 * step, "reward_std": 0.4 + step % 2 / 10})
        record.update({"rewards/exact/mean": 0.2 + 0.005 * step, "rewards/exact/std": 0.4 + step % 2 / 10})
        record["frac_reward_zero_std"] = 0.25 * (step % 4)
        record.update({"kl": 0.001 * step, "entropy": 2.0 - 0.01 * step, "clip_ratio/region_mean": 0.0})
        record.update({key: 0.0 for key in CLIP_RATIOS})
        record.update({key: 4.0 + step % 3 for key in COMPLETIONS})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_rl_section_charts_the_reward_first_and_flat_clip_ratios_last(tmp_path: Path) -> None:
    page = write_report(grpo_run(tmp_path)).read_text()
    section = page.split("<h2>Reinforcement learning</h2>")[1].split("<h2>")[0]
    charted = re.findall(r'data-metric="stage_([^"]+)"', section)
    assert charted[:7] == [
        "reward",
        "rewards/exact/mean",
        "reward_std",
        "rewards/exact/std",
        "frac_reward_zero_std",
        "kl",
        "entropy",
    ]
    assert charted[7] == "completions/mean_length"
    # The clip ratios that stay 0 come last; past the page's 16 charts they are named, not charted.
    assert charted[-2:] == ["clip_ratio/high_max", "clip_ratio/high_mean"] and len(charted) == 16
    assert (
        "3 more in metrics.jsonl: clip_ratio/low_mean, clip_ratio/low_min, clip_ratio/region_mean" in section
    )


def test_rl_summary_headlines_the_reward_not_the_loss(tmp_path: Path) -> None:
    page = write_report(grpo_run(tmp_path)).read_text()
    summary = page.split("<h2>Summary</h2>")[1].split("<h2>")[0]
    headline = "<th>final reward</th><td>0.4 (step 40); mean of the first 10 logged steps 0.2275 -&gt; last 10 0.3775"
    assert headline in summary
    assert "final train loss" not in summary
    assert summary.index("final reward") < summary.index("final policy loss")
    assert "near zero by design in online RL" in summary
