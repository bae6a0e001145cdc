"""`lmforge ckpt prune`: a slimmer copy of a checkpoint (positions, layers, adapters, dtype)."""

from __future__ import annotations

from pathlib import Path

import typer

from lmforge.cli.console import console


def command(
    path: Path = typer.Argument(..., help="An HF model directory (safetensors), for example a run's final/."),
    out: Path = typer.Option(..., "--out", help="Output directory."),
    max_positions: int | None = typer.Option(
        None,
        "--max-positions",
        help="Shrink the context: max_position_embeddings / n_positions and any learned position table.",
    ),
    keep_layers: str | None = typer.Option(
        None, "--keep-layers", help="Decoder layers to keep, as ranges and lists such as 0-3,6 (renumbered)."
    ),
    drop_adapters: bool = typer.Option(
        False, "--drop-adapters", help="Leave out adapter/ and adapter files; keep the full model."
    ),
    dtype: str | None = typer.Option(None, "--dtype", help="Cast floating tensors: f32, f16 or bf16."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors shard."),
) -> None:
    """Slim a checkpoint: fewer positions, fewer layers, no adapters, a smaller dtype.

    Example: `lmforge ckpt prune runs/sft/final --out slim/ --keep-layers 0-5 --max-positions 512 --dtype bf16`
    """
    from lmforge.export.prune import prune_checkpoint

    report = prune_checkpoint(
        path,
        out,
        max_positions=max_positions,
        keep_layers=keep_layers,
        drop_adapters=drop_adapters,
        dtype=dtype,
        max_shard_size=max_shard_size,
    )
    for change in report.changes:
        console.print(f"  {change}", markup=False)
    console.print(
        f"parameters {report.parameters_before:,} -> {report.parameters_after:,}, "
        f"weight bytes {report.bytes_before:,} -> {report.bytes_after:,} "
        f"({report.bytes_after / max(report.bytes_before, 1):.0%})",
        markup=False,
    )
    console.print(f"[bold green]pruned[/] {path} -> {report.out}")
