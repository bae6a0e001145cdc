"""What this machine must have for a run, checked before any data, tokenizer or model work: a
run that cannot work here stops in a second with the fix, not after minutes of preparation."""

from __future__ import annotations

from lmforge.config import LmforgeConfig
from lmforge.models.methods import check_attention_runs_here, check_method_runs_here
from lmforge.monitor.sinks import require_sink_packages
from lmforge.train.eval_generations import require_eval_generation_packages
from lmforge.train.rl_stage import RL_STAGES, uses_vllm
from lmforge.upstream import check_upstream_versions


def check_runs_here(cfg: LmforgeConfig) -> None:
    """UserInputError for the first requirement this machine misses; a warning when a library
    lmforge patches is outside its tested versions."""
    check_method_runs_here(cfg.train)  # qlora without CUDA + bitsandbytes
    check_attention_runs_here(cfg.model)  # flash_attention_2 without CUDA + flash-attn
    require_sink_packages(cfg.monitor)  # a selected logger whose extra is not installed
    require_eval_generation_packages(cfg.monitor)  # BERTScore without the bertscore extra
    if cfg.train.stage in RL_STAGES:
        uses_vllm(cfg.train.rl)  # generation: vllm without CUDA + the vllm package
    check_upstream_versions()
