"""`lmforge estimate`: memory per device of each distributed strategy, and the one to use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.table import Table

from lmforge.cli.console import console
from lmforge.errors import UserInputError

if TYPE_CHECKING:  # the CLI imports transformers only when a command runs
    from lmforge.distributed.estimate import VisionEstimate


def estimate(
    config: Path = typer.Argument(..., help="The run's YAML config."),
    overrides: list[str] | None = typer.Argument(
        None, help="Dotted key=value overrides (train.micro_batch_size=4)."
    ),
    gpus: int = typer.Option(1, "--gpus", help="GPUs per node."),
    gpu_mem: str | None = typer.Option(
        None,
        "--gpu-mem",
        help="Memory of one GPU, for example 24GB or 80GiB [default: this machine's GPU, else 80GB, said so].",
        show_default=False,
    ),
    nodes: int = typer.Option(1, "--nodes", help="Number of nodes."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of a table."),
) -> None:
    """Memory per device for DDP, ZeRO-1/2/3 (with offload) and FSDP, and the cheapest that fits.

    Example: `lmforge estimate examples/sft_chat.yaml train.micro_batch_size=4 --gpus 8 --gpu-mem 80GB`
    """
    from lmforge.config.load import load_config
    from lmforge.distributed.estimate import estimate_memory
    from lmforge.distributed.planner import overall_recommendation, plan_layouts_for
    from lmforge.export.safetensors_stream import parse_size

    try:
        gpu_mem, gpu_mem_source = _gpu_memory(gpu_mem)
        try:
            gpu_mem_bytes = parse_size(gpu_mem)
        except UserInputError as err:
            raise UserInputError(f"--gpu-mem: {err}") from None
        if gpu_mem_bytes <= 0:
            raise UserInputError(f"--gpu-mem {gpu_mem!r}: must be more than zero")
        cfg = load_config(config, overrides or [], tokenizer_optional=True)
        result = estimate_memory(cfg, gpus=gpus, gpu_mem_bytes=gpu_mem_bytes, nodes=nodes)
        plan = plan_layouts_for(cfg, result)
        verdict = overall_recommendation(result, plan).to_dict()
        layouts = plan.to_dict()
    except UserInputError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(
            json.dumps(
                {
                    **result.to_dict(),
                    "layouts": layouts,
                    "recommendation": verdict,
                    "gpu_mem_source": gpu_mem_source,
                },
                indent=2,
            )
        )
        return
    if gpu_mem_source == "assumed":
        console.print(f"no GPU is visible here: assuming {gpu_mem} per GPU (set --gpu-mem for yours)")
    shape = result.model
    table = Table(
        title=f"{shape.total_params:,} parameters, {gpus} GPU(s) x {nodes} node(s), "
        f"{_gib(gpu_mem_bytes)} per GPU ({result.headroom:.0%} headroom)"
    )
    for column in ("strategy", "model states/GPU", "activations", "logits", "total/GPU", "CPU/node", "fits"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for row in result.strategies:
        table.add_row(
            row.strategy,
            _gib(row.model_states_gpu),
            _gib(row.activations),
            _gib(row.logits),
            _gib(row.total_gpu),
            _gib(row.model_states_cpu),
            "yes" if row.fits else "no",
        )
    console.print(table)
    every = f" (every {result.checkpoint_every} layers)" if result.checkpoint_every > 1 else ""
    console.print(
        f"activations: {_gib(result.activations_no_checkpointing)} without, "
        f"{_gib(result.activations_checkpointing)} with gradient checkpointing{every}"
        + (
            f"; activation offload keeps {_gib(result.activations_offloaded_to_cpu)} in host memory"
            if result.activation_offload
            else ""
        )
    )
    console.print(
        f"logits: {_gib(result.logits_full)} whole, {_gib(result.logits_chunked)} with "
        f"train.chunked_cross_entropy{' (on)' if result.chunked_cross_entropy else ''}"
    )
    console.print(
        f"optimizer {result.optimizer}: {result.optimizer_state_bytes_per_param:.1f} bytes of state per "
        "parameter (AdamW: 8)"
    )
    console.print(
        f"strategies: {result.recommended} is the cheapest that fits as configured"
        if result.recommended
        else "strategies: none fits as configured"
    )
    if result.vision is not None:
        _print_vision(result.vision)
    if result.model.vocab_source == "architecture default":
        console.print(
            f"vocabulary: {result.model.vocab_size:,} ({result.model.model_type}'s default; no tokenizer given)"
        )
    _print_layouts(layouts)
    _print_verdict(verdict)


# Rows of the layout table: enough to see the order, the first fits and the recommendation.
_LAYOUT_ROWS = 12


def _print_layouts(plan: dict[str, Any]) -> None:
    """The 3-D layouts: the first rows in the preferred order, then every other one that fits."""
    rows = plan.get("layouts", [])
    if len(rows) <= 1:
        return
    shown = rows[:_LAYOUT_ROWS] + [r for r in rows[_LAYOUT_ROWS:] if r["fits"]][:_LAYOUT_ROWS]
    table = Table(
        title=f"3-D layouts, GiB per device ({len(rows)} possible; {len(shown)} shown, preferred first)"
    )
    columns = "dp tp cp pp ep weights grads optim activ logits total bubble fits"
    for column in columns.split():
        table.add_column(column, justify="right")
    for r in shown:
        fits = "yes" if r["fits"] else "no" if r["fits"] is not None else "?"
        if r["fits"] and not r["runnable"]:
            fits = "yes*"
        table.add_row(
            *(str(r[k]) for k in ("data", "tensor", "context", "pipeline", "expert")),
            *(
                f"{r[k] / 2**30:.1f}"
                for k in ("parameters", "gradients", "optimizer", "activations", "logits", "total")
            ),
            f"{r['bubble']:.0%}",
            fits,
        )
    console.print(table)
    unrunnable = sorted({r["note"] for r in shown if r["fits"] and not r["runnable"]})
    if unrunnable:
        console.print(f"yes*: fits, but lmforge does not run it: {'; '.join(unrunnable)}")


def _print_verdict(verdict: dict[str, Any]) -> None:
    """The one recommendation over the strategy table and the layouts (planner.overall_recommendation)."""
    if verdict["kind"] == "none":
        console.print(f"recommended: [bold]nothing fits[/] ({verdict['reason']})")
        return
    total = f", {_gib(verdict['total'])} per GPU" if verdict["total"] is not None else ""
    line = f"recommended: [bold]{verdict['name']}[/] ({verdict['reason']}{total})"
    if verdict["settings"]:
        line += f"; set {', '.join(verdict['settings'])}"
    console.print(line)


def _print_vision(vision: VisionEstimate) -> None:
    """A VLM's image side, with the assumptions its figures rest on."""
    console.print(
        f"vision ({vision.model_type}): vision tower {vision.vision_tower_params:,} + projector "
        f"{vision.projector_params:,} parameters, counted in the model states as trained, "
        f"like every weight here (train.vision freezes the tower by default: an upper bound); text model {vision.text_params:,}"
    )
    console.print(
        f"images: {vision.image_tokens_per_image} image tokens per {vision.image_size}x{vision.image_size} "
        f"image ({vision.sequence_tokens_per_image} sequence tokens with its framing, inside data.max_length); "
        f"assuming {vision.images_per_sample} image per sample: vision tower activations "
        f"{vision.activations_per_image / 2**20:.2f} MiB per image, {vision.activations / 2**20:.2f} MiB per micro-batch "
        f"(in the activations above); {vision.flops_per_image:.3g} training FLOPs per image"
    )


def _gpu_memory(given: str | None) -> tuple[str, str]:
    """(--gpu-mem value, where it came from: given, detected from this machine's GPU, or assumed)."""
    if given is not None:
        return given, "given"
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_properties(0).total_memory}B", "detected"
    return "80GB", "assumed"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
