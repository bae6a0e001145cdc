"""lmforge's Trainers: HF Trainer or a TRL trainer plus exact real-token counting, guarded
steps (train/guarded.py) through their step hooks, and FSDP2 that really shards on CPU too
(distributed/fsdp.py). Everything else is the library's trainer unchanged."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer

from lmforge.distributed.fsdp import CpuFsdp
from lmforge.train.guarded import GuardedSteps
from lmforge.train.numerics import REAL_TOKENS_KEY


class RealTokenCounting:
    """Counts the real (non-pad) tokens of each training batch into `state.num_input_tokens_seen`.

    lmforge's own collators put the exact count under REAL_TOKENS_KEY (HF's own count sums
    `attention_mask`, which is wrong for the 4-D masks of packed rows). TRL's collators pad
    with plain 2-D masks, so there the masks of the sequences the model runs are summed.
    """

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Any:
        tokens = inputs.pop(REAL_TOKENS_KEY, None)
        if tokens is None:
            tokens = _mask_tokens(inputs)
        total = self.accelerator.gather(tokens.reshape(1).to(self.args.device)).sum()  # type: ignore[attr-defined]
        self.state.num_input_tokens_seen += int(total.item())  # type: ignore[attr-defined]
        return super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> Any:
        inputs.pop(REAL_TOKENS_KEY, None)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)  # type: ignore[misc]


def _mask_tokens(inputs: dict[str, Any]) -> torch.Tensor:
    """Sum of the 2-D attention masks of every sequence the model runs (chosen, rejected, KL, ...);
    `prompt_*` masks are parts of those sequences, not sequences of their own."""
    total = torch.zeros((), dtype=torch.int64)
    for key, value in inputs.items():
        if key.endswith("attention_mask") and not key.startswith("prompt") and getattr(value, "ndim", 0) == 2:
            total = total + value.sum().cpu()
    return total


class LmforgeTrainer(CpuFsdp, RealTokenCounting, GuardedSteps, Trainer):
    """HF Trainer with real FSDP2 on CPU too, exact real-token counting and guarded steps (pretrain and sft)."""


def counting(trainer_class: type[Trainer]) -> type[Trainer]:
    """`trainer_class` (a TRL trainer) with CpuFsdp, RealTokenCounting and GuardedSteps mixed in."""
    return type(
        f"Lmforge{trainer_class.__name__}", (CpuFsdp, RealTokenCounting, GuardedSteps, trainer_class), {}
    )
