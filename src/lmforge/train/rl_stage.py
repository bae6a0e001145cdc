"""Online RL stages: `train.stage: grpo` through TRL's GRPOTrainer, `rloo` through its RLOOTrainer.

lmforge supplies what TRL takes as arguments: the prompts (data/preference.py, with the
reference answer in an `answer` column), the reward functions built from `train.rewards`
(train/rewards.py), the generation and loss settings of `train.rl` (train/stages/online_rl.py),
and a reference model TRL can load when the KL term needs one. The RL loop itself (generate, score, group advantages,
clipped policy loss) is TRL's.
"""

from __future__ import annotations

import json
import logging
import shutil
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lmforge.config.schema import ADAPTER_METHODS, TrainConfig
from lmforge.distributed.ranks import current_world
from lmforge.run_layout import RunPaths
from lmforge.train.rewards import ErrorPolicy, RewardSet, build_reward_functions

log = logging.getLogger(__name__)


def build_rl_rewards(train: TrainConfig, dataset: Any, tokenizer: PreTrainedTokenizerBase) -> RewardSet:
    """The reward functions of `train.rewards`; the default exact match is announced in train.log
    and on the console."""
    has_reference = "answer" in getattr(dataset, "column_names", [])
    rewards = build_reward_functions(
        train.rewards,
        has_reference=has_reference,
        group_size=train.rl.group_size,
        tokenizer=tokenizer,
        policy=ErrorPolicy(train.rl.on_reward_error, train.rl.max_reward_error_fraction),
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


def record_rl_settings(settings: dict[str, Any], paths: RunPaths) -> None:
    """Write the update's resolved settings to rl_settings.json (main process) and say them in one
    line at start: what a reader of a curve needs to know about how it was trained."""
    if current_world().is_main:
        paths.rl_settings.write_text(json.dumps(settings, indent=1, default=str) + "\n", encoding="utf-8")
    loss = settings.get("loss_type", "rloo")
    level = settings.get("importance_sampling_level")
    scaling = settings.get("scale_rewards", "group" if settings.get("normalize_advantages") else "none")
    log.info(
        "online RL: %s, loss %s%s, epsilon %s-%s, beta %s, rewards scaled by %s; %s completions per prompt, "
        "%s update(s) per batch, %s step(s) per generation (all in %s)",
        settings["trainer"].rpartition(":")[2],
        loss,
        f" ({level}-level ratios)" if level else "",
        settings.get("epsilon"),
        settings.get("epsilon_high", settings.get("epsilon")),
        settings.get("beta"),
        scaling,
        settings.get("num_generations"),
        settings.get("num_iterations"),
        settings.get("steps_per_generation"),
        paths.rl_settings.name,
    )
