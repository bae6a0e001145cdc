"""`lmforge ckpt convert`: format conversion (safetensors re-shard/re-dtype, GGUF, ONNX, compressed-tensors)."""

from __future__ import annotations

from pathlib import Path

import typer

from lmforge.cli.console import console


def command(
    path: Path = typer.Argument(..., help="An HF model directory (for --to safetensors also a .bin one)."),
    to: str = typer.Option(
        ...,
        "--to",
        help="Target format: safetensors, gguf, onnx, compressed-tensors (vLLM's FP8/int formats) or "
        "tensorrt-llm (bf16 safetensors with TensorRT-LLM's serving config and scripts).",
    ),
    out: Path = typer.Option(..., "--out", help="Output directory."),
    dtype: str | None = typer.Option(
        None,
        "--dtype",
        help="gguf: f32|f16|bf16|q8_0, or a k-quant (q6_k, q5_k_m, q4_k_m, ...; needs llama-cpp-python) "
        "(default f16); onnx: f32|f16|int8 (default f32); safetensors: f32|f16|bf16 (default: keep); "
        "compressed-tensors: fp8|w8a16|w4a16 (default fp8); tensorrt-llm: bf16|f16 (default bf16).",
    ),
    imatrix_data: Path | None = typer.Option(
        None,
        "--imatrix-data",
        help="gguf k-quants: texts or QA rows to compute llama.cpp's importance matrix on (needs llama.cpp's "
        "llama-imatrix and llama-quantize on PATH).",
    ),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="safetensors: largest shard."),
    allow_bin: bool = typer.Option(
        False,
        "--allow-bin",
        help="safetensors: read pytorch_model*.bin (loaded with weights_only=True; only for files you trust).",
    ),
) -> None:
    """Convert a model to safetensors, GGUF (with a Modelfile for Ollama), ONNX, or a compressed-tensors
    FP8 / int8 / int4 checkpoint for vLLM. A vision-language model (SmolVLM / Idefics3) exports as
    safetensors, or as GGUF (the text model + its vision projector, mmproj) when its processor tiles
    images as llama.cpp does; the other formats cannot hold its vision tower here and are refused
    with the fix.

    Example: `lmforge ckpt convert runs/sft/final --to gguf --dtype q8_0 --out export/gguf`
    """
    from lmforge.export.convert import convert

    result = convert(
        path,
        to,
        out,
        dtype=dtype,
        max_shard_size=max_shard_size,
        allow_bin=allow_bin,
        imatrix_data=imatrix_data,
    )
    console.print(f"[bold green]converted[/] {path} -> {result.format} in {result.out}")
    for file in result.files:
        console.print(f"  {file}", markup=False)
    if "runs_with" in result.details:
        console.print(f"run with: {result.details['runs_with']}", markup=False)
