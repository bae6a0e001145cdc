"""`lmforge ckpt convert`: format conversion (safetensors re-shard/re-dtype, GGUF, ONNX)."""

from __future__ import annotations

from pathlib import Path

import typer

from lmforge.cli.console import console


def command(
    path: Path = typer.Argument(..., help="An HF model directory (for --to safetensors also a .bin one)."),
    to: str = typer.Option(..., "--to", help="Target format: safetensors, gguf or onnx."),
    out: Path = typer.Option(..., "--out", help="Output directory."),
    dtype: str | None = typer.Option(
        None,
        "--dtype",
        help="gguf: f32|f16|bf16|q8_0 (default f16); onnx: f32|f16 (default f32); "
        "safetensors: f32|f16|bf16 (default: keep).",
    ),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="safetensors: largest shard."),
    allow_bin: bool = typer.Option(
        False,
        "--allow-bin",
        help="safetensors: read pytorch_model*.bin (loaded with weights_only=True; only for files you trust).",
    ),
) -> None:
    """Convert a model to safetensors, GGUF (with a Modelfile for Ollama) or ONNX.

    Example: `lmforge ckpt convert runs/sft/final --to gguf --dtype q8_0 --out export/gguf`
    """
    from lmforge.export.convert import convert

    result = convert(path, to, out, dtype=dtype, max_shard_size=max_shard_size, allow_bin=allow_bin)
    console.print(f"[bold green]converted[/] {path} -> {result.format} in {result.out}")
    for file in result.files:
        console.print(f"  {file}", markup=False)
