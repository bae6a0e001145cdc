"""The modules a pipeline stage is built from (distributed/pipeline_parallel.py cuts the model with
them): a pass-through for what another stage owns, the layer list that runs one stage's layers, and
the forward torch's PipelineStage runs.

Apart from pipeline_parallel.py because they subclass torch modules: the pipeline dimension is
imported when a config is checked, before the training stack loads, and imports this module only
when it cuts a model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["SKIP", "PassThrough", "StageForward", "StageLayers"]


class PassThrough(nn.Module):
    """Stands in for a module another stage owns: returns its first input unchanged."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


class StageLayers(nn.ModuleList):
    """The decoder's layer list (every index, so every parameter keeps its name). While a stage
    runs (`active`), the decoder's loop over it gets that stage's layers and a pass-through at
    every other index: the layer numbers the loop counts (a Qwen2 layer's attention type) hold,
    and a rank holding two stages (interleaved 1F1B) runs one at a time."""

    active: range | None = None

    def __getitem__(self, index: Any) -> Any:
        found = super().__getitem__(index)
        if not isinstance(index, slice) or self.active is None:
            return found
        first = range(len(self))[index].start if len(self) else 0
        return [layer if first + i in self.active else SKIP for i, layer in enumerate(found)]


SKIP = PassThrough()


class StageForward(nn.Module):
    """The module torch's PipelineStage runs: the HF model's own forward on one stage's part.

    Calling the whole model (not its submodules) keeps FSDP2's root hooks and the model's mask
    and rotary-position code; `StageLayers` limits the loop to this stage's layers. On every stage
    but the last, the "logits" are the hidden states: norm and head are pass-throughs there."""

    def __init__(self, model: nn.Module, *, index: int, total: int, layers: range) -> None:
        super().__init__()
        self.model, self.index, self.total, self.layers = model, index, total, layers

    def forward(self, hidden: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        inputs = {"input_ids": hidden} if self.index == 0 else {"inputs_embeds": hidden}
        model: Any = self.model
        base = getattr(model, model.base_model_prefix)
        held = base.norm, model.lm_head
        base.layers.active = self.layers
        if self.index != self.total - 1:  # the last rank's earlier stage (interleaved): no head yet
            base.norm, model.lm_head = SKIP, SKIP
        try:
            return model(**inputs, **kwargs, use_cache=False).logits
        finally:
            base.layers.active = None
            base.norm, model.lm_head = held
