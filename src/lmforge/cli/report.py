"""`lmforge report RUN_DIR`, `lmforge runs [DIR]` and `lmforge runs compare RUN_A RUN_B ...`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.table import Table
from typer.core import TyperGroup

from lmforge.cli.console import console
from lmforge.errors import UserInputError


def report(
    run_dir: Path = typer.Argument(..., help="A run directory (runs/\\<name>).", show_default=False),
    out: Path | None = typer.Option(
        None, "--out", help="Where to write the page (default: RUN_DIR/report.html).", show_default=False
    ),
    no_hash: bool = typer.Option(
        False, "--no-hash", help="Do not re-hash checkpoint files (marker and manifest are still checked)."
    ),
) -> None:
    """Write an HTML report of a run: summary, curves with guardrail events, data, checkpoints,
    export verdicts and the resolved config. One self-contained file; opens offline.

    Example: `lmforge report runs/sft --out sft.html`
    """
    from lmforge.report import write_report

    path = write_report(run_dir, out, verify_hashes=not no_hash)
    console.print(f"report: {path}", markup=False)


class _ListByDefault(TyperGroup):
    """`lmforge runs [DIR]` lists runs; a first word naming a subcommand (compare) runs that.

    A group with an optional DIR argument would swallow the subcommand's name as DIR, so the
    listing is a hidden `list` command that a first word that is not a command falls to."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # typer's vendored click.Context
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["list", *args]
        return super().parse_args(ctx, args)


runs_app = typer.Typer(
    cls=_ListByDefault,
    help="List runs (`lmforge runs [DIR] [--json]`, DIR defaults to ./runs) and compare them (`lmforge runs compare A B`).",
    context_settings={"help_option_names": ["-h", "--help"]},
)


@runs_app.command("list", hidden=True)
def list_runs_command(
    directory: Path = typer.Argument(Path("runs"), help="Directory holding run directories."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    """List the runs under DIR (default ./runs): name, stage, status, steps, best eval, started, duration.

    Example: `lmforge runs runs/ --json`
    """
    from lmforge.report import list_runs

    if not directory.is_dir():
        raise UserInputError(f"{directory}: no such directory; pass the run.output_dir of your runs")
    rows = list_runs(directory)
    if as_json:
        print(json.dumps([row.to_json() for row in rows], indent=2))
        return
    if not rows:
        console.print(f"no runs under {directory}", markup=False)
        return
    console.print(_runs_table(rows))


@runs_app.command("compare")
def compare_command(
    run_dirs: list[Path] = typer.Argument(..., help="Two or more run directories.", show_default=False),
    out: Path = typer.Option(Path("compare.html"), "--out", help="Where to write the page."),
) -> None:
    """Write one HTML page with the runs' curves overlaid and their config differences side by side.

    Example: `lmforge runs compare runs/lr-1e-4 runs/lr-3e-4 --out lr.html`
    """
    from lmforge.report import write_comparison

    if len(run_dirs) < 2:
        raise UserInputError("runs compare: pass at least two run directories")
    path = write_comparison(run_dirs, out)
    console.print(f"comparison: {path}", markup=False)


def _runs_table(rows: list[Any]) -> Table:
    from lmforge.report.html import fmt_duration, fmt_number, fmt_time

    table = Table(title_justify="left")
    for column in ("name", "stage", "status", "steps", "best eval", "started", "duration", "path"):
        table.add_column(column, overflow="fold")
    for row in rows:
        best = f"{row.best_eval_metric} {fmt_number(row.best_eval_value)}" if row.best_eval_metric else "-"
        table.add_row(
            row.name,
            row.stage,
            row.status,
            "-" if row.steps is None else str(row.steps),
            best,
            fmt_time(row.started),
            fmt_duration(row.duration_s),
            row.path,
        )
    return table
