"""`make demo` stopped with Ctrl-C during pretraining says so, and the same command resumes the
stage from its checkpoint instead of starting over (or crashing on numbers the stopped run never
produced)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow
ARGS = ("--steps", "40", "--finetune-steps", "10", "--rl-steps", "0")


def _logged_steps(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    steps = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "loss" in record:
            steps.append(int(record["step"]))
    return steps


@pytest.mark.integration  # heavy: `make test-integration` (CI stays near its time budget)
def test_interrupted_quickstart_says_so_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    command = [sys.executable, "-m", "lmforge.cli.main", "quickstart", "--out", str(out), *ARGS]
    first = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ
    )
    deadline = time.monotonic() + 300
    while not any(step >= 10 for step in _logged_steps(out / "pretrain" / "metrics.jsonl")):
        assert first.poll() is None and time.monotonic() < deadline, "pretraining never reached step 10"
        time.sleep(0.5)
    first.send_signal(signal.SIGINT)  # what Ctrl-C sends
    printed, _ = first.communicate(timeout=300)
    assert first.returncode == 0, printed[-3000:]
    match = re.search(
        r"stopped by SIGINT: pretrain saved a checkpoint at step (\d+); run the same command", printed
    )
    assert match, printed[-3000:]
    stopped_at = int(match.group(1))
    assert "Traceback" not in printed and not (out / "quickstart.json").exists()

    second = run_cli("quickstart", "--out", str(out), *ARGS)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"checkpoints/step-{stopped_at}" in second.stderr  # "resuming from .../checkpoints/step-N"
    steps = _logged_steps(out / "pretrain" / "metrics.jsonl")
    assert steps == sorted(set(steps)) and steps[-1] == 40  # continued, no step logged twice
    summary = json.loads((out / "quickstart.json").read_text())
    assert summary["results"]["pretrain"]["steps"] == 40 and "interrupted" not in summary["results"]
    assert summary["results"]["finetune"]["steps"] == 10
