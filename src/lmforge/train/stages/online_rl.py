"""The online RL stages, grpo and rloo, bound to TRL's GRPOTrainer and RLOOTrainer.

lmforge supplies the values of their config classes: the generation and loss settings of
`train.rl` and the rewards' weights (train/rl_stage.py builds the rewards and the reference copy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import RlConfig, TrainConfig
from lmforge.config.stages import stage_spec
from lmforge.train.rewards import RewardSet
from lmforge.train.stages.binding import TrlStage, trl_stage
from lmforge.train.tools import tool_arguments, tool_names


def rl_config_values(train: TrainConfig, rewards: RewardSet, *, use_vllm: bool) -> dict[str, Any]:
    """GRPOConfig / RLOOConfig values from `train.rl` and the rewards' weights."""
    rl = train.rl
    values: dict[str, Any] = {
        "num_generations": rl.group_size,
        "max_completion_length": rl.max_completion_length,
        "temperature": rl.temperature,
        "top_p": rl.top_p,
        "top_k": rl.top_k,
        "min_p": rl.min_p,
        "repetition_penalty": rl.repetition_penalty,
        "num_iterations": rl.num_iterations,
        "steps_per_generation": rl.steps_per_generation,
        "beta": rl.beta,
        "epsilon": rl.epsilon,
        "epsilon_high": rl.epsilon_high if rl.epsilon_high is not None else rl.epsilon,
        "mask_truncated_completions": rl.mask_truncated_completions,
        "reward_weights": rewards.weights,
        # TRL's own completion printer writes rich tables to the console and parquet files;
        # lmforge sends the samples to its sinks instead (train/rl_samples.py).
        "log_completions": False,
        "remove_unused_columns": False,  # the reference answers reach the reward functions as a column
        # A micro-batch holds completions; evaluation needs whole groups of them.
        "per_device_eval_batch_size": train.micro_batch_size * train.grad_accum,
        "use_vllm": use_vllm,
        **_vllm_values(rl),
        # Only the reference model is loaded by TRL (from <run>/reference/, reference_model_path):
        # in the dtype it was saved in.
        "model_init_kwargs": {"dtype": "auto"},
    }
    if rl.tools is not None:
        values["max_tool_calling_iterations"] = rl.tools.max_turns
    values.update(_LOSS_VALUES[train.stage](rl))
    return values


def _vllm_values(rl: RlConfig) -> dict[str, Any]:
    """TRL's vLLM settings from train.rl.vllm (read only when vLLM generates). The server is always
    the one `lmforge launch` started on this node, on 127.0.0.1."""
    vllm = rl.vllm
    values: dict[str, Any] = {
        "vllm_mode": vllm.mode,
        "vllm_gpu_memory_utilization": vllm.gpu_memory_utilization,
    }
    if vllm.mode == "server":
        values["vllm_server_base_url"] = f"http://127.0.0.1:{vllm.server_port}"
    return values


def _importance_sampling_values(rl: RlConfig) -> dict[str, Any]:
    """GRPO's correction of the train / rollout mismatch under vLLM (RLOOTrainer has none)."""
    vllm = rl.vllm
    values: dict[str, Any] = {
        "vllm_importance_sampling_correction": vllm.importance_sampling != "off",
        "vllm_importance_sampling_clip_max": vllm.importance_sampling_max,
        "vllm_importance_sampling_clip_min": vllm.importance_sampling_min,
    }
    if vllm.importance_sampling != "off":
        values["vllm_importance_sampling_mode"] = vllm.importance_sampling
    return values


def _grpo_loss_values(rl: RlConfig) -> dict[str, Any]:
    """GRPO's loss variants: train.rl.loss, GSPO being GRPO's loss over sequence-level ratios."""
    return {
        "loss_type": "grpo" if rl.loss == "gspo" else rl.loss,
        "importance_sampling_level": "sequence" if rl.loss == "gspo" else "token",
        "scale_rewards": rl.scale_rewards,
        **_importance_sampling_values(rl),
    }


def _rloo_loss_values(rl: RlConfig) -> dict[str, Any]:
    """RLOO has its own estimator; only an explicit train.rl.scale_rewards reaches it."""
    if "scale_rewards" in rl.model_fields_set:
        return {"normalize_advantages": rl.scale_rewards != "none"}
    return {}


# Every stage whose spec is online_rl, by name: the config values of its own loss.
_LOSS_VALUES: dict[str, Callable[[RlConfig], dict[str, Any]]] = {
    "grpo": _grpo_loss_values,
    "rloo": _rloo_loss_values,
}


# What decides an online-RL update, read back from the trainer's own config once it is built (TRL
# resolves some of them: steps_per_generation defaults to the accumulation, generation_batch_size).
RESOLVED_SETTINGS = (
    "loss_type",
    "importance_sampling_level",
    "scale_rewards",
    "normalize_advantages",
    "epsilon",
    "epsilon_high",
    "beta",
    "num_generations",
    "num_iterations",
    "steps_per_generation",
    "generation_batch_size",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_completion_length",
    "mask_truncated_completions",
    "use_vllm",
    "vllm_mode",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_server_base_url",
    "max_tool_calling_iterations",
)


def resolved_rl_settings(args: Any, train: TrainConfig) -> dict[str, Any]:
    """The update's settings as the TRL trainer's config holds them (the ones it has), with the
    trainer class and lmforge's reward-error policy: written to the run directory at start."""
    settings = {name: getattr(args, name) for name in RESOLVED_SETTINGS if hasattr(args, name)}
    return {
        "trainer": stage_spec(train.stage).trainer,
        **settings,
        "on_reward_error": train.rl.on_reward_error,
        "max_reward_error_fraction": train.rl.max_reward_error_fraction,
        **({"tools": tool_names(train.rl.tools)} if train.rl.tools is not None else {}),
    }


def online_rl_stage(
    train: TrainConfig, rewards: RewardSet, tokenizer: PreTrainedTokenizerBase, *, use_vllm: bool
) -> TrlStage:
    """The TRL trainer of `train.stage` (grpo or rloo), given the reward functions (and the tools
    of a multi-turn run, which may give the tokenizer its tool-call parser)."""
    spec = stage_spec(train.stage)
    extra: dict[str, Any] = {"reward_funcs": rewards.functions}
    if train.rl.tools is not None:
        extra.update(tool_arguments(train.rl.tools, tokenizer))
    return trl_stage(
        spec.trainer,
        spec.arguments,
        rl_config_values(train, rewards, use_vllm=use_vllm),
        takes_reference=False,  # TRL loads the reference itself (train/rl_stage.py's reference_model_path)
        extra=extra,
    )
