"""The optimizer step, guarded: measure each step, let the guardrails judge it, act before the update.

`GuardedSteps` is a Trainer mixin over HF Trainer's own step hooks (see UPSTREAM_HOOKS):
- `training_step`: injects drills, sums the step's loss, and on out-of-memory halves the
  micro-batch (the batch runs as 2, 4, ... chunks: same global batch, same gradients);
- `get_batch_samples`: times the wait for data (the data-wait share) and the slow-data drill;
- `_get_grad_norm`: receives the pre-clip gradient norm once per optimizer step, right before
  `optimizer.step()`; this is where a bad step's gradients are dropped, so the optimizer
  applies nothing to parameters or moments (torch optimizers skip parameters without grad).
`StepGuard` holds what these measure and decide; `GuardCallback` (train/guard_callback.py)
turns its decisions into events, checkpoints and stops.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lmforge.config.schema import FaultConfig
from lmforge.monitor.guard import Guardrails, Verdict

log = logging.getLogger(__name__)
# HF Trainer methods overridden here; tests/test_guardrails.py fails if upstream renames them.
UPSTREAM_HOOKS = ("training_step", "compute_loss", "get_batch_samples", "_get_grad_norm", "log")
# Parameters sampled for the update-to-parameter ratio: a copy of at most this many elements
# is kept across the optimizer step, at logged steps only.
_RATIO_SAMPLE_ELEMENTS = 8_000_000


class OutOfMemoryGivenUp(RuntimeError):
    """Out of memory with one sample per chunk already: nothing left to halve."""


@dataclass
class StepGuard:
    guardrails: Guardrails
    faults: list[FaultConfig] = field(default_factory=list)
    rank: int = 0
    world_size: int = 1
    oom_backoff: bool = True
    splits: int = 1  # chunks each micro-batch runs as (OOM back-off doubles it)
    # Per optimizer step, reset by begin_step:
    step_loss: torch.Tensor | None = None
    loss_mean: float = math.nan
    loss_max: float = math.nan
    tainted: str = ""  # why this step's gradients cannot be trusted (a failed backward)
    in_backward: bool = False
    # Since the last logged step:
    data_wait_s: float = 0.0
    verdicts: list[tuple[int, Verdict]] = field(default_factory=list)
    notices: list[tuple[str, str]] = field(default_factory=list)  # (kind, message) events to emit
    _fired: set[tuple[str, int]] = field(default_factory=set)
    _ratio_before: list[torch.Tensor] | None = None
    _ratio_sharded: bool = False
    _ratio_params: list[torch.nn.Parameter] = field(default_factory=list)
    update_ratio: float | None = None

    def fault(self, kind: str, step: int) -> FaultConfig | None:
        """The drill of `kind` due at `step` on this rank, each at most once per process."""
        for fault in self.faults:
            if fault.kind == kind and fault.step == step and fault.rank in (None, self.rank):
                if kind in ("oom", "hang", "slow_data") and (kind, step) in self._fired:
                    return None  # a replay after rollback does not re-run one-off drills
                self._fired.add((kind, step))
                return fault
        return None

    def add_loss(self, loss: torch.Tensor) -> None:
        loss = loss.detach().float().reshape(())
        self.step_loss = loss if self.step_loss is None else self.step_loss + loss

    def decide(self, step: int, grad_norm: Any, model: torch.nn.Module) -> Verdict:
        """Judge the step about to be applied; drop its gradients unless it is healthy."""
        local = self.step_loss if self.step_loss is not None else torch.tensor(math.nan)
        self.loss_mean, self.loss_max = _across_ranks(local, self.world_size)
        norm = float(grad_norm) if grad_norm is not None else None
        verdict = self.guardrails.judge(step, self.loss_mean, norm)
        if self.tainted and verdict.action == "apply":
            verdict = Verdict("skip", "oom_backoff", f"step {step}: {self.tainted}")
        if verdict.action != "apply":
            for param in model.parameters():
                param.grad = None  # optimizer.step() now leaves parameters and moments unchanged
            self.guardrails.note_skipped()
            self.verdicts.append((step, verdict))
        self.step_loss, self.tainted = None, ""
        return verdict

    def snapshot_for_ratio(self, model: torch.nn.Module) -> None:
        """Copy a sample of trainable parameters before the update (logged steps only)."""
        params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
        chosen: list[torch.nn.Parameter] = []
        used = 0
        stride = max(len(params) // 32, 1)  # spread the sample over the depth of the model
        for param in params[::stride]:
            if used + param.numel() > _RATIO_SAMPLE_ELEMENTS and chosen:
                break
            chosen.append(param)
            used += param.numel()
        self._ratio_params = chosen
        self._ratio_sharded = any(isinstance(p, DTensor) for p in chosen)
        self._ratio_before = [p.detach().clone() for p in chosen]

    def measure_ratio(self) -> None:
        """||update|| / ||parameters|| over the sampled tensors, after the optimizer step."""
        if self._ratio_before is None:
            return
        with torch.no_grad():
            pairs = [
                (_local(p.detach()), _local(b))
                for p, b in zip(self._ratio_params, self._ratio_before, strict=True)
            ]
            sums = torch.tensor(
                [
                    sum(float((p - b).float().pow(2).sum()) for p, b in pairs),
                    sum(float(b.float().pow(2).sum()) for _, b in pairs),
                ],
                dtype=torch.float64,
            )
            if self._ratio_sharded and dist.is_initialized():
                # FSDP: each rank holds one shard of every tensor; the norms are over the whole ones.
                dist.all_reduce(sums)
            delta, size = float(sums[0]), float(sums[1])
        self.update_ratio = math.sqrt(delta) / math.sqrt(size) if size > 0 else None
        self._ratio_before, self._ratio_params = None, []


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (FSDP2 DTensor) tensor; any other tensor whole."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _across_ranks(loss: torch.Tensor, world_size: int) -> tuple[float, float]:
    """(mean, max) of the step loss over ranks: every rank must take the same decision.
    Gathered rather than reduced with MAX, which would drop a NaN of one rank."""
    if world_size == 1 or not dist.is_initialized():
        value = float(loss)
        return value, value
    device = _collective_device()
    gathered = [torch.zeros((), device=device) for _ in range(world_size)]
    dist.all_gather(gathered, loss.to(device))
    losses = torch.stack(gathered)
    return float(losses.mean()), float(losses.max())


def _collective_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


class GuardedSteps:
    """Trainer mixin; without a `step_guard` attribute it changes nothing."""

    step_guard: StepGuard | None = None

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Any:
        guard = self.step_guard
        if guard is None:
            return super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        step = self.state.global_step + 1  # type: ignore[attr-defined]
        if guard.fault("crash", step) is not None:
            raise RuntimeError(f"debug.faults: simulated crash on rank {guard.rank} at step {step}")
        hang = guard.fault("hang", step)
        if hang is not None:
            log.warning("debug.faults: hanging step %d for %.1f s", step, hang.seconds)
            time.sleep(hang.seconds)
        while True:
            guard.in_backward = False  # set once a backward may have added to the gradients
            try:
                if guard.fault("oom", step) is not None:
                    raise torch.OutOfMemoryError(f"debug.faults: simulated out-of-memory at step {step}")
                loss = self._chunked_step(model, inputs, num_items_in_batch, guard.splits)
                break
            except torch.OutOfMemoryError as err:
                self._back_off(guard, step, inputs, err)
        guard.add_loss(loss)
        return loss

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        out = super().compute_loss(model, inputs, *args, **kwargs)  # type: ignore[misc]
        guard = self.step_guard
        if guard is None or not model.training:
            return out
        guard.in_backward = True  # the caller runs backward next: an OOM from here taints the grads
        step = self.state.global_step + 1  # type: ignore[attr-defined]
        factor = None
        if guard.fault("nan", step) is not None:
            factor = math.nan
        elif (spike := guard.fault("spike", step)) is not None:
            factor = spike.factor
        if factor is None:
            return out
        log.warning("debug.faults: loss x %s at step %d", factor, step)
        return (out[0] * factor, *out[1:]) if isinstance(out, tuple) else out * factor

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        guard = self.step_guard
        started = time.perf_counter()
        if guard is not None:
            slow = guard.fault("slow_data", self.state.global_step + 1)  # type: ignore[attr-defined]
            if slow is not None:
                time.sleep(slow.seconds)
        batches = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        if guard is not None:
            guard.data_wait_s += time.perf_counter() - started
        return batches

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)  # type: ignore[misc]
        guard = self.step_guard
        if guard is not None:
            step = self.state.global_step + 1  # type: ignore[attr-defined]
            verdict = guard.decide(step, norm, model)
            if verdict.action == "apply" and _logs_at(self.args, step):  # type: ignore[attr-defined]
                guard.snapshot_for_ratio(model)
        return norm

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        super().log(logs, *args, **kwargs)  # type: ignore[misc]
        # HF zeroes its loss accumulator by subtracting it from itself, which leaves a NaN in
        # place forever: after a skipped non-finite step every later logged loss would read NaN.
        accumulated = getattr(self, "_tr_loss", None)
        if isinstance(accumulated, torch.Tensor) and not bool(torch.isfinite(accumulated).all()):
            accumulated.zero_()

    def _chunked_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items: Any, splits: int
    ) -> Any:
        guard = self.step_guard
        assert guard is not None
        if splits == 1:
            return super().training_step(model, inputs, num_items)  # type: ignore[misc]
        size = _batch_size(inputs)
        chunks = _split_batch(inputs, min(splits, size))
        saved = self.current_gradient_accumulation_steps  # type: ignore[has-type]
        total = None
        try:
            for chunk in chunks:
                # Where the loss is a per-sample mean (not normalised by the step's token count),
                # each chunk's mean is weighted by its share of the micro-batch.
                self.current_gradient_accumulation_steps = saved * size / _batch_size(chunk)
                loss = super().training_step(model, chunk, num_items)  # type: ignore[misc]
                total = loss if total is None else total + loss
        finally:
            self.current_gradient_accumulation_steps = saved
        return total

    def _back_off(self, guard: StepGuard, step: int, inputs: dict[str, Any], err: Exception) -> None:
        size = _batch_size(inputs)
        if not guard.oom_backoff or guard.world_size > 1 or guard.splits >= size:
            reason = (
                "monitor.guard.oom_backoff is off"
                if not guard.oom_backoff
                else "the back-off runs in single-process training only (ranks must split in lockstep)"
                if guard.world_size > 1
                else f"each micro-batch already runs one sample at a time ({size} chunks)"
            )
            raise OutOfMemoryGivenUp(
                f"out of memory at step {step} and {reason}; lower train.micro_batch_size or data.max_length, "
                f"or turn on train.gradient_checkpointing ({err})"
            ) from err
        if guard.in_backward:
            guard.tainted = (
                "out of memory during backward: this step's gradients are partial, so it is not applied"
            )
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        guard.splits *= 2
        micro = math.ceil(size / guard.splits)
        guard.notices.append(
            (
                "oom_backoff",
                f"out of memory at step {step}: micro-batch {size} now runs as {guard.splits} chunks of <= {micro} "
                f"(accumulation x{guard.splits}; global batch unchanged)",
            )
        )


def _logs_at(args: Any, step: int) -> bool:
    return step == 1 or (args.logging_steps and step % args.logging_steps == 0)


def _batch_size(inputs: dict[str, Any]) -> int:
    return next(v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.ndim >= 1)


def _split_batch(inputs: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """Split every batch-dimension tensor into `parts` chunks; other values are shared."""
    size = _batch_size(inputs)
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
