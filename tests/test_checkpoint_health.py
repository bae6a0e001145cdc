"""Checkpoints and outputs at the edges (issue 33, items 2 and 15): a sealed checkpoint whose
weights are NaN is never resumed, the messages that refuse a checkpoint or a weights file say
what exists and what to do, and an unwritable `ckpt convert --out` is bad input (exit 2).

Unit-level and fast: the end-to-end runs are in tests/test_run_reliability.py.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lmforge.ckpt.atomic import commit_checkpoint
from lmforge.ckpt.safe_load import refusal_message
from lmforge.config.schema import TrainConfig
from lmforge.errors import UserInputError
from lmforge.run_layout import RunPaths
from lmforge.train.run_start import decide_start
from tests.conftest import run_cli


def sealed_checkpoint(checkpoints: Path, step: int, *, weight: float) -> Path:
    """checkpoints/step-N as a run seals it: trainer state and weights filled with `weight`."""
    staging = checkpoints / f".staging-{step}"
    staging.mkdir(parents=True)
    (staging / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    save_file({"w": torch.full((4, 4), weight), "ids": torch.arange(4)}, str(staging / "model.safetensors"))
    return commit_checkpoint(staging, checkpoints / f"step-{step}", step=step)


def finished_at(paths: RunPaths, step: int) -> None:
    paths.final.mkdir(parents=True)
    paths.finished.write_text(json.dumps({"step": step, "target": {"max_steps": step, "epochs": 1.0}}))


def test_a_nan_checkpoint_is_skipped_for_the_previous_one_and_all_nan_is_refused(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    sealed_checkpoint(paths.checkpoints, 25, weight=0.5)
    sealed_checkpoint(paths.checkpoints, 30, weight=float("nan"))
    start = decide_start(TrainConfig(max_steps=40), paths, overwrite=False, act=True)
    assert start.resume is not None and start.resume.path.name == "step-25"

    sealed_checkpoint(paths.checkpoints, 20, weight=float("inf"))
    (paths.checkpoints / "step-25").rename(tmp_path / "step-25-aside")
    with pytest.raises(UserInputError) as refused:
        decide_start(TrainConfig(max_steps=40), paths, overwrite=False, act=True)
    message = str(refused.value)
    assert "no checkpoint in" in message and "can be resumed" in message
    assert "step-30: model.safetensors: 1 of 2 weight tensors hold NaN or inf (first: w)" in message
    assert "step-20: model.safetensors" in message and "run.overwrite=true" in message
    assert not (paths.root / "previous").exists()  # nothing was moved aside for a silent fresh start


def test_extending_a_finished_run_whose_last_checkpoint_is_refused_names_the_usable_one(
    tmp_path: Path,
) -> None:
    paths = RunPaths(tmp_path / "run")
    sealed_checkpoint(paths.checkpoints, 25, weight=0.5)
    sealed_checkpoint(paths.checkpoints, 30, weight=float("nan"))
    finished_at(paths, 30)
    with pytest.raises(UserInputError) as refused:
        decide_start(TrainConfig(max_steps=40), paths, overwrite=False, act=True)
    message = str(refused.value)
    assert "keeps no checkpoint" not in message  # step-25 exists: the old message said otherwise
    assert "finished at step 30, but its checkpoint of that step cannot be resumed" in message
    assert "step-30: model.safetensors: 1 of 2 weight tensors hold NaN or inf" in message
    assert f"train.resume={paths.checkpoints / 'step-25'}" in message and "steps 26-30" in message


def test_a_refused_weights_file_outside_a_checkpoint_does_not_speak_of_resuming() -> None:
    err = pickle.UnpicklingError("Weights only load failed. Unsupported global: GLOBAL posix.system")
    model_file = refusal_message("/models/base/pytorch_model.bin", err)
    assert "posix.system" in model_file and "resume" not in model_file and "checkpoint" not in model_file
    assert "safetensors" in model_file and "model.allow_bin_weights" in model_file
    in_checkpoint = refusal_message("/runs/a/checkpoints/step-4/optimizer.pt", err)
    assert "delete this checkpoint and resume from an earlier one" in in_checkpoint


@pytest.mark.parametrize("where", ["read-only", "file-in-the-way"])
def test_ckpt_convert_to_an_unwritable_out_exits_2_naming_it(tmp_path: Path, where: str) -> None:
    if where == "read-only":
        out = Path("/sys/lmforge-out")  # sysfs: no one, root included, creates a directory there
        if not Path("/sys/class").is_dir():
            pytest.skip("no sysfs here")
    else:
        (tmp_path / "a-file").write_text("")
        out = tmp_path / "a-file" / "out"
    source = tmp_path / "model"
    source.mkdir()  # refused before any work, so no model is needed
    result = run_cli("ckpt", "convert", str(source), "--to", "safetensors", "--out", str(out))
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"--out {out}" in result.stderr and "pass a writable directory as --out" in result.stderr
    assert "Traceback" not in result.stderr and not Path(f"{out}.partial").exists()


def test_a_deepspeed_checkpoint_with_nan_weights_is_not_resumable(tmp_path: Path) -> None:
    from lmforge.ckpt.resumable import resume_problem

    checkpoint = tmp_path / "step-3"
    (checkpoint / "global_step3").mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    states = checkpoint / "global_step3" / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(3), "b": torch.tensor([float("nan")])}}, states)
    problem = resume_problem(checkpoint, 3)
    assert problem is not None
    assert (
        "global_step3/mp_rank_00_model_states.pt: 1 of 2 weight tensors hold NaN or inf (first: b)" in problem
    )
    torch.save({"module": {"w": torch.ones(3), "b": torch.zeros(1)}}, states)
    assert resume_problem(checkpoint, 3) is None


def test_a_nan_final_evaluation_writes_no_final(tmp_path: Path) -> None:
    from lmforge.errors import WorkFailed
    from lmforge.train.final import refuse_nonfinite_final_eval

    paths = RunPaths(tmp_path / "run")
    history = [
        {"step": 4, "eval_loss": 3.2},
        {"step": 8, "loss": 2.9},
        {"step": 8, "eval_loss": float("nan")},
    ]
    with pytest.raises(
        WorkFailed, match=r"final/ was not written: the evaluation at step 8 gave eval_loss nan"
    ):
        refuse_nonfinite_final_eval(history, paths)
    refuse_nonfinite_final_eval(history[:2], paths)  # a finite last evaluation passes
    refuse_nonfinite_final_eval([{"step": 8, "loss": 2.9}], paths)  # so does a run without eval data
