"""Expert-load metrics of Mixture-of-Experts models, for every logged step's record.

Forward hooks on each router (the module whose output transformers records as `router_logits`)
add the experts it chose for each real token to a [layers x experts] count, on the device, over
the micro-batches of one optimizer step; a hook on the outermost module says which positions are
real (the attention mask) and keeps the model's aux / z loss. Only training forwards count:
evaluation, generation (no grad) and gradient-checkpointing's recomputation in backward (after the
outer forward has returned) are left out. At a logged step the counts are summed over ranks (one
all_reduce, one host sync) and become, per layer i and expert j:

    moe/layer{i}/expert{j}_tokens   tokens routed to the expert (each token counts once per top-k pick,
                                    so a layer's counts sum to real tokens x top_k)
    moe/layer{i}/max_over_mean      busiest expert's load over the mean load (1 = even)
    moe/layer{i}/cv                 coefficient of variation of the loads (0 = even)
    moe_load_max_over_mean, moe_load_cv   the worst layer's value (collapse shows in one layer first)
    moe_aux_loss, moe_z_loss        the model's router losses (before their coefficients), mean over
                                    micro-batches and ranks; z only where the family computes one

The HF families lmforge presets route dropless (no capacity factor), so there is no dropped-token
count to record; models/moe.py says so in the log line that describes the routing.
"""

from __future__ import annotations

import logging
import re
import statistics
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lmforge.distributed.devices import collective_device
from lmforge.models.moe import hf_model, is_moe

log = logging.getLogger(__name__)
_LAYER = re.compile(r"\.layers?\.(\d+)\.")
# Router losses a model output may carry as `<name>_loss`, recorded as `moe_<name>_loss`.
LOSSES = ("aux", "z")


def router_sites(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router module) of each MoE layer, from the module class (or name) that
    transformers records router logits from; [] for a model that records none."""
    inner = hf_model(model)
    recorder = (getattr(inner, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    layer_name = getattr(recorder, "layer_name", None)
    if target is None and layer_name is None:
        return []
    found = [
        (name, module)
        for name, module in inner.named_modules()
        if (target is not None and isinstance(module, target))
        or (target is None and layer_name is not None and name.endswith(f".{layer_name}"))
    ]
    sites = []
    for ordinal, (name, module) in enumerate(found):
        match = _LAYER.search(f".{name}.")
        sites.append((int(match.group(1)) if match else ordinal, module))
    return sites


def real_token_mask(attention_mask: Any) -> torch.Tensor | None:
    """Which (batch x length) positions hold real tokens, flattened as a router sees its rows;
    None when every position does (no mask: fixed blocks, padding-free rows)."""
    if not isinstance(attention_mask, torch.Tensor):
        return None
    if attention_mask.ndim == 2:
        return attention_mask.reshape(-1).bool()
    if attention_mask.ndim == 4:
        # A packed row's block-diagonal mask (data/collate.py): padding attends only to itself and
        # nothing attends to it. A real token alone in both ways would be a one-token sample, which
        # carries no loss and never reaches a packed row.
        allowed = attention_mask[:, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0] == 0
        alone = (allowed.sum(-1) == 1) & (allowed.sum(-2) == 1)
        return (~alone).reshape(-1)
    return None


def load_metrics(counts: list[list[float]], layers: list[int]) -> dict[str, float]:
    """The record fields of one step's [layers x experts] token counts (see the module docstring)."""
    record: dict[str, float] = {}
    ratios, cvs = [], []
    for layer, row in zip(layers, counts, strict=True):
        for expert, tokens in enumerate(row):
            record[f"moe/layer{layer}/expert{expert}_tokens"] = int(round(tokens))
        mean = statistics.fmean(row)
        if mean <= 0:  # no token reached this layer in the step
            continue
        ratios.append(max(row) / mean)
        cvs.append(statistics.pstdev(row) / mean)
        record[f"moe/layer{layer}/max_over_mean"] = ratios[-1]
        record[f"moe/layer{layer}/cv"] = cvs[-1]
    if ratios:
        record["moe_load_max_over_mean"] = max(ratios)
        record["moe_load_cv"] = max(cvs)
    return record


class ExpertLoad:
    """The hooks and the step's device-side tallies: expert counts, aux / z loss sums."""

    def __init__(self, model: torch.nn.Module, sites: list[tuple[int, torch.nn.Module]]) -> None:
        self.layers = [layer for layer, _ in sites]
        self.experts = max(_experts_of(router) for _, router in sites)
        self.counts: torch.Tensor | None = None  # [layers, experts + 1], made on the routers' device
        self.losses: dict[str, list[Any]] = {}  # name -> [sum on the device, micro-batches]
        self._mask: torch.Tensor | None = None
        self._armed = False
        self._misaligned_warned = False
        model.register_forward_pre_hook(self._outer_begins, with_kwargs=True)
        model.register_forward_hook(self._outer_ends, with_kwargs=True)
        for position, (_, router) in enumerate(sites):
            router.register_forward_hook(self._router_hook(position, getattr(router, "top_k", None)))

    def _outer_begins(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._armed = module.training and torch.is_grad_enabled()
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        self._mask = real_token_mask(mask) if self._armed else None

    def _outer_ends(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if self._armed:
            for name in LOSSES:
                value = getattr(output, f"{name}_loss", None)
                if isinstance(value, torch.Tensor):
                    tally = self.losses.setdefault(name, [torch.zeros((), dtype=torch.float64), 0])
                    tally[0] = tally[0].to(value.device) + value.detach().double()
                    tally[1] += 1
        self._armed, self._mask = False, None

    def _router_hook(self, position: int, top_k: int | None) -> Any:
        def count(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if self._armed:
                self._add(position, _chosen_experts(output, top_k))

        return count

    def _add(self, position: int, chosen: torch.Tensor | None) -> None:
        if chosen is None:
            return
        if self.counts is None:
            # One slot past the last expert: expert parallelism marks experts held elsewhere so.
            self.counts = torch.zeros(
                len(self.layers), self.experts + 1, dtype=torch.int64, device=chosen.device
            )
        picks = chosen.reshape(-1).clamp(max=self.experts)
        weights = torch.ones_like(picks)
        mask = self._mask
        if mask is not None and mask.numel() == chosen.shape[0]:
            weights = mask.to(picks.device, torch.int64).repeat_interleave(chosen.shape[-1])
        elif mask is not None and not self._misaligned_warned:
            self._misaligned_warned = True
            log.warning(
                "MoE metrics: a router saw %d rows for %d mask positions; counting every row",
                chosen.shape[0],
                mask.numel(),
            )
        self.counts[position].scatter_add_(0, picks, weights)

    def take(self, world_size: int) -> dict[str, float]:
        """This step's record, summed over ranks; the tallies start again. A collective when
        world_size > 1: every rank calls it at the same steps."""
        distributed = world_size > 1 and dist.is_initialized()
        packed = self._packed(collective_device() if distributed else torch.device("cpu"))
        if distributed:
            dist.all_reduce(packed)  # counts, loss sums and micro-batch counts all add up over ranks
        values = packed.tolist()  # the host sync, at logged steps only
        self.reset()
        return self._record(values)

    def _packed(self, device: torch.device) -> torch.Tensor:
        """One float64 vector: the [layers x experts] counts, then (sum, micro-batches) of aux and z."""
        counts = self.counts if self.counts is not None else torch.zeros(len(self.layers), self.experts + 1)
        parts = [counts[:, : self.experts].to(device, torch.float64).reshape(-1)]
        for name in LOSSES:
            total, micro = self.losses.get(name, [torch.zeros((), dtype=torch.float64), 0])
            parts.append(total.to(device, torch.float64).reshape(1))
            parts.append(torch.tensor([float(micro)], device=device, dtype=torch.float64))
        return torch.cat(parts)

    def _record(self, values: list[float]) -> dict[str, float]:
        width = self.experts
        rows = [values[i * width : (i + 1) * width] for i in range(len(self.layers))]
        record = load_metrics(rows, self.layers)
        tail = values[len(self.layers) * width :]
        for index, name in enumerate(LOSSES):
            total, micro = tail[2 * index], tail[2 * index + 1]
            if micro > 0:
                record[f"moe_{name}_loss"] = total / micro
        return record

    def reset(self) -> None:
        if self.counts is not None:
            self.counts.zero_()
        self.losses.clear()


class ExpertLoadCallback(TrainerCallback):
    """Takes the step's expert load at each logged step (on every rank: it is a collective) and
    holds it for that step's metrics record (`take_record`, rank 0). Side effects only."""

    def __init__(self, load: ExpertLoad, world_size: int) -> None:
        self.load = load
        self.world_size = world_size
        self.pending: dict[str, float] = {}

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        # A rollback trains again from a checkpoint: what the abandoned step routed is not kept.
        self.load.reset()
        self.pending = {}

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        # Listed after the callback that forces a log at the last step, so should_log is final here.
        if control.should_log:
            self.pending = self.load.take(self.world_size)
        else:
            self.load.reset()

    def take_record(self) -> dict[str, float]:
        record, self.pending = self.pending, {}
        return record


def expert_load_callback(model: torch.nn.Module, world_size: int) -> ExpertLoadCallback | None:
    """The expert-load metrics of an MoE model (None for a dense one, or one whose routers transformers
    does not record)."""
    inner = hf_model(model)
    if not is_moe(inner.config):
        return None
    sites = router_sites(model)
    if not sites:
        log.info("MoE metrics: %s records no router outputs; no expert-load metrics", type(inner).__name__)
        return None
    return ExpertLoadCallback(ExpertLoad(model, sites), world_size)


def _experts_of(router: torch.nn.Module) -> int:
    count = getattr(router, "num_experts", None)
    if isinstance(count, int):
        return count
    weight = getattr(router, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else 0


def _chosen_experts(output: Any, top_k: int | None) -> torch.Tensor | None:
    """[rows, top_k] expert ids a router chose: the integer tensor it returns (transformers 5's
    TopKRouter returns logits, scores, indices), else the top-k of its logits."""
    if isinstance(output, tuple):
        ids = [t for t in output if isinstance(t, torch.Tensor) and t.ndim == 2 and not t.is_floating_point()]
        if ids:
            return ids[-1]
        output = output[0]
    if isinstance(output, torch.Tensor) and top_k:
        return torch.topk(output, top_k, dim=-1).indices
    return None
