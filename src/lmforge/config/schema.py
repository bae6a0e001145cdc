"""The typed config tree: one pydantic model per config section (README.md, "The config").

Every field's description is its help text (`lmforge config schema` prints them).
Only keys that have an effect exist; unknown keys are errors (`extra="forbid"`).
Each stage receives its own section (`cfg.data`, `cfg.train`, ...), never the root.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, cast, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo

from lmforge.config.chat_template_names import ChatTemplateName, canonical_chat_template


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # `warmup_steps: null` (or a bare `lora:` with its lines commented out) is how YAML users
        # write "not set"; for a key that has a default and no meaning for None, that is the default.
        if not isinstance(data, dict):
            return data
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in cls.model_fields or _takes_none(cls.model_fields[key])
        }


def _takes_none(field: FieldInfo) -> bool:
    """Whether None is a value of its own for this field (or it has no default to fall back on)."""
    if field.is_required():
        return True
    annotation = field.annotation
    return annotation is Any or annotation is None or type(None) in get_args(annotation)


class RunConfig(Section):
    name: str = Field("run", description="Run name; the run directory is <output_dir>/<name>.", min_length=1)
    output_dir: Path = Field(Path("runs"), description="Parent directory of run directories.")
    seed: int = Field(42, description="Seed for model init, data order and dropout.")
    overwrite: bool = Field(
        False,
        description="Start from scratch: delete what an earlier run wrote in the run directory (checkpoints, "
        "final/, records; nothing else) instead of resuming it or reporting it finished.",
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        # The run directory is deleted and rewritten by name (run.overwrite, restarts): a name that
        # could point anywhere but one level below output_dir would put other files at risk.
        if name in (".", "..") or any(sep in name for sep in ("/", "\\", "\0")) or Path(name).is_absolute():
            raise ValueError(
                f"{name!r} is not a plain name: no '/', '\\', '..' or absolute paths (the run directory is "
                "<run.output_dir>/<run.name>; put the directory part in run.output_dir)"
            )
        return name

    @property
    def dir(self) -> Path:
        return self.output_dir / self.name


class MoeConfig(Section):
    """Router settings of a Mixture-of-Experts model; a key left unset keeps the model's own value."""

    top_k: int | None = Field(
        None,
        ge=1,
        description="Experts each token is routed to (the HF config's num_experts_per_tok); at most the "
        "number of experts per layer.",
    )
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="Weight of the load-balancing auxiliary loss (the HF config's router_aux_loss_coef). "
        "Training forwards return the router logits, so the loss includes it; evaluation losses do not. "
        "0 trains without it (moe_aux_loss is still recorded).",
    )
    router_z_loss_coef: float | None = Field(
        None,
        ge=0,
        description="Weight of the router z-loss, for families whose config has one (router_z_loss_coef, as "
        "in Switch Transformers); refused for families without it (qwen2_moe, qwen3_moe, mixtral).",
    )


class ModelConfig(Section):
    preset: str | None = Field(
        None,
        description="Named tiny architecture built from scratch: llama-tiny, qwen2-tiny, mistral-tiny, gpt2-tiny, "
        "and the Mixture-of-Experts qwen2-moe-tiny, qwen3-moe-tiny, mixtral-tiny (4 experts per layer, top-2).",
    )
    path: str | None = Field(None, description="Local HF model directory (or hub name when online) to load.")
    config: dict[str, Any] | None = Field(
        None,
        description="Inline architecture config (AutoConfig kwargs with model_type); with `preset`, overrides its fields.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype the weights are held in; mixed precision is `train.precision`."
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "sdpa",
        description="Attention kernel passed to transformers. flex_attention: torch's FlexAttention (training "
        "on CUDA GPUs); with data.packing its block mask skips every block between two samples of a row, the "
        "varlen path where flash-attn is not installed.",
    )
    trust_remote_code: bool = Field(
        False, description="Run model code shipped with a checkpoint. Off unless you trust it."
    )
    allow_bin_weights: bool = Field(
        False,
        description="Allow loading legacy .bin weights (read with weights_only, never full unpickling).",
    )
    moe: MoeConfig | None = Field(
        None,
        description="Mixture-of-Experts router settings (top_k, router_aux_loss_coef, router_z_loss_coef), "
        "written into the model's config when it is built; MoE models only (refused on a dense model).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.path and (self.preset or self.config):
            raise ValueError("set either model.path or model.preset/model.config, not both")
        if not (self.path or self.preset or self.config):
            raise ValueError("set one of model.preset, model.path or model.config")
        if self.config is not None and not self.preset and "model_type" not in self.config:
            raise ValueError("model.config needs a model_type (for example model_type: llama)")
        return self


class TokenizerTrainConfig(Section):
    vocab_size: int = Field(
        8192, ge=300, description="Vocabulary size of the byte-level BPE tokenizer to train."
    )
    min_frequency: int = Field(2, ge=1, description="Minimum pair frequency for a BPE merge.")
    max_chars: int = Field(
        20_000_000, ge=1000, description="Train on at most this many characters of the training text."
    )
    chat_template: Literal["chatml"] = Field("chatml", description="Chat template stored with the tokenizer.")


class TokenizerConfig(Section):
    path: str | None = Field(None, description="Local HF tokenizer directory; defaults to model.path.")
    train: TokenizerTrainConfig | None = Field(
        None, description="Train a tokenizer on the training data before anything else."
    )

    @model_validator(mode="after")
    def _not_both(self) -> TokenizerConfig:
        if self.path and self.train:
            raise ValueError("set either tokenizer.path or tokenizer.train, not both")
        return self


class SourceConfig(Section):
    path: str = Field(
        description="File, glob, directory, or a built-in corpus `builtin:<name>` (builtin:python-stdlib)."
    )
    format: Literal["auto", "text", "alpaca", "sharegpt", "messages", "preference", "kto"] = Field(
        "auto",
        description="Row format: text (pretraining), alpaca, sharegpt, messages, preference, kto; "
        "auto detects it from the columns when unambiguous.",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Column mapping, format role -> column name in the file (LLaMA-Factory's `columns`), "
        "for example {prompt: question, response: answer}.",
    )
    dataset: str | None = Field(
        None, description="With `path` pointing at a LLaMA-Factory dataset_info.json: the dataset name in it."
    )
    weight: float = Field(
        1.0, gt=0, description="Mixing weight of this source relative to the other training sources."
    )
    text_field: str = Field("text", description="Field holding the document in .jsonl/.json/.parquet files.")
    split: Literal["file", "line", "paragraph"] = Field(
        "file",
        description="How a .txt file becomes documents: the whole file, each line, or blank-line-separated paragraphs.",
    )
    max_documents: int | None = Field(
        None, ge=1, description="Read at most this many documents from this source."
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Token budget of this source in the training mix (text under data.streaming or data.store): "
        "it contributes at most this many tokens, its weight applied first.",
    )


class SlurmStoreConfig(Section):
    partition: str | None = Field(None, description="Slurm partition the tokenization tasks run on.")
    time: str = Field("12:00:00", description="Slurm time limit per task (HH:MM:SS).")
    cpus_per_task: int = Field(1, ge=1, description="CPUs per tokenization task.")
    mem_per_cpu_gb: float = Field(2.0, gt=0, description="Memory per CPU in GB.")
    venv: str | None = Field(
        None, description="Virtual environment the job activates (path to bin/activate)."
    )
    sbatch_args: dict[str, str] = Field(
        default_factory=dict, description="Extra #SBATCH directives, for example {account: my-account}."
    )


class TokenStoreConfig(Section):
    path: Path | None = Field(
        None,
        description="Directory of the sharded token store; defaults to <cache_dir>/store-<fingerprint>. Point "
        "it at shared storage (NFS, Lustre) when Slurm or Ray tasks write it.",
    )
    tasks: int = Field(
        1,
        ge=1,
        description="Tokenization tasks; the input files are dealt to them, each writes its own shards.",
    )
    workers: int = Field(
        -1,
        ge=-1,
        description="Tasks run at once by the local executor (-1: one per CPU core, at most `tasks`).",
    )
    executor: Literal["local", "slurm", "ray"] = Field(
        "local",
        description="The datatrove executor that runs the tasks: local processes, a Slurm job array, or Ray.",
    )
    slurm: SlurmStoreConfig = Field(
        default_factory=SlurmStoreConfig, description="Slurm settings, with executor: slurm."
    )


class DataConfig(Section):
    train: list[SourceConfig] = Field(min_length=1, description="Training sources.")
    eval: list[SourceConfig] = Field(default_factory=list, description="Evaluation sources.")
    eval_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Hold out this share of training blocks for eval when `eval` is empty.",
    )
    max_length: int = Field(
        1024, ge=8, description="Tokens per training block (pretraining) or per sample / packed row (SFT)."
    )
    chat_template: ChatTemplateName | None = Field(
        None,
        description="Built-in chat template of a model family, used instead of the tokenizer's own (needed "
        "when it has none). LLaMA-Factory's template names are accepted too (qwen, phi, gemma2, deepseek3, ...).",
    )
    train_on: Literal["assistant", "all", "last_assistant"] = Field(
        "assistant", description="Which tokens carry loss in conversations."
    )
    over_length: Literal["truncate", "drop", "error"] = Field(
        "error",
        description="A sample longer than max_length: truncate it (rows left with no supervised token are "
        "dropped and counted), drop it (counted), or stop with an error naming it.",
    )
    packing: bool = Field(
        False,
        description="SFT: pack several samples per row (best-fit), attention never crossing samples.",
    )
    padding_free: bool = Field(
        False, description="SFT: concatenate a batch into one row with restarting position ids (no padding)."
    )
    on_bad_row: Literal["error", "skip"] = Field(
        "error",
        description="A malformed row: stop with file:line and the reason, or quarantine it to bad_rows.jsonl.",
    )
    max_bad_fraction: float = Field(
        0.01, ge=0, le=1, description="With on_bad_row=skip: fail when more than this share of rows is bad."
    )
    memory_budget_mb: int = Field(
        1024, ge=16, description="Rows held in memory while preparing; larger inputs are streamed through it."
    )
    cache_dir: Path | None = Field(
        None, description="Where prepared data is cached; defaults to $LMFORGE_CACHE or ~/.cache/lmforge."
    )
    streaming: bool = Field(
        False,
        description="Read the sources lazily while training (local shards, globs, hub or remote datasets): "
        "tokenized and packed on the fly, each rank and dataloader worker reading its own part, nothing "
        "cached. Needs train.max_steps.",
    )
    store: TokenStoreConfig | None = Field(
        None,
        description="Pretraining: tokenize into a sharded token store (a datatrove pipeline of `tasks` tasks; "
        "`lmforge prepare --executor`) and train from it memory-mapped, for corpora too big for one cache.",
    )

    @field_validator("chat_template", mode="before")
    @classmethod
    def _built_in_name(cls, name: Any) -> Any:
        # A LLaMA-Factory name becomes the built-in's, so the resolved config records what renders.
        return canonical_chat_template(name) if isinstance(name, str) else name


class LoraConfig(Section):
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: int = Field(16, gt=0, description="LoRA scaling numerator (the update is scaled by alpha / r).")
    dropout: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Dropout on the LoRA input. Adapters on parameters (target_parameters) have none: at "
        "this default it is then 0 for the run; another value above 0 with them is refused.",
    )
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Modules that get adapters: `all-linear` (every linear layer but the output head) "
        "or a list of module names such as [q_proj, v_proj]. Each listed name must match a module.",
    )
    target_parameters: list[str] | None = Field(
        None,
        description="Parameters that get adapters, by name suffix (PEFT's target_parameters), for weights that "
        "are no linear layer: the fused 3-D expert weights of transformers 5 MoE models, for example "
        "[experts.gate_up_proj, experts.down_proj]. Unset: with target_modules all-linear on an MoE model, "
        "every fused expert parameter is targeted automatically; [] targets none. Each name must match.",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full and saved with the adapter (for example [lm_head, embed_tokens]).",
    )


class FreezeConfig(Section):
    trainable_layers: int = Field(
        2, ge=0, description="train.method=freeze: train only the top N transformer layers."
    )
    trainable_modules: list[str] = Field(
        default_factory=list,
        description="Also train parameters whose name contains one of these (for example [lm_head, norm]).",
    )


class VisionTrainConfig(Section):
    """A vision-language model's image side: which parts train (LLaMA-Factory's freeze_vision_tower /
    freeze_multi_modal_projector, ms-swift's freeze_vit / freeze_aligner)."""

    tower: Literal["train", "freeze"] = Field(
        "freeze",
        description="The vision tower (image encoder): freeze (default: a pretrained encoder already "
        "sees; fine-tuning it needs much data) or train (under lora: it gets adapters).",
    )
    projector: Literal["train", "freeze"] = Field(
        "train",
        description="The projector (connector) from image features to the language model's inputs: "
        "train (default) or freeze (under lora: train gives it adapters).",
    )


class DpoConfig(Section):
    loss: Literal["sigmoid", "ipo", "orpo", "simpo"] = Field(
        "sigmoid",
        description="Preference loss: sigmoid (DPO), ipo, orpo (no reference model), simpo (no reference model).",
    )
    beta: float = Field(0.1, gt=0, description="DPO/IPO beta (IPO's tau), ORPO's lambda, SimPO's beta.")
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO target reward margin (gamma / beta ratio).")


class KtoConfig(Section):
    beta: float = Field(0.1, gt=0, description="KTO beta.")
    desirable_weight: float = Field(1.0, gt=0, description="Loss weight of desirable (label true) rows.")
    undesirable_weight: float = Field(1.0, gt=0, description="Loss weight of undesirable (label false) rows.")


class DistillConfig(Section):
    """On-policy distillation (train.stage distill, TRL's DistillationTrainer): the student answers each
    prompt itself, and its loss is a divergence from the teacher's next-token distribution at every
    token of that answer. Always on-policy (GKD's lmbda = 1): the student only learns on its own samples."""

    teacher: Path | None = Field(
        None,
        description="The teacher: a local HF causal-LM directory (config.json + safetensors weights), for "
        "example a larger model's final/. Its tokenizer must have the student's vocabulary (checked before "
        "training). Loaded in model.dtype, with model.trust_remote_code.",
    )
    beta: float = Field(
        1.0,
        ge=0,
        le=1,
        description="The divergence, a generalized Jensen-Shannon interpolation: 0 = forward KL(teacher || "
        "student) (mean-seeking), 0.5 = JSD, 1 = reverse KL(student || teacher) (mode-seeking, TRL's default).",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="Sampling temperature of the student's answers, also applied to both distributions in the "
        "loss (1: the models' own distributions).",
    )
    max_new_tokens: int = Field(
        128,
        ge=1,
        description="Tokens the student generates per prompt at most (TRL's max_completion_length).",
    )


RewardKind = Literal["exact", "contains", "regex", "format", "length", "math", "model", "python"]


class RewardConfig(Section):
    """One reward of an online-RL stage (train.stage grpo / rloo); several are summed with weights."""

    kind: RewardKind = Field(
        description="exact / contains: the completion equals / contains the row's reference answer; regex: "
        "`pattern` extracts the answer (its first group, else the match) from the completion and the "
        "reference (a reference it does not match counts whole), and the two must be equal; "
        "format: the completion must match `pattern` (1 or 0); length: 0 up to `max_tokens` completion "
        "tokens, then falling linearly to -1 at twice that; math: the answer is mathematically equal to the "
        "reference (math-verify); model: the score of a reward model (`path`, the output of train.stage rm "
        "or any HF sequence-classification model); python: your own function `function: module:function` "
        "(runs your code: needs `run_user_code: true`)."
    )
    weight: float = Field(1.0, description="Weight of this reward in the total.")
    name: str | None = Field(
        None, description="Name in metrics (rewards/<name>/mean); defaults to the kind, or the function name."
    )
    pattern: str | None = Field(None, description="Regular expression for kind regex and format.")
    ignore_case: bool = Field(True, description="exact / contains / regex: compare without case.")
    max_tokens: int | None = Field(None, ge=1, description="kind length: completion tokens free of penalty.")
    path: str | None = Field(None, description="kind model: directory of the reward model.")
    function: str | None = Field(
        None,
        description="kind python: `module:function` (a module on PYTHONPATH or a file path `dir/file.py:function`); "
        "called as TRL calls reward functions: f(prompts, completions, completion_ids, answer, ...) -> floats.",
    )
    run_user_code: bool = Field(
        False, description="kind python: the explicit opt-in to import and run the named user code."
    )

    @model_validator(mode="after")
    def _settings_of_the_kind(self) -> RewardConfig:
        import re

        needs = {
            "regex": "pattern",
            "format": "pattern",
            "length": "max_tokens",
            "model": "path",
            "python": "function",
        }
        key = needs.get(self.kind)
        if key is not None and getattr(self, key) is None:
            raise ValueError(f"a reward of kind {self.kind} needs `{key}`")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as err:
                raise ValueError(
                    f"pattern {self.pattern!r} is not a valid regular expression: {err}"
                ) from None
        if self.kind == "python":
            if ":" not in (self.function or ""):
                raise ValueError(
                    f"function {self.function!r} must be `module:function` or `path/file.py:function`"
                )
            if not self.run_user_code:
                raise ValueError(
                    f"a python reward runs your code ({self.function}); set `run_user_code: true` on it to allow that"
                )
        return self

    @property
    def label(self) -> str:
        """The reward's name in metrics."""
        if self.name is not None:
            return self.name
        if self.kind == "python" and self.function is not None:
            return self.function.rsplit(":", 1)[1]
        return self.kind


BUILTIN_TOOLS = ("calculator",)  # train/tools.py defines them (config/ imports no stage)


class RlToolsConfig(Section):
    """Multi-turn tool-use rollouts of train.stage grpo: TRL's GRPOTrainer runs the episode (the model
    calls a tool, the result is appended, the model goes on) and masks the tool results out of the loss."""

    functions: list[str] = Field(
        default_factory=list,
        description="The tools the model may call: a built-in (calculator: + - * / // % ** and parentheses "
        "over numbers), or your function `module:function` / `path/file.py:function` (runs your code: needs "
        "`run_user_code: true`). A function's name, type hints and docstring (Google style, with Args:) are "
        "the tool's schema in the prompt.",
    )
    environment: str | None = Field(
        None,
        description="`module:Class` / `path/file.py:Class`: a fresh instance per episode (TRL's "
        "environment_factory); `reset(**row)` starts an episode, its public methods are the tools, and "
        "`get_reward()` (if defined) adds the episode's reward. Needs `run_user_code: true`.",
    )
    run_user_code: bool = Field(
        False, description="The explicit opt-in to import and run your tool functions or environment."
    )
    max_turns: int = Field(
        4,
        ge=1,
        description="Tool-calling turns per episode at most (TRL's max_tool_calling_iterations). The episode's "
        "token budget is train.rl.max_completion_length: the model's tokens and the tool results together.",
    )

    @model_validator(mode="after")
    def _what_runs(self) -> RlToolsConfig:
        if not self.functions and self.environment is None:
            raise ValueError(
                "tools need `functions` (for example [calculator]) or an `environment` (`module:Class`)"
            )
        user_code = [f for f in self.functions if f not in BUILTIN_TOOLS]
        for spec in user_code:
            if ":" not in spec:
                raise ValueError(
                    f"function {spec!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor "
                    "`module:function` / `path/file.py:function`"
                )
        if self.environment is not None and ":" not in self.environment:
            raise ValueError(
                f"environment {self.environment!r} must be `module:Class` or `path/file.py:Class`"
            )
        if self.environment is not None:
            user_code.append(self.environment)
        if user_code and not self.run_user_code:
            raise ValueError(
                f"tools {', '.join(user_code)} run your code; set `run_user_code: true` under train.rl.tools "
                "to allow that"
            )
        if len(set(self.functions)) != len(self.functions):
            raise ValueError("a tool is listed twice in `functions`")
        return self


class RlVllmConfig(Section):
    """vLLM generation of online RL (train.rl.generation: vllm; CUDA only)."""

    mode: Literal["colocate", "server"] = Field(
        "colocate",
        description="colocate: vLLM runs inside each training process and shares its GPU; server: `lmforge "
        "launch` starts TRL's vLLM server (trl vllm-serve) on `server_gpus` GPUs of its own, after the "
        "training processes' (with --nproc-per-node 2 and server_gpus 1: training on GPUs 0-1, the server on "
        "GPU 2), on 127.0.0.1; the weights are sent to it after each update.",
    )
    server_gpus: int = Field(
        1, ge=1, description="Server mode: GPUs of the vLLM server (its tensor parallel size)."
    )
    server_port: int = Field(8000, ge=1, le=65535, description="Server mode: the server's port on 127.0.0.1.")
    gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        le=1,
        description="Share of GPU memory vLLM takes (colocated: of the training GPU; server: of its own).",
    )
    importance_sampling: Literal[
        "off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = Field(
        "sequence_mask",
        description="TRL's correction of the train / rollout mismatch (vLLM's log-probs are not the "
        "trainer's): the ratio of the two per token or per sequence, truncated to [importance_sampling_min, "
        "importance_sampling_max] or masked outside it; off: none.",
    )
    importance_sampling_max: float | None = Field(3.0, gt=0, description="Upper bound of the ratio (C_max).")
    importance_sampling_min: float | None = Field(None, ge=0, description="Lower bound of the ratio (C_min).")


class RlConfig(Section):
    """Settings of the online-RL stages: grpo (TRL GRPOTrainer) and rloo (TRL RLOOTrainer)."""

    loss: Literal["grpo", "dr_grpo", "dapo", "bnpo", "gspo"] = Field(
        "dapo",
        description="grpo (per-sequence length normalisation), dr_grpo (a constant: no length bias), dapo "
        "(tokens of the whole batch; TRL's default), bnpo (tokens of the local batch), gspo (sequence-level "
        "importance ratio, GSPO). Stage grpo only.",
    )
    group_size: int = Field(4, ge=2, description="Completions generated per prompt (TRL's num_generations).")
    max_completion_length: int = Field(64, ge=1, description="Tokens generated per completion at most.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the completions.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of the completions.")
    top_k: int = Field(0, ge=0, description="Top-k sampling of the completions (0: off).")
    min_p: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Min-p sampling: a token needs this share of the most likely token's probability.",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0,
        description="Penalty on tokens already in the prompt or completion (above 1: fewer repeats).",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Policy updates on each batch of completions (TRL's num_iterations, the GRPO paper's mu); "
        "above 1 the later updates are off-policy and the clipped ratio (epsilon) bounds them.",
    )
    steps_per_generation: int | None = Field(
        None,
        ge=1,
        description="Optimizer steps per generated batch (TRL's steps_per_generation; default train.grad_accum): "
        "one generation serves that many steps, the later ones off-policy.",
    )
    beta: float = Field(
        0.0,
        ge=0,
        description="KL coefficient against the reference (the starting model; with LoRA the base with the "
        "adapter off). 0 loads no reference model.",
    )
    epsilon: float = Field(0.2, gt=0, description="Lower clipping epsilon of the importance ratio.")
    epsilon_high: float | None = Field(
        None, gt=0, description="Upper clipping epsilon (DAPO's clip-higher); defaults to epsilon."
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantage scaling by the reward std of the group, of the batch, or none (Dr. GRPO).",
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions cut at max_completion_length out of the loss (DAPO)."
    )
    generation: Literal["auto", "transformers", "vllm"] = Field(
        "auto",
        description="Who generates: transformers generate (everywhere), or vLLM colocated on the GPU (needs "
        "the vllm extra and CUDA); auto picks vLLM when both are there.",
    )
    tools: RlToolsConfig | None = Field(
        None,
        description="Multi-turn tool use (stage grpo): the tools the model may call during an episode. The chat "
        "template must have a tool-call format (data.chat_template qwen2, qwen3, qwen3_nothink or llama3).",
    )
    vllm: RlVllmConfig = Field(
        default_factory=RlVllmConfig,
        description="vLLM generation (train.rl.generation: vllm): colocated or a server of its own, and the "
        "importance-sampling correction.",
    )
    log_completions: int = Field(
        4, ge=0, description="Sample completions with their rewards kept per logged step (0: none)."
    )
    check_at_start: bool = Field(
        True,
        description="Before the first update of a fresh single-process run: `lmforge rl check`'s checks on 4 "
        "prompts with the model as it starts, each failure or doubt a warning in the log (the run goes on).",
    )
    on_reward_error: Literal["stop", "zero", "skip_group"] = Field(
        "stop",
        description="A reward that raises or gives no finite number for a completion: stop the run before the "
        "update (naming the reward, the prompt and the completion); zero: that reward gives the completion 0; "
        "skip_group: the completion's whole group is left out of the update (TRL's unscorable rows: no "
        "advantage, not in the baseline). With zero / skip_group each reward logs rewards/<name>/failed, the "
        "share of its completions that failed.",
    )
    max_reward_error_fraction: float = Field(
        0.1,
        ge=0,
        le=1,
        description="With on_reward_error zero / skip_group: stop once more than this share of a reward's "
        "completions so far have failed (judged from 32 completions on).",
    )


class RlGuardConfig(Section):
    """Guardrails of online RL, judged at every logged step from TRL's RL metrics."""

    action: Literal["alert", "stop", "rollback"] = Field(
        "alert",
        description="On a signal: alert (an event and the configured alerts), stop (with a checkpoint), or "
        "rollback (to the last checkpoint).",
    )
    kl_bound: float | None = Field(
        1.0,
        gt=0,
        description="Reward hacking: the mean reward rose over the last `window` logged steps while KL to the "
        "reference grew past this bound (null: off).",
    )
    entropy_floor: float | None = Field(
        0.05,
        ge=0,
        description="Entropy collapse: the policy's mean token entropy fell below this (null: off).",
    )
    zero_variance_steps: int | None = Field(
        20,
        ge=1,
        description="Every group had zero reward variance (no learning signal) for this many logged steps in a "
        "row (null: off).",
    )
    window: int = Field(5, ge=2, description="Logged steps over which the reward trend is judged.")


def lower_is_better(metric: str) -> bool:
    """An eval metric's direction: losses and perplexities fall as a model improves, the rest rise."""
    return "loss" in metric or "ppl" in metric


class EarlyStoppingConfig(Section):
    metric: str = Field(
        "eval_loss",
        description="Eval metric to watch (lower is better for names containing loss or ppl, higher otherwise).",
    )
    patience: int = Field(
        3, ge=1, description="Stop after this many evaluations in a row without an improvement."
    )
    min_delta: float = Field(
        0.0, ge=0, description="An evaluation improves only when it beats the best so far by more than this."
    )


ADAPTER_METHODS = ("lora", "dora", "qlora")
# Tokens per chunk of train.chunked_cross_entropy: at a 150k vocabulary one chunk's float32 logits
# take 1024 x 150k x 4 B = 0.6 GB, where a micro-batch of 8 x 1024 tokens would take 4.9 GB at
# once; chunks this long keep the head's matmul large enough to run at full speed.
CHUNKED_LOSS_TOKENS = 1024
OPTIMIZERS_ON_GPU_ONLY = ("paged_adamw_8bit", "paged_adamw_32bit")


class GaloreConfig(Section):
    rank: int = Field(128, ge=1, description="Rank of the gradient projection.")
    update_interval: int = Field(
        200, ge=1, description="Steps between recomputed projections (update_proj_gap)."
    )
    scale: float = Field(0.25, gt=0, description="Scale of the projected update (GaLore's alpha).")
    targets: list[str] = Field(
        default_factory=lambda: [r".*\.(self_attn|attn|attention|mlp)\..*"],
        min_length=1,
        description="Linear layers whose weights GaLore projects: module names containing one of these, or "
        "regexes matching the whole name (transformers' optim_target_modules; default: the attention and "
        "MLP projections); every other parameter is stepped by plain AdamW.",
    )


class MuonConfig(Section):
    momentum: float = Field(0.95, gt=0, lt=1, description="Muon momentum.")
    ns_steps: int = Field(5, ge=1, description="Newton-Schulz iterations that orthogonalise each update.")
    adamw_lr: float = Field(
        3e-4,
        gt=0,
        description="Peak rate of the parameters Muon leaves to AdamW (embeddings, the head, norms, biases); "
        "train.lr is Muon's own (0.02 is common).",
    )


class OptimizerConfig(Section):
    name: Literal[
        "adamw", "adafactor", "lion", "galore", "muon", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"
    ] = Field(
        "adamw",
        description="adamw (torch's fused AdamW); adafactor (factored second moments: less optimizer memory); "
        "lion (sign updates, one moment; use a 3-10x lower lr); galore (GaLore AdamW: low-rank projected "
        "gradients, settings in galore); muon (orthogonalised momentum for the 2-D hidden weights, AdamW "
        "for the rest, settings in muon); adamw_8bit (bitsandbytes 8-bit states); paged_adamw_8bit / "
        "paged_adamw_32bit (bitsandbytes paged states; CUDA GPU only).",
    )
    lora_plus_ratio: float | None = Field(
        None,
        gt=0,
        description="LoRA+ (lora / dora / qlora runs): the adapters' B matrices learn this many times faster "
        "than train.lr (16 is the paper's choice).",
    )
    galore: GaloreConfig = Field(default_factory=GaloreConfig, description="Settings for name=galore.")
    muon: MuonConfig = Field(default_factory=MuonConfig, description="Settings for name=muon.")

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _settings_of_the_chosen_one(self) -> OptimizerConfig:
        # Compared with the defaults, not with the keys given: a recorded config.yaml holds every
        # section's defaults and must read back as it was written.
        for other, defaults in (("galore", GaloreConfig()), ("muon", MuonConfig())):
            if getattr(self, other) != defaults and self.name != other:
                raise ValueError(
                    f"train.optimizer.{other} holds settings of the {other} optimizer, but train.optimizer.name "
                    f"is {self.name}; set name: {other} or remove the {other} section"
                )
        return self


class Fp8Config(Section):
    recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise",
        description="torchao's float8 recipe: tensorwise (one scale per tensor, fastest; FSDP2 can all-gather "
        "the weights in float8) or rowwise (one scale per row, closer to bf16's loss).",
    )
    exclude: list[str] = Field(
        default_factory=lambda: ["lm_head"],
        description="Linear layers kept in bf16, by name (a layer whose qualified name contains one of these, "
        "e.g. lm_head, mlp.gate for an MoE router). Layers whose sizes are not multiples of 16 stay bf16 too.",
    )
    fsdp_float8_all_gather: bool = Field(
        True,
        description="Under distributed.strategy fsdp with the tensorwise recipe: all-gather the sharded "
        "weights in float8 (half the traffic of bf16).",
    )


class TrainConfig(Section):
    stage: Literal["pretrain", "sft", "dpo", "kto", "rm", "grpo", "rloo", "distill"] = Field(
        "pretrain",
        description="Training stage: pretrain (raw text), sft (conversations), dpo (preference pairs; "
        "loss in train.dpo), kto (labelled conversations), rm (reward model on preference pairs), grpo / "
        "rloo (online RL: prompts, completions scored by train.rewards; settings in train.rl), distill "
        "(on-policy distillation: conversations' prompts, the student's answers scored token by token by "
        "train.distill.teacher).",
    )
    method: Literal["full", "freeze", "lora", "dora", "qlora"] = Field(
        "full",
        description="Which weights train: full; freeze (top layers only, train.freeze); lora / dora "
        "(PEFT adapters, train.lora); qlora (LoRA over a 4-bit base; needs a CUDA GPU and bitsandbytes).",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Adapter settings for lora/dora/qlora.")
    freeze: FreezeConfig = Field(default_factory=FreezeConfig, description="Settings for method=freeze.")
    vision: VisionTrainConfig = Field(
        default_factory=VisionTrainConfig,
        description="A vision-language model's vision tower and projector: train or freeze, for every method.",
    )
    dpo: DpoConfig = Field(default_factory=DpoConfig, description="Settings for stage=dpo.")
    kto: KtoConfig = Field(default_factory=KtoConfig, description="Settings for stage=kto.")
    distill: DistillConfig = Field(
        default_factory=DistillConfig, description="Settings for stage=distill (the teacher model)."
    )
    rl: RlConfig = Field(default_factory=RlConfig, description="Settings for stage=grpo and stage=rloo.")
    rewards: list[RewardConfig] = Field(
        default_factory=list,
        description="Rewards of stage grpo / rloo, summed with their weights. Empty with reference answers in "
        "the data: exact match against the reference (announced at start).",
    )
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps to run; overrides `epochs`.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training data when max_steps is not set.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per device per forward pass.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate.")
    optimizer: OptimizerConfig = Field(
        default_factory=OptimizerConfig,
        description="The optimizer: a name (`train.optimizer: lion`) or a section with its settings "
        "(`{name: galore, galore: {rank: 64}}`).",
    )
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine",
        description="Learning-rate decay after warmup: cosine, linear, constant (HF's constant_with_warmup: "
        "flat after the warmup), or wsd (warmup-stable-decay: "
        "the peak rate until the last train.decay_ratio of the steps, then a cosine decay; common for "
        "pretraining).",
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="cosine and wsd: decay to this fraction of train.lr instead of to 0 (0.1 is common).",
    )
    decay_ratio: float = Field(
        0.1, gt=0, le=1, description="wsd: the share of all steps spent decaying, at the end of the run."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    warmup_ratio: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="Linear warmup as a share of all steps (instead of train.warmup_steps; 0.03 is common).",
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (AdamW, Lion, GaLore, Muon).")
    adam_beta2: float = Field(
        0.999,
        gt=0,
        lt=1,
        description="AdamW beta2 (0.95 is common for pretraining); Lion's beta2 too (0.99 is common there).",
    )
    max_grad_norm: float = Field(1.0, ge=0, description="Clip gradients to this global norm (0 disables).")
    precision: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = Field(
        "auto",
        description="Mixed precision; auto picks bf16 where the device supports it (CPUs included), else fp32. "
        "fp8: bf16 with the linear layers' matmuls in float8 (torchao; train.fp8 says how; a CUDA GPU of "
        "compute capability 8.9 or newer: H100, L4, RTX 4090 and later).",
    )
    fp8: Fp8Config = Field(
        default_factory=Fp8Config,
        description="How train.precision fp8 trains (ignored at other precisions).",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute activations in backward to save memory (non-reentrant torch.utils.checkpoint "
        "unless train.checkpoint_reentrant).",
    )
    checkpoint_every: int = Field(
        1,
        ge=1,
        description="With gradient_checkpointing: recompute only every Nth decoder layer (selective "
        "checkpointing; 1: every layer). Fewer recomputed layers run faster and keep more activations.",
    )
    checkpoint_reentrant: bool = Field(
        False,
        description="Use the reentrant checkpoint implementation (older; needs inputs that require grad).",
    )
    activation_offload: bool = Field(
        False,
        description="Keep the activations saved for backward in CPU memory (torch.autograd.graph.save_on_cpu) "
        "instead of device memory; costs a copy each way per layer. For GPU runs.",
    )
    chunked_cross_entropy: bool = Field(
        False,
        description="Compute the next-token loss over chunks of tokens, each chunk's logits recomputed in "
        "backward, so the full (tokens x vocabulary) logits never exist at once (pretrain and sft; a "
        "150k-vocabulary model's logits dominate activation memory). With train.kernels liger, Liger's "
        "fused linear cross-entropy does this on the GPU.",
    )
    kernels: Literal["none", "liger"] = Field(
        "none",
        description="Fused kernels: liger (Liger's RMSNorm, RoPE, SwiGLU and fused linear cross-entropy; "
        "CUDA GPU and the liger-kernel package).",
    )
    compile: Literal[False, "model", "layers"] = Field(
        False,
        description="torch.compile (CPU and GPU; the first steps compile): model compiles the whole model "
        "(true means model); layers compiles each decoder layer, the repeated block, in place, and leaves the "
        "loss eager, so it works beside train.kernels liger and train.chunked_cross_entropy and compiles "
        "one layer's graph once for all of them.",
    )

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_true_is_model(cls, value: Any) -> Any:
        # `compile: true` predates the regional choice and keeps its meaning (the whole model).
        return "model" if value is True else value

    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile mode with train.compile."
    )
    empty_cache_steps: int | None = Field(
        None,
        ge=1,
        description="Release the device's cached memory every N steps (torch_empty_cache_steps: less "
        "fragmentation, about 10% slower).",
    )
    log_every: int = Field(1, ge=1, description="Log metrics every N optimizer steps.")
    eval_every: int | None = Field(
        None, ge=1, description="Evaluate every N steps (and at the end) when eval data exists."
    )
    save_every: int | None = Field(None, ge=1, description="Write a checkpoint every N steps.")
    keep_last: int = Field(3, ge=1, description="Keep only the newest N complete checkpoints.")
    best_metric: str | None = Field(
        None,
        description="Also keep the checkpoint with the best value of this eval metric (for example "
        "eval_loss; lower is better for names containing loss or ppl, higher otherwise); it is recorded "
        "in checkpoints/best.json and never rotated away.",
    )
    early_stopping: EarlyStoppingConfig | None = Field(
        None,
        description="Stop a run whose eval metric stopped improving (needs train.eval_every and eval data); "
        "with train.save_every the best checkpoint is kept (train.best_metric defaults to this metric). "
        "Example: {metric: eval_loss, patience: 3, min_delta: 0.01}.",
    )
    resume: str = Field(
        "auto",
        description="`auto`: continue from the newest complete checkpoint if any; `never`; or a checkpoint path.",
    )
    resume_changed: Literal["refuse", "allow"] = Field(
        "refuse",
        description="A resume whose settings changed the maths (model, tokenizer, data, max_length, batch, "
        "accumulation, optimizer, schedule, precision, seed) since the checkpoint was written: refuse, "
        "naming the changes; or allow, recorded as a config_changed event.",
    )
    dataloader_workers: int = Field(0, ge=0, description="DataLoader worker processes.")

    @property
    def kept_best_metric(self) -> str | None:
        """The metric whose best checkpoint is kept: train.best_metric, else early stopping's when
        checkpoints are written (an early-stopped run keeps its best state)."""
        if self.best_metric is not None:
            return self.best_metric
        if self.early_stopping is not None and self.save_every is not None:
            return self.early_stopping.metric
        return None


class DistributedConfig(Section):
    strategy: Literal["auto", "none", "ddp", "fsdp", "deepspeed"] = Field(
        "auto",
        description="How the workers of `lmforge launch` share the job. none: one process; ddp: torch DDP "
        "(every rank holds the whole model); fsdp: FSDP2 full sharding (torch.distributed.fsdp.fully_shard); "
        "deepspeed: DeepSpeed ZeRO (distributed.zero_stage, distributed.offload). auto: one process -> none; "
        "several -> the cheapest strategy that fits device memory, as `lmforge estimate` computes it.",
    )
    zero_stage: Literal[1, 2, 3] = Field(
        2,
        description="DeepSpeed ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters.",
    )
    offload: Literal["none", "optimizer", "optimizer+params"] = Field(
        "none",
        description="Move states to CPU memory: optimizer (ZeRO-2/3: optimizer states, stepped by DeepSpeed's "
        "CPU Adam) or optimizer+params (ZeRO-3 also parameters; FSDP: CPUOffloadPolicy).",
    )
    deepspeed_config: Path | None = Field(
        None,
        description="Your own DeepSpeed JSON (implies strategy deepspeed). Validated before training; its "
        '"auto" values are filled from train.* and the world size, and the resolved file is written to '
        "<run dir>/deepspeed_config.json.",
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        description="Tensor-parallel degree: each decoder layer's attention heads and MLP columns split over this "
        "many ranks (transformers' tp_plan on torch DTensor). Must divide the attention heads and KV heads. "
        "Composes with strategy fsdp as a 2-D mesh (data-shard x tensor); the data-shard degree is the world "
        "size divided by the product of the parallel degrees.",
    )
    sequence_parallel: bool = Field(
        True,
        description="With tensor_parallel > 1: also split norms and dropout along the sequence where the "
        "model's tp_plan has sequence-parallel entries.",
    )
    context_parallel: int = Field(
        1,
        ge=1,
        description="Context-parallel degree: each sequence split over this many ranks (torch's context_parallel: "
        "ring attention, each rank a head and a tail chunk); for sequences one device cannot hold. Composes "
        "with strategy fsdp (which shards the weights over the data x context ranks) and tensor_parallel; "
        "sdpa attention, pretrain and sft, no packing. Batches are padded to a multiple of 2 x the degree.",
    )
    pipeline_parallel: int = Field(
        1,
        ge=1,
        description="Pipeline stages: decoder layers split into this many consecutive stages "
        "(torch.distributed.pipelining over the model's pp_plan). Must divide the number of layers.",
    )
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b",
        description="Pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (one forward, one "
        "backward: less activation memory), interleaved_1f1b (two stages per rank, rank r holding stages r "
        "and r + pipeline_parallel: a smaller bubble; the layers must divide into 2 x pipeline_parallel stages).",
    )
    pipeline_microbatches: int | None = Field(
        None,
        ge=1,
        description="Pipeline micro-batches each train.micro_batch_size batch is cut into (more: a smaller "
        "bubble, (stages - 1) / (micro-batches + stages - 1)). Default: the number of stages. At most "
        "train.micro_batch_size; 1f1b needs at least one per stage.",
    )
    expert_parallel: int = Field(
        1,
        ge=1,
        description="Expert-parallel degree for Mixture-of-Experts models: the experts of each MoE layer split "
        "over this many ranks (transformers' distributed MoE). Must divide the number of experts.",
    )

    @property
    def model_parallel_degree(self) -> int:
        """Ranks one model replica spans: the product of the tensor, context, pipeline degrees."""
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel


AlertKind = Literal[
    "nonfinite",
    "spike",
    "rollback",
    "stall",
    "oom_backoff",
    "oom_ladder",
    "data_bound",
    "finished",
    "failed",
    "stopped",
    "reward_hacking",
    "entropy_collapse",
    "zero_reward_variance",
]
ALERT_KINDS: tuple[str, ...] = AlertKind.__args__  # type: ignore[attr-defined]


class AlertsConfig(Section):
    webhook_url: str | None = Field(
        None,
        description="Webhook that receives alerts (a secret: never logged or written). Prefer webhook_url_env.",
    )
    webhook_url_env: str | None = Field(
        None, description="Name of the environment variable that holds the webhook URL."
    )
    format: Literal["generic", "slack", "feishu", "dingtalk"] = Field(
        "generic", description="Payload shape: generic JSON, Slack, Feishu/Lark or DingTalk."
    )
    kinds: list[AlertKind] = Field(
        default_factory=lambda: cast(list[AlertKind], list(ALERT_KINDS)),
        description="Event kinds that are sent as alerts.",
    )
    window_seconds: float = Field(600.0, gt=0, description="At most one alert per kind per window.")
    timeout_seconds: float = Field(
        5.0, gt=0, description="HTTP timeout per alert; a failed send never stops training."
    )


class PrometheusConfig(Section):
    enabled: bool = Field(False, description="Serve /metrics for Prometheus while training.")
    host: str = Field("127.0.0.1", description="Bind address; anything but loopback is warned about.")
    port: int = Field(9400, ge=0, le=65535, description="Port (0: any free port).")


OomRung = Literal["gradient_checkpointing", "chunked_cross_entropy", "activation_offload", "offload"]
OOM_RUNGS: tuple[str, ...] = OomRung.__args__  # type: ignore[attr-defined]


class GuardConfig(Section):
    nonfinite: Literal["skip", "rollback", "stop"] = Field(
        "skip",
        description="On a NaN/inf loss or gradient: skip the update, roll back to the last checkpoint, or stop.",
    )
    spike: Literal["off", "skip", "rollback", "stop"] = Field(
        "skip", description="On a loss spike (z-score over a rolling window): the same actions, or off."
    )
    spike_sigma: float = Field(
        6.0, gt=0, description="A spike is a loss this many standard deviations above the window mean."
    )
    spike_window: int = Field(100, ge=5, description="Steps in the rolling loss window.")
    spike_warmup: int = Field(
        50,
        ge=0,
        description="Steps before spike detection starts (at most a fifth of train.max_steps, at least 5, "
        "so short runs are guarded too).",
    )
    max_bad_steps: int = Field(
        5,
        ge=1,
        description="Bad steps in a row before the run stops with a checkpoint of the last good state.",
    )
    rollback_lr_scale: float = Field(
        1.0, gt=0, le=1, description="Multiply the learning rate by this after a rollback."
    )
    oom_backoff: bool = Field(
        True,
        description="On out-of-memory: halve the micro-batch, double accumulation (same global batch), go on.",
    )
    oom_ladder: list[OomRung] = Field(
        default_factory=lambda: cast(list[OomRung], list(OOM_RUNGS)),
        description="When out of memory with nothing left to halve (micro-batch 1, or any distributed run): "
        "`lmforge launch` restarts from the last complete checkpoint with the next rung switched on, in this "
        "order, skipping rungs already on: gradient_checkpointing, chunked_cross_entropy, activation_offload, "
        "offload (distributed.offload: FSDP2 parameters and optimizer on CPU, DeepSpeed optimizer states on "
        "CPU). Each restart is an oom_ladder event; [] stops at the first such out-of-memory.",
    )
    stall_seconds: float | None = Field(
        900.0,
        gt=0,
        description="No step for this long: dump every thread's stack and alert; under `lmforge launch` the "
        "launch then ends (exit 1, naming the stalled rank, every rank's stacks saved). null: off. Why 900 s: "
        "above the longest pause between steps that is no stall (a first step that compiles, a sharded "
        "checkpoint of a large model), and below the process "
        "group's 1800 s timeout (HF ddp_timeout), which would end a hung collective first, without stacks.",
    )
    rl: RlGuardConfig = Field(
        default_factory=RlGuardConfig,
        description="Online-RL signals (stage grpo / rloo): reward hacking, entropy collapse, no reward variance.",
    )


class HistogramsConfig(Section):
    every: int = Field(
        100,
        ge=1,
        description="Write weight and gradient histograms every N optimizer steps (rank 0: an FSDP run shows "
        "rank 0's shard of each tensor; DeepSpeed ZeRO-3 none), and their mean/std/abs max to histograms.jsonl.",
    )
    max_elements: int = Field(
        65536,
        ge=1024,
        description="Elements sampled per tensor (a fixed random subset), which bounds the cost for big layers.",
    )
    weights: bool = Field(True, description="Histograms of the trainable weights, one per parameter tensor.")
    gradients: bool = Field(
        True, description="Histograms of their gradients (after clipping, before the update)."
    )


class ProfileConfig(Section):
    start_step: int = Field(
        5,
        ge=1,
        description="The first optimizer step recorded (skip the first steps: they include warm-up); the window "
        "must end by train.max_steps.",
    )
    steps: int = Field(3, ge=1, le=100, description="Optimizer steps recorded.")
    memory: bool = Field(True, description="Record tensor allocations (profile_memory).")
    record_shapes: bool = Field(False, description="Record input shapes of each op (bigger traces).")
    with_stack: bool = Field(False, description="Record Python stacks of each op (much bigger traces).")
    all_ranks: bool = Field(False, description="Profile every rank of a distributed run (default: rank 0).")


class EvalGenerationsConfig(Section):
    prompts: int = Field(
        4, ge=1, le=512, description="Eval rows whose prompt is completed greedily at each eval step."
    )
    max_new_tokens: int = Field(32, ge=1, description="Tokens generated per prompt at most.")
    metrics: bool = Field(
        True,
        description="Score the completions against the rows' references: BLEU and chrF (sacrebleu), "
        "ROUGE-1/2/L (rouge-score), exact match; logged as eval_bleu, eval_chrf, eval_rouge1, ...",
    )
    bertscore_model: str | None = Field(
        None,
        description="Also BERTScore F1 (eval_bertscore) with this local model directory; needs the "
        "`bertscore` extra.",
    )


class MonitorConfig(Section):
    enabled: bool = Field(
        True,
        description="false: metrics.jsonl and the loggers only; no guardrails, drills, extra metrics, alerts, "
        "Prometheus or system sampling (the baseline of bench/monitor_overhead.py).",
    )
    loggers: list[Literal["tensorboard", "wandb", "mlflow", "swanlab"]] = Field(
        default_factory=lambda: list[Literal["tensorboard", "wandb", "mlflow", "swanlab"]](["tensorboard"]),
        description="Metric sinks besides metrics.jsonl (always written); wandb/mlflow/swanlab need their extras.",
    )
    project: str | None = Field(
        None, description="W&B project / MLflow experiment / SwanLab project (default: lmforge)."
    )
    system_metrics_seconds: float | None = Field(
        10.0,
        gt=0,
        description="Sample CPU/GPU/memory/disk/network every N seconds in the background (null: off).",
    )
    alerts: AlertsConfig = Field(default_factory=AlertsConfig, description="Where alerts go besides events/.")
    prometheus: PrometheusConfig = Field(
        default_factory=PrometheusConfig, description="The /metrics endpoint."
    )
    guard: GuardConfig = Field(
        default_factory=GuardConfig, description="Guardrails that act on a run's health."
    )
    eval_generations: EvalGenerationsConfig | None = Field(
        default_factory=EvalGenerationsConfig,
        description="At each eval step, greedy completions of a few eval prompts: shown as text in "
        "TensorBoard (a table in W&B) and scored against their references (null: off).",
    )
    histograms: HistogramsConfig | None = Field(
        None,
        description="TensorBoard weight and gradient histograms, sampled (opt-in: {every: 100}).",
    )
    profile: ProfileConfig | None = Field(
        None,
        description="torch.profiler over a window of steps: a Chrome/Perfetto trace in <run>/profile/, the "
        "TensorBoard profiler format in tb/, and a top-ops table in the report (opt-in: {start_step: 5}).",
    )
    comm_metrics: bool = Field(
        True,
        description="In distributed runs, time in all-reduce / reduce-scatter / all-gather per step and their "
        "share of the step time (comm_*_s, comm_share), from the engine.",
    )


GgufDtype = Literal[
    "f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q5_k_s", "q5_0", "q5_1",
    "q4_k_m", "q4_k_s", "q4_0", "q4_1", "q3_k_l", "q3_k_m", "q3_k_s", "q2_k",
]  # fmt: skip


class ExportGates(Section):
    """What an export must keep of the trained model's behaviour, on the verify data. Unset: the
    precision's default (f32 / 16-bit / 8-bit / 5-6 bit / 4-bit: perplexity +0.01% / 1% / 3% / 5% /
    15%, top-1 agreement 99% / 95% / 90% / 85% / 75%, accuracy drop 1 / 2 / 3 / 5 / 8 points)."""

    max_ppl_increase: float | None = Field(
        None, ge=0, description="Largest relative perplexity increase (0.05: 5% above the trained model's)."
    )
    max_accuracy_drop: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Largest drop in greedy task accuracy (0.02: two points), on QA verify data only.",
    )
    min_top1_agreement: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Smallest share of positions where the export and the trained model predict the same "
        "next token.",
    )


class ExportConfig(Section):
    merge_lora: bool = Field(
        False,
        description="After a lora/dora run, also write the adapter merged into its base as a full HF model in final/.",
    )
    formats: list[Literal["safetensors", "gguf", "onnx", "compressed-tensors", "tensorrt-llm"]] = Field(
        default_factory=list,
        description="After training, convert final/ into export/<format>/ (an adapter run is merged first, "
        "streaming, into export/merged/). compressed-tensors: an FP8 / int8 / int4 checkpoint for vLLM; "
        "tensorrt-llm: the model in bf16 with TensorRT-LLM's serving config and scripts (a GPU hand-off).",
    )
    gguf_dtype: GgufDtype = Field(
        "f16",
        description="GGUF weight type: f32 / f16 / bf16 / q8_0 written by lmforge; the k-quants (q6_k, q5_k_m, "
        "q4_k_m, ...) and q4_0-q5_1 are the f16 file requantized by llama.cpp's quantizer (needs "
        "llama-cpp-python: pip install 'lmforge[gguf]').",
    )
    gguf_imatrix_data: str | None = Field(
        None,
        description="A GGUF k-quant with an importance matrix: `eval` (the verify data) or a texts / QA-rows "
        "file to calibrate on; llama.cpp's llama-imatrix computes it and llama-quantize applies it (both "
        "tools on PATH). Calibrating on the verify data makes its gates in-sample; a separate file avoids that.",
    )
    onnx_dtype: Literal["f32", "f16", "int8"] = Field(
        "f32",
        description="ONNX weight type; int8: onnxruntime's dynamic quantization of the MatMul weights (per "
        "output channel), for onnxruntime on CPU.",
    )
    compressed_dtype: Literal["fp8", "w8a16", "w4a16"] = Field(
        "fp8",
        description="compressed-tensors scheme (pip install 'lmforge[quantize]'): fp8 = FP8 weights, one scale "
        "per channel, activations FP8 per token at run time; w8a16 / w4a16 = int8 / int4 weights in groups "
        "of 128 inputs. Scales from each channel's or group's range (no calibration data).",
    )
    safetensors_dtype: Literal["f32", "f16", "bf16"] | None = Field(
        None, description="safetensors export dtype (default: as trained)."
    )
    verify: bool = Field(
        True,
        description="Run each export in its own runtime against the trained model (the adapter on its base "
        "for adapter runs) and fail the run when logits, perplexity or greedy generations disagree.",
    )
    verify_data: str | None = Field(
        None,
        description="Texts or QA rows (jsonl/.txt) to verify on (default: the run's first eval file, else "
        "built-in texts). QA rows add the task-accuracy gate.",
    )
    gates: ExportGates = Field(
        default_factory=lambda: ExportGates(),
        description="Limits an export must meet against the trained model, or it is removed and the run "
        "fails (exit 1); each unset limit takes the default of the export's precision.",
    )


class FaultConfig(Section):
    kind: Literal["nan", "spike", "slow_data", "oom", "hang", "crash", "disk_full"] = Field(
        description="nan: the loss becomes NaN; spike: the loss is multiplied by `factor`; slow_data: the data "
        "loader sleeps `seconds`; oom: an out-of-memory error is raised (the micro-batch back-off halves the "
        "micro-batch; at micro-batch 1 or in a distributed run monitor.guard.oom_ladder takes over; the fault "
        "fires only while the run has taken no rung of the ladder, as if the rung had freed the memory); hang: the step sleeps `seconds`; "
        "crash: the step raises an error (with `rank`, one worker of a distributed run dies); disk_full: "
        "the checkpoint of that step fails with 'No space left on device' after its files were written."
    )
    step: int = Field(ge=1, description="The optimizer step (1-based) the fault hits.")
    factor: float = Field(50.0, description="spike: loss multiplier.")
    seconds: float = Field(5.0, ge=0, description="slow_data / hang: how long to sleep.")
    rank: int | None = Field(None, ge=0, description="Only on this rank (default: every rank).")


class DebugConfig(Section):
    crash_at_step: int | None = Field(
        None,
        ge=1,
        description="Drill: SIGKILL this process right after step N (after its checkpoint, if one is due).",
    )
    faults: list[FaultConfig] = Field(
        default_factory=list, description="Drills for the guardrails: faults injected at given steps."
    )


class LmforgeConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and output location.")
    model: ModelConfig = Field(description="Which model to train.")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Which tokenizer to use.")
    data: DataConfig = Field(description="Training and evaluation data.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The optimisation loop.")
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, description="Distributed strategy for `lmforge launch`."
    )
    monitor: MonitorConfig = Field(default_factory=MonitorConfig, description="Metric sinks.")
    export: ExportConfig = Field(default_factory=ExportConfig, description="What final/ holds.")
    debug: DebugConfig = Field(default_factory=DebugConfig, description="Fault-injection drills.")

    @model_validator(mode="after")
    def _tokenizer_source(self, info: ValidationInfo) -> LmforgeConfig:
        # `lmforge estimate` sizes an architecture alone: it passes tokenizer_optional and uses the
        # architecture's own vocab_size.
        optional = bool(info.context and info.context.get("tokenizer_optional"))
        if not (optional or self.tokenizer.path or self.tokenizer.train or self.model.path):
            raise ValueError(
                "no tokenizer: set tokenizer.path, tokenizer.train (to train one), or load a model.path that has one"
            )
        return self
