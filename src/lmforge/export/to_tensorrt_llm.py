"""`lmforge ckpt convert --to tensorrt-llm`: a hand-off to TensorRT-LLM, which runs only on NVIDIA GPUs.

TensorRT-LLM's current path reads HF checkpoints directly (its PyTorch backend, the default of
`trtllm-serve` and of its `LLM` API; the older convert_checkpoint.py + trtllm-build engine flow is
deprecated upstream), so the hand-off is the model as HF safetensors in the GPU's dtype (bf16 by
default) and, beside it, what a user would otherwise write by hand:

  llm_api_options.yaml  the LLM API settings (`trtllm-serve --config`): batch and token limits, the
                        sequence length from the model, the KV-cache share of GPU memory
  serve.sh              `trtllm-serve` on 127.0.0.1 with those settings (OpenAI-compatible)
  build.sh              the same through the TensorRT engine backend, which builds an engine first

Families outside TensorRT-LLM's PyTorch-backend model list are refused before any work. Nothing
here can be run without a GPU and the tensorrt_llm package (CUDA-only wheels), so the model itself
is verified in transformers like a safetensors export; on a GPU, `bash serve.sh` is the check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmforge.errors import UserInputError
from lmforge.export.conversion import Conversion
from lmforge.export.to_safetensors import convert_to_safetensors

# HF model_type -> the architecture TensorRT-LLM's PyTorch backend implements for it.
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
HANDOFF_DIR = "tensorrt_llm"
MAX_BATCH_SIZE, MAX_NUM_TOKENS, KV_CACHE_SHARE = 8, 8192, 0.85


def convert_to_tensorrt_llm(source: Path, out: Path, *, dtype: str | None) -> Conversion:
    """The model as HF safetensors in `dtype` (default bf16) plus the TensorRT-LLM serving files."""
    config = _refuse_unsupported(source)
    weights = convert_to_safetensors(
        source, out, dtype=dtype or "bf16", max_shard_size="5GB", allow_bin=False
    )
    files = _write_handoff(out, config)
    return Conversion(
        "tensorrt-llm",
        out,
        [*weights.files, *files],
        {**weights.details, "architecture": SUPPORTED[config["model_type"]], "handoff": HANDOFF_DIR},
    )


def _refuse_unsupported(source: Path) -> dict[str, Any]:
    config_path = source / "config.json"
    if not config_path.is_file():
        raise UserInputError(f"{source}: no config.json; point it at an HF model directory")
    config = json.loads(config_path.read_text())
    if config.get("model_type") not in SUPPORTED:
        raise UserInputError(
            f"{config_path}: model_type {config.get('model_type')!r} is not among TensorRT-LLM's PyTorch-backend "
            f"models here ({', '.join(sorted(SUPPORTED))}). Fix: serve it with vLLM (`lmforge serve` on a GPU) "
            "or as GGUF in llama.cpp (`--to gguf`)"
        )
    return config


def _write_handoff(out: Path, config: dict[str, Any]) -> list[Path]:
    handoff = out / HANDOFF_DIR
    handoff.mkdir()
    max_seq_len = int(config.get("max_position_embeddings") or 4096)
    options = handoff / "llm_api_options.yaml"
    options.write_text(
        "# TensorRT-LLM LLM API settings, written by lmforge (`trtllm-serve --config`; keys are LLM() arguments).\n"
        f"max_batch_size: {MAX_BATCH_SIZE}\n"
        f"max_num_tokens: {min(MAX_NUM_TOKENS, max_seq_len * MAX_BATCH_SIZE)}\n"
        f"max_seq_len: {max_seq_len}\n"
        "kv_cache_config:\n"
        f"  free_gpu_memory_fraction: {KV_CACHE_SHARE}\n"
    )
    scripts = []
    for name, backend, note in (
        ("serve.sh", "pytorch", "the PyTorch backend reads the HF checkpoint directly"),
        ("build.sh", "tensorrt", "the TensorRT backend builds an engine from the checkpoint, then serves it"),
    ):
        script = handoff / name
        script.write_text(_script(backend, note))
        script.chmod(0o755)
        scripts.append(script)
    return [options, *scripts]


def _script(backend: str, note: str) -> str:
    # Paths relative to the script: the export directory can be copied to the GPU machine as it is.
    command = [
        "trtllm-serve",
        '"$MODEL"',
        "--backend",
        backend,
        "--host",
        "127.0.0.1",
        "--port",
        '"${PORT:-8000}"',
        "--config",
        '"$HERE/llm_api_options.yaml"',
    ]
    return (
        "#!/usr/bin/env bash\n"
        f"# Serve this model with TensorRT-LLM ({note}); OpenAI-compatible on 127.0.0.1.\n"
        "# Needs an NVIDIA GPU and `pip install tensorrt_llm` (or NVIDIA's TensorRT-LLM container).\n"
        "set -euo pipefail\n"
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n'
        'MODEL="$(dirname "$HERE")"\n'
        f'exec {" ".join(command)} "$@"\n'
    )
