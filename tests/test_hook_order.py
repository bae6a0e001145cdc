"""The hooks lmforge takes from HF Trainer's step run when lmforge needs them to, on the installed
transformers: a signature check (tests/test_upstream.py) cannot see call order.

- The skip-step hook (HF's private `_get_grad_norm`, which the adapter overrides to close the step:
  train/step.py close_step) runs after the backward of every micro-batch of the step and before
  optimizer.step(), exactly once per optimizer step, with gradient accumulation.
- A micro-batch split into chunks after an out-of-memory error (HF's private
  `current_gradient_accumulation_steps` rescaled) trains as the unsplit micro-batch does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lmforge.config import load_config
from lmforge.monitor.events import read_events
from lmforge.train.runner import run_training
from lmforge.train.step import TrainStep
from tests.conftest import SMALL_ARCH

ACCUMULATION = 2


def _config(tmp_path: Path, corpus: Path, name: str, max_steps: int, faults: list[Any] | None = None) -> Any:
    return load_config(
        None,
        base={
            "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 0},
            "model": {"preset": "llama-tiny", "config": SMALL_ARCH},
            "tokenizer": {"train": {"vocab_size": 300}},
            "data": {"train": [{"path": str(corpus)}], "max_length": 64, "eval_fraction": 0},
            "train": {
                "max_steps": max_steps,
                "micro_batch_size": 4,
                "grad_accum": ACCUMULATION,
                "lr": 3e-3,
                "precision": "fp32",
                "log_every": 1,
                "warmup_steps": 0,
            },
            "monitor": {"loggers": []},
            "debug": {"faults": faults or []},
        },
    )


def test_the_skip_step_hook_runs_between_backward_and_optimizer_step(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    real_backward = torch.Tensor.backward
    real_close = TrainStep.close_step

    def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = real_backward(tensor, *args, **kwargs)
        order.append("backward")
        return result

    def close_step(
        self: TrainStep, step: int, grad_norm: Any, model: torch.nn.Module, *args: Any, **kw: Any
    ) -> None:
        # After backward: the step's gradients are there to judge (and to drop).
        has_grads = any(p.grad is not None for p in model.parameters() if p.requires_grad)
        order.append("close_step" if has_grads else "close_step without gradients")
        real_close(self, step, grad_norm, model, *args, **kw)

    def optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        order.append("optimizer.step")

    monkeypatch.setattr(torch.Tensor, "backward", backward)
    monkeypatch.setattr(TrainStep, "close_step", close_step)
    handle = register_optimizer_step_pre_hook(optimizer_step)
    try:
        outcome = run_training(_config(tmp_path, corpus, "order", max_steps=3))
    finally:
        handle.remove()
    assert outcome.steps == 3
    one_step = ["backward"] * ACCUMULATION + ["close_step", "optimizer.step"]
    assert order == one_step * 3


def test_a_micro_batch_split_after_out_of_memory_trains_as_the_whole(tmp_path: Path, corpus: Path) -> None:
    whole = run_training(_config(tmp_path, corpus, "whole", max_steps=4))
    split = run_training(_config(tmp_path, corpus, "split", max_steps=4, faults=[{"kind": "oom", "step": 2}]))
    events = read_events(split.run_dir / "events")
    assert [e["step"] for e in events if e["kind"] == "oom_backoff"] == [2]

    def losses(run_dir: Path) -> list[float]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if "loss" in r and "step" in r]

    # The chunks' losses add up to the unsplit micro-batch's: the same logged losses and weights.
    assert losses(split.run_dir) == pytest.approx(losses(whole.run_dir), rel=1e-4)
    a = load_file(whole.final_dir / "model.safetensors")
    b = load_file(split.final_dir / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4)
