"""What this machine must have for a run, checked before any data, tokenizer or model work: a
run that cannot work here stops in a second with the fix, not after minutes of preparation.

This module imports torch and lmforge's config alone (no transformers, peft or TRL), so `lmforge
train` runs these checks before it loads the training stack."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from lmforge.config import LmforgeConfig
from lmforge.config.rl_rules import reward_model_problems
from lmforge.config.schema import (
    OPTIMIZERS_ON_GPU_ONLY,
    DistillConfig,
    ModelConfig,
    MonitorConfig,
    RlConfig,
    TrainConfig,
)
from lmforge.config.stages import stage_spec
from lmforge.errors import UserInputError
from lmforge.evaluate.quality import require_bertscore
from lmforge.export.gguf_quantize import QUANT_TYPES, require_imatrix_tools, require_quantizer
from lmforge.export.vision_formats import check_vision_exports
from lmforge.monitor.sinks import require_sink_packages
from lmforge.train.precision import require_fp8_device
from lmforge.upstream import ALLOW_UNTESTED_ENV, check_upstream_versions, untested_versions


def check_runs_here(cfg: LmforgeConfig) -> None:
    """UserInputError for the first requirement this machine misses, or for a library lmforge
    patches that is outside its tested versions."""
    check_machine_requirements(cfg)
    require_tested_versions()


def require_tested_versions() -> None:
    """UserInputError (exit code 2) naming each library outside the versions lmforge's overrides and
    patches were tested on: an untested upgrade fails at start, not minutes into a run. With
    LMFORGE_ALLOW_UNTESTED_VERSIONS=1 each is a warning instead."""
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        check_upstream_versions()
        return
    problems = untested_versions()
    if problems:
        raise UserInputError(
            "\n".join(
                f"{line}: lmforge overrides or patches parts of it (see lmforge/upstream.py)"
                for line in problems
            )
            + f"\ninstall the tested versions (pip install -c constraints.txt -e .), or set {ALLOW_UNTESTED_ENV}=1 "
            "to run anyway with a warning"
        )


def check_machine_requirements(cfg: LmforgeConfig) -> None:
    """UserInputError for the first GPU, package or extra the run needs and this machine lacks."""
    check_precision_runs_here(cfg.train)  # fp8 without a float8 GPU or torchao
    check_method_runs_here(cfg.train)  # qlora without CUDA + bitsandbytes
    check_recipe_runs_here(cfg.train)  # paged optimizers or Liger without CUDA
    check_attention_runs_here(cfg.model)  # flash_attention_2 without CUDA + flash-attn
    require_sink_packages(cfg.monitor)  # a selected logger whose extra is not installed
    require_eval_generation_packages(cfg.monitor)  # BERTScore without the bertscore extra
    if stage_spec(cfg.train.stage).online_rl:
        require_vllm_server(cfg.train.rl)  # server mode outside `lmforge launch`, which starts the server
        uses_vllm(cfg.train.rl)  # generation: vllm without CUDA + the vllm package
        missing = reward_model_problems(cfg)  # a kind: model reward whose directory is not there
        if missing:
            raise UserInputError("\n".join(f"{key}: {message}" for key, message in missing))
    if stage_spec(cfg.train.stage).teacher:
        teacher_directory(cfg.train.distill)  # a teacher directory that is not there
    check_vision_exports(
        cfg.model.path, cfg.model.preset, list(cfg.export.formats)
    )  # a format without the vision tower
    if "gguf" in cfg.export.formats:
        check_gguf_export_runs_here(cfg)
    if "compressed-tensors" in cfg.export.formats:
        check_compressed_export_runs_here(cfg)


def check_gguf_export_runs_here(cfg: LmforgeConfig) -> None:
    """A GGUF export this machine could not finish: a k-quant without llama.cpp to make it, or an
    MoE GGUF to verify without llama.cpp to run it."""
    if cfg.export.gguf_imatrix_data is not None:
        try:
            require_imatrix_tools(cfg.export.gguf_dtype)
        except UserInputError as err:
            raise UserInputError(f"export.gguf_imatrix_data: {err}") from None
        data = cfg.export.gguf_imatrix_data
        if data != "eval" and not Path(data).expanduser().is_file():
            raise UserInputError(
                f"export.gguf_imatrix_data: {data!r} is not a file; give texts or QA rows, or eval"
            )
    elif cfg.export.gguf_dtype in QUANT_TYPES:
        try:
            require_quantizer(cfg.export.gguf_dtype)
        except UserInputError as err:
            raise UserInputError(f"export.gguf_dtype: {err}") from None
    if cfg.export.verify and importlib.util.find_spec("llama_cpp") is None:
        from lmforge.models.build import architecture_config
        from lmforge.models.moe import is_moe

        if is_moe(architecture_config(cfg.model)):
            raise UserInputError(
                "export.formats: gguf of a Mixture-of-Experts model is verified in llama.cpp (transformers' GGUF "
                "reader does not load stacked experts), and llama-cpp-python is not installed. Fix: pip install "
                "'lmforge[gguf]', or set export.verify: false"
            )


def check_compressed_export_runs_here(cfg: LmforgeConfig) -> None:
    """A compressed-tensors export without the library, or of a model its scheme does not fit."""
    from lmforge.export.to_compressed import check_scheme_fits, require_compressed_tensors
    from lmforge.models.build import architecture_config

    key = "export.compressed_dtype"
    try:
        require_compressed_tensors(cfg.export.compressed_dtype)
        check_scheme_fits(architecture_config(cfg.model).to_dict(), cfg.export.compressed_dtype, "the model")
    except UserInputError as err:
        raise UserInputError(f"{key}: {err}") from None


def held_out_file(cfg: LmforgeConfig) -> Path | None:
    """The run's first eval source when it is a local .jsonl or .txt file: what its exports are
    verified on (export.verify_data overrides it)."""
    for source in cfg.data.eval:
        path = Path(source.path)
        if source.dataset is None and path.suffix in (".jsonl", ".txt") and path.is_file():
            return path
    return None


TEACHER_KEY = "train.distill.teacher"
VLLM_SERVER_ENV = "LMFORGE_VLLM_SERVER"  # the URL of the server `lmforge launch` started


def teacher_directory(settings: DistillConfig) -> Path:
    """The distillation teacher's directory; a UserInputError when it is unset or holds no model.
    Its tokenizer is compared with the student's once that is loaded (train/teacher.py)."""
    if settings.teacher is None:  # the config rules require it for stage distill; said again for callers
        raise UserInputError(f"{TEACHER_KEY}: not set. Fix: point it at the teacher model's directory")
    path = settings.teacher.expanduser()
    if not path.is_dir():
        raise UserInputError(
            f"{TEACHER_KEY}: {str(settings.teacher)!r} is not a directory. Fix: point it at the teacher "
            "model's directory (an HF causal LM saved with save_pretrained: config.json, safetensors "
            "weights and its tokenizer), for example a larger model's runs/<name>/final"
        )
    if not (path / "config.json").is_file():
        raise UserInputError(
            f"{TEACHER_KEY}: {path} has no config.json. Fix: point it at an HF model directory"
        )
    return path


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


def check_precision_runs_here(train: TrainConfig) -> None:
    """train.precision fp8 needs a CUDA GPU with float8 matmuls (compute capability 8.9+) and
    torchao; say so before any work (resolve_precision would say the first only once the run starts)."""
    if train.precision != "fp8":
        return
    require_fp8_device(use_cuda=torch.cuda.is_available())
    if importlib.util.find_spec("torchao") is None:
        raise UserInputError(
            "train.precision=fp8 trains through torchao's float8 linear layers, and torchao is not installed. "
            "Fix: pip install 'lmforge[fp8]' (or set train.precision: bf16)"
        )


def check_method_runs_here(cfg: TrainConfig) -> None:
    """Fail before any work when the method cannot run on this machine (qlora without CUDA + bitsandbytes)."""
    if cfg.method != "qlora":
        return
    if not torch.cuda.is_available():
        raise UserInputError(
            "train.method: qlora needs a CUDA GPU (bitsandbytes 4-bit kernels); none is visible here. "
            "Use train.method: lora on this machine, or run on a GPU host"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserInputError(
            "train.method: qlora needs bitsandbytes; install it with `pip install bitsandbytes`"
        )


def check_attention_runs_here(cfg: ModelConfig) -> None:
    """flash_attention_2 needs a CUDA GPU and the flash-attn package, flex_attention a CUDA GPU to
    train: say so before any work (transformers would raise a long ImportError once the model is
    built, torch a NotImplementedError at the first backward)."""
    if cfg.attn_implementation == "flex_attention" and not torch.cuda.is_available():
        raise UserInputError(
            "model.attn_implementation: flex_attention trains on CUDA GPUs only: torch's FlexAttention has no "
            "backward on CPU. Use model.attn_implementation: sdpa on this machine (data.packing keeps samples "
            "apart there with a block mask), or run on a GPU host"
        )
    if cfg.attn_implementation != "flash_attention_2":
        return
    if not torch.cuda.is_available():
        raise UserInputError(
            "model.attn_implementation: flash_attention_2 runs on CUDA GPUs only and none is visible here. "
            "Use model.attn_implementation: sdpa on this machine (with data.packing: true instead of "
            "data.padding_free), or run on a GPU host"
        )
    if importlib.util.find_spec("flash_attn") is None:
        raise UserInputError(
            "model.attn_implementation: flash_attention_2 needs the flash-attn package; install it with "
            "`pip install flash-attn --no-build-isolation`, or use model.attn_implementation: sdpa"
        )


def require_eval_generation_packages(monitor: MonitorConfig) -> None:
    """UserInputError, before any work, when the eval steps would score BERTScore without bert-score."""
    settings = monitor.eval_generations
    if monitor.enabled and settings is not None and settings.metrics:
        require_bertscore(settings.bertscore_model)


def require_vllm_server(rl: RlConfig) -> None:
    """Server mode generates with the vLLM server `lmforge launch` starts beside the workers (it
    sets VLLM_SERVER_ENV in their environment); `lmforge train` alone would wait minutes for a
    server nobody started, then fail inside TRL."""
    if rl.generation == "vllm" and rl.vllm.mode == "server" and not os.environ.get(VLLM_SERVER_ENV):
        raise UserInputError(
            "train.rl.vllm.mode: server generates with a vLLM server that `lmforge launch` starts on GPUs of "
            "its own; run `lmforge launch CONFIG --nproc-per-node N` (N training processes, the server on the "
            "next train.rl.vllm.server_gpus GPUs), or use mode colocate with `lmforge train`"
        )


def uses_vllm(rl: RlConfig) -> bool:
    """`train.rl.generation`: vLLM when asked (refused without it) or, with auto, when it is there."""
    has_vllm = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()
    if rl.generation == "vllm" and not has_vllm:
        raise UserInputError(
            "train.rl.generation: vllm needs a CUDA GPU and the vllm package (pip install 'lmforge[vllm]'); "
            "use generation: transformers (or auto) here"
        )
    return rl.generation == "vllm" or (rl.generation == "auto" and has_vllm)
