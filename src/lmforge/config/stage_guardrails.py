"""Which step guardrails fit each `train.stage`'s loss (monitor/guard.py, monitor/rl_guard.py).

- nonfinite: a NaN/inf loss or gradient norm is never a healthy update, whatever the stage.
- spike: a z-score of the loss over a rolling window. It fits a loss that is positive and
  falls smoothly: the next-token loss of pretrain and sft, and the preference losses, which are
  log-sigmoid shaped (DPO, RM and KTO start near ln 2 = 0.69 and descend; ORPO adds an NLL
  term; SimPO and IPO are positive too), so a jump of many sigmas is a divergence there as well.
  It does not fit online RL: GRPO's and RLOO's policy loss is an advantage-weighted ratio whose
  advantages are centred per group, so it sits near zero and changes sign by design; a step of
  2e-5 after a window of 2e-6 is "11 sigma" and yet an ordinary update. Their health is
  judged from the reward and the policy (`monitor.guard.rl`) instead.
- rl: the online-RL signals (reward hacking, entropy collapse, no reward variance).
"""

from __future__ import annotations

from typing import Literal

Guardrail = Literal["nonfinite", "spike", "rl"]

_LANGUAGE_MODEL: frozenset[Guardrail] = frozenset({"nonfinite", "spike"})
_ONLINE_RL: frozenset[Guardrail] = frozenset({"nonfinite", "rl"})

STAGE_GUARDRAILS: dict[str, frozenset[Guardrail]] = {
    "pretrain": _LANGUAGE_MODEL,
    "sft": _LANGUAGE_MODEL,
    "dpo": _LANGUAGE_MODEL,
    "kto": _LANGUAGE_MODEL,
    "rm": _LANGUAGE_MODEL,
    "grpo": _ONLINE_RL,
    "rloo": _ONLINE_RL,
}

# The monitor.guard keys of the loss-spike rule (refused for a stage it does not apply to).
SPIKE_KEYS = ("spike", "spike_sigma", "spike_window", "spike_warmup")


def stage_guardrails(stage: str) -> frozenset[Guardrail]:
    """The guardrails that judge `stage`'s steps."""
    return STAGE_GUARDRAILS[stage]
