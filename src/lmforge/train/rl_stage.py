"""Online RL stages: `train.stage: grpo` through TRL's GRPOTrainer, `rloo` through its RLOOTrainer.

lmforge supplies what TRL takes as arguments: the prompts (data/preference.py, with the
reference answer in an `answer` column), the reward functions built from `train.rewards`
(train/rewards.py), the generation and loss settings of `train.rl`, and a reference model TRL
can load when the KL term needs one. The RL loop itself (generate, score, group advantages,
clipped policy loss) is TRL's.
"""

from __future__ import annotations

import logging
import shutil
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lmforge.config.schema import ADAPTER_METHODS, TrainConfig
from lmforge.run_layout import RunPaths
from lmforge.train.rewards import RewardSet, build_reward_functions

log = logging.getLogger(__name__)


def rl_config_values(train: TrainConfig, rewards: RewardSet, *, use_vllm: bool) -> dict[str, Any]:
    """GRPOConfig / RLOOConfig values from `train.rl` and the rewards' weights."""
    rl = train.rl
    values: dict[str, Any] = {
        "num_generations": rl.group_size,
        "max_completion_length": rl.max_completion_length,
        "temperature": rl.temperature,
        "top_p": rl.top_p,
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
        "vllm_mode": "colocate",
        # Only the reference model is loaded by TRL (from <run>/reference/, reference_model_path):
        # in the dtype it was saved in.
        "model_init_kwargs": {"dtype": "auto"},
    }
    if train.stage == "grpo":
        values["loss_type"] = "grpo" if rl.loss == "gspo" else rl.loss
        values["importance_sampling_level"] = "sequence" if rl.loss == "gspo" else "token"
        values["scale_rewards"] = rl.scale_rewards
    elif "scale_rewards" in rl.model_fields_set:
        values["normalize_advantages"] = rl.scale_rewards != "none"
    return values


def build_rl_rewards(train: TrainConfig, dataset: Any, tokenizer: PreTrainedTokenizerBase) -> RewardSet:
    """The reward functions of `train.rewards`; the default exact match is announced in train.log
    and on the console."""
    has_reference = "answer" in getattr(dataset, "column_names", [])
    rewards = build_reward_functions(
        train.rewards, has_reference=has_reference, group_size=train.rl.group_size, tokenizer=tokenizer
    )
    if rewards.announcement:
        log.warning(rewards.announcement)
    return rewards


def reference_model_path(
    model: PreTrainedModel, train: TrainConfig, paths: RunPaths, *, is_main: bool
) -> None:
    """Point the model's `_name_or_path` at a copy of its starting weights when the KL term needs
    a reference model: TRL loads the reference from that path. An adapter run needs none (TRL
    switches the adapter off); beta 0 needs none. The copy is written once, so a resumed run
    compares with the weights the run started from, not with a checkpoint."""
    if train.rl.beta == 0 or train.method in ADAPTER_METHODS:
        return
    target = paths.reference
    if is_main and not (target / "config.json").is_file():
        staging = paths.root / ".reference.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging, safe_serialization=True)
        staging.rename(target)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank loads the copy rank 0 wrote
    model.config._name_or_path = str(target)
