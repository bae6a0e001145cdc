"""Every place lmforge couples to upstream internals: overridden methods, private attributes,
patches. One registry, with why and the tested versions, so an upgrade fails a test
(tests/test_upstream.py) or warns at start, instead of breaking a run.

Torch-free at import: upstream modules are imported only inside the checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.abc
import importlib.util
import inspect
import io
import logging
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Literal

log = logging.getLogger(__name__)

# override: lmforge's method replaces upstream's; private_call: lmforge calls (or imports) a
# private function, class or module; private_attribute: reads or writes a private attribute;
# patch: replaces upstream behaviour (a function, method or table entry) on a module, class or
# instance; attribute: writes a public attribute upstream reads (a flag, a config value, a
# submodule); own_attribute: puts an attribute of lmforge's own on an upstream object, which
# upstream must not define.
Kind = Literal["override", "private_attribute", "patch", "private_call", "attribute", "own_attribute"]


@dataclass(frozen=True)
class Coupling:
    target: str  # module:qualname of the upstream object
    kind: Kind
    where: str  # lmforge file that depends on it
    why: str
    parameters: tuple[str, ...] | None = None  # the upstream callable's parameter names, as tested
    set_in: str | None = None  # instance attribute: module:qualname of the function that sets it
    instance: str | None = None  # instance attribute: module:qualname of a no-argument factory that has it
    extra: str | None = None  # the upstream package comes with this lmforge extra: checked where installed


_TRAINER = "transformers.trainer:Trainer"
_STEP = "train/hf_trainer.py"  # the Trainer adapter: every Trainer hook lmforge overrides
_RESHARD = "distributed/reshard.py"
_CONTEXT = "distributed/context_parallel.py"
_RING = "torch.distributed.tensor.experimental._context_parallel._attention"
_CONTROL = "transformers.trainer_callback:TrainerControl"
_CONFIG = "transformers.configuration_utils:PretrainedConfig"
_MODEL = "transformers.modeling_utils:PreTrainedModel"
_TOKENIZER = "transformers.tokenization_utils_base:PreTrainedTokenizerBase"
_SAVERS = "train/memory_savers.py"
REGISTRY: tuple[Coupling, ...] = (
    Coupling(f"{_TRAINER}.__init__", "override", _STEP,
             "the adapter's step, parallel state, train settings and weights dtype are set before HF's __init__, "
             "which calls create_accelerator_and_postprocess (the dimensions wrap the model there)"),
    Coupling(f"{_TRAINER}.training_step", "override", _STEP,
             "count real tokens, run drills and split a micro-batch after an OOM; a pipeline-parallel batch "
             "runs through torch.distributed.pipelining's schedule",
             ("self", "model", "inputs", "num_items_in_batch")),
    Coupling(f"{_TRAINER}.compute_loss", "override", _STEP,
             "mark the backward (an OOM after it taints the gradients), scale the loss in drills, and run "
             "a training forward under the memory savers (activation offload, chunked cross-entropy)",
             ("self", "model", "inputs", "return_outputs", "num_items_in_batch")),
    Coupling(f"{_TRAINER}.create_optimizer", "override", _STEP,
             "build Muon and LoRA+, which no `optim` name selects; HF wraps whatever is in self.optimizer",
             ("self", "model")),
    Coupling(f"{_TRAINER}.create_scheduler", "override", _STEP,
             "warmup-stable-decay's decay length in steps, from train.decay_ratio and HF's step count",
             ("self", "num_training_steps", "optimizer")),
    Coupling(f"{_TRAINER}.prediction_step", "override", _STEP,
             "drop the real-token count key before the model sees an eval batch; a pipeline-parallel eval "
             "batch runs the schedule forward only; under context parallelism each rank scores its chunks of "
             "an eval batch and the context group's losses are averaged",
             ("self", "model", "inputs", "prediction_loss_only", "ignore_keys")),
    Coupling(f"{_TRAINER}._prepare_inputs", "override", _STEP,
             "online RL (TRL GRPO / RLOO) generates its completions here: count their tokens once "
             "(TRL's own addition to num_input_tokens_seen is undone)",
             ("self", "inputs")),
    Coupling(f"{_TRAINER}._get_train_sampler", "override", _STEP,
             "pretraining blocks are shuffled by a permutation computed per position (data/shuffle.py): "
             "HF's RandomSampler holds a list of every block index, growing with the corpus",
             ("self", "train_dataset")),
    Coupling(f"{_TRAINER}.get_train_dataloader", "override", _STEP,
             "a stream's loader is torchdata's StatefulDataLoader built here (the stream reads only this "
             "rank's part; accelerate would split it again), its saved position restored on resume",
             ("self",)),
    Coupling(f"{_TRAINER}._save_checkpoint", "private_call", _STEP,
             "a source lost mid-stream stops the run with a checkpoint of the last finished step, written "
             "as a scheduled save writes it", ("self", "model", "trial")),
    Coupling(f"{_TRAINER}.control", "attribute", _STEP,
             "that stop's save runs the on_save callbacks (they seal the checkpoint), as HF's own save does",
             set_in=f"{_TRAINER}.__init__"),
    Coupling(f"{_TRAINER}.get_batch_samples", "override", _STEP,
             "time the wait for data (data-wait share) and the slow_data drill",
             ("self", "epoch_iterator", "num_batches", "device")),
    Coupling(f"{_TRAINER}._get_grad_norm", "override", _STEP,
             "called once per optimizer step right before optimizer.step(): close the step there; the "
             "unclipped norm of a pipeline (max_grad_norm 0) spans every stage",
             ("self", "model", "grad_norm")),
    Coupling(f"{_TRAINER}.log", "override", _STEP,
             "repair HF's NaN-forever loss accumulator after a logged NaN",
             ("self", "logs", "start_time")),
    Coupling(f"{_TRAINER}._issue_warnings_after_load", "override", _STEP,
             "a tied head is never in a checkpoint: not a missing key (HF only knows _keys_to_ignore_on_save)",
             ("self", "load_result")),
    Coupling(f"{_TRAINER}.create_accelerator_and_postprocess", "override", _STEP,
             "the dimensions' wrap once the Accelerator exists: switch a CPU accelerator from MULTI_CPU to FSDP "
             "so FSDP2 really shards on CPU (distributed/fsdp.py), FSDP2 over a mesh's data dimension",
             ("self",)),
    Coupling(f"{_TRAINER}.save_model", "override", _STEP,
             "gather a full HF model under FSDP sharded state dicts and DeepSpeed, one shard per pipeline "
             "stage (distributed/fsdp.py, distributed/pipeline_parallel.py)",
             ("self", "output_dir", "_internal_call")),
    Coupling(f"{_TRAINER}._save", "private_call", "distributed/fsdp.py",
             "write the gathered state dict the way save_model would", ("self", "output_dir", "state_dict")),
    Coupling(f"{_TRAINER}.train", "override", _STEP,
             "a launch that loads DeepSpeed universal checkpoints converts each checkpoint it resumes "
             "(rollbacks too) and resumes from the converted directory",
             ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval")),
    Coupling(f"{_TRAINER}._load_from_checkpoint", "override", _STEP,
             "an FSDP2 (torch DCP) checkpoint resumed by one process or DDP loads into the plain model; "
             "HF raises there", ("self", "resume_from_checkpoint", "model")),
    Coupling(f"{_TRAINER}._load_optimizer_and_scheduler", "override", _STEP,
             "the same for the optimizer (by parameter name) and scheduler; called right after DeepSpeed "
             "loaded a checkpoint, where a ZeRO-3 universal load's shared step counters are split",
             ("self", "checkpoint")),
    Coupling(f"{_TRAINER}._load_rng_state", "override", _STEP,
             "a rank whose RNG file another world size did not write continues a writer rank's",
             ("self", "checkpoint")),
    Coupling("transformers.trainer_pt_utils:set_rng_state_for_device", "private_call", "ckpt/reshard_states.py",
             "restores the CUDA RNG state of a stand-in RNG file the way HF restores its own",
             ("device_name", "device_module", "checkpoint_rng_state", "is_distributed")),
    Coupling("transformers.trainer_pt_utils:safe_globals", "private_call", "ckpt/reshard_states.py",
             "HF's numpy allow-list for rng_state*.pth, to load a stand-in RNG file", ()),
    Coupling("deepspeed.checkpoint.ds_to_universal:main", "private_call", "ckpt/universal.py",
             "DeepSpeed's universal-checkpoint converter, called with the Namespace its parse_arguments "
             "builds (tests/test_reshard_resume.py compares the option names)", ("args",)),
    Coupling("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3."
             "load_hp_checkpoint_state_from_checkpoint_dir_stage3", "patch", _RESHARD,
             "gives every sub-group one shared Adam step tensor, which each sub-group's step advances, and "
             "every group group 0's settings (weight decay on the no-decay group): separate_step_counters "
             "and restore_group_settings undo both after the load (tests/test_reshard_resume.py notices a fix)",
             ("self", "checkpoint_dir")),
    Coupling(f"{_TRAINER}._tr_loss", "private_attribute", _STEP,
             "zeroed after a NaN (HF subtracts it from itself, keeping the NaN)",
             set_in=f"{_TRAINER}._inner_training_loop"),
    Coupling(f"{_TRAINER}.current_gradient_accumulation_steps", "private_attribute", _STEP,
             "rescaled while a micro-batch runs as chunks after an OOM", set_in=f"{_TRAINER}._run_epoch"),
    Coupling(f"{_TRAINER}.is_fsdp_enabled", "private_attribute", "distributed/fsdp.py",
             "set after the CPU FSDP switch; every later FSDP branch of the Trainer keys off it",
             set_in=f"{_TRAINER}.create_accelerator_and_postprocess"),
    Coupling("accelerate.state:AcceleratorState._shared_state", "private_attribute", "distributed/fsdp.py",
             "the distributed type lives in shared state; both dicts must see FSDP"),
    Coupling("accelerate.state:PartialState._shared_state", "private_attribute", "distributed/fsdp.py",
             "the distributed type lives in shared state; both dicts must see FSDP"),
    Coupling("transformers.distributed.mixin:DistributedMixin._resolve_parallel_plans", "private_call",
             "distributed/tensor_parallel.py",
             "the model's tp_plan resolved and expanded per layer, as from_pretrained(distributed_config=) does; "
             "that public path marks the model sharded at load time and the Trainer then cannot resume it",
             ("self", "distributed_config")),
    Coupling("transformers.distributed.tensor_parallel:apply_tensor_parallelism", "private_call",
             "distributed/tensor_parallel.py", "shards the parameters and installs the forward hooks of the plan",
             ("model", "tp_mesh", "tp_plan")),
    Coupling("transformers.distributed.expert_parallel:apply_expert_parallelism", "private_call",
             "distributed/expert_parallel.py",
             "splits the experts of the ep_plan over the expert mesh and installs the all-to-all token dispatch; "
             "the plan comes from _resolve_parallel_plans with DistributedConfig(fsdp_size, ep_size)",
             ("model", "ep_mesh", "tp_mesh", "plan", "ep_implementation")),
    Coupling("transformers.distributed.mixin:DistributedMixin._tp_size", "private_attribute",
             "distributed/tensor_parallel.py",
             "Trainer.get_tp_size reads it first: the ranks of a tensor group share a batch (token count, loss "
             "scale); set after the Accelerator exists, which would otherwise build a ParallelismConfig"),
    Coupling("accelerate.state:AcceleratorState.device_mesh", "private_attribute", "distributed/tensor_parallel.py",
             "the 2-D mesh handed to accelerate after the fact: its data loader shards over dp_shard only",
             set_in="accelerate.state:AcceleratorState.__init__"),
    Coupling("accelerate.accelerator:Accelerator.gather_for_metrics", "patch", "distributed/tensor_parallel.py",
             "replaced on the instance under tensor parallelism: it counted each eval batch once per tensor rank",
             ("self", "input_data", "use_gather_object")),
    Coupling(f"{_TRAINER}.gather_function", "private_attribute", "distributed/tensor_parallel.py",
             "the first evaluation reads the gather captured before the patch above",
             set_in=f"{_TRAINER}.create_accelerator_and_postprocess"),
    Coupling(f"{_TRAINER}._clip_grad_norm", "override", _STEP,
             "a pipeline's gradient norm spans every stage: clipping by one stage's norm would clip each "
             "stage differently", ("self", "model")),
    Coupling(f"{_TRAINER}._save_optimizer_and_scheduler", "override", _STEP,
             "a pipeline checkpoint: the stages' DCP model shards, the optimizer keyed by parameter name (each "
             "stage holds other parameters), the scheduler once", ("self", "output_dir")),
    Coupling(f"{_TRAINER}._prepare_inputs", "private_call", "distributed/pipeline_parallel.py",
             "the pipeline step moves its batch to the device as the Trainer's own step does", ("self", "inputs")),
    Coupling("transformers.modeling_utils:PreTrainedModel.all_tied_weights_keys", "private_attribute",
             "distributed/pipeline_parallel.py",
             "emptied on pipeline stages without the head: transformers would re-tie a head that is not there",
             set_in="transformers.modeling_utils:PreTrainedModel.post_init"),
    Coupling(f"{_TRAINER}.get_cp_size", "override", _STEP,
             "the context degree from lmforge's mesh (HF reads accelerate's ParallelismConfig, which accelerate "
             "refuses on CPU): the Trainer divides its token count by it", ("self",)),
    Coupling(f"{_TRAINER}._prepare_context_parallel_inputs", "override", _STEP,
             "torch's context_parallel over lmforge's mesh (HF enters it through accelerate's ParallelismConfig); "
             "HF's training and eval steps wrap forward and backward in what it returns", ("self", "model", "inputs")),
    Coupling("accelerate.big_modeling:_attach_context_parallel_hooks", "private_call", _CONTEXT,
             "accelerate's attention pre-hooks that drop the mask and set is_causal (what ring attention runs); "
             "accelerate calls it from prepare() only under a ParallelismConfig", ("model",)),
    Coupling(f"{_RING}:custom_ops", "private_attribute", _CONTEXT,
             "torch's table of sharded attention kernels the ring handles (CUDA only): the CPU flash kernel is "
             "added so gloo runs context parallelism"),
    Coupling(f"{_RING}:_templated_ring_attention", "private_call", _CONTEXT,
             "torch's ring attention forward, given the CPU flash kernel",
             ("group", "seq_dim", "op", "query", "key", "value", "is_causal", "kwargs")),
    Coupling(f"{_RING}:_templated_ring_attention_backward", "private_call", _CONTEXT,
             "torch's ring attention backward, given the CPU flash kernel's backward",
             ("group", "seq_dim", "op", "grad_out", "grad_out_name", "query", "key", "value", "out", "logsumexp",
              "is_causal", "kwargs")),
    Coupling("torch.distributed.tensor._dispatch:OpDispatcher.unwrap_to_op_info", "private_call", _CONTEXT,
             "the local chunks and mesh of a sharded attention call, as torch's own ring handler reads them",
             ("self", "op_call", "args", "kwargs")),
    Coupling("torch.distributed.device_mesh:DeviceMesh._flatten", "private_call", "distributed/tensor_parallel.py",
             "the data x context ranks as one mesh dimension for FSDP2 (torchtitan's dp_shard_cp)",
             ("self", "mesh_dim_name", "backend_override")),
    Coupling("torch:load", "patch", "ckpt/safe_load.py",
             "forced weights_only=True while training: DeepSpeed loads its states with weights_only=False",
             ("f", "map_location", "pickle_module", "weights_only", "mmap", "pickle_load_args")),
    Coupling("torch.distributed.checkpoint.filesystem:FileSystemReader.read_metadata", "patch",
             "ckpt/safe_load.py", "DCP unpickles .metadata in full; lmforge reads it under an allow-list",
             ("self", "args", "kwargs")),
    Coupling("torch.distributed.checkpoint.filesystem:FileSystemReader._get_metadata_path", "private_call",
             "ckpt/safe_load.py", "where the patched read_metadata finds the file", ("self", "rank")),
    Coupling("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine.load",
             "private_call", "ckpt/safe_load.py",
             "the DeepSpeed reader the torch.load patch guards (tests call it directly)",
             ("self", "path", "map_location")),
    Coupling("transformers.trainer_pt_utils:safe_globals", "private_call", "ckpt/resumable.py",
             "HF's numpy allow-list for rng_state*.pth, used to pre-check them", ()),
    Coupling("wandb.sdk.wandb_run:Run._log_artifact", "private_call", "monitor/sink_publish.py",
             "offline runs record the dataset as the run's input (use_after_commit); use_artifact refuses offline",
             ("self", "artifact_or_path", "name", "type", "aliases", "tags", "distributed_id", "finalize",
              "is_user_created", "use_after_commit")),
    Coupling("torch.distributed.fsdp._fully_shard._fsdp_collectives:DefaultAllGather.__call__", "private_call",
             "distributed/comm_timing.py", "FSDP2's own all-gather, wrapped to be timed (set_custom_all_gather)",
             ("self", "output_tensor", "input_tensor", "group", "async_op")),
    Coupling("torch.distributed.fsdp._fully_shard._fsdp_collectives:DefaultReduceScatter.__call__",
             "private_call", "distributed/comm_timing.py",
             "FSDP2's own reduce-scatter, wrapped to be timed (set_custom_reduce_scatter)",
             ("self", "output_tensor", "input_tensor", "group", "op", "async_op")),
    Coupling("deepspeed.comm.comm:comms_logger", "private_attribute", "distributed/comm_timing.py",
             "comm_* metrics under DeepSpeed: its comms logger's records, read and reset every step"),
    Coupling("deepspeed.comm.comm:timers", "private_attribute", "distributed/comm_timing.py",
             "the comms logger's timers log running totals; reset with its records every step"),
    *(
        Coupling(f"transformers.models.{family}.modeling_{family}:{prefix}PreTrainedModel._can_record_outputs",
                 "private_attribute", "train/moe_metrics.py",
                 "names the router module class each MoE family records router_logits from: the modules whose "
                 "chosen experts the expert-load metrics count")
        for family, prefix in (("qwen2_moe", "Qwen2Moe"), ("qwen3_moe", "Qwen3Moe"), ("mixtral", "Mixtral"))
    ),
    Coupling("peft.tuners.lora.layer:ParamWrapper.parameter_name", "private_attribute", "models/adapter_audit.py",
             "the parameter a LoRA parameter wrapper adapts (fused MoE experts): the audit's group name",
             set_in="peft.tuners.lora.layer:ParamWrapper.__init__"),
    Coupling("torch.cpu:_is_avx512_bf16_supported", "private_call", "distributed/devices.py",
             "whether this CPU multiplies bf16 natively (torch has no public question for it)", ()),
    Coupling("torch.cpu:_is_amx_tile_supported", "private_call", "distributed/devices.py",
             "the same for AMX tiles", ()),
    Coupling("torch.distributed.tensor:DTensor._op_dispatcher", "private_attribute", _CONTEXT,
             "torch's dispatcher of sharded calls: its unwrap_to_op_info gives the ring handler the local chunks"),
    Coupling("torch:ops.aten._scaled_dot_product_flash_attention_for_cpu", "private_call", _CONTEXT,
             "the CPU flash-attention kernel the ring handler is registered for (the table lists CUDA kernels)"),
    Coupling("torch:ops.aten._scaled_dot_product_flash_attention_for_cpu_backward", "private_call", _CONTEXT,
             "its backward, registered the same way"),
    Coupling("torch.distributed.fsdp._fully_shard._fsdp_api:AllGather", "private_call", "distributed/comm_timing.py",
             "the all-gather protocol set_custom_all_gather takes: the timed wrapper implements it"),
    Coupling("torch.distributed.fsdp._fully_shard._fsdp_api:ReduceScatter", "private_call",
             "distributed/comm_timing.py", "the reduce-scatter protocol set_custom_reduce_scatter takes"),
    Coupling("torch.nn:Module._forward_hooks", "private_attribute", "train/chunked_loss.py",
             "a head with forward hooks (PEFT, accelerate offload) is not fused into the chunked loss: the hooks "
             "would not run", instance="torch.nn:Identity"),
    Coupling("torch.nn:Module._forward_pre_hooks", "private_attribute", "train/chunked_loss.py",
             "the same for forward pre-hooks", instance="torch.nn:Identity"),
    Coupling("torch.nn:Module._hf_hook", "private_attribute", "train/chunked_loss.py",
             "accelerate's hook on an offloaded module: such a head is not fused into the chunked loss either",
             set_in="accelerate.hooks:add_hook_to_module"),
    Coupling("torch.nn:Linear.forward", "patch", _SAVERS,
             "the LM head's forward, replaced on the instance by a pass-through while the chunked cross-entropy "
             "computes the logits chunk by chunk; deleted afterwards (the class's forward again)",
             ("self", "input")),
    Coupling(f"{_MODEL}.loss_function", "patch", _SAVERS,
             "the model's loss, replaced on the instance by the chunked cross-entropy while a training forward runs"),
    Coupling(f"{_MODEL}._loss_function", "private_attribute", _SAVERS,
             "where the loss_function setter stores a replacement: deleted afterwards, so the property picks "
             "the model's own loss again", set_in=f"{_MODEL}.loss_function"),
    Coupling("transformers:Gemma2Config.final_logit_softcapping", "attribute", _SAVERS,
             "switched off while the chunked cross-entropy applies the softcap itself, then restored",
             instance="transformers:Gemma2Config"),
    *(
        Coupling(f"trl.trainer.{module}:{cls}._calculate_rewards", "override", _STEP,
                 "train.rl.on_reward_error skip_group: every row of a group in which a reward failed loses its "
                 "rewards (NaN, TRL's unscorable rows: no advantage, out of the baseline)",
                 ("self", "inputs", "prompts", "completions", "completion_ids_list"))
        for module, cls in (("grpo_trainer", "GRPOTrainer"), ("rloo_trainer", "RLOOTrainer"))
    ),
    *(
        Coupling(f"trl.trainer.{module}:{cls}.{name}", "attribute", "train/runner.py",
                 "the rl check before the first update scores with the trainer's own reward functions and "
                 "weights (a reward model is not loaded twice)", set_in=f"trl.trainer.{module}:{cls}.__init__")
        for module, cls in (("grpo_trainer", "GRPOTrainer"), ("rloo_trainer", "RLOOTrainer"))
        for name in ("reward_funcs", "reward_weights")
    ),
    Coupling("trl.trainer.distillation_trainer:DistillationTrainer._prepare_inputs", "override", _STEP,
             "on-policy distillation generates the student's completions here, as online RL does: the adapter's "
             "_prepare_inputs counts their tokens once from the prompt and completion masks it returns (TRL's "
             "own addition to num_input_tokens_seen is undone)",
             ("self", "generation_batch")),
    *(
        Coupling(f"llama_cpp.mtmd_cpp:mtmd_context_params.{name}", "attribute", "export/gguf_runtime.py",
                 "a VLM GGUF pair's projector loads in libmtmd on the CPU, without timing prints, with the Llama's "
                 "thread count (what llama-cpp-python's multimodal chat handlers set)", extra="gguf")
        for name in ("use_gpu", "print_timings", "n_threads")
    ),
    Coupling("llama_cpp.llama:Llama._ctx", "private_attribute", "export/gguf_runtime.py",
             "libmtmd decodes an image's embeddings into the Llama's own llama_context, as llama-cpp-python's "
             "multimodal chat handlers pass it, and its KV cache is cleared before each sequence",
             set_in="llama_cpp.llama:Llama.__init__", extra="gguf"),
    Coupling("llama_cpp.llama:Llama.n_tokens", "attribute", "export/gguf_runtime.py",
             "after libmtmd decoded an image at the context's end the Llama's position moves past it (as the chat "
             "handlers do), so the text after the image is evaluated at the next positions",
             set_in="llama_cpp.llama:Llama.__init__", extra="gguf"),
    Coupling("llama_cpp._logger:llama_log_callback", "private_call", "export/gguf_runtime.py",
             "libmtmd's log goes through llama-cpp-python's own callback (errors only unless verbose), so each "
             "encoded image does not print to the console", extra="gguf"),
    *(
        Coupling(f"llama_cpp.llama_cpp:llama_model_quantize_params.{name}", "attribute", "export/gguf_quantize.py",
                 "GGUF k-quants: the quantizer's parameters, from llama.cpp's defaults with the file type chosen "
                 "(--dtype) and a thread per core", extra="gguf")
        for name in ("ftype", "nthread")
    ),
    *(
        Coupling(f"torch.optim.{module}:{cls}.found_inf", "attribute", "train/step.py",
                 "the guardrails' verdict on the device: a fused optimizer skips its whole update (parameters, "
                 "moments, step count) on a non-zero found_inf, the flag AMP's GradScaler hands it, so no host "
                 "sync precedes the update (tests/test_guardrails.py trains it bit for bit like the host's "
                 "verdict)", set_in="torch.amp.grad_scaler:GradScaler.step")
        for module, cls in (("adam", "Adam"), ("adamw", "AdamW"), ("sgd", "SGD"), ("adagrad", "Adagrad"))
    ),
    Coupling(f"{_TOKENIZER}.response_template", "attribute", "train/tools.py",
             "tool rollouts: the parser of the model's tool calls (TRL's template for the catalogue's tool "
             "templates), which TRL's GRPOTrainer reads through tokenizer.parse_response",
             set_in=f"{_TOKENIZER}.__init__"),
    Coupling("trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions", "private_call",
             "train/rl_check.py",
             "rl check rolls out its tool-use episodes with the trainer's own generation, tool loop and tool_mask "
             "(what a training step does first), to compare the mask with the chat template's",
             ("self", "inputs")),
    *(
        Coupling(f"trl.trainer.grpo_trainer:GRPOTrainer.{name}", "private_attribute", "train/rl_check.py",
                 "rl check reads the episodes from the trainer's logs and puts its logs and metrics back as they "
                 "were, so a check before the first update leaves no trace in the run's metrics",
                 set_in="trl.trainer.grpo_trainer:GRPOTrainer.__init__")
        for name in ("_logs", "_metrics")
    ),
    Coupling("trl.trainer.grpo_trainer:GRPOTrainer._logs", "private_attribute", "train/rl_samples.py",
             "TRL keeps the logged prompts, completions and rewards there: lmforge sends the latest as samples",
             set_in="trl.trainer.grpo_trainer:GRPOTrainer.__init__"),
    Coupling("optuna.trial._trial:Trial._trial_id", "private_attribute", "sweep/run.py",
             "the storage's id of the trial, which the trial's run directory and the failed-trial record name",
             set_in="optuna.trial._trial:Trial.__init__"),
    Coupling("deepspeed.utils.logging:logger.propagate", "attribute", "upstream.py",
             "DeepSpeed's logger writes to stdout itself: route_deepspeed_logs removes its handler and lets its "
             "records reach lmforge's console filter and train.log"),
    Coupling(f"{_MODEL}._no_split_modules", "private_attribute", "distributed/fsdp.py",
             "the decoder-layer classes FSDP2 wraps as one unit each"),
    Coupling(f"{_CONTROL}.should_save", "attribute", "train/guard_callback.py",
             "a guard stop or a stop signal checkpoints this step; a rollback does not (also sweep/pruning.py)"),
    Coupling(f"{_CONTROL}.should_training_stop", "attribute", "train/guard_callback.py",
             "guardrails, stop signals and the sweep pruner end training through HF's flag"),
    Coupling(f"{_CONTROL}.should_log", "attribute", "train/assembly.py", "a log record at every logging step"),
    Coupling(f"{_CONTROL}.should_evaluate", "attribute", "train/assembly.py",
             "the evaluation at the last step, when there is an eval set"),
    Coupling("transformers.trainer_callback:TrainerState.num_input_tokens_seen", "attribute", _STEP,
             "lmforge counts the real tokens itself (they survive a resume); TRL's own addition is undone"),
    Coupling("transformers.training_args:TrainingArguments.eval_on_start", "attribute", "train/assembly.py",
             "the step-0 evaluation of a fresh run only (not of a resume or a rollback)"),
    Coupling("transformers.training_args:TrainingArguments.lr_scheduler_kwargs", "attribute", _STEP,
             "warmup-stable-decay's decay length, known once HF knows the step count"),
    Coupling(f"{_TRAINER}.optimizer", "attribute", _STEP,
             "create_optimizer sets Muon or LoRA+ where HF would build its own", set_in=f"{_TRAINER}.__init__"),
    Coupling("transformers.trainer_callback:EarlyStoppingCallback.early_stopping_patience_counter", "attribute",
             "train/callbacks.py", "the early-stopping count, restored on resume",
             instance="transformers.trainer_callback:EarlyStoppingCallback"),
    Coupling("transformers.trainer_callback:TrainerState.best_metric", "attribute", "train/callbacks.py",
             "the best metric early stopping compares with, replayed from metrics.jsonl on resume"),
    *(
        Coupling(f"{_CONFIG}.{name}", "attribute", where, why, instance="transformers:LlamaConfig")
        for name, where, why in (
            ("tie_word_embeddings", "train/final.py", "an untied copy of the final model says so in its config"),
            ("eos_token_id", "train/final.py", "generation stops at the chat template's end-of-turn tokens"),
            ("use_cache", "export/to_onnx.py", "the ONNX graph is traced without a key-value cache"),
            ("pad_token_id", "models/build.py", "a sequence-classification head reads the last non-pad token"),
            ("dtype", "distributed/pipeline_parallel.py", "a pipeline stage's weights dtype, as loaded"),
            ("_name_or_path", "train/rl_stage.py", "the reference model's path, written into its config"),
        )
    ),
    Coupling("transformers.models.llama.modeling_llama:LlamaForCausalLM.lm_head", "attribute",
             "distributed/pipeline_stages.py",
             "replaced by a pass-through on pipeline stages without the head (HF causal LMs name it lm_head)",
             set_in="transformers.models.llama.modeling_llama:LlamaForCausalLM.__init__"),
    Coupling("transformers.models.llama.modeling_llama:LlamaModel.norm", "attribute",
             "distributed/pipeline_stages.py",
             "the final norm, replaced by a pass-through on pipeline stages without the head and put back "
             "after the stage's forward (HF decoder models name it norm)",
             set_in="transformers.models.llama.modeling_llama:LlamaModel.__init__"),
    Coupling(f"{_TOKENIZER}.pad_token", "attribute", "data/tokenizer.py",
             "set to a stand-in token where the tokenizer has none (also evaluate/loading.py, "
             "train/reward_sources.py)", instance="lmforge.upstream:bare_fast_tokenizer"),
    Coupling(f"{_TOKENIZER}.chat_template", "attribute", "data/chat.py",
             "the chat template lmforge renders with, set on the tokenizer it saves",
             set_in=f"{_TOKENIZER}.__init__"),
    Coupling("tokenizers:Tokenizer.pre_tokenizer", "attribute", "data/tokenizer.py",
             "byte-level pre-tokenization of a tokenizer lmforge trains"),
    Coupling("tokenizers:Tokenizer.decoder", "attribute", "data/tokenizer.py", "its byte-level decoder"),
    Coupling("torch.distributed.checkpoint.metadata:Metadata.storage_meta", "attribute", "ckpt/safe_load.py",
             "set as torch's reader does after it reads .metadata (lmforge reads it under an allow-list)"),
    Coupling("torch.distributed.checkpoint.metadata:StorageMeta.load_id", "attribute", "ckpt/safe_load.py",
             "the same, as torch's reader sets it"),
    Coupling("torch:Tensor.grad", "attribute", "train/step.py",
             "a skipped step's gradients are set to None: optimizer.step() then changes neither parameters nor "
             "moments"),
)  # fmt: skip

# Versions the registry was checked against: [tested, next minor) from constraints.txt.
TESTED = {
    "transformers": ("5.23", "5.24"),
    "trl": ("1.16", "1.17"),
    "accelerate": ("1.15", "1.16"),
    "deepspeed": ("0.19.8", "0.20"),
    "torch": ("2.13", "2.14"),
    "peft": ("0.21", "0.22"),
    "wandb": ("0.31", "0.32"),
}


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


# Set to 1 to run with a library outside its tested range anyway: the stop becomes a warning.
ALLOW_UNTESTED_ENV = "LMFORGE_ALLOW_UNTESTED_VERSIONS"


def untested_versions() -> list[str]:
    """One line per installed package outside the versions lmforge's couplings were tested on,
    naming the package, the installed version and the tested range."""
    found = []
    for package, (low, high) in TESTED.items():
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        if not (_version_tuple(low) <= _version_tuple(installed) < _version_tuple(high)):
            found.append(f"{package} {installed} is outside the tested range >={low},<{high}")
    return found


def check_upstream_versions() -> list[str]:
    """One warning per installed package outside the versions lmforge's couplings were tested on."""
    warnings = [
        f"{line}; lmforge overrides or patches parts of it (see lmforge/upstream.py): pin the tested "
        "version if training misbehaves"
        for line in untested_versions()
    ]
    for line in warnings:
        log.warning(line)
    return warnings


def resolve(target: str) -> Any:
    """The upstream object `module:qualname` names (AttributeError / ImportError when it is gone)."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def bare_fast_tokenizer() -> Any:
    """A transformers fast tokenizer over an empty BPE model: an instance for the registry's checks."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(BPE()))


def coupling_problem(entry: Coupling) -> str | None:
    """Why `entry` no longer holds for the installed libraries, or None. An instance attribute is
    looked up on an object built for the check (`instance`), else found among the attributes the
    function that sets it (`set_in`) assigns; anything else is resolved, and a callable's parameter
    names are compared."""
    name = entry.target.rsplit(".", 1)[-1]
    if (
        entry.extra is not None
        and importlib.util.find_spec(entry.target.split(".", 1)[0].split(":")[0]) is None
    ):
        return None  # an extra this machine does not have: nothing of lmforge's touches it here
    try:
        if entry.instance is not None:
            built = resolve(entry.instance)()
            return None if hasattr(built, name) else f"{entry.instance}() has no attribute {name}"
        if entry.set_in is not None:
            assigned = assigned_attributes(resolve(entry.set_in))
            return None if name in assigned else f"{entry.set_in} no longer sets .{name}"
        if entry.kind == "own_attribute":
            owner = resolve(entry.target.rsplit(".", 1)[0])
            return f"{entry.target} is now defined upstream" if hasattr(owner, name) else None
        obj = resolve_member(entry.target)
    except (ImportError, AttributeError) as err:
        return f"{entry.target} is gone ({err})"
    if entry.parameters is not None:
        found = tuple(inspect.signature(obj).parameters)
        if found != entry.parameters:
            return f"{entry.target} now takes {found}, lmforge was written for {entry.parameters}"
    return None


def resolve_member(target: str) -> Any:
    """`resolve(target)`, or the dataclass field `target` names when it has no class-level default."""
    try:
        return resolve(target)
    except AttributeError:
        owner_path, _, name = target.rpartition(".")
        owner = resolve(owner_path)
        fields = {f.name: f for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
        if name not in fields:
            raise
        return fields[name]


def assigned_attributes(function: Any) -> set[str]:
    """Every attribute name `function` (a property: its setter) assigns to, read from its syntax
    tree: `obj.name = ...`, `obj.name, other = ...`, `obj.name += ...`."""
    import ast
    import textwrap

    if isinstance(function, property):
        function = function.fset
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    names = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets += target.elts
            elif isinstance(target, ast.Attribute):
                names.add(target.attr)
    return names


def check_upstream_coupling() -> list[str]:
    """Every registry entry that does not hold for the installed libraries, with the reason."""
    return [
        f"{entry.target} ({entry.where}): {problem}"
        for entry in REGISTRY
        if (problem := coupling_problem(entry))
    ]


def route_deepspeed_logs() -> None:
    """DeepSpeed's "DeepSpeed" logger writes to stdout through a handler of its own and does not
    propagate, so its INFO lines and its import-time "Setting accelerator to CPU" bypass the
    console filter and train.log alike. Route them when DeepSpeed is imported: at once when it
    already is, else on its first import (by lmforge, accelerate or PEFT). Importing it eagerly
    would cost every run that never uses it about 1.2 s of start-up. A no-op without DeepSpeed."""
    import sys

    if importlib.util.find_spec("deepspeed") is None:
        return
    if "deepspeed" in sys.modules:
        _let_deepspeed_records_propagate("")
    elif not any(isinstance(finder, _RouteDeepSpeedOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RouteDeepSpeedOnImport())


def _let_deepspeed_records_propagate(printed: str) -> None:
    """Drop DeepSpeed's own stdout handler, let its records reach lmforge's handlers, and replay
    what its import printed into the log."""
    logger = logging.getLogger("DeepSpeed")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True
    for line in printed.splitlines():
        if line.strip():
            logger.log(logging.WARNING if "[WARNING]" in line else logging.INFO, "%s", line)


class _RouteDeepSpeedOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `deepspeed` is first imported, it wraps the real loader so the
    import's stdout is captured and its logger routed right after the module runs."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "deepspeed":
            return None
        import sys

        # The finders after this one do the finding (a find_spec alone, as accelerate's
        # is_deepspeed_available does, imports nothing and leaves this finder in place).
        for finder in sys.meta_path[sys.meta_path.index(self) + 1 :]:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _CapturingLoader(spec.loader, self)
                return spec
        return None


class _CapturingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, finder: _RouteDeepSpeedOnImport) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        import sys

        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)  # routed once, on the one real import
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            self.loader.exec_module(module)
        _let_deepspeed_records_propagate(printed.getvalue())


def quiet_progress_bars(quiet: bool = True) -> None:
    """transformers' "Loading weights" / "Writing model shards" and the Hub's download bars:
    lmforge shows one progress display per stage of its own (`quiet=False` brings them back)."""
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    if quiet:
        transformers_logging.disable_progress_bar()
        disable_progress_bars()
    else:
        transformers_logging.enable_progress_bar()
        enable_progress_bars()
