"""`lmforge ckpt consolidate`: a DeepSpeed ZeRO or FSDP / torch-DCP sharded checkpoint -> one HF model."""

from __future__ import annotations

from pathlib import Path

import typer

from lmforge.cli.console import console


def command(
    path: Path = typer.Argument(
        ...,
        help="An HF Trainer checkpoint-N directory of a DeepSpeed run, a DeepSpeed global_stepN "
        "directory, or a torch DCP directory (*.distcp + .metadata, e.g. from FSDP).",
    ),
    out: Path = typer.Option(..., "--out", help="Where to write the HF model directory."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors shard."),
    dtype: str = typer.Option("f32", "--dtype", help="f32 (as DeepSpeed's zero_to_fp32), bf16 or f16."),
    config: Path | None = typer.Option(
        None,
        "--config",
        help="An HF model directory whose config.json (and tokenizer) to use when the checkpoint "
        "has none next to it (default: the checkpoint directory, then its parent).",
    ),
) -> None:
    """Consolidate a DeepSpeed ZeRO-1/2/3 or FSDP / torch-DCP sharded checkpoint into one HF safetensors model.

    Streams one tensor at a time (memory near the largest tensor); rank files are read with
    weights_only, never unpickled in full. Weights equal DeepSpeed's zero_to_fp32 output.

    Example: `lmforge ckpt consolidate runs/zero3/checkpoint-500 --out runs/zero3/consolidated`
    """
    from lmforge.export.consolidate import MISSING_PROCESSOR, consolidate

    report = consolidate(path, out, max_shard_size=max_shard_size, dtype=dtype, config_dir=config)
    source = f"ZeRO-{report.zero_stage}" if report.zero_stage is not None else report.format
    console.print(
        f"[bold green]consolidated[/] {source} checkpoint of {report.world_size} ranks: "
        f"{report.tensors} tensors, {report.parameters:,} parameters in {len(report.files)} shard(s) -> {report.out}"
    )
    if report.skipped:
        console.print(
            f"  left out {len(report.skipped)} tensors that are not model weights (optimizer state)"
        )
    if not report.tokenizer:
        console.print(
            "[yellow]no tokenizer files found next to the checkpoint: the output holds the model only[/]"
        )
    if report.processor is False:
        console.print(f"[yellow]{MISSING_PROCESSOR}[/]")
