"""What one micro-batch is, as the step sees it: its size, its real tokens by attention mask, and
its split into chunks when an out-of-memory error makes the step run it in parts."""

from __future__ import annotations

from typing import Any

import torch


def mask_tokens(inputs: dict[str, Any]) -> torch.Tensor:
    """Sum of the 2-D attention masks of every sequence the model runs (chosen, rejected, KL, ...);
    `prompt_*` masks are parts of those sequences, not sequences of their own (TRL's collators).
    TRL's online RL batches hold a prompt and a completion mask: the model runs both.

    The count stays on the masks' device: the step adds it up there and syncs once per optimizer
    step (train/step.py close_step), not once per micro-batch."""
    if "completion_mask" in inputs and "prompt_mask" in inputs:
        return inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()
    masks = [
        value
        for key, value in inputs.items()
        if key.endswith("attention_mask") and not key.startswith("prompt") and getattr(value, "ndim", 0) == 2
    ]
    total = torch.zeros((), dtype=torch.int64, device=masks[0].device if masks else None)
    for mask in masks:
        total = total + mask.sum()
    return total


def batch_size(inputs: dict[str, Any]) -> int:
    return next(v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.ndim >= 1)


def split_batch(inputs: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """Split every batch-dimension tensor into `parts` chunks; other values are shared."""
    size = batch_size(inputs)
    pieces = {
        key: torch.tensor_split(value, parts)
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == size
        else None
        for key, value in inputs.items()
    }
    return [
        {key: (pieces[key][i] if pieces[key] is not None else value) for key, value in inputs.items()}  # type: ignore[index]
        for i in range(parts)
    ]
