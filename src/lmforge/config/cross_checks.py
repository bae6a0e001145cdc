"""Rules that span config sections, in one table: (applies?, key path, problem and fix).

Each rule is checked after every section validated on its own, and all broken rules are
reported together, like any other config error.
"""

from __future__ import annotations

from collections.abc import Callable

from lmforge.config.layout_rules import layout_problems
from lmforge.config.rl_rules import rl_problems
from lmforge.config.schema import ADAPTER_METHODS, LmforgeConfig, TrainConfig
from lmforge.config.stages import stage_spec

CHAT_FORMATS = {"alpaca", "sharegpt", "messages"}

Rule = tuple[Callable[[LmforgeConfig], bool], str, str]

RULES: list[Rule] = [
    (
        lambda c: c.data.streaming and c.data.store is not None,
        "data.streaming",
        "choose one of data.streaming (read the sources while training) and data.store (tokenize into a "
        "sharded token store first)",
    ),
    (
        lambda c: c.data.store is not None and stage_spec(c.train.stage).data_kind != "text",
        "data.store",
        "the token store holds pretraining text (train.stage: pretrain); fine-tuning sets use the cache "
        "or data.streaming",
    ),
    (
        lambda c: c.data.streaming and stage_spec(c.train.stage).data_kind not in ("text", "chat"),
        "data.streaming",
        "streaming reads pretraining text and SFT conversations; preference and RL stages read their rows "
        "from the cache: remove data.streaming",
    ),
    (
        lambda c: (
            c.data.streaming
            and max(
                c.distributed.tensor_parallel, c.distributed.context_parallel, c.distributed.pipeline_parallel
            )
            > 1
        ),
        "data.streaming",
        "a stream is split over data-parallel ranks, and tensor / context / pipeline ranks must read the same "
        "batch; use data.store (a map-style token store the sampler splits by data rank) with these layouts",
    ),
    (
        lambda c: c.data.streaming and c.train.max_steps is None,
        "train.max_steps",
        "a stream has no length to count epochs in; set train.max_steps",
    ),
    (
        lambda c: c.data.streaming and c.data.eval_fraction > 0,
        "data.eval_fraction",
        "a stream cannot hold out blocks it has not read yet; set data.eval sources (read whole, cached) "
        "and data.eval_fraction: 0",
    ),
    (
        lambda c: (
            stage_spec(c.train.stage).data_kind == "text"
            and not c.data.streaming
            and c.data.store is None
            and any(s.weight != 1.0 or s.max_tokens is not None for s in c.data.train)
        ),
        "data.train",
        "source weights and max_tokens mix pretraining sources block by block, which the single cache (one "
        "stream of all sources) does not do; set data.streaming: true or data.store: {} (or remove them)",
    ),
    (
        lambda c: (
            stage_spec(c.train.stage).data_kind != "text"
            and any(s.max_tokens is not None for s in c.data.train)
        ),
        "data.train",
        "max_tokens budgets pretraining text; for fine-tuning rows use max_documents",
    ),
    (
        lambda c: c.data.store is not None and any(s.max_documents is not None for s in c.data.train),
        "data.train",
        "the token store's tasks read their files independently, so a source-wide max_documents cannot be "
        "applied; use max_tokens (a budget applied when training reads the store)",
    ),
    (
        lambda c: c.data.padding_free and c.model.attn_implementation != "flash_attention_2",
        "data.padding_free",
        "padding-free batches keep samples apart only under flash_attention_2 (sdpa/eager would let them "
        "attend to each other); set model.attn_implementation: flash_attention_2, or use data.packing: true "
        "(with sdpa, or flex_attention on a GPU)",
    ),
    (
        lambda c: c.data.packing and c.model.attn_implementation == "flash_attention_2",
        "data.packing",
        "with flash_attention_2 use data.padding_free: true (varlen attention) instead of data.packing",
    ),
    (
        lambda c: c.data.packing and c.data.padding_free,
        "data.packing",
        "choose one of data.packing and data.padding_free",
    ),
    (
        lambda c: stage_spec(c.train.stage).data_kind == "text" and (c.data.packing or c.data.padding_free),
        "data.packing",
        "pretraining already packs text into full blocks; packing/padding_free apply to train.stage: sft",
    ),
    (
        lambda c: (
            stage_spec(c.train.stage).data_kind == "text"
            and any(s.format not in ("auto", "text") for s in [*c.data.train, *c.data.eval])
        ),
        "data.train",
        "train.stage: pretrain reads raw text (format: text); set train.stage: sft for conversation data",
    ),
    (
        lambda c: (
            stage_spec(c.train.stage).data_kind != "text"
            and any(s.format == "text" for s in [*c.data.train, *c.data.eval])
        ),
        "data.train",
        "format: text is raw pretraining text; train.stage: sft/dpo/kto/rm needs conversation or preference rows",
    ),
    (
        lambda c: stage_spec(c.train.stage).data_kind != "text" and c.tokenizer.train is not None,
        "tokenizer.train",
        "tokenizer.train learns from raw text sources; for fine-tuning stages train one with "
        "`lmforge tokenizer train --input ... --out DIR` and set tokenizer.path: DIR, or use model.path's tokenizer",
    ),
    (
        lambda c: (
            stage_spec(c.train.stage).data_kind == "chat"
            and any(s.format in ("preference", "kto") for s in c.data.train)
        ),
        "data.train",
        "preference and kto rows need a preference stage (dpo / kto / rm), not train.stage: sft",
    ),
    (
        lambda c: (
            stage_spec(c.train.stage).data_kind == "pairs"
            and any(s.format in CHAT_FORMATS | {"kto"} for s in [*c.data.train, *c.data.eval])
        ),
        "data.train",
        "train.stage: dpo and rm learn from preference pairs (format: preference, with chosen and rejected)",
    ),
    (
        lambda c: (
            stage_spec(c.train.stage).data_kind == "labelled"
            and any(s.format in CHAT_FORMATS for s in [*c.data.train, *c.data.eval])
        ),
        "data.train",
        "train.stage: kto learns from labelled rows (format: kto) or preference pairs (format: preference)",
    ),
    (
        lambda c: stage_spec(c.train.stage).offline_preference and (c.data.packing or c.data.padding_free),
        "data.packing",
        "preference stages batch chosen and rejected answers side by side; packing applies to pretrain and sft",
    ),
    (
        lambda c: stage_spec(c.train.stage).on_policy and (c.data.packing or c.data.padding_free),
        "data.packing",
        "online RL and distillation generate their completions at run time; packing applies to pretrain "
        "and sft",
    ),
    (
        lambda c: (
            stage_spec(c.train.stage).on_policy
            and any(s.format == "kto" for s in [*c.data.train, *c.data.eval])
        ),
        "data.train",
        "train.stage grpo / rloo / distill reads prompts (with a reference answer for grpo / rloo): alpaca, "
        "sharegpt, messages, {question, answer} rows, or preference pairs, whose chosen answer is the "
        "reference; not kto rows",
    ),
    (
        lambda c: stage_spec(c.train.stage).teacher and c.train.distill.teacher is None,
        "train.distill.teacher",
        "on-policy distillation needs a teacher: set train.distill.teacher to the teacher model's directory "
        "(an HF causal LM with the student's tokenizer)",
    ),
    (
        lambda c: not stage_spec(c.train.stage).teacher and c.train.distill.teacher is not None,
        "train.distill.teacher",
        "a teacher is the model train.stage distill learns from; set train.stage: distill, or remove "
        "train.distill",
    ),
    (
        lambda c: (
            stage_spec(c.train.stage).online_rl
            and (c.train.micro_batch_size * c.train.grad_accum) % c.train.rl.group_size != 0
        ),
        "train.micro_batch_size",
        "in online RL a micro-batch holds completions, and each optimizer step's completions "
        "(train.micro_batch_size x train.grad_accum per process) must be whole groups of train.rl.group_size; "
        "make their product a multiple of the group size",
    ),
    (
        lambda c: (
            stage_spec(c.train.stage).online_rl
            and c.train.rl.steps_per_generation is not None
            and (c.train.micro_batch_size * c.train.rl.steps_per_generation) % c.train.rl.group_size != 0
        ),
        "train.rl.steps_per_generation",
        "one generation makes train.micro_batch_size x train.rl.steps_per_generation completions per process, "
        "which must be whole groups of train.rl.group_size; make their product a multiple of the group size",
    ),
    (
        lambda c: c.train.stage == "rloo" and "loss" in c.train.rl.model_fields_set,
        "train.rl.loss",
        "train.rl.loss selects GRPO's loss variants; RLOO has its own estimator: leave train.rl.loss unset",
    ),
    (
        lambda c: c.train.rl.generation == "transformers" and bool(c.train.rl.vllm.model_fields_set),
        "train.rl.vllm",
        "vLLM settings with train.rl.generation: transformers do nothing; set generation: vllm (CUDA and the "
        "vllm extra) or remove train.rl.vllm",
    ),
    (
        lambda c: (
            stage_spec(c.train.stage).trainer != "trl:GRPOTrainer"
            and bool(
                {"importance_sampling", "importance_sampling_max", "importance_sampling_min"}
                & c.train.rl.vllm.model_fields_set
            )
        ),
        "train.rl.vllm.importance_sampling",
        "the importance-sampling correction of vLLM's log-probs is GRPO's (TRL's GRPOTrainer); TRL's "
        "RLOOTrainer has none: remove it, or use train.stage: grpo",
    ),
    (
        lambda c: c.train.rl.vllm.mode == "server" and c.train.rl.generation != "vllm",
        "train.rl.vllm.mode",
        "server mode starts a vLLM server beside the trainer: set train.rl.generation: vllm (with auto, a "
        "machine without vLLM would generate with transformers and leave the server unused)",
    ),
    (
        lambda c: c.train.rl.tools is not None and not stage_spec(c.train.stage).tool_rollouts,
        "train.rl.tools",
        "tool-use rollouts run on TRL's GRPOTrainer, which runs the episode's tool calls (train.stage grpo); "
        "TRL's other trainers have no tool loop. Fix: set train.stage: grpo, or remove train.rl.tools",
    ),
    (
        lambda c: not stage_spec(c.train.stage).online_rl and bool(c.train.rewards),
        "train.rewards",
        "rewards score the completions of online RL (train.stage grpo or rloo); remove them for this stage",
    ),
    (
        lambda c: c.train.stage == "kto" and c.train.micro_batch_size < 2,
        "train.micro_batch_size",
        "KTO estimates its KL term from mismatched answers within a micro-batch; set at least 2",
    ),
    (
        lambda c: c.train.method in ("lora", "dora", "qlora") and c.model.path is None,
        "train.method",
        "adapters train on top of pretrained weights that must exist on disk to load the adapter later; "
        "set model.path to the model to fine-tune (for example a pretraining run's final/)",
    ),
    (
        lambda c: c.export.merge_lora and c.train.method not in ("lora", "dora"),
        "export.merge_lora",
        "only a lora or dora run has an adapter to merge (a qlora base is 4-bit: merge the adapter onto the "
        "full-precision base with `lmforge ckpt merge-lora`)",
    ),
    (
        lambda c: bool(c.export.formats) and stage_spec(c.train.stage).head == "score",
        "export.formats",
        "a reward model (train.stage rm) has a score head, not a language-model head; GGUF/ONNX/"
        "safetensors exports here are for causal LMs: remove export.formats",
    ),
    (
        lambda c: (
            c.export.gguf_imatrix_data is not None
            and ("gguf" not in c.export.formats or c.export.gguf_dtype in ("f32", "f16", "bf16", "q8_0"))
        ),
        "export.gguf_imatrix_data",
        "an importance matrix steers llama.cpp's quantizer: it goes with export.formats [gguf] and a k-quant "
        "export.gguf_dtype (q4_k_m, q5_k_m, ...), not f32/f16/bf16/q8_0",
    ),
    (
        lambda c: bool(c.export.formats) and c.train.method == "qlora",
        "export.formats",
        "a qlora run's base is 4-bit: merge the adapter onto the full-precision base with "
        "`lmforge ckpt merge-lora`, then `lmforge ckpt convert` the merged model",
    ),
    (
        lambda c: c.train.best_metric is not None and c.train.eval_every is None,
        "train.best_metric",
        "keeping the best checkpoint needs evaluations; set train.eval_every (and eval data)",
    ),
    (
        lambda c: c.train.best_metric is not None and c.train.save_every is None,
        "train.best_metric",
        "keeping the best checkpoint needs checkpoints; set train.save_every (a multiple of train.eval_every)",
    ),
    (
        lambda c: c.train.early_stopping is not None and c.train.eval_every is None,
        "train.early_stopping",
        "early stopping watches evaluations; set train.eval_every (and eval data)",
    ),
    (
        lambda c: (
            c.train.kept_best_metric is not None
            and c.train.save_every is not None
            and c.train.eval_every is not None
            and c.train.save_every % c.train.eval_every != 0
        ),
        "train.save_every",
        "with train.best_metric (or train.early_stopping) each checkpoint is judged by the evaluation at "
        "its own step; "
        "make train.save_every a multiple of train.eval_every",
    ),
    (
        lambda c: (
            c.distributed.deepspeed_config is not None and c.distributed.strategy not in ("auto", "deepspeed")
        ),
        "distributed.deepspeed_config",
        "a DeepSpeed JSON needs distributed.strategy: deepspeed (or auto); remove one of the two",
    ),
    (
        lambda c: c.distributed.offload != "none" and c.distributed.strategy in ("none", "ddp"),
        "distributed.offload",
        "offload needs a sharding strategy: set distributed.strategy: deepspeed (ZeRO-2/3) or fsdp "
        "(offload: optimizer+params)",
    ),
    (
        lambda c: (
            c.distributed.offload == "optimizer+params"
            and c.distributed.strategy == "deepspeed"
            and c.distributed.zero_stage != 3
        ),
        "distributed.offload",
        "only ZeRO-3 partitions (and so offloads) parameters; set distributed.zero_stage: 3, or offload: optimizer",
    ),
    (
        lambda c: (
            c.distributed.offload == "optimizer"
            and c.distributed.strategy == "deepspeed"
            and c.distributed.zero_stage == 1
        ),
        "distributed.offload",
        "DeepSpeed offloads optimizer states from ZeRO-2 up; set distributed.zero_stage: 2 or 3",
    ),
    (
        lambda c: c.distributed.offload == "optimizer" and c.distributed.strategy == "fsdp",
        "distributed.offload",
        "FSDP2 offloads parameters, gradients and optimizer states together; set offload: optimizer+params",
    ),
    (
        lambda c: c.distributed.strategy == "fsdp" and c.train.method != "full",
        "distributed.strategy",
        "fsdp is wired for full fine-tuning and pretraining here; for adapter methods (lora, dora, qlora, "
        "freeze) use distributed.strategy: ddp or deepspeed",
    ),
    (
        lambda c: (
            c.monitor.profile is not None
            and c.train.max_steps is not None
            and c.monitor.profile.start_step + c.monitor.profile.steps - 1 > c.train.max_steps
        ),
        "monitor.profile.start_step",
        "the profiled window (monitor.profile.start_step to start_step + monitor.profile.steps - 1) ends after "
        "train.max_steps; lower monitor.profile.start_step or monitor.profile.steps, or raise train.max_steps",
    ),
    (
        lambda c: c.train.warmup_ratio is not None and c.train.warmup_steps > 0,
        "train.warmup_ratio",
        "set one of train.warmup_steps and train.warmup_ratio (a share of all steps), not both",
    ),
    (
        lambda c: c.train.min_lr_ratio > 0 and c.train.schedule not in ("cosine", "wsd"),
        "train.min_lr_ratio",
        "a minimum learning rate applies to schedule cosine or wsd; set train.schedule: cosine (or wsd), "
        "or remove train.min_lr_ratio",
    ),
    (
        lambda c: (
            c.train.decay_ratio != TrainConfig.model_fields["decay_ratio"].default
            and c.train.schedule != "wsd"
        ),
        "train.decay_ratio",
        "train.decay_ratio is the decay share of schedule wsd; set train.schedule: wsd or remove it",
    ),
    (
        lambda c: c.train.optimizer.lora_plus_ratio is not None and c.train.method not in ADAPTER_METHODS,
        "train.optimizer.lora_plus_ratio",
        "LoRA+ gives the adapters' B matrices their own rate; it needs train.method lora, dora or qlora",
    ),
    (
        lambda c: (
            c.train.optimizer.lora_plus_ratio is not None and c.train.optimizer.name in ("galore", "muon")
        ),
        "train.optimizer.lora_plus_ratio",
        "LoRA+ builds its own parameter groups and cannot combine with galore or muon, which build theirs; "
        "use name adamw, adafactor, lion or adamw_8bit",
    ),
    (
        lambda c: c.train.optimizer.name == "galore" and c.train.method != "full",
        "train.optimizer.name",
        "GaLore projects the gradients of full weight matrices; with adapters the matrices are already "
        "low-rank: use train.method: full, or optimizer adamw",
    ),
    (
        lambda c: (
            c.train.optimizer.name in ("galore", "muon") and c.distributed.strategy in ("deepspeed", "fsdp")
        ),
        "train.optimizer.name",
        "galore and muon step whole weight matrices, which DeepSpeed ZeRO and FSDP shard; use "
        "distributed.strategy: ddp (or none), or optimizer adamw",
    ),
    (
        lambda c: c.train.optimizer.name != "adamw" and c.distributed.strategy == "deepspeed",
        "train.optimizer.name",
        "DeepSpeed runs its own optimizer (distributed.deepspeed_config's optimizer section, AdamW by default); "
        "use optimizer adamw with deepspeed, or distributed.strategy: fsdp / ddp",
    ),
    (
        lambda c: c.train.chunked_cross_entropy and not stage_spec(c.train.stage).language_model_loss,
        "train.chunked_cross_entropy",
        "the chunked loss is the next-token loss of stage pretrain and sft; the other stages compute their "
        "own losses from the logits: remove train.chunked_cross_entropy",
    ),
    (
        lambda c: c.train.chunked_cross_entropy and c.train.kernels == "liger",
        "train.chunked_cross_entropy",
        "with train.kernels: liger the loss is already Liger's fused linear cross-entropy, which never "
        "builds the logits either; remove train.chunked_cross_entropy",
    ),
    (
        lambda c: c.train.checkpoint_every != 1 and not c.train.gradient_checkpointing,
        "train.checkpoint_every",
        "train.checkpoint_every selects the layers gradient checkpointing recomputes; set "
        "train.gradient_checkpointing: true",
    ),
    (
        lambda c: bool(c.train.compile) and c.distributed.strategy == "deepspeed",
        "train.compile",
        "torch.compile under DeepSpeed is DeepSpeed's own (deepspeed_config compile section), for the "
        "whole model and for its layers alike; remove train.compile or use distributed.strategy: fsdp / ddp",
    ),
    (
        lambda c: c.train.compile == "model" and c.train.kernels == "liger",
        "train.compile",
        "model: Liger's fused linear cross-entropy does not trace under torch.compile (measured on an H100 "
        "with torch 2.11 and liger-kernel 0.8.5: dynamo fails on its addmm); set train.compile: layers to "
        "compile the decoder layers and keep the loss eager, or choose one of train.kernels: liger and "
        "train.compile: model -- each alone gave about 1.4x the plain bf16 step there (bench/RESULTS.md)",
    ),
    (
        lambda c: bool(c.train.compile) and stage_spec(c.train.stage).on_policy,
        "train.compile",
        "online RL and distillation alternate generation and training with changing shapes, which "
        "recompiles the model (or each of its layers) every step; remove train.compile",
    ),
    (
        lambda c: c.train.chunked_cross_entropy and c.train.compile == "model",
        "train.chunked_cross_entropy",
        "torch.compile of the whole model traces its forward once, and the chunked loss swaps the head "
        "around each training forward (a retrace every step); set train.compile: layers to compile the "
        "decoder layers and keep the chunked loss eager, or choose one of train.compile and "
        "train.chunked_cross_entropy",
    ),
    (
        lambda c: (
            c.train.chunked_cross_entropy
            and (
                c.distributed.strategy == "fsdp"
                or (c.distributed.strategy == "deepspeed" and c.distributed.zero_stage == 3)
            )
        ),
        "train.chunked_cross_entropy",
        "the chunked loss calls the output head chunk by chunk, also in backward, where FSDP and ZeRO-3 "
        "have released its sharded weight; use distributed.strategy ddp or ZeRO-1/2, or remove "
        "train.chunked_cross_entropy",
    ),
    # train.precision fp8 (train/fp8.py): torchao's Float8Linear computes every weight gradient in float8
    # whether the weight trains or not, so a frozen base pays a third float8 matmul per layer for nothing
    # (and qlora's 4-bit base cannot be cast at all); float8 is for full fine-tunes and pretraining.
    (
        lambda c: c.train.precision == "fp8" and c.train.method != "full",
        "train.precision",
        "fp8 trains full weights (pretraining, full fine-tunes): torchao's float8 layers compute the weight "
        "gradient of a frozen base too, and an adapter's small matmuls gain nothing from float8; set "
        "train.method: full, or train.precision: bf16 for lora / dora / qlora / freeze",
    ),
    (
        lambda c: (
            c.train.precision == "fp8"
            and (c.distributed.strategy == "deepspeed" or c.distributed.deepspeed_config is not None)
        ),
        "train.precision",
        "fp8 trains through torchao's float8 layers, which work with FSDP2, DDP and one process, not inside "
        "DeepSpeed's engine; set distributed.strategy: fsdp (or ddp), or train.precision: bf16",
    ),
    (
        lambda c: c.train.precision == "fp8" and c.distributed.tensor_parallel > 1,
        "train.precision",
        "fp8 with distributed.tensor_parallel > 1: float8 under tensor parallelism needs torchao's own float8 "
        "parallel styles, which the model's tensor-parallel plan does not use; set "
        "distributed.tensor_parallel: 1 (FSDP2 shards the model), or train.precision: bf16",
    ),
]


def cross_section_problems(cfg: LmforgeConfig) -> list[tuple[str, str]]:
    """(key path, message) for every rule the config breaks, the layout rules
    (config/layout_rules.py, which the workers check again) included."""
    rules = [(key, message) for applies, key, message in RULES if applies(cfg)]
    return rules + layout_problems(cfg) + rl_problems(cfg)  # rl: spike settings on an RL stage
