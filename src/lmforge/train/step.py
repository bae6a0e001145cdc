"""One optimizer step, top to bottom: everything lmforge adds to HF Trainer's step lives here.

    for each micro-batch (HF's `training_step`, see train/hf_trainer.py):
        drills due at this step (crash, hang, oom; nan / spike scale the loss)   run_drills, scale_loss
        count its real tokens, on the device (no host sync; TRL's masks too)     count_tokens
        forward + backward (HF), as 2, 4, ... chunks after an out-of-memory     batches.split_batch, back_off
        add its loss to the step's, on the device                               add_loss
    once, right before optimizer.step() (HF's `_get_grad_norm` hook):          close_step
        one all_gather of [loss, tokens, grad norm] over ranks: the step's one
        host sync (tests/test_host_syncs.py counts it, LM and TRL stages alike)
        tokens into state.num_input_tokens_seen (they survive a resume)
        judge the step (monitor/guard.py): apply it, or drop its gradients so
        the optimizer changes neither parameters nor moments
        at a logged step, keep a sample of the parameters for the update ratio
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
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm

from lmforge.config import LmforgeConfig
from lmforge.config.stages import stage_guardrails, stage_spec
from lmforge.distributed.devices import collective_device
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
    ) -> TrainStep:
        """The run's step: its guardrails (state restored from `resume`; none when monitoring is off),
        drills and the constants its metrics need. The Trainer adapter binds it to its arguments.

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
            flops_per_token=rank_flops_per_token(model, cfg.data.max_length),
            peak_flops=peak_flops(device, precision) if cfg.monitor.enabled else 0.0,
            peak_measured=datasheet_peak(device) is None,
            mix_tokens=restored_mix_tokens(cfg, resume),
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
        self, step: int, grad_norm: Any, model: torch.nn.Module, state: Any, *, logs: bool
    ) -> None:
        """Aggregate over ranks, count the tokens, judge the step and drop it if it is not healthy."""
        tokens, norm, mix = self._aggregate(grad_norm)
        state.num_input_tokens_seen += tokens
        self.mix_tokens = [before + now for before, now in zip(self.mix_tokens, mix, strict=True)]
        verdict = self._judge(step, norm)
        if verdict.action != "apply":
            for param in model.parameters():
                param.grad = None  # optimizer.step() now leaves parameters and moments unchanged
            if self.guardrails is not None:
                self.guardrails.note_skipped()
            self.verdicts.append((step, verdict))
        elif logs and self.guardrails is not None:
            self._snapshot_for_ratio(model)
        self.step_loss, self.step_tokens, self.step_mix, self.tainted = None, None, None, ""

    def _aggregate(self, grad_norm: Any) -> tuple[int, float | None, list[int]]:
        """(loss mean, loss max) over ranks into this object, the step's total real tokens, this
        rank's gradient norm as a number, and the step's tokens per mixed source (if any).

        One all_gather of [loss, tokens, grad norm] and one host sync per optimizer step: the grad
        norm (a tensor on the device) rides along instead of costing a sync of its own. Gathered
        rather than reduced with MAX, which would drop a NaN of one rank."""
        loss = self.step_loss if self.step_loss is not None else torch.tensor(math.nan)
        tokens = self.step_tokens if self.step_tokens is not None else torch.zeros((), dtype=torch.int64)
        distributed = self.world_size > 1 and dist.is_initialized()
        device = collective_device() if distributed else loss.device
        columns = [loss.to(device, torch.float64), tokens.to(device, torch.float64)]
        # A sharded (DTensor) norm is read as before, by float(): its placement decides what a rank holds.
        norm_on_device = isinstance(grad_norm, torch.Tensor) and not isinstance(grad_norm, DTensor)
        if norm_on_device:
            columns.append(grad_norm.detach().reshape(()).to(device, torch.float64))
        sources = len(self.mix_tokens)  # each source's tokens ride along too: no collective of their own
        mix = self.step_mix if self.step_mix is not None else torch.zeros(sources, dtype=torch.float64)
        mine = torch.cat([torch.stack(columns), mix.to(device, torch.float64)])
        if distributed:
            gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
            dist.all_gather(gathered, mine)
            table = torch.stack(gathered)
        else:
            table = mine.reshape(1, -1)
        rows = table.tolist()  # the host sync
        own_row = rows[dist.get_rank() if distributed else 0]
        norm = own_row[2] if norm_on_device else float(grad_norm) if grad_norm is not None else None
        losses = [row[0] for row in rows]
        self.loss_mean = math.fsum(losses) / len(losses) if not any(map(math.isnan, losses)) else math.nan
        self.loss_max = max(losses) if not any(map(math.isnan, losses)) else math.nan
        mixed = [
            int(round(sum(row[-sources + i] for row in rows) / self.batch_replicas)) for i in range(sources)
        ]
        return int(round(sum(row[1] for row in rows) / self.batch_replicas)), norm, mixed

    def _judge(self, step: int, norm: float | None) -> Verdict:
        if self.guardrails is None:
            return Verdict("apply")
        verdict = self.guardrails.judge(step, self.loss_mean, norm)
        if self.tainted and verdict.action == "apply":
            verdict = Verdict("skip", "oom_backoff", f"step {step}: {self.tainted}")
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
