"""The troubleshooting table applied to a run: what its metrics and events say is wrong.

`diagnose_run(run_dir)` reads metrics.jsonl, events/ and config.yaml and runs one check per
symptom (non-finite loss, OOM, stalls, rollbacks, loss trend, instability, overfitting, data-bound
steps, slowdown); every finding names the config change to try as dotted `key=value` overrides
(`lmforge train CONFIG k=v`).
"""

from __future__ import annotations

from pathlib import Path

from lmforge.config.recorded import read_recorded_config
from lmforge.errors import UserInputError
from lmforge.monitor.curve_checks import (
    check_data_bound,
    check_loss_trend,
    check_oscillating,
    check_overfit,
    check_slow,
    check_slowdown,
    check_unstable,
)
from lmforge.monitor.events import read_events
from lmforge.monitor.metrics import read_metrics
from lmforge.monitor.run_view import Finding, RunView, fmt, is_nonfinite, step_list
from lmforge.run_layout import RunPaths

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def diagnose_run(run_dir: Path) -> list[Finding]:
    """Findings from a run directory's metrics.jsonl and events/, worst first."""
    if not run_dir.is_dir():
        raise UserInputError(
            f"RUN_DIR {run_dir}: not a directory (a run directory is <run.output_dir>/<run.name>)"
        )
    paths = RunPaths(run_dir)
    metrics_path = paths.metrics
    if not metrics_path.is_file():
        raise UserInputError(f"RUN_DIR {run_dir}: no metrics.jsonl; is this a run directory (runs/<name>)?")
    run = RunView(
        read_metrics(metrics_path),
        read_events(paths.events),
        read_recorded_config(paths.config),
    )
    findings: list[Finding] = []
    for check in (
        _nonfinite,
        _oom,
        _oom_ladder,
        _stall,
        _rollback,
        _failed,
        check_loss_trend,
        check_unstable,
        check_oscillating,
        check_overfit,
        check_data_bound,
        check_slow,
        check_slowdown,
    ):
        findings.extend(check(run))
    return sorted(findings, key=lambda f: SEVERITY_ORDER.get(f.severity, 3))


def _nonfinite(run: RunView) -> list[Finding]:
    events = run.events_of("nonfinite")
    bad_records = [
        r["step"] for r in run.records if is_nonfinite(r.get("loss")) or is_nonfinite(r.get("grad_norm"))
    ]
    counted = max(run.series("nonfinite_count"), default=0.0)
    if not (events or bad_records or counted):
        return []
    changes = [f"train.lr={fmt(run.lr / 3)}"]
    if run.cfg.train.precision in ("fp16", "fp8") or not run.cfg.found:  # 8 or 16 bits: try bf16
        changes.insert(0, "train.precision=bf16")
    if run.cfg.train.max_grad_norm == 0:
        changes.append("train.max_grad_norm=1.0")
    guard = run.cfg.monitor.guard.nonfinite
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
            f"{len(events)} nonfinite event(s), {len(bad_records)} non-finite record(s); steps {step_list(steps)}",
            changes,
            "fp16 overflows where bf16 does not; a lower learning rate and clipping keep updates bounded; "
            "the guard skips or rolls back bad steps. A batch that is NaN at the same step every time is bad data.",
        )
    ]


def _oom(run: RunView) -> list[Finding]:
    events = run.events_of("oom_backoff")
    if not events:
        return []
    micro, accum = run.cfg.train.micro_batch_size, run.cfg.train.grad_accum
    changes = [f"train.micro_batch_size={max(micro // 2, 1)}", f"train.grad_accum={accum * 2}"]
    if not run.cfg.train.gradient_checkpointing:
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


def _oom_ladder(run: RunView) -> list[Finding]:
    events = run.events_of("oom_ladder")
    if not events:
        return []
    changes = list(dict.fromkeys(str(o) for e in events for o in e.get("overrides", [])))
    taken = ", ".join(f"{e.get('rung')} at step {e.get('step')}" for e in events)
    return [
        Finding(
            "oom_ladder",
            "warning",
            "out of memory with nothing left to halve: the run was restarted with memory savers on",
            f"{len(events)} oom_ladder event(s): {taken}",
            changes,
            "put these settings in the config so that the next run starts with them instead of training again "
            "the steps since the last checkpoint; a shorter data.max_length or more devices leave more room "
            "(`lmforge estimate CONFIG` shows memory per device for each strategy).",
        )
    ]


def _stall(run: RunView) -> list[Finding]:
    events = run.events_of("stall")
    if not events:
        return []
    changes = ["train.dataloader_workers=0"] if run.cfg.train.dataloader_workers else []
    return [
        Finding(
            "stall",
            "error",
            "the run stalled (no step for a long time)",
            f"{len(events)} stall event(s); first at step {events[0].get('step')}: {events[0].get('message', '')}"[
                :300
            ],
            changes
            + [f"monitor.guard.stall_seconds={int((run.cfg.monitor.guard.stall_seconds or 900) * 2)}"],
            "read the thread stacks the watchdog dumped (events/ and the log): a stack in a collective means a rank "
            "died or diverged (rerun with NCCL_DEBUG=INFO); in the DataLoader, a worker hung (workers=0 rules it out); "
            "raise stall_seconds only when the pause was a long eval or checkpoint.",
        )
    ]


def _rollback(run: RunView) -> list[Finding]:
    events = run.events_of("rollback")
    if not events:
        return []
    changes = [f"train.lr={fmt(run.lr / 2)}"]
    if run.cfg.monitor.guard.rollback_lr_scale == 1.0:
        changes.append("monitor.guard.rollback_lr_scale=0.5")
    return [
        Finding(
            "rollback",
            "warning",
            "the guardrails rolled the run back",
            f"{len(events)} rollback(s) at step(s) {step_list([int(e.get('step', 0)) for e in events])}",
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
