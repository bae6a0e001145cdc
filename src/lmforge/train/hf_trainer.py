"""lmforge's one HF Trainer adapter: every HF Trainer hook lmforge overrides, written once.

Each hook delegates: the maths of the step to the run's `TrainStep` (train/step.py), the parallel
dimensions' work to the `ParallelState` (distributed/parallel_state.py: each dimension answers the
hooks where it changes what the Trainer does, asked in registry order), a resume of a checkpoint
another world size wrote to distributed/reshard.py. Everything else is the library's. Every
override is listed in lmforge/upstream.py with its upstream signature.

The adapter is complete when built: its step, parallel state, train settings and weights dtype are
constructor arguments. For a TRL stage it is combined with the stage's trainer class
(`with_stage_trainer`): one adapter class, then the stage's base.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import Trainer

from lmforge.config.schema import TrainConfig
from lmforge.data.shuffle import PretrainingBlocks, ShuffledBlocks
from lmforge.distributed.parallel import no_parallelism
from lmforge.distributed.parallel_state import ParallelState
from lmforge.distributed.reshard import (
    load_resumed_model,
    load_resumed_optimizer,
    load_stand_in_rng,
    resumed_from,
)
from lmforge.errors import DataSourceLost, UserInputError, WorkFailed
from lmforge.train.batches import batch_size, split_batch
from lmforge.train.memory_savers import memory_savers
from lmforge.train.numerics import MIX_SOURCE_KEY, REAL_TOKENS_KEY
from lmforge.train.optimizers import build_optimizer, needs_own_optimizer, wsd_scheduler_kwargs
from lmforge.train.rewards import skip_failed_groups
from lmforge.train.step import TrainStep, logs_at, save_mix_tokens
from lmforge.train.stream_loading import (
    is_stream,
    restore_stream_position,
    save_stream_position,
    stream_loader,
)

log = logging.getLogger(__name__)

__all__ = ["HFTrainerAdapter", "tied_aliases", "with_stage_trainer"]


class HFTrainerAdapter(Trainer):
    """HF Trainer with lmforge's step (token counts, drills, OOM back-off, the skip-step), the parallel
    dimensions of `parallel`, resumes of checkpoints another world size wrote, and the recipe HF
    cannot build from its arguments alone (`train_settings`: Muon and LoRA+ optimizers, WSD's decay
    length, the chunked loss and activation offload).

    The hooks below are in the order HF Trainer reaches them: construction, `train` and the resume,
    the optimizer and schedule, then per micro-batch, per optimizer step, per save and per
    evaluation, and the final save."""

    def __init__(
        self,
        *args: Any,
        train_step: TrainStep | None = None,
        parallel: ParallelState | None = None,
        train_settings: TrainConfig | None = None,
        weights_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        # Set before HF's __init__: it calls create_accelerator_and_postprocess, which wraps the model.
        self.train_step = train_step if train_step is not None else TrainStep()
        self.parallel = parallel if parallel is not None else no_parallelism()
        self.train_settings = train_settings
        # The dtype final/ is written in (`model.dtype`) whatever the engine trained in (DeepSpeed: a 16-bit copy).
        self.weights_dtype = weights_dtype
        # A stream's loader and its position after the current optimizer step's batches (saved with
        # each checkpoint); the checkpoint a resume starts from, whose saved position it restores.
        self.stream: StatefulDataLoader | None = None
        self.stream_position: dict[str, Any] | None = None
        self.resuming_from: str | None = None
        self.saved_step: int | None = None  # the step of the newest checkpoint this process wrote
        super().__init__(*args, **kwargs)
        self.train_step.bind(self.args, tensor_ranks=self.get_tp_size(), context_ranks=self.get_cp_size())

    # -- construction ----------------------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        for dimension in self.parallel.dimensions:
            dimension.wrap(self.parallel, self)

    # -- train, and the resume --------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        checkpoint = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        self.resuming_from = checkpoint
        if checkpoint is None:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        with resumed_from(self, checkpoint) as source:
            return super().train(source, trial, ignore_keys_for_eval)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if load_resumed_model(self, resume_from_checkpoint, model):
            return
        if not _load_renamed_weights(
            self.accelerator.unwrap_model(model or self.model), resume_from_checkpoint
        ):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        # A tied head (lm_head = the embedding) is saved once, so a checkpoint never holds it:
        # HF recognises that only through _keys_to_ignore_on_save, which transformers 5 models
        # leave empty, and warned "missing keys ['lm_head.weight']" on every resume.
        model: Any = self.model
        tied = tied_aliases(model)
        missing = [key for key in load_result.missing_keys if key not in tied]
        if len(missing) < len(load_result.missing_keys):
            model.tie_weights()
            load_result = load_result._replace(missing_keys=missing)
        if missing:  # a resume that left weights at their initial values would train on silently
            raise RuntimeError(
                f"the checkpoint did not restore {len(missing)} weight(s) of the model (first: {missing[0]}); "
                "resuming would train from their initial values"
            )
        super()._issue_warnings_after_load(load_result)

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if isinstance(dataset, PretrainingBlocks):
            # Pretraining blocks: a permutation computed per position (O(1) memory) rather than HF's
            # randperm list, whose size grows with the corpus. Same order on every rank: accelerate
            # deals each rank its batches of it.
            return ShuffledBlocks(len(dataset), seed=self.args.seed)
        return super()._get_train_sampler(train_dataset)

    def get_train_dataloader(self) -> Any:
        if not is_stream(self.train_dataset):
            return super().get_train_dataloader()
        # Built here, not by accelerate: the stream already reads only this rank's part.
        self.stream = stream_loader(self.train_dataset, self.args, self.data_collator)
        if self.resuming_from is not None:
            restore_stream_position(
                self.stream, self.resuming_from, rank=self.args.process_index, world_size=self.args.world_size
            )
        return self.stream

    def create_optimizer(self, model: nn.Module | None = None) -> Any:
        settings = self.train_settings.optimizer if self.train_settings is not None else None
        if self.optimizer is None and settings is not None and needs_own_optimizer(settings):
            built: Any = model if model is not None else self.model
            decay = set(self.get_decay_parameter_names(built))
            self.optimizer = build_optimizer(settings, built, self.args, decay)
        try:
            return super().create_optimizer(model)
        except ValueError as err:  # transformers' GaLore: no Linear layer matched the targets
            if settings is None or settings.name != "galore" or "No target modules" not in str(err):
                raise
            raise UserInputError(
                f"train.optimizer.galore.targets {settings.galore.targets} match no linear layer of this model; "
                "name the projections (for example q_proj, up_proj) or a regex of their module names"
            ) from err

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        args = self.args
        if isinstance(args.lr_scheduler_kwargs, dict) and args.lr_scheduler_kwargs:
            args.lr_scheduler_kwargs = wsd_scheduler_kwargs(args.lr_scheduler_kwargs, num_training_steps)
        return super().create_scheduler(num_training_steps, optimizer)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not load_resumed_optimizer(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not load_stand_in_rng(self, checkpoint):
            super()._load_rng_state(checkpoint)

    # -- each micro-batch -------------------------------------------------------------------------

    def _calculate_rewards(
        self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any
    ) -> Any:
        # Online RL only (TRL's GRPO / RLOO trainers define it): with on_reward_error skip_group, a
        # group in which a reward failed on some completion sits the update out as a whole.
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)  # type: ignore[misc]
        settings = self.train_settings
        if settings is None or settings.rl.on_reward_error != "skip_group":
            return rewards
        training = self.model is not None and self.model.training
        group_size = self.num_generations if training else self.num_generations_eval  # type: ignore[attr-defined]
        return skip_failed_groups(rewards, group_size)

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int, device: Any) -> Any:
        started = time.perf_counter()
        slow = self.train_step.drills.due("slow_data", self.state.global_step + 1)
        if slow is not None:
            time.sleep(slow.seconds)
        try:
            batches = super().get_batch_samples(epoch_iterator, num_batches, device)
        except DataSourceLost as lost:
            raise self._stop_with_checkpoint(lost) from None
        if self.stream is not None:  # where this step's batches end: what a checkpoint of it holds
            self.stream_position = self.stream.state_dict()
        self.train_step.data_wait_s += time.perf_counter() - started
        return batches

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        step, number = self.train_step, self.state.global_step + 1
        if isinstance(inputs, dict):  # online RL's prompts are counted once generated (_prepare_inputs)
            step.count_tokens(inputs, self.args.device)
        while True:
            step.in_backward = False  # set once a backward may have added to the gradients
            try:
                step.run_drills(number)
                loss = self._chunked_step(model, inputs, num_items_in_batch, step.splits)
                break
            except torch.OutOfMemoryError as err:
                # Online RL and distillation pass the step its prompt rows (a list), not tensors.
                rows = batch_size(inputs) if isinstance(inputs, dict) else len(inputs)
                step.back_off(number, rows, err)
        step.add_loss(loss)
        return loss

    def get_cp_size(self) -> int:
        for dimension in self.parallel.dimensions:
            ranks = dimension.batch_ranks(self.parallel)
            if ranks is not None:
                return ranks
        return super().get_cp_size()

    def _prepare_context_parallel_inputs(
        self, model: nn.Module, inputs: dict[str, Any]
    ) -> tuple[Callable[..., Any], dict[str, Any]]:
        for dimension in self.parallel.dimensions:
            split = dimension.split_batch(self.parallel, inputs)
            if split is not None:
                return split
        return super()._prepare_context_parallel_inputs(model, inputs)

    def _prepare_inputs(self, inputs: Any) -> Any:
        state = self.state
        seen = state.num_input_tokens_seen
        prepared = super()._prepare_inputs(inputs)
        # TRL's online RL turns a list of prompt rows into completions here: their tokens are the
        # step's (the prompt and completion masks), counted like any other batch's by close_step.
        # TRL adds them to num_input_tokens_seen itself as well; that count is undone, or every
        # token would be counted twice.
        model: Any = self.model
        if not isinstance(inputs, dict) and model.training:
            state.num_input_tokens_seen = seen
            self.train_step.count_tokens(prepared, self.args.device)
        return prepared

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if not model.training:
            return super().compute_loss(model, inputs, *args, **kwargs)
        unwrapped: Any = self.model  # the savers patch the model's own head, not the engine's wrapper
        with memory_savers(self.train_settings, unwrapped):
            out = super().compute_loss(model, inputs, *args, **kwargs)
        self.train_step.in_backward = True  # the caller runs backward next: an OOM from here taints the grads
        number = self.state.global_step + 1
        factor = self.train_step.scale_loss(number)
        if factor is None:
            return out
        log.warning("debug.faults: loss x %s at step %d", factor, number)
        return (out[0] * factor, *out[1:]) if isinstance(out, tuple) else out * factor

    # -- each optimizer step ----------------------------------------------------------------------

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        norm = self._dimension_grad_norm(model, self.args.max_grad_norm)
        return norm if norm is not None else super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        # HF calls this once per optimizer step, after clipping and right before optimizer.step():
        # the step closes here (train/step.py: close_step judges it and may drop its gradients).
        if grad_norm is None:
            grad_norm = self._dimension_grad_norm(model, float("inf"))
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        number = self.state.global_step + 1
        self.train_step.close_step(
            number, norm, model, self.state, logs=logs_at(self.args, number), optimizer=self.optimizer
        )
        return norm

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        super().log(logs, *args, **kwargs)
        # HF zeroes its loss accumulator by subtracting it from itself, which leaves a NaN in
        # place forever: after a skipped non-finite step every later logged loss would read NaN.
        accumulated = getattr(self, "_tr_loss", None)
        if isinstance(accumulated, torch.Tensor) and not bool(torch.isfinite(accumulated).all()):
            accumulated.zero_()

    # -- each save: a checkpoint (`_internal_call`), or the final model ------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        target = str(output_dir or self.args.output_dir)
        if not _internal_call:  # the final model: a dimension may write it its own way (a collective)
            for dimension in self.parallel.dimensions:
                if dimension.save_model(self.parallel, self, target, self.weights_dtype):
                    return
        super().save_model(output_dir, _internal_call=_internal_call)
        if _internal_call:
            for dimension in self.parallel.dimensions:
                dimension.model_checkpointed(self.parallel, self, target)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.saved_step = self.state.global_step
        if self.stream is not None and self.stream_position is not None:
            save_stream_position(
                self.stream_position,
                output_dir,
                rank=self.args.process_index,
                world_size=self.args.world_size,
            )
        if self.train_step.mix_tokens and self.args.process_index == 0:
            save_mix_tokens(self.train_step.mix_tokens, output_dir)
        for dimension in self.parallel.dimensions:
            if dimension.save_optimizer(self.parallel, self, output_dir):
                return
        super()._save_optimizer_and_scheduler(output_dir)

    # -- each evaluation batch ----------------------------------------------------------------------

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> Any:
        if isinstance(inputs, dict):  # online RL evaluates a list of prompt rows
            inputs.pop(REAL_TOKENS_KEY, None)
            inputs.pop(MIX_SOURCE_KEY, None)
        loss = self._run_by_dimension(model, inputs, None, training=False)
        if loss is not None:
            return loss, None, None
        loss, logits, labels = super().prediction_step(
            model, inputs, prediction_loss_only, ignore_keys=ignore_keys
        )
        if loss is None:
            return loss, logits, labels
        for dimension in self.parallel.dimensions:
            reduced = dimension.eval_loss(self.parallel, loss, losses_only=prediction_loss_only)
            if reduced is not None:
                return reduced, None, None
        return loss, logits, labels

    # -- helpers ----------------------------------------------------------------------------------

    def _stop_with_checkpoint(self, lost: DataSourceLost) -> WorkFailed:
        """A source vanished mid-stream, at a step boundary: checkpoint the last finished step (the
        stream's position included) the way a scheduled save does, and say how to go on."""
        step = self.state.global_step
        resumed_here = self.resuming_from is not None and self.resuming_from.rstrip("/").endswith(f"-{step}")
        if self.args.world_size > 1:
            # The other ranks are inside the step's collectives: a save (itself collective) would hang.
            saved = "the newest checkpoint in checkpoints/ is the state to resume from"
        elif step == 0:
            saved = "no step had finished, so nothing was saved"
        else:
            if step != self.saved_step and not resumed_here:  # else that checkpoint exists already
                self._save_checkpoint(self.model_wrapped, trial=None)
                self.control = self.callback_handler.on_save(self.args, self.state, self.control)
            saved = f"step {step} is checkpointed"
        # Raised in a dataloader worker, the message carries torch's traceback text: its last line is ours.
        reason = str(lost).strip().splitlines()[-1] if str(lost).strip() else type(lost).__name__
        return WorkFailed(
            f"{reason}. Training stopped: {saved}. Fix: put the file back (or remove its source from the "
            "config, which starts a new stream) and run the same command to resume."
        )

    def _chunked_step(self, model: nn.Module, inputs: dict[str, Any], num_items: Any, splits: int) -> Any:
        if splits == 1:
            return self._one_step(model, inputs, num_items)
        size = batch_size(inputs)
        chunks = split_batch(inputs, min(splits, size))
        saved = self.current_gradient_accumulation_steps
        total = None
        try:
            for chunk in chunks:
                # Where the loss is a per-sample mean (not normalised by the step's token count),
                # each chunk's mean is weighted by its share of the micro-batch.
                self.current_gradient_accumulation_steps = saved * size / batch_size(chunk)
                loss = self._one_step(model, chunk, num_items)
                total = loss if total is None else total + loss
        finally:
            self.current_gradient_accumulation_steps = saved
        return total

    def _one_step(self, model: nn.Module, inputs: dict[str, Any], num_items: Any) -> Any:
        """One (chunk of a) micro-batch: a dimension's own run (the pipeline schedule), else HF's."""
        loss = self._run_by_dimension(model, inputs, num_items, training=True)
        return loss if loss is not None else super().training_step(model, inputs, num_items)

    def _run_by_dimension(
        self, model: nn.Module, inputs: dict[str, Any], num_items: Any, *, training: bool
    ) -> torch.Tensor | None:
        for dimension in self.parallel.dimensions:
            loss = dimension.run_batch(self.parallel, self, model, inputs, num_items, training=training)
            if loss is not None:
                return loss
        return None

    def _dimension_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor | None:
        for dimension in self.parallel.dimensions:
            norm = dimension.grad_norm(self.parallel, self, model, max_norm)
            if norm is not None:
                return norm
        return None


def with_stage_trainer(trainer_class: type[Trainer]) -> type[HFTrainerAdapter]:
    """The adapter over `trainer_class` (a TRL trainer): the adapter's hooks first, then the stage's
    (TRL's SFTTrainer can run pipeline and context parallelism; the other stages are refused at load)."""
    return type(f"Lmforge{trainer_class.__name__}", (HFTrainerAdapter, trainer_class), {})


def tied_aliases(model: nn.Module) -> set[str]:
    """Names of parameters that are another parameter under a second name (a tied head): the
    ones `named_parameters()` drops as duplicates."""
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return every - {name for name, _ in model.named_parameters()}


def _load_renamed_weights(model: Any, checkpoint: str) -> bool:
    """Load a checkpoint saved under the model family's checkpoint names into `model`, through
    from_pretrained's renaming; True when it did. transformers' save_pretrained writes a LLaVA
    model's weights as `language_model.*` / `vision_tower.*` / `multi_modal_projector.*`, and HF
    Trainer's resume loads the file by module names (`model.language_model.*`), which match none."""
    from safetensors import safe_open
    from transformers import PreTrainedModel

    files = sorted(Path(checkpoint).glob("model*.safetensors"))
    if not isinstance(model, PreTrainedModel) or hasattr(model, "peft_config") or not files:
        return False
    saved: set[str] = set()
    for file in files:
        with safe_open(str(file), "pt") as handle:
            saved |= set(handle.keys())
    if saved <= set(model.state_dict()):
        return False  # module names: HF's loader reads them
    dtype = next(model.parameters()).dtype
    loaded = type(model).from_pretrained(checkpoint, config=model.config, dtype=dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    return True
