"""lmforge's Trainer: HF Trainer plus exact real-token counting, through its public step hooks."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer

from lmforge.train.numerics import REAL_TOKENS_KEY


class LmforgeTrainer(Trainer):
    """Counts real tokens from the batch's REAL_TOKENS_KEY (see CountingCollator) into
    `state.num_input_tokens_seen`; HF's own count sums `attention_mask`, which is wrong for
    the 4-D masks of packed rows. Everything else is HF Trainer unchanged."""

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Any:
        tokens = inputs.pop(REAL_TOKENS_KEY, None)
        if tokens is not None:
            total = self.accelerator.gather(tokens.reshape(1).to(self.args.device)).sum()
            self.state.num_input_tokens_seen += int(total.item())
        return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> Any:
        inputs.pop(REAL_TOKENS_KEY, None)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
