"""The cost of `monitor.comm_metrics` (on by default) under DDP: steady-state step time of a
2-process `lmforge launch` with the collectives timed vs not.

Same model (llama-tiny, 5M parameters), data, batch and seed, fp32, 2 processes (gloo on CPU,
nccl on GPUs); runs alternate off, on. Each run's step time is the median `step_time_s` of its
logged steps after the warm-up (metrics.jsonl, rank 0). The DDP comm hook replaces DDP's
built-in C++ all-reduce with torch's Python default hook plus two clock reads per bucket.

    .venv/bin/python bench/comm_overhead.py [--steps 40 --warmup 10 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml


def write_config(out: Path, name: str, steps: int, *, comm: bool) -> Path:
    config = {
        "run": {"name": name, "output_dir": str(out), "seed": 0, "overwrite": True},
        "model": {"preset": "llama-tiny"},
        "tokenizer": {"train": {"vocab_size": 8192, "max_chars": 3_000_000}},
        "data": {
            "train": [{"path": "builtin:python-stdlib", "max_documents": 400}],
            "max_length": 256,
            "cache_dir": str(out / "cache"),
        },
        "train": {"max_steps": steps, "micro_batch_size": 4, "precision": "fp32", "resume": "never"},
        "distributed": {"strategy": "ddp"},
        "monitor": {"comm_metrics": comm, "eval_generations": None},
    }
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def timed_run(out: Path, name: str, steps: int, warmup: int, *, comm: bool) -> tuple[float, float | None]:
    """(median step seconds after warm-up, median comm_share or None)."""
    config = write_config(out, name, steps, comm=comm)
    command = [sys.executable, "-m", "lmforge.cli.main", "launch", str(config), "--nproc-per-node", "2"]
    subprocess.run(command, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r.get("step", 0) > warmup and "step_time_s" in r]
    share = [r["comm_share"] for r in steady if "comm_share" in r]
    return statistics.median(r["step_time_s"] for r in steady), statistics.median(share) if share else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        timed_run(out, "warm", 4, 0, comm=False)  # the data cache and the tokenizer
        for repeat in range(args.repeats):
            for name in ("off", "on"):
                step_s, share = timed_run(out, f"{name}-{repeat}", args.steps, args.warmup, comm=name == "on")
                seconds[name].append(step_s)
                extra = f", comm_share {share:.3f}" if share is not None else ""
                print(f"{name:3} {step_s:.4f} s/step{extra}", flush=True)
    off, on = statistics.median(seconds["off"]), statistics.median(seconds["on"])
    print(f"comm metrics off: {off:.4f} s/step (runs {seconds['off']})")
    print(f"comm metrics on:  {on:.4f} s/step (runs {seconds['on']})")
    print(f"throughput ratio on/off: {off / on:.3f} (goal >= 0.97)")


if __name__ == "__main__":
    main()
