"""lmforge's Trainers: HF Trainer or a TRL trainer whose step hooks forward to train/step.py,
plus FSDP2 that really shards on CPU too (distributed/fsdp.py). Every hook overridden here is
listed in lmforge/upstream.py with its upstream signature; everything else is the library's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from transformers import Trainer

from lmforge.config.schema import TrainConfig
from lmforge.distributed.context_parallel import ContextParallel
from lmforge.distributed.fsdp import CpuFsdp
from lmforge.distributed.pipeline_parallel import PipelineStages
from lmforge.distributed.reshard import ReshardResume
from lmforge.errors import UserInputError
from lmforge.train.batches import batch_size, split_batch
from lmforge.train.memory_savers import memory_savers
from lmforge.train.numerics import REAL_TOKENS_KEY
from lmforge.train.optimizers import build_optimizer, needs_own_optimizer, wsd_scheduler_kwargs
from lmforge.train.step import TrainStep, logs_at

log = logging.getLogger(__name__)


class StepHooks:
    """Trainer mixin: HF Trainer's step hooks, each forwarding to the run's TrainStep (`train_step`),
    and the recipe HF cannot build from its arguments alone (`train_settings`: Muon and LoRA+
    optimizers, WSD's decay length, the chunked loss and activation offload)."""

    train_step: TrainStep
    train_settings: TrainConfig | None = None  # set by train/assembly.py

    def create_optimizer(self, model: torch.nn.Module | None = None) -> Any:
        settings = self.train_settings.optimizer if self.train_settings is not None else None
        if self.optimizer is None and settings is not None and needs_own_optimizer(settings):  # type: ignore[has-type]
            built = model if model is not None else self.model  # type: ignore[attr-defined]
            decay = set(self.get_decay_parameter_names(built))  # type: ignore[attr-defined]
            self.optimizer = build_optimizer(settings, built, self.args, decay)  # type: ignore[attr-defined]
        try:
            return super().create_optimizer(model)  # type: ignore[misc]
        except ValueError as err:  # transformers' GaLore: no Linear layer matched the targets
            if settings is None or settings.name != "galore" or "No target modules" not in str(err):
                raise
            raise UserInputError(
                f"train.optimizer.galore.targets {settings.galore.targets} match no linear layer of this model; "
                "name the projections (for example q_proj, up_proj) or a regex of their module names"
            ) from err

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        args = self.args  # type: ignore[attr-defined]
        if args.lr_scheduler_kwargs:
            args.lr_scheduler_kwargs = wsd_scheduler_kwargs(args.lr_scheduler_kwargs, num_training_steps)
        return super().create_scheduler(num_training_steps, optimizer)  # type: ignore[misc]

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Any:
        step, number = self.train_step, self.state.global_step + 1  # type: ignore[attr-defined]
        if isinstance(inputs, dict):  # online RL's prompts are counted once generated (_prepare_inputs)
            step.count_tokens(inputs, self.args.device)  # type: ignore[attr-defined]
        while True:
            step.in_backward = False  # set once a backward may have added to the gradients
            try:
                step.run_drills(number)
                loss = self._chunked_step(model, inputs, num_items_in_batch, step.splits)
                break
            except torch.OutOfMemoryError as err:
                step.back_off(number, batch_size(inputs), err)
        step.add_loss(loss)
        return loss

    def _prepare_inputs(self, inputs: Any) -> Any:
        state = self.state  # type: ignore[attr-defined]
        seen = state.num_input_tokens_seen
        prepared = super()._prepare_inputs(inputs)  # type: ignore[misc]
        # TRL's online RL turns a list of prompt rows into completions here: their tokens are the
        # step's (the prompt and completion masks), counted like any other batch's by close_step.
        # TRL adds them to num_input_tokens_seen itself as well; that count is undone, or every
        # token would be counted twice.
        if not isinstance(inputs, dict) and self.model.training:  # type: ignore[attr-defined]
            state.num_input_tokens_seen = seen
            self.train_step.count_tokens(prepared, self.args.device)  # type: ignore[attr-defined]
        return prepared

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if not model.training:
            return super().compute_loss(model, inputs, *args, **kwargs)  # type: ignore[misc]
        with memory_savers(self.train_settings, self.model):  # type: ignore[attr-defined]
            out = super().compute_loss(model, inputs, *args, **kwargs)  # type: ignore[misc]
        self.train_step.in_backward = True  # the caller runs backward next: an OOM from here taints the grads
        number = self.state.global_step + 1  # type: ignore[attr-defined]
        factor = self.train_step.scale_loss(number)
        if factor is None:
            return out
        log.warning("debug.faults: loss x %s at step %d", factor, number)
        return (out[0] * factor, *out[1:]) if isinstance(out, tuple) else out * factor

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> Any:
        if isinstance(inputs, dict):  # online RL evaluates a list of prompt rows
            inputs.pop(REAL_TOKENS_KEY, None)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)  # type: ignore[misc]

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        started = time.perf_counter()
        slow = self.train_step.drills.due("slow_data", self.state.global_step + 1)  # type: ignore[attr-defined]
        if slow is not None:
            time.sleep(slow.seconds)
        batches = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        self.train_step.data_wait_s += time.perf_counter() - started
        return batches

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        # A tied head (lm_head = the embedding) is saved once, so a checkpoint never holds it:
        # HF recognises that only through _keys_to_ignore_on_save, which transformers 5 models
        # leave empty, and warned "missing keys ['lm_head.weight']" on every resume.
        tied = tied_aliases(self.model)  # type: ignore[attr-defined]
        missing = [key for key in load_result.missing_keys if key not in tied]
        if len(missing) < len(load_result.missing_keys):
            self.model.tie_weights()  # type: ignore[attr-defined]
            load_result = load_result._replace(missing_keys=missing)
        super()._issue_warnings_after_load(load_result)  # type: ignore[misc]

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        # HF calls this once per optimizer step, after clipping and right before optimizer.step().
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)  # type: ignore[misc]
        number = self.state.global_step + 1  # type: ignore[attr-defined]
        logs = logs_at(self.args, number)  # type: ignore[attr-defined]
        self.train_step.close_step(number, norm, model, self.state, logs=logs)  # type: ignore[attr-defined]
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
        if splits == 1:
            return super().training_step(model, inputs, num_items)  # type: ignore[misc]
        size = batch_size(inputs)
        chunks = split_batch(inputs, min(splits, size))
        saved = self.current_gradient_accumulation_steps  # type: ignore[has-type]
        total = None
        try:
            for chunk in chunks:
                # Where the loss is a per-sample mean (not normalised by the step's token count),
                # each chunk's mean is weighted by its share of the micro-batch.
                self.current_gradient_accumulation_steps = saved * size / batch_size(chunk)
                loss = super().training_step(model, chunk, num_items)  # type: ignore[misc]
                total = loss if total is None else total + loss
        finally:
            self.current_gradient_accumulation_steps = saved
        return total


class LmforgeTrainer(CpuFsdp, ReshardResume, StepHooks, PipelineStages, ContextParallel, Trainer):  # type: ignore[misc]
    """HF Trainer with lmforge's step (pretrain and sft), real FSDP2 on CPU too, pipeline stages,
    context parallelism, and resumes of checkpoints another world size wrote. PipelineStages and
    ContextParallel sit under StepHooks: lmforge's step (token counts, drills, the OOM back-off)
    wraps the pipeline schedule and the sequence split."""


def with_lmforge_step(trainer_class: type[Trainer]) -> type[Trainer]:
    """`trainer_class` (a TRL trainer) with CpuFsdp, ReshardResume, StepHooks, PipelineStages and
    ContextParallel mixed in (TRL's SFTTrainer can run pipeline and context parallelism; the other
    stages are refused at load)."""
    mixins = (CpuFsdp, ReshardResume, StepHooks, PipelineStages, ContextParallel)
    return type(f"Lmforge{trainer_class.__name__}", (*mixins, trainer_class), {})


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are another parameter under a second name (a tied head): the
    ones `named_parameters()` drops as duplicates."""
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return every - {name for name, _ in model.named_parameters()}
