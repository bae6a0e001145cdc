"""`lmforge ckpt ...`: the checkpoint toolkit. Each command is a thin wrapper over lmforge.export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from lmforge.cli import ckpt_consolidate, ckpt_convert, ckpt_prune, ckpt_verify
from lmforge.cli.console import console

if TYPE_CHECKING:
    from lmforge.export.run_export import ExportOutcome

ckpt_app = typer.Typer(help="Checkpoint tools.", no_args_is_help=True)
ckpt_app.command("consolidate")(ckpt_consolidate.command)
ckpt_app.command("convert")(ckpt_convert.command)
ckpt_app.command("prune")(ckpt_prune.command)
ckpt_app.command("verify")(ckpt_verify.command)


@ckpt_app.command("inspect")
def ckpt_inspect(
    path: Path = typer.Argument(
        ..., help="A model or adapter directory, checkpoints/step-N, or a model file."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    """What a checkpoint is: format, architecture, dtypes, parameters, shards, adapters, completeness.

    Reads metadata only (safetensors headers, JSON files, lmforge's hash manifest); loads no weights.

    Example: `lmforge ckpt inspect runs/sft/checkpoints/step-100 --json`
    """
    from lmforge.export.inspect import inspect_checkpoint

    info = inspect_checkpoint(path)
    if as_json:
        print(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        console.print(
            f"{key:22} {json.dumps(value) if isinstance(value, dict | list) else value}", markup=False
        )


@ckpt_app.command("merge-lora")
def ckpt_merge_lora(
    base: Path = typer.Option(..., "--base", help="The base HF model directory (safetensors)."),
    adapter: Path = typer.Option(..., "--adapter", help="The PEFT LoRA / DoRA adapter directory."),
    out: Path = typer.Option(..., "--out", help="Where to write the merged HF model."),
) -> None:
    """Merge a PEFT LoRA / DoRA adapter into its base, shard by shard (memory near one shard).

    Example: `lmforge ckpt merge-lora --base runs/quickstart/pretrain/final --adapter runs/quickstart/finetune/final/adapter --out merged/`
    """
    from lmforge.export.merge import merge_lora

    report = merge_lora(base, adapter, out)
    console.print(
        f"[bold green]merged[/] {report.merged_tensors} adapted and {report.replaced_tensors} replaced tensors "
        f"over {len(report.shards)} shard(s) into {report.out}"
    )


def print_export(outcome: ExportOutcome) -> None:
    """One line per exported artifact with its verification numbers."""
    for line in outcome.summary_lines():
        console.print(line, markup=False)
