"""One optimizer step, top to bottom: everything lmforge adds to HF Trainer's step lives here.

    for each micro-batch (HF's `training_step`, see train/hf_trainer.py):
        drills due at this step (crash, hang, oom; nan / spike scale the loss)   run_drills, scale_loss
        count its real tokens, on the device (no host sync; TRL's masks too)     count_tokens
        forward + backward (HF), as 2, 4, ... chunks after an out-of-memory     batches.split_batch, back_off
        add its loss to the step's, on the device                               add_loss
    once, right before optimizer.step() (HF's `_get_grad_norm` hook):          close_step
        read the previous step's numbers (settle: done on the device a step ago)
        one all_gather of [loss, tokens, grad norm] over ranks, on the device
        judge the step on the device (monitor/guard.py's non-finite and spike   _device_verdict
        rules) into the fused optimizer's `found_inf`: a bad update is dropped
        (parameters, moments, step count unchanged) with no host sync
        (tests/test_host_syncs.py: none before an unlogged update, LM and TRL stages alike)
        other optimizers, DeepSpeed, a sharded norm: the host judges here and
        drops the step's gradients instead (one sync, before the update)
        at a logged step, keep a sample of the parameters for the update ratio
    when something reads the step (a log, a save, an eval, the end), else at    settle
    the next close: tokens into state.num_input_tokens_seen (they survive a
    resume), loss mean / max over ranks, the host's verdict (the same rules on
    the same numbers: events, rollback, stop; acted on a step late when read late)
    after optimizer.step():                                                     measure_update_ratio
    at a logged step, the metrics.jsonl record                                  record
        (a logged step reads more on the host: the update ratio, HF's logged loss)

The Trainer adapter (train/hf_trainer.py) only forwards its hooks here; the callbacks (train/guard_callback.py,
train/callbacks.py) turn the verdicts into events, checkpoints and stops, and write records.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm

from lmforge.config import LmforgeConfig
from lmforge.config.stages import stage_guardrails, stage_spec
from lmforge.distributed.devices import collective_device
from lmforge.models.vision import is_vision_config
from lmforge.monitor.guard import Guardrails, Verdict, settings_for_update_in_backward, stage_guard_settings
from lmforge.monitor.rl_guard import RlGuard
from lmforge.train.batches import mask_tokens
from lmforge.train.drills import Drills
from lmforge.train.numerics import (
    MIX_SOURCE_KEY,
    REAL_TOKENS_KEY,
    RankFlops,
    datasheet_peak,
    memory_metrics,
    mfu,
    peak_flops,
    perplexity,
    rank_flops_per_token,
    vlm_rank_flops,
)

if TYPE_CHECKING:
    from transformers import TrainingArguments

log = logging.getLogger(__name__)
# Parameters sampled for the update-to-parameter ratio: a copy of at most this many elements
# is kept across the optimizer step, at logged steps only.
_RATIO_SAMPLE_ELEMENTS = 8_000_000


class OutOfMemoryGivenUp(RuntimeError):
    """Out of memory with nothing left to halve in the process (one sample per chunk already, or a
    distributed run); the OOM ladder (train/oom_ladder.py) takes it from here."""

    def __init__(self, message: str, *, step: int, micro_batch: int) -> None:
        super().__init__(message)
        self.step = step
        self.micro_batch = micro_batch  # samples per forward pass when memory ran out


def model_flops_per_token(model: Any, seq_len: int, images_per_token: float) -> float:
    """This rank's training FLOPs per token for MFU: a vision-language model's text side per token
    plus its vision tower's per image, spread over the tokens at the data's images per token."""
    if is_vision_config(model.config):
        return vlm_rank_flops(model, seq_len).per_token(1.0, images_per_token)
    return rank_flops_per_token(model, seq_len)


@dataclass
class TrainStep:
    """The state and maths of the optimizer step; `guardrails` None means nothing is judged."""

    guardrails: Guardrails | None = None
    drills: Drills = field(default_factory=Drills)
    rank: int = 0
    world_size: int = 1
    batch_replicas: int = 1  # ranks that read one batch (a tensor x context group): counted once
    oom_backoff: bool = True
    global_batch: int = 0
    max_grad_norm: float = 0.0
    flops_per_token: float = 0.0  # of this rank's part of the model (numerics.rank_flops_per_token)
    peak_flops: float = 0.0
    peak_measured: bool = False  # a CPU's measured matmul peak, not a datasheet value
    token_share: float = 1.0  # the share of the run's tokens this rank computes
    peak_uncertain: bool = False  # a window beat a measured peak: no MFU from then on
    ranks_flops: list[RankFlops] = field(default_factory=list)  # every rank's, from gather_rank_stats
    splits: int = 1  # chunks each micro-batch runs as (the OOM back-off doubles it)
    # This step, on the device until close_step:
    step_loss: torch.Tensor | None = None
    step_tokens: torch.Tensor | None = None
    step_mix: torch.Tensor | None = None  # tokens per source of a mixed stream or store
    tainted: str = ""  # why this step's gradients cannot be trusted (a failed backward)
    in_backward: bool = False
    judge_on_host: bool = False  # DeepSpeed applies the update inside backward: no device flag can stop it
    # This step, after close_step:
    loss_mean: float = math.nan
    loss_max: float = math.nan
    # Since the last logged step:
    data_wait_s: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    rank_stats: dict[str, float] = field(default_factory=dict)
    update_ratio: float | None = None
    verdicts: list[tuple[int, Verdict]] = field(default_factory=list)
    notices: list[tuple[str, str]] = field(default_factory=list)  # (kind, message) events to emit
    # Tokens trained on per source of a mixed stream or store, the whole run (restored on resume):
    mix_tokens: list[int] = field(default_factory=list)
    _ratio_before: list[torch.Tensor] | None = None
    _ratio_params: list[torch.nn.Parameter] = field(default_factory=list)
    _pending: _PendingStep | None = None  # the last closed step, until `settle` reads it

    @classmethod
    def from_config(
        cls,
        cfg: LmforgeConfig,
        model: Any,
        resume: Path | None,
        *,
        update_in_backward: bool = False,
        precision: str = "fp32",
        oom_ladder_climbed: bool = False,
        images_per_token: float = 0.0,
    ) -> TrainStep:
        """The run's step: its guardrails (state restored from `resume`; none when monitoring is off),
        drills and the constants its metrics need. The Trainer adapter binds it to its arguments.
        `images_per_token`: the training data's images per token (a vision-language run's MFU counts
        the vision tower's FLOPs per image, spread over the tokens).

        `update_in_backward`: the engine applies each update inside backward (DeepSpeed), before
        the guard sees the step's gradient norm, so a bad step can be neither skipped nor rolled
        back in the process (the engine cannot be re-initialised): the run stops, and the newest
        complete checkpoint is the last good state; the same launch command resumes from it.
        `precision`: the resolved train.precision, whose matmul peak MFU is measured against.
        `oom_ladder_climbed`: the run took a rung of the OOM ladder; oom drills no longer fire."""
        settings = stage_guard_settings(cfg.monitor.guard, cfg.train.stage)
        spec = stage_spec(cfg.train.stage)
        online_rl = spec.online_rl
        if update_in_backward:
            settings, named = settings_for_update_in_backward(settings, online_rl=online_rl)
            if named:
                log.warning(
                    "monitor.guard: DeepSpeed applies each update inside backward, before a bad step can be "
                    "dropped; %s act as stop (resume from the newest checkpoint: set train.save_every)",
                    " and ".join(named),
                )
        guardrails = Guardrails(settings, total_steps=cfg.train.max_steps) if cfg.monitor.enabled else None
        if guardrails is not None and "rl" in stage_guardrails(cfg.train.stage):
            guardrails.rl = RlGuard(settings.rl)
        if guardrails is not None and resume is not None:
            guardrails.load(resume)
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        return cls(
            guardrails,
            Drills.from_config(cfg.debug, oom_ladder_climbed=oom_ladder_climbed),
            # On-policy micro-batches are prompt rows the trainer generates from (online RL's in whole
            # groups): not token batches to split in chunks.
            oom_backoff=cfg.monitor.enabled and settings.oom_backoff and not spec.on_policy,
            flops_per_token=model_flops_per_token(model, cfg.data.max_length, images_per_token),
            peak_flops=peak_flops(device, precision) if cfg.monitor.enabled else 0.0,
            peak_measured=datasheet_peak(device) is None,
            mix_tokens=restored_mix_tokens(cfg, resume),
            judge_on_host=update_in_backward,
        )

    def bind(self, args: TrainingArguments, *, tensor_ranks: int, context_ranks: int) -> None:
        """Rank, world size, global batch and clipping from the Trainer's arguments (the adapter calls
        this once built). The ranks of a tensor-parallel or context-parallel group read one batch
        (HF's `get_tp_size`, `get_cp_size`): it counts once."""
        self.rank = self.drills.rank = args.process_index
        self.world_size = args.world_size
        self.batch_replicas = tensor_ranks * context_ranks
        # Each rank computes its group's batch (1 / data ranks of the tokens), a context rank 1 / cp of it.
        self.token_share = self.batch_replicas / context_ranks / args.world_size
        data_ranks = args.world_size // self.batch_replicas
        self.global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * data_ranks
        self.max_grad_norm = args.max_grad_norm or 0.0

    # -- each micro-batch -----------------------------------------------------------------
    def run_drills(self, step: int) -> None:
        if self.drills.due("crash", step) is not None:
            raise RuntimeError(f"debug.faults: simulated crash on rank {self.rank} at step {step}")
        hang = self.drills.due("hang", step)
        if hang is not None:
            log.warning("debug.faults: hanging step %d for %.1f s", step, hang.seconds)
            time.sleep(hang.seconds)
        if self.drills.due("oom", step) is not None:
            raise torch.OutOfMemoryError(f"debug.faults: simulated out-of-memory at step {step}")

    def scale_loss(self, step: int) -> float | None:
        """The factor a nan / spike drill multiplies this step's loss by, if one is due."""
        if self.drills.due("nan", step) is not None:
            return math.nan
        spike = self.drills.due("spike", step)
        return spike.factor if spike is not None else None

    def count_tokens(self, inputs: dict[str, Any], device: torch.device) -> None:
        """Add the batch's real tokens (the collator's exact count, else the 2-D masks) on the device."""
        tokens = inputs.pop(REAL_TOKENS_KEY, None)
        sources = inputs.pop(MIX_SOURCE_KEY, None)
        tokens = (mask_tokens(inputs) if tokens is None else tokens).reshape(()).to(device)
        self.step_tokens = tokens if self.step_tokens is None else self.step_tokens + tokens
        if sources is not None and self.mix_tokens:
            mix = source_tokens(inputs, sources, len(self.mix_tokens)).to(device)
            self.step_mix = mix if self.step_mix is None else self.step_mix + mix

    def add_loss(self, loss: torch.Tensor) -> None:
        loss = loss.detach().float().reshape(())
        self.step_loss = loss if self.step_loss is None else self.step_loss + loss

    def back_off(self, step: int, size: int, err: Exception) -> None:
        """After an out-of-memory: run each micro-batch as twice as many chunks, or give up."""
        if not self.oom_backoff or self.world_size > 1 or self.splits >= size:
            reason = (
                "the micro-batch back-off is off (monitor.guard.oom_backoff; always in online RL and "
                "distillation, whose micro-batches are prompts the trainer generates completions for)"
                if not self.oom_backoff
                else "the back-off runs in single-process training only (ranks must split in lockstep)"
                if self.world_size > 1
                else f"each micro-batch already runs one sample at a time ({size} chunks)"
            )
            raise OutOfMemoryGivenUp(
                f"out of memory at step {step} and {reason}; lower train.micro_batch_size or data.max_length, "
                f"or turn on train.gradient_checkpointing ({err})",
                step=step,
                micro_batch=math.ceil(size / self.splits),
            ) from err
        if self.in_backward:
            self.tainted = (
                "out of memory during backward: this step's gradients are partial, so it is not applied"
            )
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.splits *= 2
        micro = math.ceil(size / self.splits)
        self.notices.append(
            (
                "oom_backoff",
                f"out of memory at step {step}: micro-batch {size} now runs as {self.splits} chunks of <= {micro} "
                f"(accumulation x{self.splits}; global batch unchanged)",
            )
        )

    # -- once per optimizer step ----------------------------------------------------------
    def close_step(
        self,
        step: int,
        grad_norm: Any,
        model: torch.nn.Module,
        state: Any,
        *,
        logs: bool,
        optimizer: Any = None,
    ) -> None:
        """Aggregate over ranks and judge the step; drop its update if it is not healthy.

        Where the optimizer can skip its own update on a device flag (torch's fused AdamW / SGD /
        Adagrad: the `found_inf` that AMP's GradScaler uses), the verdict is computed on the device
        and the host reads it later (`settle`), when the device has long finished it: nothing waits
        for the device before the update. Elsewhere (another optimizer, DeepSpeed's update inside
        backward, a sharded norm) the host reads the step's numbers here and drops its gradients."""
        self.settle(state)  # the previous step's numbers: finished on the device a step ago
        replayed = self.guardrails is not None and self.guardrails.replayed(step)
        table, norm_on_device, host_norm = self._gather(grad_norm)
        inner = _device_skipper(optimizer)
        judged_on_device = inner is not None and norm_on_device and self.guardrails is not None
        judged_on_device = judged_on_device and not self.judge_on_host
        drop = (
            self._device_verdict(table, forced=replayed or bool(self.tainted)) if judged_on_device else None
        )
        if inner is not None:
            inner.found_inf = drop.to(torch.float32) if drop is not None else None  # type: ignore[attr-defined]
        self._pending = _PendingStep.start(step, table, drop, norm_on_device, host_norm, self.tainted)
        self.step_loss, self.step_tokens, self.step_mix, self.tainted = None, None, None, ""
        if not judged_on_device:
            verdict = self.settle(state)
            if verdict is not None and verdict.action != "apply":
                for param in model.parameters():
                    param.grad = None  # optimizer.step() now leaves parameters and moments unchanged
                return
        if logs and self.guardrails is not None:
            self._snapshot_for_ratio(model)  # a dropped update leaves the parameters: no ratio then

    @property
    def unsettled(self) -> bool:
        return self._pending is not None

    def settle(self, state: Any) -> Verdict | None:
        """Read the pending step's numbers on the host and account for them: tokens into
        state.num_input_tokens_seen (they survive a resume), loss mean / max over ranks, tokens per
        mixed source, the guardrails' verdict (kept in `verdicts` unless it is "apply"). The
        callbacks call this before anything reads those (a logged, saved or last step)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        rows, dropped = pending.read()
        tokens, norm, mix = self._account(rows, pending)
        state.num_input_tokens_seen += tokens
        self.mix_tokens = [before + now for before, now in zip(self.mix_tokens, mix, strict=True)]
        verdict = self._judge(pending.step, norm, pending.tainted)
        if dropped is not None and dropped != (verdict.action != "apply"):
            # Only at a z-score equal to the threshold in its last bit (a mean over 3+ ranks): the
            # device decided what happened to the parameters; the record says what the host saw.
            log.warning(
                "step %d: the device and the host judged the step differently; the device's stands",
                pending.step,
            )
        if verdict.action != "apply":
            if self.guardrails is not None:
                self.guardrails.note_skipped()
            self.verdicts.append((pending.step, verdict))
            self._ratio_before, self._ratio_params, self.update_ratio = None, [], None
        return verdict

    def _gather(self, grad_norm: Any) -> tuple[torch.Tensor, bool, float | None]:
        """The step's [loss, tokens, grad norm, tokens per mixed source] of every rank, on the device:
        one all_gather, no host sync. Gathered rather than reduced with MAX, which would drop a NaN
        of one rank. A sharded (DTensor) norm is read on the host, by float(): its placement decides
        what a rank holds."""
        loss = self.step_loss if self.step_loss is not None else torch.tensor(math.nan)
        tokens = self.step_tokens if self.step_tokens is not None else torch.zeros((), dtype=torch.int64)
        distributed = self.world_size > 1 and dist.is_initialized()
        device = collective_device() if distributed else loss.device
        columns = [loss.to(device, torch.float64), tokens.to(device, torch.float64)]
        norm_on_device = isinstance(grad_norm, torch.Tensor) and not isinstance(grad_norm, DTensor)
        columns.append(
            grad_norm.detach().reshape(()).to(device, torch.float64)
            if norm_on_device
            else torch.tensor(math.nan, dtype=torch.float64, device=device)
        )
        host_norm = None if norm_on_device else float(grad_norm) if grad_norm is not None else None
        sources = len(self.mix_tokens)  # each source's tokens ride along too: no collective of their own
        mix = self.step_mix if self.step_mix is not None else torch.zeros(sources, dtype=torch.float64)
        mine = torch.cat([torch.stack(columns), mix.to(device, torch.float64)])
        if not distributed:
            return mine.reshape(1, -1), norm_on_device, host_norm
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        return torch.stack(gathered), norm_on_device, host_norm

    def _device_verdict(self, table: torch.Tensor, *, forced: bool) -> torch.Tensor:
        """1.0 where the step must be dropped, on the device: the guardrails' non-finite and spike
        rules (monitor/guard.py) in the same float64 arithmetic the host repeats at `settle`."""
        own = table[dist.get_rank() if self.world_size > 1 and dist.is_initialized() else 0]
        if forced or self.guardrails is None:  # a replayed bad step or a failed backward
            return torch.full((), float(forced), dtype=torch.float64, device=table.device)
        losses = table[:, 0]
        bad = ~(torch.isfinite(losses).all() & torch.isfinite(own[2]))
        limits = self.guardrails.spike_limits()
        if limits is not None:
            mean, deviation, sigma = limits
            bad = bad | ((losses.sum() / losses.numel() - mean) / deviation > sigma)
        return bad.to(torch.float64)

    def _account(self, rows: list[list[float]], pending: _PendingStep) -> tuple[int, float | None, list[int]]:
        """(loss mean, loss max) over ranks into this object; the step's total real tokens, this
        rank's gradient norm and the step's tokens per mixed source (if any)."""
        own_row = rows[dist.get_rank() if self.world_size > 1 and dist.is_initialized() else 0]
        norm = own_row[2] if pending.norm_on_device else pending.host_norm
        losses = [row[0] for row in rows]
        self.loss_mean = math.fsum(losses) / len(losses) if not any(map(math.isnan, losses)) else math.nan
        self.loss_max = max(losses) if not any(map(math.isnan, losses)) else math.nan
        sources = len(self.mix_tokens)
        mixed = [int(round(sum(row[3 + i] for row in rows) / self.batch_replicas)) for i in range(sources)]
        return int(round(sum(row[1] for row in rows) / self.batch_replicas)), norm, mixed

    def _judge(self, step: int, norm: float | None, tainted: str) -> Verdict:
        if self.guardrails is None:
            return Verdict("apply")
        verdict = self.guardrails.judge(step, self.loss_mean, norm)
        if tainted and verdict.action == "apply":
            verdict = Verdict("skip", "oom_backoff", f"step {step}: {tainted}")
        return verdict

    def _snapshot_for_ratio(self, model: torch.nn.Module) -> None:
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
        self._ratio_before = [p.detach().clone() for p in chosen]

    def measure_update_ratio(self) -> None:
        """||update|| / ||parameters|| over the sampled tensors, after the optimizer step."""
        if self._ratio_before is None:
            return
        if not self._ratio_before:  # nothing sampled (DeepSpeed keeps no .grad on the parameters)
            self.update_ratio, self._ratio_before, self._ratio_params = None, None, []
            return
        with torch.no_grad():
            pairs = [
                (_local(p.detach()), _local(b))
                for p, b in zip(self._ratio_params, self._ratio_before, strict=True)
            ]
            # Both norms stay on the device (foreach kernels) and reach the host in one sync,
            # not two per tensor: 78 syncs on llama-tiny cost 4 ms a logged step on an H100.
            before = [b.float() for _, b in pairs]
            deltas = [p.float() - b for (p, _), b in zip(pairs, before, strict=True)]
            sharded = any(isinstance(p, DTensor) for p in self._ratio_params) and dist.is_initialized()
            if not sharded:
                sums = torch.stack([get_total_norm(deltas), get_total_norm(before)]).double().pow(2)
            else:
                # FSDP: each rank holds one shard of every tensor; the norms are over the whole ones,
                # each element counted once though a tensor-parallel group may repeat it (holders).
                world = dist.get_world_size()
                groups: dict[int, list[int]] = {}
                for index, param in enumerate(self._ratio_params):
                    groups.setdefault(_holders(param, world), []).append(index)
                sums = torch.zeros(2, dtype=torch.float64, device=before[0].device)
                for holders, group in groups.items():
                    norms = [
                        get_total_norm([deltas[i] for i in group]),
                        get_total_norm([before[i] for i in group]),
                    ]
                    sums += torch.stack(norms).double().pow(2) / holders
                sums = sums.to(collective_device())
                dist.all_reduce(sums)
            delta, size = sums.tolist()
        self.update_ratio = math.sqrt(delta) / math.sqrt(size) if size > 0 else None
        self._ratio_before, self._ratio_params = None, []

    # -- the metrics record ---------------------------------------------------------------
    def record(self, logs: dict[str, float], window: dict[str, float], *, guarded: bool) -> dict[str, Any]:
        """metrics.jsonl's fields for a logged step, from HF's logs and the throughput window."""
        record: dict[str, Any] = {}
        if "grad_norm" in logs and self.max_grad_norm > 0:
            record["grad_clipped"] = bool(logs["grad_norm"] > self.max_grad_norm)  # grad_norm is pre-clip
        record.update({key: window[key] for key in ("tokens_per_s", "step_time_s") if key in window})
        if not guarded:
            return record
        record.update(self.guardrails.counters() if self.guardrails is not None else {})
        window_s = window.get("window_s")
        if window_s:
            record["samples_per_s"] = window.get("window_steps", 0) * self.global_batch / window_s
            record["data_wait_share"] = min(self.data_wait_s / window_s, 1.0)
            if "tokens_per_s" in window:
                value = self.utilisation(window["tokens_per_s"])
                if value is None:
                    record["mfu_peak_uncertain"] = True
                else:
                    record["mfu"] = value
        self.data_wait_s = 0.0
        if self.update_ratio is not None:
            record["update_ratio"], self.update_ratio = self.update_ratio, None
        if self.splits > 1:
            record["oom_splits"] = self.splits
        record.update(memory_metrics())
        record.update(self.rank_stats)
        record.update({f"mix_tokens_{index}": tokens for index, tokens in enumerate(self.mix_tokens)})
        return record

    def utilisation(self, tokens_per_s: float) -> float | None:
        """MFU of the window (numerics.mfu over every rank), or None once a window has beaten a
        measured CPU peak: that peak was measured while other work shared the cores, so it is low,
        and an MFU against it (this window's or a later one's) is no measurement (said in train.log)."""
        ranks = self.ranks_flops or [RankFlops(self.flops_per_token, self.peak_flops, self.peak_measured)]
        if sum(rank.peak for rank in ranks) <= 0:
            return None
        value = None if self.peak_uncertain else mfu(tokens_per_s, ranks, self.token_share)
        if value is None and not self.peak_uncertain:
            self.peak_uncertain = True
            beaten = max(ranks, key=lambda rank: rank.flops_per_token / rank.peak)
            log.info(
                "MFU: %.3g FLOP/s achieved beats the matmul peak %.3g measured at start (other work shared "
                "the cores then); MFU is not reported from here on (mfu_peak_uncertain in metrics.jsonl)",
                tokens_per_s * self.token_share * beaten.flops_per_token,
                beaten.peak,
            )
        return value

    def gather_rank_stats(self) -> None:
        """Loss mean/max across ranks and a straggler score (slowest rank's step time / median),
        for the next record. A collective: every rank calls it at every logged step."""
        mine = statistics.fmean(self.step_seconds) if self.step_seconds else 0.0
        self.step_seconds.clear()
        self.rank_stats = self._gather_times(mine)

    def _gather_times(self, mine: float) -> dict[str, float]:
        if self.world_size == 1 or not dist.is_initialized():
            return {}
        device = collective_device()
        # With each rank's FLOPs per token and peak, for MFU (a pipeline's stages differ).
        mine_row = [mine, self.flops_per_token, self.peak_flops, float(self.peak_measured)]
        rows = [torch.zeros(4, dtype=torch.float64, device=device) for _ in range(self.world_size)]
        dist.all_gather(rows, torch.tensor(mine_row, dtype=torch.float64, device=device))
        table = torch.stack(rows).tolist()  # one host sync
        self.ranks_flops = [RankFlops(row[1], row[2], bool(row[3])) for row in table]
        values = [row[0] for row in table]
        median = statistics.median(values) or 1e-9
        return {
            "loss_rank_mean": self.loss_mean,
            "loss_rank_max": self.loss_max,
            "straggler": max(values) / median,
            "slowest_rank": values.index(max(values)),
        }


def eval_record(logs: dict[str, float], *, language_model_loss: bool) -> dict[str, float]:
    """eval_loss, and eval_ppl = exp(eval_loss) where the loss is a next-token loss (pretrain,
    sft); a DPO / KTO / reward loss is no perplexity."""
    record = {"eval_loss": logs["eval_loss"]}
    if language_model_loss:
        record["eval_ppl"] = perplexity(logs["eval_loss"])
    return record


def scale_learning_rate(optimizer: Any, scheduler: Any, scale: float) -> None:
    """After a rollback: lower the schedule (its base rates) and the current rates alike."""
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * scale for lr in scheduler.base_lrs]
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["lr"] *= scale


def group_learning_rates(optimizer: Any) -> dict[str, float]:
    """lr_group_<i> of each optimizer param group when there are several (HF's AdamW puts the
    weights with and without decay apart; LoRA+ gives the adapters' B matrices a rate of their own)."""
    groups = getattr(optimizer, "param_groups", None) or []
    if len(groups) < 2:
        return {}
    return {f"lr_group_{i}": float(group["lr"]) for i, group in enumerate(groups)}


def logs_at(args: Any, step: int) -> bool:
    return step == 1 or bool(args.logging_steps and step % args.logging_steps == 0)


def _holders(param: torch.Tensor, world: int) -> int:
    """Ranks that store each element of `param`: all of them for a whole tensor, the world over its
    shard count for a DTensor (FSDP2 alone: 1; a norm weight on the data dimension of a 2-D mesh:
    the tensor degree, one copy per rank of a tensor group)."""
    if not isinstance(param, DTensor):
        return world
    shards = math.prod(param.device_mesh.size(i) for i, p in enumerate(param.placements) if p.is_shard())
    return max(world // shards, 1)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (FSDP2 DTensor) tensor; any other tensor whole."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


MIX_STATE_FILE = "data_state/mix.json"  # in a checkpoint: tokens trained on per mixed source so far


def mixed_sources(cfg: LmforgeConfig) -> int:
    """Sources whose tokens are counted apart: pretraining text read as a stream or from the store."""
    if stage_spec(cfg.train.stage).data_kind != "text" or not (cfg.data.streaming or cfg.data.store):
        return 0
    return len(cfg.data.train)


def restored_mix_tokens(cfg: LmforgeConfig, resume: Path | None) -> list[int]:
    """Tokens per mixed source at the checkpoint `resume` (zeros for a new run or an older checkpoint)."""
    sources = mixed_sources(cfg)
    saved = resume / MIX_STATE_FILE if resume is not None else None
    if saved is None or not saved.is_file():
        return [0] * sources
    tokens = [int(n) for n in json.loads(saved.read_text(encoding="utf-8"))["tokens"]]
    return tokens if len(tokens) == sources else [0] * sources


def save_mix_tokens(tokens: list[int], checkpoint: str | Path) -> None:
    """Record the tokens per mixed source in the checkpoint being saved, for `restored_mix_tokens`."""
    target = Path(checkpoint) / MIX_STATE_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"tokens": tokens}), encoding="utf-8")


def source_tokens(inputs: dict[str, Any], sources: torch.Tensor, count: int) -> torch.Tensor:
    """Tokens of each of `count` sources in a batch: each sample's real tokens under its source."""
    mask = inputs.get("attention_mask")
    ids = inputs["input_ids"]
    per_sample = mask.sum(-1) if mask is not None else torch.full((ids.shape[0],), ids.shape[-1])
    return torch.bincount(sources.reshape(-1).cpu(), weights=per_sample.cpu().double(), minlength=count)


@dataclass
class _PendingStep:
    """A closed step's numbers on their way to the host: on a GPU a non-blocking copy into pinned
    memory started when the step closed, behind an event, so reading it a step later waits for
    nothing queued after it (a plain `.tolist()` then would wait for the whole next step)."""

    step: int
    host: torch.Tensor
    ready: Any  # torch.cuda.Event, or None on a CPU
    columns: int
    device_judged: bool
    norm_on_device: bool
    host_norm: float | None
    tainted: str

    @classmethod
    def start(
        cls,
        step: int,
        table: torch.Tensor,
        drop: torch.Tensor | None,
        norm_on_device: bool,
        host_norm: float | None,
        tainted: str,
    ) -> _PendingStep:
        flat = table.reshape(-1) if drop is None else torch.cat([table.reshape(-1), drop.reshape(1)])
        ready = None
        if flat.is_cuda:
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = flat
        return cls(step, host, ready, table.shape[1], drop is not None, norm_on_device, host_norm, tainted)

    def read(self) -> tuple[list[list[float]], bool | None]:
        """Every rank's row, and whether the device dropped the update (None: the host decides)."""
        if self.ready is not None:
            self.ready.synchronize()
        values = self.host.tolist()
        dropped = bool(values.pop()) if self.device_judged else None
        return [values[i : i + self.columns] for i in range(0, len(values), self.columns)], dropped


# torch's optimizers whose fused kernels skip the whole update (parameters, moments, step count) when
# `found_inf` holds a non-zero value on the device: AMP's GradScaler mechanism, used here for the guardrails.
_FUSED_SKIPPERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def _device_skipper(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under accelerate's wrapper if it can drop an update on a device flag."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if type(inner) not in _FUSED_SKIPPERS or not inner.defaults.get("fused"):
        return None
    return cast(torch.optim.Optimizer, inner)
