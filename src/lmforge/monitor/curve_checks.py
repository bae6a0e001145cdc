"""The checks that read a run's curves: loss trend, instability, overfitting, data-bound steps
and a throughput drop (the event-driven checks are in diagnosis.py)."""

from __future__ import annotations

import os
import statistics

from lmforge.config.stages import stage_guardrails, stage_spec
from lmforge.monitor.run_view import (
    DATA_BOUND_SHARE,
    MIN_POINTS,
    NOISE_SHARE,
    OSCILLATION_FLIPS,
    OSCILLATION_SWING,
    SLOW_STEP_SECONDS,
    SPIKE_RATIO,
    Finding,
    RunView,
    fmt,
    step_list,
    warmup,
)


def check_loss_trend(run: RunView) -> list[Finding]:
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
                [f"train.lr={fmt(run.lr / 10)}", f"train.warmup_steps={warmup(run)}"],
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
                [f"train.lr={fmt(raised_lr(run.lr))}"],
                "too low a learning rate learns nothing in time (raise it); if it plateaued high from the start, check the "
                "data: labels all masked (data_report.json: supervised tokens), text and labels shuffled apart, or a "
                "tokenizer that does not match the model. Too high a learning rate can also stall: try train.lr lower too.",
            )
        ]
    return []


def check_unstable(run: RunView) -> list[Finding]:
    if "spike" not in stage_guardrails(run.cfg.train.stage):
        return []  # online RL: the policy loss sits near zero and changes sign (config/stages.py)
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
    changes = [f"train.lr={fmt(run.lr / 3)}", f"train.warmup_steps={warmup(run)}"]
    if run.cfg.train.max_grad_norm == 0 or run.cfg.train.max_grad_norm > 1.0:
        changes.append("train.max_grad_norm=1.0")
    if noise > NOISE_SHARE and not spikes:  # steady noise rather than spikes: average over more samples
        changes.append(f"train.grad_accum={run.cfg.train.grad_accum * 2}")
    if run.cfg.monitor.guard.spike == "off":
        changes.append("monitor.guard.spike=skip")
    all_spikes = sorted(set(spikes) | {int(e.get("step", 0)) for e in spike_events})
    return [
        Finding(
            "loss_unstable",
            "warning",
            "the training loss spikes or oscillates",
            f"{len(all_spikes)} spike(s) at step(s) {step_list(all_spikes)}; residual noise {noise:.0%} of the mean loss",
            changes,
            "a lower learning rate, a longer warmup and gradient clipping calm the updates (a larger batch calms "
            "steady noise); spikes at the same steps on "
            "every run are data: look at the batches there (duplicates, garbage, very long samples).",
        )
    ]


def check_overfit(run: RunView) -> list[Finding]:
    """Eval loss rising while the training loss still falls. When the training loss rises too the
    run diverges (the trend check reports it), and a best eval before the first step (the eval at
    start) is no step to stop at."""
    if len(run.evals) < 3:
        return []
    best_step, best = min(run.evals, key=lambda point: point[1])
    last_step, last = run.evals[-1]
    if last_step == best_step or last <= best * 1.05 or best_step <= 0:
        return []
    if not _train_loss_fell(run, best_step, last_step):
        return []
    changes = [f"train.max_steps={best_step}", "train.best_metric=eval_loss"]
    if run.cfg.train.weight_decay == 0:
        changes.append("train.weight_decay=0.1")
    if run.cfg.train.method in ("lora", "dora", "qlora"):
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


def check_data_bound(run: RunView) -> list[Finding]:
    shares = run.series("data_wait_share")
    if not shares or statistics.fmean(shares[len(shares) // 2 :]) < DATA_BOUND_SHARE:
        return []
    share = statistics.fmean(shares[len(shares) // 2 :])
    workers = run.cfg.train.dataloader_workers
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    changes = [f"train.dataloader_workers={max(workers * 2, min(8, max(usable - 1, 1)), 1)}"]
    if stage_spec(run.cfg.train.stage).data_kind == "chat" and not (
        run.cfg.data is not None and run.cfg.data.packing
    ):
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


def check_slowdown(run: RunView) -> list[Finding]:
    speed = run.series("tokens_per_s")
    if len(speed) < MIN_POINTS:
        return []
    early = max(statistics.median(speed[i : i + 5]) for i in range(0, len(speed) - 4))
    late = statistics.median(speed[-max(3, len(speed) // 5) :])
    if late >= 0.5 * early:
        return []
    changes = [] if run.cfg.monitor.system_metrics_seconds else ["monitor.system_metrics_seconds=10"]
    return [
        Finding(
            "throughput_dropped",
            "warning",
            "tokens per second fell during the run",
            f"{late:.4g} tokens/s at the end against {early:.4g} at best",
            changes
            + ([f"train.save_every={run.cfg.train.save_every * 4}"] if run.cfg.train.save_every else []),
            "compare the sys_* metrics (CPU, memory, disk, GPU) around the drop: swapping, other jobs, thermal "
            "throttling, or checkpoints written too often to slow storage.",
        )
    ]


def raised_lr(lr: float) -> float:
    """A learning rate to try when the loss does not move: x3 from a usual value; from a very low
    one, orders of magnitude at once (1e-7 -> 1e-5), up to 3e-4 (x3 of 1e-7 would learn nothing
    either)."""
    return lr * 3 if lr >= 1e-4 else min(lr * 100, 3e-4)


def _train_loss_fell(run: RunView, start: int, end: int) -> bool:
    """Whether the training loss around `end` is below the one around `start`."""

    def near(step: int) -> float | None:
        window = [v for s, v in run.losses if abs(s - step) <= max(5, (end - start) // 10)]
        return statistics.median(window) if window else None

    before, after = near(start), near(end)
    return before is None or after is None or after < before


def check_oscillating(run: RunView) -> list[Finding]:
    """A loss that goes up and down step after step (differences alternate in sign) by more than
    a few percent: updates overshoot. Noise alone alternates about two times in three."""
    half = [v for _, v in run.losses][len(run.losses) // 2 :]
    if len(half) < MIN_POINTS or statistics.fmean(half) <= 0:
        return []
    diffs = [b - a for a, b in zip(half, half[1:], strict=False)]
    flips = sum(1 for a, b in zip(diffs, diffs[1:], strict=False) if a * b < 0) / max(len(diffs) - 1, 1)
    swing = statistics.median(abs(d) for d in diffs) / statistics.fmean(half)
    if flips < OSCILLATION_FLIPS or swing < OSCILLATION_SWING:
        return []
    return [
        Finding(
            "loss_oscillating",
            "warning",
            "the training loss oscillates from step to step",
            f"over the second half the loss changed direction at {flips:.0%} of steps, by {swing:.0%} of its "
            "mean (median step)",
            [
                f"train.lr={fmt(run.lr / 3)}",
                f"train.grad_accum={run.cfg.train.grad_accum * 2}",
                f"train.warmup_steps={warmup(run)}",
            ],
            "each update overshoots: a lower learning rate, a larger batch (accumulation) and a longer warmup "
            "smooth it",
        )
    ]


def check_slow(run: RunView) -> list[Finding]:
    """Steps that take long: the usual levers, from what the config shows is not on yet."""
    times = run.series("step_time_s")
    if len(times) < 3 or statistics.median(times) < SLOW_STEP_SECONDS:
        return []
    train, data, model = run.cfg.train, run.cfg.data, run.cfg.model
    changes = []
    if train.precision in ("fp32", "auto"):
        changes.append("train.precision=bf16")
    if stage_spec(train.stage).data_kind == "chat" and not (data is not None and data.packing):
        changes.append("data.packing=true")
    if model is not None and model.attn_implementation == "eager":
        changes.append("model.attn_implementation=sdpa")
    if train.gradient_checkpointing:
        changes.append("train.gradient_checkpointing=false")
    return [
        Finding(
            "slow_training",
            "warning",
            "training steps are slow",
            f"median step time {statistics.median(times):.1f} s over {len(times)} records",
            changes,
            "bf16 (GPUs and recent CPUs), packing instead of padding, a fused attention kernel (sdpa, or "
            "flash attention on GPUs) and a larger micro-batch in place of accumulation raise throughput; "
            "gradient checkpointing trades about a third of the speed for memory",
        )
    ]
