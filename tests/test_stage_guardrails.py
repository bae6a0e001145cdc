"""Which guardrails judge each stage's steps (config/stage_guardrails.py), and the RL config
mistakes refused before any model loads. Fast: no training."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from lmforge.config import load_config
from lmforge.config.schema import GuardConfig, TrainConfig
from lmforge.config.stages import STAGE_GUARDRAILS
from lmforge.errors import UserInputError
from lmforge.monitor.guard import Guardrails, stage_guard_settings
from tests.conftest import run_cli

# The GRPO policy loss of issue 33's 30-step run (default settings): near zero, changing sign,
# with the 2.131e-05 of step 9 that today's spike rule called "11.3 sigma" and skipped.
GRPO_LOSSES = [
    1.9e-06, -2.4e-06, 3.1e-06, 2.2e-06, -1.1e-06, 4.0e-06, 2.9e-06, 3.0e-06,
    2.131e-05, 1.8e-05, 2.5e-06, -3.3e-06, 2.4e-05, 1.2e-06, -8.0e-07,
]  # fmt: skip


def test_every_stage_declares_its_guardrails() -> None:
    """Every train.stage has an entry; the loss-spike rule judges the language-model, preference
    and distillation losses, never online RL's; every stage keeps the non-finite check; RL keeps the
    RL guard."""
    stages = set(get_args(TrainConfig.model_fields["stage"].annotation))
    assert set(STAGE_GUARDRAILS) == stages
    spike_judged = {"pretrain", "sft", "dpo", "kto", "rm", "distill"}
    assert {s for s in stages if "spike" in STAGE_GUARDRAILS[s]} == spike_judged
    assert all("nonfinite" in rules for rules in STAGE_GUARDRAILS.values())
    assert {s for s in stages if "rl" in STAGE_GUARDRAILS[s]} == {"grpo", "rloo"}


def judged(stage: str, losses: list[float]) -> list[tuple[int, str, str]]:
    """(step, action, kind) of every verdict but apply, for a 30-step run of `stage`, default settings."""
    guard = Guardrails(stage_guard_settings(GuardConfig(), stage), total_steps=30)
    verdicts = [guard.judge(step, loss, 1.0) for step, loss in enumerate(losses, start=1)]
    return [(step, v.action, v.kind) for step, v in enumerate(verdicts, start=1) if v.action != "apply"]


@pytest.mark.parametrize("stage", ["grpo", "rloo"])
def test_the_grpo_loss_of_issue_33_is_not_a_spike(stage: str) -> None:
    assert judged(stage, GRPO_LOSSES) == []


def test_language_model_stages_still_skip_a_spike() -> None:
    """The same series under sft: the rule still acts where it fits (a positive loss series with one jump)."""
    losses = [2.0 - 0.01 * i for i in range(12)]
    losses[9] = 9.0
    assert judged("sft", losses) == [(10, "skip", "spike")]


def test_online_rl_keeps_the_nonfinite_check() -> None:
    assert judged("grpo", [1e-6, float("nan")]) == [(2, "skip", "nonfinite")]


def rl_config(tmp_path: Path, stage: str, **extra: Any) -> dict[str, Any]:
    return {
        "run": {"name": "rl", "output_dir": str(tmp_path / "runs")},
        "model": {"path": str(tmp_path / "policy")},
        "data": {"train": [{"path": str(tmp_path / "rows.jsonl")}], "max_length": 48},
        "train": {"stage": stage, "rl": {"group_size": 4}, "max_steps": 2, "micro_batch_size": 8},
        **extra,
    }


def test_spike_settings_for_an_rl_stage_are_refused(tmp_path: Path) -> None:
    """A spike setting would silently do nothing for grpo: refused, naming the key, its value and the
    fix; `spike: off` says what happens anyway and is accepted."""
    config = rl_config(tmp_path, "grpo", monitor={"guard": {"spike": "skip", "spike_sigma": 8.0}})
    with pytest.raises(UserInputError) as raised:
        load_config(None, base=config)
    message = str(raised.value)
    assert "monitor.guard.spike: 'skip' is a setting of the loss-spike rule" in message
    assert "monitor.guard.spike_sigma: 8.0" in message
    assert "does not judge train.stage grpo" in message and "Fix: remove monitor.guard.spike_sigma" in message
    config["monitor"]["guard"] = {"spike": "off", "spike_sigma": 8.0}
    assert load_config(None, base=config).monitor.guard.spike == "off"
    config["train"]["stage"] = "sft"
    config["train"].pop("rl")
    config["monitor"]["guard"] = {"spike": "rollback", "spike_sigma": 8.0}
    assert load_config(None, base=config).monitor.guard.spike_sigma == 8.0


def test_a_missing_reward_model_stops_lmforge_train_before_any_work(tmp_path: Path) -> None:
    """RLOO with a reward model directory that is not there: exit 2 in seconds (it was found only after
    the policy model loaded), naming the key and the path, before the data stage writes anything."""
    missing = tmp_path / "no-such-rm"
    config = rl_config(tmp_path, "rloo")
    config["train"]["rewards"] = [{"kind": "format", "pattern": "x"}, {"kind": "model", "path": str(missing)}]
    path = tmp_path / "rloo.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_cli("train", str(path))
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"train.rewards.1.path: {str(missing)!r} is not a directory" in result.stderr
    assert "Fix: point it at the final/ of a train.stage rm run" in result.stderr
    assert "Traceback" not in result.stderr
    # Refused before the run directory, the data stage and the policy model (about 3 s of CPU).
    assert not (tmp_path / "runs" / "rl").exists()


def test_doctor_does_not_call_the_grpo_loss_unstable(tmp_path: Path) -> None:
    """`lmforge doctor` read the same near-zero, sign-changing loss as spikes ("lower train.lr",
    "set monitor.guard.spike=skip", which an RL stage now refuses)."""
    from lmforge.monitor.diagnosis import diagnose_run
    from tests.test_doctor import CONFIG, _run_dir

    config = {**CONFIG, "train": {**CONFIG["train"], "stage": "grpo"}, "monitor": {}}
    losses = GRPO_LOSSES * 14  # 210 steps
    records = [{"step": i, "loss": loss, "lr": 3e-4, "reward": 0.3} for i, loss in enumerate(losses, start=1)]
    assert "loss_unstable" not in {f.id for f in diagnose_run(_run_dir(tmp_path, records, config=config))}
