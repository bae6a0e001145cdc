"""train.early_stopping: a run on a plateau stops before max_steps, says why in an event, keeps
its best checkpoint, and counts patience across a crash and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.test_train_e2e import metrics_of, write_config

pytestmark = pytest.mark.slow

# lr 1e-7 moves eval_loss by far less than min_delta: a plateau from the first evaluation on.
PLATEAU = [
    "train.max_steps=40",
    "train.lr=1e-7",
    "train.warmup_steps=0",
    "train.eval_every=2",
    "train.save_every=2",
    "train.early_stopping.metric=eval_loss",
    "train.early_stopping.patience=3",
    "train.early_stopping.min_delta=0.01",
]


def events_of(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for f in sorted((run_dir / "events").glob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]


def test_a_plateau_stops_early_keeps_the_best_checkpoint_and_says_why(tmp_path: Path) -> None:
    result = run_cli("train", str(write_config(tmp_path)), *PLATEAU)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "base"
    # The evaluation at step 2 sets the best (HF does not judge the one at the start, step 0);
    # 4, 6, 8 improve by less than 0.01: three without improvement -> stop at step 8.
    assert metrics_of(run_dir)[-1]["step"] == 8
    kinds = [e["kind"] for e in events_of(run_dir)]
    assert kinds[-2:] == ["early_stopped", "finished"]
    stop = next(e for e in events_of(run_dir) if e["kind"] == "early_stopped")
    assert stop["step"] == 8
    assert "eval_loss did not improve by more than 0.01 in 3 evaluations" in stop["message"]
    best = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    assert best["metric"] == "eval_loss"  # train.best_metric defaulted to the early-stopping metric
    assert f"the best checkpoint is checkpoints/{best['path']}" in stop["message"]
    assert (run_dir / "checkpoints" / best["path"]).is_dir()
    assert (run_dir / "final" / "model.safetensors").is_file()
    # The same command again: the run is finished, not extended to max_steps.
    again = run_cli("train", str(write_config(tmp_path)), *PLATEAU)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished at step 8" in again.stdout


def test_patience_counts_across_a_crash_and_resume(tmp_path: Path) -> None:
    config = str(write_config(tmp_path))
    crashed = run_cli("train", config, *PLATEAU, "debug.crash_at_step=4")
    assert crashed.returncode != 0
    resumed = run_cli("train", config, *PLATEAU)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_dir = tmp_path / "runs" / "base"
    # The evaluation at step 4, before the crash, counts: the stop comes at step 8 as in an
    # uninterrupted run, not three evaluations after the resume (step 10).
    assert metrics_of(run_dir)[-1]["step"] == 8
    assert [e["step"] for e in events_of(run_dir) if e["kind"] == "early_stopped"] == [8]


def test_early_stopping_without_evaluations_is_refused_before_training(tmp_path: Path) -> None:
    result = run_cli("train", str(write_config(tmp_path)), "train.early_stopping.patience=2")
    assert result.returncode == 2
    assert "train.early_stopping" in result.stderr + result.stdout
    assert "set train.eval_every" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr
