"""The troubleshooting table applied to a run: what its metrics and events say is wrong.

`diagnose_run(run_dir)` reads metrics.jsonl, events/ and config.yaml and runs one check per
symptom (non-finite loss, OOM, stalls, rollbacks, loss trend, instability, overfitting, data-bound
steps, slowdown); every finding names the config change to try as dotted `key=value` overrides
(`lmforge train CONFIG k=v`).
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmforge.errors import UserInputError
from lmforge.monitor.events import read_events
from lmforge.monitor.metrics import read_metrics

MIN_POINTS = 10  # fewer finite losses than this: no trend findings
DATA_BOUND_SHARE = 0.2
SPIKE_RATIO = 1.5  # a loss 50% above the median of the 10 before it
NOISE_SHARE = 0.15  # residual std / mean loss over the second half
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass
class Finding:
    id: str
    severity: str  # error | warning | info
    title: str
    evidence: str
    changes: list[str] = field(default_factory=list)  # dotted key=value overrides to try
    advice: str = ""


def diagnose_run(run_dir: Path) -> list[Finding]:
    """Findings from a run directory's metrics.jsonl and events/, worst first."""
    if not run_dir.is_dir():
        raise UserInputError(
            f"RUN_DIR {run_dir}: not a directory (a run directory is <run.output_dir>/<run.name>)"
        )
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UserInputError(f"RUN_DIR {run_dir}: no metrics.jsonl; is this a run directory (runs/<name>)?")
    run = RunView(read_metrics(metrics_path), read_events(run_dir / "events"), _read_config(run_dir))
    findings: list[Finding] = []
    for check in (
        _nonfinite,
        _oom,
        _stall,
        _rollback,
        _failed,
        _loss_trend,
        _unstable,
        _overfit,
        _data_bound,
        _slowdown,
    ):
        findings.extend(check(run))
    return sorted(findings, key=lambda f: SEVERITY_ORDER.get(f.severity, 3))


class RunView:
    """The series the checks look at, with the run's config values where config.yaml has them."""

    def __init__(
        self, records: list[dict[str, Any]], events: list[dict[str, Any]], config: dict[str, Any]
    ) -> None:
        self.records = records
        self.events = events
        self.config = config
        self.losses = [
            (int(r["step"]), v)
            for r in records
            if (v := _num(r.get("loss"))) is not None and math.isfinite(v)
        ]
        self.evals = [
            (int(r["step"]), v)
            for r in records
            if (v := _num(r.get("eval_loss"))) is not None and math.isfinite(v)
        ]
        lrs = [v for r in records if (v := _num(r.get("lr"))) is not None and math.isfinite(v)]
        self.lr = float(self.get("train.lr", max(lrs) if lrs else 3e-4))

    def get(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("kind") == kind]

    def series(self, key: str) -> list[float]:
        return [v for r in self.records if (v := _num(r.get(key))) is not None and math.isfinite(v)]


def _nonfinite(run: RunView) -> list[Finding]:
    events = run.events_of("nonfinite")
    bad_records = [
        r["step"] for r in run.records if _is_nonfinite(r.get("loss")) or _is_nonfinite(r.get("grad_norm"))
    ]
    counted = max(run.series("nonfinite_count"), default=0.0)
    if not (events or bad_records or counted):
        return []
    changes = [f"train.lr={_fmt(run.lr / 3)}"]
    if run.get("train.precision") in ("fp16", None):
        changes.insert(0, "train.precision=bf16")
    if run.get("train.max_grad_norm") == 0:
        changes.append("train.max_grad_norm=1.0")
    guard = run.get("monitor.guard.nonfinite")
    if guard == "stop":
        changes.append("monitor.guard.nonfinite=skip")
    elif len(events) >= 3:
        changes.append("monitor.guard.nonfinite=rollback")
    steps = sorted({int(e.get("step", 0)) for e in events} | {int(s) for s in bad_records})
    return [
        Finding(
            "nonfinite",
            "error",
            "NaN/inf loss or gradients",
            f"{len(events)} nonfinite event(s), {len(bad_records)} non-finite record(s); steps {_steps(steps)}",
            changes,
            "fp16 overflows where bf16 does not; a lower learning rate and clipping keep updates bounded; "
            "the guard skips or rolls back bad steps. A batch that is NaN at the same step every time is bad data.",
        )
    ]


def _oom(run: RunView) -> list[Finding]:
    events = run.events_of("oom_backoff")
    if not events:
        return []
    micro, accum = int(run.get("train.micro_batch_size", 8)), int(run.get("train.grad_accum", 1))
    changes = [f"train.micro_batch_size={max(micro // 2, 1)}", f"train.grad_accum={accum * 2}"]
    if not run.get("train.gradient_checkpointing", False):
        changes.append("train.gradient_checkpointing=true")
    return [
        Finding(
            "oom_backoff",
            "warning",
            "out of memory: the micro-batch was halved during the run",
            f"{len(events)} oom_backoff event(s); first at step {events[0].get('step')}",
            changes,
            "start with the smaller micro-batch (same global batch through accumulation) instead of backing off at run "
            "time; on several GPUs shard with ZeRO-3 or FSDP (`lmforge estimate CONFIG` shows memory per strategy).",
        )
    ]


def _stall(run: RunView) -> list[Finding]:
    events = run.events_of("stall")
    if not events:
        return []
    changes = ["train.dataloader_workers=0"] if run.get("train.dataloader_workers", 0) else []
    return [
        Finding(
            "stall",
            "error",
            "the run stalled (no step for a long time)",
            f"{len(events)} stall event(s); first at step {events[0].get('step')}: {events[0].get('message', '')}"[
                :300
            ],
            changes
            + [
                f"monitor.guard.stall_seconds={int(float(run.get('monitor.guard.stall_seconds') or 900) * 2)}"
            ],
            "read the thread stacks the watchdog dumped (events/ and the log): a stack in a collective means a rank "
            "died or diverged (rerun with NCCL_DEBUG=INFO); in the DataLoader, a worker hung (workers=0 rules it out); "
            "raise stall_seconds only when the pause was a long eval or checkpoint.",
        )
    ]


def _rollback(run: RunView) -> list[Finding]:
    events = run.events_of("rollback")
    if not events:
        return []
    changes = [f"train.lr={_fmt(run.lr / 2)}"]
    if float(run.get("monitor.guard.rollback_lr_scale", 1.0)) == 1.0:
        changes.append("monitor.guard.rollback_lr_scale=0.5")
    return [
        Finding(
            "rollback",
            "warning",
            "the guardrails rolled the run back",
            f"{len(events)} rollback(s) at step(s) {_steps([int(e.get('step', 0)) for e in events])}",
            changes,
            "repeated rollbacks at the same steps point at the data there; elsewhere at a learning rate too high",
        )
    ]


def _failed(run: RunView) -> list[Finding]:
    found = []
    for kind, title in (("failed", "the run failed"), ("stopped", "the guardrails stopped the run")):
        events = run.events_of(kind)
        if events:
            last = events[-1]
            found.append(
                Finding(
                    f"run_{kind}",
                    "error",
                    title,
                    f"step {last.get('step')}: {last.get('message', '')}"[:300],
                    [],
                    "the other findings say why; resume with `lmforge train CONFIG` (train.resume=auto) after the change",
                )
            )
    return found


def _loss_trend(run: RunView) -> list[Finding]:
    losses = [v for _, v in run.losses]
    if len(losses) < MIN_POINTS:
        return []
    head = statistics.median(losses[: max(3, len(losses) // 10)])
    tail = statistics.median(losses[-max(3, len(losses) // 5) :])
    if head <= 0.05:  # already near zero: nothing left to fall
        return []
    evidence = f"median loss {head:.4g} over the first tenth of {len(losses)} records, {tail:.4g} over the last fifth"
    if tail > head * 1.1:
        return [
            Finding(
                "loss_rising",
                "error",
                "the training loss is rising",
                evidence,
                [f"train.lr={_fmt(run.lr / 10)}", f"train.warmup_steps={_warmup(run)}"],
                "a rising loss is divergence: the learning rate is too high for this model and batch size",
            )
        ]
    if tail > head * 0.98:
        return [
            Finding(
                "loss_flat",
                "warning",
                "the training loss is not falling",
                evidence,
                [f"train.lr={_fmt(run.lr * 3)}"],
                "too low a learning rate learns nothing in time (raise it); if it plateaued high from the start, check the "
                "data: labels all masked (data_report.json: supervised tokens), text and labels shuffled apart, or a "
                "tokenizer that does not match the model. Too high a learning rate can also stall: try train.lr lower too.",
            )
        ]
    return []


def _unstable(run: RunView) -> list[Finding]:
    losses = [v for _, v in run.losses]
    steps = [s for s, _ in run.losses]
    spikes = [
        steps[i]
        for i in range(10, len(losses))
        if losses[i] > SPIKE_RATIO * statistics.median(losses[i - 10 : i])
    ]
    noise = 0.0
    half = losses[len(losses) // 2 :]
    if len(half) >= MIN_POINTS and statistics.fmean(half) > 0:
        smooth = [statistics.median(half[max(0, i - 3) : i + 4]) for i in range(len(half))]
        noise = statistics.pstdev([x - s for x, s in zip(half, smooth, strict=True)]) / statistics.fmean(half)
    spike_events = run.events_of("spike")
    if not (spikes or spike_events or noise > NOISE_SHARE):
        return []
    changes = [f"train.lr={_fmt(run.lr / 3)}", f"train.warmup_steps={_warmup(run)}"]
    if float(run.get("train.max_grad_norm", 1.0)) == 0 or float(run.get("train.max_grad_norm", 1.0)) > 1.0:
        changes.append("train.max_grad_norm=1.0")
    if noise > NOISE_SHARE and not spikes:  # steady noise rather than spikes: average over more samples
        changes.append(f"train.grad_accum={int(run.get('train.grad_accum', 1)) * 2}")
    if run.get("monitor.guard.spike") == "off":
        changes.append("monitor.guard.spike=skip")
    all_spikes = sorted(set(spikes) | {int(e.get("step", 0)) for e in spike_events})
    return [
        Finding(
            "loss_unstable",
            "warning",
            "the training loss spikes or oscillates",
            f"{len(all_spikes)} spike(s) at step(s) {_steps(all_spikes)}; residual noise {noise:.0%} of the mean loss",
            changes,
            "a lower learning rate, a longer warmup and gradient clipping calm the updates (a larger batch calms "
            "steady noise); spikes at the same steps on "
            "every run are data: look at the batches there (duplicates, garbage, very long samples).",
        )
    ]


def _overfit(run: RunView) -> list[Finding]:
    if len(run.evals) < 3:
        return []
    best_step, best = min(run.evals, key=lambda point: point[1])
    last_step, last = run.evals[-1]
    if last_step == best_step or last <= best * 1.05:
        return []
    changes = [f"train.max_steps={best_step}", "train.best_metric=eval_loss"]
    if float(run.get("train.weight_decay", 0.0)) == 0:
        changes.append("train.weight_decay=0.1")
    if run.get("train.method") in ("lora", "dora", "qlora"):
        changes.append("train.lora.dropout=0.1")
    return [
        Finding(
            "overfitting",
            "warning",
            "the eval loss rises while training goes on",
            f"eval_loss best {best:.4g} at step {best_step}, {last:.4g} at step {last_step}",
            changes,
            "stop near the best step (best_metric keeps that checkpoint), regularise, or add data",
        )
    ]


def _data_bound(run: RunView) -> list[Finding]:
    shares = run.series("data_wait_share")
    if not shares or statistics.fmean(shares[len(shares) // 2 :]) < DATA_BOUND_SHARE:
        return []
    share = statistics.fmean(shares[len(shares) // 2 :])
    workers = int(run.get("train.dataloader_workers", 0))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    changes = [f"train.dataloader_workers={max(workers * 2, min(8, max(usable - 1, 1)), 1)}"]
    if run.get("train.stage") == "sft" and not run.get("data.packing", False):
        changes.append("data.packing=true")
    return [
        Finding(
            "data_bound",
            "warning",
            "training waits for data",
            f"{share:.0%} of step time waits for the next batch (mean over the second half)"
            + (
                f"; {len(run.events_of('data_bound'))} data_bound event(s)"
                if run.events_of("data_bound")
                else ""
            ),
            changes,
            "more DataLoader workers overlap loading with compute; packing removes padding work; a slow disk or a "
            "network filesystem feeding the data is the other usual cause (`lmforge prepare` caches tokenized data).",
        )
    ]


def _slowdown(run: RunView) -> list[Finding]:
    speed = run.series("tokens_per_s")
    if len(speed) < MIN_POINTS:
        return []
    early = max(statistics.median(speed[i : i + 5]) for i in range(0, len(speed) - 4))
    late = statistics.median(speed[-max(3, len(speed) // 5) :])
    if late >= 0.5 * early:
        return []
    changes = [] if run.get("monitor.system_metrics_seconds", 10.0) else ["monitor.system_metrics_seconds=10"]
    return [
        Finding(
            "throughput_dropped",
            "warning",
            "tokens per second fell during the run",
            f"{late:.4g} tokens/s at the end against {early:.4g} at best",
            changes
            + (
                [f"train.save_every={int(run.get('train.save_every')) * 4}"]
                if run.get("train.save_every")
                else []
            ),
            "compare the sys_* metrics (CPU, memory, disk, GPU) around the drop: swapping, other jobs, thermal "
            "throttling, or checkpoints written too often to slow storage.",
        )
    ]


def _warmup(run: RunView) -> int:
    steps = int(run.get("train.max_steps") or (run.losses[-1][0] if run.losses else 100))
    return max(int(run.get("train.warmup_steps", 0)) * 2, steps // 20, 10)


def _read_config(run_dir: Path) -> dict[str, Any]:
    """config.yaml as written by the run (redacted); {} when absent or unreadable."""
    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _num(value: Any) -> float | None:
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


def _is_nonfinite(value: Any) -> bool:
    number = _num(value)
    return number is not None and not math.isfinite(number)


def _fmt(value: float) -> str:
    """A learning rate as an override value: 0.0001, 3e-5."""
    text = f"{value:.2g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text


def _steps(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")
