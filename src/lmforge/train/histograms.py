"""HistogramCallback: TensorBoard histograms of the trainable weights and their gradients every
`monitor.histograms.every` optimizer steps, and a per-tensor summary in histograms.jsonl.

Taken at HF's `on_pre_optimizer_step`: the gradients are clipped and the guard has judged the
step (a step it dropped has no gradients, so no gradient histograms), and the update is not
applied yet. The cost is bounded: a histogram holds at most `max_elements` values of a tensor,
always the same ones (indices drawn once per tensor from a seed of its name, kept on the CPU),
and all samples and summary numbers reach the host in one copy. The summary (mean, std, abs
max) is over the whole tensor, computed on the device without a full-size copy.

Rank 0 only, over what rank 0 holds: an FSDP2 rank holds one shard of each tensor (its DTensor's
local part), and the names say so (`<name>@rank0-shard`). DeepSpeed ZeRO-3 leaves empty
placeholders on every rank, so there are no histograms there (said once in train.log);
DeepSpeed keeps gradients inside its engine, so its runs get weight histograms only.
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lmforge.config.schema import HistogramsConfig
from lmforge.monitor.metrics import drop_records_after
from lmforge.monitor.run_monitor import RunMonitor

log = logging.getLogger(__name__)
SHARD_SUFFIX = "@rank0-shard"  # a tensor of which rank 0 holds one part
_STATS = ("mean", "std", "abs_max")


class HistogramCallback(TrainerCallback):
    def __init__(self, cfg: HistogramsConfig, monitor: RunMonitor, summary: Path) -> None:
        self.cfg = cfg
        self.monitor = monitor
        self.summary = summary  # histograms.jsonl
        self._indices: dict[str, torch.Tensor | None] = {}  # per tensor; None: small enough to take whole
        self._off = False
        self._warned_no_sink = False

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.is_world_process_zero:  # a resume replays the steps after its checkpoint
            drop_records_after(self.summary, state.global_step)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        step = state.global_step + 1  # global_step counts finished steps; this one is about to finish
        model = kw.get("model")
        if self._off or step % self.cfg.every or not state.is_world_process_zero or model is None:
            return
        self.write(step, model)

    def write(self, step: int, model: torch.nn.Module) -> None:
        """Draw this step's histograms and append its summary line."""
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if any(hasattr(p, "ds_numel") for _, p in named):
            log.warning(
                "monitor.histograms: DeepSpeed ZeRO-3 partitions every parameter, so no rank holds "
                "its values; no histograms in this run"
            )
            self._off = True
            return
        with torch.no_grad():
            tensors = self._tensors(named)
            samples = [self._sample(name, tensor) for name, tensor in tensors]
            stats = [_summary(tensor) for _, tensor in tensors]
            if not tensors:
                return
            # One copy to the host for everything (per-tensor copies each wait for the device).
            device = samples[0].device
            flat = torch.cat([*(s.float().to(device) for s in samples), *(s.to(device) for s in stats)])
            host = flat.cpu().numpy()
        sizes = [s.numel() for s in samples]
        *parts, numbers = np.split(host, np.cumsum(sizes))
        histograms = {name: part for (name, _), part in zip(tensors, parts, strict=True)}
        summary = numbers.reshape(len(tensors), len(_STATS))
        if not self.monitor.log_histograms(step, histograms) and not self._warned_no_sink:
            self._warned_no_sink = True
            log.warning(
                "monitor.histograms: no sink draws histograms (add tensorboard to monitor.loggers); "
                "only the summary in %s is written",
                self.summary.name,
            )
        self._append_summary(step, [name for name, _ in tensors], summary)

    def _tensors(self, named: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
        """(tag, this rank's 1-D values) for each histogram of the step: weights/..., grads/..."""
        tensors: list[tuple[str, torch.Tensor]] = []
        for name, param in named:
            local, tag = _local(param.detach(), name)
            if local.numel() == 0:  # an FSDP rank may hold nothing of a small tensor
                continue
            if self.cfg.weights:
                tensors.append((f"weights/{tag}", local.reshape(-1)))
            if self.cfg.gradients and param.grad is not None:
                grad, _ = _local(param.grad.detach(), name)
                tensors.append((f"grads/{tag}", grad.reshape(-1)))
        return tensors

    def _sample(self, tag: str, values: torch.Tensor) -> torch.Tensor:
        key = tag.split("/", 1)[1]  # a weight and its gradient are sampled at the same places
        if key not in self._indices:
            self._indices[key] = _fixed_indices(key, values.numel(), self.cfg.max_elements)
        indices = self._indices[key]
        if indices is None:
            return values
        return values.index_select(0, indices.to(values.device, non_blocking=True))

    def _append_summary(self, step: int, names: list[str], summary: np.ndarray) -> None:
        record: dict[str, Any] = {"step": step, "stats": list(_STATS), "weights": {}, "grads": {}}
        for name, row in zip(names, summary.tolist(), strict=True):
            kind, tag = name.split("/", 1)
            record[kind][tag] = [_number(v) for v in row]
        try:
            with open(self.summary, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        except OSError as err:  # a full disk loses the summary, never the run
            log.warning("could not append to %s: %s", self.summary, err)


def _local(tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, str]:
    """This rank's part of a (FSDP2 DTensor) tensor and the tag naming it; any other tensor whole."""
    if isinstance(tensor, DTensor):
        return tensor.to_local(), f"{name}{SHARD_SUFFIX}"
    return tensor, name


def _fixed_indices(key: str, numel: int, limit: int) -> torch.Tensor | None:
    """`limit` indices at most into a tensor of `numel` values, the same for a name every time
    (resumes included); None when the whole tensor fits. Drawn with replacement (no full-size
    permutation), so a few repeat and are dropped."""
    if numel <= limit:
        return None
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    drawn = torch.randint(numel, (limit,), generator=generator).unique()  # sorted: friendlier reads
    return drawn.to(torch.int32) if numel < 2**31 else drawn


def _summary(values: torch.Tensor) -> torch.Tensor:
    """[mean, std, abs max] of a 1-D tensor, on its device, in float32 (no full-size copy)."""
    std, mean = torch.std_mean(values, correction=0)
    low, high = torch.aminmax(values)
    return torch.stack([mean, std, torch.maximum(high, -low)]).float()


def _number(value: float) -> float | str:
    """A summary number as metrics.jsonl writes it: 6 significant digits, "nan"/"inf" as strings."""
    if not math.isfinite(value):
        return str(value)
    return float(f"{value:.6g}")
