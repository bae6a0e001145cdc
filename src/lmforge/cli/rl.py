"""`lmforge rl ...`: tools for online-RL runs (train.stage grpo / rloo)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from lmforge.cli.console import OVERRIDES_HELP, apply_verbosity, console

rl_app = typer.Typer(help="Online RL tools: check that a GRPO / RLOO run can learn.", no_args_is_help=True)

CHECK_FAILED = 1  # a check failed: the run as configured would not learn (or not as intended)


@rl_app.callback()
def _group() -> None:
    """Online RL tools: check that a GRPO / RLOO run can learn."""
    # A callback keeps `rl` a command group while it has a single command.


@rl_app.command("check")
def check(
    config: Path = typer.Argument(..., help="The RL run's YAML config (train.stage grpo or rloo)."),
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
    prompts: int = typer.Option(8, "--prompts", min=1, help="Prompts of the training data to sample."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of the table."),
    verbose: bool = typer.Option(False, "--verbose", help="Show upstream notices on the console."),
) -> None:
    """Before an RL run: the group reward signal (zero-variance groups, the reference answer's own
    reward), the chat template and loss-mask round trip, and generation vs trainer log-probabilities.
    Exit 1 when a check fails, so it can gate a launch.

    Example: `lmforge rl check examples/grpo_rule_reward.yaml --prompts 16 --json`
    """
    apply_verbosity(verbose)
    from rich.table import Table
    from rich.text import Text

    from lmforge.config import load_config
    from lmforge.train.rl_check import run_rl_check

    report = run_rl_check(load_config(config, overrides or []), prompts=prompts)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=1))
    else:
        table = Table(title=f"lmforge rl check ({report.seconds:.1f} s)")
        for column in ("check", "result", "what it found"):
            table.add_column(column)
        styles = {"pass": "green", "warn": "yellow", "fail": "bold red"}
        for item in report.checks:
            table.add_row(item.name, f"[{styles[item.status]}]{item.status}[/]", Text(item.summary))
        console.print(table)
        if report.example:
            console.rule(
                f"a rollout: {report.example['tokens']} tokens, {report.example['with_loss']} with loss"
            )
            text = Text()
            for piece, supervised in report.example["runs"]:
                text.append(piece, style="bold green" if supervised else "dim")
            console.print(text)
            console.print(
                "[dim]dim: prompt (no loss)[/]   [bold green]green: the model's tokens (policy loss)[/]"
            )
    if report.failed:
        raise typer.Exit(CHECK_FAILED)
