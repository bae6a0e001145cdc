"""Crash-and-resume campaign: SIGKILL at random moments, during saves and during final/, then
the same command, until it finishes; the result must be bitwise the uninterrupted run's.

Random moments fall anywhere from start-up (tokenizer training, the data cache) to the end;
"save" kills the process as soon as HF Trainer starts writing a checkpoint into staging, and
"final" as soon as final.partial appears, so a half-written save and a half-written final/ are
always covered. The suite runs three moments (one of each); `make test-integration` runs twelve.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_run_reliability import config_for, same_weights, steps_of

Moment = tuple[str, float]  # ("time", seconds after start) | ("save", step) | ("final", 0)


def kill_at(command: list[str], run_dir: Path, moment: Moment) -> int:
    """Run `command`, SIGKILL it at `moment` (unless it ends first); its exit code."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kind, value = moment
    started = time.monotonic()
    while process.poll() is None and time.monotonic() - started < 300:
        if kind == "time":
            due = time.monotonic() - started >= value
        elif kind == "save":
            due = (run_dir / "checkpoints" / ".staging" / f"checkpoint-{int(value)}").exists()
        else:
            due = (run_dir / "final.partial").exists()
        if due:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    return process.wait()


def run_campaign(tmp_path: Path, corpus: Path, moments: list[Moment]) -> None:
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    config = config_for(reference_dir, corpus)
    command = [sys.executable, "-m", "lmforge.cli.main", "train", str(config)]
    assert subprocess.run(command, capture_output=True).returncode == 0
    reference = reference_dir / "runs" / "base"
    outcomes = []
    for index, moment in enumerate(moments):
        trial = tmp_path / f"trial-{index}"
        trial.mkdir()
        command = [sys.executable, "-m", "lmforge.cli.main", "train", str(config_for(trial, corpus))]
        run_dir = trial / "runs" / "base"
        first = kill_at(command, run_dir, moment)
        again = subprocess.run(command, capture_output=True, text=True)
        assert again.returncode == 0, (moment, again.stderr[-3000:])
        outcomes.append((moment, first))
        assert steps_of(run_dir) == steps_of(reference), moment
        assert same_weights(run_dir, reference), moment
        finished = json.loads((run_dir / "final" / "lmforge_finished.json").read_text())
        assert finished["step"] == 6, moment
    killed = [o for o in outcomes if o[1] == -signal.SIGKILL]
    # Most moments must really have killed the run (a moment after the end proves nothing).
    assert len(killed) >= len(moments) - 1, outcomes


@pytest.mark.integration  # heavy: `make test-integration` (CI stays near its time budget)
@pytest.mark.slow
def test_three_kills_random_during_save_and_during_final(tmp_path: Path, corpus: Path) -> None:
    run_campaign(tmp_path, corpus, [("time", random.Random(7).uniform(4.0, 9.0)), ("save", 4), ("final", 0)])


@pytest.mark.integration
def test_twelve_kills_campaign(tmp_path: Path, corpus: Path) -> None:
    rng = random.Random(2026)
    moments: list[Moment] = [("time", rng.uniform(2.0, 11.0)) for _ in range(8)]
    moments += [("save", 2), ("save", 6), ("final", 0), ("final", 0)]
    run_campaign(tmp_path, corpus, moments)
