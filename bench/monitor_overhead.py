"""The cost of lmforge's monitoring: steady-state steps/s with everything on vs monitoring off.

Same model (llama-tiny, 5M parameters), data, batch and seed, fp32, in one process; runs
alternate off, on, off, on. "on" is the worst case: logging every step (so the update-ratio
copy, MFU, memory and per-step guard checks run every step), guardrails, the stall watchdog,
the system sampler every second and the Prometheus endpoint. "off" is `monitor.enabled=false`:
metrics.jsonl and TensorBoard only. Both are timed by the same step-end clock.

    .venv/bin/python bench/monitor_overhead.py [--steps 60 --warmup 10 --repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from train_overhead import StepClock, lmforge_config

from lmforge.train.runner import run_training


def timed_run(out: Path, steps: int, warmup: int, *, monitored: bool) -> float:
    cfg = lmforge_config(out, steps, log_every=1)
    cfg.run.name = "on" if monitored else "off"
    cfg.monitor.enabled = monitored
    cfg.monitor.system_metrics_seconds = 1.0
    cfg.monitor.prometheus.enabled = monitored
    cfg.monitor.prometheus.port = 0
    clock = StepClock()
    run_training(cfg, extra_callbacks=[clock])
    return clock.steps_per_s(warmup)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        timed_run(out, 12, 2, monitored=False)  # warm the data cache and the tokenizer
        for _ in range(args.repeats):
            for name in ("off", "on"):
                rate = timed_run(out, args.steps, args.warmup, monitored=name == "on")
                results[name].append(rate)
                print(f"{name:3} {rate:.3f} steps/s", flush=True)
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"monitoring off: {off:.3f} steps/s (runs {results['off']})")
    print(f"monitoring on:  {on:.3f} steps/s (runs {results['on']})")
    print(f"ratio on/off: {on / off:.3f} (goal >= 0.97)")


if __name__ == "__main__":
    main()
