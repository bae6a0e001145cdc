"""What the run checks look at: a run's metric series and events with its config read back
through the schema, the Finding each check returns, and the small helpers they share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lmforge.config.recorded import RecordedConfig

MIN_POINTS = 10  # fewer finite losses than this: no trend findings
DATA_BOUND_SHARE = 0.2
SPIKE_RATIO = 1.5  # a loss 50% above the median of the 10 before it
NOISE_SHARE = 0.15  # residual std / mean loss over the second half
OSCILLATION_FLIPS = 0.85  # share of steps where the loss changes direction (noise: about 2/3)
OSCILLATION_SWING = 0.03  # median step-to-step change over the mean loss
SLOW_STEP_SECONDS = 30.0  # median seconds per optimizer step


@dataclass
class Finding:
    id: str
    severity: str  # error | warning | info
    title: str
    evidence: str
    changes: list[str] = field(default_factory=list)  # dotted key=value overrides to try
    advice: str = ""


class RunView:
    """The series the checks look at, and the run's config read back through the schema."""

    def __init__(
        self, records: list[dict[str, Any]], events: list[dict[str, Any]], cfg: RecordedConfig
    ) -> None:
        self.records = records
        self.events = events
        self.cfg = cfg
        self.losses = [
            (int(r["step"]), v) for r in records if (v := num(r.get("loss"))) is not None and math.isfinite(v)
        ]
        self.evals = [
            (int(r["step"]), v)
            for r in records
            if (v := num(r.get("eval_loss"))) is not None and math.isfinite(v)
        ]
        lrs = [v for r in records if (v := num(r.get("lr"))) is not None and math.isfinite(v)]
        # Without config.yaml the peak logged lr stands for train.lr.
        self.lr = cfg.train.lr if cfg.found or not lrs else max(lrs)

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("kind") == kind]

    def series(self, key: str) -> list[float]:
        return [v for r in self.records if (v := num(r.get(key))) is not None and math.isfinite(v)]


def warmup(run: RunView) -> int:
    steps = run.cfg.train.max_steps or (run.losses[-1][0] if run.losses else 100)
    return max(run.cfg.train.warmup_steps * 2, steps // 20, 10)


def num(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # "nan" / "inf" as metrics.jsonl keeps them
        except ValueError:
            return None
    return None


def is_nonfinite(value: Any) -> bool:
    number = num(value)
    return number is not None and not math.isfinite(number)


def fmt(value: float) -> str:
    """A learning rate as an override value: 0.0001, 3e-5."""
    text = f"{value:.2g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text


def step_list(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")
