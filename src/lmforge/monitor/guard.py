"""Guardrail decisions: is this optimizer step healthy, and if not, what to do about it.

Pure bookkeeping, no torch: the trainer measures (loss, grad norm), `Guardrails.judge` decides,
and the trainer and its callback act (drop the update, roll back, stop). The state — the rolling
loss window, counters, steps to skip after a rollback — is saved with every checkpoint, so a
resumed run judges exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from lmforge.config.schema import GuardConfig
from lmforge.config.stages import stage_guardrails

# alert: the update stands; the event is recorded and sent to the configured alerts (RL signals).
Action = Literal["apply", "skip", "rollback", "stop", "alert"]
STATE_FILE = "lmforge_guard.json"


@dataclass(frozen=True)
class Verdict:
    action: Action
    kind: str = ""  # nonfinite | spike | replayed | oom_backoff | reward_hacking | entropy_collapse | ...
    message: str = ""


HEALTHY = Verdict("apply")


class LogJudge(Protocol):
    """A guard judged from a logged step's metrics (monitor/rl_guard.py's RlGuard), saved with the rest."""

    def judge(self, step: int, logs: dict[str, Any]) -> Verdict | None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def rewind(self, state: dict[str, Any] | None) -> None: ...


def stage_guard_settings(cfg: GuardConfig, stage: str) -> GuardConfig:
    """`cfg` with the rules that do not fit `stage`'s loss switched off (config/stages.py):
    online RL's policy loss sits near zero and changes sign, so the loss-spike rule is off there."""
    if "spike" in stage_guardrails(stage) or cfg.spike == "off":
        return cfg
    return cfg.model_copy(update={"spike": "off"})


def settings_for_update_in_backward(cfg: GuardConfig, *, online_rl: bool) -> tuple[GuardConfig, list[str]]:
    """`cfg` for an engine that applies each update inside backward (DeepSpeed), before the guard
    sees the step's gradient norm: a bad step can be neither skipped nor rolled back in the process
    (the engine cannot be re-initialised), so skip and rollback act as stop. Also the `key=value`
    settings this changed, for the warning that says so."""
    acting: dict[str, Any] = {
        key: "stop" for key in ("nonfinite", "spike") if getattr(cfg, key) in ("skip", "rollback")
    }
    named = [f"{key}={getattr(cfg, key)}" for key in acting]
    if online_rl and cfg.rl.action == "rollback":
        acting["rl"] = cfg.rl.model_copy(update={"action": "stop"})
        named.append("rl.action=rollback")
    return (cfg.model_copy(update=acting) if acting else cfg), named


@dataclass
class Guardrails:
    cfg: GuardConfig
    total_steps: int | None = None  # train.max_steps, when known: short runs arm the spike check sooner
    window: deque[float] = field(default_factory=deque)
    bad_in_a_row: int = 0
    nonfinite_count: int = 0
    spike_count: int = 0
    skipped_steps: int = 0
    rollbacks: int = 0
    skip_on_replay: set[int] = field(default_factory=set)  # steps whose batches a rollback skips
    # Online RL's guard (stage grpo / rloo), judged from logged metrics by judge_log (GuardCallback.on_log
    # acts on the verdict).
    # Typed by its protocol: rl_guard.py builds on this module's Verdict.
    rl: LogJudge | None = None

    def judge_log(self, step: int, logs: dict[str, Any] | None) -> Verdict | None:
        """The RL guard's verdict on a training log's metrics (stage grpo / rloo); None for a stage
        without it, an evaluation log, or metrics it finds healthy."""
        if self.rl is None or not logs or any(key.startswith("eval_") for key in logs):
            return None
        return self.rl.judge(step, logs)

    def judge(self, step: int, loss: float, grad_norm: float | None) -> Verdict:
        """The verdict for optimizer step `step` (1-based, the step about to be applied)."""
        verdict = self._classify(step, loss, grad_norm)
        if verdict.action == "apply":
            self.bad_in_a_row = 0
            self._remember(loss)
            return verdict
        self.bad_in_a_row += verdict.kind != "replayed"
        if self.bad_in_a_row >= self.cfg.max_bad_steps:
            return Verdict(
                "stop",
                verdict.kind,
                f"{verdict.message}; {self.bad_in_a_row} bad steps in a row (monitor.guard.max_bad_steps="
                f"{self.cfg.max_bad_steps})",
            )
        return verdict

    def _classify(self, step: int, loss: float, grad_norm: float | None) -> Verdict:
        if step in self.skip_on_replay:
            return Verdict("skip", "replayed", f"step {step}: batch skipped after the rollback it caused")
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            self.nonfinite_count += 1
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            return Verdict(
                self.cfg.nonfinite,
                "nonfinite",
                f"step {step}: non-finite {what} (loss={loss}, grad_norm={grad_norm})",
            )
        z = self.spike_score(loss)
        if self.cfg.spike != "off" and z is not None and z > self.cfg.spike_sigma:
            self.spike_count += 1
            mean = sum(self.window) / len(self.window)
            return Verdict(
                self.cfg.spike,
                "spike",
                f"step {step}: loss {loss:.4g} is {z:.1f} sigma above the last {len(self.window)} steps' mean {mean:.4g}",
            )
        return HEALTHY

    def replayed(self, step: int) -> bool:
        """Whether `step` is a bad step replayed after the rollback it caused (its batch is skipped)."""
        return step in self.skip_on_replay

    def spike_score(self, loss: float) -> float | None:
        """Standard deviations above the window mean; None until the warm-up has passed."""
        limits = self._window_statistics()
        return None if limits is None else (loss - limits[0]) / limits[1]

    def spike_limits(self) -> tuple[float, float, float] | None:
        """(window mean, deviation, spike_sigma) for judging the next step on the device the way
        `spike_score` does on the host (train/step.py); None while spikes are not judged."""
        limits = self._window_statistics()
        return None if limits is None or self.cfg.spike == "off" else (*limits, self.cfg.spike_sigma)

    def _window_statistics(self) -> tuple[float, float] | None:
        """The window's mean and standard deviation, None until the warm-up has passed.

        The deviation has a floor of 1% of the mean: on a very smooth curve a tiny wiggle
        would otherwise count as many sigmas."""
        if len(self.window) < self.spike_warmup:
            return None
        mean = sum(self.window) / len(self.window)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.window) / len(self.window))
        return mean, max(std, 0.01 * abs(mean), 1e-8)

    @property
    def spike_warmup(self) -> int:
        """Healthy steps seen before spikes are judged: `spike_warmup`, but at most a fifth of the
        run (a 30-step run would otherwise never arm a 50-step warm-up), and at least 5."""
        steps = self.cfg.spike_warmup
        if self.total_steps is not None:
            steps = min(steps, self.total_steps // 5)
        return max(steps, 5)

    def _remember(self, loss: float) -> None:
        self.window.append(loss)
        while len(self.window) > self.cfg.spike_window:
            self.window.popleft()

    def note_skipped(self) -> None:
        self.skipped_steps += 1

    def rewind(self, checkpoint: Path, bad_step: int) -> None:
        """Back to `checkpoint`'s loss window; counters keep what happened since. On the replay
        the batches of `bad_step` are skipped."""
        path = checkpoint / STATE_FILE
        if path.is_file():
            state = json.loads(path.read_text())
            self.window = deque(state["window"])
            if self.rl is not None:
                self.rl.rewind(state.get("rl"))
        self.bad_in_a_row = 0
        self.rollbacks += 1
        self.skip_on_replay.add(bad_step)

    def counters(self) -> dict[str, int]:
        return {
            "nonfinite_count": self.nonfinite_count,
            "spike_count": self.spike_count,
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
        }

    def state_dict(self) -> dict[str, Any]:
        state = {
            "window": list(self.window),
            "bad_in_a_row": self.bad_in_a_row,
            **self.counters(),
            "skip_on_replay": sorted(self.skip_on_replay),
        }
        if self.rl is not None:
            state["rl"] = self.rl.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window = deque(state["window"])
        self.bad_in_a_row = state["bad_in_a_row"]
        self.nonfinite_count = state["nonfinite_count"]
        self.spike_count = state["spike_count"]
        self.skipped_steps = state["skipped_steps"]
        self.rollbacks = state["rollbacks"]
        # Rollback skips are kept from the live state too: the checkpoint predates the rollback.
        self.skip_on_replay |= set(state["skip_on_replay"])
        # Files written before the RL guard existed (or by a non-RL stage) have no "rl": it starts fresh.
        if self.rl is not None and "rl" in state:
            self.rl.load_state_dict(state["rl"])

    def save(self, directory: Path) -> None:
        (directory / STATE_FILE).write_text(json.dumps(self.state_dict()))

    def load(self, directory: Path) -> bool:
        path = directory / STATE_FILE
        if not path.is_file():
            return False
        self.load_state_dict(json.loads(path.read_text()))
        return True
