"""Online-RL guardrails: judge TRL's logged RL metrics (stage grpo / rloo) for three failures.

    reward hacking        the mean reward rose over the last `window` logged steps while the KL
                          to the reference rose too and ended above `kl_bound`
    entropy collapse      the policy's mean token entropy is below `entropy_floor`
    zero reward variance  every prompt group scored all its completions alike (no advantage,
                          so no gradient) for `zero_variance_steps` logged steps in a row

Pure bookkeeping, no torch, like monitor/guard.py: the callback hands over each training log
(TRL's keys `reward`, `kl`, `entropy`, `frac_reward_zero_std`, averaged over the logging window)
and acts on the verdict. A signal fires when it starts and again only once it has cleared, so a
lasting condition is one event, not one per logged step. A key the log lacks (no `kl` when
train.rl.beta is 0) leaves its check as it was. The state is saved with every checkpoint.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lmforge.config.schema import RlGuardConfig
from lmforge.monitor.guard import Verdict

# `frac_reward_zero_std` is a mean over the logging window: "all groups" up to float rounding.
ALL_GROUPS = 0.999
KINDS = ("reward_hacking", "entropy_collapse", "zero_reward_variance")  # the order in a combined verdict


@dataclass
class RlGuard:
    """The RL signals' state: a verdict per training log, `monitor.guard.rl.action` on each new signal."""

    cfg: RlGuardConfig
    rewards: deque[float] = field(default_factory=deque)  # the last `window` logged (reward, kl) pairs
    kls: deque[float] = field(default_factory=deque)
    zero_variance_run: int = 0  # logged steps in a row with every group's rewards alike
    active: set[str] = field(default_factory=set)  # signals firing now: silent until they clear
    # Signals that already caused a rollback; kept across rewinds, as the checkpoint predates them.
    rolled_back: set[str] = field(default_factory=set)

    def judge(self, step: int, logs: dict[str, Any]) -> Verdict | None:
        """The verdict for the training log of `step`, or None when no signal starts there.

        Signals starting at the same step share one verdict: the first kind in KINDS names it and
        the message holds all of them."""
        conditions = {
            "reward_hacking": self._reward_hacking(step, logs),
            "entropy_collapse": self._entropy_collapse(step, logs),
            "zero_reward_variance": self._zero_reward_variance(step, logs),
        }
        started: list[tuple[str, str]] = []
        for kind in KINDS:
            message = conditions[kind]
            if message is None:  # not judged at this step: the signal stays as it was
                continue
            if not message:
                self.active.discard(kind)  # cleared: fires again when it comes back
            elif kind not in self.active:
                self.active.add(kind)
                started.append((kind, message))
        if not started:
            return None
        return self._verdict(started)

    def _verdict(self, started: list[tuple[str, str]]) -> Verdict:
        kinds = [kind for kind, _ in started]
        message = "; ".join(message for _, message in started)
        if self.cfg.action != "rollback":
            return Verdict(self.cfg.action, kinds[0], message)
        if any(kind in self.rolled_back for kind in kinds):
            # The replay after a rollback is the same run again: rolling back once more would loop.
            return Verdict(
                "stop",
                kinds[0],
                f"{message}; it came back after a rollback (monitor.guard.rl.action=rollback), so the run stops",
            )
        self.rolled_back.update(kinds)
        return Verdict("rollback", kinds[0], message)

    # -- the signals: "" when clear, a message when present, None when not judged --------------
    def _reward_hacking(self, step: int, logs: dict[str, Any]) -> str | None:
        bound = self.cfg.kl_bound
        reward, kl = _number(logs, "reward"), _number(logs, "kl")
        if bound is None or reward is None or kl is None:
            return None
        _push(self.rewards, reward, self.cfg.window)
        _push(self.kls, kl, self.cfg.window)
        if len(self.rewards) < self.cfg.window or kl <= bound:
            return ""
        if not (_rose(list(self.rewards)) and _rose(list(self.kls))):
            return ""
        return (
            f"step {step}: possible reward hacking: the mean reward rose {self.rewards[0]:.4g} -> {reward:.4g} over "
            f"the last {len(self.rewards)} logged steps while the KL to the reference rose {self.kls[0]:.4g} -> "
            f"{kl:.4g}, above monitor.guard.rl.kl_bound={bound:g}. Read the sampled completions "
            "(train.rl.log_completions) for an exploit of the reward; tighten the reward, raise train.rl.beta, "
            "or lower train.lr"
        )

    def _entropy_collapse(self, step: int, logs: dict[str, Any]) -> str | None:
        floor = self.cfg.entropy_floor
        entropy = _number(logs, "entropy")
        if floor is None or entropy is None:
            return None
        if entropy >= floor:
            return ""
        return (
            f"step {step}: entropy collapse: the policy's mean token entropy {entropy:.4g} is below "
            f"monitor.guard.rl.entropy_floor={floor:g}, so its completions barely differ and it stops exploring. "
            "Set train.rl.epsilon_high above train.rl.epsilon (clip-higher, e.g. 0.28), raise "
            "train.rl.temperature or train.rl.beta, or lower train.lr"
        )

    def _zero_reward_variance(self, step: int, logs: dict[str, Any]) -> str | None:
        needed = self.cfg.zero_variance_steps
        share = _number(logs, "frac_reward_zero_std")
        if needed is None or share is None:
            return None
        self.zero_variance_run = self.zero_variance_run + 1 if share >= ALL_GROUPS else 0
        if self.zero_variance_run < needed:
            return ""
        return (
            f"step {step}: no learning signal: every prompt group gave all its completions the same reward "
            f"(frac_reward_zero_std={share:.3g}) for {self.zero_variance_run} logged steps in a row "
            f"(monitor.guard.rl.zero_variance_steps={needed}), so every advantage is 0. The prompts are too hard "
            "or too easy for the model, or the reward is constant: check train.rewards on a few completions, "
            "raise train.rl.group_size or train.rl.temperature, or change the prompts"
        )

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "rewards": list(self.rewards),
            "kls": list(self.kls),
            "zero_variance_run": self.zero_variance_run,
            "active": sorted(self.active),
            "rolled_back": sorted(self.rolled_back),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A resume with a smaller window keeps the newest values.
        self.rewards = deque(state["rewards"][-self.cfg.window :])
        self.kls = deque(state["kls"][-self.cfg.window :])
        self.zero_variance_run = state["zero_variance_run"]
        self.active = set(state["active"])
        self.rolled_back = set(state["rolled_back"])

    def rewind(self, state: dict[str, Any] | None) -> None:
        """Back to a checkpoint's state (None: a checkpoint from before any RL log), keeping which
        signals already caused a rollback: the checkpoint predates that rollback."""
        rolled_back = set(self.rolled_back)
        if state is None:
            self.rewards, self.kls, self.zero_variance_run, self.active = deque(), deque(), 0, set()
        else:
            self.load_state_dict(state)
        self.rolled_back |= rolled_back


def _number(logs: dict[str, Any], key: str) -> float | None:
    """The logged value of `key` as a float; None when missing, None (TRL: no valid value) or NaN."""
    value = logs.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)


def _push(values: deque[float], value: float, size: int) -> None:
    values.append(value)
    while len(values) > size:
        values.popleft()


def _rose(values: list[float]) -> bool:
    """The series went up: its last value is above its first, or its least-squares slope is positive."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))  # the sign of the slope
    return values[-1] > values[0] or slope > 0
