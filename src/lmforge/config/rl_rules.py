"""Config rules of the online RL stages (grpo, rloo) whose messages name the value at fault.

`rl_problems` is read by config/cross_checks.py whenever a config loads. `reward_model_problems`
looks at the disk, so it is not a config rule (a chained example names the reward model an
earlier step will write, and `lmforge config show` must still work): train/preflight.py runs it
when `lmforge train` starts, before any data, tokenizer or model work, so the run stops in about
a second instead of after the policy model loaded.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.config.schema import LmforgeConfig
from lmforge.config.stages import SPIKE_KEYS, stage_guardrails, stage_spec

__all__ = ["reward_model_problems", "rl_problems"]


def rl_problems(cfg: LmforgeConfig) -> list[tuple[str, str]]:
    """(key path, message) for each RL rule the config breaks."""
    return _spike_settings_problems(cfg)


def _spike_settings_problems(cfg: LmforgeConfig) -> list[tuple[str, str]]:
    """A loss-spike setting the user gave for a stage whose loss the rule does not judge. An error,
    not a warning: a guard setting that silently does nothing is how the user of issue 33 lost
    GRPO updates without noticing. `spike: off` says what happens anyway and is accepted."""
    guard, stage = cfg.monitor.guard, cfg.train.stage
    if "spike" in stage_guardrails(stage) or guard.spike == "off":
        return []
    return [
        (
            f"monitor.guard.{key}",
            f"{getattr(guard, key)!r} is a setting of the loss-spike rule, which does not judge train.stage "
            f"{stage}: its policy loss sits near zero and changes sign by design. {stage} runs keep the "
            "non-finite check (monitor.guard.nonfinite) and the RL guard (monitor.guard.rl: reward hacking, "
            f"entropy collapse, no reward variance). Fix: remove monitor.guard.{key} (or set monitor.guard.spike: off)",
        )
        for key in SPIKE_KEYS
        if key in guard.model_fields_set
    ]


def reward_model_problems(cfg: LmforgeConfig) -> list[tuple[str, str]]:
    """A `kind: model` reward whose directory is missing (otherwise found only after the policy loaded)."""
    if not stage_spec(cfg.train.stage).online_rl:
        return []  # rewards on another stage are refused by their own rule
    return [
        (
            f"train.rewards.{index}.path",
            f"{reward.path!r} is not a directory. A reward of kind model reads a reward model directory. Fix: "
            "point it at the final/ of a train.stage rm run, or any HF sequence-classification model saved "
            "with save_pretrained (config.json + model.safetensors)",
        )
        for index, reward in enumerate(cfg.train.rewards)
        if reward.kind == "model" and reward.path is not None and not Path(reward.path).expanduser().is_dir()
    ]
