"""Online-RL guardrails (monitor/rl_guard.py) on synthetic TRL logs, their saved state, and the
callback that turns their verdicts into events, alerts and stops."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from lmforge.config import load_config
from lmforge.config.schema import ALERT_KINDS, GuardConfig, RlGuardConfig
from lmforge.monitor.events import EventLog, read_events
from lmforge.monitor.guard import STATE_FILE, Guardrails, Verdict
from lmforge.monitor.rl_guard import KINDS, RlGuard
from lmforge.train.guard_callback import GuardCallback
from lmforge.train.step import TrainStep
from tests.conftest import SMALL_ARCH

HEALTHY_LOG = {"reward": 0.5, "kl": 0.1, "entropy": 1.0, "frac_reward_zero_std": 0.2, "loss": 0.0}


def judged(guard: RlGuard, logs: list[dict[str, Any]], first_step: int = 1) -> list[tuple[int, Verdict]]:
    """(step, verdict) for every log that produced one."""
    verdicts = []
    for step, log in enumerate(logs, start=first_step):
        verdict = guard.judge(step, log)
        if verdict is not None:
            verdicts.append((step, verdict))
    return verdicts


def logs_with(**series: list[Any]) -> list[dict[str, Any]]:
    """One healthy log per position, with the named keys replaced by the given series (None drops the key)."""
    length = len(next(iter(series.values())))
    logs = []
    for i in range(length):
        log = dict(HEALTHY_LOG)
        for key, values in series.items():
            if values[i] is None:
                log.pop(key)
            else:
                log[key] = values[i]
        logs.append(log)
    return logs


# -- the signals ------------------------------------------------------------------------------


def test_reward_hacking_fires_when_reward_and_kl_rise_past_the_bound_once_then_rearms() -> None:
    guard = RlGuard(RlGuardConfig(kl_bound=1.0, window=3))
    logs = logs_with(
        reward=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.6, 0.7, 0.8],
        kl=[0.2, 0.5, 0.8, 1.2, 1.5, 0.5, 0.9, 1.0, 1.3],
    )
    verdicts = judged(guard, logs)
    # Step 3 is under the bound; 4 starts the signal, 5 continues it, 6 clears it, 8 sits at the
    # bound (not past it) and 9 starts it again.
    assert [(step, v.kind, v.action) for step, v in verdicts] == [
        (4, "reward_hacking", "alert"),
        (9, "reward_hacking", "alert"),
    ]
    message = verdicts[0][1].message
    assert "monitor.guard.rl.kl_bound=1" in message
    assert "0.2 -> 0.4" in message and "0.5 -> 1.2" in message  # reward and KL over the window
    assert "train.rl.beta" in message  # what to try


def test_reward_hacking_needs_the_reward_to_rise() -> None:
    """A KL past the bound while the reward falls is drift, not hacking: no verdict."""
    guard = RlGuard(RlGuardConfig(kl_bound=1.0, window=3))
    logs = logs_with(reward=[0.9, 0.8, 0.7, 0.6], kl=[0.8, 1.1, 1.3, 1.6])
    assert judged(guard, logs) == []


def test_entropy_collapse_fires_once_and_again_after_it_cleared() -> None:
    guard = RlGuard(RlGuardConfig(entropy_floor=0.05))
    logs = logs_with(entropy=[0.8, 0.2, 0.04, 0.03, 0.01, 0.3, 0.02])
    verdicts = judged(guard, logs)
    assert [(step, v.kind) for step, v in verdicts] == [(3, "entropy_collapse"), (7, "entropy_collapse")]
    message = verdicts[0][1].message
    assert "0.04" in message and "monitor.guard.rl.entropy_floor=0.05" in message
    assert "train.rl.epsilon_high" in message


def test_zero_reward_variance_counts_logged_steps_in_a_row() -> None:
    guard = RlGuard(RlGuardConfig(zero_variance_steps=3))
    shares = [1.0, 1.0, 0.5, 1.0, 1.0, 0.9995, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    verdicts = judged(guard, logs_with(frac_reward_zero_std=shares))
    # The run of 1.0s broken at step 3 starts again at 4 and reaches 3 at step 6 (0.9995 counts as all).
    assert [(step, v.kind) for step, v in verdicts] == [
        (6, "zero_reward_variance"),
        (12, "zero_reward_variance"),
    ]
    message = verdicts[0][1].message
    assert "3 logged steps in a row" in message and "monitor.guard.rl.zero_variance_steps=3" in message
    assert "train.rl.group_size" in message


def test_null_thresholds_switch_the_checks_off() -> None:
    guard = RlGuard(RlGuardConfig(kl_bound=None, entropy_floor=None, zero_variance_steps=None, window=2))
    awful = {"reward": 0.0, "kl": 50.0, "entropy": 0.0, "frac_reward_zero_std": 1.0}
    logs = [{**awful, "reward": step / 10, "kl": 50.0 + step} for step in range(30)]
    assert judged(guard, logs) == []


def test_missing_or_none_keys_leave_their_checks_as_they_were() -> None:
    """No `kl` (train.rl.beta 0) turns reward hacking off; TRL's None (no valid value) is no value."""
    guard = RlGuard(RlGuardConfig(kl_bound=1.0, entropy_floor=0.05, window=2))
    rising_without_kl = logs_with(reward=[0.1, 0.5, 0.9, 1.3], kl=[None] * 4)
    assert judged(guard, rising_without_kl) == []
    assert guard.judge(5, {**HEALTHY_LOG, "entropy": 0.01}) is not None  # collapse starts
    # A log without entropy, or with None, neither clears the signal nor re-fires it ...
    assert guard.judge(6, {"reward": 0.5, "frac_reward_zero_std": 0.2}) is None
    assert guard.judge(7, {**HEALTHY_LOG, "entropy": None}) is None
    assert guard.judge(8, {**HEALTHY_LOG, "entropy": 0.02}) is None
    # ... and the last log of training (runtime, no RL keys at all) is not judged.
    assert guard.judge(9, {"train_runtime": 12.0, "train_loss": 0.3}) is None
    assert guard.active == {"entropy_collapse"}


def test_signals_starting_together_share_one_verdict() -> None:
    guard = RlGuard(RlGuardConfig(entropy_floor=0.05, zero_variance_steps=1, action="stop"))
    verdict = guard.judge(3, {**HEALTHY_LOG, "entropy": 0.01, "frac_reward_zero_std": 1.0})
    assert verdict is not None and (verdict.action, verdict.kind) == ("stop", "entropy_collapse")
    assert "entropy collapse" in verdict.message and "no learning signal" in verdict.message
    assert guard.active == {"entropy_collapse", "zero_reward_variance"}


def test_rl_signal_kinds_are_alert_kinds() -> None:
    assert set(KINDS) <= set(ALERT_KINDS)


# -- state ------------------------------------------------------------------------------------


def noisy_logs(count: int) -> list[dict[str, Any]]:
    """A seeded RL run that goes bad in every way and recovers, more than once."""
    rng = random.Random(0)
    logs = []
    for step in range(count):
        phase = (step // 12) % 3  # healthy, hacking and collapsing, no variance
        logs.append(
            {
                "reward": 0.3 + (0.05 * (step % 12) if phase == 1 else 0.0) + rng.gauss(0, 0.01),
                "kl": (0.4 + 0.2 * (step % 12)) if phase == 1 else 0.2 + rng.gauss(0, 0.02),
                "entropy": 0.02 if phase == 1 and step % 12 > 6 else 0.5 + rng.gauss(0, 0.05),
                "frac_reward_zero_std": 1.0 if phase == 2 else rng.random() * 0.5,
            }
        )
    return logs


def test_a_resumed_guard_judges_as_the_uninterrupted_one(tmp_path: Path) -> None:
    cfg = GuardConfig(rl=RlGuardConfig(kl_bound=1.0, window=4, zero_variance_steps=5))
    logs = noisy_logs(72)
    whole = Guardrails(cfg, rl=RlGuard(cfg.rl))
    uninterrupted = judged(whole.rl, logs)  # type: ignore[arg-type]
    assert {v.kind for _, v in uninterrupted} == set(KINDS)  # the sequence exercises every signal

    for split in (5, 18, 27, 30, 41):  # mid-window, a signal active, a run of zero variance under way
        before = Guardrails(cfg, rl=RlGuard(cfg.rl))
        first = judged(before.rl, logs[:split])  # type: ignore[arg-type]
        checkpoint = tmp_path / f"checkpoint-{split}"
        checkpoint.mkdir()
        before.save(checkpoint)
        after = Guardrails(cfg, rl=RlGuard(cfg.rl))
        assert after.load(checkpoint)
        rest = judged(after.rl, logs[split:], first_step=split + 1)  # type: ignore[arg-type]
        assert first + rest == uninterrupted, split


def test_guard_files_without_rl_state_load(tmp_path: Path) -> None:
    """A checkpoint written before the RL guard existed (or by a non-RL stage) resumes with a fresh one,
    and a non-RL run ignores a file's RL state."""
    old = Guardrails(GuardConfig())
    old.judge(1, 2.0, 1.0)
    old.save(tmp_path)
    assert "rl" not in json.loads((tmp_path / STATE_FILE).read_text())
    resumed = Guardrails(GuardConfig(), rl=RlGuard(RlGuardConfig()))
    assert resumed.load(tmp_path)
    assert resumed.window == old.window and resumed.rl is not None
    assert resumed.rl.state_dict() == RlGuard(RlGuardConfig()).state_dict()

    resumed.rl.judge(2, {**HEALTHY_LOG, "entropy": 0.0})
    resumed.save(tmp_path)
    plain = Guardrails(GuardConfig())
    assert plain.load(tmp_path) and plain.rl is None


def test_a_signal_that_returns_after_a_rollback_stops_the_run(tmp_path: Path) -> None:
    cfg = GuardConfig(rl=RlGuardConfig(action="rollback", entropy_floor=0.05))
    guard = Guardrails(cfg, rl=RlGuard(cfg.rl))
    assert guard.rl is not None
    entropies = [0.5, 0.4, 0.3, 0.01]
    assert judged(guard.rl, logs_with(entropy=entropies[:2])) == []
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    guard.save(checkpoint)
    first = judged(guard.rl, logs_with(entropy=entropies[2:]), first_step=3)
    assert [(step, v.action) for step, v in first] == [(4, "rollback")]

    guard.rewind(checkpoint, bad_step=4)  # what train/rollback.py does before the replay
    assert guard.rl.active == set() and guard.rollbacks == 1
    replay = judged(guard.rl, logs_with(entropy=entropies[2:]), first_step=3)
    assert [(step, v.action, v.kind) for step, v in replay] == [(4, "stop", "entropy_collapse")]
    assert "came back after a rollback" in replay[0][1].message


# -- the callback -----------------------------------------------------------------------------


def callback_with(tmp_path: Path, action: str) -> GuardCallback:
    cfg = GuardConfig(rl=RlGuardConfig(action=action, entropy_floor=0.05))  # type: ignore[arg-type]
    step = TrainStep(Guardrails(cfg, rl=RlGuard(cfg.rl)))
    return GuardCallback(
        step, EventLog(tmp_path / "events"), stacks_dir=tmp_path / "stacks", stall_seconds=None
    )


def log_step(
    callback: GuardCallback, args: TrainingArguments, step: int, logs: dict[str, Any]
) -> TrainerControl:
    state, control = TrainerState(global_step=step), TrainerControl()
    callback.on_log(args, state, control, logs=logs)
    return control


@pytest.fixture(scope="module")
def args(tmp_path_factory: pytest.TempPathFactory) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path_factory.mktemp("out")), report_to=[])


def test_callback_stop_on_entropy_collapse_records_the_event_and_stops(
    tmp_path: Path, args: TrainingArguments
) -> None:
    callback = callback_with(tmp_path, "stop")
    healthy = log_step(callback, args, 1, HEALTHY_LOG)
    assert not healthy.should_training_stop and read_events(tmp_path / "events") == []
    control = log_step(callback, args, 2, {**HEALTHY_LOG, "entropy": 0.01})
    assert control.should_training_stop and control.should_save  # a checkpoint of the state it stopped at
    assert callback.stop_reason is not None and "entropy_floor" in callback.stop_reason
    events = read_events(tmp_path / "events")
    assert [(e["kind"], e["step"], e["action"]) for e in events] == [("entropy_collapse", 2, "stop")]
    assert callback.step.verdicts == []


def test_callback_alert_records_the_event_and_training_goes_on(
    tmp_path: Path, args: TrainingArguments
) -> None:
    callback = callback_with(tmp_path, "alert")
    sent: list[dict[str, Any]] = []
    callback.events.listeners.append(sent.append)  # where AlertSender listens
    for step in (1, 2, 3):
        control = log_step(callback, args, step, {**HEALTHY_LOG, "entropy": 0.01})
        assert not control.should_training_stop and not control.should_save
    # Evaluation logs (eval_ keys) are not training logs: not judged.
    log_step(callback, args, 4, {"eval_loss": 1.0, "eval_entropy": 0.5})
    log_step(callback, args, 5, {**HEALTHY_LOG, "entropy": 0.01})
    assert [(e["kind"], e["step"], e["action"]) for e in sent] == [("entropy_collapse", 1, "alert")]
    assert callback.stop_reason is None and callback.rollback_from is None


def test_callback_rollback_marks_the_step_and_skips_its_save(tmp_path: Path, args: TrainingArguments) -> None:
    callback = callback_with(tmp_path, "rollback")
    control = TrainerControl(should_save=True)  # a save step: the state it would save is the bad one
    callback.on_log(args, TrainerState(global_step=6), control, logs={**HEALTHY_LOG, "entropy": 0.0})
    assert callback.rollback_from == 6 and control.should_training_stop and not control.should_save


def tiny_model() -> Any:
    model = torch.nn.Linear(4, 4)
    text = SimpleNamespace(num_hidden_layers=2, hidden_size=64)
    model.config = SimpleNamespace(get_text_config=lambda: text)  # type: ignore[assignment]
    return model


def rl_config(stage: str, **guard: Any) -> Any:
    return load_config(
        None,
        base={
            "run": {"name": "rl"},
            "model": {"preset": "llama-tiny", "config": SMALL_ARCH},
            "tokenizer": {"path": "tokenizer"},  # never read: TrainStep.from_config needs no tokenizer
            "data": {"train": [{"path": "prompts.jsonl"}], "max_length": 64},
            "train": {"stage": stage, "micro_batch_size": 4},
            "monitor": {"loggers": [], "guard": {"rl": guard}},
        },
    )


def test_rl_stages_get_an_rl_guard_and_others_do_not() -> None:
    grpo = TrainStep.from_config(rl_config("grpo", entropy_floor=0.1), tiny_model(), None)
    assert grpo.guardrails is not None and isinstance(grpo.guardrails.rl, RlGuard)
    assert grpo.guardrails.rl.cfg.entropy_floor == 0.1
    sft = TrainStep.from_config(rl_config("sft"), tiny_model(), None)
    assert sft.guardrails is not None and sft.guardrails.rl is None
    # DeepSpeed cannot roll back in the process: an RL rollback acts as a stop there.
    deepspeed = TrainStep.from_config(
        rl_config("rloo", action="rollback"), tiny_model(), None, update_in_backward=True
    )
    assert deepspeed.guardrails is not None and isinstance(deepspeed.guardrails.rl, RlGuard)
    assert deepspeed.guardrails.rl.cfg.action == "stop"
