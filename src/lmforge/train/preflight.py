"""What this machine must have for a run, checked before any data, tokenizer or model work: a
run that cannot work here stops in a second with the fix, not after minutes of preparation."""

from __future__ import annotations

import importlib.util

import torch

from lmforge.config import LmforgeConfig
from lmforge.config.schema import OPTIMIZERS_ON_GPU_ONLY, TrainConfig
from lmforge.errors import UserInputError
from lmforge.models.methods import check_attention_runs_here, check_method_runs_here
from lmforge.monitor.sinks import require_sink_packages
from lmforge.train.eval_generations import require_eval_generation_packages
from lmforge.train.rl_stage import RL_STAGES, uses_vllm
from lmforge.upstream import check_upstream_versions


def check_runs_here(cfg: LmforgeConfig) -> None:
    """UserInputError for the first requirement this machine misses; a warning when a library
    lmforge patches is outside its tested versions."""
    check_method_runs_here(cfg.train)  # qlora without CUDA + bitsandbytes
    check_recipe_runs_here(cfg.train)  # paged optimizers or Liger without CUDA
    check_attention_runs_here(cfg.model)  # flash_attention_2 without CUDA + flash-attn
    require_sink_packages(cfg.monitor)  # a selected logger whose extra is not installed
    require_eval_generation_packages(cfg.monitor)  # BERTScore without the bertscore extra
    if cfg.train.stage in RL_STAGES:
        uses_vllm(cfg.train.rl)  # generation: vllm without CUDA + the vllm package
    check_upstream_versions()


def check_recipe_runs_here(train: TrainConfig) -> None:
    cuda = torch.cuda.is_available()
    name = train.optimizer.name
    if name in OPTIMIZERS_ON_GPU_ONLY and not cuda:
        raise UserInputError(
            f"train.optimizer {name} pages its states between GPU and host memory (CUDA unified memory), "
            "and this machine has no CUDA GPU; use adamw_8bit (8-bit states, runs on CPUs too) or adamw"
        )
    if train.kernels == "liger":
        if not cuda:
            raise UserInputError(
                "train.kernels liger runs Triton kernels on a CUDA GPU, and this machine has none; remove "
                "train.kernels (train.chunked_cross_entropy saves the logits' memory on any device)"
            )
        if importlib.util.find_spec("liger_kernel") is None:
            raise UserInputError(
                "train.kernels liger needs the liger-kernel package: pip install 'lmforge[liger]'"
            )
